"""SGLang's `POST /v1/score`: the probability of each label token after query + item (or item +
query), for every item; and vLLM's `POST /generative_scoring`: the first label's. Both scored in
batches with the other score requests (jobs.ScoreJob)."""

from __future__ import annotations

import math
import time
import uuid

from fastapi import FastAPI, Request

from .. import scoring
from .errors import AsciiJSON, ServingError
from .jobs import ScoreJob
from .schemas import GenerativeScoringRequest, ScoreRequest
from .served import Served, run
from .settings import REUSE_PREFIX

# SGLang's score fields this server does not carry out, with their neutral values: another value is a 400.
NEUTRAL = {"return_pooled_hidden_states": False, "embed_override_token_id": None, "query_embed_overrides": None,
           "item_embed_overrides": None, "score_extraction_token": None}


def _check_counts(served: Served, items: int, label_lists: list[list[int]]) -> None:
    """The server's limits on a score request's items and label ids (each list's), before anything is tokenized."""
    settings = served.settings
    if items > settings.max_items:
        raise ValueError(f"items has {items} entries; this server takes at most {settings.max_items} per request")
    longest = max(map(len, label_lists), default=0)
    if longest > settings.max_labels:
        raise ValueError(f"label_token_ids has a list of {longest} ids; this server takes at most "
                         f"{settings.max_labels}")


def _check_request(served: Served, body: ScoreRequest) -> None:
    """What SGLang checks of a request before its items: the model, the fields not carried out, the temperature."""
    if body.model not in (None, "", served.name):  # SGLang answers 400 here, OpenAI's routes 404
        raise ValueError(f"model {body.model!r} is not served here; this server serves {served.name!r}")
    for name, neutral in NEUTRAL.items():
        if getattr(body, name) != neutral:
            raise ValueError(f"{name} is not supported by this server; leave it out")
    if not math.isfinite(body.temperature) or body.temperature <= 0:
        raise ValueError(f"temperature must be finite and greater than zero, got {body.temperature}")
    if body.temperature != 1 and not body.apply_softmax:
        raise ValueError("temperature requires apply_softmax=true (it scales the softmax over the labels)")


def make_job(served: Served, body: ScoreRequest, loop) -> ScoreJob:
    """The request checked (sizes before anything is tokenized) and tokenized."""
    settings = served.settings
    _check_request(served, body)
    items = [body.items] if isinstance(body.items, str) else body.items
    per_item = bool(body.label_token_ids) and isinstance(body.label_token_ids[0], list)
    lists = body.label_token_ids if per_item else [body.label_token_ids]
    if per_item and len(lists) != len(items):
        raise ValueError(f"label_token_ids has {len(lists)} lists for {len(items)} items: give one list per item, or "
                         "one list for all")
    _check_counts(served, len(items), lists)
    served.check_values(sum(map(len, lists)) if per_item else len(items) * len(lists[0]),
                        "the scores (items x label_token_ids)", "label_token_ids")
    texts = [("query", body.query)] + [(f"items[{i}]", item) for i, item in enumerate(items)]
    # Each prompt is query + item: every text must fit alone, and the query with the longest item.
    longest = max((len(item) for item in items if isinstance(item, str)), default=0)
    query = [texts[0]] if isinstance(body.query, str) else []
    served.check_texts(query + [(where, text) for where, text in texts[1:]
                                if isinstance(text, str) and len(text) == longest][:1])
    prompts = scoring.prompts_of(served.tokenizer, body.query, body.items, body.item_first)
    labels = [scoring.checked_labels(labels, served.vocab) for labels in lists]
    if any(len(set(row)) != len(row) for row in labels):
        raise ValueError("label_token_ids must not hold a token twice (in one item's list)")
    scoring.check_prompts(prompts, served.vocab, served.context)
    return ScoreJob(prompts, labels if per_item else labels[0], body.apply_softmax, loop, settings.token_budget,
                    REUSE_PREFIX[settings.reuse_prefix], float(body.temperature))


def respond(served: Served, body: ScoreRequest, job: ScoreJob | None, scores) -> dict:
    tokens = job.tokens if job is not None else 0
    answer = {"scores": scores, "model": served.name, "object": "scoring",
              "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}}
    if body.return_token_logprobs:
        answer["token_logprobs"] = job.label_logprobs if job is not None else []
    return answer


def make_generative_job(served: Served, body: GenerativeScoringRequest, loop) -> ScoreJob:
    """vLLM's request checked (sizes before anything is tokenized) and tokenized as vLLM does: the query
    and each item apart, joined as token ids; a prompt past the context cut to its first context - 1
    tokens (vLLM keeps room for the token it would generate)."""
    settings = served.settings
    served.check_model(body.model)
    if not body.items:
        raise ValueError("items must contain at least one item")
    _check_counts(served, len(body.items), [body.label_token_ids])
    # A label given twice counts once in vLLM's softmax over the labels (it keeps them in a dict by id).
    labels = list(dict.fromkeys(scoring.checked_labels(body.label_token_ids, served.vocab)))
    # Each text alone: one that cannot fit the context however it tokenizes is refused before tokenizing
    # (a prompt of two that fit is cut to the context, as vLLM cuts it).
    for where, text in [("query", body.query)] + [(f"items[{i}]", item) for i, item in enumerate(body.items)]:
        if isinstance(text, str):
            served.check_texts([(where, text)])
    tokenizer = served.tokenizer
    if tokenizer is None and (isinstance(body.query, str) or isinstance(body.items[0], str)):
        raise ValueError("text query and items need a tokenizer; this server has none: send token ids")
    query = (tokenizer(body.query, add_special_tokens=body.add_special_tokens)["input_ids"]
             if isinstance(body.query, str) else body.query)
    items = list(body.items)
    if items and isinstance(items[0], str):  # all text, or all token ids (the schema)
        items = tokenizer(items, add_special_tokens=False)["input_ids"]
    prompts = [list(item) + list(query) if body.item_first else list(query) + list(item) for item in items]
    prompts = [prompt[: served.context - 1] for prompt in prompts]
    empty = next((i for i, prompt in enumerate(prompts) if not prompt), None)
    if empty is not None:
        raise ValueError(f"item {empty}: the prompt has no tokens")
    scoring.check_prompts(prompts, served.vocab, served.context)
    return ScoreJob(prompts, labels, body.apply_softmax, loop, settings.token_budget,
                    REUSE_PREFIX[settings.reuse_prefix])


def respond_generative(served: Served, job: ScoreJob, scores, request_id: str) -> dict:
    """vLLM's answer: each item's first label probability; usage counts the one token vLLM generates an item."""
    items = len(scores)
    return {"id": f"generative-scoring-{request_id}", "object": "list", "created": int(time.time()),
            "model": served.name, "data": [{"index": i, "object": "score", "score": row[0]}
                                           for i, row in enumerate(scores)],
            "usage": {"prompt_tokens": job.tokens, "total_tokens": job.tokens + items, "completion_tokens": items}}


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request):
        if body.items == []:  # SGLang answers no items with no scores, once the request itself is checked
            try:
                _check_request(served, body)
            except ValueError as e:
                raise ServingError(str(e)) from None
            return AsciiJSON(respond(served, body, None, []))
        return await run(served, make_job, body, request, respond)

    @app.post("/generative_scoring")
    async def generative_scoring(body: GenerativeScoringRequest, request: Request):
        request_id = request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
        return await run(served, make_generative_job, body, request,
                         lambda served, body, job, scores: respond_generative(served, job, scores, request_id))
