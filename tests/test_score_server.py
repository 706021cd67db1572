"""`/v1/score` over real HTTP on 127.0.0.1: answers, 400s, batching of concurrent clients, 503."""

import contextlib
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import SCORE_ITEMS as ITEMS
from helpers import SCORE_QUERY as QUERY
from helpers import LiveServer, float32_logits_copy, hold_worker, labels_for, load_pair
from helpers import score_reference as reference

import ortmodule
from ortmodule import OrtModelForCausalLM, load_tokenizer
from ortmodule.serving import create_app
from ortmodule.serving.jobs import ScoreJob


@pytest.fixture(scope="module")
def setup(build):
    fixture = build("llama")
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    live = LiveServer(create_app(model, tokenizer, name="tiny-llama", window_ms=50))
    yield live, hf, tokenizer
    live.stop()


def test_health_and_models(setup):
    live, _, _ = setup
    assert live.client.get("/health").json() == {"status": "ok"}
    models = live.client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-llama" and models["data"][0]["max_model_len"] == 256


@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_and_token_requests_match_transformers(setup, apply_softmax, item_first):
    live, hf, tokenizer = setup
    labels = labels_for(tokenizer)
    token_query, token_items = [10, 11, 12, 13, 14, 15], [[20], [21, 22, 23]]
    for query, items in ((QUERY, ITEMS), (token_query, token_items)):
        body = dict(query=query, items=items, label_token_ids=labels, apply_softmax=apply_softmax,
                    item_first=item_first, model="tiny-llama")
        response = live.client.post("/v1/score", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["object"] == "scoring" and answer["model"] == "tiny-llama"
        expected = reference(hf, tokenizer, query, items, labels, apply_softmax, item_first)
        assert (torch.tensor(answer["scores"], dtype=torch.float64) - expected).abs().max().item() < 1e-5
        prompt_tokens = sum(len(tokenizer(item + query if item_first else query + item).input_ids) for item in items) \
            if isinstance(query, str) else sum(len(query) + len(item) for item in items)
        assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                   "total_tokens": prompt_tokens}


def test_sglangs_per_item_labels_temperature_and_token_logprobs_match_transformers(setup):
    """SGLang 0.5.23's score fields: a label list per item (of different lengths), `temperature` dividing
    the label log-probabilities before the softmax over them, `return_token_logprobs` (the labels' own
    log-probabilities per item), and its other fields at their neutral values, against transformers."""
    live, hf, tokenizer = setup
    labels = [[5, 300], [7, 8, 9], [10], [11, 12]]
    body = dict(query=QUERY, items=ITEMS, label_token_ids=labels, apply_softmax=True, temperature=0.5,
                return_token_logprobs=True, return_pooled_hidden_states=False, embed_override_token_id=None,
                score_extraction_token=None)
    response = live.client.post("/v1/score", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    for item, own, scores, logprobs in zip(ITEMS, labels, answer["scores"], answer["token_logprobs"]):
        with torch.no_grad():
            expected = torch.log_softmax(hf(tokenizer(QUERY + item, return_tensors="pt").input_ids).logits[0, -1]
                                         .double(), -1)[own]
        assert max(abs(a - b) for a, b in zip(logprobs, expected.tolist())) < 1e-4
        assert max(abs(a - b) for a, b in zip(scores, torch.softmax(expected / 0.5, -1).tolist())) < 1e-5
    plain = live.client.post("/v1/score", json=dict(query=QUERY, items=ITEMS, label_token_ids=labels)).json()
    assert [len(row) for row in plain["scores"]] == [2, 3, 1, 2] and "token_logprobs" not in plain


def test_no_items_get_no_scores_as_sglang_answers_them(setup):
    """SGLang 0.5.23 answers `items: []` with `scores: []` (and `token_logprobs: []` when asked), after its
    checks of the request itself; the server's next request is scored as usual."""
    live, hf, tokenizer = setup
    for extra in ({}, {"return_token_logprobs": True, "apply_softmax": True, "temperature": 0.5}):
        response = live.client.post("/v1/score", json=dict(query=QUERY, items=[], label_token_ids=[5, 6], **extra))
        assert response.status_code == 200, response.text
        assert response.json() == {"scores": [], "model": response.json()["model"], "object": "scoring",
                                   "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                                   **({"token_logprobs": []} if extra else {})}
    good = live.client.post("/v1/score", json=dict(query=QUERY, items=ITEMS[:1], label_token_ids=[5, 6])).json()
    expected = reference(hf, tokenizer, QUERY, ITEMS[:1], [5, 6], False, False)
    assert (torch.tensor(good["scores"], dtype=torch.float64) - expected).abs().max().item() < 1e-5


BAD_REQUESTS = [
    (dict(label_token_ids=None), "label_token_ids"),
    (dict(label_token_ids=[]), "label_token_ids is empty"),
    (dict(label_token_ids=[1, 512]), "label token id 512 is outside the vocabulary"),
    (dict(items=[], model="another-model"), "model 'another-model' is not served here"),
    (dict(items=[], temperature=2.0), "temperature requires apply_softmax=true"),
    (dict(items=[[5, 6], [7]]), "item 0 is list"),
    (dict(query=[5, 6], items=["text"]), "item 0 is text"),
    (dict(query=[5, 70000], items=[[6]]), "token id 70000 is outside the vocabulary"),
    (dict(query="word " * 300), "over the model's context length 256"),
    (dict(query=42), "query"),
    (dict(label_token_ids="abc"), "label_token_ids"),
    (dict(apply_softmax="maybe"), "apply_softmax"),
    (dict(model="another-model"), "model 'another-model' is not served here"),
    (dict(temperature=2.0), "temperature requires apply_softmax=true"),
    (dict(temperature=0, apply_softmax=True), "temperature must be finite and greater than zero"),
    (dict(temperature="hot", apply_softmax=True), "temperature"),
    (dict(label_token_ids=[[5], [6]]), "label_token_ids has 2 lists for 4 items"),
    (dict(label_token_ids=[5, 6, 5]), "must not hold a token twice"),
    (dict(return_pooled_hidden_states=True), "return_pooled_hidden_states is not supported"),
    (dict(score_extraction_token="<x>"), "score_extraction_token is not supported"),
    (dict(query_embed_overrides=[[0.5]]), "query_embed_overrides is not supported"),
]


@pytest.mark.parametrize("change, message", BAD_REQUESTS)
def test_a_bad_request_gets_400_and_the_next_good_one_succeeds(setup, change, message):
    live, _, _ = setup
    body = dict(query=QUERY, items=ITEMS, label_token_ids=[5, 6])
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    response = live.client.post("/v1/score", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["message"]
    good = live.client.post("/v1/score", json=dict(query=QUERY, items=ITEMS, label_token_ids=[5, 6]))
    assert good.status_code == 200 and len(good.json()["scores"]) == len(ITEMS)


def test_malformed_json_gets_400(setup):
    live, _, _ = setup
    response = live.client.post("/v1/score", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400


def test_concurrent_clients_are_scored_together(setup):
    live, hf, tokenizer = setup
    groups_before = dict(live.client.get("/metrics?format=json").json()["batch_sizes"].get("score", {}))
    queries = [QUERY, "a different question entirely", QUERY, "short"] * 2
    labels = [[5, 6], [7], [5, 6, 8], [9, 10]] * 2

    def ask(i):
        body = dict(query=queries[i], items=ITEMS[: 1 + i % 4], label_token_ids=labels[i], apply_softmax=i % 2 == 1)
        return httpx.post(live.url + "/v1/score", json=body, timeout=60)

    with ThreadPoolExecutor(len(queries)) as pool:
        answers = list(pool.map(ask, range(len(queries))))
    for i, response in enumerate(answers):
        assert response.status_code == 200, response.text
        expected = reference(hf, tokenizer, queries[i], ITEMS[: 1 + i % 4], labels[i], i % 2 == 1, False)
        assert (torch.tensor(response.json()["scores"], dtype=torch.float64) - expected).abs().max().item() < 1e-5
    groups = live.client.get("/metrics?format=json").json()["batch_sizes"]["score"]
    new_groups = {int(k): v - groups_before.get(k, 0) for k, v in groups.items() if v - groups_before.get(k, 0)}
    assert sum(k * v for k, v in new_groups.items()) == len(queries)
    assert max(new_groups) > 1, f"every request was scored alone: {new_groups}"


@pytest.mark.parametrize("worth", [True, False])
def test_metrics_count_the_requests_whose_query_ran_once(setup, monkeypatch, worth):
    """`/metrics`' `reused_prefixes`: the score requests whose items' common prefix ran once, as
    scoring.label_logprobs decided (here forced either way); a request of one item never shares."""
    live, _, _ = setup
    monkeypatch.setattr(ortmodule.scoring, "worth_sharing", lambda *args, **kwargs: worth)
    before = live.client.get("/metrics?format=json").json()["reused_prefixes"]
    for items in (ITEMS, ITEMS[:1], ITEMS[:2]):
        body = dict(query=QUERY, items=items, label_token_ids=[5, 6])
        assert live.client.post("/v1/score", json=body).status_code == 200
    assert live.client.get("/metrics?format=json").json()["reused_prefixes"] - before == (2 if worth else 0)


@pytest.mark.parametrize("reuse", ["on", "off"])
def test_the_reuse_prefix_setting_decides_whatever_the_costs_say(build, monkeypatch, reuse):
    """`reuse_prefix="on"` runs every request's query once (its items over copies of its KV) and
    "off" every prompt whole, where the measured costs would choose the other way; the scores are
    transformers' either way, and `/metrics` counts the requests whose query ran once (a request of
    one item has no query shared by items)."""
    monkeypatch.setattr(ortmodule.scoring, "worth_sharing", lambda *args, **kwargs: reuse == "off")
    fixture = build("llama")
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    live = LiveServer(create_app(model, tokenizer, reuse_prefix=reuse, window_ms=0))
    try:
        for items in (ITEMS, ITEMS[:1], ITEMS[:2]):
            body = dict(query=QUERY, items=items, label_token_ids=[5, 6], apply_softmax=True)
            response = live.client.post("/v1/score", json=body)
            assert response.status_code == 200, response.text
            expected = reference(hf, tokenizer, QUERY, items, [5, 6], True, False)
            assert (torch.tensor(response.json()["scores"], dtype=torch.float64) - expected).abs().max().item() < 1e-5
        assert live.client.get("/metrics?format=json").json()["reused_prefixes"] == (2 if reuse == "on" else 0)
    finally:
        live.stop()


def test_a_full_queue_answers_503_and_the_server_recovers(build):
    fixture = build("llama")
    model, _ = load_pair(fixture)
    app = create_app(model, load_tokenizer(fixture.package_dir), max_queue=1, window_ms=0)
    server = app.state.served
    started, release, _ = hold_worker(server)  # the worker blocks on the first group until released
    live = LiveServer(app)
    try:
        body = dict(query=[5, 6, 7], items=[[8]], label_token_ids=[1])
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(live.client.post, "/v1/score", json=body)
            assert started.wait(30)  # the worker holds request 1
            second = pool.submit(live.client.post, "/v1/score", json=body)
            deadline = time.monotonic() + 30
            while live.client.get("/metrics?format=json").json()["waiting"] < 1:  # request 2 waits in the queue
                assert time.monotonic() < deadline
                time.sleep(0.01)
            third = live.client.post("/v1/score", json=body)
            assert third.status_code == 503 and "busy" in third.json()["message"]
            release.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert live.client.post("/v1/score", json=body).status_code == 200
        assert live.client.get("/metrics?format=json").json()["rejected_busy"] == 1
    finally:
        release.set()
        live.stop()


@pytest.mark.parametrize("overlaps, expected", [
    (True, ["start 1", "start 2", "finish 1", "finish 2"]),
    (False, ["start 1", "finish 1", "start 2", "finish 2"]),
], ids=["overlapping", "one-by-one"])
def test_requests_arriving_during_a_call_are_queued_before_it_is_answered(build, monkeypatch, overlaps, expected):
    """The engine's overlap (on CUDA: `engine.overlaps`, turned on here on a CPU): two requests that
    arrive while a call runs are queued as the next call before the running one is answered, so that
    a GPU goes from one to the next without waiting for the host; without it (a CPU), each call is
    answered as soon as it returns. Either way every answer is transformers', the last call is
    answered with nothing queued behind it, and a call whose answers fail to come back fails its
    own requests only (500), not the next call's."""
    fixture = build("llama")
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    app = create_app(model, tokenizer, window_ms=0)
    engine = app.state.served.engine
    engine.overlaps = overlaps
    events, start_together = [], ScoreJob.start_together.__func__

    def recorded(cls, model, jobs):
        finish = start_together(cls, model, jobs)
        events.append(f"start {len(jobs)}")

        def finished():
            events.append(f"finish {len(jobs)}")
            if failing and len(jobs) == 1:
                raise RuntimeError("the copy to the host failed")
            return finish()

        return finished

    monkeypatch.setattr(ScoreJob, "start_together", classmethod(recorded))
    started, release, _ = hold_worker(app.state.served)
    live = LiveServer(app)
    labels = labels_for(tokenizer)
    bodies = [dict(query=QUERY, items=ITEMS[:k], label_token_ids=labels) for k in (2, 3, 4)]
    try:
        for failing in (False, True):
            events.clear()
            started.clear()
            release.clear()
            with ThreadPoolExecutor(3) as pool:
                first = pool.submit(live.client.post, "/v1/score", json=bodies[0])
                assert started.wait(30)  # the first call is held
                rest = [pool.submit(live.client.post, "/v1/score", json=body) for body in bodies[1:]]
                deadline = time.monotonic() + 30
                while engine.inbox.queue.qsize() < 2:  # both handed to the engine while the call is held
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                release.set()
                answers = [first.result(), *(r.result() for r in rest)]
            assert events == expected
            assert answers[0].status_code == (500 if failing else 200)
            for body, answer in zip(bodies[0 if not failing else 1 :], answers[0 if not failing else 1 :]):
                assert answer.status_code == 200, answer.text
                reference_scores = reference(hf, tokenizer, QUERY, body["items"], labels, False, False)
                got = torch.tensor(answer.json()["scores"], dtype=torch.float64)
                assert (got - reference_scores).abs().max().item() < 1e-5
    finally:
        release.set()
        live.stop()


def test_waiting_requests_do_not_poll_their_connections(build):
    """Requests waiting for the engine wait for their client's departure instead of checking for it:
    while the worker is held, eight queued requests make no calls into their connections (polling
    every 50 ms had made about 20 a second each, costing the event loop more the more requests
    waited), and each is still answered when the worker goes on."""
    fixture = build("llama")
    model, _ = load_pair(fixture)
    app = create_app(model, load_tokenizer(fixture.package_dir), window_ms=0)
    started, release, _ = hold_worker(app.state.served)
    calls = []

    async def counting(scope, receive, send):  # counts the ASGI receive calls of the score requests
        async def counted():
            calls.append(time.monotonic())
            return await receive()

        mine = scope["type"] == "http" and scope.get("path") == "/v1/score"
        await app(scope, counted if mine else receive, send)

    live = LiveServer(counting)
    try:
        body = dict(query=[5, 6, 7], items=[[8]], label_token_ids=[1])
        with ThreadPoolExecutor(9) as pool:
            first = pool.submit(live.client.post, "/v1/score", json=body)
            assert started.wait(30)  # the worker holds request 1; the next eight wait in the queue
            waiting = [pool.submit(httpx.post, live.url + "/v1/score", json=body, timeout=60) for _ in range(8)]
            deadline = time.monotonic() + 30
            while live.client.get("/metrics?format=json").json()["waiting"] < 8:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.1)  # each waiting request has settled into its wait
            before = len(calls)
            time.sleep(0.5)
            during = len(calls) - before
            release.set()
            assert first.result().status_code == 200
            assert all(f.result().status_code == 200 for f in waiting)
        assert during == 0, f"{during} receive calls in 0.5 s from 8 waiting requests"
    finally:
        release.set()
        live.stop()


@contextlib.contextmanager
def served(*command, output: list | None = None):
    """`command` (an `ortmodule serve` line, without its port) running on a free port: its URL; what
    the process printed goes into `output` when it has stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "ortmodule serve did not come up"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)
        if output is not None:
            output.append(process.stdout.read())


def test_the_console_command_serves_a_package(llama, tmp_path, monkeypatch):
    """`ortmodule serve` times the model's runs at start where they decide a query's reuse (`auto`, the
    default), so that no request waits for it; with `--reuse-prefix on` or `off` it times nothing."""
    console = str(Path(sys.executable).parent / "ortmodule")
    body = dict(query=[5, 6], items=[[7], [8]], label_token_ids=[1, 2], apply_softmax=True)
    for cache, options in (("auto", ()), ("fixed", ("--reuse-prefix", "on"))):
        monkeypatch.setenv("ORTMODULE_CACHE", str(tmp_path / cache))
        with served(console, "serve", str(llama.package_dir), "--name", "tiny", *options) as url:
            measured = list((tmp_path / cache).glob("costs/*.json"))
            answer = httpx.post(url + "/v1/score", json=body)
        assert answer.status_code == 200 and answer.json()["model"] == "tiny"
        assert [round(sum(row), 5) for row in answer.json()["scores"]] == [1.0, 1.0]
        assert len(measured) == (1 if cache == "auto" else 0)


def test_a_port_in_use_is_said_before_the_package_loads(llama, monkeypatch):
    """`serve` binds its socket first: a port in use, or one outside 0-65535, is a ValueError naming it
    (`ortmodule serve` says it as a usage error) before the package is loaded and its runs timed,
    minutes for a big model, where uvicorn said it only after them."""
    from ortmodule.serving import app

    monkeypatch.setattr(OrtModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("the package loaded first"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1 port {port}: Address already in use"):
            app.serve(str(llama.package_dir), port=port)
    with pytest.raises(ValueError, match="cannot listen on 127.0.0.1 port 70000: .*0-65535"):
        app.serve(str(llama.package_dir), port=70000)


def test_prefill_attention_flag_serves_scores_from_the_prefill_graph(llama):
    """`ortmodule serve --prefill-attention onnx`: the score runs take the prefill graph (its load says
    so) and the scores are the package graph's."""
    body = dict(query=[5, 6, 9, 11], items=[[7, 3], [8], [40, 41, 42]], label_token_ids=[1, 2, 30], apply_softmax=False)
    expected = torch.tensor(ortmodule.score(OrtModelForCausalLM.from_pretrained(llama.package_dir), None, body["query"],
                                            body["items"], body["label_token_ids"]))
    output = []
    with served(sys.executable, "-m", "ortmodule", "serve", str(llama.package_dir), "--prefill-attention", "onnx",
                output=output) as url:
        scores = torch.tensor(httpx.post(url + "/v1/score", json=body).json()["scores"])
    assert "runs without a cache take the prefill graph" in output[0], output[0][-2000:]
    assert ((scores - expected).abs() / expected).max().item() < 1e-4


def test_enable_fp32_lm_head_serves_the_float32_head(build, tmp_path):
    """`--enable-fp32-lm-head` (SGLang's and vLLM's flag) on a package casting half-precision logits
    to float32: the scores are those of the model loaded with `rewrite_lm_head="float32"`, not
    those of the half-precision head."""
    casting = float32_logits_copy(build("llama", precision="fp16"), tmp_path / "package")
    body = dict(query=[5, 6, 9, 11], items=[[7, 3], [8], [40, 41, 42]], label_token_ids=[1, 2, 30], apply_softmax=False)
    expected = {choice: ortmodule.score(OrtModelForCausalLM.from_pretrained(casting, rewrite_lm_head=choice,
                                                                            cache_dir=tmp_path / "graphs"),
                                        None, body["query"], body["items"], body["label_token_ids"])
                for choice in (True, "float32")}
    with served(sys.executable, "-m", "ortmodule", "serve", str(casting), "--enable-fp32-lm-head") as url:
        scores = torch.tensor(httpx.post(url + "/v1/score", json=body).json()["scores"])
    def relative(other):  # probabilities of a 512-token vocabulary are small: compare their ratios
        return ((scores - torch.tensor(other)).abs() / scores).max().item()

    assert relative(expected["float32"]) < 1e-5 and relative(expected[True]) > 1e-4


def vllm_reference(hf, tokenizer, query, items, labels, apply_softmax, item_first, context=None):
    """vLLM's generative scoring by its own rules: the query tokenized with special tokens, each item
    without, joined as ids, cut to context - 1 tokens; the first label's probability after it."""
    query_ids = tokenizer(query).input_ids if isinstance(query, str) else query
    scores = []
    for item in items:
        item_ids = tokenizer(item, add_special_tokens=False).input_ids if isinstance(item, str) else item
        ids = item_ids + query_ids if item_first else query_ids + item_ids
        ids = ids[: context - 1] if context else ids
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)[labels]
        scores.append((torch.softmax(logprobs, -1) if apply_softmax else logprobs.exp())[0].item())
    return scores


@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_vllms_generative_scoring_matches_transformers(setup, apply_softmax, item_first):
    """vLLM's `POST /generative_scoring` (vLLM 0.33): text, token ids, and a text query with token-id
    items, each item's `score` the first label's probability as vLLM computes it, its answer's shape
    and usage (one generated token an item, as vLLM counts); the request id from `X-Request-Id`."""
    live, hf, tokenizer = setup
    labels = labels_for(tokenizer)
    for query, items in ((QUERY, ITEMS), ([10, 11, 12, 13, 14, 15], [[20], [21, 22, 23]]), (QUERY, [[20], [21, 22]])):
        body = dict(query=query, items=items, label_token_ids=labels, apply_softmax=apply_softmax,
                    item_first=item_first, model="tiny-llama", priority=3, cache_salt="x" * 43, temperature=0.0)
        response = live.client.post("/generative_scoring", json=body, headers={"X-Request-Id": "abc"})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["id"] == "generative-scoring-abc" and answer["object"] == "list"
        assert answer["model"] == "tiny-llama" and isinstance(answer["created"], int)
        assert [d["index"] for d in answer["data"]] == list(range(len(items)))
        assert all(d["object"] == "score" for d in answer["data"])
        expected = vllm_reference(hf, tokenizer, query, items, labels, apply_softmax, item_first)
        assert max(abs(d["score"] - e) for d, e in zip(answer["data"], expected)) < 1e-5
        query_ids = tokenizer(query).input_ids if isinstance(query, str) else query
        prompt_tokens = sum(len(query_ids) + len(tokenizer(i, add_special_tokens=False).input_ids
                                                 if isinstance(i, str) else i) for i in items)
        assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(items),
                                   "total_tokens": prompt_tokens + len(items)}


def test_vllms_generative_scoring_cuts_a_long_prompt_and_refuses_bad_requests_in_openais_shape(setup):
    """A prompt past the context is cut to its first context - 1 tokens, as vLLM cuts it; what vLLM
    refuses is a 400 (a model it does not serve a 404) in OpenAI's error shape, and the next request
    succeeds."""
    live, hf, tokenizer = setup
    query, items = list(range(4, 200)), [list(range(5, 105)), [7]]  # 296 tokens: past the 256 context
    answer = live.client.post("/generative_scoring", json=dict(query=query, items=items, label_token_ids=[5, 6]))
    assert answer.status_code == 200, answer.text
    expected = vllm_reference(hf, tokenizer, query, items, [5, 6], True, False, context=256)
    assert max(abs(d["score"] - e) for d, e in zip(answer.json()["data"], expected)) < 1e-5
    assert answer.json()["usage"]["prompt_tokens"] == 255 + len(query) + 1
    for change, status, message in ((dict(items=[]), 400, "at least one item"),
                                    (dict(label_token_ids=[]), 400, "label_token_ids is empty"),
                                    (dict(label_token_ids=[5, 512]), 400, "outside the vocabulary"),
                                    (dict(items=[[5], "text"]), 400, "items"),
                                    (dict(model="another"), 404, "does not exist")):
        body = dict(query=QUERY, items=ITEMS, label_token_ids=[5, 6]) | change
        response = live.client.post("/generative_scoring", json=body)
        assert response.status_code == status, response.text
        assert message in response.json()["error"]["message"]
    good = live.client.post("/generative_scoring", json=dict(query=QUERY, items=ITEMS, label_token_ids=[5, 6]))
    assert good.status_code == 200 and len(good.json()["data"]) == len(ITEMS)
    # a label given twice counts once in the softmax over the labels, as in vLLM's dict of them
    twice = live.client.post("/generative_scoring", json=dict(query=QUERY, items=ITEMS, label_token_ids=[5, 6, 5]))
    assert [d["score"] for d in twice.json()["data"]] == [d["score"] for d in good.json()["data"]]
