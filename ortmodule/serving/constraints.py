"""Structured output: a row's tokens kept within a grammar, as vLLM's and SGLang's structured outputs keep
them, with llguidance (the `serve` extra installs it): at each step the tokens the grammar cannot take next
are masked before the choice (greedy or sampled), and the row ends where the grammar is complete.

The forms a completions, chat or responses request takes (one a request):
- OpenAI's `response_format`: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema",
  "json_schema": {"schema": {...}}}` (the Responses API's `text.format`, flattened, is turned into this);
  `{"type": "text"}` is none.
- vLLM's `structured_outputs`: one of `json` (a schema, or its JSON text), `regex`, `choice` (a list of
  strings: the output is one of them), `grammar` (a Lark grammar, llguidance's dialect, or an EBNF one in
  llama.cpp's GBNF form, `root ::= ...`, as vLLM's examples write them: turned into Lark), `json_object`
  true; and its older fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. Its option
  `disable_any_whitespace` (true: JSON without whitespace between its tokens; by default any, as in vLLM)
  applies to the JSON forms, and to a chat request's `tool_choice` (tools.py), where it may come alone.
- SGLang's `regex`, `json_schema` (the schema's JSON text) and `ebnf` (an EBNF grammar, as `grammar` takes it).
- A structural tag (`response_format` `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
  "triggers": [...]}`, vLLM's `structured_outputs.structural_tag` and SGLang's `structural_tag`, its JSON text):
  free text, where each structure's `begin` (after one of the triggers it starts with) is followed by JSON of
  its schema and its `end`, by llguidance's `StructTag`; xgrammar's newer `format` form is refused.
A form that does not compile (a bad regex, schema or grammar) is a 400 naming its field, with
llguidance's reason; so is a form this server does not carry out.
On a server with a reasoning parser (reasoning.py) a chat request's grammar holds the answer after the model's
thinking, which stays free (`thinking_first`), as vLLM starts the grammar where the reasoning ends.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field

import torch

from .errors import ServingError
from .reasoning import Reasoning

# The fields that ask for structured output, and the values that ask for none.
FORMS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
         "regex", "json_schema", "ebnf", "structural_tag")
NONE = (None, {}, {"type": "text"})
# vLLM's options of structured_outputs, beside a form (or alone, for tool_choice's schema): no whitespace in JSON.
OPTIONS = {"disable_any_whitespace"}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Constraint:
    """A request's grammar (llguidance's form), compiled once when the request is checked; each row matches
    its tokens with a copy of the compiled matcher."""

    grammar: str
    matcher: object = field(compare=False, hash=False, repr=False)

    def new_matcher(self):
        return self.matcher.deep_copy()


def constraint_of(served, body, tool_schema: dict | None = None, reasoning: Reasoning | None = None) \
        -> Constraint | None:
    """The structured output a request asks for (module docstring), or `tool_schema` (the JSON schema a
    chat request's `tool_choice` keeps its output to: tools.py), compiled against the served tokenizer, after
    the thinking `reasoning` reads (where the server has a reasoning parser); None where it asks for none."""
    extra = getattr(body, "model_extra", None) or {}
    values = [(name, getattr(body, name, None) if name in type(body).model_fields else extra.get(name))
              for name in FORMS]
    compact = served.settings.disable_any_whitespace  # the server's default (vLLM's option of that name)
    for i, (name, value) in enumerate(values):
        if name == "structured_outputs" and isinstance(value, dict) and OPTIONS & value.keys():
            compact = value.get("disable_any_whitespace", compact)
            if not isinstance(compact, bool):
                raise ServingError("structured_outputs.disable_any_whitespace must be true or false", name)
            values[i] = (name, {k: v for k, v in value.items() if k not in OPTIONS})
    given = [(name, value) for name, value in values
             if not any(value == none and type(value) is type(none) for none in NONE)]
    if tool_schema is not None:
        if given:
            raise ServingError(f"tool_choice {body.tool_choice!r} and {given[0][0]} both keep the output to a "
                               "grammar: send one", given[0][0])
        given = [("tool_choice", tool_schema)]
    if not given:
        return None
    if len(given) > 1:
        raise ServingError(f"{given[0][0]} and {given[1][0]} both ask for structured output: send one", given[1][0])
    name, value = given[0]
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ServingError(f"{name}: structured output needs the llguidance package, which this server's "
                           "environment lacks (pip install 'ortmodule[serve]')", name, 501) from None
    view = grammar_tokenizer(served)
    specials = _added_special(served, view)
    grammar = _grammar(name, value, compact, specials)
    if reasoning is not None:
        grammar = thinking_first(grammar, reasoning, specials)
    matcher = LLMatcher(view, grammar, log_level=0)
    if matcher.is_error():
        raise ServingError(f"{name}: {matcher.get_error()}", name)
    return Constraint(grammar, matcher)


def _grammar(name: str, value, compact: bool = False, specials: frozenset[str] = frozenset()) -> str:
    """llguidance's grammar for a form (module docstring), or the 400 that names what is wrong with it;
    `specials`: the tokenizer's added tokens, which llguidance reads as special tokens (structural tags)."""
    from llguidance import LLMatcher

    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return _schema(name, {"type": "object"}, compact)
        if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
            return _schema(name, value["json_schema"].get("schema", {"type": "object"}), compact)
        if kind == "structural_tag":
            return _structural_tag(name, value, specials)
        raise ServingError(f"response_format {value!r} is not supported: send type 'text', 'json_object', "
                           "'json_schema' with a json_schema object, or 'structural_tag'", name)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise ServingError("structured_outputs must be an object", name)
        asked = {k: v for k, v in value.items() if v not in (None, False)}
        kinds = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                 "grammar": "guided_grammar", "structural_tag": "structural_tag", "json_object": None}
        if len(asked) != 1 or next(iter(asked)) not in kinds:
            raise ServingError(f"structured_outputs takes one of {', '.join(kinds)}; got {sorted(asked) or 'none'}",
                               name)
        (kind, inner), = asked.items()
        if kind == "json_object":
            return _schema(name, {"type": "object"}, compact)
        try:
            return _grammar(kinds[kind], inner, compact, specials)
        except ServingError as e:  # named as the request wrote it
            raise ServingError(str(e).replace(kinds[kind], f"{name}.{kind}", 1), name, e.status, e.code) from None
    if name in ("guided_json", "json_schema", "tool_choice"):
        return _schema(name, value, compact)
    if name in ("guided_regex", "regex") and isinstance(value, str):
        return LLMatcher.grammar_from_regex(value)
    if name == "guided_choice" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return LLMatcher.grammar_from_regex("|".join(f"({_literal(v)})" for v in value))
    if name in ("guided_grammar", "ebnf") and isinstance(value, str):
        return LLMatcher.grammar_from_lark(_lark(name, value))
    if name == "structural_tag":
        return _structural_tag(name, value, specials)
    raise ServingError(f"{name} must be " + {"guided_choice": "a non-empty list of strings"}.get(name, "a string"),
                       name)


def _structural_tag(name: str, value, specials: frozenset[str]) -> str:
    """A structural tag (module docstring; the object or its JSON text) as llguidance's `StructTag` grammar. Its
    triggers of the form `<...>` are tokens where each such one is an added token of the tokenizer (`specials`:
    Qwen's `<tool_call>`, Llama's `<|python_tag|>`), else text."""
    from llguidance import LLMatcher, StructTag

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ServingError(f"{name}: the structural tag is not JSON ({e})", name) from None
    if not isinstance(value, dict) or "format" in value:
        raise ServingError(f"{name}: a structural tag is {{'structures': [{{'begin', 'schema', 'end'}}, ...], "
                           "'triggers': [...]}} (xgrammar's 'format' form is not supported)", name)
    structures, triggers = value.get("structures"), value.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):
        raise ServingError(f"{name}: a structural tag needs a non-empty list of structures and of triggers "
                           "(non-empty strings)", name)
    tags = []
    for i, structure in enumerate(structures):
        begin, end = (structure.get(k) if isinstance(structure, dict) else None for k in ("begin", "end"))
        if not (isinstance(begin, str) and isinstance(end, str) and isinstance(structure.get("schema"), dict)):
            raise ServingError(f"{name}: structures[{i}] needs a string begin and end and a JSON schema object", name)
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ServingError(f"{name}: structures[{i}].begin {begin!r} starts with none of the triggers", name)
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=structure["schema"], end=end))
    tokens = [t for t in triggers if t.startswith("<") and t.endswith(">")]
    grammar = StructTag.to_grammar(tags, assume_special=bool(tokens) and all(t in specials for t in tokens))
    return grammar if grammar.lstrip().startswith("{") else LLMatcher.grammar_from_lark(grammar)


def _added_special(served, view) -> frozenset[str]:
    """The served tokenizer's added tokens that llguidance's `view` reads as special tokens (every added one)."""
    added = served.tokenizer.get_added_vocab() if hasattr(served.tokenizer, "get_added_vocab") else {}
    return frozenset(t for t, i in added.items() if i < served.vocab and view.is_special_token(i))


def _lark(name: str, grammar: str) -> str:
    """A grammar in Lark (llguidance's dialect), as given, or turned into it from llama.cpp's GBNF (`root ::=
    ...`, the EBNF that vLLM's examples and SGLang's `ebnf` write), by llguidance's converter."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if "::=" not in grammar or is_lark_syntax(grammar):
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # noqa: BLE001 (the converter raises a bare Exception for a rule it cannot find)
        raise ServingError(f"{name}: not a grammar in Lark or EBNF (GBNF) form: {e}", name) from None


def _schema(name: str, schema, compact: bool = False) -> str:
    """llguidance's grammar of a JSON schema (given as an object or its JSON text); `compact`: no whitespace
    between the JSON's tokens (vLLM's `disable_any_whitespace`), else any, as vLLM allows by default."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ServingError(f"{name}: the schema is not JSON ({e})", name) from None
    if not isinstance(schema, dict):
        raise ServingError(f"{name}: a JSON schema is an object, got {type(schema).__name__}", name)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact})
    except ValueError as e:
        raise ServingError(f"{name}: {e}", name) from None


def thinking_first(grammar: str, reading: Reasoning, tokens: set[str] = frozenset()) -> str:
    """llguidance's grammar of a thinking model's output: its thinking, any bytes to `</think>` (the `reading`'s
    markers: Gemma 4's `<|channel>` and `<channel|>`; either of Granite's words), then `grammar`'s answer (nested:
    llguidance's `TopLevelGrammar` of its grammars, or a Lark text); or the thinking alone, where the model ends its
    output inside it (as vLLM's grammar, which starts where the reasoning ends, lets it). The thinking comes from
    the first token where the reading's `from_start` (a `<think>` the model writes first taken), else only where the
    output opens with `<think>`. `tokens`: the tokenizer's tokens which llguidance counts special (added tokens:
    Qwen3's `<think>`, harmony's `<|channel|>`), written in Lark as tokens where a marker holds them, the rest of it
    as text; an end that is text alone ends the thinking at its first occurrence. The thinking takes any bytes but a
    special token's (0xFF, which begins them in llguidance), invalid UTF-8 too, as free as without a grammar."""
    try:
        nested = json.loads(grammar)["grammars"]
    except (ValueError, TypeError, KeyError):
        nested = [{"lark_grammar": grammar}]
    ends = reading.ends
    opening = " | ".join(_marker(start, tokens) for start in reading.starts)
    opening = f"({opening})" if len(reading.starts) > 1 else opening
    free = "/(?s-u:[\\x00-\\xfe]*)/"
    if len(ends) == 1 and any(ends[0].startswith(t) for t in tokens):  # the thinking's bytes cannot hold its first
        body, rules = f"THINKING ({_marker(ends[0], tokens)} @answer)?", f"THINKING: {free}"
    else:  # the thinking to the first text of an end, or without one to the output's end
        either = "(?:" + "|".join(_literal(end) for end in ends) + ")"
        suffix = json.dumps(ends[0]) if len(ends) == 1 else f"/{either}/"
        body = "(thinking @answer | UNFINISHED)"
        rules = (f"thinking[suffix={suffix}]: {free}\n"
                 f"UNFINISHED: {free} & ~/(?s-u:[\\x00-\\xfe]*{either}[\\x00-\\xfe]*)/")
    start_rule = f"{opening}? {body}" if reading.from_start else f"{opening} {body} | @answer"
    lark = f'%llguidance {{"allow_invalid_utf8": true}}\nstart: {start_rule}\n{rules}\n'
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**nested[0], "name": "answer"}, *nested[1:]]})


def _marker(text: str, tokens: set[str]) -> str:
    """A marker in Lark: the special tokens it holds (of `tokens`) as tokens, the text between as strings (harmony's
    `<|channel|>analysis<|message|>`: a token, a word, a token)."""
    held = sorted((t for t in tokens if t in text), key=len, reverse=True)
    if not held:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(map(re.escape, held)) + ")", text)
    return " ".join(p if p in held else json.dumps(p) for p in pieces if p)


def _literal(text: str) -> str:
    """`text` as a regex that matches it alone: every character but letters and digits escaped by its code."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def grammar_tokenizer(served):
    """llguidance's view of the served tokenizer (about a second to build for a 50,000-token vocabulary):
    built at the first request that asks for structured output, then kept."""
    with _LOCK:
        if served.grammar_view is None:
            import llguidance.hf

            served.grammar_view = llguidance.hf.from_tokenizer(served.tokenizer, n_vocab=served.vocab)
        return served.grammar_view


def mask(matcher, logits: torch.Tensor) -> torch.Tensor:
    """`[1, V]` logits with the tokens the grammar cannot take next at -inf (unchanged where it takes none:
    a matcher in error, whose row then ends)."""
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
    allowed[: min(len(bias), len(allowed))] = bias[: len(allowed)] > 0
    if not allowed.any():
        return logits
    return logits.masked_fill(~allowed.to(logits.device)[None], float("-inf"))
