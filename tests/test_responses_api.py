"""OpenAI's Responses API (`POST /v1/responses`) against the `openai` client nobody here wrote, its own
pydantic types (validated strictly), and transformers' greedy generation on the same weights."""

import json

import httpx
import pytest
import torch
from helpers import CHAT_TEMPLATE, LiveServer, expected_text, load_pair
from helpers import OPENAI_NAME as NAME


def reference(hf, tokenizer, messages: list[dict], max_new_tokens: int, eos: set[int] = frozenset({1})):
    """transformers' greedy tokens after the chat template's prompt (up to and without an end token), its
    text as a completion's, whether an end token ended it, and the prompt's length."""
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2,
                      eos_token_id=sorted(eos))[0, len(ids):].tolist()
    ended = bool(out) and out[-1] in eos
    tokens = out[:-1] if ended else out
    return tokens, expected_text(tokenizer, tokens)[0], ended, len(ids)


def same_logprobs(got: list, expected: list) -> bool:
    """The same tokens and alternatives, their log-probabilities within 1e-5."""
    def close(a, b):
        return a[0] == b[0] and abs(a[1] - b[1]) < 1e-5
    return len(got) == len(expected) and all(
        close(g, e) and len(g[2]) == len(e[2]) and all(map(close, g[2], e[2])) for g, e in zip(got, expected))


def client_of(live):
    from openai import OpenAI

    return OpenAI(base_url=f"{live.url}/v1", api_key="not-needed", max_retries=0)


def test_a_response_is_transformers_greedy_text_in_the_apis_types(openai_live):
    """A text input, and a conversation with instructions, a developer message and parts: the output text
    is transformers' greedy continuation of the chat template's prompt; the answer validates against the
    client's `Response` type; a length-cut answer is "incomplete" with its reason; usage counts the tokens."""
    from openai.types.responses import Response

    live, _, hf, tokenizer, _ = openai_live
    client = client_of(live)
    tokens, text, _, prompt = reference(hf, tokenizer, [{"role": "user", "content": "Tell me a story."}], 12)
    answer = client.responses.create(model=NAME, input="Tell me a story.", max_output_tokens=12, temperature=0)
    assert answer.output_text == text and answer.status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (prompt, len(tokens))
    raw = httpx.post(f"{live.url}/v1/responses", json={"model": NAME, "input": "Tell me a story.",
                                                       "max_output_tokens": 12, "temperature": 0}).json()
    assert Response.model_validate(raw).output_text == text  # every field the type requires, of its types
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in English."},
                    {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"},
                    {"role": "user", "content": "Name a color."}]
    _, text, _, _ = reference(hf, tokenizer, conversation, 10)
    answer = client.responses.create(
        model=NAME, instructions="Be brief.", max_output_tokens=10, temperature=0, metadata={"run": "1"},
        input=[{"role": "developer", "content": "Answer in English."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hi there"}]},
               {"role": "user", "content": "Name a color."}])
    assert answer.output_text == text and answer.instructions == "Be brief." and answer.metadata == {"run": "1"}
    assert answer.output[0].role == "assistant" and answer.store is False


def test_vllms_responses_extras_are_carried_out(openai_live):
    """vLLM's Responses request takes chat's sampling extras and more, carried out here as on chat: `stop` (the
    text cut before it, or after it with `include_stop_str_in_output`; the response completed) and `logit_bias`
    against transformers' greedy text (its `sequence_bias` the same); left out they were ignored. Its extras this
    server does not carry out are refused by name (`media_io_kwargs`, `vllm_xargs`, `cache_salt`)."""
    live, _, hf, tokenizer, _ = openai_live
    asked = [{"role": "user", "content": "Tell me a story."}]
    tokens, text, _, _ = reference(hf, tokenizer, asked, 12)
    stop = text[3:5]
    for include in (False, True):
        answer = httpx.post(f"{live.url}/v1/responses", json={
            "model": NAME, "input": asked, "max_output_tokens": 12, "temperature": 0, "stop": [stop],
            "include_stop_str_in_output": include}).json()
        cut = text[:text.index(stop) + (len(stop) if include else 0)]
        assert answer["output"][0]["content"][0]["text"] == cut and answer["status"] == "completed", answer
    ids = list(tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=True, return_dict=False))
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=2, eos_token_id=None,
                          sequence_bias={(tokens[0],): -100.0})[0, len(ids):].tolist()
    answer = httpx.post(f"{live.url}/v1/responses", json={
        "model": NAME, "input": asked, "max_output_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logit_bias": {str(tokens[0]): -100}}).json()
    assert answer["output"][0]["content"][0]["text"] == expected_text(tokenizer, out)[0] != text
    for name, value in (("media_io_kwargs", {"image": {}}), ("vllm_xargs", {"a": 1}), ("cache_salt", "s")):
        refused = httpx.post(f"{live.url}/v1/responses", json={"model": NAME, "input": "Hi", name: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text


def test_a_response_ended_by_its_end_token_is_completed_streamed_or_not(build):
    """With an end token the model generates (its generation config's), the answer is "completed", and its
    stream is the API's events in order: the deltas make the text, `response.completed` closes it, and the
    client's stream helper returns the final response."""
    from ortmodule import OrtModelForCausalLM, load_tokenizer
    from ortmodule.serving import create_app

    fixture = build("llama")
    _, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Tell me a story."}]
    first, _, _, _ = reference(hf, tokenizer, messages, 8)
    end = first[5]  # the sixth token ends the answer
    tokens, text, ended, _ = reference(hf, tokenizer, messages, 40, eos={1, end})
    assert ended and len(tokens) < 40
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    model.generation_config.eos_token_id = [1, end]
    live = LiveServer(create_app(model, tokenizer, name=NAME, window_ms=5))
    try:
        client = client_of(live)
        answer = client.responses.create(model=NAME, input="Tell me a story.", max_output_tokens=40, temperature=0)
        assert (answer.output_text, answer.status, answer.incomplete_details) == (text, "completed", None)
        events = list(client.responses.create(model=NAME, input="Tell me a story.", max_output_tokens=40,
                                              temperature=0, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
        assert events[-1].response.output_text == text and events[-1].response.id == events[0].response.id
        with client.responses.stream(model=NAME, input="Tell me a story.", max_output_tokens=40,
                                     temperature=0) as stream:
            assert stream.get_final_response().output_text == text
    finally:
        live.stop()


def test_a_cut_stream_ends_incomplete_and_its_logprobs_are_chats(openai_live):
    """A stream cut by `max_output_tokens` ends with `response.incomplete`; the log-probabilities `include`
    asks for are those `/v1/chat/completions` gives for the same request (within float32's rounding: a later
    request reuses the earlier one's prompt), in the stream's deltas and its done event alike."""
    live, _, hf, tokenizer, _ = openai_live
    client = client_of(live)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    expected = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
                for c in chat.choices[0].logprobs.content]
    answer = client.responses.create(model=NAME, input="Hi", max_output_tokens=6, temperature=0, top_logprobs=2,
                                     include=["message.output_text.logprobs"])
    got = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
           for c in answer.output[0].content[0].logprobs]
    assert same_logprobs(got, expected) and answer.output_text == chat.choices[0].message.content
    events = list(client.responses.create(model=NAME, input="Hi", max_output_tokens=6, temperature=0,
                                          top_logprobs=2, include=["message.output_text.logprobs"], stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    streamed = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
                for e in events if e.type == "response.output_text.delta" for c in e.logprobs]
    assert same_logprobs(streamed, expected)
    assert [c.token for c in next(e for e in events if e.type == "response.output_text.done").logprobs] == \
        [token for token, _, _ in expected]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no conversations"),
    ({"background": True}, "background", "answers in the request"),
    # tool calling (tests/test_tool_calling.py): "auto" on a server started without a parser, hosted tools
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "'web_search' is not supported"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "is not supported"),
    ({"max_tool_calls": 3}, "max_tool_calls", "built-in tools"),
    ({"text": {"format": {"type": "grammar", "name": "x"}}}, "text", "is not supported"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text", "a JSON schema is an object"),
    ({"reasoning": {"effort": "high", "summary": "brief"}}, "reasoning.summary", "must be one of"),
    ({"reasoning": {"effort": "high", "budget": 3}}, "reasoning.budget", "takes reasoning.effort"),
    ({"truncation": "auto"}, "truncation", "does not cut a prompt"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "includes 'message.output_text.logprobs' only"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "needs its call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input", "file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}]}, "input", "'input_file'"),
    ({"input": [{"content": "no role"}]}, "input", "needs a role"),
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     "input[1].role", "input[1].role 'robot' is not a chat role"),
    ({"temperature": "0"}, "temperature", ""),
    ({"stop": 5}, "stop", ""),  # vLLM's extras, checked as chat checks them
    ({"presence_penalty": 3.0}, "presence_penalty", ""),
    ({"top_logprobs": 21}, "top_logprobs", ""),
])
def test_what_cannot_be_carried_out_is_refused_naming_its_field(openai_live, fields, param, words):
    """A 400 in OpenAI's error shape naming the field (this API's name, not chat's), never an answer that
    silently left the field out; neutral values pass, as unknown fields do."""
    live = openai_live[0]
    answer = httpx.post(f"{live.url}/v1/responses", json={"model": NAME, "input": "Hi", "max_output_tokens": 3,
                                                          **fields})
    assert answer.status_code in (400, 422), answer.text
    error = answer.json()["error"]
    assert param in (error["param"] or "") + error["message"] and words in error["message"]
    neutral = {"tools": [], "tool_choice": "auto", "text": {"format": {"type": "text"}}, "truncation": "disabled",
               "background": False, "reasoning": None, "store": True, "parallel_tool_calls": False,
               "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "user": "u"}
    answer = httpx.post(f"{live.url}/v1/responses", json={"model": NAME, "input": "Hi", "max_output_tokens": 3,
                                                          "temperature": 0, **neutral})
    assert answer.status_code == 200 and answer.json()["store"] is False


def test_the_request_id_field_is_the_responses_id_as_vllms(openai_live):
    """vLLM's `request_id` field names the response (its id, whole and in the stream's events); without it a
    `resp_` id; a request_id that is not a string is refused naming it."""
    live, _, hf, tokenizer, _ = openai_live
    _, text, _, _ = reference(hf, tokenizer, [{"role": "user", "content": "Tell me a story."}], 6)
    body = {"model": NAME, "input": "Tell me a story.", "max_output_tokens": 6, "temperature": 0}
    named = httpx.post(f"{live.url}/v1/responses", json={**body, "request_id": "trace-42"}).json()
    assert (named["id"], named["output"][0]["content"][0]["text"]) == ("trace-42", text)
    assert httpx.post(f"{live.url}/v1/responses", json=body).json()["id"].startswith("resp_")
    with httpx.stream("POST", f"{live.url}/v1/responses", json={**body, "stream": True, "request_id": "trace-43"},
                      timeout=60) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert {e["response"]["id"] for e in events if "response" in e} == {"trace-43"}
    for bad in (42, "", "x" * 257):
        refused = httpx.post(f"{live.url}/v1/responses", json={**body, "request_id": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id", refused.text
