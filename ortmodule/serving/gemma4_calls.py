"""Gemma 4's tool calls, as vLLM's `gemma4` parser reads them (tools.py's `--tool-call-parser gemma4`).

Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>`, its own serialization rather than
JSON: keys bare, a string between two `<|"|>`, objects in braces, lists in brackets, and bare values (`true`,
`false`, numbers: with a point a float, else an integer) else kept as text. `arguments` reads one call's
`key:value,...` into the object it stands for; it never fails (text out of that form is read as far as it
goes, as vLLM's parser reads it). `Reading` finds a stream's calls as each one closes, as `CALL.findall` finds them
in the whole text.
"""

from __future__ import annotations

import json
import re

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL = re.compile(r"<\|tool_call>call:([\w\-.]+)\{(.*?)\}<tool_call\|>", re.DOTALL)
_SPACE = " \n\t"


class Reading:
    """A stream's calls, each read once its `}<tool_call|>` has come (`read`: the text so far), as `CALL.findall`
    reads them in the whole output; each character looked at once for the markers."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []  # each call's name and arguments as JSON
        self.at = self.looked = 0  # where the next call is looked for; how far its end was

    def read(self, text: str) -> list[tuple[str, str, int, int]]:
        """Each call so far: its name, its arguments as JSON, and their span (the whole text of them)."""
        while (start := text.find(START, self.at)) >= 0:
            end = text.find("}" + END, max(start, self.looked))
            if end < 0:  # the call is still being written
                self.at, self.looked = start, max(start, len(text) - len(END))
                break
            found = CALL.match(text, start)
            if found is None:  # not a call: the text goes on after its marker's first character, as findall's
                self.at = start + 1
                continue
            self.calls.append((found.group(1), json.dumps(arguments(found.group(2)), ensure_ascii=False)))
            self.at = self.looked = found.end()
        else:
            self.at = max(self.at, len(text) - len(START) + 1)
        return [(name, found, 0, len(found)) for name, found in self.calls]


def arguments(text: str) -> dict:
    """A call's `key:value,...` (what its braces hold) as an object."""
    return _Reader(text).members(None)


class _Reader:
    def __init__(self, text: str):
        self.text, self.at = text, 0

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
            bare = not self.text.startswith((QUOTE, "{", "["), self.at)
            item = self.value(",]")
            if not bare or self.at < len(self.text):
                found.append(item)

    def value(self, stops: str) -> object:
        """A value from where the reading stands: a string, an object, a list, else the bare text up to one of
        `stops` (at least a character, so that every call moves on)."""
        text = self.text
        if text.startswith(QUOTE, self.at):
            start = self.at + len(QUOTE)
            end = text.find(QUOTE, start)
            end = len(text) if end < 0 else end
            self.at = end + len(QUOTE)
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
