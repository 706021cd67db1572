"""Packed projections unpacked (ortmodule/projections.py): one MatMul per part over a slice of the
packed weight, which ONNX Runtime folds at load; the same logits as the package's packed graph."""

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from helpers import load_pair
from onnx import TensorProto, helper, numpy_helper

from ortmodule import OrtModelForCausalLM, extend, graph, projections, runtime
from ortmodule.package import read_package

# The builder's packings: a Split node (exports with query/key norms, Qwen3's and Gemma 3's),
# `fuse_mlp_gate_up` (the MLP's gate and up projections, split in two equal parts), and
# GroupQueryAttention's packed input (the other exports), which the decoder's graph keeps. Per case:
# the fixture, and per layer the MatMuls unpacking adds and the weight slices it makes.
CASES = {"split": (dict(arch="qwen3"), 2, 3), "split-sliding": (dict(arch="gemma3"), 2, 3),
         "gate-up": (dict(arch="llama", extra_options=(("fuse_mlp_gate_up", "true"),)), 1, 2),
         "packed-input": (dict(arch="llama"), 0, 0)}


def op_counts(data: bytes) -> collections.Counter:
    return collections.Counter(node.op_type for node in onnx.load_from_string(data).graph.node)


def packed_inputs(data: bytes) -> int:
    """GroupQueryAttention nodes that take query, key and value packed in one input."""
    return sum(n.op_type == "GroupQueryAttention" and not (len(n.input) > 2 and n.input[1] and n.input[2])
               for n in onnx.load_from_string(data).graph.node)


@pytest.mark.parametrize("case", CASES)
def test_unpacked_projections_give_the_package_graphs_logits(build, case, monkeypatch, tmp_path):
    fields, added, slices = CASES[case]
    fixture = build(**fields)
    packed = OrtModelForCausalLM.from_pretrained(fixture.package_dir, cache_dir=tmp_path)
    monkeypatch.setattr(projections, "UNPACK_ON", ("cpu",))  # as on CUDA
    unpacked = OrtModelForCausalLM.from_pretrained(fixture.package_dir, cache_dir=tmp_path)
    layers = len(packed.decoder.spec.layers)
    before, after = op_counts(packed.decoder.graph_bytes), op_counts(unpacked.decoder.graph_bytes)
    assert after["MatMul"] == before["MatMul"] + added * layers and after["Split"] == 0
    # GroupQueryAttention's packed input stays packed: its CUDA prologue reads the parts where they lie.
    assert packed_inputs(unpacked.decoder.graph_bytes) == packed_inputs(packed.decoder.graph_bytes)
    assert packed_inputs(packed.decoder.graph_bytes) == (layers if fields["arch"] == "llama" else 0)

    # ONNX Runtime folds the weights' slices into initializers at load: no Slice is left to run.
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    runtime.make_session(unpacked.decoder.graph_bytes, torch.device("cpu"), fixture.package_dir, options)
    optimized = collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath,
                                                                          load_external_data=False).graph.node)
    assert optimized["Slice"] == 0 and after["Slice"] == slices * layers

    ids = torch.randint(4, 500, (3, 11), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected, got = packed(ids, attention_mask=mask).logits, unpacked(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)
    with torch.no_grad():  # and transformers on the same weights
        reference = load_pair(fixture)[1](ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], reference[mask.bool()], rtol=1e-4, atol=1e-4)


def test_a_cuda_export_unpacked(build):
    """The builder's CUDA export (fp16, the query/key norms inside GroupQueryAttention, which only its
    CUDA kernel applies) unpacked as on CUDA: run here in the prefill graph (extend.py: the norms as
    nodes), its logits equal the packed graph's and transformers' on the same weights."""
    fixture = build("qwen3", precision="fp16", execution_provider="cuda")
    spec = read_package(fixture.package_dir).decoder
    proto = onnx.load(str(spec.path), load_external_data=False)
    assert op_counts(proto.SerializeToString())["Split"] == len(spec.layers)
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(6))
    logits = {}
    for unpack in (False, True):
        rewritten = graph.rewrite_keep_positions(proto, spec.logits, unpack_qkv=unpack)
        data = extend.prefill_graph(rewritten, spec.layers[0].head_size).SerializeToString()
        assert op_counts(data)["Split"] == (0 if unpack else len(spec.layers))
        session = runtime.make_session(data, torch.device("cpu"), fixture.package_dir)
        binding = session.io_binding()
        runtime.bind_input(binding, spec.input_ids, ids)
        runtime.bind_input(binding, extend.POSITIONS, torch.arange(9).expand(2, -1).contiguous())
        runtime.bind_input(binding, graph.LOGITS_INDICES, torch.arange(18))
        logits[unpack] = torch.empty(18, 512, dtype=torch.float16)
        runtime.bind_output(binding, spec.logits, logits[unpack])
        session.run(binding)
    with torch.no_grad():
        reference = load_pair(build("qwen3"))[1](ids).logits.reshape(18, -1)  # the same weights, fp32
    assert (logits[True].float() - logits[False].float()).abs().max().item() < 1e-2
    assert (logits[True].float() - reference).abs().max().item() < 2e-2


def test_the_prefill_graph_unpacks_a_packed_input(build, monkeypatch, tmp_path):
    """The prefill graph (extend.py) splits GroupQueryAttention's packed input with a Split node;
    where ortmodule unpacks projections (on CUDA, forced here) that Split becomes three MatMuls: no
    Split left, and the logits of runs without a cache equal the packed prefill graph's and
    transformers' on the same weights."""
    fixture = build("llama")
    packed = OrtModelForCausalLM.from_pretrained(fixture.package_dir, cache_dir=tmp_path, prefill_attention="onnx")
    monkeypatch.setattr(projections, "UNPACK_ON", ("cpu",))  # as on CUDA
    unpacked = OrtModelForCausalLM.from_pretrained(fixture.package_dir, cache_dir=tmp_path, prefill_attention="onnx")
    decoder, layers = unpacked.decoder, len(unpacked.decoder.spec.layers)
    assert packed.decoder.causal is not None and decoder.causal is not None
    made = {unpack: op_counts(extend.extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem,
                                                        decoder.spec.layers[0].head_size, False, tmp_path,
                                                        layout="prefill", unpack_qkv=unpack))
            for unpack in (False, True)}
    assert made[False]["Split"] == layers and made[True]["Split"] == 0
    assert made[True]["MatMul"] == made[False]["MatMul"] + 2 * layers

    ids = torch.randint(4, 500, (3, 13), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    with torch.no_grad():
        expected, got = packed(ids, attention_mask=mask).logits, unpacked(ids, attention_mask=mask).logits
        reference = load_pair(fixture)[1](ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[mask.bool()], reference[mask.bool()], rtol=1e-4, atol=1e-4)


def test_the_bias_is_sliced_with_the_weight_and_other_uses_are_left_alone(tmp_path):
    """A packed projection with a bias (MatMul, Add, Split), its weight and bias in an external file
    as a package keeps them and the split sizes in a Constant node as the builder writes them, gives
    its parts' values unpacked (the rewrite reads no external data); a MatMul whose output is also
    read elsewhere stays packed."""
    gen = np.random.default_rng(0)
    weight, bias = gen.standard_normal((8, 12)).astype(np.float32), gen.standard_normal(12).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["sizes"], value=numpy_helper.from_array(np.array([6, 3, 3], np.int64))),
             helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["pb"]),
             helper.make_node("Split", ["pb", "sizes"], ["q0", "k0", "v0"], axis=-1),
             *(helper.make_node("Identity", [f"{n}0"], [n]) for n in "qkv"),
             helper.make_node("MatMul", ["x", "w"], ["shared"]),
             helper.make_node("Split", ["shared", "sizes"], ["a", "c", "d"], axis=-1),
             helper.make_node("Identity", ["shared"], ["also"])]
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "k", "v", "a", "also")]
    proto = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["b", "s", 8])], outputs, inits), opset_imports=[helper.make_opsetid("", 18)],
        ir_version=10)
    onnx.save(proto, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    model = ir.serde.deserialize_model(onnx.load(str(tmp_path / "model.onnx"), load_external_data=False))
    assert projections.unpack_projections(model.graph) == 1
    data = ir.serde.serialize_model(model).SerializeToString()
    counts = op_counts(data)
    assert counts["Split"] == 1 and counts["MatMul"] == 4 and counts["Add"] == 3 and counts["Slice"] == 6

    x = gen.standard_normal((2, 5, 8)).astype(np.float32)
    session = runtime.make_session(data, torch.device("cpu"), tmp_path)
    binding = session.io_binding()
    runtime.bind_input(binding, "x", torch.from_numpy(x))
    got = {name: torch.empty(2, 5, width) for name, width in (("q", 6), ("k", 3), ("v", 3), ("a", 6), ("also", 12))}
    for name, out in got.items():
        runtime.bind_output(binding, name, out)
    session.run(binding)
    packed = x @ weight + bias
    for name, (start, end) in zip("qkv", [(0, 6), (6, 9), (9, 12)]):
        np.testing.assert_allclose(got[name].numpy(), packed[..., start:end], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["a"].numpy(), (x @ weight)[..., :6], rtol=1e-6, atol=1e-6)
