"""Python calls (tools.py's `pythonic` and `lfm2` parsers, as vLLM's parsers of those names read them), whole or
as they are written.

- `pythonic` (Llama 3.2's and Llama 4's calls): the whole output a Python list of calls with keyword arguments of
  literal values, `[f(a=1), g(b="x")]` (Llama 4's `<|python_start|>`...`<|python_end|>` around it taken);
- `lfm2` (LFM2's and LFM2.5's): the same list between `<|tool_call_start|>` and `<|tool_call_end|>` (to the end
  where that never comes), the text before and after it the content.
A call's arguments are its keywords' values as a JSON object (`json.dumps`), not the text the model wrote, so a
stream sends them as that JSON grows: `PythonReading` reads the list as it is written, each keyword's value once it
is whole (a value that is a string as its characters come), so that the pieces put together are the whole
answer's arguments.
"""

from __future__ import annotations

import ast
import bisect
import json
import keyword
import re
import unicodedata

from .text import safe_before

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
LFM2_START, LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"
NOT_YET = -1  # `PythonReading.origin`: where the calls begin is not known yet
_NAME = re.compile(r"[^\W\d]\w*")
_SPACE = " \t\r\n\f"
_IN_VALUE = re.compile(r"""[\[\](){}'"#,\\]""")  # what a value's scan stops at outside its strings
_IN_STRING = {(q, triple): re.compile("[\\\\" + q + ("" if triple else "\n") + "]") for q in "'\"" for triple in
              (False, True)}
_STREAMED_PREFIXES = ("", "r", "u", "R", "U")  # string values sent as they come (not bytes, not f-strings)
_LONGEST_ESCAPE = 10  # `\U0001f600`


def pythonic(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """Llama 3.2's and Llama 4's calls: the whole output a Python list of calls (Llama 4's tags around it)."""
    inner = text.removeprefix(PYTHON_START).removesuffix(PYTHON_END) if text.startswith(PYTHON_START) else text
    if not re.fullmatch(r"\[.*\]", inner, re.DOTALL):  # the whole output a list, as a stream holds it
        return text, None
    return None, python_calls(inner)


def lfm2(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """LFM2's calls: a Python list of calls between its markers (to the end where the end never comes); the text
    before and after it the content (after the last `<|tool_call_end|>`: LFM2 may write the calls again)."""
    at = text.find(LFM2_START)
    if at < 0:
        return text, None
    inner, _, after = text[at + len(LFM2_START):].partition(LFM2_END)
    content = text[:at] + after[after.rfind(LFM2_END) + len(LFM2_END):] if LFM2_END in after else \
        text[:at] + after
    return content or None, python_calls(inner)


def python_calls(text: str) -> list[tuple[str, str]]:
    """A Python list of calls `[f(a=1), g(b="x")]`: each call's name and its keyword arguments (literal values)
    as JSON; a ValueError (or SyntaxError, TypeError) where it is not one (a keyword given twice included, which
    Python refuses too)."""
    listed = ast.parse(text.strip(), mode="eval").body
    if not isinstance(listed, ast.List) or not listed.elts:
        raise ValueError("not a list of calls")
    calls = []
    for call in listed.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args or \
                any(k.arg is None for k in call.keywords):
            raise ValueError("a call is a function's name with keyword arguments")
        arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        if len(arguments) < len(call.keywords):
            raise ValueError("a keyword argument repeated")
        calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _identifier(text: str) -> str | None:
    """A name as Python's parser takes it (NFKC-normalized), None where it is not one (a keyword)."""
    name = unicodedata.normalize("NFKC", text) if not text.isascii() else text
    return name if name.isidentifier() and not keyword.iskeyword(name) else None


def _after_space(text: str, at: int, limit: int) -> int | None:
    """Where the next character that is neither space nor a comment is, None where the text so far ends first."""
    while at < limit:
        if text[at] in _SPACE:
            at += 1
        elif text[at] == "#":
            end = text.find("\n", at, limit)
            if end < 0:
                return None
            at = end + 1
        else:
            return at
    return None


def _string_cut(text: str, start: int, end: int, quote: str) -> int:
    """How far a string's characters from `start` (where an escape begins or ends) to `end` decode on their own as
    they will within the whole string: before a backslash that may begin an escape still growing (octal digits,
    a line continued), a carriage return that may be half of a line break, quotes that may close the string."""
    last = text.rfind("\\", max(start, end - _LONGEST_ESCAPE), end)
    if last >= 0:
        while last > start and text[last - 1] == "\\":
            last -= 1
        end = last
    while end > start and text[end - 1] in ("\r", quote):
        end -= 1
    return end


class _Text:
    """A text that only grows, kept in the pieces it grew by, whose tail is read without joining it whole."""

    def __init__(self, first: str):
        self.parts, self.ends = [first], [len(first)]  # each piece and where it ends

    def add(self, more: str) -> None:
        if more:
            self.parts.append(more)
            self.ends.append(self.ends[-1] + len(more))

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, span: slice) -> str:
        start, stop, _ = span.indices(len(self))
        k = bisect.bisect_right(self.ends, start)
        found, at = [], self.ends[k - 1] if k else 0
        while k < len(self.parts) and at < stop:
            found.append(self.parts[k][max(0, start - at): stop - at])
            at = self.ends[k]
            k += 1
        return "".join(found)


class _Call:
    """One call as far as it is read: its name, its arguments' JSON as far as it is sent (its `{`, each keyword's
    `"key": value` once whole, or a string value's as its characters come; its `}` once its `)` came), the keywords
    taken, where the pair being written begins (None: none)."""

    def __init__(self, name: str):
        self.name, self.text, self.keys, self.pair = name, _Text("{"), set(), None

    def begin_pair(self, key: str, value: str) -> None:
        """The pair of `key` begun, its value's JSON so far `value`."""
        self.pair = len(self.text)
        self.text.add((", " if self.keys else "") + json.dumps(key, ensure_ascii=False) + ": " + value)

    def end_pair(self, key: str, value: str) -> bool:
        """The pair of `key` whole, its value's JSON `value`; False where it does not continue what was sent."""
        pair = (", " if self.keys else "") + json.dumps(key, ensure_ascii=False) + ": " + value
        sent = self.text[self.pair:] if self.pair is not None else ""
        if not pair.startswith(sent):
            return False
        self.text.add(pair[len(sent):])
        self.keys.add(key)
        self.pair = None
        return True


class PythonReading:
    """One stream's Python calls read as the output grows (`read`): where the list begins, found once, then each
    character scanned once (a name, a keyword's `=` or a quote that may still grow waits for the next piece), a
    keyword's value taken whole at its `,` or `)` (`ast.literal_eval`, as the whole answer takes it), a string
    value sent as it comes. A form the whole answer would not read as calls stops the reading: what was sent
    stays sent (as vLLM's streams), the whole answer decides the rest."""

    def __init__(self, parser: str):
        self.parser, self.origin, self.looked = parser, NOT_YET, 0
        self.at, self.state = 0, "open"  # open, call, key, value, after, done, broken
        self.calls: list[_Call] = []
        # the value being read: its keyword, where it begins, its brackets open, the string it is in (its quote),
        # where its first string's characters begin while it is in that string (streamed), that string's prefix
        self.key, self.begin, self.depth, self.quote, self.streamed, self.prefix = None, 0, [], None, None, ""

    def read(self, text: str) -> list[tuple[str | None, str, int, int]]:
        """Each call so far: its name (None until its arguments have begun), the text of its arguments so far,
        where they begin (0) and how far they reach."""
        if self.origin == NOT_YET:
            self.origin = self._origin(text)
            self.at = self.origin if self.origin not in (None, NOT_YET) else 0
        if self.origin is None or self.origin == NOT_YET:
            return []
        limit = len(text)
        if self.parser == "lfm2":  # the list ends at the first end marker, as the whole answer reads it
            limit = safe_before(text, LFM2_END, max(self.origin, self.at - len(LFM2_END)))
        while self.at < limit and self.state not in ("done", "broken"):
            if not getattr(self, "_" + self.state)(text, limit):
                break
        if self.state == "value" and self.streamed is not None:
            self._stream_string(text, self.at)
        return [(c.name if len(c.text) > 1 else None, c.text, 0, len(c.text)) for c in self.calls]

    def _origin(self, text: str) -> int | None:
        """Where the list may begin: NOT_YET while unknown, None where the output is not calls."""
        if self.parser == "lfm2":
            at = text.find(LFM2_START, self.looked)
            if at < 0:
                self.looked = max(self.looked, len(text) - len(LFM2_START) + 1)
                return NOT_YET
            return at + len(LFM2_START)
        if text.startswith(PYTHON_START):
            return len(PYTHON_START)
        if text.startswith("["):
            return 0
        return NOT_YET if PYTHON_START.startswith(text) else None

    def _open(self, text: str, limit: int) -> bool:
        at = self.at if self.parser == "pythonic" else _after_space(text, self.at, limit)  # pythonic: "[" first
        if at is None:
            return False
        self.at, self.state = at + 1, "call" if text[at] == "[" else "broken"
        return True

    def _call(self, text: str, limit: int) -> bool:
        """A call's name and its `(`, or the list's `]` after a call."""
        at = _after_space(text, self.at, limit)
        if at is None:
            return False
        if text[at] == "]" and self.calls:
            self.at, self.state = at + 1, "done"
            return True
        found = _NAME.match(text, at, limit)
        opening = None if found is None or found.end() == limit else _after_space(text, found.end(), limit)
        if found is not None and (found.end() == limit or opening is None):
            return False  # the name or what follows it may still grow
        name = _identifier(found.group()) if found is not None else None
        if name is None or text[opening] != "(":
            self.state = "broken"
            return True
        self.calls.append(_Call(name))
        self.at, self.state = opening + 1, "key"
        return True

    def _key(self, text: str, limit: int) -> bool:
        """A keyword and its `=`, or the call's `)`."""
        at = _after_space(text, self.at, limit)
        if at is None:
            return False
        call = self.calls[-1]
        if text[at] == ")":
            call.text.add("}")
            self.at, self.state = at + 1, "after"
            return True
        found = _NAME.match(text, at, limit)
        equals = None if found is None or found.end() == limit else _after_space(text, found.end(), limit)
        if found is not None and (equals is None or equals + 1 >= limit):
            return False  # the keyword may still grow, or "=" become "=="
        key = _identifier(found.group()) if found is not None else None
        if key is None or key in call.keys or text[equals] != "=" or text[equals + 1] == "=":
            self.state = "broken"
            return True
        self.key, self.begin, self.at, self.state = key, equals + 1, equals + 1, "value"
        self.depth, self.quote, self.streamed, self.prefix = [], None, None, ""
        return True

    def _after(self, text: str, limit: int) -> bool:
        """A `,` before the next call, or the list's `]`."""
        at = _after_space(text, self.at, limit)
        if at is None:
            return False
        self.at, self.state = at + 1, {",": "call", "]": "done"}.get(text[at], "broken")
        return True

    def _value(self, text: str, limit: int) -> bool:
        """A keyword's value up to its `,` or the call's `)` outside its brackets and strings, then taken whole."""
        at = self.at
        while at < limit:
            if self.quote is not None:
                at = self._in_string(text, at, limit)
                if at is None:
                    return False
                continue
            found = _IN_VALUE.search(text, at, limit)
            if found is None:
                self.at = limit
                return False
            c, at = found.group(), found.start()
            if c in "'\"":
                at = self._opening(text, at, limit)
                if at is None:
                    return False
            elif c == "#":
                end = text.find("\n", at, limit)
                if end < 0:
                    self.at = at
                    return False
                at = end + 1
            elif c in "([{":
                self.depth.append(c)
                at += 1
            elif c in ",)" and not self.depth:
                self._argument(text[self.begin: at], closes=c == ")")
                self.at = at + 1
                return True
            elif c == "\\" or c in ")]}" and (not self.depth or self.depth.pop() + c not in ("()", "[]", "{}")):
                self.state = "broken"  # a line continued outside a string, a bracket closed that was not open
                return True
            else:
                at += 1
        self.at = at
        return False

    def _opening(self, text: str, at: int, limit: int) -> int | None:
        """A string opened at `at`: where its characters begin (its quote kept), None where its quote may still be
        a triple one; a value's first string is streamed."""
        c = text[at]
        if at + 3 > limit and text[at:limit] == c * (limit - at):
            self.at = at
            return None
        triple = text.startswith(c * 3, at)
        if not triple and text.startswith(c * 2, at):
            return at + 2  # an empty string
        self.quote = (c, triple)
        start = at + (3 if triple else 1)
        before = text[self.begin: at].strip(_SPACE)
        if not self.depth and before in _STREAMED_PREFIXES:
            self.streamed, self.prefix = start, before
            self.calls[-1].begin_pair(self.key, '"')
        return start

    def _in_string(self, text: str, at: int, limit: int) -> int | None:
        """Past the string's characters from `at`: where it closes, None where the text so far ends in it."""
        quote, triple = self.quote
        while True:
            found = _IN_STRING[self.quote].search(text, at, limit)
            if found is None:
                self.at = limit
                return None
            at = found.start()
            if found.group() == "\\":
                if at + 1 >= limit:
                    self.at = at
                    return None
                at += 2
            elif found.group() == "\n":
                self.at, self.state = at, "broken"
                return None
            elif not triple:
                break
            elif text.startswith(quote * 3, at):
                at += 2
                break
            elif at + 3 > limit and text[at:limit] == quote * (limit - at):
                self.at = at
                return None
            else:
                at += 1
        if self.streamed is not None:
            self._stream_string(text, at - (2 if triple else 0))
            self.streamed = None
        self.quote = None
        return at + 1

    def _stream_string(self, text: str, end: int) -> None:
        """The value's first string's characters since the last piece (to `end`: its close, or where the scan
        stands) added to the call's text as JSON, as far as they decode as they will in the whole string."""
        quote, triple = self.quote
        quotes = quote * (3 if triple else 1)
        cut = _string_cut(text, self.streamed, end, quote)
        if cut <= self.streamed:
            return
        value = text[self.streamed: cut]
        if "\\" in value or "\r" in value:  # else the characters are the value's, raw or not
            try:
                value = ast.literal_eval(self.prefix + quotes + value + quotes)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return  # an escape that does not decode yet (a `\\N{...}` still open): with the next piece
        self.calls[-1].text.add(json.dumps(value, ensure_ascii=False)[1:-1])
        self.streamed = cut

    def _argument(self, segment: str, closes: bool) -> None:
        """A keyword's whole value (`segment`, its text) taken as the whole answer takes it, the call's `)` after it
        where it `closes`; where it is not a literal, or not the string sent so far, the reading stops."""
        call = self.calls[-1]
        try:
            if _after_space(segment, 0, len(segment)) is None:
                raise ValueError("no value")
            value = json.dumps(ast.literal_eval("(" + segment + "\n)"), ensure_ascii=False)  # as within the call
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.state = "broken"
            return
        if not call.end_pair(self.key, value):
            self.state = "broken"
            return
        if closes:
            call.text.add("}")
        self.state = "after" if closes else "key"
