"""Load generator for `/v1/score`, after SGLang's bench_score: open-loop Poisson arrivals at a
target rate for a bounded time, reporting latency percentiles and items/s.

    python benchmarks/bench_score.py --package PATH --rate 20 --duration 30   # starts `ortmodule serve`
    python benchmarks/bench_score.py --url http://127.0.0.1:30000 --rate 20  # against a running server
    python benchmarks/bench_score.py --fixture cpu --rate 5 --duration 10    # the suite's 50M CPU decoder

Requests are random token ids (no tokenizer needed): a query of `--query-tokens` and `--items`
items of 1 to `--item-tokens` tokens each, `--labels` label ids. Open loop: a request is sent at
its arrival time whatever the state of the earlier ones, so an overloaded server shows as growing
latency and 503s rather than as a slower sender.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev.serve import ServeProcess  # noqa: E402


def make_requests(count: int, vocab: int, query_tokens: int, items: int, item_tokens: int, labels: int, seed: int,
                  exact: bool = False):
    """Request bodies: items of 1 to `item_tokens` tokens, or of exactly `item_tokens` (`exact`, as
    SGLang's bench_score sends them)."""
    rng = random.Random(seed)
    label_ids = rng.sample(range(4, vocab), labels)
    for _ in range(count):
        yield {
            "query": [rng.randrange(4, vocab) for _ in range(query_tokens)],
            "items": [[rng.randrange(4, vocab) for _ in range(item_tokens if exact else rng.randint(1, item_tokens))]
                      for _ in range(items)],
            "label_token_ids": label_ids,
            "apply_softmax": True,
        }


async def run_load(url: str, rate: float, duration: float, requests, timeout: float = 120.0) -> dict:
    """Send `requests` at Poisson arrivals of `rate`/s for `duration` s; wait for every answer."""
    rng = random.Random(0)
    latencies, statuses, items_done = [], {}, 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def send(body):
            nonlocal items_done
            start = time.perf_counter()
            try:
                response = await client.post("/v1/score", json=body)
                status = response.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                latencies.append(time.perf_counter() - start)
                items_done += len(body["items"])

        tasks, begin = [], time.perf_counter()
        next_at = 0.0
        for body in requests:
            next_at += rng.expovariate(rate)
            if next_at > duration:
                break
            await asyncio.sleep(max(0.0, begin + next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(send(body)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
    latencies.sort()

    def percentile(p):
        return round(1000 * latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))], 1) if latencies else None

    return {
        "target_rate": rate,
        "sent": len(tasks),
        "ok": len(latencies),
        "statuses": {str(k): v for k, v in statuses.items()},
        "p50_ms": percentile(50),
        "p90_ms": percentile(90),
        "p99_ms": percentile(99),
        "items_per_s": round(items_done / elapsed, 1),
        "requests_per_s": round(len(latencies) / elapsed, 2),
        "seconds": round(elapsed, 1),
    }


class LocalServer(ServeProcess):
    """`ortmodule serve PATH --device DEVICE EXTRA...` in a child process on a free port of 127.0.0.1."""

    def __init__(self, package: str | Path, device: str = "cpu", extra: list[str] = (), launcher: list[str] = ()):
        """`launcher`: what runs the `ortmodule` command line instead of `python -m ortmodule` (e.g.
        serve_with_extend.py and its two settings)."""
        super().__init__(package, "--device", device, *extra, launcher=launcher)

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics?format=json").json()

    def loop_cpu_seconds(self) -> float | None:
        """CPU seconds the server's main thread (its event loop: HTTP, JSON, validation) has used so
        far; None where /proc is not there to say (Linux only)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/stat").read_text().rsplit(")", 1)[1]
        except OSError:
            return None
        user, system = fields.split()[11:13]  # utime and stime, in clock ticks
        return (int(user) + int(system)) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--package", help="start `ortmodule serve` on this package for the run")
    where.add_argument("--fixture", choices=["cpu", "gpu", "smoke"],
                       help="start `ortmodule serve` on the benchmark suite's decoder of this size (built if needed)")
    parser.add_argument("--device", default="cpu", help="with --package: cpu or cuda")
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--items", type=int, default=10, help="items per request")
    parser.add_argument("--query-tokens", type=int, default=120)
    parser.add_argument("--item-tokens", type=int, default=20, help="items have 1 to this many tokens")
    parser.add_argument("--exact", action="store_true",
                        help="items of exactly --item-tokens tokens (SGLang's bench_score shape)")
    parser.add_argument("--labels", type=int, default=4, help="label token ids per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="with --package or --fixture: an argument for `ortmodule serve` (repeatable), "
                             "e.g. --serve-arg=--prefill-attention=onnx")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)

    def measure(url: str) -> dict:
        vocab = httpx.get(url + "/v1/models").json()["data"][0].get("vocab_size", 4096)
        count = int(args.rate * args.duration * 3) + 10
        bodies = make_requests(count, vocab, args.query_tokens, args.items, args.item_tokens, args.labels, args.seed,
                               args.exact)
        return asyncio.run(run_load(url, args.rate, args.duration, bodies))

    if args.fixture:
        from conftest import SIZES

        from ortmodule_dev import fixtures

        args.package = fixtures.build(next(iter(SIZES[args.fixture]["decoders"].values()))).package_dir
    if args.url:
        result = measure(args.url)
    else:
        with LocalServer(args.package, args.device, args.serve_arg) as server:
            loop_before = server.loop_cpu_seconds()
            result = measure(server.url)
            loop_after = server.loop_cpu_seconds()
            metrics = server.metrics()
            result["server"] = {"groups": metrics["batches"].get("score", 0),
                                "largest_group": metrics["largest_batch"].get("score", 0),
                                "requests": metrics["requests"].get("score", 0)}
            if loop_before is not None and result["ok"]:
                result["server"]["loop_ms_per_request"] = round(1e3 * (loop_after - loop_before) / result["ok"], 2)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
