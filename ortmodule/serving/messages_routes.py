"""Anthropic's Messages API, as vLLM serves it: `POST /v1/messages` (server-sent events when `stream` is true)
and `POST /v1/messages/count_tokens`, for Anthropic's SDK and the tools built on it.

A request is a chat request in another shape: `system` (a text, or text blocks) a system message first, then
`messages` (a text, or `text` and `image` blocks: a base64 `source` becomes a data URL, as chat's `image_url`
takes it under `--processor`), `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences`, structured
output (`output_config.format`'s JSON schema, and the fields chat takes: constraints.py). It runs as
`/v1/chat/completions` runs it and comes back as a `message`: one `text` block, `stop_reason` "end_turn" (the
end token, or a grammar complete), "stop_sequence" (with the `stop_sequence` matched) or "max_tokens". A
stream is Anthropic's events: `message_start`, `content_block_start`, `ping`, a `content_block_delta`
(`text_delta`) each piece, then `content_block_stop`, `message_delta` (the stop reason and the output's
tokens) and `message_stop`. Tools (`tools`, `tool_choice` other than none, tool-use and tool-result blocks),
extended thinking and an effort are refused by name; errors take Anthropic's shape (errors.py).
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request

from .chat_prompts import chat_prompt
from .errors import ServingError, dumps, failed
from .jobs import Generation, Row
from .openai_routes import chat_job_as
from .schemas import ChatMessage, ChatRequest, ContentPart, ImageURL, MessagesRequest
from .served import Served, abandon, answer_off_loop, run_or_stream

RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def chat_request(body: MessagesRequest, counting: bool = False) -> ChatRequest:
    """The chat request this request is, or a `ServingError` naming what cannot be carried out."""
    if body.tools:
        raise ServingError("tools is not supported: this server calls no tools; leave it out", "tools")
    if (body.tool_choice or {}).get("type", "none") not in ("none", "auto"):  # (with no tools, "auto" calls none)
        raise ServingError("tool_choice is not supported (this server calls no tools): leave it out", "tool_choice")
    if (body.thinking or {}).get("type", "disabled") != "disabled":
        raise ServingError("thinking is not supported: this server sets no thinking budget; leave it out", "thinking")
    output = body.output_config or {}
    if output.get("effort") is not None:
        raise ServingError("output_config.effort is not supported: this server sets no effort; leave it out",
                           "output_config.effort")
    if not counting and body.max_tokens is None:
        raise ServingError("max_tokens is required (Anthropic's API has no default)", "max_tokens")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise ServingError(f"max_tokens must be at least 1, got {body.max_tokens}", "max_tokens")
    messages = []
    if body.system is not None:
        messages.append(ChatMessage(role="system", content=_text_of(body.system, "system")))
    for i, message in enumerate(body.messages):
        if message.role not in ("user", "assistant"):
            raise ServingError(f"messages[{i}].role {message.role!r}: Anthropic's messages are the user's and the "
                               "assistant's (the system's goes in `system`)", f"messages[{i}].role")
        content = message.content if isinstance(message.content, str) else [
            _part(block, f"messages[{i}].content[{j}]") for j, block in enumerate(message.content)]
        messages.append(ChatMessage(role=message.role, content=content))
    extra = {name: value for name, value in (body.model_extra or {}).items() if name in CHAT_EXTRAS}
    form = output.get("format")
    if form is not None:  # Anthropic's structured output: a JSON schema
        if not (isinstance(form, dict) and form.get("type") == "json_schema" and isinstance(form.get("schema"), dict)):
            raise ServingError("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                               "output_config.format")
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
    return ChatRequest(model=body.model, messages=messages, max_completion_tokens=body.max_tokens,
                       temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                       stop=body.stop_sequences, stream=body.stream, **extra)


# Fields beyond Anthropic's that its clients send through to vLLM and this server carries out as chat does.
CHAT_EXTRAS = ("seed", "min_p", "repetition_penalty", "response_format", "structured_outputs", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "chat_template_kwargs")


def _text_of(system, where: str) -> str:
    if isinstance(system, str):
        return system
    if any(block.type != "text" or block.text is None for block in system):
        raise ServingError(f"{where}: only text blocks are taken", where)
    return "\n".join(block.text for block in system)


def _part(block, where: str) -> ContentPart:
    """A content block as chat's part: text, or an image (a base64 source as a data URL)."""
    if block.type == "text" and block.text is not None:
        return ContentPart(type="text", text=block.text)
    source = block.source or {}
    if block.type == "image" and source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        return ContentPart(type="image_url", image_url=ImageURL(url=url))
    if block.type == "image" and source.get("type") == "url" and isinstance(source.get("url"), str):
        return ContentPart(type="image_url", image_url=ImageURL(url=source["url"]))
    raise ServingError(f"{where}: a {block.type!r} block is not supported: send text, or an image with a base64 "
                       "source", "messages")


def messages_job(served: Served, body: MessagesRequest, loop) -> Generation:
    """`chat_job` of the chat request this is, its refusals naming this API's fields."""
    return chat_job_as(served, chat_request(body), loop, RENAMED, "messages",
                       None if body.system is None else "system")


def stop_of(row: Row) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a finished row."""
    if row.text.finish_reason == "length":
        return "max_tokens", None
    if isinstance(row.text.matched, str):
        return "stop_sequence", row.text.matched
    return "end_turn", None


def _message(served: Served, ident: str, job: Generation, row: Row | None) -> dict:
    reason, sequence = stop_of(row) if row is not None else (None, None)
    return {"id": ident, "type": "message", "role": "assistant", "model": served.name,
            "content": [] if row is None else [{"type": "text", "text": row.text.text}],
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": job.tokens, "output_tokens": 0 if row is None else len(row.tokens)}}


def answered(served: Served, body: MessagesRequest, job: Generation, rows: list[Row]) -> dict:
    row, = rows
    return _message(served, f"msg_{uuid.uuid4().hex}", job, row)


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n"


async def events(served: Served, job: Generation):
    """The stream of one message (module docstring); a failure of the model's work is an `error` event, after
    which the stream ends; if the client goes away, its row stops."""
    try:
        yield _event("message_start", message=_message(served, f"msg_{uuid.uuid4().hex}", job, None))
        yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield _event("ping")
        while (piece := await job.next_event()) is not None:
            yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece[1]})
        try:
            row, = await job.future
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            error = e if isinstance(e, ServingError) else failed("the message", e)
            yield _event("error", error=error.anthropic_body()["error"])
            return
        reason, sequence = stop_of(row)
        yield _event("content_block_stop", index=0)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": len(row.tokens)})
        yield _event("message_stop")
    finally:
        if not job.future.done():  # the client went away mid-stream: free its row
            abandon(served, job)


def count_tokens(served: Served, body: MessagesRequest, _loop=None) -> dict:
    """Anthropic's `count_tokens`: the prompt's tokens as the chat template renders the request."""
    served.check_model(body.model)
    prompt, _ = chat_prompt(served, chat_request(body, counting=True))
    return {"input_tokens": len(prompt)}


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await run_or_stream(served, messages_job, body, request, answered, lambda job: events(served, job))

    @app.post("/v1/messages/count_tokens")
    async def counted(body: MessagesRequest):
        return await answer_off_loop(served, count_tokens, body)
