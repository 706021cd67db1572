"""Loglikelihood scoring through lm-eval: requests/s of the `ortmodule` backend beside every other
way to score the same weights: lm-eval 0.4.13's `hf` backend (PyTorch), its `onnxruntime-genai`
and `onnxruntime` backends, onnxruntime-genai's Generator stepped one continuation token at a time
(`genai-stepped`) and a raw InferenceSession returning full logits to numpy (`ort-numpy`), both in
benchmarks/peers.py. One multiple-choice task (benchmarks/tasks: ~200-token contexts, half the
questions with ~13-token choices, half with single-token ones). Models are loaded before the
clock starts; one round each. A peer that fails is recorded as an expected failure with its error.
"""

import time
from pathlib import Path

import lm_eval
import peers  # noqa: F401  (registers the genai-stepped and ort-numpy backends)
import pytest
import torch
from conftest import SLOW_PEERS_ON, device_name, model_label, peak_rss_mb, reset_peak_rss
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import ortmodule.lm_eval  # noqa: F401  (registers the backend)
from ortmodule_dev import fixtures

TASK = "ortmodule_bench_mc"
TASK_DIR = str(Path(__file__).parent / "tasks")
BACKENDS = ["ortmodule", "ortmodule-share-off", "ortmodule-share-on", "hf", "onnxruntime-genai", "onnxruntime",
            "genai-stepped", "ort-numpy"]
# ortmodule with its context sharing decided from the measured costs (auto), off, and always on.
SHARING = {"ortmodule": "auto", "ortmodule-share-off": "false", "ortmodule-share-on": "true"}


@pytest.fixture(scope="module")
def fixture(size, decoder_key):
    return fixtures.build(size["decoders"][decoder_key])


@pytest.fixture(scope="module")
def task_manager():
    """Built once, outside the clock: indexing lm-eval's task folders takes seconds, for every backend alike."""
    return TaskManager(include_path=TASK_DIR)


def load(backend, fixture, batch_size, device):
    if backend in SHARING:
        return get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                      share_contexts=SHARING[backend])
    if backend == "hf":
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int4": "float32"}[fixture.spec.precision]
        return get_model("hf")(pretrained=str(fixture.hf_dir), dtype=dtype, device=device, batch_size=batch_size)
    # lm-eval's ONNX backends, and the two peers built on their base, run batch 1 only.
    return get_model(backend)(pretrained=str(fixture.package_dir),
                              execution_provider="cuda" if device != "cpu" else "cpu")


class RequestTime:
    """Seconds spent in the backend's `loglikelihood` (or `loglikelihood_rolling`: tokenizing and
    scoring lm-eval's requests, answers on the host), the part of an evaluation that depends on
    the backend."""

    def __init__(self, lm, monkeypatch, method: str = "loglikelihood"):
        self.seconds = 0.0
        original = getattr(lm, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        monkeypatch.setattr(lm, method, timed)


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
    clock = RequestTime(lm, monkeypatch)
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


def answers(result, task: str = TASK) -> list[tuple[float, bool]]:
    """Per request, (loglikelihood, is_greedy); a rolling request's answer is its loglikelihood alone."""
    found = []
    for sample in result.get("samples", {}).get(task, []):
        for resp in sample["resps"]:
            answer = resp[0]
            found.append(tuple(answer) if isinstance(answer, (list, tuple)) else (answer, False))
    return found


def compare_with_ortmodule(benchmark, decoder_key, backend, result) -> None:
    """The same answers as ortmodule's? The largest loglikelihood difference and the share of
    questions whose chosen answer (the argmax over the four choices) is the same."""
    mine = answers(result)
    if backend == "ortmodule":
        ORTMODULE_ANSWERS[decoder_key] = mine
        return
    record_agreement(benchmark, "ortmodule", mine, ORTMODULE_ANSWERS.get(decoder_key))


def record_agreement(benchmark, name: str, mine, theirs, choices: int = 4) -> None:
    """`max_ll_diff_vs_<name>`: the largest loglikelihood difference between two runs' answers;
    `same_choice_as_<name>`: the share of questions whose chosen answer (the argmax over the four
    choices) is the same (none for `choices=0`: whole documents). Nothing when the runs answered
    different requests."""
    if not theirs or len(theirs) != len(mine):
        return
    benchmark.extra_info[f"max_ll_diff_vs_{name}"] = round(max(abs(a[0] - b[0]) for a, b in zip(mine, theirs)), 4)
    if not choices:
        return
    chosen = [[max(range(choices), key=lambda i, r=rows: r[i][0]) for rows in zip(*[iter(x)] * choices)]
              for x in (mine, theirs)]
    benchmark.extra_info[f"same_choice_as_{name}"] = round(sum(a == b for a, b in zip(*chosen)) / len(chosen[0]), 4)


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
            model=reference, tasks=[TASK], task_manager=task_manager, limit=options["limit"], verbosity="ERROR"))
        del reference
    record_agreement(benchmark, "fp32", answers(result), FP32_ANSWERS[decoder_key])


# ---- At scale: the shapes of MMLU, HellaSwag and wikitext, thousands of requests on a GPU ----------
# (benchmarks/tasks/loaders.py: English prose cut to exact token counts in the model's tokenizer).
WORKLOADS = {"mmlu": "ortmodule_bench_mmlu", "hellaswag": "ortmodule_bench_hellaswag",
             "rolling": "ortmodule_bench_rolling"}
# transformers first: on an fp32 or int4 package its fp32 answers are every other row's yardstick.
SCALE_BACKENDS = ["hf", "ortmodule", "ortmodule-share-off", "ortmodule-share-on"]
SCALE_ANSWERS = {}  # (model, workload, backend) -> per-request answers


@pytest.fixture(scope="module")
def model_tasks(fixture):
    """The task folder, with the model's tokenizer handed to the loaders (lm-eval's task metadata)."""
    return TaskManager(include_path=TASK_DIR, metadata={"tokenizer": str(fixture.hf_dir)})


@pytest.mark.benchmark(group="lm-eval at scale")
@pytest.mark.parametrize("backend", SCALE_BACKENDS)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_lm_eval_at_scale(benchmark, fixture, decoder_key, model_tasks, size, workload, backend, monkeypatch):
    if workload == "rolling" and backend in ("ortmodule-share-off", "ortmodule-share-on"):
        pytest.skip("documents share no context: the sharing choice does not apply")
    options = size["lm_eval_at_scale"]
    task, limit, device = WORKLOADS[workload], options["limits"][workload], size.get("device", "cpu")
    lm = load(backend, fixture, options["batch_size"], device)
    if device != "cpu":  # CUDA's first calls (kernel selection, cuBLAS handles) stay off the clock
        lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=model_tasks, limit=2, verbosity="ERROR")
    benchmark.extra_info.update(backend=backend, case=workload, model=model_label(decoder_key),
                                device=device_name(device), parameters=fixture.parameters())
    reset_peak_rss()
    clock = RequestTime(lm, monkeypatch, "loglikelihood_rolling" if workload == "rolling" else "loglikelihood")
    result = benchmark.pedantic(lambda: lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=model_tasks,
                                                                limit=limit, verbosity="ERROR"),
                                rounds=1, iterations=1, warmup_rounds=0)
    mine = answers(result, task)
    tokens = sum(len(lm.tok_encode(context + continuation)) for sample in result["samples"][task]
                 for context, continuation in (a if len(a) == 2 else ("", a[0]) for a in sample["arguments"]))
    benchmark.extra_info.update(requests=len(mine), tokens=tokens, tokens_per_request=round(tokens / len(mine)),
                                requests_s=round(clock.seconds, 4), peak_rss_mb=round(peak_rss_mb(), 1),
                                requests_per_s=round(len(mine) / clock.seconds, 1),
                                tokens_per_s=round(tokens / clock.seconds), flops=2 * fixture.parameters() * tokens)
    metric = "acc,none" if workload != "rolling" else "word_perplexity,none"
    benchmark.extra_info["acc" if workload != "rolling" else "word_perplexity"] = float(
        f"{result['results'][task][metric]:.5g}")
    SCALE_ANSWERS[decoder_key, workload, backend] = mine
    choices = 0 if workload == "rolling" else 4
    if backend != "ortmodule":
        record_agreement(benchmark, "ortmodule", mine, SCALE_ANSWERS.get((decoder_key, workload, "ortmodule")),
                         choices)
    if fixture.spec.precision in ("bf16", "fp16"):
        key = (decoder_key, workload, "fp32")
        if key not in SCALE_ANSWERS:
            reference = get_model("hf")(pretrained=str(fixture.hf_dir), dtype="float32", device=device,
                                        batch_size=options["batch_size"])
            SCALE_ANSWERS[key] = answers(lm_eval.simple_evaluate(model=reference, tasks=[task],
                                                                 task_manager=model_tasks, limit=limit,
                                                                 verbosity="ERROR"), task)
            del reference
        record_agreement(benchmark, "fp32", mine, SCALE_ANSWERS[key], choices)
    elif backend != "hf":  # transformers ran fp32 on these weights (fp32 beside an int4 package)
        record_agreement(benchmark, "fp32", mine, SCALE_ANSWERS.get((decoder_key, workload, "hf")), choices)

