"""What a model's runs cost on its device (`Costs`: a prefill token, a decode step), measured by
timing them (`measure`). Context sharing is decided from these numbers (sharing.worth_sharing);
modeling keeps one measurement per device (`OrtModelForCausalLM.measured_costs`).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from .decoder import Decoder
from .inputs import Rows


class Costs(NamedTuple):
    """What a model costs on its device, in seconds: one more token in a large prefill batch,
    one decode step over a cache (a fixed part, and a part per row), and one more new token in a
    large extend over a cache (None where the decoder has no extend graph: extend.py), with the
    extend's attention apart: per (new token, position it attends to) of a row. The extend's
    attention is not fused: it grows with the square of a row's new tokens (a 5,000-token
    remainder ran 2.5x slower than its prefill on a CPU), which the per-token cost of short ones
    does not show. `extend_fixed`: what an extend run costs beyond its tokens (0: not measured;
    the decode step's fixed part stands in). On a CPU it is several decode steps: the extend
    session does not keep its weights prepacked (extend.py), so a run of more than one token
    packs them again (about 85 ms against a 23 ms step for SmolLM2-135M in fp32 on 2 vCPUs).
    `prefill_per_score`, `prefill_width` and `prefill_chunk`: a prefill's own attention, as `prefill`
    prices it (`prefill_chunk`: the decoder's CPU chunk length, chunked.py; 0 where it runs none)."""

    per_token: float
    step: float
    step_per_row: float
    extend_per_token: float | None = None
    extend_per_score: float = 0.0
    extend_fixed: float = 0.0
    prefill_per_score: float = 0.0
    prefill_width: int = 0
    prefill_chunk: int = 0

    def prefill(self, rows: int, width: int) -> float:
        """Seconds for a prefill of `rows` rows of `width` tokens: `per_token` a token, read on rows
        of `prefill_width` tokens, and the attention the longer rows add, `prefill_per_score` per
        (token, position it attends to) past that width. ONNX Runtime's CPU attention computes every
        position of a row for every token (masking half after): on SmolLM2-135M's 300-token rows it
        added a third to their per-token cost, which made a query run once look no cheaper than
        whole prompts where it was 1.5x faster (docs/measurements.md, session 40). Rows of at least
        two chunks run chunk by chunk (chunked.py), each chunk's tokens over the positions up to its
        end: about half the scores of one run (priced as one run, two 3,000-token documents looked
        1.6x dearer than they ran, and sharing their first token was chosen and ran 1.5x slower:
        docs/measurements.md, session 52)."""
        chunk = self.prefill_chunk if self.prefill_chunk and width >= 2 * self.prefill_chunk else max(width, 1)
        ends = range(chunk, width + chunk, chunk)  # each chunk's end; the last one cut at `width`
        scores = sum((min(end, width) - (end - chunk)) * max(0, min(end, width) - self.prefill_width) for end in ends)
        return self.per_token * rows * width + self.prefill_per_score * rows * scores


# A decode step's cost per row is read from steps of 1 and STEP_ROWS rows (from 1 and 4 rows it spread
# 1.7-1.9x between eight measurements on 2 vCPUs: benchmarks/cost_spread.py).
STEP_ROWS = 8
# The attention probes (`_prefill_attention`, `_extend_costs`): rounds of their two runs, and the cached
# positions the extend's longer runs hold over all their rows (2,048 a row at 4 rows; 512 at 16 rows and more).
PREFILL_PROBE_ROUNDS = 9
EXTEND_PROBE_ROUNDS = 5
EXTEND_PROBE_POSITIONS = 8192
# The extend probe's rows on a CPU, whatever the token doubling ended at (it ends at 4 there, now and then
# at 8, where the probe read 1.8x apart over 1,024 tokens a row, 1.2-1.4x at 4 rows over 2,048).
EXTEND_PROBE_CPU_ROWS = 4


def _silent(part: str) -> None:
    """`measure`'s progress where nobody shows it."""


@torch.inference_mode()
def measure(decoder: Decoder, progress: Callable[[str], None] | None = None) -> Costs | None:
    """Time `decoder`'s runs (about 30 s for SmolLM2-135M, 130 s for a 0.6B model in fp32, on 2
    cores of a Xeon with AMX; 67 s for SmolLM2-135M on 2 of an AVX2-only EPYC; kept_costs.py keeps
    them between processes): the best of a few
    64-token prefills over growing batches (`_doubling`), then as many tokens in rows 8 times as
    long (`_prefill_attention`), of decode steps over 1 and 8 rows,
    and, with an extend graph, of extends of 16 new tokens a row over growing batches and over a
    longer prefix (`_extend_costs`).
    None, with a warning, where they cannot run (out of memory on a loaded device, say). `progress`
    is called with each part's name as it is done (`phases(decoder)` of them: kept_costs.py shows them)."""
    try:
        return _timed_runs(decoder, progress or _silent)
    except RuntimeError as e:
        warnings.warn(f"could not measure the model's costs ({e}); sharing is decided by token counts",
                      stacklevel=3)
        return None
    finally:
        if decoder.device.type == "cpu" and decoder.extender() is not None:
            # The extend probes' largest runs grew its session's arena past anything scoring asks (a
            # process kept 1 GB more RSS for SmolLM2-135M); made again (0.3 s there).
            decoder.renew_extender()


def phases(decoder: Decoder) -> int:
    """How many parts `measure` reports to its `progress`: the prefill's batches and attention, the decode
    steps, and with an extend graph the extend's batches and attention."""
    return 3 if decoder.extender() is None else 5


def _timed_runs(decoder: Decoder, progress: Callable[[str], None]) -> Costs:
    device = decoder.device
    length = min(64, decoder.package.context_length - 2)
    ids = torch.randint(4, decoder.vocab_size, (64, length), generator=torch.Generator().manual_seed(0)).to(device)

    def prefill(rows: int, cache=None) -> torch.Tensor:
        batch = Rows(ids[:rows], None, torch.full((rows,), length, device=device), length)
        last = torch.arange(rows, device=device) * length + length - 1  # the LM head at each row's last token
        return decoder.prefill(batch, last, cache)

    per_token, _, rows = _doubling(lambda rows: _best_time(lambda: prefill(rows), device), length)
    progress("prefill batches")
    try:
        per_score = _prefill_attention(decoder, rows, length)
    except RuntimeError as e:  # rows longer than the package can take (a context length it overstates)
        warnings.warn(f"could not measure a prefill's attention ({e}); whole prompts are priced by the token",
                      stacklevel=4)
        per_score = 0.0
    progress("prefill attention")
    step = {}
    for rows in (1, STEP_ROWS):
        cache = decoder.new_cache(rows, length + 8)
        prefill(rows, cache)
        token, index = ids[:rows, :1], torch.arange(rows, device=device)
        step[rows] = _best_time(lambda c=cache, t=token, i=index: decoder.step(t, c, i), device)
    per_row = max(0.0, (step[STEP_ROWS] - step[1]) / (STEP_ROWS - 1))
    progress("decode steps")
    extender = decoder.extender()
    extend = _extend_costs(decoder, extender, ids, length, progress) if extender is not None else (None, 0.0, 0.0)
    return Costs(per_token, max(0.0, step[1] - per_row), per_row, *extend, per_score, length, decoder.prefill_chunk)


@torch.inference_mode()
def check_seconds(decoder: Decoder) -> float:
    """The best of two timed prefills of 2 rows of 64 tokens (the smallest run `measure` times), after
    a warm-up: kept_costs.py compares it with its time when stored costs were measured."""
    device, length = decoder.device, min(64, decoder.package.context_length - 2)
    ids = torch.randint(4, decoder.vocab_size, (2, length), generator=torch.Generator().manual_seed(3)).to(device)
    batch = Rows(ids, None, torch.full((2,), length, device=device), length)
    last = torch.arange(2, device=device) * length + length - 1
    return _best_time(lambda: decoder.prefill(batch, last), device, repeats=2)


def _prefill_attention(decoder: Decoder, rows: int, length: int, times: int = 8) -> float:
    """`prefill_per_score`: rows `times` as long as `length` against as many tokens in rows of
    `length`, timed in turns; the longer rows' extra time is their attention over the extra
    positions. About as many tokens as the `rows` rows of `length` where the prefill's tokens showed
    in its time (`_doubling`: 4 on a CPU, more on a GPU), in rows short of two CPU chunks
    (chunked.py), which run as one prefill; 0 where the context is too short for it to show. The
    attention is a fifth of the longer rows' time on a CPU, so the extra time is the median of
    PREFILL_PROBE_ROUNDS rounds' differences (`_median_extra`). (From rows 6 times as long, the best
    of 3, the attention was a twelfth of the time, and eight readings for SmolLM2-135M int4 on 2
    vCPUs spread 7x; from rows of 511, the best of 5, 2.5x to 3.4x; the median of 11 rounds, 1.5x:
    docs/measurements.md, session 54.)"""
    device = decoder.device
    longer = min(times * length, decoder.package.context_length - 2)
    if decoder.prefill_chunk:
        longer = min(longer, 2 * decoder.prefill_chunk - 1)
    if longer - length < 64:
        return 0.0
    rows = max(1, round(rows * length / longer))
    tokens = rows * longer
    count = tokens // length  # rows of `length`: as many tokens, short of a remainder
    ids = torch.randint(4, decoder.vocab_size, (tokens,), generator=torch.Generator().manual_seed(2)).to(device)

    def run(batch: int, width: int):
        part = ids[: batch * width].reshape(batch, width)
        last = torch.arange(batch, device=device) * width + width - 1
        return lambda: decoder.prefill(Rows(part, None, torch.full((batch,), width, device=device), width), last)

    extra = _median_extra(run(count, length), run(rows, longer), device, PREFILL_PROBE_ROUNDS,
                          scale=tokens / (count * length))  # the short rows scaled to the same tokens
    return extra / (tokens * (longer - length))


def _extend_costs(decoder: Decoder, extender, ids: torch.Tensor, length: int,
                  progress: Callable[[str], None] = _silent) -> tuple[float, float, float]:
    """`extend_per_token`, `extend_per_score` and `extend_fixed`: extends of 16 new tokens a row over
    copies of a `length`-token prefix, rows doubling from 2 (`run_costs`), and rows of 16 over a
    longer prefix (`extend_probe_rows`: as many as that doubling ended at on a GPU, 4 on a CPU;
    EXTEND_PROBE_POSITIONS over the rows, at least 512 tokens; the context allowing), whose extra
    time, timed in turns, is the attention over the extra positions. (Read from one row of 256 new
    tokens against two of 16 instead, the attention drowned in the per-token cost's noise: 0 to 8e-8
    s a score on 2 vCPUs, against ~7e-7 s where it matters, remainders of thousands of tokens. Over
    a prefix of 512 it was a quarter of the longer run's time on a CPU, and six readings for
    SmolLM2-135M int4 on 2 vCPUs spread 2.6x; over 2,048, 1.3x to 1.6x, and nine for the fp32
    package still 2.5x, from the doubling's 8 rows now and then; at 4 rows always, eight spread
    1.5x: docs/measurements.md, sessions 54 and 55.)"""
    device = decoder.device
    pasts = {}

    def past(prefix: int):  # one row of `prefix` tokens, copied to every row of a run
        tokens = ids[: prefix // length + 1].reshape(1, -1)[:, :prefix]
        pasts[prefix] = decoder.new_cache(1, prefix)
        decoder.prefill(Rows(tokens, None, torch.full((1,), prefix, device=device), prefix),
                        torch.full((1,), prefix - 1, device=device), pasts[prefix])

    def run(rows: int, prefix: int = length):
        cache = decoder.new_cache(rows, prefix + extender.room(16))
        cache.start_from(pasts[prefix], torch.zeros(rows, dtype=torch.int64, device=device),
                         torch.full((rows,), prefix, device=device), prefix)
        tokens = torch.randint(4, decoder.vocab_size, (rows, 16), generator=torch.Generator().manual_seed(1)).to(device)
        index = torch.arange(rows, device=device) * 16 + 15
        return lambda: extender.run(tokens, cache, index)  # the run alone timed, as the prefills are

    past(length)
    per_token, fixed, rows = _doubling(lambda rows: _best_time(run(rows), device), 16)  # 16 new tokens a row
    progress("extend batches")
    rows = extend_probe_rows(rows, device)
    longer = min(max(512, EXTEND_PROBE_POSITIONS // rows), decoder.package.context_length - 16)
    if longer - length < 64:  # too few extra positions for their cost to show
        progress("extend attention")
        return per_token, 0.0, fixed
    past(longer)
    extra = _median_extra(run(rows), run(rows, longer), device, EXTEND_PROBE_ROUNDS)
    progress("extend attention")
    return per_token, extra / (rows * 16 * (longer - length)), fixed


def extend_probe_rows(doubled: int, device: torch.device) -> int:
    """The rows of the extend's attention probe: where the token doubling ended (`doubled`) on a GPU,
    where 4 rows over either prefix take the time of their kernel launches and the prefix would look
    free; EXTEND_PROBE_CPU_ROWS on a CPU, whose doubling ends at 4 and now and then at 8."""
    return EXTEND_PROBE_CPU_ROWS if device.type == "cpu" else doubled


def run_costs(seconds_for_rows, length: int, most_rows: int = 64) -> tuple[float, float]:
    """Seconds per extra token of a run, where its time grows with its tokens, and what the run
    costs beyond its tokens (the smallest run's time less its tokens at that cost; 0 where the time
    grows faster than the tokens).

    `seconds_for_rows(r)` times a run of r rows of `length` tokens. The rows double from 2 until a
    run takes at least 1.5x the one before (or `most_rows`), and the slope from the smaller of those
    two runs to one of four times its rows (where `most_rows` allows) is returned (`_doubling` also
    gives the rows of the larger of the two). On a CPU that is the first
    doubling; a GPU runs a few hundred tokens in the time of its kernel launches, so its slope is
    read where the batch is large enough to cost by the token, as lm-eval's batches do. (The
    average over a small run overstates a GPU's token cost several times over, and made sharing
    look worth its decode steps: measured on an H100, lm-eval chose sharing and ran 1.4x slower
    than without it.)"""
    return _doubling(seconds_for_rows, length, most_rows)[:2]


def _doubling(seconds_for_rows, length: int, most_rows: int = 64) -> tuple[float, float, int]:
    """`run_costs`, and the rows of the run where the slope was read: the smallest batch that
    costs by its work on this device (4 on a CPU, up to `most_rows` on a GPU).

    Once the doubling has found where the tokens show (r rows, then 2r), the slope is read from r
    to 4r rows where `most_rows` allows (one more run): a difference of two times three times the
    smaller one's tokens apart, not once, so that their noise weighs about half as much in it; and
    what a run costs beyond its tokens is read at the smallest run (2 rows), where the line is
    extrapolated least. The costs are kept for later processes (kept_costs.py), so one unlucky
    reading would last (`python benchmarks/cost_spread.py`: docs/measurements.md, session 42)."""
    rows, before = 2, seconds_for_rows(2)
    smallest = before
    while True:
        now = seconds_for_rows(2 * rows)
        if now >= 1.5 * before or 2 * rows >= most_rows:
            break
        rows, before = 2 * rows, now
    wide, at = (4 * rows, seconds_for_rows(4 * rows)) if 4 * rows <= most_rows else (2 * rows, now)
    slope = max(at - before, 0.0) / ((wide - rows) * length) or 1e-9
    return slope, max(0.0, smallest - slope * 2 * length), 2 * rows


def _best_time(fn, device: torch.device, repeats: int = 3) -> float:
    return _best_times([fn], device, repeats)[0]


def _best_times(fns: list, device: torch.device, repeats: int = 3) -> list[float]:
    """The best of `repeats` timed runs of each of `fns`, run in turns (`_timed_rounds`)."""
    return [min(times) for times in zip(*_timed_rounds(fns, device, repeats))]


def _median_extra(short, long, device: torch.device, rounds: int, scale: float = 1.0) -> float:
    """How much longer `long` runs than `short` (times `scale`): the median, over `rounds` rounds
    that run the two in turns, of each round's difference (at least 0). Where the difference is a
    small part of either run (an attention probe's), the best time of each came from different
    stretches of a shared machine and their difference spread about twice as far."""
    differences = [b - scale * a for a, b in _timed_rounds([short, long], device, rounds)]
    return max(0.0, statistics.median(differences))


def _timed_rounds(fns: list, device: torch.device, repeats: int) -> list[list[float]]:
    """`repeats` rounds of one timed run of each of `fns` in turns, after a warm-up of each
    (finished on the device before the first timed run): a slower stretch of a shared machine
    slows the runs of a round alike."""
    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for fn in fns:
        timed(fn)
    return [[timed(fn) for fn in fns] for _ in range(repeats)]
