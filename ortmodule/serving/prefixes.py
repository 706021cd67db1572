"""Prefix caching: the KV entries of recent prompts, so that a prompt beginning as one of them runs
only what follows the shared part (a chat template's system prompt, a few-shot preamble, a prompt
sent again), as vLLM's and SGLang's prefix caches do.

Prompts are found by their blocks of `BLOCK` tokens: each full block's key chains the keys of the
blocks before it, and maps to the latest prompt holding that block sequence. A lookup follows the
chain as far as it goes, then measures the exact common prefix with the prompt found (so a hash
collision costs a shorter match, never a wrong one). Entries are kept within a byte budget, the
least recently used dropped first; a prompt that extends an entry replaces it. A hybrid decoder's
entries also hold its layer states after the prompt (ortmodule/states.py), which serve a
prompt that extends the whole entry only (Generations._hit).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per block; prompts shorter than one block are not kept


@dataclass(eq=False)
class Entry:
    tokens: torch.Tensor  # the prompt, int64 on the host
    keys: list[torch.Tensor]  # per layer [kv_heads, length, head_size] on the model's device
    values: list[torch.Tensor]
    nbytes: int
    chain: set[int] = field(default_factory=set)  # the keys of its full blocks
    states: list[torch.Tensor] | None = None  # a hybrid decoder's, per stateful layer (its LayerState.shape)


def _chain(tokens: list[int]):
    """The key of each full block, each chaining the ones before it."""
    key = 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        key = hash((key, tuple(tokens[start : start + BLOCK])))
        yield key


class Prefixes:
    """Recent prompts' KV within `budget` bytes (0: off). Used from the model's thread only."""

    def __init__(self, budget: int, hybrid: bool = False):
        self.budget, self.hybrid = budget, hybrid  # hybrid: entries hold layer states, of their end only
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by id, least recently used first
        self.blocks: dict[int, Entry] = {}  # block-chain key -> the latest entry holding it
        self.nbytes = 0
        self.hits = 0  # prompts started past a cached prefix
        self.reused = 0  # prompt tokens not run thanks to them

    def hit(self, row) -> tuple:
        """The cached prefix of a row's prompt (looked up once): (entry, tokens to reuse, at most all but the
        last)."""
        if row.prefix is None:
            # A prompt with images is not its ids (the same placeholders stand for any image): no prefix.
            entry, shared = self.find(row.prompt) if self.budget and row.media is None else (None, 0)
            shared = min(shared, len(row.prompt) - 1)
            if self.hybrid and (entry is None or entry.states is None or shared != len(entry.tokens)):
                entry, shared = None, 0  # its states are the entry's end's: a prompt extending all of it only
            row.prefix = (entry, shared)
        return row.prefix

    def use(self, row, shared: int) -> None:
        """A row starts past `shared` tokens of its prompt taken from an entry (0: none)."""
        row.cached_prefix = shared  # SGLang's `cached_tokens`
        if shared:
            self.hits += 1
            self.reused += shared

    def find(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` (by whole blocks, then exactly), and
        how many tokens they share; (None, 0) when none shares a block."""
        found = None
        for key in _chain(prompt):
            entry = self.blocks.get(key)
            if entry is None:
                break
            found = entry
        if found is None:
            return None, 0
        tokens = torch.tensor(prompt, dtype=torch.int64)
        n = min(len(tokens), len(found.tokens))
        differ = (tokens[:n] != found.tokens[:n]).nonzero()
        shared = int(differ[0, 0]) if len(differ) else n
        self.entries.move_to_end(id(found))
        return (found, shared) if shared else (None, 0)

    def add(self, prompt: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
            states: list[torch.Tensor] | None = None) -> None:
        """Keep `prompt`'s KV (per layer `[kv_heads, >= len(prompt), head_size]`, copied here), and
        a hybrid decoder's `states` after it, unless it is shorter than a block, larger than the
        budget, or held already."""
        if len(prompt) < BLOCK:
            return
        length = len(prompt)
        nbytes = sum(k[:, :length].nbytes + v[:, :length].nbytes for k, v in zip(keys, values))
        nbytes += sum(state.nbytes for state in states or ())
        if nbytes > self.budget:
            return
        found, shared = self.find(prompt)
        if found is not None and shared == length:
            return  # an entry holds this prompt (or a longer one beginning with it)
        if found is not None and shared == len(found.tokens):
            self._drop(found)  # this prompt extends it
        while self.nbytes + nbytes > self.budget:
            self._drop(next(iter(self.entries.values())))
        entry = Entry(torch.tensor(prompt, dtype=torch.int64), [k[:, :length].clone() for k in keys],
                      [v[:, :length].clone() for v in values], nbytes,
                      states=[state.clone() for state in states] if states else None)
        for key in _chain(prompt):
            self.blocks[key] = entry
            entry.chain.add(key)
        self.entries[id(entry)] = entry
        self.nbytes += nbytes

    def _drop(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        self.nbytes -= entry.nbytes
        for key in entry.chain:
            if self.blocks.get(key) is entry:
                # A block another entry shares stays findable through that entry.
                del self.blocks[key]
                other = next((e for e in reversed(self.entries.values()) if key in e.chain), None)
                if other is not None:
                    self.blocks[key] = other

    def clear(self) -> None:
        self.entries.clear()
        self.blocks.clear()
        self.nbytes = 0
