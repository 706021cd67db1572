"""Long rows on the CPU: one row at a time, in chunks over its own KV cache.

ONNX Runtime's CPU GroupQueryAttention runs a long prompt slower per token than the same prompt
fed in chunks over a cache (batch 1, several new tokens over a past: the only case its kernel takes
for a past). Measured on the real SmolLM2-135M fp32 package, 2-vCPU Xeon (AVX-512), chunks of 256
tokens against one prefill of the row: 1 x 512 0.50 vs 0.56 s, 1 x 1,024 1.08 vs 1.45 s, 1 x 8,192
17.5 vs 21.8 s (transformers' sdpa: 19.4 s), 8 x 640 5.2 vs 6.0 s; rows under ~400 tokens gain
nothing (16 x 300: 4.75 vs 4.22 s), so only batches whose rows need at least two chunks run this
way. On CUDA the flash kernels take long rows as they are: chunking is off there.

A chunked prefill gives the logits an ordinary prefill gives (same positions, same semantics for
the padding of right-padded rows); each row runs only as far as the last position asked of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .cache import KVCache
from .inputs import Rows

# Where logits go as they come: `(places, logits)`, their places among the positions asked (None: all, in order).
Pieces = Callable[[torch.Tensor | None, torch.Tensor], None]

CPU_CHUNK = 256  # tokens per chunk on the CPU (256-512 measured alike; 128 slower)


def default_chunk(decoder, device: torch.device) -> int:
    """The chunk length `Decoder.prefill` uses on `device` when the caller chose none (0: off).
    Off on CUDA, and for packages with sliding-window layers: right there too, but slower (Gemma-3-270M's
    config, 2-vCPU Xeon: 1 x 2,048 tokens 0.71x, 4 x 1,024 0.92x, 8 x 640 0.85x;
    benchmarks/sliding_windows.py --chunks)."""
    if device.type != "cpu" or any(kv.window for kv in decoder.spec.layers) or decoder.spec.steps_one_token:
        return 0  # (a package whose attention takes one new token over a past would run chunks token by token)
    return CPU_CHUNK


def chunk_for(decoder, device: torch.device, chosen: int | None) -> int:
    """The chunk length `Decoder.prefill` uses: the caller's `chosen`, else `default_chunk`. A
    package whose attention takes one new token over a past (the model builder's fp16 export for a
    CPU: `DecoderGraph.steps_one_token`) runs no chunks, and a chunk asked of it is a ValueError: its
    chunks after the first would run one token at a time (`Decoder.step`), far slower than one prefill."""
    if chosen is None:
        return default_chunk(decoder, device)
    if chosen and decoder.spec.steps_one_token:
        raise ValueError(f"prefill_chunk={chosen}: {decoder.package.root}'s decoder attends with MultiHeadAttention "
                         "(the model builder's fp16 export for a CPU), which takes one new token at a time over a "
                         "cache, so chunks would run token by token, far slower than one prefill; use prefill_chunk=0")
    return chosen


def checked_chunk(value) -> int | None:
    """A caller's `prefill_chunk`: None (by device), 0 (off) or a positive number of tokens."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefill_chunk must be None (by device), 0 (off) or a positive number of tokens, "
                         f"not {value!r}")
    return value


def wanted(rows: Rows, logit_index: torch.Tensor | None, cache: KVCache | None, chunk: int) -> bool:
    """Whether a prefill of `rows` runs in chunks: a row must run at least two chunks to give what
    is asked of it, with no cache kept (scoring, forward) or a one-row cache without padding
    (generate's prompt)."""
    batch, width = rows.ids.shape
    if not chunk or width < 2 * chunk:
        return False
    if cache is not None:
        return batch == 1 and rows.longest == width
    if logit_index is None:
        return True
    return logit_index.numel() > 0 and int((logit_index % width).max()) + 1 >= 2 * chunk


def prefill(decoder, rows: Rows, logit_index: torch.Tensor | None, cache: KVCache | None,
            chunk: int, pieces: Pieces | None = None) -> torch.Tensor | None:
    """`Decoder.prefill`'s result, row by row in chunks: logits `[n, V]` at the flat indices
    `logit_index`, else `[B, T, V]`; a given (one-row) `cache` then holds the row. With `pieces`,
    no `[n, V]` buffer: each chunk's logits go to `pieces(places, logits)` as they come (`places`:
    their places among the n), and the result is None (a rolling batch's float32 logits, made whole,
    took 2 GB for SmolLM2's 10,000 positions; 8 windows of 8,192 tokens in Qwen3's 151,936-token
    vocabulary would take 40 GB)."""
    batch, width = rows.ids.shape
    flat = logit_index if logit_index is not None else torch.arange(batch * width, device=rows.ids.device)
    out = None if pieces is not None else torch.empty(flat.numel(), decoder.vocab_size, dtype=decoder.head_dtype,
                                                       device=decoder.device)
    write = pieces if out is None else functools.partial(put_rows, out)
    owner, column = flat // width, flat % width
    if cache is not None:  # one row, run whole: the cache holds all of it
        run_row(decoder, rows.ids, torch.arange(flat.numel(), device=flat.device), column, cache, chunk, write)
    else:
        for row in torch.unique(owner).tolist():
            mine = torch.nonzero(owner == row).squeeze(1)
            needed = int(column[mine].max()) + 1  # later tokens change nothing before them
            run_row(decoder, rows.ids[row : row + 1, :needed], mine, column[mine], decoder.new_cache(1, needed),
                     chunk, write)
    if out is None:
        return None
    return out if logit_index is not None else out.view(batch, width, -1)


def run_row(decoder, ids: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor, cache: KVCache,
            chunk: int, write: Pieces, begin: int = 0) -> None:
    """Run one row's `ids` `[1, L]` into `cache` chunk by chunk from column `begin` (a cache holding
    the columns before it: shared_prompts.py), handing the logits at `columns` to `write(slots,
    logits)` a chunk at a time (`functools.partial(put_rows, out)` writes them into `out[slots]`).
    A chunk with nothing asked of it computes one position's logits, dropped."""
    length = ids.shape[1]
    for start in range(begin, length, chunk):
        end = min(start + chunk, length)
        inside = (columns >= start) & (columns < end)
        local = columns[inside] - start
        keep = local if local.numel() else torch.tensor([end - start - 1], device=ids.device)
        tokens = ids[:, start:end]
        if start == 0:
            size = torch.tensor([end], device=ids.device)
            logits = decoder.prefill(Rows(tokens, None, size, end), keep, cache)
        else:
            logits = decoder.step(tokens, cache, keep)
        if local.numel():
            write(slots[inside], logits)


def put_rows(out: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`out[slots] = rows`, as one slice copy when `slots` are consecutive (a long row's chunk). On a
    CPU, an indexed write into a fresh `[n, V]` buffer is ten times slower than the copy: its pages
    are first touched one row at a time (2 GB of a rolling batch's logits: 4.1 s against 0.5)."""
    first = int(slots[0])
    if torch.equal(slots, torch.arange(first, first + slots.numel(), device=slots.device)):
        out[first : first + slots.numel()].copy_(rows)
    else:
        out[slots] = rows
