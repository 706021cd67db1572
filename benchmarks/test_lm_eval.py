"""Loglikelihood scoring through lm-eval: requests/s of the `ortmodule` backend beside every other
way to score the same weights: lm-eval 0.4.13's `hf` backend (PyTorch), its `onnxruntime-genai`
and `onnxruntime` backends, onnxruntime-genai's Generator stepped one continuation token at a time
(`genai-stepped`) and a raw InferenceSession returning full logits to numpy (`ort-numpy`), both in
benchmarks/peers.py. One multiple-choice task (benchmarks/tasks: ~200-token contexts, half the
questions with ~13-token choices, half with single-token ones). Models are loaded before the
clock starts; one round each. A peer that fails is recorded as an expected failure with its error.
"""


import lm_eval
import peers  # noqa: F401  (registers the genai-stepped and ort-numpy backends)
import pytest
import torch
from conftest import SLOW_PEERS_ON, device_name, model_label, peak_rss_mb, reset_peak_rss
from evaluation import SHARING, TASK_DIR, Clock, answers, load, record_agreement
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import ortmodule.lm_eval  # noqa: F401  (registers the backend)
from ortmodule_dev import fixtures

TASK = "ortmodule_bench_mc"
BACKENDS = ["ortmodule", "ortmodule-share-off", "ortmodule-share-on", "hf", "transformers-bf16", "onnxruntime-genai",
            "onnxruntime", "genai-stepped", "ort-numpy"]


@pytest.fixture(scope="module")
def fixture(size, decoder_key):
    return fixtures.build(size["decoders"][decoder_key])


@pytest.fixture(scope="module")
def task_manager():
    """Built once, outside the clock, for every backend alike (the suite's own tasks: lm-eval's built-in ones are
    not indexed)."""
    return TaskManager(include_path=TASK_DIR, include_defaults=False)


class HostBytes:
    """Bytes of model output handed to the host while scoring: ortmodule's one copy per batch
    (`Tensor.cpu` in scoring.loglikelihood), the numpy logits of the ONNX peers."""

    def __init__(self, backend, lm, monkeypatch):
        self.count = None
        if backend in SHARING:
            self.count = 0
            original = torch.Tensor.cpu

            def cpu(tensor, *args, **kwargs):
                self.count += tensor.numel() * tensor.element_size()
                return original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, "cpu", cpu)
        elif backend in ("genai-stepped", "ort-numpy"):
            self.peer = type(lm)
            self.peer.host_bytes = 0
        elif backend in ("onnxruntime-genai", "onnxruntime"):
            self.count = 0
            forward = lm._forward_logits

            def counted(tokens):
                logits = forward(tokens)
                self.count += logits.nbytes
                return logits

            monkeypatch.setattr(lm, "_forward_logits", counted)

    def total(self):
        return self.peer.host_bytes if hasattr(self, "peer") else self.count


@pytest.mark.benchmark(group="lm-eval loglikelihood")
@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_eval_requests(benchmark, fixture, decoder_key, task_manager, size, backend, monkeypatch):
    if backend in ("onnxruntime", "genai-stepped", "ort-numpy") and decoder_key not in SLOW_PEERS_ON:
        pytest.skip(f"batch-1 peer {backend} measured on the fp32 package only")
    options = size["lm_eval"]
    device = size.get("device", "cpu")
    if backend == "transformers-bf16" and (device != "cpu" or fixture.spec.precision != "fp32"):
        pytest.skip("transformers in bf16 beside an fp32 package on a CPU (lm-eval's dtype auto on SmolLM2's bf16 "
                    "checkpoint)")
    lm = load(backend, fixture, options["batch_size"], device)
    host = HostBytes(backend, lm, monkeypatch)

    def evaluate():
        try:
            return lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager,
                                           limit=options["limit"], verbosity="ERROR")
        except Exception as error:  # noqa: BLE001  lm-eval's onnxruntime backend cannot run builder 0.18 packages
            return error

    benchmark.extra_info["backend"] = backend
    benchmark.extra_info["model"] = model_label(decoder_key)
    benchmark.extra_info["device"] = device_name(device)
    if device != "cpu":  # CUDA's first calls (kernel selection, cuBLAS handles) stay off the clock
        lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager, limit=2, verbosity="ERROR")
    reset_peak_rss()
    clock = Clock(monkeypatch, lm)
    result = benchmark.pedantic(evaluate, rounds=1, iterations=1, warmup_rounds=0)
    if isinstance(result, Exception):  # recorded with its error, so the table shows it
        benchmark.extra_info["error"] = " ".join(f"{type(result).__name__}: {result}".split())[:240]
        pytest.xfail(f"{backend} fails on this package: {benchmark.extra_info['error']}")
    requests = result["n-samples"][TASK]["effective"] * 4
    benchmark.extra_info["acc"] = round(result["results"][TASK]["acc,none"], 4)
    benchmark.extra_info["peak_rss_mb"] = round(peak_rss_mb(), 1)
    if host.total() is not None:
        benchmark.extra_info["host_bytes_per_request"] = host.total() // requests
    benchmark.extra_info["parameters"] = fixture.parameters()
    benchmark.extra_info["tokens"] = scored_tokens(lm, result, requests)
    compare_with_ortmodule(benchmark, decoder_key, backend, result)
    # The table's time: the backend's loglikelihood calls. simple_evaluate's wall time also counts
    # building the task and its report (torch's environment summary alone takes about a second),
    # the same for every backend; it is kept beside it.
    benchmark.extra_info["requests_s"] = round(clock.seconds, 4)
    benchmark.extra_info["requests_per_s"] = round(requests / clock.seconds, 1)
    if benchmark.stats:
        benchmark.extra_info["end_to_end_s"] = round(benchmark.stats.stats.median, 3)
    compare_with_fp32(benchmark, fixture, decoder_key, task_manager, options, device, result)


def scored_tokens(lm, result, requests) -> int:
    """Tokens one forward pass over every request takes (context + continuation), for the
    fraction of the device's peak compute that scoring reaches."""
    samples = result.get("samples", {}).get(TASK)
    if not samples:
        return 0
    total = 0
    for sample in samples:
        for context, continuation in sample["arguments"]:
            total += len(lm.tok_encode(context + continuation))
    return total


# Per-request (loglikelihood, is_greedy) of the ortmodule backend, per model, for the rows after it.
ORTMODULE_ANSWERS = {}


def compare_with_ortmodule(benchmark, decoder_key, backend, result) -> None:
    """The same answers as ortmodule's? The largest loglikelihood difference and the share of
    questions whose chosen answer (the argmax over the four choices) is the same."""
    mine = answers(result, TASK)
    if backend == "ortmodule":
        ORTMODULE_ANSWERS[decoder_key] = mine
        return
    record_agreement(benchmark, "ortmodule", mine, ORTMODULE_ANSWERS.get(decoder_key))


# Per-request answers of transformers in fp32 on the same weights, per model: the yardstick for
# half-precision packages, where every backend's loglikelihoods carry bf16 or fp16 rounding.
FP32_ANSWERS = {}


def compare_with_fp32(benchmark, fixture, decoder_key, task_manager, options, device, result) -> None:
    """For a bf16 or fp16 package: each backend's largest loglikelihood difference from transformers
    in fp32 (lm-eval's hf backend, outside the clock) and its share of questions with fp32's choice."""
    if fixture.spec.precision not in ("bf16", "fp16"):
        return
    if decoder_key not in FP32_ANSWERS:
        reference = get_model("hf")(pretrained=str(fixture.hf_dir), dtype="float32", device=device,
                                    batch_size=options["batch_size"])
        FP32_ANSWERS[decoder_key] = answers(lm_eval.simple_evaluate(
            model=reference, tasks=[TASK], task_manager=task_manager, limit=options["limit"], verbosity="ERROR"), TASK)
        del reference
    record_agreement(benchmark, "fp32", answers(result, TASK), FP32_ANSWERS[decoder_key])

