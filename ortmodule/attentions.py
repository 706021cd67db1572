"""`forward(..., output_attentions=True)`: transformers' `attentions`, from a copy of the decoder's
graph whose attention nodes also return their weights.

transformers returns one tensor `[batch, heads, queries, keys]` per attention layer (hybrids' other
layers give none): each query's softmax over the keys it sees, after the mask, window and soft-cap.
ONNX Runtime's CPU kernels give exactly that as the fourth output of GroupQueryAttention (the model
builder's graphs; `qk_output` 2, after the softmax) and of ONNX's `Attention` (mobius-onnx's graphs
and extend.py's blocks graph; `qk_matmul_output_mode` 3); `add_attention_outputs` asks every such
node for it, in layer order, and makes the outputs the graph's (`ATTENTIONS + i`), cached like the
other rewrites (variants.graph_bytes). GroupQueryAttention's CUDA kernels (flash and
memory-efficient attention) never return them, and `MultiHeadAttention` (the builder's fp16 CPU
exports) is not rewritten: the caller refuses those with the reason.

The decoder runs rows right-padded and keeps a cache's rows packed (cache.py); `to_caller` puts a
run's weights back in the caller's columns: the k-th real key of a row at the row's k-th real
column, the queries likewise, every padding query's row and padding key's column zeros
(transformers' rows at a padding query are a uniform spread over every column: no meaning).
"""

from __future__ import annotations

import re

import onnx
import onnx_ir as ir
import torch

from .graph import RewriteSkipped

ATTENTIONS = "ortmodule_attentions_"  # + the index in transformers' tuple
ON_CPU_ONLY = ("ONNX Runtime's CUDA attention kernels (flash and memory-efficient attention) return no attention "
               "weights; load the package on the CPU (device='cpu') for them")
# The ops that give their weights after the softmax as their fourth output: (domain, op) -> the
# attribute that asks for them, its value, and the attribute naming the query heads.
_GIVING = {("com.microsoft", "GroupQueryAttention"): ("qk_output", 2, "num_heads"),
           ("", "Attention"): ("qk_matmul_output_mode", 3, "q_num_heads")}  # ONNX's, opset 23 on
_OTHERS = {"MultiHeadAttention", "Attention", "PackedMultiHeadAttention", "SparseAttention",
           "DecoderMaskedMultiHeadAttention"}
_LAYER = re.compile(r"layers\.(\d+)/")
_QK = 3  # the weights' output


def _layer(node, order: int) -> tuple[int, int]:
    found = _LAYER.search(node.name or "")
    return (int(found[1]) if found is not None else order, order)


def _kind(node) -> tuple[str, str]:
    return (node.domain or "", node.op_type)


def add_attention_outputs(g: ir.Graph, heads: int, dtype: int) -> None:
    """Give every attention node its weights after the softmax as graph outputs `ATTENTIONS + i`
    `[batch, heads, queries, keys]`, i in layer order (`heads`: the query heads where the node does not
    name them; `dtype`, an ONNX element type: the weights' where the graph records no type for the
    query); `RewriteSkipped` naming the attention op where the graph's attention is another."""
    nodes = [node for node in g if _kind(node) in _GIVING]
    others = sorted({node.op_type for node in g if node.op_type in _OTHERS and _kind(node) not in _GIVING})
    if others or not nodes:
        found = f"its attention is com.microsoft's {', '.join(others)}" if others else "it has no attention node"
        raise RewriteSkipped(f"{found}; ONNX Runtime returns attention weights from GroupQueryAttention and ONNX's "
                             "Attention only")
    ordered = sorted(enumerate(nodes), key=lambda pair: _layer(pair[1], pair[0]))
    for i, (_, node) in enumerate(ordered):
        if len(node.outputs) > _QK and node.outputs[_QK] is not None and node.outputs[_QK].name:
            raise RewriteSkipped(f"'{node.name}' already gives its weights as '{node.outputs[_QK].name}'")
        asking, value, named = _GIVING[_kind(node)]
        node.attributes[asking] = ir.AttrInt64(asking, value)
        count = node.attributes[named].as_int() if named in node.attributes else heads
        _with_weights(g, node, f"{ATTENTIONS}{i}", count, ir.DataType(dtype))


def _with_weights(g: ir.Graph, node: ir.Node, name: str, heads: int, dtype: ir.DataType) -> None:
    """Replace `node` by the same node with a fourth output, the graph output `name`."""
    query = node.inputs[0]
    replacement = ir.Node(node.domain, node.op_type, list(node.inputs), list(node.attributes.values()),
                          num_outputs=_QK + 1, name=node.name, version=node.version)
    g.insert_after(node, replacement)
    kept = [(old, new, old.name, old.type, old.shape) for old, new in zip(node.outputs, replacement.outputs)]
    for old, new, *_ in kept:
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    g.remove(node, safe=True)
    for _, new, old_name, kind, shape in kept:
        new.name, new.type, new.shape = old_name, kind, shape
    weights = replacement.outputs[_QK]
    if replacement.domain == "":
        weights = _reshaped(g, replacement)
    weights.name, weights.dtype = name, query.dtype if query is not None and query.dtype is not None else dtype
    weights.shape = ir.Shape(["batch", heads, "queries", "keys"])
    g.outputs.append(weights)


def _reshaped(g: ir.Graph, node: ir.Node) -> ir.Value:
    """ONNX's Attention's weights, reshaped to their own shape: ONNX's shape inference gives their last
    dimension as 0 (onnx 1.2x), which ONNX Runtime would hold a bound output to; the keys' count read
    from the present keys `[B, heads, keys, size]` where the graph uses them (past and new), else from
    the keys input (`[B, heads, keys, size]` or `[B, keys, hidden]`), cuts that tie."""
    present = node.outputs[1] if node.outputs[1].uses() or node.outputs[1].is_graph_output() else None
    source = present if present is not None else node.inputs[1]
    stem = f"{node.name}/ortmodule_weights"
    rows = ir.node("Shape", [node.outputs[_QK]], attributes={"start": 0, "end": 3}, name=f"{stem}/rows")
    keys = ir.node("Shape", [source], attributes={"start": -2, "end": -1}, name=f"{stem}/keys")
    shape = ir.node("Concat", [rows.outputs[0], keys.outputs[0]], attributes={"axis": 0}, name=f"{stem}/shape")
    out = ir.node("Reshape", [node.outputs[_QK], shape.outputs[0]], name=f"{stem}/Reshape")
    g.insert_after(node, [rows, keys, shape, out])
    return out.outputs[0]


def weight_outputs(session, heads: int) -> list[tuple[str, int]]:
    """A session's attention-weight outputs in transformers' order, each with its query heads (`heads`
    where ONNX Runtime reports none)."""
    shapes = {value.name: value.shape for value in session.ort_session.get_outputs()
              if value.name.startswith(ATTENTIONS)}
    ordered = sorted(shapes, key=lambda name: int(name[len(ATTENTIONS):]))
    return [(name, shapes[name][1] if isinstance(shapes[name][1], int) else heads) for name in ordered]


def windows(graph_bytes: bytes) -> list[int | None]:
    """Each attention layer's sliding window (None: it sees every earlier position), in the order of
    `add_attention_outputs`' outputs, from the decoder's graph."""
    model = onnx.ModelProto.FromString(graph_bytes)
    nodes = [node for node in model.graph.node if _kind(node) in _GIVING]
    ordered = sorted(enumerate(nodes), key=lambda pair: _layer(pair[1], pair[0]))
    found = []
    for _, node in ordered:
        window = next((attribute.i for attribute in node.attribute if attribute.name == "local_window_size"), -1)
        found.append(window if window > 0 else None)
    return found


def windowed(weights: tuple, windows: list[int | None], new: int) -> tuple:
    """A step's weights over the caller's columns as transformers gives them: a sliding-window layer's
    over the columns its cache keeps (the last window - 1 before the step, and the step's)."""
    kept = []
    for layer, window in zip(weights, windows):
        seen = layer.shape[3] - new
        kept.append(layer if window is None else layer[..., layer.shape[3] - min(seen, window - 1) - new :])
    return tuple(kept)


def _packed(real: torch.Tensor) -> torch.Tensor:
    """Per row, the columns in the order real ones first (each part in its order)."""
    return torch.argsort((~real).to(torch.int8), dim=1, stable=True)


def to_caller(weights: torch.Tensor, queries_in: torch.Tensor, queries_out: torch.Tensor, keys_in: torch.Tensor,
              keys_out: torch.Tensor) -> torch.Tensor:
    """One layer's weights `[B, heads, q, k]` as the decoder ran them, in the caller's layout
    `[B, heads, q', k']`: `queries_in` `[B, q]` / `keys_in` `[B, k]` mark the run's real queries and
    keys, `queries_out` `[B, q']` / `keys_out` `[B, k']` the caller's (each row as many real ones)."""
    batch, heads = weights.shape[:2]
    device = weights.device
    queries_in, queries_out, keys_in, keys_out = (m.to(device, torch.bool) for m in
                                                  (queries_in, queries_out, keys_in, keys_out))
    weights = weights * (queries_in[:, None, :, None] & keys_in[:, None, None, :]).to(weights.dtype)
    width_q, width_k = queries_out.shape[1], keys_out.shape[1]
    if width_k < weights.shape[3] or width_q < weights.shape[2]:
        raise ValueError(f"attention weights {tuple(weights.shape)} do not fit the caller's {width_q} x {width_k}")
    source_k, target_k = _packed(keys_in), _packed(keys_out)[:, : weights.shape[3]]
    weights = weights.gather(3, source_k[:, None, None, :].expand_as(weights))  # real keys first
    moved = weights.new_zeros(batch, heads, weights.shape[2], width_k)
    moved.scatter_(3, target_k[:, None, None, :].expand_as(weights), weights)
    source_q, target_q = _packed(queries_in), _packed(queries_out)[:, : moved.shape[2]]
    moved = moved.gather(2, source_q[:, None, :, None].expand_as(moved))
    out = moved.new_zeros(batch, heads, width_q, width_k)
    out.scatter_(2, target_q[:, None, :, None].expand_as(moved), moved)
    return out


def step_columns(cache, attention_mask: torch.Tensor | None, new: int) -> torch.Tensor:
    """The caller's real columns `[B, seen + new]` for a step of `new` tokens over `cache`: its
    `attention_mask` (as check_step checked it), else the mask the cache's prompt came with, else
    every column where every row holds every column it took in."""
    device = cache.lengths.device
    if attention_mask is not None:
        return attention_mask.to(device) != 0
    if cache.caller_mask is not None:
        return torch.cat([cache.caller_mask.to(device) != 0, cache.lengths.new_ones(cache.batch_size, new,
                                                                                      dtype=torch.bool)], 1)
    if bool((cache.lengths != cache.seen).any()):
        raise ValueError("output_attentions=True over a cache whose rows hold fewer tokens than its columns (a padded "
                         "batch's, made by generate or scoring) needs the step's attention_mask, to place the weights "
                         "in its columns")
    return torch.ones(cache.batch_size, cache.seen + new, dtype=torch.bool, device=device)
