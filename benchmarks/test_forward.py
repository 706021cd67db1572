"""Forward latency: every position's logits vs only the last `keep`, ortmodule beside transformers
on the same weights (a 65,536-token vocabulary at the CPU size)."""

import pytest
import torch
from conftest import measure_peak
from transformers import AutoModelForCausalLM

from ortmodule import OrtModelForCausalLM, fixtures


@pytest.fixture(scope="module")
def setup(size):
    fixture = fixtures.build(size["large_vocab"])
    ort_model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, fixture.spec.vocab_size, (size["batch"], size["length"]), generator=torch.Generator().manual_seed(0))
    return ort_model, hf_model, ids, size["keep"]


def run_case(benchmark, fn, batch):
    out = fn()  # warm-up, and the output whose size is recorded
    benchmark.extra_info["peak_rss_mb"] = round(measure_peak(fn), 1)
    benchmark.extra_info["logits_bytes_per_request"] = out.numel() * out.element_size() // batch
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=0)
    return out


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len"])
def test_ortmodule_forward(benchmark, setup, keep):
    model, _, ids, k = setup
    kwargs = {} if keep == "all" else {"cont_len": k}
    out = run_case(benchmark, lambda: model(ids, **kwargs).logits, len(ids))
    assert out.shape[1] == (ids.shape[1] if keep == "all" else k)


@pytest.mark.benchmark(group="forward")
@pytest.mark.parametrize("keep", ["all", "cont_len"])
def test_transformers_forward(benchmark, setup, keep):
    _, model, ids, k = setup
    kwargs = {} if keep == "all" else {"logits_to_keep": k}

    def forward():
        with torch.inference_mode():
            return model(ids, **kwargs).logits

    run_case(benchmark, forward, len(ids))
