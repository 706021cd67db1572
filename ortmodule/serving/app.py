"""`ortmodule serve`: the app over one model. Routes (score_routes, openai_routes) call the
engine (engine.py; tokenize_routes use the tokenizer alone), the engine calls the model; this file
adds what wraps them: authentication, the body limit and timeouts, the error shape of every
refusal, health and metrics, and the HTTP server's own limits (connections, header timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import resource
import socket
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from .. import __version__, scoring
from . import (
    embedding_routes,
    generate_routes,
    messages_routes,
    openai_routes,
    responses_routes,
    score_routes,
    sglang_routes,
    telemetry,
    tokenize_routes,
)
from .chat_prompts import chat_template_of
from .engine import Engine
from .errors import AsciiJSON, ServingError
from .images import ChatImages
from .served import Served, check_max_model_len, sampling_defaults
from .settings import Settings

log = logging.getLogger("ortmodule.serving")
# Health checks answer without the API key (a load balancer's or SageMaker's probe carries none).
UNKEYED = ("/health", "/ping")


def _harmony(settings: Settings, model) -> Settings:
    """gpt-oss writes OpenAI's harmony, which vLLM always reads (its analysis channel apart from the answer): its
    package's reasoning parser is `openai_gptoss` unless one is named; the `openai` tool parser needs it."""
    if settings.reasoning_parser is None and getattr(getattr(model, "config", None), "model_type", None) == "gpt_oss":
        settings = dataclasses.replace(settings, reasoning_parser="openai_gptoss")
        log.info("gpt-oss: its harmony output is read as --reasoning-parser openai_gptoss reads it, as vLLM reads it")
    if settings.tool_call_parser == "openai" and settings.reasoning_parser != "openai_gptoss":
        raise ValueError("tool_call_parser openai reads gpt-oss's harmony messages, which need reasoning_parser "
                         "openai_gptoss (--reasoning-parser openai_gptoss; a gpt-oss package has it by default)")
    return settings


def create_app(model, tokenizer, settings: Settings | None = None, **options) -> FastAPI:
    """The FastAPI app: SGLang's `POST /v1/score`, OpenAI's `/v1/completions`,
    `/v1/chat/completions` and `/v1/models`, vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`,
    `GET /health`, `GET /metrics`. `settings` (or its
    fields as keywords) say how it batches and what it takes."""
    settings = settings or Settings.with_environment(**options)
    if settings.token_budget is None:
        settings = dataclasses.replace(settings, token_budget=scoring.default_token_budget(model.device))
    settings = _harmony(settings, model)
    chat_images = ChatImages(model, settings.processor, tokenizer, settings.mm_processor_kwargs) \
        if settings.processor is not None else None
    engine = Engine(model, settings)
    # The package's folder name, never its path (which would tell clients about the host).
    served = Served(engine, tokenizer, settings.name or Path(model.package.root).name, settings, chat_images)
    if served.sampling_defaults:  # as vLLM says where its defaults come from
        source = "the package's defaults" if settings.generation_config == "auto" else settings.generation_config
        log.info("completions and chat requests that leave them out sample with %s: %s (--generation-config vllm: "
                 "OpenAI's defaults)", source, ", ".join(f"{k}={v}" for k, v in served.sampling_defaults.items()))
    if settings.generation_config == "auto" and served.sampling_defaults.get("top_k") == 1:
        log.warning("the package's default top_k is 1: sampled requests that leave top_k out get the most likely token "
                    "(mobius-onnx writes top_k 1 into its packages whatever the checkpoint says); --generation-config "
                    "FOLDER takes the checkpoint's generation_config.json, --generation-config vllm OpenAI's defaults")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has stopped accepting and answered what it accepted; the engine goes last.
        engine.stop()

    app = FastAPI(title="ortmodule", description="SGLang's score and OpenAI's completions over an ONNX GenAI package",
                  lifespan=lifespan)
    app.root_path = settings.root_path or ""  # as vLLM sets it: FastAPI puts it in each request's scope
    app.state.served = served
    _add_middleware(app, settings, engine.stats)
    _handle_errors(app, engine)
    score_routes.add_routes(app, served)
    openai_routes.add_routes(app, served)
    responses_routes.add_routes(app, served)
    messages_routes.add_routes(app, served)
    tokenize_routes.add_routes(app, served)
    embedding_routes.add_routes(app, served)
    generate_routes.add_routes(app, served)
    sglang_routes.add_routes(app, served)

    _health_routes(app, engine)
    telemetry.add_routes(app, engine, served.name)

    return app


def _health_routes(app: FastAPI, engine: Engine) -> None:
    """`/health` (503 once the package's files changed), vLLM's `/ping` (SageMaker's health check: the same, GET
    or POST) and `/version`."""

    async def health():
        if engine.files.changed is not None:
            message = f"the model's files changed on disk: {engine.files.changed}"
            return AsciiJSON({"status": "error", "message": message}, status_code=503)
        return {"status": "ok"}

    app.get("/health")(health)
    app.api_route("/ping", methods=["GET", "POST"])(health)

    @app.get("/version")
    async def version():
        return {"version": __version__}


def _add_middleware(app: FastAPI, settings: Settings, stats) -> None:
    """The API key and body limits; outside them (each added wraps those before) the request ids, so a refusal
    carries one too, and CORS, as a browser's preflight carries no key."""
    app.add_middleware(Guard, settings=settings, stats=stats)
    if settings.request_id_headers:
        app.add_middleware(RequestIds)
    if settings.allowed_origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials)


class RequestIds:
    """ASGI middleware: vLLM's `--enable-request-id-headers`. Every answer carries `X-Request-Id`: the request's,
    or a new one, added to the request's headers first, so that a completion's id ends with it too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers") or [])
        ident = next((value for name, value in headers if name == b"x-request-id"), None)
        if ident is None:
            ident = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*headers, (b"x-request-id", ident)]}

        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", ident)]}
            await send(message)

        await self.app(scope, receive, sending)


def _handle_errors(app: FastAPI, engine: Engine) -> None:
    """Every refusal in the route's error shape, counted."""

    @app.exception_handler(ServingError)
    async def refused(request: Request, exc: ServingError):
        if exc.status == 400 or exc.status == 404:
            engine.stats.rejected_bad += 1
        return exc.response(route_path(request.scope))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """Bodies that are not JSON at all (invalid UTF-8, nesting too deep) and unknown routes."""
        if 400 <= exc.status_code < 500:
            engine.stats.rejected_bad += 1
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "invalid request: the body is not valid JSON (UTF-8 text, at most a few hundred levels deep)"
        return ServingError(detail, status=exc.status_code).response(route_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def bad_schema(request: Request, exc: RequestValidationError):
        engine.stats.rejected_bad += 1
        fields = [".".join(str(p) for p in e["loc"] if _field_part(p)) or "body" for e in exc.errors()]
        problems = "; ".join(f"{where}: {e['msg']}" for where, e in zip(fields, exc.errors()))
        error = ServingError(f"invalid request: {problems}", fields[0] if fields else None)
        return error.response(route_path(request.scope))


def route_path(scope) -> str:
    """The path a route is found by: the request's, less `--root-path` where it begins with it (a proxy that keeps
    the prefix), as Starlette's router matches it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def _field_part(part) -> bool:
    """A part of a validation error's location that names a field or an index (not "body", nor the
    union member pydantic tried: `str`, `list[int]`, `function-after[...]`)."""
    if isinstance(part, int):
        return True
    return part != "body" and part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict")


class Guard:
    """ASGI middleware in front of every route: the API key (401), and the body, read here with a
    size limit (413, from Content-Length when sent, else as the bytes arrive) and a time limit
    (408), so that nothing past it ever sees an oversized or stalled body."""

    def __init__(self, app, settings: Settings, stats):
        self.app, self.settings, self.stats = app, settings, stats
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and path not in UNKEYED and not self._authorized(headers):
            return await self._refuse(send, path, ServingError("a valid API key is needed: send "
                                                               "'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                                                               status=401))
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(send, path, _too_large(limit))
        chunks, received, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.body_timeout
        try:
            while more:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    return await self._refuse(send, path, _too_large(limit))
                chunks.append(chunk)
                more = message.get("more_body", False)
        except TimeoutError:  # asyncio.wait_for raises the builtin (asyncio.TimeoutError is it from Python 3.11)
            return await self._refuse(send, path, ServingError(
                f"the request body did not arrive within {self.settings.body_timeout:g} s", status=408))
        replayed = False

        async def replay():  # the body once, then the client's own messages (a disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        """OpenAI's `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` (its SDK's)."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return True
        return b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), self.key)

    async def _refuse(self, send, path: str, error: ServingError):
        if error.status != 401:
            self.stats.rejected_bad += 1
        response = error.response(path)
        if error.status == 401:
            response.headers["www-authenticate"] = "Bearer"
        await send({"type": "http.response.start", "status": error.status, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def _too_large(limit: int) -> ServingError:
    return ServingError(f"request body over {limit} bytes; this server takes at most that", status=413)


def _timed_h11(header_timeout: float):
    """uvicorn's h11 protocol with a header timeout: a connection whose request has begun (some of it
    arrived) or that has sent nothing since it opened, and that starts no request within
    `header_timeout` seconds while none is being answered, is closed. A connection idle between
    requests (its last answer sent, nothing since) is left to the keep-alive timeout: longer than
    HTTP clients keep an idle connection in their pools, so that the client closes it first. A
    server that closes it first races a client reusing it, whose request is then lost (httpx's
    `ReadError` where both wait 5 s, uvicorn's and httpx's defaults)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_cycle = None
            self.header_timer = self.loop.call_later(header_timeout, self.check_headers)

        def check_headers(self) -> None:
            cycle = self.cycle
            answering = cycle is not None and not cycle.response_complete
            kept_alive = cycle is not None and not answering and not self.conn.trailing_data[0]
            if cycle is self.header_cycle and not (answering or kept_alive) and not self.transport.is_closing():
                self.transport.close()
                return
            self.header_cycle = cycle
            self.header_timer = self.loop.call_later(header_timeout, self.check_headers)

        def connection_lost(self, exc) -> None:
            self.header_timer.cancel()
            super().connection_lost(exc)

    return TimedH11


def open_files_for(connections: int) -> int:
    """Raise the process's open-file limit to fit `connections` (up to the hard limit); the
    connections that fit (the rest of the files kept for the model, logs and sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fits = connections if soft == resource.RLIM_INFINITY else min(connections, soft - 256)
    if fits < connections:
        log.warning("the open-file limit (%d) fits %d connections, not %d: serving at most %d", soft, fits,
                    connections, fits)
    return max(fits, 1)


def serve(path: str, host: str = "127.0.0.1", port: int = 30000, device: str = "cpu", fp32_lm_head: bool = False,
          prefill_attention: str | None = None, subfolder: str | None = None, revision: str | None = None,
          chat_template: str | None = None, **options) -> None:
    """Load the package at `path` (a folder, or a Hugging Face Hub repository id with the package's
    `subfolder` and a `revision`: hub.py) and serve it until interrupted (SIGINT, SIGTERM: what was
    accepted is answered first). `fp32_lm_head`: a bf16 package's LM head in float32 (SGLang's and
    vLLM's `--enable-fp32-lm-head`; `rewrite_lm_head="float32"`). `prefill_attention`: as
    `OrtModelForCausalLM.from_pretrained`'s (the runs without a cache: scores, prompt log-probabilities).
    `chat_template`: vLLM's `--chat-template`, a file or the template itself, in place of the package's."""
    import uvicorn

    with bound_socket(host, port) as listening:  # before the package loads and is timed: minutes for a big one
        app, settings = load_app(path, host, device, fp32_lm_head, prefill_attention, subfolder, revision, options,
                                chat_template)
        config = uvicorn.Config(app, host=host, port=port, log_level=settings.uvicorn_log_level,
                                access_log=settings.access_log, http=_timed_h11(settings.header_timeout),
                                limit_concurrency=open_files_for(settings.max_connections),
                                timeout_keep_alive=settings.keep_alive, **settings.tls)
        uvicorn.Server(config).run(sockets=[listening])


def load_app(path, host, device, fp32_lm_head, prefill_attention, subfolder, revision, options, chat_template=None):
    """`serve`'s app over the package, loaded with its costs timed where they decide, and its settings."""
    from .. import hub
    from ..environment import installed_too_old
    from ..hf import load_tokenizer
    from ..modeling import OrtModelForCausalLM
    from ..package import read_package
    from .images import check_processor

    local = hub.resolve(path, subfolder, revision)
    if options.get("name") is None and not Path(path).exists():  # a Hub repository: its id, not the snapshot's hash
        options["name"] = "/".join(part.strip("/") for part in (path, subfolder or "") if part)
    settings = Settings.with_environment(**options)
    package = read_package(local)  # its files' description, checked against the settings before the load
    check_max_model_len(settings.max_model_len, package.context_length)
    if settings.processor is not None:
        check_processor(package, settings.processor)
    if settings.generation_config not in ("auto", "vllm"):  # a folder's generation_config.json, read before the load
        sampling_defaults(None, settings.generation_config)
    template = chat_template_of(chat_template) if chat_template is not None else None
    model = OrtModelForCausalLM.from_pretrained(local, device=device, prefill_attention=prefill_attention,
                                                rewrite_lm_head="float32" if fp32_lm_head else True)
    if settings.reuse_prefix == "auto":  # the costs decide it: timed (or read from the disk) now, not in a request
        model.measured_costs()
    tokenizer = load_tokenizer(local)
    if template is not None:
        tokenizer.chat_template = template
    if getattr(tokenizer, "chat_template", None) and (old := installed_too_old("jinja2")):
        log.warning("chat requests will fail (scores and completions will not): %s", old)
    if old := installed_too_old("uvicorn"):
        log.warning("a stream whose client leaves will run to its end: %s", old)
    app = create_app(model, tokenizer, settings)
    if host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        log.warning("serving on %s without an API key: anyone who reaches it may use it (--api-key, or %s)",
                    host, "ORTMODULE_API_KEY")
    return app, settings


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds it but before the model loads (vLLM binds its port
    before its engine starts too): a port in use, or a host this machine cannot listen on, is a
    ValueError at once rather than uvicorn's error after the package was loaded and its runs timed."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        sock.close()
        raise ValueError(f"cannot listen on {host} port {port}: {getattr(e, 'strerror', None) or e}") from None
    sock.set_inheritable(True)
    return sock
