"""The engine: one thread that owns the model, one scheduler over the job protocol (jobs.py).

Routes hand it checked, tokenized jobs (`submit`); the model's thread loops:

1. take the jobs that arrived, drop those whose client went away;
2. run waiting one-shot jobs (scores, prompt log-probabilities), oldest first, up to
   `token_budget` prompt tokens, each class's jobs in one call;
3. prefill waiting rows into free slots of the decode batch, up to `prefill_chunk` tokens: short
   prompts together in one run, a long one alone in fixed chunks (the same chunks under load as
   alone, so its numbers do not depend on what else runs);
4. run one decode step of every running row, each with its own settings, and take out the rows
   that finished.

So a request joins the running batch at the next step and leaves it when done (continuous
batching); a short request never waits for a long stream's end. Greedy output is what the request
gives alone: rows do not interact in a step. Failures fail the jobs they touched (500), and the
engine goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..inputs import Rows, eos_token_ids, pad_right, to_device
from .errors import ServingError, busy
from .jobs import Generation, Job, OneShot, Row, choose_tokens, prompt_scores
from .prefixes import BLOCK, Prefixes
from .settings import Settings

log = logging.getLogger("ortmodule.serving")


class PackageFiles:
    """The package's files as the server found them at start. ONNX Runtime maps the weights: a
    file rewritten in place would give wrong numbers silently (or end the process), so every run
    is preceded by a check that nothing changed (a stat of each file, microseconds)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.seen = self._stat()
        self.changed: str | None = None

    def _stat(self) -> dict[str, tuple]:
        out = {}
        for path in sorted(self.root.iterdir()):
            if path.is_file():
                info = path.stat()
                out[path.name] = (info.st_size, info.st_mtime_ns, info.st_ino)
        return out

    def check(self) -> None:
        """ServingError 503 when a file of the package changed since the start (and from then on)."""
        if self.changed is None:
            now = self._stat()
            names = sorted(set(now) ^ set(self.seen) | {n for n in now if n in self.seen and now[n] != self.seen[n]})
            if names:
                self.changed = ", ".join(names)
                log.error("the package's files changed on disk since the server started: %s", self.changed)
        if self.changed is not None:
            raise ServingError(f"the model's files changed on disk since the server started ({self.changed}); "
                               "its answers cannot be trusted: restart the server", status=503)


@dataclass
class Stats:
    """What the engine has done; `GET /metrics` returns it with the queue's state."""

    requests: dict[str, int] = field(default_factory=dict)  # answered, per kind of job
    items: int = 0  # prompts answered
    batches: dict[str, int] = field(default_factory=dict)  # model calls of one-shot jobs, per kind
    largest_batch: dict[str, int] = field(default_factory=dict)  # one-shot jobs run in one call, per kind
    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)  # per kind: jobs per call -> calls
    prefills: int = 0  # runs that started rows (a long prompt's chunks counted once each)
    seconds: dict[str, float] = field(default_factory=dict)  # the model thread's time per phase
    decode_steps: int = 0
    decoded_rows: int = 0  # rows run over all decode steps (their mean: decoded_rows / decode_steps)
    fed_tokens: int = 0  # prompt tokens run in decode steps (a token per step, past a cached prefix)
    largest_decode_batch: int = 0
    abandoned: int = 0  # jobs whose client went away before their answer
    failed: int = 0
    rejected_bad: int = 0
    rejected_busy: int = 0

    def count(self, kind: str, jobs: int, table: str = "requests") -> None:
        counts = getattr(self, table)
        counts[kind] = counts.get(kind, 0) + jobs


class DecodeBatch:
    """The running rows: one KV cache of `max_rows` slots, the first `len(rows)` in use. A row
    joins by a copy of its prefilled KV into the next slot; a row that leaves is replaced by the
    last one (a copy of one row), so the rows in use stay the cache's first rows and one step runs
    exactly them. Packages whose attention concatenates (not GroupQueryAttention) run one row."""

    def __init__(self, decoder, max_rows: int):
        self.decoder = decoder
        self.shared = decoder.spec.shares_kv_buffer
        self.max_rows = max_rows if self.shared else 1
        self.rows: list[Row] = []
        self.pool = decoder.new_cache(self.max_rows, 256) if self.shared else None
        self.view = None  # the pool's first rows, remade when the rows or the buffers change
        self.context = decoder.package.context_length

    @property
    def free(self) -> int:
        return self.max_rows - len(self.rows)

    def join(self, cache, index: int, row: Row) -> None:
        """Row `index` of the prefilled `cache` goes into the next slot."""
        self._join(row, [k[index] for k in cache.keys] if self.shared else None,
                   [v[index] for v in cache.values] if self.shared else None, row.cached, cache)

    def join_prefix(self, row: Row, entry, shared: int) -> None:
        """`row` goes into the next slot holding the first `shared` tokens of its prompt, copied from
        a cached prefix `entry` (or none, with `shared` 0); its decode steps run the rest of its
        prompt, a token each, then generate."""
        row.prefilled = shared
        self._join(row, entry.keys if entry else [], entry.values if entry else [], shared, None)

    def _join(self, row: Row, keys, values, length: int, cache) -> None:
        slot = len(self.rows)
        if not self.shared:
            self.pool = cache
        else:
            self.pool.reserve(length + 1, self.context)
            for mine, theirs in ((self.pool.keys, keys), (self.pool.values, values)):
                for buffer, source in zip(mine, theirs):
                    buffer[slot, :, :length] = source[:, :length]
            self.pool.lengths[slot] = length
        self.rows.append(row)
        self.view = None

    def row_kv(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The KV buffers of the row in `slot`, per layer `[kv_heads, capacity, head_size]` (views)."""
        return [k[slot] for k in self.pool.keys], [v[slot] for v in self.pool.values]

    def leave(self, slot: int) -> None:
        last = len(self.rows) - 1
        if self.shared and slot != last:
            length = self.rows[last].cached
            for buffers in (self.pool.keys, self.pool.values):
                for buffer in buffers:
                    buffer[slot, :, :length] = buffer[last, :, :length]
            self.pool.lengths[slot] = self.pool.lengths[last]
        self.rows[slot] = self.rows[last]
        self.rows.pop()
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

    def prefill_chunk(self, row: Row, cache, chunk: int) -> torch.Tensor:
        """The next `chunk` tokens of a long prompt into its own one-row `cache`: the logits after
        the last of them, `[1, V]`. Chunks start at multiples of `chunk`, whatever else runs."""
        decoder = self.decoder
        start = row.prefilled
        end = min(start + chunk, len(row.prompt))
        piece = to_device(torch.tensor([row.prompt[start:end]]), decoder.device)
        last = torch.tensor([end - start - 1], device=decoder.device)
        if start == 0:
            logits = decoder.prefill(Rows(piece, None, torch.tensor([end], device=decoder.device), end), last, cache)
        else:
            logits = decoder.step(piece, cache, last)
        row.prefilled = end
        return logits

    def step(self) -> torch.Tensor:
        """Run every row's next input (its last token, or the next of a prompt being fed): logits `[rows, V]`."""
        rows = self.rows
        if self.shared:
            longest = max(row.cached for row in rows)  # the step adds one
            self.pool.reserve(longest + 1, self.context)
            if self.view is None or self.view.version != self.pool.version:
                self.view = self.pool.first_rows(len(rows), longest)
            cache = self.view
        else:
            cache = self.pool
        tokens = to_device(torch.tensor([[row.next_input] for row in rows]), self.decoder.device)
        return self.decoder.step(tokens, cache).view(len(rows), -1)


class Inbox:
    """The jobs the routes hand over, taken by the model's thread. An idle engine that takes a
    one-shot job waits `window` seconds for more (up to `token_budget` tokens) to batch with it."""

    def __init__(self, window: float, token_budget: int):
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.window, self.token_budget = window, token_budget

    def put(self, job: Job | None) -> None:
        self.queue.put(job)

    def take(self, block: bool) -> list[Job] | None:
        """The jobs waiting (at least one when `block`); None when told to stop."""
        jobs: list[Job] = []
        try:
            job = self.queue.get(block=block)
        except queue.Empty:
            return jobs
        deadline = time.monotonic() + (self.window if block and isinstance(job, OneShot) else 0)
        while job is not None:
            jobs.append(job)
            left = deadline - time.monotonic()
            gathering = left > 0 and sum(j.tokens for j in jobs if isinstance(j, OneShot)) < self.token_budget
            try:
                job = self.queue.get(timeout=left) if gathering else self.queue.get_nowait()
            except queue.Empty:
                return jobs
        return jobs or None  # told to stop (Engine.stop also sets its flag)


class Waiting:
    """Requests admitted and not yet running (being tokenized, or queued), at most `limit`."""

    def __init__(self, limit: int):
        self.limit, self.count, self.lock = limit, 0, threading.Lock()

    def add(self) -> bool:
        with self.lock:
            if self.count >= self.limit:
                return False
            self.count += 1
            return True

    def remove(self, job: Job | None) -> None:
        """One fewer (a job counts once, however often it is released)."""
        with self.lock:
            if job is None or job.waiting:
                self.count -= 1
                if job is not None:
                    job.waiting = False


class Engine:
    """The model's thread and its scheduler. `submit` from the event loop; everything else runs
    on the model's thread."""

    def __init__(self, model, settings: Settings):
        self.model = model
        self.token_budget, self.prefill_chunk = settings.token_budget, settings.prefill_chunk
        self.max_rows, self.window = settings.max_rows, settings.window_ms / 1000
        self.join_steps, self.steps = settings.join_steps, 0  # decode steps run so far
        self.files = PackageFiles(model.package.root)
        self.eos = set(eos_token_ids(model.generation_config.eos_token_id))
        self.stats = Stats()
        self.inbox = Inbox(self.window, self.token_budget)
        self.waiting = Waiting(settings.max_queue)
        self.oneshots: deque[OneShot] = deque()
        self.pending: deque[Row] = deque()  # rows waiting for a slot (a long one may be part-prefilled)
        self.partial = None  # (row, its own cache) of a long prompt being prefilled in chunks
        self.batch: DecodeBatch | None = None
        self.feed_tokens = settings.feed_tokens
        shared = model.decoder.spec.shares_kv_buffer  # prefixes and feeding need the slot pool
        self.prefixes = Prefixes(settings.prefix_cache_mb * 2**20 if shared else 0)
        self.thread: threading.Thread | None = None
        self.stopping = False

    # ---- from the event loop ------------------------------------------------------------------

    def admit(self) -> None:
        """Count a request about to be tokenized against the queue's limit (ServingError 503 when full)."""
        if not self.waiting.add():
            self.stats.rejected_busy += 1
            raise busy(self.waiting.count)

    def release(self, job: Job | None = None) -> None:
        """A request admitted is no longer waiting (it runs, was refused, or its client left)."""
        self.waiting.remove(job)

    def submit(self, job: Job) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="ortmodule-model", daemon=True)
            self.thread.start()
        self.inbox.put(job)

    def stop(self) -> None:
        self.stopping = True
        self.inbox.put(None)

    # ---- the model's thread -------------------------------------------------------------------

    def _run(self) -> None:
        if self.batch is None:
            self.batch = DecodeBatch(self.model.decoder, self.max_rows)
        with torch.inference_mode():
            while not self.stopping:
                self._take(block=not (self.oneshots or self.pending or self.partial or self.batch.rows))
                try:
                    self.files.check()
                except ServingError as e:
                    self._fail_all(e)
                    continue
                self._drop_abandoned()
                if self.oneshots and self._due(self.oneshots[0], sum(job.tokens for job in self.oneshots),
                                               self.token_budget):
                    self._timed("oneshot", self._run_oneshots)
                if self.batch.rows and self.pending and self.batch.free and self.batch.shared:
                    self._feed()
                if self.batch.free and (self.partial or self.pending and self._due(
                        self.pending[0].job, len(self.pending), self.batch.free)):
                    self._timed("prefill", self._prefill)
                if self.batch.rows:
                    self._timed("decode", self._decode)

    def _fail_all(self, error: Exception) -> None:
        """Every job filed fails with `error`; the engine keeps taking (and refusing) new ones."""
        rows = list(self.pending) + list(self.batch.rows) + ([self.partial[0]] if self.partial else [])
        for job in list(self.oneshots) + list({id(row.job): row.job for row in rows}.values()):
            self.release(job)
            job.abort(error)
        self.oneshots.clear()
        self.pending.clear()
        self.partial = None
        self.batch = DecodeBatch(self.model.decoder, self.max_rows)

    def _due(self, oldest: Job, queued: int, enough: int) -> bool:
        """Whether waiting work starts now. Each model call streams every weight once (on a CPU that
        alone is a few tens of ms), so while rows decode, new work waits up to `join_steps` steps
        for more to start with it, unless there is `enough` already."""
        return not self.batch.rows or queued >= enough or self.steps - oldest.arrived >= self.join_steps

    def _timed(self, phase: str, work) -> None:
        start = time.perf_counter()
        work()
        self.stats.seconds[phase] = self.stats.seconds.get(phase, 0.0) + time.perf_counter() - start

    def _take(self, block: bool) -> None:
        """File the jobs that arrived (waiting for one when idle)."""
        jobs = self.inbox.take(block)
        if jobs is None:
            self.stopping = True
            return
        for job in jobs:
            job.arrived = self.steps
            if isinstance(job, OneShot):
                self.oneshots.append(job)
            elif job.prompt_top is not None:  # echo: the prompts' log-probabilities first
                self._guarded(job.rows, lambda rows, job=job: self._score_prompts(job))
            else:
                self.pending.extend(job.rows)

    def _score_prompts(self, job: Generation) -> None:
        job.prompt_scores = prompt_scores(self.model, job.prompts, job.prompt_top)
        self.pending.extend(job.rows)

    def _drop_abandoned(self) -> None:
        for jobs in (self.oneshots, self.pending):
            gone = [j for j in jobs if (j.job if isinstance(j, Row) else j).cancelled.is_set()]
            for item in gone:
                jobs.remove(item)
                job = item.job if isinstance(item, Row) else item
                self.release(job)
        if self.partial is not None and self.partial[0].job.cancelled.is_set():
            self.partial = None
        rows = self.batch.rows
        for slot in reversed(range(len(rows))):
            if rows[slot].job.cancelled.is_set():
                rows[slot].stop()
                self.batch.leave(slot)

    def _run_oneshots(self) -> None:
        """The oldest one-shot jobs up to the token budget (at least one), each class in one call."""
        taken, tokens = [], 0
        while self.oneshots and (not taken or tokens + self.oneshots[0].tokens <= self.token_budget):
            job = self.oneshots.popleft()
            taken.append(job)
            tokens += job.tokens
        by_class: dict[type, list] = {}
        for job in taken:
            self.release(job)
            by_class.setdefault(type(job), []).append(job)
        for kind, jobs in by_class.items():
            self.run_together(kind, jobs)

    def run_together(self, kind: type, jobs: list[OneShot]) -> None:
        name = kind.kind
        start = time.perf_counter()
        try:
            results = kind.run_together(self.model, jobs)
        except Exception as e:  # noqa: BLE001  a failed batch fails its jobs; the engine goes on
            log.exception("a batch of %d %s failed", len(jobs), name)
            self.stats.failed += len(jobs)
            for job in jobs:
                job.fail(e)
            return
        for job, result in zip(jobs, results):
            job.resolve(result)
        self.stats.count(name, len(jobs))
        self.stats.count(name, 1, "batches")
        self.stats.largest_batch[name] = max(self.stats.largest_batch.get(name, 0), len(jobs))
        sizes = self.stats.batch_sizes.setdefault(name, {})
        sizes[len(jobs)] = sizes.get(len(jobs), 0) + 1
        self.stats.items += sum(len(job.prompts) for job in jobs)
        log.debug("%d %s jobs in one call: %.1f ms", len(jobs), name, 1000 * (time.perf_counter() - start))

    # ---- generation ---------------------------------------------------------------------------

    def _prefill(self) -> None:
        """Start waiting rows: the next chunk of a long prompt, and short prompts together, each up
        to `prefill_chunk` tokens."""
        chunk, batch = self.prefill_chunk, self.batch
        if self.partial is None:
            long = next((row for row in self.pending if len(row.prompt) > chunk or self._worth_starting_past(row)),
                        None)
            if long is not None and batch.free:
                self.pending.remove(long)
                self._starting(long)
                cache = self.model.decoder.new_cache(1, len(long.prompt) + 1)
                entry, shared = self._hit(long)
                if self._worth_starting_past(long):
                    self._used_prefix(shared)
                    long.prefilled = shared
                    for mine, theirs in ((cache.keys, entry.keys), (cache.values, entry.values)):
                        for buffer, source in zip(mine, theirs):
                            buffer[0, :, :shared] = source[:, :shared]
                    cache.lengths[0], cache.longest, cache.seen = shared, shared, shared
                self.partial = (long, cache)
        if self.partial is not None:
            self._guarded([self.partial[0]], self._next_chunk)
        free = batch.free - (self.partial is not None)
        short, tokens = [], 0
        for row in list(self.pending):
            if len(short) >= (free if batch.shared else min(free, 1)):
                break
            if (len(row.prompt) <= chunk and not self._worth_starting_past(row)
                    and (not short or tokens + len(row.prompt) <= chunk)):
                self.pending.remove(row)
                short.append(row)
                tokens += len(row.prompt)
        if short:
            for row in short:
                self._starting(row)
            self._guarded(short, self._prefill_short)

    def _hit(self, row: Row) -> tuple:
        """The cached prefix of the row's prompt (looked up once): (entry, tokens to reuse, at
        most all but the last)."""
        if row.prefix is None:
            entry, shared = self.prefixes.find(row.prompt) if self.prefixes.budget else (None, 0)
            row.prefix = (entry, min(shared, len(row.prompt) - 1))
        return row.prefix

    def _worth_starting_past(self, row: Row) -> bool:
        """Whether a prompt starts past its cached prefix in a run of its own (the rest in chunks):
        when the prefix is at least a block and at least half of the prompt. A shorter one runs
        whole, batched with other prompts."""
        shared = self._hit(row)[1]
        return shared >= BLOCK and 2 * shared >= len(row.prompt)

    def _used_prefix(self, shared: int) -> None:
        if shared:
            self.prefixes.hits += 1
            self.prefixes.reused += shared

    def _feed(self) -> None:
        """Waiting prompts with at most `feed_tokens` left to run past their cached prefix join the
        running batch now: its decode steps run their prompt a token each (no separate model call,
        no padding), then generate."""
        for row in list(self.pending):
            if not self.batch.free:
                return
            entry, shared = self._hit(row)
            if len(row.prompt) - shared <= self.feed_tokens:
                self.pending.remove(row)
                self._starting(row)
                self._used_prefix(shared)
                self.batch.join_prefix(row, entry, shared)

    def _starting(self, row: Row) -> None:
        job = row.job
        self.release(job)
        if not row.sampling.greedy and row.sampling.seed is not None:
            row.generator = torch.Generator(self.model.device).manual_seed(row.sampling.seed)

    def _next_chunk(self, rows: list[Row]) -> None:
        """One chunk of the long prompt being prefilled; its row starts when the prompt is done."""
        row, cache = self.partial
        logits = self.batch.prefill_chunk(row, cache, self.prefill_chunk)
        self.stats.prefills += 1
        if row.prefilled == len(row.prompt):
            self.partial = None
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
                self.prefixes.add(row.prompt, [k[i] for k in cache.keys], [v[i] for v in cache.values])
        for i, row in enumerate(self._accept(rows, logits)):
            if not row.finished and not row.job.cancelled.is_set():
                self.batch.join(cache, i, row)

    def _decode(self) -> None:
        batch = self.batch
        rows = list(batch.rows)
        self._guarded(rows, lambda rows: self._stepped(rows, batch.step()))
        self.stats.decode_steps += 1
        self.steps += 1
        self.stats.decoded_rows += len(rows)
        self.stats.largest_decode_batch = max(self.stats.largest_decode_batch, len(rows))
        for slot in reversed(range(len(batch.rows))):
            if batch.rows[slot].finished:
                batch.leave(slot)

    def _stepped(self, rows: list[Row], logits: torch.Tensor) -> None:
        """After a decode step: rows feeding their prompt move on (the last prompt token's logits
        are the row's first choice, and its prompt's KV goes to the prefix cache); the rest choose."""
        choosing = []
        for slot, row in enumerate(rows):
            if row.feeding:
                row.prefilled += 1
                self.stats.fed_tokens += 1
                if row.feeding:
                    continue
                if self.prefixes.budget:
                    self.prefixes.add(row.prompt, *self.batch.row_kv(slot))
            choosing.append(slot)
        if len(choosing) == len(rows):
            self._accept(rows, logits)
        elif choosing:
            self._accept([rows[i] for i in choosing], logits[torch.tensor(choosing, device=logits.device)])

    def _accept(self, rows: list[Row], logits: torch.Tensor) -> list[Row]:
        """Each row takes its next token chosen from its logits `[rows, V]`."""
        for row, (token, logprob, top) in zip(rows, choose_tokens(rows, logits)):
            row.accept(token, logprob, top)
            if row.finished and row.job.unfinished == 0:
                self.stats.count(row.job.kind, 1)
                self.stats.items += len(row.job.prompts)
        return rows

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
            for job in jobs:
                job.abort(e)  # its other rows leave at the next pass
            if broken:
                self.batch = DecodeBatch(self.model.decoder, self.max_rows)
