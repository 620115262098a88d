"""Frame preprocessing for vision encoders: our own resize, crop and normalisation (no torchvision)."""

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image


def to_pixels(
    frames: Sequence[np.ndarray], image_size: int, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """RGB uint8 frames, each (H, W, 3), to normalised pixels (N, 3, image_size, image_size).

    Each frame is resized so that its shorter side is `image_size`, then centre-cropped.
    """
    batch = np.stack([_resize_crop(frame, image_size) for frame in frames])  # (N, S, S, 3)
    pixels = torch.from_numpy(batch).permute(0, 3, 1, 2).float().div_(255.0)  # (N, 3, S, S)
    mean_t = torch.tensor(mean).view(1, 3, 1, 1)
    std_t = torch.tensor(std).view(1, 3, 1, 1)
    return (pixels - mean_t) / std_t


def _resize_crop(frame: np.ndarray, size: int) -> np.ndarray:
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"expected an RGB uint8 frame (H, W, 3), got {frame.dtype} {frame.shape}")
    height, width = frame.shape[:2]
    scale = size / min(height, width)
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    image = Image.fromarray(frame).resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)))
