"""Contrib ops whose CPU kernels in ONNX Runtime run far below what their work needs, written as the
standard ops they stand for. graph.py applies this to a decoder that runs on a CPU only; CUDA keeps the
fused kernels.

- `GatedRMSNorm(x, scale, gate)` (Qwen3.5's linear attention, after its recurrence): the RMS norm of
  each `scale`-wide group of `x`'s last axis, times `scale`, times SiLU(gate). As
  `SimplifiedLayerNormalization` over `x` viewed `[..., groups, width]`, then `gate * Sigmoid(gate)`
  (ONNX Runtime fuses it) times that: on a 2-vCPU Xeon 10 ms where the kernel took 70 ms for a
  scoring batch's `[8, 256, 2048]` (docs/measurements.md, session 119), the same numbers to float
  rounding (tests/test_hybrid.py).

Not `CausalConvWithState`: written as ONNX's depthwise `Conv` over `concat(past, x)` it took 3.4 s of a
Qwen3.5 scoring batch where the kernel takes 2.0 s; as the sum of its four taps' slices times their
weights in `[B, S, C]`, without the transposes around it, about what the kernel and the transposes take
(2.5 s; session 119).
"""

from __future__ import annotations

import onnx_ir as ir

GATED_NORM = ("com.microsoft", "GatedRMSNorm")


def decompose(graph: ir.Graph) -> bool:
    """Replace every `GatedRMSNorm` of a rank-3 input and a 1-D scale of known width by standard ops;
    whether any was."""
    nodes = [node for node in graph if (node.domain, node.op_type) == GATED_NORM and _decomposable(node)]
    for index, node in enumerate(nodes):
        _replace_gated_norm(graph, node, index)
    return bool(nodes)


def _decomposable(node: ir.Node) -> bool:
    if len(node.inputs) != 3 or any(value is None for value in node.inputs):
        return False
    x, scale = node.inputs[0], node.inputs[1]
    return (x.shape is not None and x.shape.rank() == 3 and scale.shape is not None and scale.shape.rank() == 1
            and isinstance(scale.shape[0], int))


def _replace_gated_norm(graph: ir.Graph, node: ir.Node, index: int) -> None:
    x, scale, gate = node.inputs
    name, width = f"/ortmodule/cpu_forms/gated_norm{index}", scale.shape[0]
    groups = ir.Value(name=f"{name}/groups", const_value=ir.tensor([0, 0, -1, width], dtype=ir.DataType.INT64,
                                                                   name=f"{name}/groups"))
    graph.register_initializer(groups)
    epsilon = node.attributes.get("epsilon")
    grouped = ir.node("Reshape", [x, groups], name=f"{name}/Reshape")
    norm = ir.node("SimplifiedLayerNormalization", [grouped.outputs[0], scale], name=f"{name}/Norm",
                   attributes={"axis": -1, "epsilon": epsilon.value if epsilon is not None else 1e-5})
    shape = ir.node("Shape", [x], name=f"{name}/Shape")
    flat = ir.node("Reshape", [norm.outputs[0], shape.outputs[0]], name=f"{name}/Flat")
    sigmoid = ir.node("Sigmoid", [gate], name=f"{name}/Sigmoid")
    silu = ir.node("Mul", [gate, sigmoid.outputs[0]], name=f"{name}/SiLU")
    out = ir.node("Mul", [flat.outputs[0], silu.outputs[0]], name=f"{name}/Mul")
    graph.insert_before(node, [grouped, norm, shape, flat, sigmoid, silu, out])
    made = out.outputs[0]
    made.type, made.shape = node.outputs[0].type, node.outputs[0].shape
    node.outputs[0].replace_all_uses_with(made, replace_graph_outputs=True)
    graph.remove(node, safe=True)
