"""SGLang's `POST /v1/score`: the probability of each label token after query + item (or item +
query), for every item; scored in batches with the other score requests (jobs.ScoreJob)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from .. import scoring
from .jobs import ScoreJob
from .schemas import ScoreRequest
from .served import Served, run
from .settings import REUSE_PREFIX


def make_job(served: Served, body: ScoreRequest, loop) -> ScoreJob:
    """The request checked (sizes before anything is tokenized) and tokenized."""
    settings = served.settings
    if body.model not in (None, "", served.name):  # SGLang answers 400 here, OpenAI's routes 404
        raise ValueError(f"model {body.model!r} is not served here; this server serves {served.name!r}")
    items = [body.items] if isinstance(body.items, str) else body.items
    if len(items) > settings.max_items:
        raise ValueError(f"items has {len(items)} entries; this server takes at most {settings.max_items} per request")
    if len(body.label_token_ids) > settings.max_labels:
        raise ValueError(f"label_token_ids has {len(body.label_token_ids)} entries; this server takes at most "
                         f"{settings.max_labels}")
    served.check_values(len(items) * len(body.label_token_ids), "the scores (items x label_token_ids)",
                        "label_token_ids")
    texts = [("query", body.query)] + [(f"items[{i}]", item) for i, item in enumerate(items)]
    # Each prompt is query + item: every text must fit alone, and the query with the longest item.
    longest = max((len(item) for item in items if isinstance(item, str)), default=0)
    query = [texts[0]] if isinstance(body.query, str) else []
    served.check_texts(query + [(where, text) for where, text in texts[1:]
                                if isinstance(text, str) and len(text) == longest][:1])
    prompts = scoring.prompts_of(served.tokenizer, body.query, body.items, body.item_first)
    labels = scoring.checked_labels(body.label_token_ids, served.vocab)
    scoring.check_prompts(prompts, served.vocab, served.context)
    return ScoreJob(prompts, labels, body.apply_softmax, loop, settings.token_budget,
                    REUSE_PREFIX[settings.reuse_prefix])


def respond(served: Served, body: ScoreRequest, job: ScoreJob, scores) -> dict:
    return {"scores": scores, "model": served.name, "object": "scoring",
            "usage": {"prompt_tokens": job.tokens, "completion_tokens": 0, "total_tokens": job.tokens}}


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request):
        return await run(served, make_job, body, request, respond)
