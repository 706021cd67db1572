"""What the decoder's own session cannot give, from a second session of its (LM-head-rewritten)
graph: transformers' hidden states (hidden.py's outputs), attention weights (attentions.py's, on
a CPU), runs from `inputs_embeds` instead of token ids (embeddings.py's input), or several of these.
Made at the first call that asks (`for_decoder`), once per decoder session and kind, cached on disk
like the other rewrites (graph.py).

A multimodal package's decoder already takes embeddings (its embedding model makes them from the
ids): there `inputs_embeds` are bound to that input, in the decoder's own session unless hidden
states are asked for too. Runs take the decoder's bindings and cache locks (`Decoder.holding`);
with hidden states every position goes through the LM head: paths for inspecting or steering a
model, not for speed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref

import onnx
import onnx_ir as ir
import torch

from . import attentions, embeddings, extend, graph, hidden, inputs, runtime
from .cache import KVCache
from .decoder import Decoder, run_prefill
from .graph import RewriteSkipped
from .inputs import Rows
from .package import NotSupportedError

logger = logging.getLogger("ortmodule")

VARIANT_VERSION = "1"
# `hidden_states=LAST`: the final norm's output only, and no LM head (the logits output and what only it
# needed taken out of the graph): the backbone's run (backbone.py)
LAST = "last"


class Variant:
    """A session of the decoder's graph with hidden-state and/or attention-weight outputs and/or an
    embeddings input, and its runs."""

    def __init__(self, decoder: Decoder, session: runtime.Session, hidden_states: bool, embeds_input: str | None,
                 attention_weights: bool = False):
        self.decoder, self.session = weakref.proxy(decoder), session
        self.embeds_input = embeds_input  # where `inputs_embeds` are bound (None: runs take token ids)
        layers = decoder.package.num_hidden_layers
        # the hidden-state outputs, in transformers' order: every layer's, or (LAST) the final norm's
        self.names = [f"{hidden.HIDDEN}{i}" for i in (range(layers + 1) if hidden_states != LAST else [layers])] \
            if hidden_states else []
        self.dtypes = [runtime.output_dtype(session, name) for name in self.names]
        # (name, heads, dtype) of each attention layer's weights, in transformers' order
        self.weights = [(name, heads, runtime.output_dtype(session, name)) for name, heads in
                        attentions.weight_outputs(session, decoder.package.num_attention_heads)] \
            if attention_weights else []
        self.windows = attentions.windows(decoder.graph_bytes) if self.weights else []

    @property
    def inspects(self) -> bool:
        """Whether runs give more than logits (then every position goes through the LM head)."""
        return bool(self.dtypes or self.weights)

    def _bind(self, binding, ids: torch.Tensor, keys: int, extra: dict | None = None):
        """Bind the embeddings (where `ids` are), the embedding model's other outputs (`extra`), the
        hidden-state outputs and the attention weights over `keys` columns; the latter two's tensors."""
        decoder = self.decoder
        if ids.is_floating_point():
            runtime.bind_input(binding, self.embeds_input, ids.to(decoder.kv_dtype).contiguous())
        for name, value in (extra or {}).items():
            runtime.bind_input(binding, name, value.contiguous())
        (batch, queries), size = ids.shape[:2], decoder.package.hidden_size
        out = [torch.empty(batch * queries, size, dtype=dtype, device=decoder.device) for dtype in self.dtypes]
        for name, tensor in zip(self.names, out):
            runtime.bind_output(binding, name, tensor)
        weights = [torch.empty(batch, heads, queries, keys, dtype=dtype, device=decoder.device)
                   for _, heads, dtype in self.weights]
        for (name, _, _), tensor in zip(self.weights, weights):
            runtime.bind_output(binding, name, tensor)
        return out, weights

    def prefill(self, rows: Rows, logit_index: torch.Tensor | None, cache: KVCache | None,
                embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None, extra: dict | None = None,
                caller_mask: torch.Tensor | None = None):
        """`Decoder.prefill`'s logits (every position through the head where the run gives more, then
        the asked-for ones), the hidden states `[B, T, hidden]` and the attention weights `[B, heads,
        T, T]`, in the caller's layout (`caller_mask`: its attention mask; None where not asked for).
        `embeds`: the rows' embeddings `[B, T, hidden]`, `positions` (None: 0, 1, ...; mRoPE's `[3, B,
        T]` after images) and `extra`, the embedding model's other outputs for a Variant made with
        `extra_feeds` ({decoder input: `[B, T, ...]`}), in the decoder's right-padded layout."""
        decoder, session = self.decoder, self.session
        kept = None if self.inspects else logit_index  # the final norm's output is every position's
        ids = rows.ids if embeds is None else embeds
        batch, width = rows.ids.shape
        mask = torch.ones_like(rows.ids, dtype=decoder.mask_dtype) if decoder.spec.attention_mask else None
        if positions is None and decoder.spec.position_ids:
            positions = torch.arange(width, device=decoder.device).expand(batch, -1)
        logits, (states, weights) = run_prefill(decoder, session, rows, ids, kept, mask, positions, cache,
                                                lambda binding: self._bind(binding, ids, width, extra))
        caller = inputs.every_position(rows)
        states = tuple((s if caller is None else s.index_select(0, caller)).view(batch, width, -1) for s in states)
        if weights:
            ran = torch.arange(width, device=rows.lengths.device)[None, :] < rows.lengths[:, None]
            given = ran if caller_mask is None else caller_mask.to(ran.device) != 0
            weights = tuple(attentions.to_caller(w, ran, given, ran, given) for w in weights)
        return _kept(logits, kept, logit_index), states or None, tuple(weights) or None

    def step(self, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None,
             caller_mask: torch.Tensor | None = None):
        """`Decoder.step`'s logits, the new tokens' hidden states `[B, s, hidden]` and attention
        weights `[B, heads, s, columns]` over the caller's columns (`caller_mask` `[B, columns]`, which
        the weights need; a sliding-window layer's over the columns transformers' cache keeps; else
        None); `tokens`: ids `[B, s]` or embeddings `[B, s, hidden]`."""
        batch, new = tokens.shape[:2]
        if new > 1 and (batch > 1 or (self.decoder.spec.steps_one_token and cache.longest > 0)):
            runs = [self._run_step(tokens[:, i : i + 1], cache, None, None if caller_mask is None else
                                   caller_mask[:, : caller_mask.shape[1] - new + i + 1]) for i in range(new)]
            logits = torch.cat([r[0].view(batch, 1, -1) for r in runs], 1).view(batch * new, -1)
            logits = logits if logit_index is None else logits.index_select(0, logit_index)
            states = tuple(torch.cat(layer, 1) for layer in zip(*(r[1] for r in runs))) if self.dtypes else None
            width = None if caller_mask is None else caller_mask.shape[1]
            weights = tuple(torch.cat([torch.nn.functional.pad(w, (0, width - w.shape[3])) for w in layer], 2)
                            for layer in zip(*(r[2] for r in runs))) if self.weights else None
        else:
            logits, states, weights = self._run_step(tokens, cache, logit_index, caller_mask)
        return logits, states, weights and attentions.windowed(weights, self.windows, new)

    def _run_step(self, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None,
                  caller_mask: torch.Tensor | None):
        """One run of `step` (every window's columns kept)."""
        decoder, session = self.decoder, self.session
        batch, new = tokens.shape[:2]
        with decoder.holding(cache) as runs:
            cache.reserve(cache.longest + new, decoder.package.context_length)
            binding = decoder.cache_binding(runs, cache, new, session)
            mask = cache.step_mask(new, decoder.mask_dtype) if decoder.mask_dtype is not None else None
            ran = cache.step_mask(new, torch.bool)
            states, weights = self._bind(binding, tokens, ran.shape[1])
            kept = None if self.inspects else logit_index  # as in prefill
            logits = decoder.run_bound(session, binding, tokens, kept, mask, cache.next_positions(new))
            cache.advance(new, new)
        states = tuple(s.view(batch, new, -1) for s in states)
        if weights:
            every = torch.ones(batch, new, dtype=torch.bool, device=ran.device)
            weights = tuple(attentions.to_caller(w, every, every, ran, caller_mask) for w in weights)
        return _kept(logits, kept, logit_index), states or None, tuple(weights) or None


def _kept(logits: torch.Tensor | None, kept: torch.Tensor | None, logit_index: torch.Tensor | None):
    """A run's logits `[n, V]` at `logit_index` where the run computed every position (`kept` None);
    None from a graph without the LM head (LAST)."""
    if logits is None:
        return None
    logits = logits.view(-1, logits.shape[-1])
    return logits.index_select(0, logit_index) if kept is None and logit_index is not None else logits


_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> {(kind): (its session, Variant)}
_lock = threading.Lock()


def graph_bytes(decoder: Decoder, hidden_states: bool, take_embeds: bool, base: bytes | None = None,
                kind: str = "variant", attention_weights: bool = False) -> bytes:
    """`base` (the decoder's LM-head-rewritten graph where None; blocks.py gives its blocks graph)
    with hidden.py's outputs, an embeddings input and/or attentions.py's outputs, cached like the
    rewrites as `kind`."""
    package, base = decoder.package, decoder.graph_bytes if base is None else base
    digest = hashlib.sha256(base)
    digest.update(f"|{hidden_states}|{take_embeds}|{attention_weights}|{package.num_hidden_layers}|{package.hidden_size}|"
                  f"{package.model_type}|{VARIANT_VERSION}|{graph.code_digest()}|{ir.__version__}".encode())

    def build() -> bytes:
        model = ir.serde.deserialize_model(onnx.ModelProto.FromString(base))
        if take_embeds:
            embeddings.take_embeddings(model.graph, decoder.spec.input_ids, package.model_type, package.hidden_size)
        if hidden_states:
            hidden.add_hidden_outputs(model.graph, package.num_hidden_layers, package.hidden_size,
                                      last_only=hidden_states == LAST)
        if hidden_states == LAST:
            hidden.drop_output(model, decoder.spec.logits)
        if attention_weights:
            attentions.add_attention_outputs(model.graph, package.num_attention_heads,
                                             runtime.ONNX_TYPE[decoder.kv_dtype])
        return ir.serde.serialize_model(model).SerializeToString()

    return graph.cached(decoder.cache_dir, f"{decoder.spec.path.stem}-{kind}-{digest.hexdigest()[:32]}", build)


def for_decoder(decoder: Decoder, hidden_states: bool, embeds: bool, extra_feeds: bool = False,
                attention_weights: bool = False) -> Variant:
    """The decoder's `Variant` giving hidden states and/or attention weights and/or taking
    embeddings, for its current session (made at the first call, again after `to(device)`); raises
    `RewriteSkipped` naming why a package's graph cannot. `extra_feeds`: the caller also gives the
    embedding model's other outputs (`Variant.prefill`'s `extra`: a multimodal package's own
    embedding model run on media)."""
    embedding = decoder.package.embedding
    if embeds and embedding is not None and len(embedding.feeds) != 1 and not extra_feeds:
        others = [target for _, target in embedding.feeds if target != embeds_feed(decoder)]
        raise RewriteSkipped(f"the package's embedding model also gives {others}, which ortmodule makes from token "
                             "ids only")
    with _lock:
        made = _made.setdefault(decoder, {})
        kind = (hidden_states, embeds, attention_weights)
        if kind in made and made[kind][0] is decoder.session:
            return made[kind][1]
        embeds_input = None
        if embeds and embedding is not None:
            embeds_input = embeds_feed(decoder)
        elif embeds:
            embeds_input = embeddings.EMBEDS
        if hidden_states or attention_weights or embedding is None:
            if not decoder.keeps_positions:
                raise RewriteSkipped("it needs the LM-head rewrite, which is off (rewrite_lm_head=False) or did not "
                                     "apply to this package's graph (the load's log says why)")
            data = graph_bytes(decoder, hidden_states, embeds and embedding is None,
                               attention_weights=attention_weights)
            session = runtime.make_session(data, decoder.device, decoder.spec.path.parent, decoder.session_options,
                                           decoder.run_provider_options, fp32_path=decoder.fp32_path,
                                           prepack=extend.has_quantized_weights(decoder.graph_bytes))
            logger.info("ortmodule: a second session of %s on %s for %s", decoder.spec.path, decoder.device,
                        " and ".join(w for w, asked in (("hidden states", hidden_states), ("embeddings", embeds),
                                                        ("attention weights", attention_weights)) if asked))
        else:
            session = decoder.wide_session  # the decoder's own graph takes embeddings
        variant = Variant(decoder, session, hidden_states, embeds_input, attention_weights)
        made[kind] = (decoder.session, variant)
        return variant


def rolled(rows: Rows, embeds: torch.Tensor) -> torch.Tensor:
    """A left-padded batch's embeddings `[B, T, H]` in the decoder's right-padded layout (rows.shift)."""
    if rows.shift is None:
        return embeds
    width = embeds.shape[1]
    order = (torch.arange(width, device=embeds.device)[None, :] + rows.shift[:, None].to(embeds.device)) % width
    return embeds.gather(1, order[..., None].expand(-1, -1, embeds.shape[2]))


def checked_embeds(embeds, hidden_size: int, device: torch.device) -> torch.Tensor:
    """`inputs_embeds` as forward takes them: a float tensor `[batch, sequence, hidden]`, on `device`."""
    if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
        raise TypeError(f"inputs_embeds must be a float tensor, got {getattr(embeds, 'dtype', type(embeds).__name__)}")
    if embeds.dim() != 3 or embeds.shape[2] != hidden_size or 0 in embeds.shape:
        raise ValueError(f"inputs_embeds must be [batch, sequence, {hidden_size}] (the model's hidden size), got "
                         f"{tuple(embeds.shape)}")
    if embeds.requires_grad:  # ONNX Runtime takes no tensor that requires grad (DLPack's BufferError)
        if torch.is_grad_enabled():
            raise NotSupportedError("inputs_embeds require grad (a soft prompt or steering vector being trained?): an "
                                    "ONNX package runs inference only, its graph computes no gradients; pass "
                                    "inputs_embeds.detach(), or call it under torch.no_grad()")
        embeds = embeds.detach()
    return embeds.to(device)


def embeds_feed(decoder: Decoder) -> str:
    """The decoder input a multimodal package's embedding model gives its embeddings to
    (genai_config's `decoder.inputs.inputs_embeds`; the embedding model's one feed where it has one)."""
    feeds = [target for _, target in decoder.package.embedding.feeds]
    named = decoder.package.genai_config["model"]["decoder"].get("inputs", {}).get("inputs_embeds", "inputs_embeds")
    return named if named in feeds else feeds[0]
