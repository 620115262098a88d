"""Resident memory given back to the operating system: the pages of part of a CPU tensor, and
the C heap's free memory.

A CPU tensor allocated with `torch.empty` takes RAM only as its pages are first written; once
written they stay resident, whether or not anything still uses them. A pool whose runs go back
(`engine/page_runs.py`) gives their pages back here (Linux's `madvise(MADV_DONTNEED)`: the
next write takes a page of zeros again), so that a worker's resident memory follows the
sessions it holds rather than the most it ever held. Elsewhere (macOS, Windows) nothing is given
back: the pages are reused by the next run. GPU memory is not touched.
"""

import ctypes
import ctypes.util
import math
import mmap
import sys

import torch

MADV_DONTNEED = 4  # Linux: the pages are freed, and read as zeros after
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None
_TRIM = getattr(_LIBC, "malloc_trim", None)  # glibc's; musl has none
if _LIBC is not None:
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def give_back(tensor: torch.Tensor, dim: int, start: int, stop: int) -> int:
    """Give back the memory of `tensor`'s indices start .. stop - 1 along `dim` (of every index
    of the dimensions before it): each whole page of it, 0 or more. `tensor` is contiguous, on a
    CPU; what it held there is gone (zeros). Returns the bytes given back (0 where nothing is)."""
    if _LIBC is None or tensor.device.type != "cpu" or start >= stop:
        return 0
    assert tensor.is_contiguous(), "give_back needs a contiguous tensor"
    row_bytes = math.prod(tensor.shape[dim + 1 :]) * tensor.element_size()  # one index along `dim`
    span_bytes = tensor.shape[dim] * row_bytes  # every index along `dim`, once for each index before it
    page = mmap.PAGESIZE
    given = 0
    for outer in range(math.prod(tensor.shape[:dim])):
        first = tensor.data_ptr() + outer * span_bytes + start * row_bytes
        last = first + (stop - start) * row_bytes
        first, last = -(-first // page) * page, last // page * page  # the whole pages inside
        if last > first and _LIBC.madvise(first, last - first, MADV_DONTNEED) == 0:
            given += last - first
    return given


def trim_heap() -> None:
    """Give back what the C heap holds free (glibc's `malloc_trim`): the activations of steps
    that ran, freed by torch but kept by the allocator for reuse."""
    if _TRIM is not None:
        _TRIM(ctypes.c_size_t(0))
