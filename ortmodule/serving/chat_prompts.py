"""Chat requests' prompts, as `/v1/chat/completions` and `/tokenize` render them: the messages
checked (roles, content parts, images), rendered through the model's chat template with the
request's template options (vLLM's and SGLang's `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`), and tokenized exactly as `apply_chat_template` tokenizes them.

Special tokens typed in chat content are text, not control tokens: content holding one is
tokenized apart from the template, with special tokens split (a user message cannot forge a
system turn). vLLM and SGLang tokenize the rendered template whole, so such content becomes
control tokens there (SGLang offers the split as an opt-in filter of the template).
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import jinja2

from .errors import ServingError
from .served import Served
from .settings import TEMPLATE_ARGUMENTS
from .text import special_tokens

ROLES = ("system", "user", "assistant", "developer", "tool")
# vLLM's reasoning efforts (OpenAI's, and DeepSeek V4's "max"), which the chat template reads as `reasoning_effort`.
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")



def refuse_unsupported(body) -> None:
    """What a chat request may ask for that this server does not carry out: OpenAI's audio output, web search
    and `verbosity` (a client asking for them would get plain text as if they had been applied). Neutral
    values pass: `modalities` ["text"]. (`response_format`: constraints.py; tools: tools.py.)"""
    # OpenAI's output other than text (audio), its web search and its answer length (`verbosity`)
    modalities = getattr(body, "modalities", None)
    if modalities not in (None, ["text"]):
        raise ServingError(f"modalities {modalities!r} is not supported: this server answers in text; leave it out or "
                           "send ['text']", "modalities")
    for name in ("audio", "web_search_options", "verbosity"):
        if getattr(body, name, None) is not None:
            raise ServingError(f"{name} is not supported by this server; leave it out", name)


def _template_options(body, messages: list[dict], defaults: dict | None = None) -> dict:
    """What the chat template is rendered with, as vLLM and SGLang take it: the assistant's turn added
    (`add_generation_prompt`, the default), or the last message, an assistant's, continued without
    its end (`continue_final_message`, which turns the former off unless both are sent), and the
    template's own variables (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), over the server's
    `defaults` (`--default-chat-template-kwargs`), which the request's fields and its own variables override."""
    extra = body.chat_template_kwargs or {}
    for key in extra:
        if key in TEMPLATE_ARGUMENTS:
            raise ServingError(f"chat_template_kwargs may not set {key!r}, an argument of the template's rendering "
                               "itself" + (" (send it as a field of the request)" if key in (
                                   "add_generation_prompt", "continue_final_message", "chat_template") else ""),
                               "chat_template_kwargs")
    continuing = body.continue_final_message
    if continuing and body.add_generation_prompt:
        raise ServingError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           "continue_final_message")
    if continuing and messages[-1]["role"] != "assistant":
        raise ServingError("continue_final_message continues the last message, which must be the assistant's; "
                           f"it is the {messages[-1]['role']}'s", "continue_final_message")
    adding = not continuing if body.add_generation_prompt is None else body.add_generation_prompt
    return {**(defaults or {}), **extra, **_effort_and_documents(body, extra), "add_generation_prompt": adding,
            "continue_final_message": continuing}


def reasoning_effort(effort, field: str, efforts: tuple[str, ...] = EFFORTS) -> str | None:
    """A request's reasoning effort, one of `efforts` (or None), or a `ServingError` naming `field`."""
    if effort is not None and effort not in efforts:
        raise ServingError(f"{field} must be one of {', '.join(efforts)}; got {effort!r}", field)
    return effort


def _effort_and_documents(body, extra: dict) -> dict:
    """vLLM's chat fields that the template renders: `reasoning_effort` as the template's `reasoning_effort`, and
    `enable_thinking` (Qwen3's, Gemma 4's) true unless the effort is "none", where `chat_template_kwargs` does not
    set it; `documents` (a list of objects, as transformers' `apply_chat_template` takes them) as its
    `documents`. A template that reads neither renders as without them."""
    options = {}
    effort = reasoning_effort(getattr(body, "reasoning_effort", None), "reasoning_effort")
    if effort is not None:
        options["reasoning_effort"] = effort
        if "enable_thinking" not in extra:
            options["enable_thinking"] = effort != "none"
    documents = getattr(body, "documents", None)
    if documents is not None:
        options["documents"] = documents
    return options


def chat_prompt(served: Served, body, texts_beside: list[tuple[str, str]] = (),
                tools: tuple[dict, ...] = ()) -> tuple[list[int], object]:
    """A chat request's prompt: its messages (`body.messages`) checked and rendered through the chat
    template with the request's template options (`_template_options`) and `tools` (tools.py's, checked),
    the images' tokens placed where the package takes images; and the images (None without).
    `texts_beside`: the request's other texts, whose sizes count with the messages'."""
    if not body.messages:
        raise ServingError("messages is empty", "messages")
    served.need_tokenizer("/v1/chat/completions", "messages")
    tokenizer = served.tokenizer
    template = request_template(served, body)
    media_options = _media_options(served, body)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ServingError("this model's tokenizer has no chat template: send a prompt instead of messages "
                           "(/v1/completions; /tokenize takes one too)", "messages")
    messages, texts, pictures = [], [], []
    for i, message in enumerate(body.messages):
        if message.role not in ROLES:
            raise ServingError(f"messages[{i}].role {message.role!r} is not a chat role", f"messages[{i}].role")
        content = message.content or ""
        if isinstance(content, list):
            content = _content_parts(served, content, f"messages[{i}].content", texts, pictures)
        else:
            texts.append((f"messages[{i}].content", content))
        messages.append({"role": "system" if message.role == "developer" else message.role, "content": content,
                         **_other_parts(message, f"messages[{i}]", texts)})
    options = _template_options(body, messages, served.settings.default_chat_template_kwargs)
    if template is not None:
        options["chat_template"] = template
    if "documents" in options:
        texts.append(("documents", json.dumps(options["documents"])))
    if tools:
        options["tools"] = list(tools)
        texts.append(("tools", json.dumps(list(tools))))
    served.check_texts(texts + list(texts_beside) +
                       [(f"chat_template_kwargs.{k}", v) for k, v in options.items() if isinstance(v, str)])
    prompt = chat_ids(tokenizer, messages, **options)
    media = None
    if pictures:
        prompt, media = served.images.expand(prompt, pictures, media_options)
    served.check_prompts([prompt])
    return prompt, media


def _media_options(served: Served, body) -> dict:
    """vLLM's `mm_processor_kwargs` of a chat request: options of the image processor for this request's images
    (serving/images.py's `REQUEST_OPTIONS`: how many tokens an image becomes). Refused unless the server takes them
    (`trust_request_mm_kwargs`, vLLM's `--trust-request-mm-kwargs`), and on a server without images; an empty
    object is none."""
    options = getattr(body, "mm_processor_kwargs", None)
    if not options:
        return {}
    if not served.settings.trust_request_mm_kwargs:
        raise ServingError("mm_processor_kwargs is passed with the request, but this server does not take them: "
                           "start it with --trust-request-mm-kwargs (as vLLM), or leave it out",
                           "mm_processor_kwargs")
    if served.images is None:
        raise ServingError("mm_processor_kwargs: this server takes no images (a package that takes them, served with "
                           "--processor, does)", "mm_processor_kwargs")
    served.images.check_options(options)
    return options


def _other_parts(message, where: str, texts: list) -> dict:
    """A message's parts beside its content as transformers' chat templates take them: an assistant's earlier
    reasoning (`reasoning_content`, or vLLM's `reasoning`: both names given to the template) and its
    `tool_calls` (each `{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments' JSON
    text read into an object, an empty one `{}`, as vLLM passes them), a tool message's `tool_call_id` and
    `name`."""
    parts = {}
    if message.tool_calls:
        if message.role != "assistant":
            raise ServingError(f"{where}.tool_calls: only an assistant's message holds calls", f"{where}.tool_calls")
        calls = []
        for j, call in enumerate(message.tool_calls):
            field = f"{where}.tool_calls[{j}]"
            if call.type != "function":
                raise ServingError(f"{field}.type must be 'function', got {call.type!r}", f"{field}.type")
            try:  # none given (an empty text, as some clients send for a function without parameters): {}
                arguments = json.loads(call.function.arguments) if call.function.arguments else {}
            except ValueError as e:
                raise ServingError(f"{field}.function.arguments is not JSON ({e})", f"{field}.function.arguments") \
                    from None
            texts.append((f"{field}.function", call.function.name + call.function.arguments))
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        parts["tool_calls"] = calls
    if message.role == "tool":
        parts.update({k: v for k, v in (("tool_call_id", message.tool_call_id), ("name", message.name)) if v})
    thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thought is not None and message.role == "assistant":  # as Qwen3's template reads it (both names given)
        texts.append((f"{where}.reasoning_content", thought))
        parts.update(reasoning_content=thought, reasoning=thought)
    return parts


def _content_parts(served: Served, parts: list, where: str, texts: list, pictures: list) -> str | list[dict]:
    """A message's content parts as the chat template takes them: text parts joined, or, with images,
    the parts as a list (`{"type": "image"}` for each image, decoded into `pictures`)."""
    kept = []
    for part in parts:
        if part.type == "text" and part.text is not None:
            texts.append((where, part.text))
            kept.append({"type": "text", "text": part.text})
        elif part.type == "image_url" and part.image_url is not None:
            if served.images is None:
                raise ServingError(f"{where}: this server takes no images (a package that takes them, served with "
                                   "--processor, does)", where)
            if len(pictures) >= served.settings.max_items:
                raise ServingError(f"{where}: more than {served.settings.max_items} images in the request", where)
            pictures.append(served.images.decode(part.image_url.url, where))
            kept.append({"type": "image"})
        else:
            raise ServingError(f"{where}: parts of type 'text' (with text) and 'image_url' are taken, got "
                               f"{part.type!r}", where)
    if any(part["type"] == "image" for part in kept):
        return kept
    return "".join(part["text"] for part in kept)


def _texts(message: dict) -> list[str]:
    content = message["content"]
    return [content] if isinstance(content, str) else [part["text"] for part in content if part["type"] == "text"]


def chat_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    """The messages through the chat template, ending with the assistant's turn (`options`, passed to
    `apply_chat_template`, may say otherwise: `_template_options`). Content holding a special token's
    text (a message's, or a document's) is tokenized apart from the template, special tokens split, so
    that it stays text; other content is tokenized with the template, exactly as `apply_chat_template`.
    A message's content is text, or (with images) a list of text and image parts. A template's refusal
    (Gemma's of a system role, say) is a `ServingError` with its message."""
    options = {"add_generation_prompt": True, **options}
    try:
        return _templated_ids(tokenizer, messages, options)
    except jinja2.TemplateError as e:
        raise ServingError(f"the model's chat template refused the messages: {e}", "messages") from None


STAND_IN = re.compile("(\x00content[0-9a-f]{32}[0-9]+\x00)")


def _templated_ids(tokenizer, messages: list[dict], options: dict) -> list[int]:
    specials = special_tokens(tokenizer)
    documents = options.get("documents") or ()
    texts = [t for m in messages for t in _texts(m)] + [v for d in documents for v in d.values() if isinstance(v, str)]
    if not any(s in text for text in texts for s in specials):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    pieces: dict[str, str] = {}  # a mark: the text it stands for

    def mark(text: str) -> str:
        pieces[f"\x00content{uuid.uuid4().hex}{len(pieces)}\x00"] = text
        return next(reversed(pieces))

    marked = [{**m, "content": mark(m["content"]) if isinstance(m["content"], str) else
               [{**part, "text": mark(part["text"])} if part["type"] == "text" else part for part in m["content"]]}
              for m in messages]
    if documents:
        options = {**options, "documents": [{k: mark(v) if isinstance(v, str) else v for k, v in d.items()}
                                            for d in documents]}
    text = tokenizer.apply_chat_template(marked, tokenize=False, **options)
    plain = tokenizer.apply_chat_template(messages, tokenize=False, **{**options, "documents": documents or None})
    if STAND_IN.sub(lambda m: pieces.get(m.group(1), m.group(1)), text) != plain:  # the template rewrote content
        raise ServingError("a message holds a special token's text, which this model's chat template cannot keep "
                           "apart from its own tokens", "messages")
    # the template's own text, then a content's, in turn (text shaped as a mark but not one of these is the
    # template's: a request's own text it renders, a variable's say)
    ids: list[int] = []
    for part in STAND_IN.split(text):
        if part in pieces:
            ids += tokenizer(pieces[part], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif part:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    return ids


def chat_template_of(value: str) -> str:
    """vLLM's `--chat-template`: a file's text, or the template itself given in one line; its syntax checked
    as transformers compiles it, so that a broken template stops the server before the package loads rather
    than failing every chat request."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it as UTF-8 text ({e})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a template (it holds no {{{{ }}}} or "
                         "{% %})")
    error = _syntax_error(text)
    if error:
        raise ValueError(f"--chat-template {value if path.is_file() else 'given'}: {error}")
    return text


def _syntax_error(text: str) -> str | None:
    """A template's syntax error as transformers' compiling would meet it ("line N: ..."), or None."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


def request_template(served: Served, body) -> str | None:
    """vLLM's `chat_template` of a chat or tokenize request, in place of the server's: refused unless the server
    trusts its clients' templates (`trust_request_chat_template`, vLLM's `--trust-request-chat-template`: a
    template runs on the server, in Jinja's sandbox, for as long as it loops); then a template (its syntax checked
    as transformers compiles it) or the name of one of the tokenizer's named templates (say "tool_use"), as
    `apply_chat_template(chat_template=...)` takes it. None: the server's template."""
    template = getattr(body, "chat_template", None)
    if template is None:
        return None
    if not served.settings.trust_request_chat_template:
        raise ServingError("a chat template is passed with the request, but this server does not take request "
                           "templates: start it with --trust-request-chat-template (as vLLM), or leave chat_template "
                           "out", "chat_template")
    named = getattr(served.tokenizer, "chat_template", None)
    if isinstance(named, dict) and template in named:
        return template
    if "{{" not in template and "{%" not in template:
        names = f" ({', '.join(sorted(named))})" if isinstance(named, dict) else ""
        raise ServingError(f"chat_template {template[:40]!r} is neither a template (it holds no {{{{ }}}} or {{% %}}) "
                           f"nor one of the tokenizer's named templates{names}", "chat_template")
    error = _syntax_error(template)
    if error:
        raise ServingError(f"chat_template: {error}", "chat_template")
    return template
