"""Frames as the Qwen2.5-VL and Qwen3-VL families see them: in pairs, resized to whole merged
patches, patched.

Qwen's vision tower takes a video as groups of `temporal_patch` frames (2), each frame resized so
that both sides are multiples of `patch * merge` pixels and its area lies within the
checkpoint's bounds, cut into patches of both frames at once, and its output merged `merge` x
`merge`: a pair of 448x252 frames is, for Qwen2.5-VL, 144 visual tokens on a grid of 9 rows and
16 columns. Qwen3-VL's tower also gives "deep-stack" features (docs/engine.md, "Qwen2.5-VL and
Qwen3-VL"). Done here with Pillow and torch, since the processors of transformers need torchvision.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from engine.frames import CLIP_MEAN, CLIP_STD, normalised, resized

QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class QwenVision:
    """A checkpoint's preprocessing of video frames, and its vision tower's output grid."""

    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2  # frames per visual group
    min_pixels: int = 128 * 28 * 28  # a frame's area after resizing (Qwen2.5-VL's video defaults)
    max_pixels: int = 768 * 28 * 28
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    # Qwen3-VL: a group's text is its time in Qwen3's words (`<1.5 seconds>`, the mean of its
    # frames' times) and its tower's output carries deep-stack features
    qwen3: bool = False

    @classmethod
    def of(cls, config, preprocessor: dict) -> "QwenVision":
        """From a checkpoint's config and its (video) preprocessor file, where it names them.
        Qwen3-VL's bounds are for a whole clip; a pair of frames is the clip here, so a frame
        takes half of them."""
        vision, qwen3 = config.vision_config, config.model_type == "qwen3_vl"
        size = preprocessor.get("size") or {}
        shares = vision.temporal_patch_size if qwen3 else 1
        low = preprocessor.get("min_pixels") or size.get("shortest_edge")
        high = preprocessor.get("max_pixels") or size.get("longest_edge")
        defaults = cls(min_pixels=128 * 32 * 32 // 2, max_pixels=768 * 32 * 32 // 2) if qwen3 else cls()
        return cls(
            vision.patch_size,
            vision.spatial_merge_size,
            vision.temporal_patch_size,
            low // shares if low else defaults.min_pixels,
            high // shares if high else defaults.max_pixels,
            tuple(preprocessor.get("image_mean") or (QWEN3_MEAN if qwen3 else CLIP_MEAN)),
            tuple(preprocessor.get("image_std") or (QWEN3_STD if qwen3 else CLIP_STD)),
            qwen3,
        )

    def frame_text(self, times_s: Sequence[float], markers: tuple[str, str]) -> tuple[str, str]:
        """The text before and after a group's tokens, given its frames' times and the model's
        vision start and end markers: Qwen3-VL's `<1.5 seconds>` before (the frames' mean
        time), or `[1.0s]` (the first frame's) and a newline after."""
        start, end = markers
        if self.qwen3:
            return f"<{sum(times_s) / len(times_s):.1f} seconds>{start}", end
        return f"[{times_s[0]:.1f}s]{start}", f"{end}\n"

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
        pixels = normalised(np.stack([np.asarray(resized(frame, h, w)) for frame in frames]), self.mean, self.std)  # (N, 3, h, w)
        groups, p, m, t = len(frames) // self.temporal_patch, self.patch, self.merge, self.temporal_patch
        rows, cols = h // p, w // p
        # (groups, t, 3, rows/m, m, p, cols/m, m, p) -> (groups, rows/m, cols/m, m, m, 3, t, p, p)
        cut = pixels.reshape(groups, t, 3, rows // m, m, p, cols // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        grid = torch.tensor([[1, rows, cols]] * groups)
        return cut.reshape(groups * rows * cols, 3 * t * p * p), grid

    @torch.inference_mode()
    def encode(self, hf: PreTrainedModel, frames: Sequence[np.ndarray]) -> torch.Tensor:
        """(groups, rows * columns, hidden * (1 + D)) visual tokens of frames in groups of
        `temporal_patch`, row by row on their grid of merged patches, and after each token's
        hidden state its D deep-stack features (Qwen3-VL; D = 0 for Qwen2.5-VL): `split` parts them."""
        patches, grid = self.patches(frames)
        visual = hf.model.visual
        out = visual(patches.to(visual.device, visual.dtype), grid_thw=grid.to(visual.device))
        # (groups * rows/merge * cols/merge, hidden) each: the merger's output, then the deep stack's
        tokens = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)
        return tokens.reshape(len(grid), -1, tokens.shape[-1])

    @staticmethod
    def split(tokens: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`encode`'s tokens (..., hidden * (1 + D)) as the visual tokens (..., hidden) and their
        deep-stack features (..., hidden * D), or None when D = 0."""
        return tokens[..., :hidden], tokens[..., hidden:] if tokens.shape[-1] > hidden else None
