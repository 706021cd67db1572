"""`KVCache`: the key and value buffers of one batch on the device, bound to ONNX Runtime in place.

One key and one value buffer per layer, `[batch, kv_heads, capacity, head_size]` with each layer's
own heads and head size. With GroupQueryAttention (the packages' `past_present_share_buffer`
layout) a buffer is bound as both the past and the present of every run: ONNX Runtime writes the
new entries in place, so the cache never moves and never passes through the host. Attention that
concatenates past and new entries instead writes a new present each run, which replaces the past.

Rows are kept right-padded: row b's tokens fill positions `[0, lengths[b])`, and a run that adds
tokens writes row b's at `lengths[b]` (the attention mask tells GroupQueryAttention each row's
length). Entries a padded prefill leaves behind lie past each row's length and are overwritten.
"""

from __future__ import annotations

import threading

import onnxruntime as ort
import torch

from . import runtime
from .package import Decoder


class KVCache:
    """The KV cache of one batch, returned as `past_key_values`.

    `cache[i]` is layer i's `(key, value)`, each `[B, kv_heads, T, head_size]` with T the longest
    row; row b's entries past `lengths[b]` are not part of its sequence. Not for two threads at once
    (the decoder refuses a second concurrent run over one cache).
    """

    def __init__(self, spec: Decoder, batch: int, capacity: int, device: torch.device):
        self.layers = spec.layers
        self.shared = spec.shares_kv_buffer
        dtype = runtime.torch_dtype(spec.kv_type)
        if self.shared:
            # Sliding-window attention in ONNX Runtime wants a buffer of at least the window.
            capacity = max([capacity] + [kv.window or 0 for kv in self.layers])
        else:
            # The buffers hold exactly the columns taken in; `valid` marks the padding among them.
            capacity = 0
            self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.keys, self.values = [], []
        for kv in self.layers:
            shape = (batch, kv.num_kv_heads, capacity, kv.head_size)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self.presents: tuple[list, list] | None = None  # being written by a concatenating run
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)  # tokens held per row
        self.longest = 0  # max(lengths), kept on the host
        self.seen = 0  # columns of the caller's input_ids (padding included) this cache has taken in
        # The caller's attention mask so far ([B, seen]), for checking a step's mask; None inside
        # generate and scoring, which build their own steps.
        self.caller_mask: torch.Tensor | None = None
        self.version = 0  # bumped whenever the buffers are replaced: a binding of older ones is stale
        self.binding = None  # the decoder's binding for runs over this cache
        self.lock = threading.Lock()  # held by the run in progress

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

    def bind(self, binding: ort.IOBinding, new: int) -> None:
        """Bind every layer's past and present for a run that adds `new` columns. A shared buffer
        is both (ONNX Runtime writes in place); otherwise the presents go to new buffers."""
        if not self.shared:
            self.presents = ([], [])
        for kv, key, value in zip(self.layers, self.keys, self.values):
            runtime.bind_input(binding, kv.past_key, key)
            runtime.bind_input(binding, kv.past_value, value)
            if self.shared:
                runtime.bind_output(binding, kv.present_key, key)
                runtime.bind_output(binding, kv.present_value, value)
                continue
            shape = (*key.shape[:2], key.shape[2] + new, key.shape[3])
            for name, buffers in ((kv.present_key, self.presents[0]), (kv.present_value, self.presents[1])):
                buffers.append(key.new_empty(shape))
                runtime.bind_output(binding, name, buffers[-1])

    def step_mask(self, new: int, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask of a run that appends `new` tokens to every row."""
        if not self.shared:
            return torch.cat([self.valid, self.valid.new_ones(self.batch_size, new)], 1).to(dtype)
        steps = torch.arange(self.longest + new, device=self.lengths.device)
        return (steps[None, :] < (self.lengths + new)[:, None]).to(dtype)

    def start(self, lengths: torch.Tensor, longest: int, columns: int) -> None:
        """Record a prefilled prompt batch: per-row lengths, the longest, the caller's width."""
        self.lengths.copy_(lengths)
        self.longest = longest
        self.seen = columns
        if not self.shared:
            self._take_presents()
            self.valid = torch.arange(columns, device=lengths.device)[None, :] < lengths[:, None]

    def start_from(self, source: KVCache, rows: torch.Tensor, lengths: torch.Tensor, longest: int) -> None:
        """Start row i as row `rows[i]` of `source`, holding its first `lengths[i]` entries (prefixes
        shared by several rows, run once in `source`)."""
        width = source.span
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

    def advance(self, new: int, columns: int) -> None:
        """Record a run that appended `new` tokens (`columns` of the caller's input) to every row."""
        self.lengths += new
        self.longest += new
        self.seen += columns
        if not self.shared:
            self._take_presents()
            self.valid = torch.cat([self.valid, self.valid.new_ones(self.batch_size, new)], 1)

    def _take_presents(self) -> None:
        self.keys, self.values = self.presents
        self.presents = None
        self.version += 1

    # The parts of transformers' Cache interface that user code reads.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, : self.span], self.values[layer][:, :, : self.span]

    def __repr__(self) -> str:
        return f"KVCache(batch={self.batch_size}, layers={len(self)}, longest={self.longest}, capacity={self.capacity})"
