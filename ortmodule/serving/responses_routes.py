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
`response.incomplete`). Function tools (`tools` of type "function", `tool_choice`, `parallel_tool_calls`;
`function_call` and `function_call_output` input items) are chat's tool calling (tools.py): calls come back
as `function_call` items after the message of the text before them (if any), streamed as
`response.function_call_arguments.delta`s. vLLM's sampling and structured-output extras (`CHAT_EXTRAS`) are
taken as chat takes them. With a reasoning parser (`--reasoning-parser`: reasoning.py) a thinking model's
reasoning is a `reasoning` item first (`reasoning_text` content, streamed as `response.reasoning_text.delta`s);
reasoning items handed back in `input` are given to the assistant's message after them as its
`reasoning_content`, which templates such as Qwen3's place (after the last user message) or leave out.
`reasoning.effort` is chat's `reasoning_effort` (the template's). What needs state or something this server does
not carry out is refused unless neutral: `previous_response_id`, `conversation`, a stored `prompt`, `background`,
hosted tools, `max_tool_calls`, `truncation` "auto"; `store` is taken and answered false (nothing is kept), and
a reasoning `summary` as vLLM takes it (none is written: the reasoning item holds the reasoning whole).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from .answers import ChatStream, chat_answer
from .chat_prompts import reasoning_effort
from .errors import ServingError, dumps, failed
from .jobs import Generation, Row
from .openai_routes import CHAT_EXTRAS, chat_job_as, chat_logprobs
from .reasoning import reasoning_tokens
from .schemas import ChatMessage, ChatRequest, ContentPart, FunctionCall, ImageURL, ResponsesRequest, ToolCall
from .served import Served, abandon, run_or_stream

LOGPROBS = "message.output_text.logprobs"
# The request's fields that only a neutral value passes: (name, what passes, why not).
NEUTRAL = (("previous_response_id", (None,), "this server keeps no responses: send the conversation in `input`"),
           ("conversation", (None,), "this server keeps no conversations: send the conversation in `input`"),
           ("prompt", (None,), "this server keeps no prompt templates"),
           ("background", (None, False), "this server answers in the request"),
           ("max_tool_calls", (None,), "it counts built-in tools' calls, and this server has none"),
           ("truncation", (None, "disabled"), "this server does not cut a prompt to fit: a prompt too long is refused"))
# vLLM's extras of its Responses request that chat takes under the same names: chat's (`CHAT_EXTRAS`), and the
# sampling, stop and output fields vLLM's Responses request adds (left out, they would be ignored).
RESPONSES_EXTRAS = CHAT_EXTRAS + ("stop", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
                                  "include_reasoning", "skip_special_tokens", "include_stop_str_in_output",
                                  "mm_processor_kwargs")
# vLLM's Responses extras this server does not carry out, refused unless neutral: (name, what passes, why not).
REFUSED_EXTRAS = (("media_io_kwargs", (None,), "this server loads no media: images come as data URLs"),
                  ("vllm_xargs", (None, {}), "this server has no custom extensions"),
                  ("cache_salt", (None,), "this server keeps one prefix cache for all requests"))
# The chat request's field names in its errors, as this API names them.
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "response_format": "text"}


def _refuse_unless_neutral(read, fields) -> None:
    """A `ServingError` naming the first of `fields` ((name, the values that pass, why not)) whose value, as
    `read(name)` gives it, is not one of those that pass (of their type too: `0` is not `False`)."""
    for name, neutral, why in fields:
        value = read(name)
        if not any(value == n and type(value) is type(n) for n in neutral):
            raise ServingError(f"{name} is not supported: {why}; leave it out", name)


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request this request is, or a `ServingError` naming the field that cannot be carried out."""
    _refuse_unless_neutral(lambda name: getattr(body, name), NEUTRAL)
    extra = set(body.include or ()) - {LOGPROBS}
    if extra:
        raise ServingError(f"include {sorted(extra)} is not supported: this server includes {LOGPROBS!r} only",
                           "include")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ServingError(f"max_output_tokens must be at least 1, got {body.max_output_tokens}", "max_output_tokens")
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    thought = None  # a reasoning item's text, for the assistant's message after it
    for i, item in enumerate(items):
        if isinstance(item, dict):
            messages.append(ChatMessage(**item))
            continue
        if item.type == "reasoning":
            parts = item.content if isinstance(item.content, list) else ()
            thought = "".join(part.text or "" for part in parts if part.type == "reasoning_text") or None
            continue
        if item.type in ("function_call", "function_call_output"):
            _add_call(messages, item, f"input[{i}]")
        else:
            messages.append(_message(item, f"input[{i}]"))
        if thought is not None and messages[-1].role == "assistant":  # the template places it (Qwen3's does)
            messages[-1] = messages[-1].model_copy(update={"reasoning_content": thought})
            thought = None
    logprobs = LOGPROBS in (body.include or ())
    tools, choice = _tools(body)
    extra = {name: value for name, value in (body.model_extra or {}).items() if name in RESPONSES_EXTRAS}
    _refuse_unless_neutral((body.model_extra or {}).get, REFUSED_EXTRAS)
    ident = (body.model_extra or {}).get("request_id")
    if ident is not None and not (isinstance(ident, str) and 0 < len(ident) <= 256):
        raise ServingError(f"request_id must be a string of 1 to 256 characters, got {ident!r:.60}", "request_id")
    return ChatRequest(model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
                       reasoning_effort=_effort(body.reasoning), temperature=body.temperature, top_p=body.top_p,
                       logprobs=logprobs,
                       top_logprobs=(body.top_logprobs or 0) if logprobs else None, stream=body.stream,
                       tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
                       response_format=_response_format((body.text or {}).get("format")), **extra)


SUMMARIES = (None, "auto", "concise", "detailed")


def _effort(reasoning: dict | None) -> str | None:
    """`reasoning`'s `effort`: chat's `reasoning_effort` (the template's; chat_prompts.py). A `summary` is taken as
    vLLM takes it: the reasoning item's `summary` stays empty, its `content` the reasoning whole (with
    `--reasoning-parser`), which clients asking for a summary (Codex's) read as none was written."""
    reasoning = reasoning or {}
    for name in set(reasoning) - {"effort"}:
        if name not in ("summary", "generate_summary"):
            raise ServingError(f"reasoning.{name} is not supported: this server takes reasoning.effort and "
                               "reasoning.summary", f"reasoning.{name}")
        if reasoning[name] not in SUMMARIES:
            raise ServingError(f"reasoning.{name} must be one of auto, concise, detailed; got {reasoning[name]!r}",
                               f"reasoning.{name}")
    return reasoning_effort(reasoning.get("effort"), "reasoning.effort")


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, str | dict | None]:
    """This API's function tools (`name`, `description`, `parameters`, `strict` flat in the tool) and
    `tool_choice` (a named function `{"type": "function", "name"}` flat too) as chat's (tools.py). Its hosted
    tools (web search, file search, MCP, ...) are refused: this server runs none."""
    tools = None
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ServingError(f"tools[{i}]: a tool of type {kind!r} is not supported: this server calls functions "
                               "(type 'function') only", f"tools[{i}]")
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        tools = (tools or []) + [{"type": "function", "function": function}]
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ServingError(f"tool_choice {choice!r} is not supported: send 'auto', 'none', 'required' or "
                               "{'type': 'function', 'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif not tools and choice in ("auto", "required"):  # nothing to call
        choice = None
    return tools, choice


def _add_call(messages: list[ChatMessage], item, where: str) -> None:
    """A `function_call` item as a call of the assistant's message (the last message, where it is the
    assistant's, else a new one); a `function_call_output` as a tool message answering its `call_id`."""
    if not item.call_id:
        raise ServingError(f"{where}: a {item.type} item needs its call_id", "input")
    if item.type == "function_call_output":
        output = item.output if isinstance(item.output, str) or item.output is None else "".join(
            part.text or "" for part in item.output if part.type in ("input_text", "output_text"))
        messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output or ""))
        return
    if item.name is None or item.arguments is None:
        raise ServingError(f"{where}: a function_call item needs its name and arguments", "input")
    call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
    if messages and messages[-1].role == "assistant":
        messages[-1] = messages[-1].model_copy(update={"tool_calls": (messages[-1].tool_calls or []) + [call]})
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _response_format(form):
    """The Responses API's `text.format` as chat's `response_format`: its JSON schema's fields are flat there."""
    if isinstance(form, dict) and form.get("type") == "json_schema" and "json_schema" not in form:
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    return form


def _message(item, where: str) -> ChatMessage:
    """A message item as a chat message: `developer` as `system` (chat templates know the one), its parts as
    chat's (text, `image_url`)."""
    if item.type not in (None, "message"):
        raise ServingError(f"{where}: an item of type {item.type!r} is not supported: this server takes messages, "
                           "function_call and function_call_output items (it keeps no items)", "input")
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
                    rows: list[Row] | None, output: list[dict] | None = None) -> dict:
    """The `response` object (`names`: its id, its message's, its time), in progress (`rows` None, no output
    yet) or answered by its one row (its `output` items as a stream gave them, else `_output`'s)."""
    ident, message_id, created = names
    sampling = job.sampling
    answer = {"id": ident, "object": "response", "created_at": created, "status": "in_progress",
              "error": None, "incomplete_details": None, "instructions": body.instructions,
              "max_output_tokens": body.max_output_tokens, "model": served.name, "output": [],
              "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
              "previous_response_id": None, "reasoning": None, "store": False, "temperature": sampling.temperature,
              "text": {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
              "tools": body.tools or [], "top_logprobs": body.top_logprobs or 0, "top_p": sampling.top_p,
              "truncation": "disabled", "usage": None, "user": body.user, "metadata": body.metadata or {}}
    if rows is None:
        return answer
    row, = rows
    cut = row.text.finish_reason == "length"
    answer.update(status="incomplete" if cut else "completed",
                  incomplete_details={"reason": "max_output_tokens"} if cut else None,
                  output=output if output is not None else _output(served, body, job, message_id, row),
                  usage={"input_tokens": job.tokens, "output_tokens": len(row.tokens),
                         "total_tokens": job.tokens + len(row.tokens),
                         "input_tokens_details": {"cached_tokens": row.cached_prefix, "cache_write_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": reasoning_tokens(job.reasoning, row.text.text,
                                                                                        row.text.ends)}})
    return answer


def _output(served: Served, body: ResponsesRequest, job: Generation, message_id: str, row: Row) -> list[dict]:
    """A finished row's output items (answers.py's reading): its reasoning as a `reasoning` item where the
    server reads some; the assistant's message, or with calls the text before them as a message (where there
    is some) and a `function_call` item each. The message's log-probabilities are the whole output's, so they
    are left out where the output is read for reasoning or calls (as a stream, which cannot know in advance
    whether the output will hold some, leaves them out)."""
    status = _status(row)
    message, _, reasoning = chat_answer(job, row)
    calls = message.get("tool_calls") or ()
    shown = reasoning is not None and job.reasoning.shown
    items = [_reasoning_item(f"rs_{message_id[4:]}", status, reasoning)] if shown else []
    if message["content"] or not calls:
        logprobs = [] if job.tools.calls or job.reasoning is not None else _logprobs(served, body, row)
        items.append(_message_item(message_id, status, message["content"] or "", logprobs))
    return items + [_call_item(call, status) for call in calls]


def _reasoning_item(ident: str, status: str, text: str | None) -> dict:
    return {"type": "reasoning", "id": ident, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}], "status": status}


def _status(row: Row) -> str:
    return "incomplete" if row.text.finish_reason == "length" else "completed"


def _message_item(message_id: str, status: str, text: str | None, logprobs: list = ()) -> dict:
    content = [] if text is None else [_text_part(text, list(logprobs))]
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict, status: str, arguments: str | None = None) -> dict:
    """A `function_call` output item of chat's call (tools.py's), its ids of this API's forms."""
    tail = call["id"].rsplit("-", 1)[-1]
    return {"type": "function_call", "id": f"fc_{tail}", "call_id": f"call_{tail}", "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments, "status": status}


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
    return response_object(served, body, job, _names(body), rows)


def _names(body: ResponsesRequest) -> tuple[str, str, int]:
    """A response's id (vLLM's `request_id` field where the request sends one, as vLLM answers it), its message's
    id and its creation time."""
    ident = (body.model_extra or {}).get("request_id") or f"resp_{uuid.uuid4().hex}"
    return ident, f"msg_{uuid.uuid4().hex}", int(time.time())


class _Events:
    """A stream's server-sent events, numbered in order (`sequence_number`), each named by its type."""

    def __init__(self):
        self.count = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.count, **fields}
        self.count += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"


class _Output:
    """A stream's output items as they come (chat's deltas: answers.py's `ChatStream`): the reasoning
    (`response.reasoning_text.delta`s), the message's text (`response.output_text.delta`s) and each call
    (`response.function_call_arguments.delta`s), an item added where one starts and done where the next starts
    or the output ends; `items` the items done."""

    def __init__(self, event: _Events, message_id: str):
        self.event, self.message_id, self.items, self.open, self.text = event, message_id, [], None, ""

    def place(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def thinking(self, piece: str) -> list[str]:
        events = []
        if self.open != "reasoning":
            events += self.close("completed")
            self.items.append(_reasoning_item(f"rs_{self.message_id[4:]}", "in_progress", None))
            self.open, self.text = "reasoning", ""
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=self.items[-1]))
        self.text += piece
        return events + [self.event("response.reasoning_text.delta", delta=piece, content_index=0, **self.place())]

    def open_message(self) -> list[str]:
        events = self.close("completed")
        self.items.append(_message_item(self.message_id, "in_progress", None))
        self.open, self.text = "message", ""
        return events + [self.event("response.output_item.added", output_index=len(self.items) - 1,
                                    item=self.items[-1]),
                         self.event("response.content_part.added", part=_text_part("", []), content_index=0,
                                    **self.place())]

    def delta(self, delta: dict, logprobs: list) -> list[str]:
        events = self.thinking(delta["reasoning"]) if delta.get("reasoning") else []
        if delta.get("content"):
            events += self.open_message() if self.open != "message" else []
            self.text += delta["content"]
            events.append(self.event("response.output_text.delta", delta=delta["content"], logprobs=logprobs,
                                     content_index=0, **self.place()))
        for part in delta.get("tool_calls") or ():
            if "id" in part:
                events += self.close("completed")
                self.items.append(_call_item(part, "in_progress", ""))
                self.open = "call"
                events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=self.items[-1]))
            piece = part.get("function", {}).get("arguments")
            if piece:
                self.items[-1]["arguments"] += piece
                events.append(self.event("response.function_call_arguments.delta", delta=piece, **self.place()))
        return events

    def close(self, status: str, logprobs: list = ()) -> list[str]:
        """The open item's done events (`logprobs`: the message's whole text's)."""
        was, self.open = self.open, None
        if was is None:
            return []
        if was == "reasoning":
            item = self.items[-1] = _reasoning_item(self.items[-1]["id"], status, self.text)
            return [self.event("response.reasoning_text.done", text=self.text, content_index=0, **self.place()),
                    self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]
        if was == "message":
            item = self.items[-1] = _message_item(self.message_id, status, self.text, logprobs)
            part = item["content"][0]
            return [self.event("response.output_text.done", text=part["text"], logprobs=part["logprobs"],
                               content_index=0, **self.place()),
                    self.event("response.content_part.done", part=part, content_index=0, **self.place()),
                    self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]
        item = self.items[-1]
        item["status"] = status
        return [self.event("response.function_call_arguments.done", arguments=item["arguments"], **self.place()),
                self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]


async def events(served: Served, body: ResponsesRequest, job: Generation):
    """The stream of one response (module docstring); a failure of the model's work is an `error` event, after
    which the stream ends; if the client goes away, its row stops."""
    names, event = _names(body), _Events()
    output = _Output(event, names[1])
    calls = ChatStream(job) if job.tools.calls or job.reasoning else None  # read as the output comes
    try:
        state = response_object(served, body, job, names, None)
        yield event("response.created", response=state)
        yield event("response.in_progress", response=state)
        for line in output.open_message() if calls is None else ():  # a message from the start, if nothing is read
            yield line
        while (piece := await job.next_event()) is not None:
            _, text, _, scored = piece
            delta = calls.piece(text) if calls else {"content": text}
            for line in output.delta(delta, [] if calls else _logprobs(served, body, None, scored or [])):
                yield line
        try:
            rows = await job.future
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            error = e if isinstance(e, ServingError) else failed("the response", e)
            yield event("error", code=error.code, message=str(error), param=error.param)
            return
        row, = rows
        for delta in calls.end(row)[0] if calls else ():
            for line in output.delta(delta, []):
                yield line
        lines = output.open_message() if not output.items else []  # no output at all: an empty message
        lines += output.close(_status(row), _logprobs(served, body, row) if calls is None else [])
        for line in lines:
            yield line
        done = response_object(served, body, job, names, rows, output.items)
        yield event(f"response.{done['status']}", response=done)
    finally:
        if not job.future.done():  # the client went away mid-stream: free its row
            abandon(served, job)


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await run_or_stream(served, responses_job, body, request, answered,
                                   lambda job: events(served, body, job))

