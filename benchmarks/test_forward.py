"""Forward latency: every position's logits vs only the last `keep`, ortmodule beside transformers
on the same weights (a 131,072-token vocabulary at the CPU size, 262,144 at the GPU size)."""

import pytest
import torch
from conftest import device_name, measure_peak, reference_model, synced

from ortmodule import OrtModelForCausalLM, fixtures


@pytest.fixture(scope="module")
def setup(size):
    fixture = fixtures.build(size["large_vocab"])
    device = size["device"]
    ort_model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    hf_model = reference_model(fixture, device)
    ids = torch.randint(4, fixture.spec.vocab_size, (size["batch"], size["length"]), generator=torch.Generator().manual_seed(0))
    return ort_model, hf_model, ids.to(device), size["keep"]


def run_case(benchmark, fn, ids):
    fn = synced(fn, ids.device.type)
    batch = len(ids)
    out = fn()  # warm-up, and the output whose size is recorded
    benchmark.extra_info["peak_rss_mb"] = round(measure_peak(fn), 1)
    benchmark.extra_info["device"] = device_name(ids.device.type)
    benchmark.extra_info["logits_bytes_per_request"] = out.numel() * out.element_size() // batch
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=0)
    return out


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len"])
def test_ortmodule_forward(benchmark, setup, keep):
    model, _, ids, k = setup
    kwargs = {} if keep == "all" else {"cont_len": k}
    out = run_case(benchmark, lambda: model(ids, **kwargs).logits, ids)
    assert out.shape[1] == (ids.shape[1] if keep == "all" else k)


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len"])
def test_transformers_forward(benchmark, setup, keep):
    _, model, ids, k = setup
    kwargs = {} if keep == "all" else {"logits_to_keep": k}

    def forward():
        with torch.inference_mode():
            return model(ids, **kwargs).logits

    run_case(benchmark, forward, ids)
