"""The decoder's tail at the kept positions only: the last attention's output and what joins it
gathered at `ortmodule_logits_indices`, instead of the final hidden states just before the head.

graph.py's rewrite gathers the final hidden states at the positions whose logits are asked for, so
the LM head runs on those rows only. Everything between the last attention and the head works on
each position alone (the last layer's output projection, residual adds, norms and MLP), so it can
run on those rows only as well: scoring asks for one to a few positions of hundreds, and the last
layer's output projection and MLP are most of a layer's weights (about 2.6% of Qwen3-0.6B's decoder
FLOPs, 1/28 of its layers times their share; 2.8% of SmolLM2-135M's). `gather_tail` moves the
gather there where the graph allows it, and leaves the head's gather where it is otherwise.

What is checked, for the rows to mean the same positions: every node of the tail (the nodes that
the last attention's output reaches before the head) works on each position alone (`_POSITIONWISE`:
element-wise ops with constant or per-position operands, norms over the last axis, MatMuls by a
constant weight); nothing outside the tail reads its values; and every variable value that enters
the tail (the attention's output, the residual stream, a per-layer input) is recorded as
`[batch, sequence, features]` in the dimensions of the decoder's token input, so that a flat
index into batch x sequence picks the same position in each.
"""

from __future__ import annotations

import onnx_ir as ir

from .constants import constant_tensor, is_constant

_ATTENTION = {"GroupQueryAttention", "MultiHeadAttention", "Attention", "PagedAttention", "SparseAttention"}
# Ops that compute each position from that position alone (with the checks of `_positionwise`).
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Sigmoid", "Tanh", "Relu", "Erf", "Sqrt", "Reciprocal", "Neg",
                "Softplus", "Cast", "Identity", "QuickGelu", "Gelu", "FastGelu", "BiasGelu"}
_NORMS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization",
          "SkipLayerNormalization"}
_WEIGHTED = {"MatMul", "MatMulNBits"}  # input 1 their constant weight


def _constant_rank(value: ir.Value) -> int | None:
    """The rank of a constant value: its tensor's (an initializer's, a Constant node's), else as recorded."""
    tensor = constant_tensor(value)
    if tensor is not None:
        return len(tensor.shape)
    return value.shape.rank() if value.shape is not None else None


def _positionwise(node: ir.Node) -> bool:
    """Whether `node` computes each position of its `[batch, sequence, features]` inputs from that
    position alone."""
    op, constants = node.op_type, [v for v in node.inputs if v is not None and is_constant(v)]
    if node.domain not in ("", "ai.onnx", "com.microsoft"):  # another domain's op of the same name
        return False
    if op in _WEIGHTED:  # every input but the first constant, a MatMul's weight a matrix
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        return weight is not None and all(v is None or is_constant(v) for v in node.inputs[1:]) and (
            op != "MatMul" or _constant_rank(weight) == 2)
    if op in _NORMS:
        axis = node.attributes.get("axis")
        return axis is None or axis.value == -1
    if op in _ELEMENTWISE:  # constants broadcast over the features only
        return all((rank := _constant_rank(v)) is not None and rank <= 1 for v in constants)
    if op == "Split":
        axis = node.attributes.get("axis")
        return axis is not None and axis.value == -1
    return False


def _tail(graph: ir.Graph, start: ir.Value, end: ir.Node) -> list[ir.Node] | None:
    """The nodes `start` reaches before `end` (in graph order), or None where one of their values is
    read outside them (a graph output, or a node they do not reach)."""
    found: dict[ir.Node, None] = {}
    stack = [start]
    while stack:
        for user, _ in stack.pop().uses():
            if user is not end and user not in found:
                found[user] = None
                stack.extend(user.outputs)
    for node in found:
        for value in node.outputs:
            if value in graph.outputs or any(user is not end and user not in found for user, _ in value.uses()):
                return None
    return [node for node in graph if node in found]


def _token_dims(graph: ir.Graph) -> tuple | None:
    """The batch and sequence dimensions of the decoder's token input (ids or embeddings)."""
    for value in graph.inputs:
        if value.name in ("input_ids", "inputs_embeds") and value.shape is not None and value.shape.rank() >= 2:
            return value.shape[0], value.shape[1]
    return None


def _per_position(value: ir.Value, dims) -> bool:
    shape = value.shape
    return shape is not None and shape.rank() == 3 and (shape[0], shape[1]) == dims \
        and all(isinstance(d, ir.SymbolicDim) and d.value is not None for d in dims)  # named, not unknown


def gather_tail(graph: ir.Graph, flatten: ir.Node, gather: ir.Node) -> bool:
    """Move the head's gather (`flatten` of the final hidden states, then `gather` at the indices)
    before the tail after the last attention, where the module docstring's checks hold: each value
    entering the tail is flattened and gathered instead (as `[1, n, features]`), and the head reads
    the tail's output flattened. Returns whether it moved."""
    attention = [node for node in graph if node.op_type in _ATTENTION]
    dims = _token_dims(graph)
    if not attention or dims is None:
        return False
    tail = _tail(graph, attention[-1].outputs[0], flatten)
    if not tail or flatten.inputs[0].producer() not in tail or not all(_positionwise(node) for node in tail):
        return False
    inside = {value for node in tail for value in node.outputs}
    entering = {}
    for node in tail:
        for value in node.inputs:
            if value is not None and value not in inside and not is_constant(value):
                entering[value] = None
    if not all(_per_position(value, dims) for value in entering):
        return False
    indices, axes = gather.inputs[1], ir.Value(name="/ortmodule/tail/axes", const_value=ir.tensor(
        [0], dtype=ir.DataType.INT64, name="/ortmodule/tail/axes"))
    graph.register_initializer(axes)
    for i, value in enumerate(entering):
        name = f"/ortmodule/tail/{i}"
        rows = ir.node("Flatten", [value], attributes={"axis": 2}, name=f"{name}/Flatten")
        picked = ir.node("Gather", [rows.outputs[0], indices], attributes={"axis": 0}, name=f"{name}/Gather")
        batched = ir.node("Unsqueeze", [picked.outputs[0], axes], name=f"{name}/Unsqueeze")
        readers = [node for node in tail if value in node.inputs]
        graph.insert_before(readers[0], [rows, picked, batched])  # after `value` is made, before its first reader
        for node in readers:
            for k, v in enumerate(node.inputs):
                if v is value:
                    node.replace_input_with(k, batched.outputs[0])
    for value in inside:
        value.shape = None  # `[1, n, features]` now; ONNX Runtime infers it
    gather.outputs[0].replace_all_uses_with(flatten.outputs[0])
    graph.remove(gather, safe=True)
    return True
