"""Python calls (serving/python_calls.py: the `pythonic` and `lfm2` tool-call parsers) streamed as they are written:
random lists of calls whose keyword values are any literal written as Python writes them (repr, double quotes,
triple quotes, raw strings, adjacent strings, tuples, comments and line breaks between arguments), given to the
server's tool stream in random pieces, put together are the whole answer's calls, whose arguments parse to the
values written (Python's own reading of the literals is the reference); each call arrives in pieces before the
end; and forms Python would not read as calls are text in the whole answer."""

import json
import random

import pytest
from test_json_calls import random_value
from test_tool_calling import auto_plan, gathered, streamed_in_pieces, streams_as_read

from ortmodule.serving.tools import ToolStream, read_calls


def py_written(rng, value) -> str:
    """`value` as a model may write it in Python."""
    if isinstance(value, str):
        form = rng.randrange(5)
        if form == 0 or not value:
            return repr(value)
        if form == 1:
            return json.dumps(value, ensure_ascii=False)  # a JSON string is a Python one (no surrogate escapes)
        if form == 2:
            return '"""' + value.replace("\\", "\\\\").replace('"', '\\"') + '"""'
        if form == 3 and "\\" not in value and "'" not in value and "\n" not in value and "\u2028" not in value:
            return "r'" + value + "'"
        cut = rng.randrange(len(value) + 1)  # two adjacent strings, which Python joins
        return repr(value[:cut]) + rng.choice(["", " ", "\n"] if cut else [" ", "\n"]) + repr(value[cut:])
    if isinstance(value, list):
        items = [py_written(rng, v) for v in value]
        if rng.random() < 0.3 and items:
            return "(" + ", ".join(items) + ",)"  # a tuple, which JSON writes as a list
        return "[" + rng.choice([", ", ",", ",\n "]).join(items) + rng.choice(["", ","] if items else [""]) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py_written(rng, k)}: {py_written(rng, v)}" for k, v in value.items()) + "}"
    return repr(value)


def python_text(rng, calls) -> tuple[str, str | None, str]:
    """The calls as the pythonic or lfm2 parser's model writes them: the text, the content around them, the parser."""
    written = []
    for name, arguments in calls:
        pairs = [f"{key}{rng.choice(['=', ' = '])}{py_written(rng, value)}" for key, value in arguments.items()]
        between = rng.choice([", ", ",\n    ", " , ", ",  # a comment, with ) and ] in it\n "])
        written.append(f"{name}{rng.choice(['', ' '])}(" + between.join(pairs) + rng.choice(["", ","]) + ")")
    listed = "[" + rng.choice(["", " ", "\n"]) + rng.choice([", ", ",\n"]).join(written) + rng.choice(["", "\n"]) + "]"
    if rng.random() < 0.5:
        python4 = rng.random() < 0.5
        return ("<|python_start|>" + listed + "<|python_end|>") if python4 else listed, None, "pythonic"
    lead, after = rng.choice(["", "Sure. ", "a [b(c=1)] "]), rng.choice(["", " It is done."])
    end = rng.choice(["<|tool_call_end|>", ""]) if not after else "<|tool_call_end|>"
    return lead + "<|tool_call_start|>" + rng.choice(["", " "]) + listed + end + after, (lead + after) or None, "lfm2"


@pytest.mark.parametrize("seed", range(300))
def test_random_python_calls_stream_as_their_whole_answer(seed):
    rng = random.Random(seed)
    calls = [(f"tool_{rng.randrange(3)}", {"a": random_value(rng), "b" * rng.randrange(1, 3): random_value(rng)})
             for _ in range(rng.randrange(1, 4))]
    text, content, parser = python_text(rng, calls)
    plan = auto_plan(parser)
    found_content, found = read_calls(plan, text)
    assert found is not None and [(name, json.loads(arguments)) for name, arguments in found] == calls, (seed, text)
    assert found_content == content
    sent = streamed_in_pieces(plan, text, rng)
    assert gathered(sent) == found, (seed, text)
    assert "".join(d.get("content", "") for d in sent) == (content or ""), (seed, text)


@pytest.mark.parametrize(("parser", "text"), [
    ("pythonic", '[get_weather(city="Paris", unit="c"), get_time(zone=\'utc\', days=[1, -2])]'),
    ("pythonic", '<|python_start|>[f(note="""a long\nnote""", n=3)]<|python_end|>'),
    ("lfm2", 'Checking. <|tool_call_start|>[get_weather(city="San José", days=(1, 2))]<|tool_call_end|>'),
])
def test_python_calls_stream_in_pieces(parser, text):
    """A character at a time, each call comes once its first value has begun (a string) or is whole, then its
    arguments in pieces, a string's characters as they come (they came whole at the end before): every call more
    than one piece before the end, put together the whole answer's."""
    stream = ToolStream(auto_plan(parser))
    sent = [stream.piece(c) for c in text]
    whole = read_calls(auto_plan(parser), text)[1]
    for k, (_, arguments) in enumerate(whole):
        pieces = [p["function"]["arguments"] for d in sent for p in d.get("tool_calls", ()) if p["index"] == k]
        assert len([p for p in pieces if p]) > 2 and arguments.startswith("".join(pieces)), (k, pieces)
    assert gathered(sent + stream.end(text, "stop")[0]) == whole


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("[f(a=1,), g()]", None, [("f", '{"a": 1}'), ("g", "{}")]),  # a trailing comma, a call without arguments
    ("[f(a='x' 'y', b=\"\"\"q\"\"\", c=r'\\d', d=-1.5e3, e={'k': (None,)})]", None,
     [("f", '{"a": "xy", "b": "q", "c": "\\\\d", "d": -1500.0, "e": {"k": [null]}}')]),
    ("[f(a=b'x')]", "[f(a=b'x')]", None),  # bytes: not JSON
    ("[f(a={1, 2})]", "[f(a={1, 2})]", None),  # a set: not JSON
    ("[f(a=)]", "[f(a=)]", None),
    ("[f(a==1)]", "[f(a==1)]", None),
    ("[f(x.y=1)]", "[f(x.y=1)]", None),
    ("[f(a=1 # c, d)\n)]", None, [("f", '{"a": 1}')]),  # a comment in the arguments
    ("[]", "[]", None),
    ('[f(s="""a\\101\\x42\\N{LATIN SMALL LETTER E WITH ACUTE}\r\n\\\r\nz\\0\\7""", t=\'\\12\\1234\')]', None,
     [("f", '{"s": "aABé\\nz\\u0000\\u0007", "t": "\\nS4"}')]),  # escapes that grow, line breaks
])
def test_forms_python_reads_or_refuses(text, content, calls):
    """The whole answer reads what Python reads as a list of calls with keyword literals (a trailing comma,
    adjacent strings, triple quotes, raw strings, tuples, comments), anything else text; streamed the same at
    any cut."""
    streams_as_read(auto_plan("pythonic"), text, content, calls)
    around = "<|tool_call_start|>" + text + "<|tool_call_end|>"
    streams_as_read(auto_plan("lfm2"), around, around if content else None, calls)


@pytest.mark.parametrize("text", ["[f(a=1, a=2)]", "[f(a=1)(b=2)]", '[f(a="x\\', "[f(a=1)] and more"])
def test_a_form_refused_after_its_start_streamed(text):
    """Output that turns out not to be calls after a call's start was streamed (a keyword repeated, which Python
    refuses; the call's result called; a string never closed; text after the list) is text in the whole answer,
    and the stream, which cannot take back what it sent, ends with that text as content, as vLLM's streams do."""
    assert read_calls(auto_plan("pythonic"), text) == (text, None)
    stream = ToolStream(auto_plan("pythonic"))
    sent = [stream.piece(c) for c in text] + stream.end(text, "stop")[0]
    assert [name for name, _ in gathered(sent)] == ["f"]
    assert "".join(d.get("content", "") for d in sent) == text


def test_calls_the_length_cut_short_come_as_far_as_written():
    """Where the length cuts the output short, the calls whose arguments had begun come as far as they were
    written (a string value's characters so far), whole and streamed, as the other parsers' do; a call whose first
    value had not begun as a string is left out."""
    streams_as_read(auto_plan("pythonic"), '[f(a=1, b="ab', None, [("f", '{"a": 1, "b": "ab')], finish="length")
    streams_as_read(auto_plan("lfm2"), "Hi <|tool_call_start|>[f(a=1), g(b=[1, 2", "Hi ", [("f", '{"a": 1}')],
                    finish="length")
