"""The engine: one thread that owns the model, one scheduler over the job protocol (jobs.py).

Routes hand it checked, tokenized jobs (`submit`); the model's thread loops:

1. take the jobs that arrived, drop those whose client went away;
2. run waiting one-shot jobs (scores, prompt log-probabilities), oldest first, up to
   `token_budget` prompt tokens, each class's jobs in one call;
3. start waiting generations in free slots of the decode batch (generations.py): prompts with a
   few tokens to run past their cached prefix are fed into the running batch, others prefilled
   up to `prefill_chunk` tokens, short ones together, a long one alone in chunks;
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import runtime
from ..inputs import eos_token_ids
from .errors import ServingError, busy
from .generations import Generations
from .jobs import FlushCache, Job, OneShot
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
    reused_prefixes: int = 0  # score requests whose items' common prefix (the query) ran once
    largest_decode_batch: int = 0
    abandoned: int = 0  # jobs whose client went away before their answer
    failed: int = 0
    rejected_bad: int = 0
    rejected_busy: int = 0

    def count(self, kind: str, jobs: int, table: str = "requests") -> None:
        counts = getattr(self, table)
        counts[kind] = counts.get(kind, 0) + jobs


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
        self.token_budget, self.window = settings.token_budget, settings.window_ms / 1000
        self.join_steps, self.steps = settings.join_steps, 0  # decode steps run so far
        self.files = PackageFiles(model.package.root)
        self.eos = set(eos_token_ids(model.generation_config.eos_token_id))
        self.stats = Stats()
        self.inbox = Inbox(self.window, self.token_budget)
        self.waiting = Waiting(settings.max_queue)
        self.oneshots: deque[OneShot] = deque()
        # One-shot calls queued and not yet answered: (class, jobs, finish). On CUDA a pass queues
        # its calls before it answers the previous pass's, whose device work runs meanwhile.
        self.started: list[tuple[type, list[OneShot], Callable[[], list]]] = []
        self.overlaps = model.device.type == "cuda"
        self.generations = Generations(model, settings, self.stats, self.release)
        self.telemetry = self.generations.telemetry  # Prometheus' series (telemetry.py)
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
        generations = self.generations
        with torch.inference_mode():
            while not self.stopping:
                self._take(block=not (self.oneshots or generations.busy or self.started))
                try:
                    self.files.check()
                except ServingError as e:
                    self._fail_all(e)
                    continue
                self._drop_abandoned()
                if self.oneshots and self._due(self.oneshots[0], sum(job.tokens for job in self.oneshots),
                                               self.token_budget):
                    self._timed("oneshot", self._run_oneshots)
                elif self.started:  # nothing to queue behind them: their answers now
                    self._timed("oneshot", self._finish_started)
                batch, pending = generations.batch, generations.pending
                generations.feed()
                if batch.free and (generations.partial or pending and self._due(pending[0].job, len(pending),
                                                                                batch.free)):
                    self._timed("prefill", generations.prefill)
                if generations.batch.rows:
                    self._timed("decode", generations.decode)
                    self.steps += 1
            self._finish_started()

    def _fail_all(self, error: Exception) -> None:
        """Every job filed fails with `error`; the engine keeps taking (and refusing) new ones."""
        for job in self.oneshots:
            self.release(job)
            job.abort(error)
        self.oneshots.clear()
        for _, jobs, _ in self.started:  # queued before the change was seen, maybe run after it
            for job in jobs:
                job.abort(error)
        self.started = []
        self.generations.fail_all(error)

    def _due(self, oldest: Job, queued: int, enough: int) -> bool:
        """Whether waiting work starts now. Each model call streams every weight once (on a CPU that
        alone is a few tens of ms), so while rows decode, new work waits up to `join_steps` steps
        for more to start with it, unless there is `enough` already."""
        return not self.generations.batch.rows or queued >= enough or self.steps - oldest.arrived >= self.join_steps

    def _timed(self, phase: str, work) -> None:
        start = time.perf_counter()
        with runtime.CAPTURES.run(False):  # a phase's CUDA calls between runs never beside another thread's capture
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
            if isinstance(job, FlushCache):
                idle = not (self.oneshots or self.started or self.generations.busy)
                if idle:
                    self.generations.prefixes.clear()
                job.resolve(idle)
            elif isinstance(job, OneShot):
                self.oneshots.append(job)
            else:
                self.generations.add(job)

    def _drop_abandoned(self) -> None:
        for job in [job for job in self.oneshots if job.cancelled.is_set()]:
            self.oneshots.remove(job)
            self.release(job)
        self.generations.drop_abandoned()

    def _run_oneshots(self) -> None:
        """The oldest one-shot jobs up to the token budget (at least one), each class in one call,
        queued; then the answers of the calls queued in the pass before, whose device work ran
        meanwhile (on CUDA: so the device goes from one batch to the next without waiting for the
        host; on a CPU a call's work is done when it returns, and its answers go at once)."""
        taken, tokens = [], 0
        while self.oneshots and (not taken or tokens + self.oneshots[0].tokens <= self.token_budget):
            job = self.oneshots.popleft()
            taken.append(job)
            tokens += job.tokens
        by_class: dict[type, list] = {}
        for job in taken:
            self.release(job)
            by_class.setdefault(type(job), []).append(job)
        started = [(kind, jobs, finish) for kind, jobs in by_class.items()
                   if (finish := self.start_together(kind, jobs)) is not None]
        self._finish_started()
        self.started = started
        if not self.overlaps:
            self._finish_started()

    def start_together(self, kind: type, jobs: list[OneShot]):
        """Queue one call of `jobs` (of class `kind`): the function that finishes it, or None when
        queueing failed (then its jobs have failed)."""
        try:
            return kind.start_together(self.model, jobs)
        except Exception as e:  # noqa: BLE001  a failed batch fails its jobs; the engine goes on
            self._fail_batch(kind, jobs, e)
            return None

    def _fail_batch(self, kind: type, jobs: list[OneShot], error: Exception) -> None:
        log.error("a batch of %d %s failed", len(jobs), kind.kind, exc_info=error)
        self.stats.failed += len(jobs)
        for job in jobs:
            job.fail(error)

    def _finish_started(self) -> None:
        """Answer the calls queued so far (each waits for its own copy to the host)."""
        started, self.started = self.started, []
        for kind, jobs, finish in started:
            try:
                results = finish()
            except Exception as e:  # noqa: BLE001
                self._fail_batch(kind, jobs, e)
                continue
            name = kind.kind
            # Counted before the answers go out: a client that has its answer finds it in /metrics.
            self.stats.count(name, len(jobs))
            self.stats.count(name, 1, "batches")
            self.stats.largest_batch[name] = max(self.stats.largest_batch.get(name, 0), len(jobs))
            sizes = self.stats.batch_sizes.setdefault(name, {})
            sizes[len(jobs)] = sizes.get(len(jobs), 0) + 1
            self.stats.items += sum(len(job.prompts) for job in jobs)
            self.stats.reused_prefixes += sum(job.reused_prefix for job in jobs)
            now = time.monotonic()
            for job, result in zip(jobs, results):
                self.telemetry.answered(job, now)
                job.resolve(result)
