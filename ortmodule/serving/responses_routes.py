"""OpenAI's Responses API: `POST /v1/responses`, served statelessly, as vLLM serves it without its store.

A request is a chat request in another shape: `input` (a text, one user message; or message items, each
a text or `input_text` / `output_text` / `input_image` parts) after `instructions` (a system message),
`max_output_tokens`, `temperature`, `top_p`, and the log-probabilities of the output's tokens where
`include` names "message.output_text.logprobs" (`top_logprobs` alternatives each). It runs as
`/v1/chat/completions` runs it (the chat template, the server's sampling defaults, the same checks), and
comes back as a `response` object: one assistant message of one `output_text`, `status` "completed", or
"incomplete" with `incomplete_details.reason` "max_output_tokens" where the length ended it. With
`stream`, the API's events: `response.created`, `response.in_progress`, the message and its text part
added, `response.output_text.delta` each piece, their `done` events, then `response.completed` (or
`response.incomplete`). What needs state or something this server does not carry out is refused unless
neutral: `previous_response_id`, `conversation`, a stored `prompt`, `background`, tools, a `text.format`
other than text, `reasoning`, `truncation` "auto"; `store` is taken and answered false (nothing is kept).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from .errors import ServingError, dumps, failed
from .jobs import Generation, Row
from .openai_routes import chat_job_as, chat_logprobs
from .schemas import ChatMessage, ChatRequest, ContentPart, ImageURL, ResponsesRequest
from .served import Served, abandon, run_or_stream

LOGPROBS = "message.output_text.logprobs"
# The request's fields that only a neutral value passes: (name, what passes, why not).
NEUTRAL = (("previous_response_id", (None,), "this server keeps no responses: send the conversation in `input`"),
           ("conversation", (None,), "this server keeps no conversations: send the conversation in `input`"),
           ("prompt", (None,), "this server keeps no prompt templates"),
           ("background", (None, False), "this server answers in the request"),
           ("tools", (None, []), "this route calls no tools (/v1/chat/completions does)"),
           ("max_tool_calls", (None,), "this route calls no tools (/v1/chat/completions does)"),
           ("reasoning", (None, {}, {"effort": None}, {"effort": None, "summary": None}),
            "this server does not set a reasoning effort"),
           ("truncation", (None, "disabled"), "this server does not cut a prompt to fit: a prompt too long is refused"))
# The chat request's field names in its errors, as this API names them.
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "response_format": "text"}


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request this request is, or a `ServingError` naming the field that cannot be carried out."""
    for name, neutral, why in NEUTRAL:
        value = getattr(body, name)
        if not any(value == n and type(value) is type(n) for n in neutral):
            raise ServingError(f"{name} is not supported: {why}; leave it out", name)
    extra = set(body.include or ()) - {LOGPROBS}
    if extra:
        raise ServingError(f"include {sorted(extra)} is not supported: this server includes {LOGPROBS!r} only",
                           "include")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ServingError(f"max_output_tokens must be at least 1, got {body.max_output_tokens}", "max_output_tokens")
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        messages.append(_message(item, f"input[{i}]") if not isinstance(item, dict) else ChatMessage(**item))
    logprobs = LOGPROBS in (body.include or ())
    return ChatRequest(model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
                       temperature=body.temperature, top_p=body.top_p, logprobs=logprobs,
                       top_logprobs=(body.top_logprobs or 0) if logprobs else None, stream=body.stream,
                       tool_choice="none" if body.tool_choice in ("auto", "required") else body.tool_choice,
                       response_format=_response_format((body.text or {}).get("format")))


def _response_format(form):
    """The Responses API's `text.format` as chat's `response_format`: its JSON schema's fields are flat there."""
    if isinstance(form, dict) and form.get("type") == "json_schema" and "json_schema" not in form:
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    return form


def _message(item, where: str) -> ChatMessage:
    """A message item as a chat message: `developer` as `system` (chat templates know the one), its parts as
    chat's (text, `image_url`)."""
    if item.type not in (None, "message"):
        raise ServingError(f"{where}: an item of type {item.type!r} is not supported: this server takes messages "
                           "(it calls no tools and keeps no items)", "input")
    if item.role is None:
        raise ServingError(f"{where}: a message needs a role", "input")
    role = "system" if item.role == "developer" else item.role
    if item.content is None or isinstance(item.content, str):
        return ChatMessage(role=role, content=item.content)
    parts = []
    for j, part in enumerate(item.content):
        if part.type in ("input_text", "output_text") and part.text is not None:
            parts.append(ContentPart(type="text", text=part.text))
        elif part.type == "input_image" and part.image_url is not None:
            parts.append(ContentPart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail)))
        else:
            what = "an image by file_id (this server keeps no files)" if part.file_id else f"a part {part.type!r}"
            raise ServingError(f"{where}.content[{j}]: {what} is not supported: send input_text, output_text or "
                               "input_image with an image_url", "input")
    return ChatMessage(role=role, content=parts)


def responses_job(served: Served, body: ResponsesRequest, loop) -> Generation:
    """`chat_job` of the chat request this is, its refusals naming this API's fields."""
    return chat_job_as(served, chat_request(body), loop, RENAMED, "input",
                       None if body.instructions is None else "instructions")


def response_object(served: Served, body: ResponsesRequest, job: Generation, names: tuple[str, str, int],
                    rows: list[Row] | None) -> dict:
    """The `response` object (`names`: its id, its message's, its time), in progress (`rows` None, no output
    yet) or answered by its one row."""
    ident, message_id, created = names
    sampling = job.sampling
    answer = {"id": ident, "object": "response", "created_at": created, "status": "in_progress",
              "error": None, "incomplete_details": None, "instructions": body.instructions,
              "max_output_tokens": body.max_output_tokens, "model": served.name, "output": [],
              "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
              "previous_response_id": None, "reasoning": None, "store": False, "temperature": sampling.temperature,
              "text": {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto", "tools": [],
              "top_logprobs": body.top_logprobs or 0, "top_p": sampling.top_p, "truncation": "disabled",
              "usage": None, "user": body.user, "metadata": body.metadata or {}}
    if rows is None:
        return answer
    row, = rows
    cut = row.text.finish_reason == "length"
    answer.update(status="incomplete" if cut else "completed",
                  incomplete_details={"reason": "max_output_tokens"} if cut else None,
                  output=[_message_item(served, body, message_id, row, "incomplete" if cut else "completed")],
                  usage={"input_tokens": job.tokens, "output_tokens": len(row.tokens),
                         "total_tokens": job.tokens + len(row.tokens),
                         "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": 0}})
    return answer


def _message_item(served: Served, body: ResponsesRequest, message_id: str, row: Row | None, status: str) -> dict:
    content = [] if row is None else [_text_part(row.text.text, _logprobs(served, body, row))]
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _logprobs(served: Served, body: ResponsesRequest, row: Row, scored: list | None = None) -> list:
    """The output tokens' log-probabilities in chat's entries (token, logprob, bytes, top_logprobs), where
    `include` asks for them; `scored` a stream's piece of them (else the row's all)."""
    if LOGPROBS not in (body.include or ()):
        return []
    if scored is None:
        scored = list(zip(row.tokens, row.logprobs, row.top, strict=True))
    top = body.top_logprobs or 0
    return chat_logprobs(served.tokenizer, [(token, logprob, pairs[:top]) for token, logprob, pairs in scored])


def answered(served: Served, body: ResponsesRequest, job: Generation, rows: list[Row]) -> dict:
    return response_object(served, body, job, _names(), rows)


def _names() -> tuple[str, str, int]:
    """A response's id, its message's id and its creation time."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())


class _Events:
    """A stream's server-sent events, numbered in order (`sequence_number`), each named by its type."""

    def __init__(self):
        self.count = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.count, **fields}
        self.count += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"


async def events(served: Served, body: ResponsesRequest, job: Generation):
    """The stream of one response (module docstring); a failure of the model's work is an `error` event, after
    which the stream ends; if the client goes away, its row stops."""
    names, event = _names(), _Events()
    message_id = names[1]
    place = {"item_id": message_id, "output_index": 0, "content_index": 0}
    try:
        state = response_object(served, body, job, names, None)
        yield event("response.created", response=state)
        yield event("response.in_progress", response=state)
        yield event("response.output_item.added", output_index=0,
                    item=_message_item(served, body, message_id, None, "in_progress"))
        yield event("response.content_part.added", part=_text_part("", []), **place)
        while (piece := await job.next_event()) is not None:
            _, text, _, scored = piece
            yield event("response.output_text.delta", delta=text, logprobs=_logprobs(served, body, None, scored or []),
                        **place)
        try:
            rows = await job.future
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            error = e if isinstance(e, ServingError) else failed("the response", e)
            yield event("error", code=error.code, message=str(error), param=error.param)
            return
        done = response_object(served, body, job, names, rows)
        item, = done["output"]
        part, = item["content"]
        yield event("response.output_text.done", text=part["text"], logprobs=part["logprobs"], **place)
        yield event("response.content_part.done", part=part, **place)
        yield event("response.output_item.done", output_index=0, item=item)
        yield event(f"response.{done['status']}", response=done)
    finally:
        if not job.future.done():  # the client went away mid-stream: free its row
            abandon(served, job)


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await run_or_stream(served, responses_job, body, request, answered,
                                   lambda job: events(served, body, job))

