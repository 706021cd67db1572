"""`ortmodule serve PATH`: SGLang's `/v1/score` and OpenAI's `/v1/completions` and
`/v1/chat/completions` (openai_server.py) over one OrtModelForCausalLM.

Requests are checked and tokenized as they arrive (a bad one gets HTTP 400 and touches nothing
else), then queued; a full queue answers 503. One worker takes the queue in groups: the first
waiting request, plus every request that arrives within `window_ms`, up to four times
`token_budget` prompt tokens. A group is scored as one call of `scoring.label_logprobs` on a
thread of its own, so the event loop keeps answering while ONNX Runtime works. In that call a
request whose items share a long query runs it once and its items over a copy of its KV cache;
the other requests' prompts share batched prefills. A request whose client has gone is dropped
from the queue, never scored. Types are strict (no string taken for a number or a boolean);
every error, malformed JSON included, is `{"object": "error", "message": ..., "code": ...}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from . import completions, openai_api, openai_server, scoring
from .modeling import OrtModelForCausalLM

log = logging.getLogger("ortmodule.server")


class ScoreRequest(BaseModel):
    """SGLang's scoring request, strictly typed: `"5"`, `5.0` or `true` is not a token id, `"yes"`
    not a boolean."""

    model_config = ConfigDict(strict=True, extra="forbid")

    query: StrictStr | list[StrictInt]
    items: StrictStr | list[StrictStr] | list[list[StrictInt]]
    label_token_ids: list[StrictInt]
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: StrictStr | None = None


@dataclass
class _Pending:
    """A `/v1/score` request, checked and tokenized."""

    prompts: list[list[int]]
    labels: list[int]
    apply_softmax: bool
    done: asyncio.Future
    tokens: int = field(init=False)
    key = ("score",)  # every score request of a group is scored in one call

    def __post_init__(self):
        self.tokens = sum(len(p) for p in self.prompts)


def _route(owners: list[tuple], row: int | None, ids: list[int] | None) -> None:
    """Hand a batch row's new tokens to its request (`push`), or tell every request the end."""
    if row is None:
        for job in {id(job): job for job, _ in owners}.values():
            job.close()
        return
    job, index = owners[row]
    job.push(index, ids)


@dataclass
class Stats:
    """What the server has done; `GET /metrics` returns it."""

    requests: int = 0
    items: int = 0
    groups: int = 0
    largest_group: int = 0  # requests scored together in one group
    rejected_bad: int = 0
    rejected_busy: int = 0
    abandoned: int = 0  # requests whose client went away before their answer; never scored
    failed: int = 0
    completions: int = 0  # /v1/completions and /v1/chat/completions requests answered
    completion_batches: int = 0  # model calls that ran them (requests of equal settings share one)
    largest_completion_batch: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)  # requests per group -> how many groups


class BadRequest(ValueError):
    pass


# Completion requests run together in one batch, at most (a request's prompts all go in its batch).
MAX_ROWS = 32

# Defaults of the limits checked before anything is tokenized.
MAX_BODY_BYTES = 8 * 2**20
MAX_ITEMS = 1024


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token of the vocabulary can stand for (an upper bound:
    byte-level vocabularies write a byte as a character of up to 2 bytes)."""
    if tokenizer is None:
        return 1
    return max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=1)


class ScoreServer:
    """The queue, the batching worker and the scoring of a group."""

    def __init__(self, model, tokenizer, name, token_budget=8192, window_ms=5.0, max_queue=256, max_items=MAX_ITEMS):
        check_options(token_budget=token_budget, window_ms=window_ms, max_queue=max_queue, max_items=max_items)
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_items = max_items
        # A text longer than this many bytes cannot fit the context, however it tokenizes.
        self.max_text_bytes = model.package.context_length * longest_token_bytes(tokenizer)
        self.token_budget = token_budget
        self.window = window_ms / 1000
        self.group_tokens = 4 * token_budget
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(max_queue)
        self.stats = Stats()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ortmodule-score")
        # Tokenizing happens here, off the event loop and off the scoring thread.
        self.tokenizing = ThreadPoolExecutor(2, thread_name_prefix="ortmodule-tokenize")
        self._worker: asyncio.Task | None = None

    # ---- requests -----------------------------------------------------------------------------

    def check(self, request: ScoreRequest) -> tuple[list[list[int]], list[int]]:
        """The request's prompts and labels, or BadRequest naming what is wrong."""
        if request.model not in (None, "", self.name):
            raise BadRequest(f"model {request.model!r} is not served here; this server serves {self.name!r}")
        items = [request.items] if isinstance(request.items, str) else request.items
        if len(items) > self.max_items:
            raise BadRequest(f"items has {len(items)} entries; this server takes at most {self.max_items} per request")
        texts = [("query", request.query)] + [(f"item {i}", item) for i, item in enumerate(items)]
        for where, text in texts:
            # A character is at least one byte: only a text near the bound is encoded to count.
            if not isinstance(text, str) or len(text) * 4 <= self.max_text_bytes:
                continue
            size = len(text) if len(text) > self.max_text_bytes else len(text.encode("utf-8", "surrogatepass"))
            if size > self.max_text_bytes:
                raise BadRequest(
                    f"{where} is at least {size} bytes of text, more than fits the model's context of "
                    f"{self.model.package.context_length} tokens however it tokenizes"
                )
        try:
            prompts = scoring.prompts_of(self.tokenizer, request.query, request.items, request.item_first)
            package = self.model.package
            labels = scoring.checked_labels(request.label_token_ids, package.vocab_size)
            scoring.check_prompts(prompts, package.vocab_size, package.context_length)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        return prompts, labels

    def _check_quietly(self, request: ScoreRequest):
        """`check` on the tokenizing thread, returning the problem rather than raising it: an error
        raised across the thread pool holds its frames (and the request's text) in a reference cycle
        until the garbage collector's next full pass."""
        try:
            return self.check(request), None
        except BadRequest as e:
            return None, str(e)

    async def score(self, request: ScoreRequest) -> dict:
        loop = asyncio.get_running_loop()
        checked, problem = await loop.run_in_executor(self.tokenizing, self._check_quietly, request)
        if problem is not None:
            raise BadRequest(problem)
        prompts, labels = checked
        pending = _Pending(prompts, labels, request.apply_softmax, asyncio.get_running_loop().create_future())
        self.enqueue(pending)
        scores = await pending.done
        return {
            "scores": scores,
            "model": self.name,
            "usage": {"prompt_tokens": pending.tokens, "completion_tokens": 0, "total_tokens": pending.tokens},
            "object": "scoring",
        }

    # ---- the worker ---------------------------------------------------------------------------

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            if first.done.done():  # its client went away while it waited
                continue
            group = [first]
            tokens, deadline = first.tokens, loop.time() + self.window
            while tokens < self.group_tokens:
                try:
                    more = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                if not more.done.done():
                    group.append(more)
                    tokens += more.tokens
            parts: dict[tuple, list] = {}
            for job in group:  # requests of one kind and settings run as one batch
                parts.setdefault(job.key, []).append(job)
            for key, part in parts.items():
                size = len(part) if key[0] == "score" else MAX_ROWS
                for start in range(0, len(part), size):  # completions: at most MAX_ROWS requests a batch
                    await self._run_part(key, part[start : start + size])

    async def _run_part(self, key: tuple, part: list) -> None:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        run = self.score_group if key[0] == "score" else self._complete_group
        try:
            results = await loop.run_in_executor(self._executor, run, part)
        except Exception as e:  # noqa: BLE001  one failed group answers 500; the server goes on
            log.exception("a group of %d %s requests failed", len(part), key[0])
            self.stats.failed += len(part)
            for job in part:
                if not job.done.done():
                    job.done.set_exception(e)
                if key[0] != "score":
                    job.close()  # a stream ends, and reads the failure from `done`
            return
        if key[0] == "score":
            self._record(part, sum(job.tokens for job in part), time.perf_counter() - start)
        else:
            self.stats.completions += len(part)
            self.stats.completion_batches += 1
            self.stats.largest_completion_batch = max(self.stats.largest_completion_batch, len(part))
        for job, result in zip(part, results):
            if not job.done.done():
                job.done.set_result(result)

    def _complete_group(self, part: list) -> list[list[tuple]]:
        """Run completion requests of one kind together; per request, per prompt, its
        (prompt scores or None, completion or None)."""
        prompts = [p for job in part for p in job.prompts]
        owners = [(job, i) for job in part for i in range(len(job.prompts))]
        tops = [job.prompt_top for job in part if job.prompt_top is not None]
        streamer = completions.RowStreamer(lambda row, ids: _route(owners, row, ids)) if part[0].streams else None
        with torch.inference_mode():
            results = completions.complete(self.model, self.tokenizer, prompts, part[0].sampling,
                                           max(tops) if tops else None, streamer, [job.cancelled for job, _ in owners])
        out, k = [], 0
        for job in part:
            mine = results[k : k + len(job.prompts)]
            out.append([(scores if job.prompt_top is not None else None, done) for scores, done in mine])
            k += len(job.prompts)
        return out

    def enqueue(self, job) -> None:
        """Queue a request for the worker (asyncio.QueueFull when the queue is full: 503)."""
        self.queue.put_nowait(job)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())

    async def complete(self, job) -> list[tuple]:
        """Queue a completion request; its per-prompt (prompt scores, completion) when done."""
        self.enqueue(job)
        return await job.done

    def score_group(self, group: list[_Pending]) -> list[list[list[float]]]:
        """Score every request of the group in one call; one device-to-host copy."""
        labels = sorted({t for pending in group for t in pending.labels})
        column = {t: i for i, t in enumerate(labels)}
        with torch.inference_mode():
            logprobs = scoring.label_logprobs(self.model, [p.prompts for p in group], labels, self.token_budget, None)
            parts, row = [], 0
            for pending in group:
                mine = logprobs[row : row + len(pending.prompts), [column[t] for t in pending.labels]]
                parts.append((torch.softmax(mine, -1) if pending.apply_softmax else mine.exp()).flatten())
                row += len(pending.prompts)
            flat = torch.cat(parts).cpu().tolist()
        out, start = [], 0
        for pending in group:
            width = len(pending.labels)
            out.append([flat[start + i * width : start + (i + 1) * width] for i in range(len(pending.prompts))])
            start += width * len(pending.prompts)
        return out

    def _record(self, group: list[_Pending], tokens: int, seconds: float) -> None:
        stats = self.stats
        items = sum(len(p.prompts) for p in group)
        stats.requests += len(group)
        stats.items += items
        stats.groups += 1
        stats.largest_group = max(stats.largest_group, len(group))
        stats.group_sizes[len(group)] = stats.group_sizes.get(len(group), 0) + 1
        log.info("scored %d requests together: %d items, %d tokens, %.1f ms", len(group), items, tokens, 1000 * seconds)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is refused with 413 before the app sees it (from
    Content-Length when sent, else as the bytes arrive), so it is never parsed or tokenized."""

    def __init__(self, app, limit: int, stats: Stats):
        self.app, self.limit, self.stats = app, limit, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send, scope.get("path", ""))
        chunks, received, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.limit:
                return await self._refuse(send, scope.get("path", ""))
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():  # the body once, then the client's own messages (a disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, path: str):
        self.stats.rejected_bad += 1
        message = f"request body over {self.limit} bytes; this server takes at most that"
        if path in openai_server.PATHS:
            body = json.dumps(openai_api.error_body(message)).encode()
        else:
            body = json.dumps({"object": "error", "code": 413, "message": message}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def check_options(**settings) -> None:
    """The server's settings, refused at start when they could only fail later: `window_ms` a
    number of ms in [0, 10000], the others (token_budget, max_queue, max_items, max_body_bytes)
    positive integers."""
    for name, value in settings.items():
        if name == "window_ms":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 10_000:
                raise ValueError(f"window_ms must be between 0 and 10000 ms, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _error(status: int, message: str, path: str = "", param: str | None = None) -> JSONResponse:
    """The error shape of the route: OpenAI's for its routes, SGLang's for the others."""
    if path in openai_server.PATHS:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(openai_api.error_body(message, kind, param), status_code=status)
    return JSONResponse({"object": "error", "message": message, "code": status}, status_code=status)


def _handle_errors(app: FastAPI, server: ScoreServer) -> None:
    """Every refusal in the server's error shape: bodies that are not JSON, unknown routes, and
    requests that do not fit the schema."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """Bodies that are not JSON at all (invalid UTF-8, nesting too deep) and unknown routes."""
        if 400 <= exc.status_code < 500:
            server.stats.rejected_bad += 1
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "invalid request: the body is not valid JSON (UTF-8 text, at most a few hundred levels deep)"
        return _error(exc.status_code, detail, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def bad_schema(request: Request, exc: RequestValidationError):
        server.stats.rejected_bad += 1
        fields = [".".join(str(p) for p in e["loc"] if p != "body") or "body" for e in exc.errors()]
        problems = "; ".join(f"{where}: {e['msg']}" for where, e in zip(fields, exc.errors()))
        return _error(400, f"invalid request: {problems}", request.url.path, fields[0] if fields else None)


def create_app(
    model: OrtModelForCausalLM,
    tokenizer,
    name: str | None = None,
    token_budget: int = 8192,
    window_ms: float = 5.0,
    max_queue: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_items: int = MAX_ITEMS,
) -> FastAPI:
    """The FastAPI app: `POST /v1/score`, `GET /health`, `GET /v1/models`, `GET /metrics`."""
    check_options(max_body_bytes=max_body_bytes)
    name = name or model.name_or_path
    server = ScoreServer(model, tokenizer, name, token_budget, window_ms, max_queue=max_queue, max_items=max_items)

    # On shutdown uvicorn stops accepting and waits for the open requests, which the worker keeps
    # answering: nothing accepted is dropped.
    app = FastAPI(title="ortmodule", description="SGLang-compatible scoring over an ONNX GenAI package")
    app.state.server = server
    app.add_middleware(BodyLimit, limit=max_body_bytes, stats=server.stats)

    _handle_errors(app, server)

    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request):
        try:
            answer = await openai_server.until_answered_or_gone(asyncio.ensure_future(server.score(body)), request)
            if answer is None:
                server.stats.abandoned += 1
                return _error(499, "the client closed the connection before the answer")
            return answer
        except BadRequest as e:
            server.stats.rejected_bad += 1
            return _error(400, str(e))
        except asyncio.QueueFull:
            server.stats.rejected_busy += 1
            return _error(503, f"the server is busy: {server.queue.maxsize} requests are waiting; retry later")
        except Exception as e:  # noqa: BLE001  any failure of the scoring is this request's 500
            return _error(500, f"scoring failed: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [openai_api.model_card(name, model.package)]}

    openai_server.add_routes(app, server)

    @app.get("/metrics")
    async def metrics():
        stats = server.stats
        return {**stats.__dict__, "queued": server.queue.qsize()}

    return app


def serve(path: str, host: str = "127.0.0.1", port: int = 30000, device: str = "cpu", **options) -> None:
    """Load the package at `path` and serve it until interrupted."""
    import uvicorn

    from .hf import load_tokenizer

    model = OrtModelForCausalLM.from_pretrained(path, device=device)
    model.measured_costs()  # timed now (about a second), not in the first request that shares a query
    app = create_app(model, load_tokenizer(path), **options)
    uvicorn.run(app, host=host, port=port, log_level="info")

