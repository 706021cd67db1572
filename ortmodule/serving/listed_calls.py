"""Llama 3's, Phi-4-mini's and Mistral's tool calls (tools.py's `llama3_json`, `phi4_mini_json` and `mistral`
parsers, as vLLM's parsers of those names read them), whole or as they are written.

- `llama3_json`: output that starts with `<|python_tag|>` or `{`: calls `{"name", "parameters"}` (or
  "arguments") in a row, ";" between them;
- `phi4_mini_json`: `functools[{"name", "arguments"}, ...]` (or "parameters"), the text before it the content;
- `mistral`: after `[TOOL_CALLS]`, a JSON list of `{"name", "arguments"}` (its tokenizers before v11), or, from
  v11 on, `name[ARGS]{...}` after each `[TOOL_CALLS]`; the text before the first the content;
- `granite` (Granite 3.0's `<|tool_call|>`, Granite 3.1's `<tool_call>`): output that is a JSON list of
  `{"name", "arguments"}` after them (space around taken), else text.
Each call's arguments are the text the model wrote (json_calls.py's `CallScanner`: the first of the keys a call
writes), so that a stream's pieces put together are the whole answer's; a Mistral call without arguments has `{}`.
`ListedReading` reads a stream's output as it grows, each character once.
"""

from __future__ import annotations

import json

from .json_calls import CallScanner
from .text import safe_before

PYTHON_TAG, PHI4, MISTRAL = "<|python_tag|>", "functools[", "[TOOL_CALLS]"
GRANITE = ("<|tool_call|>", "<tool_call>")  # Granite 3.0's token, then 3.1's text, each taken where it opens
NOT_YET = -1  # `granite_origin`: the output may still become calls or text
_EITHER = ("arguments", "parameters")
_SPACE = " \t\n\r"


def _scanned(text: str, keys: tuple[str, ...], separator: str | None = None, missing: str | None = None) \
        -> list[tuple[str, str]]:
    """The calls' names and arguments as written, from `text` (JSON the caller checked): a list of them, or a row
    with `separator`; `missing`: the arguments of a call that has none (else a ValueError, as one without a name)."""
    scanner = CallScanner(keys, listed=True, separator=separator)
    scanner.feed(text)
    calls = []
    for call in scanner.calls:
        if scanner.broken or call.name is None or not call.closed and missing is None:
            raise ValueError("not calls")
        calls.append((call.name, scanner.arguments(call) if call.closed else missing))
    if not calls:
        raise ValueError("no calls")
    return calls


def phi4_mini_json(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    at = text.find(PHI4)
    if at < 0:
        return text, None
    begin = at + len(PHI4) - 1
    _, end = json.JSONDecoder().raw_decode(text, begin)
    return text[:at] or None, _scanned(text[begin:end], _EITHER)


def _llama3_origin(text: str) -> int | None:
    """Where Llama 3's calls begin (past `<|python_tag|>`), None where the output is not calls."""
    if text.startswith(PYTHON_TAG):
        return len(PYTHON_TAG)
    return 0 if text.startswith("{") else None


def llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    begin = _llama3_origin(text)
    if begin is None:
        return text, None
    decoder, at = json.JSONDecoder(), begin
    while True:  # each call JSON, ";" between them
        at = _skip_space(text, decoder.raw_decode(text, _skip_space(text, at))[1])
        if at == len(text):
            break
        if text[at] != ";":
            raise ValueError("calls not separated by ';'")
        at += 1
    return None, _scanned(text[begin:], _EITHER, separator=";")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def granite_origin(text: str) -> int | None:
    """Where Granite's list of calls begins (its `[`), None where the output is text, `NOT_YET` where it may still
    become either (space, or a beginning of its markers, so far)."""
    at = _skip_space(text, 0)
    for marker in GRANITE:
        if text.startswith(marker, at):
            at += len(marker)
        elif len(text) - at < len(marker) and marker.startswith(text[at:]):
            return NOT_YET
    at = _skip_space(text, at)
    if at == len(text):
        return NOT_YET
    return at if text[at] == "[" else None


def granite(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    origin = granite_origin(text)
    if origin is None or origin == NOT_YET:
        return text, None
    json.loads(text[origin:])  # the list alone, as vLLM reads it
    return None, _scanned(text[origin:], ("arguments",))


def mistral(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    if MISTRAL not in text:
        return text, None
    content, *raw = text.split(MISTRAL)
    begin = _skip_space(raw[0], 0)
    if raw[0].startswith("[", begin):  # before v11: one list
        if len(raw) != 1:
            raise ValueError("more than one [TOOL_CALLS] before a list of calls")
        _, end = json.JSONDecoder().raw_decode(raw[0], begin)
        calls = _scanned(raw[0][begin:end], ("arguments",), missing="{}")
    else:
        calls = [(r[: r.find("{")].replace("[ARGS]", "").strip(), r[r.find("{"):].rstrip()) for r in raw if "{" in r]
    if not calls:
        raise ValueError("no call after [TOOL_CALLS]")
    return content or None, calls


class ListedReading:
    """One stream's calls under these parsers, read as the output grows (`read`): where the calls begin, found
    once, then a `CallScanner` fed what the text added (Mistral's v11 calls: each `[TOOL_CALLS]` found once)."""

    def __init__(self, parser: str):
        self.parser, self.origin, self.scanner = parser, NOT_YET, None
        self.marks: list[list] = []  # Mistral v11: each call's text begins, its `{`, its end (None: open)
        self.looked = 0  # where the calls' marker (Mistral's v11: the next [TOOL_CALLS]) is looked for

    def read(self, text: str) -> list[tuple[str | None, str, int, int]]:
        """Each call so far: its name (None until whole and its arguments have begun), the text its arguments are
        in, where they begin and how far they reach."""
        if self.marks:
            return self._v11(text)
        if self.scanner is None and not self._begin(text):
            return []
        if self.scanner is None:
            return self._v11(text)
        scanner = self.scanner
        scanner.read(text)
        return [(c.name if c.name is not None and c.start is not None else None, scanner.text, c.start or 0,
                 c.reach or 0) for c in scanner.calls]

    def _begin(self, text: str) -> bool:
        """Whether the calls' form is known (their origin found): the scanner made (or Mistral's v11 form)."""
        if self.parser == "llama3_json":
            self.origin = _llama3_origin(text)
            if self.origin is not None:
                self.scanner = CallScanner(_EITHER, listed=True, separator=";", origin=self.origin)
            return self.origin is not None
        if self.parser == "granite":
            if self.origin is None:  # the output is text: never calls
                return False
            self.origin = granite_origin(text)
            if self.origin is not None and self.origin != NOT_YET:
                self.scanner = CallScanner(("arguments",), listed=True, origin=self.origin)
            return self.scanner is not None
        marker = PHI4 if self.parser == "phi4_mini_json" else MISTRAL
        at = text.find(marker, self.looked)
        if at < 0:  # looked for again only in what comes next
            self.looked = max(self.looked, len(text) - len(marker) + 1)
            return False
        self.looked = at
        begin = _skip_space(text, at + len(marker))
        if self.parser == "phi4_mini_json" or text.startswith("[", begin):
            self.origin = at + len(marker) - 1 if self.parser == "phi4_mini_json" else begin
            self.scanner = CallScanner(_EITHER if self.parser == "phi4_mini_json" else ("arguments",), listed=True,
                                       origin=self.origin)
            return True
        if begin == len(text):  # not yet known which form
            return False
        self.marks, self.looked = [[at + len(MISTRAL), None, None]], at + len(MISTRAL)
        return True

    def _v11(self, text: str) -> list[tuple[str | None, str, int, int]]:
        """Mistral's v11 calls: each `name[ARGS]{...}` after its `[TOOL_CALLS]`, its arguments from `{` to the next
        `[TOOL_CALLS]` (or as far as the text is sure not to begin one), trailing space left out."""
        while (at := text.find(MISTRAL, self.looked)) >= 0:
            self.marks[-1][2] = at
            self.marks.append([at + len(MISTRAL), None, None])
            self.looked = at + len(MISTRAL)
        self.looked = max(self.looked, len(text) - len(MISTRAL) + 1)
        found = []
        for mark in self.marks:
            begin, brace, end = mark
            end = end if end is not None else safe_before(text, MISTRAL, max(begin, self.looked))
            if brace is None:
                brace = text.find("{", begin, end)
                mark[1] = brace = None if brace < 0 else brace
            if brace is None:
                found.append((None, text, 0, 0))
                continue
            reach = end
            while reach > brace and text[reach - 1] in _SPACE:
                reach -= 1
            found.append((text[begin:brace].replace("[ARGS]", "").strip(), text, brace, reach))
        return found
