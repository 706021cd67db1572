"""gpt-oss's output (OpenAI's harmony format) on the chat routes, as vLLM reads it with `--reasoning-parser
openai_gptoss` and `--tool-call-parser openai`.

The chat template's generation prompt ends with `<|start|>assistant`; the model then writes messages, each a
header to `<|message|>` (`<|channel|>analysis`, `<|channel|>final`, `<|channel|>commentary to=functions.NAME
<|constrain|>json`, or the recipient first: ` to=functions.NAME<|channel|>commentary json`), its text, and
`<|end|>` (the next one opening with `<|start|>assistant`), `<|call|>` or `<|return|>` (which end the output).
- the `analysis` channel's messages are the reasoning (joined by a line break where there are several);
- the `final` channel's and `commentary` without a recipient (a preamble shown to the user) are the content;
- a message to `functions.NAME` is a call of the tool NAME, its text the arguments (JSON read and written again
  where its content type is JSON or unnamed, as vLLM's `openai` parser does; else the text as written), read with
  `--tool-call-parser openai`; messages to other recipients (built-in tools this server does not run) are left
  out, as are calls without that parser.
Output that does not open with a header (a model that does not write harmony) is all content.

The reading is one pass over the text (`HarmonyStream`), a stream's pieces or a whole output alike, so that a
stream's deltas put together are the whole answer. Calls travel in the content as their harmony text
(`<|channel|>commentary to=functions.NAME <|constrain|>TYPE<|message|>ARGUMENTS<|call|>`), which `read_calls`
reads (tools.py's `openai` parser)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .text import safe_before

PARSER, TOOL_PARSER = "openai_gptoss", "openai"
MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
CALL_END = "<|call|>"
ENDS = ("<|end|>", CALL_END, "<|return|>", START)  # what ends a message's text (a new <|start|>: one never ended)
# How the output may open: a header (the prompt's `<|start|>assistant` before it, or a new <|start|>)
OPENINGS = (CHANNEL, START, " to=", "to=", "<|constrain|>", MESSAGE)
# The thinking's opening and end where the output thinks, then answers (a thinking budget, a grammar after it)
THINKING = (f"{CHANNEL}analysis{MESSAGE}", f"<|end|>{START}assistant{CHANNEL}final{MESSAGE}")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
_LONGEST = 256  # a call's header is shorter (OpenAI's function names: at most 64 characters)
_HEAD = re.compile(r"<\|channel\|>commentary to=(functions\.[^\s<]+) <\|constrain\|>[^\s<]*<\|message\|>")


@dataclass(frozen=True)
class Header:
    """A message's header: its channel, recipient and content type (each None where it names none)."""

    channel: str | None
    recipient: str | None
    content_type: str | None


def read_header(text: str) -> Header:
    """The header `text` (what stands before `<|message|>`, a `<|start|>` and its role included)."""
    if text.startswith(START):
        text = text[len(START):]
        text = text[len(re.match(r"[^\s<]*", text).group()):]  # the author's role
    channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
    kind = _CONSTRAIN.search(text)
    if kind is None and channel is not None:  # the template's form: `<|channel|>commentary json`
        rest = text[channel.end():].split()
        kind = next((w for w in rest if not w.startswith("to=") and "<|" not in w), None)
    else:
        kind = kind and kind.group(1)
    return Header(channel and channel.group(1), recipient and recipient.group(1), kind)


class HarmonyStream:
    """One output read as it comes: `piece(text)` gives the (reasoning, content) to send for it, `end()` what was
    held at the output's end. `calls`: calls to `functions.*` kept in the content as their harmony text (the
    `openai` tool parser's); `opened`: the prompt opened the analysis message (its text comes first)."""

    def __init__(self, calls: bool = False, opened: bool = False):
        self.calls, self.text, self.at, self.looked = calls, "", 0, 0
        self.mode = "body" if opened else "opening"  # "opening", "header", "body" or "plain" (not harmony)
        self.kind = "reasoning"  # the message's: "reasoning", "content", "call" or "hidden"
        self.begun = {"reasoning": int(opened), "content": 0}  # messages of each begun so far

    def piece(self, text: str) -> tuple[str, str]:
        self.text += text
        out = {"reasoning": [], "content": []}
        while self._step(out):
            pass
        if self.at > 4096:  # what was read goes (a long output's text is not copied again at each piece)
            self.text, self.looked, self.at = self.text[self.at:], max(0, self.looked - self.at), 0
        return "".join(out["reasoning"]), "".join(out["content"])

    def end(self) -> tuple[str, str]:
        out = {"reasoning": [], "content": []}
        if self.mode == "opening":  # the whole output a beginning of a header, and no more: text
            self.mode, self.kind = "plain", "content"
        if self.mode in ("plain", "body"):
            self._write(out, self.text[self.at:])
        self.at = len(self.text)
        return "".join(out["reasoning"]), "".join(out["content"])

    def _step(self, out: dict) -> bool:
        """Read on from `at`; whether there may be more to read now."""
        text, at = self.text, self.at
        if self.mode == "opening":
            rest = text[at:]
            if any(rest.startswith(o) for o in OPENINGS):
                self.mode = "header"
            elif any(o.startswith(rest) for o in OPENINGS):  # may still become a header
                return False
            else:
                self.mode, self.kind = "plain", "content"
            return True
        if self.mode == "plain":
            self._write(out, text[at:])
            self.at = len(text)
            return False
        if self.mode == "header":
            found = text.find(MESSAGE, max(at, self.looked))
            if found < 0:  # looked for again only in what comes next (a header that never ends costs no more)
                self.looked = len(text) - len(MESSAGE) + 1
                return False
            self._begin(out, read_header(text[at:found]))
            self.at, self.mode = found + len(MESSAGE), "body"
            return True
        ends = [(j, e) for e in ENDS if (j := text.find(e, at)) >= 0]
        if not ends:
            safe = min(safe_before(text, e, at) for e in ENDS)
            self._write(out, text[at:safe])
            self.at = safe
            return False
        j, marker = min(ends)
        self._write(out, text[at:j] + (CALL_END if self.kind == "call" else ""))
        self.at, self.mode = (j if marker == START else j + len(marker)), "header"
        return True

    def _begin(self, out: dict, header: Header) -> None:
        if header.recipient is not None:
            self.kind = "call" if self.calls and header.recipient.startswith("functions.") else "hidden"
        elif header.channel == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content" if header.channel in (None, "final", "commentary") else "hidden"
        if self.kind in self.begun:
            if self.begun[self.kind]:
                out[self.kind].append("\n")
            self.begun[self.kind] += 1
        elif self.kind == "call":
            out["content"].append(f"{CHANNEL}commentary to={header.recipient} <|constrain|>"
                                  f"{header.content_type or 'json'}{MESSAGE}")

    def _write(self, out: dict, text: str) -> None:
        if text and self.kind != "hidden":
            out["content" if self.kind == "call" else self.kind].append(text)


def split(text: str, calls: bool = False, opened: bool = False) -> tuple[str | None, str | None]:
    """A whole output's reasoning and content (each None where there is none)."""
    stream = HarmonyStream(calls, opened)
    reasoning, content = stream.piece(text)
    more = stream.end()
    return reasoning + more[0] or None, content + more[1] or None


def read_calls(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """The `openai` tool parser's reading of the content `split` gave: the text around the calls, and each call's
    name and arguments, the text the model wrote (None where there is none)."""
    reading = CallsRead()
    calls = reading.read(text, whole=True)
    content, at = [], 0
    for (_, head, _, end), _ in zip(reading.calls, calls):
        content.append(text[at:head])
        at = len(text) if end is None else end + len(CALL_END)
    content.append(text[at:])
    return "".join(content) or None, [(name, text[begin:reach]) for name, _, begin, reach in calls] or None


class CallsRead:
    """The calls in the content `HarmonyStream` gives with `calls` (their harmony text), read as it grows: each
    call's name once its header is whole, and its arguments as far as they are written, each character looked at
    once (tools.py's `ToolStream` streams them)."""

    def __init__(self):
        self.calls: list[list] = []  # each call's name, where its header begins, its text begins and ends (None)
        self.at = 0  # where the next header is looked for

    def read(self, text: str, whole: bool = False) -> list[tuple[str, str, int, int]]:
        """Each call so far: (name, `text`, where its arguments begin, how far they reach); `whole`: the text is
        the whole content (an unfinished `<|call|>` at its end is the arguments' text)."""
        while self._next(text):
            pass
        found = []
        for name, _, begin, end in self.calls:
            reach = end if end is not None else len(text) if whole else safe_before(text, CALL_END, self.at)
            found.append((name, text, begin, reach))
        return found

    def _next(self, text: str) -> bool:
        if self.calls and self.calls[-1][3] is None:  # the open call's end, looked for in what came since
            end = text.find(CALL_END, self.at)
            if end < 0:
                self.at = max(self.at, len(text) - len(CALL_END) + 1)
                return False
            self.calls[-1][3], self.at = end, end + len(CALL_END)
        head = text.find(CHANNEL, self.at)
        if head < 0:
            self.at = max(self.at, len(text) - len(CHANNEL) + 1)
            return False
        found = _HEAD.match(text, head)
        if found is None and len(text) - head < _LONGEST and MESSAGE not in text[head:]:
            self.at = head  # a header that may still be written whole (`HarmonyStream` gives one in one piece)
            return False
        if found is None:  # the content's own text
            self.at = head + len(CHANNEL)
            return True
        self.calls.append([found.group(1)[len("functions."):], head, found.end(), None])
        self.at = found.end()
        return True
