"""Reasoning output on the chat routes, as vLLM's `--reasoning-parser` separates it: a thinking model's
`<think>...</think>` text comes back apart from its answer, chat's `message.reasoning` (vLLM's name; SGLang's
and DeepSeek's `reasoning_content` beside it, the same text), the answer alone in `content`, which tool calls
are then read from (tools.py).

The parsers (vLLM's of the same names):
- `qwen3` (Qwen3, Qwen3.5): the model thinks where its output opens with `<think>` or its prompt ends with one
  (Qwen3.5's template opens it there); its text up to `</think>` is then the reasoning, the rest the content
  (all reasoning where `</think>` never comes: thinking cut short by the length). Other output is all content
  (`enable_thinking: false`, whose template closes an empty thinking in the prompt).
- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ-32B: their templates open `<think>` in the prompt): the text
  up to `</think>` is the reasoning; output without it is all reasoning.
- `gemma4` (Gemma 4, whose template asks for thinking with `enable_thinking`): output that opens with
  `<|channel>` thinks, its channel's `thought` label left out, to `<channel|>`; other output is all content.
- `mistral` (Magistral, and Mistral's models that think): output that opens with `[THINK]` thinks, to `[/THINK]`;
  other output is all content.
- `granite` (Granite 3.2, whose template asks for thinking with `thinking`): output that opens with "Here is my
  thought process:" (or "Here's") thinks, to "Here is my response:" (or "Here's"); words, not tokens, so each
  marker has two forms; other output is all content.
- `openai_gptoss` (gpt-oss: OpenAI's harmony format, harmony.py): the `analysis` channel's messages are the
  reasoning, the `final` channel's (and preambles) the content; its calls read with `--tool-call-parser openai`.
A request's `include_reasoning: false` (vLLM's) leaves the reasoning out of the answer, and its content the same.
Structured output (a grammar, a forced tool call: constraints.py) holds the content after the thinking, which
stays free, as vLLM starts a grammar where the reasoning ends. A request's `thinking_token_budget` (vLLM's; Anthropic's
`thinking.budget_tokens`) ends the thinking after that many tokens: `</think>` forced (`ThinkingBudget`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import harmony
from .settings import REASONING_PARSERS
from .text import safe_before, special_tokens

PARSERS = REASONING_PARSERS
START, END = "<think>", "</think>"
# Each parser's markers of the thinking: its openings, its ends (the first of each the one written where one is
# forced), and a label the opening is followed by.
MARKERS = {"qwen3": ((START,), (END,), ""), "deepseek_r1": ((START,), (END,), ""),
           "gemma4": (("<|channel>",), ("<channel|>",), "thought\n"), "mistral": (("[THINK]",), ("[/THINK]",), ""),
           "granite": (("Here is my thought process:", "Here's my thought process:"),
                       ("Here is my response:", "Here's my response:"), ""),
           harmony.PARSER: ((harmony.THINKING[0],), (harmony.THINKING[1],), "")}


@dataclass(frozen=True)
class Reasoning:
    """How a chat request's output is read: the server's `parser`; whether the prompt `opened` the thinking
    (the chat template's `<think>` at its end); whether the answer is `shown` the reasoning (`include_reasoning`);
    whether harmony's `calls` stay in the content for the `openai` tool parser (harmony.py)."""

    parser: str
    opened: bool = False
    shown: bool = True
    calls: bool = False

    @property
    def starts(self) -> tuple[str, ...]:
        """The thinking's openings (`<think>`; Gemma 4's `<|channel>`; Granite's two)."""
        return MARKERS[self.parser][0]

    @property
    def ends(self) -> tuple[str, ...]:
        """The thinking's ends (`</think>`; Gemma 4's `<channel|>`; Granite's two)."""
        return MARKERS[self.parser][1]

    @property
    def start(self) -> str:
        """The opening a thinking budget looks for (the first of `starts`)."""
        return self.starts[0]

    @property
    def end(self) -> str:
        """The end written where one is forced (a thinking budget's)."""
        return self.ends[0]

    @property
    def from_start(self) -> bool:
        """Whether the output is thinking from its first token (else only where it opens with `start`)."""
        return self.parser == "deepseek_r1" or self.opened

    def thinks(self, text: str) -> bool:
        """Whether output beginning with `text` (enough of it to tell) is the model's thinking first."""
        return self.from_start or text.startswith(self.starts)

    def opening(self, text: str) -> int:
        """How much of the output's beginning `text` is the thinking's opening (and its label), not reasoning."""
        label = MARKERS[self.parser][2]
        start = next((s for s in self.starts if text.startswith(s)), None)
        if start is None:
            return 0
        return len(start) + (len(label) if text.startswith(label, len(start)) else 0)

    def undecided(self, text: str) -> bool:
        """Whether the output so far (`text`) may still become the thinking's opening (and its label)."""
        label = MARKERS[self.parser][2]
        return any(len(text) < len(s + label) and (s + label).startswith(text) for s in self.starts)

    def end_in(self, text: str, start: int = 0) -> tuple[int, int]:
        """Where the thinking's first end in `text` (from `start`) begins and how long it is; else where a tail that
        may still become one begins (a stream holds it back: `safe_before`), and 0."""
        safe = min(safe_before(text, end, start) for end in self.ends)
        return safe, next((len(end) for end in self.ends if text.startswith(end, safe)), 0)


def reasoning_of(parser: str | None, tokenizer, prompt: list[int], shown: bool, calls: bool = False) \
        -> Reasoning | None:
    """The reading of a chat request's output under the server's reasoning `parser` (None: none); `calls`: the
    request's calls are read by harmony's `openai` tool parser."""
    if parser is None:
        return None
    return Reasoning(parser, tokenizer.decode(prompt[-8:]).rstrip().endswith(MARKERS[parser][0]), shown, calls)


def split_reasoning(reading: Reasoning | None, text: str) -> tuple[str | None, str | None]:
    """The output's reasoning and its content (each None where there is none), as the parser reads them."""
    if reading is not None and reading.parser == harmony.PARSER:
        return harmony.split(text, reading.calls, reading.opened)
    if reading is None or not reading.thinks(text):
        return None, text
    rest = text[reading.opening(text):]
    at, length = reading.end_in(rest)
    if length:
        return rest[:at], rest[at + length:] or None
    return rest, None


def reasoning_tokens(reading: Reasoning | None, text: str, ends: list[int]) -> int:
    """How many of an output's tokens are its reasoning (the Responses API's `output_tokens_details.
    reasoning_tokens`): those whose text ends inside the reasoning the parser reads out of `text`, each token's end
    in it given by `ends` (serving/text.py's `TextStream.ends`): the thinking's opening and end markers not counted,
    as vLLM counts the tokens between them. 0 without a parser or thinking."""
    reasoning, _ = split_reasoning(reading, text)
    if not reasoning:
        return 0
    if reading.parser == harmony.PARSER:
        spans = _analysis_spans(text, reading.opened)
    else:
        begin = reading.opening(text)
        spans = [(begin, begin + len(reasoning))]
    return sum(1 for end in ends if any(begin < end <= last for begin, last in spans))


def _analysis_spans(text: str, opened: bool) -> list[tuple[int, int]]:
    """Where each of harmony's analysis messages is in `text` (from its text's start to what ends it); `opened`:
    the prompt opened the first."""
    spans, at, opening = [], 0, harmony.THINKING[0]
    while True:
        begin = 0 if opened and not spans else text.find(opening, at)
        if begin < 0:
            return spans
        begin += 0 if opened and not spans else len(opening)
        last = min((i for i in (text.find(end, begin) for end in harmony.ENDS) if i >= 0), default=len(text))
        spans.append((begin, last))
        at = last


def thinking_is_special(parser: str | None, tokenizer) -> bool:
    """Whether the thinking's end (`</think>`; harmony's `<|message|>`) is a special token of this tokenizer, whose
    text the output must then keep for the parser to see it."""
    end = harmony.MESSAGE if parser == harmony.PARSER else MARKERS.get(parser, (None, (None,)))[1][0]
    return parser is not None and end in special_tokens(tokenizer)


def reasoning_stream(reading: Reasoning):
    """A streamed choice's reader of its output under `reading` (`piece` and `end`, each giving the reasoning and
    the content to send): harmony's, or the thinking's markers'."""
    if reading.parser == harmony.PARSER:
        return harmony.HarmonyStream(reading.calls, reading.opened)
    return ReasoningStream(reading)


class ReasoningStream:
    """A streamed choice's output split as it comes: reasoning until `</think>` (a piece that may begin it
    held), the content after; `piece` gives (reasoning, content) to send for each piece of output."""

    def __init__(self, reading: Reasoning):
        self.reading, self.text, self.sent, self.thinking = reading, "", 0, None

    def piece(self, text: str) -> tuple[str, str]:
        self.text += text
        if self.thinking is None:  # output that may still open with <think>: held until it is known
            if self.reading.undecided(self.text):
                return "", ""
            self.thinking = self.reading.thinks(self.text)
            self.sent = self.reading.opening(self.text)
        if not self.thinking:
            content, self.sent = self.text[self.sent:], len(self.text)
            return "", content
        safe, length = self.reading.end_in(self.text, self.sent)
        if length:
            reasoning, content = self.text[self.sent: safe], self.text[safe + length:]
            self.thinking, self.sent = False, len(self.text)
            return reasoning, content
        reasoning, self.sent = self.text[self.sent: safe], safe
        return reasoning, ""

    def end(self) -> tuple[str, str]:
        """What was held at the end of the output: a `<think>` or `</think>` begun and never finished."""
        if self.thinking is None:  # the whole output a beginning of <think>, and no more
            self.thinking = self.reading.thinks(self.text)
            self.sent = self.reading.opening(self.text)
        rest, self.sent = self.text[self.sent:], len(self.text)
        return (rest, "") if self.thinking else ("", rest)


@dataclass(frozen=True)
class ThinkingBudget:
    """vLLM's `thinking_token_budget`: at most `budget` tokens of thinking, then `</think>` forced (its tokens `end`,
    one a step), after which the model goes on with its answer. The thinking starts at the output's first token
    where `from_start` (the reading's), else where the output opens with `<think>` (its tokens `start`); it ends
    early where the model writes `end` itself."""

    budget: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    from_start: bool

    def counter(self) -> ThinkingCount:
        return ThinkingCount(self, "thinking" if self.from_start else "opening")


def thinking_budget(reading: Reasoning, tokenizer, budget: int) -> ThinkingBudget:
    """The budget of a request whose output `reading` reads, with the tokenizer's tokens of the markers."""
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return ThinkingBudget(budget, ids(reading.start), ids(reading.end), reading.from_start)


@dataclass
class ThinkingCount:
    """One row's place against its `ThinkingBudget`: `phase` "opening" (the output may still open with `<think>`),
    "thinking" (`count` tokens of it so far), "ending" (`forced` of the end's tokens given) or "done"."""

    budget: ThinkingBudget
    phase: str
    count: int = 0
    forced: int = 0
    recent: list[int] = field(default_factory=list)  # the last tokens, to see the opening or the end written

    def forced_token(self) -> int | None:
        """The token the row's next step must give (the end's next one, once the budget is spent), else None."""
        if self.phase == "thinking" and self.count >= self.budget.budget:
            self.phase = "ending"
        return self.budget.end[self.forced] if self.phase == "ending" else None

    def accept(self, token: int) -> None:
        """Count the token the row gave."""
        budget = self.budget
        if self.phase == "opening":
            self.recent.append(token)
            if tuple(self.recent) == budget.start:
                self.phase, self.recent = "thinking", []
            elif tuple(self.recent) != budget.start[: len(self.recent)]:
                self.phase = "done"
        elif self.phase == "thinking":
            self.count += 1
            self.recent = (self.recent + [token])[-len(budget.end):]
            if tuple(self.recent) == budget.end:
                self.phase = "done"
        elif self.phase == "ending":
            self.forced += 1
            if self.forced == len(budget.end):
                self.phase = "done"
