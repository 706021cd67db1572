"""JSON tool calls read as they are written, for streaming their arguments in pieces (tools.py's `ToolStream`).

A call is a JSON object `{"name": ..., KEY: {...}}` (KEY "parameters" in "required"'s list, "arguments" in
hermes' `<tool_call>`, either in Llama 3's and Phi-4-mini's), alone, in a list, or in a row with a separator between
(Llama 3's ";"): `CallScanner` takes the output a piece at a time, each character once, and tells for
each call its name, once its string is whole, and where its arguments' text begins and how far it reaches
(to its last character that is not space, so that what is given of it only grows). The arguments are the
text the model wrote, so that the pieces streamed put together are the whole answer's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_SPACE = " \t\n\r"


@dataclass
class FoundCall:
    """A call as far as it is written: `name` (None until its string is whole), its arguments' text from
    `start` (None until it begins) to `reach`, `closed` once the arguments' value is whole."""

    name: str | None = None
    start: int | None = None
    reach: int | None = None
    closed: bool = False
    key: str | None = None  # the key its arguments are under (the first of the scanner's keys it writes)
    named: bool = False  # whether its "name" key came (a second one breaks the reading)


class CallScanner:
    """Calls written as JSON objects (module docstring): one object (`listed` false) or a list of them; `key` the
    arguments' key (or keys: the first a call writes is its arguments); `separator`: the objects in a row with it
    between them, no brackets (Llama 3's ";"); `origin`: where they begin in the text. `feed` takes the text a
    piece at a time (`read`: the text so far, taken whole); `calls` holds what is found so far, its positions in
    the text. `broken` is set, and reading stops, where the text leaves that form (the whole text is then read as
    it is at the end), or a call writes its name or its arguments twice (which `json.loads` would read as the last
    of them, the stream having sent the first)."""

    def __init__(self, key: str | tuple[str, ...], listed: bool, separator: str | None = None, origin: int = 0):
        self.keys, self.level = (key,) if isinstance(key, str) else key, 2 if listed or separator else 1
        self.separator = separator
        self.text, self.calls, self.broken = "", [], False
        # where the calls begin in the text (`read`: a stream's whole output, the positions found in it)
        self._at, self._depth, self._string, self._escape, self._string_at = origin, int(bool(separator)), False, \
            False, 0
        # in a call's object: "key", "colon", "value", "scalar" (a number or literal), "after" (',' or '}');
        # between a list's calls: "item" ('{'), "sep" (',' or ']'), "done"
        self._expect, self._key = "item" if separator else "key", None  # the key whose value is read

    def feed(self, text: str) -> None:
        """Take the text's next piece."""
        self.read(self.text + text)

    def read(self, text: str, upto: int | None = None) -> None:
        """Take the text so far, to `upto` (its end): the text read before grown (a stream's whole output, taken
        as it is rather than copied piece by piece)."""
        self.text = text
        end = len(text) if upto is None else upto
        while self._at < end and not self.broken:
            self._step(self._at, text[self._at])
            self._at += 1

    def arguments(self, call: FoundCall) -> str:
        """A call's arguments as far as they are written."""
        return "" if call.start is None else self.text[call.start: call.reach]

    def _step(self, i: int, c: str) -> None:
        call = self.calls[-1] if self.calls else None
        reading = call is not None and call.start is not None and not call.closed and self._key == call.key
        if self._string:
            if reading:
                call.reach = i + 1
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._string = False
                if self._depth == self.level:
                    self._string_read(i, call)
            return
        if self._expect == "scalar" and self._depth == self.level:
            if c not in _SPACE + ",}":
                call.reach = i + 1 if reading else call.reach
                return
            self._value_read(call)
        if c in _SPACE:
            return
        if self._depth < self.level:
            self._between_calls(c)
        elif self._depth > self.level:
            call.reach = i + 1 if reading else call.reach
            self._nested(c, call)
        elif self._expect == "value":
            self._value_begins(i, c, call)
        else:
            self._punctuation(c)

    def _between_calls(self, c: str) -> None:
        """Outside the calls: a list's brackets and commas (listed) or the separators of a row, else the one call's
        opening."""
        item = self._depth == self.level - 1 and (self.level == 2 and self._expect == "item" or not self.calls)
        if c == "{" and item:
            self._depth += 1
            self.calls.append(FoundCall())
            self._expect, self._key = "key", None
        elif self.level == 2 and c == "[" and self._depth == 0 and not self.calls:
            self._depth, self._expect = 1, "item"
        elif self.level == 2 and self._depth == 1 and c == (self.separator or ",") and self._expect == "sep":
            self._expect = "item"
        elif self.level == 2 and self._depth == 1 and c == "]" and not self.separator and \
                (self._expect == "sep" or not self.calls):
            self._depth, self._expect = 0, "done"
        else:
            self.broken = True

    def _value_begins(self, i: int, c: str, call: FoundCall) -> None:
        if self._key in self.keys and call.key is None:
            call.start, call.reach, call.key = i, i + 1, self._key
        if c == '"':
            self._string, self._string_at = True, i
        elif c in "{[":
            self._depth += 1
        else:
            self._expect = "scalar"
            return
        self._expect = "after" if c in "{[" else "value"

    def _nested(self, c: str, call: FoundCall) -> None:
        """A character inside a value's object or list."""
        if c == '"':
            self._string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == self.level:
                self._value_read(call)

    def _punctuation(self, c: str) -> None:
        """A character between a call's keys and values."""
        if self._expect == "key" and c == '"':
            self._string, self._string_at = True, self._at
        elif self._expect == "colon" and c == ":":
            self._expect = "value"
        elif self._expect in ("after", "key") and c == "}":
            self._depth, self._expect = self._depth - 1, "sep"
        elif self._expect == "after" and c == ",":
            self._expect, self._key = "key", None
        else:
            self.broken = True

    def _string_read(self, i: int, call: FoundCall) -> None:
        """A string at a call's level ends: a key, or a value (the name's)."""
        try:
            value = json.loads(self.text[self._string_at: i + 1])
        except ValueError:
            self.broken = True
            return
        if self._expect == "key":
            if value == "name" and call.named or value == call.key:  # json.loads would take the last: not a call
                self.broken = True
            self._key, self._expect = value, "colon"
            call.named = call.named or value == "name"
            return
        if self._key == "name" and isinstance(value, str):
            call.name = value
        self._value_read(call)

    def _value_read(self, call: FoundCall) -> None:
        self._expect = "after"
        if self._key == call.key:
            call.closed = True
