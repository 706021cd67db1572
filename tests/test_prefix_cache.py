"""Prefix caching and prompt feeding in the serving engine: prompts that begin as an earlier one
start past the shared part (from the cache, or a token per decode step of the running batch), and
every answer still equals transformers' greedy continuation of the whole prompt; the cache keeps to
its byte budget."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import LiveServer, expected_text, load_pair

from ortmodule import load_tokenizer
from ortmodule.serving import create_app
from ortmodule.serving.prefixes import BLOCK, Prefixes

NAME = "tiny"


@pytest.fixture(scope="module")
def pair(build):
    fixture = build("llama")
    model, hf = load_pair(fixture)
    return model, hf, load_tokenizer(fixture.package_dir)


def greedy(hf, ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def complete(client, prompt, max_tokens) -> dict:
    response = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "temperature": 0,
                                                    "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def check(hf, tokenizer, prompt, new, choice) -> None:
    text, reason = expected_text(tokenizer, greedy(hf, prompt, new))
    assert (choice["text"], choice["finish_reason"]) == (text, reason), f"prompt of {len(prompt)} tokens"


@pytest.fixture()
def server(pair):
    model, _, tokenizer = pair
    live = LiveServer(create_app(model, tokenizer, name=NAME, prefill_chunk=64, max_rows=8, feed_tokens=8))
    yield live
    live.stop()


def test_prompts_sharing_a_prefix_start_past_it(server, pair):
    """A 40-token shared beginning (a system prompt), sent once; then, while a long generation
    runs, twelve prompts that begin with it (3 to 30 tokens after it, one sent again whole) are
    fed into the running batch or started past the prefix. Every answer equals transformers'."""
    _, hf, tokenizer = pair
    rng = random.Random(3)
    system = [rng.randrange(4, 512) for _ in range(40)]
    first = system + [rng.randrange(4, 512) for _ in range(5)]
    check(hf, tokenizer, first, 6, complete(server.client, first, 6))
    prompts = [system + [rng.randrange(4, 512) for _ in range(n)] for n in (3, 8, 30, 1, 12, 5, 20, 7, 2, 16, 4)]
    prompts.append(first)  # the same prompt again: all but its last token from the cache
    long_prompt = [rng.randrange(4, 512) for _ in range(9)]
    body = {"model": NAME, "prompt": long_prompt, "max_tokens": 120, "temperature": 0}
    before = server.client.get("/metrics?format=json").json()
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        running = pool.submit(lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120).json())
        answers = list(pool.map(lambda p: complete(server.client, p, 10), prompts))
        check(hf, tokenizer, long_prompt, 120, running.result()["choices"][0])
    for prompt, answer in zip(prompts, answers):
        check(hf, tokenizer, prompt, 10, answer)
    after = server.client.get("/metrics?format=json").json()
    hits = after["prefix_cache"]["hits"] - before["prefix_cache"]["hits"]
    reused = after["prefix_cache"]["reused_tokens"] - before["prefix_cache"]["reused_tokens"]
    assert hits >= len(prompts) - 1 and reused >= 40 * (len(prompts) - 1), after["prefix_cache"]
    assert after["fed_tokens"] > before["fed_tokens"]


def test_an_idle_engine_starts_a_prompt_past_its_cached_prefix(server, pair):
    """A prompt of 150 tokens, then one sharing its first 120: run alone from the cached prefix
    (the rest in one run of its own) and equal to transformers."""
    _, hf, tokenizer = pair
    rng = random.Random(4)
    shared = [rng.randrange(4, 512) for _ in range(120)]
    first = shared + [rng.randrange(4, 512) for _ in range(30)]
    second = shared + [rng.randrange(4, 512) for _ in range(20)]
    check(hf, tokenizer, first, 8, complete(server.client, first, 8))
    before = server.client.get("/metrics?format=json").json()["prefix_cache"]
    check(hf, tokenizer, second, 8, complete(server.client, second, 8))
    after = server.client.get("/metrics?format=json").json()["prefix_cache"]
    assert after["hits"] == before["hits"] + 1 and after["reused_tokens"] == before["reused_tokens"] + 120


def test_without_the_cache_nothing_is_kept(pair):
    model, hf, tokenizer = pair
    live = LiveServer(create_app(model, tokenizer, name=NAME, prefix_cache_mb=0, feed_tokens=0))
    try:
        prompt = list(range(5, 60))
        for _ in range(2):
            check(hf, tokenizer, prompt, 5, complete(live.client, prompt, 5))
        metrics = live.client.get("/metrics?format=json").json()
        assert metrics["prefix_cache"] == {"hits": 0, "reused_tokens": 0, "entries": 0, "bytes": 0}
        assert metrics["fed_tokens"] == 0
    finally:
        live.stop()


def kv(length: int, layers: int = 2, value: float = 0.0) -> tuple[list, list]:
    return ([torch.full((2, length + 3, 4), value) for _ in range(layers)],
            [torch.full((2, length + 3, 4), -value) for _ in range(layers)])


def test_the_store_finds_the_longest_exact_prefix_and_keeps_its_budget():
    per_token = 2 * 2 * 2 * 4 * 4  # layers x (key, value) x heads x head size x 4 bytes
    store = Prefixes(budget=100 * per_token)
    a = list(range(100, 140))  # 40 tokens
    store.add(a, *kv(40, value=1.0))
    assert store.nbytes == 40 * per_token and store.entries
    entry, shared = store.find(a[:35] + [7, 8, 9])
    assert shared == 35 and torch.equal(entry.keys[0], torch.ones(2, 40, 4))  # copied, only the prompt's part
    assert store.find(a[:BLOCK - 1] + [1] * 20) == (None, 0)  # not a whole block in common
    assert store.find([1] * 40) == (None, 0)
    store.add(a[:10], *kv(10))  # shorter than a block: not kept
    assert len(store.entries) == 1
    store.add(a[:30], *kv(30))  # held already (a longer entry begins with it)
    assert len(store.entries) == 1
    store.add(a + [5] * 8, *kv(48, value=2.0))  # extends the entry: replaces it
    assert len(store.entries) == 1 and store.nbytes == 48 * per_token
    b = list(range(300, 340))
    store.add(b, *kv(40))  # 88 tokens of 100
    c = list(range(500, 540))
    store.add(c, *kv(40))  # over the budget: the least recently used (a's extension) goes
    assert store.nbytes <= 100 * per_token and store.find(a)[0] is None
    assert store.find(b + [1])[1] == 40 and store.find(c)[1] == 40
    store.find(b)  # b used last: c goes next
    store.add(list(range(700, 740)), *kv(40))
    assert store.find(c)[0] is None and store.find(b)[1] == 40
    store.add(list(range(900, 1200)), *kv(300))  # larger than the whole budget: not kept
    assert store.find(list(range(900, 1200)))[0] is None


def test_a_block_shared_by_two_entries_stays_findable_when_one_goes():
    store = Prefixes(budget=10**9)
    system = list(range(1000, 1000 + BLOCK))
    store.add(system + [1] * 10, *kv(BLOCK + 10))
    store.add(system + [2] * 10, *kv(BLOCK + 10))
    store._drop(store.find(system + [2] * 10)[0])
    entry, shared = store.find(system + [3] * 4)
    assert entry is not None and shared == BLOCK


def test_a_hash_collision_costs_a_shorter_match_not_a_wrong_one(monkeypatch):
    """Every block made to hash alike: a lookup follows the chain to an entry that differs, and
    the exact comparison gives what they really share."""
    import ortmodule.serving.prefixes as prefixes

    monkeypatch.setattr(prefixes, "hash", lambda value: 1, raising=False)
    store = Prefixes(budget=10**9)
    store.add(list(range(50, 90)), *kv(40))
    entry, shared = store.find(list(range(50, 58)) + list(range(200, 240)))
    assert shared == 8


def test_concurrent_prompts_with_and_without_a_prefix(server, pair):
    """Thirty prompts at once, half beginning alike, into a batch of eight: the same answers as
    transformers, whichever way each started."""
    _, hf, tokenizer = pair
    rng = random.Random(5)
    system = [rng.randrange(4, 512) for _ in range(24)]
    prompts = [(system if i % 2 else []) + [rng.randrange(4, 512) for _ in range(rng.randrange(1, 40))]
               for i in range(30)]
    barrier = threading.Barrier(len(prompts))

    def send(prompt):
        barrier.wait()
        return complete(server.client, prompt, 6)

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(send, prompts))
    for prompt, answer in zip(prompts, answers):
        check(hf, tokenizer, prompt, 6, answer)
