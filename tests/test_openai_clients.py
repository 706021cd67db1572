"""Clients nobody here wrote, against `ortmodule serve`'s OpenAI routes: the `openai` package,
lm-eval's `local-completions` backend (the same metrics and loglikelihoods as `--model ortmodule`
in-process), and 32 concurrent clients mixing score, completions and chat."""

import os

import lm_eval
import pytest
import torch
from helpers import OPENAI_NAME as NAME
from helpers import expected_text

import ortmodule
import ortmodule.lm_eval  # noqa: F401  (registers --model ortmodule)
from ortmodule import tasks
from ortmodule_dev import load

LOAD_SECONDS = float(os.environ.get("ORTMODULE_LOAD_SECONDS", "30"))


def generated(model, tokenizer, ids: list[int], **options) -> str:
    """What `model.generate` makes of a prompt, as a completion's text."""
    out = model.generate(torch.tensor([ids]), **options)
    return expected_text(tokenizer, out[0, len(ids):].tolist())[0]


def test_the_openai_client_gets_completions_chat_and_a_stream(openai_live):
    from openai import OpenAI

    live, model, _, tokenizer, _ = openai_live
    client = OpenAI(base_url=f"{live.url}/v1", api_key="not-needed", max_retries=0)
    prompt = "The quick brown fox"
    completion = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert completion.choices[0].text == generated(model, tokenizer, tokenizer(prompt).input_ids, max_new_tokens=10,
                                                   do_sample=False)
    sampled = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0.7, top_p=0.95, seed=3)
    assert sampled.choices[0].text == generated(model, tokenizer, tokenizer(prompt).input_ids, max_new_tokens=10,
                                                do_sample=True, temperature=0.7, top_p=0.95, top_k=0,
                                                generator=torch.Generator().manual_seed(3))
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    expected = generated(model, tokenizer, ids, max_new_tokens=12, do_sample=False)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == expected and chat.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    assert [m.id for m in client.models.list().data] == [NAME]


def samples(result: dict, task: str) -> list[dict]:
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_local_completions_equals_in_process(openai_live, backend):
    """The shipped multiple-choice and generation tasks through the server, against
    `--model ortmodule` in-process on the same package: same metrics, loglikelihoods within 1e-4,
    the same generated answers; with the package's tokenizer on the client, or the server's
    (`tokenizer_backend=remote`: vLLM's `/tokenizer_info`, `/tokenize` and `/detokenize`)."""
    live, _, _, _, fixture = openai_live
    task_names = ["ortmodule_arithmetic_mc", "ortmodule_arithmetic_gen"]
    common = dict(tasks=task_names, task_manager=tasks.task_manager(task_names), log_samples=True,
                  limit=16, verbosity="ERROR")
    tokenizer = f"tokenizer={fixture.package_dir}," if backend == "huggingface" else ""
    remote = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={live.url}/v1/completions,model={NAME},{tokenizer}tokenizer_backend={backend},"
                   f"tokenized_requests=True,max_length=256,num_concurrent=4",
        **common)
    local = lm_eval.simple_evaluate(model="ortmodule", model_args=f"pretrained={fixture.package_dir}",
                                    batch_size=1, device="cpu", **common)
    for task in task_names:
        ours, theirs = local["results"][task], remote["results"][task]
        assert {k: v for k, v in ours.items() if "stderr" not in k and k != "alias"} == \
            {k: v for k, v in theirs.items() if "stderr" not in k and k != "alias"}
    pairs = list(zip(samples(local, "ortmodule_arithmetic_mc"), samples(remote, "ortmodule_arithmetic_mc")))
    assert pairs
    for a, b in pairs:
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"]):
            assert abs(float(ll_a) - float(ll_b)) < 1e-4 and greedy_a == greedy_b
    for a, b in zip(samples(local, "ortmodule_arithmetic_gen"), samples(remote, "ortmodule_arithmetic_gen")):
        assert a["resps"] == b["resps"]


def test_lm_eval_local_chat_completions_equals_in_process(openai_live):
    """lm-eval's `local-chat-completions` backend (a generation task with `--apply_chat_template`,
    its requests as chat messages on `/v1/chat/completions`, lm-eval's stop strings and seed) against
    `OrtModuleLM` in-process on the same model and chat template: the same answers and metric."""
    from ortmodule.lm_eval import OrtModuleLM

    live, model, _, tokenizer, _ = openai_live
    task_names = ["ortmodule_arithmetic_gen"]
    common = dict(tasks=task_names, task_manager=tasks.task_manager(task_names), log_samples=True, limit=12,
                  apply_chat_template=True, verbosity="ERROR")
    remote = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"base_url={live.url}/v1/chat/completions,model={NAME},num_concurrent=4,max_gen_toks=12",
        **common)
    local = lm_eval.simple_evaluate(model=OrtModuleLM(pretrained=model, tokenizer=tokenizer, batch_size=4,
                                                      max_gen_toks=12), **common)
    pairs = list(zip(samples(local, task_names[0]), samples(remote, task_names[0])))
    assert len(pairs) == 12
    for a, b in pairs:
        assert a["arguments"] and a["resps"] == b["resps"], (a["resps"], b["resps"])
    assert local["results"][task_names[0]]["exact_match,none"] == remote["results"][task_names[0]]["exact_match,none"]


def mixed_calls(model, tokenizer) -> list[load.Call]:
    """Score, greedy completions and chat requests with their expected answers, computed in-process."""
    calls = []
    for i, prompt in enumerate(["The quick brown fox", "Once upon a time", "In the beginning", "Hello there"]):
        ids = tokenizer(prompt).input_ids
        text = generated(model, tokenizer, ids, max_new_tokens=6 + i, do_sample=False)
        calls.append(load.Call("completions", "/v1/completions",
                               {"model": NAME, "prompt": prompt, "max_tokens": 6 + i, "temperature": 0},
                               lambda body, t=text: None if body["choices"][0]["text"] == t else "wrong text"))
        messages = [{"role": "user", "content": prompt}]
        chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        chat_text = generated(model, tokenizer, chat_ids, max_new_tokens=8, do_sample=False)
        calls.append(load.Call("chat", "/v1/chat/completions",
                               {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0},
                               lambda body, t=chat_text: None if body["choices"][0]["message"]["content"] == t
                               else "wrong chat text"))
        items = [" yes", " no", " maybe"]
        scores = ortmodule.score(model, tokenizer, prompt, items, [5, 6, 7])
        calls.append(load.Call("score", "/v1/score", {"query": prompt, "items": items, "label_token_ids": [5, 6, 7]},
                               lambda body, s=scores: None if torch.allclose(torch.tensor(body["scores"]),
                                                                             torch.tensor(s), atol=1e-5)
                               else "wrong scores"))
    return calls


def test_lm_evals_gguf_backend_gets_transformers_loglikelihoods_and_generations(openai_live):
    """lm-eval's `gguf` backend (llama.cpp's server's client) sends no `model`, as vLLM takes it: the
    continuation's log-probability (the joint text's tokens after the context, as it reads them from an echo
    with 10 alternatives), whether each was the greedy one, and its greedy generations cut at `until`, as
    transformers gives them on the same weights."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.gguf import GGUFLM

    live, _, hf, tokenizer, _ = openai_live
    lm = GGUFLM(base_url=live.url)
    pairs = [("The quick brown", " fox jumps"), ("Hello", " world"), ("a b c", " d")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (total, greedy) in zip(pairs, got, strict=True):
        encoded = tokenizer(context + continuation, return_offsets_mapping=True)
        ids = torch.tensor([encoded.input_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0, :-1].double(), -1)
        first = next(i for i, (start, _) in enumerate(encoded.offset_mapping) if start >= len(context))
        positions = range(first, ids.shape[1])
        expected = sum(logprobs[i - 1, ids[0, i]].item() for i in positions)
        assert abs(total - expected) < 1e-4, (context, total, expected)
        assert greedy == all(logprobs[i - 1].argmax().item() == ids[0, i].item() for i in positions)
    prompt = "The quick brown fox"
    out = hf.generate(torch.tensor([tokenizer(prompt).input_ids]), max_new_tokens=16, do_sample=False, pad_token_id=2)
    text = expected_text(tokenizer, out[0, len(tokenizer(prompt).input_ids):].tolist())[0]
    until = text[len(text) // 2:][:3]
    generated, = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [until]}), 0)])
    assert generated == text[:text.index(until)].strip()


@pytest.mark.slow
def test_32_clients_mixing_score_completions_and_chat(openai_live):
    live, model, _, tokenizer, _ = openai_live
    result = load.run(live.url, mixed_calls(model, tokenizer), clients=32, seconds=LOAD_SECONDS)
    print({k: v for k, v in result.items() if k != "wrong"})
    assert result["wrong"] == [] and result["failed"] == 0 and result["refused"] == 0
    assert result["sent"] == result["answered"] == result["correct"] > 32
    assert set(result["kinds"]) == {"score", "completions", "chat"}
