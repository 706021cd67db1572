"""A closed-loop load generator for `ortmodule serve`: N clients on threads, each sending the next
request of a list as soon as its previous answer is in, for a fixed time, on 127.0.0.1 only.
Every answer is checked; the result counts what was sent, answered, correct and refused, and
gives latency percentiles and throughput per kind of request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx


@dataclass(frozen=True)
class Call:
    """One request of the mix: its kind (for the statistics), route, body, and a check of the
    answer's JSON that returns None when it is right, else what is wrong."""

    kind: str
    path: str
    body: dict
    check: Callable[[dict], str | None]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(url: str, calls: list[Call], clients: int = 32, seconds: float = 30.0) -> dict:
    """Run the mix from `clients` threads for `seconds`; return the counts and latencies."""
    if urlparse(url).hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"the load generator runs on the loopback interface only, not {url}")
    lock = threading.Lock()
    latencies: dict[str, list[float]] = {}
    counts = {"sent": 0, "answered": 0, "correct": 0, "refused": 0, "failed": 0, "prompt_tokens": 0,
              "completion_tokens": 0}
    wrong: list[str] = []
    stop_at = time.monotonic() + seconds

    def client(number: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            i = number
            while time.monotonic() < stop_at:
                call = calls[i % len(calls)]
                i += clients
                start = time.perf_counter()
                with lock:
                    counts["sent"] += 1
                try:
                    response = http.post(call.path, json=call.body)
                except httpx.HTTPError as e:
                    with lock:
                        counts["failed"] += 1
                        wrong.append(f"{call.kind}: {type(e).__name__}: {e}")
                    continue
                elapsed = time.perf_counter() - start
                answer = response.json() if response.status_code == 200 else {}
                problem = call.check(answer) if response.status_code == 200 else None
                with lock:
                    for key in ("prompt_tokens", "completion_tokens"):
                        counts[key] += answer.get("usage", {}).get(key, 0)
                    if response.status_code == 503:
                        counts["refused"] += 1
                        continue
                    counts["answered"] += 1
                    if response.status_code != 200:
                        wrong.append(f"{call.kind}: HTTP {response.status_code} {response.text[:200]}")
                    elif problem:
                        wrong.append(f"{call.kind}: {problem}")
                    else:
                        counts["correct"] += 1
                        latencies.setdefault(call.kind, []).append(elapsed)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - began
    kinds = {kind: {"requests": len(v), "p50_ms": 1000 * percentile(v, 0.5), "p99_ms": 1000 * percentile(v, 0.99),
                    "per_s": len(v) / wall} for kind, v in sorted(latencies.items())}
    every = [x for v in latencies.values() for x in v]
    return {**counts, "clients": clients, "seconds": wall, "wrong": wrong[:20], "kinds": kinds,
            "p50_ms": 1000 * percentile(every, 0.5), "p99_ms": 1000 * percentile(every, 0.99),
            "per_s": len(every) / wall, "completion_tokens_per_s": counts["completion_tokens"] / wall,
            "prompt_tokens_per_s": counts["prompt_tokens"] / wall}
