"""Decoding speed: tokens/s for a batch of prompts of different lengths (batch 1 and batch 8 at the
CPU size), and for the largest batch of prompts that begin alike (`fewshot`: a common beginning of
`fewshot_beginning` tokens, as a few-shot task's examples, then the same lengths as the others),
ortmodule's generate() beside transformers' generate on the same weights and onnxruntime-genai's
Generator on the same package. Every backend makes exactly `new_tokens` tokens per row (no early
end of sequence)."""

import numpy as np
import onnxruntime_genai as og
import pytest
import torch
from conftest import SIZES, model_label, record_rate, reference_model, weight_bytes

from ortmodule import OrtModelForCausalLM, shared_prompts
from ortmodule_dev import fixtures


def pytest_generate_tests(metafunc):
    if "batch" in metafunc.fixturenames:
        size = SIZES[metafunc.config.getoption("--bench-size")]
        metafunc.parametrize("batch", [*size["generate"]["batches"], "fewshot"],
                             ids=lambda b: f"b{b}" if isinstance(b, int) else b, scope="module")


@pytest.fixture(scope="module")
def fixture(size, decoder_key):
    return fixtures.build(size["decoders"][decoder_key])


@pytest.fixture(scope="module")
def workload(size, fixture, decoder_key, batch):
    shape = size["generate"]
    (shortest, longest), new = shape["prompt_lengths"], shape["new_tokens"]
    fewshot = batch == "fewshot"
    rows = max(shape["batches"]) if fewshot else batch
    lengths = torch.linspace(shortest, longest, rows).long() if rows > 1 else torch.tensor([longest])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, min(fixture.spec.vocab_size, 32000), (rows, longest), generator=generator)
    mask = (torch.arange(longest)[None, :] >= longest - lengths[:, None]).long()  # left-padded, as HF generates
    pad = fixture_pad(fixture)
    ids = ids.masked_fill(mask == 0, pad)
    if fewshot:  # every row begins with the same tokens, after its padding
        beginning = torch.randint(4, min(fixture.spec.vocab_size, 32000), (shape["fewshot_beginning"],),
                                  generator=generator)
        ids = torch.cat([torch.full((rows, len(beginning)), pad), ids], 1)
        mask = torch.cat([torch.zeros(rows, len(beginning), dtype=mask.dtype), mask], 1)
        for row, length in enumerate(lengths.tolist()):
            ids[row, -length - len(beginning) : -length] = beginning
            mask[row, -length - len(beginning) : -length] = 1
    device = size["device"]
    case = f"batch {rows}" + (", few-shot prompts" if fewshot else "")
    return fixture, ids.to(device), mask.to(device), new, pad, decoder_key, case


def fixture_pad(fixture) -> int:
    from ortmodule import read_package

    pad = read_package(fixture.package_dir).pad_token_id
    return 2 if pad is None else pad


def record(benchmark, fn, workload):
    fixture, ids, _, new, _, key, case = workload
    info = benchmark.extra_info
    info["model"] = model_label(key)
    info["case"] = case
    # One decode step streams every weight once: bytes per step x steps/s, against memory bandwidth.
    info["weight_bytes"] = weight_bytes(fixture)
    info["decode_steps"] = new
    return record_rate(benchmark, fn, len(ids) * new, "tokens", ids.device.type, rounds=3)


@pytest.mark.benchmark(group="generate")
def test_ortmodule_generate(benchmark, workload):
    fixture, ids, mask, new, pad, *_ = workload
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=ids.device)
    out = record(benchmark, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None,
                                                   pad_token_id=pad), workload)
    assert out.shape == (ids.shape[0], ids.shape[1] + new)


def forced_way(benchmark, workload, monkeypatch, backend: str, **constants) -> None:
    """The few-shot prompts generated with shared_prompts' `constants` set (a way forced), as `backend`."""
    fixture, ids, mask, new, pad, _, case = workload
    if not case.endswith("few-shot prompts") or ids.device.type != "cpu":
        pytest.skip("the few-shot prompts on a CPU only (elsewhere each row runs its whole prompt anyway)")
    for name, value in constants.items():
        monkeypatch.setattr(shared_prompts, name, value)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=ids.device)
    benchmark.extra_info["backend"] = backend
    out = record(benchmark, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None,
                                                   pad_token_id=pad), workload)
    assert out.shape == (ids.shape[0], ids.shape[1] + new)


@pytest.mark.benchmark(group="generate")
def test_ortmodule_generate_whole_prompts(benchmark, workload, monkeypatch):
    """The few-shot prompts with the common beginning run in every row (as on CUDA, or before
    shared_prompts.py): what running it once gives, side by side."""
    forced_way(benchmark, workload, monkeypatch, "ortmodule-whole-prompts", RUN_TOKENS=10**9, EXTEND_TOKENS=10**9)


@pytest.mark.benchmark(group="generate")
def test_ortmodule_generate_rests_apart(benchmark, workload, monkeypatch):
    """The few-shot prompts' common beginning run once, then each row's rest in a run of its own (as
    before 2026-12-01) instead of all rests in one extend run: what the one run gives, side by side."""
    forced_way(benchmark, workload, monkeypatch, "ortmodule-rests-apart", EXTEND_TOKENS=10**9)


@pytest.mark.benchmark(group="generate")
def test_ortmodule_generate_no_cuda_graph(benchmark, workload):
    """The same without ONNX Runtime capturing each decode step as a CUDA graph (`enable_cuda_graph`, on by
    default for a half-precision package on CUDA since 2026-12-04, so the `ortmodule` rows have them)."""
    fixture, ids, mask, new, pad, *_ = workload
    if ids.device.type != "cuda":
        pytest.skip("CUDA graphs need the CUDA provider")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=ids.device,
                                                provider_options={"enable_cuda_graph": "0"})
    benchmark.extra_info["backend"] = "ortmodule-no-cuda-graph"
    out = record(benchmark, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None,
                                                   pad_token_id=pad), workload)
    assert out.shape == (ids.shape[0], ids.shape[1] + new)


def transformers_generate(benchmark, workload, precision: str | None = None):
    """transformers' greedy generate on the fixture's weights, in the package's precision or `precision`."""
    fixture, ids, mask, new, pad, *_ = workload
    model = reference_model(fixture, ids.device, precision)

    def generate():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=pad,
                                  do_sample=False)

    out = record(benchmark, generate, workload)
    assert out.shape == (ids.shape[0], ids.shape[1] + new)


@pytest.mark.benchmark(group="generate")
def test_transformers_generate(benchmark, workload):
    transformers_generate(benchmark, workload)


@pytest.mark.benchmark(group="generate")
def test_transformers_bf16_generate(benchmark, workload):
    """transformers in bf16 beside an fp32 package on a CPU: what a checkpoint saved in bf16 runs in
    by default, and on a CPU with AMX bf16 matmuls run several times fp32's (docs/lm-eval.md)."""
    fixture, ids, *_ = workload
    if ids.device.type != "cpu" or fixture.spec.precision != "fp32":
        pytest.skip("transformers in bf16 beside an fp32 package on a CPU")
    benchmark.extra_info["backend"] = "transformers-bf16"
    transformers_generate(benchmark, workload, "bf16")


@pytest.mark.benchmark(group="generate")
def test_genai_generate(benchmark, workload):
    """onnxruntime-genai's Generator, batched: prompts padded with the pad id, as it expects."""
    fixture, ids, _, new, *_ = workload
    model = og.Model(str(fixture.package_dir))
    prompts = ids.cpu().numpy().astype(np.int32)
    total = ids.shape[1] + new

    def generate():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(prompts)
        while not generator.is_done():
            generator.generate_next_token()
        return np.stack([generator.get_sequence(i) for i in range(len(prompts))])

    out = record(benchmark, generate, workload)
    assert out.shape == (ids.shape[0], total)
