"""The generation side of the engine: rows waiting to start, the running decode batch, and the
prefix cache.

Each pass of the model's thread (engine.py) may `feed` waiting prompts into the running batch (a
token per decode step, past their cached prefix), `prefill` others (short ones together, a long one
or one past a cached prefix alone in chunks), and `decode` one step of every running row. A row
joins the batch at the next step and leaves it when done (continuous batching); greedy output is
what the request gives alone, since rows do not interact in a step.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from ..cache import rows_view
from ..hf import CACHE_NAME
from ..inputs import Rows, pad_right, to_device
from .jobs import Generation, Row, choose_tokens, prompt_scores
from .prefixes import BLOCK, Prefixes
from .settings import Settings
from .telemetry import Telemetry

log = logging.getLogger("ortmodule.serving")


def put_row(cache, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor], length: int,
            states: list[torch.Tensor] | None = None, offset=0) -> None:
    """Row `slot` of a shared-buffer `cache` takes the first `length` entries of per-layer KV
    `[kv_heads, >= length, head_size]` (another row's, or a cached prefix's), a hybrid decoder's
    layer states after them (each of its `LayerState.shape`; None: before any token, zeros), and its
    next position's offset from its length (mRoPE after images: `KVCache.position_offset`)."""
    for mine, theirs in ((cache.keys, keys), (cache.values, values)):
        for buffer, source in zip(mine, theirs):
            buffer[slot, :, :length] = source[:, :length]
    for i, buffer in enumerate(cache.states.current):
        if states is None:
            buffer[slot].zero_()
        else:
            buffer[slot] = states[i]
    cache.lengths[slot] = length
    if cache.position_offset is None and (not isinstance(offset, int) or offset):
        cache.position_offset = torch.zeros_like(cache.lengths)
    if cache.position_offset is not None:
        cache.position_offset[slot] = offset


class DecodeBatch:
    """The running rows: one KV cache of slots, the first `len(rows)` in use. A row joins by a copy
    of its prefilled KV into the next slot; a row that leaves is replaced by the last one (a copy of
    one row), so the rows in use stay the cache's first rows and one step runs exactly them. The
    cache's slots (up to `max_rows`) and positions grow by doubling as rows join and lengthen; its
    positions shrink once the longest row in use needs a quarter of them or less, and its slots
    once the rows in use fill a quarter of them or less where the cache is made again anyway (its
    positions growing or shrinking) or no row runs: its memory follows the rows running, not
    `max_rows` times the longest row ever run, and rows coming and going copy nothing more.
    Packages whose attention concatenates (not GroupQueryAttention) run one row."""

    FIRST_SLOTS, FIRST_POSITIONS = 4, 256

    def __init__(self, decoder, max_rows: int):
        self.decoder = decoder
        self.shared = decoder.spec.shares_kv_buffer
        self.max_rows = max_rows if self.shared else 1
        self.rows: list[Row] = []
        self.first_slots = min(self.max_rows, self.FIRST_SLOTS)
        self.pool = decoder.new_cache(self.first_slots, self.FIRST_POSITIONS) if self.shared else None
        self.least = self.pool.capacity if self.shared else 0  # positions of the first cache (sliding windows: more)
        self.view = None  # the pool's first rows, remade when the rows or the buffers change
        self.context = decoder.package.context_length

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def join(self, cache, index: int, row: Row) -> None:
        """Row `index` of the prefilled `cache` goes into the next slot."""
        offset = 0 if cache.position_offset is None else cache.position_offset[index]
        self._join(row, [k[index] for k in cache.keys] if self.shared else None,
                   [v[index] for v in cache.values] if self.shared else None, row.cached, cache,
                   [state[index] for state in cache.states.current], offset)

    def join_prefix(self, row: Row, entry, shared: int) -> None:
        """`row` goes into the next slot holding the first `shared` tokens of its prompt, copied from
        a cached prefix `entry` (or none, with `shared` 0); its decode steps run the rest of its
        prompt, a token each, then generate."""
        row.prefilled = shared
        self._join(row, entry.keys if entry else [], entry.values if entry else [], shared, None,
                   entry.states if entry else None)

    def _join(self, row: Row, keys, values, length: int, cache, states=None, offset=0) -> None:
        slot = len(self.rows)
        if not self.shared:
            self.pool = cache
        else:
            if slot == self.pool.batch_size:
                self._remake(min(2 * slot, self.max_rows), self.pool.capacity)
            self._room(length + 1, slot + 1)
            put_row(self.pool, slot, keys, values, length, states, offset)
        self.rows.append(row)
        self.view = None

    def row_kv(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The KV buffers of the row in `slot`, per layer `[kv_heads, capacity, head_size]` (views)."""
        return [k[slot] for k in self.pool.keys], [v[slot] for v in self.pool.values]

    def leave(self, slot: int) -> None:
        last = len(self.rows) - 1
        if self.shared and slot != last:
            offsets = self.pool.position_offset
            put_row(self.pool, slot, *self.row_kv(last), self.rows[last].cached,
                    [state[last].clone() for state in self.pool.states.current],
                    0 if offsets is None else offsets[last].clone())
        self.rows[slot] = self.rows[last]
        self.rows.pop()
        self.view = None

    def fit(self) -> None:
        """After rows left: a smaller cache where the longest row in use needs a quarter of its
        positions or less (then twice the longest's), or no row runs; its slots then the fewest that
        hold the rows in use where those fill a quarter of them or less (a quarter's margin, so that
        rows of about the same length or number do not make a cache each)."""
        if not self.shared:
            return
        slots, positions, rows = self.pool.batch_size, self.pool.capacity, len(self.rows)
        needed = max((row.cached for row in self.rows), default=0) + 1
        shorter = positions >= 4 * max(self.least, needed)
        if shorter or (not rows and slots > self.first_slots):
            self._remake(self._slots(rows), max(self.least, 2 * needed) if shorter else positions)

    def _room(self, needed: int, rows: int) -> None:
        """Positions for `needed` tokens a row (doubling, up to the context) for `rows` rows in use: the
        cache made again with fewer slots where they fill a quarter of it or less, else grown in place."""
        if needed <= self.pool.capacity:
            return
        if self._slots(rows) < self.pool.batch_size:
            self._remake(self._slots(rows), min(max(needed, 2 * self.pool.capacity), self.context))
        else:
            self.pool.reserve(needed, self.context)

    def _slots(self, rows: int) -> int:
        """The cache's slots for `rows` rows in use: the same where they fill over a quarter of them,
        else the fewest (a power of two, at least the first cache's) that hold them."""
        slots = self.pool.batch_size
        return slots if 4 * rows > slots else max(self.first_slots, 1 << max(rows - 1, 0).bit_length())

    def sizes(self) -> dict:
        """The decode batch's KV cache: its slots, positions and bytes (for /metrics)."""
        pool = self.pool
        if pool is None:
            return {"slots": 0, "positions": 0, "bytes": 0}
        held = sum(buffer.nbytes for buffers in (pool.keys, pool.values) for buffer in buffers)
        return {"slots": pool.batch_size, "positions": pool.capacity, "bytes": held}

    def _remake(self, slots: int, positions: int) -> None:
        """The pool again with `slots` rows of `positions`, holding the rows in use (the first rows: one
        copy per buffer of them up to the longest)."""
        old, rows = self.pool, len(self.rows)
        self.pool = new = self.decoder.new_cache(slots, positions)
        longest = max((row.cached for row in self.rows), default=0)
        for mine, theirs in zip((*new.keys, *new.values), (*old.keys, *old.values)):
            mine[:rows, :, :longest] = theirs[:rows, :, :longest]
        for mine, theirs in zip(new.states.current, old.states.current):  # a hybrid's layer states
            mine[:rows] = theirs[:rows]
        new.lengths[:rows] = old.lengths[:rows]
        if old.position_offset is not None:
            new.position_offset = old.position_offset.new_zeros(slots)
            new.position_offset[:rows] = old.position_offset[:rows]
        self.view = None

    def prefill(self, rows: list[Row]) -> tuple[torch.Tensor, object]:
        """Run the prompts of `rows` together: the logits after each, `[rows, V]`, and their cache."""
        decoder, device = self.decoder, self.decoder.device
        ids, _ = pad_right([row.prompt for row in rows])
        width = ids.shape[1]
        lengths = torch.tensor([len(row.prompt) for row in rows])
        last = torch.arange(len(rows)) * width + lengths - 1
        cache = decoder.new_cache(len(rows), width + 1)
        logits = decoder.prefill(Rows(to_device(ids, device), None, to_device(lengths, device), width),
                                 to_device(last, device), cache)
        for row in rows:
            row.prefilled = len(row.prompt)
        return logits, cache

    def prefill_images(self, model, row: Row) -> tuple[torch.Tensor, object]:
        """Run a prompt with images (`row.media`) alone, whole, through the model's forward: the
        logits after it, `[1, V]`, and its cache, which keeps the row's mRoPE position offset."""
        out = model(torch.tensor([row.prompt]), **row.media.inputs, use_cache=True, logits_to_keep=1)
        row.prefilled = len(row.prompt)
        return out.logits[:, -1], out[CACHE_NAME]

    def prefill_chunk(self, row: Row, cache, chunk: int) -> torch.Tensor:
        """The next `chunk` tokens of a long prompt into its own one-row `cache`: the logits after
        the last of them, `[1, V]`. Chunks start at multiples of `chunk`, whatever else runs."""
        decoder = self.decoder
        start = row.prefilled
        end = min(start + chunk, len(row.prompt))
        piece, last, size = (to_device(values, decoder.device)
                             for values in ([row.prompt[start:end]], [end - start - 1], [end]))
        if start == 0:
            logits = decoder.prefill(Rows(piece, None, size, end), last, cache)
        else:
            logits = decoder.step(piece, cache, last)
        row.prefilled = end
        return logits

    def step(self) -> tuple[list[int], torch.Tensor]:
        """Run every row's next input (its last token, or the next of a prompt being fed): the slots
        of the rows that choose a token after it (all but those fed a prompt token before their
        last) and their logits `[len(slots), V]`, the LM head run for those rows only."""
        rows = self.rows
        if self.shared:
            longest = max(row.cached for row in rows)  # the step adds one
            self._room(longest + 1, len(rows))
            if self.view is None or self.view.version != self.pool.version:
                self.view = rows_view(self.pool, 0, len(rows), longest)
            cache = self.view
        else:
            cache = self.pool
        device = self.decoder.device
        tokens = to_device([[row.next_input] for row in rows], device)
        choosing = [slot for slot, row in enumerate(rows) if row.prefilled >= len(row.prompt) - 1]
        # The LM head needs at least one row: when every row is mid-prompt, row 0's logits go unused.
        index = None if len(choosing) == len(rows) else to_device(choosing or [0], device)
        logits = self.decoder.step(tokens, cache, index)
        return choosing, logits.view(-1, logits.shape[-1])


class Generations:
    """Rows waiting, being prefilled and decoding; every method runs on the model's thread.
    `release(job)` tells the engine a job no longer waits; `stats` is the engine's."""

    def __init__(self, model, settings: Settings, stats, release):
        self.model, self.stats, self.release = model, stats, release
        self.prefill_chunk, self.max_rows = settings.prefill_chunk, settings.max_rows
        if model.decoder.spec.steps_one_token:  # chunks over a past would run a token at a time: prompts run whole
            self.prefill_chunk = model.package.context_length
        self.feed_tokens = settings.feed_tokens
        self.pending: deque[Row] = deque()  # rows waiting for a slot
        self.partial = None  # (row, its own cache) of a prompt being prefilled in chunks
        self.batch = DecodeBatch(model.decoder, self.max_rows)
        shared = model.decoder.spec.shares_kv_buffer  # prefixes and feeding need the slot pool
        # layer states (a hybrid's): a prompt's end only (states.py)
        self.prefixes = Prefixes(settings.prefix_cache_mb * 2**20 if shared else 0, bool(model.decoder.spec.states))
        self.telemetry = Telemetry(model.package.context_length, self.prefixes.budget > 0)

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.partial or self.batch.rows)

    def add(self, job: Generation) -> None:
        """File a generation's rows (after its prompts' log-probabilities, when it echoes them)."""
        if job.prompt_top is None:
            self.pending.extend(job.rows)
        else:
            self._guarded(job.rows, lambda rows: self._score_prompts(job))

    def _score_prompts(self, job: Generation) -> None:
        job.prompt_scores = prompt_scores(self.model, job.prompts, job.prompt_top, job.prompt_ranks)
        self.pending.extend(job.rows)

    def drop_abandoned(self) -> None:
        """Rows whose client went away leave the queue, the chunked prefill and the batch (each an abort, unless
        it ended already: a failed job's rows)."""
        now, ended = time.monotonic(), self.telemetry.row_ended
        for row in [row for row in self.pending if row.job.cancelled.is_set()]:
            self.pending.remove(row)
            ended(row, "abort", now)
            self.release(row.job)
        if self.partial is not None and self.partial[0].job.cancelled.is_set():
            ended(self.partial[0], "abort", now)
            self.partial = None
        rows = self.batch.rows
        for slot in reversed(range(len(rows))):
            if rows[slot].job.cancelled.is_set():
                ended(rows[slot], "abort", now)
                rows[slot].stop()
                self.batch.leave(slot)
        self.batch.fit()

    def fail_all(self, error: Exception) -> None:
        """Every generation filed fails with `error`."""
        rows = list(self.pending) + list(self.batch.rows) + ([self.partial[0]] if self.partial else [])
        jobs = list({id(row.job): row.job for row in rows}.values())
        self.telemetry.jobs_ended(jobs, "error")
        for job in jobs:
            self.release(job)
            job.abort(error)
        self.pending.clear()
        self.partial = None
        self.batch = DecodeBatch(self.model.decoder, self.max_rows)

    def prefill(self) -> None:
        """Start waiting rows: the next chunk of a long prompt, and short prompts together, each up
        to `prefill_chunk` tokens."""
        chunk, batch = self.prefill_chunk, self.batch
        pictured = next((row for row in self.pending if row.media is not None), None)
        if pictured is not None and self.partial is None and batch.free:
            self.pending.remove(pictured)
            self._starting(pictured)
            self._guarded([pictured], self._prefill_images)
        if self.partial is None:
            long = next((row for row in self.pending if row.media is None and
                         (len(row.prompt) > chunk or self._worth_starting_past(row))), None)
            if long is not None and batch.free:
                self.pending.remove(long)
                self._starting(long)
                cache = self.model.decoder.new_cache(1, len(long.prompt) + 1)
                entry, shared = self.prefixes.hit(long)
                if self._worth_starting_past(long):
                    self.prefixes.use(long, shared)
                    long.prefilled = shared
                    put_row(cache, 0, entry.keys, entry.values, shared, entry.states)
                    cache.longest = cache.seen = shared
                self.partial = (long, cache)
        if self.partial is not None:
            self._guarded([self.partial[0]], self._next_chunk)
        free = batch.free - (self.partial is not None)
        short, tokens = [], 0
        for row in list(self.pending):
            if len(short) >= (free if batch.shared else min(free, 1)):
                break
            if (row.media is None and len(row.prompt) <= chunk and not self._worth_starting_past(row)
                    and (not short or tokens + len(row.prompt) <= chunk)):
                self.pending.remove(row)
                short.append(row)
                tokens += len(row.prompt)
        if short:
            for row in short:
                self._starting(row)
            self._guarded(short, self._prefill_short)

    def _worth_starting_past(self, row: Row) -> bool:
        """Whether a prompt starts past its cached prefix in a run of its own (the rest in chunks):
        when the prefix is at least a block and at least half of the prompt. A shorter one runs
        whole, batched with other prompts."""
        shared = self.prefixes.hit(row)[1]
        return shared >= BLOCK and 2 * shared >= len(row.prompt)

    def feed(self) -> None:
        """Waiting prompts with at most `feed_tokens` left to run past their cached prefix join the
        running batch now: its decode steps run their prompt a token each (no separate model call,
        no padding), then generate. Only while rows decode, into a shared-buffer batch."""
        if not (self.batch.rows and self.batch.shared):
            return
        for row in list(self.pending):
            if not self.batch.free:
                return
            entry, shared = self.prefixes.hit(row)
            if row.media is None and len(row.prompt) - shared <= self.feed_tokens:
                self.pending.remove(row)
                self._starting(row)
                self.prefixes.use(row, shared)
                self.batch.join_prefix(row, entry, shared)

    def _starting(self, row: Row) -> None:
        job = row.job
        row.started_at = time.monotonic()
        self.release(job)
        if not row.sampling.greedy and row.sampling.seed is not None:
            row.generator = torch.Generator(self.model.device).manual_seed(row.sampling.seed + row.copy)

    def _next_chunk(self, rows: list[Row]) -> None:
        """One chunk of the long prompt being prefilled; its row starts when the prompt is done."""
        row, cache = self.partial
        logits = self.batch.prefill_chunk(row, cache, self.prefill_chunk)
        self.stats.prefills += 1
        if row.prefilled == len(row.prompt):
            self.partial = None
            self._start(rows, logits, cache)

    def _prefill_images(self, rows: list[Row]) -> None:
        logits, cache = self.batch.prefill_images(self.model, rows[0])
        self.stats.prefills += 1
        self._start(rows, logits, cache)

    def _prefill_short(self, rows: list[Row]) -> None:
        logits, cache = self.batch.prefill(rows)
        self.stats.prefills += 1
        self._start(rows, logits, cache)

    def _start(self, rows: list[Row], logits: torch.Tensor, cache) -> None:
        """Each prefilled row takes its first token; those not done with it join the decode batch.
        Their prompts' KV go to the prefix cache."""
        if self.prefixes.budget:
            for i, row in enumerate(rows):
                if row.media is not None:
                    continue
                self.prefixes.add(row.prompt, [k[i] for k in cache.keys], [v[i] for v in cache.values],
                                  [state[i] for state in cache.states.current])
        for i, row in enumerate(self._accept(rows, logits)):
            if not row.finished and not row.job.cancelled.is_set():
                self.batch.join(cache, i, row)

    def decode(self) -> None:
        """A decode step of the batch; the rows it finished leave the batch before their answers go
        out (so that a client reading /metrics after its answer sees its row gone)."""
        batch, done = self.batch, []
        rows = list(batch.rows)
        self._guarded(rows, lambda rows: self._stepped(rows, *batch.step(), done))
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(rows)
        self.stats.largest_decode_batch = max(self.stats.largest_decode_batch, len(rows))
        for slot in reversed(range(len(batch.rows))):
            if batch.rows[slot].finished:
                batch.leave(slot)
        batch.fit()
        for row in done:
            self._finish(row)

    def _stepped(self, rows: list[Row], choosing: list[int], logits: torch.Tensor, done: list[Row]) -> None:
        """After a decode step: rows feeding their prompt move on (the last prompt token's logits
        are the row's first choice, and its prompt's KV goes to the prefix cache); the rows in
        `choosing` choose from their `logits`, those that finish added to `done`."""
        for slot, row in enumerate(rows):
            if row.feeding:
                row.prefilled += 1
                self.stats.fed_tokens += 1
                if not row.feeding and self.prefixes.budget:  # the step ran its last prompt token
                    self.prefixes.add(row.prompt, *self.batch.row_kv(slot),
                                      [state[slot] for state in self.batch.pool.states.current])
        if choosing:
            self._accept([rows[slot] for slot in choosing], logits[: len(choosing)], done)

    def _accept(self, rows: list[Row], logits: torch.Tensor, done: list[Row] | None = None) -> list[Row]:
        """Each row takes its next token chosen from its logits `[rows, V]`; a finished row's job is told
        at once, or where `done` is given, the row is added to it for the caller to tell."""
        chosen = choose_tokens(rows, logits)
        now = time.monotonic()
        for row, (token, logprob, top) in zip(rows, chosen):
            row.accept(token, logprob, top)
            if not row.exhausted:  # it took the token
                self.telemetry.token(row, now)
            if not row.finished:
                continue
            if done is None:
                self._finish(row)
            else:
                done.append(row)
        return rows

    def _finish(self, row: Row) -> None:
        """Tell a finished row's job (its last row: counted before its answer goes out)."""
        now = time.monotonic()
        self.telemetry.row_ended(row, row.text.finish_reason, now)
        if row.job.unfinished == 1:
            self.stats.count(row.job.kind, 1)
            self.stats.items += len(row.job.prompts)
            self.telemetry.answered(row.job, now)
        row.job.row_done()

    def _guarded(self, rows: list[Row], work) -> None:
        """Run `work(rows)`; if it fails, every job with a row in it fails (500), and a failed
        decode step empties the batch (its cache is in an unknown state)."""
        try:
            work(rows)
        except Exception as e:  # noqa: BLE001  the engine goes on with the other jobs
            broken = any(row in self.batch.rows for row in rows)  # the batch's cache: state unknown
            jobs = list({id(row.job): row.job for row in rows + (self.batch.rows if broken else [])}.values())
            log.exception("generation failed for %d requests", len(jobs))
            self.stats.failed += len(jobs)
            if broken:  # before the answers go out: a client that has its 500 finds its row gone in /metrics
                self.batch = DecodeBatch(self.model.decoder, self.max_rows)
            self.telemetry.jobs_ended(jobs, "error")
            for job in jobs:
                job.abort(e)  # its other rows leave at the next pass
