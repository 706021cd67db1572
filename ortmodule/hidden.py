"""`forward(..., output_hidden_states=True)`: transformers' `hidden_states`, from a copy of the
decoder's graph that also returns them.

transformers returns `num_hidden_layers + 1` tensors `[batch, sequence, hidden]`: the residual
stream entering each layer (the first is the token embeddings, scaled where the model scales them),
and last the final norm's output, the LM head's input. A builder decoder computes each of them:
layer i's first norm reads the residual stream, its `input_layernorm` (`operator_layernorm` in
LFM2) either a plain norm of it (layer 0) or a skip norm that adds the previous layer's output to
the residual and returns the sum as its fourth output; the final norm's output feeds the head.
`hidden_graph` makes those values outputs (reshaped to `[rows * positions, hidden]`) of the
LM-head-rewritten graph, cached like it (graph.py). Graphs named otherwise (mobius-onnx's) raise
`RewriteSkipped`, and the caller a `NotSupportedError` with the reason.

The session is made at the first such call (the weights' pages shared as the extend graph's are,
extend.py) and runs every position through the LM head: a path for inspecting a model, not for
speed. Runs take the decoder's own bindings and cache locks (`Decoder.holding`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import weakref

import onnx
import onnx_ir as ir
import torch

from . import extend, graph, inputs, runtime
from .cache import KVCache
from .decoder import Decoder
from .graph import RewriteSkipped
from .inputs import Rows

logger = logging.getLogger("ortmodule")

HIDDEN = "ortmodule_hidden_states_"  # + the index in transformers' tuple
HIDDEN_VERSION = "1"
_FIRST_NORMS = ("input_layernorm", "operator_layernorm")
_NORMS = {"SimplifiedLayerNormalization", "LayerNormalization"}
_SKIP_NORMS = {"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}
_SUM = 3  # a skip norm's input + skip (+ bias) sum output
_LAYER_NORM = re.compile(r"^/model/layers\.(\d+)/([a-z_]+)/")


def hidden_values(g: ir.Graph, layers: int) -> list[ir.Value]:
    """The `layers + 1` values transformers returns as `hidden_states`, in its order."""
    first: dict[int, ir.Node] = {}
    final = None
    for node in g:
        found = _LAYER_NORM.match(node.name or "")
        if found is None or node.op_type not in _NORMS | _SKIP_NORMS:
            continue
        layer, name = int(found[1]), found[2]
        if name in _FIRST_NORMS and layer not in first:
            first[layer] = node
        elif name == "final_norm_layernorm" and layer == layers:
            final = node
    missing = [i for i in range(layers) if i not in first]
    if missing or final is None:
        what = f"layers {missing[:3]} have no input norm" if missing else f"no final norm after layer {layers - 1}"
        raise RewriteSkipped(f"the graph's nodes are not named as the model builder names them ({what})")
    values = []
    for layer in range(layers):
        node = first[layer]
        if node.op_type in _NORMS:
            values.append(node.inputs[0])
        elif len(node.outputs) > _SUM and node.outputs[_SUM] is not None and node.outputs[_SUM].name:
            values.append(node.outputs[_SUM])
        else:
            raise RewriteSkipped(f"'{node.name}' does not return the residual stream (its sum output)")
    return [*values, final.outputs[0]]


def hidden_graph(proto: onnx.ModelProto, layers: int, hidden_size: int) -> onnx.ModelProto:
    """The graph with outputs `HIDDEN + i` `[rows * positions, hidden_size]`, i = 0 ... layers."""
    model = ir.serde.deserialize_model(proto)
    g = model.graph
    shape = ir.Value(name="/ortmodule/hidden_shape", const_value=ir.tensor([-1, hidden_size], dtype=ir.DataType.INT64))
    g.initializers.add(shape)
    for i, value in enumerate(hidden_values(g, layers)):
        flat = ir.node("Reshape", [value, shape], name=f"/ortmodule/hidden_{i}")
        flat.outputs[0].name = f"{HIDDEN}{i}"
        flat.outputs[0].dtype = value.dtype
        flat.outputs[0].shape = ir.Shape(["hidden_rows", hidden_size])
        g.append(flat)
        g.outputs.append(flat.outputs[0])
    return ir.serde.serialize_model(model)


class HiddenStates:
    """The hidden-states graph's session for one decoder session, and its runs."""

    def __init__(self, decoder: Decoder, session: runtime.Session):
        self.decoder, self.session = weakref.proxy(decoder), session
        self.layers = decoder.package.num_hidden_layers
        self.dtypes = [runtime.output_dtype(session, f"{HIDDEN}{i}") for i in range(self.layers + 1)]

    def _bind(self, binding, rows: int) -> list[torch.Tensor]:
        hidden_size, device = self.decoder.package.hidden_size, self.decoder.device
        out = [torch.empty(rows, hidden_size, dtype=dtype, device=device) for dtype in self.dtypes]
        for i, tensor in enumerate(out):
            runtime.bind_output(binding, f"{HIDDEN}{i}", tensor)
        return out

    def prefill(self, rows: Rows, logit_index: torch.Tensor | None, cache: KVCache | None):
        """`Decoder.prefill`'s logits (every position through the head, then the asked-for ones)
        and the hidden states `[B, T, hidden]` in the caller's layout."""
        decoder, session = self.decoder, self.session
        batch, width = rows.ids.shape
        mask = torch.ones_like(rows.ids, dtype=decoder.mask_dtype) if decoder.spec.attention_mask else None
        positions = torch.arange(width, device=decoder.device).expand(batch, -1) if decoder.spec.position_ids else None
        if cache is None:
            binding = session.io_binding()
            decoder.scratch.bind(binding, decoder, batch, width)
            states = self._bind(binding, batch * width)
            logits = decoder.run_bound(session, binding, rows.ids, None, mask, positions, rows.lengths)
        else:
            with decoder.holding(cache) as runs:
                binding = decoder.cache_binding(runs, cache, width, session)
                cache.states.zero()
                states = self._bind(binding, batch * width)
                logits = decoder.run_bound(session, binding, rows.ids, None, mask, positions, rows.lengths)
                cache.start(rows.lengths, rows.longest, width)
        caller = inputs.every_position(rows)
        states = tuple((s if caller is None else s.index_select(0, caller)).view(batch, width, -1) for s in states)
        logits = logits.view(batch * width, -1)
        return (logits if logit_index is None else logits.index_select(0, logit_index)), states

    def step(self, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None):
        """`Decoder.step`'s logits and the new tokens' hidden states `[B, s, hidden]`."""
        decoder, session = self.decoder, self.session
        batch, new = tokens.shape
        if new > 1 and (batch > 1 or (decoder.spec.steps_one_token and cache.longest > 0)):
            runs = [self.step(tokens[:, i : i + 1], cache, None) for i in range(new)]
            logits = torch.cat([r[0].view(batch, 1, -1) for r in runs], 1).view(batch * new, -1)
            states = tuple(torch.cat(layer, 1) for layer in zip(*(r[1] for r in runs)))
            return (logits if logit_index is None else logits.index_select(0, logit_index)), states
        with decoder.holding(cache) as runs:
            cache.reserve(cache.longest + new, decoder.package.context_length)
            binding = decoder.cache_binding(runs, cache, new, session)
            mask = cache.step_mask(new, decoder.mask_dtype) if decoder.mask_dtype is not None else None
            positions = cache.lengths[:, None] + torch.arange(new, device=decoder.device)
            states = self._bind(binding, batch * new)
            logits = decoder.run_bound(session, binding, tokens, None, mask, positions).view(batch * new, -1)
            cache.advance(new, new)
        states = tuple(s.view(batch, new, -1) for s in states)
        return (logits if logit_index is None else logits.index_select(0, logit_index)), states


_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> (its session, HiddenStates)
_lock = threading.Lock()


def for_decoder(decoder: Decoder) -> HiddenStates:
    """The decoder's `HiddenStates` for its current session (made at the first call, again after
    `to(device)`); raises `RewriteSkipped` where its graph cannot give them."""
    with _lock:
        made = _made.get(decoder)
        if made is not None and made[0] is decoder.session:
            return made[1]
        if not decoder.keeps_positions:
            raise RewriteSkipped("the LM-head rewrite did not apply to this package's graph (see the load's log)")
        package = decoder.package
        base = decoder.graph_bytes
        digest = hashlib.sha256(base)
        digest.update(f"|hidden|{package.num_hidden_layers}|{package.hidden_size}|{HIDDEN_VERSION}|"
                      f"{graph.code_digest()}|{ir.__version__}".encode())
        data = graph.cached(decoder.cache_dir, f"{decoder.spec.path.stem}-hidden-{digest.hexdigest()[:32]}",
                            lambda: hidden_graph(onnx.ModelProto.FromString(base), package.num_hidden_layers,
                                                 package.hidden_size).SerializeToString())
        session = runtime.make_session(data, decoder.device, decoder.spec.path.parent, decoder.session_options,
                                       decoder.run_provider_options, prepack=extend.has_quantized_weights(base),
                                       fp32_path=decoder.fp32_path)
        logger.info("ortmodule: hidden states of %s from its graph's layer inputs and final norm on %s",
                    decoder.spec.path, decoder.device)
        runner = HiddenStates(decoder, session)
        _made[decoder] = (decoder.session, runner)
        return runner
