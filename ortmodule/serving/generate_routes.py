"""SGLang's native `POST /generate` (as of SGLang 0.5.23): a prompt's text or token ids (one, or a
batch), `sampling_params`, and the log-probabilities of the output and, from `logprob_start_len`, of
the prompt, answered in SGLang's shape (`text`, `output_ids`, `meta_info`) or streamed as SGLang
streams it (each event the output so far). lm-eval's `sglang-generate` backend speaks it.

The request becomes a completion (openai_routes.completion_job): the same engine, batching, sampling
and checks, the same answers as `/v1/completions` with the same settings."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import FastAPI, Request

from .errors import ServingError, dumps, failed
from .jobs import Generation, Row
from .openai_routes import MAX_LOGPROBS, completion_job, prompt_part
from .schemas import CompletionRequest, GenerateRequest, SGLangSamplingParams
from .served import Served, abandon, run_or_stream
from .text import token_strings

# SGLang's fields this server does not carry out: any value but a neutral one (absent, null, false, empty) is a 400.
NEUTRAL = ("input_embeds", "image_data", "video_data", "audio_data", "token_ids_logprob", "return_hidden_states",
           "lora_path", "custom_logit_processor", "session_params", "modalities", "mm_hashes", "mm_content_hashes",
           "use_audio_in_video", "video_config", "watermark", "return_sampling_mask", "sampling_logprobs_mode",
           "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
           "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "lora_id",
           "positional_embed_overrides", "background", "require_reasoning", "max_thinking_tokens", "return_bytes",
           "return_entropy", "return_prompt_token_ids", "need_wait_for_mm_inputs", "num_items_assigned",
           "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
           "video_max_dynamic_patch", "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices",
           "token_indices_to_pool", "cache_salt", "extra_key")
SAMPLING_NEUTRAL = {"custom_params": None,
                    "spaces_between_special_tokens": True, "stop_regex": None, "beam_width": None, "watermark": None,
                    "ebnf_full_assistant": False}


def _per_prompt(value, count: int, name: str, default):
    """A field given once for every prompt or as a list of one value per prompt (SGLang's batch form):
    the one value, or a 400 where the prompts' values differ (send those as separate requests)."""
    if not isinstance(value, list):
        return default if value is None else value
    if len(value) != count:
        raise ServingError(f"{name} has {len(value)} entries for {count} prompts: give one for all, or one each", name)
    if any(v != value[0] for v in value):
        raise ServingError(f"{name} differs between the prompts of one request; send those prompts as separate "
                           "requests", name)
    return value[0]


def _prompts(served: Served, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The prompts' token ids (text tokenized with the tokenizer's special tokens, as SGLang tokenizes
    it, after the size check every text gets), and whether the request is a batch."""
    served.need_tokenizer("/generate")
    if (body.text is None) == (body.input_ids is None):
        raise ServingError("send the prompt as text or as input_ids, one of them", "text")
    if body.input_ids is not None:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        return (body.input_ids if batch else [body.input_ids]), batch
    texts = body.text if isinstance(body.text, list) else [body.text]
    served.check_texts([(f"text[{i}]", text) for i, text in enumerate(texts)])
    if not texts:
        raise ServingError("text is empty", "text")
    return [list(ids) for ids in served.tokenizer(texts)["input_ids"]], isinstance(body.text, list)


def generate_job(served: Served, body: GenerateRequest, loop):
    """The request checked and made a completion job; `job.answering` keeps how it is answered."""
    for name in NEUTRAL:
        if getattr(body, name) not in (None, False, [], {}):
            raise ServingError(f"{name} is not supported by this server; leave it out", name)
    prompts, batch = _prompts(served, body)
    count = len(prompts)
    if isinstance(body.rid, list) and len(body.rid) != count:
        raise ServingError(f"rid has {len(body.rid)} entries for {count} prompts", "rid")
    params: SGLangSamplingParams = _per_prompt(body.sampling_params, count, "sampling_params", SGLangSamplingParams())
    for name, neutral in SAMPLING_NEUTRAL.items():
        if getattr(params, name) not in (neutral, None, [], {}):  # the frontend language sends `stop_regex: []`
            raise ServingError(f"sampling_params.{name} is not supported by this server (its output is not "
                               "constrained that way: regex and json_schema are); leave it out",
                               f"sampling_params.{name}")
    if params.top_k == 0:
        raise ServingError("top_k must be -1 (disable), or at least 1", "sampling_params.top_k")
    logprobs = bool(_per_prompt(body.return_logprob, count, "return_logprob", False))
    start_at = _per_prompt(body.logprob_start_len, count, "logprob_start_len", -1) if logprobs else -1
    top = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num", 0)
    if body.stream and start_at >= 0:
        raise ServingError("the prompt's log-probabilities (logprob_start_len) in a stream are not supported: ask "
                           "without stream, or for the output's alone", "logprob_start_len")
    if body.stream and params.max_new_tokens == 0:
        raise ServingError("a stream needs max_new_tokens of at least 1", "sampling_params.max_new_tokens")
    if logprobs and start_at > min(map(len, prompts)):
        raise ServingError(f"logprob_start_len={start_at} is higher than the number of input tokens "
                           f"{min(map(len, prompts))}; use a smaller logprob_start_len", "logprob_start_len")
    if top > MAX_LOGPROBS:
        raise ServingError(f"top_logprobs_num must be between 0 and {MAX_LOGPROBS}, got {top}", "top_logprobs_num")
    # Built from SGLang's checked fields (whose ranges are SGLang's: a temperature above OpenAI's 2, say)
    completion = CompletionRequest.model_construct(**dict(
        model=served.name, prompt=prompts, max_tokens=params.max_new_tokens, temperature=float(params.temperature),
        top_p=float(params.top_p), seed=params.sampling_seed, stop=params.stop, n=params.n, stream=body.stream,
        presence_penalty=float(params.presence_penalty), frequency_penalty=float(params.frequency_penalty),
        logit_bias=params.logit_bias, top_k=params.top_k, min_p=float(params.min_p),
        repetition_penalty=float(params.repetition_penalty), min_tokens=params.min_new_tokens,
        ignore_eos=params.ignore_eos, stop_token_ids=params.stop_token_ids,
        include_stop_str_in_output=params.no_stop_trim, skip_special_tokens=params.skip_special_tokens,
        # the prompt's log-probabilities come with an echo (its text is not shown: `respond` writes the answer)
        echo=start_at >= 0 or params.max_new_tokens == 0, logprobs=top if logprobs else None,
        # structured output (constraints.py reads SGLang's names among a completion's extra fields)
        **{name: value for name in ("regex", "json_schema", "ebnf", "structural_tag")
           if (value := getattr(params, name)) is not None}))
    completion = _clipped(served, completion)
    try:
        job = completion_job(served, completion, loop)
    except ServingError as e:  # named as SGLang's fields are
        raise _in_sglangs_terms(e, "text" if body.text is not None else "input_ids") from None
    _own_limits(served, job, params.max_new_tokens)
    job.answering = dict(batch=batch or params.n > 1, logprobs=logprobs, start=start_at, top=top, n=params.n,
                      texts=body.return_text_in_logprobs, rid=body.rid, begun=time.perf_counter())
    return job


# The completion's fields, as SGLang names them (in an error's field and message).
SGLANG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
                "include_stop_str_in_output": "no_stop_trim"}
SAMPLING = ("max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "logit_bias", "n", "temperature", "top_p",
            "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "include_stop_str_in_output", "skip_special_tokens", "ignore_eos", "regex", "json_schema", "ebnf",
            "structural_tag")


def _in_sglangs_terms(error: ServingError, prompt_field: str) -> ServingError:
    """A completion's refusal named by SGLang's fields: `sampling_params.min_new_tokens` for
    `min_tokens`, `top_logprobs_num` for `logprobs`, the prompt's field for `prompt`."""
    message, param = str(error), error.param
    for ours, theirs in SGLANG_NAMES.items():
        message = message.replace(ours, theirs)
    if param in SAMPLING:
        param = f"sampling_params.{SGLANG_NAMES.get(param, param)}"
    elif param == "logprobs":
        param, message = "top_logprobs_num", message.replace("logprobs", "top_logprobs_num")
    elif param == "prompt":
        param = prompt_field
    return ServingError(message, param, error.status, error.code)


def _room(served: Served, prompt: list[int]) -> int:
    """The new tokens SGLang lets a prompt have: what the context leaves after it, less one."""
    return max(0, served.context - len(prompt) - 1)


def _clipped(served: Served, completion: CompletionRequest) -> CompletionRequest:
    """SGLang's `max_new_tokens` cut to the longest prompt's room, where it would not fit (the job's
    limit, which the completion's checks take; each shorter prompt's own is set by `_own_limits`). A
    batch in which one prompt fills the context and another has room is refused: SGLang would give the
    one no token and the others theirs, which one job cannot."""
    rooms = [_room(served, prompt) for prompt in completion.prompt]
    room = min(rooms, default=0)
    if completion.max_tokens > room:
        if room == 0 and completion.max_tokens > 0 and max(rooms) > 0:
            full = rooms.index(0)
            raise ServingError(f"prompt {full} has {len(completion.prompt[full])} tokens and leaves no room for new "
                               f"tokens in the model's context of {served.context}; send it as a request of its own",
                               "sampling_params.max_new_tokens")
        return completion.model_copy(update={"max_tokens": room, "echo": completion.echo or room == 0})
    return completion


def _own_limits(served: Served, job, wanted: int) -> None:
    """Each prompt's `max_new_tokens` cut to its own room, as SGLang cuts each request's: the job's
    limit is the longest prompt's (`_clipped`), which a shorter prompt's rows go past."""
    if not isinstance(job, Generation) or job.sampling.max_tokens >= wanted:
        return
    for row in job.rows:
        limit = min(wanted, _room(served, row.prompt))
        if limit > row.sampling.max_tokens:
            row.sampling = dataclasses.replace(row.sampling, max_tokens=limit)
    if job.sampling.logprobs is not None:  # the completion's check counted the job's limit: again, with the rows'
        per_token = 1 + job.sampling.logprobs
        echoed = sum(len(row.prompt) for row in job.rows) if job.prompt_top is not None else 0
        served.check_values((sum(row.sampling.max_tokens for row in job.rows) + echoed) * per_token,
                            "the log-probabilities asked for", "top_logprobs_num")


def respond(served: Served, body: GenerateRequest, job, result):
    """SGLang's answer: one object for one prompt, a list for a batch (or `n` > 1)."""
    answers = [_answer(served, job, result, i) for i in range(len(job.prompts))]
    return answers if job.answering["batch"] else answers[0]


def _answer(served: Served, job, result, i: int) -> dict:
    how = job.answering
    scores, row = prompt_part(served, job, result, i)
    tokens = list(row.tokens) if row else []
    prompt = job.prompts[i]
    meta = {"id": _rid(how["rid"], i // how["n"], i % how["n"], how["n"]), "finish_reason": _finish(row),
            "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
            "cached_tokens": row.cached_prefix if row else 0, "e2e_latency": time.perf_counter() - how["begun"]}
    if how["logprobs"]:
        meta.update(_logprobs(served, how, prompt, scores, _scored(row)))
    return {"text": row.text.text if row else "", "output_ids": tokens, "meta_info": meta}


def _scored(row: Row | None) -> list[tuple[int, float, list]]:
    """A row's (token, log-probability, top alternatives), as the stream's events carry them."""
    if row is None or not row.logprobs:  # none asked for
        return []
    return list(zip(row.tokens, row.logprobs, row.top, strict=True))


def _rid(rid, prompt: int, copy: int, n: int) -> str:
    """SGLang's request id of prompt `prompt`'s choice `copy`: the request's `rid` (one per prompt, or one
    string that prefixes each of a batch's), else a new one."""
    if isinstance(rid, list):
        base = rid[prompt]
    elif rid is not None:
        base = rid if prompt == 0 and n == 1 else f"{rid}_{prompt}"
    else:
        base = uuid.uuid4().hex
    return base if n == 1 else f"{base}_{copy}"


def _finish(row: Row | None) -> dict:
    """SGLang's `finish_reason`: `{"type": "stop", "matched": token id or stop string}` or
    `{"type": "length", "length": tokens}`."""
    if row is None or row.text.finish_reason != "stop":
        return {"type": "length", "length": len(row.tokens) if row else 0}
    return {"type": "stop", "matched": row.text.matched}


def _logprobs(served: Served, how: dict, prompt: list[int], scores, outputs: list[tuple[int, float, list]]) -> dict:
    """SGLang's log-probability fields: `(logprob, token id, text or None)` per token; the prompt's from
    `logprob_start_len` (its first entry's log-probability null, as SGLang's), each output token's; with
    `top_logprobs_num`, the most likely at each position (null at the prompt's first)."""
    start, top = how["start"], how["top"]
    positions = range(start, len(prompt)) if start >= 0 else range(0)  # the prompt's, from the start asked
    values = [None] + (scores.token_logprobs if scores else [])
    ranked = [[]] + (scores.top if scores else [])
    tops = {k: ranked[k][:top] for k in positions if k > start} if top > 0 else {}
    name = {}
    if how["texts"] and served.tokenizer is not None:  # every token's text from one decode
        seen = sorted({prompt[k] for k in positions} | {t for t, _, _ in outputs}
                      | {t for pairs in tops.values() for t, _ in pairs}
                      | ({t for _, _, pairs in outputs for t, _ in pairs[:top]} if top > 0 else set()))
        name = dict(zip(seen, token_strings(served.tokenizer, seen)))
    entry = lambda token, value: [value, token, name.get(token)]  # noqa: E731
    out: dict = {"input_token_logprobs": [entry(prompt[k], None if k == start else values[k]) for k in positions],
                 "output_token_logprobs": [entry(t, v) for t, v, _ in outputs],
                 "output_token_logprobs_length": len(outputs)}
    if top > 0:
        out["input_top_logprobs"] = [[entry(t, v) for t, v in tops[k]] if k in tops else None for k in positions]
        out["output_top_logprobs"] = [[entry(t, v) for t, v in pairs[:top]] for _, _, pairs in outputs]
    return out


async def _events(served: Served, job: Generation):
    """SGLang's stream: after each piece of text, the output so far (`text`, `output_ids`, `meta_info`;
    `index` in a batch); the last event of each prompt with its finish reason; then `[DONE]`."""
    how, texts, ids, scored = job.answering, {}, {}, {}
    try:
        while (event := await job.next_event()) is not None:
            index, text, tokens, chunk = event
            texts[index] = texts.get(index, "") + text
            ids.setdefault(index, []).extend(tokens)
            scored.setdefault(index, []).extend(chunk or ())
            yield _event(served, how, job, index, texts[index], ids[index], None, scored[index])
        try:
            rows = await job.future
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            error = e if isinstance(e, ServingError) else failed("the generation", e)
            yield f"data: {dumps({'error': {'message': str(error), 'code': error.status}})}\n\n"
            return
        for row in rows:
            yield _event(served, how, job, row.index, row.text.text, list(row.tokens), row, _scored(row))
        yield "data: [DONE]\n\n"
    finally:
        if not job.future.done():  # the client went away mid-stream: free its rows
            abandon(served, job)


def _event(served: Served, how: dict, job: Generation, index: int, text: str, tokens: list[int], row: Row | None,
           scored: list[tuple[int, float, list]]) -> str:
    """One event of the stream: prompt `index`'s output so far (`row`: its last, finished)."""
    meta = {"id": _rid(how["rid"], index // how["n"], index % how["n"], how["n"]),
            "finish_reason": _finish(row) if row is not None else None, "prompt_tokens": len(job.prompts[index]),
            "completion_tokens": len(tokens), "cached_tokens": job.rows[index].cached_prefix}
    if row is not None:
        meta["e2e_latency"] = time.perf_counter() - how["begun"]
    if how["logprobs"]:  # the output's so far (a stream takes no prompt's: `generate_job`)
        meta.update(_logprobs(served, how, job.prompts[index], None, scored))
    answer = {"text": text, "output_ids": tokens, "meta_info": meta}
    if how["batch"]:
        answer["index"] = index
    return f"data: {dumps(answer)}\n\n"


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        return await run_or_stream(served, generate_job, body, request, respond, lambda job: _events(served, job))
