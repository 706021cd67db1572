"""`KVCache`: the key and value buffers of one batch on the device, which ONNX Runtime writes in place.

Data only: the decoder (decoder.py) binds these buffers to its session and keeps, per cache, the
binding and the lock of the run in progress.

One key and one value buffer per layer, `[batch, kv_heads, capacity, head_size]` with each layer's
own heads and head size. With GroupQueryAttention (the packages' `past_present_share_buffer`
layout) a buffer is bound as both the past and the present of every run: ONNX Runtime writes the
new entries in place, so the cache never moves and never passes through the host. Attention that
concatenates past and new entries instead writes a new present each run, which replaces the past.

Rows are kept right-padded: row b's tokens fill positions `[0, lengths[b])`, and a run that adds
tokens writes row b's at `lengths[b]` (the attention mask tells GroupQueryAttention each row's
length). Entries a padded prefill leaves behind lie past each row's length and are overwritten.

A hybrid decoder's convolution and linear-attention layers keep no KV but states (`states`: `LayerStates`, states.py),
which every run replaces; rows are selected, repeated and reset with the KV. A state holds the inputs
before one position only, so the cache keeps a copy of the states after each of its last runs
(`Checkpoint`s): a crop goes back to the last one at or before the kept columns and runs the tokens
from there again, or, where they are the first of one step run (assisted decoding: its candidates'
run, cropped to the accepted ones), leaves them `pending` for the next step to run with its own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref

import torch
from transformers import Cache

from . import runtime
from .package import DecoderGraph


def _inference_mode(method):
    """Run a method that updates the cache's tensors in place in inference mode: the cache may have been
    made inside `torch.inference_mode()` (generate) and be updated outside it, or the other way round."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():  # a decode step's: entering it again costs more than the update
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)
    return wrapper


# Runs after which a hybrid cache keeps its layer states (LayerStates.log); a crop further back
# runs again from the newest kept ones (from the prompt at worst), where the runs' tokens are known.
CHECKPOINTS = 32
# ... fewer where a batch's states are large (a linear attention's recurrent states: transformers' default Qwen3.5
# text config's, about 25 MB a row in bf16): at most this many bytes of copies, and always the newest run's.
CHECKPOINT_BYTES = 256 * 2**20


@dataclasses.dataclass
class Checkpoint:
    """A hybrid cache's layer states after `seen` columns of the caller's input (`states`: None
    before the first run, zeros; `kept` False once dropped, CHECKPOINTS runs later), and the run that
    followed (`ran`: `(decoder, rerun, tokens)`, a weak proxy of the decoder, the function that
    runs it again and that run's input, `("prompt", rows)` or `("step", tokens)`: decoder.py's
    `noted`; None where it cannot be run again)."""

    seen: int
    states: list | None
    kept: bool = True
    ran: tuple | None = None

    def __deepcopy__(self, memo: dict) -> Checkpoint:
        """A copy with states of its own; the run that followed shared (a recipe: a weak proxy of the decoder,
        which a copy cannot take, a function, its input), so that `copy.deepcopy(cache)` copies a hybrid's."""
        return Checkpoint(self.seen, copy.deepcopy(self.states, memo), self.kept, self.ran)


def _cannot_crop(seen: int, keep: int, why: str) -> str:
    return (f"cannot crop a cache with layer states (a hybrid model's) from {seen} columns to {keep}: "
            f"a state holds the inputs before the last token only, and {why}; run the shorter sequence again")


class LayerStates:
    """A hybrid decoder's layer states of one batch (states.py): per stateful layer
    (`specs`), `current` `[batch, *shape]` (package.LayerState). A run writes its present states into `written`,
    copied into `current` when the run is recorded: a copy, not a swap, so that the buffers'
    addresses stay fixed (steps.py). `log`: a `Checkpoint` per run since the prompt (None in a view
    of some rows, which keeps none). Empty (false) for other decoders."""

    def __init__(self, specs: tuple, current: list[torch.Tensor], log: list | None = None):
        self.specs, self.current = specs, current
        self.written = [torch.empty_like(state) for state in current]
        self.log = [Checkpoint(0, None)] if log is None else log
        # False: no checkpoints (generate's own loop, whose cache is not returned: nothing can crop it)
        # until the next prompt; a crop then finds none and is refused.
        self.keeping = True

    def __bool__(self) -> bool:
        return bool(self.specs)

    def take(self, seen: int, ran: tuple | None = None) -> None:
        """Record a run (`ran`: how to run it again, Checkpoint): its present states become the current
        ones, kept as the checkpoint at `seen`."""
        for state, written in zip(self.current, self.written):
            state.copy_(written)
        if self and self.log is not None and not self.keeping:
            self.log.clear()
        elif self and self.log is not None:
            self.log[-1].ran = ran
            self.log.append(Checkpoint(seen, [state.clone() for state in self.current]))
            kept = self.kept_runs()
            if len(self.log) > kept:
                dropped = self.log[-kept - 1]
                dropped.kept = dropped.seen == 0 and dropped.states is None
                dropped.states = None

    def kept_runs(self) -> int:
        """How many runs' states the log keeps: CHECKPOINTS, or fewer past CHECKPOINT_BYTES of copies."""
        size = sum(state.numel() * state.element_size() for state in self.current)
        return max(1, min(CHECKPOINTS, CHECKPOINT_BYTES // max(1, size)))

    def restart(self, seen: int = 0, *, zeros: bool = True) -> None:
        """Start the log over: the states before a prompt (`zeros`) or as they are now, at `seen`."""
        if self.log is not None:
            self.log = [Checkpoint(seen, None if zeros else [state.clone() for state in self.current])]
            self.keeping = True

    def copied_log(self) -> list | None:
        """The log for a copy of these rows (steps.py's `copy_cache`): the checkpoints, the last one
        the copy's own (its next run is noted there)."""
        return None if self.log is None else [*self.log[:-1], dataclasses.replace(self.log[-1])]

    @_inference_mode
    def zero(self) -> None:
        for state in self.current:
            state.zero_()

    def start_from(self, source: LayerStates, rows: torch.Tensor, whole: bool) -> None:
        """Row i takes row `rows[i]` of `source`, which must hold the whole of that row (`whole`)."""
        if self and not whole:
            raise ValueError("a cache with layer states starts only from whole rows of another: a state holds "
                             "the inputs before its row's last token, not before an earlier one")
        for mine, theirs in zip(self.current, source.current):
            mine.copy_(theirs.index_select(0, rows))

    def select(self, rows: torch.Tensor) -> LayerStates:
        """The states of `rows` (selected, repeated or reordered), with the checkpoints' states so
        selected (no run is run again from them: its tokens were the old rows')."""
        log = None if self.log is None else \
            [Checkpoint(c.seen, None if c.states is None else [s.index_select(0, rows) for s in c.states], c.kept)
             for c in self.log]
        return LayerStates(self.specs, [state.index_select(0, rows) for state in self.current], log)

    def rewind_plan(self, seen: int, keep: int) -> tuple[Checkpoint, list[tuple]]:
        """How a crop from `seen` columns to `keep` goes back: the newest kept checkpoint at or before
        `keep`, and the runs after it to run again, `(ran, columns)` each; a ValueError that says why
        where it cannot."""
        log = self.log or []
        start = next((i for i in reversed(range(len(log))) if log[i].kept and log[i].seen <= keep), None)
        if start is None:
            raise ValueError(_cannot_crop(seen, keep, "this cache keeps none of its states from before that column"))
        redo = []
        for i in range(start, len(log)):
            point = log[i]
            if point.seen >= keep:
                break
            if point.ran is None:
                raise ValueError(_cannot_crop(seen, keep, f"the run from column {point.seen} (one with images, hidden "
                                              "states, attention weights or embeddings) cannot be run again"))
            end = min(log[i + 1].seen if i + 1 < len(log) else seen, keep)
            kind, tokens = point.ran[2]
            if kind == "prompt" and end - point.seen < tokens.ids.shape[1] and \
                    not bool((tokens.lengths == tokens.ids.shape[1]).all()):
                raise ValueError(_cannot_crop(seen, keep, "that column lies inside a padded prompt batch"))
            redo.append((point.ran, end - point.seen))
        return log[start], redo

    @_inference_mode
    def rewind(self, point: Checkpoint, keep_ran: bool = False) -> None:
        """Go back to `point` (`rewind_plan`'s): its states, the log up to it (and the run after it,
        where `keep_ran`: its first tokens are to run again, `KVCache.pending`)."""
        for i, state in enumerate(self.current):
            state.zero_() if point.states is None else state.copy_(point.states[i])
        del self.log[self.log.index(point) + 1:]
        if not keep_ran:
            point.ran = None

    def rows_view(self, start: int, stop: int) -> LayerStates:
        view = copy.copy(self)
        view.current = [s[start:stop] for s in self.current]
        view.written = [s[start:stop] for s in self.written]
        view.log = None
        return view


def _checked_rows(rows, batch: int, device: torch.device) -> torch.Tensor:
    """Row indices for `KVCache`'s selections (`reorder_cache`, `batch_select_indices`, ...) as an int64
    tensor on `device`: a ValueError where they are not a non-empty 1-D run of rows of a `batch`-row cache."""
    rows = torch.as_tensor(rows)
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise TypeError(f"row indices must be integers, got {rows.dtype}")  # 0.7 is not truncated
    rows = rows.to(device, torch.int64)
    if rows.dim() != 1 or rows.numel() == 0:
        raise ValueError(f"row indices must be a non-empty 1-D tensor, got shape {tuple(rows.shape)}")
    if bool(((rows < 0) | (rows >= batch)).any()):
        raise ValueError(f"row indices must lie in [0, {batch})")
    return rows


class KVCache(Cache):
    """The KV cache of one batch, returned as `past_key_values`: a `transformers.Cache`.

    `cache[i]` is layer i's `(key, value)`, each `[B, kv_heads, T, head_size]` with T the longest
    row; row b's entries past `lengths[b]` are not part of its sequence. Not for two threads at once
    (the decoder refuses a second concurrent run over one cache).

    Of transformers' `Cache` API it carries what generation code and libraries call, with
    transformers' semantics, in the caller's column layout: `get_seq_length`, `get_mask_sizes`,
    `crop`, `reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`, `reset`, on the device.
    `update` (a PyTorch attention layer writing its keys) has no meaning here: ONNX Runtime writes it.
    """

    is_compileable, is_croppable, is_initialized = False, True, True

    def __init__(self, spec: DecoderGraph, batch: int, capacity: int, device: torch.device):
        # Cache.__init__ is not called: its per-layer objects hold PyTorch tensors that a PyTorch
        # attention fills; here one buffer per layer is written in place by ONNX Runtime.
        self.specs = spec.layers
        self.layer_class_to_replicate = None
        self.offloading = False
        self.shared = spec.shares_kv_buffer
        dtype = runtime.torch_dtype(spec.kv_type)
        if self.shared:
            # Sliding-window attention in ONNX Runtime wants a buffer of at least the window.
            capacity = max([capacity] + [kv.window or 0 for kv in self.specs])
        else:
            # The buffers hold exactly the columns taken in; `valid` marks the padding among them.
            capacity = 0
            self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.keys, self.values = [], []
        for kv in self.specs:
            shape = (batch, kv.num_kv_heads, capacity, kv.head_size)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self.states = LayerStates(spec.states, [torch.zeros(batch, *s.shape, dtype=dtype, device=device)
                                               for s in spec.states])
        self.presents: tuple[list, list] | None = None  # being written by a concatenating run
        # A hybrid's last tokens `[B, m]` whose KV the cache holds but whose layer states it does
        # not yet (a crop inside a run: `_crop_states`): the next step runs them first (decoder.py).
        self.pending: torch.Tensor | None = None
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)  # tokens held per row
        self.longest = 0  # max(lengths), kept on the host
        self.seen = 0  # columns of the caller's input_ids (padding included) this cache has taken in
        # The caller's attention mask so far ([B, seen]), for checking a step's mask; None inside
        # generate and scoring, which build their own steps.
        self.caller_mask: torch.Tensor | None = None
        # The caller's token ids of those columns ([B, seen]) where forward and generate know them (None: not
        # known), for generate continuing this cache (`keep_known`).
        self.tokens: torch.Tensor | None = None
        self.position_offset: torch.Tensor | None = None  # next position - tokens held (mRoPE after images)
        self.version = 0  # bumped whenever the buffers are replaced: a binding of older ones is stale

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def span(self) -> int:
        """The columns of the buffers that hold entries."""
        return self.longest if self.shared else self.capacity

    def reserve(self, needed: int, limit: int) -> None:
        """Grow every buffer to hold `needed` positions (doubling, up to `limit`), copying on the device."""
        if not self.shared or needed <= self.capacity:
            return
        capacity = min(max(needed, 2 * self.capacity), limit)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                new[:, :, : old.shape[2]] = old
                buffers[i] = new
        self.version += 1

    def next_positions(self, new: int) -> torch.Tensor:
        """`[B, new]`: the positions of `new` tokens appended to every row."""
        positions = self.lengths[:, None] + torch.arange(new, device=self.lengths.device)
        return positions if self.position_offset is None else positions + self.position_offset[:, None]

    def step_mask(self, new: int, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask of a run that appends `new` tokens to every row."""
        if not self.shared:
            return torch.cat([self.valid, self.valid.new_ones(self.batch_size, new)], 1).to(dtype)
        steps = torch.arange(self.longest + new, device=self.lengths.device)
        return (steps[None, :] < (self.lengths + new)[:, None]).to(dtype)

    @_inference_mode
    def start(self, lengths: torch.Tensor, longest: int, columns: int, ran: tuple | None = None) -> None:
        """Record a prefilled prompt batch: per-row lengths, the longest, the caller's width (`ran`:
        how to run it again, `Checkpoint`)."""
        self.lengths.copy_(lengths)
        self.longest = longest
        self.seen = columns
        self.position_offset = None
        self.states.restart()
        self.states.take(columns, ran)
        if not self.shared:
            self._take_presents()
            self.valid = torch.arange(columns, device=lengths.device)[None, :] < lengths[:, None]

    @_inference_mode
    def start_from(self, source: KVCache, rows: torch.Tensor, lengths: torch.Tensor, longest: int) -> None:
        """Start row i as row `rows[i]` of `source`, holding its first `lengths[i]` entries (prefixes
        shared by several rows, run once in `source`)."""
        settle(source)
        width = source.span
        # Only a hybrid's states need the check, a read of the device: the shared path reads none otherwise.
        whole = not self.states or bool((source.lengths.index_select(0, rows) == lengths).all())
        self.states.start_from(source.states, rows, whole)
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for i, buffer in enumerate(theirs):
                picked = buffer.index_select(0, rows)[:, :, :width]
                if self.shared:
                    mine[i][:, :, :width] = picked
                else:
                    mine[i] = picked.contiguous()
        if not self.shared:
            self.valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
            self.version += 1
        self.lengths.copy_(lengths)
        self.longest = longest
        self.seen = width
        self.position_offset = None if source.position_offset is None else source.position_offset.index_select(0, rows)
        self.states.restart(width, zeros=False)

    @_inference_mode
    def advance(self, new: int, columns: int, ran: tuple | None = None) -> None:
        """Record a run that appended `new` tokens (`columns` of the caller's input) to every row (`ran`:
        how to run it again, `Checkpoint`)."""
        self.lengths += new
        self.longest += new
        self.seen += columns
        self.states.take(self.seen, ran)
        if not self.shared:
            self._take_presents()
            self.valid = torch.cat([self.valid, self.valid.new_ones(self.batch_size, new)], 1)

    def _take_presents(self) -> None:
        self.keys, self.values = self.presents
        self.presents = None
        self.version += 1

    # ---- transformers' Cache API --------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The columns of the caller's input taken in so far (padding included), as transformers counts."""
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows on the device up to the model's context, as a DynamicCache grows

    @property
    def layers(self) -> list:
        """One `(key, value)` view per layer (transformers' caches hold per-layer objects here)."""
        return [_LayerView(self, i) for i in range(len(self.specs))]

    is_sliding = property(lambda self: [kv.window is not None for kv in self.specs])
    is_linear = property(lambda self: [False] * len(self.specs))
    is_dummy = property(lambda self: [False] * len(self.specs))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        raise NotImplementedError(
            "a KVCache is written by ONNX Runtime inside OrtModelForCausalLM; it cannot take key/value states from "
            "a PyTorch attention layer. Pass it back to the OrtModelForCausalLM that returned it."
        )

    @_inference_mode
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` columns of the caller's input (transformers 5; 0 removes
        nothing). A positive value keeps the first `tokens_to_remove` columns, as transformers 4's
        `crop(max_length)` did (guidance 0.3 calls it so; transformers 5.23's own caches refuse it)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"crop takes an int, got {type(tokens_to_remove).__name__}")
        keep = self.seen + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self.seen)
        if keep < 0:
            raise ValueError(f"cannot crop {-tokens_to_remove} columns from a cache holding {self.seen}")
        if keep == self.seen:
            return
        if self.states:
            _crop_states(self, keep)
        else:
            _crop_columns(self, keep)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)  # row i becomes a copy of row beam_idx[i] (beam search)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (row i becomes rows i*repeats ... i*repeats+repeats-1)."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"batch_repeat_interleave takes a positive int, got {repeats!r}")
        self._select_rows(torch.arange(self.batch_size, device=self.lengths.device).repeat_interleave(repeats))

    @_inference_mode
    def _select_rows(self, rows: torch.Tensor) -> None:
        settle(self)
        rows = _checked_rows(rows, self.batch_size, self.lengths.device)
        self.keys = [key.index_select(0, rows) for key in self.keys]
        self.values = [value.index_select(0, rows) for value in self.values]
        self.states = self.states.select(rows)
        self.lengths = self.lengths.index_select(0, rows)
        if not self.shared:
            self.valid = self.valid.index_select(0, rows)
        if self.caller_mask is not None:
            self.caller_mask = self.caller_mask.index_select(0, rows)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, rows)
        if self.position_offset is not None:
            self.position_offset = self.position_offset.index_select(0, rows)
        self.version += 1

    @_inference_mode
    def reset(self) -> None:
        """Empty every row (the buffers stay allocated)."""
        self.lengths.zero_()
        self.longest = self.seen = 0
        self.caller_mask = self.position_offset = self.pending = self.tokens = None
        self.states.zero()
        self.states.restart()
        if not self.shared:
            self.keys = [key[:, :, :0].contiguous() for key in self.keys]
            self.values = [value[:, :, :0].contiguous() for value in self.values]
            self.valid = self.valid[:, :0]
            self.version += 1

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, : self.span], self.values[layer][:, :, : self.span]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"KVCache(batch={self.batch_size}, layers={len(self)}, longest={self.longest}, capacity={self.capacity})"


def _crop_columns(cache: KVCache, keep: int) -> None:
    removed = cache.seen - keep
    # Tokens each row loses: its real tokens among the removed columns of the caller's layout.
    if cache.caller_mask is not None:
        lost = cache.caller_mask[:, keep:].sum(1)
        cache.caller_mask = cache.caller_mask[:, :keep]
    else:
        lost = torch.full_like(cache.lengths, removed)
    lost = torch.minimum(lost, cache.lengths)
    if cache.tokens is not None:
        cache.tokens = cache.tokens[:, :keep]
    if not cache.shared:
        # Drop each row's last `lost` valid columns, then the columns no row uses any more.
        rank = cache.valid.flip(1).cumsum(1).flip(1)  # valid columns at or after each column
        cache.valid &= rank > lost[:, None]
        used = int(cache.valid.any(0).nonzero().max().item()) + 1 if bool(cache.valid.any()) else 0
        cache.valid = cache.valid[:, :used]
        cache.keys = [key[:, :, :used].contiguous() for key in cache.keys]
        cache.values = [value[:, :, :used].contiguous() for value in cache.values]
        cache.version += 1
    cache.lengths -= lost
    cache.longest = int(cache.lengths.max().item())
    cache.seen = keep


def _crop_states(cache: KVCache, keep: int) -> None:
    """A hybrid's crop: back to the newest layer states kept at or before `keep`
    (`LayerStates.rewind_plan`), then the tokens from there to `keep` run again, the prompt's and
    the steps' (these in one run). Where those are the first tokens of one step run (assisted
    decoding's accepted candidates), they are left `pending` instead, their KV kept: the next step
    runs them before its own tokens, in the same run (decoder.py), or `settle` does."""
    cache.pending = None  # the log has them: the states are at its last checkpoint
    point, redo = cache.states.rewind_plan(cache.seen, keep)
    if len(redo) == 1:
        (_, _, (kind, tokens)), columns = redo[0]
        if kind == "step":
            _crop_columns(cache, keep)
            cache.states.rewind(point, keep_ran=True)
            cache.pending = tokens[:, :columns]
            return
    decoders = [ran[0] for ran, _ in redo]  # weak proxies
    try:
        for decoder in decoders:
            decoder.device  # noqa: B018 (a dead proxy raises)
    except ReferenceError:
        raise ValueError(_cannot_crop(cache.seen, keep, "the model that ran it is gone")) from None
    mask = None if cache.caller_mask is None else cache.caller_mask[:, :keep]
    known = None if cache.tokens is None else cache.tokens[:, :keep]  # the runs again do not keep them
    _crop_columns(cache, point.seen)
    cache.states.rewind(point)
    steps = []
    for ((_, rerun, (kind, tokens)), columns), decoder in zip(redo, decoders):
        if kind == "prompt":
            rerun(decoder, cache, kind, tokens, columns)
        else:
            steps.append(tokens[:, :columns])
    if steps:
        rerun(decoders[-1], cache, "step", torch.cat(steps, 1), sum(t.shape[1] for t in steps))
    cache.caller_mask, cache.tokens = mask, known


def keep_known(cache: KVCache, input_ids: torch.Tensor) -> None:
    """Before generate continues `cache` with `input_ids` (every column, the cached ones first): where
    the cache knows its tokens (`KVCache.tokens`) and the ids do not extend them, cropped back to the
    columns they share (all but the last id at most), so that the rest run again rather than stale
    keys. transformers' assistant across tokenizers (`assistant_tokenizer`) after a rejected draft is
    such a caller: since transformers 5.25 it leaves its assistant's cache as long as the new ids or
    longer (its own model then appends the ids again after them, and drafts from that)."""
    known = cache.tokens
    if known is None or known.shape != (input_ids.shape[0], cache.seen) or input_ids.dim() != 2:
        return
    width = min(cache.seen, input_ids.shape[1] - 1)
    same = (known[:, :width] == input_ids[:, :width].to(known.device)).all(0)
    keep = int(same.to(torch.int64).cumprod(0).sum())  # the columns every row shares, from the first
    if keep < cache.seen:
        cache.crop(keep - cache.seen)


# What each empty transformers cache given to forward or generate (a `DynamicCache()`) stands for: the KVCache made
# for it, and the decoder that made it. transformers fills its own caches in place, so callers pass the same object
# again (a manual decoding loop, one cache for every turn of a chat); that object cannot hold ONNX Runtime's
# buffers, so the next call with it continues the KVCache this map names. Weak: the entry goes with the object.
_CARRIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def carry(given: Cache, cache: KVCache, decoder) -> None:
    """Let `given` (an empty transformers cache the caller passed) stand for `cache` in the next call."""
    _CARRIED[given] = (weakref.ref(decoder), cache)


def carried(given, decoder) -> KVCache | None:
    """The KVCache an empty transformers cache stands for (`carry`), where this decoder made it; else None."""
    try:
        entry = _CARRIED.get(given)
    except TypeError:  # an object that cannot be a weak key stands for nothing
        return None
    return entry[1] if entry is not None and entry[0]() is decoder else None


def refill(emptied: KVCache, new: KVCache) -> KVCache:
    """`emptied` (a cache `reset()` or cropped of every column, given with a prompt) made to hold `new`'s
    entries and buffers (the prompt's cache), so that the object the caller holds is filled in place, as
    transformers' caches are. The version passes both, so no binding of either's older buffers is taken
    for current."""
    version = max(emptied.version, new.version) + 1
    emptied.__dict__.update(new.__dict__)
    emptied.version = version
    return emptied


def take_back(cache: KVCache) -> torch.Tensor:
    """The cache's `pending` tokens, taken back out of it (every row shortened by them, the last
    columns of a step's run; the caller's mask kept whole): to run them again, before any new ones.
    No read from the device, as `advance` makes none."""
    tokens, cache.pending = cache.pending, None
    new = tokens.shape[1]
    cache.lengths -= new
    cache.longest -= new
    cache.seen -= new
    if not cache.shared:
        cache.valid = cache.valid[:, :-new]
        cache.keys = [key[:, :, :-new].contiguous() for key in cache.keys]
        cache.values = [value[:, :, :-new].contiguous() for value in cache.values]
        cache.version += 1
    return tokens


def settle(cache: KVCache) -> None:
    """Run a hybrid cache's `pending` tokens again (their layer states), if it has any: before
    anything that reads its states other than a step (which runs them with its own)."""
    if cache.pending is None:
        return
    decoder, rerun, _ = cache.states.log[-1].ran
    tokens = take_back(cache)
    rerun(decoder, cache, "step", tokens, tokens.shape[1])


def rows_view(cache: KVCache, start: int, stop: int, longest: int) -> KVCache:
    """A cache over rows `start` to `stop` of `cache`, the longest holding `longest` tokens (the
    caller knows it: no read from the device), sharing its buffers and lengths (runs over it write
    into `cache`): a continuous batch runs only the slots in use (shared_prompts.py one row at a
    time). Shared layout only."""
    if not cache.shared:
        raise ValueError("rows_view needs the shared-buffer layout (GroupQueryAttention)")
    view = copy.copy(cache)
    view.keys = [key[start:stop] for key in cache.keys]
    view.values = [value[start:stop] for value in cache.values]
    view.states = cache.states.rows_view(start, stop)
    view.lengths = cache.lengths[start:stop]
    view.position_offset = None if cache.position_offset is None else cache.position_offset[start:stop]
    view.longest = longest
    view.caller_mask = None
    return view


class _LayerView:
    """Layer i of a KVCache as transformers' per-layer objects show it: `keys`, `values`, `is_sliding`."""

    is_initialized = True
    is_compileable = False

    def __init__(self, cache: KVCache, index: int):
        self.keys, self.values = cache[index]
        self.is_sliding = cache.specs[index].window is not None
        self._seen = cache.seen

    def get_seq_length(self) -> int:
        return self._seen
