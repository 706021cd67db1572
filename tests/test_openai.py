"""The OpenAI-compatible routes over real HTTP on 127.0.0.1, against transformers on the same
weights, `model.generate`, the `openai` client and lm-eval's `local-completions` backend."""

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import (
    CHAT_TEMPLATE,
    OPENAI_NAME,
    LiveServer,
    expected_text,
    hf_greedy,
    hold_worker,
    load_pair,
    one_held_one_waiting,
)

from ortmodule import OrtModelForCausalLM, cli, load_tokenizer, runtime
from ortmodule.serving import create_app
from ortmodule.serving.jobs import PromptJob

NAME = OPENAI_NAME


@pytest.fixture(scope="module")
def setup(openai_live):
    return openai_live




def test_greedy_completions_equal_transformers(setup):
    live, _, hf, tokenizer, _ = setup
    prompts = ["The quick brown fox", "Once upon a time there"]
    response = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompts, "max_tokens": 12,
                                                         "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == NAME
    prompt_tokens, completion_tokens = 0, 0
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt).input_ids
        tokens = hf_greedy(hf, ids, 12)
        text, reason = expected_text(tokenizer, tokens)
        choice = body["choices"][i]
        assert choice["index"] == i and choice["text"] == text and choice["finish_reason"] == reason
        prompt_tokens += len(ids)
        eos = tokenizer.eos_token_id
        completion_tokens += tokens.index(eos) + 1 if eos in tokens else len(tokens)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}


def test_echo_with_logprobs_is_lm_evals_request_and_matches_transformers(setup):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, one greedy token."""
    live, _, hf, tokenizer, _ = setup
    prompts = [[5, 17, 99, 3, 250, 41], [7, 8, 9]]
    response = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompts, "max_tokens": 1,
                                                         "temperature": 0, "logprobs": 2, "echo": True, "seed": 1234})
    assert response.status_code == 200, response.text
    for ids, choice in zip(prompts, response.json()["choices"]):
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt, then the generated token
        for k in range(1, len(ids)):
            assert abs(logprobs["token_logprobs"][k] - reference[k - 1, ids[k]].item()) < 1e-4
            assert len(logprobs["top_logprobs"][k]) <= 2
            assert abs(max(logprobs["top_logprobs"][k].values()) - reference[k - 1].max().item()) < 1e-4
        greedy = int(reference[-1].argmax())
        assert abs(logprobs["token_logprobs"][-1] - reference[-1, greedy].item()) < 1e-4
        assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode([greedy], skip_special_tokens=True)


@pytest.mark.parametrize("max_tokens, echo", [(1, False), (4, False), (0, True)])
def test_vllms_prompt_logprobs_match_transformers(setup, max_tokens, echo):
    """vLLM's `prompt_logprobs` on `/v1/completions` (its answer's shape as vLLM 0.33 writes it): None for
    the first token, then per position the prompt token's log-probability and its rank among the whole
    vocabulary, and the k most likely with ranks 1 to k, each with its decoded text; beside a greedy
    generation (read from the prompt's prefill, or a decode batch's), or an echo without new tokens."""
    live, _, hf, tokenizer, _ = setup
    prompts, k = [[5, 17, 99, 3, 250, 41], [7, 8, 9]], 3
    response = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompts, "max_tokens": max_tokens,
                                                         "temperature": 0, "prompt_logprobs": k, "echo": echo})
    assert response.status_code == 200, response.text
    for ids, choice in zip(prompts, response.json()["choices"]):
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        positions = choice["prompt_logprobs"]
        assert len(positions) == len(ids) and positions[0] is None
        for i in range(1, len(ids)):
            row, entries = reference[i - 1], positions[i]
            token = entries[str(ids[i])]
            assert abs(token["logprob"] - row[ids[i]].item()) < 1e-4
            assert token["rank"] == int((row > row[ids[i]]).sum()) + 1
            assert token["decoded_token"] == tokenizer.decode([ids[i]])
            assert list(entries)[0] == str(ids[i])  # the prompt's token first, as vLLM puts it
            best = row.topk(k)
            for place, (value, other) in enumerate(zip(best.values.tolist(), best.indices.tolist()), 1):
                assert entries[str(other)]["rank"] == place and abs(entries[str(other)]["logprob"] - value) < 1e-4
            assert len(entries) == k + (str(ids[i]) not in {str(t) for t in best.indices.tolist()})
        if max_tokens == 4:
            assert choice["text"] == expected_text(tokenizer, hf_greedy(hf, ids, 4))[0]


def test_vllms_prompt_logprobs_of_a_chat_match_transformers(setup):
    """vLLM's `prompt_logprobs` on `/v1/chat/completions`: beside the choices, the rendered prompt's
    (chat template, generation prompt) log-probabilities and ranks as on completions."""
    live, _, hf, tokenizer, _ = setup
    messages = [{"role": "user", "content": "the quick brown fox"}]
    response = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 3,
                                                              "temperature": 0, "prompt_logprobs": 2, "n": 2})
    assert response.status_code == 200, response.text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    positions = response.json()["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    for i in range(1, len(ids)):
        token = positions[i][str(ids[i])]
        assert abs(token["logprob"] - reference[i - 1, ids[i]].item()) < 1e-4
        assert token["rank"] == int((reference[i - 1] > reference[i - 1, ids[i]]).sum()) + 1


def test_vllms_return_token_ids_are_the_prompts_and_the_generated_tokens(setup):
    """vLLM's `return_token_ids`: on completions each choice's `prompt_token_ids` and `token_ids` (the
    tokens its usage counts; with `echo` the text then leaves the prompt out, as vLLM's does); on chat
    the rendered prompt's ids beside the choices and each choice's own."""
    live, _, hf, tokenizer, _ = setup
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    tokens = hf_greedy(hf, ids, 6)
    eos = tokenizer.eos_token_id
    generated = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
    for echo in (False, True):
        response = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 6,
                                                             "temperature": 0, "return_token_ids": True, "echo": echo})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == generated
        assert choice["text"] == expected_text(tokenizer, tokens)[0]
    messages = [{"role": "user", "content": "the quick brown fox"}]
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 4,
                                                          "temperature": 0, "return_token_ids": True}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert chat["prompt_token_ids"] == rendered
    answer = hf_greedy(hf, rendered, 4)
    assert chat["choices"][0]["token_ids"] == (answer[: answer.index(eos) + 1] if eos in answer else answer)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllms_return_token_ids_in_a_stream_are_the_answers_own(setup, path):
    """vLLM's `return_token_ids` in a stream: each choice's first chunk carries its prompt's ids (a
    completion's in the choice, a chat's beside the choices, as vLLM puts them), each chunk its own
    tokens' ids (those whose text a stop string holds back with a later chunk); put together, the
    unstreamed answer's ids, for two choices, a stop string and a completion's echo (whose text then
    leaves the prompt out, as vLLM's does)."""
    live, _, _, tokenizer, _ = setup
    if path == "/v1/completions":
        cases = [{"prompt": "Once upon a time there", "echo": echo} for echo in (False, True)]
    else:
        cases = [{"messages": [{"role": "user", "content": "Once upon a time there"}]}]
    for fields in cases:
        request = {"model": NAME, "max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 2, "stop": ["e "],
                   "return_token_ids": True, **fields}
        whole = live.client.post(path, json=request).json()
        chunks = streamed(live, path, request)
        for choice in whole["choices"]:
            own = [c for c in chunks if c["choices"][0]["index"] == choice["index"]]
            prompts = [c["choices"][0].get("prompt_token_ids", c.get("prompt_token_ids")) for c in own]
            expected_prompt = choice.get("prompt_token_ids", whole.get("prompt_token_ids"))
            assert prompts[0] == expected_prompt and prompts[1:] == [None] * (len(prompts) - 1)
            assert sum((c["choices"][0].get("token_ids", []) for c in own), []) == choice["token_ids"]
            text = "".join(c["choices"][0]["text"] if "text" in c["choices"][0] else
                           c["choices"][0]["delta"].get("content", "") for c in own)
            assert text == (choice["text"] if "text" in choice else choice["message"]["content"])
        assert len(whole["choices"]) == 2 and whole["choices"][0]["token_ids"] != whole["choices"][1]["token_ids"]


def test_vllms_add_special_tokens_false_tokenizes_a_text_prompt_without_them(setup):
    """vLLM's `add_special_tokens` on completions (default true): false tokenizes the text prompt as
    the tokenizer does without its special tokens (a tokenizer that adds a BOS here), and the completion
    is that prompt's."""
    import copy

    from tokenizers.processors import TemplateProcessing

    _, model, hf, tokenizer, _ = setup
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    live = LiveServer(create_app(model, tokenizer, name=NAME))
    try:
        prompt = "The quick brown fox"
        for add in (True, False):
            ids = tokenizer(prompt, add_special_tokens=add).input_ids
            assert (ids[0] == tokenizer.bos_token_id) == add
            response = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 5,
                                                                 "temperature": 0, "add_special_tokens": add,
                                                                 "return_token_ids": True})
            choice = response.json()["choices"][0]
            assert choice["prompt_token_ids"] == ids
            assert choice["text"] == expected_text(tokenizer, hf_greedy(hf, ids, 5))[0]
    finally:
        live.stop()


def test_echo_without_new_tokens_and_stop_strings(setup):
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("Once upon a time").input_ids
    body = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                                     "logprobs": 0}).json()
    assert body["choices"][0]["text"] == tokenizer.decode(ids)
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    assert body["usage"]["completion_tokens"] == 0
    tokens = hf_greedy(hf, ids, 20)
    full, _ = expected_text(tokenizer, tokens)
    stop = next(c for c in full[3:] if c.strip())  # a character the greedy text reaches after a few
    text, reason = expected_text(tokenizer, tokens, (stop,))
    answer = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 20,
                                                       "temperature": 0, "stop": [stop]}).json()["choices"][0]
    assert (answer["text"], answer["finish_reason"]) == (text, "stop") and stop not in answer["text"]


def test_sampling_with_a_seed_equals_model_generate(setup):
    live, model, _, tokenizer, _ = setup
    ids = tokenizer("The quick brown fox").input_ids
    options = {"temperature": 0.8, "top_p": 0.9}
    answers = [live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 10, "seed": 7,
                                                         **options}).json()["choices"][0]["text"] for _ in range(2)]
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=True, top_k=0, **options,
                         generator=torch.Generator().manual_seed(7))
    assert answers[0] == answers[1] == expected_text(tokenizer, out[0, len(ids):].tolist())[0]


def test_vllms_sampling_extras_equal_generate_with_the_same_options(setup):
    """vLLM's `top_k`, `min_p` and `repetition_penalty`, as `generate` applies them: greedy with a
    repetition penalty against transformers' own greedy `generate` on the same weights; sampled with
    all three and a seed against `model.generate`'s draw with the same generator. The log-probabilities
    stay the model's own (vLLM's raw ones)."""
    live, model, hf, tokenizer, _ = setup
    ids = tokenizer("the the the quick brown fox the").input_ids
    penalized = hf_greedy(hf, ids, 12, repetition_penalty=1.8)
    assert penalized != hf_greedy(hf, ids, 12)  # the penalty changed the greedy choice
    answer = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 12,
                                                       "temperature": 0, "repetition_penalty": 1.8,
                                                       "logprobs": 0}).json()["choices"][0]
    assert answer["text"] == expected_text(tokenizer, penalized)[0]
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
    assert abs(answer["logprobs"]["token_logprobs"][0] - raw[penalized[0]].item()) < 1e-4
    options = {"temperature": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}
    for top_p in (1.0, 0.8):
        request = {"model": NAME, "prompt": ids, "max_tokens": 10, "seed": 11, "top_p": top_p, **options}
        answer = live.client.post("/v1/completions", json=request).json()["choices"][0]["text"]
        drawn = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=10, do_sample=True, top_p=top_p, **options,
                               generator=torch.Generator().manual_seed(11))
        assert answer == expected_text(tokenizer, drawn[0, len(ids):].tolist())[0]
    messages = [{"role": "user", "content": "the the quick the"}]
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 12, "temperature": 0,
                                                          "messages": messages, "repetition_penalty": 1.8}).json()
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    penalized = hf_greedy(hf, ids, 12, repetition_penalty=1.8)
    assert penalized != hf_greedy(hf, ids, 12)
    assert chat["choices"][0]["message"]["content"] == expected_text(tokenizer, penalized)[0]


def test_requests_that_leave_sampling_out_take_the_packages_defaults_as_vllm(build, tmp_path, capsys, monkeypatch):
    """vLLM's `--generation-config`: completions and chat requests that leave out `temperature`, `top_p`,
    `top_k`, `min_p` or `repetition_penalty` take the package's defaults (genai_config.json's search
    section, what `model.generate` applies) with `auto`, the default; OpenAI's with `vllm`; those of a
    folder's generation_config.json with its path. A request's own value wins. A folder without a readable
    generation_config.json, or a default out of range, stops `ortmodule serve` before the package loads."""
    fixture = build("llama")
    _, hf = load_pair(fixture)
    package = tmp_path / "package"
    shutil.copytree(fixture.package_dir, package)
    config = json.loads((package / "genai_config.json").read_text())
    config["search"].update(repetition_penalty=1.8, temperature=0.9, top_k=20, top_p=0.8)
    (package / "genai_config.json").write_text(json.dumps(config))
    model, tokenizer = OrtModelForCausalLM.from_pretrained(package), load_tokenizer(package)
    ids = tokenizer("the the the quick brown fox the").input_ids
    penalized, plain = hf_greedy(hf, ids, 12, repetition_penalty=1.8), hf_greedy(hf, ids, 12)
    assert penalized != plain  # the penalty changes the greedy choice
    assert model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist() == penalized
    drawn = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=True,
                           generator=torch.Generator().manual_seed(11))[0, len(ids):].tolist()
    messages = [{"role": "user", "content": "the the quick the"}]
    tokenizer.chat_template = CHAT_TEMPLATE
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))

    original = PromptJob.__init__

    def answers(app, **request):
        live = LiveServer(app)
        try:
            text = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, **request}).json()
            chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, **request})
            return text["choices"][0]["text"], chat.json()["choices"][0]["message"]["content"]
        finally:
            live.stop()

    greedy = {"max_tokens": 12, "temperature": 0}
    auto = create_app(model, tokenizer, name=NAME)
    assert answers(auto, **greedy) == (expected_text(tokenizer, penalized)[0],
                                       expected_text(tokenizer, hf_greedy(hf, chat_ids, 12, repetition_penalty=1.8))[0])
    assert answers(create_app(model, tokenizer, name=NAME), **greedy, repetition_penalty=1.0)[0] == \
        expected_text(tokenizer, plain)[0]  # the request's own value
    sampled = answers(create_app(model, tokenizer, name=NAME), max_tokens=10, seed=11)  # the package's four
    assert sampled[0] == expected_text(tokenizer, drawn)[0]
    # lm-eval's loglikelihood request (echo, one greedy token): still one prefill, its token penalized, the
    # log-probabilities the model's own (vLLM's raw ones)
    parted = next(k for k, (a, b) in enumerate(zip(penalized, plain)) if a != b)
    prompts = [ids, ids + penalized[:parted]]  # the second's next token one the penalty turns
    live, made = LiveServer(create_app(model, tokenizer, name=NAME)), []
    monkeypatch.setattr(PromptJob, "__init__", lambda job, *a, **k: made.append(job) or original(job, *a, **k))
    try:
        echo = {"model": NAME, "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
        choices = live.client.post("/v1/completions", json=echo).json()["choices"]
        raw = live.client.post("/v1/completions", json={**echo, "repetition_penalty": 1.0}).json()["choices"]
    finally:
        live.stop()
    assert len(made) == 2
    for choice, other, prompt in zip(choices, raw, prompts):
        first = hf_greedy(hf, prompt, 1, repetition_penalty=1.8)[0]
        assert choice["logprobs"]["tokens"][-1] == tokenizer.decode([first])
        assert choice["logprobs"]["token_logprobs"][:-1] == other["logprobs"]["token_logprobs"][:-1]
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)[first].item()
        assert abs(choice["logprobs"]["token_logprobs"][-1] - expected) < 1e-4
    assert choices[1]["logprobs"]["tokens"][-1] != raw[1]["logprobs"]["tokens"][-1]  # the penalty mattered
    monkeypatch.undo()
    neutral = answers(create_app(model, tokenizer, name=NAME, generation_config="vllm"), **greedy)
    assert neutral == (expected_text(tokenizer, plain)[0], expected_text(tokenizer, hf_greedy(hf, chat_ids, 12))[0])
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.8, "do_sample": False,
                                                                    "max_new_tokens": 5}))
    plain_package = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    folder = answers(create_app(plain_package, tokenizer, name=NAME, generation_config=str(checkpoint)), **greedy)
    assert folder[0] == expected_text(tokenizer, penalized)[0]
    # its max_new_tokens: the length of a chat request that leaves max_tokens out (vLLM's default max_tokens)
    live = LiveServer(create_app(plain_package, tokenizer, name=NAME, generation_config=str(checkpoint)))
    try:
        unbounded = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages,
                                                                   "temperature": 0}).json()
    finally:
        live.stop()
    assert unbounded["usage"]["completion_tokens"] == 5 and unbounded["choices"][0]["finish_reason"] == "length"
    assert unbounded["choices"][0]["message"]["content"] == \
        expected_text(tokenizer, hf_greedy(hf, chat_ids, 5, repetition_penalty=1.8))[0]
    assert answers(create_app(plain_package, tokenizer, name=NAME), **greedy)[0] == expected_text(tokenizer, plain)[0]

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before --generation-config was checked")

    monkeypatch.setattr(OrtModelForCausalLM, "from_pretrained", loaded)
    (tmp_path / "bad" / "generation_config.json").parent.mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    (tmp_path / "none" / "generation_config.json").parent.mkdir()
    (tmp_path / "none" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    for flag, message in ((tmp_path / "absent", "a readable generation_config.json"),
                          (tmp_path / "bad", "default top_p is 1.5"),
                          (tmp_path / "none", "default max_new_tokens is 0")):
        with pytest.raises(SystemExit) as stopped:
            cli.ortmodule(["serve", str(package), "--generation-config", str(flag), "--port", "0"])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_one_processed_token_after_an_echo_is_the_generations(setup, monkeypatch):
    """An echo with one greedy token whose choice is processed (a logit bias, `min_tokens` masking the end of
    sequence, `ignore_eos`, a stop token) runs as one prefill (`PromptJob`, the prompt's last logits kept for
    the choice) and answers as the decode path does for the same request without echo: the token, its raw
    log-probability and alternatives, the finish reason."""
    live, _, _, tokenizer, _ = setup
    ids, eos = tokenizer("The quick brown fox").input_ids, tokenizer.eos_token_id
    made, original = [], PromptJob.__init__
    monkeypatch.setattr(PromptJob, "__init__", lambda job, *a, **k: made.append(job) or original(job, *a, **k))
    base = {"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 2}
    for extra in ({"logit_bias": {"77": 100}}, {"logit_bias": {str(eos): 100}}, {"logit_bias": {str(eos): 100},
                  "min_tokens": 1}, {"logit_bias": {str(eos): 100}, "ignore_eos": True},
                  {"logit_bias": {"77": 100}, "stop_token_ids": [77]}, {"repetition_penalty": 1.5}):
        echoed = live.client.post("/v1/completions", json={**base, **extra, "echo": True}).json()["choices"][0]
        decoded = live.client.post("/v1/completions", json={**base, **extra}).json()["choices"][0]
        assert echoed["finish_reason"] == decoded["finish_reason"], extra
        assert echoed["text"] == tokenizer.decode(ids) + decoded["text"], extra
        for key in ("tokens", "top_logprobs"):
            assert echoed["logprobs"][key][-1] == decoded["logprobs"][key][0], extra
        assert abs(echoed["logprobs"]["token_logprobs"][-1] - decoded["logprobs"]["token_logprobs"][0]) < 1e-5
    assert len(made) == 6


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as its API reference defines them, a transformers
    logits processor: each token generated so far (not the prompt's) lowered by frequency x its count
    and by presence once."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_length:]):
            for token, count in zip(*torch.unique(ids, return_counts=True)):
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def test_stop_token_ids_stop_strings_kept_and_special_tokens_shown_as_vllm_takes_them(setup):
    """vLLM's `stop_token_ids` (the row ends at one, its text shown as any token's), the stop string
    kept in the answer (`include_stop_str_in_output`, SGLang's `no_stop_trim`), and special tokens' text shown
    (`skip_special_tokens` false), each against the text of transformers' greedy tokens; streamed too."""
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("Once upon a time there").input_ids
    tokens = hf_greedy(hf, ids, 16)
    request = {"model": NAME, "prompt": ids, "max_tokens": 16, "temperature": 0}
    at = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])  # a token the greedy run first makes there
    answer = live.client.post("/v1/completions", json={**request, "stop_token_ids": [tokens[at], 511]}).json()
    assert answer["choices"][0]["text"] == tokenizer.decode(tokens[: at + 1], skip_special_tokens=True)
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == at + 1
    full, _ = expected_text(tokenizer, tokens)
    stop = next(c for c in full[3:] if c.strip())
    kept = live.client.post("/v1/completions", json={**request, "stop": [stop],
                                                     "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == full[: full.index(stop, 0) + 1] and kept["text"].endswith(stop)
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
    plain = live.client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    chat["stop"] = [next(c for c in plain[3:] if c.strip())]
    for route, body in (("/v1/completions", {**request, "stop": [stop]}), ("/v1/chat/completions", chat)):
        sglangs = live.client.post(route, json={**body, "no_stop_trim": True}).json()  # SGLang's name of it
        vllms = live.client.post(route, json={**body, "include_stop_str_in_output": True}).json()
        assert sglangs["choices"] == vllms["choices"]
    eos = tokenizer.eos_token_id
    shown = live.client.post("/v1/completions", json={**request, "max_tokens": 3, "ignore_eos": True,
                                                      "logit_bias": {str(eos): 100}, "skip_special_tokens": False})
    assert shown.json()["choices"][0]["text"] == tokenizer.eos_token * 3
    with live.client.stream("POST", "/v1/completions", json={**request, "stream": True,
                                                             "stop_token_ids": [tokens[at]]}) as stream:
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                           if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert streamed == answer["choices"][0]["text"]


def test_presence_and_frequency_penalties_as_openai_defines_them(setup):
    """Greedy completions and a chat with OpenAI's penalties, against transformers' greedy `generate`
    with a logits processor of the API reference's formula; the greedy choice changes."""
    from transformers import LogitsProcessorList

    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("Once upon a time there").input_ids
    for presence, frequency in ((0.0, 2.0), (1.5, 0.0), (-1.0, 0.5)):
        processor = LogitsProcessorList([OpenAIPenalties(len(ids), presence, frequency)])
        penalized = hf_greedy(hf, ids, 16, logits_processor=processor)
        answer = live.client.post("/v1/completions", json={
            "model": NAME, "prompt": ids, "max_tokens": 16, "temperature": 0, "presence_penalty": presence,
            "frequency_penalty": frequency}).json()["choices"][0]["text"]
        assert answer == expected_text(tokenizer, penalized)[0], (presence, frequency)
        if presence >= 0:
            assert penalized != hf_greedy(hf, ids, 16)
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}):
        refused = live.client.post("/v1/completions", json={"model": NAME, "prompt": "x", **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(bad))


def close(a, b) -> bool:
    """The same JSON, numbers within 1e-4 (two requests may run in batches of other shapes, or over a
    cached prefix)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def streamed(live, path: str, request: dict) -> list[dict]:
    with live.client.stream("POST", path, json={**request, "stream": True}) as stream:
        return [json.loads(line[6:]) for line in stream.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_streams_carry_the_log_probabilities_of_their_chunks(setup):
    """A stream asked for log-probabilities carries each chunk's tokens' (those whose text is held
    back with a later chunk, the rest with the last): put together, the answer's own, on completions
    (text offsets running on from chunk to chunk) and chats, with a stop string and two choices."""
    live, _, _, tokenizer, _ = setup
    ids = tokenizer("Once upon a time there").input_ids
    request = {"model": NAME, "prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 2, "n": 2}
    free = live.client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    stop = next(c for c in free[3:] if c.strip())  # a character the answer reaches after a few
    for extra in ({}, {"stop": [stop]}):
        whole = live.client.post("/v1/completions", json={**request, **extra}).json()["choices"]
        chunks = streamed(live, "/v1/completions", {**request, **extra})
        for choice in whole:
            parts = [c["choices"][0]["logprobs"] for c in chunks
                     if c["choices"] and c["choices"][0]["index"] == choice["index"] and c["choices"][0]["logprobs"]]
            joined = {key: [v for part in parts for v in part[key]] for key in choice["logprobs"]}
            assert len(parts) > 1 and close(joined, choice["logprobs"])
    messages = [{"role": "user", "content": "Say something."}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    whole = live.client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    chunks = streamed(live, "/v1/chat/completions", chat)
    assert close([e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                  for e in c["choices"][0]["logprobs"]["content"]], whole)
    plain = streamed(live, "/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": None})
    assert all(c["choices"][0]["logprobs"] is None for c in plain if c["choices"])


def test_a_stream_with_echo_begins_each_choice_with_its_prompt(setup):
    """`echo` in a completions stream (vLLM's way): each choice's first chunk is its prompt's text, then
    the generated text; put together, the unstreamed answer's text (text and token-id prompts, two
    choices each, greedy and seeded sampling, one greedy token as lm-eval's generation asks)."""
    live, _, _, tokenizer, _ = setup
    texts = ["The quick brown fox", "Once upon a time there"]
    for prompts in (texts, [tokenizer(text).input_ids for text in texts]):
        for extra in ({"temperature": 0, "max_tokens": 8}, {"temperature": 0.9, "seed": 3, "max_tokens": 8},
                      {"temperature": 0, "max_tokens": 1}):
            request = {"model": NAME, "prompt": prompts, "echo": True, "n": 2, **extra}
            whole = live.client.post("/v1/completions", json=request).json()["choices"]
            chunks = [c["choices"][0] for c in streamed(live, "/v1/completions", request) if c["choices"]]
            assert len(whole) == 4
            for choice in whole:
                mine = [c for c in chunks if c["index"] == choice["index"]]
                prompt = prompts[choice["index"] // 2]
                assert mine[0]["text"] == (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)), extra
                assert len(mine) > 2 and "".join(c["text"] for c in mine) == choice["text"], extra
                assert mine[-1]["finish_reason"] == choice["finish_reason"]


def test_n_choices_of_each_prompt(setup):
    """OpenAI's `n`: choice i * n + k is prompt i's k-th; sampled with a seed, choice k draws with seed
    + k (as `model.generate` with that seed's generator); greedy choices are transformers' greedy
    tokens; the prompt's tokens are counted once in the usage; a chat's n choices, whole and streamed."""
    live, model, hf, tokenizer, _ = setup
    prompts = ["The quick brown fox", "Once upon a time there"]
    ids = [tokenizer(p).input_ids for p in prompts]

    def drawn(prompt_ids, seed, new=8):
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                    dtype=torch.long),
                             max_new_tokens=new, do_sample=True, top_k=0, temperature=0.9,
                             generator=torch.Generator().manual_seed(seed))
        return expected_text(tokenizer, out[0, len(prompt_ids):].tolist())[0]

    body = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompts, "max_tokens": 8, "n": 3,
                                                     "seed": 7, "temperature": 0.9}).json()
    texts = [choice["text"] for choice in body["choices"]]
    assert [choice["index"] for choice in body["choices"]] == list(range(6))
    assert texts == [drawn(prompt_ids, 7 + k) for prompt_ids in ids for k in range(3)]
    assert len(set(texts[:3])) > 1  # the copies drew apart
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    greedy = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids[0], "max_tokens": 8, "n": 2,
                                                       "temperature": 0}).json()
    assert [c["text"] for c in greedy["choices"]] == [expected_text(tokenizer, hf_greedy(hf, ids[0], 8))[0]] * 2
    assert greedy["usage"]["completion_tokens"] == 16
    messages = [{"role": "user", "content": "Say something."}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    request = {"model": NAME, "messages": messages, "max_tokens": 8, "n": 2, "seed": 3, "temperature": 0.9}
    chat = live.client.post("/v1/chat/completions", json=request).json()
    expected = [drawn(chat_ids, 3 + k) for k in range(2)]
    assert [c["message"]["content"] for c in chat["choices"]] == expected
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    texts = ["", ""]
    chunks = streamed(live, "/v1/chat/completions", request)
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == expected
    assert sum(c["choices"][0]["delta"] == {"role": "assistant"} for c in chunks) == 2


def test_min_tokens_and_ignore_eos_as_vllm_takes_them(setup):
    """vLLM's `min_tokens` (end-of-sequence masked until that many tokens, as `generate`'s
    `min_new_tokens`) and `ignore_eos` (an end-of-sequence token is generated as any other; the row
    ends by length), on a row whose end-of-sequence token is biased to win: against transformers'
    `generate` with the same bias and `min_new_tokens`."""
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("The quick brown fox").input_ids
    eos = tokenizer.eos_token_id
    request = {"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    ended = live.client.post("/v1/completions", json=request).json()
    assert ended["choices"][0] == {**ended["choices"][0], "text": "", "finish_reason": "stop"}
    assert ended["usage"]["completion_tokens"] == 1
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=6, do_sample=False, min_new_tokens=3, eos_token_id=eos, pad_token_id=eos,
                          sequence_bias={(eos,): 100.0})
    tokens = out[0, len(ids):].tolist()
    assert eos not in tokens[:3] and tokens[3] == eos
    held = live.client.post("/v1/completions", json={**request, "min_tokens": 3}).json()
    assert (held["choices"][0]["text"], held["choices"][0]["finish_reason"]) == expected_text(tokenizer, tokens)
    assert held["usage"]["completion_tokens"] == 4
    ignoring = live.client.post("/v1/completions", json={**request, "ignore_eos": True, "min_tokens": 3}).json()
    assert ignoring["choices"][0]["finish_reason"] == "length" and ignoring["usage"]["completion_tokens"] == 6
    assert ignoring["choices"][0]["text"] == tokenizer.decode(tokens[:3], skip_special_tokens=True)
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user",
                                                                                        "content": "hi"}],
                                                          "max_tokens": 5, "ignore_eos": True, "temperature": 0,
                                                          "logit_bias": {str(eos): 100}}).json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 5


def test_logit_bias_equals_generates_sequence_bias(setup):
    """OpenAI's `logit_bias` as transformers' `sequence_bias` of single tokens: a greedy completion,
    lm-eval's echo request with one greedy token (its prompt's log-probabilities the model's own), a
    chat, and a biased request sent together with an unbiased one (rows of one decode batch, where
    they meet there); bad keys and values are 400s."""
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("The quick brown fox").input_ids
    plain = hf_greedy(hf, ids, 8)
    bias = {plain[0]: -100.0, plain[3]: -100.0, 77: 5.0}
    biased = hf_greedy(hf, ids, 8, sequence_bias={(token,): value for token, value in bias.items()})
    assert biased != plain
    wire = {str(token): value for token, value in bias.items()}
    requests = [{"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0, "logit_bias": wire},
                {"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0}]
    with httpx.Client(base_url=live.url, timeout=30) as client, ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda r: client.post("/v1/completions", json=r).json(), requests))
    assert answers[0]["choices"][0]["text"] == expected_text(tokenizer, biased)[0]
    assert answers[1]["choices"][0]["text"] == expected_text(tokenizer, plain)[0]
    echo = live.client.post("/v1/completions", json={**requests[0], "max_tokens": 1, "echo": True, "logprobs": 1,
                                                     "prompt": ids}).json()["choices"][0]
    assert echo["text"] == tokenizer.decode(ids) + expected_text(tokenizer, biased[:1])[0]
    messages = [{"role": "user", "content": "Say something."}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    first = hf_greedy(hf, chat_ids, 1)[0]
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 6,
                                                          "temperature": 0, "logit_bias": {str(first): -100}}).json()
    expected = hf_greedy(hf, chat_ids, 6, sequence_bias={(first,): -100.0})
    assert chat["choices"][0]["message"]["content"] == expected_text(tokenizer, expected)[0]
    for bad in ({"abc": 1}, {"-1": 1}, {str(hf.config.vocab_size): 1}, {"5": 101}, {"5": "1"}, {"5": True},
                {str(i): 1 for i in range(1025)}):
        refused = live.client.post("/v1/completions", json={"model": NAME, "prompt": "x", "logit_bias": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", (bad, refused.text)


def masked_greedy(hf, ids: list[int], new: int, processors) -> list[int]:
    """transformers' greedy continuation with logits processors that see the tokens generated only (as vLLM's
    bad words match them), the whole sequence run each step."""
    out: list[int] = []
    for _ in range(new):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[:, -1].float()
        for processor in processors:
            logits = processor(torch.tensor([out], dtype=torch.long), logits)
        out.append(int(logits.argmax(-1)))
    return out


def vllm_bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """A bad word's token ids as vLLM's SamplingParams makes them: the word alone, and after a space where that
    gives another first token and as many tokens."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    return [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


def test_allowed_token_ids_and_bad_words_as_vllm_masks_them(setup):
    """vLLM's `allowed_token_ids`: a greedy completion and chat equal transformers' with every other token
    suppressed (`suppress_tokens`), and sampled tokens stay among them; `bad_words`: transformers'
    `NoBadWordsLogitsProcessor` over the tokens generated (vLLM matches a word's first tokens there, not in the
    prompt: a word begun by the prompt's last token does not bar the first token), each word tokenized as vLLM
    tokenizes it; both on the Responses API's extras too."""
    from transformers import NoBadWordsLogitsProcessor

    live, _, hf, tokenizer, _ = setup
    vocab = hf.config.vocab_size
    ids = tokenizer("The quick brown fox").input_ids
    plain = hf_greedy(hf, ids, 8)
    allowed = sorted({*plain[3:], 77, 78, 91})
    expected = hf_greedy(hf, ids, 8, suppress_tokens=[t for t in range(vocab) if t not in allowed])
    assert expected != plain
    answer = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0,
                                                       "allowed_token_ids": allowed}).json()
    assert answer["choices"][0]["text"] == expected_text(tokenizer, expected)[0]
    sampled = live.client.post("/v1/completions", json={
        "model": NAME, "prompt": ids, "max_tokens": 8, "n": 4, "allowed_token_ids": allowed,
        "return_token_ids": True}).json()
    assert all(set(choice["token_ids"]) <= set(allowed) for choice in sampled["choices"])
    messages = [{"role": "user", "content": "Say something."}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    chat_allowed = sorted({*hf_greedy(hf, chat_ids, 6)[2:], 77})
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 6,
                                                          "temperature": 0, "allowed_token_ids": chat_allowed}).json()
    chat_expected = hf_greedy(hf, chat_ids, 6, suppress_tokens=[t for t in range(vocab) if t not in chat_allowed])
    assert chat["choices"][0]["message"]["content"] == expected_text(tokenizer, chat_expected)[0]
    ids = tokenizer("The weather today is").input_ids
    plain = hf_greedy(hf, ids, 8)
    words = [tokenizer.decode(plain[2:4]), tokenizer.decode(plain[5:6]),
             tokenizer.decode([ids[-1], plain[0]])]  # the last: begun by the prompt's last token
    barred = [w for word in words for w in vllm_bad_word_ids(tokenizer, word)]
    assert [ids[-1], plain[0]] in barred
    expected = masked_greedy(hf, ids, 8, [NoBadWordsLogitsProcessor(barred, eos_token_id=None)])
    assert expected != plain and expected[0] == plain[0]
    answer = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0,
                                                       "bad_words": words}).json()
    assert answer["choices"][0]["text"] == expected_text(tokenizer, expected)[0]
    response = live.client.post("/v1/responses", json={"model": NAME, "input": "Say something.", "temperature": 0,
                                                       "max_output_tokens": 6, "allowed_token_ids": chat_allowed})
    assert response.json()["output"][0]["content"][0]["text"] == expected_text(tokenizer, chat_expected)[0]


def test_masks_that_leave_no_token_end_the_row_or_are_refused(setup):
    """Where `allowed_token_ids` are all one-token bad words, the request is a 400 naming the field; where they leave
    no token only after some output (a bad word of two tokens completed by the only other allowed one) or beside a
    grammar that takes none of them, the row ends there ("stop"), greedy and sampled: never a token outside the
    masks (the argmax of all -inf, token 0) or sampling's failure on them (a 500)."""
    live, _, _, tokenizer, _ = setup

    def alone(ids):
        return tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids

    a, b = next((a, b) for a in range(40, 300) for b in range(40, 300)
                if a != b and alone([a]) and alone([b, b]) and not tokenizer.decode([a, b, b]).isdigit())
    vllm = vllm_bad_word_ids(tokenizer, tokenizer.decode([b, b]))
    assert [b, b] in vllm and all(word[0] != b for word in vllm if word != [b, b])
    request = {"model": NAME, "prompt": "The quick", "max_tokens": 6, "return_token_ids": True}
    refused = live.client.post("/v1/completions", json={**request, "allowed_token_ids": [a],
                                                       "bad_words": [tokenizer.decode([a])]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids"
    for temperature in (0, 1):
        answer = live.client.post("/v1/completions", json={
            **request, "temperature": temperature, "allowed_token_ids": [a, b],
            "bad_words": [tokenizer.decode([a]), tokenizer.decode([b, b])]}).json()["choices"][0]
        assert (answer["token_ids"], answer["finish_reason"]) == ([b], "stop")
        grammar = live.client.post("/v1/completions", json={
            **request, "temperature": temperature, "allowed_token_ids": [a, b],
            "structured_outputs": {"regex": "[0-9]+"}}).json()["choices"][0]
        assert (grammar["token_ids"], grammar["text"], grammar["finish_reason"]) == ([], "", "stop")


def test_logprob_token_ids_give_those_tokens_log_probabilities(setup):
    """vLLM's `logprob_token_ids`: at each generated token the alternatives are the chosen token's and those asked
    for (not the top ones), their log-probabilities transformers' at that position; on completions (whole,
    streamed, after an echoed prompt, whose positions keep the top `logprobs`) and on chat; refused without
    logprobs, with nothing generated, and outside the vocabulary."""
    live, _, hf, tokenizer, _ = setup
    ids = tokenizer("The quick brown fox").input_ids
    tokens = hf_greedy(hf, ids, 5)
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:].float().log_softmax(-1)
    asked = list(dict.fromkeys([77, 130, 301, tokens[1], tokens[3]]))  # two of them chosen where they are
    names = [tokenizer.decode([t]) for t in range(hf.config.vocab_size)]
    assert len({names[t] for t in asked + tokens}) == len(set(asked + tokens))  # no two of them one string

    def expected(position: int) -> dict:
        chosen = tokens[position]
        return {names[t]: logprobs[position, t].item() for t in [chosen] + [t for t in asked if t != chosen]}

    def close(got: dict, want: dict) -> bool:
        return list(got) == list(want) and all(abs(got[k] - want[k]) < 1e-4 for k in want)

    request = {"model": NAME, "prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 1,
               "logprob_token_ids": asked}
    answer = live.client.post("/v1/completions", json=request).json()["choices"][0]
    assert answer["text"] == expected_text(tokenizer, tokens)[0]
    assert all(close(got, expected(k)) for k, got in enumerate(answer["logprobs"]["top_logprobs"]))
    with live.client.stream("POST", "/v1/completions", json={**request, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = [top for c in chunks for choice in c["choices"] if choice.get("logprobs")
                for top in choice["logprobs"]["top_logprobs"]]
    assert len(streamed) == 5 and all(close(got, expected(k)) for k, got in enumerate(streamed))
    echoed = live.client.post("/v1/completions", json={**request, "echo": True, "max_tokens": 2}).json()["choices"][0]
    tops = echoed["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(top) == 1 for top in tops[1: len(ids)])  # the prompt's: its top 1
    assert all(close(got, expected(k)) for k, got in enumerate(tops[len(ids):]))
    messages = [{"role": "user", "content": "Say something."}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    chat_tokens = hf_greedy(hf, chat_ids, 4)
    with torch.no_grad():
        chat_logprobs = hf(torch.tensor([chat_ids + chat_tokens])).logits[0, len(chat_ids) - 1:].float().log_softmax(-1)
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 4,
                                                          "temperature": 0, "logprobs": True,
                                                          "logprob_token_ids": asked}).json()["choices"][0]
    for k, entry in enumerate(chat["logprobs"]["content"]):
        order = [chat_tokens[k]] + [t for t in asked if t != chat_tokens[k]]
        assert [e["token"] for e in entry["top_logprobs"]] == [names[t] for t in order]
        assert all(abs(e["logprob"] - chat_logprobs[k, t].item()) < 1e-4 for e, t in zip(entry["top_logprobs"], order))
    for extra, param in (({"logprobs": None}, "logprob_token_ids"), ({"max_tokens": 0, "echo": True},
                                                                     "logprob_token_ids"),
                         ({"logprob_token_ids": [hf.config.vocab_size]}, "logprob_token_ids")):
        refused = live.client.post("/v1/completions", json={**request, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (extra, refused.text)


def test_return_tokens_as_token_ids_names_the_log_probabilities_tokens_by_id(setup):
    """vLLM's `return_tokens_as_token_ids`: the log-probabilities' tokens (completions' `tokens` and `top_logprobs`
    keys, whole and streamed; chat's `token` and its `bytes`) written `token_id:N`, the ids the model chose and the
    same values as without it."""
    live, _, _, tokenizer, _ = setup
    request = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 2,
               "return_token_ids": True}
    plain = live.client.post("/v1/completions", json=request).json()["choices"][0]
    named = live.client.post("/v1/completions", json={**request, "return_tokens_as_token_ids": True}).json()
    named = named["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for mine, theirs in zip(named["logprobs"]["top_logprobs"], plain["logprobs"]["top_logprobs"], strict=True):
        assert all(k.startswith("token_id:") for k in mine)
        assert {tokenizer.decode([int(k[len("token_id:"):])]): v for k, v in mine.items()} == theirs
    with live.client.stream("POST", "/v1/completions", json={**request, "stream": True,
                                                             "return_tokens_as_token_ids": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = [t for c in chunks for choice in c["choices"] if choice.get("logprobs")
                for t in choice["logprobs"]["tokens"]]
    assert streamed == named["logprobs"]["tokens"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = live.client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"][0]["token"].startswith("token_id:")
               for e in entries)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(setup):
    """vLLM's `truncate_prompt_tokens`: a completion and a chat of a prompt's last k tokens equal transformers'
    greedy continuation of those tokens, the usage counting k; -1 keeps the context's length."""
    live, _, hf, tokenizer, _ = setup
    ids = (tokenizer("The quick brown fox jumps over the lazy dog. " * 40).input_ids)[:300]
    assert len(ids) == 300
    for keep, kept in ((12, 12), (200, 200), (-1, 256)):
        body = {"model": NAME, "prompt": ids, "max_tokens": 6 if kept < 256 else 1, "temperature": 0,
                "truncate_prompt_tokens": keep}
        if kept == 256:
            refused = live.client.post("/v1/completions", json=body)  # the context is full: no room for a token
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
            continue
        answer = live.client.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == expected_text(tokenizer, hf_greedy(hf, ids[-kept:], 6))[0]
        assert answer["usage"]["prompt_tokens"] == kept
    messages = [{"role": "user", "content": "Tell me a story about a fox and a dog in the woods."}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 6,
                                                          "temperature": 0, "truncate_prompt_tokens": 9}).json()
    assert chat["choices"][0]["message"]["content"] == expected_text(tokenizer, hf_greedy(hf, chat_ids[-9:], 6))[0]
    assert chat["usage"]["prompt_tokens"] == 9 < len(chat_ids)


def test_tokenize_detokenize_and_tokenizer_info_as_vllm(setup):
    """vLLM's tokenizer routes against the tokenizer itself: a prompt with and without special tokens,
    the token strings; chat messages rendered as `/v1/chat/completions` renders them (its prompt
    tokens, the template's options); ids back to text; the tokenizer's settings and chat template
    (no host path among them); refusals as 400s naming the field, `/tokenizer_info` a 404 where the
    server was not started with it."""
    live, model, _, tokenizer, _ = setup
    text = "Once upon a time there"
    for special in (True, False):
        body = live.client.post("/tokenize", json={"model": NAME, "prompt": text, "add_special_tokens": special,
                                                   "return_token_strs": True}).json()
        ids = tokenizer(text, add_special_tokens=special).input_ids
        assert body == {"count": len(ids), "max_model_len": model.package.context_length, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert live.client.post("/tokenize", json={"prompt": text}).json()["tokens"] == tokenizer(text).input_ids
    messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Here"}]
    for options in ({}, {"continue_final_message": True}, {"chat_template_kwargs": {"enable_thinking": False}}):
        tokens = live.client.post("/tokenize", json={"messages": messages, **options}).json()["tokens"]
        reference = {"add_generation_prompt": not options.get("continue_final_message"),
                     **options.get("chat_template_kwargs", {}),
                     **{k: v for k, v in options.items() if k != "chat_template_kwargs"}}
        assert tokens == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **reference))
        chat = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 1,
                                                              **options}).json()
        assert chat["usage"]["prompt_tokens"] == len(tokens)
    ids = tokenizer(text).input_ids
    assert live.client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    info = live.client.get("/tokenizer_info").json()
    assert info["chat_template"] == tokenizer.chat_template and info["eos_token"] == tokenizer.eos_token
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert "name_or_path" not in info and str(model.package.root.parent) not in json.dumps(info)  # no host path
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
                              ("/tokenize", {"messages": messages, "tools": [{"type": "function"}]},
                               "tools[0].function"),
                              ("/tokenize", {"prompt": "x" * 200_000}, "prompt"),
                              ("/detokenize", {"tokens": [5, model.package.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": [5, "6"]}, "tokens.1"),
                              ("/tokenize", {"model": "other", "prompt": "x"}, "model")):
        refused = live.client.post(path, json=body)
        assert refused.status_code == (404 if param == "model" else 400), (path, body, refused.text)
        assert refused.json()["error"]["param"] == param, refused.text
    with TestClient(create_app(model, tokenizer, name=NAME)) as client:
        off = client.get("/tokenizer_info")
        assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]


def chat_reference(hf, tokenizer, messages, new, **options):
    options = {"add_generation_prompt": True, **options}
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    return expected_text(tokenizer, hf_greedy(hf, list(ids), new)), len(ids)


def test_chat_template_options_as_vllm_takes_them(setup):
    """vLLM's and SGLang's chat fields, each against transformers' `apply_chat_template` with the same
    options and its greedy tokens: the template's own variables (`chat_template_kwargs`, as Qwen3's
    `enable_thinking`), the assistant's last message continued (`continue_final_message`, which turns
    `add_generation_prompt` off unless both are sent), no assistant turn (`add_generation_prompt`
    false)."""
    live, _, hf, tokenizer, _ = setup
    asked = [{"role": "user", "content": "Say something."}]
    started = asked + [{"role": "assistant", "content": "Here is something"}]
    cases = [(asked, {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
             (started, {"continue_final_message": True}, {"continue_final_message": True,
                                                          "add_generation_prompt": False}),
             (started, {"continue_final_message": True, "add_generation_prompt": False},
              {"continue_final_message": True, "add_generation_prompt": False}),
             (asked, {"add_generation_prompt": False}, {"add_generation_prompt": False})]
    prompts = set()
    for messages, fields, options in cases:
        (text, reason), prompt_tokens = chat_reference(hf, tokenizer, messages, 10, **options)
        body = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 10,
                                                              "temperature": 0, **fields}).json()
        assert body["choices"][0]["message"]["content"] == text, (fields, body)
        assert body["usage"]["prompt_tokens"] == prompt_tokens and body["choices"][0]["finish_reason"] == reason
        prompts.add((len(messages), prompt_tokens))
    assert len(prompts) == 3  # each option changed what was rendered (the two continuing cases are one)
    refused = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "tool",
                                                                                          "content": "42"}]})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == ("the model's chat template refused the messages: tool messages "
                                                  "are not supported")


def test_the_servers_default_template_variables_yield_to_the_requests(setup, monkeypatch):
    """vLLM's `--default-chat-template-kwargs` (say `{"enable_thinking": false}`): chat requests and `/tokenize`
    render with them (transformers' `apply_chat_template` with the same variables, and its greedy tokens), a
    request's own `chat_template_kwargs` and its `reasoning_effort` override them; one that sets an argument of
    the rendering itself, or is not an object, stops the server at start, and the flag takes JSON."""
    _, model, hf, tokenizer, _ = setup
    asked = [{"role": "user", "content": "Say something."}]
    live = LiveServer(create_app(model, tokenizer, name=NAME, default_chat_template_kwargs={"enable_thinking": False}))
    try:
        prompts = set()
        for fields, options in (({}, {"enable_thinking": False}),
                                ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
                                ({"reasoning_effort": "high"}, {"enable_thinking": True, "reasoning_effort": "high"})):
            (text, _), prompt_tokens = chat_reference(hf, tokenizer, asked, 8, **options)
            body = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": asked, "max_tokens": 8,
                                                                  "temperature": 0, **fields}).json()
            assert body["choices"][0]["message"]["content"] == text and body["usage"]["prompt_tokens"] == prompt_tokens
            prompts.add(prompt_tokens)
        assert len(prompts) == 2  # the default changed what was rendered
        tokens = live.client.post("/tokenize", json={"model": NAME, "messages": asked}).json()["tokens"]
        assert tokens == tokenizer.apply_chat_template(asked, tokenize=True, return_dict=False,
                                                       add_generation_prompt=True, enable_thinking=False)
    finally:
        live.stop()
    for given, words in (({"tokenize": False}, "may not set 'tokenize'"), (["x"], "must be a JSON object")):
        with pytest.raises(ValueError, match=words):
            create_app(model, tokenizer, default_chat_template_kwargs=given)
    import ortmodule.serving

    captured, folder = {}, str(setup[4].package_dir)
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: captured.update(options))
    cli.ortmodule(["serve", folder, "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert captured["default_chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        cli.ortmodule(["serve", folder, "--default-chat-template-kwargs", "enable_thinking=false"])

def test_prompt_tokens_details_count_the_prompts_tokens_the_prefix_cache_gave(setup):
    """vLLM's `--enable-prompt-tokens-details`: usage's `prompt_tokens_details.cached_tokens`, the prompt's tokens
    taken from the prefix cache. A prompt's first run takes none; sent again, all but its last token, which runs
    to give the next token's logits (a prompt's `n` choices count it once); a chat the same, whole and streamed.
    Without the flag usage has no such field, as vLLM's."""
    live, model, _, tokenizer, _ = setup
    prompt = tokenizer("A prompt long enough to fill two of the prefix cache's blocks of sixteen tokens, and then "
                       "some more words at its end").input_ids
    assert len(prompt) > 32
    plain = live.client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2}).json()
    assert "prompt_tokens_details" not in plain["usage"]
    detailed = LiveServer(create_app(model, tokenizer, name=NAME, enable_prompt_tokens_details=True))
    try:
        cached = []
        for _ in range(2):
            body = detailed.client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2,
                                                                 "n": 2, "temperature": 0.5, "seed": 1}).json()
            assert body["usage"]["prompt_tokens"] == len(prompt)
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, len(prompt) - 1]
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Tell me about the weather in Paris today, "
                                                                        "and the day after, in a few words."}],
                "max_tokens": 2}
        first = detailed.client.post("/v1/chat/completions", json=chat).json()["usage"]
        again = detailed.client.post("/v1/chat/completions", json=chat).json()["usage"]
        with detailed.client.stream("POST", "/v1/chat/completions", json={
                **chat, "stream": True, "stream_options": {"include_usage": True}}) as events:
            last = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")][-1]
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        for usage in (again, last["usage"]):
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    finally:
        detailed.stop()

def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(setup):
    """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries its choice's
    usage so far, its prompt's tokens and the tokens its chunks carried (the chat's first, its role, none), each
    choice ending at its tokens, which together are the last chunk's usage and the whole answer's; without
    `include_usage` no chunk has one, as vLLM's; another option is a 400 naming `stream_options`."""
    live, _, _, tokenizer, _ = setup
    prompt = tokenizer("The quick brown fox").input_ids
    for path, request in (("/v1/completions", {"prompt": prompt, "n": 2, "temperature": 0.8, "seed": 3}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say something."}],
                                                    "temperature": 0})):
        request = {"model": NAME, "max_tokens": 8, **request}
        whole = live.client.post(path, json=request).json()
        options = {"include_usage": True, "continuous_usage_stats": True}
        with live.client.stream("POST", path, json={**request, "stream": True, "stream_options": options}) as events:
            chunks = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")]
        so_far = {}
        for chunk in chunks[:-1]:
            (choice,), usage = chunk["choices"], chunk["usage"]
            assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]  # a prompt's n choices count it once
            assert usage["completion_tokens"] >= so_far.get(choice["index"], 0)
            so_far[choice["index"]] = usage["completion_tokens"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        assert sum(so_far.values()) == whole["usage"]["completion_tokens"] and len(so_far) == request.get("n", 1)
        if path.endswith("chat/completions"):
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[0]["usage"]["completion_tokens"] == 0
        with live.client.stream("POST", path, json={**request, "stream": True,
                                                    "stream_options": {"continuous_usage_stats": True}}) as events:
            assert not [line for line in events.iter_lines() if '"usage"' in line]
    bad = live.client.post("/v1/completions", json={"model": NAME, "prompt": "x", "stream": True,
                                                    "stream_options": {"include_usage": True, "per_token": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"

def test_chats_echo_begins_the_answer_with_the_last_message_as_vllm_does(setup):
    """vLLM's `echo` on chat: the assistant's message continued (`continue_final_message`) comes back whole, its
    text then transformers' greedy continuation, whole and streamed (its first content delta); after a user's
    message the answer is the same as without echo, unless the template adds no turn (`add_generation_prompt`
    false), where vLLM takes the answer's role to be that message's and its text comes first too."""
    live, _, hf, tokenizer, _ = setup
    asked = [{"role": "user", "content": "Say something."}]
    started = asked + [{"role": "assistant", "content": "Here is something"}]
    for messages, fields, lead in ((started, {"continue_final_message": True}, "Here is something"),
                                   (asked, {}, ""), (asked, {"add_generation_prompt": False}, "Say something.")):
        options = {"add_generation_prompt": not fields.get("continue_final_message") and
                   fields.get("add_generation_prompt", True), **fields}
        (text, _), _ = chat_reference(hf, tokenizer, messages, 8, **options)
        request = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "echo": True, **fields}
        body = live.client.post("/v1/chat/completions", json=request).json()
        assert body["choices"][0]["message"]["content"] == lead + text, (fields, body)
        with live.client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        contents = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
        assert "".join(contents) == lead + text and (not lead or lead in contents), fields


def test_chat_completions_and_their_stream(setup):
    live, _, hf, tokenizer, _ = setup
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    (text, reason), prompt_tokens = chat_reference(hf, tokenizer, messages, 15)
    request = {"model": NAME, "messages": messages, "max_tokens": 15, "temperature": 0}
    body = live.client.post("/v1/chat/completions", json=request).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == reason
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    events = []
    with live.client.stream("POST", "/v1/chat/completions",
                            json={**request, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == reason
    assert chunks[-1]["usage"] == body["usage"]


@pytest.mark.parametrize("fields", [{"tools": []}, {"tools": [], "tool_choice": "auto"},
                                    {"tools": [], "tool_choice": "required"}, {"tool_choice": "none"},
                                    {"functions": [], "function_call": "auto"}, {"response_format": {"type": "text"}},
                                    {"modalities": ["text"], "audio": None, "verbosity": None}])
def test_neutral_tool_fields_are_the_request_without_them(setup, fields):
    """OpenAI's (and vLLM 0.34's) reading of an empty `tools`: an omitted one, where "auto" and
    "required" have nothing to call and fall back to "none"; the answer is the plain request's."""
    live, _, hf, tokenizer, _ = setup
    messages = [{"role": "user", "content": "Say something."}]
    (text, _), prompt_tokens = chat_reference(hf, tokenizer, messages, 8)
    body = live.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 8,
                                                          "temperature": 0, **fields})
    assert body.status_code == 200, body.text
    assert body.json()["choices"][0]["message"]["content"] == text
    assert body.json()["usage"]["prompt_tokens"] == prompt_tokens


def test_neutral_extras_of_completions_are_the_request_without_them(setup):
    """vLLM's and SGLang's output-changing completion fields at what leaving them out means (as their clients
    send them) are taken: the answer is the plain request's."""
    live = setup[0]
    request = {"model": NAME, "prompt": "The fox", "max_tokens": 6, "temperature": 0}
    plain = live.client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    neutral = {"response_format": {"type": "text"}, "stop_regex": [], "no_stop_trim": False, "lora_path": None,
               "return_hidden_states": False, "structural_tag": None}
    answer = live.client.post("/v1/completions", json={**request, **neutral})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == plain


BAD = [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": ["x", "y"], "n": 513}, 400, "n"),  # over --max-items choices
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 1025}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 9000]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 400}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "echo": True, "max_tokens": 0, "stream": True}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": NAME}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 200_000}, 400, "prompt"),  # cannot fit, never tokenized
    ("/v1/completions", {"model": NAME, "prompt": ["x"] * 1025}, 400, "prompt"),  # over --max-items prompts
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x" * 200_000}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    # Values that once reached the model and failed there (500), or were taken silently.
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": "0"}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": "0.5"}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "x\ud800"}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["\udfff"]}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": "s" * 1001}, 400, "stop"),
    ("/v1/completions", {"model": "\ud800", "prompt": "x"}, 400, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "us\ud800er", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi\udc00"}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1,
                              "max_completion_tokens": 5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 60_000}] * 4}]}, 400, "messages"),  # parts together cannot fit
    # Tool choices without tools, OpenAI's deprecated functions (tool calling: tests/test_tool_calling.py); structured
    # output of a form it does not take (its forms: tests/test_structured_output.py).
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tool_choice"),  # auto: no parser
    *[("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], field: value}, 400,
       field) for field, value in (("tool_choice", "auto"), ("tool_choice", {"type": "function"}),
                                   ("functions", [{"name": "f"}]), ("function_call", "auto"),
                                   ("response_format", {"type": "structural_tag"}),
                                   ("chat_template_kwargs", {"tokenize": False}),
                                   ("chat_template_kwargs", {"add_generation_prompt": False}),
                                   ("continue_final_message", True))],  # the last message is the user's
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "assistant", "content": "hi"}],
                              "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"note": "x" * 200_000}}, 400, "chat_template_kwargs"),
    # vLLM's documents: objects, their text counted with the messages'
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "documents": ["x"]},
     400, "documents.0"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                              "documents": [{"text": "x" * 200_000}]}, 400, "documents"),
    # vLLM's sampling extras out of range, and its extras that would change the output and are not
    # carried out (were taken silently).
    *[("/v1/completions", {"model": NAME, "prompt": "x", field: value}, 400, field)
      for field, value in (("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0), ("min_tokens", -1),
                           ("min_tokens", 17), ("ignore_eos", "yes"), ("stop_token_ids", [512]),
                           ("include_stop_str_in_output", 1),
                           ("skip_special_tokens", "no"), ("use_beam_search", True), ("prompt_logprobs", -1),
                           ("prompt_logprobs", 21), ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
                           ("truncate_prompt_tokens", 257), ("allowed_token_ids", []), ("allowed_token_ids", [512]),
                           ("bad_words", "fox"), ("bad_words", [""]),
                           ("return_tokens_as_token_ids", 1),
                           ("guided_json", [1]), ("guided_choice", []), ("regex", "a("),
                           ("structured_outputs", {"choice": ["a"], "regex": "a"}),
                           # output-changing fields of vLLM's and SGLang's completions that were taken silently
                           ("response_format", {"type": "grammar"}), ("structural_tag", "{}"),
                           ("stop_regex", ["a+"]), ("lora_path", "adapter"), ("return_hidden_states", True),
                           ("custom_logit_processor", "x"), ("no_stop_trim", 1))],
    ("/v1/completions", {"model": NAME, "prompt": "x", "allowed_token_ids": [5, -1]}, 400, "allowed_token_ids.1"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                              "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                              "add_special_tokens": True}, 400, "add_special_tokens"),
    *[("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], field: value}, 400,
       field) for field, value in (("chat_template", "{{ messages }}"), ("reasoning_effort", "extreme"),
                                   ("echo", 1), ("mm_processor_kwargs", {"a": 1}), ("media_io_kwargs", {"image": {}}),
                                   # OpenAI's audio output, web search and answer length (were taken silently)
                                   ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
                                   ("web_search_options", {}), ("verbosity", "low"))],
    ("/v1/completions", {"model": NAME, "prompt": "x", "min_tokens": 2, "stop": ["a"]}, 400, "min_tokens"),
    # OpenAI's completions fields that would change the output and are not carried out, and stops past the limits
    ("/v1/completions", {"model": NAME, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "suffix": " end"}, 400, "suffix"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": [str(i) for i in range(9)]}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop_token_ids": ["5"]}, 400, "stop_token_ids.0"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "eA==", "format": "wav"}}]}]}, 400, "messages[0].content"),
    ("/detokenize", {"model": NAME, "tokens": [5] * 300}, 400, "tokens"),  # more than the context's 256
    # The template's own refusal (a 500 before): its message, as a client error.
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_requests_get_openai_errors_naming_the_field(setup, path, body, status, param):
    live = setup[0]
    # As the JSON of clients in other languages: lone surrogates written as \\uXXXX escapes.
    content = json.dumps(body, ensure_ascii=True)
    response = live.client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


def test_a_tokenizer_without_a_chat_template_refuses_messages_by_name(setup):
    """A base model's tokenizer has no chat template: chat completions and `/tokenize` of messages are a
    400 saying to send a prompt; a prompt is tokenized as ever."""
    _, model, _, tokenizer, fixture = setup
    plain = load_tokenizer(fixture.package_dir)
    assert not getattr(plain, "chat_template", None)
    live = LiveServer(create_app(model, plain, name=NAME, tokenizer_info=True))
    try:
        messages = [{"role": "user", "content": "hi"}]
        for path in ("/v1/chat/completions", "/tokenize"):
            answer = live.client.post(path, json={"model": NAME, "messages": messages})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
            assert "has no chat template: send a prompt instead of messages" in answer.json()["error"]["message"]
        tokens = live.client.post("/tokenize", json={"model": NAME, "prompt": "hi there"}).json()["tokens"]
        assert tokens == tokenizer("hi there").input_ids
    finally:
        live.stop()



REQUEST_TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_a_requests_own_chat_template_when_the_server_trusts_it(setup):
    """vLLM's request `chat_template`, on a server started with `--trust-request-chat-template`: chat completions
    render it in place of the server's (transformers' `apply_chat_template(chat_template=...)` and its greedy
    tokens), `/tokenize` too; a base model's tokenizer, which has no template, then takes messages; a tokenizer's
    named templates are taken by name; a word that is neither a template nor a name, and a template that does not
    compile, are a 400 naming `chat_template`. A server that does not trust them refuses the field by name on both
    routes (`/tokenize` ignored it before, counting the server's template's tokens)."""
    live, model, hf, tokenizer, fixture = setup
    messages = [{"role": "user", "content": "Say something."}]
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = live.client.post(path, json={"model": NAME, "messages": messages, "chat_template": REQUEST_TEMPLATE})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    plain = load_tokenizer(fixture.package_dir)
    assert not getattr(plain, "chat_template", None)
    trusting = LiveServer(create_app(model, plain, name=NAME, trust_request_chat_template=True))
    try:
        (text, _), prompt_tokens = chat_reference(hf, tokenizer, messages, 10, chat_template=REQUEST_TEMPLATE)
        assert prompt_tokens != chat_reference(hf, tokenizer, messages, 1)[1]  # not the package's template
        body = trusting.client.post("/v1/chat/completions", json={
            "model": NAME, "messages": messages, "max_tokens": 10, "temperature": 0,
            "chat_template": REQUEST_TEMPLATE}).json()
        assert body["choices"][0]["message"]["content"] == text and body["usage"]["prompt_tokens"] == prompt_tokens
        tokens = trusting.client.post("/tokenize", json={"model": NAME, "messages": messages,
                                                         "chat_template": REQUEST_TEMPLATE}).json()["tokens"]
        assert tokens == tokenizer.apply_chat_template(messages, chat_template=REQUEST_TEMPLATE, tokenize=True,
                                                       return_dict=False, add_generation_prompt=True)
        without = trusting.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages})
        assert without.status_code == 400 and "has no chat template" in without.json()["error"]["message"]
        plain.chat_template = {"default": tokenizer.chat_template, "plain": REQUEST_TEMPLATE}
        named = trusting.client.post("/tokenize", json={"model": NAME, "messages": messages, "chat_template": "plain"})
        assert named.json()["tokens"] == tokens
        default = trusting.client.post("/tokenize", json={"model": NAME, "messages": messages}).json()["tokens"]
        assert default == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                        add_generation_prompt=True) != tokens
        for template, words in (("plainer", "nor one of the tokenizer's named templates (default, plain)"),
                                ("{% for m in messages %}{{ m.content }}", "chat_template: line 1: ")):
            bad = trusting.client.post("/v1/chat/completions", json={"model": NAME, "messages": messages,
                                                                     "chat_template": template})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template", bad.text
            assert words in bad.json()["error"]["message"]
        kwargs = trusting.client.post("/v1/chat/completions", json={
            "model": NAME, "messages": messages, "chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}})
        assert kwargs.status_code == 400 and "send it as a field of the request" in kwargs.json()["error"]["message"]
    finally:
        trusting.stop()


def test_a_server_made_without_a_tokenizer_scores_token_ids_and_refuses_the_rest(setup):
    """`create_app(model, None)`: /v1/score takes token ids (transformers' probabilities), /health_generate
    answers; every route that writes or reads text is a 400 saying so (completions of token ids, /generate's
    input_ids and /detokenize failed in the engine with a 500 on the missing tokenizer's decode)."""
    _, model, hf, _, _ = setup
    live = LiveServer(create_app(model, None, name=NAME, tokenizer_info=True))
    try:
        ids = [5, 17, 99]
        scored = live.client.post("/v1/score", json={"query": ids, "items": [[7], [8]], "label_token_ids": [3, 4]})
        assert scored.status_code == 200, scored.text
        with torch.no_grad():
            for item, scores in zip((7, 8), scored.json()["scores"], strict=True):
                reference = torch.softmax(hf(torch.tensor([ids + [item]])).logits[0, -1].double(), -1)[[3, 4]]
                assert torch.allclose(torch.tensor(scores, dtype=torch.float64), reference, atol=1e-5)
        vllm = live.client.post("/generative_scoring", json={"query": ids, "items": [[7], [8]],
                                                            "label_token_ids": [3, 4], "apply_softmax": False})
        assert [d["score"] for d in vllm.json()["data"]] == [s[0] for s in scored.json()["scores"]], vllm.text
        assert live.client.get("/health_generate").status_code == 200
        for method, path, body in [("post", "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 2}),
                                   ("post", "/v1/chat/completions",
                                    {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}),
                                   ("post", "/generate", {"input_ids": ids}),
                                   ("post", "/tokenize", {"prompt": "hi"}), ("post", "/detokenize", {"tokens": ids}),
                                   ("get", "/tokenizer_info", None)]:
            answer = live.client.request(method.upper(), path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["message"] == (f"{path} needs a tokenizer, and this server was made without "
                                                         "one: it scores token ids on /v1/score")
        text = live.client.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [3]})
        assert text.status_code == 400 and "need a tokenizer" in text.text
    finally:
        live.stop()

def test_models_and_malformed_json(setup):
    live = setup[0]
    assert live.client.get(f"/v1/models/{NAME}").json()["id"] == NAME
    missing = live.client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    broken = live.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "error" in broken.json()


def test_a_client_leaving_mid_stream_frees_its_slot(setup, monkeypatch):
    """Every decode step is slowed to 20 ms: a 200-token stream would hold the worker for 4 s. The
    client reads two events and leaves; the next request is answered long before that."""
    live, _, _, _, _ = setup
    run = runtime.Session.run
    monkeypatch.setattr(runtime.Session, "run", lambda s, b: (time.sleep(0.02), run(s, b)))
    before = live.client.get("/metrics?format=json").json()["abandoned"]
    request = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as client, client.stream("POST", "/v1/completions",
                                                                                json=request) as stream:
        seen = 0
        for line in stream.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break
    start = time.monotonic()
    answer = live.client.post("/v1/completions", json={"model": NAME, "prompt": "Hello", "max_tokens": 2,
                                                       "temperature": 0})
    assert answer.status_code == 200 and time.monotonic() - start < 2.0
    deadline = time.monotonic() + 5
    while live.client.get("/metrics?format=json").json()["abandoned"] != before + 1:
        assert time.monotonic() < deadline, "the stream's departure was not recorded"
        time.sleep(0.05)


def test_a_full_queue_answers_503_in_openai_shape(build):
    """One request held in the worker, one waiting (`max_queue=1`): the third gets 503, the first
    two their answers once the worker goes on."""
    from concurrent.futures import ThreadPoolExecutor

    fixture = build("llama")
    model, _ = load_pair(fixture)
    app = create_app(model, load_tokenizer(fixture.package_dir), name=NAME, max_queue=1, window_ms=0)
    started, release, _ = hold_worker(app.state.served)
    live = LiveServer(app)
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    try:
        with ThreadPoolExecutor(2) as pool:
            first, second = one_held_one_waiting(live, pool, started, body)
            busy = live.client.post("/v1/completions", json=body)
            assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_error"
            assert "busy" in busy.json()["error"]["message"]
            release.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
    finally:
        release.set()
        live.stop()


def test_chat_template_flag_replaces_the_packages_and_is_checked_before_the_load(build, tmp_path, monkeypatch,
                                                                                 capsys):
    """vLLM's `--chat-template` (a file, or the template itself) on a package without a chat template: chat
    requests then answer as transformers' greedy generate on what the template renders; a template that
    does not parse, or a path to nothing, stops the server before the package loads, naming the fault.
    `--served-model-name` is vLLM's spelling of `--name`."""
    import ortmodule.serving
    from ortmodule.serving import app as serving_app

    fixture = build("llama")
    _, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    assert not tokenizer.chat_template  # without the flag, a chat request is refused
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    expected = expected_text(tokenizer, hf_greedy(hf, list(ids), 6))[0]
    (tmp_path / "template.jinja").write_text(CHAT_TEMPLATE)
    for given in (str(tmp_path / "template.jinja"), CHAT_TEMPLATE):
        app, _ = serving_app.load_app(str(fixture.package_dir), "127.0.0.1", "cpu", False, None, None, None,
                                     {"name": "t"}, given)
        live = LiveServer(app)
        try:
            answer = live.client.post("/v1/chat/completions", json={"model": "t", "messages": messages,
                                                                    "max_tokens": 6, "temperature": 0}).json()
        finally:
            live.stop()
        assert answer["choices"][0]["message"]["content"] == expected
    captured = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: captured.update(options))
    cli.ortmodule(["serve", str(fixture.package_dir), "--served-model-name", "x", "--chat-template",
                   str(tmp_path / "template.jinja")])
    assert (captured["name"], captured["chat_template"]) == ("x", str(tmp_path / "template.jinja"))
    assert captured["trust_request_chat_template"] is False
    cli.ortmodule(["serve", str(fixture.package_dir), "--trust-request-chat-template"])
    assert captured["trust_request_chat_template"] is True
    monkeypatch.undo()

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before --chat-template was checked")

    monkeypatch.setattr(OrtModelForCausalLM, "from_pretrained", loaded)
    for flag, message in (("{% for m in messages %}{{ m }}", "line 1: Unexpected end of template"),
                          (str(tmp_path / "absent.jinja"), "no such file, and not a template")):
        with pytest.raises(SystemExit) as stopped:
            cli.ortmodule(["serve", str(fixture.package_dir), "--chat-template", flag, "--port", "0"])
        assert stopped.value.code == 2 and message in capsys.readouterr().err
