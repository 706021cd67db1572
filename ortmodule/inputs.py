"""Checking what callers pass, and the one convention for which logits to compute.

Callers speak of positions of their own padded input (`cont_len`, `logits_to_keep`, `(row, col)`
pairs). The decoder runs rows right-padded (left-padded rows are rolled first) and speaks of flat
indices, `row * width + column` of the right-padded layout; `flat_index` converts one to the
other. Every check raises a TypeError or ValueError naming the argument and the bad value.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """A checked input batch in the right-padded layout the decoder runs."""

    ids: torch.Tensor  # [B, T] int64 on the device, each row's tokens starting at column 0
    shift: torch.Tensor | None  # how far each row was rolled left to get there (None: not at all)
    lengths: torch.Tensor  # [B] real tokens per row
    longest: int  # max(lengths), on the host
    positions: tuple[torch.Tensor, torch.Tensor] | None = None  # check_batch's `positions`, checked (rows, cols)


def flat_index(width: int, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Flat indices into a right-padded batch `width` wide of the positions `(rows[i], cols[i])` of
    the caller's layout (`shift`: how far each row was rolled left to make it right-padded)."""
    if shift is not None:
        cols = (cols - shift[rows]) % width
    return rows * width + cols


def each_row(batch: int, width: int, positions: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Flat indices of the same `positions` of every row, row after row (see `flat_index`)."""
    owners = torch.arange(batch, device=positions.device).repeat_interleave(positions.numel())
    return flat_index(width, owners, positions.repeat(batch), shift)


def every_position(rows: Rows) -> torch.Tensor | None:
    """Flat indices of every position in the caller's order, or None when that is the decoder's."""
    if rows.shift is None:
        return None
    batch, width = rows.ids.shape
    return each_row(batch, width, torch.arange(width, device=rows.ids.device), rows.shift)


def kept_positions(keep, length: int, device: torch.device) -> torch.Tensor | None:
    """The positions of a `length`-wide input that `cont_len` / `logits_to_keep` asks logits for, or
    None for all of them."""
    if keep is None:
        return None
    if isinstance(keep, torch.Tensor):
        if keep.dim() != 1 or keep.is_floating_point() or keep.is_complex() or keep.dtype == torch.bool:
            raise ValueError("logits_to_keep as a tensor must be 1-D integer positions")
        if keep.numel() == 0:
            raise ValueError("logits_to_keep is an empty tensor: name at least one position")
        keep = keep.to(device, torch.int64)
        if ((keep < -length) | (keep >= length)).any():
            raise ValueError(f"logits_to_keep positions must lie in [-{length}, {length})")
        return keep % length  # a negative position counts from the end, as transformers' tensor index does
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise TypeError(f"cont_len must be an int, got {type(keep).__name__}")
    if keep < 0:
        raise ValueError(f"cont_len must be >= 0, got {keep}")
    if keep == 0 or keep >= length:
        return None
    return torch.arange(length - keep, length, device=device)


def to_device(tensor: torch.Tensor | Sequence, device: torch.device) -> torch.Tensor:
    """A host tensor (or a list of numbers, as `torch.tensor` makes it) on `device` without waiting
    for the work queued there: on CUDA through pinned memory (a copy from pageable memory, or a
    blocking one, would make the host wait for the runs before it, and leave the device idle while
    the host builds the next batch)."""
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.tensor(tensor)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def start_copy_to_host(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start copying `tensor` to the host behind the work queued before it, without waiting;
    returns the function that waits for that copy alone (not for work queued after it) and gives
    the host tensor. On a CPU the tensor itself."""
    if tensor.device.type != "cuda":
        return lambda: tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)  # on the current stream of the tensor's device
    copied = torch.cuda.Event()
    # On that same stream: `record()` alone takes the current device's, which is another device's
    # (and the wait then covers nothing) in a thread whose current device is not the tensor's.
    copied.record(torch.cuda.current_stream(tensor.device))

    def wait() -> torch.Tensor:
        copied.synchronize()
        return host

    return wait


def argmax(values: torch.Tensor) -> torch.Tensor:
    """`values.argmax(-1)` (the first of equal maxima; a NaN counts as the maximum), through NumPy for
    a float32 tensor on the CPU: torch's CPU argmax reduces one element at a time (83 us a row of
    49,152 logits on a 2-vCPU Xeon, against NumPy's 4 us: docs/measurements.md), a cost every greedy
    step and every scored position's greedy check pays."""
    if values.device.type != "cpu" or values.dtype != torch.float32 or values.dim() == 0 or not values.shape[-1]:
        return values.argmax(-1)
    return torch.as_tensor(values.detach().numpy().argmax(-1), dtype=torch.int64)


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A list (or tuple) of Python ints as a 1-D int64 host tensor, through an `array` (about 4x faster than
    `torch.tensor` on a list: lm-eval's requests come as lists, some 64,000 ids a rolling batch).
    Raises TypeError for a value that is no int, OverflowError for one past int64."""
    if not len(values):
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def pad_right(rows: list[list[int]], pad: int = 0, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as a right-padded int64 batch on the host, and its attention mask: as wide as
    the longest row, or `width` where that is wider."""
    width = max(width, max(len(row) for row in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row.to(torch.int64) if isinstance(row, torch.Tensor) else int64_tensor(row)
        mask[r, : len(row)] = 1
    return ids, mask


def check_ids_form(input_ids) -> None:
    """`input_ids` as forward and generate take them, a 2-D integer tensor `[batch, sequence]` (what a
    tokenizer's return_tensors='pt' gives); what else is given is named, with the way to the form."""
    if not isinstance(input_ids, torch.Tensor):
        hint = "a tokenizer's output goes in as keywords: model(**encoding), generate(**encoding)" \
            if isinstance(input_ids, Mapping) else "torch.tensor(ids) makes one; a tokenizer's return_tensors='pt' too"
        raise TypeError(f"input_ids must be a torch.Tensor [batch, sequence] of token ids, got "
                        f"{type(input_ids).__name__} ({hint})")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        hint = ": ids[None] adds the batch dimension" if input_ids.dim() == 1 else ""
        raise ValueError(f"input_ids must be 2-D [batch, sequence], got shape {tuple(input_ids.shape)}{hint}")


def check_ids_present(input_ids) -> None:
    """Ids of the 2-D form (`check_ids_form`) that hold at least one token: a row and a column."""
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")


def _check_ids(input_ids, context_length: int) -> None:
    check_ids_form(input_ids)
    check_ids_present(input_ids)
    length = input_ids.shape[1]
    if length > context_length:
        raise ValueError(f"input length {length} exceeds the model's context length {context_length}")


def check_mask_type(attention_mask, shape: tuple) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids shape {tuple(shape)}"
        )


def outside_vocabulary(ids, vocab: int):
    """The vocabulary rule, in one place: for a tensor of ids, the mask of those outside [0, vocab);
    for a sequence of ints, the first such id (None when all are inside)."""
    if isinstance(ids, torch.Tensor):
        return (ids < 0) | (ids >= vocab)
    return next((t for t in ids if not 0 <= t < vocab), None)


def vocabulary_message(token_id: int, vocab: int, what: str = "token id", where: str = "") -> str:
    return f"{what} {token_id}{where} is outside the vocabulary [0, {vocab})"


def eos_token_ids(eos) -> list:
    """An `eos_token_id` setting (None, one id, a list or a tensor of them) as a list, the one
    reading of it that generation's checks and the completions' cut share."""
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return eos.flatten().tolist()
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def raise_bad_id(ids: torch.Tensor, vocab: int) -> None:
    """Name the first token id outside the vocabulary (the error path of the checks)."""
    row, col = outside_vocabulary(ids, vocab).nonzero()[0].tolist()
    raise ValueError(vocabulary_message(ids[row, col].item(), vocab, where=f" at input_ids[{row}, {col}]"))


def check_batch(input_ids, attention_mask, vocab: int, context_length: int, device: torch.device,
                position_ids=None, cache_position=None, positions=None) -> Rows:
    """Validate a prompt batch where the caller's ids are (on the host for host tensors: no
    device-to-host copy at all; else on the device with one read of a few flags) and return it in
    the right-padded layout on `device`: rows whose ones form one contiguous run are rolled to
    start at column 0. `position_ids` / `cache_position`, when given, must be what transformers
    computes from the mask. `positions` (rows, cols), the caller's layout's positions whose logits
    are asked for: each must be one of its row's real tokens, never padding."""
    _check_ids(input_ids, context_length)
    positions = None if positions is None else checked_positions(*positions, input_ids.shape)
    ids = input_ids.to(torch.int64)
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        check_mask_type(attention_mask, input_ids.shape)
        mask = to_device(attention_mask, ids.device)
    not_binary = ((mask != 0) & (mask != 1)).any()
    mask = mask.to(torch.int64)
    counts = mask.sum(1)
    lead = mask.argmax(1)  # index of each row's first 1
    steps = torch.arange(ids.shape[1], device=ids.device)
    contiguous = mask == ((steps >= lead[:, None]) & (steps < (lead + counts)[:, None]))
    real = mask != 0
    checks = {
        "not_binary": not_binary,
        "bad_id": outside_vocabulary(ids, vocab).any(),
        "empty_row": (counts == 0).any(),
        "gaps": ~contiguous.all(),
        "left_padded": (lead > 0).any(),
        "longest": counts.max(),
        "positions": _positions_differ(position_ids, cache_position, real.cumsum(1) - 1, real, 0),
        "padding_asked": _outside_rows(positions, lead, counts).any(),
    }
    flags = dict(zip(checks, torch.stack(list(checks.values())).tolist()))  # the one host sync of the checks
    if flags["not_binary"]:
        raise ValueError("attention_mask must hold only 0 and 1")
    if flags["bad_id"]:
        raise_bad_id(ids, vocab)
    if flags["empty_row"]:
        raise ValueError(f"attention_mask row {(counts == 0).nonzero()[0].item()} has no tokens")
    if flags["gaps"]:
        row = (~contiguous).any(1).nonzero()[0].item()
        raise ValueError(
            f"attention_mask row {row} has gaps: each row's ones must be one contiguous run (left- or right-padded)"
        )
    if flags["positions"]:
        _refuse_positions()
    if flags["padding_asked"]:
        _refuse_padding(positions, _outside_rows(positions, lead, counts))

    def up(tensor):  # host tensors are copied up without waiting for the device
        return to_device(tensor, device)

    if not flags["left_padded"]:
        return Rows(up(ids), None, up(counts), flags["longest"], positions)
    order = (steps[None, :] + lead[:, None]) % ids.shape[1]  # roll every row to start at column 0
    return Rows(up(ids.gather(1, order)), up(lead), up(counts), flags["longest"], positions)


def checked_positions(rows, cols, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions `(rows[i], cols[i])` of a batch of `shape`, checked where they are: host positions
    (scoring's) cost the device no wait."""
    batch, length = shape
    rows, cols = torch.as_tensor(rows), torch.as_tensor(cols)
    for name, value in (("rows", rows), ("cols", cols)):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer positions, got dtype {value.dtype}")
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError(f"rows and cols must be 1-D of one length, got {tuple(rows.shape)} and {tuple(cols.shape)}")
    outside = (rows < 0) | (rows >= batch) | (cols < 0) | (cols >= length)
    if outside.any():
        first = int(outside.nonzero()[0, 0])
        raise ValueError(f"positions must lie inside the input of shape {(batch, length)}: position {first} is "
                         f"(row {int(rows[first])}, col {int(cols[first])})")
    return rows, cols


def _outside_rows(positions, lead: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per position (none: an empty tensor), whether it lies outside its row's real tokens (columns lead to
    lead + count), on the device of the mask's checks."""
    if positions is None:
        return torch.zeros(0, dtype=torch.bool, device=lead.device)
    rows, cols = (to_device(p, lead.device) for p in positions)
    return (cols < lead[rows]) | (cols >= (lead + counts)[rows])


def _refuse_padding(positions, outside: torch.Tensor) -> None:
    first = int(outside.nonzero()[0].item())
    row, col = int(positions[0][first]), int(positions[1][first])
    raise ValueError(f"position ({row}, {col}) is padding (attention_mask[{row}, {col}] is 0): logits are asked for "
                     "at a row's own tokens only (a loglikelihood's start plus its number of targets stays within its "
                     "row)")


def check_step(input_ids, attention_mask, cache, vocab: int, context_length: int, device: torch.device,
               position_ids=None, cache_position=None) -> torch.Tensor:
    """Validate tokens `[B, s]` that continue `cache` (and the caller's mask so far, the positions
    and cache columns, when given); return them as int64 on `device`."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError("input_ids must be a 2-D integer tensor [batch, new tokens]")
    if input_ids.dtype == torch.bool or input_ids.is_complex():
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    batch, new = input_ids.shape
    if batch != cache.batch_size or new == 0:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)} does not continue a cache of {cache.batch_size} rows"
        )
    if cache.longest + new > context_length:
        raise ValueError(
            f"{cache.longest} cached + {new} new tokens exceeds the model's context length {context_length}"
        )
    ids = input_ids.to(device, torch.int64)
    checks = {"bad_id": outside_vocabulary(ids, vocab).any()}
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        expected = (batch, cache.seen + new)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match the cache and the new "
                f"tokens: expected {expected}"
            )
        mask = attention_mask.to(device)
        checks["new_not_one"] = (mask[:, -new:] != 1).any()
        if cache.caller_mask is not None:
            checks["mask_differs"] = (mask[:, :-new] != cache.caller_mask).any()
    checks["positions"] = _positions_differ(position_ids, cache_position,
                                            cache.lengths[:, None] + torch.arange(new, device=device), None, cache.seen)
    flags = dict(zip(checks, torch.stack(list(checks.values())).tolist()))  # the one host sync of the checks
    if flags["bad_id"]:
        raise_bad_id(ids, vocab)
    if flags.get("new_not_one"):
        raise ValueError("attention_mask must be 1 at every new token: a step appends to every row")
    if flags.get("mask_differs"):
        raise ValueError(
            "attention_mask's earlier columns differ from the mask this cache was built with: a step's "
            "mask is the mask so far followed by ones for the new tokens"
        )
    if flags["positions"]:
        caller = cache.caller_mask
        gap = caller is not None and bool(((caller[:, 1:] == 0) & (caller[:, :-1] == 1)).any())
        _refuse_positions(right_padded=gap)
    return ids


def _positions_differ(position_ids, cache_position, expected: torch.Tensor, real: torch.Tensor | None,
                      first_column: int) -> torch.Tensor:
    """A device flag: do `position_ids` differ from `expected` ([B, S]) at the `real` positions, or
    `cache_position` from the columns `first_column`, ... of this input?"""
    differs = torch.zeros((), dtype=torch.bool, device=expected.device)
    if cache_position is not None:
        width = expected.shape[1]
        if not isinstance(cache_position, torch.Tensor) or cache_position.dim() != 1 or cache_position.numel() != width:
            raise ValueError(f"cache_position must be a 1-D tensor of {width} columns")
        columns = torch.arange(first_column, first_column + width, device=expected.device)
        differs = differs | (cache_position.to(expected.device) != columns).any()
    if position_ids is None:
        return differs
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point():
        got = f"dtype {position_ids.dtype}" if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"position_ids must be an integer tensor, got {got}")
    positions = position_ids.to(expected.device)
    if positions.dim() == 3:  # mRoPE sections [3, B, S]: for text all three are the token's position
        positions, rest = positions[0], positions[1:]
        differs = differs | (rest != positions).any()
    if positions.dim() == 1:
        positions = positions[None]
    rows_ok = positions.dim() == 2 and positions.shape[0] in (1, expected.shape[0])
    if not rows_ok or positions.shape[-1] != expected.shape[1]:
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} do not match the input "
                         f"{tuple(expected.shape)}")
    wrong = positions != expected
    return differs | ((wrong & real).any() if real is not None else wrong.any())


def check_prompt_positions(position_ids, shape: tuple, attention_mask) -> None:
    """generate()'s `position_ids` for prompts of `shape` ([batch, sequence]): taken where they are what
    transformers computes (each row's tokens 0, 1, ... over its mask), as forward takes them; a shape that
    does not match is a ValueError, other positions a NotImplementedError (the graph numbers each row's
    tokens from its mask, and generate would otherwise run at positions the caller did not ask for)."""
    if position_ids is None:
        return
    real = attention_mask != 0 if attention_mask is not None else torch.ones(shape, dtype=torch.bool)
    if _positions_differ(position_ids, None, real.cumsum(1) - 1, real, 0):
        _refuse_positions()


def _refuse_positions(right_padded: bool = False) -> None:
    if right_padded:
        raise ValueError(
            "these steps continue a right-padded prompt batch, and the positions given for the new tokens (by "
            "transformers' generation loop, which numbers them after the padding) are not the rows' own: pad "
            "prompts on the left for generation (tokenizer.padding_side = 'left')"
        )
    raise NotImplementedError(
        "position_ids or cache_position other than each row's own positions are not supported: the ONNX graph "
        "numbers each row's tokens 0, 1, ... from the attention mask (what transformers computes for left- and "
        "right-padded rows); leave them out, or pass the attention mask that gives the positions you want"
    )


def common_prefix(rows: list[list[int]]) -> int:
    """How many first tokens all `rows` share (list slices compared in C, the length found by
    bisection: a few microseconds for rows of hundreds of tokens)."""
    first = rows[0]
    shared = min(len(r) for r in rows)
    for row in rows[1:]:
        if row[:shared] == first[:shared]:
            continue
        low, high = 0, shared - 1  # row[:low] matches; row[:high + 1] does not
        while low < high:
            middle = (low + high + 1) // 2
            if row[:middle] == first[:middle]:
                low = middle
            else:
                high = middle - 1
        shared = low
    return shared


def reusable_prefix(kept: list[int], prefix: list[int], rows: int) -> int:
    """How many first tokens of `prefix` the cache of an earlier run of `kept` can give `rows` rows that
    begin with it: the tokens the two share, where the rows running the rest of `prefix` themselves costs
    fewer tokens than half of it (a run of `prefix` of its own saves more otherwise); else 0."""
    shared = common_prefix([kept, prefix])
    return shared if shared and 2 * (len(prefix) - shared) * rows < len(prefix) else 0
