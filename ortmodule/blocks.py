"""Prompts whose tokens see later tokens within blocks: Gemma 3's images.

transformers' Gemma 3 attends both ways within each image of a prompt (the processor's
`token_type_ids` mark the image tokens; each run of them is a block): an image token sees every
token of its own image, later ones included, besides everything before it, on every layer (on a
sliding-window layer, within the window). A package's GroupQueryAttention is causal, so such a
prompt runs in the blocks graph instead (extend.py's `blocks_graph`: ONNX's `Attention` with an
additive mask given as an input, the keys and values kept), from an empty past, with the mask built
here; its keys and values go into the cache, and the steps after it (text) run in the package graph
as always.
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import attentions, extend, graph, hidden, projections, runtime, variants
from .cache import KVCache
from .graph import RewriteSkipped
from .inputs import Rows

TEXT = -1  # a token outside every block


class BlocksUnsupported(Exception):
    """The decoder's graph cannot be run with blocks (the reason is the message)."""


def block_ids(marks: torch.Tensor) -> torch.Tensor:
    """Each token's block `[B, T]` from `marks` (nonzero: an image token): each run of marked tokens
    is a block, numbered along the row; TEXT elsewhere (transformers' `get_block_sequence_ids_for_mask`)."""
    marked = marks != 0
    starts = marked & ~torch.nn.functional.pad(marked, (1, 0))[:, :-1]
    return torch.where(marked, starts.long().cumsum(1) - 1, torch.full_like(marked, TEXT, dtype=torch.long))


def block_bias(lengths: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """The additive mask `[B, 1, T, T]` of right-padded rows of `lengths` tokens: token i sees token j
    where j is one of the row's tokens and j <= i or both are in one block; with a `window`, only
    where i - j < window too (transformers' Gemma 3: sliding window AND (causal OR block)). Padding
    sees the row's tokens before it (its outputs are read by no one)."""
    width = blocks.shape[1]
    order = torch.arange(width, device=blocks.device)
    real = order[None, :] < lengths[:, None]  # [B, T]
    causal = order[:, None] >= order[None, :]  # [T, T]: query i, key j
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] != TEXT)
    seen = real[:, None, :] & (causal[None] | same)
    if window:
        seen &= (order[:, None] - order[None, :]) < window
    hidden = torch.finfo(dtype).min
    return torch.where(seen, torch.zeros((), dtype=dtype, device=blocks.device),
                       torch.full((), hidden, dtype=dtype, device=blocks.device))[:, None]


class BlockPrefill:
    """Runs the blocks graph of a decoder (`for_decoder` makes it): right-padded rows of embeddings
    from an empty cache, with blocks, into the cache."""

    def __init__(self, decoder, session: runtime.Session):
        self.decoder, self.session = weakref.proxy(decoder), session  # a binding per call: any threads
        names = {i.name for i in session.ort_session.get_inputs()}
        self.windows = sorted(int(name[len(extend.WINDOW_BIAS):]) for name in names
                              if name.startswith(extend.WINDOW_BIAS))
        self.positions = extend.POSITIONS in names
        spec = decoder.spec
        self.embeds = next((name for name in (spec.input_ids, "inputs_embeds") if name in names), None)
        known = {self.embeds, extend.POSITIONS, extend.ATTENTION_BIAS, graph.LOGITS_INDICES,
                 *(f"{extend.WINDOW_BIAS}{window}" for window in self.windows)}
        known |= {name for kv in spec.layers for name in (kv.past_key, kv.past_value)}
        made = {o.name for o in session.ort_session.get_outputs()}
        # transformers' hidden states where the graph gives them (`for_decoder(..., hidden_states=True)`)
        self.states = sorted((name for name in made if name.startswith(hidden.HIDDEN)),
                             key=lambda name: int(name[len(hidden.HIDDEN):]))
        # and its attention weights (`for_decoder(..., attention_weights=True)`): (name, heads) a layer
        self.weights = attentions.weight_outputs(session, decoder.package.num_attention_heads)
        unknown, missing = names - known, {name for kv in spec.layers for name in (kv.present_key, kv.present_value)}
        if self.embeds is None or unknown or spec.states or not missing <= made:
            raise RewriteSkipped(f"the blocks graph takes {sorted(names)} and gives {sorted(made)}")

    def run(self, rows: Rows, embeds: torch.Tensor, blocks: torch.Tensor, logit_index: torch.Tensor | None,
            cache: KVCache | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Logits `[n, V]` at `logit_index` (every position where None) of right-padded `embeds`
        `[B, T, H]` (`rows`: their lengths) with `blocks` `[B, T]` (block_ids), their keys and values
        into `cache` (a fresh one) where given; the hidden states `[B * T, H]` a layer and the
        attention weights `[B, heads, T, T]` a layer (in the rows' layout) where the graph gives them
        (every position through the LM head then, as `Variant.prefill`'s), else ()."""
        decoder = self.decoder
        device, dtype = decoder.device, decoder.kv_dtype
        batch, width = rows.ids.shape
        binding = self.session.io_binding()
        runtime.bind_input(binding, self.embeds, embeds.to(device).contiguous())
        if self.positions:
            positions = torch.arange(width, device=device).clamp_(max=decoder.package.context_length - 1)
            runtime.bind_input(binding, extend.POSITIONS, positions.expand(batch, -1).contiguous())
        lengths, blocks = rows.lengths.to(device), blocks.to(device)
        runtime.bind_input(binding, extend.ATTENTION_BIAS, block_bias(lengths, blocks, dtype))
        for window in self.windows:
            runtime.bind_input(binding, f"{extend.WINDOW_BIAS}{window}", block_bias(lengths, blocks, dtype, window))
        presents = []
        for kv in decoder.spec.layers:
            empty = torch.empty(batch, kv.num_kv_heads, 0, kv.head_size, dtype=dtype, device=device)
            runtime.bind_input(binding, kv.past_key, empty)
            runtime.bind_input(binding, kv.past_value, empty)
            made = [torch.empty(batch, kv.num_kv_heads, width, kv.head_size, dtype=dtype, device=device)
                    for _ in range(2)]
            runtime.bind_output(binding, kv.present_key, made[0])
            runtime.bind_output(binding, kv.present_value, made[1])
            presents.append(made)
        every = self.states or self.weights or logit_index is None  # the final norm's output is every position's
        kept = torch.arange(batch * width, device=device) if every else logit_index
        runtime.bind_input(binding, graph.LOGITS_INDICES, kept)
        logits = torch.empty(kept.numel(), decoder.vocab_size, dtype=decoder.head_dtype, device=device)
        runtime.bind_output(binding, decoder.spec.logits, logits)
        states = tuple(torch.empty(batch * width, decoder.package.hidden_size, device=device,
                                   dtype=runtime.output_dtype(self.session, name)) for name in self.states)
        for name, state in zip(self.states, states):
            runtime.bind_output(binding, name, state)
        weights = tuple(torch.empty(batch, heads, width, width, device=device, dtype=runtime.output_dtype(
            self.session, name)) for name, heads in self.weights)
        for (name, _), tensor in zip(self.weights, weights):
            runtime.bind_output(binding, name, tensor)
        self.session.run(binding)
        if cache is not None:
            _fill(cache, presents, rows, decoder.package.context_length)
        if every and logit_index is not None:
            logits = logits.index_select(0, logit_index)
        return logits, states, weights


def _fill(cache: KVCache, presents: list, rows: Rows, context: int) -> None:
    """A fresh cache holding `presents` ([key, value] a layer, `[B, kv_heads, T, head]`) for `rows`."""
    width = rows.ids.shape[1]
    if not cache.shared:
        raise BlocksUnsupported("a decoder that concatenates its cache (no shared KV buffer)")
    cache.reserve(width, context)
    for i, (key, value) in enumerate(presents):
        cache.keys[i][:, :, :width] = key
        cache.values[i][:, :, :width] = value
    cache.start(rows.lengths, rows.longest, width)


# decoder -> {(hidden states?, attention weights?): (its session, BlockPrefill or reason)}
_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def for_decoder(decoder, hidden_states: bool = False, attention_weights: bool = False) -> BlockPrefill:
    """The decoder's `BlockPrefill` (one whose graph also gives transformers' hidden states where
    `hidden_states`, its attention weights where `attention_weights`), made at the first prompt with
    blocks that asks for it (again after `to(device)`); `BlocksUnsupported` naming why where its
    graph cannot be rewritten so."""
    kind = (hidden_states, attention_weights)
    with _lock:
        kinds = _made.setdefault(decoder, {})
        made = kinds.get(kind)
        if made is None or made[0] is not decoder.session:
            made = kinds[kind] = (decoder.session, _make(decoder, *kind))
    if isinstance(made[1], str):
        raise BlocksUnsupported(made[1])
    return made[1]


def _graph_bytes(decoder, head_size: int, expand: bool, unpack: bool, hidden_states: bool,
                 attention_weights: bool) -> bytes:
    """The blocks graph's bytes, with hidden.py's and/or attentions.py's outputs where asked
    (variants.py's rewrite)."""
    data = extend.extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem, head_size, expand,
                                     decoder.cache_dir, layout="blocks", unpack_qkv=unpack)
    if not (hidden_states or attention_weights):
        return data
    return variants.graph_bytes(decoder, hidden_states, False, data, "blocks-inspected", attention_weights)


def _make(decoder, hidden_states: bool, attention_weights: bool) -> BlockPrefill | str:
    if not decoder.spec.shares_kv_buffer:
        return "the decoder concatenates its cache (no GroupQueryAttention to rewrite)"
    unpack = projections.applies(decoder.device.type, decoder.session_options)
    expand = decoder.device.type == "cuda" and extend.REPEAT_KV_HEADS_ON_CUDA  # as the extend graph's
    try:  # up to 90% of the free memory: without it, prompts with images cannot run at all
        session = extend.rewrite_session(
            decoder, lambda head_size: _graph_bytes(decoder, head_size, expand, unpack, hidden_states,
                                                    attention_weights), room=0.9)
        if isinstance(session, str):
            return f"the blocks graph cannot be made: {session}"
        return BlockPrefill(decoder, session)
    except RewriteSkipped as reason:
        return f"the decoder's graph cannot be rewritten to attend within blocks: {reason}"
