"""JSON calls read as they are written (serving/json_calls.py), which the server's streams of "required"'s and
hermes' calls are made of: for outputs with strings that hold brackets and escapes, numbers, literals, nested
lists, space anywhere, the arguments' key before the name, fed a piece at a time and cut everywhere, each
call's arguments so far only grow, and put together they are the whole text's, which parse as `json.loads`
reads the call."""

import json

import pytest

from ortmodule.serving.json_calls import CallScanner

ARGUMENTS = ['{"s": "a}\\\\\\"{[, ]", "n": -1.5e3, "t": true, "l": [1, {"x": null}], "u": "\\u00e9"}',
             '{}', '[]', '"a text"', '12', 'null', '{ "deep" : { "deeper" : [ [ ] , { } ] } }']


def whole(text: str, key: str, listed: bool) -> list[tuple[str, str]]:
    scanner = CallScanner(key, listed)
    scanner.feed(text)
    assert not scanner.broken
    return [(c.name, scanner.arguments(c)) for c in scanner.calls if c.closed]


@pytest.mark.parametrize("arguments", ARGUMENTS)
@pytest.mark.parametrize("form", ["compact", "spaced", "arguments-first"])
def test_a_call_is_read_as_json_reads_it_at_every_cut(arguments, form):
    text = {"compact": f'{{"name":"get_x","arguments":{arguments}}}',
            "spaced": f'\n {{ "name" : "get_x" ,\n "arguments" :  {arguments}  \n}} ',
            "arguments-first": f'{{"arguments": {arguments}, "name": "get_x"}}'}[form]
    reference = json.loads(text)
    (name, found), = whole(text, "arguments", listed=False)
    assert (name, json.loads(found)) == (reference["name"], reference["arguments"]) and found in text
    for cut in range(len(text) + 1):
        scanner = CallScanner("arguments", listed=False)
        scanner.feed(text[:cut])
        so_far = [scanner.arguments(c) for c in scanner.calls]
        scanner.feed(text[cut:])
        assert all(found.startswith(piece) for piece in so_far), cut
        assert [scanner.arguments(c) for c in scanner.calls] == [found] and not scanner.broken


def test_a_list_of_calls_is_read_in_turn():
    calls = [("get_x", ARGUMENTS[0]), ("get_y", "{}"), ("get_x", '{"a": [1, 2, {"b": "]}"}]}')]
    text = " [ " + " , ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls) + " ] "
    assert whole(text, "parameters", listed=True) == calls
    assert [(c["name"], c["parameters"]) for c in json.loads(text)] == [(n, json.loads(a)) for n, a in calls]
    scanner = CallScanner("parameters", listed=True)
    for i in range(0, len(text), 3):  # as a stream's pieces come
        scanner.feed(text[i:i + 3])
    assert [(c.name, scanner.arguments(c), c.closed) for c in scanner.calls] == [(n, a, True) for n, a in calls]


@pytest.mark.parametrize("text", ['hello', '{"name": "f" "arguments": {}}', '{"name": "f", 3: {}}',
                                  '[{"name": "f", "parameters": {}} {"name": "g"}]', '{"name": "f"} }',
                                  '{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}',
                                  '{"name": "f", "name": "g", "arguments": {}}',
                                  '{"name": "f", "arguments": {}, "arguments": {"a": 1}}'])
def test_text_that_leaves_the_form_stops_the_reading(text):
    """Text out of the form, and a call that writes its name or its arguments twice (`json.loads` reads the last of
    them, where a stream would have sent the first)."""
    scanner = CallScanner("parameters" if text.startswith("[") else "arguments", listed=text.startswith("["))
    scanner.feed(text)
    assert scanner.broken


def random_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 3.25, 1e-3, 12345678901234])
    if kind in (2, 3):  # strings with the characters a scanner could stumble on
        return "".join(rng.choice(['a', ' ', '"', '\\', '{', '}', '[', ']', ',', ':', '\n', 'é', '\u2028', '😀'])
                       for _ in range(rng.randrange(6)))
    if kind in (4, 5):
        return {"k" + str(i) + rng.choice(["", " ", '"']): random_value(rng, depth + 1)
                for i in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def written(rng, value) -> str:
    """`value` as a model may write it: JSON with any space between its tokens, escapes or not."""
    space = rng.choice(["", " ", "\n  ", "\t"])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]),
                      separators=(rng.choice([",", ", ", " ,"]) + space, rng.choice([":", ": ", " : "])))


@pytest.mark.parametrize("seed", range(300))
def test_random_calls_stream_as_their_whole_reading(seed):
    """Random lists of calls, their arguments any JSON value written with any spacing and escapes, fed in random
    pieces: each call's arguments so far only grow, and in the end they are the text the model wrote for them,
    which parses to the value (the server's "required" stream and whole answer both read this)."""
    import random

    rng = random.Random(seed)
    calls = [(f"tool_{rng.randrange(3)}", random_value(rng)) for _ in range(rng.randrange(1, 4))]
    parts = [f'{{"name": "{name}", "parameters": {written(rng, value)}}}' for name, value in calls]
    text = rng.choice(["", " ", "\n"]) + "[" + rng.choice([",", ", ", ",\n"]).join(parts) + "]"
    scanner, so_far, at = CallScanner("parameters", listed=True), {}, 0
    while at < len(text):
        step = rng.randrange(1, 8)
        scanner.feed(text[at: at + step])
        at += step
        for k, call in enumerate(scanner.calls):
            now = scanner.arguments(call)
            assert now.startswith(so_far.get(k, "")), (seed, k)
            so_far[k] = now
    assert not scanner.broken and all(c.closed for c in scanner.calls)
    found = [(c.name, scanner.arguments(c)) for c in scanner.calls]
    assert [(name, json.loads(arguments)) for name, arguments in found] == calls
    assert all(arguments in text for _, arguments in found)


@pytest.mark.parametrize("seed", range(200))
def test_random_llama3_phi4_mistral_and_granite_calls_stream_as_their_whole_answer(seed):
    """Random calls written in Llama 3's row (";" between), Phi-4-mini's `functools[...]`, Mistral's list and its
    v11 `name[ARGS]{...}` form, Granite's list, with any spacing and escapes, given to the server's tool stream in
    random pieces: the calls put together are the whole answer's, whose arguments parse to the values written
    (objects: what a model writes), and the content the same."""
    import random

    from test_tool_calling import auto_plan, gathered, streamed_in_pieces

    from ortmodule.serving.tools import read_calls

    rng = random.Random(seed)
    calls = [(f"tool_{rng.randrange(3)}", {"a": random_value(rng), "b" * rng.randrange(1, 3): random_value(rng)})
             for _ in range(rng.randrange(1, 4))]
    key = rng.choice(["arguments", "parameters"])
    objects = [f'{{"name": "{name}", "{key}": {written(rng, value)}}}' for name, value in calls]
    lead = rng.choice(["", "Sure. ", "a { b\n"])
    parser = rng.choice(["llama3_json", "phi4_mini_json", "mistral", "mistral11", "granite"])
    if parser == "granite":
        text = rng.choice(["", " ", "<|tool_call|>", "<tool_call>", "<|tool_call|><tool_call> "]) + "[" + \
            ", ".join(o.replace(key, "arguments") for o in objects) + "]" + rng.choice(["", "\n"])
        lead = ""
    elif parser == "llama3_json":
        text, lead = rng.choice(["", "<|python_tag|>"]) + rng.choice([";", " ;\n", "; "]).join(objects), ""
    elif parser == "phi4_mini_json":
        text = lead + "functools[" + ", ".join(objects) + "]"
    elif parser == "mistral":
        text = lead + "[TOOL_CALLS]" + rng.choice(["", " "]) + "[" + ",".join(o.replace(key, "arguments")
                                                                             for o in objects) + "]"
    else:
        text = lead + "".join(f"[TOOL_CALLS]{name}[ARGS]{written(rng, value)}" + rng.choice(["", "\n"])
                              for name, value in calls)
    plan = auto_plan("mistral" if parser == "mistral11" else parser)
    content, found = read_calls(plan, text)
    assert [(name, json.loads(arguments)) for name, arguments in found] == calls, (seed, text)
    assert content == (lead or None)
    sent = streamed_in_pieces(plan, text, rng)
    assert gathered(sent) == found and "".join(d.get("content", "") for d in sent) == lead, (seed, text)
