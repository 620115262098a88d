"""Frames as the Qwen2.5-VL family sees them: in pairs, resized to whole merged patches, patched.

Qwen's vision tower takes a video as groups of `temporal_patch` frames (2), each frame resized so
that both sides are multiples of `patch * merge` pixels (28) and its area lies within the
checkpoint's bounds (`min_pixels`, `max_pixels`, keeping the aspect ratio), cut into patches of
`patch` pixels (14) of both frames at once, and its output merged `merge` x `merge` (2x2): a pair
of 448x252 frames is 16 x 9 merged patches, 144 visual tokens, laid out row by row on a grid of 9
rows and 16 columns. Done here with Pillow and torch, to the numbers of the checkpoint's
preprocessor file, since the processors of transformers need torchvision.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedModel

QWEN_MEAN = (0.48145466, 0.4578275, 0.40821073)
QWEN_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenVision:
    """A checkpoint's preprocessing of video frames, and its vision tower's output grid."""

    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2  # frames per visual group
    min_pixels: int = 128 * 28 * 28  # a frame's area after resizing (Qwen2.5-VL's video defaults)
    max_pixels: int = 768 * 28 * 28
    mean: tuple[float, float, float] = QWEN_MEAN
    std: tuple[float, float, float] = QWEN_STD

    @classmethod
    def of(cls, config, preprocessor: dict) -> "QwenVision":
        """From a checkpoint's config and its (video) preprocessor file, where it names them."""
        vision = config.vision_config
        size = preprocessor.get("size") or {}
        defaults = cls()
        return cls(
            vision.patch_size,
            vision.spatial_merge_size,
            vision.temporal_patch_size,
            preprocessor.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels,
            preprocessor.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels,
            tuple(preprocessor.get("image_mean") or QWEN_MEAN),
            tuple(preprocessor.get("image_std") or QWEN_STD),
        )

    def size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) in pixels of a frame after resizing: both multiples of patch * merge,
        the area within [min_pixels, max_pixels], the aspect ratio kept as near as that allows."""
        factor = self.patch * self.merge
        if max(height, width) / max(1, min(height, width)) > 200:
            raise ValueError(f"a frame of {width}x{height} is too narrow (aspect ratio over 200)")
        h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def grid(self, frame_shape: Sequence[int]) -> tuple[int, int]:
        """(rows, columns) of merged patches of a frame of this (height, width, 3) shape."""
        h, w = self.size(frame_shape[0], frame_shape[1])
        side = self.patch * self.merge
        return h // side, w // side

    def patches(self, frames: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames (a whole number of groups, all resized to the first one's size) as the vision
        tower's input: patches (groups * h/patch * w/patch, 3 * temporal_patch * patch * patch),
        in the order its merger groups them, and each group's grid (groups, 3) of (1, h/patch,
        w/patch)."""
        if len(frames) % self.temporal_patch:
            raise ValueError(f"{len(frames)} frames are not whole groups of {self.temporal_patch}")
        h, w = self.size(*frames[0].shape[:2])
        pixels = torch.from_numpy(np.stack([_resized(frame, h, w) for frame in frames])).permute(0, 3, 1, 2).float().div_(255.0)
        pixels = (pixels - torch.tensor(self.mean).view(1, 3, 1, 1)) / torch.tensor(self.std).view(1, 3, 1, 1)
        groups, p, m, t = len(frames) // self.temporal_patch, self.patch, self.merge, self.temporal_patch
        rows, cols = h // p, w // p
        # (groups, t, 3, rows/m, m, p, cols/m, m, p) -> (groups, rows/m, cols/m, m, m, 3, t, p, p)
        cut = pixels.reshape(groups, t, 3, rows // m, m, p, cols // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        grid = torch.tensor([[1, rows, cols]] * groups)
        return cut.reshape(groups * rows * cols, 3 * t * p * p), grid

    @torch.inference_mode()
    def encode(self, hf: PreTrainedModel, frames: Sequence[np.ndarray]) -> torch.Tensor:
        """(groups, rows * columns, hidden) visual tokens of frames in groups of `temporal_patch`,
        row by row on their grid of merged patches."""
        patches, grid = self.patches(frames)
        visual = hf.model.visual
        out = visual(patches.to(visual.device, visual.dtype), grid_thw=grid.to(visual.device))
        tokens = out.pooler_output  # (groups * rows/merge * cols/merge, hidden), the merger's output
        return tokens.reshape(len(grid), -1, tokens.shape[-1])


def _resized(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"expected an RGB uint8 frame (H, W, 3), got {frame.dtype} {frame.shape}")
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))
