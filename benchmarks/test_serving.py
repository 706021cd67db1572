"""`ortmodule serve` under open-loop load (benchmarks/bench_score.py): Poisson arrivals of score
requests at fixed rates (SGLang's bench_score shape on the GPU), latency percentiles and items/s,
and the answers against transformers in fp32 on the same weights."""

import asyncio
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from bench_score import LocalServer, make_requests, run_load
from conftest import model_label, reference_model, transformers_scores

from ortmodule_dev import fixtures

SERVE_WITH_EXTEND = Path(__file__).with_name("serve_with_extend.py")


@pytest.fixture(scope="module")
def workload(size, decoder_key):
    return fixtures.build(size["decoders"][decoder_key]), size["device"], decoder_key


class Servers:
    """One `ortmodule serve` process at a time, started again when a test asks for another
    `--reuse-prefix` (the rates of one setting run one after the other, on the same server)."""

    def __init__(self, package, device: str, extend: str | None):
        self.package, self.device = package, device
        self.launcher = [sys.executable, str(SERVE_WITH_EXTEND), *extend.split(",")] if extend else []
        self.reuse, self.server = None, None

    def get(self, reuse: str) -> LocalServer:
        if reuse != self.reuse:
            self.close()
            self.server = LocalServer(self.package, self.device, ["--reuse-prefix", reuse], self.launcher)
            self.reuse = reuse
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server, self.reuse = None, None


@pytest.fixture(scope="module")
def score_servers(workload, size, request):
    """The servers of the size's first package (the headline model), in their own processes, with
    the extend graph `--server-extend` names (default: ortmodule's)."""
    fixture, device, key = workload
    if key != next(iter(size["decoders"])):
        pytest.skip("the server is measured on the size's first package only")
    servers = Servers(fixture.package_dir, device, request.config.getoption("--server-extend"))
    yield servers
    servers.close()


@pytest.fixture
def score_server(score_servers, server_reuse):
    """`ortmodule serve --reuse-prefix SERVER_REUSE`."""
    return score_servers.get(server_reuse)


@pytest.mark.benchmark(group="score server")
def test_ortmodule_server_load(benchmark, workload, score_server, size, server_reuse, server_rate, request):
    """Open-loop Poisson arrivals at `server_rate` requests/s: latency percentiles and items/s, and
    the answers to a few of the same requests against transformers in fp32 on the same weights.
    `server_reuse`: the server's `--reuse-prefix` (auto, the default: each request's query run once
    where the measured costs say so; "on": always, the `ortmodule_server-reuse-on` rows)."""
    fixture, device, key = workload
    load = size["server"]
    backend = "ortmodule_server" + ("" if server_reuse == "auto" else f"-reuse-{server_reuse}")
    benchmark.extra_info.update(backend=backend, model=model_label(key), case=f"{server_rate:g} requests/s")
    extend = request.config.getoption("--server-extend")
    if extend:  # the extend graph the servers were started with: "cache, grouped" and the like
        benchmark.extra_info["extend_graph"] = extend.replace(",", ", ")
    shape = [load[k] for k in ("query_tokens", "items", "item_tokens", "labels")]
    bodies = list(make_requests(int(server_rate * load["duration"] * 3) + 10, fixture.spec.vocab_size, *shape,
                                seed=1, exact=load["exact"]))
    before, loop_before = score_server.metrics(), score_server.loop_cpu_seconds()
    result = benchmark.pedantic(lambda: asyncio.run(run_load(score_server.url, server_rate, load["duration"], bodies)),
                                rounds=1, iterations=1)
    groups, loop_after = score_server.metrics(), score_server.loop_cpu_seconds()
    # Beyond its capacity the server sheds load by design (503 "busy" once `max_queue` requests wait):
    # recorded as `refused`; any other status is a failure.
    refused = result["statuses"].get("503", 0)
    assert result["ok"] + refused == result["sent"] and result["ok"] > 0, result
    benchmark.extra_info["refused"] = refused
    if loop_before is not None:  # the event loop's CPU time (HTTP, JSON, validation) per request
        benchmark.extra_info["loop_ms_per_request"] = round(1e3 * (loop_after - loop_before) / result["ok"], 2)
    for name in ("target_rate", "p50_ms", "p90_ms", "p99_ms", "items_per_s"):
        benchmark.extra_info[name] = result[name]
    benchmark.extra_info["largest_group"] = groups["largest_batch"].get("score", 0)
    count = groups["batches"].get("score", 0) - before["batches"].get("score", 0)
    benchmark.extra_info["groups"] = count
    # The model thread's time per group (its runs, and on CUDA its waits for the device), and the
    # share of requests whose query ran once (scoring.label_logprobs decides from measured costs).
    model_s = groups["seconds"].get("oneshot", 0.0) - before["seconds"].get("oneshot", 0.0)
    benchmark.extra_info["model_ms_per_group"] = round(1e3 * model_s / max(count, 1), 1)
    answered = groups["requests"].get("score", 0) - before["requests"].get("score", 0)
    # Requests per group on average: at saturation, whether the token budget fills the groups
    benchmark.extra_info["mean_group"] = round(answered / max(count, 1), 1)
    benchmark.extra_info["reused_queries"] = round((groups["reused_prefixes"] - before["reused_prefixes"])
                                                   / max(answered, 1), 3)
    hf = reference_model(fixture, device, "fp32")
    with torch.inference_mode():
        answers = [httpx.post(score_server.url + "/v1/score", json=body, timeout=120).json()["scores"]
                   for body in bodies[:3]]
        expected = [transformers_scores(hf, body) for body in bodies[:3]]
    worst = max(np.abs(np.array(a) - np.array(e)).max() for a, e in zip(answers, expected))
    benchmark.extra_info["max_diff_vs_fp32"] = float(f"{worst:.3g}")
