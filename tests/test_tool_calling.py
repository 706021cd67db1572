"""Tool calling on `/v1/chat/completions` (serving/tools.py): the prompt is transformers' `apply_chat_template`
with the same tools and messages; a named function's and "required"'s calls are transformers' greedy
`generate` under the same JSON schema (a logits processor written in tests/helpers.py on llguidance's own
matcher); "auto"'s calls read by the hermes parser from what the model wrote; the answers validated by the
`openai` client's own types and stream helper; and the refusals."""

import json
import re

import httpx
import pytest
import torch
from helpers import OPENAI_NAME as NAME
from helpers import expected_text, grammar_greedy, served_live

llguidance = pytest.importorskip("llguidance")
from llguidance import LLMatcher  # noqa: E402

# A chat template of Hermes' and Qwen's form for the fixture's tokenizer (short: the fixture's context is 256
# tokens): the tools named in a system turn, an assistant's calls in <tool_call> tags, a tool's answer in its
# own turn.
TOOL_TEMPLATE = (
    "{%- if tools %}<s>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}</s>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}</s>\n"
    "{%- elif m.role == 'tool' %}<s>tool\n<tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response></s>\n"
    "{%- else %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant\n{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# vLLM's option of JSON without whitespace between its tokens: the random fixture, free to, writes whitespace on.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def compact(schema: dict) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def tools_live(build):
    """The server on the llama fixture with the tool template, auto tool choice read by the hermes parser."""
    live, _, hf, tokenizer = served_live(build("llama"), TOOL_TEMPLATE, enable_auto_tool_choice=True,
                                         tool_call_parser="hermes")
    yield live, hf, tokenizer
    live.stop()


def client(live):
    from openai import OpenAI

    return OpenAI(base_url=f"{live.url}/v1", api_key="not-needed", max_retries=0)


def prompt_ids(tokenizer, messages, tools=TOOLS) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def greedy_text(hf, tokenizer, ids, grammar, new=60) -> tuple[str, bool]:
    tokens, complete = grammar_greedy(hf, tokenizer, ids, grammar, new)
    return expected_text(tokenizer, tokens)[0], complete


def chat(live, **fields) -> dict:
    answer = httpx.post(f"{live.url}/v1/chat/completions", json={"model": NAME, "messages": ASK, "max_tokens": 60,
                                                                "temperature": 0, "tools": TOOLS, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed(live, **fields) -> tuple[str, dict, str]:
    """A streamed answer's content, its calls gathered by index from their deltas, and its finish reason."""
    content, calls, finish = "", {}, None
    body = {"model": NAME, "messages": ASK, "max_tokens": 60, "temperature": 0, "tools": TOOLS, "stream": True,
            **fields}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body) as events:
        for line in events.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for part in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": "", "pieces": 0})
                call["id"] = part.get("id") or call["id"]
                call["name"] += part.get("function", {}).get("name") or ""
                call["arguments"] += part.get("function", {}).get("arguments") or ""
                call["pieces"] += bool(part.get("function", {}).get("arguments"))
            finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_a_named_function_is_transformers_greedy_call_under_its_schema(tools_live):
    """tool_choice naming a function: its arguments are transformers' greedy text under the function's
    parameters schema, after the prompt transformers renders with the tools; one call of it, content None,
    finish "stop"; the `openai` client's types take it, and a stream's deltas make the same call."""
    from openai.types.chat import ChatCompletion

    live, hf, tokenizer = tools_live
    ids = prompt_ids(tokenizer, ASK)
    expected, complete = greedy_text(hf, tokenizer, ids, compact(WEATHER))
    assert complete
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = chat(live, tool_choice=named, return_token_ids=True, **COMPACT)
    assert answer["prompt_token_ids"] == ids
    ChatCompletion.model_validate(answer, strict=True)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": expected}
    assert set(json.loads(expected)) == {"city", "unit"}
    content, calls, finish = streamed(live, tool_choice=named, **COMPACT)
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", expected)]
    sdk = client(live).chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=named,
                                               max_tokens=60, temperature=0, extra_body=COMPACT)
    assert sdk.choices[0].message.tool_calls[0].function.arguments == expected


def test_required_is_a_list_of_calls_under_the_tools_schemas(tools_live):
    """tool_choice "required": transformers' greedy text under a schema of a list of {name, parameters} of the
    tools (as vLLM builds it), answered as those calls with finish "tool_calls"; with parallel_tool_calls false
    the list holds one call; a stream ends with the same calls."""
    live, hf, tokenizer = tools_live
    ids = prompt_ids(tokenizer, ASK)

    def schema(most=None):
        options = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                     "parameters": t["function"]["parameters"]},
                    "required": ["name", "parameters"], "additionalProperties": False} for t in TOOLS]
        return {"type": "array", "minItems": 1, "items": {"anyOf": options},
                **({"maxItems": most} if most else {})}

    for parallel, most in ((True, None), (False, 1)):
        expected, complete = greedy_text(hf, tokenizer, ids, compact(schema(most)), 120)
        answer = chat(live, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120, **COMPACT)
        choice = answer["choices"][0]
        assert complete or parallel  # (one call, at most, fits)
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        at = 0  # as the model wrote them (the grammar compact): each call's text in the list, in turn
        for name, arguments in got:
            at = expected.index(f'{{"name":"{name}","parameters":{arguments}', at) + 1
        if complete:
            assert [(name, json.loads(arguments)) for name, arguments in got] == [
                (c["name"], c["parameters"]) for c in json.loads(expected)]
        else:  # the length ended it: the calls as far as they were written, each whose arguments began
            assert len(got) == len(re.findall('"parameters":.', expected)) >= 1
        assert choice["finish_reason"] == ("tool_calls" if complete else "length")
        assert choice["message"]["content"] is None and (len(got) == 1 or parallel)
        content, calls, finish = streamed(live, tool_choice="required", parallel_tool_calls=parallel,
                                          max_tokens=120, **COMPACT)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == got and finish == choice["finish_reason"]
        assert all(c["pieces"] > 1 for c in calls.values())  # the arguments streamed as they came


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "(Paris|Rome)", "unit": "(c|f)"}}\n</tool_call>'


def test_auto_reads_the_models_hermes_calls_and_keeps_its_text(tools_live):
    """tool_choice "auto" (the default beside tools) under `--tool-call-parser hermes`: what the model writes
    (held here to a call by a regex, so that the random fixture writes one) is transformers' greedy text; the
    text before <tool_call> is the content, the call's name and arguments are read from it, finish
    "tool_calls"; streamed, the content comes as text and the call's arguments in pieces. Output without a call is
    plain content."""
    live, hf, tokenizer = tools_live
    ids = prompt_ids(tokenizer, ASK)
    pattern = r"(Sure|Yes)\. " + CALL.replace("{", r"\{").replace("}", r"\}")
    expected, complete = greedy_text(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), 170)
    assert complete
    before, _, call = expected.partition("<tool_call>")
    inner = json.loads(call.removesuffix("</tool_call>"))
    answer = chat(live, structured_outputs={"regex": pattern}, max_tokens=170)
    choice = answer["choices"][0]
    assert choice["message"]["content"] == before and choice["finish_reason"] == "tool_calls"
    (made,) = choice["message"]["tool_calls"]
    assert made["function"] == {"name": inner["name"], "arguments": json.dumps(inner["arguments"])}
    content, calls, finish = streamed(live, structured_outputs={"regex": pattern}, max_tokens=170)
    assert content == before and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(inner["name"], json.dumps(inner["arguments"]))]
    assert calls[0]["pieces"] > 1  # the arguments streamed as they came
    plain = greedy_text(hf, tokenizer, ids, LLMatcher.grammar_from_regex("[a-z ]{1,30}"), 40)[0]
    answer = chat(live, structured_outputs={"regex": "[a-z ]{1,30}"}, max_tokens=40)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": plain}
    assert streamed(live, structured_outputs={"regex": "[a-z ]{1,30}"}, max_tokens=40)[:2] == (plain, {})


def test_a_conversation_with_calls_and_results_renders_as_transformers_renders_it(tools_live):
    """An assistant's earlier calls (arguments sent as JSON text, given to the template as an object) and the
    tools' answers (`tool_call_id`) give transformers' prompt ids, on the chat route and on /tokenize; the
    SDK's own message object round-trips."""
    live, hf, tokenizer = tools_live
    arguments = {"city": "Rome", "unit": "c"}
    sent = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    rendered = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    ids = prompt_ids(tokenizer, rendered)
    assert "21 degrees" in tokenizer.decode(ids) and '"city": "Rome"' in tokenizer.decode(ids)
    answer = chat(live, messages=sent, tool_choice="none", return_token_ids=True, max_tokens=4)
    assert answer["prompt_token_ids"] == ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert answer["choices"][0]["message"]["content"] == expected_text(tokenizer, out[0, len(ids):].tolist())[0]
    counted = httpx.post(f"{live.url}/tokenize", json={"model": NAME, "messages": sent, "tools": TOOLS}).json()
    assert counted["tokens"] == ids
    sent[1]["tool_calls"][0]["function"]["arguments"] = ""  # none given: an empty object, as vLLM reads it
    rendered[1]["tool_calls"][0]["function"]["arguments"] = {}
    counted = httpx.post(f"{live.url}/tokenize", json={"model": NAME, "messages": sent, "tools": TOOLS}).json()
    assert counted["tokens"] == prompt_ids(tokenizer, rendered)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tool_choice": "required", "tools": None}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "has not been passed"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "a named tool_choice is"),
    ({"tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function", "non-empty name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "functions only"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters",
     "JSON schema object"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "both keep the output"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls",
     "only an assistant's"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not JSON"),
])
def test_tools_that_cannot_be_carried_out_are_refused_naming_their_field(tools_live, fields, param, words):
    live = tools_live[0]
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, "tools": TOOLS, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    answer = httpx.post(f"{live.url}/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_auto_needs_the_servers_parser_and_the_settings_are_checked(openai_live):
    """A server started without --enable-auto-tool-choice refuses "auto" (the default beside tools) naming the
    flags, as vLLM does, and takes a named function; the settings refuse an unknown parser and auto without one."""
    from ortmodule.serving import Settings

    live = openai_live[0]
    for choice in ({}, {"tool_choice": "auto"}):
        answer = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": NAME, "messages": ASK, "max_tokens": 4, "tools": TOOLS, **choice})
        assert answer.status_code == 400 and "--enable-auto-tool-choice" in answer.json()["error"]["message"]
    named = httpx.post(f"{live.url}/v1/chat/completions", json={
        "model": NAME, "messages": ASK, "max_tokens": 60, "temperature": 0, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}, **COMPACT}).json()
    assert json.loads(named["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["zone"] in (
        "utc", "cet")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        Settings(tool_call_parser="kimi_k2")
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        Settings(enable_auto_tool_choice=True)


@pytest.mark.parametrize(("template", "parser"), [
    ("{{ '<start_function_call>call:' }}", "functiongemma"), ("{{ '<|tool_call>call:' }}", "gemma4"),
    ("<tool_call>{{ x }}</tool_call>", "hermes"), ("<|tool_call_start|>", "lfm2"), ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"), ("functools[", "phi4_mini_json"), ("<function=", "qwen3_coder"),
])
def test_auto_without_a_parser_names_the_one_the_template_writes(template, parser):
    """The 400 for "auto" on a server without a parser names the parser whose calls the model's template writes."""
    from types import SimpleNamespace

    from ortmodule.serving.errors import ServingError
    from ortmodule.serving.settings import Settings
    from ortmodule.serving.tools import tool_plan

    served = SimpleNamespace(settings=Settings(), tokenizer=SimpleNamespace(chat_template=template))
    body = SimpleNamespace(tools=TOOLS, tool_choice="auto", parallel_tool_calls=None, functions=None,
                           function_call=None)
    with pytest.raises(ServingError, match=f"--tool-call-parser {parser}\\)"):
        tool_plan(served, body)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ('{"name": "f", "arguments": {"a": "é"}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": "é"}'), ("g", "{}")]),
    ("The answer is 4.", "The answer is 4.", None),
    ('{"name": "f", "parameters": {"a": 1}} ;\n{"name": "g", "arguments": {"b": [2]}}\n', None,
     [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
])
def test_the_llama3_json_parser_reads_llamas_calls(text, content, calls):
    """Llama 3.1's JSON calls (its `<|python_tag|>` or a bare object, ";" between calls) as vLLM's parser of
    that name reads them, each one's arguments as written; text stays text; streamed the same at any cut (the
    arguments in pieces as written); a call the length cut short comes as far as written, whole and streamed;
    calls not separated by ";", or cut short otherwise, are text in a whole answer."""
    from ortmodule.serving.tools import read_calls

    streams_as_read(auto_plan("llama3_json"), text, content, calls)
    cut = '{"name": "f", "parameters": {"a": '
    streams_as_read(auto_plan("llama3_json"), cut, None, [("f", '{"a":')], finish="length")
    for text in (cut, '{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}'):
        assert read_calls(auto_plan("llama3_json"), text) == (text, None)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure. ", [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"b": "x"}}',
     None, [("f", "{}"), ("g", '{"b": "x"}')]),  # the second never closed, as vLLM reads it too
    ("a < b, <tool", "a < b, <tool", None),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', None),  # no arguments
])
def test_the_hermes_parser_reads_hermes_calls(text, content, calls):
    """Hermes' (and Qwen's) `<tool_call>` calls as vLLM's parser reads them; a stream cut anywhere sends the
    same content (a marker's beginning held until it is known) and the same calls."""
    streams_as_read(auto_plan("hermes"), text, content, calls)


def auto_plan(parser):
    from ortmodule.serving.tools import ToolPlan

    return ToolPlan("auto", parser=parser)


def streams_as_read(plan, text, content, calls, finish="stop"):
    """`read_calls`'s reading of `text` (the whole answer's, where the length cut it: `finish` "length"); and a
    stream given it in two pieces, cut anywhere, or a character at a time, sends the same content and the same
    calls (put together as a client puts them)."""
    from ortmodule.serving.tools import ToolStream, read_calls, tool_message

    if finish == "stop":
        assert read_calls(plan, text) == (content, calls)
    else:
        message = tool_message(plan, text, finish)[0]
        assert (message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                     for c in message.get("tool_calls", ())] or None) == (content, calls)
    for cut in range(len(text) + 1):
        stream = ToolStream(plan)
        sent = [stream.piece(text[:cut]), stream.piece(text[cut:]), *stream.end(text, finish)[0]]
        assert "".join(d.get("content", "") for d in sent) == (content or ""), cut
        assert gathered(sent) == (calls or []), cut
    stream = ToolStream(plan)  # a character at a time
    sent = [stream.piece(c) for c in text] + stream.end(text, finish)[0]
    assert "".join(d.get("content", "") for d in sent) == (content or "")
    assert gathered(sent) == (calls or [])


def streamed_in_pieces(plan, text: str, rng) -> list[dict]:
    """The tool stream's deltas for `text` given to it in random pieces of 1 to 7 characters, its end's included."""
    from ortmodule.serving.tools import ToolStream

    stream, sent, at = ToolStream(plan), [], 0
    while at < len(text):
        step = rng.randrange(1, 8)
        sent.append(stream.piece(text[at: at + step]))
        at += step
    return sent + stream.end(text, "stop")[0]


def gathered(deltas: list[dict]) -> list[tuple[str, str]]:
    """Streamed calls put together as a client puts them: by index, the name from the first delta of each (with
    its id), the arguments from all of them; the indexes in order, each call begun once."""
    calls = []
    for part in (p for d in deltas for p in d.get("tool_calls", ())):
        if "id" in part:
            assert part["index"] == len(calls) and part["type"] == "function"
            calls.append([part["function"]["name"], ""])
        calls[part["index"]][1] += part["function"]["arguments"]
    return [tuple(c) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('functools[{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "parameters": {}}]', None,
     [("f", '{"a": [1, 2]}'), ("g", "{}")]),
    ('Let me check. functools[{"name": "f", "arguments": {}}]', "Let me check. ", [("f", "{}")]),
    ("No call.", "No call.", None),
    ('Sure functools[ {"arguments": {"x": "]"} ,"name": "f"} ]', "Sure ", [("f", '{"x": "]"}')]),
])
def test_the_phi4_mini_json_parser_reads_phi4_minis_calls(text, content, calls):
    """Phi-4-mini's `functools[...]` calls as vLLM's parser of that name reads them (a list in the arguments
    too), each one's arguments as written; the text before them its content; streamed the same at any cut (the
    arguments in pieces as written); a call the length cut short comes as far as written, whole and streamed,
    and is text in a whole answer the length did not cut."""
    from ortmodule.serving.tools import read_calls

    streams_as_read(auto_plan("phi4_mini_json"), text, content, calls)
    cut = 'Sure. functools[{"name": "f", "arguments": {'
    streams_as_read(auto_plan("phi4_mini_json"), cut, "Sure. ", [("f", "{")], finish="length")
    assert read_calls(auto_plan("phi4_mini_json"), cut) == (cut, None)


XML_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"}, "at": {"type": "number"},
    "tags": {"type": "array"}, "note": {"type": ["string", "null"]}, "zone": {"anyOf": [{"type": "null"},
                                                                                      {"type": "integer"}]}}}}}]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Let me look.\n<tool_call>\n<function=f>\n<parameter=city>\nSan José\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", "Let me look.\n", [("f", '{"city": "San José", "days": 3}')]),
    ("<tool_call>\n<function=f>\n<parameter=hot>\nTrue\n</parameter>\n<parameter=at>\n2.0\n</parameter>\n"
     "<parameter=tags>\n['a', 1]\n</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=zone>\nnull"
     "\n</parameter>\n<parameter=city>\nnull\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=g>\n<parameter=x>\n7\n</parameter>\n</function>\n</tool_call>", None,
     [("f", '{"hot": true, "at": 2, "tags": ["a", 1], "note": null, "zone": null, "city": "null"}'),
      ("g", '{"x": "7"}')]),  # a parameter the tool does not name, or a tool not given: the text
    ("<tool_call>\n<function=f>\n<parameter=days>\nmany\n</parameter>\n<parameter=city>\nOslo",
     None, [("f", '{"days": "many", "city": "Oslo"}')]),  # not an integer: the text; cut short: read as vLLM reads
    ("<tool_call>\nno function here\n</tool_call>", "<tool_call>\nno function here\n</tool_call>", None),
    ("a < b, <tool_c", "a < b, <tool_c", None),
])
def test_the_qwen3_coder_parser_reads_qwen35s_xml_calls(text, content, calls):
    """Qwen3.5's and Qwen3-Coder's XML calls as vLLM's `qwen3_coder` parser reads them: each parameter's text
    typed by the tool's schema (integer, number, boolean, array, null where admitted), the text where it does not
    convert; the text before the first call its content; streamed the same at any cut."""
    from ortmodule.serving.tools import ToolPlan, checked_tools

    streams_as_read(ToolPlan("auto", checked_tools(XML_TOOLS), parser="qwen3_coder"), text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[get_weather(city="Paris", unit="c"), get_time(zone=\'utc\', days=[1, -2], x={"a": None, "b": True})]', None,
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"zone": "utc", "days": [1, -2], '
                                                                     '"x": {"a": null, "b": true}}')]),
    ('<|python_start|>[f(a="é")]<|python_end|>', None, [("f", '{"a": "é"}')]),  # Llama 4's
    ("[1, 2] are numbers.", "[1, 2] are numbers.", None),
    ("[f(1)]", "[f(1)]", None),  # a positional argument: not a call vLLM reads
    ("[f(a=open('x'))]", "[f(a=open('x'))]", None),  # not a literal
    ("[f(a=", "[f(a=", None),
    ("The answer is [f(a=1)].", "The answer is [f(a=1)].", None),
])
def test_the_pythonic_parser_reads_llamas_python_calls(text, content, calls):
    """Llama 3.2's and Llama 4's Python calls as vLLM's `pythonic` parser reads them: the whole output a list of
    calls with keyword arguments of literal values; anything else text; streamed the same at any cut."""
    streams_as_read(auto_plan("pythonic"), text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Checking. <|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>It is sunny.', "Checking. It is sunny.",
     [("get_weather", '{"city": "Paris"}')]),
    ('<|tool_call_start|>[f(a=1), g(b=[2])]<|tool_call_end|>[f(a=1), g(b=[2])]<|tool_call_end|>', None,
     [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),  # LFM2's echo of its calls after the end, left out
    ("<|tool_call_start|>[f(a='x')]", None, [("f", '{"a": "x"}')]),  # the end never came
    ("<|tool_call_start|>not calls<|tool_call_end|>", "<|tool_call_start|>not calls<|tool_call_end|>", None),
    ("No call. <|tool_call", "No call. <|tool_call", None),
])
def test_the_lfm2_parser_reads_lfm2s_calls(text, content, calls):
    """LFM2's and LFM2.5's calls as vLLM's `lfm2` parser reads them: a Python list of calls between its markers,
    the text around them the content; streamed the same at any cut."""
    streams_as_read(auto_plan("lfm2"), text, content, calls)


@pytest.mark.parametrize(("arch", "parser", "call"), [
    ("lfm2", "lfm2", r'<\|tool_call_start\|>\[get_weather\(city="(Paris|Rome)", unit="(c|f)"\)\]<\|tool_call_end\|>'),
    ("llama", "pythonic", r'\[get_weather\(city="(Paris|Rome)", unit="(c|f)"\)\]'),
    ("llama", "qwen3_coder", r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
                             r"<parameter=unit>\n(c|f)\n</parameter>\n</function>\n</tool_call>"),
    ("llama", "mistral", r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Paris|Rome)", "unit": "(c|f)"\}'),
    ("llama", "gemma4", r'<\|tool_call>call:get_weather\{city:<\|"\|>(Paris|Rome)<\|"\|>,unit:<\|"\|>(c|f)<\|"\|>\}'
                        r"<tool_call\|>"),
    ("llama", "functiongemma", r"<start_function_call>call:get_weather\{city:<escape>(Paris|Rome)<escape>,"
                               r"unit:<escape>(c|f)<escape>\}<end_function_call>"),
    ("llama", "granite", r'<\|tool_call\|>\[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                         r'"unit": "(c|f)"\}\}\]'),
])
def test_auto_reads_each_parsers_calls_from_the_models_output(build, arch, parser, call):
    """tool_choice "auto" under `--tool-call-parser lfm2`, `pythonic`, `qwen3_coder`, `mistral`, `gemma4`,
    `functiongemma` and `granite`: the
    model's output (held by a regex to the parser's form, on the lfm2 fixture for LFM2's) is transformers' greedy
    text; the call read from it, the text before it the content, finish "tool_calls", whole and streamed. Under
    mistral every call's id (a named function's too) is nine letters and digits, as Mistral's templates require."""
    import re

    live, _, hf, tokenizer = served_live(build(arch), TOOL_TEMPLATE, enable_auto_tool_choice=True,
                                         tool_call_parser=parser)
    try:
        before = "" if parser in ("pythonic", "granite") else "Sure. "  # their calls are the whole output
        pattern = re.escape(before) + call
        expected, complete = greedy_text(hf, tokenizer, prompt_ids(tokenizer, ASK),
                                         LLMatcher.grammar_from_regex(pattern), 120)
        assert complete
        found = re.fullmatch(pattern, expected)
        made = [("get_weather", json.dumps({"city": found.group(1), "unit": found.group(2)}))]
        choice = chat(live, structured_outputs={"regex": pattern}, max_tokens=120)["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (before or None, "tool_calls")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == made
        content, calls, finish = streamed(live, structured_outputs={"regex": pattern}, max_tokens=120)
        assert (content, [(c["name"], c["arguments"]) for c in calls.values()], finish) == (before, made, "tool_calls")
        named = chat(live, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=30,
                     **COMPACT)["choices"][0]["message"]["tool_calls"][0]
        for ident in [c["id"] for c in choice["message"]["tool_calls"]] + [named["id"]]:
            assert (len(ident) == 9 and ident.isalnum()) if parser == "mistral" else ident.startswith("chatcmpl-tool-")
    finally:
        live.stop()


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Let me check.[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]', "Let me check.",
     [("f", '{"a": 1}'), ("g", "{}")]),  # before v11: one JSON list
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "utc"}')]),  # v11 on: name[ARGS]{...} each
    ('[TOOL_CALLS]f{"a": [1, 2]}', None, [("f", '{"a": [1, 2]}')]),  # [ARGS] skipped as a special token
    ("No tools needed.", "No tools needed.", None),
    ('[TOOL_CALLS] [{"name": "f", "argu', '[TOOL_CALLS] [{"name": "f", "argu', None),
    ("It costs [TOOL", "It costs [TOOL", None),
])
def test_the_mistral_parser_reads_mistrals_calls(text, content, calls):
    """Mistral's `[TOOL_CALLS]` calls as vLLM's `mistral` parser reads them, in both of its tokenizers' forms;
    the text before them the content; streamed the same at any cut."""
    streams_as_read(auto_plan("mistral"), text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', None,
     [("f", '{"a": 1}'), ("g", "{}")]),  # Granite 3.0's token
    (' <tool_call> [{"name": "f", "arguments": {"x": "é"}}]\n', None, [("f", '{"x": "é"}')]),  # 3.1's text
    ('[{"name": "f", "arguments": {"a": 1}}]', None, [("f", '{"a": 1}')]),
    ("The answer is [1, 2].", "The answer is [1, 2].", None),
    ('<|tool_call|>[{"name": "f"}]', '<|tool_call|>[{"name": "f"}]', None),  # no arguments: text, as vLLM
    ("[1, 2]", "[1, 2]", None),
    ("<|tool_", "<|tool_", None),
])
def test_the_granite_parser_reads_granites_calls(text, content, calls):
    """Granite 3's calls as vLLM's `granite` parser reads them: a JSON list of `{"name", "arguments"}` after
    `<|tool_call|>` (3.0) or `<tool_call>` (3.1) or alone, space around it taken, each call's arguments as written;
    other output is text (a call without arguments; in a whole answer, a list with text after it); streamed the
    same at any cut."""
    from ortmodule.serving.tools import read_calls

    streams_as_read(auto_plan("granite"), text, content, calls)
    after = '[{"name": "f", "arguments": {}}] and more'
    assert read_calls(auto_plan("granite"), after) == (after, None)


@pytest.mark.parametrize(("parser", "text"), [
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": 1, "b": "two"}}]'),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1, "b": "two"}}; {"name": "g", '
                    '"parameters": {"c": [3, 4]}}'),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": {"a": 1, "b": "two"}}]'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1, "b": "two"}}]'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1, "b": "two"}  [TOOL_CALLS]g[ARGS]{"c": [3, 4]}\n'),
])
def test_llama3_phi4_and_mistral_calls_stream_in_pieces(parser, text):
    """A character at a time, each call comes once its name is whole and its arguments have begun, then its
    arguments in pieces as written (they came whole at the end before): every call more than one piece before
    the end, put together the whole answer's."""
    from ortmodule.serving.tools import ToolStream, read_calls

    stream = ToolStream(auto_plan(parser))
    sent = [stream.piece(c) for c in text]
    for k, (_, arguments) in enumerate(read_calls(auto_plan(parser), text)[1]):
        pieces = [p["function"]["arguments"] for d in sent for p in d.get("tool_calls", ()) if p["index"] == k]
        assert len([p for p in pieces if p]) > 1 and arguments.startswith("".join(pieces)), (k, pieces)
    assert gathered(sent + stream.end(text, "stop")[0]) == read_calls(auto_plan(parser), text)[1]


Q = '<|"|>'  # Gemma 4's string delimiter (a token of its own)


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f"Let me check.<|tool_call>call:get_weather{{city:{Q}Paris, France{Q},unit:{Q}c{Q}}}<tool_call|>",
     "Let me check.", [("get_weather", '{"city": "Paris, France", "unit": "c"}')]),
    (f"<|tool_call>call:f{{n:42,x:1.5,t:true,b:false,o:{{k:{Q}v}}{Q}}},l:[1,{Q}a{Q}],e:{{}}}}<tool_call|>"
     "<|tool_call>call:get-time.now{}<tool_call|>", None,
     [("f", '{"n": 42, "x": 1.5, "t": true, "b": false, "o": {"k": "v}"}, "l": [1, "a"], "e": {}}'),
      ("get-time.now", "{}")]),
    ("<|tool_call>call:f{v:None,w:1e5}<tool_call|>", None, [("f", '{"v": "None", "w": "1e5"}')]),  # as text
    (f"<|tool_call>call:f{{a:{Q}x{Q}}}", f"<|tool_call>call:f{{a:{Q}x{Q}}}", None),  # never closed
    ("No call <|tool", "No call <|tool", None),
    ("Hi <|tool_call>oops<tool_call|> <|tool_call>call:f{a:1}<tool_call|>", "Hi ",
     [("f", '{"a": 1}')]),  # a marker that is not a call: passed over; the content before the first, as vLLM's
])
def test_the_gemma4_parser_reads_gemma4s_calls(text, content, calls):
    """Gemma 4's `<|tool_call>call:NAME{key:value}<tool_call|>` calls as vLLM's `gemma4` parser reads them:
    bare keys, `<|"|>` strings (a brace inside one is text), numbers (a point: a float), booleans, objects,
    lists, other bare values as text; the text before the first call the content; streamed the same at any
    cut."""
    streams_as_read(auto_plan("gemma4"), text, content, calls)


E = "<escape>"  # FunctionGemma's string delimiter (a token of its own)


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f"Moving them.<start_function_call>call:move_files{{destination:{E}Docs, {{old}}{E},extensions:[{E}pdf{E}],"
     f"min_size_mb:100,recursive:true}}<end_function_call>", "Moving them.",
     [("move_files", '{"destination": "Docs, {old}", "extensions": ["pdf"], "min_size_mb": 100, "recursive": true}')]),
    (f"<start_function_call>call:a{{}}<end_function_call><start_function_call>call:get-time{{zone:{E}utc{E}}}"
     "<end_function_call>", None, [("a", "{}"), ("get-time", '{"zone": "utc"}')]),
    (f"<start_function_call>call:f{{a:{E}x{E},n:2.5", None, [("f", '{"a": "x", "n": 2.5}')]),  # never closed
    (f"<start_function_call>call:f{{a:{E}x{E}}}<end_function_call><start_function_call>call:g{{b:1}}", None,
     [("f", '{"a": "x"}'), ("g", '{"b": 1}')]),  # the last never closed: read to the end, as vLLM's
    (f"<start_function_call>call:f{{a:{E}5{E}}}<end_function_call>", None, [("f", '{"a": "5"}')]),  # a string
    ("No call <start_function", "No call <start_function", None),
    ("<start_function_call>oops<end_function_call>", "<start_function_call>oops<end_function_call>", None),
])
def test_the_functiongemma_parser_reads_functiongemmas_calls(text, content, calls):
    """FunctionGemma's `<start_function_call>call:NAME{key:value}<end_function_call>` calls as vLLM's
    `functiongemma` parser finds them (a call never closed read to the text's end), their arguments read as Gemma
    4's are, strings between `<escape>`s (numbers and lists too, which vLLM's parser drops; a string stays a
    string, which vLLM's reads as JSON where it parses); the text before the first call the content; streamed
    the same at any cut."""
    streams_as_read(auto_plan("functiongemma"), text, content, calls)


def gemma_value(rng, quote: str, depth: int = 0):
    """A random argument value of the kinds Gemma 4's serialization writes (no null: it has none of its own)."""
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return rng.choice([True, False, 0, -7, 42, 12345678901234, 3.25, -0.5, 2.0])
    if kind in (1, 2):
        while quote in (text := "".join(rng.choice(list('a "\\{}[],:\n<|>é') + ["😀", "'"])
                                        for _ in range(rng.randrange(7)))):
            pass
        return text
    if kind in (3, 4):
        return {f"k{i}": gemma_value(rng, quote, depth + 1) for i in range(rng.randrange(4))}
    return [gemma_value(rng, quote, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize("seed", range(200))
def test_random_gemma_calls_read_as_transformers_response_parser_reads_them(seed):
    """Random Gemma 4 and FunctionGemma calls (any values of the serialization: strings holding braces, commas,
    colons, quotes, line breaks; numbers; booleans; nested objects and lists), the text before them random: the
    whole answer's calls and content are what transformers' response parser gives (`parse_response` under
    transformers' own response template for Gemma 4, and the same with FunctionGemma's markers), the arguments
    the same JSON text (the content as written, which transformers' strips); the stream in random pieces gives the
    whole answer's calls."""
    import random

    from test_tool_stream_fuzz import gemma4_written
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    from transformers.utils.chat_parsing.response_parser import parse_response

    from ortmodule.serving.tools import read_calls

    rng = random.Random(seed)
    template = json.loads(json.dumps(_RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)]))
    parser, start, end, quote, anchor = rng.choice([("gemma4", "<|tool_call>", "<tool_call|>", Q, "<|turn>model\n"),
                                                    ("functiongemma", "<start_function_call>", "<end_function_call>",
                                                     E, "<start_of_turn>model\n")])
    if parser == "functiongemma":
        calls = template["fields"]["tool_calls"]
        calls["open_pattern"], calls["close"] = re.escape(start) + r"call:(?P<name>\w+)", end
        calls["content_args"]["string_delims"] = [[quote, quote]]
        template["start_anchor"], template["fields"]["content"]["close"] = anchor, ["<end_of_turn>"]
    written = [(f"tool_{rng.randrange(3)}", {f"k{i}": gemma_value(rng, quote) for i in range(rng.randrange(4))})
               for _ in range(rng.randrange(1, 4))]
    lead = rng.choice(["", "Sure, let me check.", "{a:1} "])
    text = lead + "".join(f"{start}call:{name}{gemma4_written(value, quote)}{end}" for name, value in written)
    expected = parse_response(text, template, prefix=anchor)
    want = [(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
            for c in expected["tool_calls"]]
    content, calls = read_calls(auto_plan(parser), text)
    assert calls == want and (content or "").strip() == expected.get("content", "")  # transformers' strips it
    assert gathered(streamed_in_pieces(auto_plan(parser), text, rng)) == want


def test_gemma4s_calls_stream_each_as_it_closes():
    """A stream sends each Gemma 4 call as soon as its `<tool_call|>` comes, not at the output's end (they came
    whole at the end before)."""
    from ortmodule.serving.tools import ToolStream

    first = f"<|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|>"
    text = first + "<|tool_call>call:g{b:2}<tool_call|>"
    stream = ToolStream(auto_plan("gemma4"))
    sent = [stream.piece(c) for c in first]
    assert gathered(sent) == [("f", '{"a": "x"}')]
    sent += [stream.piece(c) for c in text[len(first):]]
    assert gathered(sent) == [("f", '{"a": "x"}'), ("g", '{"b": 2}')]
    assert gathered(sent + stream.end(text, "stop")[0]) == gathered(sent)


# ---- Anthropic's Messages API: the same calls in its shape ------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                    **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
                   for t in TOOLS]


def anthropic_client(live):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=live.url, api_key="not-needed", max_retries=0)


def test_anthropics_tool_use_is_the_same_call_in_its_shape(tools_live):
    """Anthropic's `tool_choice` {"type": "tool"} and {"type": "any"}: the chat route's calls (transformers'
    greedy text under the same schemas) as `tool_use` blocks, their `input` the arguments' object, stop reason
    "tool_use"; the SDK's `Message` takes the answer and its stream helper ends with the same message;
    count_tokens counts transformers' prompt of the tools."""
    from anthropic.types import Message

    live, hf, tokenizer = tools_live
    client = anthropic_client(live)
    ids = prompt_ids(tokenizer, ASK)
    expected = greedy_text(hf, tokenizer, ids, compact(WEATHER))[0]
    request = dict(model=NAME, max_tokens=60, messages=ASK, tools=ANTHROPIC_TOOLS,
                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0.0, **COMPACT})
    answer = client.messages.create(**request)
    assert answer.stop_reason == "tool_use" and len(answer.content) == 1
    use = answer.content[0]
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", json.loads(expected))
    assert use.id.startswith("toolu_")
    raw = httpx.post(f"{live.url}/v1/messages", json={**{k: v for k, v in request.items() if k != "extra_body"},
                                                      **request["extra_body"]}).json()
    Message.model_validate(raw, strict=True)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", json.loads(expected))]
    assert final.stop_reason == "tool_use"
    assert client.messages.count_tokens(model=NAME, messages=ASK, tools=ANTHROPIC_TOOLS).input_tokens == len(ids)
    required = chat(live, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                    **COMPACT)["choices"][0]["message"]
    anyone = client.messages.create(**{**request, "max_tokens": 120,
                                       "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert len(required["tool_calls"]) == 1 and [(b.name, b.input) for b in anyone.content] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in required["tool_calls"]]
    with client.messages.stream(**{**request, "max_tokens": 120,
                                   "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}) as stream:
        final = stream.get_final_message()  # its input streamed in pieces (json_calls.py)
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in anyone.content]


def test_anthropics_auto_calls_and_a_conversation_with_results(tools_live):
    """"auto" under the hermes parser: the text before the call a text block, then the call's `tool_use`
    block, streamed the same; an assistant's `tool_use` blocks and the user's `tool_result` blocks render as
    transformers renders the chat messages they are (an assistant's calls, then a tool message)."""
    live, hf, tokenizer = tools_live
    client = anthropic_client(live)
    pattern = r"(Sure|Yes)\. " + CALL.replace("{", r"\{").replace("}", r"\}")
    ids = prompt_ids(tokenizer, ASK)
    expected = greedy_text(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), 170)[0]
    before, _, call = expected.partition("<tool_call>")
    inner = json.loads(call.removesuffix("</tool_call>"))
    request = dict(model=NAME, max_tokens=170, messages=ASK, tools=ANTHROPIC_TOOLS,
                   extra_body={"temperature": 0.0, "structured_outputs": {"regex": pattern}})
    answer = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    for message in (answer, final):
        assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", before), ("tool_use", None)]
        assert (message.content[1].name, message.content[1].input) == (inner["name"], inner["arguments"])
        assert message.stop_reason == "tool_use"
    arguments = {"city": "Rome", "unit": "c"}
    conversation = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    rendered = ASK + [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 degrees"},
        {"role": "user", "content": "And tomorrow?"}]
    counted = client.messages.count_tokens(model=NAME, messages=conversation, tools=ANTHROPIC_TOOLS).input_tokens
    assert counted == len(prompt_ids(tokenizer, rendered))


# ---- OpenAI's Responses API: the same calls as function_call items ---------------------------------------------

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_the_responses_apis_function_calls_are_chats_calls_as_items(tools_live):
    """A named function and "auto" on `/v1/responses`: chat's calls (transformers' greedy text under the same
    grammars) as `function_call` items after the text before them; the `openai` client's `Response` takes the
    answer and its stream helper's final response holds the same items; an earlier call and its output in
    `input` render as transformers renders the chat messages they are."""
    from openai.types.responses import Response

    live, hf, tokenizer = tools_live
    sdk = client(live)
    ids = prompt_ids(tokenizer, ASK)
    expected = greedy_text(hf, tokenizer, ids, compact(WEATHER))[0]
    named = dict(model=NAME, input=ASK, tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                 max_output_tokens=60, temperature=0.0, extra_body=COMPACT)
    answer = sdk.responses.create(**named)
    Response.model_validate(answer.model_dump(), strict=True)
    (item,) = answer.output
    assert (item.type, item.name, item.arguments, item.status) == ("function_call", "get_weather", expected,
                                                                    "completed")
    assert item.call_id.startswith("call_") and answer.status == "completed"
    with sdk.responses.stream(**named) as stream:
        final = stream.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", "get_weather", expected)]
    required = {**named, "tool_choice": "required", "max_output_tokens": 120, "parallel_tool_calls": False}
    whole = sdk.responses.create(**required)
    with sdk.responses.stream(**required) as stream:
        final = stream.get_final_response()  # the calls' arguments streamed in pieces (json_calls.py)
    assert [(i.type, i.name, i.arguments) for i in final.output] == [
        (i.type, i.name, i.arguments) for i in whole.output] and whole.output
    pattern = r"(Sure|Yes)\. " + CALL.replace("{", r"\{").replace("}", r"\}")
    expected = greedy_text(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), 170)[0]
    before, _, call = expected.partition("<tool_call>")
    inner = json.loads(call.removesuffix("</tool_call>"))
    auto = dict(model=NAME, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=170, temperature=0.0,
                extra_body={"structured_outputs": {"regex": pattern}})
    answer = sdk.responses.create(**auto)
    with sdk.responses.stream(**auto) as stream:
        final = stream.get_final_response()
    for got in (answer, final):
        message, made = got.output
        assert (message.type, message.content[0].text) == ("message", before)
        assert (made.type, made.name, json.loads(made.arguments)) == ("function_call", inner["name"],
                                                                      inner["arguments"])
    arguments = {"city": "Rome", "unit": "c"}
    conversation = ASK + [{"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": json.dumps(arguments)},
                          {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"}]
    rendered = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    answer = sdk.responses.create(model=NAME, input=conversation, tools=RESPONSES_TOOLS, tool_choice="none",
                                  max_output_tokens=4, temperature=0.0)
    assert answer.usage.input_tokens == len(prompt_ids(tokenizer, rendered))


def test_the_openai_clients_pydantic_tools_parse(tools_live):
    """The `openai` client's `pydantic_function_tool` (a strict schema with `$defs` and a `$ref`) through its
    `chat.completions.parse`: a named call and "required"'s calls (the tools' `$defs` gathered where the
    references point) come back parsed into the pydantic model by the client."""
    import enum

    import openai
    from pydantic import BaseModel

    class City(enum.StrEnum):
        paris = "Paris"
        rome = "Rome"

    class GetWeather(BaseModel):
        city: City

    class GetTime(BaseModel):
        city: City
        utc: bool

    live = tools_live[0]
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    assert "$defs" in tools[0]["function"]["parameters"]
    for choice in ({"type": "function", "function": {"name": "GetWeather"}}, "required"):
        answer = client(live).chat.completions.parse(model=NAME, messages=ASK, tools=tools, tool_choice=choice,
                                                     parallel_tool_calls=False, max_tokens=60, temperature=0,
                                                     extra_body=COMPACT)
        (call,) = answer.choices[0].message.tool_calls
        kind = {"GetWeather": GetWeather, "GetTime": GetTime}[call.function.name]
        assert isinstance(call.function.parsed_arguments, kind)
        assert json.loads(call.function.arguments) == call.function.parsed_arguments.model_dump(mode="json")


def test_the_command_line_takes_vllms_tool_flags(llama, capsys, monkeypatch):
    """`ortmodule serve --enable-auto-tool-choice --tool-call-parser hermes` reaches the settings; the first
    without the second stops the server before the package loads, as vLLM's does; an unknown parser is
    argparse's error."""
    import ortmodule.serving
    from ortmodule import cli

    with pytest.raises(SystemExit) as stopped:
        cli.ortmodule(["serve", str(llama.package_dir), "--port", "0", "--enable-auto-tool-choice"])
    assert stopped.value.code == 2 and "enable_auto_tool_choice needs tool_call_parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.ortmodule(["serve", str(llama.package_dir), "--tool-call-parser", "kimi_k2"])
    assert "invalid choice: 'kimi_k2'" in capsys.readouterr().err
    given = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: given.update(options))
    cli.ortmodule(["serve", str(llama.package_dir), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (given["enable_auto_tool_choice"], given["tool_call_parser"]) == (True, "hermes")


# ---- real chat templates (trl ships them) on the real SmolLM2's tokenizer and weights ---------------------------

def trl_template(name: str) -> str:
    """A real model's chat template, as trl ships it (trl is a dev dependency: tests/test_libraries.py)."""
    from importlib import resources

    pytest.importorskip("trl")
    return (resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def smollm2():
    from ortmodule import OrtModelForCausalLM, load_tokenizer
    from ortmodule_dev import fixtures

    fixture = fixtures.build(fixtures.SMOLLM2)
    return fixture, OrtModelForCausalLM.from_pretrained(fixture.package_dir), load_tokenizer(fixture.package_dir)


@pytest.mark.parametrize("template", ["qwen3", "qwen2_5", "llama3_1", "qwen3_5_think", "lfm2_2_5", "llama3_2"])
def test_real_templates_render_a_tool_conversation_as_transformers(smollm2, template):
    """Qwen3's, Qwen2.5's and Llama 3.1's own templates (tools in the system turn, calls, tool results, Qwen3's
    earlier reasoning): the chat route's prompt (`/tokenize`), the Responses API's (its items: a reasoning item,
    a function_call and its output) and Anthropic's (`count_tokens`: thinking, tool_use and tool_result blocks)
    are transformers' `apply_chat_template` of the same conversation, token for token."""
    from fastapi.testclient import TestClient

    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    fixture, model, _ = smollm2
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = trl_template(template)
    arguments = {"city": "Rome", "unit": "c"}
    rendered = ASK + [{"role": "assistant", "content": "", "reasoning_content": "The user wants Rome's weather.",
                       "tool_calls": [{"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": arguments}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    ids = list(tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    text = tokenizer.decode(ids)
    assert "get_weather" in text and "21 degrees" in text and '"Rome"' in text
    if template == "qwen3":  # the reasoning after the last user message is placed
        assert "The user wants Rome's weather." in text
    chat = [*ASK, {**rendered[1], "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        rendered[2]]
    items = [*ASK, {"type": "reasoning", "id": "rs_1", "summary": [],
                    "content": [{"type": "reasoning_text", "text": "The user wants Rome's weather."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(arguments)},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"}]
    blocks = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user wants Rome's weather.", "signature": ""},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "21 degrees"}]}]
    with TestClient(create_app(model, tokenizer, name=NAME)) as client:
        assert client.post("/tokenize", json={"messages": chat, "tools": TOOLS}).json()["tokens"] == ids
        answer = client.post("/v1/responses", json={"input": items, "tools": RESPONSES_TOOLS, "tool_choice": "none",
                                                    "max_output_tokens": 1}).json()
        assert answer["usage"]["input_tokens"] == len(ids)
        counted = client.post("/v1/messages/count_tokens", json={"messages": blocks, "tools": ANTHROPIC_TOOLS})
        assert counted.json()["input_tokens"] == len(ids)


def test_smollm2_under_qwen3s_template_thinks_and_calls(smollm2):
    """The real SmolLM2 served with Qwen3's template, `--reasoning-parser qwen3` and `--tool-call-parser hermes`:
    its greedy output (held by a regex to Qwen3's thinking-then-call form, the grammar over the thinking too:
    `enable_in_reasoning`) is transformers' on the same weights
    under the same grammar; the answer is the thinking as `reasoning`, the call read from the rest."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM

    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    fixture, model, _ = smollm2
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = trl_template("qwen3")
    pattern = (r"<think>\n[A-Za-z ,.']{1,60}\n</think>\n\n<tool_call>\n\{\"name\": \"get_weather\", \"arguments\": "
               r"\{\"city\": \"(Paris|Rome)\", \"unit\": \"(c|f)\"\}\}\n</tool_call>")
    ids = list(tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    expected, complete = greedy_text(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), 120)
    assert complete
    thought = expected.split("</think>")[0].removeprefix("<think>")
    call = json.loads(expected.split("<tool_call>")[1].removesuffix("</tool_call>"))
    with TestClient(create_app(model, tokenizer, name=NAME, reasoning_parser="qwen3", enable_in_reasoning=True,
                               enable_auto_tool_choice=True, tool_call_parser="hermes")) as client:
        choice = client.post("/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "structured_outputs": {"regex": pattern}}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == thought
    (made,) = choice["message"]["tool_calls"]
    assert made["function"] == {"name": "get_weather", "arguments": json.dumps(call["arguments"])}


def test_smollm2_under_qwen35s_template_thinks_and_calls_in_xml(smollm2):
    """The real SmolLM2 served with Qwen3.5's template (which opens the thinking in the prompt), `--reasoning-parser
    qwen3` and `--tool-call-parser qwen3_coder`: its greedy output (held by a regex to Qwen3.5's thinking, then an
    XML call) is transformers' on the same weights under the same grammar; the answer is the thinking as
    `reasoning` and the call read from the rest, whole and streamed (a parameter at a time)."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM

    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    fixture, model, _ = smollm2
    tokenizer = load_tokenizer(fixture.package_dir)
    tokenizer.chat_template = trl_template("qwen3_5_think")
    pattern = (r"[A-Za-z ,.']{1,60}\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
               r"(Paris|Rome)\n</parameter>\n<parameter=unit>\n(c|f)\n</parameter>\n</function>\n</tool_call>")
    ids = prompt_ids(tokenizer, ASK)
    assert tokenizer.decode(ids).endswith("<think>\n")
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    expected, complete = greedy_text(hf, tokenizer, ids, LLMatcher.grammar_from_regex(pattern), 120)
    assert complete
    found = re.fullmatch(pattern, expected)
    arguments = json.dumps({"city": found.group(1), "unit": found.group(2)})
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "structured_outputs": {"regex": pattern}}
    with TestClient(create_app(model, tokenizer, name=NAME, reasoning_parser="qwen3", enable_in_reasoning=True,
                               enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")) as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        events = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == expected.split("</think>")[0]
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_weather",
                                                                          "arguments": arguments}]
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in events.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == expected.split("</think>")[0]
    assert gathered(deltas) == [("get_weather", arguments)]
    assert len([c for d in deltas for c in d.get("tool_calls", [])]) == 4  # "{", each parameter, "}"


def test_a_call_the_length_cuts_short(tools_live):
    """A named function's output cut by `max_tokens`: chat's call holds the arguments as far as they came
    (transformers' greedy tokens under the schema), `finish_reason` "length"; the Responses API's
    `function_call` item the same, the response "incomplete"; Anthropic's answer that text as a `text` block
    ("max_tokens"), a `tool_use` needing a whole `input`; "required"'s list cut before any call's arguments
    begin is text."""
    live, hf, tokenizer = tools_live
    ids = prompt_ids(tokenizer, ASK)
    tokens, complete = grammar_greedy(hf, tokenizer, ids, compact(WEATHER), 4)
    cut = expected_text(tokenizer, tokens)[0]
    assert not complete
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(live, tool_choice=named, max_tokens=4, **COMPACT)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == cut
    answer = httpx.post(f"{live.url}/v1/responses", json={
        "model": NAME, "input": ASK, "tools": RESPONSES_TOOLS, "max_output_tokens": 4, "temperature": 0,
        "tool_choice": {"type": "function", "name": "get_weather"}, **COMPACT}).json()
    assert answer["status"] == "incomplete" and answer["output"][0]["arguments"] == cut
    message = httpx.post(f"{live.url}/v1/messages", json={
        "model": NAME, "messages": ASK, "tools": ANTHROPIC_TOOLS, "max_tokens": 4, "temperature": 0,
        "tool_choice": {"type": "tool", "name": "get_weather"}, **COMPACT}).json()
    assert (message["content"], message["stop_reason"]) == ([{"type": "text", "text": cut}], "max_tokens")
    required = chat(live, tool_choice="required", max_tokens=4, **COMPACT)["choices"][0]
    assert required["finish_reason"] == "length" and "tool_calls" not in required["message"]
    assert required["message"]["content"].startswith("[")
