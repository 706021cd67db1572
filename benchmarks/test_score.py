"""score(): items/s of SGLang-style scoring requests (one query, many short items, a few label
tokens), ortmodule beside transformers on the same weights and onnxruntime-genai's Generator on
the same package. (The `/v1/score` server under load: test_serving.py.)"""


import numpy as np
import onnxruntime_genai as og
import pytest
import torch
from bench_score import make_requests
from conftest import model_label, record_rate, reference_model, transformers_scores

import ortmodule
from ortmodule import OrtModelForCausalLM
from ortmodule_dev import fixtures


@pytest.fixture(scope="module")
def workload(size, decoder_key):
    fixture = fixtures.build(size["decoders"][decoder_key])
    shape = size["score"]
    requests = list(make_requests(shape["requests"], fixture.spec.vocab_size, shape["query_tokens"], shape["items"],
                                  shape["item_tokens"], shape["labels"], seed=0))
    return fixture, requests, size["device"], decoder_key


def record(benchmark, fn, items, workload, case=""):
    benchmark.extra_info["model"] = model_label(workload[3])
    benchmark.extra_info["case"] = case
    return record_rate(benchmark, fn, items, "items", workload[2], rounds=3)


def count(requests):
    return sum(len(r["items"]) for r in requests)


@pytest.mark.benchmark(group="score")
@pytest.mark.parametrize("reuse", ["auto", "no_reuse", "lanes_off"])
def test_ortmodule_score(benchmark, workload, reuse, monkeypatch):
    fixture, requests, device, _ = workload
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    # The costs `auto` decides by, read or timed before the clock as lm-eval's backend and `ortmodule serve` do at
    # load: a stream of score calls gets them after 16,384 tokens (scoring.UNTIMED_TOKENS), which fell inside a
    # timed round (a 27 s round of three on a CPU).
    model.measured_costs()
    option = False if reuse == "no_reuse" else None
    if reuse == "lanes_off":  # `auto` with every item in a row of its own in the extend run (sharing.choose_lanes)
        if model.decoder.extender() is None:
            pytest.skip("no extend graph: the items continue the query by decode steps")
        model.decoder.extender().packs = False
        monkeypatch.setattr(ortmodule.scoring, "packs", lambda model: False)  # and priced so

    def score():
        return [ortmodule.score(model, None, r["query"], r["items"], r["label_token_ids"], apply_softmax=True,
                                reuse_prefix=option) for r in requests]

    out = np.array(record(benchmark, score, count(requests), workload, reuse)[0])
    if fixture.spec.precision == "int4":
        # The same int4 package through onnxruntime-genai, each item's row in one prefill in the
        # package's int8 path. ortmodule's prefills run in ONNX Runtime's fp32 path where this CPU
        # runs it faster (nbits.py), and with reuse the items run over the query's cache (one
        # extend): other numbers than onnxruntime-genai's (int8 against fp32 arithmetic; with
        # `quantized_prefill="package"` a prefill's equal theirs, tests/test_real_model.py). Both are
        # held to transformers fp32 on the same weights, no further from it than onnxruntime-genai.
        expected = np.array(genai_scores(og.Model(str(fixture.package_dir)), requests[0]))
        with torch.inference_mode():
            exact = np.array(transformers_scores(reference_model(fixture, device), requests[0]))
        assert np.abs(out - exact).mean() < 1.1 * np.abs(expected - exact).mean() + 2e-3
        return
    hf = reference_model(fixture, device)
    with torch.inference_mode():
        expected = np.array(transformers_scores(hf, requests[0]))
    if fixture.spec.precision == "fp32":
        assert np.abs(out - expected).max() < 1e-4
        return
    # Half precision: two bf16 implementations differ by their rounding (up to 0.05 in a probability
    # on Qwen3-0.6B's random weights, H100), so both are held to transformers fp32 on the same
    # weights: ortmodule no further from it than transformers in the package's precision.
    del hf
    with torch.inference_mode():
        exact = np.array(transformers_scores(reference_model(fixture, device, "fp32"), requests[0]))
    assert np.abs(out - exact).mean() < 1.1 * np.abs(expected - exact).mean() + 2e-3


def genai_scores(model, request) -> list:
    """onnxruntime-genai's Generator, one per item, the last position's logits copied to numpy."""
    out = []
    for item in request["items"]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(request["query"]) + len(item) + 1)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([request["query"] + item], dtype=np.int32))
        logits = generator.get_logits()[0, -1].astype(np.float64)
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        picked = np.exp(logprobs[request["label_token_ids"]])
        out.append(picked / picked.sum())
    return out


@pytest.mark.benchmark(group="score")
def test_transformers_score(benchmark, workload):
    fixture, requests, device, _ = workload
    model = reference_model(fixture, device)

    def score():
        with torch.inference_mode():
            return [transformers_scores(model, r) for r in requests]

    record(benchmark, score, count(requests), workload)


@pytest.mark.benchmark(group="score")
def test_genai_score(benchmark, workload):
    """onnxruntime-genai's Generator: one per item (its batches cannot hold prompts of different
    lengths without padding them), the last position's logits copied to numpy."""
    fixture, requests, device, _ = workload
    model = og.Model(str(fixture.package_dir))

    def score():
        return [scores for r in requests for scores in genai_scores(model, r)]

    record(benchmark, score, count(requests), workload)
