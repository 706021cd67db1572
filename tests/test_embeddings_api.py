"""OpenAI's `POST /v1/embeddings` in vLLM's form, against the `openai` client nobody here wrote and transformers'
final hidden state at each input's last token on the same weights (vLLM's pooling of a decoder model);
`scoring.pooled_hidden_states`, the model-level primitive under it, on every architecture of the quick set; vLLM's
`--pooler-config`."""

import base64
import random
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import CHAT_TEMPLATE, MODEL_ARCHES, OPENAI_NAME, hold_worker, load_pair, served_live

from ortmodule import scoring


def reference(hf, ids: list[int], normalize: bool = True, pooling: str = "LAST") -> torch.Tensor:
    """transformers' final norm output at the last token of `ids` alone (no padding; `MEAN`: their mean over the
    tokens, `CLS`: the first token's), L2-normalized."""
    with torch.inference_mode():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    state = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]
    return torch.nn.functional.normalize(state, dim=-1) if normalize else state


def assert_close(got, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < tolerance * max(1.0, expected.abs().max().item())


def post(live, **body) -> httpx.Response:
    return live.client.post("/v1/embeddings", json={"model": OPENAI_NAME, **body})


def test_the_openai_client_gets_transformers_last_token_states(openai_live):
    """Texts of different lengths in one request (a padded batch), through the `openai` client, which asks for
    base64 and decodes it itself: each embedding is transformers' normalized final state at the text's last
    token, in the input's order; the usage counts the tokens."""
    from openai import OpenAI

    live, _, hf, tokenizer, _ = openai_live
    client = OpenAI(base_url=f"{live.url}/v1", api_key="not-needed", max_retries=0)
    texts = ["hello there", "a much longer text of several more words than the others", "x"]
    answer = client.embeddings.create(model=OPENAI_NAME, input=texts)
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert [item.index for item in answer.data] == [0, 1, 2] and answer.model == OPENAI_NAME
    for item, row in zip(answer.data, ids):
        assert_close(item.embedding, reference(hf, row))
        assert abs(torch.tensor(item.embedding).norm().item() - 1) < 1e-5
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=OPENAI_NAME, input="hello there", encoding_format="float")
    assert_close(one.data[0].embedding, reference(hf, ids[0]))


def test_token_ids_raw_states_truncation_and_the_ids(openai_live):
    """Token ids (one list and a list of lists); `normalize: false` (the final state as it is);
    `truncate_prompt_tokens` (the last k tokens); `dimensions` equal to the hidden size; the answer's id from
    X-Request-Id or vLLM's `request_id`."""
    live, model, hf, _, _ = openai_live
    rows = [[5, 9, 77, 301, 12, 40], [8, 3], [100, 200, 300, 400]]
    answer = post(live, input=rows, normalize=False, encoding_format="float").json()
    for item, row in zip(answer["data"], rows):
        assert_close(item["embedding"], reference(hf, row, normalize=False))
    assert answer["object"] == "list" and answer["usage"] == {"prompt_tokens": 12, "total_tokens": 12,
                                                              "completion_tokens": 0}
    one = post(live, input=rows[0], truncate_prompt_tokens=3, dimensions=model.package.hidden_size).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == 3
    assert_close(one["data"][0]["embedding"], reference(hf, rows[0][-3:]))
    whole = post(live, input=rows[0], truncate_prompt_tokens=-1).json()  # -1: the context, the whole input here
    assert_close(whole["data"][0]["embedding"], reference(hf, rows[0]))
    assert post(live, input=[1, 2], request_id="abc").json()["id"] == "embd-abc"
    named = live.client.post("/v1/embeddings", json={"input": [1, 2]}, headers={"X-Request-Id": "from-header"})
    assert named.json()["id"] == "embd-from-header"


@pytest.mark.parametrize("dtype, code, endianness", [("float32", "f", "little"), ("float32", "f", "big"),
                                                     ("float16", "e", "big"), ("bfloat16", None, "little")])
def test_base64_in_each_dtype_and_byte_order(openai_live, dtype, code, endianness):
    """vLLM's `embed_dtype` and `endianness`: the base64 bytes decode (by struct, byte order given) to the
    float32 embedding rounded to that dtype."""
    live, _, hf, _, _ = openai_live
    row = [7, 70, 170, 270]
    text = post(live, input=row, encoding_format="base64", embed_dtype=dtype, endianness=endianness).json()
    raw = base64.b64decode(text["data"][0]["embedding"])
    expected = reference(hf, row)
    order = "<" if endianness == "little" else ">"
    if code is None:  # bfloat16: the top 16 bits of a float32
        halves = struct.unpack(f"{order}{len(raw) // 2}H", raw)
        got = torch.tensor(halves, dtype=torch.int32).bitwise_left_shift(16).view(torch.float32)
        assert_close(got, expected, tolerance=1e-2)
    else:
        got = struct.unpack(f"{order}{len(raw) // struct.calcsize(code)}{code}", raw)
        assert_close(got, expected, tolerance=1e-5 if code == "f" else 1e-3)


def test_a_chat_embeds_its_template_rendering(openai_live):
    """vLLM's chat form: the messages rendered by the chat template without the assistant's turn (vLLM's default
    for embeddings), or with it when asked."""
    live, _, hf, tokenizer, _ = openai_live
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two and two?"}]
    for adding in (False, True):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=adding, tokenize=True, return_dict=False)
        answer = post(live, messages=messages, add_generation_prompt=adding, encoding_format="float").json()
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert_close(answer["data"][0]["embedding"], reference(hf, list(ids)))


def test_bad_requests_are_refused_naming_the_field(openai_live):
    """Each refusal is a 400 (404: another model) in OpenAI's error shape naming the field, before any model call."""
    live, *_ = openai_live
    cases = [({"input": "a", "messages": [{"role": "user", "content": "a"}]}, "input", "either input"),
             ({}, "input", "either input"),
             ({"input": []}, "input", "input is empty"),
             ({"input": [[1, 2], []]}, "input", "input[1] has no tokens"),
             ({"input": [1, 2], "dimensions": 3}, "dimensions", "Matryoshka"),
             ({"input": [1, 2], "encoding_format": "bytes"}, "encoding_format", "float, base64"),
             ({"input": [1, 2], "embed_dtype": "fp8_e4m3"}, "embed_dtype", "float32, float16, bfloat16"),
             ({"input": [1, 2], "endianness": "middle"}, "endianness", "native, little, big"),
             ({"input": [1, 600]}, "input", "vocabulary"),
             ({"input": list(range(1, 300))}, "input", "truncate_prompt_tokens"),
             ({"input": [1, 2], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "from 1"),
             ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, "add_special_tokens",
              "chat template"),
             ({"input": "a", "normalize": "yes"}, None, "normalize")]
    for body, param, words in cases:
        response = live.client.post("/v1/embeddings", json={"model": OPENAI_NAME, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"] or words in str(error.get("param")), (body, error)
        if param is not None:
            assert error["param"] == param, (body, error)
    other = live.client.post("/v1/embeddings", json={"model": "another", "input": "a"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_requests_batched_together_keep_their_own_answers(build):
    """Requests queued while the model's thread is held run several to a call, normalized and raw ones mixed, in
    batches of a small token budget: each gets its own inputs' embeddings, as transformers computes them."""
    live, _, hf, _ = served_live(build("llama"), CHAT_TEMPLATE, token_budget=16)
    try:
        started, release, scored = hold_worker(live.app.state.served)
        first = {"input": [3, 4, 5], "encoding_format": "float"}
        bodies = [{"input": [[i + 1] * (i + 2), [40 + i, 7]], "normalize": i % 2 == 0, "encoding_format": "float"}
                  for i in range(6)]
        with ThreadPoolExecutor(7) as pool:
            held = pool.submit(post, live, **first)
            assert started.wait(30)
            answers = [pool.submit(post, live, **body) for body in bodies]
            deadline = time.monotonic() + 30
            while live.client.get("/metrics?format=json").json()["waiting"] < len(bodies):
                assert time.monotonic() < deadline, "the requests never reached the queue"
                time.sleep(0.02)
            release.set()
            assert_close(held.result().json()["data"][0]["embedding"], reference(hf, [3, 4, 5]))
            for body, answer in zip(bodies, answers):
                data = answer.result().json()["data"]
                for item, row in zip(data, body["input"]):
                    assert_close(item["embedding"], reference(hf, row, normalize=body["normalize"]))
        # the held request alone, then the queued ones up to the budget's tokens a pass: several in one call
        assert scored[0] == 1 and sum(scored) == 1 + len(bodies) and max(scored[1:]) > 1, scored
        metrics = live.client.get("/metrics?format=json").json()
        assert metrics["requests"]["embed"] == 1 + len(bodies) and metrics["batches"]["embed"] == len(scored)
        assert 'ortmodule:requests_total{engine="0",kind="embed",model_name="tiny-llama"} 7.0' in \
            live.client.get("/metrics").text
    finally:
        live.stop()


@pytest.mark.parametrize("arch", [*MODEL_ARCHES, "lfm2", "qwen3_5"])  # hybrids: layer states beside attention
def test_pooled_hidden_states_equal_transformers(build, arch):
    """`scoring.pooled_hidden_states` over prompts of several lengths in batches of a 12-token budget (several
    padded batches, one prompt past the budget alone): each row is transformers' final state at that prompt's
    last token run alone, or their mean over its tokens, or its first token's."""
    model, hf = load_pair(build(arch))
    prompts = [[5, 6, 7], [9] * 14, [300, 4], [11, 12, 13, 14, 15], [2]]
    for pooling in ("LAST", "MEAN", "CLS"):
        states = scoring.pooled_hidden_states(model, prompts, 12, pooling)
        assert states.dtype == torch.float32 and states.shape == (len(prompts), model.package.hidden_size)
        for row, prompt in zip(states, prompts):
            assert_close(row, reference(hf, prompt, normalize=False, pooling=pooling), tolerance=1e-4)
    with pytest.raises(ValueError, match="pooling must be one of LAST, MEAN, CLS"):
        scoring.pooled_hidden_states(model, prompts, 12, "last")


@pytest.mark.parametrize("config, pooling, normalize", [({"pooling_type": "MEAN"}, "MEAN", True),
                                                        ({"seq_pooling_type": "CLS", "normalize": False}, "CLS", False),
                                                        ({"use_activation": False}, "LAST", False)])
def test_the_pooler_config_sets_the_pooling_and_the_default_normalization(build, config, pooling, normalize):
    """vLLM's `--pooler-config`: the server's pooling and whether embeddings are normalized unless a request says."""
    live, _, hf, _ = served_live(build("llama"), CHAT_TEMPLATE, pooler_config=config)
    try:
        rows = [[5, 9, 77, 301, 12], [8, 3]]
        answer = post(live, input=rows, encoding_format="float").json()
        for item, row in zip(answer["data"], rows):
            assert_close(item["embedding"], reference(hf, row, normalize=normalize, pooling=pooling))
        asked = post(live, input=rows[0], encoding_format="float", normalize=not normalize).json()
        assert_close(asked["data"][0]["embedding"], reference(hf, rows[0], normalize=not normalize, pooling=pooling))
    finally:
        live.stop()


@pytest.mark.parametrize("config, words", [({"pooling_type": "ALL"}, "pooling_type must be one of LAST, MEAN, CLS"),
                                           ({"dimensions": 32}, "'dimensions' is not supported"),
                                           ({"normalize": "yes"}, "normalize must be one of"),
                                           ({"pooling_type": "MEAN", "seq_pooling_type": "CLS"}, "two values")])
def test_a_pooler_config_it_cannot_carry_out_is_refused_at_start(llama, config, words):
    from ortmodule.serving.settings import Settings

    with pytest.raises(ValueError, match=words):
        Settings(pooler_config=config)


def test_batches_of_mixed_lengths_hold_little_padding():
    """`length_batches` with `spread`: every prompt in exactly one batch, each batch within the token budget (or a
    lone prompt), its shortest prompt at least `spread` x its longest, and each batch as large as those allow."""
    lengths = [random.Random(7).choice([3, 5, 8, 13, 40, 90, 200]) + k % 4 for k in range(300)]
    for budget, spread in ((512, 0.75), (4096, 0.5), (100, 0.9)):
        batches = list(scoring.length_batches(lengths, 0, budget, spread=spread))
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        for k, batch in enumerate(batches):
            longest, shortest = max(lengths[i] for i in batch), min(lengths[i] for i in batch)
            assert len(batch) == 1 or len(batch) * longest <= budget
            assert shortest >= spread * longest
            if k + 1 < len(batches):  # cut only where the next prompt breaks a rule
                following = lengths[batches[k + 1][0]]
                assert (len(batch) + 1) * longest > budget or following < spread * longest


def test_the_servers_limits_are_kept_before_tokenizing(build):
    """`--max-items` inputs a request and `max_response_values` numbers an answer (inputs x the hidden size: 64
    here), each a 400 naming `input`, before any text is tokenized."""
    live, _, _, tokenizer = served_live(build("llama"), CHAT_TEMPLATE, max_items=3, max_response_values=150)
    calls = []

    class Counted(type(tokenizer)):  # this server's own tokenizer (served_live loads one for it)
        def __call__(self, *args, **kwargs):
            calls.append(args)
            return super().__call__(*args, **kwargs)

    tokenizer.__class__ = Counted
    try:
        for given, words in ((["a", "b", "c", "d"], "at most 3"), (["a", "b", "c"], "192 numbers")):
            response = post(live, input=given)
            assert response.status_code == 400 and response.json()["error"]["param"] == "input", response.text
            assert words in response.json()["error"]["message"]
        assert calls == []
        assert post(live, input=["a", "b"]).status_code == 200 and len(calls) == 1
    finally:
        live.stop()


def test_the_pooler_config_flag_reaches_the_settings(llama, monkeypatch, capsys):
    """`ortmodule serve --pooler-config JSON` (vLLM's flag) becomes the settings' `pooler_config`; a key it cannot
    carry out stops the command before the package loads, naming the key."""
    import ortmodule.serving
    from ortmodule import cli

    given = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: given.update(options))
    cli.ortmodule(["serve", str(llama.package_dir), "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}'])
    assert given["pooler_config"] == {"pooling_type": "MEAN", "normalize": False}
    monkeypatch.undo()  # the real serve: the settings are checked before the package is looked at
    with pytest.raises(SystemExit) as stopped:
        cli.ortmodule(["serve", "/no/such/package", "--pooler-config", '{"max_embed_len": 9}'])
    assert stopped.value.code == 2 and "'max_embed_len' is not supported" in capsys.readouterr().err
