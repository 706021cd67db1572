"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) against Anthropic's own SDK (its
types validated strictly) and transformers' greedy generation on the same weights."""

import httpx
import pytest
from helpers import CHAT_TEMPLATE, LiveServer, expected_text, grammar_greedy, hf_greedy
from helpers import OPENAI_NAME as NAME

anthropic = pytest.importorskip("anthropic")

GREEDY = {"temperature": 0.0}  # Anthropic's newer SDKs send sampling fields in the body's extras


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def client_of(live, key: str = "not-needed"):
    return anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0)


def test_a_message_is_transformers_greedy_text_in_the_apis_types(openai_live):
    """A system prompt (text blocks) and a conversation: the reply is transformers' greedy continuation of the
    chat template's prompt, cut by the length ("max_tokens") or at a stop sequence ("stop_sequence", the one
    matched named); the answer validates against the SDK's `Message`; count_tokens counts the same prompt."""
    from anthropic.types import Message

    live, _, hf, tokenizer, _ = openai_live
    client = client_of(live)
    chat = [{"role": "system", "content": "Be brief.\nAnswer in English."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Name a color."}]
    ids = prompt_ids(tokenizer, chat)
    tokens = hf_greedy(hf, ids, 12)
    text = expected_text(tokenizer, tokens)[0]
    request = dict(model=NAME, max_tokens=12, system=[{"type": "text", "text": "Be brief."},
                                                      {"type": "text", "text": "Answer in English."}],
                   messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"},
                             {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    answer = client.messages.create(**request, extra_body=GREEDY)
    assert (answer.content[0].text, answer.stop_reason, answer.stop_sequence) == (text, "max_tokens", None)
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (len(ids), 12)
    raw = httpx.post(f"{live.url}/v1/messages", json={**request, **GREEDY}).json()
    assert Message.model_validate(raw).content[0].text == text  # every field the type requires, of its types
    assert client.messages.count_tokens(model=NAME, system=request["system"],
                                        messages=request["messages"]).input_tokens == len(ids)
    stop = text[len(text) // 2:][:2]
    cut = client.messages.create(**request, stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (text[:text.index(stop)], "stop_sequence",
                                                                         stop)


def test_a_stream_and_a_structured_reply(openai_live):
    """The SDK's stream: its text is the reply's, its final message the same with its stop reason; Anthropic's
    structured output (`output_config.format`, a JSON schema) ends the reply where the schema is complete
    ("end_turn"), as transformers' greedy generate under the same grammar."""
    from llguidance import LLMatcher

    live, _, hf, tokenizer, _ = openai_live
    client = client_of(live)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.messages.create(model=NAME, max_tokens=10, messages=messages, extra_body=GREEDY)
    with client.messages.stream(model=NAME, max_tokens=10, messages=messages, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text and final.stop_reason == "max_tokens"
    with httpx.stream("POST", f"{live.url}/v1/messages", json={"model": NAME, "max_tokens": 3, "messages": messages,
                                                              "stream": True, **GREEDY}) as events:
        kinds = [line[7:] for line in events.iter_lines() if line.startswith("event: ")]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    schema = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}}, "required": ["pick"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # (random weights)
    tokens, complete = grammar_greedy(hf, tokenizer, prompt_ids(tokenizer, messages),
                                      LLMatcher.grammar_from_json_schema(schema), 40)
    answer = client.messages.create(model=NAME, max_tokens=40, messages=messages, extra_body=GREEDY,
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    assert answer.content[0].text == expected_text(tokenizer, tokens)[0]
    assert complete and answer.stop_reason == "end_turn"


@pytest.mark.parametrize(("fields", "kind", "words"), [
    # tool calling (tests/test_tool_calling.py): "auto" on a server started without a parser, a choice without
    # tools, Anthropic's server tools, a result in the assistant's turn
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "invalid_request_error",
     "--enable-auto-tool-choice"),
    ({"tool_choice": {"type": "any"}}, "invalid_request_error", "`tools` must be set"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "invalid_request_error",
     "'web_search_20250305' is not supported"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "4"}]}]},
     "invalid_request_error", "'tool_result' block is not supported here"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "invalid_request_error",
     "budget_tokens (1024) must be less than max_tokens (3)"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2}}, "invalid_request_error", "needs the server's reasoning"),
    ({"thinking": {"type": "interleaved"}}, "invalid_request_error", "thinking must be"),
    ({"output_config": {"effort": "minimal"}}, "invalid_request_error", "output_config.effort must be one of"),
    ({"output_config": {"format": {"type": "json_schema", "schema": [1]}}}, "invalid_request_error",
     "output_config.format"),
    ({"messages": [{"role": "system", "content": "x"}]}, "invalid_request_error", "goes in `system`"),
    ({"system": "Be brief.", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]},
     "invalid_request_error", "messages[1].content: this server takes no images"),  # counted past the system
    ({"max_tokens": None}, "invalid_request_error", "max_tokens is required"),
    ({"max_tokens": 10**6}, "invalid_request_error", "max_tokens 1000000"),
    ({"model": "claude-x"}, "not_found_error", "does not exist"),
])
def test_what_cannot_be_carried_out_is_refused_in_anthropics_shape(openai_live, fields, kind, words):
    live = openai_live[0]
    body = {"model": NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], **fields}
    answer = httpx.post(f"{live.url}/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert answer.status_code in (400, 404), answer.text
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == kind
    assert words in answer.json()["error"]["message"], answer.text


def test_anthropics_sdk_authenticates_with_its_own_header(build):
    """With an API key the server takes Anthropic's `x-api-key` (its SDK's header) as OpenAI's bearer token; a
    wrong key is a 401 in Anthropic's shape."""
    from helpers import load_pair

    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    fixture = build("llama")
    model, _ = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    live = LiveServer(create_app(model, tokenizer, name=NAME, api_key="sesame"))
    try:
        prompt = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        assert client_of(live, "sesame").messages.count_tokens(**{k: v for k, v in prompt.items()
                                                                   if k != "max_tokens"}).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            client_of(live, "wrong").messages.create(**prompt)
        assert client_of(live, "sesame").messages.create(**prompt, extra_body=GREEDY).usage.output_tokens == 2
    finally:
        live.stop()


def test_lm_evals_anthropic_chat_backend_equals_its_chat_completions_backend(openai_live, monkeypatch):
    """lm-eval's `anthropic-chat` backend (a generation task's requests as Anthropic messages, with the
    `x-api-key` and `anthropic-version` headers) through the server answers as its `local-chat-completions`
    backend does through `/v1/chat/completions` with the same stop strings (anthropic-chat leaves out the
    task's whitespace-only stop "\\n", so the chat run is given the rest as its `until`)."""
    import lm_eval

    from ortmodule import tasks

    live = openai_live[0]
    monkeypatch.setenv("ANTHROPIC_API_KEY", "not-needed")
    names = ["ortmodule_arithmetic_gen"]
    common = dict(tasks=names, task_manager=tasks.task_manager(names), log_samples=True, limit=12,
                  apply_chat_template=True, verbosity="ERROR")
    messages = lm_eval.simple_evaluate(model="anthropic-chat", model_args=f"base_url={live.url}/v1/messages,"
                                       f"model={NAME},max_gen_toks=8", **common)
    chat = lm_eval.simple_evaluate(model="local-chat-completions", model_args=f"base_url={live.url}/v1/chat/"
                                   f"completions,model={NAME},max_gen_toks=8", gen_kwargs="until=.", **common)
    got, expected = (sorted(run["samples"][names[0]], key=lambda s: s["doc_id"]) for run in (messages, chat))
    assert len(got) == 12 and [s["resps"] for s in got] == [s["resps"] for s in expected]
    assert messages["results"][names[0]]["exact_match,none"] == chat["results"][names[0]]["exact_match,none"]
