"""The worker's threads beside its event loop, and the one rule for what runs on each.

- **engine**: everything that runs the model or touches a session's cache: loading the model,
  opening or restoring a `Session`, `append_frames`, `ask` and each `next` (and `close`) of its
  answer, `snapshot`, `memory`, tokenising. One thread, so steps never overlap: one model, one
  device. The loop awaits each call before the next step, so between steps it may read a
  session's `stats()` (counters) itself. It is also the only thread whose torch operations run
  on several cores: each thread that does starts a team of OpenMP threads of its own, and once
  there are more of those than cores, libgomp stops letting idle team threads spin, so each of
  a step's hundreds of small operations waits for its threads to wake (a decode step of
  SmolLM2 on 2 cores 40-60 % slower: docs/benchmarks.md).
- **decode**: an upload's sampling (`frames_block` ingests: `resume`, `next_frames`, `close`),
  so that its next frames are decoded while the engine works.
- **media**: media entries into ingests (`receive`), off the loop (a live ingest may wait for
  room in its byte feed). Each live container stream also has a decoder thread of its own
  (`worker.ingest.StreamIngest`).
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Threads:
    def __init__(self) -> None:
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._decode = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self._media = ThreadPoolExecutor(1, thread_name_prefix="media")

    async def engine(self, fn: Callable[..., T], *args: object) -> T:
        return await _run(self._engine, fn, *args)

    async def decode(self, fn: Callable[..., T], *args: object) -> T:
        return await _run(self._decode, fn, *args)

    def decode_ahead(self, fn: Callable[..., T], *args: object) -> asyncio.Future:
        """Start `fn` on the decode thread; its result is awaited later."""
        return asyncio.get_running_loop().run_in_executor(self._decode, fn, *args)

    async def media(self, fn: Callable[..., T], *args: object) -> T:
        return await _run(self._media, fn, *args)

    def shutdown(self) -> None:
        for pool in (self._engine, self._decode, self._media):
            pool.shutdown(wait=True, cancel_futures=True)


async def _run(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
