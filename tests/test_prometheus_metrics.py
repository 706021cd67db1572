"""`GET /metrics` in Prometheus' format (serving/telemetry.py): vLLM's series count what the requests did, as
their answers tell it, read back through prometheus_client's own parser; the format follows the scraper's
Accept header; a client leaving counts an abort, a failed step an error."""

import json
import time
from collections import Counter

import httpx
import pytest
from helpers import CHAT_TEMPLATE, OPENAI_NAME, served_live
from prometheus_client.parser import text_string_to_metric_families

from ortmodule.serving.generations import DecodeBatch

PROMETHEUS = "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"  # part of what a Prometheus server sends
OPENMETRICS = "application/openmetrics-text;version=1.0.0;q=0.6,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"


@pytest.fixture(scope="module")
def server(build):
    live, model, hf, tokenizer = served_live(build("llama"), CHAT_TEMPLATE)
    yield live, tokenizer
    live.stop()


def scrape(live, accept: str = PROMETHEUS) -> dict:
    """Every sample: (name, its labels other than model_name and engine) -> value; each sample is checked to
    carry this server's model_name and engine 0."""
    answer = live.client.get("/metrics", headers={"Accept": accept})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert (labels.pop("model_name"), labels.pop("engine")) == (OPENAI_NAME, "0"), sample
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def histogram(samples: dict, name: str, **labels) -> tuple[float, float]:
    """(count, sum) of histogram `name`, its buckets checked: cumulative, the last (+Inf) its count."""
    buckets = sorted(((float(dict(key)["le"]), v) for (n, key), v in samples.items()
                      if n == f"{name}_bucket" and all(dict(key).get(k) == w for k, w in labels.items())))
    assert buckets and all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), name
    count = value(samples, f"{name}_count", **labels)
    assert buckets[-1] == (float("inf"), count), name
    return count, value(samples, f"{name}_sum", **labels)


def observations(samples: dict, name: str, **labels) -> tuple[float, float]:
    """histogram()'s (count, sum), (0, 0) where the series is not there yet."""
    if (f"{name}_count", tuple(sorted(labels.items()))) not in samples:
        return 0, 0
    return histogram(samples, name, **labels)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0)


def test_vllm_series_count_what_the_answers_say(server):
    """Completions (greedy, two choices; one ended by a stop token), a streamed chat and a score request: the
    prompt and generation tokens equal the answers' usage (each choice's prompt counted, as vLLM's child
    requests), `request_success` their finish reasons, each histogram one observation per choice (inter-token
    latencies one per token after the first), its latencies within what the client measured; the score request
    is not a generation row, and `ortmodule:` series count both kinds."""
    live, tokenizer = server
    client, before = live.client, scrape(live)
    prompt = "The quick brown fox"
    start = time.monotonic()
    first = client.post("/v1/completions", json={"model": OPENAI_NAME, "prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0, "n": 2, "return_token_ids": True})
    stop_id = first.json()["choices"][0]["token_ids"][1]
    requests = [("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                     "stop_token_ids": [stop_id]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                          "max_tokens": 5, "temperature": 0})]
    answers, walls = [first.json()], [time.monotonic() - start]
    for route, body in requests:
        start = time.monotonic()
        answers.append(client.post(route, json={"model": OPENAI_NAME, **body}).json())
        walls.append(time.monotonic() - start)
    start = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": OPENAI_NAME, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    walls.append(time.monotonic() - start)
    events = [json.loads(line[6:]) for line in lines]
    answers.append({"usage": events[-1]["usage"], "choices": [
        {"finish_reason": e["choices"][0]["finish_reason"]} for e in events if e["choices"] and
        e["choices"][0]["finish_reason"]]})
    score = client.post("/v1/score", json={"model": OPENAI_NAME, "query": "Is it", "items": [" yes", " no"],
                                           "label_token_ids": [5, 6]})
    assert score.status_code == 200, score.text
    after = scrape(live)

    choices = [len(a["choices"]) for a in answers]
    reasons = Counter(c["finish_reason"] for a in answers for c in a["choices"])
    assert choices == [2, 1, 1, 1] and reasons["stop"] >= 1, reasons
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    prompted = sum(a["usage"]["prompt_tokens"] * n for a, n in zip(answers, choices))
    assert delta(after, before, "vllm:generation_tokens_total") == generated
    assert delta(after, before, "vllm:prompt_tokens_total") == prompted
    for reason in ("stop", "length", "abort", "error"):
        assert delta(after, before, "vllm:request_success_total", finished_reason=reason) == reasons[reason]
    rows = sum(choices)

    def observed(name, **labels):
        (count, total), (count0, total0) = observations(after, name, **labels), observations(before, name, **labels)
        return count - count0, total - total0

    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert observed(f"vllm:{name}")[0] == rows, name
    assert observed("vllm:inter_token_latency_seconds")[0] == generated - rows
    assert observed("vllm:request_generation_tokens") == (rows, generated)
    assert observed("vllm:request_prompt_tokens") == (rows, prompted)
    assert observed("vllm:request_params_max_tokens")[1] == 6 * 2 + 8 + 5 + 4
    assert observed("vllm:request_params_n") == (4, 5)  # once per prompt: n 2, then 1, 1, 1
    e2e, first_token, queue, inference = (observed(f"vllm:{name}_seconds")[1] for name in (
        "e2e_request_latency", "time_to_first_token", "request_queue_time", "request_inference_time"))
    assert 0 < first_token <= e2e and abs(queue + inference - e2e) < 1e-6
    assert e2e <= sum(wall * n for wall, n in zip(walls, choices))  # each row within its request's time at the client
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    # ortmodule's own: every kind of request, the score request among them
    json_counts = client.get("/metrics?format=json").json()
    for kind, count in json_counts["requests"].items():
        assert value(after, "ortmodule:requests_total", kind=kind) == count
    assert delta(after, before, "ortmodule:requests_total", kind="score") == 1
    assert delta(after, before, "ortmodule:requests_total", kind="generation") == 4
    assert observed("ortmodule:request_latency_seconds", kind="generation")[0] == 4
    assert observed("ortmodule:request_latency_seconds", kind="score")[0] == 1


def test_the_format_follows_the_scrapers_accept_header(server):
    """Prometheus' text for a scraper and for curl's `*/*` (vLLM's /metrics), and where OpenMetrics is asked for;
    the engine's JSON where JSON is preferred or `?format=json`; another format a 400 naming it."""
    live, _ = server
    client = live.client

    def kind(accept=None, query=""):
        answer = client.get("/metrics" + query, headers={"Accept": accept} if accept else {})
        assert answer.status_code == 200, answer.text
        return answer.headers["content-type"].split(";")[0], answer

    assert kind()[0] == kind("*/*")[0] == kind(PROMETHEUS)[0] == "text/plain"
    # OpenMetrics asked for first gets the text format too: prometheus_client's OpenMetrics output would rename
    # the samples of vllm:... names (their colon) and not their HELP and TYPE lines
    content_type, answer = kind(OPENMETRICS)
    assert content_type == "text/plain" and "\nvllm:generation_tokens_total{" in answer.text
    for family in text_string_to_metric_families(answer.text):
        assert all(sample.name.startswith(family.name) for sample in family.samples), family
    for accept, query in (("application/json", ""), ("text/plain;q=0.5, application/json", ""),
                          (PROMETHEUS, "?format=json"), (None, "?format=json")):
        content_type, answer = kind(accept, query)
        assert content_type == "application/json" and "running_rows" in answer.json(), (accept, query)
    assert kind("application/json;q=0.1, text/plain", "")[0] == "text/plain"
    assert kind("application/json", "?format=prometheus")[0] == "text/plain"
    refused = client.get("/metrics?format=xml")
    assert refused.status_code == 400 and "format must be json or prometheus" in refused.text


def test_a_client_leaving_counts_an_abort_and_a_failed_step_an_error(server, monkeypatch):
    """A stream read for two events and left (decode steps slowed to 20 ms) is running meanwhile, its KV the
    cache's use, and one `abort` when its row leaves the batch; a completion whose decode step raises is one
    `error`; neither a success of another reason."""
    live, tokenizer = server
    before = scrape(live)
    step = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda batch: (time.sleep(0.02), step(batch))[1])
    abandoned = live.client.get("/metrics?format=json").json()["abandoned"]
    request = {"model": OPENAI_NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
               "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=request) as stream:
        seen = 0
        for line in stream.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break
        # running: its row, whose KV holds its prompt and the tokens so far (of 32 rows x 256 positions)
        running = scrape(live)
        held = value(running, "vllm:kv_cache_usage_perc") * 32 * 256
        prompt = len(tokenizer("Once upon a time")["input_ids"])
        assert value(running, "vllm:num_requests_running") == 1 and prompt <= round(held) < prompt + 200, held
    deadline = time.monotonic() + 10
    while live.client.get("/metrics?format=json").json()["abandoned"] != abandoned + 1 or \
            value(scrape(live), "vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the stream's departure was not recorded"
        time.sleep(0.05)

    def failing(batch):
        raise RuntimeError("injected: the device stopped")

    monkeypatch.setattr(DecodeBatch, "step", failing)
    failed = live.client.post("/v1/completions", json={"model": OPENAI_NAME, "prompt": "Hello", "max_tokens": 5,
                                                        "temperature": 0, "ignore_eos": True})
    assert failed.status_code == 500, failed.text
    after = scrape(live)
    counts = {reason: delta(after, before, "vllm:request_success_total", finished_reason=reason)
              for reason in ("stop", "length", "abort", "error")}
    assert counts == {"stop": 0, "length": 0, "abort": 1, "error": 1}
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(after, "vllm:num_requests_running") == 0
