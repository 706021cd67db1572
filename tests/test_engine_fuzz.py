"""A seeded fuzz test of the serving engine's scheduling: random settings (decode batch size,
prefill chunks, join steps, prompt feeding, the prefix cache, the score token budget, query reuse,
the embeddings' pooling)
and a random mix of concurrent requests (greedy completions whose prompts share prefixes, repeat
exactly or not at all, with log-probabilities and echo sometimes, vLLM's prompt log-probabilities and
token ids, a repetition penalty, allowed tokens, a grammar (structured output), streamed or not; some of them as
SGLang's /generate;
SGLang's score requests, with a label list per item, a temperature, the labels' log-probabilities;
vLLM's generative scoring; OpenAI's embeddings), sent by several
clients at random moments. Whatever runs together, every answer must be transformers' on the request
alone: the greedy text and finish reason, the scores and embeddings within 1e-4; a seeded sample must be what
`model.generate` samples from that prompt alone with that seed. `ENGINE_FUZZ_SEEDS=N` runs more."""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import LiveServer, expected_text, fuzz_seeds, grammar_greedy, hf_greedy, load_pair

from ortmodule import load_tokenizer
from ortmodule.serving import create_app
from ortmodule.serving.generations import DecodeBatch

NAME = "fuzz"
# A Llama most often; a Qwen3, Gemma 3 (sliding-window layers), LFM2 (convolution states) and Qwen3.5
# (linear attention: convolution and recurrent states) sometimes: the prefix cache and feeding keep what
# each kind of cache needs. Not the multimodal fixtures: their random weights generate media placeholder
# ids, after which transformers' logits differ by design (docs/usage.md, "How multimodal packages run for text").
ARCHES = ["llama", "llama", "llama", "qwen3", "gemma3", "lfm2", "qwen3_5"]
# Structured output's grammars (regexes) a greedy completion may keep to: ended by the grammar, by the length, or
# open-ended where the model may end it.
GRAMMARS = ["[a-z ]{1,12}", "(yes|no|maybe)", "[0-9]+", "[A-Za-z]+( [a-z]+)*[.]"]


def draw_settings(rng: random.Random) -> dict:
    return dict(max_rows=rng.choice([1, 2, 4, 8]), prefill_chunk=rng.choice([4, 16, 512]),
                join_steps=rng.choice([0, 1, 4]), feed_tokens=rng.choice([0, 4, 16]),
                prefix_cache_mb=rng.choice([0, 1, 512]), window_ms=rng.choice([0.0, 5.0]),
                token_budget=rng.choice([16, 64, 8192]), reuse_prefix=rng.choice(["auto", "on", "off"]),
                pooler_config={"pooling_type": rng.choice(["LAST", "LAST", "MEAN", "CLS"])})


def draw_requests(rng: random.Random, vocab: int, context: int) -> list[tuple[str, dict]]:
    tokens = lambda n: [rng.randrange(4, vocab) for _ in range(n)]  # noqa: E731
    # 220: prompts at the context's end (a completion's tokens fill it to one position short of SGLang's cut)
    prefixes = [tokens(n) for n in (20, 40, 70, min(220, context - 36))]
    requests, sent = [], []
    for _ in range(rng.randint(6, 16)):
        if rng.random() < 0.65:
            if sent and rng.random() < 0.2:
                prompt = list(rng.choice(sent))  # an exact repeat
            else:
                prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + tokens(rng.randint(1, 30))
            sent.append(prompt)
            room = context - 1 - len(prompt)
            body = {"prompt": prompt, "max_tokens": min(rng.randint(1, 20), room), "temperature": 0}
            if rng.random() < 0.25:  # a seeded sample: each row draws from its own generator
                body.update(temperature=round(rng.uniform(0.3, 1.5), 2), top_p=rng.choice([1.0, 0.9, 0.5]),
                            seed=rng.randrange(2**31))
            if rng.random() < 0.3:
                body.update(logprobs=2, echo=rng.random() < 0.5)
            elif rng.random() < 0.3:
                body.update(stream=True)
            if not body.get("stream") and rng.random() < 0.2:  # vLLM's, every prompt position ranked
                body.update(prompt_logprobs=rng.choice([0, 2]))
            if rng.random() < 0.3:  # vLLM's, streamed chunk by chunk or whole
                body.update(return_token_ids=True)
            if rng.random() < 0.2 and not body.get("echo") and "prompt_logprobs" not in body:
                body.update(sglang=True)  # sent through SGLang's /generate
            if rng.random() < 0.3:
                body.update(stop=[rng.choice(["e", "an", " t", "s", "\u00e9"])])
            if rng.random() < 0.2:  # vLLM's, greedy rows too (an echo's one token chosen from its prefill)
                body.update(repetition_penalty=rng.choice([1.3, 0.8]))
            if rng.random() < 0.15 and not body.get("sglang"):  # vLLM's: every other token masked
                body.update(allowed_token_ids=sorted(rng.sample(range(vocab), rng.randint(2, 60))))
            plain = not set(body) & {"stop", "repetition_penalty", "echo", "prompt_logprobs", "return_token_ids",
                                     "sglang", "allowed_token_ids"}
            if plain and not body["temperature"] and rng.random() < 0.5:  # structured output: a greedy row's grammar
                body.update(guided_regex=rng.choice(GRAMMARS))
            requests.append(("completion", body))
        elif rng.random() < 0.2:  # OpenAI's embeddings: each input's last-token final state
            requests.append(("embed", {"input": [tokens(rng.randint(1, 12)) for _ in range(rng.randint(1, 4))],
                                       "normalize": rng.random() < 0.7, "encoding_format": "float"}))
        else:
            query = (rng.choice(prefixes) if rng.random() < 0.5 else []) + tokens(rng.randint(1, 10))
            items = [tokens(rng.randint(1, 8)) for _ in range(rng.randint(1, 4))]
            labels = lambda: rng.sample(range(vocab), rng.randint(1, 3))  # noqa: E731
            body = {"query": query, "items": items, "apply_softmax": rng.random() < 0.5,
                    "item_first": rng.random() < 0.2}
            if rng.random() < 0.25:  # vLLM's: the first label's probability
                requests.append(("generative", {**body, "label_token_ids": labels()}))
                continue
            per_item = rng.random() < 0.3  # SGLang 0.5.23's list per item, of their own lengths
            body["label_token_ids"] = [labels() for _ in items] if per_item else labels()
            if body["apply_softmax"] and rng.random() < 0.3:
                body["temperature"] = rng.choice([0.5, 2.0])
            if rng.random() < 0.3:
                body["return_token_logprobs"] = True
            requests.append(("score", body))
    return requests


def label_logprobs(hf, body: dict) -> list[torch.Tensor]:
    """Each item's labels' log-probabilities after its prompt, from transformers (float64)."""
    lists = body["label_token_ids"]
    lists = lists if isinstance(lists[0], list) else [lists] * len(body["items"])
    out = []
    for item, labels in zip(body["items"], lists, strict=True):
        ids = item + body["query"] if body["item_first"] else body["query"] + item
        with torch.no_grad():
            out.append(torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)[labels])
    return out


def check_prompt_logprobs(hf, prompt: list[int], positions: list, top: int, where: str) -> None:
    """vLLM's `prompt_logprobs` against transformers: each prompt token's log-probability and rank (a
    rank within float32's reach of ties), the `top` most likely after it."""
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    assert len(positions) == len(prompt) and positions[0] is None, where
    for i in range(1, len(prompt)):
        row, entries = reference[i - 1], positions[i]
        token = entries[str(prompt[i])]
        assert abs(token["logprob"] - row[prompt[i]].item()) < 1e-4, where
        near = 1e-4
        # the tokens surely above it, plus one, up to those within reach of it (itself included)
        assert int((row > row[prompt[i]] + near).sum()) < token["rank"] <= int((row > row[prompt[i]] - near).sum())
        others = {int(t): e for t, e in entries.items() if e["rank"] <= top and int(t) != prompt[i]}
        assert len(entries) - 1 <= top and all(abs(e["logprob"] - row[t].item()) < 1e-4 for t, e in others.items())
        assert len({*others, prompt[i]}) >= top, where  # the top ones are there, the prompt token among them or not
        if top:
            least = row.topk(top).values[-1].item()
            assert all(row[t].item() > least - 1e-4 for t in others), where




def streamed(url: str, body: dict) -> dict:
    """A streamed completion's events joined into the answer's shape (text, finish reason)."""
    text, reason, tokens, prompts = "", None, [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as events:
        assert events.status_code == 200
        for line in events.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                tokens += choice.get("token_ids", [])
                prompts += [choice["prompt_token_ids"]] if "prompt_token_ids" in choice else []
    answer = {"text": text, "finish_reason": reason}
    if body.get("return_token_ids"):
        assert len(prompts) == 1
        answer.update(token_ids=tokens, prompt_token_ids=prompts[0])
    return {"choices": [answer]}


def sglang_generate(server, body: dict) -> dict:
    """A completion's request sent as SGLang's `/generate` (streamed or not), its answer in the
    completion's shape: SGLang's output ids and, with `logprobs`, its output token log-probabilities."""
    params = {"max_new_tokens": body["max_tokens"], "temperature": float(body["temperature"])}
    if body["temperature"]:
        params.update(top_p=body["top_p"], sampling_seed=body["seed"])
    if "stop" in body:
        params["stop"] = body["stop"]
    if "repetition_penalty" in body:
        params["repetition_penalty"] = body["repetition_penalty"]
    request = {"input_ids": body["prompt"], "sampling_params": params, "stream": bool(body.get("stream"))}
    if "logprobs" in body and not body.get("stream"):
        request.update(return_logprob=True, top_logprobs_num=body["logprobs"])
    if request["stream"]:
        with httpx.stream("POST", server.url + "/generate", json=request, timeout=120) as events:
            assert events.status_code == 200
            lines = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        answer = json.loads(lines[-2])  # the output so far, in the last event: all of it
    else:
        response = server.client.post("/generate", json=request, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
    choice = {"text": answer["text"], "finish_reason": answer["meta_info"]["finish_reason"]["type"],
              "token_ids": answer["output_ids"], "prompt_token_ids": body["prompt"]}
    return {"choices": [choice]}


def check_prometheus(server, metrics: dict, completions: list[dict]) -> None:
    """vLLM's series in /metrics against the engine's own counts: every generation row (a completion, one prompt,
    n 1, not answered from its prefill alone) ended once, as stop or length (none aborted or failed), as many
    of each as the answers say at most, each an end-to-end latency; none running or waiting."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(sample.name, sample.labels.get("finished_reason")): sample.value for family in
               text_string_to_metric_families(server.client.get("/metrics").text) for sample in family.samples
               if "le" not in sample.labels and "kind" not in sample.labels}
    rows = metrics["requests"].get("generation", 0)
    ended = {reason: samples[("vllm:request_success_total", reason)] for reason in ("stop", "length", "abort", "error")}
    said = {reason: sum(c["finish_reason"] == reason for a in completions for c in a["choices"])
            for reason in ("stop", "length")}
    assert sum(ended.values()) == rows and ended["abort"] == ended["error"] == 0, (ended, rows)
    assert ended["stop"] <= said["stop"] and ended["length"] <= said["length"], (ended, said)
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] == rows
    assert samples[("vllm:time_to_first_token_seconds_count", None)] <= rows
    assert samples[("vllm:num_requests_running", None)] == samples[("vllm:num_requests_waiting", None)] == 0


@pytest.mark.parametrize("seed", fuzz_seeds("ENGINE_FUZZ_SEEDS", 8))
def test_engine_fuzz(build, seed, monkeypatch):
    rng = random.Random(seed)
    fixture = build(rng.choice(ARCHES))
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    settings = draw_settings(rng)
    # The decode batch's first cache (slots, positions): small ones grow and shrink while rows run.
    first = rng.choice([(4, 256), (1, 8), (2, 16)])
    monkeypatch.setattr(DecodeBatch, "FIRST_SLOTS", first[0])
    monkeypatch.setattr(DecodeBatch, "FIRST_POSITIONS", first[1])
    settings_drawn = dict(settings, first_cache=first)
    requests = draw_requests(rng, min(len(tokenizer), model.config.vocab_size), model.package.context_length)
    clients = rng.randint(1, 6)
    delays = [rng.uniform(0, 0.02) for _ in requests]
    server = LiveServer(create_app(model, tokenizer, name=NAME, **settings))
    try:
        def send(i: int):
            time.sleep(delays[i])
            kind, body = requests[i]
            if body.get("sglang"):
                return sglang_generate(server, body)
            if body.get("stream"):
                return streamed(server.url, {"model": NAME, **body})
            path = {"completion": "/v1/completions", "score": "/v1/score", "generative": "/generative_scoring",
                    "embed": "/v1/embeddings"}[kind]
            response = server.client.post(path, json={"model": NAME, **body}, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()

        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(send, range(len(requests))))
        metrics = server.client.get("/metrics?format=json").json()
        assert metrics["running_rows"] == 0
        check_prometheus(server, metrics, [a for (kind, _), a in zip(requests, answers) if kind == "completion"])
        # with no rows left, the decode batch's cache has its first slots again, and under 4x its positions
        least = max([first[1]] + [kv.window or 0 for kv in model.decoder.spec.layers])
        if model.decoder.spec.shares_kv_buffer:
            held = metrics["decode_cache"]
            assert held["slots"] == min(first[0], settings["max_rows"]) and held["positions"] < 4 * least, held
    finally:
        server.stop()
    case = f"seed {seed}: {fixture.spec.arch}, {settings_drawn}, {clients} clients"
    for i, ((kind, body), answer) in enumerate(zip(requests, answers, strict=True)):
        if kind == "completion":
            penalty = {"repetition_penalty": body["repetition_penalty"]} if "repetition_penalty" in body else {}
            if "allowed_token_ids" in body:  # as transformers' suppress_tokens of every other token
                penalty["suppress_tokens"] = sorted(set(range(hf.config.vocab_size)) - set(body["allowed_token_ids"]))
            if "guided_regex" in body:  # transformers' greedy generate under the same grammar, alone
                from llguidance import LLMatcher

                grammar = LLMatcher.grammar_from_regex(body["guided_regex"])
                tokens, complete = grammar_greedy(hf, tokenizer, body["prompt"], grammar, body["max_tokens"])
                text, reason = expected_text(tokenizer, tokens)
                choice = answer["choices"][0]
                reason = "stop" if complete else reason
                assert (choice["text"], choice["finish_reason"]) == (text, reason), f"request {i}: {body}; {case}"
                continue
            if body["temperature"]:  # as `model.generate` samples the prompt alone with that seed (docs/serving.md)
                out = model.generate(torch.tensor([body["prompt"]]), max_new_tokens=body["max_tokens"], do_sample=True,
                                     temperature=body["temperature"], top_p=body["top_p"], top_k=0, **penalty,
                                     generator=torch.Generator().manual_seed(body["seed"]))
                tokens = out[0, len(body["prompt"]):].tolist()
            else:
                tokens = hf_greedy(hf, body["prompt"], body["max_tokens"], **penalty)
            text, reason = expected_text(tokenizer, tokens, body.get("stop", ()))
            choice = answer["choices"][0]
            # vLLM leaves the prompt's text out with the token ids; SGLang's answer holds none
            if body.get("echo") and not body.get("return_token_ids") and not body.get("sglang"):
                text = tokenizer.decode(body["prompt"], skip_special_tokens=True) + text
            assert (choice["text"], choice["finish_reason"]) == (text, reason), f"request {i}: {body}; {case}"
            if body.get("return_token_ids") or body.get("sglang"):
                assert choice["prompt_token_ids"] == body["prompt"], f"request {i}: {body}; {case}"
                eos = tokenizer.eos_token_id
                kept = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
                if "stop" in body:  # up to the token that completed the stop string
                    kept = next((kept[:k] for k in range(1, len(kept) + 1) if any(
                        s in tokenizer.decode(kept[:k], skip_special_tokens=True) for s in body["stop"])), kept)
                assert choice["token_ids"] == kept, f"request {i}: {body}; {case}"
            if "prompt_logprobs" in body:
                check_prompt_logprobs(hf, body["prompt"], choice["prompt_logprobs"], body["prompt_logprobs"],
                                      f"request {i}: {body}; {case}")
            continue
        if kind == "embed":
            for ids, item in zip(body["input"], answer["data"], strict=True):
                with torch.no_grad():
                    states = hf.model(torch.tensor([ids])).last_hidden_state[0].double()
                pooling = settings["pooler_config"]["pooling_type"]
                state = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]
                expected = torch.nn.functional.normalize(state, dim=-1) if body["normalize"] else state
                worst = (torch.tensor(item["embedding"], dtype=torch.float64) - expected).abs().max().item()
                assert worst < 1e-4 * max(1.0, expected.abs().max().item()), f"request {i}: off by {worst}; {case}"
            continue
        logprobs = label_logprobs(hf, body)
        temperature = body.get("temperature", 1.0)
        expected = [torch.softmax(row / temperature, -1) if body["apply_softmax"] else row.exp() for row in logprobs]
        if kind == "generative":
            expected = [row[:1] for row in expected]
            got = [[entry["score"]] for entry in answer["data"]]
        else:
            got = answer["scores"]
            if body.get("return_token_logprobs"):
                got, expected = got + answer["token_logprobs"], expected + logprobs
        assert len(got) == len(expected), f"request {i}: {body}; {case}"
        worst = max((torch.tensor(g, dtype=torch.float64) - e).abs().max().item() for g, e in zip(got, expected))
        assert worst < 1e-4, f"request {i}: off by {worst}; {body}; {case}"
