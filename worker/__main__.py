"""`python -m worker`: serve one model to the sessions in Redis, configured by the environment."""

import asyncio
import logging
import signal
import time

import av.logging
import decord.logging
import huggingface_hub.utils
import torch
import transformers.utils.logging

from engine import Model, choose_dtype, load_model, resolve_device
from streamvqa.redis_client import close, connect
from worker.loop import Worker
from worker.settings import WorkerSettings
from worker.threads import Threads

log = logging.getLogger("worker")

ADVICE = (
    "Set MODEL to a built-in model, a local checkpoint folder, or a hub id that this machine can download "
    "or already has in the Hugging Face cache (HF_HOME)."
)


def load(settings: WorkerSettings) -> Model:
    """The worker's model, with a line before and after; SystemExit(1) and one line naming the model,
    the cause and what to do when it cannot load (the traceback only at LOG_LEVEL=DEBUG)."""
    log.info("loading %s…", settings.model)
    started_s = time.monotonic()
    try:
        numerics = choose_dtype(settings.dtype, resolve_device(settings.torch_device))
        model = load_model(settings.model, settings.torch_device, settings.model_cache_dir, numerics.dtype)
    except Exception as err:
        log.debug("loading %s failed", settings.model, exc_info=True)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if settings.model not in reason:
            reason = f"cannot load model {settings.model!r}: {reason}"
        log.error("%s. %s", reason.rstrip("."), ADVICE)
        raise SystemExit(1) from None
    log.info("%s loaded in %.1f s, in %s (DTYPE=%s: %s)", settings.model, time.monotonic() - started_s, numerics.name,
             settings.dtype, numerics.reason)
    return model


def quiet_libraries(log_level: str) -> None:
    """What the libraries print on their own, beside the worker's log, says nothing a user acts on:
    transformers' bar of the weights it loads (instant, on every start) and FFmpeg's line for every
    broken block of a damaged video (the session's error or warning says what is wrong), from both
    copies of FFmpeg: PyAV's and decord's. A model's download keeps its progress bars
    (huggingface_hub's), and LOG_LEVEL=DEBUG shows FFmpeg's errors."""
    downloads_shown = not huggingface_hub.utils.are_progress_bars_disabled()
    transformers.utils.logging.disable_progress_bar()  # which turns huggingface_hub's off too
    if downloads_shown:
        huggingface_hub.utils.enable_progress_bars()
    debug = log_level.upper() == "DEBUG"
    av.logging.set_libav_level(av.logging.ERROR if debug else av.logging.FATAL)
    decord.logging.set_level(decord.logging.ERROR if debug else decord.logging.FATAL)


async def serve(settings: WorkerSettings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    threads = Threads()
    model = await threads.engine(load, settings)  # on the thread that runs it (worker/threads.py)
    redis = connect(settings.redis_url, cluster=settings.redis_cluster)
    reader = connect(settings.redis_url, retry=False, cluster=settings.redis_cluster)
    worker = Worker(settings, model, threads, redis, reader)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, worker.stop)
    try:
        await worker.run()
    finally:
        await close(redis)
        await close(reader)


def main() -> None:
    settings = WorkerSettings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries(settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
