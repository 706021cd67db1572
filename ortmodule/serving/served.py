"""What every route works with: the engine, the tokenizer, the served name and the settings; and
the path of a request through them, one for all routes:

admit (503 when too many wait) -> check and tokenize on a tokenizing thread (400 on a bad value)
-> submit to the engine -> wait for the answer, or for the client to go away (then the job is
dropped, or its rows stop at the next step) -> build the answer off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request

from ..inputs import outside_vocabulary, vocabulary_message
from .engine import Engine
from .errors import AsciiJSON, ServingError, failed, gone
from .jobs import Job
from .settings import Settings
from .text import longest_token_bytes


def check_max_model_len(limit: int | None, context: int) -> None:
    """ValueError where `max_model_len` is longer than the package's context."""
    if limit is not None and limit > context:
        raise ValueError(f"max_model_len {limit} is longer than the package's context of {context} tokens (the "
                         "graph's positions stop there)")


@dataclass
class Served:
    engine: Engine
    tokenizer: object
    name: str
    settings: Settings
    images: object = None  # serving/images.py's ChatImages, where the package takes images (`--processor`)
    # llguidance's view of the tokenizer, for structured output: built at the first request asking for it
    # (constraints.grammar_tokenizer).
    grammar_view: object = field(default=None, init=False, repr=False)
    # Tokenizing and answer-building happen here, off the event loop and off the model's thread.
    tokenizing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="ortmodule-tokenize"))

    def __post_init__(self):
        package = self.engine.model.package
        check_max_model_len(self.settings.max_model_len, package.context_length)
        self.context, self.vocab = self.settings.max_model_len or package.context_length, package.vocab_size
        # A text longer than this many bytes cannot fit the context, however it tokenizes.
        self.max_text_bytes = self.context * longest_token_bytes(self.tokenizer)
        self.sampling_defaults = sampling_defaults(self.engine.model, self.settings.generation_config)

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.name):
            raise ServingError(f"The model '{model}' does not exist; this server serves '{self.name}'", "model", 404,
                               "model_not_found")

    def need_tokenizer(self, what: str, param: str | None = None) -> None:
        """A 400 where this server was made without a tokenizer (`create_app(model, None)`) and `what`
        needs one: it then scores token ids on /v1/score and nothing else."""
        if self.tokenizer is None:
            raise ServingError(f"{what} needs a tokenizer, and this server was made without one: it scores token ids "
                               "on /v1/score", param)

    def check_texts(self, texts: list[tuple[str, str]]) -> None:
        """Texts (field, text) that cannot fit the context however they tokenize, each and together,
        refused before anything is tokenized."""
        total = 0
        for where, text in texts:
            size = len(text)
            if size * 4 > self.max_text_bytes:  # a character is 1 to 4 bytes: encode only near the bound
                size = len(text.encode("utf-8"))
            total += size
            if size > self.max_text_bytes or total > self.max_text_bytes:
                field_name = where if size > self.max_text_bytes else "the request's texts together"
                raise ServingError(f"{field_name}: {size if field_name == where else total} bytes of text, more than "
                                   f"fits the model's context of {self.context} tokens however it tokenizes",
                                   where.split("[")[0].split(".")[0])

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """Token-id prompts: at least one, none empty, every id inside the vocabulary."""
        if not prompts:
            raise ServingError("prompt is empty", "prompt")
        for i, ids in enumerate(prompts):
            if not ids:
                raise ServingError(f"prompt {i} has no tokens", "prompt")
            bad = outside_vocabulary(ids, self.vocab)
            if bad is not None:
                raise ServingError(f"prompt {i}: {vocabulary_message(bad, self.vocab)}", "prompt")

    def check_values(self, values: int, what: str, param: str) -> None:
        limit = self.settings.max_response_values
        if values > limit:
            raise ServingError(f"{what} would be {values} numbers; this server answers at most {limit} per request",
                               param)


# The sampling fields whose defaults vLLM takes from a model's generation config (its `--generation-config`), each
# with the values it may hold: (lowest, highest, whether the lowest is excluded, whether an integer).
# `max_new_tokens` (vLLM's default `max_tokens`) bounds a chat request that leaves its length out.
SAMPLING_FIELDS = {"temperature": (0.0, math.inf, False, False), "top_p": (0.0, 1.0, True, False),
                   "top_k": (-1, math.inf, False, True), "min_p": (0.0, 1.0, False, False),
                   "repetition_penalty": (0.0, math.inf, True, False), "max_new_tokens": (1, math.inf, False, True)}


def sampling_defaults(model, source: str) -> dict:
    """The values the OpenAI routes give the sampling fields a request leaves out (`SAMPLING_FIELDS`), as vLLM's
    `--generation-config` takes them: "auto", those the package sets (`model.generation_config`, read from
    genai_config.json's search section: the fields that differ from transformers' defaults, as vLLM reads a
    checkpoint's generation_config.json); "vllm", none (OpenAI's defaults); else a folder holding a
    generation_config.json (the checkpoint's), the fields it sets. A ValueError names a value out of range."""
    if source == "vllm":
        return {}
    if source == "auto":
        given, where = {name: getattr(model.generation_config, name, None) for name in SAMPLING_FIELDS}, "the package's"
    else:
        path = Path(source) / "generation_config.json"
        try:
            given = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config must be auto, vllm or a folder holding a readable "
                             f"generation_config.json; {source!r}: {e}") from None
        if not isinstance(given, dict):
            raise ValueError(f"{path} holds no JSON object")
        where = str(path)
    defaults = {name: given[name] for name in SAMPLING_FIELDS if given.get(name) is not None}
    for name, value in defaults.items():
        low, high, open_low, integer = SAMPLING_FIELDS[name]
        kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if (isinstance(value, bool) or not kind_ok or not math.isfinite(value) or not low <= value <= high
                or (open_low and value == low)):
            raise ValueError(f"{where} default {name} is {value!r}, which the OpenAI routes cannot sample with; "
                             "--generation-config vllm takes OpenAI's defaults instead")
    return defaults


async def start(served: Served, make_job, body) -> Job:
    """Admit, check and tokenize, submit: the job running (`make_job(served, body, loop)` checks
    and tokenizes on a tokenizing thread)."""
    engine = served.engine
    engine.admit()
    loop = asyncio.get_running_loop()
    try:
        job, problem = await loop.run_in_executor(served.tokenizing, _quietly, make_job, served, body, loop)
    except BaseException:
        engine.release()
        raise
    if problem is not None:
        engine.release()
        raise problem
    engine.submit(job)
    return job


async def run(served: Served, make_job, body, request: Request, respond) -> AsciiJSON:
    """One request's way through the server (see the module's docstring); `respond(served, body,
    job, result)` builds the answer, which is also serialized off the event loop."""
    job = await start(served, make_job, body)
    try:
        result = await until_answered_or_gone(job, request)
    except ServingError as e:
        if e.status == 499:
            abandon(served, job)
        raise
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(served.tokenizing, lambda: AsciiJSON(respond(served, body, job, result)))


async def run_or_stream(served: Served, make_job, body, request: Request, respond, stream):
    """A generation's answer: with `body.stream`, server-sent events (`stream(job)`, an async generator of
    them) as the job runs; else `run`'s JSON answer, built by `respond`."""
    from fastapi.responses import StreamingResponse

    if body.stream:
        job = await start(served, make_job, body)
        return StreamingResponse(stream(job), media_type="text/event-stream")
    return await run(served, make_job, body, request, respond)


async def answer_off_loop(served: Served, work, body) -> AsciiJSON:
    """A request the tokenizer alone answers (vLLM's `/tokenize`, `/detokenize`): admitted as every
    request is (503 when too many wait), `work(served, body)` run on a tokenizing thread (a refusal
    raised as the route's error), its answer written there too."""
    engine = served.engine
    engine.admit()
    try:
        loop = asyncio.get_running_loop()
        answer, problem = await loop.run_in_executor(served.tokenizing, _quietly,
                                                     lambda *args: AsciiJSON(work(*args)), served, body, None)
    finally:
        engine.release()
    if problem is not None:
        raise problem
    return answer


def _quietly(make_job, served, body, loop):
    """`make_job` on a tokenizing thread, returning the refusal rather than raising it across threads
    (without its traceback, whose frames would keep the request's text alive)."""
    try:
        return make_job(served, body, loop), None
    except ServingError as e:
        return None, e.with_traceback(None)
    except (ValueError, TypeError) as e:
        return None, ServingError(str(e))
    except MemoryError:
        return None, ServingError("the request is too large to tokenize", status=413)
    except Exception as e:  # noqa: BLE001  a fault of the server's own: a 500 in the API's error shape
        return None, failed("preparing the request", e).with_traceback(None)


async def until_answered_or_gone(job: Job, request: Request):
    """The job's result; if the client disconnects first, the job is cancelled and 499 raised.

    Nothing is polled: beside the job's future, a task waits for the connection's next message,
    which after the body (already read) is `http.disconnect`. A request waiting for the engine
    costs the event loop nothing until one of the two happens, however many wait."""
    left = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait({job.future, left}, return_when=asyncio.FIRST_COMPLETED)
        if not job.future.done():
            raise gone()
        error = job.future.exception()
        if error is None:
            return job.future.result()
        raise error if isinstance(error, ServingError) else failed("the model's work", error)
    finally:
        left.cancel()
        error = None  # a raised error's frames would hold the job (and its text) alive


async def _disconnect(receive) -> None:
    """Returns when the client has gone: the ASGI messages after a request's body are (in uvicorn)
    `http.disconnect` when the connection closes, and nothing before."""
    while (await receive())["type"] != "http.disconnect":
        pass


def abandon(served: Served, job: Job) -> None:
    """The client went away: the engine drops the job, or stops its rows at the next step."""
    served.engine.stats.abandoned += 1
    job.cancelled.set()
    if not job.future.done():
        job.future.cancel()
