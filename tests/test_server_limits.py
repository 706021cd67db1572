"""The server's limits, checked before anything is tokenized: body size, item count, text far over
the context (refused from its byte length), unknown fields; tokenizing never blocks other clients;
a graceful shutdown answers what it accepted; memory stays flat over a soak; no request is lost on a
connection reused after idling."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import LiveServer, hold_worker, load_pair

from ortmodule import load_tokenizer
from ortmodule.serving import create_app
from ortmodule_dev.serve import ServeProcess

GOOD = dict(query="The capital of France is", items=[" Paris", " Rome"], label_token_ids=[5, 6])


class CountingTokenizer:
    """The package's tokenizer, counting the texts it tokenizes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, 0

    def __call__(self, texts, *args, **kwargs):
        self.texts += len(texts)
        return self.tokenizer(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def live(llama):
    model, _ = load_pair(llama)
    app = create_app(model, load_tokenizer(llama.package_dir), name="tiny", window_ms=0, max_body_bytes=100_000,
                     max_items=8)
    server = app.state.served
    server.tokenizer = CountingTokenizer(server.tokenizer)
    live = LiveServer(app)
    yield live, server
    live.stop()


def refused_untokenized(live, server, status, message, **request):
    before = server.tokenizer.texts, live.client.get("/metrics?format=json").json()["rejected_bad"]
    response = live.client.post("/v1/score", **request)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status and message in body["message"]
    assert server.tokenizer.texts == before[0]  # refused before tokenizing
    assert live.client.get("/metrics?format=json").json()["rejected_bad"] == before[1] + 1
    assert live.client.post("/v1/score", json=GOOD).status_code == 200


def test_a_body_over_the_limit_is_refused_unread(live):
    live, server = live
    big = {**GOOD, "query": "word " * 30_000}
    refused_untokenized(live, server, 413, "request body over 100000 bytes", json=big)

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"query": "'
        for _ in range(200):
            yield b"x" * 1000
        yield b'", "items": ["a"], "label_token_ids": [1]}'

    refused_untokenized(live, server, 413, "request body over", content=chunks(),
                        headers={"content-type": "application/json"})


def test_too_many_items_and_text_beyond_the_context_are_refused_untokenized(live):
    live, server = live
    refused_untokenized(live, server, 400, "items has 9 entries; this server takes at most 8",
                        json={**GOOD, "items": ["a"] * 9})
    limit = server.max_text_bytes
    refused_untokenized(live, server, 400, "more than fits the model's context of 256 tokens",
                        json={**GOOD, "query": "y" * (limit + 1)})
    refused_untokenized(live, server, 400, "items[1]:", json={**GOOD, "items": ["a", "z" * (limit + 1)]})


def test_unknown_fields_are_refused(live):
    live, server = live
    refused_untokenized(live, server, 400, "labels", json={**GOOD, "labels": [1]})


def test_tokenizing_a_large_text_does_not_block_other_clients(llama):
    """A text just under the byte bound takes a while to tokenize; small requests from other
    clients are answered meanwhile, not after it."""
    model, _ = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    app = create_app(model, tokenizer, window_ms=0)
    server = app.state.served
    entered, release = threading.Event(), threading.Event()
    real = server.tokenizer

    class Slow(CountingTokenizer):
        def __call__(self, texts, *args, **kwargs):
            if any(len(t) > 1000 for t in texts):
                entered.set()
                release.wait(30)  # a slow tokenization, held until the small requests are answered
            return super().__call__(texts, *args, **kwargs)

    server.tokenizer = Slow(real)
    live = LiveServer(app)
    try:
        with ThreadPoolExecutor(1) as pool:
            text = "word " * (server.max_text_bytes // 5 - 10)  # under the byte bound: it is tokenized
            large = pool.submit(live.client.post, "/v1/score", json={**GOOD, "query": text})
            assert entered.wait(30)
            start = time.monotonic()
            for _ in range(3):
                assert httpx.post(live.url + "/v1/score", json=GOOD, timeout=10).status_code == 200
            assert time.monotonic() - start < 5
            release.set()
            assert large.result().status_code == 400  # its tokens are over the 256-token context
    finally:
        release.set()
        live.stop()


def test_a_graceful_shutdown_answers_what_it_accepted(llama):
    model, _ = load_pair(llama)
    app = create_app(model, load_tokenizer(llama.package_dir), window_ms=0)
    server = app.state.served
    entered, release, held = hold_worker(server)
    live = LiveServer(app)
    with ThreadPoolExecutor(5) as pool:
        answers = [pool.submit(httpx.post, live.url + "/v1/score", json=GOOD, timeout=60) for _ in range(5)]
        assert entered.wait(30)
        deadline = time.monotonic() + 30
        while server.engine.waiting.count + sum(held) < 5:  # some held by the model thread, the others waiting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        live.server.should_exit = True  # what SIGTERM does
        time.sleep(0.3)
        release.set()
        statuses = [a.result().status_code for a in answers]
    live.thread.join(30)
    assert statuses == [200] * 5
    assert not live.thread.is_alive()  # and then the server did exit


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow
def test_memory_stays_flat_over_a_soak(llama):
    """`ortmodule serve` in its own process: 300 requests, a tenth of them far too large, each
    refused before it is tokenized; resident memory grows by less than 60 MB over the first
    hundred and less than 40 MB over the next two hundred (holding each refused 7.5 MB body would
    be 150 MB there; the allocator's own drift measured up to 22 MB on the 2-vCPU VM)."""
    with ServeProcess(llama.package_dir) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for _ in range(20):  # warm up
                client.post("/v1/score", json=GOOD)
            huge = {**GOOD, "query": "word " * 1_500_000}  # 7.5 MB: under the body limit, over the context
            start = rss_mb(server.pid)
            sizes = []
            for i in range(300):
                response = client.post("/v1/score", json=huge if i % 10 == 0 else GOOD)
                assert response.status_code == (400 if i % 10 == 0 else 200), response.text
                if i % 100 == 99:
                    sizes.append(rss_mb(server.pid))
        # Parsing a 7.5 MB body takes some memory once (the allocator keeps it for the next); it
        # must not grow with every refused request (it did, 160 MB in 300 requests, while a refused
        # request's error held its body in a reference cycle).
        assert sizes[0] - start < 60 and sizes[-1] - sizes[0] < 40, f"resident memory {start:.0f} MB -> {sizes}"


@pytest.mark.slow
def test_no_request_is_lost_on_a_connection_reused_after_idling(llama):
    """Clients with httpx's defaults (its pools keep an idle connection 5 s, as the OpenAI client's)
    each reuse their connection after idling 4.99-5.01 s, 500 times in all: every request is
    answered. With the server's keep-alive at 5 s (uvicorn's default, the server's until session
    57) the server closed connections the clients were reusing: this test lost 8 of the 500
    requests (`ReadError`, `RemoteProtocolError`) on the 2-vCPU VM, and session 57's H200 run 3 of
    1,779 under load."""
    import asyncio
    import random
    from collections import Counter

    outcomes = Counter()

    async def client(url, seed):
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url) as c:
            for _ in range(5):
                try:
                    outcomes[(await c.get("/health")).status_code] += 1
                except httpx.HTTPError as e:
                    outcomes[type(e).__name__] += 1
                await asyncio.sleep(rng.uniform(4.99, 5.01))

    async def clients(url):
        await asyncio.gather(*(client(url, seed) for seed in range(100)))

    with ServeProcess(llama.package_dir) as server:
        asyncio.run(clients(server.url))
    assert outcomes == {200: 500}, dict(outcomes)
