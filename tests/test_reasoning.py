"""Reasoning output (serving/reasoning.py, `--reasoning-parser`): a thinking model's `<think>...</think>` text
answered apart from its content on the chat, responses and messages routes, whole and streamed, beside tool
calls; the output itself transformers' greedy text (held here by a regex to a thinking model's form, so that
the random fixture writes one), split where `</think>` is."""

import json

import httpx
import pytest
import torch
from helpers import OPENAI_NAME as NAME
from helpers import expected_text, grammar_greedy, served_live
from test_tool_calling import CALL, TOOL_TEMPLATE, TOOLS, gathered

llguidance = pytest.importorskip("llguidance")
from llguidance import LLMatcher  # noqa: E402

ASK = [{"role": "user", "content": "Which is larger, 9.11 or 9.8?"}]
THINKING = r"<think>[a-z ]{4,16}</think>\n\n[A-Z][a-z ]{2,12}\."
PLAIN = r"[A-Z][a-z ]{2,12}\."


@pytest.fixture(scope="module")
def thinking_live(build):
    """The server on the llama fixture with the tool template, the qwen3 reasoning parser and hermes calls; a
    request's grammar over the whole output (`enable_in_reasoning`), which holds the random model to a thinking
    model's form here."""
    live, model, hf, tokenizer = served_live(build("llama"), TOOL_TEMPLATE, reasoning_parser="qwen3",
                                             enable_in_reasoning=True, enable_auto_tool_choice=True,
                                             tool_call_parser="hermes")
    yield live, model, hf, tokenizer
    live.stop()


def greedy(hf, tokenizer, pattern: str, messages=ASK, tools=None, new: int = 120) -> str:
    ids = list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    tokens, complete = grammar_greedy(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), new)
    assert complete
    return expected_text(tokenizer, tokens)[0]


def post(live, path: str, **fields) -> dict:
    answer = httpx.post(f"{live.url}{path}", json={"model": NAME, "temperature": 0, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def chat_stream(live, **fields) -> tuple[str, str, list]:
    """A chat stream's reasoning and content, each put together from its deltas, and its calls' deltas."""
    reasoning, content, calls = "", "", []
    body = {"model": NAME, "temperature": 0, "stream": True, **fields}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body) as events:
        for line in events.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                calls += delta.get("tool_calls") or []
    return reasoning, content, calls


def test_chat_answers_the_reasoning_apart_from_the_content(thinking_live):
    """The text between <think> and </think> is `reasoning` (and `reasoning_content`), the rest the `content`,
    whole and in a stream's deltas; `include_reasoning: false` leaves it out; output that does not open with
    <think> is all content (qwen3's reading)."""
    live, _, hf, tokenizer = thinking_live
    text = greedy(hf, tokenizer, THINKING)
    thought, _, answer = text.removeprefix("<think>").partition("</think>")
    fields = {"messages": ASK, "max_tokens": 120, "structured_outputs": {"regex": THINKING}}
    message = post(live, "/v1/chat/completions", **fields)["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (thought, thought, answer)
    assert chat_stream(live, **fields)[:2] == (thought, answer)
    hidden = post(live, "/v1/chat/completions", **fields, include_reasoning=False)["choices"][0]["message"]
    assert hidden == {"role": "assistant", "content": answer}
    assert chat_stream(live, **fields, include_reasoning=False)[:2] == ("", answer)
    info = httpx.get(f"{live.url}/model_info").json()  # SGLang's route says which parsers read the output
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("qwen3", "hermes")
    plain = greedy(hf, tokenizer, PLAIN)
    fields["structured_outputs"] = {"regex": PLAIN}
    assert post(live, "/v1/chat/completions", **fields)["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": plain}
    assert chat_stream(live, **fields)[:2] == ("", plain)


def test_calls_are_read_from_the_content_after_the_reasoning(thinking_live):
    """Thinking, then a hermes call: the reasoning apart, the call read from the content, finish "tool_calls";
    streamed, the reasoning as it comes and the call at the end."""
    live, _, hf, tokenizer = thinking_live
    pattern = r"<think>[a-z ]{4,12}</think>\n\n" + CALL.replace("{", r"\{").replace("}", r"\}")
    text = greedy(hf, tokenizer, pattern, tools=TOOLS, new=190)
    thought, _, rest = text.removeprefix("<think>").partition("</think>")
    inner = json.loads(rest.strip().removeprefix("<tool_call>").removesuffix("</tool_call>"))
    fields = {"messages": ASK, "tools": TOOLS, "max_tokens": 190, "structured_outputs": {"regex": pattern}}
    choice = post(live, "/v1/chat/completions", **fields)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == thought
    assert choice["message"]["content"] == "\n\n"  # the text between the thinking and the call, as hermes reads it
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": inner["name"], "arguments": json.dumps(inner["arguments"])}
    reasoning, content, calls = chat_stream(live, **fields)
    assert (reasoning, content) == (thought, "\n\n")
    assert gathered([{"tool_calls": calls}]) == [(inner["name"], json.dumps(inner["arguments"]))]


def test_responses_and_messages_answer_the_reasoning_in_their_own_shapes(thinking_live):
    """The Responses API: a `reasoning` item (its `reasoning_text`; a summary asked for, none written) before the
    message, in the `openai` client's types, streamed as the same items; Anthropic's: a `thinking` block before
    the text, streamed the same."""
    from openai import OpenAI
    from openai.types.responses import Response

    anthropic = pytest.importorskip("anthropic")
    live, _, hf, tokenizer = thinking_live
    text = greedy(hf, tokenizer, THINKING)
    thought, _, answer = text.removeprefix("<think>").partition("</think>")
    sdk = OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    request = dict(model=NAME, input=ASK, max_output_tokens=120, temperature=0.0, reasoning={"summary": "auto"},
                   extra_body={"structured_outputs": {"regex": THINKING}})  # a summary asked for, as Codex asks
    whole = sdk.responses.create(**request)
    Response.model_validate(whole.model_dump(), strict=True)
    with sdk.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    ids = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False))
    tokens, _ = grammar_greedy(hf, tokenizer, ids, LLMatcher.grammar_from_regex(THINKING), 120)
    ends = [len(tokenizer.decode(tokens[:i + 1])) for i in range(len(tokens))]  # each token's end in the text
    inside = sum(1 for end in ends if len("<think>") < end <= len("<think>") + len(thought))
    assert 0 < inside < len(tokens) - 3
    for response in (whole, streamed):
        reasoning, message = response.output
        assert (reasoning.type, reasoning.content[0].text, reasoning.summary) == ("reasoning", thought, [])
        assert (message.type, message.content[0].text, response.output_text) == ("message", answer, answer)
        # the tokens between the thinking's markers, as vLLM counts them; the prompt cached but for its last token
        assert response.usage.output_tokens_details.reasoning_tokens == inside
    assert streamed.usage.input_tokens_details.cached_tokens == streamed.usage.input_tokens - 1
    handed_back = post(live, "/v1/responses", input=ASK + [whole.output[0].model_dump(), whole.output[1].model_dump(),
                                                           {"role": "user", "content": "Sure?"}],
                       max_output_tokens=2)
    assert handed_back["status"] == "incomplete"  # taken (the reasoning item left out of the prompt)
    client = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
    request = dict(model=NAME, max_tokens=120, messages=ASK,
                   extra_body={"temperature": 0.0, "structured_outputs": {"regex": THINKING}})
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    for got in (message, final):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in got.content] == [
            ("thinking", thought), ("text", answer)]


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "content"), [
    ("qwen3", False, "<think>a b</think>\n\nYes.", "a b", "\n\nYes."),
    ("qwen3", True, "a b</think>Yes.", "a b", "Yes."),  # a template that opened <think> in the prompt (Qwen3.5's)
    ("qwen3", False, "a b</think>Yes.", None, "a b</think>Yes."),  # one that did not: no thinking
    ("qwen3", False, "<think>cut short", "cut short", None),
    ("qwen3", False, "No thinking.", None, "No thinking."),
    ("qwen3", False, "<thi", None, "<thi"),
    ("qwen3", True, "<think>a</think>", "a", None),
    ("deepseek_r1", False, "all thinking", "all thinking", None),
    ("deepseek_r1", False, "<think>x</think>y", "x", "y"),
    ("deepseek_r1", False, "x</think></think>y", "x", "</think>y"),
    (None, False, "<think>x</think>y", None, "<think>x</think>y"),
    ("gemma4", False, "<|channel>thought\na b<channel|>Yes.", "a b", "Yes."),  # its channel's label left out
    ("gemma4", False, "<|channel>other<channel|>Yes.", "other", "Yes."),  # no label: the text kept
    ("gemma4", False, "<|channel>thou", "thou", None),
    ("gemma4", False, "<think>x</think>y", None, "<think>x</think>y"),
    ("gemma4", False, "Plain.", None, "Plain."),
    ("mistral", False, "[THINK]a b[/THINK]Yes.", "a b", "Yes."),
    ("mistral", False, "[THINK]cut", "cut", None),
    ("mistral", False, "No [THINK]", None, "No [THINK]"),
    ("granite", False, "Here is my thought process:\na b\n\nHere is my response:\nYes.", "\na b\n\n", "\nYes."),
    ("granite", False, "Here's my thought process: x Here's my response: y", " x ", " y"),
    ("granite", False, "Here is my thought process: Here is my respite. Here's my response:", " Here is my respite. ",
     None),
    ("granite", False, "Here is my thought process: cut short", " cut short", None),
    ("granite", False, "Here is my response: plain", None, "Here is my response: plain"),  # no thinking opened
    ("granite", False, "Here is my", None, "Here is my"),
])
def test_the_parsers_read_as_vllms_and_a_stream_reads_the_same_at_every_cut(parser, opened, text, reasoning,
                                                                            content):
    """Each parser's reading of whole outputs; a stream given the output in pieces cut anywhere (every one or two
    cuts) sends reasoning and content that put together are the whole reading."""
    from ortmodule.serving.reasoning import Reasoning, ReasoningStream, reasoning_tokens, split_reasoning

    reading = Reasoning(parser, opened) if parser else None
    assert split_reasoning(reading, text) == (reasoning, content)
    # the Responses API's count of reasoning tokens, a token a character here: the reasoning's, no marker's
    assert reasoning_tokens(reading, text, list(range(1, len(text) + 1))) == len(reasoning or "")
    if parser is None:
        return
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream, got = ReasoningStream(reading), ["", ""]
            for piece in (text[:i], text[i:j], text[j:]):
                for k, part in enumerate(stream.piece(piece)):
                    got[k] += part
            for k, part in enumerate(stream.end()):
                got[k] += part
            assert (got[0] or None, got[1] or None) == (reasoning or None, content), (i, j)


GRANITE_WORDS = ["Here is my thought process:", "Here's my thought process:", "Here is my response:",
                 "Here's my response:", "Here", "Here is", "Here's", " my", " response", ":", " thought process",
                 "\n", " a", " b c", "é"]


@pytest.mark.parametrize("seed", range(300))
def test_granites_thinking_reads_as_vllms_granite_parser_reads_it(seed):
    """Random Granite outputs (its two forms of each marker, and pieces of them, among words): where the output
    opens with the thinking's words and holds the response's, the reading is vLLM's `granite` parser's whole
    answer (its regex: the reasoning up to the first "Here is my response:" or "Here's my response:", the content
    after it); output that does not open with them is all content; a stream in random pieces reads the same."""
    import random
    import re

    from ortmodule.serving.reasoning import Reasoning, ReasoningStream, split_reasoning

    rng = random.Random(seed)
    text = rng.choice(["", "Here is my thought process:", "Here's my thought process:", " "]) + \
        "".join(rng.choice(GRANITE_WORDS) for _ in range(rng.randrange(12)))
    reading = Reasoning("granite")
    found = re.findall(r"(?:Here's|Here is) my thought process:(.*?)(?:Here's|Here is) my response:(.*)", text,
                       re.DOTALL)  # vLLM's whole reading
    if found and text.startswith(("Here is my thought process:", "Here's my thought process:")):
        assert split_reasoning(reading, text) == (found[0][0], found[0][1] or None)
    elif not text.startswith(("Here is my thought process:", "Here's my thought process:")):
        assert split_reasoning(reading, text) == (None, text)
    stream, got, at = ReasoningStream(reading), ["", ""], 0
    while at < len(text):
        step = rng.randint(1, 6)
        got = [g + p for g, p in zip(got, stream.piece(text[at: at + step]))]
        at += step
    got = [g + p for g, p in zip(got, stream.end())]
    reasoning, content = split_reasoning(reading, text)
    assert (got[0] or None, got[1] or None) == (reasoning or None, content or None), text


def test_granite_thinks_in_its_words_on_the_chat_route(build):
    """`--reasoning-parser granite`: Granite 3.2's thinking ("Here is my thought process:" to "Here's my
    response:", held here by a regex) is the reasoning, the rest the content, whole and streamed, of transformers'
    greedy text; a thinking budget is refused by name (its end is words, not tokens to force)."""
    live, _, hf, tokenizer = served_live(build("llama"), TOOL_TEMPLATE, reasoning_parser="granite",
                                         enable_in_reasoning=True)
    try:
        pattern = r"Here is my thought process:\n[a-z ]{4,16}\n\nHere's my response:\n[A-Z][a-z ]{2,12}\."
        text = greedy(hf, tokenizer, pattern)
        thought, _, answer = text.removeprefix("Here is my thought process:").partition("Here's my response:")
        fields = {"messages": ASK, "max_tokens": 120, "structured_outputs": {"regex": pattern}}
        message = post(live, "/v1/chat/completions", **fields)["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (thought, answer) and thought.strip()
        assert chat_stream(live, **fields)[:2] == (thought, answer)
        plain = greedy(hf, tokenizer, PLAIN)
        fields["structured_outputs"] = {"regex": PLAIN}
        assert post(live, "/v1/chat/completions", **fields)["choices"][0]["message"] == {"role": "assistant",
                                                                                         "content": plain}
        refused = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": NAME, "messages": ASK, "max_tokens": 4, "thinking_token_budget": 2})
        assert refused.status_code == 400 and "granite" in refused.json()["error"]["message"]
    finally:
        live.stop()


def test_deepseek_r1s_output_without_its_end_is_all_reasoning(thinking_live):
    """deepseek_r1's template opens <think> in the prompt: output without </think> is all reasoning, content
    None; the settings refuse a parser they do not know."""
    from fastapi.testclient import TestClient

    from ortmodule.serving import Settings, create_app

    _, model, hf, tokenizer = thinking_live
    plain = greedy(hf, tokenizer, PLAIN)
    with TestClient(create_app(model, tokenizer, name=NAME, reasoning_parser="deepseek_r1",
                               enable_in_reasoning=True)) as client:
        message = client.post("/v1/chat/completions", json={
            "model": NAME, "messages": ASK, "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"regex": PLAIN}}).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (plain, None)
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        Settings(reasoning_parser="exaone4")


def test_the_responses_apis_logprobs_are_left_out_where_the_output_is_read(thinking_live):
    """A server that reads its output for reasoning leaves the Responses message's log-probabilities out
    whether or not this output thinks, whole and streamed alike (a stream cannot know in advance)."""
    from openai import OpenAI

    live = thinking_live[0]
    sdk = OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    for pattern in (THINKING, PLAIN):
        request = dict(model=NAME, input=ASK, max_output_tokens=120, temperature=0.0, top_logprobs=2,
                       include=["message.output_text.logprobs"], extra_body={"structured_outputs": {"regex": pattern}})
        whole = sdk.responses.create(**request)
        with sdk.responses.stream(**request) as stream:
            streamed = stream.get_final_response()
        for response in (whole, streamed):
            assert response.output[-1].content[0].logprobs == []


# ---- structured output after the thinking (vLLM's default: the grammar starts where the reasoning ends) ---------

# A template that opens the thinking in the prompt where asked (`chat_template_kwargs: {"open": true}`, as
# Qwen3.5's and DeepSeek-R1's do), served with <think> and </think> added as single tokens (as Qwen3's
# tokenizer has them) to a fixture whose model vocabulary holds them.
GATED_TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant\n{% if open %}<think>\n{% endif %}{% endif %}")
ANSWER = {"type": "object", "properties": {"warm": {"type": "boolean"}}, "required": ["warm"],
          "additionalProperties": False}


@pytest.fixture(scope="module", params=[("qwen3", False), ("deepseek_r1", True)], ids=["qwen3", "r1-special"])
def gated_live(build, request):
    """The server with a reasoning parser (qwen3: the markers text tokens, as Qwen3's; deepseek_r1: special ones)
    and the grammar after the thinking (the default)."""
    parser, special = request.param
    live, _, hf, tokenizer = served_live(build("llama", vocab_size=514), GATED_TEMPLATE, ("<think>", "</think>"),
                                         special, reasoning_parser=parser)
    yield live, parser, hf, tokenizer
    live.stop()


def thinking_then(hf, tokenizer, ids: list[int], grammar: str, new: int = 40) -> tuple[float, str, str]:
    """transformers' greedy output that thinks freely until </think> and keeps to `grammar` after it (vLLM's
    structured output beside a reasoning parser), with a bias on </think> that ends the random model's thinking
    after a few tokens: (the bias, the thinking, the answer)."""
    end = tokenizer.convert_tokens_to_ids("</think>")
    for tenth in range(4, 30):
        tokens, complete = grammar_greedy(hf, tokenizer, ids, grammar, new, after="</think>", bias={end: tenth / 10})
        if complete and end in tokens[2:] and end not in tokens[:2]:
            thought, _, answer = tokenizer.decode(tokens).partition("</think>")
            return tenth / 10, thought.removeprefix("<think>"), answer
    raise AssertionError("no bias ends the fixture's thinking after a few tokens")


def test_structured_output_holds_the_answer_after_the_thinking(gated_live):
    """With a reasoning parser, a response format (and a named tool's arguments) holds the content after
    </think>, the thinking free before it, as vLLM's structured output waits for the reasoning's end: the
    reasoning and the answer equal transformers' greedy output under that rule, whole and streamed (before, the
    grammar held the first token, so a thinking model could not think)."""
    live, parser, hf, tokenizer = gated_live
    opened = parser == "qwen3"  # deepseek_r1 reads the output as thinking from its start whatever the prompt
    ids = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False,
                                             open=opened))
    bias, thought, answer = thinking_then(hf, tokenizer, ids, LLMatcher.grammar_from_json_schema(
        ANSWER, defaults={"whitespace_flexible": False}))
    fields = {"messages": ASK, "max_tokens": 40, "chat_template_kwargs": {"open": opened},
              "logit_bias": {str(tokenizer.convert_tokens_to_ids("</think>")): bias},
              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
              "structured_outputs": {"disable_any_whitespace": True}}
    choice = post(live, "/v1/chat/completions", **fields)["choices"][0]
    assert (choice["message"]["reasoning"], choice["message"]["content"], choice["finish_reason"]) == (
        thought, answer, "stop")
    json.loads(answer)
    assert chat_stream(live, **fields)[:2] == (thought, answer)
    del fields["response_format"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    weather = TOOLS[0]["function"]["parameters"]
    bias, thought, arguments = thinking_then(hf, tokenizer, list(tokenizer.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, open=opened)),
        LLMatcher.grammar_from_json_schema(weather, defaults={"whitespace_flexible": False}))
    fields["logit_bias"] = {str(tokenizer.convert_tokens_to_ids("</think>")): bias}
    choice = post(live, "/v1/chat/completions", **fields, tools=TOOLS, tool_choice=named)["choices"][0]
    assert choice["message"]["reasoning"] == thought
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}


def test_output_that_does_not_think_keeps_to_the_grammar_from_its_first_token(gated_live):
    """qwen3's output thinks only where it opens with <think>: one that does not (here <think> biased away) is
    held from its first token, as without a reasoning parser; the grammar's first step takes <think> too."""
    import llguidance.hf

    from ortmodule.serving.constraints import thinking_first
    from ortmodule.serving.reasoning import Reasoning

    live, parser, hf, tokenizer = gated_live
    if parser != "qwen3":
        pytest.skip("deepseek_r1 reads all output as thinking first")
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    grammar = LLMatcher.grammar_from_json_schema(ANSWER, defaults={"whitespace_flexible": False})
    ids = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False))
    tokens, complete = grammar_greedy(hf, tokenizer, ids, grammar, 20, bias={start: -100.0})
    assert complete
    fields = {"messages": ASK, "max_tokens": 20, "logit_bias": {str(start): -100},
              "response_format": {"type": "json_object"} | {"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": ANSWER}},
              "structured_outputs": {"disable_any_whitespace": True}}
    message = post(live, "/v1/chat/completions", **fields)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": tokenizer.decode(tokens)}
    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=hf.config.vocab_size)
    matcher = LLMatcher(view, thinking_first(grammar, Reasoning("qwen3"), {"<think>", "</think>"}))
    first = set(torch.nonzero(torch.tensor(list(matcher.compute_logit_bias())) > 0).flatten().tolist())
    assert start in first and tokenizer.convert_tokens_to_ids("{") in first and end not in first
    assert matcher.consume_tokens([start, *tokenizer.encode("any } text", add_special_tokens=False)])
    assert matcher.is_accepting()  # the output may end inside the thinking, as vLLM's grammar lets it
    assert matcher.consume_tokens([end]) and not matcher.is_accepting()  # then the answer is asked for
    assert matcher.consume_tokens(tokenizer.encode('{"warm":true}', add_special_tokens=False))
    assert matcher.is_stopped() and not matcher.is_error()
    # markers that are text (no such tokens): the thinking ends at the first </think> written in any pieces
    text = LLMatcher(view, thinking_first(grammar, Reasoning("qwen3")))
    pieces = ("<", "think>a</thi", "</", "think>", '{"warm":false}')  # none a whole marker: no marker token
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    assert text.consume_tokens(ids[0] + ids[1]) and text.is_accepting()  # inside the thinking: it may end
    assert text.consume_tokens(ids[2] + ids[3]) and not text.is_accepting()
    assert not text.consume_tokens(tokenizer.encode("free", add_special_tokens=False)[:1])  # the answer's grammar
    text = LLMatcher(view, thinking_first(grammar, Reasoning("qwen3")))
    assert text.consume_tokens([t for piece in ids for t in piece])
    assert text.is_stopped() and not text.is_error()


def budget_greedy(hf, tokenizer, ids: list[int], budget: int, new: int, bias: dict | None = None,
                  end: str = "</think>") -> str:
    """transformers' greedy text after `ids` (thinking from its first token) with vLLM's thinking budget: after
    `budget` tokens of thinking with no `end` (</think>), its tokens forced one a step (a processor written here)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    end = tokenizer.encode(end, add_special_tokens=False)

    class Budget(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for token, value in (bias or {}).items():
                scores[:, token] += value
            out = input_ids[0, len(ids):].tolist()
            ended = any(out[i: i + len(end)] == end for i in range(len(out)))
            if ended or len(out) < budget:
                return scores
            forced = torch.full_like(scores, float("-inf"))
            forced[:, end[len(out) - budget]] = 0.0
            return forced

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList([Budget()]))
    return tokenizer.decode(out[0, len(ids):].tolist())


@pytest.mark.parametrize("budget", [0, 3])
def test_a_thinking_budget_ends_the_thinking_with_a_forced_end(gated_live, budget):
    """vLLM's `thinking_token_budget` (and Anthropic's `thinking.budget_tokens`): after that many tokens of
    thinking, </think> is forced and the model answers after it; the reasoning and the answer equal
    transformers' greedy output under the same rule, whole and streamed; thinking that ends itself first
    (here </think> biased to come early) is left as it is."""
    from anthropic import Anthropic

    live, parser, hf, tokenizer = gated_live
    opened = parser == "qwen3"
    ids = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False,
                                             open=opened))
    thought, _, answer = budget_greedy(hf, tokenizer, ids, budget, 12).partition("</think>")
    fields = {"messages": ASK, "max_tokens": 12, "chat_template_kwargs": {"open": opened},
              "thinking_token_budget": budget}
    message = post(live, "/v1/chat/completions", **fields)["choices"][0]["message"]
    assert (message["reasoning"] or "", message["content"] or "") == (thought, answer)
    assert chat_stream(live, **fields)[:2] == (thought, answer)
    client = Anthropic(base_url=live.url, api_key="x", max_retries=0)
    got = client.messages.create(model=NAME, max_tokens=12, messages=ASK, thinking={
        "type": "enabled", "budget_tokens": budget}, extra_body={"temperature": 0.0,
                                                                "chat_template_kwargs": {"open": opened}})
    blocks = {b.type: getattr(b, "thinking", None) or getattr(b, "text", None) for b in got.content}
    assert (blocks.get("thinking") or "", blocks.get("text") or "") == (thought, answer)
    end = tokenizer.convert_tokens_to_ids("</think>")
    bias = next(b / 10 for b in range(4, 60) if "</think>" in budget_greedy(hf, tokenizer, ids, 30, 12,
                                                                             bias={end: b / 10})[1:])
    early = budget_greedy(hf, tokenizer, ids, 30, 12, bias={end: bias})
    message = post(live, "/v1/chat/completions", **{**fields, "thinking_token_budget": 30,
                                                     "logit_bias": {str(end): bias}})["choices"][0]["message"]
    assert (message["reasoning"] or "") + "</think>" + (message["content"] or "") == early


def test_a_thinking_budget_forces_an_end_of_several_tokens_and_needs_a_parser(build, thinking_live):
    """Where </think> is several tokens (the fixture's own tokenizer), they are forced one a step; a budget on a
    server without a reasoning parser is a 400 naming the flag, as in vLLM."""
    live, _, hf, tokenizer = served_live(build("llama"), TOOL_TEMPLATE, reasoning_parser="deepseek_r1")
    try:
        assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
        ids = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False))
        thought, _, answer = budget_greedy(hf, tokenizer, ids, 4, 16).partition("</think>")
        message = post(live, "/v1/chat/completions", messages=ASK, max_tokens=16,
                       thinking_token_budget=4)["choices"][0]["message"]
        assert (message["reasoning"], message["content"] or "") == (thought, answer) and thought
    finally:
        live.stop()
    plain, *_ = served_live(build("llama"), TOOL_TEMPLATE)
    try:
        refused = httpx.post(f"{plain.url}/v1/chat/completions", json={
            "model": NAME, "messages": ASK, "max_tokens": 4, "thinking_token_budget": 2})
        assert refused.status_code == 400 and "--reasoning-parser" in refused.json()["error"]["message"]
    finally:
        plain.stop()


def test_the_command_line_takes_vllms_enable_in_reasoning(llama, monkeypatch, capsys):
    """`--structured-outputs-config.enable_in_reasoning` and `.disable_any_whitespace` (vLLM's spellings; alone or
    with true/false), and the JSON form of `--structured-outputs-config`, reach the settings; another value, an
    option or backend this server does not take, is argparse's error."""
    import ortmodule.serving
    from ortmodule import cli

    given = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: given.update(options))
    flag = "--structured-outputs-config.enable_in_reasoning"
    for extra, expected in (([], False), ([flag], True), ([f"{flag}=false"], False), ([flag, "True"], True)):
        cli.ortmodule(["serve", str(llama.package_dir), "--reasoning-parser", "qwen3", *extra])
        assert given["enable_in_reasoning"] is expected, extra
    with pytest.raises(SystemExit):
        cli.ortmodule(["serve", str(llama.package_dir), f"{flag}=maybe"])
    assert "not true or false: 'maybe'" in capsys.readouterr().err
    cli.ortmodule(["serve", str(llama.package_dir), "--structured-outputs-config.disable_any_whitespace"])
    assert (given["disable_any_whitespace"], given["enable_in_reasoning"]) == (True, False)
    cli.ortmodule(["serve", str(llama.package_dir), "--structured-outputs-config",
                   '{"backend": "guidance", "enable_in_reasoning": true, "disable_any_whitespace": true}'])
    assert (given["disable_any_whitespace"], given["enable_in_reasoning"]) == (True, True)
    for config, words in (('{"backend": "xgrammar"}', "this server's is llguidance"),
                          ('{"reasoning_parser": "qwen3"}', "options this server does not take"), ("[1]", "object")):
        with pytest.raises(SystemExit):
            cli.ortmodule(["serve", str(llama.package_dir), "--structured-outputs-config", config])
        assert words in capsys.readouterr().err


def test_gemma4_thinks_in_its_channel_and_calls_in_its_own_form(build):
    """Gemma 4's own template (trl ships it) with `--reasoning-parser gemma4` and `--tool-call-parser gemma4`,
    thinking asked for by `reasoning_effort` (the template's `enable_thinking`): the greedy output (held by a
    regex to Gemma 4's thinking channel, then a call) is transformers' on the same weights under the same
    grammar; the answer is the channel's text (its `thought` label left out) as `reasoning` and the call read
    from the rest, its arguments as JSON, whole and streamed."""
    import re

    from test_tool_calling import gathered, trl_template

    pattern = (r'<\|channel>thought\n[a-z ]{4,16}<channel\|><\|tool_call>call:get_weather\{city:<\|"\|>(Paris|Rome)'
               r'<\|"\|>,unit:<\|"\|>(c|f)<\|"\|>\}<tool_call\|>')
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
    # Gemma 4's template and its markers as text are long in the fixture's small vocabulary: a longer context
    live, _, hf, tokenizer = served_live(build("llama", context_length=512), trl_template("gemma4"),
                                         reasoning_parser="gemma4",
                                         enable_in_reasoning=True, enable_auto_tool_choice=True,
                                         tool_call_parser="gemma4")
    try:
        ids = list(tokenizer.apply_chat_template(ASK, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, enable_thinking=True, reasoning_effort="high"))
        assert "<|think|>" in tokenizer.decode(ids)
        tokens, complete = grammar_greedy(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), 100)
        assert complete
        text = expected_text(tokenizer, tokens)[0]
        found = re.fullmatch(pattern, text)
        thought = text.removeprefix("<|channel>thought\n").split("<channel|>")[0]
        arguments = json.dumps({"city": found.group(1), "unit": found.group(2)})
        fields = {"messages": ASK, "tools": tools, "max_tokens": 100, "reasoning_effort": "high",
                  "structured_outputs": {"regex": pattern}}
        choice = post(live, "/v1/chat/completions", **fields)["choices"][0]
        assert (choice["message"]["reasoning"], choice["message"]["content"], choice["finish_reason"]) == (
            thought, None, "tool_calls")
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_weather",
                                                                              "arguments": arguments}]
        reasoning, content, calls = chat_stream(live, **fields)
        assert (reasoning, content) == (thought, "")
        assert gathered([{"tool_calls": calls}]) == [("get_weather", arguments)]
    finally:
        live.stop()


@pytest.mark.parametrize(("parser", "start", "end"), [
    ("mistral", "[THINK]", "[/THINK]"), ("gemma4", "<|channel>", "<channel|>"),
    ("granite", "Here's my thought process:", "Here is my response:"),
    ("granite", "Here is my thought process:", "Here's my response:")])
def test_each_parsers_markers_gate_the_grammar(llama, parser, start, end):
    """The grammar after the thinking under each parser's markers (here text): free text to its end marker
    (the output may end inside it), then the answer's grammar; output that does not open with the marker keeps
    to the grammar from its first token."""
    import llguidance.hf

    from ortmodule import load_tokenizer
    from ortmodule.serving.constraints import thinking_first
    from ortmodule.serving.reasoning import Reasoning

    tokenizer = load_tokenizer(llama.package_dir)
    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=512)
    grammar = LLMatcher.grammar_from_json_schema(ANSWER, defaults={"whitespace_flexible": False})

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    matcher = LLMatcher(view, thinking_first(grammar, Reasoning(parser)))
    assert matcher.consume_tokens(encode(f"{start}thought\nany {{ text")) and matcher.is_accepting()
    assert matcher.consume_tokens(encode(end)) and not matcher.is_accepting()
    assert matcher.consume_tokens(encode('{"warm":true}')) and matcher.is_stopped() and not matcher.is_error()
    plain = LLMatcher(view, thinking_first(grammar, Reasoning(parser)))
    assert not plain.consume_tokens(encode("free")[:1])
