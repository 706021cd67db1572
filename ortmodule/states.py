"""Hybrid decoders' convolution states, each row's taken at its own last token.

A hybrid decoder (LFM2's: convolution layers beside attention layers) keeps, per convolution
layer, the last `width` inputs of a causal depthwise convolution (`com.microsoft`
`CausalConvWithState`: `[batch, channels, width]`), passed in as its past state and returned as its
present one. ONNX Runtime's kernel returns the state after the last column of the run: for a
right-padded batch (ortmodule's layout, inputs.py) that is after the padding of every row shorter
than the longest, which would then enter that row's next tokens. The rewrite here adds one input,
`ortmodule_state_lengths` (int64 `[batch]`: each row's real tokens in this run, 0 to the run's
width), and returns as each present state the `width` columns of `concat(past, inputs)` that end at
the row's last real token: what the kernel returns for a row without padding, and the past itself
for a row of no real token. The convolution's outputs at the real positions are causal, so padding
after them never reaches them.

The decoder (decoder.py) binds the lengths on every run; the cache (cache.py) holds the states
beside the KV and passes them from run to run. The extend and prefill graphs (extend.py) return no
states (`state_outputs` names the outputs they drop): their convolutions read their rows' pasts.
What a convolution state cannot do is shrink: a state holds the inputs before one position only,
so a cache with states is cropped by going back to the states it kept after an earlier run and
running the tokens from there again (cache.py's `Checkpoint`), and a cached prefix is reusable only
whole (docs/usage.md, "Hybrid models").
"""

from __future__ import annotations

import onnx_ir as ir

STATE_LENGTHS = "ortmodule_state_lengths"
CONV_OP = ("com.microsoft", "CausalConvWithState")


class StatesSkipped(Exception):
    """The graph's convolution states are not in the form the rewrite knows; the reason is the message."""


def convolutions(graph: ir.Graph) -> list[ir.Node]:
    """The graph's stateful convolutions."""
    return [node for node in graph if (node.domain, node.op_type) == CONV_OP]


def select_states_at_lengths(graph: ir.Graph) -> bool:
    """Rewrite every `CausalConvWithState`'s present state to be taken at each row's real length
    (`ortmodule_state_lengths`). Returns whether the graph had any; raises `StatesSkipped` where a
    convolution's state is not a graph input and output of a fixed width (nothing is changed then)."""
    nodes = convolutions(graph)
    if not nodes:
        return False
    outputs = {value.name: i for i, value in enumerate(graph.outputs)}
    for node in nodes:
        past = node.inputs[3] if len(node.inputs) > 3 else None
        present = node.outputs[1] if len(node.outputs) > 1 else None
        window = node.attributes.get("state_window")
        if past is None or present is None or not past.is_graph_input() or present.name not in outputs:
            raise StatesSkipped(f"{node.name}: its state is not a graph input and output")
        if window is not None and window.value not in (0, 1):
            raise StatesSkipped(f"{node.name}: state_window={window.value} (a windowed state) is not supported")
        if past.shape is None or past.shape.rank() != 3 or not isinstance(past.shape[2], int):
            raise StatesSkipped(f"{node.name}: its state's shape {past.shape} has no fixed width")
    lengths = ir.Value(name=STATE_LENGTHS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch_size"]))
    graph.inputs.append(lengths)
    axes = _constant(graph, "/ortmodule/states/axes", [1, 2])
    ends = ir.node("Unsqueeze", [lengths, axes], name="/ortmodule/states/Unsqueeze")  # [B, 1, 1]
    graph.insert_before(nodes[0], [ends])
    for node in nodes:
        _take_at_lengths(graph, node, ends.outputs[0], outputs)
    return True


def state_outputs(graph: ir.Graph) -> set[str]:
    """The names of the graph's outputs that are convolution states (the kernel's own, or taken at
    the rows' lengths by `select_states_at_lengths`)."""
    names = {node.name for node in convolutions(graph)}
    found = set()
    for value in graph.outputs:
        producer = value.producer()
        if producer is not None and ((producer.domain, producer.op_type) == CONV_OP
                                     or producer.name.rsplit("/ortmodule_state/", 1)[0] in names):
            found.add(value.name)
    return found


def _constant(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
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
