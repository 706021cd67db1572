"""lm-eval backend: `OrtModuleLM`, registered as `ortmodule` when this module is imported.

It is lm-eval's own `HFLM` with an ONNX GenAI package underneath. It overrides only what it
must: config and model built from the package, `max_length` from `genai_config.json`, model info
without network calls, the texts' encoding (encoding.py: each text once, batched on every core,
on CUDA beside the device's work), and loglikelihood scoring, which goes through
`ortmodule.loglikelihood` so that only the continuation's positions reach the LM head and the
log-softmax and gather run on the device, with one small copy to the host per call.
"""

from __future__ import annotations

import atexit
import copy
import functools
import inspect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.models.utils_hf import get_dtype
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from . import extend, graph, hf, hub, nbits, runtime, shared_prompts
from .encoding import encode_as_tok_encode, encode_pairs_as_tok_encode, hflm_request, request_waves
from .hf import build_config
from .inputs import pad_right
from .modeling import OrtModelForCausalLM
from .package import read_package
from .scoring import (
    answers,
    default_token_budget,
    grouped_loglikelihood_totals,
    length_batches,
    logit_positions,
    loglikelihood_totals,
)
from .sharing import KeptPrefixes, common_prefix, packs, prefix_groups, worth_sharing

logger = logging.getLogger(__name__)


class ModelArgsError(ValueError, TypeError):
    """A model arg the backend cannot take, named (a ValueError, and a TypeError where Python's would
    be one: an unknown or repeated argument); `ortmodule-eval` prints it without a traceback."""


def checked_loading_options(options: dict) -> None:
    """`OrtModelForCausalLM`'s loading options among the model args, checked as it checks them, before the
    package loads: a bad one is a ModelArgsError, which `ortmodule-eval` prints in one line."""
    try:
        graph.checked_rewrite(options.get("rewrite_lm_head", True))
        nbits.checked_choice(options.get("quantized_prefill"))
        extend.checked_attention(options.get("prefill_attention"))
        # the kind only; on a CPU the warning that provider options do nothing comes as the model loads
        runtime.checked_options(None, options.get("provider_options"), torch.device("cuda"))
    except (ValueError, TypeError) as e:
        raise ModelArgsError(str(e)) from None


def _sharing_choice(value) -> bool | str:
    """`share_contexts`: "auto" (where `sharing.worth_sharing` says it saves time, from this
    model's measured costs), or always / never; lm-eval passes model_args as strings."""
    if isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key not in ("auto", "true", "false"):
        raise ModelArgsError(f"share_contexts must be auto, true or false, got {value!r}")
    return "auto" if key == "auto" else key == "true"


def _sharing_at_load(share: bool | str, model) -> bool | str:
    """`share_contexts` once the model is loaded. `auto` on CUDA does not share: there the extend
    run has lost to the padded rows on every lm-eval shape measured (an H100: HellaSwag-shaped 1.8-2.4x
    slower, MMLU and ARC 1.1-1.2x; docs/measurements.md, 2026-11-25), and the cost model chose it on
    HellaSwag. Elsewhere the costs are timed (or read from the disk: kept_costs.py) now, as `ortmodule
    serve` does, so that the timing runs (about 30 s for SmolLM2-135M on 2 vCPUs the first time on a
    machine) are not spent inside the first evaluation."""
    if share != "auto" or not isinstance(model, OrtModelForCausalLM):
        return share
    if model.device.type == "cuda":
        return False
    model.measured_costs()
    return share


def positive_int(value, name: str) -> int | None:
    """A positive int model arg (lm-eval passes model_args as strings), or None when not given."""
    if value is None:
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ModelArgsError(f"{name} must be a positive integer, got {value!r}")
    return number


def _chunk_arg(value) -> int | None:
    """The `prefill_chunk` model arg: None or "auto" (by device), else a count of tokens (0: off)."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise ModelArgsError(f"prefill_chunk must be auto, 0 (off) or a positive number of tokens, got {value!r}")
    return int(str(value).strip())


def padded_width(length: int, multiple: int, limit: int) -> int:
    """`length` rounded up to a multiple of `multiple`, unless that would pass `limit`."""
    rounded = -(-length // multiple) * multiple
    return rounded if rounded <= limit else length


def row_lengths(keys, multiple: int, limit: int) -> tuple[list[int], list[int]]:
    """Per (row, start) key: the width its batch gives it (`padded_width`, so that a token budget
    holds for the padded batches) and the positions it scores."""
    return [padded_width(len(row), multiple, limit) for row, _ in keys], [len(row) - start for row, start in keys]


def pad_within(rows: list[list[int]], pad: int, multiple: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pad_right` to the longest row's `padded_width`."""
    return pad_right(rows, pad, padded_width(max(len(row) for row in rows), multiple, limit))


def context_groups(requests, rows, starts) -> list[list[int]]:
    """Indices of tokenized requests that share a context and could score it once: the rows of a
    group start alike and are not all one row."""
    by_context: dict[tuple, list[int]] = {}
    for i, (_, context, _) in enumerate(requests):
        by_context.setdefault(tuple(context), []).append(i)
    # Rows cut on the left to max_length by different amounts (continuations of different
    # lengths after a long context) no longer start alike: those run batched. So do groups
    # whose rows are all one row (one-token continuations): the batched prefill runs it once.
    return [group for group in by_context.values()
            if len(group) > 1 and common_prefix([rows[i] for i in group]) > 0
            and len({(tuple(rows[i]), starts[i]) for i in group}) > 1]


# A batch takes more shared contexts (`group_batches`) or padded rows (`fixed_batch_end`) than lm-eval's
# batch size counts while its work stays under this many tokens: on a CPU a run costs some 48 (a prefill)
# to 96 (an extend run) tokens' work beyond its tokens (shared_prompts.RUN_TOKENS, EXTEND_TOKENS), so a
# batch of two short questions spent most of its time on its two runs, and at lm-eval's default batch
# size of 1 every question paid them. `python benchmarks/shared_batches.py` has the figures (SmolLM2-135M
# fp32, 2-vCPU Xeon; docs/measurements.md, session 73); batches of more work gained nothing there.
SMALL_WORK = 512


def small_work(batch_size) -> int:
    """The work under which a batch takes more than a fixed `batch_size` counts (`SMALL_WORK`); none
    under `auto`, whose token budget (the user's, or the device's default) already sizes the batches."""
    return SMALL_WORK if isinstance(batch_size, int) else 0


def group_batches(groups: list[list[int]], works: list[int | None], rows, rows_per_batch, small: int):
    """(request, group) pairs in batches of whole groups: as many groups as hold `rows_per_batch(longest)`
    rows of the batch's longest row, and more while the batch's work (`works`, per group: its prefix once
    and each distinct row's rest, `shared_tokens`) stays under `small` tokens (`small_work`). A question's context
    with its short choices is a few tokens of work: counted by its rows alone, lm-eval's batch of 8 held
    two such questions, and each pair paid two runs (docs/lm-eval.md). A group whose work is None (a
    piece of a few-shot prefix group: `batch_work`) is counted by its rows only."""
    batch: list[tuple[int, int]] = []
    longest, work = 0, 0
    for g, group in enumerate(groups):
        widest = max(longest, *(len(rows[i]) for i in group))
        fits = len(batch) + len(group) <= rows_per_batch(widest) or (
            work is not None and works[g] is not None and work + works[g] <= small)
        if batch and not fits:
            yield batch
            batch, widest, work = [], max(len(rows[i]) for i in group), 0
        batch += [(i, g) for i in group]
        longest = widest
        work = None if work is None or works[g] is None else work + works[g]
    if batch:
        yield batch


def batch_work(requests, rows, starts, row_of, group) -> int | None:
    """A group's work for `group_batches`: its shared tokens where its requests share one context (a
    question's choices), else None: a piece of a prefix group (a subject's few-shot examples) keeps the
    batch it was cut for, since two pieces of one subject in a batch would each run its examples, which
    `KeptPrefixes` runs once for all its batches."""
    if len({tuple(requests[i][1]) for i in group}) > 1:
        return None
    return shared_tokens(rows, starts, row_of, group)


def batch_rows(requests, rows, starts, row_of, group, rows_per_batch, small: int) -> int:
    """The distinct rows of the batches `group_batches` would put `group` in, were the other groups like
    it: what a run's fixed cost is shared by (`worth_sharing`'s price)."""
    firsts = leads(row_of, group)
    width = max(len(rows[i]) for i in firsts)
    most, work = rows_per_batch(width), batch_work(requests, rows, starts, row_of, group)
    together = max(1, most // len(firsts))
    if work is not None:
        together = max(together, small // max(work, 1))
    return len(firsts) * together


def fixed_batch_end(k: int, size: int, widths: list[int], small: int) -> int:
    """Where a padded batch of `size` rows that starts at row `k` ends, the rows' `widths` sorted longest
    first: `size` rows, and more while its padded tokens stay under `small` (`small_work`: eight rows of
    a dozen tokens are a small part of what a run costs)."""
    end = min(k + size, len(widths))
    while end < len(widths) and (end + 1 - k) * widths[k] <= small:
        end += 1
    return end


def distinct_rows(rows, starts) -> list[int]:
    """Per request, the index of its (row, start) among the distinct ones: requests that differ only
    in their targets (one-token choices after one context) share one."""
    index: dict[tuple, int] = {}
    return [index.setdefault((tuple(row), start), len(index)) for row, start in zip(rows, starts)]


def leads(row_of, group) -> list[int]:
    """The first request of each distinct row in `group`."""
    first: dict[int, int] = {}
    for i in group:
        first.setdefault(row_of[i], i)
    return list(first.values())


def prefix_request_groups(rows, starts, row_of, rows_per_batch) -> list[list[int]]:
    """Requests whose rows begin with the same long prefix before their first scored position
    (`sharing.prefix_groups`): the few-shot examples every question of a subject starts with.
    Requests on the same row (`row_of`) count as one row; a group is cut into pieces of as many rows
    as one batch holds (`rows_per_batch` of its longest row), each running the prefix once."""
    alike: dict[int, list[int]] = {}
    for i, row in enumerate(row_of):
        alike.setdefault(row, []).append(i)
    members = list(alike.values())
    groups = []
    for group in prefix_groups([rows[m[0]] for m in members], [starts[m[0]] + 1 for m in members]):
        most = rows_per_batch(max(len(rows[members[k][0]]) for k in group))
        for piece in (group[n : n + most] for n in range(0, len(group), most)):
            if len(piece) > 1:
                groups.append([i for k in piece for i in members[k]])
    return groups


def sharing_groups(requests, rows, starts, row_of, rows_per_batch, worth=None) -> list[list[int]]:
    """The groups of requests that run a shared prefix once: the requests of one context
    (`context_groups`: a question's choices) and rows that begin alike across requests
    (`prefix_request_groups`: a subject's few-shot examples, a task's fixed preamble), each kept if
    `worth(group)` (by default all). Where a prefix group holds context groups (questions with
    several multi-token choices after the same examples), it is taken if it runs fewer tokens than
    they do with its other rows padded (a long preamble before short questions), else the context
    groups are (short examples before long questions); requests in none run padded."""
    worth = worth or (lambda group: True)
    contexts = context_groups(requests, rows, starts)
    context_of = {i: c for c, group in enumerate(contexts) for i in group}
    chosen, dropped = [], set()
    for group in prefix_request_groups(rows, starts, row_of, rows_per_batch):
        inside = {context_of[i] for i in group if i in context_of}
        separately = sum(shared_tokens(rows, starts, row_of, contexts[c]) for c in inside) + sum(
            len(rows[i]) for i in leads(row_of, [i for i in group if i not in context_of]))
        if (not inside or shared_tokens(rows, starts, row_of, group) < separately) and worth(group):
            chosen.append(group)
            dropped |= inside
    return chosen + [group for c, group in enumerate(contexts) if c not in dropped and worth(group)]


def shared_tokens(rows, starts, row_of, group) -> int:
    """Tokens a group's shared run computes: its prefix once, every distinct row's rest after it."""
    firsts = leads(row_of, group)
    prefix = min(common_prefix([rows[i] for i in firsts]), min(starts[i] for i in firsts) + 1)
    return prefix + sum(len(rows[i]) - prefix for i in firsts)


def shared_batches(model, requests, rows, starts, row_of, groups, rows_per_batch, small, progress):
    """`groups` (requests whose rows share a prefix) in batches of whole groups (`group_batches`),
    each through `grouped_loglikelihood_totals`; requests on the same row (`row_of`: one-token
    choices after one context) read it once. Per batch: its requests and their answers on the device."""
    pending, kept = [], KeptPrefixes()  # a subject's examples run once for all its batches
    reading: dict[int, list[int]] = {}  # a distinct row's first request -> every request reading that row
    for group in groups:
        for i in group:
            reading.setdefault(row_of[i], []).append(i)
    works = [batch_work(requests, rows, starts, row_of, group) for group in groups]
    for batch in group_batches([leads(row_of, group) for group in groups], works, rows, rows_per_batch, small):
        chunk = [i for lead, _ in batch for i in reading[row_of[lead]]]
        rows_of = [r for r, (lead, _) in enumerate(batch) for _ in reading[row_of[lead]]]
        pending.append((chunk, grouped_loglikelihood_totals(
            model, [rows[lead] for lead, _ in batch], [g for _, g in batch], [starts[i] for i in chunk],
            [requests[i][2] for i in chunk], rows_of, kept)))
        progress.update(len(chunk))
    return pending


@runtime.entry_point  # its copy to the host waits for the device: never beside another thread's capture
def read_back(keys, pending: list[tuple[list[int], torch.Tensor]], cache_hook) -> list[tuple[float, bool]]:
    """Every request's (loglikelihood, is_greedy) from the answers left on the device, in one copy;
    `keys[i]` (request i's texts, or None) goes to lm-eval's cache hook."""
    results: list = [None] * len(keys)
    if pending:
        order = [i for chunk, _ in pending for i in chunk]
        for i, answer in zip(order, answers(torch.cat([totals for _, totals in pending], dim=1))):
            results[i] = answer
            if keys[i] is not None:
                cache_hook.add_partial("loglikelihood", keys[i], answer)
    return results


def shared_context_groups(lm: OrtModuleLM, requests, rows, starts, row_of) -> list[list[int]]:
    """Requests with the same context, or rows that begin with the same long prefix
    (`sharing_groups`): the groups worth running their prefix once, as `lm`'s `share_contexts` says."""
    if lm._share is False:
        return []
    if lm._share is True:
        return sharing_groups(requests, rows, starts, row_of, lm._rows_per_batch)
    costs, packed, small = lm._model.measured_costs(), packs(lm._model), small_work(lm.batch_size)

    def worth(group: list[int]) -> bool:
        firsts = leads(row_of, group)
        together = batch_rows(requests, rows, starts, row_of, group, lm._rows_per_batch, small)
        return worth_sharing([rows[i] for i in firsts], [starts[i] for i in firsts], costs, together, packed)

    return sharing_groups(requests, rows, starts, row_of, lm._rows_per_batch, worth)


def rolling_totals(lm: OrtModuleLM, requests, disable_tqdm: bool = False) -> list[float]:
    """`HFLM.loglikelihood_rolling`'s answers (lm-eval's disjoint windows of `max_length` tokens,
    the prefix token before the first), with every window of every document scored in one call:
    HFLM batches the windows in document order, each batch padded to its longest window and read
    back before the next is built; here they are batched by length (`_totals_on_device`) and come
    back in one copy. Documents share no context but the prefix token, so none is shared."""
    windows, counts = [], []
    for request in requests:
        mine = [(None, *make_disjoint_window(window)) for window in get_rolling_token_windows(
            token_list=lm.tok_encode(rolling_text(request)), prefix_token=lm.prefix_token_id,
            max_seq_len=lm.max_length, context_len=1)]
        windows += mine
        counts.append(len(mine))
    progress = tqdm(total=len(windows), disable=disable_tqdm or lm.rank != 0, desc="Running rolling windows")
    lm._greedy = False  # lm-eval reads no greedy flag of a rolling window: none is computed
    try:
        pending = lm._totals_on_device(windows, progress, share=False)
    finally:
        lm._greedy = True
    progress.close()
    scores = iter(read_back([None] * len(windows), pending, lm.cache_hook))
    totals = []
    for request, count in zip(requests, counts):
        totals.append(rolling_answer(request, sum(next(scores)[0] for _ in range(count))))
        lm.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
    return totals


def rolling_text(request) -> str:
    """A `loglikelihood_rolling` request's document: its one argument (lm-eval 0.4), or the second of
    ("", text) (lm-eval 0.5's requests, as its `next0.5` branch and 0.5.0.dev1 make them)."""
    return request.args[-1]


def rolling_answer(request, total: float) -> float | tuple[float, bool]:
    """A rolling request's answer in its lm-eval's form: the total (0.4), or (total, False) for 0.5's
    two-argument requests, whose metrics read every answer as loglikelihood's pair."""
    return (total, False) if len(request.args) == 2 else total


def _prefix_text(lm) -> str | None:
    """The text of `lm`'s prefix token (BOS), for `tok_encode`'s rule on texts that start with it."""
    return lm.tokenizer.decode(lm.prefix_token_id) if lm.prefix_token_id is not None else None


def halved_budget(budget: int, shape) -> int:
    """The token budget after a prefill of `shape` ran out of memory: half of the smaller of the two,
    said in a warning (it holds for the rest of the run)."""
    halved = max(1, min(budget, shape[0] * shape[1]) // 2)
    logger.warning("ortmodule: out of memory on a prefill of %d rows x %d tokens; batches now hold at most %d "
                   "padded tokens (token_budget)", shape[0], shape[1], halved)
    return halved


def leave_process_group() -> None:
    """Destroy torch.distributed's default process group, if one is up (as `accelerate launch`
    makes for data parallel). lm-eval never does, and gloo's worker threads still running when the
    interpreter finalizes abort the process at exit ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#190489). Idempotent; logs the rank that left."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
        logger.info("rank %d left torch.distributed's process group", rank)


def _one_evaluation_at_a_time(method):
    """lm-eval backends keep per-run state (batch-size search, caches): a second thread calling
    into the same backend while it runs gets a clear error instead of a race."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not self._running.acquire(blocking=False):
            raise RuntimeError(
                "this OrtModuleLM is already running requests on another thread; use one OrtModuleLM per "
                "thread (they may share one model: OrtModuleLM(pretrained=model, tokenizer=tokenizer))"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            self._running.release()

    return run


class StopSequences(transformers.StoppingCriteria):
    """lm-eval's stop sequences tested for each row on its own. lm-eval's criteria
    (`MultiTokenEOSCriteria`, one per sequence) stop a batch once one sequence has been written by
    every row: rows that end with different sequences (the end-of-sequence token, which lm-eval adds
    to `until`, among them) run the batch to `max_gen_toks`. This one stops a row once its answer can
    no longer change: lm-eval's `generate_until` cuts the row's text (`tok_decode`) at each stop
    sequence in turn, so a row whose text holds a sequence with as many characters after it as two of
    the longest sequences (and a few for a character still being written) has its answer; the row then
    gets pad tokens and, on a CPU, leaves the decode steps (generation.py). A row whose last tokens show
    a sequence its text does not hold (a special token's text, which `tok_decode` leaves out) stops
    at once, with the answer it has when it runs alone under lm-eval's criteria. And once every row's last
    tokens (as many as the longest sequence takes, plus two: lm-eval's own test) have shown a sequence,
    all stop: lm-eval's criteria stop them then or earlier where one sequence is in every row, so a
    batch never runs longer than under them. That moment may come earlier than lm-eval's and cut a row
    whose answer is not fixed yet, only where one stop sequence is a piece of another and the longer
    is being written across the cut: an answer that `hf` gives at some batch sizes only (its criteria
    stop a row by what the other rows of its batch have written)."""

    def __init__(self, lm: HFLM, sequences: list[str], prompt_width: int, batch: int):
        self.lm, self.prompt_width = lm, prompt_width
        self.sequences = [s for s in sequences if s]  # lm-eval's cuts skip an empty one; its criteria stop at it
        self.tested = list(sequences)
        self.window = max((len(lm.tok_encode(s, add_special_tokens=False)) for s in self.sequences), default=0) + 2
        self.margin = 2 * max(map(len, self.sequences), default=0) + 4
        self.seen: set[int] = set()  # rows whose last tokens have shown a sequence
        self.stopped = [False] * batch

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows = [row for row, done in enumerate(self.stopped) if not done] if self.tested else []
        written = input_ids[rows, self.prompt_width :].tolist()
        tails = self.lm.tokenizer.batch_decode([tokens[-self.window :] for tokens in written])
        for row, tokens, tail in zip(rows, written, tails):
            if row not in self.seen and not any(s in tail for s in self.tested):
                continue
            self.seen.add(row)
            text = self.lm.tok_decode(tokens)
            first = min((at for at in map(text.find, self.sequences) if at >= 0), default=-1)
            # A tail that shows a sequence which the answer's text does not hold (a special token's text,
            # which `tok_decode` leaves out, or an empty sequence): lm-eval's criteria stop the row here
            # when it runs alone, so it stops, with the answer it has alone.
            self.stopped[row] = first < 0 or len(text) - first >= self.margin
        if self.tested and all(done or row in self.seen for row, done in enumerate(self.stopped)):
            self.stopped = [True] * len(self.stopped)  # every row has written one: as lm-eval's criteria or earlier
        return torch.tensor(self.stopped, device=input_ids.device)


def generate_stopping_rows(lm: HFLM, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
    """`HFLM._model_generate` (its temperature and sampling defaults), each row stopped on its own
    (`StopSequences`); lm-eval's own where a thinking model's answer follows its end-of-thinking
    token (the stop sequences then apply to the text after it, which the rows have not written yet)."""
    if getattr(lm, "think_end_token", None) is not None:
        return HFLM._model_generate(lm, context, max_length, stop, **generation_kwargs)
    return generate_with_stops(lm, {"input_ids": context}, max_length, stop, **generation_kwargs)


def generate_with_stops(lm: HFLM, inputs: dict, max_length: int, stop: list[str], **generation_kwargs):
    """`lm.model.generate(**inputs)` as lm-eval's `_model_generate` calls it (its temperature and
    sampling defaults), each row stopped on its own (`StopSequences`)."""
    generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
    do_sample = generation_kwargs.get("do_sample")
    if (temperature := generation_kwargs.get("temperature")) == 0.0 and do_sample is None:
        generation_kwargs["do_sample"] = do_sample = False
    if do_sample is False and temperature == 0.0:
        generation_kwargs.pop("temperature", None)
    rows, width = inputs["input_ids"].shape
    criteria = transformers.StoppingCriteriaList([StopSequences(lm, stop, width, rows)])
    with torch.autocast(device_type=lm.device.type, dtype=lm.mixed_precision_dtype,
                        enabled=lm.mixed_precision_dtype is not None):
        return lm.model.generate(**inputs, max_length=max_length, stopping_criteria=criteria,
                                 pad_token_id=lm.tokenizer.pad_token_id, use_cache=True, **generation_kwargs)


# Tokens (a row's prompt and new tokens) that a fixed batch size's `generate_until` batches grow to.
GENERATION_WORK = 8192


def generation_batches(keys: list, order_keys: list, tokens: list[int], size: int | None, budget: int,
                       most: int) -> list[list[int]]:
    """`generate_until`'s batches of request indices, in HFLM's order: requests grouped by their
    generation arguments (`keys`, groups in the order they first come), sorted within a group by
    `order_keys` (HFLM's: longest prompt first). A batch holds as many requests as `budget` tokens
    hold at its first row's `tokens` (its prompt and new tokens: the rows after it need no more), at
    most `most`, and at least a fixed `size` (None: `auto`)."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    batches = []
    for group in groups.values():
        group = sorted(group, key=order_keys.__getitem__)
        k = 0
        while k < len(group):
            rows = max(size or 1, min(most, budget // max(tokens[group[k]], 1)))
            batches.append(group[k : k + rows])
            k += rows
    return batches


def plan_generation(lm: HFLM, requests, widths: list[int], size: int | None) -> list[list[int]]:
    """`generate_until`'s batches (`generation_batches`) for prompts of `widths` tokens: each request's
    tokens its prompt (at most what `max_length` leaves its new tokens) and its `max_gen_toks`, the
    longest prompt first; `size` a fixed batch size (None: `auto`). A fixed size's batch grows while its
    rows stay within `GENERATION_WORK` tokens (or the `token_budget`, if smaller), `auto`'s within the
    token budget; at most `max_batch_size` unless the fixed size is larger."""
    tokens = [min(width, max(lm.max_length - new, 1)) + new
              for width, new in zip(widths, new_tokens(requests, lm.max_gen_toks))]
    order = [(-width, req.args[0]) for width, req in zip(widths, requests)]
    budget = lm.token_budget if size is None else min(lm.token_budget, GENERATION_WORK)
    batches = generation_batches([repr(sorted(req.args[1].items())) for req in requests], order, tokens,
                                 size, budget, lm.max_batch_size or len(requests))
    logger.info("generate_until: %d requests in %d batches of up to %d (%d tokens a batch)",
                len(requests), len(batches), max(map(len, batches), default=0), budget)
    return batches


def run_in_batches(lm: HFLM, method, requests, batches: list[list[int]], disable_tqdm: bool, desc: str) -> list:
    """`method(lm, a batch's requests, True)` for each batch of request indices, in order, with the
    backend's batch size set to the batch's (and restored after): the answers in the requests' order.
    One progress bar over the batches."""
    answers: list = [None] * len(requests)
    before = lm.batch_size_per_gpu
    with tqdm(total=len(requests), disable=disable_tqdm or lm.rank != 0, desc=desc) as progress:
        try:
            for batch in batches:
                lm.batch_size_per_gpu = len(batch)
                for i, answer in zip(batch, method(lm, [requests[i] for i in batch], True), strict=True):
                    answers[i] = answer
                progress.update(len(batch))
        finally:
            lm.batch_size_per_gpu = before
    return answers


def in_generation_batches(method):
    """`method` (HFLM's `generate_until`) run in batches by their work (`plan_generation`):
    lm-eval's `batch_size` counts rows, and a decode step's cost on a CPU and on a GPU is mostly a
    pass over the weights, whatever the rows, so one request at a time (lm-eval's default batch size
    of 1, and HFLM's `auto`, which sizes generation batches for rows of the model's whole context)
    left most of every step unused. On a CPU an fp32 package's rows do not depend on the rows beside
    them, so the answers are those of one request at a time (a 4-bit package's can: ONNX Runtime's
    MatMulNBits kernels, as within HFLM's batches)."""

    @functools.wraps(method)
    def run(lm: OrtModuleLM, requests, disable_tqdm: bool = False):
        if (not isinstance(lm._model, OrtModelForCausalLM) or not requests
                or not all(isinstance(req.args[1], dict) for req in requests)):
            return method(lm, requests, disable_tqdm)  # HFLM's own path (and its errors)
        size, contexts = lm.batch_size_per_gpu, [req.args[0] for req in requests]
        if not getattr(lm, "enable_thinking", False):
            lm._encoded = lm._encode_batched(list(dict.fromkeys(contexts)))
        try:
            widths = [len(lm.tok_encode(context)) for context in contexts]
            batches = plan_generation(lm, requests, widths, size if isinstance(size, int) else None)
            return run_in_batches(lm, method, requests, batches, disable_tqdm, "Running generate_until requests")
        finally:
            lm._encoded = {}

    return run


def new_tokens(requests, default: int) -> list[int]:
    """Each `generate_until` request's `max_gen_toks` (its generation arguments', else `default`)."""
    return [normalize_gen_kwargs(copy.deepcopy(req.args[1]), default)["max_gen_toks"] for req in requests]


# HFLM's own loop, one evaluation at a time, in batches by their work (in_generation_batches); on a CPU a
# few-shot task's examples, which every prompt of its batches begins with, run once for them all
# (shared_prompts.keeping_beginnings).
_generate_until = _one_evaluation_at_a_time(
    shared_prompts.keeping_beginnings(in_generation_batches(HFLM.generate_until)))


def arguments_once(args: dict, additional: dict | None) -> dict:
    """lm-eval's `create_from_arg_string`'s merge of `--model_args` and its own options (`--batch_size`,
    whose default of 1 it always passes, `--max_batch_size`, `--device`): a name in both is a
    ModelArgsError saying which, where Python's TypeError ("multiple values for keyword argument")
    would come from deep inside lm-eval."""
    given = {name: value for name, value in (additional or {}).items() if value is not None}
    twice = sorted(args.keys() & given.keys())
    if twice:
        raise ModelArgsError(f"{', '.join(twice)} given twice: in the model args and as lm-eval's own option "
                             f"({', '.join('--' + name for name in twice)}, which lm-eval's command line passes "
                             "even when left out); give each once, as the option")
    return {**args, **given}


class ArgumentsOnce:
    """lm-eval's ways of making a backend from its model args and its own options, each argument given
    once (`arguments_once`)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls(**arguments_once(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        return cls(**arguments_once(dict(arg_dict), additional_config))


@register_model("ortmodule")
class OrtModuleLM(ArgumentsOnce, HFLM):
    """`lm_eval --model ortmodule --model_args pretrained=PACKAGE_DIR --device cpu` (or cuda, cuda:N).

    Extra model_args: `rewrite_lm_head` (default float32: a half-precision package's LM head in
    float32, graph.py; True: in its own precision), `provider_options` (a dict, from Python),
    `share_contexts` (auto, true, false: run a context shared by several requests once; auto where
    `sharing.worth_sharing` says it saves work, never on CUDA), `token_budget` (padded tokens per
    prefill under `batch_size=auto`; a generation batch's prompts and new tokens), `prefill_chunk`
    (rows in chunks of N tokens; auto: 256 on a CPU, off on CUDA; 0: off), `quantized_prefill` (auto, package, fp32),
    `prefill_attention` (auto, package, onnx: extend.py's prefill graph), `pad_to_multiple_of` (batch
    widths rounded up: few shapes). `pretrained` may be an `OrtModelForCausalLM` (pass `tokenizer=`)."""

    AUTO_MODEL_CLASS = transformers.AutoModelForCausalLM

    def __init__(self, pretrained, device: str | None = None, rewrite_lm_head: bool | str = "float32",
                 provider_options: dict | None = None, share_contexts: bool | str = "auto",
                 token_budget: int | str | None = None, prefill_chunk: int | str | None = None,
                 quantized_prefill: str | None = None, prefill_attention: str | None = None,
                 pad_to_multiple_of: int | str | None = None, **kwargs):
        self._running = threading.RLock()
        self._token_budget = positive_int(token_budget, "token_budget")
        self._pad_multiple = positive_int(pad_to_multiple_of, "pad_to_multiple_of") or 1
        self._encoded: dict[str, list[int]] = {}  # the texts of the loglikelihood call in progress, encoded
        self._greedy = True  # whether the answers count greedy tokens (not for rolling windows)
        self._share = _sharing_choice(share_contexts)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
        self._ort_options = dict(rewrite_lm_head=rewrite_lm_head, provider_options=provider_options,
                                 prefill_chunk=_chunk_arg(prefill_chunk), quantized_prefill=quantized_prefill,
                                 prefill_attention=prefill_attention)
        checked_loading_options(self._ort_options)
        pretrained = str(pretrained) if isinstance(pretrained, Path) else pretrained
        refuse_hflm_options(kwargs)
        super().__init__(pretrained=pretrained, device=device, **kwargs)
        check_max_length(self._max_length, self._model)  # before the sharing choice times the model's runs
        # Tokenizing runs beside the device's work on CUDA, whose host cores idle meanwhile; a CPU's
        # cores run the model, so there every text is encoded before the first batch (one wave).
        self._first_wave = 256 if torch.device(self.device).type == "cuda" else None
        self._share = _sharing_at_load(self._share, self._model)
        # HFLM splits requests across `accelerate launch` processes only when it counts several
        # GPUs; ortmodule's sessions run anywhere, so N CPU processes split the work too.
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            # Before the interpreter finalizes (atexit runs while it is whole), for Python callers
            # too; ortmodule-eval also leaves the group when lm-eval returns.
            atexit.unregister(leave_process_group)
            atexit.register(leave_process_group)
            if self._world_size == 1:
                self._rank = accelerator.process_index
                self._world_size = accelerator.num_processes

    def _get_config(self, pretrained: str, revision: str | None = None, subfolder: str | None = None, **kwargs) -> None:
        self._package = read_package(hub.resolve(pretrained, subfolder or None, revision))  # a folder or a Hub repo
        self._config = build_config(self._package)

    def _create_tokenizer(self, pretrained, tokenizer, **kwargs) -> None:
        """HFLM's, from the package's folder (a Hub repository's package was fetched by `_get_config`)."""
        local = str(self._package.root) if isinstance(pretrained, str) else pretrained
        super()._create_tokenizer(local, tokenizer, **dict(kwargs, revision=None, subfolder=""))

    def _create_model(self, pretrained: str, dtype: str | torch.dtype | None = "auto", **kwargs) -> None:
        check_dtype(dtype, self._package)
        refuse_unknown_args(self, kwargs)
        self._model = OrtModelForCausalLM(self._package, device=self._device, **self._ort_options)

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        if isinstance(self._model, OrtModelForCausalLM):
            return self._model.package.context_length
        return super().max_length

    @_one_evaluation_at_a_time
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """HFLM's, with the tokenizing beside the device's work: the requests go in waves
        (`encoding.request_waves`; one wave on a CPU), a thread encodes each wave's texts once and
        in batches on every core while the earlier waves' batches run, and every wave's answers stay
        on the device until the last has run, then come back in one copy."""
        pairs = [req.args for req in requests]
        if not isinstance(self._model, OrtModelForCausalLM) or getattr(self, "enable_thinking", False):
            self._encoded = self._encode_pairs(pairs)  # HFLM's path (and its errors)
            try:
                return HFLM.loglikelihood(self, requests, disable_tqdm)
            finally:
                self._encoded = {}
        waves = request_waves(pairs, self._first_wave or len(pairs))
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
        pending: list[tuple[list[int], torch.Tensor]] = []
        ahead = ThreadPoolExecutor(1, thread_name_prefix="ortmodule-tokenize")
        try:
            encodings = [ahead.submit(self._encode_pairs, [pairs[i] for i in wave]) for wave in waves]
            for wave, encoding in zip(waves, encodings):
                self._encoded = encoding.result()
                tokenized = [hflm_request(self, *pairs[i]) for i in wave]
                pending += [([wave[j] for j in chunk], totals)
                            for chunk, totals in self._totals_on_device(tokenized, progress)]
        finally:
            ahead.shutdown(cancel_futures=True)
            self._encoded = {}
        progress.close()
        return read_back(pairs, pending, self.cache_hook)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        known = self._encoded.get(string) if add_special_tokens is None and not kwargs else None
        if known is None:
            return super().tok_encode(string, add_special_tokens, left_truncate_len, **kwargs)
        return known[-left_truncate_len:] if left_truncate_len else list(known)

    def _encode_batched(self, texts: list[str]) -> dict[str, list[int]]:
        """`HFLM.tok_encode(text)` of every text, batched on every core (`encoding.encode_as_tok_encode`)."""
        return encode_as_tok_encode(self.tokenizer, texts, self.add_bos_token, _prefix_text(self))

    def _encode_pairs(self, pairs) -> dict[str, list[int]]:
        """`HFLM.tok_encode` of every text `_encode_pair` encodes for (context, continuation) pairs,
        a shared context's tokens once where the tokenizer allows (`encoding.encode_pairs_as_tok_encode`)."""
        return encode_pairs_as_tok_encode(self.tokenizer, pairs, self.add_bos_token, _prefix_text(self))

    @_one_evaluation_at_a_time
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """HFLM's, with the documents encoded first, batched on every core (HFLM: one by one, on one
        core), and on an ortmodule model every window of every document in one call (`rolling_totals`)."""
        self._encoded = self._encode_batched([rolling_text(req) for req in requests])
        try:
            if not isinstance(self._model, OrtModelForCausalLM):
                return HFLM.loglikelihood_rolling(self, requests, disable_tqdm)
            return rolling_totals(self, requests, disable_tqdm)
        finally:
            self._encoded = {}

    generate_until, _model_generate = _generate_until, generate_stopping_rows

    def get_model_info(self) -> dict:
        return {"model_num_parameters": self._model.num_parameters(), "model_dtype": str(self._model.dtype),
                "model_revision": None, "model_sha": ""}

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's semantics (left truncation to max_length + 1, longest first), scored on the device.

        Requests whose rows are the same (one-token continuations after the same context: HFLM's
        logits cache) are computed once. Requests that share a context (a multiple-choice
        question's choices) run it once when that saves time (`sharing.worth_sharing`); the others
        go through batched prefills, `batch_size` rows each, or under `auto` as many rows as the
        token budget holds."""
        if not isinstance(self._model, OrtModelForCausalLM):
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests")
        pending = self._totals_on_device(requests, progress, override_bs)
        progress.close()
        return read_back([key for key, _, _ in requests], pending, self.cache_hook)

    def _totals_on_device(self, requests, progress, override_bs: int | None = None, share: bool = True
                          ) -> list[tuple[list[int], torch.Tensor]]:
        """The answers of tokenized requests, left on the device: per batch, its requests' indices
        and `[2, n]` totals (`share`: contexts shared as `share_contexts` says). On CUDA nothing
        here waits for the device: the host builds the next batch (tokenizes the next wave) meanwhile."""
        rows, starts = _rows_and_starts(requests, self.max_length)
        row_of = distinct_rows(rows, starts)
        shared = shared_context_groups(self, requests, rows, starts, row_of) if share else []
        pending = shared_batches(self._model, requests, rows, starts, row_of, shared, self._rows_per_batch,
                                 small_work(self.batch_size), progress)
        done = {i for group in shared for i in group}
        rest = [i for i in range(len(requests)) if i not in done]
        return pending + self._batched(requests, rows, starts, rest, progress, override_bs)

    @property
    def token_budget(self) -> int:
        """Padded tokens per prefill under `batch_size=auto` (model arg `token_budget`; by default
        `scoring.default_token_budget` of the device), halved when ONNX Runtime runs out of memory."""
        if self._token_budget is None:
            self._token_budget = default_token_budget(self._model.device)
        return self._token_budget

    def _detect_batch_size(self, requests=None, pos: int = 0) -> int:
        """HFLM's batch-size search under `auto` for any HFLM path that still asks (generation's batches
        are cut by `in_generation_batches`), from the token budget: as many rows of the longest length as
        it holds (HFLM's own search would run five prefills of 64 full-length rows with every logit)."""
        if not isinstance(self._model, OrtModelForCausalLM):
            return super()._detect_batch_size(requests, pos)
        length = self.max_length
        if requests:
            _, context, continuation = requests[pos]
            length = len((context + continuation)[-(self.max_length + 1):][:-1])
        return max(1, min(self.max_batch_size, self.token_budget // max(length, 1)))

    def _rows_per_batch(self, width: int) -> int:
        """Rows of `width` tokens a batch holds: `batch_size`, or under `auto` the token budget's."""
        if isinstance(self.batch_size, int):
            return self.batch_size
        return max(1, self.token_budget // max(width, 1))

    def _batched(self, requests, rows, starts, indices, progress, override_bs) -> list[tuple[list[int], torch.Tensor]]:
        """Right-padded batches, longest first (HFLM's order), one prefill each: per batch, its
        requests and their answers on the device (`loglikelihood_totals`). Requests with the same
        row and start (HFLM's logits cache: one-token continuations after one context) share a row."""
        same: dict[tuple, list[int]] = {}
        for i in indices:
            same.setdefault((tuple(rows[i]), starts[i]), []).append(i)
        keys = sorted(same, key=lambda key: (-len(key[0]), key[0]))
        auto = self.batch_size == "auto" and not override_bs
        size = override_bs or (self.batch_size if not auto else None)
        if auto:
            self.batch_sizes = {}
        lengths, scored = row_lengths(keys, self._pad_multiple, self.max_length)
        most_scored = logit_positions(self._model)
        pending, k = [], 0
        while k < len(keys):
            # Under auto, each batch is cut with the budget in force (halved after a failure).
            end = (fixed_batch_end(k, size, lengths, small_work(self.batch_size)) if size is not None
                   else k + len(next(length_batches(lengths[k:], 0, self.token_budget, scored[k:], most_scored))))
            pending += self._run_rows(requests, keys[k:end], same, auto)
            progress.update(sum(len(same[key]) for key in keys[k:end]))
            k = end
        return pending

    def _run_rows(self, requests, keys, same, auto: bool) -> list[tuple[list[int], torch.Tensor]]:
        """One prefill of the distinct rows `keys` for all their requests; under `auto`, an
        allocation failure halves the token budget and runs the rows again in two halves."""
        chunk = [i for key in keys for i in same[key]]
        rows_of = [r for r, key in enumerate(keys) for _ in same[key]]
        ids, mask = pad_within([list(k[0]) for k in keys], self.tokenizer.pad_token_id or 0, self._pad_multiple,
                               self.max_length)
        try:
            totals = loglikelihood_totals(self._model, ids, mask, [keys[r][1] for r in rows_of],
                                          [requests[i][2] for i in chunk], rows_of, self._greedy)
        except RuntimeError as e:
            if not auto or "out of memory." not in str(e) or len(keys) == 1:
                raise
            self._token_budget = halved_budget(self.token_budget, ids.shape)
            half = len(keys) // 2
            return self._run_rows(requests, keys[:half], same, auto) + self._run_rows(requests, keys[half:], same, auto)
        if auto:
            self.batch_sizes.setdefault(0, len(keys))  # the longest rows' batch, as HFLM reports its search
        return [(chunk, totals)]


def _rows_and_starts(requests, max_length: int) -> tuple[list[list[int]], list[int]]:
    """HFLM's rows of tokenized (key, context, continuation) requests (left-truncated to `max_length`
    + 1, the last token dropped) and where each continuation's targets start."""
    rows, starts = [], []
    for _, context, continuation in requests:
        if not context or not continuation:
            raise ValueError("a loglikelihood request needs a non-empty context and continuation")
        if len(continuation) > max_length:
            raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length {max_length}")
        row = (context + continuation)[-(max_length + 1):][:-1]
        rows.append(row)
        starts.append(len(row) - len(continuation))
    return rows, starts


# HFLM's model args for what a PyTorch model loads or computes, which an ONNX package fixed at export.
_FIXED_AT_EXPORT = {"peft": "a PEFT adapter", "delta": "delta weights", "autogptq": "GPTQ weights",
                    "gptqmodel": "GPTQ weights", "gguf_file": "a GGUF file", "quantization_config": "quantization",
                    "tp_plan": "tensor parallelism", "mixed_precision_dtype": "an autocast to another precision"}


def check_max_length(max_length: int | None, model) -> None:
    """The `max_length` model arg against the package's context length, which no run can pass: a longer one
    would cut no context and fail at the first request longer than the package takes, perhaps hours in."""
    limit = model.package.context_length if isinstance(model, OrtModelForCausalLM) else None
    if max_length and limit and max_length > limit:
        raise ModelArgsError(f"max_length={max_length} is over the package's context length {limit} (genai_config's "
                             f"search.max_length, what its KV cache holds): leave it out for {limit}, or give less")


def refuse_hflm_options(kwargs: dict) -> None:
    """HFLM's model args that ortmodule cannot honour, refused by name rather than ignored (they would
    change the numbers a user asked for); `parallelize` (placement only) is a warning. Sets the causal
    backend, and `max_length`, `max_batch_size` and a batch size not `auto` as positive ints."""
    for name, what in _FIXED_AT_EXPORT.items():
        if kwargs.get(name) not in (None, False, ""):
            raise ModelArgsError(f"{name}={kwargs[name]!r} asks for {what}, which applies to a PyTorch model: an "
                                 "ONNX package's weights and precision are fixed when it is exported (merge or "
                                 "quantize the checkpoint, then `ortmodule export` it; a GGUF file exports as it is)")
    backend = kwargs.setdefault("backend", "causal")
    if backend not in ("causal", "default"):
        raise ModelArgsError(f"backend={backend!r}: a GenAI package is a causal (decoder-only) model")
    softmax = kwargs.get("softmax_dtype")
    if softmax is not None and get_dtype(softmax) != torch.float32:
        raise ModelArgsError(f"softmax_dtype={softmax!r}: ortmodule computes log-softmax in float32 (leave it out, "
                             "or pass float32)")
    for name in ("max_length", "max_batch_size"):  # checked here, not at the first request they do not fit
        if kwargs.get(name) is not None:
            kwargs[name] = positive_int(kwargs[name], name)
    batch = kwargs.get("batch_size")
    if batch is not None and not str(batch).startswith("auto"):  # hf runs 0 or less as one batch of everything
        try:
            kwargs["batch_size"] = positive_int(batch, "batch_size")
        except ValueError:
            raise ModelArgsError(f"batch_size must be a positive integer, auto or auto:N, got {batch!r}") from None
    if kwargs.get("parallelize"):
        logger.warning("ortmodule: parallelize=True is ignored: a package runs on the one device given (for several, "
                       "run lm-eval's data parallel: accelerate launch ... -m ortmodule.cli, docs/lm-eval.md)")


# HFLM's own arguments of `_create_model`: the rest of what it passes on are the caller's extra model args.
_HFLM_MODEL_ARGS = frozenset(inspect.signature(HFLM._create_model).parameters) - {"self", "kwargs"}


def refuse_unknown_args(backend, kwargs: dict) -> None:
    """What HFLM passes to `backend._create_model` beyond its own arguments: the caller's model args that
    are neither HFLM's nor the backend's. `--model hf` hands them to transformers' `from_pretrained`, which
    fails on a name it does not know. Those a package takes pass as they do through
    `OrtModelForCausalLM.from_pretrained` (hf.loading_options: without effect, or checked); any other is
    a TypeError naming it, so that a misspelt `share_context=false` is not silently ignored."""
    extras = {name: value for name, value in kwargs.items() if name not in _HFLM_MODEL_ARGS}
    unknown = hf.unexpected_loading_options(extras)
    if unknown:
        own = [name for name in inspect.signature(type(backend).__init__).parameters
               if name not in ("self", "pretrained", "kwargs")]
        raise ModelArgsError(f"unknown model_args for the {type(backend).__name__} backend: {', '.join(unknown)} "
                             f"(it takes lm-eval's hf arguments, its own: {', '.join(own)}, and the transformers "
                             "loading arguments a package can honour: docs/lm-eval.md)")
    check_dtype(hf.loading_options(backend._device, extras)[2], backend._package)


def check_dtype(dtype, package) -> None:
    """HFLM's `dtype` model arg: "auto" (or None) or the package's own precision, else a ModelArgsError."""
    try:
        hf.check_dtype(dtype if dtype is None or dtype == "auto" else get_dtype(dtype), package, dtype)
    except ValueError as e:
        raise ModelArgsError(str(e)) from None
