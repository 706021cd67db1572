"""The job protocol: what the engine runs, one class per kind of work.

Every request becomes a `Job` once checked and tokenized. A job is either run in one piece
(`OneShot`: a score request, a prompt's log-probabilities) together with others of its class, in
batches of a token budget, or is a `Generation` whose prompts become `Row`s that join the running
decode batch one by one and leave it when done. The engine (engine.py) knows only this protocol;
the routes build the jobs and read their results. Results and streamed text reach the event loop
through the job's own future and queue, thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .. import scoring
from ..inputs import argmax, pad_right, start_copy_to_host, to_device
from . import constraints
from .constraints import Constraint
from .reasoning import Reasoning, ThinkingBudget, ThinkingCount
from .text import TextStream
from .tools import NO_TOOLS, ToolPlan

Ids = list[int]

# vLLM's rule: a temperature this small is greedy decoding (dividing by it would overflow).
GREEDY_BELOW = 1e-5
# Logit rows (positions x vocabulary floats) one prompt-logprobs batch may hold on the device.
LOGIT_BYTES = 2**28


class Job:
    """A checked, tokenized request waiting for or running on the model."""

    kind = "job"  # its name in the metrics

    def __init__(self, prompts: list[Ids], loop: asyncio.AbstractEventLoop):
        self.prompts = prompts
        self.tokens = sum(len(p) for p in prompts)
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()  # the client went away: drop the job, stop its rows
        self.waiting = True  # counted against the queue's limit until it starts running
        self.arrived = 0  # the engine's decode step count when it was filed
        self.received = time.monotonic()  # when it was made (its prompts tokenized): vLLM's arrival time
        self.answering: dict = {}  # what the route keeps to write its answer (generate_routes: SGLang's shape)

    def resolve(self, result) -> None:
        """Hand the result to the waiting route (from any thread)."""
        self.loop.call_soon_threadsafe(_settle, self.future, result, None)

    def fail(self, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(_settle, self.future, None, error)

    def abort(self, error: BaseException) -> None:
        """Fail it and stop whatever of it still runs (its rows leave at the engine's next pass)."""
        self.cancelled.set()
        self.fail(error)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # cancelled: the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class FlushCache(Job):
    """SGLang's `/flush_cache`: the prefix cache emptied on the model's thread, where it is used, if
    nothing runs or waits there (SGLang's rule); resolves with whether it was emptied (engine.py)."""

    kind = "flush_cache"

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__([], loop)
        self.waiting = False  # not a request counted against the queue's limit


class OneShot(Job):
    """Work done in one model call per batch. `start_together(model, jobs)` queues the work of
    several jobs of one class and returns `finish`, which returns each job's result: on CUDA the
    engine queues the next batch before it finishes this one, so the device never waits for the
    host between batches. A class whose results are ready at once defines `run_together` instead."""

    reused_prefix = False  # a score job whose items' common prefix (its query) ran once: ScoreJob sets it

    @classmethod
    def start_together(cls, model, jobs: list) -> Callable[[], list]:
        results = cls.run_together(model, jobs)
        return lambda: results

    @staticmethod
    def run_together(model, jobs: list) -> list:
        raise NotImplementedError


class ScoreJob(OneShot):
    """SGLang's `/v1/score` and vLLM's `/generative_scoring`: label probabilities after each prompt.
    `labels`: one list of label ids for every prompt, or a list per prompt (SGLang's per-item candidates);
    with `apply_softmax` the probabilities are a softmax over the prompt's labels of their log-probabilities
    divided by `temperature`, else each label's own. After `finish`, `label_logprobs` holds each prompt's
    labels' log-probabilities (SGLang's `return_token_logprobs`)."""

    kind = "score"

    def __init__(self, prompts: list[Ids], labels: Ids | list[Ids], apply_softmax: bool, loop, token_budget: int,
                 reuse_prefix: bool | None = None, temperature: float = 1.0):
        super().__init__(prompts, loop)
        self.labels = [list(row) for row in labels] if labels and isinstance(labels[0], list) \
            else [list(labels)] * len(prompts)
        self.apply_softmax, self.token_budget, self.temperature = apply_softmax, token_budget, temperature
        self.reuse_prefix = reuse_prefix  # the server's setting: None decides per request from measured costs
        self.label_logprobs: list[list[float]] | None = None

    @classmethod
    def start_together(cls, model, jobs: list[ScoreJob]) -> Callable[[], list[list[list[float]]]]:
        """Every job's scores from one call of `scoring.label_logprobs` (each distinct label once), each
        prompt's labels' log-probabilities picked on the device and queued with their one copy to the host;
        `finish` waits for that copy and turns them into probabilities (a few per prompt, on the host)."""
        labels = sorted({t for job in jobs for row in job.labels for t in row})
        column = {t: i for i, t in enumerate(labels)}
        requests, budget = [job.prompts for job in jobs], jobs[0].token_budget
        reused = scoring.prefix_reuse(model, requests, budget, jobs[0].reuse_prefix)
        for job, once in zip(jobs, reused):
            job.reused_prefix = once
        logprobs = scoring.label_logprobs(model, requests, labels, budget, reused)
        rows, columns, start = [], [], 0
        for job in jobs:
            for i, row in enumerate(job.labels):
                rows += [start + i] * len(row)
                columns += [column[t] for t in row]
            start += len(job.prompts)
        # (lists as indices would be copied up with a wait for the device)
        copied = start_copy_to_host(logprobs[to_device(rows, logprobs.device), to_device(columns, logprobs.device)])

        def finish() -> list[list[list[float]]]:
            flat, out, at = copied().tolist(), [], 0
            for job in jobs:
                job.label_logprobs = []
                for row in job.labels:
                    job.label_logprobs.append(flat[at : at + len(row)])
                    at += len(row)
                out.append([scoring.label_probabilities(values, job.apply_softmax, job.temperature)
                            for values in job.label_logprobs])
            return out

        return finish


class EmbedJob(OneShot):
    """OpenAI's and vLLM's `/v1/embeddings`: each prompt's final-norm outputs pooled (`scoring.pooled_hidden_states`,
    `pooling`: the server's, one for all its jobs), L2-normalized where `normalize`; each job's `[prompts, hidden]`
    float32 on the host."""

    kind = "embed"

    def __init__(self, prompts: list[Ids], normalize: bool, loop, token_budget: int, pooling: str = "LAST"):
        super().__init__(prompts, loop)
        self.normalize, self.token_budget, self.pooling = normalize, token_budget, pooling

    @classmethod
    def start_together(cls, model, jobs: list[EmbedJob]) -> Callable[[], list[torch.Tensor]]:
        states = scoring.pooled_hidden_states(model, [p for job in jobs for p in job.prompts], jobs[0].token_budget,
                                              jobs[0].pooling)
        scaled = [job.normalize for job in jobs for _ in job.prompts]
        if all(scaled):
            states = torch.nn.functional.normalize(states, dim=-1)
        elif any(scaled):
            keep = to_device(scaled, states.device)[:, None]
            states = torch.where(keep, torch.nn.functional.normalize(states, dim=-1), states)
        copied = start_copy_to_host(states)

        def finish() -> list[torch.Tensor]:
            host, out, at = copied(), [], 0
            for job in jobs:
                out.append(host[at : at + len(job.prompts)])
                at += len(job.prompts)
            return out

        return finish


@dataclass
class PromptScores:
    """One prompt's log-probabilities: `token_logprobs[i]` of token i+1 given the tokens before it,
    and per position the `top` most likely (token, log-probability); then the next token's."""

    token_logprobs: list[float]
    top: list[list[tuple[int, float]]]
    next_top: list[tuple[int, float]]  # the distribution after the prompt, most likely first
    ranks: list[int]  # of token i+1 among the vocabulary (1: the most likely; 0: not asked for), vLLM's
    last: torch.Tensor | None = None  # the logits after the prompt `[V]`, where its next token is processed


class PromptJob(OneShot):
    """Log-probabilities of prompts (echo), and at most one greedy token read from the same prefill:
    lm-eval's loglikelihood request over the OpenAI API. `sampling`: the request's settings; where that
    token's logits are processed (a repetition penalty over the prompt, a logit bias, `min_tokens`) or its
    end or text is (`ignore_eos`, stop tokens, special tokens shown: `Sampling.processed`), the prompts'
    last logits are kept for `Row.process`; `eos`: the model's end-of-sequence ids."""

    kind = "prompt_logprobs"

    def __init__(self, prompts: list[Ids], top: int, next_token: bool, sampling: Sampling, loop,
                 eos: set[int] | frozenset[int], ranked: bool = False):
        super().__init__(prompts, loop)
        self.top, self.next_token, self.sampling, self.eos, self.ranked = top, next_token, sampling, eos, ranked

    @staticmethod
    def run_together(model, jobs: list[PromptJob]) -> list[list[PromptScores]]:
        prompts = [p for job in jobs for p in job.prompts]
        last = [job.next_token and job.sampling.processed for job in jobs for _ in job.prompts]
        scores = prompt_scores(model, prompts, max(job.top for job in jobs), any(job.ranked for job in jobs),
                               last if any(last) else None)
        out, k = [], 0
        for job in jobs:
            out.append(scores[k : k + len(job.prompts)])
            k += len(job.prompts)
        return out


def prompt_scores(model, prompts: list[Ids], top: int, ranked: bool = False,
                  last: list[bool] | None = None) -> list[PromptScores]:
    """Log-probabilities of every prompt token and of the next token, in batches of at most
    LOGIT_BYTES of logits, longest prompts first; with `ranked`, each token's rank too (vLLM's
    `prompt_logprobs`: a pass more over the logits, so only where asked); `last[j]`: prompt j's logits
    after it kept whole too (`PromptScores.last`)."""
    budget = max(1, LOGIT_BYTES // (4 * model.package.vocab_size))
    out: list[PromptScores | None] = [None] * len(prompts)
    for batch in scoring.length_batches([len(p) for p in prompts], 0, budget):
        kept = [last[j] for j in batch] if last is not None else None
        for j, scores in zip(batch, _score_batch(model, [prompts[j] for j in batch], max(top, 1), ranked, kept)):
            out[j] = scores
    return out


def _score_batch(model, prompts: list[Ids], top: int, ranked: bool, last: list[bool] | None) -> list[PromptScores]:
    """`prompt_scores` of one batch. The logits are reduced as they come (`logits_at`'s pieces: on a CPU a
    long prompt's chunk by chunk), so that no `[positions, V]` buffer is held whole (a 6,000-token prompt's
    took the process 3.7 GB above its model for SmolLM2's 49,152-token vocabulary); the last position's
    rows of the prompts `last` marks are copied whole (at most a row a prompt)."""
    ids, mask = pad_right(prompts)
    lengths = [len(p) for p in prompts]
    rows = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lengths))
    cols = torch.cat([torch.arange(n) for n in lengths])
    targets = to_device(torch.cat([torch.tensor(p[1:] + [0]) for p in prompts]), model.device)
    top = min(top, model.decoder.vocab_size)
    values = torch.empty(len(targets), 1 + top, dtype=torch.float32, device=model.device)
    indices = torch.empty(len(targets), top, dtype=torch.int64, device=model.device)
    ranks = torch.zeros(len(targets), dtype=torch.int64, device=model.device) if ranked else None
    slots, kept = _last_slots(lengths, last, len(targets), model)

    def reduce(places: torch.Tensor | None, logits: torch.Tensor) -> None:
        at = slice(None) if places is None else places
        if slots is not None:
            slot = slots[at]
            wanted = slot >= 0
            kept[slot[wanted]] = logits[wanted].float()
        normalizers, _ = scoring.log_normalizers(logits)  # log-probability = logit - normalizer, in float32
        best, indices[at] = logits.topk(top, dim=-1)
        chosen = logits.gather(1, targets[at][:, None])
        if ranked:  # ties share the better rank, as vLLM counts
            ranks[at] = (logits > chosen).sum(1) + 1
        values[at] = torch.cat([chosen, best], 1).float() - normalizers[:, None]

    model.logits_at(ids, mask, rows, cols, upcast=False, pieces=reduce)  # checked on the host, no wait
    values, indices = values.cpu().tolist(), indices.cpu().tolist()
    ranks = ranks.cpu().tolist() if ranked else [0] * len(targets)  # no copy where none were asked for
    out, start, slot = [], 0, 0
    for j, n in enumerate(lengths):
        span = range(start, start + n)
        pairs = [list(zip(indices[k], values[k][1:])) for k in span]
        out.append(PromptScores([values[k][0] for k in span][:-1], pairs[:-1], pairs[-1], ranks[start : start + n - 1]))
        if last is not None and last[j]:
            out[-1].last, slot = kept[slot], slot + 1
        start += n
    return out


def _last_slots(lengths: list[int], last: list[bool] | None, positions: int, model):
    """Where `_score_batch` keeps whole rows: per position of the batch's flat order, the row of `kept` its
    logits go to (-1: none), and `kept` itself; (None, None) where no prompt's are kept."""
    if last is None or not any(last):
        return None, None
    ends = torch.tensor(lengths).cumsum(0) - 1
    chosen = ends[torch.tensor(last)]
    slots = torch.full((positions,), -1, dtype=torch.int64)
    slots[chosen] = torch.arange(len(chosen))
    kept = torch.empty(len(chosen), model.decoder.vocab_size, dtype=torch.float32, device=model.device)
    return to_device(slots, model.device), kept


@dataclass(frozen=True)
class Sampling:
    """How a row is generated (OpenAI's settings)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-k log-probabilities per generated token (None: none)
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; on greedy rows too
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); greedy rows too
    min_tokens: int = 0  # end-of-sequence tokens masked until this many tokens are generated
    ignore_eos: bool = False  # an end-of-sequence token is generated as any other; the row ends by length
    presence_penalty: float = 0.0  # OpenAI's: off at 0
    frequency_penalty: float = 0.0
    stop_ids: tuple[int, ...] = ()  # vLLM's stop_token_ids: tokens that end the row, shown as text is
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    skip_special: bool = True  # vLLM's skip_special_tokens
    constraint: Constraint | None = None  # structured output: the grammar its tokens keep to (constraints.py)
    thinking: ThinkingBudget | None = None  # vLLM's thinking_token_budget (reasoning.py)
    allowed: tuple[int, ...] = ()  # vLLM's allowed_token_ids: the only tokens it may choose (empty: all)
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words, as token ids: never completed
    logprob_ids: tuple[int, ...] = ()  # vLLM's logprob_token_ids: the alternatives given at each token (not the top)

    @property
    def alters_logits(self) -> bool:
        """Whether the row's logits change before it chooses (a bias, a penalty, a mask: `Row.process`)."""
        return (bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.min_tokens > 0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.constraint is not None
                or self.thinking is not None or bool(self.allowed) or bool(self.bad_words))

    @property
    def processed(self) -> bool:
        """Whether the row's logits change before it chooses, or its end or text does (`ignore_eos`,
        stop tokens, the stop string or special tokens shown)."""
        return (self.alters_logits or self.ignore_eos or bool(self.stop_ids) or self.include_stop
                or not self.skip_special)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def alternatives(self) -> int | None:
        """How many alternatives each generated token's log-probabilities carry: the top `logprobs`, or the chosen
        token and the `logprob_ids` (vLLM's), or None where none are asked for."""
        return len(self.logprob_ids) + 1 if self.logprob_ids and self.logprobs is not None else self.logprobs

    def text_stream(self, tokenizer, eos: set[int] | frozenset[int]) -> TextStream:
        """A row's text under these settings: its ends (the model's `eos` unless `ignore_eos`, the stop
        strings and tokens) and what it shows (the stop string, special tokens)."""
        ends = set() if self.ignore_eos else eos
        return TextStream(tokenizer, ends, self.stop, frozenset(self.stop_ids), self.include_stop, self.skip_special)


class Generation(Job):
    """Completions of every prompt with `sampling`, each prompt a `Row` of the decode batch (a
    request's `n` choices: each prompt `copies` times in a row, each copy a row of its own).
    `stream`: an asyncio.Queue that gets `(prompt index, text)` as text becomes final, then None.
    `tools`: a chat request's tool calling (tools.py's plan), read when its answer is written; `reasoning` how its
    output's reasoning is read (reasoning.py; None: it is all content)."""

    kind = "generation"

    def __init__(self, prompts: list[Ids], sampling: Sampling, loop, tokenizer, eos: set[int],
                 stream: bool = False, prompt_top: int | None = None, media=None, copies: int = 1,
                 prompt_ranks: bool = False, tools: ToolPlan = NO_TOOLS, reasoning: Reasoning | None = None):
        super().__init__(prompts, loop)
        self.tools, self.reasoning = tools, reasoning
        self.sampling, self.prompt_top, self.prompt_ranks = sampling, prompt_top, prompt_ranks
        self.stream: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.prompt_scores: list[PromptScores] | None = None  # echo: filled before the rows start
        self.eos, self.copies = eos, copies
        self.rows = [Row(self, i, p, sampling, sampling.text_stream(tokenizer, eos), media=media, copy=i % copies)
                     for i, p in enumerate(prompts)]
        self.unfinished = len(self.rows)

    async def next_event(self):
        """The stream's next event (None at its end), after a turn of the event loop: events waiting in
        the queue would otherwise be written back to back, so a client that left would be heard of only
        after them all (its rows running on, and asyncio logging "socket.send() raised exception." from
        the fifth write to the lost connection)."""
        await asyncio.sleep(0)
        return await self.stream.get()

    def emit(self, row: Row, text: str) -> None:
        """Stream `text` (when there is some) of `row`, with its tokens not yet streamed and their
        log-probabilities where the request asks for them: `(index, text, tokens, [(token, logprob, top), ...]
        or None)`."""
        if self.stream is None or not text:
            return
        tokens, scored = row.unsent()
        self.loop.call_soon_threadsafe(self.stream.put_nowait, (row.index, text, tokens, scored))

    def row_done(self) -> None:
        """A row finished; the last one resolves the job."""
        self.unfinished -= 1
        if self.unfinished == 0:
            if self.stream is not None:
                self.loop.call_soon_threadsafe(self.stream.put_nowait, None)
            self.resolve(self.rows)

    def fail(self, error: BaseException) -> None:
        super().fail(error)
        if self.stream is not None:
            self.loop.call_soon_threadsafe(self.stream.put_nowait, None)


@dataclass(eq=False)
class Row:
    """One prompt's generation: its settings, tokens and text so far."""

    job: Generation
    index: int
    prompt: Ids
    sampling: Sampling
    text: TextStream
    tokens: Ids = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in its cache (run in chunks, one per decode step, or cached)
    generator: torch.Generator | None = None
    prefix: tuple | None = None  # the cached prefix found for its prompt: (entry or None, tokens shared)
    cached_prefix: int = 0  # of its prompt's tokens, those taken from the prefix cache (not run)
    media: object = None  # the prompt's images (serving/images.py's Media): it is prefilled alone, whole
    copy: int = 0  # which of the request's `n` choices of its prompt: a seeded row draws with seed + copy
    sent: int = 0  # tokens a stream has carried
    processors: list | None = None  # transformers' processors of its sampling, made at its first choice
    matcher: object = None  # its grammar's matcher (structured output), made at its first choice
    thought: ThinkingCount | None = None  # its place against a thinking budget, made at its first choice
    barred: torch.Tensor | None = None  # the tokens outside its allowed_token_ids (True), made at its first choice
    exhausted: bool = False  # its masks (allowed tokens, bad words, a grammar) left no token: it ends, taking none
    # time.monotonic() when it left the queue, took its first and its latest token (0: not yet); whether
    # telemetry counted its end
    started_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    ended: bool = False

    @property
    def feeding(self) -> bool:
        """Whether its prompt is still being run (a token per decode step, or in chunks)."""
        return self.prefilled < len(self.prompt)

    @property
    def cached(self) -> int:
        """Tokens in the row's cache: the prompt's run so far, then every token chosen but the last."""
        return self.prefilled if self.feeding else len(self.prompt) + len(self.tokens) - 1

    @property
    def next_input(self) -> int:
        """The token the row's next decode step runs."""
        return self.prompt[self.prefilled] if self.feeding else self.tokens[-1]

    @property
    def finished(self) -> bool:
        return self.text.finish_reason is not None

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's `[1, V]` float logits after its logit bias, its repetition penalty over its prompt
        and tokens so far, OpenAI's presence and frequency penalties over its tokens so far, and its
        end-of-sequence mask before `min_tokens`: `sequence_bias`, `repetition_penalty` and
        `min_new_tokens` as `model.generate` applies them (transformers' own processors, in its
        order), greedy or sampled."""
        sampling = self.sampling
        logits = self._masked(logits)
        if self.processors is None:  # made once: the bias processor prepares its tensors at its first call
            ends = sorted(set(self.job.eos) | set(sampling.stop_ids))
            self.processors = [
                *([SequenceBiasLogitsProcessor(sequence_bias={(t,): v for t, v in sampling.logit_bias})]
                  if sampling.logit_bias else []),
                *([RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)]
                  if sampling.repetition_penalty != 1.0 else []),
                *([MinNewTokensLengthLogitsProcessor(len(self.prompt), sampling.min_tokens, ends, device=logits.device)]
                  if sampling.min_tokens > 0 and ends else [])]
        if self.processors:
            ids = torch.tensor([list(self.prompt) + self.tokens], device=logits.device)
            for processor in self.processors:
                logits = processor(ids, logits)
        if self.tokens and (sampling.presence_penalty or sampling.frequency_penalty):
            # OpenAI's: each token generated so far (not the prompt's) lowered by frequency x its count,
            # and by presence once (transformers has no processor of these).
            counts = torch.bincount(torch.tensor(self.tokens, device=logits.device), minlength=logits.shape[-1])
            logits = logits - (sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0))[None]
        if sampling.constraint is not None:  # last: the grammar's mask, over what the rest made of the logits
            if self.matcher is None:
                self.matcher = sampling.constraint.new_matcher()
            logits = constraints.mask(self.matcher, logits)
        if sampling.thinking is not None:  # the budget spent: the end of the thinking, forced
            self.thought = self.thought or sampling.thinking.counter()
            forced = self.thought.forced_token()
            if forced is not None:
                logits = torch.full_like(logits, float("-inf")).index_fill_(-1, to_device([forced], logits.device), 0.0)
        # vLLM's masks may leave no token (with a grammar's too; a grammar alone leaves its logits as they are where it
        # takes none): the row ends (`accept`). Looked at only for rows with those masks: it waits for the device.
        if (sampling.allowed or sampling.bad_words) and not bool(torch.isfinite(logits).any()):
            self.exhausted = True
            logits = torch.zeros_like(logits)
        return logits

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's masks, first as in vLLM: every token outside `allowed_token_ids` at -inf; and each bad word's last
        token where the tokens generated so far (not the prompt's, as vLLM matches them) end with the rest of it."""
        sampling = self.sampling
        if sampling.allowed:
            if self.barred is None:
                self.barred = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
                self.barred[to_device(list(sampling.allowed), logits.device)] = False
            logits = logits.masked_fill(self.barred, float("-inf"))
        tokens = self.tokens
        banned = [word[-1] for word in sampling.bad_words
                  if len(word) == 1 or (len(word) <= len(tokens) + 1 and tuple(tokens[1 - len(word):]) == word[:-1])]
        if banned:
            logits = logits.index_fill(-1, to_device(banned, logits.device), float("-inf"))
        return logits

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of a sampled row from its `[1, V]` float logits, as `model.generate`'s
        sampling draws it (transformers' own warpers in its order, this row's generator)."""
        sampling = self.sampling
        if sampling.temperature != 1.0:
            logits = TemperatureLogitsWarper(sampling.temperature)(None, logits)
        if sampling.top_k > 0:
            logits = TopKLogitsWarper(sampling.top_k)(None, logits)
        if sampling.top_p < 1.0:
            logits = TopPLogitsWarper(sampling.top_p)(None, logits)
        if sampling.min_p > 0.0:
            logits = MinPLogitsWarper(sampling.min_p)(None, logits)
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator).view(())

    def accept(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        """Take the token chosen; stream the text it completes; finish on end of sequence, a stop
        string or the length (the caller then calls the job's `row_done`). A row whose masks left no token to
        choose (`process`) takes none and ends there, a "stop" as where a grammar is complete."""
        if self.exhausted:
            self.job.emit(self, self.text.complete())
            return
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.top.append(top)
        self.job.emit(self, self.text.add(token))
        if self.thought is not None:
            self.thought.accept(token)
        if self.matcher is not None and not self.finished:  # the grammar complete (or failed): the row ends
            self.matcher.consume_token(token)
            if self.matcher.is_error():
                logging.getLogger("ortmodule.serving").warning("structured output: the grammar's matcher failed "
                                                               "(the row ends there): %s", self.matcher.get_error())
            if self.matcher.is_stopped() or self.matcher.is_error():
                self.job.emit(self, self.text.complete())
        if not self.finished and len(self.tokens) >= self.sampling.max_tokens:
            self.job.emit(self, self.text.end())

    def unsent(self) -> tuple[Ids, list[tuple[int, float, list]] | None]:
        """The tokens a stream has not carried yet, and their (token, log-probability, top alternatives)
        where the request asks for log-probabilities (None where not)."""
        tokens = self.tokens[self.sent :]
        scored = None
        if self.sampling.logprobs is not None:
            scored = list(zip(tokens, self.logprobs[self.sent :], self.top[self.sent :], strict=True))
        self.sent = len(self.tokens)
        return tokens, scored

    def stop(self) -> None:
        """Leave without finishing (the client went away): the job is already answered."""
        self.text.finish_reason = self.text.finish_reason or "abandoned"


def choose_tokens(rows: list[Row], logits: torch.Tensor) -> list[tuple[int, float | None, list | None]]:
    """Each row's next token from its logits `[rows, V]` (greedy: the argmax; sampled: its own
    warpers and generator), with its log-probability and the top-k when the row asks for them (the
    model's own, before a bias or a penalty: vLLM's raw log-probabilities)."""
    logits = logits.float()
    chosen = argmax(logits)
    for i, row in enumerate(rows):
        if row.sampling.alters_logits or not row.sampling.greedy:
            own = row.process(logits[i : i + 1]) if row.sampling.alters_logits else logits[i : i + 1]
            chosen[i] = own[0].argmax() if row.sampling.greedy else row.sample(own)
    wanted = [i for i, row in enumerate(rows) if row.sampling.logprobs is not None]
    picked, tops, tokens = {}, {}, chosen.tolist()
    if wanted:
        index = to_device(wanted, logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index), -1)
        values = logprobs.gather(1, chosen.index_select(0, index)[:, None])[:, 0].tolist()
        k = max(1, max(rows[i].sampling.logprobs for i in wanted))
        top_values, top_ids = (t.tolist() for t in logprobs.topk(k, -1))
        for j, i in enumerate(wanted):
            picked[i] = values[j]
            asked = rows[i].sampling.logprob_ids
            if asked:  # vLLM's logprob_token_ids: the chosen token's, then each of those asked for (once)
                ids = [tokens[i]] + [t for t in dict.fromkeys(asked) if t != tokens[i]]
                tops[i] = list(zip(ids, logprobs[j, to_device(ids, logits.device)].tolist()))
            else:
                tops[i] = list(zip(top_ids[j], top_values[j]))[: rows[i].sampling.logprobs]
    return [(token, picked.get(i), tops.get(i)) for i, token in enumerate(tokens)]
