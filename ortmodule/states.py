"""Hybrid decoders' layer states, each row's taken at its own last token.

A hybrid decoder keeps, beside its attention layers' KV, a state per layer of another kind, passed
in as its past state and returned as its present one:
- a causal depthwise convolution's last `width` inputs (`com.microsoft` `CausalConvWithState`:
  `[batch, channels, width]`): LFM2's convolution layers, and Qwen3.5's linear attention before its
  recurrence;
- a linear attention's recurrent state (`com.microsoft` `LinearAttention`, the gated delta rule:
  `[batch, heads, key size, value size]`): Qwen3.5's.

ONNX Runtime's kernels return the state after the last column of the run: for a right-padded batch
(ortmodule's layout, inputs.py) that is after the padding of every row shorter than the longest,
which would then enter that row's next tokens. The rewrite here adds one input,
`ortmodule_state_lengths` (int64 `[batch]`: each row's real tokens in this run, 0 to the run's
width). Each convolution's present state becomes the `width` columns of `concat(past, inputs)` that
end at the row's last real token: what the kernel returns for a row without padding, and the past
itself for a row of no real token. Each linear attention's decay and update strength (`beta`) are set
to 0 at padded positions, where the state then passes unchanged (`S_t = exp(decay_t) S_{t-1} +
beta_t k_t (v_t - S_{t-1}^T k_t)`), so its present state is the one after the row's last real token.
The outputs at the real positions are causal, so padding after them never reaches them.

The decoder (decoder.py) binds the lengths on every run; the cache (cache.py) holds the states
beside the KV and passes them from run to run. The extend and prefill graphs (extend.py) return no
states (`state_outputs` names the outputs they drop): their layers read their rows' pasts.
What a state cannot do is shrink: a state holds the sequence before one position only, so a cache
with states is cropped by going back to the states it kept after an earlier run and running the
tokens from there again (cache.py's `Checkpoint`), and a cached prefix is reusable only whole
(docs/usage.md, "Hybrid models").
"""

from __future__ import annotations

import onnx_ir as ir

STATE_LENGTHS = "ortmodule_state_lengths"
CONV_OP = ("com.microsoft", "CausalConvWithState")
LINEAR_OP = ("com.microsoft", "LinearAttention")
STATE_OPS = {CONV_OP, LINEAR_OP}
# The builder's other stateful forms: its CUDA-only gated delta rule (`linear_attn_op=gated_delta_net`,
# whose gates are applied inside the kernel) and its packed (paged-attention) variants
_OTHER_STATE_OPS = {"GatedDeltaNet", "VarlenGatedDeltaNet", "VarlenCausalConvWithState"}


class StatesSkipped(Exception):
    """The graph's layer states are not in the form the rewrite knows; the reason is the message."""


def stateful(graph: ir.Graph) -> list[ir.Node]:
    """The graph's stateful convolutions and linear attentions."""
    return [node for node in graph if (node.domain, node.op_type) in STATE_OPS]


def has_states(node_kinds) -> bool:
    """Whether a graph with these `(domain, op_type)` nodes keeps layer states this module rewrites or refuses."""
    return any(kind in STATE_OPS or kind[1] in _OTHER_STATE_OPS for kind in node_kinds)


def select_states_at_lengths(graph: ir.Graph) -> bool:
    """Rewrite every `CausalConvWithState`'s and `LinearAttention`'s present state to be taken at each
    row's real length (`ortmodule_state_lengths`). Returns whether the graph had any; raises
    `StatesSkipped` where a state is not of the form the rewrite knows (nothing is changed then)."""
    other = next((node for node in graph if node.op_type in _OTHER_STATE_OPS), None)
    if other is not None:
        raise StatesSkipped(f"{other.name}: {other.op_type} (the builder's CUDA gated delta rule or its packed "
                            "form) is not supported; export with the default linear_attn_op (LinearAttention)")
    nodes = stateful(graph)
    if not nodes:
        return False
    outputs = {value.name: i for i, value in enumerate(graph.outputs)}
    for node in nodes:
        _check_state_form(node, outputs)
    lengths = ir.Value(name=STATE_LENGTHS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size"]))
    graph.inputs.append(lengths)
    convolutions = [node for node in nodes if (node.domain, node.op_type) == CONV_OP]
    if convolutions:
        axes = _constant(graph, "/ortmodule/states/axes", [1, 2])
        ends = ir.node("Unsqueeze", [lengths, axes], name="/ortmodule/states/Unsqueeze")  # [B, 1, 1]
        graph.insert_before(convolutions[0], [ends])
        for node in convolutions:
            _take_at_lengths(graph, node, ends.outputs[0], outputs)
    linear = [node for node in nodes if (node.domain, node.op_type) == LINEAR_OP]
    if linear:
        real, typed = _real_positions(graph, linear[0], lengths), {}
        for node in linear:
            _hold_at_padding(graph, node, real, typed, linear[0])
    return True


def _check_state_form(node: ir.Node, outputs: dict) -> None:
    """StatesSkipped where `node`'s state is not a graph input and output of a fixed shape, unwindowed
    (and, for a linear attention, not fed its decay and beta)."""
    linear = (node.domain, node.op_type) == LINEAR_OP
    past = node.inputs[3] if len(node.inputs) > 3 else None
    present = node.outputs[1] if len(node.outputs) > 1 else None
    window = node.attributes.get("state_window")
    if past is None or present is None or not past.is_graph_input() or present.name not in outputs:
        raise StatesSkipped(f"{node.name}: its state is not a graph input and output")
    if window is not None and window.value not in (0, 1):
        raise StatesSkipped(f"{node.name}: state_window={window.value} (a windowed state) is not supported")
    rank = 4 if linear else 3
    if past.shape is None or past.shape.rank() != rank or not all(isinstance(d, int) for d in past.shape[1:]):
        raise StatesSkipped(f"{node.name}: its state's shape {past.shape} is not of fixed sizes after the batch")
    if linear and (len(node.inputs) < 6 or node.inputs[4] is None or node.inputs[5] is None
                   or node.inputs[4].shape is None or node.inputs[4].shape.rank() != 3):
        raise StatesSkipped(f"{node.name}: a linear attention without its decay and beta gates [batch, sequence, "
                            "heads] (another update rule)")


def state_outputs(graph: ir.Graph) -> set[str]:
    """The names of the graph's outputs that are layer states (the kernels' own, or taken at the rows'
    lengths by `select_states_at_lengths`)."""
    names = {node.name for node in stateful(graph)}
    found = set()
    for value in graph.outputs:
        producer = value.producer()
        if producer is not None and ((producer.domain, producer.op_type) in STATE_OPS
                                     or producer.name.rsplit("/ortmodule_state/", 1)[0] in names):
            found.add(value.name)
    return found


def release_padding_holds(graph: ir.Graph) -> None:
    """Undo `select_states_at_lengths`' hold of the linear attentions' states at padding, for a graph
    that returns no states (extend.py's): its outputs at real positions do not depend on it, and the
    graph then takes no lengths."""
    for node in [node for node in graph if node.name.rsplit("/ortmodule_state/", 1)[-1] in ("decay", "beta")
                 and node.op_type == "Mul"]:
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)


def _real_positions(graph: ir.Graph, first: ir.Node, lengths: ir.Value) -> ir.Value:
    """`[B, S, 1]`: true at each row's real positions of the run (`position < length`), false at its padding
    (the run's width read from `first`'s decay), made just before `first`."""
    name = "/ortmodule/states/real"
    decay = first.inputs[4]
    zero, one = _constant(graph, f"{name}/zero", 0), _constant(graph, f"{name}/one", 1)
    axis = _constant(graph, f"{name}/axis", [1])
    shape = ir.node("Shape", [decay], attributes={"start": 1, "end": 2}, name=f"{name}/Shape")  # [1]: S
    width = ir.node("Squeeze", [shape.outputs[0]], name=f"{name}/Squeeze")
    positions = ir.node("Range", [zero, width.outputs[0], one], name=f"{name}/Range")  # [S]
    ends = ir.node("Unsqueeze", [lengths, axis], name=f"{name}/Unsqueeze")  # [B, 1]
    real = ir.node("Less", [positions.outputs[0], ends.outputs[0]], name=f"{name}/Less")  # [B, S]
    spread = ir.node("Unsqueeze", [real.outputs[0], _constant(graph, f"{name}/last", [2])],
                     name=f"{name}/Spread")  # [B, S, 1]
    graph.insert_before(first, [shape, width, positions, ends, real, spread])
    return spread.outputs[0]


def _hold_at_padding(graph: ir.Graph, node: ir.Node, real: ir.Value, typed: dict, first: ir.Node) -> None:
    """Zero `node`'s decay and beta (inputs 4 and 5) at padded positions: its state passes them unchanged."""
    for index, part in ((4, "decay"), (5, "beta")):
        gate = node.inputs[index]
        held = ir.node("Mul", [gate, _real_as(graph, real, gate, node, typed, first)],
                       name=f"{node.name}/ortmodule_state/{part}")
        graph.insert_before(node, [held])
        node.replace_input_with(index, held.outputs[0])


def _real_as(graph: ir.Graph, real: ir.Value, gate: ir.Value, node: ir.Node, typed: dict, first: ir.Node) -> ir.Value:
    """`real` in `gate`'s element type: one Cast per type for every layer (`typed`, made before `first`, the
    first linear attention), or, where the graph records no type, a CastLike before `node`."""
    dtype = gate.type.dtype if gate.type is not None else None
    if dtype is None:
        cast = ir.node("CastLike", [real, gate], name=f"{node.name}/ortmodule_state/real_{gate.name}")
        graph.insert_before(node, [cast])
        return cast.outputs[0]
    if dtype not in typed:
        cast = ir.node("Cast", [real], attributes={"to": dtype}, name=f"/ortmodule/states/real_{dtype.name}")
        graph.insert_before(first, [cast])
        typed[dtype] = cast.outputs[0]
    return typed[dtype]


def _constant(graph: ir.Graph, name: str, values: list[int] | int) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(values, dtype=ir.DataType.INT64, name=name))
    graph.register_initializer(value)
    return value


def _take_at_lengths(graph: ir.Graph, node: ir.Node, ends: ir.Value, outputs: dict) -> None:
    """Make `node`'s present state output the columns of `concat(past, inputs)` `[length, length + width)`."""
    past, present = node.inputs[3], node.outputs[1]
    width, name = past.shape[2], f"{node.name}/ortmodule_state"
    offsets = _constant(graph, f"{name}/offsets", list(range(width)))
    joined = ir.node("Concat", [past, node.inputs[0]], attributes={"axis": 2}, name=f"{name}/Concat")
    columns = ir.node("Add", [ends, offsets], name=f"{name}/Add")  # [B, 1, width]
    shape = ir.node("Shape", [past], name=f"{name}/Shape")
    spread = ir.node("Expand", [columns.outputs[0], shape.outputs[0]], name=f"{name}/Expand")  # [B, C, width]
    taken = ir.node("GatherElements", [joined.outputs[0], spread.outputs[0]], attributes={"axis": 2},
                    name=f"{name}/GatherElements")
    graph.insert_after(node, [joined, columns, shape, spread, taken])
    state = taken.outputs[0]
    name = present.name
    present.name = f"{name}/ortmodule_last_column"
    state.name, state.type, state.shape = name, present.type, present.shape
    graph.outputs[outputs[name]] = state
