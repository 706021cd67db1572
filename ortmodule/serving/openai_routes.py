"""OpenAI's routes: `POST /v1/completions`, `POST /v1/chat/completions` (server-sent events when
`stream` is true), `GET /v1/models` and `GET /v1/models/{model}`.

A completion is a `Generation` job: each prompt a row of the engine's decode batch. lm-eval's
loglikelihood request (token ids, echo, logprobs, at most one greedy token) is a `PromptJob`:
prompts' log-probabilities from one batched prefill, the greedy token read from it. A chat
request's prompt is chat_prompts.py's; structured output, constraints.py's. Fields that would change the
answer and that this server does not carry out (`best_of`, `suffix`, tools, vLLM's and SGLang's
`UNSUPPORTED_EXTRAS`) are refused unless neutral; unknown fields are ignored, as OpenAI-compatible
servers do.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
import uuid

import torch
from fastapi import FastAPI, Request

from ..inputs import outside_vocabulary, vocabulary_message
from .answers import ChatStream, chat_answer
from .chat_prompts import chat_prompt, refuse_unsupported
from .constraints import constraint_of
from .errors import ServingError, dumps, failed
from .jobs import Generation, PromptJob, PromptScores, Row, Sampling
from .reasoning import Reasoning, ThinkingBudget, reasoning_of, thinking_budget, thinking_is_special
from .schemas import ChatRequest, CompletionRequest
from .served import Served, abandon, run_or_stream
from .text import logprob_names, token_strings
from .tools import markers_are_special, tool_plan

MAX_LOGPROBS = 20
MAX_STOPS = 8
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


# ---- checks -------------------------------------------------------------------------------------

# vLLM's and SGLang's extra fields that would change the output and that this server does not carry
# out, with their neutral values (what leaving them out means): a client sending another value
# would get an answer as if it had been applied.
UNSUPPORTED_EXTRAS = {"use_beam_search": (None, False), "logits_processors": (None,), "prompt_embeds": (None,),
                      # chat's: options of loading media (this server fetches none: images come as data URLs)
                      "media_io_kwargs": (None,),
                      # SGLang's stop regexes, LoRA adapter, hidden states and logit processor
                      "stop_regex": (None, []),
                      "lora_path": (None,), "return_hidden_states": (None, False), "custom_logit_processor": (None,)}


def check_common(served: Served, body) -> tuple[str, ...]:
    """The model name, the fields refused unless neutral, and the stop strings."""
    served.check_model(body.model)
    extra = body.model_extra or {}
    for name, neutral in UNSUPPORTED_EXTRAS.items():
        value = extra.get(name)
        if not any(value == n and type(value) is type(n) for n in neutral):
            raise ServingError(f"{name} is not supported by this server; leave it out", name)
    if body.n < 1:
        raise ServingError(f"n must be at least 1, got {body.n}", "n")
    if getattr(body, "best_of", None) not in (None, 1):
        raise ServingError("best_of must be 1", "best_of")
    if getattr(body, "suffix", None):
        raise ServingError("suffix is not supported", "suffix")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    limit = served.settings.max_stop_chars
    if len(stop) > MAX_STOPS or any(not s for s in stop):
        raise ServingError(f"stop takes up to {MAX_STOPS} non-empty strings", "stop")
    if any(len(s) > limit for s in stop):
        raise ServingError(f"a stop string has {max(len(s) for s in stop)} characters; this server takes at most "
                           f"{limit}", "stop")
    return stop


def logit_bias_of(served: Served, body) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: token ids (as strings) of the vocabulary to biases from -100 to 100
    (at most `--max-labels` of them), each added to its token's logit before the choice."""
    given = body.logit_bias or {}
    if len(given) > served.settings.max_labels:
        raise ServingError(f"logit_bias has {len(given)} entries; this server takes at most "
                           f"{served.settings.max_labels}", "logit_bias")
    biases = []
    for key, value in given.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= served.vocab:
            raise ServingError(f"logit_bias key {key!r} is not a token id of the vocabulary [0, {served.vocab})",
                               "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ServingError(f"logit_bias value {value!r} for token {key} is not a number from -100 to 100",
                               "logit_bias")
        biases.append((int(key), float(value)))
    return tuple(biases)


def listed_ids(served: Served, given, field: str) -> tuple[int, ...]:
    """A request's list of token ids (`field`: vLLM's `stop_token_ids`, `allowed_token_ids`, `logprob_token_ids`),
    each once: at most `--max-labels` of them, each of the vocabulary."""
    ids = tuple(dict.fromkeys(given or ()))
    if len(ids) > served.settings.max_labels:
        raise ServingError(f"{field} has {len(ids)} ids; this server takes at most {served.settings.max_labels}",
                           field)
    bad = outside_vocabulary(list(ids), served.vocab)
    if bad is not None:
        raise ServingError(f"{field}: {vocabulary_message(bad, served.vocab)}", field)
    return ids


def allowed_of(served: Served, body) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids`: one or more token ids of the vocabulary (`listed_ids`)."""
    if body.allowed_token_ids is None:
        return ()
    if not body.allowed_token_ids:
        raise ServingError("allowed_token_ids is empty: give at least one token id, or leave it out",
                           "allowed_token_ids")
    return listed_ids(served, body.allowed_token_ids, "allowed_token_ids")


def bad_words_of(served: Served, body) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words`, each as vLLM tokenizes it: the word (its leading space taken off) alone, and after a space
    where that gives another first token and as many tokens (a word at the text's start and within it)."""
    found = []
    for word in body.bad_words or ():
        bare = tuple(served.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(served.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ServingError(f"bad_words: {word!r} has no tokens", "bad_words")
        found += [bare] + ([spaced] if spaced and spaced[0] != bare[0] and len(spaced) == len(bare) else [])
    if sum(map(len, found)) > served.settings.max_labels:
        raise ServingError(f"bad_words come to {sum(map(len, found))} token ids; this server takes at most "
                           f"{served.settings.max_labels}", "bad_words")
    bad = outside_vocabulary([t for word in found for t in word], served.vocab)
    if bad is not None:
        raise ServingError(f"bad_words: {vocabulary_message(bad, served.vocab)}", "bad_words")
    return tuple(found)


def logprob_ids_of(served: Served, body, logprobs: int | None) -> tuple[int, ...]:
    """vLLM's `logprob_token_ids`: the token ids whose log-probabilities each generated token carries instead of the
    top ones (beside the chosen token's; an empty list: the top ones), with `logprobs` asked for."""
    if not body.logprob_token_ids:
        return ()
    if logprobs is None:
        raise ServingError("logprob_token_ids gives log-probabilities where they are asked for: send logprobs too "
                           "(completions: logprobs, a number; chat: logprobs true)", "logprob_token_ids")
    return listed_ids(served, body.logprob_token_ids, "logprob_token_ids")


def truncated(served: Served, body, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens`: each prompt's last k tokens (-1: the model's context length)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompts
    if keep == 0 or keep > served.context:
        raise ServingError(f"truncate_prompt_tokens must be -1 (the context length) or from 1 to the model's context "
                           f"length {served.context}, got {keep}", "truncate_prompt_tokens")
    keep = served.context if keep < 0 else keep
    return [ids[-keep:] for ids in prompts]


def stop_ids_of(served: Served, body) -> tuple[int, ...]:
    """vLLM's `stop_token_ids`: token ids of the vocabulary, at most `--max-labels` of them."""
    return listed_ids(served, body.stop_token_ids, "stop_token_ids")


def sampling_of(served: Served, body, max_tokens: int, logprobs: int | None, stop: tuple[str, ...],
                tool_schema: dict | None = None, reasoning: Reasoning | None = None) -> Sampling:
    """A field the request leaves out takes the server's default (`served.sampling_defaults`: the
    package's, as vLLM takes a model's generation config), else OpenAI's: temperature 1, top_p 1; a seed
    matters only when sampling; `logit_bias`, `presence_penalty` and `frequency_penalty` (over the tokens
    generated so far). vLLM's extras: `top_k` (-1 or 0: off), `min_p` (0: off), `repetition_penalty` (1:
    off), `min_tokens` (end-of-sequence and stop tokens masked before), `ignore_eos`, `stop_token_ids`,
    `include_stop_str_in_output`, `skip_special_tokens`. `tool_schema`: what a chat request's `tool_choice` keeps
    the output to (tools.py); `reasoning`: how a chat request's output is read for thinking, which a grammar
    then follows (reasoning.py)."""
    def given(name: str, otherwise):
        value = getattr(body, name)
        return served.sampling_defaults.get(name, otherwise) if value is None else value

    sampling = Sampling(max_tokens, float(given("temperature", 1.0)), float(given("top_p", 1.0)), None, stop, logprobs,
                        max(0, given("top_k", 0)), float(given("min_p", 0.0)), float(given("repetition_penalty", 1.0)),
                        logit_bias_of(served, body), body.min_tokens, body.ignore_eos,
                        float(body.presence_penalty), float(body.frequency_penalty),
                        stop_ids_of(served, body), body.include_stop_str_in_output or body.no_stop_trim,
                        body.skip_special_tokens,
                        constraint_of(served, body, tool_schema, reasoning), allowed=allowed_of(served, body),
                        bad_words=bad_words_of(served, body), logprob_ids=logprob_ids_of(served, body, logprobs))
    if sampling.allowed and set(sampling.allowed) <= {word[0] for word in sampling.bad_words if len(word) == 1}:
        raise ServingError("every one of allowed_token_ids is a bad word's only token: no token is left to choose",
                           "allowed_token_ids")
    if body.min_tokens > max_tokens:
        raise ServingError(f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", "min_tokens")
    if body.min_tokens and stop:
        raise ServingError("min_tokens with stop strings is not supported: send one or the other", "min_tokens")
    if body.min_tokens and sampling.constraint is not None:  # a grammar complete before it would leave no token
        raise ServingError("min_tokens with structured output is not supported: send one or the other", "min_tokens")
    if not sampling.greedy and body.seed is not None:
        sampling = dataclasses.replace(sampling, seed=body.seed)
    return sampling


def _check_length(served: Served, prompts: list[list[int]], max_tokens: int) -> None:
    for i, ids in enumerate(prompts):
        if len(ids) + max_tokens > served.context:
            raise ServingError(f"prompt {i} has {len(ids)} tokens; with max_tokens {max_tokens} that exceeds the "
                               f"model's context length {served.context}", "max_tokens")


# ---- completions --------------------------------------------------------------------------------

def completion_job(served: Served, body: CompletionRequest, loop):
    stop = check_common(served, body)
    served.need_tokenizer("/v1/completions")
    prompt = body.prompt
    nested = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    entries = prompt if nested else [prompt]
    if len(entries) * body.n > served.settings.max_items:
        raise ServingError(f"prompt has {len(entries)} entries, each with n = {body.n} choices; this server takes at "
                           f"most {served.settings.max_items} choices a request", "prompt" if body.n == 1 else "n")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise ServingError(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not body.echo):
        raise ServingError(f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}", "max_tokens")
    if body.stream and body.echo and body.logprobs is not None:
        raise ServingError("a stream with echo carries the prompt's text, not its log-probabilities: ask without "
                           "stream for them", "logprobs")
    if body.stream and body.echo and max_tokens == 0:
        raise ServingError("a stream with echo needs max_tokens of at least 1 (with 0 there is only the prompt: "
                           "ask without stream)", "max_tokens")
    _check_vllm_extras(body)
    texts = [(f"prompt[{i}]", text) for i, text in enumerate(entries) if isinstance(text, str)]
    served.check_texts(texts)
    if texts:
        prompts = [list(ids) for ids in served.tokenizer([t for _, t in texts],
                                                         add_special_tokens=body.add_special_tokens)["input_ids"]]
    else:
        prompts = [list(ids) for ids in entries]
    served.check_prompts(prompts)
    prompts = truncated(served, body, prompts)
    _check_length(served, prompts, max_tokens)
    per_token = 1 + max(body.logprobs or 0, len(body.logprob_token_ids or ()) + 1 if body.logprob_token_ids else 0)
    echoed = sum(len(p) for p in prompts) * per_token if body.echo and body.logprobs is not None else 0
    generated = len(prompts) * max_tokens * per_token if body.logprobs is not None else 0
    vllms = sum(len(p) for p in prompts) * (2 + body.prompt_logprobs) if body.prompt_logprobs is not None else 0
    served.check_values((echoed + generated + vllms) * body.n, "the log-probabilities asked for", "logprobs")
    sampling = sampling_of(served, body, max_tokens, body.logprobs, stop)
    prompts = [prompt for prompt in prompts for _ in range(body.n)]  # choice i * n + k: prompt i's k-th
    scored = body.echo and body.logprobs is not None or body.prompt_logprobs is not None
    top = max(body.logprobs or 0, body.prompt_logprobs or 0) if scored else None  # the prompts' alternatives
    if sampling.logprob_ids and max_tokens == 0:
        raise ServingError("logprob_token_ids are given at generated tokens, and max_tokens 0 generates none (the "
                           "prompt's are prompt_logprobs')", "logprob_token_ids")
    if (body.echo or scored) and not body.stream and not sampling.logprob_ids and \
            (max_tokens == 0 or (max_tokens == 1 and sampling.greedy)):
        return PromptJob(prompts, top or 0, max_tokens == 1, sampling, loop, served.engine.eos,
                         body.prompt_logprobs is not None)
    return Generation(prompts, sampling, loop, served.tokenizer, served.engine.eos, body.stream, top, copies=body.n,
                      prompt_ranks=body.prompt_logprobs is not None)


def _check_vllm_extras(body: CompletionRequest | ChatRequest) -> None:
    """vLLM's `prompt_logprobs`: 0 to MAX_LOGPROBS alternatives (vLLM's default limit too; -1, the whole
    vocabulary, is past it), not in a stream."""
    if body.prompt_logprobs is None:
        return
    if body.prompt_logprobs > MAX_LOGPROBS:
        raise ServingError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.prompt_logprobs}",
                           "prompt_logprobs")
    if body.stream:
        raise ServingError("prompt_logprobs are not available in a stream: ask without stream", "prompt_logprobs")


def completion_body(served: Served, body: CompletionRequest, job, result, ident: str) -> dict:
    tokenizer, choices, generated, rows = served.tokenizer, [], 0, []
    for i, prompt in enumerate(job.prompts):
        scores, row = prompt_part(served, job, result, i)
        rows.append(row)
        # vLLM leaves the echoed prompt's text out where it gives the prompt's ids
        shown = tokenizer.decode(prompt) if body.echo and not body.return_token_ids else ""
        text = shown + (row.text.text if row else "")
        logprobs = None
        if body.logprobs is not None:
            names = logprob_names(tokenizer, body.return_tokens_as_token_ids)
            logprobs = _completion_logprobs(names, prompt, scores, row, body.echo, body.logprobs,
                                            job.sampling.alternatives)
        choice = {"index": i, "text": text, "logprobs": logprobs,
                  "finish_reason": row.text.finish_reason if row else "length"}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(tokenizer, prompt, scores, body.prompt_logprobs)
        if body.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = list(prompt), list(row.tokens) if row else []
        choices.append(choice)
        generated += len(row.tokens) if row else 0
    return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": served.name,
            "choices": choices, "usage": _usage(served, job.tokens // body.n, generated, rows)}


def prompt_part(served: Served, job, result, i: int) -> tuple[PromptScores | None, Row | None]:
    """Prompt i's log-probabilities (echo) and its generated row, whichever the job made."""
    if isinstance(job, Generation):
        return (job.prompt_scores[i] if job.prompt_scores else None), result[i]
    scores = result[i]
    if not job.next_token:
        return scores, None
    row = Row(job, i, job.prompts[i], job.sampling, job.sampling.text_stream(served.tokenizer, job.eos))
    token, logprob = scores.next_top[0]  # one greedy token, read from the prompt's prefill
    if scores.last is not None:  # processed first (a repetition penalty, say); its log-probability the raw one
        token = int(row.process(scores.last[None]).argmax(-1))
        logprob = float(scores.last[token] - torch.logsumexp(scores.last, -1))
        if row.exhausted:  # its masks left no token: it ends without one
            row.text.complete()
            return scores, row
    row.tokens, row.logprobs, row.top = [token], [logprob], [scores.next_top[: job.top]]
    row.text.add(token)
    row.text.end()
    return scores, row


def _completion_logprobs(tokenizer, prompt, scores: PromptScores | None, row: Row | None, echo: bool,
                         top: int, generated: int) -> dict:
    """OpenAI's `logprobs` object: the prompt's tokens first when echoing (the first one's
    log-probability null, `top` alternatives at each), then the generated tokens (`generated` alternatives: the
    top ones, or the chosen token's and vLLM's `logprob_token_ids`)."""
    ids, values, alternatives = [], [], []
    if echo:
        ids += prompt
        values += [None] + scores.token_logprobs
        alternatives += [None] + [t[:top] for t in scores.top]
    if row is not None:
        ids += row.tokens
        values += row.logprobs
        alternatives += [t[:generated] for t in row.top]
    return _completion_entries(tokenizer, ids, values, alternatives)


def _vllm_prompt_logprobs(tokenizer, prompt: list[int], scores: PromptScores, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first token, then for each next one a dict from
    token id to `{"logprob", "rank", "decoded_token"}`: the prompt's token first (its rank among the
    vocabulary), then the `top` most likely (ranks 1 to `top`; the prompt's token once if among them)."""
    seen = sorted(set(prompt) | {t for pairs in scores.top for t, _ in pairs[:top]})
    name = dict(zip(seen, token_strings(tokenizer, seen))) if tokenizer is not None else {}
    out: list[dict | None] = [None]
    for token, value, rank, pairs in zip(prompt[1:], scores.token_logprobs, scores.ranks, scores.top, strict=True):
        position = {str(token): {"logprob": value, "rank": rank, "decoded_token": name.get(token)}}
        for place, (other, logprob) in enumerate(pairs[:top], 1):
            position[str(other)] = {"logprob": logprob, "rank": place, "decoded_token": name.get(other)}
        out.append(position)
    return out


def _completion_entries(tokenizer, ids: list[int], values: list, alternatives: list, offset: int = 0) -> dict:
    """OpenAI's completions `logprobs` object of these tokens, their text offsets counted from `offset`."""
    seen = sorted(set(ids) | {t for pairs in alternatives if pairs for t, _ in pairs})
    name = dict(zip(seen, token_strings(tokenizer, seen)))  # one decode for every token string
    strings = [name[t] for t in ids]
    tops = [None if pairs is None else {name[t]: v for t, v in pairs} for pairs in alternatives]
    offsets, at = [], offset
    for text in strings:
        offsets.append(at)
        at += len(text)
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


# ---- chat ---------------------------------------------------------------------------------------

def chat_job(served: Served, body: ChatRequest, loop) -> Generation:
    stop = check_common(served, body)
    refuse_unsupported(body)
    if body.top_logprobs is not None and not (body.logprobs and 0 <= body.top_logprobs <= MAX_LOGPROBS):
        raise ServingError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, with logprobs true", "top_logprobs")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, name)
        if value is not None and value < 1:
            raise ServingError(f"{name} must be at least 1, got {value}", name)
    plan = tool_plan(served, body)
    prompt, media = chat_prompt(served, body, [("stop", s) for s in stop], plan.tools)
    if media and body.truncate_prompt_tokens is not None:
        raise ServingError("truncate_prompt_tokens with images is not supported: it could cut an image's tokens",
                           "truncate_prompt_tokens")
    prompt = truncated(served, body, [prompt])[0]
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    room = served.context - len(prompt)  # left out: what the context leaves, within the default's max_new_tokens
    max_tokens = min(room, served.sampling_defaults.get("max_new_tokens", room)) if limit is None else limit
    if max_tokens < 1:
        raise ServingError(f"the prompt's {len(prompt)} tokens fill the model's context of {served.context}",
                           "messages")
    _check_length(served, [prompt], max_tokens)
    if body.n > served.settings.max_items:
        raise ServingError(f"n is {body.n}; this server takes at most {served.settings.max_items} choices a request",
                           "n")
    top = (body.top_logprobs or 0) if body.logprobs else None
    if top is not None:
        wide = len(body.logprob_token_ids) + 1 if body.logprob_token_ids else 0  # vLLM's logprob_token_ids
        served.check_values(max_tokens * (1 + max(top, wide)) * body.n, "the log-probabilities asked for",
                            "top_logprobs")
    _check_vllm_extras(body)
    if body.add_special_tokens:
        raise ServingError("add_special_tokens with messages is not supported: the chat template places the special "
                           "tokens", "add_special_tokens")
    if body.prompt_logprobs is not None and media:
        raise ServingError("prompt_logprobs of a prompt with images is not supported: ask without images",
                           "prompt_logprobs")
    if body.prompt_logprobs is not None:
        served.check_values(len(prompt) * (2 + body.prompt_logprobs), "the prompt's log-probabilities asked for",
                            "prompt_logprobs")
    parser = served.settings.reasoning_parser
    reading = reasoning_of(parser, served.tokenizer, prompt, body.include_reasoning,
                           calls=plan.mode == "auto" and plan.parser == "openai")
    sampling = sampling_of(served, body, max_tokens, top, stop, plan.schema,
                           None if served.settings.enable_in_reasoning else reading)
    if body.thinking_token_budget is not None:
        sampling = dataclasses.replace(sampling, thinking=_budget(served, body, reading, sampling))
    if markers_are_special(plan, served.tokenizer) or thinking_is_special(parser, served.tokenizer):
        sampling = dataclasses.replace(sampling, skip_special=False)  # the parsers' markers kept in the text
    return Generation([prompt] * body.n, sampling, loop, served.tokenizer, served.engine.eos, body.stream,
                      body.prompt_logprobs, media=media, copies=body.n, prompt_ranks=body.prompt_logprobs is not None,
                      tools=plan, reasoning=reading)


def _budget(served: Served, body: ChatRequest, reading: Reasoning | None, sampling: Sampling) -> ThinkingBudget:
    """vLLM's `thinking_token_budget` (reasoning.py), which needs the server's reasoning parser (what it reads as
    thinking is what the budget counts) and a grammar, where there is one, that lets the thinking end."""
    if reading is None:
        raise ServingError("thinking_token_budget needs the server's reasoning parser (--reasoning-parser), which "
                           "says what the thinking is", "thinking_token_budget")
    if reading.parser == "granite":
        raise ServingError("thinking_token_budget is not supported under --reasoning-parser granite: Granite's "
                           "thinking ends at words it may write either way ('Here is my response:', 'Here's my "
                           "response:'), not at tokens a budget can count to and force", "thinking_token_budget")
    if sampling.constraint is not None and served.settings.enable_in_reasoning:
        raise ServingError("thinking_token_budget beside structured output is not supported on a server whose "
                           "grammar holds the thinking too (--structured-outputs-config.enable_in_reasoning): the "
                           "forced </think> could break the grammar", "thinking_token_budget")
    return thinking_budget(reading, served.tokenizer, body.thinking_token_budget)


# Fields beyond the Responses API's and Anthropic's that their clients send through to vLLM (`extra_body`), which
# those routes carry out as chat does.
CHAT_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "allowed_token_ids", "bad_words",
               "truncate_prompt_tokens", "logprob_token_ids", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "chat_template_kwargs", "thinking_token_budget")


def chat_job_as(served: Served, chat: ChatRequest, loop, names: dict[str, str], items: str,
                lead: str | None) -> Generation:
    """`chat_job` of a chat request made from another API's request (the Responses API's, Anthropic's), its
    refusals naming that API's fields: chat's field names as `names` maps them, `messages[i]` as `items[i]`,
    counted past a first system message made of the field `lead` where the request has one (then `lead`
    for that message)."""
    try:
        return chat_job(served, chat, loop)
    except ServingError as e:
        if e.param is None or not (e.param in names or e.param.startswith("messages")):
            raise
        shift = int(lead is not None)

        def item(found: re.Match) -> str:
            index = int(found.group(1)) - shift
            return f"{items}[{index}]" if index >= 0 else lead

        def renamed(text: str) -> str:
            text = re.sub(r"\bmessages\[(\d+)\]", item, text)
            text = re.sub(r"^messages\b", items, text)  # the field itself, where a refusal starts with it
            for old, new in names.items():
                text = re.sub(rf"\b{old}\b", new, text)
            return text

        raise ServingError(renamed(str(e)), renamed(e.param), e.status, e.code) from None


def chat_echo(body: ChatRequest) -> str:
    """vLLM's `echo` on chat: the last message's text where its role is the answer's (the assistant's; the last
    message's own where the template adds no turn: `continue_final_message`, `add_generation_prompt` false), which
    the answer's content then begins with; its text parts joined by line breaks, as vLLM joins them."""
    last = body.messages[-1] if body.echo and body.messages else None
    adding = not body.continue_final_message if body.add_generation_prompt is None else body.add_generation_prompt
    if last is None or last.content is None or last.role != ("assistant" if adding else last.role):
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content if part.type == "text" and part.text is not None)


def chat_body(served: Served, body: ChatRequest, job: Generation, rows: list[Row], ident: str) -> dict:
    answers, lead = [], chat_echo(body)
    for row in rows:
        message, finish, reasoning = chat_answer(job, row)
        if lead:
            message["content"] = lead + (message["content"] or "")
        if reasoning is not None and job.reasoning.shown:  # vLLM's name, and SGLang's and DeepSeek's
            message.update(reasoning=reasoning, reasoning_content=reasoning)
        answers.append((message, finish))
    choices = [{"index": row.index, "message": message,
                "logprobs": {"content": chat_logprobs(logprob_names(served.tokenizer, body.return_tokens_as_token_ids),
                                                      list(zip(row.tokens, row.logprobs, row.top)))}
                if body.logprobs else None,
                "finish_reason": finish} for row, (message, finish) in zip(rows, answers, strict=True)]
    answer = {"id": ident, "object": "chat.completion", "created": int(time.time()),
              "model": served.name, "choices": choices,
              "usage": _usage(served, job.tokens // body.n, sum(len(row.tokens) for row in rows), rows)}
    if body.prompt_logprobs is not None:  # vLLM's, beside the choices: the one prompt's
        answer["prompt_logprobs"] = _vllm_prompt_logprobs(served.tokenizer, job.prompts[0], job.prompt_scores[0],
                                                          body.prompt_logprobs)
    if body.return_token_ids:  # vLLM's: the prompt's ids beside the choices, each choice's own in it
        answer["prompt_token_ids"] = list(job.prompts[0])
        for choice, row in zip(choices, rows, strict=True):
            choice["token_ids"] = list(row.tokens)
    return answer


def chat_logprobs(tokenizer, scored: list[tuple[int, float, list]]) -> list[dict]:
    """OpenAI's chat `logprobs.content` of these (token, log-probability, top alternatives)."""
    seen = sorted({t for t, _, _ in scored} | {t for _, _, pairs in scored for t, _ in pairs})
    name = dict(zip(seen, token_strings(tokenizer, seen)))

    def entry(token: int, logprob: float) -> dict:
        return {"token": name[token], "logprob": logprob, "bytes": list(name[token].encode("utf-8"))}

    return [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in pairs]} for t, v, pairs in scored]


# ---- streams ------------------------------------------------------------------------------------

def _chunk(served: Served, kind: str, ident: str, index: int, delta: str | dict | None = None,
           finish: str | None = None, role: bool = False, logprobs: dict | None = None,
           ids: _StreamedIds | None = None, tokens: list[int] = (), usage: dict | None = None) -> str:
    """One server-sent event of a chat completion (`chat.completion.chunk`) or a completion; with `ids`
    (vLLM's `return_token_ids`), the chunk's `tokens` and, in a choice's first chunk, its prompt's. A chat
    chunk's `delta`: its text, or the delta's fields (answers.py's `ChatStream`)."""
    body = {"id": ident, "object": kind, "created": int(time.time()), "model": served.name}
    if kind == "chat.completion.chunk":
        message = {"role": "assistant"} if role else {}
        if isinstance(delta, dict):
            message.update(delta)
        elif delta:
            message["content"] = delta
        choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
    body["choices"] = [choice]
    if ids is not None:
        prompt = ids.first(index)  # vLLM's chat chunk carries it beside the choices, its completion's in the choice
        if prompt is not None:
            (body if kind == "chat.completion.chunk" else choice)["prompt_token_ids"] = prompt
        if not role:
            choice["token_ids"] = list(tokens)
    if usage is not None:  # vLLM's `continuous_usage_stats`: the choice's usage so far
        body["usage"] = usage
    return _sse(body)


class _UsageSoFar:
    """vLLM's `continuous_usage_stats` in a stream: each choice's prompt tokens and the tokens it has carried."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts, self.carried = prompts, [0] * len(prompts)

    def of(self, index: int, tokens: list[int] = ()) -> dict:
        self.carried[index] += len(tokens)
        prompt = len(self.prompts[index])
        return {"prompt_tokens": prompt, "completion_tokens": self.carried[index],
                "total_tokens": prompt + self.carried[index]}


class _StreamedIds:
    """vLLM's `return_token_ids` in a stream: each choice's prompt ids in its first chunk (once)."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts, self.sent = prompts, set()

    def first(self, index: int) -> list[int] | None:
        if index in self.sent:
            return None
        self.sent.add(index)
        return list(self.prompts[index])


class _StreamedLogprobs:
    """The log-probabilities of a stream's chunks, in the route's shape: chat's `content` entries, or
    completions' token lists with each choice's text offsets running on from chunk to chunk; None
    where the request asks for none (`top`: the alternatives it asks for)."""

    def __init__(self, tokenizer, kind: str, top: int | None):
        self.tokenizer, self.kind, self.top, self.offsets = tokenizer, kind, top, {}

    def of(self, index: int, scored: list | None) -> dict | None:
        if scored is None or self.top is None:
            return None
        if self.kind == "chat.completion.chunk":
            return {"content": chat_logprobs(self.tokenizer, [(t, v, pairs[: self.top]) for t, v, pairs in scored])}
        entries = _completion_entries(self.tokenizer, [t for t, _, _ in scored], [v for _, v, _ in scored],
                                      [pairs[: self.top] for _, _, pairs in scored], self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(text) for text in entries["tokens"])
        return entries


def _sse(data) -> str:
    return f"data: {data if isinstance(data, str) else dumps(data)}\n\n"


async def _events(served: Served, job: Generation, kind: str, ident: str, usage: bool, n: int,
                  echo: bool = False, token_ids: bool = False, names_as_ids: bool = False, lead: str = "",
                  continuous: bool = False):
    """The server-sent events of a streamed completion (`n` choices of each prompt, each chunk's id `ident`), with the
    log-probabilities of each chunk's tokens where asked for (those of tokens whose text is held back,
    with a later chunk's; the rest with the last), and with `token_ids` the chunk's token ids the same
    way (vLLM's `return_token_ids`); with `echo`, each choice's prompt text first, as vLLM streams it
    (left out with `token_ids`, as vLLM leaves it); with `continuous` (vLLM's `continuous_usage_stats`),
    each chunk its choice's usage so far; if the client goes away, its rows stop."""
    logprobs = _StreamedLogprobs(logprob_names(served.tokenizer, names_as_ids), kind, job.sampling.alternatives)
    ids = _StreamedIds(job.prompts) if token_ids else None
    choices = [ChatStream(job) for _ in job.prompts] if kind == "chat.completion.chunk" else None
    so_far = _UsageSoFar(job.prompts) if continuous else None
    try:
        if kind == "chat.completion.chunk":
            for index in range(n):
                yield _chunk(served, kind, ident, index, role=True, ids=ids, usage=so_far and so_far.of(index))
            for index in range(n if lead else 0):  # vLLM's chat echo: the last message's text first
                yield _chunk(served, kind, ident, index, {"content": lead}, usage=so_far and so_far.of(index))
        if echo:  # choice i * n + k is prompt i's k-th: each prompt decoded once
            texts = [served.tokenizer.decode(prompt) if not token_ids else "" for prompt in job.prompts[::n]]
            for index in range(len(job.prompts)):
                yield _chunk(served, kind, ident, index, texts[index // n], ids=ids, usage=so_far and so_far.of(index))
        while (event := await job.next_event()) is not None:
            index, text, tokens, scored = event
            delta = choices[index].piece(text) if choices else text
            yield _chunk(served, kind, ident, index, delta, logprobs=logprobs.of(index, scored), ids=ids, tokens=tokens,
                         usage=so_far and so_far.of(index, tokens))
        try:
            rows = await job.future
        except Exception as e:  # noqa: BLE001  the model's work failed: the stream says so and ends
            error = e if isinstance(e, ServingError) else failed("the completion", e)
            yield _sse(error.openai_body())
            return
        for row in rows:
            tokens, rest = row.unsent()
            finish = row.text.finish_reason
            if choices:  # what a choice's reasoning and calls held back, then its finish reason as tools.py reads it
                deltas, finish = choices[row.index].end(row)
                for delta in deltas:
                    yield _chunk(served, kind, ident, row.index, delta, usage=so_far and so_far.of(row.index))
            yield _chunk(served, kind, ident, row.index, finish=finish, logprobs=logprobs.of(row.index, rest),
                         ids=ids, tokens=tokens, usage=so_far and so_far.of(row.index, tokens))
        if usage:
            yield _sse({"id": ident, "object": kind, "model": served.name, "choices": [],
                        "usage": _usage(served, job.tokens // n, sum(len(row.tokens) for row in rows), rows)})
        yield _sse("[DONE]")
    finally:
        if not job.future.done():  # the client went away mid-stream: free its rows
            abandon(served, job)


# ---- routes -------------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def request_ident(prefix: str, request: Request, body) -> str:
    """An answer's id as vLLM makes it: `prefix-` and the request's X-Request-Id header, else its `request_id`
    field, else a random one."""
    given = request.headers.get("x-request-id") or body.request_id
    return f"{prefix}-{given}" if given else _new_id(prefix)


def _usage(served: Served, prompt_tokens: int, completion_tokens: int, rows: list) -> dict:
    """OpenAI's usage; with `enable_prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`), its
    `prompt_tokens_details.cached_tokens`: the prompts' tokens taken from the prefix cache, not run (each prompt
    once, as `n` choices share it)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if served.settings.enable_prompt_tokens_details:
        cached = sum(row.cached_prefix for row in rows if row is not None and row.copy == 0)
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def stream_options(body) -> tuple[bool, bool]:
    """OpenAI's `stream_options`: `include_usage` (a last chunk with the usage), and vLLM's `continuous_usage_stats`
    (with it, every chunk its choice's usage so far); another option is a 400 naming it."""
    options = body.stream_options or {}
    for name, value in options.items():
        if name not in ("include_usage", "continuous_usage_stats"):
            raise ServingError(f"stream_options.{name} is not an option this server takes (it takes include_usage "
                               "and continuous_usage_stats)", "stream_options")
        if not isinstance(value, bool) and value is not None:
            raise ServingError(f"stream_options.{name} must be true or false", "stream_options")
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


def model_card(served: Served) -> dict:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "ortmodule",
            "max_model_len": served.context, "vocab_size": served.vocab}


def add_routes(app: FastAPI, served: Served) -> None:
    async def answer(make_job, body, request: Request, respond, kind: str):
        include, continuous = stream_options(body)
        chat = kind == "chat.completion.chunk"
        ident = request_ident("chatcmpl" if chat else "cmpl", request, body)
        return await run_or_stream(served, make_job, body, request, functools.partial(respond, ident=ident),
                                   lambda job: _events(
            served, job, kind, ident, include, body.n, body.echo and not chat, bool(body.return_token_ids),
            body.return_tokens_as_token_ids, chat_echo(body) if chat else "", continuous))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(completion_job, body, request, completion_body, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await answer(chat_job, body, request, chat_body, "chat.completion.chunk")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != served.name:
            raise ServingError(f"The model '{model}' does not exist", "model", 404, "model_not_found")
        return model_card(served)
