"""`forward(..., output_hidden_states=True)`: transformers' `hidden_states`, from a copy of the
decoder's graph that also returns them.

transformers returns `num_hidden_layers + 1` tensors `[batch, sequence, hidden]`: the residual
stream entering each layer (the first is the token embeddings, scaled where the model scales them),
and last the final norm's output, the LM head's input. A builder decoder computes each of them:
layer i's first norm reads the residual stream, its `input_layernorm` (`operator_layernorm` in
LFM2) either a plain norm of it (layer 0) or a skip norm that adds the previous layer's output to
the residual and returns the sum as its fourth output; the final norm's output feeds the head.
`add_hidden_outputs` makes those values outputs (reshaped to `[rows * positions, hidden]`) of the
LM-head-rewritten graph (or of blocks.py's rewrite of it), cached like it (variants.graph_bytes). The
norms are found by the builder's node names, else by their weights' names (mobius-onnx's graphs:
`decoder.model.layers.3.input_layernorm.weight`, the final `decoder.model.norm.weight`, ONNX's
`RMSNormalization` or the fused skip norm); graphs named neither way raise `RewriteSkipped`, and the
caller a `NotSupportedError` with the reason.

variants.py runs the graph (with an embeddings input too where the call gives `inputs_embeds`).
"""

from __future__ import annotations

import re

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .graph import RewriteSkipped

HIDDEN = "ortmodule_hidden_states_"  # + the index in transformers' tuple
_FIRST_NORMS = ("input_layernorm", "operator_layernorm")
_NORMS = {"SimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization"}
_SKIP_NORMS = {"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}
_SUM = 3  # a skip norm's input + skip (+ bias) sum output
_LAYER_NORM = re.compile(r"^/model/layers\.(\d+)/([a-z_]+)/")  # the builder's node names
_NORM_WEIGHT = re.compile(r"(?:^|\.)model\.(?:layers\.(\d+)\.([a-z_]+)|norm)\.weight$")  # mobius-onnx's weights
_FINAL = "final_norm_layernorm"


def _role(node: ir.Node, layers: int) -> tuple[int, str] | None:
    """A norm's layer and name: from the builder's node name, else from its weight's name (the final
    norm's as the builder names it, after the last layer)."""
    found = _LAYER_NORM.match(node.name or "")
    if found is not None:
        return int(found[1]), found[2]
    for value in node.inputs[1:]:
        found = _NORM_WEIGHT.search(value.name or "") if value is not None else None
        if found is not None:
            return (int(found[1]), found[2]) if found[1] is not None else (layers, _FINAL)
    return None


def hidden_values(g: ir.Graph, layers: int) -> list[ir.Value]:
    """The `layers + 1` values transformers returns as `hidden_states`, in its order."""
    first: dict[int, ir.Node] = {}
    final = None
    for node in g:
        role = _role(node, layers) if node.op_type in _NORMS | _SKIP_NORMS else None
        if role is None:
            continue
        layer, name = role
        if name in _FIRST_NORMS and layer not in first:
            first[layer] = node
        elif name == _FINAL and layer == layers:
            final = node
    missing = [i for i in range(layers) if i not in first]
    if missing or final is None:
        what = f"layers {missing[:3]} have no input norm" if missing else f"no final norm after layer {layers - 1}"
        raise RewriteSkipped("neither the graph's nodes nor its norms' weights are named as the model builder or "
                             f"mobius-onnx names them ({what})")
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


def add_hidden_outputs(g: ir.Graph, layers: int, hidden_size: int, last_only: bool = False) -> None:
    """Give the graph outputs `HIDDEN + i` `[rows * positions, hidden_size]`, i = 0 ... layers (`last_only`:
    i = layers, the final norm's output, only)."""
    shape = ir.Value(name="/ortmodule/hidden_shape", const_value=ir.tensor([-1, hidden_size], dtype=ir.DataType.INT64))
    g.initializers.add(shape)
    values = hidden_values(g, layers)
    # mobius-onnx records no types inside its graphs: a value without one has the others' (the
    # embeddings' input has one), the residual stream's type throughout.
    known = next((value.dtype for value in values if value.dtype is not None), None)
    for i, value in enumerate(values):
        if last_only and i < layers:
            continue
        flat = ir.node("Reshape", [value, shape], name=f"/ortmodule/hidden_{i}")
        flat.outputs[0].name = f"{HIDDEN}{i}"
        flat.outputs[0].dtype = value.dtype or known
        flat.outputs[0].shape = ir.Shape(["hidden_rows", hidden_size])
        g.append(flat)
        g.outputs.append(flat.outputs[0])


def drop_output(model: ir.Model, name: str) -> None:
    """Take output `name` out of the graph, and every node and initializer only it needed (onnx-ir's dead
    code elimination): the LM head and its weight, where the logits are the output."""
    model.graph.outputs[:] = [value for value in model.graph.outputs if value.name != name]
    RemoveUnusedNodesPass()(model)
