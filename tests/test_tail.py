"""The decoder's tail after the last attention at the kept positions only (ortmodule/tail.py): the
same logits as the graph that gathers just before the head, and transformers'; left alone where a
node of the tail mixes positions, where its values are read elsewhere, or where a value entering it
has no recorded per-position shape."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from helpers import left_padded_batch, load_pair, right_padded_batch
from onnx import TensorProto, helper, numpy_helper

from ortmodule import OrtModelForCausalLM, graph, tail


def tail_gathers(data: bytes) -> int:
    return sum(n.op_type == "Gather" and n.name.startswith("/ortmodule/tail/")
               for n in onnx.load_from_string(data).graph.node)


# Per package: the values entering its tail (the attention's output and the residual stream; in a
# mobius-exported Gemma 4 also its per-layer input and a value of its first layer's).
PACKAGES = {"llama": (dict(arch="llama"), 2), "qwen3": (dict(arch="qwen3"), 2), "gemma3": (dict(arch="gemma3"), 2),
            "phi3": (dict(arch="phi3"), 2), "llama-int4": (dict(arch="llama", precision="int4"), 2),
            "gemma4-mobius": (dict(arch="gemma4_mobius"), 3)}


@pytest.mark.parametrize("package", PACKAGES)
def test_the_tail_at_the_kept_positions_gives_the_same_logits(build, package, monkeypatch, tmp_path):
    fields, entering = PACKAGES[package]
    fixture = build(**fields)
    model, hf = load_pair(fixture)
    assert tail_gathers(model.decoder.graph_bytes) == entering
    monkeypatch.setattr(graph, "gather_tail", lambda *args: False)
    head_only = OrtModelForCausalLM.from_pretrained(fixture.package_dir, cache_dir=tmp_path)
    assert tail_gathers(head_only.decoder.graph_bytes) == 0
    for ids, mask in (right_padded_batch([9, 14, 5], seed=3), left_padded_batch([9, 14, 5], seed=4)):
        ours = model(ids, attention_mask=mask, cont_len=3).logits
        torch.testing.assert_close(ours, head_only(ids, attention_mask=mask, cont_len=3).logits, rtol=0, atol=1e-5)
        if fields.get("precision", "fp32") == "fp32":
            with torch.no_grad():
                expected = hf(input_ids=ids, attention_mask=mask).logits[:, -3:]
            real = mask[:, -3:].bool()
            torch.testing.assert_close(ours[real], expected[real], rtol=1e-4, atol=1e-4)


def tail_graph(mixing: str = "Sigmoid", read_elsewhere: bool = False,
               recorded: bool = True) -> tuple[ir.Graph, ir.Node, ir.Node]:
    """A decoder's end: attention -> MatMul -> `mixing` -> Add(residual) -> head, with the head's
    gather as graph.py inserts it: (the graph, its Flatten, its Gather)."""
    per_position = ["batch_size", "sequence_length", 4]
    nodes = [helper.make_node("GroupQueryAttention", ["x"], ["a"], domain="com.microsoft", num_heads=1,
                              kv_num_heads=1),
             # a constant that differs along the sequence, its shape recorded nowhere but in itself
             helper.make_node("Constant", [], ["along"], value=numpy_helper.from_array(
                 np.arange(28, dtype=np.float32).reshape(1, 7, 4))),
             helper.make_node("MatMul", ["a", "w"], ["y"]),
             helper.make_node(mixing, {"CumSum": ["y", "one"], "Mul": ["y", "along"]}.get(mixing, ["y"]), ["z"]),
             helper.make_node("Add", ["z", "residual"], ["h"]),
             helper.make_node("MatMul", ["h", "head"], ["logits"])]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("x", TensorProto.FLOAT, per_position),
              helper.make_tensor_value_info("residual", TensorProto.FLOAT, per_position if recorded else None)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", 8])]
    if read_elsewhere:
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    inits = [numpy_helper.from_array(np.ones((4, 4), np.float32), "w"),
             numpy_helper.from_array(np.ones((4, 8), np.float32), "head"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    value_info = [helper.make_tensor_value_info("a", TensorProto.FLOAT, per_position)]
    proto = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits, value_info=value_info),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model = ir.serde.deserialize_model(proto)
    g = model.graph
    head = next(n for n in g if n.op_type == "MatMul" and n.inputs[1].name == "head")
    indices = ir.Value(name=graph.LOGITS_INDICES, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["n"]))
    g.inputs.append(indices)
    flatten = ir.node("Flatten", [head.inputs[0]], attributes={"axis": 2})
    gather = ir.node("Gather", [flatten.outputs[0], indices], attributes={"axis": 0})
    g.insert_before(head, [flatten, gather])
    head.replace_input_with(0, gather.outputs[0])
    return g, flatten, gather


@pytest.mark.parametrize("case,moves", [("positionwise", True), ("mixes positions", False),
                                        ("a constant along the sequence", False), ("read elsewhere", False),
                                        ("no recorded shape", False)])
def test_what_the_tail_gather_checks(case, moves):
    mixing = {"mixes positions": "CumSum", "a constant along the sequence": "Mul"}.get(case, "Sigmoid")
    g, flatten, gather = tail_graph(mixing=mixing, read_elsewhere=case == "read elsewhere",
                                    recorded=case != "no recorded shape")
    assert tail.gather_tail(g, flatten, gather) is moves
    gathers = [n for n in g if n.op_type == "Gather"]
    assert len(gathers) == (2 if moves else 1)  # the attention's output and the residual, or the head's
