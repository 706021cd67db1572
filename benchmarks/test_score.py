"""score(): items/s of SGLang-style scoring requests (one query, many short items, a few label
tokens), ortmodule beside transformers on the same weights and onnxruntime-genai's Generator on
the same package; and the `/v1/score` server under open-loop load (benchmarks/bench_score.py)."""

import asyncio
import dataclasses

import httpx
import numpy as np
import onnxruntime_genai as og
import pytest
import torch
from bench_score import LocalServer, make_requests, run_load
from conftest import model_label, record_rate, reference_model

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


def reference(hf, request):
    """What a transformers user writes: the items left-padded in one batch, logits_to_keep=1."""
    prompts = [request["query"] + item for item in request["items"]]
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    logits = hf(ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
    return torch.softmax(torch.log_softmax(logits.float(), -1)[:, request["label_token_ids"]], -1).tolist()


@pytest.mark.benchmark(group="score")
@pytest.mark.parametrize("reuse", ["auto", "no_reuse"])
def test_ortmodule_score(benchmark, workload, reuse):
    fixture, requests, device, _ = workload
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    option = None if reuse == "auto" else False

    def score():
        return [ortmodule.score(model, None, r["query"], r["items"], r["label_token_ids"], apply_softmax=True,
                                reuse_prefix=option) for r in requests]

    out = record(benchmark, score, count(requests), workload, reuse)
    if fixture.spec.precision == "int4":
        # The same int4 package through onnxruntime-genai, fed as ortmodule feeds it: ONNX Runtime's
        # int4 kernels give a token stepped alone over a cache other numbers than the same token
        # in a prefill (quantization noise, identical in onnxruntime-genai), and prefix reuse steps.
        expected = genai_scores(og.Model(str(fixture.package_dir)), requests[0], stepped=option is not False)
    else:
        hf = reference_model(fixture, device)
        with torch.inference_mode():
            expected = reference(hf, requests[0])
    tolerance = {"fp32": 1e-4, "int4": 1e-3}.get(fixture.spec.precision, 2e-2)
    assert np.abs(np.array(out[0]) - np.array(expected)).max() < tolerance


def genai_scores(model, request, stepped: bool = False) -> list:
    """onnxruntime-genai's Generator, one per item, the last position's logits copied to numpy;
    `stepped`: the query appended at once, then the item one token at a time."""
    out = []
    for item in request["items"]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(request["query"]) + len(item) + 1)
        generator = og.Generator(model, params)
        if stepped:
            generator.append_tokens(np.array([request["query"]], dtype=np.int32))
            for token in item:
                generator.append_tokens(np.array([[token]], dtype=np.int32))
        else:
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
            return [reference(model, r) for r in requests]

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


@pytest.fixture(scope="module")
def score_server(workload, size):
    """`ortmodule serve` on the size's first package (the headline model), in its own process, for
    every rate."""
    fixture, _, device, key = workload
    if key != next(iter(size["decoders"])):
        pytest.skip("the server is measured on the size's first package only")
    with LocalServer(fixture.package_dir, device) as server:
        yield server


@pytest.mark.benchmark(group="score server")
def test_ortmodule_server_load(benchmark, workload, score_server, size, server_rate):
    """Open-loop Poisson arrivals at `server_rate` requests/s: latency percentiles and items/s, and
    the answers to a few of the same requests against transformers in fp32 on the same weights."""
    fixture, _, device, key = workload
    load = size["server"]
    benchmark.extra_info.update(model=model_label(key), case=f"{server_rate:g} requests/s")
    shape = [load[k] for k in ("query_tokens", "items", "item_tokens", "labels")]
    bodies = list(make_requests(int(server_rate * load["duration"] * 3) + 10, fixture.spec.vocab_size, *shape,
                                seed=1, exact=load["exact"]))
    before = score_server.metrics()
    result = benchmark.pedantic(lambda: asyncio.run(run_load(score_server.url, server_rate, load["duration"], bodies)),
                                rounds=1, iterations=1)
    groups = score_server.metrics()
    assert result["ok"] == result["sent"] > 0, result
    for name in ("target_rate", "p50_ms", "p90_ms", "p99_ms", "items_per_s"):
        benchmark.extra_info[name] = result[name]
    benchmark.extra_info["largest_group"] = groups["largest_group"]
    benchmark.extra_info["groups"] = groups["groups"] - before["groups"]
    hf = reference_model(dataclasses.replace(fixture, spec=dataclasses.replace(fixture.spec, precision="fp32")), device)
    with torch.inference_mode():
        answers = [httpx.post(score_server.url + "/v1/score", json=body, timeout=120).json()["scores"]
                   for body in bodies[:3]]
        expected = [reference(hf, body) for body in bodies[:3]]
    worst = max(np.abs(np.array(a) - np.array(e)).max() for a, e in zip(answers, expected))
    benchmark.extra_info["max_diff_vs_fp32"] = float(f"{worst:.3g}")
