"""OpenAI's `POST /v1/embeddings`, in vLLM's form: an embedding of each input, the final norm's output
at its last token (the LM head's input there), L2-normalized unless `normalize` is false, as vLLM pools
a decoder model it serves for embeddings (and as sentence-transformers' last-token pooling of Qwen3's
embedding models does); or their mean, or the first token's (vLLM's `--pooler-config`, settings.pooling).
Inputs are texts or token ids, or vLLM's chat form (`messages`, rendered as the chat route renders them,
without the assistant's turn unless `add_generation_prompt`). Run in batches with the other embedding
requests (jobs.EmbedJob) by the decoder without its LM head: no logits. Answers as `float` lists or
`base64` (vLLM's `embed_dtype` float32, float16 or bfloat16, in its `endianness`), the way OpenAI's client
decodes them."""

from __future__ import annotations

import base64
import sys
import time
from array import array

import torch
from fastapi import FastAPI, Request

from ..inputs import outside_vocabulary, vocabulary_message
from .chat_prompts import chat_prompt, refuse_unsupported
from .errors import ServingError
from .jobs import EmbedJob
from .openai_routes import request_ident, truncated
from .schemas import EmbeddingRequest
from .served import Served, run
from .settings import pooling

# vLLM's `embed_dtype`s that this server writes (not its fp8 ones), as torch's dtypes (None: float32, as computed).
EMBED_DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
ENDIANNESS = ("native", "little", "big")
ENCODINGS = ("float", "base64")


def _check_options(served: Served, body: EmbeddingRequest, width: int) -> None:
    """The fields other than the input: the output's form and size."""
    if body.encoding_format not in ENCODINGS:
        raise ServingError(f"encoding_format must be one of {', '.join(ENCODINGS)}; got {body.encoding_format!r}",
                           "encoding_format")
    if body.embed_dtype not in EMBED_DTYPES:
        raise ServingError(f"embed_dtype must be one of {', '.join(EMBED_DTYPES)}; got {body.embed_dtype!r}",
                           "embed_dtype")
    if body.endianness not in ENDIANNESS:
        raise ServingError(f"endianness must be one of {', '.join(ENDIANNESS)}; got {body.endianness!r}",
                           "endianness")
    if body.dimensions is not None and body.dimensions != width:
        raise ServingError(f"dimensions {body.dimensions}: this model's embeddings have {width} and it was not "
                           "trained to be cut shorter (no Matryoshka representation, as vLLM refuses it); leave "
                           "dimensions out", "dimensions")


def _input_prompts(served: Served, body: EmbeddingRequest) -> list[list[int]]:
    """`input`'s token ids: texts tokenized (with the tokenizer's special tokens unless `add_special_tokens`
    is false), token ids as they are."""
    given = body.input
    nested = isinstance(given, list) and bool(given) and not isinstance(given[0], int)
    entries = given if nested else [given]
    if given == []:
        raise ServingError("input is empty: give a text, texts, token ids or lists of them", "input")
    if len(entries) > served.settings.max_items:
        raise ServingError(f"input has {len(entries)} entries; this server takes at most "
                           f"{served.settings.max_items} a request", "input")
    served.check_values(len(entries) * served.engine.model.package.hidden_size,
                        "the embeddings (inputs x the model's hidden size)", "input")
    texts = [(f"input[{i}]" if nested else "input", text) for i, text in enumerate(entries) if isinstance(text, str)]
    if not texts:
        return [list(ids) for ids in entries]
    served.need_tokenizer("/v1/embeddings", "input")
    served.check_texts(texts)
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return [list(ids) for ids in served.tokenizer([t for _, t in texts], add_special_tokens=special)["input_ids"]]


def _chat_prompt(served: Served, body: EmbeddingRequest) -> list[list[int]]:
    refuse_unsupported(body)
    if body.add_special_tokens:
        raise ServingError("add_special_tokens with messages is not supported: the chat template places the "
                           "special tokens", "add_special_tokens")
    ids, media = chat_prompt(served, body)
    if media is not None:
        raise ServingError("images in an embedding request are not supported: send text", "messages")
    return [ids]


def make_job(served: Served, body: EmbeddingRequest, loop) -> EmbedJob:
    """The request checked (sizes before anything is tokenized) and tokenized."""
    served.check_model(body.model)
    if (body.input is None) == (body.messages is None):
        raise ServingError("send either input (texts or token ids) or messages (a chat)", "input")
    width = served.engine.model.package.hidden_size
    _check_options(served, body, width)
    prompts = _input_prompts(served, body) if body.messages is None else _chat_prompt(served, body)
    field = "input" if body.messages is None else "messages"
    for i, ids in enumerate(prompts):
        where = f"{field}[{i}]" if len(prompts) > 1 else field
        if not ids:
            raise ServingError(f"{where} has no tokens", field)
        bad = outside_vocabulary(ids, served.vocab)
        if bad is not None:
            raise ServingError(f"{where}: {vocabulary_message(bad, served.vocab)}", field)
    prompts = truncated(served, body, prompts)
    for i, ids in enumerate(prompts):
        if len(ids) > served.context:
            where = f"{field}[{i}]" if len(prompts) > 1 else field
            raise ServingError(f"{where} has {len(ids)} tokens, more than the model's context of {served.context}: "
                               "shorten it, or send truncate_prompt_tokens to embed its last tokens", field)
    kind, normalized = pooling(served.settings.pooler_config)
    return EmbedJob(prompts, normalized if body.normalize is None else body.normalize, loop,
                    served.settings.token_budget, kind)


def encoded(row: torch.Tensor, body: EmbeddingRequest) -> list[float] | str:
    """One embedding as the request asks for it: float32 numbers, or their bits (in `embed_dtype`) in base64."""
    if body.encoding_format == "float":
        return row.tolist()
    dtype = EMBED_DTYPES[body.embed_dtype]
    values = array("f", row.tolist()) if dtype is None else array("h", row.to(dtype).view(torch.int16).tolist())
    if body.endianness != "native" and body.endianness != sys.byteorder:
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def respond(served: Served, body: EmbeddingRequest, job: EmbedJob, result: torch.Tensor, ident: str) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": encoded(row, body)} for i, row in enumerate(result)]
    return {"id": ident, "object": "list", "created": int(time.time()), "model": served.name, "data": data,
            "usage": {"prompt_tokens": job.tokens, "total_tokens": job.tokens, "completion_tokens": 0}}


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        ident = request_ident("embd", request, body)
        return await run(served, make_job, body, request,
                         lambda served, body, job, result: respond(served, body, job, result, ident))
