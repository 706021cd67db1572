"""Several new tokens for several rows over their caches in one run: the "extend" graph.

ONNX Runtime's GroupQueryAttention refuses more than one new token over a cache for more than
one row ("batch_size must be 1 when sequence_length > 1 and past context is given"). Scoring
needs exactly that: rows that continue a shared prefix (a question's answers after its context,
score's items after their query) run the prefix once and the rest of every row over a copy of its
KV. Without it the rest runs one decode step per token.

`extend_graph` rewrites a builder decoder (after graph.py's LM-head rewrite) so that every
GroupQueryAttention becomes what it computes, in ops that take any batch: the packed projection
split into query, key and value, the query/key norms where GroupQueryAttention applied them,
`RotaryEmbedding` at positions given as an input, and ONNX's `Attention` (opset 23) over the past
and the new keys with an additive mask given as an input. The graph has no present outputs: the
new tokens' KV is not kept. ortmodule builds the mask and positions (`Extender.run`); the graph
bytes are cached like the LM-head rewrite's (graph.py) and reference the package's weights.

Sliding-window layers take a mask of their own in the mask layout (`ortmodule_attention_bias_window_W`
for a window of W: each new token sees the keys fewer than W positions before it). Where a decoder
does not match (sliding windows in the cache layout and the prefill graph, soft-capping on CUDA,
attention biases, sinks), `extend_graph` raises `graph.RewriteSkipped` and callers keep the decode
steps.

The mask layout with the new tokens' keys and values kept is the blocks graph (`blocks_graph`): a
prompt whose mask lets tokens see later ones (Gemma 3's images, which attend both ways within each
image: blocks.py) runs from an empty past, its presents written as the package graph's are.

The same rewrite without a past is the prefill graph (`prefill_graph`): `Attention` with `is_causal`
over the new tokens alone, no KV read or written, for runs that keep no cache (scoring's padded
rows), where the package's GroupQueryAttention would write a cache that is thrown away (on CUDA in a
kernel of one 16-thread block per token, head and row). `CausalPrefill.run` runs it where the
decoder's `prefill_attention` is "onnx" (`make_prefill`: made at load, its first run checked against
the package graph's logits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from . import graph, mapped, projections, runtime, states
from .cache import KVCache
from .graph import RewriteSkipped
from .inputs import Rows

logger = logging.getLogger("ortmodule")

POSITIONS = "ortmodule_positions"
# Whether the extend graph repeats each KV head for its query heads before `Attention` on CUDA (its
# grouped heads were not taken by ONNX Runtime's CUDA kernel until its PR 27542, in 1.31). Off: on an
# H200 the grouped heads ran the score call's queries once 15% faster (82.3 against 96.4 ms) and
# HellaSwag-shaped shared contexts 17% faster (28.5 against 34.3 ms; docs/measurements.md, session 58).
# benchmarks/profile_gpu.py `--repeat-kv` sets it to measure both.
REPEAT_KV_HEADS_ON_CUDA = False
# The extend graph's layout per device type (extend_graph): "mask" everywhere until the GPU measures
# "cache" (ONNX Runtime's flash attention over the rows' caches on CUDA; its unfused kernel runs the
# mask layout there). benchmarks/profile_gpu.py `--extend-layout` sets it.
EXTEND_LAYOUT = {"cpu": "mask", "cuda": "mask"}
ATTENTION_BIAS = "ortmodule_attention_bias"
# The mask layout's additive mask for sliding-window layers of window W: ATTENTION_BIAS + "_window_W".
WINDOW_BIAS = ATTENTION_BIAS + "_window_"
WRITE_AT = "ortmodule_write_at"
# The cache layout's outputs: each past written with the new tokens' KV, which `Extender.run` binds
# to the past's own buffer, so that ONNX Runtime's TensorScatter writes in place instead of copying
# the whole buffer first (it skips the copy where its output is its input's memory).
WRITTEN = ".ortmodule_written"
KV_LENGTHS = "ortmodule_kv_lengths"
EXTEND_VERSION = "3"
_OPSET = 23  # ONNX's Attention
_OPSET_CACHE = 24  # its external-cache input (nonpad_kv_seqlen), and TensorScatter


PREFILL_ATTENTION = ("auto", "package", "onnx")


def checked_attention(value) -> str:
    """A caller's `prefill_attention`: "auto" (None), "package" or "onnx"."""
    value = "auto" if value is None else value
    if value not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}, not {value!r}")
    return value


def uses_prefill_graph(choice: str, device: torch.device) -> bool:
    """Whether runs without a cache take the prefill graph (`prefill_graph`): where asked ("onnx");
    under "auto" nowhere yet: on a 2-vCPU Xeon it ran SmolLM2's prefills of 8 x 128 and 4 x 512 tokens
    at 0.93x and 0.95x of the package graph's speed (docs/measurements.md, session 30); CUDA's figures
    (the GPU suite's `ortmodule-prefill-onnx` rows) are to come."""
    return choice == "onnx"


def _attribute(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def extend_graph(proto: onnx.ModelProto, head_size: int, expand_kv_heads: bool = False,
                 layout: str = "mask", unpack_qkv: bool = False) -> onnx.ModelProto:
    """The decoder with every GroupQueryAttention replaced as the module docstring says; the present
    outputs are gone, and the past KV inputs keep their names. Inputs added: `ortmodule_positions`
    (int64 `[batch, new]`: each new token's position) and by `layout`:

    - "mask": `ortmodule_attention_bias` (`[batch, 1, new, past + new]` in the KV's dtype: 0 where a
      new token sees a key, a large negative number where not), and for sliding-window layers of a
      window W `ortmodule_attention_bias_window_W` (the keys fewer than W positions before the
      token); the pasts are the caches' buffers `[batch, kv_heads, past, head_size]`.
      `expand_kv_heads` repeats each KV head for its group of query heads before `Attention`, for
      kernels without grouped-query attention.
    - "cache": ONNX's external-cache form (opset 24), which ONNX Runtime's CUDA kernel runs as flash
      attention where the mask form falls back to its unfused kernel: the pasts are buffers with
      room for the new tokens after every row's past (`[batch, kv_heads, capacity, head_size]`);
      `TensorScatter` writes the new keys and values at `ortmodule_write_at` (int64 `[batch]`: the
      row's past length) and `Attention` reads `ortmodule_kv_lengths` (int64 `[batch]`: past + new)
      keys with `is_causal`, aligned at each row's end (a right-padded row's real new tokens never
      see the padding after them).

    `unpack_qkv`: a packed query/key/value projection (GroupQueryAttention's packed input, split by
    the rewrite) becomes three MatMuls (projections.py), as ortmodule makes it on CUDA."""
    if layout not in ("mask", "cache"):
        raise ValueError(f"layout must be 'mask' or 'cache', not {layout!r}")
    return _rewrite(proto, head_size, expand_kv_heads and layout == "mask", layout, unpack_qkv)


def prefill_graph(proto: onnx.ModelProto, head_size: int, unpack_qkv: bool = False) -> onnx.ModelProto:
    """The decoder for runs from an empty cache (the prefill graph): every GroupQueryAttention
    replaced by the same norms and rotary (at `ortmodule_positions`) and ONNX's `Attention` with
    `is_causal` over the new tokens alone. No past inputs, no present outputs (no KV is written),
    no attention mask: right for right-padded rows only, where a real token never attends to the
    padding after it (ortmodule's prefills are right-padded: inputs.check_batch). `unpack_qkv` as
    in `extend_graph`."""
    return _rewrite(proto, head_size, False, "prefill", unpack_qkv)


def blocks_graph(proto: onnx.ModelProto, head_size: int, expand_kv_heads: bool = False,
                 unpack_qkv: bool = False) -> onnx.ModelProto:
    """`extend_graph`'s mask layout (its bias inputs, any mask at all) for runs from an empty past,
    with every layer's new keys and values as outputs under the package graph's present names
    (`[batch, kv_heads, new, head_size]`: after the norms and rotary, before `expand_kv_heads`
    repeats them for the kernel)."""
    return _rewrite(proto, head_size, expand_kv_heads, "blocks", unpack_qkv)


@dataclasses.dataclass
class _Feeds:
    """The inputs a rewrite adds, by layout (extend_graph's "mask" and "cache", and "prefill")."""

    layout: str
    positions: ir.Value
    bias: ir.Value | None = None
    write_at: ir.Value | None = None
    kv_lengths: ir.Value | None = None
    windows: dict[int, ir.Value] = dataclasses.field(default_factory=dict)  # mask layout: a bias per window

    def window_bias(self, window: int) -> ir.Value:
        """The mask layout's bias for sliding-window layers of `window` (made at the first such layer)."""
        if window not in self.windows:
            self.windows[window] = ir.Value(name=f"{WINDOW_BIAS}{window}", type=self.bias.type,
                                            shape=ir.Shape(["batch", 1, "new", "total"]))
        return self.windows[window]

    @classmethod
    def make(cls, layout: str, kv_type) -> _Feeds:
        def value(name, kind, shape):
            return ir.Value(name=name, type=kind, shape=ir.Shape(shape))
        int64 = ir.TensorType(ir.DataType.INT64)
        feeds = cls(layout, value(POSITIONS, int64, ["batch", "new"]))
        if layout in ("mask", "blocks"):
            feeds.bias = value(ATTENTION_BIAS, kv_type, ["batch", 1, "new", "total"])
        elif layout == "cache":
            feeds.write_at, feeds.kv_lengths = value(WRITE_AT, int64, ["batch"]), value(KV_LENGTHS, int64, ["batch"])
        return feeds

    def values(self) -> list[ir.Value]:
        return [v for v in (self.positions, self.bias, self.write_at, self.kv_lengths) if v is not None]


def _rewrite(proto: onnx.ModelProto, head_size: int, expand_kv_heads: bool, layout: str,
             unpack_qkv: bool = False) -> onnx.ModelProto:
    model = ir.serde.deserialize_model(proto)
    graph = model.graph
    attention = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not attention:
        raise RewriteSkipped("no GroupQueryAttention nodes")
    kv_type = attention[0].inputs[3].type if attention[0].inputs[3] is not None else None
    if kv_type is None:
        raise RewriteSkipped("GroupQueryAttention without a past key input")
    feeds = _Feeds.make(layout, kv_type)
    graph.inputs.extend(feeds.values())
    presents = set()
    for index, node in enumerate(attention):
        presents.update(v.name for v in node.outputs[1:3] if v is not None)
        _replace(graph, node, index, feeds, head_size, expand_kv_heads)
    graph.inputs.extend(feeds.windows[window] for window in sorted(feeds.windows))
    presents |= states.state_outputs(graph)  # a hybrid decoder's stateful layers read their past states only
    states.release_padding_holds(graph)
    if layout != "blocks":  # the blocks graph's presents are its attention nodes' (_keep_presents)
        graph.outputs[:] = [o for o in graph.outputs if o.name not in presents]
    model.opset_imports[""] = max(model.opset_imports.get("", 1), _OPSET_CACHE if layout == "cache" else _OPSET)
    _remove_unused(graph)
    if unpack_qkv:  # once the replaced GroupQueryAttention no longer reads the packed projection
        projections.unpack_projections(graph)
    used = {v for node in graph for v in node.inputs if v is not None} | set(graph.outputs)
    graph.inputs[:] = [v for v in graph.inputs if v in used]
    return ir.serde.serialize_model(model)


def _replace(graph: ir.Graph, node: ir.Node, index: int, feeds: _Feeds, head_size: int,
             expand_kv_heads: bool) -> None:
    window = _check_rewritable(node, feeds.layout)
    heads = _attribute(node, "num_heads", 0)
    kv_heads = _attribute(node, "kv_num_heads", 0)
    softcap = _attribute(node, "softcap", 0.0)
    name = f"/ortmodule/extend/{index}"
    new_nodes = []

    def add(op, inputs, domain="", **attributes):
        made = ir.node(op, inputs, attributes=attributes, domain=domain, name=f"{name}/{op}{len(new_nodes)}")
        new_nodes.append(made)
        return made.outputs[0]

    query, key, value = node.inputs[0], _input(node, 1), _input(node, 2)
    if key is None:  # packed query, key and value
        sizes = ir.tensor([heads * head_size, kv_heads * head_size, kv_heads * head_size], dtype=ir.DataType.INT64)
        split = ir.node("Split", [query, add("Constant", [], value=sizes)], attributes={"axis": -1},
                        num_outputs=3, name=f"{name}/Split")
        new_nodes.append(split)
        query, key, value = split.outputs
    query, key = _own_norms(add, node, query, key, heads, kv_heads, head_size)
    if _attribute(node, "do_rotary", 0):
        query, key = _rotate(add, node, query, key, feeds.positions, heads, kv_heads, head_size)
    scale = _attribute(node, "scale", 0.0) or 1.0 / math.sqrt(head_size)
    attributes = {"q_num_heads": heads, "kv_num_heads": kv_heads, "scale": float(scale)}
    if softcap:
        attributes["softcap"] = float(softcap)
    if feeds.layout == "prefill":  # causal over the new tokens, nothing written
        attend = ir.node("Attention", [query, key, value], attributes={**attributes, "is_causal": 1},
                         num_outputs=1, name=f"{name}/Attention")
        _put(graph, node, new_nodes, attend, add)
        return
    past_key, past_value = node.inputs[3], node.inputs[4]
    if feeds.layout == "cache":  # the new KV written after each row's past, flash over the row's keys
        query, key, value = (_heads_first(add, v, n, head_size) for v, n in ((query, heads), (key, kv_heads),
                                                                               (value, kv_heads)))
        key, value = (add("TensorScatter", [past, new, feeds.write_at], axis=-2)
                      for past, new in ((past_key, key), (past_value, value)))
        _written_outputs(graph, ((past_key, key), (past_value, value)))
        attend = ir.node("Attention", [query, key, value, None, None, None, feeds.kv_lengths],
                         attributes={**attributes, "is_causal": 1}, num_outputs=1, name=f"{name}/Attention")
        _put(graph, node, new_nodes, attend, add, heads_first=heads * head_size)
        return
    # the blocks graph's presents: the new keys and values (its past is empty), before any repeat of their heads
    kept = tuple(_heads_first(add, v, kv_heads, head_size) for v in (key, value)) if feeds.layout == "blocks" else ()
    if expand_kv_heads and kv_heads != heads:
        if softcap:
            raise RewriteSkipped(f"'{node.name}' soft-caps its attention, which this Attention kernel does not")
        group = heads // kv_heads
        key, value = (_repeat_heads(add, v, kv_heads, group, head_size, new=True) for v in (key, value))
        past_key, past_value = (_repeat_heads(add, v, kv_heads, group, head_size, new=False)
                                for v in (past_key, past_value))
        attributes["kv_num_heads"] = heads
    bias = feeds.window_bias(window) if window else feeds.bias
    attend = ir.node("Attention", [query, key, value, bias, past_key, past_value], attributes=attributes,
                     num_outputs=3, name=f"{name}/Attention")  # presents unread (the CPU kernel wants them)
    _put(graph, node, new_nodes, attend, add, presents=kept)


def _own_norms(add, node: ir.Node, query: ir.Value, key: ir.Value, heads: int, kv_heads: int,
               head_size: int) -> tuple[ir.Value, ir.Value]:
    """The query and key after the norms a GroupQueryAttention node applies itself (CUDA exports), if any."""
    q_norm, k_norm = _input(node, 14), _input(node, 15)
    if q_norm is None and k_norm is None:
        return query, key
    epsilon = _attribute(node, "qk_norm_epsilon", 1e-6)
    return (_norm(add, query, q_norm, heads, head_size, epsilon),
            _norm(add, key, k_norm, kv_heads, head_size, epsilon))


def _keep_presents(graph: ir.Graph, node: ir.Node, presents: tuple) -> None:
    """`presents` (key, value) as the graph outputs `node` (a GroupQueryAttention) gave."""
    for old, new in zip(node.outputs[1:3], presents):
        if old is None or old not in graph.outputs:
            raise RewriteSkipped(f"'{node.name}' writes no present key and value as graph outputs")
        name = old.name
        old.name = f"{name}.ortmodule_replaced"
        new.name, new.shape, new.type = name, old.shape, old.type
        graph.outputs[graph.outputs.index(old)] = new


def _check_rewritable(node: ir.Node, layout: str) -> int:
    """The node's sliding window (0: none); RewriteSkipped where a GroupQueryAttention node computes
    what the rewrite does not. Sliding windows are in the mask layout's masks only (`_extend_bias`)."""
    window = _attribute(node, "local_window_size", -1)
    window = window if window is not None and window > 0 else 0
    if window and layout not in ("mask", "blocks"):
        raise RewriteSkipped(f"'{node.name}' is a sliding-window layer, which the {layout} layout does not take")
    for i, what in ((9, "position ids"), (10, "an attention bias"), (11, "a head sink")):
        if _input(node, i) is not None:
            raise RewriteSkipped(f"'{node.name}' takes {what}")
    if _attribute(node, "smooth_softmax", 0):
        raise RewriteSkipped(f"'{node.name}' uses a smooth softmax")
    return window


def _written_outputs(graph: ir.Graph, pairs) -> None:
    """Each (past, written) pair's written value as an output named after its past (`WRITTEN`),
    which `Extender.run` binds to the past's own buffer."""
    for past, written in pairs:
        written.name, written.shape, written.type = past.name + WRITTEN, past.shape, past.type
        graph.outputs.append(written)


def _put(graph: ir.Graph, node: ir.Node, new_nodes: list[ir.Node], attend: ir.Node, add,
         heads_first: int = 0, presents: tuple = ()) -> None:
    """`new_nodes` and `attend` before `node`, whose first output `attend`'s replaces (brought back
    from `[batch, heads, new, head_size]` to `[batch, new, heads_first]` where `heads_first` is given);
    `presents` (key, value), where given, replace its present outputs (`_keep_presents`)."""
    new_nodes.append(attend)
    out = attend.outputs[0]
    if heads_first:
        out = add("Reshape", [add("Transpose", [out], perm=[0, 2, 1, 3]),
                              add("Constant", [], value=ir.tensor([0, 0, heads_first], dtype=ir.DataType.INT64))])
    graph.insert_before(node, new_nodes)
    node.outputs[0].replace_all_uses_with(out)
    out.shape, out.type = node.outputs[0].shape, node.outputs[0].type
    if presents:
        _keep_presents(graph, node, presents)


def _heads_first(add, x: ir.Value, heads: int, head_size: int) -> ir.Value:
    """`[batch, new, heads * head_size]` as `[batch, heads, new, head_size]` (the cache's layout)."""
    split = add("Constant", [], value=ir.tensor([0, 0, heads, head_size], dtype=ir.DataType.INT64))
    return add("Transpose", [add("Reshape", [x, split])], perm=[0, 2, 1, 3])


def _rotate(add, node: ir.Node, query: ir.Value, key: ir.Value, positions: ir.Value, heads: int, kv_heads: int,
            head_size: int) -> tuple[ir.Value, ir.Value]:
    """The rotary embedding GroupQueryAttention applies (`do_rotary`), at `positions`."""
    cos, sin = node.inputs[7], node.inputs[8]
    if cos is None or sin is None:
        raise RewriteSkipped(f"'{node.name}' rotates without cos/sin caches")
    rotary_dim = 2 * cos.shape[1] if cos.shape is not None and isinstance(cos.shape[1], int) else head_size
    attributes = {"interleaved": _attribute(node, "rotary_interleaved", 0)}
    if rotary_dim != head_size:
        attributes["rotary_embedding_dim"] = rotary_dim
    return (add("RotaryEmbedding", [query, positions, cos, sin], "com.microsoft", num_heads=heads, **attributes),
            add("RotaryEmbedding", [key, positions, cos, sin], "com.microsoft", num_heads=kv_heads, **attributes))


def _repeat_heads(add, x: ir.Value, kv_heads: int, group: int, head_size: int, new: bool) -> ir.Value:
    """Each of `kv_heads` heads repeated `group` times, in place: new keys `[B, S, kv_heads * H]`
    or a past `[B, kv_heads, P, H]` becomes the same with `kv_heads * group` heads."""
    def const(values):
        return add("Constant", [], value=ir.tensor(values, dtype=ir.DataType.INT64))
    if new:  # [B, S, kv*H] -> [B, S, kv, 1, H] -> [B, S, kv, group, H] -> [B, S, kv*group*H]
        split, tile, back = [0, 0, kv_heads, 1, head_size], [1, 1, 1, group, 1], [0, 0, kv_heads * group * head_size]
    else:  # [B, kv, P, H] -> [B, kv, 1, P, H] -> [B, kv, group, P, H] -> [B, kv*group, P, H]
        split, tile, back = [0, kv_heads, 1, -1, head_size], [1, 1, group, 1, 1], [0, kv_heads * group, -1, head_size]
    return add("Reshape", [add("Tile", [add("Reshape", [x, const(split)]), const(tile)]), const(back)])


def _norm(add, x: ir.Value, weight: ir.Value, heads: int, head_size: int, epsilon: float) -> ir.Value:
    per_head = add("Constant", [], value=ir.tensor([0, 0, heads, head_size], dtype=ir.DataType.INT64))
    flat = add("Constant", [], value=ir.tensor([0, 0, heads * head_size], dtype=ir.DataType.INT64))
    normed = add("SimplifiedLayerNormalization", [add("Reshape", [x, per_head]), weight], axis=-1, epsilon=epsilon)
    return add("Reshape", [normed, flat])


def _remove_unused(graph: ir.Graph) -> None:
    """Remove the nodes nothing reads any more (the replaced attention, the sequence-length
    subgraph), last first. onnx-ir's own pass would also drop the Attention nodes' unread present
    outputs, which ONNX Runtime's CPU kernel wants whenever a past is given."""
    outputs = set(graph.outputs)
    removed = True
    while removed:
        removed = False
        for node in reversed(list(graph)):
            if all(not v.uses() and v not in outputs for v in node.outputs) and node.op_type != "Attention":
                graph.remove(node, safe=True)
                removed = True


def extend_graph_bytes(base: bytes, stem: str, head_size: int, expand_kv_heads: bool,
                       cache_dir: Path | None = None, layout: str = "mask", unpack_qkv: bool = False) -> bytes:
    """`extend_graph` in `layout` ("mask", "cache"; "prefill": `prefill_graph`; "blocks": `blocks_graph`) of the
    LM-head-rewritten graph bytes `base` (`unpack_qkv` as there), cached like them (graph.py);
    raises `RewriteSkipped` where the decoder does not match."""
    if layout not in ("mask", "cache", "prefill", "blocks"):
        raise ValueError(f"layout must be 'mask', 'cache', 'prefill' or 'blocks', not {layout!r}")
    expand_kv_heads = expand_kv_heads and layout in ("mask", "blocks")
    digest = hashlib.sha256(base)
    digest.update(f"|{head_size}|{expand_kv_heads}|{layout}|{EXTEND_VERSION}|{graph.code_digest()}|{ir.__version__}"
                  f"{'|unpack_qkv' * unpack_qkv}".encode())
    kind = layout if layout in ("prefill", "blocks") else "extend"
    return graph.cached(cache_dir, f"{stem}-{kind}-{digest.hexdigest()[:32]}",
                        lambda: _rewrite(onnx.ModelProto.FromString(base), head_size, expand_kv_heads,
                                         layout, unpack_qkv).SerializeToString())


class Extender:
    """Runs the extend graph of a decoder (`Decoder.extender()` makes it): new tokens for every
    row of a cache, attending to the row's past and to the new tokens before them."""

    def __init__(self, decoder, session: runtime.Session):
        # The decoder keeps this runner: a weak reference back (no cycle), so that a model dropped
        # frees its sessions at once rather than at the cyclic garbage collector's next pass.
        self.decoder, self.session = weakref.proxy(decoder), session  # any number of threads: a binding per call
        names = {i.name for i in session.ort_session.get_inputs()}
        self.positions = POSITIONS in names  # absent where no layer rotates inside its attention node (HunYuan)
        self.position_ids = decoder.spec.position_ids if decoder.spec.position_ids in names else None
        self.layout = "cache" if KV_LENGTHS in names else "mask"
        # the sliding-window layers' masks, by window (the mask layout)
        self.windows = sorted(int(name[len(WINDOW_BIAS):]) for name in names if name.startswith(WINDOW_BIAS))
        # Whether a row may hold several segments (`run`'s `starts`; where positions are an input of the graph).
        self.packs = takes_segments(decoder, self.layout) and (self.positions or self.position_ids is not None)
        known = {decoder.spec.input_ids, POSITIONS, ATTENTION_BIAS, WRITE_AT, KV_LENGTHS, graph.LOGITS_INDICES,
                 self.position_ids, *(f"{WINDOW_BIAS}{window}" for window in self.windows)}
        known |= {name for kv in decoder.spec.layers for name in (kv.past_key, kv.past_value)}
        known |= {state.past for state in decoder.spec.states}
        if decoder.embedding_session is not None:
            known |= {name for _, name in decoder.package.embedding.feeds}
        unknown = names - known
        if unknown:
            raise RewriteSkipped(f"the extend graph still takes {sorted(unknown)}")

    def room(self, new: int) -> int:
        """The positions a cache for `run` needs past its longest row, for `new` tokens a row."""
        return new if self.layout == "cache" else 0

    def run(self, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor,
            starts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[n, V]` at the flat indices `logit_index` (`row * new + i`) of `tokens`
        `[rows, new]` (right-padded) appended to the rows of `cache` (`cache.lengths` each row's
        past). The rows are not changed: in the mask layout every column of the cache's buffers is
        attended to, masked past each row's end (so a cache as long as its longest row costs least;
        a sliding-window package's holds at least the window); in the cache layout they grow to hold
        the new tokens (`reserve`), which are written past the rows' ends and not counted.

        `starts` (where `packs`): `[rows, new]`, for each new token the index in its row where its
        segment begins: a row then holds several continuations of its past one after another, each
        positioned right after the past and seeing the past and its own segment's tokens only."""
        decoder = self.decoder
        rows, new = tokens.shape
        if cache.batch_size != rows:
            raise ValueError(f"extend needs a cache of {rows} rows, got {cache.batch_size}")
        if starts is not None and not self.packs:
            raise ValueError("this extend graph takes no segments (Extender.packs is False)")
        device = decoder.device
        order = torch.arange(new, device=device)
        if starts is not None:
            order = order - starts
        binding = self.session.io_binding()
        decoder.bind_tokens(binding, tokens)
        # A row's padding past its own tokens may run past the context (a long past among shorter
        # ones, its remainder padded to the longest): its positions, read by no one, stay inside the
        # rotary tables, and in the cache layout its KV lands in columns grown past the context.
        context = decoder.package.context_length
        positions = (cache.lengths[:, None] + order).clamp_(max=context - 1)
        if self.positions:
            runtime.bind_input(binding, POSITIONS, positions.to(torch.int64).contiguous())
        if self.position_ids is not None:
            runtime.bind_input(binding, self.position_ids, decoder.position_input(positions))
        if self.layout == "cache":
            cache.reserve(cache.longest + new, max(context, cache.longest + new))
            runtime.bind_input(binding, WRITE_AT, cache.lengths.to(torch.int64).contiguous())
            runtime.bind_input(binding, KV_LENGTHS, (cache.lengths + new).to(torch.int64).contiguous())
        else:
            runtime.bind_input(binding, ATTENTION_BIAS, _extend_bias(cache, new, decoder.kv_dtype, starts=starts))
            for window in self.windows:
                windowed = _extend_bias(cache, new, decoder.kv_dtype, window)
                runtime.bind_input(binding, f"{WINDOW_BIAS}{window}", windowed)
        for kv, key, value in zip(cache.specs, cache.keys, cache.values):
            runtime.bind_input(binding, kv.past_key, key)
            runtime.bind_input(binding, kv.past_value, value)
            if self.layout == "cache":  # the new KV written past each row's end, in the cache's own buffers
                runtime.bind_output(binding, kv.past_key + WRITTEN, key)
                runtime.bind_output(binding, kv.past_value + WRITTEN, value)
        for state, past in zip(cache.states.specs, cache.states.current):  # each row's after its past
            runtime.bind_input(binding, state.past, past)
        runtime.bind_input(binding, graph.LOGITS_INDICES, logit_index)
        logits = torch.empty(logit_index.numel(), decoder.vocab_size, dtype=decoder.head_dtype, device=device)
        runtime.bind_output(binding, decoder.spec.logits, logits)
        self.session.run(binding)
        return logits


def takes_segments(decoder, layout: str) -> bool:
    """Whether the extend graph of `layout` over `decoder` runs several segments a row (`Extender.run`'s
    `starts`), read from the package alone (sharing.py prices its plans so without making the graph):
    the mask layout, where the mask and the positions say all a token sees; not with sliding windows
    (their masks have no segments), nor the cache layout (each segment's KV would be written where
    the next one's goes), nor a hybrid's layer states (they would run on from one segment into
    the next)."""
    return layout == "mask" and not any(kv.window for kv in decoder.spec.layers) and not decoder.spec.states


def _extend_bias(cache: KVCache, new: int, dtype: torch.dtype, window: int = 0,
                 starts: torch.Tensor | None = None) -> torch.Tensor:
    """The mask layout's additive mask `[rows, 1, new, past + new]`: a row's new token sees the
    row's past and the new tokens up to itself (with `starts`, those of its own segment); with a
    `window`, only the keys fewer than `window` positions before it (a sliding-window layer's, as
    GroupQueryAttention's `local_window_size`)."""
    past, device, hidden = cache.keys[0].shape[2], cache.lengths.device, torch.finfo(dtype).min
    bias = torch.empty(cache.batch_size, 1, new, past + new, dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    if window:  # a past key k of row b is seen by new token i where k < lengths[b] and lengths[b] + i - k < window
        order, keys = torch.arange(new, device=device), torch.arange(past, device=device)
        distance = cache.lengths[:, None, None] + order[:, None] - keys  # [rows, new, past]
        seen = (keys < cache.lengths[:, None, None]) & (distance < window)
        bias[:, 0, :, :past] = torch.where(seen, zero, hidden)
        behind = order[:, None] - order  # new token j is seen by new token i where 0 <= i - j < window
        bias[..., past:] = torch.where((behind >= 0) & (behind < window), zero, hidden)
        return bias
    # each element written once: the rows' pasts broadcast over the new tokens, the causal part over the rows
    seen = torch.arange(past, device=device) < cache.lengths[:, None]
    bias[..., :past] = torch.where(seen, zero, hidden)[:, None, None]
    if starts is None:
        bias[..., past:] = torch.full((new, new), hidden, dtype=dtype, device=device).triu_(1)
        return bias
    order = torch.arange(new, device=device)
    own = (starts[:, :, None] == starts[:, None, :]) & (order[:, None] >= order)  # [rows, new, new]
    bias[:, 0, :, past:] = torch.where(own, zero, hidden)
    return bias


def has_quantized_weights(data: bytes) -> bool:
    """Whether a serialized graph multiplies by block-quantized weights (`MatMulNBits`)."""
    return "MatMulNBits" in mapped.quantized_ops(data)


def lazy_extender(decoder) -> Callable[[], Extender | None]:
    """A function that makes the decoder's `Extender` at its first call (`make_extender`) and
    returns the same one after; None where the package's graph or the device does not allow it.
    The decoder keeps the function, which refers back to it weakly (as `Extender` does)."""
    lock, made, owner = threading.Lock(), [], weakref.ref(decoder)

    def extender() -> Extender | None:
        with lock:
            if not made:
                decoder = owner()
                made.append(make_extender(decoder, decoder.cache_dir))
        return made[0]

    return extender


_writers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # writing_extender's, by decoder
_writers_lock = threading.Lock()


def writing_extender(decoder) -> Extender | None:
    """An `Extender` of the cache layout for `decoder`, whose runs write the new tokens' KV into the
    cache (shared_prompts.py: a generation's prompts continued over their common beginning, every row
    in one run; decoder.py: a step of several tokens over a batch's cache): the decoder's own where
    that is its device's layout, else one made at the first call (a second extend session: on a CPU
    it reads the package's weight files as the first does) and kept while the decoder lives; None
    where it cannot be made (the reason logged)."""
    if EXTEND_LAYOUT.get(decoder.device.type, "mask") == "cache":
        return decoder.extender()
    with _writers_lock:
        if decoder not in _writers:
            _writers[decoder] = make_extender(decoder, decoder.cache_dir, "cache")
        return _writers[decoder]


def make_extender(decoder, cache_dir: Path | None = None, layout: str | None = None) -> Extender | None:
    """The decoder's `Extender` (in `layout`, by default its device's `EXTEND_LAYOUT`), or None (with
    the reason logged) where its graph does not match,
    the device lacks room for the weights a second time, or its first run fails or gives other
    logits than the package graph on the same rows (by more than the package graph's own decode
    steps differ from its prefill there: `_steps_error`)."""
    device = decoder.device

    def check(extender: Extender) -> None:
        prefixes, rests = [[3, 1, 4], [9, 2]], [[1, 5], [6, 5]]
        tokens = torch.tensor(rests, device=device) % decoder.vocab_size
        got = extender.run(tokens, _prefixes_cache(decoder, prefixes), torch.arange(4, device=device))
        whole = _rows([prefixes[0] + rests[0], prefixes[1] + rests[1] + [0]], [5, 4], device)
        expected = decoder.package_prefill(whole, torch.tensor([3, 4, 7, 8], device=device))
        _check_close(expected, got, decoder, lambda: _steps_error(decoder, prefixes, tokens, expected))

    layout = layout or EXTEND_LAYOUT.get(device.type, "mask")
    expand = device.type == "cuda" and REPEAT_KV_HEADS_ON_CUDA and layout == "mask"
    unpack = projections.applies(device.type, decoder.session_options)
    made = _second_session(decoder, "extend graph", "shared prefixes continue by decode steps", Extender, check,
                           lambda head_size: extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem, head_size,
                                                                expand, cache_dir, layout, unpack))
    if made is not None:
        logger.info("ortmodule: shared prefixes continue in the extend graph on %s (%s layout, KV heads %s)", device,
                    layout, "repeated" if expand else "grouped")
    return made


def make_prefill(decoder) -> CausalPrefill | None:
    """The decoder's `CausalPrefill`, or None (with the reason logged, a warning where ONNX Runtime
    fails it) where its graph does not match, the device lacks room for the weights a second time,
    or its first run's logits differ from the package graph's on the same tokens."""
    device = decoder.device

    def check(prefill: CausalPrefill) -> None:
        rows = _rows([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0]], [5, 3], device)
        index = torch.tensor([0, 2, 4, 5, 7], device=device)  # the second row's real positions: 5-7
        _check_close(decoder.package_prefill(rows, index), prefill.run(rows.ids, index), decoder)

    unpack = projections.applies(device.type, decoder.session_options)
    return _second_session(decoder, "prefill graph", "runs without a cache keep the package's graph", CausalPrefill,
                           check, lambda head_size: extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem,
                                                                       head_size, False, decoder.cache_dir,
                                                                       layout="prefill", unpack_qkv=unpack))


def _prefixes_cache(decoder, prefixes: list[list[int]]) -> KVCache:
    """A cache of the two check prefixes (three tokens and two), prefilled by the package graph."""
    cache = decoder.new_cache(2, 3)
    decoder.prefill(_rows([prefixes[0], prefixes[1] + [0]], [3, 2], decoder.device), None, cache)
    return cache


def _rows(ids: list[list[int]], lengths: list[int], device: torch.device) -> Rows:
    """Right-padded rows of small token ids for a check."""
    return Rows(torch.tensor(ids, device=device), None, torch.tensor(lengths, device=device), max(lengths))


# How much farther than the package graph's own decode steps a rewrite's logits may land from its prefill where
# both differ by more than rounding (4-bit weights in the int8 path): the two are draws of the largest of the
# same activation-quantization noise over a handful of rows, and either may be the larger by half again, while a
# wrong graph lands tens away on logits of tens (docs/scoring.md).
NOISE_MARGIN = 2.0


def _check_close(expected: torch.Tensor, got: torch.Tensor, decoder, own=None) -> None:
    """RuntimeError where a rewrite's logits are not the package graph's (to its dtype's rounding).
    `own()`, where given: how far the package graph's own other way to the same logits lands from
    `expected`; a rewrite no farther than `NOISE_MARGIN` times that passes (4-bit weights in ONNX
    Runtime's int8 path quantize each call's activations, so the package graph's decode steps and its
    prefill differ by more than rounding: 3.8 on logits up to 29.7 for SmolLM2-135M int4 on a CPU)."""
    expected, got = expected.float(), got.float()
    scale, error = expected.abs().max().item(), (got - expected).abs().max().item()
    tolerance = 1e-4 if decoder.kv_dtype == torch.float32 else 5e-2
    if error <= tolerance * max(1.0, scale):
        return
    baseline = own() if own is not None else None
    if baseline is not None and error <= NOISE_MARGIN * baseline:
        logger.info("ortmodule: a rewrite's logits differ from the package graph's prefill by %.3g, within %gx of "
                    "the package graph's own decode steps (%.3g)", error, NOISE_MARGIN, baseline)
        return
    also = f"; the package graph's own decode steps by {baseline:.3g}" if baseline is not None else ""
    raise RuntimeError(f"its logits differ from the package graph's by {error:.3g} (largest {scale:.3g}{also})")


def _steps_error(decoder, prefixes: list[list[int]], tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference between `expected` (the package graph's prefill logits at every token
    of `tokens` after two `prefixes`) and the package graph's decode steps over the same tokens."""
    device, cache = decoder.device, _prefixes_cache(decoder, prefixes)
    steps = [decoder.step(tokens[:, s : s + 1], cache, torch.arange(2, device=device)) for s in range(tokens.shape[1])]
    stepped = torch.stack([steps[s][row] for row in range(2) for s in range(len(steps))])  # row-major, as expected
    return (stepped.float() - expected.float()).abs().max().item()


def _second_session(decoder, what: str, otherwise: str, runner, check, graph_bytes):
    """A session of a rewrite of the decoder's graph (`graph_bytes(head_size)`) in `runner`, after
    `check(runner)`; None, with the reason logged (`what`, and what happens `otherwise`), where the
    graph does not match, the device lacks room for the weights a second time, or a check fails. An
    optimisation: it takes no more than a quarter of the device's free memory."""
    try:
        session = rewrite_session(decoder, graph_bytes, room=0.25)
        if isinstance(session, str):
            logger.info("ortmodule: no %s for %s on %s: %s; %s", what, decoder.spec.path, decoder.device, session,
                        otherwise)
            return None
        made = runner(decoder, session)
        check(made)
    except RewriteSkipped as reason:
        logger.info("ortmodule: no %s for %s (%s): %s", what, decoder.spec.path, reason, otherwise)
        return None
    except Exception as e:  # noqa: BLE001  ONNX Runtime's own types: the package's graph runs instead
        logger.warning("ortmodule: the %s of %s is set aside on %s (%s); %s", what, decoder.spec.path,
                       decoder.device, " ".join(str(e).split())[:300], otherwise)
        return None
    return made


def rewrite_session(decoder, graph_bytes, room: float) -> runtime.Session | str:
    """A session of a rewrite of the decoder's graph, `graph_bytes(head_size)` (`RewriteSkipped`
    where the graph does not match), made as the decoder's own is; or why it cannot be made (a str):
    the LM-head rewrite did not apply, the layers' head sizes differ, or on CUDA the weights a second
    time would take more than `room` of the device's free memory."""
    if not decoder.keeps_positions:
        return "the LM-head rewrite did not apply to the decoder's graph"
    heads = {kv.head_size for kv in decoder.spec.layers}
    if len(heads) != 1:
        return f"layers of different head sizes {sorted(heads)}"
    device = decoder.device
    if device.type == "cuda":  # a second session of the decoder's graph holds its weights again
        weights = decoder.spec.weight_bytes
        free, _ = torch.cuda.mem_get_info(device)
        if weights > free * room:
            return (f"a second session of the decoder's weights (~{weights >> 20} MB) would take over "
                    f"{room:.0%} of the device's free memory ({free >> 20} MB)")
    data = graph_bytes(heads.pop())
    # Float weights: no packed copy (with ortmodule's session options); this session reads the
    # package's file pages, shared with the page cache, beside the main session's copy. 4-bit
    # weights are packed: unpacked, ONNX Runtime unpacks them at every run (0.2 s a run on
    # SmolLM2-135M int4, eight times a 16-token extend), and their packed copy is small (~100 MB).
    return runtime.make_session(data, device, decoder.spec.path.parent, decoder.session_options,
                                decoder.run_provider_options, prepack=has_quantized_weights(decoder.graph_bytes),
                                fp32_path=decoder.fp32_path)


class CausalPrefill:
    """Runs the prefill graph of a decoder (`prefill_graph`): right-padded rows from an empty
    cache, no KV written. `Decoder.prefill` takes it for runs without a cache where the decoder's
    `prefill_attention` says so."""

    def __init__(self, decoder, session: runtime.Session):
        self.decoder, self.session = weakref.proxy(decoder), session  # as Extender's; a binding per call
        spec = decoder.spec
        names = {i.name for i in session.ort_session.get_inputs()}
        self.positions = POSITIONS in names  # absent where no layer rotates inside its attention node
        self.position_ids = spec.position_ids if spec.position_ids in names else None
        self.mask = spec.attention_mask if spec.attention_mask in names else None
        known = {spec.input_ids, POSITIONS, graph.LOGITS_INDICES, self.position_ids, self.mask}
        known |= {state.past for state in spec.states}
        if decoder.embedding_session is not None:
            known |= {name for _, name in decoder.package.embedding.feeds}
        unknown = names - known
        if unknown:
            raise RewriteSkipped(f"the prefill graph still takes {sorted(unknown)}")

    def run(self, ids: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
        """`Decoder.prefill`'s logits for right-padded `ids` `[B, T]` without a cache."""
        decoder = self.decoder
        batch, width = ids.shape
        positions = torch.arange(width, device=decoder.device).expand(batch, -1)
        binding = self.session.io_binding()
        if self.positions:
            runtime.bind_input(binding, POSITIONS, positions.contiguous())
        for state in decoder.spec.states:  # a hybrid decoder's convolutions start from zeros
            zeros = torch.zeros(batch, *state.shape, dtype=decoder.kv_dtype, device=decoder.device)
            runtime.bind_input(binding, state.past, zeros)
        mask = torch.ones_like(ids, dtype=decoder.mask_dtype) if self.mask else None
        return decoder.run_bound(self.session, binding, ids, logit_index, mask,
                                 positions if self.position_ids else None)
