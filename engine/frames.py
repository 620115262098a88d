"""Frame preprocessing for vision encoders: our own resize, crop and normalisation (no torchvision)."""

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's normalisation, which Qwen2.5-VL's uses too
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def to_pixels(frames: Sequence[np.ndarray], image_size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """RGB uint8 frames, each (H, W, 3), to normalised pixels (N, 3, image_size, image_size): each
    resized so that its shorter side is `image_size`, then centre-cropped."""
    return normalised(np.stack([_resize_crop(frame, image_size) for frame in frames]), mean, std)


def normalised(frames: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """RGB uint8 frames (N, H, W, 3) as pixels (N, 3, H, W) in 0..1, less `mean`, over `std` (per channel)."""
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float().div_(255.0)
    return (pixels - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def resized(frame: np.ndarray, height: int, width: int) -> Image.Image:
    """An RGB uint8 frame (H, W, 3) resized (bicubic); ValueError for anything else."""
    return Image.fromarray(_rgb(frame)).resize((width, height), Image.Resampling.BICUBIC)


def _rgb(frame: np.ndarray) -> np.ndarray:
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"expected an RGB uint8 frame (H, W, 3), got {frame.dtype} {frame.shape}")
    return frame


def _resize_crop(frame: np.ndarray, size: int) -> np.ndarray:
    height, width = _rgb(frame).shape[:2]
    scale = size / min(height, width)
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return np.asarray(resized(frame, new_h, new_w).crop((left, top, left + size, top + size)))
