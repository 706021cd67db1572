"""Generation's prompts that begin alike, on the CPU: the common beginning runs once.

A batch of prompts from one few-shot task (lm-eval's `generate_until` over GSM8K-style prompts,
say) begins with the same examples in every row. `prefill` runs that beginning once, in one row,
copies its KV into every row of the generation's cache, and runs the rows' rests over their copies:
all in one run of the extend graph in its cache layout (extend.py: it writes their KV into the
cache's buffers), or one row at a time in the package's graph (ONNX Runtime's GroupQueryAttention
takes several new tokens over a past for one row only; cache.py's `rows_view`). The cache and the
first token's logits are those of the whole prompts' prefill, to float32 rounding (the kernels of a
run with a past sum in another order).

It pays where the tokens it spares, the beginning in every row but one and the batch's padding
(a batched prefill runs every row as long as the longest), outweigh the runs it adds: a run of its
own for each row costs on a CPU what some `RUN_TOKENS` more tokens in a prefill cost, one run for
all rows (their rests padded to the longest) some `EXTEND_TOKENS`; `way` takes the cheapest of the
three (`costs`). On CUDA a prefill is
cheap against the decoding that follows and the rows' runs would go one after the other: off there.
Off too for hybrid decoders (layer states), sliding-window layers, multimodal packages and
caches that concatenate.

Within `keeping(KeptBeginning())` (lm-eval's `generate_until`: the batches of a few-shot task, whose
every prompt begins with the same examples), the beginning one call ran is kept with its cache, and a
later call whose beginning starts with most of it runs from a copy of it instead of running it again.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from . import chunked, extend
from .cache import KVCache, rows_view
from .inputs import Rows, reusable_prefix

# A run of its own costs, on a CPU, about what this many more tokens in a prefill cost (streaming
# every weight once against a token's matmuls, whatever the model's size). Measured on the real
# SmolLM2-135M, 2-vCPU Xeon, 8 rows of 96 tokens: the beginning run once broke even at about 46
# common tokens in fp32 (some 45 tokens a run) and 24 in int4 (docs/measurements.md, session 39).
RUN_TOKENS = 48


def common_beginning(rows: Rows) -> int:
    """How many tokens every row begins with, short of the shortest row's last (each row keeps a
    token of its own, whose logits its own run gives)."""
    shortest = int(rows.lengths.min())
    ids = rows.ids[:, : shortest - 1]
    differ = torch.nonzero(~(ids == ids[:1]).all(0))
    return int(differ[0]) if differ.numel() else shortest - 1


# Every row's rest in one run instead (extend.py's extend graph in its cache layout, which writes the
# rests' KV into the cache; a second session of the package's weights, made at the first use) costs,
# on a CPU, about what this many more prompt tokens cost, the beginning's own run included: its
# session packs the float weights at each run. Measured on the real SmolLM2-135M packages, 2-vCPU Xeon,
# 8 rows of 96 tokens (`python benchmarks/shared_prompts.py`): one run broke even with the whole
# prompts between 8 and 16 common tokens (7 x 8 < 96 < 7 x 16 tokens spared; docs/measurements.md,
# session 71).
EXTEND_TOKENS = 96


def costs(rows: Rows, prefix: int) -> tuple[int, int, int]:
    """In prompt tokens: the whole prompts' prefill; the beginning once, then each row's rest in a run
    of its own; the beginning once, then every row's rest in one run (each padded to the longest)."""
    batch, width = rows.ids.shape
    apart = prefix + int(rows.lengths.sum()) - batch * prefix + RUN_TOKENS * batch
    return batch * width, apart, prefix + batch * (width - prefix) + EXTEND_TOKENS


def fits_one_run(decoder, rest: int) -> bool:
    """Whether rests `rest` tokens wide run in one run: no wider than the decoder's prefill chunk (longer
    ones run in chunks a row at a time, where GroupQueryAttention over a long past is the faster on a CPU)."""
    return rest <= (decoder.prefill_chunk or rest)


def continues_in_place(decoder, cache: KVCache) -> bool:
    """Whether several new tokens a row may continue `cache`'s rows over their pasts here (a run a row,
    or one run of the writing extender): on a CPU, over buffers shared by every step (not a cache written
    by concatenation), without layer states, positions offset by images, sliding windows or an
    embedding model before the decoder."""
    return (decoder.device.type == "cpu" and cache.shared and not cache.states and cache.position_offset is None
            and decoder.embedding_session is None and not any(kv.window for kv in decoder.spec.layers))


def several_tokens_pay(new: int) -> bool:
    """Whether `new` tokens a row over a batch's cache cost less in one run of the extend graph than in
    as many decode steps (`EXTEND_TOKENS` against `RUN_TOKENS` a step; decoder.py's `_several_tokens`)."""
    return new * RUN_TOKENS > EXTEND_TOKENS


def way(decoder, rows: Rows, logit_index: torch.Tensor, cache: KVCache) -> tuple[int, extend.Extender | None]:
    """The common beginning's length where running it once pays (0: it does not, or cannot), and the
    extender that then runs every row's rest at once, where that pays more than a run a row and the
    rests are no longer than the decoder's prefill chunk (None: a run a row)."""
    batch, width = rows.ids.shape
    if batch < 2 or not continues_in_place(decoder, cache):
        return 0, None
    prefix = common_beginning(rows)
    if not prefix or int((logit_index % width).min()) < prefix:  # the logits asked of a row come from its rest
        return 0, None
    whole, apart, together = costs(rows, prefix)
    if together < min(whole, apart) and fits_one_run(decoder, width - prefix):
        extender = extend.writing_extender(decoder)
        if extender is not None:
            return prefix, extender
    return (prefix, None) if apart < whole else (0, None)


class KeptBeginning:
    """The beginning `prefill` last ran within `keeping`, with its one-row cache, for the next call."""

    def __init__(self):
        self.tokens: list[int] = []
        self.decoder = None
        self.cache: KVCache | None = None
        self.reused = 0  # calls that ran from it

    def start(self, decoder, tokens: list[int], batch: int, capacity: int) -> tuple[KVCache | None, int]:
        """The kept cache and how many of `tokens` it holds, where it holds enough of them for `batch`
        rows (`inputs.reusable_prefix`) and fits a cache of `capacity` columns; else (None, 0)."""
        if self.cache is None or self.decoder is not decoder or self.cache.span > capacity:
            return None, 0
        shared = reusable_prefix(self.tokens, tokens, batch)
        if not shared:
            return None, 0
        self.reused += 1
        return self.cache, shared


_kept = threading.local()


@contextlib.contextmanager
def keeping(kept: KeptBeginning):
    """Within it, on this thread, `prefill` keeps the beginning it runs in `kept` and starts from it."""
    previous = getattr(_kept, "beginning", None)
    _kept.beginning = kept
    try:
        yield kept
    finally:
        _kept.beginning = previous


def keeping_beginnings(method):
    """`method` (lm-eval's `generate_until`) run within `keeping` a `KeptBeginning` of its own."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with keeping(KeptBeginning()):
            return method(*args, **kwargs)

    return run


def _beginning(decoder, ids: torch.Tensor, prefix: int, batch: int, capacity: int) -> tuple[KVCache, int]:
    """A one-row cache holding the first tokens of `ids` `[1, prefix]`, and how many: kept (`keeping`), or run."""
    kept = getattr(_kept, "beginning", None)
    tokens = ids[0].tolist() if kept is not None else []
    first, begin = kept.start(decoder, tokens, batch, capacity) if kept is not None else (None, 0)
    if first is not None:
        return first, begin
    device = decoder.device
    first = decoder.new_cache(1, prefix)
    decoder.prefill(Rows(ids, None, torch.full((1,), prefix, device=device), prefix),
                    torch.full((1,), prefix - 1, device=device), first)
    if kept is not None:
        kept.tokens, kept.decoder, kept.cache = tokens, decoder, first
    return first, prefix


def prefill(decoder, rows: Rows, logit_index: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """`decoder.prefill(rows, logit_index, cache)`: the logits `[n, V]` at the flat indices
    `logit_index` and `cache` holding the rows, the rows' common beginning run once where that pays."""
    prefix, extender = way(decoder, rows, logit_index, cache)
    if not prefix:
        return decoder.prefill(rows, logit_index, cache)
    batch, width = rows.ids.shape
    device = decoder.device
    first, begin = _beginning(decoder, rows.ids[:1, :prefix], prefix, batch, cache.capacity)
    together = extender is not None and fits_one_run(decoder, width - begin)  # a kept beginning may hold fewer
    # The cache layout's attention reads every column of the cache's buffers, used or not (8 rests of
    # 20-60 tokens: 1.3x the time with 256 columns to spare, 2.2x with 1,024; docs/measurements.md,
    # session 72): a generation's cache, with room for its new tokens, takes the rests' KV from a cache
    # as wide as the prompts.
    wide = max(width, first.span)  # a kept beginning may hold more columns than these prompts
    into = decoder.new_cache(batch, wide) if together and cache.capacity > wide else cache
    into.start_from(first, torch.zeros(batch, dtype=torch.int64, device=device),
                    torch.full((batch,), begin, device=device), begin)
    if together:
        logits = _rests_together(extender, rows, logit_index, into, begin)
        if into is not cache:
            cache.start_from(into, torch.arange(batch, device=device), rows.lengths, rows.longest)
            cache.seen = width
        return logits
    out = torch.empty(logit_index.numel(), decoder.vocab_size, dtype=decoder.head_dtype, device=device)
    owner, column = logit_index // width, logit_index % width
    chunk, write = decoder.prefill_chunk or width, functools.partial(chunked.put_rows, out)
    for row, length in enumerate(rows.lengths.tolist()):
        asked = torch.nonzero(owner == row).squeeze(1)
        chunked.run_row(decoder, rows.ids[row : row + 1, :length], asked, column[asked],
                        rows_view(cache, row, row + 1, begin), chunk, write, begin=begin)
    cache.longest, cache.seen = rows.longest, width  # its lengths went up through the views
    return out


def _rests_together(extender: extend.Extender, rows: Rows, logit_index: torch.Tensor, cache: KVCache,
                    begin: int) -> torch.Tensor:
    """`prefill`'s logits and cache where `cache` holds each row's first `begin` tokens: every row's rest
    in one run of `extender` (the cache layout), its KV written after the beginning in the cache's buffers."""
    width = rows.ids.shape[1]
    new = width - begin
    index = logit_index // width * new + logit_index % width - begin
    logits = extender.run(rows.ids[:, begin:].contiguous(), cache, index)
    cache.lengths.copy_(rows.lengths)  # the run wrote the rests' KV but counts none of it (a padded row's past its end)
    cache.longest, cache.seen = rows.longest, width
    return logits
