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
tokens) and `message_stop`. Tools (`tools` with `input_schema`s, `tool_choice` auto, any, tool or none, an
assistant's `tool_use` blocks and a user's `tool_result` blocks) are chat's tool calling (tools.py): calls come
back as `tool_use` blocks (after the text before them, if any) with `stop_reason` "tool_use", streamed as
`input_json_delta`s. With a reasoning parser (`--reasoning-parser`: reasoning.py) a thinking model's reasoning is
a `thinking` block first (`thinking_delta`s in a stream); extended thinking's `budget_tokens` is vLLM's
`thinking_token_budget`; `thinking` enabled, adaptive or disabled turns the template's `enable_thinking` on or
off, and `output_config.effort` is chat's `reasoning_effort` (chat_prompts.py). Anthropic's server tools are
refused by name; errors take Anthropic's shape (errors.py).
"""

from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request

from .answers import ChatStream, chat_answer
from .chat_prompts import chat_prompt, reasoning_effort
from .errors import ServingError, dumps, failed
from .jobs import Generation, Row
from .openai_routes import CHAT_EXTRAS, chat_job_as
from .reasoning import split_reasoning
from .schemas import ChatMessage, ChatRequest, ContentPart, FunctionCall, ImageURL, MessagesRequest, ToolCall
from .served import Served, abandon, answer_off_loop, run_or_stream
from .tools import checked_tools

RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "reasoning_effort": "output_config.effort"}
# Anthropic's efforts (`output_config.effort`), chat's `reasoning_effort` by name.
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def chat_request(body: MessagesRequest, counting: bool = False) -> ChatRequest:
    """The chat request this request is, or a `ServingError` naming what cannot be carried out."""
    tools, choice, parallel = _tools(body)
    budget, thinking = _thinking(body)
    output = body.output_config or {}
    effort = reasoning_effort(output.get("effort"), "output_config.effort", EFFORTS)
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
        messages += _chat_messages(message, f"messages[{i}]")
    extra = {name: value for name, value in (body.model_extra or {}).items()
             if name in CHAT_EXTRAS + ("response_format",)}
    form = output.get("format")
    if form is not None:  # Anthropic's structured output: a JSON schema
        if not (isinstance(form, dict) and form.get("type") == "json_schema" and isinstance(form.get("schema"), dict)):
            raise ServingError("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                               "output_config.format")
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
    if budget is not None:
        extra["thinking_token_budget"] = budget
    options = extra.get("chat_template_kwargs") or {}
    if thinking is not None and isinstance(options, dict):  # the template's switch, unless the request sets it
        extra["chat_template_kwargs"] = {"enable_thinking": thinking, **options}
    return ChatRequest(model=body.model, messages=messages, max_completion_tokens=body.max_tokens,
                       reasoning_effort=effort,
                       temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                       stop=body.stop_sequences, stream=body.stream, tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel, **extra)


def _thinking(body: MessagesRequest) -> tuple[int | None, bool | None]:
    """Anthropic's `thinking`: the thinking budget (vLLM's `thinking_token_budget`) and whether the model thinks
    (the template's `enable_thinking`: Qwen3's, Gemma 4's; None where `thinking` is left out). Extended thinking,
    `{"type": "enabled", "budget_tokens": N}` (fewer than `max_tokens`, as Anthropic's API asks; its minimum of
    1,024 is its models' own and not kept); `{"type": "adaptive"}`, thinking without a budget; `{"type":
    "disabled"}`, none."""
    if not body.thinking:
        return None, None
    thinking = body.thinking
    kind = thinking.get("type")
    if kind in ("disabled", "adaptive"):
        return None, kind == "adaptive"
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ServingError("thinking must be {'type': 'enabled', 'budget_tokens': a number of tokens}, "
                           "{'type': 'adaptive'} or {'type': 'disabled'}", "thinking")
    if body.max_tokens is not None and budget >= body.max_tokens:
        raise ServingError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({body.max_tokens})",
                           "thinking.budget_tokens")
    return budget, True


def _tools(body: MessagesRequest) -> tuple[list[dict] | None, str | dict | None, bool | None]:
    """Anthropic's `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`, `tool` with
    its `name`, `none`; `disable_parallel_tool_use`) as chat's tools, `tool_choice` and `parallel_tool_calls`
    (tools.py). Anthropic's server tools (a `type` such as web search's) are refused: they run on Anthropic's
    side."""
    tools = None
    for i, tool in enumerate(body.tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ServingError(f"{where}: a tool of type {kind!r} is not supported: this server takes client tools "
                               "(name, description, input_schema)", where)
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ServingError(f"{where} needs a name and an input_schema object", where)
        function = {"name": tool["name"], "parameters": tool["input_schema"],
                    **({"description": tool["description"]} if tool.get("description") is not None else {})}
        tools = (tools or []) + [{"type": "function", "function": function}]
    choice = body.tool_choice or {}
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ServingError("tool_choice of type 'tool' needs the tool's name", "tool_choice")
        return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    chosen = {None: None, "auto": "auto", "any": "required", "none": "none"}
    if kind not in chosen:
        raise ServingError(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    if not tools and kind in ("auto", "none"):  # nothing to call
        return tools, None, parallel
    return tools, chosen[kind], parallel


def _chat_messages(message, where: str) -> list[ChatMessage]:
    """One of Anthropic's messages as chat's: its text and images one message, with an assistant's `tool_use`
    blocks as its calls and its `thinking` blocks as its `reasoning_content` (a template such as Qwen3's places
    it); a user's `tool_result` blocks each a tool message first, as vLLM splits them."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    parts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        if block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            thoughts += [block.thinking] if block.type == "thinking" and block.thinking else []  # redacted: unread
        elif block.type == "tool_use" and message.role == "assistant":
            if not (block.id and block.name):
                raise ServingError(f"{at}: a tool_use block needs an id and a name", at)
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                                     arguments=json.dumps(block.input or {}))))
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise ServingError(f"{at}: a tool_result block needs its tool_use_id", at)
            text = "" if block.content is None else _text_of(block.content, f"{at}.content")
            results.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=text))
        else:
            parts.append(_part(block, at))
    if not (parts or calls or thoughts):
        return results
    return results + [ChatMessage(role=message.role, content=parts or None, tool_calls=calls or None,
                                  reasoning_content="\n".join(thoughts) if thoughts else None)]



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
    raise ServingError(f"{where}: a {block.type!r} block is not supported here: send text, or an image with a base64 "
                       "source (an assistant's tool_use, a user's tool_result)", "messages")


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


def _tool_use(call: dict, arguments) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].rsplit("-", 1)[-1], "name": call["function"]["name"],
            "input": arguments}


def content_of(job: Generation, row: Row) -> tuple[list[dict], str, str | None]:
    """A finished row's content blocks, `stop_reason` and `stop_sequence` (answers.py's reading): a `thinking`
    block of its reasoning where the server reads some; one text block, or with calls the text before them
    (where there is some) and a `tool_use` block each, stop reason "tool_use" (a call cut short by the length
    stays text, "max_tokens")."""
    reason, sequence = stop_of(row)
    message, _, reasoning = chat_answer(job, row)
    thinking = [{"type": "thinking", "thinking": reasoning, "signature": ""}] \
        if reasoning is not None and job.reasoning.shown else []
    calls = message.get("tool_calls") or ()
    try:
        uses = [_tool_use(call, json.loads(call["function"]["arguments"])) for call in calls]
    except ValueError:
        return thinking + [{"type": "text", "text": split_reasoning(job.reasoning, row.text.text)[1] or ""}], \
            reason, sequence
    text = [{"type": "text", "text": message["content"] or ""}] \
        if message["content"] or not (uses or thinking) else []
    if uses and reason != "max_tokens":
        reason, sequence = "tool_use", None
    return thinking + text + uses, reason, sequence


def _message(served: Served, ident: str, job: Generation, row: Row | None) -> dict:
    blocks, reason, sequence = content_of(job, row) if row is not None else ([], None, None)
    return {"id": ident, "type": "message", "role": "assistant", "model": served.name, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": job.tokens, "output_tokens": 0 if row is None else len(row.tokens)}}


def answered(served: Served, body: MessagesRequest, job: Generation, rows: list[Row]) -> dict:
    row, = rows
    return _message(served, f"msg_{uuid.uuid4().hex}", job, row)


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n"


class _Blocks:
    """A stream's content blocks: chat's deltas (answers.py's `ChatStream`) as Anthropic's block events, a block
    started where its kind changes (thinking, text, or a call's `tool_use` with its input's JSON in
    `input_json_delta`s)."""

    def __init__(self):
        self.index, self.open, self.calls = -1, None, 0

    def start(self, block: dict) -> list[str]:
        events = self.close()
        self.index, self.open = self.index + 1, block["type"]
        return events + [_event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[str]:
        was, self.open = self.open, None
        return [_event("content_block_stop", index=self.index)] if was else []

    def of(self, delta: dict | str) -> list[str]:
        events = []
        thought = None if isinstance(delta, str) else delta.get("reasoning")
        if thought:
            if self.open != "thinking":
                events += self.start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "thinking_delta", "thinking": thought}))
        text = delta if isinstance(delta, str) else delta.get("content")
        if text:
            if self.open != "text":
                events += self.start({"type": "text", "text": ""})
            events.append(_event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text}))
        for part in {} if isinstance(delta, str) else delta.get("tool_calls") or ():
            if "id" in part:
                self.calls += 1
                events += self.start(_tool_use(part, {}))
            arguments = part.get("function", {}).get("arguments")
            if arguments:
                events.append(_event("content_block_delta", index=self.index,
                                     delta={"type": "input_json_delta", "partial_json": arguments}))
        return events


async def events(served: Served, job: Generation):
    """The stream of one message (module docstring); a failure of the model's work is an `error` event, after
    which the stream ends; if the client goes away, its row stops."""
    blocks, calls = _Blocks(), ChatStream(job) if job.tools.calls or job.reasoning else None
    try:
        yield _event("message_start", message=_message(served, f"msg_{uuid.uuid4().hex}", job, None))
        if calls is None:  # a text block from the start, as Anthropic's API streams one, if nothing is read
            for event in blocks.start({"type": "text", "text": ""}):
                yield event
        yield _event("ping")
        while (piece := await job.next_event()) is not None:
            for event in blocks.of(calls.piece(piece[1]) if calls else piece[1]):
                yield event
        try:
            row, = await job.future
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            error = e if isinstance(e, ServingError) else failed("the message", e)
            yield _event("error", error=error.anthropic_body()["error"])
            return
        reason, sequence = stop_of(row)
        for delta in calls.end(row)[0] if calls else ():
            for event in blocks.of(delta):
                yield event
        if blocks.index < 0:  # no output at all: the empty text block the answer has
            for event in blocks.start({"type": "text", "text": ""}):
                yield event
        for event in blocks.close():
            yield event
        if blocks.calls and reason != "max_tokens":
            reason, sequence = "tool_use", None
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": len(row.tokens)})
        yield _event("message_stop")
    finally:
        if not job.future.done():  # the client went away mid-stream: free its row
            abandon(served, job)


def count_tokens(served: Served, body: MessagesRequest, _loop=None) -> dict:
    """Anthropic's `count_tokens`: the prompt's tokens as the chat template renders the request."""
    served.check_model(body.model)
    chat = chat_request(body, counting=True)
    prompt, _ = chat_prompt(served, chat, tools=checked_tools(chat.tools))
    return {"input_tokens": len(prompt)}


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await run_or_stream(served, messages_job, body, request, answered, lambda job: events(served, job))

    @app.post("/v1/messages/count_tokens")
    async def counted(body: MessagesRequest):
        return await answer_off_loop(served, count_tokens, body)
