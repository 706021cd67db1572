"""A chat row's answer, as the chat, responses and messages routes write it: the output's reasoning apart
(reasoning.py, where the server has a reasoning parser), its content read for tool calls (tools.py); whole
(`chat_answer`) or as a stream's deltas (`ChatStream`), in chat's shape, which the other routes turn into
theirs."""

from __future__ import annotations

from .jobs import Generation, Row
from .reasoning import reasoning_stream, split_reasoning
from .tools import ToolStream, tool_message


def chat_answer(job: Generation, row: Row) -> tuple[dict, str, str | None]:
    """A finished row's chat `message` (content None where the output was all reasoning), its finish reason
    and its reasoning (None where there is none; shown or not, the message holds none of it)."""
    reasoning, content = split_reasoning(job.reasoning, row.text.text)
    message, finish = tool_message(job.tools, content or "", row.text.finish_reason)
    if content is None and message["content"] == "":
        message["content"] = None
    return message, finish, reasoning


class ChatStream:
    """One streamed choice's deltas in chat's shape: `reasoning` (and `reasoning_content`, the same) as it
    comes, where the job shows it; the content as tools.py's `ToolStream` gives it, or as text."""

    def __init__(self, job: Generation):
        self.job = job
        self.thinking = reasoning_stream(job.reasoning) if job.reasoning else None
        self.calls = ToolStream(job.tools) if job.tools.calls else None

    def piece(self, text: str) -> dict:
        """The delta's fields for this piece of output (none where it is all held back)."""
        reasoning, content = self.thinking.piece(text) if self.thinking else ("", text)
        return self._delta(reasoning, content)

    def _delta(self, reasoning: str, content: str) -> dict:
        delta = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning and self.job.reasoning.shown \
            else {}
        if self.calls is not None:
            if content:
                delta.update(self.calls.piece(content))
        elif content:
            delta["content"] = content
        return delta

    def end(self, row: Row) -> tuple[list[dict], str]:
        """The deltas still to send once the row is done (what was held back), and its finish reason."""
        deltas = []
        if self.thinking is not None:
            delta = self._delta(*self.thinking.end())
            deltas += [delta] if delta else []
        finish = row.text.finish_reason
        if self.calls is not None:
            content = split_reasoning(self.job.reasoning, row.text.text)[1] or ""
            more, finish = self.calls.end(content, finish)
            deltas += more
        return deltas, finish
