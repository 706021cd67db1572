"""Text out of token ids, token by token: incremental detokenization and stop strings.

`TextStream` turns a row's tokens into text with a constant amount of work per token, as TGI and
vLLM do: it decodes a short window (the tokens last shown, as context, and the new ones) rather
than the whole row, and holds back a character still incomplete (`\\ufffd`). Stop strings are looked for only in
the text's tail, where a new token could have completed one, so a long generation or a long stop
string costs no more per token than its own length. The text before a stop string is the answer;
text that could still become the start of a stop string waits before it is streamed.
"""

from __future__ import annotations


def special_tokens(tokenizer) -> set[str]:
    """The tokenizer's special tokens: those it names (`all_special_tokens`) and the added tokens marked special,
    which decoding with `skip_special_tokens` drops too though a tokenizer may not name them (Llama 3's
    `<|python_tag|>`, a `</think>` added as special)."""
    named = {t for t in getattr(tokenizer, "all_special_tokens", ()) if t}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return named | {t.content for t in added.values() if getattr(t, "special", False) and t.content}


def safe_before(text: str, marker: str, start: int = 0) -> int:
    """How much of `text` is sure to come before `marker` (looked for from `start`): up to where the marker
    begins, or where a tail that may still become it begins (a stream holds that tail back)."""
    at = text.find(marker, start)
    if at >= 0:
        return at
    at = text.find(marker[0], max(start, len(text) - len(marker) + 1))  # the first tail that may become it
    while at >= 0:
        if marker.startswith(text[at:]):
            return at
        at = text.find(marker[0], at + 1)
    return len(text)


class TextStream:
    """One row's text. `add(token)` returns the text that became final (safe to send)."""

    def __init__(self, tokenizer, eos: set[int], stop: tuple[str, ...], stop_ids: frozenset[int] = frozenset(),
                 include_stop: bool = False, skip_special: bool = True):
        """`eos`: tokens that end the row, not shown; `stop`: strings that end it, cut before them (or
        after, `include_stop`); `stop_ids`: tokens that end it, shown as text is (vLLM's `stop_token_ids`);
        `skip_special`: special tokens' text left out (vLLM's `skip_special_tokens`, true by default)."""
        self.tokenizer, self.eos, self.stop = tokenizer, eos, stop
        self.stop_ids, self.include_stop, self.skip_special = stop_ids, include_stop, skip_special
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut before a stop string once one is found)
        self.sent = 0  # characters of `text` handed out
        self.prefix = self.read = 0  # the window: ids[prefix:read] decoded, ids[read:] not yet shown
        self.waiting = ""  # whole characters of ids[read:] before an incomplete one (not yet shown)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.finish_reason: str | None = None
        self.matched: int | str | None = None  # what ended the row "stop": the token id, or the stop string
        self.counted = 0  # tokens counted for usage: through the end-of-sequence or stop-completing one
        self.ends: list[int] = []  # each shown token's end in `text` (how much of it was final after the token)

    def add(self, token: int) -> str:
        """Take the next token; the text that can be sent now."""
        if self.finish_reason is not None:
            return ""
        self.counted += 1
        if token in self.eos:
            self.finish_reason, self.matched = "stop", token
            self._flush()
            return self._release(len(self.text))
        self.ids.append(token)
        before = len(self.text)
        self.text += self._decode_new()
        self.ends.append(len(self.text))
        if self.stop:
            # Only a stop string ending in the new text can be new: look in the tail that could hold
            # it, with the characters already whole before an incomplete one that waits.
            start = max(0, before - self.hold)
            tail = self.text + self.waiting
            found = [(at, len(s), s) for at, s in ((tail.find(s, start), s) for s in self.stop) if at >= 0]
            if found:
                at, length, self.matched = min(found)
                self.text = tail[: at + length if self.include_stop else at]
                self.finish_reason = "stop"
                return self._release(len(self.text))
        if token in self.stop_ids:
            self.finish_reason, self.matched = "stop", token
            self._flush()
            return self._release(len(self.text))
        safe = len(self.text) - self.hold if self.stop else len(self.text)
        return self._release(safe)

    def end(self, reason: str = "length") -> str:
        """The row ended by length (or by `reason`): everything not yet sent (an incomplete character included)."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self._flush()
        return self._release(len(self.text))

    def complete(self) -> str:
        """The row ended where its grammar is complete (structured output): a "stop", as at an end token."""
        return self.end("stop")

    def _flush(self) -> None:
        """The row ends (by length or end-of-sequence): the tokens held back for an incomplete
        character join the text as the whole row's decoding shows them (U+FFFD where it stays
        incomplete)."""
        if self.read < len(self.ids):
            self.text += self._window_text(len(self.ids))[len(self._window_text(self.read)):]
            self.read = len(self.ids)

    def _decode_new(self) -> str:
        """Text the newest tokens add, once it is whole (not ending in an incomplete character)."""
        shown = self._window_text(self.read)
        current = self._window_text(len(self.ids))
        self.waiting = ""
        if len(current) <= len(shown) or current.endswith("\ufffd"):
            self.waiting = current[len(shown):].rstrip("\ufffd")
            return ""
        self.prefix, self.read = self.read, len(self.ids)  # the tokens just shown are the next window's context
        return current[len(shown):]

    def _window_text(self, end: int) -> str:
        if self.tokenizer is None:  # a server made without one: only /health_generate's token, whose text is unread
            return ""
        return self.tokenizer.decode(self.ids[self.prefix : end], skip_special_tokens=self.skip_special)

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta, self.sent = self.text[self.sent : upto], upto
        return delta


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text, as OpenAI's `logprobs.tokens` lists it."""
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


class TokenIdStrings:
    """Token strings as vLLM's `return_tokens_as_token_ids` writes them in log-probabilities: `token_id:N` (every
    token told apart, those whose text is not whole characters too); `token_strings` takes it for a tokenizer."""

    @staticmethod
    def batch_decode(rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [f"token_id:{row[0]}" for row in rows]


def logprob_names(tokenizer, as_ids: bool):
    """What names the tokens of a request's log-probabilities: its tokenizer, or their ids (`as_ids`)."""
    return TokenIdStrings() if as_ids else tokenizer


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token of the vocabulary can stand for (an upper bound:
    byte-level vocabularies write a byte as a character of up to 2 bytes)."""
    if tokenizer is None:
        return 1
    return max((len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=1)
