"""gpt-oss's output (OpenAI's harmony format) on the server: `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai` (serving/harmony.py), read as vLLM reads them: the analysis channel the reasoning,
the final channel and preambles the content, messages to `functions.NAME` the calls."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
from helpers import OPENAI_NAME as NAME
from helpers import grammar_greedy, served_live

from ortmodule.serving import harmony
from ortmodule.serving.reasoning import Reasoning, reasoning_tokens

llguidance = pytest.importorskip("llguidance")
from llguidance import LLMatcher  # noqa: E402

SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
A = "<|start|>assistant"
# (output, reasoning, content without the tool parser, content and calls with it), as vLLM's harmony reading
# gives them (its parse_chat_output and OpenAIToolParser)
CASES = [
    ("<|channel|>analysis<|message|>Think.<|end|>" + A + "<|channel|>final<|message|>Hi!", "Think.", "Hi!",
     ("Hi!", None)),
    ("<|channel|>analysis<|message|>a<|end|>" + A + "<|channel|>analysis<|message|>b<|end|>" + A
     + "<|channel|>commentary<|message|>Checking.<|end|>" + A
     + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
     "a\nb", "Checking.", ("Checking.", [("get_weather", '{"city":"Paris"}')])),
    # the recipient before the channel, the content type after it (the chat template's form)
    (' to=functions.f<|channel|>commentary json<|message|>{"x": [1, 2]}', None, None, (None, [("f", '{"x": [1, 2]}')])),
    # the arguments as written, whatever the content type, JSON or not
    ("<|channel|>commentary to=functions.f <|constrain|>text<|message|>{raw", None, None, (None, [("f", "{raw")])),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad", None, None, (None, [("f", "{bad")])),
    # a built-in tool's message (no function): left out
    ("<|channel|>analysis to=python<|message|>print(1)<|call|>", None, None, (None, None)),
    ("<|channel|>analysis<|message|>cut sho", "cut sho", None, (None, None)),  # the length ended the thinking
    ("<|channel|>analysis<|message|>x<|end|>" + A + "<|channel|>fin", "x", None, (None, None)),  # a header unfinished
    ("<|channel|>final<|message|>Two<|end|>" + A + "<|channel|>final<|message|>parts", None, "Two\nparts",
     ("Two\nparts", None)),
    ("Not harmony <|channel|>.", None, "Not harmony <|channel|>.", ("Not harmony <|channel|>.", None)),
    ("<|chan", None, "<|chan", ("<|chan", None)),  # a beginning of a header, and no more: text
]


@pytest.mark.parametrize(("text", "reasoning", "content", "called"), CASES)
def test_harmony_output_reads_as_vllm_reads_it(text, reasoning, content, called):
    """Each output's reasoning and content, without and with the calls kept for the `openai` tool parser, whose
    reading gives the content and calls; the reasoning's tokens (the Responses API's count) its analysis messages'
    text, none of their headers or ends; a stream of it cut at every point, and a character at a time, gives the
    same text as the whole."""
    assert harmony.split(text) == (reasoning, content)
    ends = list(range(1, len(text) + 1))  # a token a character: the reasoning's tokens are its messages' characters
    assert reasoning_tokens(Reasoning(harmony.PARSER), text, ends) == len((reasoning or "").replace("\n", ""))
    kept = harmony.split(text, calls=True)
    assert kept[0] == reasoning and harmony.read_calls(kept[1] or "") == called
    for calls in (False, True):
        whole = harmony.split(text, calls)
        cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
        for pieces in cuts:
            stream, got = harmony.HarmonyStream(calls), ["", ""]
            for piece in pieces:
                got = [g + p for g, p in zip(got, stream.piece(piece))]
            got = [g + p for g, p in zip(got, stream.end())]
            assert (got[0] or None, got[1] or None) == whole, pieces


def test_random_harmony_messages_read_back(request):
    """Random sequences of messages (analysis, final, preambles, calls in either header form, built-in tools)
    written in harmony and read back, whole and in random pieces: the reasoning and the content are the messages'
    texts joined, and the calls those to functions in order."""
    rng = random.Random(request.node.name)
    words = ["a", "b c", "<x>", "{", "}", '"q"', "\n", "é", "to", "|"]
    for _ in range(300):
        out, thoughts, shown, calls = [], [], [], []
        for k in range(rng.randint(1, 5)):
            body = "".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
            kind = rng.choice(["analysis", "final", "commentary", "call", "builtin"])
            head = "<|channel|>" if k == 0 and rng.random() < 0.5 else A + "<|channel|>"
            if kind == "call":
                arguments = json.dumps({"v": body}, ensure_ascii=False)
                name = rng.choice(["f", "get_weather"])
                head = (head + f"commentary to=functions.{name} <|constrain|>json" if rng.random() < 0.5 else
                        head.replace("<|channel|>", "") + f" to=functions.{name}<|channel|>commentary json")
                out.append(head + "<|message|>" + arguments + "<|call|>")
                calls.append((name, arguments))
                break  # <|call|> ends the output
            out.append(head + ("analysis to=python" if kind == "builtin" else kind) + "<|message|>" + body + "<|end|>")
            (thoughts if kind == "analysis" else shown if kind != "builtin" else []).append(body)
        text = "".join(out)
        reasoning, content = harmony.split(text, calls=True)
        assert (reasoning or None) == ("\n".join(thoughts) or None)
        assert harmony.read_calls(content or "") == ("\n".join(shown) or None, calls or None)
        stream, got, at = harmony.HarmonyStream(True), ["", ""], 0
        while at < len(text):
            step = rng.randint(1, 8)
            got = [g + p for g, p in zip(got, stream.piece(text[at: at + step]))]
            at += step
        got = [g + p for g, p in zip(got, stream.end())]
        assert (got[0] or None, got[1] or None) == (reasoning, content)


def test_a_gptoss_package_is_read_as_harmony_by_default(build, llama):
    """A gpt-oss package is served with the harmony reading (vLLM always reads gpt-oss's harmony), and with it
    the `openai` tool parser; another model's package takes the `openai` tool parser only beside the harmony
    reasoning parser (a ValueError naming it, `ortmodule serve`'s one-line error)."""
    from ortmodule import OrtModelForCausalLM, load_tokenizer
    from ortmodule.serving import create_app

    gptoss = build("gpt_oss")
    model = OrtModelForCausalLM.from_pretrained(gptoss.package_dir)
    app = create_app(model, load_tokenizer(gptoss.package_dir), enable_auto_tool_choice=True,
                     tool_call_parser="openai")
    try:
        assert app.state.served.settings.reasoning_parser == "openai_gptoss"
    finally:
        app.state.served.engine.stop()
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss"):
        create_app(model, load_tokenizer(llama.package_dir), enable_auto_tool_choice=True, tool_call_parser="openai")
    app = create_app(model, load_tokenizer(llama.package_dir))
    try:
        assert app.state.served.settings.reasoning_parser is None
    finally:
        app.state.served.engine.stop()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": CITY}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gptoss_live(build):
    """gpt-oss's own chat template (trl ships it) over the llama fixture with harmony's markers as special tokens,
    the server reading harmony (`--reasoning-parser openai_gptoss --tool-call-parser openai`), a request's grammar
    over the whole output (`enable_in_reasoning`), which holds the random model to harmony's form here."""
    from test_tool_calling import trl_template

    live, _, hf, tokenizer = served_live(build("llama", vocab_size=512 + len(SPECIAL), context_length=512),
                                         trl_template("gptoss"), SPECIAL, True, reasoning_parser="openai_gptoss",
                                         enable_in_reasoning=True, enable_auto_tool_choice=True,
                                         tool_call_parser="openai")
    yield live, hf, tokenizer
    live.stop()


def _chat(live, stream: bool, **fields):
    body = {"model": NAME, "temperature": 0, "messages": ASK, "max_tokens": 120, **fields}
    if not stream:
        answer = httpx.post(f"{live.url}/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return message.get("reasoning"), message["content"], calls, choice["finish_reason"]
    reasoning, content, calls, finish, pieces = "", "", {}, None, 0
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                delta, finish = choice["delta"], choice["finish_reason"] or finish
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    name, arguments = calls.get(call["index"], ("", ""))
                    function = call.get("function", {})
                    pieces += bool(function.get("arguments"))
                    calls[call["index"]] = (name + (function.get("name") or ""),
                                            arguments + (function.get("arguments") or ""))
    assert pieces != 1, "a call's arguments streamed whole"
    return reasoning or None, content or None, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_gptoss_thinks_in_analysis_and_calls_functions(gptoss_live, stream):
    """The greedy output (held by a grammar to harmony: an analysis message, a preamble, then a call of
    get_weather) is transformers' on the same weights under the same grammar: its analysis text is the
    `reasoning`, the preamble the content, the call's arguments the JSON the model wrote, finish "tool_calls"
    (streamed: the arguments in more than one piece); and without tools, an answer in the final channel is the
    content; whole and streamed."""
    live, hf, tokenizer = gptoss_live
    call = ('<|channel|> "analysis" <|message|> /[a-z ]{4,12}/ <|end|> <|start|> "assistant" <|channel|> '
            '"commentary" <|message|> /[A-Z][a-z]{2,8}\\./ <|end|> <|start|> "assistant" <|channel|> '
            '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\":\\"" '
            '/(Paris|Rome)/ "\\"}" <|call|>')
    final = ('<|channel|> "analysis" <|message|> /[a-z ]{4,12}/ <|end|> <|start|> "assistant" <|channel|> '
             '"final" <|message|> /[A-Z][a-z ]{2,12}\\./ <|return|>')
    for grammar, tools in ((call, TOOLS), (final, None)):
        lark = f"start: {grammar}"
        ids = list(tokenizer.apply_chat_template(ASK, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        assert tokenizer.decode(ids).endswith("<|start|>assistant")
        tokens, complete = grammar_greedy(hf, tokenizer, ids, lark, 120)
        assert complete
        text = tokenizer.decode(tokens)  # the markers kept
        thought = re.search(r"analysis<\|message\|>(.*?)<\|end\|>", text).group(1)
        answer = re.findall(r"(?:commentary|final)<\|message\|>(.*?)<\|(?:end|return)\|>", text)
        fields = {"tools": tools} if tools else {}
        got = _chat(live, stream, structured_outputs={"grammar": lark}, **fields)
        if tools:
            arguments = re.search(r"json<\|message\|>(.*?)<\|call\|>", text).group(1)
            assert json.loads(arguments)["city"] in ("Paris", "Rome")
            assert got == (thought, answer[0], [("get_weather", arguments)], "tool_calls")
        else:
            assert got == (thought, answer[0], [], "stop")


def test_structured_output_waits_for_the_final_channel(build):
    """The grammar beside the harmony reasoning parser (its markers special tokens): the analysis message free,
    then, after `<|end|><|start|>assistant<|channel|>final<|message|>`, the answer's grammar; output that does not
    open with the analysis channel keeps to the grammar from its first token."""
    import llguidance.hf

    from ortmodule import load_tokenizer
    from ortmodule.serving.constraints import thinking_first
    from ortmodule.serving.reasoning import Reasoning

    tokenizer = load_tokenizer(build("llama", vocab_size=512 + len(SPECIAL), context_length=512).package_dir)
    tokenizer.add_tokens(list(SPECIAL), special_tokens=True)
    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    schema = {"type": "object", "properties": {"warm": {"type": "boolean"}}, "required": ["warm"],
              "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    reading = Reasoning("openai_gptoss")

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    matcher = LLMatcher(view, thinking_first(grammar, reading, set(SPECIAL)))
    assert matcher.consume_tokens(encode("<|channel|>analysis<|message|>any { text")) and matcher.is_accepting()
    assert matcher.consume_tokens(encode("<|end|><|start|>assistant<|channel|>final<|message|>"))
    assert not matcher.is_accepting()
    assert matcher.consume_tokens(encode('{"warm":true}')) and matcher.is_stopped() and not matcher.is_error()
    plain = LLMatcher(view, thinking_first(grammar, reading, set(SPECIAL)))
    assert plain.consume_tokens(encode('{"warm":false}')) and plain.is_stopped()
    wrong = LLMatcher(view, thinking_first(grammar, reading, set(SPECIAL)))
    assert not wrong.consume_tokens(encode("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>"
                                           "commentary"))


def test_a_thinking_budget_ends_the_analysis_with_the_final_channel(build):
    """vLLM's `thinking_token_budget` beside the harmony parser: after that many tokens of analysis (here opened by
    the prompt), `<|end|><|start|>assistant<|channel|>final<|message|>` is forced a token a step and the model
    answers in the final channel: the reasoning and the content equal transformers' greedy output under the same
    rule, whole and streamed."""
    from test_reasoning import budget_greedy
    from test_tool_calling import trl_template

    template = trl_template("gptoss").replace("<|start|>assistant\n{%- endif -%}",
                                              "<|start|>assistant<|channel|>analysis<|message|>\n{%- endif -%}")
    assert template != trl_template("gptoss")
    live, _, hf, tokenizer = served_live(build("llama", vocab_size=512 + len(SPECIAL), context_length=512),
                                         template, SPECIAL, True, reasoning_parser="openai_gptoss")
    try:
        ids = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False))
        end = harmony.THINKING[1]
        text = budget_greedy(hf, tokenizer, ids, 3, 30, end=end)
        thought, _, answer = text.partition(end)
        assert thought and answer and "<|" not in answer, text  # the random model's answer, its markers none
        for stream in (False, True):
            assert _chat(live, stream, max_tokens=30, thinking_token_budget=3) == (thought, answer, [], "length")
    finally:
        live.stop()


@pytest.mark.parametrize("text", [CASES[1][0], CASES[2][0], CASES[3][0], CASES[4][0],
                                  CASES[1][0].replace("<|call|>", "")])
def test_the_calls_stream_as_the_whole_answer_reads_them(text):
    """The content kept for the `openai` tool parser, given to the tool stream cut anywhere and a character at a
    time: the same content and calls, put together, as the whole answer's (the calls in more than one piece)."""
    from test_tool_calling import auto_plan, streams_as_read

    from ortmodule.serving.tools import ToolStream

    content = harmony.split(text, calls=True)[1] or ""
    streams_as_read(auto_plan("openai"), content, *harmony.read_calls(content))
    stream = ToolStream(auto_plan("openai"))
    sent = [stream.piece(c) for c in content]  # before the end: the arguments as they are written
    assert sum(1 for d in sent for call in d.get("tool_calls", ()) if call["function"]["arguments"]) > 1


def test_gptoss_on_the_responses_api(gptoss_live):
    """The Responses API over the harmony reading (Codex's API for gpt-oss): a `reasoning` item with the analysis
    text, the preamble's message, then a `function_call` item with the arguments the model wrote, in the `openai`
    client's types, its stream helper's final response the same; transformers' greedy output under the grammar is
    the reference."""
    from openai import OpenAI
    from openai.types.responses import Response

    live, hf, tokenizer = gptoss_live
    lark = ('start: <|channel|> "analysis" <|message|> /[a-z ]{4,12}/ <|end|> <|start|> "assistant" <|channel|> '
            '"commentary" <|message|> /[A-Z][a-z]{2,8}\\./ <|end|> <|start|> "assistant" <|channel|> '
            '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\":\\"" /(Paris|Rome)/ '
            '"\\"}" <|call|>')
    ids = list(tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    text = tokenizer.decode(grammar_greedy(hf, tokenizer, ids, lark, 120)[0])
    thought = re.search(r"analysis<\|message\|>(.*?)<\|end\|>", text).group(1)
    preamble = re.search(r"commentary<\|message\|>(.*?)<\|end\|>", text).group(1)
    arguments = re.search(r"json<\|message\|>(.*?)<\|call\|>", text).group(1)
    sdk = OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    request = dict(model=NAME, input=ASK, tools=tools, max_output_tokens=120, temperature=0.0,
                   extra_body={"structured_outputs": {"grammar": lark}})
    whole = sdk.responses.create(**request)
    Response.model_validate(whole.model_dump(), strict=True)
    with sdk.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        reasoning, message, call = response.output
        assert (reasoning.type, reasoning.content[0].text) == ("reasoning", thought)
        assert (message.type, message.content[0].text) == ("message", preamble)
        assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", arguments)
