"""Packed projections unpacked: one MatMul per part instead of one MatMul and a split of its output.

The model builder packs a layer's query, key and value projections into one MatMul whose output is
split into the three: by a `Split` node (exports with query/key norms, Qwen3's CUDA exports among
them) or inside GroupQueryAttention (its packed input, every other export). On CUDA a `Split` is a
kernel of its own that reads and writes every projected value again: `_SplitSmallInnerKernel`, 5.5%
of an MMLU batch's device time on an H200, and the builder's `fuse_qkv=false` (three MatMuls) ran a
32 x 512 prefill of Qwen3-0.6B's shape 1.04x faster (docs/measurements.md, session 28); the
builder's `fuse_mlp_gate_up=true` (the MLP's gate and up projections packed, split in two equal
parts) ran 0.91x. `unpack_projections` makes such a graph the unpacked one: each part multiplies by
a `Slice` of the packed weight's columns, which ONNX Runtime's constant folding turns into an
initializer of its own when the session loads (no slice at run time, the packed weight no longer
held; tests/test_projections.py checks the folding), and the parts' products are the packed
product's columns: the same numbers.

GroupQueryAttention's packed input is left as it is: its CUDA prologue (`UnpackRoPEAppend`, which
runs for packed and separate inputs alike) reads the three parts where they lie, so there is no
split to save, and three MatMuls would launch two kernels more a layer (a decode step's pace on
CUDA without graphs) over smaller products. The extend and prefill graphs (extend.py), which replace
GroupQueryAttention and split such an input with a `Split` node, are unpacked after that rewrite.

ortmodule applies it on CUDA only (`applies`: graph.py's rewrite and extend.py's graphs): on a CPU
the builder's option measured within the noise (session 26), and a second session over a package's
float weights there reads the weight file's pages, which folded copies would not share.
"""

from __future__ import annotations

import onnx_ir as ir

from .constants import constant_tensor

# The device types whose sessions take the unpacked graphs (decoder.py, extend.py).
UNPACK_ON = ("cuda",)


def applies(device_type: str, session_options) -> bool:
    """Whether sessions on a device of `device_type` take the unpacked graphs: on `UNPACK_ON`'s
    device types, with ortmodule's own session options only (a caller's `session_options` may turn
    off the optimizations that fold the weights' slices)."""
    return device_type in UNPACK_ON and session_options is None


def _constant(value: ir.Value | None):
    """The NumPy array of a constant value held in the graph, else None (weights in an external
    file are not read: the rewrite sees the graph without its weights)."""
    tensor = constant_tensor(value)
    return None if tensor is None or isinstance(tensor, ir.ExternalTensor) else tensor.numpy()


def _only_use(value: ir.Value) -> tuple[ir.Node, int] | None:
    uses = list(value.uses())
    return (uses[0][0], uses[0][1]) if len(uses) == 1 else None


def _parts(value: ir.Value, width: int) -> tuple[ir.Node, list[int]] | None:
    """How `value` (a MatMul's `[..., width]`, read by one node) is split along its last axis by a
    `Split` node: (that node, the parts' widths), or None where it is read otherwise."""
    use = _only_use(value)
    if use is None or use[1] != 0 or use[0].op_type != "Split" or use[0].domain != "":
        return None
    user = use[0]
    axis, count = user.attributes.get("axis"), user.attributes.get("num_outputs")
    sizes = _constant(user.inputs[1] if len(user.inputs) > 1 else None)
    if sizes is None and count is not None and width % count.value == 0:  # equal parts (a packed gate and up)
        sizes = [width // count.value] * count.value
    rank = value.shape.rank() if value.shape is not None else None
    last = axis is not None and axis.value in (-1, None if rank is None else rank - 1)
    if not last or sizes is None or len(sizes) != len(user.outputs):
        return None
    return (user, [int(s) for s in sizes]) if sum(int(s) for s in sizes) == width else None


def _packed(graph: ir.Graph, matmul: ir.Node) -> tuple[ir.Value, ir.Node | None, ir.Node, list[int]] | None:
    """For a MatMul by a constant 2-D weight whose output (after a constant bias's Add, if any) is
    only split by columns: (its weight, the Add, the `Split` node, the parts' widths)."""
    if matmul.op_type != "MatMul" or matmul.domain != "" or len(matmul.inputs) != 2:
        return None
    weight = matmul.inputs[1]
    if weight is None or not weight.is_initializer() or weight.shape is None or weight.shape.rank() != 2 \
            or not isinstance(weight.shape[1], int):
        return None
    width, out, add = weight.shape[1], matmul.outputs[0], None
    use = _only_use(out)
    if use is not None and use[0].op_type == "Add" and use[0].domain == "":
        bias = constant_tensor(use[0].inputs[1 - use[1]])  # its shape only: its data may be external
        if bias is not None and tuple(bias.shape) == (width,):
            add, out = use[0], use[0].outputs[0]
    parts = _parts(out, width)
    if parts is None:
        return None
    if any(v in graph.outputs for v in (out, *parts[0].outputs)):
        return None
    return weight, add, *parts


def _columns(graph: ir.Graph, before: ir.Node, value: ir.Value, start: int, end: int, axis: int,
             name: str) -> ir.Value:
    """`value[..., start:end]` along `axis`, as a Slice node inserted before `before`."""
    def const(values, what):
        return ir.Value(name=f"{name}/{what}", const_value=ir.tensor(values, dtype=ir.DataType.INT64,
                                                                     name=f"{name}/{what}"))
    bounds = [const([start], "start"), const([end], "end"), const([axis], "axis")]
    for bound in bounds:
        graph.register_initializer(bound)
    made = ir.node("Slice", [value, *bounds], name=f"{name}/Slice")
    graph.insert_before(before, made)
    return made.outputs[0]


def unpack_projections(graph: ir.Graph) -> int:
    """Replace every MatMul by a constant 2-D weight whose output is only split by columns (a `Split`
    node's parts) with one MatMul per part over the weight's columns (and the bias's, where an Add of
    a constant bias comes between). Returns how many were replaced."""
    replaced = 0
    for matmul in list(graph):
        found = _packed(graph, matmul)
        if found is None:
            continue
        weight, add, user, widths = found
        name = matmul.name or f"/ortmodule/unpacked/{replaced}"
        products, start = [], 0
        for i, width in enumerate(widths):
            part = f"{name}/ortmodule_part{i}"
            product = ir.node("MatMul", [matmul.inputs[0], _columns(graph, matmul, weight, start, start + width, 1,
                                                                     part)], name=f"{part}/MatMul")
            graph.insert_before(matmul, product)
            out = product.outputs[0]
            if add is not None:
                bias = add.inputs[1] if add.inputs[0] is matmul.outputs[0] else add.inputs[0]
                shifted = ir.node("Add", [out, _columns(graph, matmul, bias, start, start + width, 0, f"{part}/bias")],
                                  name=f"{part}/Add")
                graph.insert_before(matmul, shifted)
                out = shifted.outputs[0]
            products.append(out)
            start += width
        for old, new in zip(user.outputs, products):
            new.shape, new.type = old.shape, old.type
            old.replace_all_uses_with(new)
        sizes = user.inputs[1].producer() if len(user.inputs) > 1 and user.inputs[1] is not None else None
        graph.remove(user, safe=True)
        if sizes is not None and sizes.op_type == "Constant" and not sizes.outputs[0].uses():
            graph.remove(sizes, safe=True)
        for node in (add, matmul):
            if node is not None:
                graph.remove(node, safe=True)
        replaced += 1
    return replaced
