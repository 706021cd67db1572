"""lm-eval at the scale users run: MMLU-, HellaSwag-, wikitext- and GSM8K-shaped workloads
(benchmarks/tasks/loaders.py: English prose from the documentation that ships with Python, cut to
exact token counts in the model's tokenizer), thousands of requests at the GPU size; ortmodule beside
lm-eval's `hf` backend on the same weights, every row's answers against transformers in fp32.
(Kept apart from test_lm_eval.py, so that `-k lm_eval` selects the small workload alone.)"""

import lm_eval
import pytest
import torch
import transformers
from conftest import at_scale_batch, device_name, model_label, peak_rss_mb, reset_peak_rss
from evaluation import TASK_DIR, BatchTimes, Clock, ShapeLog, answers, at_scale_skip, load, record_agreement
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from references import reference_answers

import ortmodule.lm_eval
from ortmodule import scoring
from ortmodule.lm_eval import OrtModuleLM
from ortmodule_dev import fixtures


@pytest.fixture(scope="module")
def fixture(size, decoder_key):
    return fixtures.build(size["decoders"][decoder_key])


WORKLOADS = {"mmlu": "ortmodule_bench_mmlu", "fewshot": "ortmodule_bench_fewshot",
             "hellaswag": "ortmodule_bench_hellaswag", "arc": "ortmodule_bench_arc",
             "rolling": "ortmodule_bench_rolling", "gsm8k": "ortmodule_bench_gsm8k"}
# transformers first: on an fp32 or int4 package its fp32 answers are every other row's yardstick.
SCALE_BACKENDS = ["hf", "transformers-bf16", "ortmodule", "ortmodule-share-off", "ortmodule-share-on",
                  "ortmodule-chunks-off", "ortmodule-tokenize-first", "ortmodule-bf16-head", "ortmodule-no-cuda-graph",
                  "ortmodule-pad64", "ortmodule-prefill-onnx", "ortmodule-compiled-normalizers", "ortmodule-lanes-off",
                  "ortmodule-lm-eval-stops"]
SCALE_ANSWERS = {}  # (model, workload, backend) -> per-request answers
FP32_REFERENCES = {}  # (model, workload) -> (answers of transformers in fp32, when and where they were computed)
SCALE_TOKENS = {}  # (model, workload) -> context + continuation tokens of all its requests


@pytest.fixture(scope="module")
def model_tasks(fixture):
    """The task folder, with the model's tokenizer handed to the loaders (lm-eval's task metadata)."""
    return TaskManager(include_path=TASK_DIR, include_defaults=False, metadata={"tokenizer": str(fixture.hf_dir)})


@pytest.mark.benchmark(group="lm-eval at scale")
@pytest.mark.parametrize("backend", SCALE_BACKENDS)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_at_scale(benchmark, fixture, decoder_key, model_tasks, size, workload, backend, monkeypatch):
    options = size["lm_eval_at_scale"]
    task, limit, device = WORKLOADS[workload], options["limits"][workload], size.get("device", "cpu")
    reason = at_scale_skip(workload, backend, device, fixture.spec.precision)
    if reason:
        pytest.skip(reason)
    if backend == "ortmodule-compiled-normalizers":  # compiled in the warm-up's calls, off the clock
        monkeypatch.setitem(scoring.COMPILED_NORMALIZERS, torch.device(device).type, True)
    if backend == "ortmodule-lanes-off":  # priced so too (evaluation.load turns the packing off)
        monkeypatch.setattr(ortmodule.lm_eval, "packs", lambda model: False)
    if backend == "ortmodule-lm-eval-stops":  # every row of a batch run until one sequence is in all of them
        monkeypatch.setattr(OrtModuleLM, "_model_generate", HFLM._model_generate)
    batch = at_scale_batch(options, workload)
    lm = load(backend, fixture, batch, device)
    if device != "cpu":  # CUDA's first calls (kernel selection, cuBLAS handles) stay off the clock
        lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=model_tasks, limit=2, verbosity="ERROR")
    benchmark.extra_info.update(backend=backend, case=workload, model=model_label(decoder_key), batch_size=batch,
                                device=device_name(device), parameters=fixture.parameters())
    reset_peak_rss()
    method = {"rolling": "loglikelihood_rolling", "gsm8k": "generate_until"}.get(workload, "loglikelihood")
    clock = Clock(monkeypatch, lm, method)
    parts, logs = {}, []
    if isinstance(lm, OrtModuleLM) and workload != "gsm8k":  # where the time goes: batches, read-back, tokenizing
        logs = [ShapeLog(monkeypatch), BatchTimes(monkeypatch, device)]
        parts = {"batches_s": Clock(monkeypatch, lm, "_totals_on_device"),
                 "read_back_s": Clock(monkeypatch, ortmodule.lm_eval, "read_back"),
                 "encode_s": Clock(monkeypatch, lm, "_encode_batched" if workload == "rolling" else "_encode_pairs")}
    result = benchmark.pedantic(lambda: lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=model_tasks,
                                                                limit=limit, verbosity="ERROR"),
                                rounds=1, iterations=1, warmup_rounds=0)
    mine = answers(result, task)
    if (decoder_key, workload) not in SCALE_TOKENS:  # the same requests for every backend: counted once
        SCALE_TOKENS[decoder_key, workload] = sum(
            len(lm.tok_encode(context + continuation)) for sample in result["samples"][task]
            for context, continuation in request_texts(sample, workload))
    tokens = SCALE_TOKENS[decoder_key, workload]
    benchmark.extra_info.update(requests=len(mine), tokens=tokens, tokens_per_request=round(tokens / len(mine)),
                                requests_s=round(clock.seconds, 4), peak_rss_mb=round(peak_rss_mb(), 1),
                                requests_per_s=round(len(mine) / clock.seconds, 1),
                                tokens_per_s=round(tokens / clock.seconds), flops=2 * fixture.parameters() * tokens)
    benchmark.extra_info.update({name: round(part.seconds, 3) for name, part in parts.items()})
    for log in logs:
        benchmark.extra_info.update(log.summary())
    metric = {"rolling": "word_perplexity", "gsm8k": "exact_match"}.get(workload, "acc")
    benchmark.extra_info[metric] = float(f"{result['results'][task][metric + ',none']:.5g}")
    SCALE_ANSWERS[decoder_key, workload, backend] = mine
    choices = 0 if workload in ("rolling", "gsm8k") else 4
    if backend != "ortmodule":
        record_agreement(benchmark, "ortmodule", mine, SCALE_ANSWERS.get((decoder_key, workload, "ortmodule")),
                         choices)
    if fixture.spec.precision in ("bf16", "fp16"):
        if (decoder_key, workload) not in FP32_REFERENCES:
            FP32_REFERENCES[decoder_key, workload] = fp32_reference(fixture, f"{decoder_key}-{workload}", task,
                                                                    model_tasks, limit, result, device,
                                                                    at_scale_batch(options, workload, reference=True))
        found, made = FP32_REFERENCES[decoder_key, workload]
        benchmark.extra_info["fp32_reference"] = made
        record_agreement(benchmark, "fp32", mine, found, choices)
    elif backend != "hf":  # transformers ran fp32 on these weights (fp32 beside an int4 package)
        record_agreement(benchmark, "fp32", mine, SCALE_ANSWERS.get((decoder_key, workload, "hf")), choices)


def request_texts(sample: dict, workload: str) -> list[tuple[str, str]]:
    """A sample's (context, continuation) texts: a loglikelihood request's own, a rolling document
    whole, a generation's prompt and the answer it got (`tokens` counts both)."""
    if workload == "gsm8k":
        return [(sample["arguments"][0][0], sample["resps"][0][0])]
    return [a if len(a) == 2 else ("", a[0]) for a in sample["arguments"]]


def fp32_reference(fixture, name, task, model_tasks, limit, result, device, batch_size) -> tuple[list, str]:
    """Transformers in fp32 on the fixture's weights, answering the requests of `result`: the run's
    slowest part on a GPU, so kept between runs (benchmarks/references.py) and reused where the
    weights and the requests are the same."""
    def run():
        reference = get_model("hf")(pretrained=str(fixture.hf_dir), dtype="float32", device=device,
                                    batch_size=batch_size)
        found = answers(lm_eval.simple_evaluate(model=reference, tasks=[task], task_manager=model_tasks, limit=limit,
                                                verbosity="ERROR"), task)
        return found, {"device": device_name(device), "batch_size": batch_size,
                       "transformers": transformers.__version__, "torch": torch.__version__}

    return reference_answers(name, fixture.hf_dir, result, task, run)
