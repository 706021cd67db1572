"""`GET /metrics` in Prometheus' text format: vLLM's series, under vLLM's names, buckets and labels
(`model_name`, `engine`), where the engine does the same thing (so that a dashboard or alert made for vLLM
reads this server unchanged), and the engine's own counters as `ortmodule:` series.

The `vllm:` series count generation rows (a prompt's each choice, as vLLM's child requests: completions,
chat, the Responses and Messages APIs, `/generate`): the times are taken on the model's thread from the
job's arrival (its prompt tokenized, as vLLM's `arrival_time`). One-shot jobs (scores, prompt
log-probabilities) are not generation rows: `ortmodule:requests_total{kind}` and
`ortmodule:request_latency_seconds{kind}` count them, with every other kind of request.
"""

from __future__ import annotations

import bisect
import threading
import time

from fastapi import FastAPI, Request, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from .errors import ServingError

# vLLM's buckets (vllm/v1/metrics/loggers.py)
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
# ortmodule's latency of every kind of request: finer at the low end, where a score request answers
JOB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0,
               30.0, 60.0, 120.0, 300.0, 600.0)
# a row's end, as vLLM's `finished_reason` label names it
FINISHED = {"stop": "stop", "length": "length", "abandoned": "abort", "abort": "abort", "error": "error"}
LABELS = ["model_name", "engine"]
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def add_routes(app: FastAPI, engine, model_name: str) -> None:
    """`GET /metrics`: Prometheus' text format, as vLLM's and SGLang's; the engine's counts as JSON with
    `?format=json` or `Accept: application/json` first."""
    registry = registry_of(engine, model_name)

    @app.get("/metrics")
    async def metrics(request: Request, format: str | None = None):  # noqa: A002  (the query's name)
        if format not in (None, "json", "prometheus"):
            raise ServingError(f"format must be json or prometheus, got {format!r}", "format")
        if format == "json" or format is None and _prefers_json(request.headers.get("accept", "")):
            return engine_counts(engine)
        # Prometheus' text format 0.0.4 to every scraper: prometheus_client's OpenMetrics output renames the samples
        # of a name with a colon (vllm:...) but not its HELP and TYPE lines (prometheus/client_python#1177), which
        # strict parsers reject; Prometheus reads the format the answer names.
        return Response(generate_latest(registry), media_type=TEXT_FORMAT)


def registry_of(engine, model_name: str) -> CollectorRegistry:
    """A registry of the engine's series, for `generate_latest`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def engine_counts(engine) -> dict:
    """The engine's counts and state, as `/metrics?format=json` gives them."""
    prefixes, batch = engine.generations.prefixes, engine.generations.batch
    return {**engine.stats.__dict__, "waiting": engine.waiting.count, "running_rows": len(batch.rows),
            "decode_cache": batch.sizes(), "prefix_cache": {"hits": prefixes.hits, "reused_tokens": prefixes.reused,
                                                            "entries": len(prefixes.entries), "bytes": prefixes.nbytes}}


def _prefers_json(accept: str) -> bool:
    """Whether an Accept header asks for JSON before Prometheus' formats (a scraper names text/plain or
    OpenMetrics; curl's `*/*` gets Prometheus' text, as vLLM's /metrics gives it)."""
    ranked = []
    for i, part in enumerate(accept.split(",")):
        kind, *params = (p.strip() for p in part.split(";"))
        q = next((p[2:] for p in params if p.startswith("q=")), "1")
        try:
            ranked.append((-float(q), i, kind.lower()))
        except ValueError:
            continue
    for _, _, kind in sorted(ranked):
        if kind == "application/json":
            return True
        if kind in ("text/plain", "application/openmetrics-text", "*/*", "text/*"):
            return False
    return False


def buckets_1_2_5(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's token-count buckets, up to the context)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return tuple(bounds)
            bounds.append(m * scale)
        scale *= 10


class Histogram:
    """Counts per bucket and their sum, observed on the model's thread (a few per decode step: no
    allocation) and read at a scrape under a lock, so that a scrape's buckets, count and sum agree."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        """Its series under `values` of `labels`, as a family of its own."""
        return self.add_to(HistogramMetricFamily(name, doc, labels=labels), values)

    def add_to(self, family: HistogramMetricFamily, values: list[str]) -> HistogramMetricFamily:
        """Its series under `values` added to `family`."""
        with self.lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(values, buckets, total)
        return family


class Telemetry:
    """What the generation rows did, in vLLM's terms, and every job's latency. Every method but `collect`'s
    reads runs on the model's thread; a row is counted once, at its first end."""

    def __init__(self, context: int, prefix_caching: bool):
        self.context, self.prefix_caching = context, prefix_caching
        self.prompt_tokens = self.generation_tokens = self.prefix_queries = self.prefix_hits = 0
        self.finished = dict.fromkeys(("stop", "length", "abort", "error"), 0)
        tokens = buckets_1_2_5(context)
        self.first_token, self.inter_token = Histogram(FIRST_TOKEN_BUCKETS), Histogram(INTER_TOKEN_BUCKETS)
        self.times = {name: Histogram(REQUEST_BUCKETS) for name in ("e2e", "queue", "inference", "prefill", "decode")}
        self.counts = {name: Histogram(tokens) for name in ("prompt", "generation", "max_tokens")}
        self.choices = Histogram((1, 2, 5, 10, 20))
        self.jobs: dict[str, Histogram] = {}

    def token(self, row, now: float) -> None:
        """`row` took a token at `now` (time.monotonic): its first (its prompt is in) or the next."""
        if not row.first_at:
            row.first_at = now
            self.first_token.observe(now - row.job.received)
            self.prompt_tokens += len(row.prompt)
            if self.prefix_caching and row.media is None:
                self.prefix_queries += len(row.prompt)
                self.prefix_hits += row.cached_prefix
        else:
            self.inter_token.observe(now - row.last_at)
        row.last_at = now
        self.generation_tokens += 1

    def row_ended(self, row, reason: str, now: float) -> None:
        """`row` ended (finished, left with its client, or failed) at `now`; later calls do nothing."""
        if row.ended:
            return
        row.ended = True
        self.finished[FINISHED.get(reason, "stop")] += 1
        received, times = row.job.received, self.times
        times["e2e"].observe(now - received)
        if row.started_at:
            times["queue"].observe(row.started_at - received)
            times["inference"].observe(now - row.started_at)
            if row.first_at:
                times["prefill"].observe(row.first_at - row.started_at)
                times["decode"].observe(row.last_at - row.first_at)
        self.counts["prompt"].observe(len(row.prompt))
        self.counts["generation"].observe(len(row.tokens))
        self.counts["max_tokens"].observe(row.sampling.max_tokens)
        if row.copy == 0:  # once per prompt: its `n`
            self.choices.observe(row.job.copies)

    def jobs_ended(self, jobs, reason: str) -> None:
        """Every row of `jobs` not ended yet ends now with `reason` ("abort", "error")."""
        now = time.monotonic()
        for job in jobs:
            for row in job.rows:
                self.row_ended(row, reason, now)

    def answered(self, job, now: float) -> None:
        """`job` was answered at `now`: its latency under its kind."""
        histogram = self.jobs.get(job.kind)
        if histogram is None:
            histogram = self.jobs[job.kind] = Histogram(JOB_BUCKETS)
        histogram.observe(now - job.received)


class EngineCollector(Collector):
    """The series of one engine, read at each scrape (prometheus_client's collector protocol)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.values = engine, [model_name, "0"]

    def collect(self):
        engine, values = self.engine, self.values
        telemetry, generations = engine.telemetry, engine.generations
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.", values,
                     len(generations.batch.rows) + (generations.partial is not None))
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", values,
                     engine.waiting.count)
        held = sum(row.cached for row in list(generations.batch.rows))
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (every row of the decode "
                     "batch holding a whole context).", values, held / (generations.max_rows * telemetry.context))
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", values, telemetry.prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", values,
                       telemetry.generation_tokens)
        yield _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                       values, telemetry.prefix_queries)
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", values,
                       telemetry.prefix_hits)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine (none: a row keeps "
                       "its cache until it ends).", values, 0)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, count in telemetry.finished.items():
            success.add_metric([*values, reason], count)
        yield success
        yield from self._histograms(telemetry, values)
        yield from _engine_series(engine, values)

    @staticmethod
    def _histograms(telemetry: Telemetry, values: list[str]):
        yield telemetry.first_token.family("vllm:time_to_first_token_seconds",
                                           "Histogram of time to first token in seconds.", LABELS, values)
        yield telemetry.inter_token.family("vllm:inter_token_latency_seconds",
                                           "Histogram of inter-token latency in seconds.", LABELS, values)
        for name, metric, doc in (("e2e", "e2e_request_latency", "e2e request latency"),
                                  ("queue", "request_queue_time", "time spent in WAITING phase for request"),
                                  ("inference", "request_inference_time", "time spent in RUNNING phase for request"),
                                  ("prefill", "request_prefill_time", "time spent in PREFILL phase for request"),
                                  ("decode", "request_decode_time", "time spent in DECODE phase for request")):
            yield telemetry.times[name].family(f"vllm:{metric}_seconds", f"Histogram of {doc} in seconds.", LABELS,
                                               values)
        for name, metric, doc in (("prompt", "request_prompt_tokens", "Number of prefill tokens processed."),
                                  ("generation", "request_generation_tokens", "Number of generation tokens processed."),
                                  ("max_tokens", "request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.")):
            yield telemetry.counts[name].family(f"vllm:{metric}", doc, LABELS, values)
        yield telemetry.choices.family("vllm:request_params_n", "Histogram of the n request parameter.", LABELS, values)
        latency = HistogramMetricFamily("ortmodule:request_latency_seconds", "Seconds from a request's arrival at the "
                                        "engine (tokenized) to its answer, per kind.", labels=[*LABELS, "kind"])
        for kind, histogram in sorted(telemetry.jobs.items()):
            histogram.add_to(latency, [*values, kind])
        yield latency


def _engine_series(engine, values: list[str]):
    """The engine's own counts (what `/metrics?format=json` gives) as `ortmodule:` series."""
    stats, prefixes = engine.stats, engine.generations.prefixes
    for name, doc, table in (("requests", "Requests answered, per kind.", stats.requests),
                             ("batches", "Model calls of one-shot requests, per kind.", stats.batches)):
        family = CounterMetricFamily(f"ortmodule:{name}", doc, labels=[*LABELS, "kind"])
        for kind, count in sorted(table.items()):
            family.add_metric([*values, kind], count)
        yield family
    for name, doc, count in (("items", "Prompts answered.", stats.items),
                             ("prefills", "Prefill runs (a long prompt's chunks each).", stats.prefills),
                             ("decode_steps", "Decode steps.", stats.decode_steps),
                             ("decoded_rows", "Rows run over all decode steps.", stats.decoded_rows),
                             ("fed_tokens", "Prompt tokens run in decode steps.", stats.fed_tokens),
                             ("reused_prefixes", "Score requests whose query ran once.", stats.reused_prefixes),
                             ("abandoned", "Requests whose client went away before their answer.", stats.abandoned),
                             ("failed", "Requests failed by an error of the model's work.", stats.failed),
                             ("prefix_cache_hits", "Prompts started past a cached prefix.", prefixes.hits),
                             ("prefix_cache_reused_tokens", "Prompt tokens not run thanks to the prefix cache.",
                              prefixes.reused)):
        yield _counter(f"ortmodule:{name}", doc, values, count)
    rejected = CounterMetricFamily("ortmodule:rejected", "Requests refused: bad (4xx) or busy (503).",
                                   labels=[*LABELS, "reason"])
    rejected.add_metric([*values, "bad"], stats.rejected_bad)
    rejected.add_metric([*values, "busy"], stats.rejected_busy)
    yield rejected
    seconds = CounterMetricFamily("ortmodule:model_thread_seconds", "The model thread's seconds per phase.",
                                  labels=[*LABELS, "phase"])
    for phase, spent in sorted(dict(stats.seconds).items()):
        seconds.add_metric([*values, phase], spent)
    yield seconds
    cache = engine.generations.batch.sizes()
    yield _gauge("ortmodule:decode_cache_bytes", "Bytes of the decode batch's KV cache.", values, cache["bytes"])
    yield _gauge("ortmodule:decode_cache_slots", "Rows the decode batch's KV cache holds.", values, cache["slots"])
    yield _gauge("ortmodule:prefix_cache_entries", "Prompts held by the prefix cache.", values, len(prefixes.entries))
    yield _gauge("ortmodule:prefix_cache_bytes", "Bytes held by the prefix cache.", values, prefixes.nbytes)


def _gauge(name: str, doc: str, values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=LABELS)
    family.add_metric(values, value)
    return family


def _counter(name: str, doc: str, values: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=LABELS)
    family.add_metric(values, value)
    return family
