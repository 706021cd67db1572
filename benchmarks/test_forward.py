"""Forward latency (prefill): every position's logits vs only the last `keep`, ortmodule beside
transformers on the same weights. CPU size: the real SmolLM2-135M-Instruct at batch 8 x 128, and
random-weight packages with the exact configs of Qwen3-0.6B (151,936-token vocabulary) and
Gemma-3-270M (262,144) at batch 2 x 128; `backbone`: the last hidden state without the LM head
(`model.model(ids).last_hidden_state`, ortmodule/backbone.py). `ortmodule-prefill-onnx`: the same package loaded with
`prefill_attention="onnx"` (the prefill graph: ONNX's `Attention` instead of GroupQueryAttention,
no KV written; ortmodule/extend.py), whose logits are checked against the package graph's at load.
`ortmodule-packed-qkv` (CUDA): the package's packed query/key/value projection as it is, where
ortmodule's CUDA default runs it as three MatMuls (ortmodule/projections.py: projections that a
`Split` node splits, as in Qwen3's export; GroupQueryAttention's packed input stays packed)."""

import onnx
import pytest
import torch
from conftest import device_name, flop_count, measure_peak, model_label, reference_model, synced

from ortmodule import OrtModelForCausalLM, projections
from ortmodule_dev import fixtures


@pytest.fixture(scope="module")
def setup(size, forward_key):
    spec, batch, length = size["forward"][forward_key]
    fixture = fixtures.build(spec)
    device = size["device"]
    ort_model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    hf_model = reference_model(fixture, device)
    ids = torch.randint(4, min(fixture.spec.vocab_size, 32000), (batch, length),
                        generator=torch.Generator().manual_seed(0))
    return fixture, ort_model, hf_model, ids.to(device), size["keep"], forward_key


@pytest.fixture(scope="module")
def prefill_model(setup, size):
    """The package loaded with the prefill graph (None where the graph cannot be made for it)."""
    model = OrtModelForCausalLM.from_pretrained(setup[0].package_dir, device=size["device"],
                                                prefill_attention="onnx")
    return model if model.decoder.causal is not None else None


@pytest.fixture(scope="module")
def packed_model(setup, size):
    """The package loaded with its packed projections kept (None where ortmodule keeps them anyway:
    off CUDA, and packages whose only packing is GroupQueryAttention's packed input)."""
    if torch.device(size["device"]).type not in projections.UNPACK_ON:
        return None
    unpack_on, projections.UNPACK_ON = projections.UNPACK_ON, ()
    try:
        model = OrtModelForCausalLM.from_pretrained(setup[0].package_dir, device=size["device"])
    finally:
        projections.UNPACK_ON = unpack_on
    return model if matmuls(model.decoder.graph_bytes) != matmuls(setup[1].decoder.graph_bytes) else None


def matmuls(data: bytes) -> int:
    return sum(node.op_type == "MatMul" for node in onnx.load_from_string(data).graph.node)


def run_case(benchmark, fn, setup, keep):
    fixture, _, _, ids, k, key = setup
    fn = synced(fn, ids.device.type)
    batch, length = ids.shape
    out = fn()  # warm-up, and the output whose size is recorded
    info = benchmark.extra_info
    info["model"] = model_label(key)
    info["case"] = keep
    info["shape"] = f"{batch}x{length}"
    info["peak_rss_mb"] = round(measure_peak(fn), 1)
    info["device"] = device_name(ids.device.type)
    info["logits_bytes_per_request"] = out.numel() * out.element_size() // batch  # the backbone's: its hidden states
    head_rows = {"all": length, "backbone": 0}.get(keep, k)
    info["flops"] = flop_count(fixture, batch * length, batch * head_rows)
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=0)
    return out


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len", "backbone"])
def test_ortmodule_forward(benchmark, setup, keep):
    _, model, _, ids, k, _ = setup
    if keep == "backbone":  # the last hidden state, no LM head (ortmodule/backbone.py)
        out = run_case(benchmark, lambda: model.model(ids).last_hidden_state, setup, keep)
        assert out.shape == (*ids.shape, model.config.hidden_size)
        return
    kwargs = {} if keep == "all" else {"cont_len": k}
    out = run_case(benchmark, lambda: model(ids, **kwargs).logits, setup, keep)
    assert out.shape[1] == (ids.shape[1] if keep == "all" else k)


# The package loaded another way: (its fixture, the name of its logit difference from the `ortmodule`
# row's model, why a device or package has none).
VARIANTS = {
    "ortmodule-prefill-onnx": ("prefill_model", "max_diff_vs_package_graph",
                               "no prefill graph for this package (ortmodule logs why)"),
    "ortmodule-packed-qkv": ("packed_model", "max_diff_vs_ortmodule", "ortmodule keeps packed projections here"),
}


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len"])
@pytest.mark.parametrize("backend", VARIANTS)
def test_ortmodule_variant_forward(benchmark, setup, request, backend, keep):
    """A row of the package loaded another way, with its largest logit difference from the
    `ortmodule` row's model on the benchmark's own ids (the load's checks ran on a few tokens)."""
    fixture_name, diff_name, none = VARIANTS[backend]
    variant = request.getfixturevalue(fixture_name)
    if variant is None:
        pytest.skip(none)
    _, model, _, ids, k, _ = setup
    kwargs = {} if keep == "all" else {"cont_len": k}
    benchmark.extra_info["backend"] = backend
    expected = model(ids, **kwargs).logits
    out = run_case(benchmark, lambda: variant(ids, **kwargs).logits, setup, keep)
    assert out.shape == expected.shape
    benchmark.extra_info[diff_name] = round((out.float() - expected.float()).abs().max().item(), 4)


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len", "backbone"])
def test_transformers_forward(benchmark, setup, keep):
    _, _, model, ids, k, _ = setup
    kwargs = {} if keep == "all" else {"logits_to_keep": k}

    def forward():
        with torch.inference_mode():
            if keep == "backbone":
                return model.model(ids).last_hidden_state
            return model(ids, **kwargs).logits

    run_case(benchmark, forward, setup, keep)
