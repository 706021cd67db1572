"""The OpenAI routes of `ortmodule serve`: `POST /v1/completions`, `POST /v1/chat/completions`
(both with server-sent events when `stream` is true) and `GET /v1/models/{model}`.

A request is checked and tokenized on the server's tokenizing threads, then queued as a
`Completion` for the one worker that owns the model (server.py), which runs requests of equal
settings in one batch: lm-eval's loglikelihood requests (echo, logprobs, one greedy token) share
prefills, greedy generations share a batched `generate`. A request with a seed of its own runs
alone, so that its samples are the ones `model.generate` gives with that seed. A client that goes
away is dropped from the queue, or, while generating, its rows stop at the next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import openai_api
from .completions import Generated, Sampling, eos_ids, finish
from .openai_api import ChatRequest, CompletionRequest, OpenAIError

PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class Completion:
    """A completions or chat request, checked and tokenized, waiting for the model's worker."""

    prompts: list[list[int]]
    sampling: Sampling | None  # None: the prompts' log-probabilities only (echo with max_tokens 0)
    prompt_top: int | None  # echo with logprobs: top-k per prompt position (None: none)
    done: asyncio.Future
    stream: asyncio.Queue | None = None  # streaming: (prompt index, new token ids), then None
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when the client has gone
    tokens: int = field(init=False)

    def __post_init__(self):
        self.tokens = sum(len(p) for p in self.prompts)
        self.loop = self.done.get_loop()

    @property
    def streams(self) -> bool:
        return self.stream is not None

    @property
    def key(self) -> tuple:
        """Requests with equal keys run as one batch: the same settings, no seed of their own."""
        if self.sampling is None or self.sampling.batchable:
            return ("complete", self.sampling, self.streams)
        return ("alone", id(self))

    def push(self, index: int, ids: list[int]) -> None:
        """New tokens of prompt `index` (called on the model's thread)."""
        if self.stream is not None:
            self.loop.call_soon_threadsafe(self.stream.put_nowait, (index, ids))

    def close(self) -> None:
        if self.stream is not None:
            self.loop.call_soon_threadsafe(self.stream.put_nowait, None)


def error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _check_completion(server, body: CompletionRequest) -> tuple[list[list[int]], Sampling | None, int | None]:
    """Prompts, settings and the prompt top-k of a completions request, or OpenAIError."""
    openai_api.check_common(body, server.name)
    package = server.model.package
    if body.logprobs is not None and not 0 <= body.logprobs <= openai_api.MAX_LOGPROBS:
        raise OpenAIError(f"logprobs must be between 0 and {openai_api.MAX_LOGPROBS}", "logprobs")
    if body.stream and (body.echo or body.logprobs is not None):
        raise OpenAIError("stream does not carry echo or logprobs; ask without stream", "stream")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not body.echo):
        raise OpenAIError(f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}", "max_tokens")
    prompts = openai_api.completion_prompts(body, server.tokenizer, package.vocab_size)
    openai_api.check_length(prompts, max_tokens, package.context_length)
    sampling = openai_api.sampling_of(body, max_tokens, body.logprobs) if max_tokens else None
    return prompts, sampling, body.logprobs if body.echo and body.logprobs is not None else None


def _check_chat(server, body: ChatRequest) -> tuple[list[list[int]], Sampling, None]:
    openai_api.check_common(body, server.name)
    if body.logprobs:
        raise OpenAIError("logprobs is not supported for chat completions; use /v1/completions", "logprobs")
    prompt = openai_api.chat_prompt(body, server.tokenizer)
    context = server.model.package.context_length
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = context - len(prompt) if limit is None else limit
    if max_tokens < 1:
        raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    openai_api.check_length([prompt], max_tokens, context)
    return [prompt], openai_api.sampling_of(body, max_tokens, None), None


def _check_size(server, body) -> None:
    """Texts that cannot fit the context however they tokenize, and too many prompts, are refused
    before anything is tokenized."""
    if isinstance(body, CompletionRequest):
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(texts) > server.max_items:
            raise OpenAIError(f"prompt has {len(texts)} entries; this server takes at most {server.max_items}",
                              "prompt")
        where = "prompt"
    else:
        texts, where = [m.content if isinstance(m.content, str) else "" for m in body.messages], "messages"
    for text in texts:
        if isinstance(text, str) and len(text) > server.max_text_bytes:
            raise OpenAIError(f"{where} holds a text of {len(text)} characters, more than fits the model's context "
                              f"of {server.model.package.context_length} tokens however it tokenizes", where)


def _quietly(check, server, body):
    """`check` on a tokenizing thread, returning the refusal rather than raising it across threads
    (without its traceback, whose frames would keep the request alive)."""
    try:
        _check_size(server, body)
        return check(server, body), None
    except OpenAIError as e:
        return None, e.with_traceback(None)


async def _prepare(server, check, body) -> Completion:
    loop = asyncio.get_running_loop()
    checked, problem = await loop.run_in_executor(server.tokenizing, _quietly, check, server, body)
    if problem is not None:
        raise problem
    prompts, sampling, prompt_top = checked
    return Completion(prompts, sampling, prompt_top, loop.create_future(),
                      asyncio.Queue() if body.stream else None)


async def until_answered_or_gone(work: asyncio.Task, request: Request, poll: float = 0.05):
    """Wait for `work`; if the client disconnects first, cancel it (its queued request is then
    skipped) and return None."""
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=poll)
            if done:
                return work.result()
            if await request.is_disconnected():
                work.cancel()
                return None
    finally:
        # An error raised from work.result() holds this frame in its traceback, and this frame
        # holds the task (in `work` and `done`) that holds the error: without this, every refused
        # request (with its body) would stay in memory until the garbage collector's next full pass.
        work = done = None


async def _answer(server, job: Completion, request: Request):
    """The job's results, or None when the client went away first (the job is then dropped, or its
    rows stopped at the next step)."""
    results = await until_answered_or_gone(asyncio.ensure_future(server.complete(job)), request)
    if results is None:
        job.cancelled.set()
        server.stats.abandoned += 1
    return results


def _completion_body(server, body: CompletionRequest, job: Completion, results: list[tuple]) -> dict:
    tokenizer, choices, generated = server.tokenizer, [], 0
    for i, (prompt, (scores, done)) in enumerate(zip(job.prompts, results)):
        text = (tokenizer.decode(prompt) if body.echo else "") + (done.text if done else "")
        logprobs = None
        if body.logprobs is not None:
            logprobs = openai_api.completion_logprobs(tokenizer, prompt, scores, done, body.echo, body.logprobs)
        choices.append({"index": i, "text": text, "logprobs": logprobs,
                        "finish_reason": done.finish_reason if done else "length"})
        generated += len(done.tokens) if done else 0
    return openai_api.completion_body(server.name, choices, job.tokens, generated)


class _TextStream:
    """One prompt's streamed text: tokens in, safe-to-send text deltas out (text that could still
    turn into a stop string, or an incomplete character, waits)."""

    def __init__(self, tokenizer, eos: set[int], stop: tuple[str, ...]):
        self.tokenizer, self.eos, self.stop = tokenizer, eos, stop
        self.ids: list[int] = []
        self.sent, self.count, self.finished = 0, 0, None
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, ids: list[int]) -> str:
        if self.finished:
            return ""
        for token in ids:
            self.count += 1
            if token in self.eos:
                self.finished = "stop"
                return self._rest(finish(self.tokenizer, self.ids, self.eos, self.stop).text)
            self.ids.append(token)
        done = finish(self.tokenizer, self.ids, self.eos, self.stop)
        if done.finish_reason == "stop":
            self.finished, self.count = "stop", len(done.tokens)
            return self._rest(done.text)
        safe = len(done.text.rstrip("\ufffd")) - self.hold
        delta = done.text[self.sent : max(self.sent, safe)]
        self.sent += len(delta)
        return delta

    def end(self) -> str:
        if self.finished:
            return ""
        self.finished = "length"
        return self._rest(finish(self.tokenizer, self.ids, self.eos, self.stop).text)

    def _rest(self, text: str) -> str:
        delta, self.sent = text[self.sent :], len(text)
        return delta


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _events(server, job: Completion, kind: str, usage: bool):
    """Server-sent events of a streamed completion (the job already queued); the job is dropped,
    or its rows stopped, if the client goes away."""
    ident = openai_api.new_id("chatcmpl" if kind == "chat.completion.chunk" else "cmpl")
    streams = [_TextStream(server.tokenizer, eos_ids(server.model), job.sampling.stop) for _ in job.prompts]
    try:
        if kind == "chat.completion.chunk":
            yield _sse(openai_api.chunk(kind, ident, server.name, 0, role=True))
        while (event := await job.stream.get()) is not None:
            index, ids = event
            delta = streams[index].add(ids)
            if delta:
                yield _sse(openai_api.chunk(kind, ident, server.name, index, delta))
        try:
            await job.done
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            yield _sse(OpenAIError(f"the completion failed: {type(e).__name__}: {e}", status=500,
                                   kind="server_error").body())
            return
        for index, stream in enumerate(streams):
            delta = stream.end()
            if delta:
                yield _sse(openai_api.chunk(kind, ident, server.name, index, delta))
            yield _sse(openai_api.chunk(kind, ident, server.name, index, finish=stream.finished))
        if usage:
            yield _sse({"id": ident, "object": kind, "model": server.name, "choices": [],
                        "usage": openai_api.usage(job.tokens, sum(s.count for s in streams))})
        yield _sse("[DONE]")
    finally:
        if not job.done.done():  # the client went away mid-stream: free its rows
            job.cancelled.set()
            job.done.cancel()
            server.stats.abandoned += 1


async def _run(server, check, body, request: Request, respond, kind: str):
    """Check, queue and answer one OpenAI request (streamed when asked)."""
    try:
        job = await _prepare(server, check, body)
        if job.streams:
            include = bool((body.stream_options or {}).get("include_usage"))
            server.enqueue(job)
            return StreamingResponse(_events(server, job, kind, include), media_type="text/event-stream")
        results = await _answer(server, job, request)
    except OpenAIError as e:
        server.stats.rejected_bad += 1
        return error(e)
    except asyncio.QueueFull:
        server.stats.rejected_busy += 1
        return error(OpenAIError(f"the server is busy: {server.queue.maxsize} requests are waiting; retry later",
                                 status=503, kind="server_error"))
    except Exception as e:  # noqa: BLE001  a failure of the model's work is this request's 500
        return error(OpenAIError(f"the completion failed: {type(e).__name__}: {e}", status=500, kind="server_error"))
    if results is None:
        return error(OpenAIError("the client closed the connection before the answer", status=499))
    # Decoding texts and token strings happens off the event loop, as tokenizing does.
    return await asyncio.get_running_loop().run_in_executor(server.tokenizing, respond, server, body, job, results)


def _chat_body(server, body: ChatRequest, job: Completion, results: list[tuple]) -> dict:
    done: Generated = results[0][1]
    return openai_api.chat_body(server.name, done, job.tokens)


def add_routes(app: FastAPI, server) -> None:
    """`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models/{model}`."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _run(server, _check_completion, body, request, _completion_body, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _run(server, _check_chat, body, request, _chat_body, "chat.completion.chunk")

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != server.name:
            return error(OpenAIError(f"The model '{model}' does not exist", "model", 404, "model_not_found"))
        return openai_api.model_card(server.name, server.model.package)
