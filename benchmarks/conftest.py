"""Benchmark shapes and helpers. `--bench-size cpu` (default) is the CPU set; `smoke` runs tiny
shapes once so CI keeps the suite working (`pytest benchmarks --benchmark-disable --bench-size smoke`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from ortmodule import fixtures

# Qwen3-0.6B's and a Gemma-style 262K-vocabulary config with random weights: throughput does not
# depend on weight values. Exported by the builder for CUDA in bf16.
QWEN3_0_6B = fixtures.FixtureSpec("qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                                  intermediate_size=3072, vocab_size=151936, context_length=4096, precision="bf16",
                                  initializer_range=0.02, execution_provider="cuda")
GEMMA_262K = fixtures.FixtureSpec("gemma3", hidden_size=1152, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=256,
                                  intermediate_size=6912, vocab_size=262144, context_length=4096, precision="bf16",
                                  initializer_range=0.02, execution_provider="cuda")

SIZES = {
    "cpu": dict(
        device="cpu",
        # A 131,072-token vocabulary: the LM head is most of the model's work.
        large_vocab=fixtures.FixtureSpec("llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=512, vocab_size=131072, context_length=1024),
        batch=4, length=512, keep=4,
        # The 51.7M-parameter Llama of the lm-eval workloads: hidden 512, 6 layers, 32,000 tokens.
        decoder=fixtures.FixtureSpec("llama", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                                     intermediate_size=1376, vocab_size=32000, context_length=1024),
        generate=dict(batch=4, prompt_lengths=(32, 128), new_tokens=64),
        lm_eval=dict(limit=100, batch_size=8),  # 100 questions: 400 loglikelihood requests
        # score(): requests of one query and many short items; the server's load at a steady rate.
        score=dict(requests=4, query_tokens=120, items=16, item_tokens=20, labels=4),
        server=dict(rate=4.0, duration=20.0, items=10),
    ),
    "gpu": dict(
        device="cuda",
        large_vocab=GEMMA_262K, batch=8, length=1024, keep=4,
        decoder=QWEN3_0_6B,
        generate=dict(batch=16, prompt_lengths=(128, 512), new_tokens=128),
        lm_eval=dict(limit=None, batch_size=32),
        score=dict(requests=8, query_tokens=512, items=64, item_tokens=32, labels=4),
        server=dict(rate=20.0, duration=30.0, items=32),
    ),
    "smoke": dict(
        device="cpu",
        large_vocab=fixtures.FixtureSpec("llama", vocab_size=4096, context_length=256),
        batch=2, length=32, keep=4,
        decoder=fixtures.FixtureSpec("llama", vocab_size=4096, context_length=256),
        generate=dict(batch=2, prompt_lengths=(4, 9), new_tokens=4),
        lm_eval=dict(limit=3, batch_size=8),
        score=dict(requests=2, query_tokens=12, items=3, item_tokens=4, labels=2),
        server=dict(rate=4.0, duration=1.0, items=2),
    ),
}


def pytest_addoption(parser):
    parser.addoption("--bench-size", default="cpu", choices=sorted(SIZES), help="which set of shapes to run")


@pytest.fixture(scope="session")
def size(request):
    return SIZES[request.config.getoption("--bench-size")]


def reset_peak_rss() -> None:
    """Linux: restart the process's peak resident set size count (VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_peak(fn) -> float:
    """Peak resident memory (MB) while `fn` runs once."""
    reset_peak_rss()
    fn()
    return peak_rss_mb()


def reference_model(fixture, device: str):
    """transformers on the fixture's weights, in the package's precision, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[fixture.spec.precision]
    return AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=dtype).to(device).eval()


def synced(fn, device: str):
    """`fn` followed by a device sync, so that the clock sees the work a CUDA call queued."""
    if device == "cpu":
        return fn
    import torch

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


def device_name(device: str) -> str:
    import torch

    return "cpu" if device == "cpu" else torch.cuda.get_device_name(device)


def record_rate(benchmark, fn, units: int, unit: str, device: str, rounds: int):
    """Time `fn` (one warm-up call, then `rounds`), recording `{unit}_per_s` and the peak memory;
    return the warm-up's output for the caller to check."""
    fn = synced(fn, device)
    out = fn()
    reset_peak_rss()
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info["peak_rss_mb"] = round(peak_rss_mb(), 1)
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info[f"{unit}_per_s"] = round(units / benchmark.stats.stats.median, 1)
    return out
