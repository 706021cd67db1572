"""The host's time per lm-eval request: what ortmodule spends around ONNX Runtime, measured where
the model's compute is negligible (one layer, hidden size 64) and the tokenizer is a real one
(SmolLM2's, 49,152 tokens), so that it can be measured and improved on a CPU for the GPU's sake: on
a GPU this time either hides behind the device's or stalls it.

The MMLU-shaped workload (benchmarks/tasks; 5-shot prompts of 300-900 tokens, four one-token
letters). Per request: the time in the backend's `loglikelihood` (lm-eval's tokenizing included),
the part of it in ortmodule's scoring of the tokenized requests (`_totals_on_device`: batching,
padding, copies, the log-softmax and gather; `read_back`: the one copy of the answers), and the part
of that in ONNX Runtime's `run`. ortmodule's own host time is the middle
one less the last. transformers (lm-eval's `hf`) runs the same weights beside it.

ortmodule runs with `prefill_chunk=0`: one prefill per batch, the path a GPU takes. On the CPU,
rows this long would otherwise run one at a time in chunks of 256 tokens (ortmodule/chunked.py),
about three runs per row instead of one per batch of 32, which is the CPU's own trade (its
attention is faster per token that way) and would hide the GPU's host time under a loop the GPU
never runs (73 against 287 us per request on a 2-vCPU Xeon).
"""

import time
from pathlib import Path

import lm_eval
import numpy as np
import onnxruntime_genai as og
import pytest
import torch
from conftest import device_name
from evaluation import Clock
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import ortmodule.lm_eval  # registers the backend; its read_back is clocked
from ortmodule import OrtModelForCausalLM, runtime, scoring
from ortmodule_dev import fixtures

TASK = "ortmodule_bench_mmlu"
# Negligible compute, a real tokenizer and vocabulary: what is left is the host's work.
HOST_PROBE = fixtures.FixtureSpec("llama", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                  intermediate_size=128, vocab_size=49152, context_length=8192, tokenizer="smollm2")


def mean_round(benchmark, fn, rounds: int) -> tuple[float, int]:
    """`fn` timed by pytest-benchmark for `rounds` rounds: (the mean seconds of a round, rounds)."""
    taken = []

    def timed():
        start = time.perf_counter()
        fn()
        taken.append(time.perf_counter() - start)

    benchmark.pedantic(timed, rounds=rounds, iterations=1)
    return sum(taken) / len(taken), len(taken)


@pytest.fixture(scope="module")
def probe():
    return fixtures.build(HOST_PROBE)


@pytest.mark.benchmark(group="host time")
@pytest.mark.parametrize("backend", ["ortmodule", "hf"])
def test_host_time_per_request(benchmark, probe, size, backend, monkeypatch):
    options = size["host_time"]
    device = size.get("device", "cpu")
    tasks = TaskManager(include_path=str(Path(__file__).parent / "tasks"), include_defaults=False,
                        metadata={"tokenizer": str(probe.hf_dir)})
    if backend == "ortmodule":
        lm = get_model("ortmodule")(pretrained=str(probe.package_dir), device=device,
                                    batch_size=options["batch_size"], share_contexts="false",
                                    prefill_chunk=0)
    else:
        lm = get_model("hf")(pretrained=str(probe.hf_dir), dtype="float32", device=device,
                             batch_size=options["batch_size"])
    lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, limit=2, verbosity="ERROR")  # warm-up
    requests = Clock(monkeypatch, lm, "loglikelihood")
    if backend == "ortmodule":
        scoring = [Clock(monkeypatch, lm, "_totals_on_device"), Clock(monkeypatch, ortmodule.lm_eval, "read_back")]
        onnxruntime = Clock(monkeypatch, runtime.Session, "run")
    result = benchmark.pedantic(lambda: lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks,
                                                                limit=options["questions"], verbosity="ERROR"),
                                rounds=1, iterations=1)
    count = result["n-samples"][TASK]["effective"] * 4
    benchmark.extra_info.update(backend=backend, case="mmlu", device=device_name(device), requests=count,
                                model="a 1-layer, hidden-64 Llama with SmolLM2's tokenizer (negligible compute)",
                                requests_s=round(requests.seconds, 4),
                                loglikelihood_us_per_request=round(1e6 * requests.seconds / count))
    if backend == "ortmodule":
        scored = sum(clock.seconds for clock in scoring)
        benchmark.extra_info["ortmodule_us_per_request"] = round(1e6 * scored / count)
        benchmark.extra_info["onnxruntime_us_per_request"] = round(1e6 * onnxruntime.seconds / count)
        benchmark.extra_info["host_us_per_request"] = round(1e6 * (scored - onnxruntime.seconds) / count)


@pytest.mark.benchmark(group="host time")
@pytest.mark.parametrize("backend", ["ortmodule", "onnxruntime-genai"])
def test_host_time_per_decoded_token(benchmark, probe, size, backend, monkeypatch):
    new, prompt_length = size["host_time"]["decode_tokens"], 128
    device = size.get("device", "cpu")
    prompt = torch.randint(4, 32000, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    if backend == "ortmodule":
        model = OrtModelForCausalLM.from_pretrained(probe.package_dir, device=device)

        def generate():
            return model.generate(prompt, max_new_tokens=new, eos_token_id=None, pad_token_id=0, do_sample=False)
    else:
        model = og.Model(str(probe.package_dir))

        def generate():
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=prompt_length + new, min_length=prompt_length + new,
                                      do_sample=False, batch_size=1)
            generator = og.Generator(model, params)
            generator.append_tokens(prompt.numpy().astype(np.int32))
            while not generator.is_done():
                generator.generate_next_token()
            return generator.get_sequence(0)

    generate()  # warm-up
    onnxruntime = Clock(monkeypatch, runtime.Session, "run")
    seconds, rounds = mean_round(benchmark, generate, 3)
    benchmark.extra_info.update(backend=backend, case="decode", device=device_name(device),
                                model="a 1-layer, hidden-64 Llama with SmolLM2's tokenizer (negligible compute)",
                                us_per_token=round(1e6 * seconds / new))
    if backend == "ortmodule":
        runs = onnxruntime.seconds / rounds  # a round's runs: one prefill and new - 1 steps
        benchmark.extra_info["onnxruntime_us_per_token"] = round(1e6 * runs / new)
        benchmark.extra_info["host_us_per_token"] = round(1e6 * (seconds - runs) / new)


@pytest.mark.benchmark(group="host time")
@pytest.mark.parametrize("backend", ["ortmodule", "ortmodule-no-reuse"])
def test_host_time_per_scored_item(benchmark, probe, size, backend, monkeypatch):
    """The score server's call (`scoring.label_logprobs` over the requests waiting together) on
    SGLang's score shape: requests of a 120-token query and 10 items of 180 tokens, 2 labels, at the
    server's default token budget; `ortmodule` runs each query once (its items over copies of its
    KV cache, the requests' queries in one prefill), `ortmodule-no-reuse` every item's whole prompt."""
    device, count = size.get("device", "cpu"), size["host_time"]["score_requests"]
    model = OrtModelForCausalLM.from_pretrained(probe.package_dir, device=device, prefill_chunk=0)
    generator = torch.Generator().manual_seed(0)
    requests = []
    for _ in range(count):
        query = torch.randint(4, 32000, (120,), generator=generator).tolist()
        requests.append([query + torch.randint(4, 32000, (180,), generator=generator).tolist() for _ in range(10)])
    budget = scoring.default_token_budget(model.device)

    def call():
        scoring.label_logprobs(model, requests, [10, 20], budget, backend == "ortmodule").cpu()

    call()  # warm-up: the extend graph's first use and its check
    onnxruntime = Clock(monkeypatch, runtime.Session, "run")
    seconds, rounds = mean_round(benchmark, call, 5)
    items, runs = 10 * count, onnxruntime.seconds / rounds
    benchmark.extra_info.update(backend=backend, case="score", device=device_name(device), items=items,
                                model="a 1-layer, hidden-64 Llama with SmolLM2's tokenizer (negligible compute)",
                                us_per_item=round(1e6 * seconds / items),
                                onnxruntime_us_per_item=round(1e6 * runs / items),
                                host_us_per_item=round(1e6 * (seconds - runs) / items))
