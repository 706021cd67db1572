"""SGLang's native endpoints around `/generate` that its own tools call (as of SGLang 0.5.23): its
benchmark (`python -m sglang.bench_serving --backend sglang`: `/model_info` for the tokenizer,
`/flush_cache` after the warm-up, `/server_info` at the end), its frontend language's
`RuntimeEndpoint` (`/get_model_info`, `/flush_cache`), and its health checks (`/health_generate`,
`/ready`).

`/model_info` names the model by the served name, never the package's path on the host (as every
route here does); `/server_info` is this server's settings, not SGLang's launch arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import FastAPI, Query
from fastapi.responses import PlainTextResponse, Response

from .. import __version__
from .errors import AsciiJSON, ServingError
from .jobs import FlushCache, Generation, Sampling
from .served import Served

HEALTH_TIMEOUT = 20.0  # seconds a `/health_generate` token may take (SGLang's HEALTH_CHECK_TIMEOUT)
FLUSH_RETRY = 0.05  # seconds between tries of a `/flush_cache` that waits for the engine to be idle


def model_info(served: Served) -> dict:
    """SGLang's `/model_info` fields, as this server can fill them."""
    model = served.engine.model
    config = model.config
    return {"model_path": served.name, "served_model_name": served.name, "tokenizer_path": served.name,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "load_format": "onnx-genai", "reasoning_parser": served.settings.reasoning_parser,
            "tool_call_parser": served.settings.tool_call_parser,  # vLLM's names (serving/tools.py, reasoning.py)
            "disaggregation_mode": "null", "has_image_understanding": served.images is not None,
            "has_audio_understanding": False, "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None)}


def server_info(served: Served) -> dict:
    """This server's settings and state where SGLang's `/server_info` has its launch arguments and
    scheduler states (`internal_states`: one, with the running rows and waiting requests)."""
    engine = served.engine
    settings = {key: value for key, value in dataclasses.asdict(served.settings).items()
                if isinstance(value, (int, float, str, bool)) or value is None}
    for name in ("api_key", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):  # a secret, or where the host keeps one
        if settings[name] is not None:
            settings[name] = "<set>"
    return {**model_info(served), **settings, "context_length": served.context, "device": str(engine.model.device),
            "version": __version__, "engine": "ortmodule",
            "internal_states": [{"running_rows": len(engine.generations.batch.rows),
                                 "waiting_requests": engine.waiting.count}]}


async def flush(served: Served, timeout: float) -> bool:
    """Empty the prefix cache once the engine is idle, trying for up to `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    while True:
        job = FlushCache(loop)
        served.engine.submit(job)
        if await job.future or time.monotonic() >= deadline:
            return job.future.result()
        await asyncio.sleep(FLUSH_RETRY)


async def health_generate(served: Served) -> bool:
    """Whether the engine generates a token (greedy, after the first token id) within HEALTH_TIMEOUT,
    as SGLang's health check asks; the request is admitted as every request is."""
    engine = served.engine
    engine.admit()
    job = Generation([[0]], Sampling(max_tokens=1, temperature=0.0), asyncio.get_running_loop(),
                     served.tokenizer, engine.eos)
    engine.submit(job)
    try:
        await asyncio.wait_for(asyncio.shield(job.future), HEALTH_TIMEOUT)
    except Exception:  # noqa: BLE001  timed out, or the model's work failed: unhealthy either way
        job.cancelled.set()
        engine.release(job)  # a check that timed out waiting holds no place in the queue until the worker drops it
        return False
    return True


def add_routes(app: FastAPI, served: Served) -> None:
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return AsciiJSON(model_info(served))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return AsciiJSON(server_info(served))

    @app.get("/ready")
    async def ready():
        return Response(status_code=503 if served.engine.files.changed is not None else 200)

    @app.get("/health_generate")
    async def check_generation():
        if served.engine.files.changed is not None:
            return Response(status_code=503)
        try:
            healthy = await health_generate(served)
        except ServingError as e:  # the queue is full: busy, and saying so
            return Response(status_code=e.status)
        return Response(status_code=200 if healthy else 503)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
        if await flush(served, timeout):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting; try again when the server is "
                                 "idle, or pass ?timeout=SECONDS to wait for it.\n", status_code=400)
