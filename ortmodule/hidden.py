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

variants.py runs the graph (with an embeddings input too where the call gives `inputs_embeds`).
"""

from __future__ import annotations

import re

import onnx_ir as ir

from .graph import RewriteSkipped

HIDDEN = "ortmodule_hidden_states_"  # + the index in transformers' tuple
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


def add_hidden_outputs(g: ir.Graph, layers: int, hidden_size: int) -> None:
    """Give the graph outputs `HIDDEN + i` `[rows * positions, hidden_size]`, i = 0 ... layers."""
    shape = ir.Value(name="/ortmodule/hidden_shape", const_value=ir.tensor([-1, hidden_size], dtype=ir.DataType.INT64))
    g.initializers.add(shape)
    for i, value in enumerate(hidden_values(g, layers)):
        flat = ir.node("Reshape", [value, shape], name=f"/ortmodule/hidden_{i}")
        flat.outputs[0].name = f"{HIDDEN}{i}"
        flat.outputs[0].dtype = value.dtype
        flat.outputs[0].shape = ir.Shape(["hidden_rows", hidden_size])
        g.append(flat)
        g.outputs.append(flat.outputs[0])
