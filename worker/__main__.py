"""`python -m worker`: serve one model to the sessions in Redis, configured by the environment."""

import asyncio
import logging
import signal
import time

import torch

from engine import Model, load_model
from streamvqa.redis_client import close, connect
from worker.loop import Worker
from worker.settings import WorkerSettings

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
        model = load_model(settings.model, settings.torch_device, settings.model_cache_dir)
    except Exception as err:
        log.debug("loading %s failed", settings.model, exc_info=True)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if settings.model not in reason:
            reason = f"cannot load model {settings.model!r}: {reason}"
        log.error("%s. %s", reason.rstrip("."), ADVICE)
        raise SystemExit(1) from None
    log.info("%s loaded in %.1f s", settings.model, time.monotonic() - started_s)
    return model


async def serve(settings: WorkerSettings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    model = load(settings)
    redis = connect(settings.redis_url, cluster=settings.redis_cluster)
    reader = connect(settings.redis_url, retry=False, cluster=settings.redis_cluster)
    worker = Worker(settings, model, redis, reader)
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
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
