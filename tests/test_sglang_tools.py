"""SGLang's own tools against `ortmodule serve` (ortmodule/serving/sglang_routes.py and `/generate`):
the requests its benchmark (`sglang.bench_serving --backend sglang`) and its frontend language's
`RuntimeEndpoint` send, as SGLang 0.5.23 writes them, answered as transformers computes them on the
same weights; `/model_info`, `/server_info`, `/flush_cache`, `/health_generate`, `/ready`."""

import json
import threading
import time

import torch
from helpers import OPENAI_NAME, LiveServer, expected_text, hf_greedy, hold_worker, one_held_one_waiting

from ortmodule.serving import create_app


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_bench_servings_streamed_request_is_answered(openai_live):
    """`bench_serving --backend sglang`'s request: its fields (`lora_path`, `return_routed_experts`,
    `logprob_start_len` -1 ...) at their defaults, streamed; the last event is transformers' greedy text."""
    live, _, hf, tokenizer, _ = openai_live
    prompt = "The quick brown fox jumps over"
    payload = {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
               "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
               "logprob_start_len": -1}
    answer = live.client.post("/generate", json=payload)
    assert answer.status_code == 200, answer.text
    last = events(answer.text)[-1]
    tokens = hf_greedy(hf, tokenizer(prompt).input_ids, 12)
    assert last["output_ids"] == tokens and last["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    refused = live.client.post("/generate", json={**payload, "return_routed_experts": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_routed_experts"
    refused = live.client.post("/generate", json={"text": prompt, "sampling_params": {"stop_regex": "a+"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "sampling_params.stop_regex"


def test_the_frontend_languages_gen_and_select(openai_live):
    """`RuntimeEndpoint.generate`'s request (every sampling field it sends, `stop` empty) and
    `RuntimeEndpoint.select`'s: the prompt with each choice, no new tokens, the log-probabilities from
    two tokens before the prompt's end with their texts; SGLang's `token_length_normalized` choice
    (the mean of the non-null log-probabilities) computed from the answer is transformers'."""
    live, _, hf, tokenizer, _ = openai_live
    text = "The capital of France is"
    params = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8,
              "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0,
              "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
              "ignore_eos": False, "regex": None, "json_schema": None}
    body = live.client.post("/generate", json={"text": text, "sampling_params": params}).json()
    assert body["text"] == expected_text(tokenizer, hf_greedy(hf, tokenizer(text).input_ids, 8))[0]
    cached = live.client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}}).json()
    start = max(cached["meta_info"]["prompt_tokens"] - 2, 0)
    choices = [" Paris", " a city", " London"]
    answers = live.client.post("/generate", json={
        "text": [text + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start}).json()
    means, expected = [], []
    for choice, answer in zip(choices, answers, strict=True):
        entries = answer["meta_info"]["input_token_logprobs"]
        ids = tokenizer(text + choice).input_ids
        assert [token for _, token, _ in entries] == ids[start:]
        assert [name for _, _, name in entries] == [tokenizer.decode([t]) for t in ids[start:]]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        reference = [logprobs[k - 1, ids[k]].item() for k in range(start + 1, len(ids))]
        values = [value for value, _, _ in entries if value]
        assert max(abs(a - b) for a, b in zip(values, reference, strict=True)) < 1e-4
        means.append(sum(values) / len(values))
        expected.append(sum(reference) / len(reference))
    assert means.index(max(means)) == expected.index(max(expected))


def test_model_info_server_info_ready_and_health(openai_live):
    live, model, *_ = openai_live
    info = live.client.get("/model_info").json()
    assert live.client.get("/get_model_info").json() == info
    assert info["model_path"] == info["tokenizer_path"] == info["served_model_name"] == OPENAI_NAME
    assert info["is_generation"] is True and info["model_type"] == model.config.model_type
    assert "/" not in info["model_path"]  # the served name, never the package's path on the host
    server = live.client.get("/server_info").json()
    assert live.client.get("/get_server_info").json()["context_length"] == server["context_length"] == \
        model.package.context_length
    assert server["internal_states"][0]["running_rows"] == 0
    assert live.client.get("/ready").status_code == 200
    assert live.client.get("/health_generate").status_code == 200


def test_health_generate_is_503_while_generation_fails_or_waits_on_a_full_queue(openai_live, monkeypatch):
    """`/health_generate` generates one token: 503 where that fails (the engine goes on: 200 once it
    works again), 503 where the queue is full (one request held in the worker, one waiting with
    `max_queue=1`), 200 once the queue drains; timed out it is 503 too (HEALTH_TIMEOUT, shortened here)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ortmodule.serving import sglang_routes
    from ortmodule.serving.generations import Generations

    _, model, _, tokenizer, _ = openai_live
    app = create_app(model, tokenizer, name=OPENAI_NAME, window_ms=0, max_queue=1)
    live = LiveServer(app)
    try:
        assert live.client.get("/health_generate").status_code == 200
        with monkeypatch.context() as patch:
            patch.setattr(Generations, "_prefill_short", lambda *a: 1 / 0)
            assert live.client.get("/health_generate").status_code == 503
        assert live.client.get("/health_generate").status_code == 200
        started, release, _ = hold_worker(app.state.served)
        body = {"model": OPENAI_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            first, second = one_held_one_waiting(live, pool, started, body)
            assert live.client.get("/health_generate").status_code == 503  # busy
            release.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert live.client.get("/health_generate").status_code == 200
        started, release, _ = hold_worker(app.state.served)
        with monkeypatch.context() as patch, ThreadPoolExecutor(1) as pool:
            patch.setattr(sglang_routes, "HEALTH_TIMEOUT", 0.2)
            first = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=60)
            assert started.wait(30)
            assert live.client.get("/health_generate").status_code == 503  # its token held past the wait
            assert app.state.served.engine.waiting.count == 0  # and its queue place given back (max_queue is 1)
            release.set()
            assert first.result().status_code == 200
        # with the route's own timeout again: 0.2 s was too short for one token on a loaded 2-vCPU machine
        assert live.client.get("/health_generate").status_code == 200
    finally:
        if "release" in locals():
            release.set()
        live.stop()


def test_flush_cache_empties_the_prefix_cache_when_idle(openai_live):
    """`/flush_cache` (GET or POST) empties the prefix cache; the prompt sent again runs whole, with
    the same answer. While a generation runs it is refused (SGLang's rule), and with `timeout` it
    waits for the engine to be idle. `meta_info.cached_tokens` counts the prompt's tokens taken from the
    cache, as SGLang's does."""
    _, model, hf, tokenizer, _ = openai_live
    live = LiveServer(create_app(model, tokenizer, name=OPENAI_NAME, window_ms=0))
    try:
        prompt = [5 + (11 * i) % 400 for i in range(40)]
        expected = hf_greedy(hf, prompt, 4)

        def generate(new=4, ids=prompt):
            return live.client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": new, "temperature": 0, "ignore_eos": True}}).json()

        def cache():
            return live.client.get("/metrics?format=json").json()["prefix_cache"]

        first = generate()
        assert first["output_ids"] == expected and cache()["entries"] == 1
        assert first["meta_info"]["cached_tokens"] == 0
        again = generate()  # starts past the cached prompt (all of it but its last token)
        assert again["output_ids"] == expected and cache()["hits"] == 1
        assert again["meta_info"]["cached_tokens"] == cache()["reused_tokens"] == len(prompt) - 1
        flushed = live.client.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text == "Cache flushed.\n"
        assert cache()["entries"] == 0 and live.client.get("/flush_cache").status_code == 200
        after = generate()
        assert after["output_ids"] == expected and after["meta_info"]["cached_tokens"] == 0
        assert cache()["hits"] == 1  # ran whole, not reused

        started, release, _ = hold_worker(live.app.state.served)
        running = threading.Thread(target=generate, args=(60, prompt[::-1]))  # not cached: it is prefilled
        running.start()
        assert started.wait(30)  # its prefill held: the engine is busy
        answers = {}

        def flush(timeout):
            answers[timeout] = live.client.post("/flush_cache", params={"timeout": timeout})

        asks = [threading.Thread(target=flush, args=(t,)) for t in (0, 30)]
        for ask in asks:
            ask.start()
        deadline = time.monotonic() + 30
        while live.app.state.served.engine.inbox.queue.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        for thread in (*asks, running):
            thread.join(60)
        assert answers[0].status_code == 400 and "requests are running" in answers[0].text
        assert answers[30].status_code == 200 and cache()["entries"] == 0
    finally:
        live.stop()
