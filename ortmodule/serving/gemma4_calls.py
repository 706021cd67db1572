"""Gemma 4's and FunctionGemma's tool calls, as vLLM's `gemma4` and `functiongemma` parsers read them (tools.py's
`--tool-call-parser gemma4` and `functiongemma`).

Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>`, its own serialization rather than
JSON: keys bare, a string between two `<|"|>`, objects in braces, lists in brackets, and bare values (`true`,
`false`, numbers: with a point a float, else an integer) else kept as text. FunctionGemma (Gemma 3 270M tuned
for calls) writes the same between `<start_function_call>` and `<end_function_call>`, a string between two
`<escape>`s; a call never closed is read to the text's end, as vLLM's `functiongemma` reads it. Each is a `Form`.
`arguments` reads one call's `key:value,...` into the object it stands for; it never fails (text out of that form
is read as far as it goes, as vLLM's parser reads it). `Reading` finds a stream's calls as each one closes, as
`calls` finds them in the whole text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_SPACE = " \n\t"


@dataclass(frozen=True)
class Form:
    """How a model writes its calls: the markers around each (`start`, `end`), its strings' delimiter (`quote`);
    `unclosed`: whether a call whose end never comes is read to the text's end (FunctionGemma's, as vLLM reads it)."""

    start: str
    end: str
    quote: str
    unclosed: bool = False

    @cached_property
    def call(self) -> re.Pattern:
        """A closed call: its name and what its braces hold."""
        return re.compile(re.escape(self.start) + r"call:([\w\-.]+)\{(.*?)\}" + re.escape(self.end), re.DOTALL)

    def calls(self, text: str) -> list[tuple[str, str]]:
        """Each call in the whole `text`: its name and its arguments as JSON, as vLLM's parser finds them."""
        pattern = self.call.pattern
        if self.unclosed:  # the last call, never closed: to the end (a closing brace then one of what it holds)
            pattern += "|" + re.escape(self.start) + r"call:([\w\-.]+)\{(.*)"
        found = [(m[0] or m[2], m[1] or m[3]) if self.unclosed else m
                 for m in re.findall(pattern, text, flags=re.DOTALL)]
        return [(name, json.dumps(arguments(body, self.quote), ensure_ascii=False)) for name, body in found]


GEMMA4 = Form(START, END, QUOTE)
FUNCTIONGEMMA = Form("<start_function_call>", "<end_function_call>", "<escape>", unclosed=True)
FORMS = {"gemma4": GEMMA4, "functiongemma": FUNCTIONGEMMA}


class Reading:
    """A stream's calls, each read once its closing brace and end marker have come (`read`: the text so far), as
    `Form.calls` reads them in the whole output; each character looked at once for the markers."""

    def __init__(self, form: Form = GEMMA4):
        self.form, self.call = form, form.call
        self.calls: list[tuple[str, str]] = []  # each call's name and arguments as JSON
        self.at = self.looked = 0  # where the next call is looked for; how far its end was

    def read(self, text: str) -> list[tuple[str, str, int, int]]:
        """Each call so far: its name, its arguments as JSON, and their span (the whole text of them)."""
        form = self.form
        while (start := text.find(form.start, self.at)) >= 0:
            end = text.find("}" + form.end, max(start, self.looked))
            if end < 0:  # the call is still being written
                self.at, self.looked = start, max(start, len(text) - len(form.end))
                break
            found = self.call.match(text, start)
            if found is None:  # not a call: the text goes on after its marker's first character, as findall's
                self.at = start + 1
                continue
            self.calls.append((found.group(1), json.dumps(arguments(found.group(2), form.quote), ensure_ascii=False)))
            self.at = self.looked = found.end()
        else:
            self.at = max(self.at, len(text) - len(form.start) + 1)
        return [(name, found, 0, len(found)) for name, found in self.calls]


def arguments(text: str, quote: str = QUOTE) -> dict:
    """A call's `key:value,...` (what its braces hold) as an object, its strings between two `quote`s."""
    return _Reader(text, quote).members(None)


class _Reader:
    def __init__(self, text: str, quote: str):
        self.text, self.at, self.quote = text, 0, quote

    def _skip(self, also: str = "") -> None:
        while self.at < len(self.text) and self.text[self.at] in _SPACE + also:
            self.at += 1

    def members(self, closing: str | None) -> dict:
        """`key:value` pairs up to `closing` (None: the end), which is taken."""
        found = {}
        while True:
            self._skip(",")
            if self.at >= len(self.text) or self.text[self.at] == closing:
                self.at += 1
                return found
            colon = self.text.find(":", self.at)
            if colon < 0:
                self.at = len(self.text)
                return found
            key, self.at = self.text[self.at: colon].strip(), colon + 1
            self._skip()
            found[key] = self.value(",}]")

    def items(self) -> list:
        """A list's values up to its `]`, which is taken; a bare value is the text up to the next `,` or `]` (a `}`
        in it too), and one the text ends in while the list is open is left out, as vLLM's parser reads a list."""
        found = []
        while True:
            self._skip(",")
            if self.at >= len(self.text) or self.text[self.at] == "]":
                self.at += 1
                return found
            bare = not self.text.startswith((self.quote, "{", "["), self.at)
            item = self.value(",]")
            if not bare or self.at < len(self.text):
                found.append(item)

    def value(self, stops: str) -> object:
        """A value from where the reading stands: a string, an object, a list, else the bare text up to one of
        `stops` (at least a character, so that every call moves on)."""
        text, quote = self.text, self.quote
        if text.startswith(quote, self.at):
            start = self.at + len(quote)
            end = text.find(quote, start)
            end = len(text) if end < 0 else end
            self.at = end + len(quote)
            return text[start:end]
        if text.startswith("{", self.at):
            self.at += 1
            return self.members("}")
        if text.startswith("[", self.at):
            self.at += 1
            return self.items()
        start = self.at
        while self.at < len(text) and text[self.at] not in stops:
            self.at += 1
        return _bare(text[start: self.at].strip())


def _bare(value: str) -> object:
    if value in ("true", "false"):
        return value == "true"
    try:
        return float(value) if "." in value else int(value)
    except ValueError:
        return value
