"""Benchmark shapes and helpers. `--bench-size cpu` (default) is the CPU set; `smoke` runs tiny
shapes once so CI keeps the suite working (`pytest benchmarks --benchmark-disable --bench-size smoke`)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from ortmodule import fixtures

SIZES = {
    # A 65,536-token vocabulary: the LM head is most of the model's work.
    "cpu": dict(
        large_vocab=fixtures.FixtureSpec("llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=512, vocab_size=65536, context_length=1024),
        batch=8, length=512, keep=4,
        # The 51.7M-parameter Llama of the lm-eval workloads: hidden 512, 6 layers, 32,000 tokens.
        decoder=fixtures.FixtureSpec("llama", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                                     intermediate_size=1376, vocab_size=32000, context_length=1024),
        generate=dict(batch=4, prompt_lengths=(32, 128), new_tokens=64),
        lm_eval=dict(limit=None, batch_size=8),  # all 200 questions: 800 loglikelihood requests
        # score(): requests of one query and many short items; the server's load at a steady rate.
        score=dict(requests=4, query_tokens=120, items=16, item_tokens=20, labels=4),
        server=dict(rate=4.0, duration=20.0, items=10),
    ),
    "smoke": dict(
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
