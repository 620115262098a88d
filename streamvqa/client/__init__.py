"""A Python client for the streamvqa gateway: sessions, uploads, questions (whole or streamed),
watches and their firings, and live `frames` streams with questions on the socket. docs/client.md
shows it at work.

    from streamvqa.client import Client

    with Client("http://127.0.0.1:8000") as client, client.create_session(fps=1) as session:
        session.upload("clip.mp4")
        session.wait_until_ingested()
        print(session.ask("What is happening?").answer)

It needs only the gateway's dependencies (httpx, websockets); streaming a video file or a camera
as frames also needs PyAV and Pillow (`pip install 'streamvqa[worker]'`).
"""

from streamvqa.client.aio import AsyncAnswerStream, AsyncClient, AsyncSession
from streamvqa.client.endpoints import AnswerStream
from streamvqa.client.frames import camera_frames, file_frames
from streamvqa.client.models import Answer, Evidence, StreamResult, StreamvqaError, Watch, WatchFiredEvent
from streamvqa.client.sync import Client, Session

__all__ = [
    "Answer",
    "AnswerStream",
    "AsyncAnswerStream",
    "AsyncClient",
    "AsyncSession",
    "Client",
    "Evidence",
    "Session",
    "StreamResult",
    "StreamvqaError",
    "Watch",
    "WatchFiredEvent",
    "camera_frames",
    "file_frames",
]
