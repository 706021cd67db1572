"""SGLang's native `POST /generate` on `ortmodule serve` (ortmodule/serving/generate_routes.py), against
transformers on the same weights: greedy text and token ids, finish reasons, the log-probabilities of
the output and of the prompt in SGLang's shape, a batch, `n`, sampling with a seed as `/v1/completions`
samples it, the stream; lm-eval's `sglang-generate` backend against it; refusals named."""

import json

import pytest
import torch
from helpers import OPENAI_NAME, expected_text, hf_greedy

NAME = OPENAI_NAME


@pytest.fixture(scope="module")
def setup(openai_live):
    return openai_live


def cut_at_eos(tokenizer, tokens: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_text_and_ids_equal_transformers(setup):
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("The quick brown fox").input_ids
    tokens = hf_greedy(hf, ids, 10)
    for prompt in ({"text": "The quick brown fox"}, {"input_ids": ids}):
        answer = live.client.post("/generate", json={**prompt, "sampling_params": {"max_new_tokens": 10,
                                                                                    "temperature": 0}})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        text, reason = expected_text(tokenizer, tokens)
        assert body["text"] == text and body["output_ids"] == cut_at_eos(tokenizer, tokens)
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(body["output_ids"])
        expected = {"type": "length", "length": 10} if reason == "length" else {"type": "stop",
                                                                                 "matched": tokenizer.eos_token_id}
        assert meta["finish_reason"] == expected and isinstance(meta["id"], str) and meta["e2e_latency"] > 0
        assert "input_token_logprobs" not in meta


def test_a_batch_and_stop_strings_answer_each_prompt_as_alone(setup):
    """A list of prompts gets a list of answers; a stop string ends a row (`matched` names it) and is
    cut from its text unless `no_stop_trim`. Fields given per prompt (SGLang's batch form) take their
    one value where the prompts' are equal."""
    live, _, hf, tokenizer, _ = setup
    texts = ["Once upon a time there", "The capital of France is"]
    references = [hf_greedy(hf, tokenizer(t).input_ids, 12) for t in texts]
    stop = tokenizer.decode(references[0][3:5])  # a string the first row surely writes
    for trim in (False, True):
        params = {"max_new_tokens": 12, "temperature": 0, "stop": [stop], "no_stop_trim": trim}
        # SGLang's batch form, one entry per prompt, where they are equal: as the one given for all
        answers = live.client.post("/generate", json={"text": texts, "rid": ["a", "b"], "sampling_params":
                                                      [params, params] if trim else params,
                                                      "return_logprob": [False, False]}).json()
        assert [a["meta_info"]["id"] for a in answers] == ["a", "b"]
        for answer, tokens in zip(answers, references, strict=True):
            text, reason = expected_text(tokenizer, tokens, (stop,))
            if reason == "stop" and text != expected_text(tokenizer, tokens)[0]:
                assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
                text += stop if trim else ""
            assert answer["text"] == text
        assert answers[0]["meta_info"]["finish_reason"]["type"] == "stop"


def test_log_probabilities_of_the_prompt_and_the_output_as_sglang_gives_them(setup):
    """`return_logprob` with `logprob_start_len` and `top_logprobs_num`: `[logprob, token id, text]` per
    token (the text with `return_text_in_logprobs`), the prompt's from the start given (its first entry
    null), the output's, the top ones at each position; against transformers' log-softmax."""
    live, _, hf, tokenizer, _ = setup
    ids = [5, 17, 99, 3, 250, 41, 8]
    new = 4
    tokens = hf_greedy(hf, ids, new)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + tokens])).logits[0].double()
    reference = torch.log_softmax(logits, -1)
    for start in (0, 3, -1):
        body = live.client.post("/generate", json={
            "input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
            "return_text_in_logprobs": start == 3, "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                                                        "ignore_eos": True}}).json()
        meta = body["meta_info"]
        assert body["output_ids"] == tokens
        prompt = meta["input_token_logprobs"]
        assert len(prompt) == (0 if start < 0 else len(ids) - start)
        for k, (value, token, text) in enumerate(prompt):
            position = start + k
            assert token == ids[position]
            assert text == (tokenizer.decode([token]) if start == 3 else None)
            if k == 0:
                assert value is None and meta["input_top_logprobs"][0] is None
            else:
                assert abs(value - reference[position - 1, token].item()) < 1e-4
                best = reference[position - 1].topk(2)
                assert [entry[1] for entry in meta["input_top_logprobs"][k]] == best.indices.tolist()
        assert meta["output_token_logprobs_length"] == new
        for k, (value, token, _) in enumerate(meta["output_token_logprobs"]):
            row = reference[len(ids) + k - 1]
            assert token == tokens[k] and abs(value - row[token].item()) < 1e-4
            assert [e[1] for e in meta["output_top_logprobs"][k]] == row.topk(2).indices.tolist()


def test_sampling_with_a_seed_and_n_choices_equal_the_completions_route(setup):
    """SGLang's `sampling_seed` and `n` sample as `/v1/completions` does with `seed` and `n` (one
    engine): choice k of a prompt draws with seed + k; the answers come as a list."""
    live, *_ = setup
    params = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "sampling_seed": 11, "n": 2}
    answers = live.client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": params}).json()
    completion = live.client.post("/v1/completions", json={
        "model": NAME, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 20,
        "seed": 11, "n": 2, "return_token_ids": True}).json()
    assert [a["output_ids"] for a in answers] == [c["token_ids"] for c in completion["choices"]]
    assert [a["text"] for a in answers] == [c["text"] for c in completion["choices"]]
    assert answers[0]["output_ids"] != answers[1]["output_ids"]


def test_a_temperature_past_openais_two_samples_as_generate_does(setup):
    """SGLang takes any temperature >= 0 (OpenAI's routes stop at 2): a seeded sample at 3 is what
    `model.generate` samples from that prompt with that seed."""
    live, model, *_ = setup
    answer = live.client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6, "temperature": 3.0, "sampling_seed": 5, "ignore_eos": True}}).json()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=True, temperature=3.0, top_k=0,
                         top_p=1.0, eos_token_id=None, generator=torch.Generator().manual_seed(5))
    assert answer["output_ids"] == out[0, 3:].tolist()


def test_a_stream_carries_the_output_so_far_then_done(setup):
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("Once upon a time there").input_ids
    tokens = hf_greedy(hf, ids, 10)
    with live.client.stream("POST", "/generate", json={"text": "Once upon a time there", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 10,
                                                                           "temperature": 0}}) as events:
        lines = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each the output so far
    assert chunks[-1]["text"] == expected_text(tokenizer, tokens)[0]
    assert chunks[-1]["output_ids"] == cut_at_eos(tokenizer, tokens)
    assert chunks[-1]["meta_info"]["finish_reason"] is not None and len(chunks) > 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    # with the output's log-probabilities: each event those of its output so far, the last the whole answer's
    request = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    whole = live.client.post("/generate", json=request).json()
    with live.client.stream("POST", "/generate", json={**request, "stream": True}) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] <= len(chunk["output_ids"])
        assert meta["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][: len(
            meta["output_token_logprobs"])]
    last = chunks[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
        assert last[key] == whole["meta_info"][key], key


def test_lm_evals_sglang_generate_backend_scores_as_transformers(setup):
    """lm-eval's `sglang-generate` backend (SGLang's `/generate` with `logprob_start_len` 0): each
    request's log-likelihood against transformers'."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.sglang_generate_API import SGLANGGENERATEAPI

    live, _, hf, tokenizer, fixture = setup
    lm = SGLANGGENERATEAPI(base_url=f"{live.url}/generate", tokenizer=str(fixture.package_dir),
                           tokenized_requests=True, batch_size=1, max_retries=1)
    pairs = [("The capital of France is", " Paris"), ("Two plus two is", " four"), ("Water boils at", " 100 C")]
    answers = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (value, _) in zip(pairs, answers, strict=True):
        whole = tokenizer(context + continuation).input_ids
        begin = len(tokenizer(context).input_ids)
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), -1)
        expected = sum(logprobs[k - 1, whole[k]].item() for k in range(begin, len(whole)))
        assert abs(value - expected) < 1e-3
    asks = [Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 8}), i)
            for i, (context, _) in enumerate(pairs)]
    for (context, _), text in zip(pairs, lm.generate_until(asks), strict=True):
        assert text == expected_text(tokenizer, hf_greedy(hf, tokenizer(context).input_ids, 8), ("\n",))[0]


def test_each_prompt_of_a_batch_gets_its_own_room(setup):
    """SGLang cuts each request's `max_new_tokens` to what the context leaves after its own prompt (less
    one): in a batch, a prompt near the context gets fewer tokens and a short one all it asked for (not
    the long one's). A prompt that leaves no room beside others that have some is refused by name;
    alone it gets none."""
    live, model, hf, tokenizer, _ = setup
    context = model.package.context_length
    long = [5 + (7 * i) % 400 for i in range(context - 6)]  # room for 5 new tokens
    short = tokenizer("The capital of France is").input_ids
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    answers = live.client.post("/generate", json={"input_ids": [long, short], "sampling_params": params}).json()
    assert [a["output_ids"] for a in answers] == [hf_greedy(hf, long, 5), hf_greedy(hf, short, 10)]
    assert [a["meta_info"]["finish_reason"] for a in answers] == [{"type": "length", "length": 5},
                                                                  {"type": "length", "length": 10}]
    streamed = live.client.post("/generate", json={"input_ids": [long, short], "sampling_params": params,
                                                   "stream": True})
    last = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            last[event["index"]] = event["output_ids"]
    assert last == {0: answers[0]["output_ids"], 1: answers[1]["output_ids"]}
    full = long + [9] * 5  # context - 1 tokens: no room
    refused = live.client.post("/generate", json={"input_ids": [full, short], "sampling_params": params})
    assert refused.status_code == 400 and "prompt 0 has" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "sampling_params.max_new_tokens"
    alone = live.client.post("/generate", json={"input_ids": full, "sampling_params": params}).json()
    assert alone["output_ids"] == [] and alone["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


@pytest.mark.parametrize("body, param, message", [
    ({"sampling_params": {"max_new_tokens": 4}}, "text", "send the prompt as text or as input_ids"),
    ({"text": "x", "input_ids": [5]}, "text", "one of them"),
    ({"text": "x", "sampling_params": {"regex": "a+("}}, "sampling_params.regex", "regex parse error"),
    ({"text": "x", "sampling_params": {"ebnf": "root ::= missing"}}, "sampling_params.ebnf", "'missing' not found"),
    ({"text": "x", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag", "non-empty list"),
    ({"text": "x", "sampling_params": {"top_k": 0}}, "sampling_params.top_k", "top_k must be -1"),
    ({"text": "x", "sampling_params": {"max_new_token": 4}}, None, "max_new_token"),
    ({"text": "x", "image_data": "http://x/y.png"}, "image_data", "image_data is not supported"),
    ({"text": "x", "cache_salt": "tenant-a"}, "cache_salt", "cache_salt is not supported"),
    ({"text": ["x", "y"], "sampling_params": [{"temperature": 0}, {"temperature": 1}]}, "sampling_params",
     "differs between the prompts"),
    ({"text": "x", "stream": True, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len",
     "in a stream are not supported"),
    ({"text": ["x", "y"], "sampling_params": [{"temperature": 0}]}, "sampling_params",
     "sampling_params has 1 entries for 2 prompts"),
    ({"text": ["x", "y"], "return_logprob": [True, False]}, "return_logprob", "differs between the prompts"),
    ({"text": ["x", "y"], "rid": ["a"]}, "rid", "rid has 1 entries for 2 prompts"),
    ({"text": []}, "text", "text is empty"),
    ({"input_ids": []}, "input_ids", "prompt 0 has no tokens"),
    ({"input_ids": [[5], []]}, "input_ids", "prompt 1 has no tokens"),
    ({"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens",
     "a stream needs max_new_tokens of at least 1"),
    ({"input_ids": [5, 600]}, "input_ids", "outside the vocabulary"),
    ({"input_ids": [[5, 6], [7, 8]], "sampling_params": {"n": 600}}, "sampling_params.n",
     "takes at most 1024 choices a request"),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len",
     "higher than the number of input tokens 2"),
    ({"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num", "between 0 and 20"),
    ({"input_ids": [5, 6], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
     "sampling_params.min_new_tokens", "min_new_tokens (5) is more than max_new_tokens (2)"),
    ({"input_ids": [5, 6], "sampling_params": {"logit_bias": {"5": 200}}}, "sampling_params.logit_bias",
     "not a number from -100 to 100"),
    # past float32's largest: the logits over infinity were NaN under a grammar's mask, a 500 (request fuzz seed 2943)
    ({"text": "x", "sampling_params": {"temperature": 1e39, "regex": "[a-z ]+"}}, None,
     "temperature: Input should be less than or equal to 340282346638528860000000000000000000000"),
])
def test_bad_requests_are_named(setup, body, param, message):
    live, *_ = setup
    answer = live.client.post("/generate", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    after = live.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
    assert after.status_code == 200
