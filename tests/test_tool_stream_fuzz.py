"""The server's tool-call and reasoning readers on outputs a model got wrong: random calls in each tool parser's
form ("required"'s list, hermes, llama3_json, phi4_mini_json, mistral's two forms, granite, qwen3_coder, gemma4,
functiongemma, pythonic, lfm2), random thinking under each reasoning parser (Granite's words too) and gpt-oss's
harmony messages, with a few characters or markers inserted, removed or replaced, given to the stream in random
pieces and read whole. The reading never raises and always ends (a Gemma 4 list holding a `}` looped forever,
growing a list, until it was fixed); where the whole answer still reads calls, the stream's calls and content are
the whole answer's (a call that wrote its name twice was read whole with the last name and the first arguments,
streamed with the first name: such a call is now text, as one with its arguments twice), and the stream's reasoning
and content always are. 20,000 seeds of each run once by hand: all passed (5,887 of the mutated calls still calls);
50,000 more of the calls and 30,000 of the reasoning after FunctionGemma's and Granite's were added: all passed."""

import json
import random
import threading

import pytest
from test_json_calls import random_value, written
from test_python_calls import python_text
from test_tool_calling import XML_TOOLS, auto_plan, gathered, streamed_in_pieces

from ortmodule.serving.tools import ToolPlan, checked_tools, read_calls

Q = '<|"|>'  # Gemma 4's string delimiter
MUTATIONS = list('()[]{},:="\\#\n\r .-_aZ0é<>/') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", ";", "functools[", "<|python_tag|>", "<|tool_call|>",
    '"name"', '"arguments"', '{"name": "f", "arguments": {}}', "<function=f>", "</function>", "<parameter=city>",
    "</parameter>", Q, "<|tool_call>", "<tool_call|>", "call:", "'", '"' * 3, "'" * 3, "<|tool_call_end|>",
    "<|python_end|>", "b'", "r'", "f(", "x=", "<escape>", "<start_function_call>", "<end_function_call>"]


def gemma4_written(value, quote: str = Q) -> str:
    """A value as Gemma 4 writes it (FunctionGemma with its `quote`, `<escape>`)."""
    if isinstance(value, str):
        return quote + value + quote
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{gemma4_written(v, quote)}" for key, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma4_written(v, quote) for v in value) + "]"
    return repr(value)


def output(rng) -> tuple[str, ToolPlan]:
    """Random calls as one parser's model writes them, and the plan that reads them."""
    calls = [(f"tool_{rng.randrange(3)}", {"a": random_value(rng), "b" * rng.randrange(1, 3): random_value(rng)})
             for _ in range(rng.randrange(1, 3))]
    objects = [f'{{"name": "{name}", "arguments": {written(rng, value)}}}' for name, value in calls]
    lead = rng.choice(["", "Sure. "])
    form = rng.choice(["required", "hermes", "llama3_json", "phi4_mini_json", "mistral", "mistral11", "granite",
                       "qwen3_coder", "gemma4", "functiongemma", "python"])
    if form == "python":  # pythonic's or lfm2's (test_python_calls.py)
        text, _, parser = python_text(rng, calls)
        return text, auto_plan(parser)
    if form == "required":
        return "[" + ", ".join(o.replace('"arguments"', '"parameters"') for o in objects) + "]", ToolPlan("required")
    if form == "qwen3_coder":
        text = lead + "".join("<tool_call>\n<function=f>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n"
                              f"{rng.randrange(9)}\n</parameter>\n<parameter=tags>\n[1, \"a\"]\n</parameter>\n"
                              "</function>\n</tool_call>" for _ in calls)
        return text, ToolPlan("auto", checked_tools(XML_TOOLS), parser="qwen3_coder")
    text = {"hermes": lead + "".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects),
            "llama3_json": rng.choice(["", "<|python_tag|>"]) + "; ".join(objects),
            "phi4_mini_json": lead + "functools[" + ", ".join(objects) + "]",
            "mistral": lead + "[TOOL_CALLS][" + ",".join(objects) + "]",
            "mistral11": lead + "".join(f"[TOOL_CALLS]{name}[ARGS]{written(rng, value)}" for name, value in calls),
            "granite": rng.choice(["", "<|tool_call|>", "<tool_call>"]) + "[" + ", ".join(objects) + "]",
            "gemma4": lead + "".join(f"<|tool_call>call:{name}{gemma4_written(value)}<tool_call|>"
                                     for name, value in calls),
            "functiongemma": lead + "".join(f"<start_function_call>call:{name}{gemma4_written(value, '<escape>')}"
                                            "<end_function_call>" for name, value in calls)}[form]
    return text, auto_plan("mistral" if form == "mistral11" else form)


def read_both(plan, text, rng) -> tuple:
    """The whole answer's content and calls, and the stream's deltas for `text` in random pieces."""
    return *read_calls(plan, text), streamed_in_pieces(plan, text, rng)


@pytest.mark.parametrize("seed", range(600))
def test_mutated_calls_stream_as_their_whole_answer_or_are_text(seed):
    rng = random.Random(seed)
    text, plan = output(rng)
    for _ in range(rng.randrange(1, 4)):
        at, kind, mutation = rng.randrange(len(text) + 1), rng.randrange(3), rng.choice(MUTATIONS)
        text = text[:at] + (mutation if kind != 1 else "") + text[at + (0 if kind == 0 else rng.randrange(1, 4)):]
    result = []
    worker = threading.Thread(target=lambda: result.append(read_both(plan, text, rng)), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert result, f"the reading of {text!r} under {plan.parser or plan.mode} did not end"
    content, found, sent = result[0]
    if found is not None:
        assert gathered(sent) == found and "".join(d.get("content", "") for d in sent) == (content or ""), text


@pytest.mark.parametrize(("body", "arguments"), [
    ("a:[1,x}],b:2", {"a": [1, "x}"], "b": 2}),  # a `}` in a list's bare value is the value's, as vLLM's
    ("a:[x}", {"a": []}),  # a list the text ends in: its last bare value left out, as vLLM's
    ("a:[x", {"a": []}),
    (f"a:[{Q}s", {"a": ["s"]}),  # a string the text ends in: kept, as vLLM's
    ("a:[{b:1]", {"a": [{"b": 1}]}),
])
def test_a_gemma4_list_with_a_brace_ends(body, arguments):
    """A Gemma 4 call whose list holds a `}` (its reading stopped there without moving on and looped forever,
    the whole answer and the stream alike) reads as vLLM's parser reads it."""
    from ortmodule.serving.gemma4_calls import arguments as read

    done = []
    worker = threading.Thread(target=lambda: done.append(read(body)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done == [arguments]


REASONING_MUTATIONS = list('<>|{}"\n é') + [
    "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|start|>", "<|start|>assistant", "<|constrain|>",
    " to=functions.f", "commentary", "analysis", "final", "<think>", "</think>", "<|channel>", "<channel|>", "[THINK]",
    "[/THINK]", "thought\n", "Here is my thought process:", "Here's my response:", "Here", "Here's", " my", ":"]
WORDS = ["a", "b c", "<x>", "{", "}", '"q"', "\n", "é", "to", "|"]


def harmony_written(rng) -> str:
    out = []
    for k in range(rng.randint(1, 5)):
        body = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
        kind = rng.choice(["analysis", "final", "commentary", "call", "builtin"])
        head = "<|channel|>" if k == 0 and rng.random() < 0.5 else "<|start|>assistant<|channel|>"
        if kind == "call":
            out.append(f"{head}commentary to=functions.f <|constrain|>json<|message|>{json.dumps({'v': body})}<|call|>")
            break
        out.append(head + ("analysis to=python" if kind == "builtin" else kind) + "<|message|>" + body + "<|end|>")
    return "".join(out)


@pytest.mark.parametrize("seed", range(400))
def test_mutated_reasoning_streams_as_its_whole_reading(seed):
    from ortmodule.serving.harmony import PARSER, HarmonyStream
    from ortmodule.serving.reasoning import MARKERS, Reasoning, ReasoningStream, split_reasoning

    rng = random.Random(seed)
    parser, opened, calls = rng.choice(["openai_gptoss", "qwen3", "deepseek_r1", "gemma4", "mistral", "granite"]), \
        rng.random() < 0.3, rng.random() < 0.5
    if parser == PARSER:
        text = harmony_written(rng)
    else:
        starts, ends, label = MARKERS[parser]
        start, end = rng.choice(starts), rng.choice(ends)
        text = rng.choice(["", start + label]) + "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 8))) + \
            rng.choice([end, ""]) + "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 8)))
    for _ in range(rng.randrange(1, 4)):
        at, kind, mutation = rng.randrange(len(text) + 1), rng.randrange(3), rng.choice(REASONING_MUTATIONS)
        text = text[:at] + (mutation if kind != 1 else "") + text[at + (0 if kind == 0 else rng.randrange(1, 4)):]
    reading = Reasoning(parser, opened, True, calls and parser == PARSER)
    result = []

    def both():
        stream = HarmonyStream(reading.calls, opened) if parser == PARSER else ReasoningStream(reading)
        got, at = ["", ""], 0
        while at < len(text):
            step = rng.randint(1, 8)
            got = [g + p for g, p in zip(got, stream.piece(text[at: at + step]))]
            at += step
        got = [g + p for g, p in zip(got, stream.end())]
        result.append((split_reasoning(reading, text), (got[0] or None, got[1] or None)))

    worker = threading.Thread(target=both, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert result, f"the reading of {text!r} under {parser} did not end"
    (reasoning, content), streamed = result[0]
    assert (reasoning or None, content or None) == streamed, text
