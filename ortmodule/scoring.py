"""Scoring on the device: continuation log-likelihoods from one forward per batch.

The LM head runs only at the positions that predict a target token, the log-softmax (float32)
and the gather happen on `model.device`, and one small tensor per batch comes back to the host.
"""

from __future__ import annotations

import logging
import math
import operator
import weakref
from collections.abc import Callable, Sequence

import torch

from . import runtime
from .inputs import argmax, int64_tensor, outside_vocabulary, pad_right, to_device, vocabulary_message
from .modeling import OrtModelForCausalLM
from .sharing import KeptPrefixes, common_prefix, packs, shared_prefix_logits, worth_sharing

# Padded tokens per prefill by device (runtime.py's; lm-eval's backends and the server read it here too).
default_token_budget = runtime.default_token_budget

logger = logging.getLogger("ortmodule")


def loglikelihood(
    model: OrtModelForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    starts: Sequence[int],
    targets: Sequence[Sequence[int]],
) -> list[tuple[float, bool]]:
    """Per row: the sum of log p(target) and whether every target is the greedy token.

    Row i's targets are predicted by the logits at positions `starts[i], starts[i] + 1, ...` of the
    padded input (for a row holding context + continuation[:-1], `starts[i] = len(context) - 1`),
    each one of the row's own tokens: a padded one is a ValueError naming it.
    """
    # a caller's own lists (lm-eval's backend passes the tokenizer's ints to loglikelihood_totals): `array`
    # would take True as token 1
    if any(type(t) is bool for row in targets for t in row):
        raise TypeError("target token ids must be integers, got ['bool']")
    return answers(loglikelihood_totals(model, input_ids, attention_mask, starts, targets))


def answers(totals: torch.Tensor) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) per row of `[2, rows]` totals (`loglikelihood_totals`, several
    batches' concatenated): the one device-to-host copy."""
    summary = totals.cpu()
    return [(s, m == 0) for s, m in zip(summary[0].tolist(), summary[1].tolist())]


@runtime.entry_point
@torch.inference_mode()
def loglikelihood_totals(
    model: OrtModelForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    starts: Sequence[int],
    targets: Sequence[Sequence[int]],
    rows_of: Sequence[int] | None = None,
    greedy: bool = True,
) -> torch.Tensor:
    """`loglikelihood`'s answers left on the device, `[2, requests]` float32: per request the
    summed log-probability of its targets and how many of them are not the greedy token. On CUDA
    nothing here waits for the device, so the caller builds its next batch while this one runs.

    A request is a row of the input by default; with `rows_of`, request k reads row `rows_of[k]`,
    so requests that differ only in their targets (a multiple-choice question's one-token
    choices after the same context) share one row, and a position asked for twice reaches the LM
    head once. `greedy=False`: the second answer is not wanted (lm-eval's rolling loglikelihoods),
    so where every position is asked for once no greedy token is computed and it reads 0."""
    counts = _checked_counts(input_ids.shape[0], starts, targets, rows_of)
    starts = _checked_starts(starts, counts, input_ids.shape[-1], "row" if rows_of is None else "request")
    requests, vocab = len(counts), model.package.vocab_size
    flat_targets = _target_ids(targets, vocab)
    device = model.device
    owner = torch.repeat_interleave(torch.arange(requests), torch.tensor(counts))
    at = None
    if rows_of is None or len(set(rows_of)) == len(rows_of):  # no row read twice: every position asked for once
        rows = owner if rows_of is None else torch.as_tensor(rows_of, dtype=torch.int64)[owner]
        cols = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
    else:
        positions: dict[tuple[int, int], int] = {}  # (row, column) -> its place among the logits computed
        at = [positions.setdefault((row, col), len(positions))
              for row, start, n in zip(rows_of, starts, counts) for col in range(start, start + n)]
        rows, cols = torch.tensor(list(positions), dtype=torch.int64).reshape(-1, 2).unbind(1)
        at = None if len(at) == len(positions) else to_device(at, device)
    totals = _Totals(requests, device)
    target, owner = to_device(flat_targets, device), to_device(owner, device)
    if at is not None:  # positions read by several requests: every position's logits first
        logits = model.logits_at(input_ids, attention_mask, rows, cols, upcast=False)  # [distinct positions, V]
        totals.add(logits, target, owner, at, greedy)
    else:  # as they come: a CPU's long rows chunk by chunk, so that no [positions, V] buffer is made
        def add(places: torch.Tensor | None, logits: torch.Tensor) -> None:
            mine = slice(None) if places is None else places
            totals.add(logits, target[mine], owner[mine], None, greedy)

        model.logits_at(input_ids, attention_mask, rows, cols, upcast=False, pieces=add)
    return totals.tensor()


def _target_ids(targets: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """Every request's target ids in one host tensor, checked as one: integers inside the vocabulary
    (one conversion and one vectorised check: a rolling batch holds some 32,000 targets)."""
    ids = [t for row in targets for t in row]
    try:
        flat = int64_tensor(ids)
    except TypeError:  # a float, or no number at all
        kinds = sorted({type(t).__name__ for t in ids} - {"int"})
        raise TypeError(f"target token ids must be integers, got {kinds}") from None
    except OverflowError:  # an id past int64
        raise ValueError(vocabulary_message(max(ids, key=abs), vocab, "target token id")) from None
    bad = outside_vocabulary(flat, vocab)
    if bad.any():
        raise ValueError(vocabulary_message(int(flat[bad][0]), vocab, "target token id"))
    return flat


def _checked_counts(batch: int, starts, targets, rows_of) -> list[int]:
    """The number of targets of each of `loglikelihood_totals`' requests, once the requests are checked
    against a batch of `batch` rows: a ValueError naming what does not fit."""
    requests = batch if rows_of is None else len(rows_of)
    if len(starts) != requests or len(targets) != requests:
        what = "row" if rows_of is None else "entry of rows_of"
        raise ValueError(f"starts and targets need one entry per {what}: {requests}, got {len(starts)} and "
                         f"{len(targets)}")
    if rows_of is not None and any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < batch
                                   for r in rows_of):
        raise ValueError(f"rows_of must hold row indices in [0, {batch})")
    counts = [len(t) for t in targets]
    if not counts:
        raise ValueError("no requests to score")
    if min(counts) == 0:
        raise ValueError(f"{'row' if rows_of is None else 'request'} {counts.index(0)} has no target tokens")
    return counts


def _checked_starts(starts, counts: list[int], width: int, what: str) -> list[int]:
    """`loglikelihood_totals`' starts as ints, each checked against the input's `width` columns with its
    request's number of targets: a TypeError or ValueError naming the request (rather than one about the
    positions made from them, or Python's own about adding to a None)."""
    checked = []
    for i, (start, count) in enumerate(zip(starts, counts)):
        if isinstance(start, bool) or (isinstance(start, torch.Tensor) and start.dtype == torch.bool):
            raise TypeError(f"starts[{i}] must be an int column, got the bool {start!r}")
        try:
            column = operator.index(start)
        except TypeError:
            raise TypeError(f"starts[{i}] must be an int column, got {type(start).__name__} {start!r}") from None
        if column < 0 or column + count > width:
            columns = f"column {column}" if count == 1 else f"columns {column} to {column + count - 1}"
            raise ValueError(f"{what} {i}: starts[{i}] = {column} with {count} target token(s) asks for the logits at "
                             f"{columns}, outside the input's {width} columns")
        checked.append(column)
    return checked


class _Totals:
    """Per request, on the device: the summed log-probability of its targets and how many of them
    are not the greedy token; `tensor` stacks them for the one device-to-host copy."""

    def __init__(self, requests: int, device: torch.device):
        self.sums = torch.zeros(requests, device=device)
        self.missed = torch.zeros(requests, device=device)

    def add(self, logits: torch.Tensor, target: torch.Tensor, owner: torch.Tensor,
            at: torch.Tensor | None = None, greedy: bool = True) -> None:
        """Targets `target[k]` of requests `owner[k]`, predicted by `logits[at[k]]` (`logits[k]`
        without `at`); without `greedy` (and `at`), no greedy token is computed or counted."""
        lse, top = log_normalizers(logits, at=target if not greedy and at is None else None)
        if at is not None:
            lse, top = lse[at], top[at]
            picked = logits[at, target]
        else:
            picked = logits.gather(1, target[:, None]).squeeze(1)
        self.sums.index_add_(0, owner, picked.float() - lse)
        if top is not None:
            self.missed.index_add_(0, owner, (top != target).float())

    def tensor(self) -> torch.Tensor:
        return torch.stack([self.sums, self.missed])


CPU_CHUNK_BYTES = 1 << 22  # float32 work per piece on a CPU: it stays in the cache between passes
CUDA_CHUNK_BYTES = 1 << 28  # on CUDA: few kernel launches, and a large batch's logits are never copied whole
# Per device type: whether the normalizers run as one torch.compile'd reduction (Inductor's kernel reads
# each logit once and writes one float per row; it compiles at its first call, seconds). Off until a
# GPU measures it: on an H200 the fused way's float32 conversion and log-softmax took about 35 of a
# rolling batch's 195 ms (docs/measurements.md, session 58); benchmarks/profile_gpu.py
# `--compiled-normalizers` and benchmarks/log_normalizers.py `--compiled` time it.
COMPILED_NORMALIZERS = {"cpu": False, "cuda": False}
_compiled: dict[bool, Callable] = {}  # per `greedy`: the compiled reduction, made at first use


def log_normalizers(logits: torch.Tensor, fused: bool | None = None, at: torch.Tensor | None = None,
                    compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of `[positions, V]` logits: the log of its softmax's denominator (float32, so that
    `logit - normalizer` is the float32 log-probability whatever the logits' precision) and its
    greedy token.

    `torch.logsumexp` is a composite (max, subtract, exp, sum, log: five passes over its input,
    two of them writing a tensor as large), so on a CPU it runs on pieces that stay in the cache
    (`CPU_CHUNK_BYTES`: about 3x faster than on 256 MB pieces, docs/measurements.md), and on CUDA
    `torch.log_softmax` in float32 runs instead: one kernel per piece that reads the half-precision
    logits and writes the float32 log-probabilities, from which the normalizer is read at the
    greedy token (`logit - log-probability`, there close to 0, so exact to float32's rounding).
    `fused` picks the way regardless of the device (the tests check both on a CPU). `compiled`
    (default: `COMPILED_NORMALIZERS` for the device) runs both reductions as one compiled kernel
    instead (`compiled_normalizers`). `at`: per row, the column to read the fused way's normalizer
    at instead (the target), and no greedy token is computed (None): an argmax pass over the logits
    saved where nobody reads it."""
    if COMPILED_NORMALIZERS.get(logits.device.type, False) if compiled is None else compiled:
        try:
            return compiled_normalizers(logits, greedy=at is None)
        except Exception as e:  # noqa: BLE001  no compiler where it runs (Triton, a C++ compiler): the other way
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e):
                raise
            COMPILED_NORMALIZERS[logits.device.type] = False  # a compilation takes seconds: not tried again
            logger.warning("ortmodule: scoring's compiled normalizers failed on %s, so they run uncompiled from now "
                           "on (scoring.COMPILED_NORMALIZERS). %s: %s", logits.device.type, type(e).__name__, e)
    greedy = argmax(logits) if at is None else None
    if not (logits.device.type == "cuda" if fused is None else fused):
        chunk = max(1, CPU_CHUNK_BYTES // (4 * logits.shape[-1]))
        return torch.cat([torch.logsumexp(part.float(), dim=-1) for part in logits.split(chunk)]), greedy
    chunk = max(1, CUDA_CHUNK_BYTES // (4 * logits.shape[-1]))
    parts = []
    for part, top in zip(logits.split(chunk), (greedy if at is None else at)[:, None].split(chunk)):
        log_probs = torch.log_softmax(part, dim=-1, dtype=torch.float32)
        parts.append((part.gather(1, top).float() - log_probs.gather(1, top)).squeeze(1))
    return torch.cat(parts), greedy


def compiled_normalizers(logits: torch.Tensor, greedy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log_normalizers` as one `torch.compile`d function (dynamic shapes: one compilation per
    dtype, not per batch): float32 `logsumexp` and, with `greedy`, `argmax`, which Inductor fuses
    into reductions that read the logits without writing anything per logit. Its first call
    compiles (seconds; Triton on CUDA, a C++ compiler on a CPU)."""
    if greedy not in _compiled:
        def reduce(x):
            return torch.logsumexp(x.float(), dim=-1), x.argmax(-1) if greedy else None

        _compiled[greedy] = torch.compile(reduce, dynamic=True)
    return _compiled[greedy](logits)


@runtime.entry_point
@torch.inference_mode()
def grouped_loglikelihood_totals(
    model: OrtModelForCausalLM, rows: list[Ids], groups: list[int], starts: list[int], targets: list[Ids],
    rows_of: Sequence[int] | None = None, kept: KeptPrefixes | None = None,
) -> torch.Tensor:
    """`loglikelihood_totals` for rows whose groups share a prefix (a question's context and its
    choices, or the few-shot examples that every question of a subject starts with): each group's
    prefix runs once, the rest of each row after it (`shared_prefix_logits`). Same results as on
    the padded rows. `groups` is per row; `starts` and `targets` are per request, and with
    `rows_of` (as in `loglikelihood_totals`) request k reads row `rows_of[k]`, so that requests
    that differ only in their targets share a row and its logits. `kept`: prefixes kept between calls
    (`sharing.KeptPrefixes`: a group's prefix that an earlier call ran starts from its KV)."""
    device = model.device
    rows_of = range(len(rows)) if rows_of is None else rows_of
    positions: list[set[int]] = [set() for _ in rows]
    for k, row in enumerate(rows_of):
        positions[row].update(range(starts[k], starts[k] + len(targets[k])))
    needed = [sorted(p) for p in positions]
    if not all(needed):
        raise ValueError(f"row {[bool(n) for n in needed].index(False)} is read by no request (rows_of)")
    pair_of = {key: n for n, key in enumerate((row, p) for row, ps in enumerate(needed) for p in ps)}
    asked: list[list[tuple[int, int]]] = [[] for _ in pair_of]  # per pair: (target token, request)
    for k, row in enumerate(rows_of):
        for offset, token in enumerate(targets[k]):
            asked[pair_of[row, starts[k] + offset]].append((token, k))
    totals = _Totals(len(targets), device)
    for pairs, logits in shared_prefix_logits(model, rows, groups, needed, kept):
        at = [i for i, pair in enumerate(pairs) for _ in asked[pair]]
        wanted = [entry for pair in pairs for entry in asked[pair]]
        totals.add(logits, to_device([token for token, _ in wanted], device),
                   to_device([k for _, k in wanted], device), to_device(at, device))
    return totals.tensor()


Ids = list[int]


@runtime.entry_point
@torch.inference_mode()
def score(
    model: OrtModelForCausalLM,
    tokenizer,
    query: str | Ids,
    items: Sequence[str] | Sequence[Ids],
    label_token_ids: Sequence[int] | Sequence[Sequence[int]],
    apply_softmax: bool = False,
    item_first: bool = False,
    token_budget: int = 8192,
    reuse_prefix: bool | None = None,
    temperature: float = 1.0,
) -> list[list[float]]:
    """SGLang's Generative Score API: per item, the probability of each label token right after
    the prompt `query + item` (`item + query` with `item_first`), in label order.

    Text is joined first and then tokenized (with the tokenizer's special tokens); token ids are
    concatenated. `label_token_ids` is one list for every item, or (as SGLang 0.5.23 takes it) a list per
    item. Without `apply_softmax` a score is the full-vocabulary probability; with it, a softmax over the
    item's labels of their log-probabilities divided by `temperature` (SGLang's; other than 1 only with
    `apply_softmax`). Prefill only: the prompts run right-padded in batches of at most `token_budget`
    tokens, the LM head only at each prompt's last token, log-softmax and gather on the device, one copy
    to the host at the end.

    `reuse_prefix` runs the prompts' shared first tokens once and the rest over a copy of its
    KV cache; None decides by the work saved (`worth_sharing`: by the model's measured costs, timed once
    the model's calls have held 16,384 tokens, and by token counts before; `prefix_reuse`).
    No items give no scores (as SGLang answers them), once `temperature` is checked.
    """
    _check_switches(apply_softmax=apply_softmax, item_first=item_first, reuse_prefix=reuse_prefix)
    if isinstance(items, Sequence) and not isinstance(items, (str, bytes)) and len(items) == 0:
        _check_temperature(temperature, apply_softmax)
        return []
    prompts = prompts_of(tokenizer, query, items, item_first)
    if isinstance(label_token_ids, torch.Tensor):  # 1-D: one list for every item; 2-D: a list per item
        label_token_ids = label_token_ids.tolist()
    if isinstance(label_token_ids, (str, bytes)) or not isinstance(label_token_ids, Sequence):  # `[id]`, not `id`
        raise TypeError(f"label_token_ids must be a list of token ids (or a list per item), got "
                        f"{type(label_token_ids).__name__}")
    per_item = bool(label_token_ids) and not isinstance(label_token_ids[0], int) \
        and isinstance(label_token_ids[0], Sequence)
    lists = [checked_labels(labels, model.package.vocab_size) for labels in
             (label_token_ids if per_item else [label_token_ids])]
    if per_item and len(lists) != len(prompts):
        raise ValueError(f"label_token_ids has {len(lists)} lists for {len(prompts)} items: give one list per item, "
                         "or one list for all")
    _check_temperature(temperature, apply_softmax)
    check_prompts(prompts, model.package.vocab_size, model.package.context_length)
    union = sorted({t for labels in lists for t in labels})
    column = {t: i for i, t in enumerate(union)}
    table = label_logprobs(model, [prompts], union, token_budget, reuse_prefix).cpu().tolist()  # the one copy
    rows = lists if per_item else lists * len(prompts)
    return [label_probabilities([values[column[t]] for t in row], apply_softmax, temperature)
            for values, row in zip(table, rows, strict=True)]


def _check_switches(**switches) -> None:
    """score's on/off arguments: a bool (`reuse_prefix` None too). Text such as "false" would otherwise count as
    on, and `reuse_prefix` as one choice per character (label_logprobs' per-request form)."""
    for name, value in switches.items():
        if isinstance(value, (str, bytes)) or (name == "reuse_prefix" and value is not None
                                               and not isinstance(value, bool)):
            allowed = "True, False or None" if name == "reuse_prefix" else "a bool"
            raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")


def _check_temperature(temperature, apply_softmax: bool) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"temperature must be finite and greater than zero, got {temperature!r}")
    if temperature != 1 and not apply_softmax:
        raise ValueError("temperature requires apply_softmax=True (it scales the softmax over the labels)")


def label_probabilities(logprobs: list[float], apply_softmax: bool, temperature: float = 1.0) -> list[float]:
    """A prompt's label probabilities from their log-probabilities: SGLang's and vLLM's rule, a softmax over
    the labels of the log-probabilities over `temperature` (centered first), or each one's own."""
    if not apply_softmax:
        return [math.exp(value) for value in logprobs]
    top = max(logprobs)
    weights = [math.exp((value - top) / temperature) for value in logprobs]
    total = sum(weights)
    return [weight / total for weight in weights]


def check_prompts(prompts: list[Ids], vocab: int, limit: int) -> None:
    """Name the first item whose prompt holds something other than a token id of the vocabulary
    (a bool, a float, an id out of range however large) or is too long."""
    for i, prompt in enumerate(prompts):
        if len(prompt) > limit:
            raise ValueError(f"item {i}: the prompt has {len(prompt)} tokens, over the model's context length {limit}")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"item {i}: token ids must be integers, got {t!r}")
        bad = outside_vocabulary(prompt, vocab)
        if bad is not None:
            raise ValueError(f"item {i}: {vocabulary_message(bad, vocab)}")


# How many tokens a model's calls with a prefix to decide on may score by token counts before
# `prefix_reuse` times its costs: the timing takes about as long as a prefill of some 20,000 tokens
# (23 s for SmolLM2-135M on 2 vCPUs, 130 s for a 0.6B model), so a few small calls never pay it and
# a stream of them pays it once, after about as much work as it costs (a ski rental). Either way the
# numbers are the same to float rounding; only the time of a call may differ.
UNTIMED_TOKENS = 16384
_untimed_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per model, scored without costs


def prefix_reuse(model: OrtModelForCausalLM, requests: list[list[Ids]], token_budget: int,
                 reuse_prefix: bool | None) -> list[bool]:
    """Per request, whether `label_logprobs` runs its prompts' shared prefix once: as
    `reuse_prefix` says, where the prompts share one (a request of one prompt shares nothing), or,
    for None, where the model's measured costs say it pays (`worth_sharing`). Timing the costs takes
    seconds to minutes the first time on a machine, so where no request's prompts share a prefix they
    are not asked for, and until the model has them (`measured_costs(measure=False)`) calls decide by
    token counts while the model's calls so far hold fewer than `UNTIMED_TOKENS` tokens."""
    if reuse_prefix is not None or not any(map(_has_prefix, requests)):
        return [bool(reuse_prefix) and _has_prefix(prompts) for prompts in requests]
    costs = model.measured_costs(measure=False)
    if costs is None:
        scored = _untimed_tokens.get(model, 0) + sum(len(p) for prompts in requests for p in prompts)
        _untimed_tokens[model] = scored
        if scored >= UNTIMED_TOKENS:
            costs = model.measured_costs()
    rows, packed = sum(len(r) for r in requests), packs(model)
    choices = []
    for prompts in requests:
        # A run's fixed cost is shared by the rows of the requests that run together.
        together = min(rows, max(1, token_budget // max(len(p) for p in prompts)))
        choices.append(len(prompts) > 1 and worth_sharing(prompts, [len(p) - 1 for p in prompts], costs, together,
                                                          packed))
    return choices


def _has_prefix(prompts: list[Ids]) -> bool:
    """Whether a request's prompts have a shared prefix to run once: several prompts that begin alike."""
    return len(prompts) > 1 and common_prefix(prompts) > 0


@runtime.entry_point
def label_logprobs(
    model: OrtModelForCausalLM, requests: list[list[Ids]], labels: Ids, token_budget: int,
    reuse_prefix: bool | None | Sequence[bool],
) -> torch.Tensor:
    """log p(label | prompt) for every prompt of every request, in order: `[prompts, labels]`
    float32 on the device. Requests whose prompts share a prefix worth reusing (`prefix_reuse`'s
    choice for `reuse_prefix`, or per request the choices given) run it once, several requests'
    prefixes in one prefill and their items in one run over copies of their KV caches
    (`_shared_logprobs`); the prompts of all the other requests, and of a request chosen whose
    prompts share no token, go through batched prefills together."""
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    if reuse_prefix is None or isinstance(reuse_prefix, bool):
        reuse_prefix = prefix_reuse(model, requests, token_budget, reuse_prefix)
    elif len(reuse_prefix) != len(requests):
        raise ValueError(f"reuse_prefix has {len(reuse_prefix)} choices for {len(requests)} requests")
    else:  # a choice per request (the server's): prompts that share no token have no prefix to run once
        reuse_prefix = [bool(reuse) and _has_prefix(prompts) for prompts, reuse in zip(requests, reuse_prefix)]
    out = torch.empty(sum(len(r) for r in requests), len(labels), device=model.device)
    batched, shared, start = [], [], 0
    for prompts, reuse in zip(requests, reuse_prefix):
        if reuse:
            shared.append((start, prompts))
        else:
            batched += [(i, p) for i, p in enumerate(prompts, start)]
        start += len(prompts)
    if shared:
        _shared_logprobs(model, shared, labels, token_budget, out)
    if batched:
        rows = to_device([i for i, _ in batched], model.device)
        out[rows] = _batched_logprobs(model, [p for _, p in batched], labels, token_budget)
    return out


def prompts_of(tokenizer, query, items, item_first: bool) -> list[Ids]:
    """Token ids of every prompt; text is joined before tokenizing, as SGLang does."""
    if isinstance(items, str):  # SGLang takes one text item as it is
        items = [items]
    if isinstance(items, bytes) or not isinstance(items, Sequence):
        raise TypeError(f"items must be a list of strings or of token id lists, got {type(items).__name__}")
    if len(items) == 0:
        raise ValueError("items is empty: give at least one item to score")
    if isinstance(query, str):
        bad = next((i for i, item in enumerate(items) if not isinstance(item, str)), None)
        if bad is not None:
            raise TypeError(f"query is text, so every item must be text too: item {bad} is {type(items[bad]).__name__}")
        if tokenizer is None:
            raise ValueError("text query and items need a tokenizer")
        texts = [item + query if item_first else query + item for item in items]
        prompts = [list(ids) for ids in tokenizer(texts)["input_ids"]]
    else:
        query = _token_ids(query, "query")
        bad = next((i for i, item in enumerate(items) if isinstance(item, str)), None)
        if bad is not None:
            raise TypeError(f"query is token ids, so every item must be token ids too: item {bad} is text")
        items = [_token_ids(item, f"item {i}") for i, item in enumerate(items)]
        prompts = [item + query if item_first else query + item for item in items]
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise ValueError(f"item {empty}: the prompt has no tokens")
    return prompts


def _token_ids(value, name: str) -> Ids:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of token ids, got {type(value).__name__}")
    bad = next((v for v in value if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise TypeError(f"{name} must hold integer token ids, got {bad!r}")
    return list(value)


def checked_labels(label_token_ids, vocab: int) -> Ids:
    labels = _token_ids(label_token_ids, "label_token_ids")
    if not labels:
        raise ValueError("label_token_ids is empty: give the token ids to score")
    bad = outside_vocabulary(labels, vocab)
    if bad is not None:
        raise ValueError(vocabulary_message(bad, vocab, "label token id"))
    return labels


def length_batches(lengths: Sequence[int], width: int, budget: int, scored: Sequence[int] | None = None,
                   most_scored: int | None = None, spread: float = 0.0):
    """Indices of the prompts in batches, longest first, each at most `budget` padded tokens
    (a lone prompt longer than the budget gets a batch of its own). With `scored` (positions each
    prompt needs logits at), a batch also holds at most `most_scored` of them; with `spread`, a batch's
    shortest prompt is at least `spread` x its longest (the padding at most 1 / spread - 1 of the tokens)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    positions = 0
    for i in order:
        longest = lengths[batch[0]] + width if batch else lengths[i] + width
        more = scored[i] if scored is not None else 0
        too_many = most_scored is not None and positions + more > most_scored
        if batch and ((len(batch) + 1) * longest > budget or too_many or lengths[i] + width < spread * longest):
            yield batch
            batch, positions = [], 0
        batch.append(i)
        positions += more
    if batch:
        yield batch


# pooled_hidden_states' batches: each prompt at least this share of its batch's longest. Texts to embed come in
# any mix of lengths (a sentence, a page), and a batch padded to its longest row pays for every pad (on the
# real SmolLM2 and 512 sentences of 5-90 tokens, 8,192-token batches held 2.06x their tokens, at 0.75 1.15x).
EMBED_SPREAD = 0.75
POOLINGS = ("LAST", "MEAN", "CLS")


def pooled_hidden_states(model: OrtModelForCausalLM, prompts: list[Ids], token_budget: int,
                         pooling: str = "LAST") -> torch.Tensor:
    """Each prompt's final norm outputs (the LM head's inputs) pooled, `[prompts, hidden]` float32 on the device:
    at its last token (`LAST`: what a decoder's next token is read from; vLLM's and sentence-transformers'
    last-token pooling of decoder embedding models), their mean over its tokens (`MEAN`) or at its first
    (`CLS`). One run per batch of at most `token_budget` padded tokens of the decoder without its LM head
    (`model.model`, backbone.py: no logits are computed). Not normalized."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    device = model.device
    out = None
    backbone = model.model
    for batch in length_batches([len(p) for p in prompts], 0, token_budget, spread=EMBED_SPREAD):
        ids, mask = pad_right([prompts[i] for i in batch])
        states = backbone(to_device(ids, device), attention_mask=to_device(mask, device), use_cache=False,
                          return_dict=True).last_hidden_state
        if out is None:
            out = torch.empty(len(prompts), states.shape[-1], device=device)
        if pooling == "MEAN":
            weights = to_device(mask / mask.sum(1, keepdim=True), device)
            pooled = torch.einsum("bt,bth->bh", weights, states.float())
        else:
            at = to_device(mask.sum(1) - 1 if pooling == "LAST" else torch.zeros(len(batch), dtype=torch.long), device)
            pooled = states[torch.arange(len(batch), device=device), at].float()
        out[to_device(batch, device)] = pooled
    return out


def logit_positions(model: OrtModelForCausalLM, logit_bytes: int = 1 << 30) -> int:
    """How many positions' logits (as the decoder computes them) fit in `logit_bytes`."""
    itemsize = model.decoder.head_dtype.itemsize
    return max(1, logit_bytes // (model.package.vocab_size * itemsize))


def _gather(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).index_select(1, labels)


def _batched_logprobs(model, prompts: list[Ids], labels: Ids, budget: int) -> torch.Tensor:
    """Label log-probabilities `[items, labels]` on the device: one prefill per batch."""
    device = model.device
    label_ids = to_device(labels, device)
    out = torch.empty(len(prompts), len(labels), device=device)
    for batch in length_batches([len(p) for p in prompts], 0, budget):
        # On the host: logits_at checks the batch and its positions there and copies them up
        # without waiting for the device (the previous batch may still run).
        ids, mask = pad_right([prompts[i] for i in batch])
        logits = model.logits_at(ids, mask, torch.arange(len(batch)), mask.sum(1) - 1, upcast=False)
        out[to_device(batch, device)] = _gather(logits, label_ids)
    return out


def _shared_logprobs(model, requests: list[tuple[int, list[Ids]]], labels: Ids, budget: int, out: torch.Tensor):
    """Label log-probabilities at each prompt's last token into `out` (rows from each request's
    first index), each request's shared prefix run once: a request's prompts in pieces of at most
    `budget` padded tokens, pieces of several requests together in one prefill of their prefixes and
    one run of the rest (`shared_prefix_logits`, a group per piece), a run whose prefixes the run
    before prefilled starting from their KV (`KeptPrefixes`)."""
    label_ids = to_device(labels, model.device)
    kept = KeptPrefixes()  # a query's KV for all its runs: a long query's prefill once, not once a run
    pieces = []  # (rows of `out`, prompts, longest prompt)
    for first, prompts in requests:
        prefix = common_prefix(prompts)
        for batch in length_batches([len(p) - prefix for p in prompts], prefix, budget):
            chosen = [prompts[i] for i in batch]
            pieces.append(([first + i for i in batch], chosen, max(map(len, chosen))))
    for run in _packed(pieces, budget):
        rows = [prompt for piece in run for prompt in piece[1]]
        groups = [g for g, piece in enumerate(run) for _ in piece[1]]
        where = [row for piece in run for row in piece[0]]  # a pair is a row here: one position each
        for pairs, logits in shared_prefix_logits(model, rows, groups, [[len(r) - 1] for r in rows], kept):
            out[to_device([where[p] for p in pairs], model.device)] = _gather(logits, label_ids)


def _packed(pieces: list[tuple], budget: int) -> list[list[tuple]]:
    """Pieces (rows, prompts, longest) in runs of at most `budget` padded tokens (all rows at the
    longest prompt's width), longest first; a piece is never split."""
    runs: list[list[tuple]] = []
    rows = width = 0
    for piece in sorted(pieces, key=lambda piece: -piece[2]):
        if runs and (rows + len(piece[1])) * max(width, piece[2]) <= budget:
            runs[-1].append(piece)
            rows += len(piece[1])
            width = max(width, piece[2])
        else:
            runs.append([piece])
            rows, width = len(piece[1]), piece[2]
    return runs
