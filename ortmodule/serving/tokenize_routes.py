"""vLLM's tokenizer routes, which clients use to count and cut tokens without the model's files
(lm-eval's `tokenizer_backend=remote` among them): `POST /tokenize` (a prompt, or chat messages
rendered exactly as `/v1/chat/completions` renders them), `POST /detokenize`, and `GET
/tokenizer_info` (the tokenizer's settings and chat template: off unless `tokenizer_info` is set,
`--enable-tokenizer-info-endpoint` as in vLLM). They run on the tokenizing threads, counted by
`--max-queue` as every request is, and never reach the model."""

from __future__ import annotations

from fastapi import FastAPI

from ..inputs import outside_vocabulary, vocabulary_message
from .chat_prompts import chat_prompt, refuse_unsupported
from .errors import ServingError
from .schemas import DetokenizeRequest, TokenizeRequest
from .served import Served, answer_off_loop
from .tools import checked_tools

# init_kwargs a tokenizer keeps that name files or folders of the host, never shown to clients.
HOST_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only")


def tokenize(served: Served, body: TokenizeRequest, loop=None) -> dict:
    served.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ServingError("send either prompt (a text) or messages (a chat)", "prompt")
    served.need_tokenizer("/tokenize")
    tokenizer = served.tokenizer
    if body.messages is None:
        served.check_texts([("prompt", body.prompt)])
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer(body.prompt, add_special_tokens=add_special)["input_ids"])
    else:
        refuse_unsupported(body)
        if body.add_special_tokens:
            raise ServingError("add_special_tokens with messages is not supported: the chat template places the "
                               "special tokens", "add_special_tokens")
        ids, _ = chat_prompt(served, body, tools=checked_tools(body.tools))  # tools rendered as chat renders them
    strings = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": served.context, "tokens": ids, "token_strs": strings}


def detokenize(served: Served, body: DetokenizeRequest, loop=None) -> dict:
    served.check_model(body.model)
    served.need_tokenizer("/detokenize")
    if len(body.tokens) > served.context:
        raise ServingError(f"tokens has {len(body.tokens)} ids, more than the model's context of {served.context}",
                           "tokens")
    bad = outside_vocabulary(body.tokens, served.vocab)
    if bad is not None:
        raise ServingError(vocabulary_message(bad, served.vocab), "tokens")
    return {"prompt": served.tokenizer.decode(body.tokens)}


def tokenizer_info(tokenizer) -> dict:
    """vLLM's answer: the tokenizer's own settings (its tokenizer_config.json, as the tokenizer keeps
    them; special tokens as their text, none of the host's paths), its class and its chat template."""
    plain = ((key, _plain(value)) for key, value in getattr(tokenizer, "init_kwargs", {}).items()
             if key not in HOST_FIELDS)
    info = {key: value for key, value in plain if value is not _DROPPED}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


_DROPPED = object()


def _plain(value):
    """`value` as JSON holds it: an added token as its text, mappings and lists element by element;
    _DROPPED where it has no JSON form (a tokenizer object, say)."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROPPED}
    if isinstance(value, (list, tuple)):
        return [v for v in map(_plain, value) if v is not _DROPPED]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return _DROPPED


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return await answer_off_loop(served, tokenize, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return await answer_off_loop(served, detokenize, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        if not served.settings.tokenizer_info:
            raise ServingError("/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint "
                               "(it shows the tokenizer's settings and chat template)", status=404)
        served.need_tokenizer("/tokenizer_info")
        return tokenizer_info(served.tokenizer)
