"""`ortmodule run-batch`: a file of requests in OpenAI's batch format (the Batch API's JSONL, as `vllm run-batch`
reads it) run through the server's own routes in this process, with no port opened, and the answers written in
the input's order.

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`; each
output line `{"id": ..., "custom_id": ..., "response": {"status_code": ..., "request_id": ..., "body": ...},
"error": ...}`, vLLM's shape: a refused request has the status, a null body and the server's error answer as
`error`. The lines are checked before the package loads (a bad line, every one named, stops the run); the
requests then run through the app (httpx's ASGI transport) as concurrent clients, so the engine batches them as it
batches a server's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("ortmodule.serving")

# The routes a line may name: the app's POST routes that answer a request (not /ping, /flush_cache).
BATCH_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/score", "/generative_scoring", "/generate", "/tokenize",
                "/detokenize")
LINE_KEYS = ("custom_id", "method", "url", "body")
SHOWN_PROBLEMS = 10  # bad lines named in the error; the rest counted
UPLOAD_TRIES, UPLOAD_WAIT_S = 5, 5.0  # as vLLM's run-batch retries its PUT


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One checked line. Its body is read again from the line's text when it is sent: a body is many Python
    objects, and a file of 100,000 short chats (34 MB) held 172 MB parsed, 69 MB as lines."""

    line: int  # 1-based, in the input
    custom_id: str
    url: str
    text: str  # the line
    model: str | None = None  # the body's model, where it is a string
    ignored: tuple = ()  # the line's other keys

    @property
    def body(self) -> dict:
        return json.loads(self.text)["body"]


def is_url(name: str) -> bool:
    return name.startswith(("http://", "https://"))


def read_input(name: str) -> str:
    """The input file's text: a path, `-` (standard input) or an http(s) URL (GET)."""
    if name == "-":
        return sys.stdin.read()
    if is_url(name):
        import httpx

        try:
            answer = httpx.get(name, follow_redirects=True, timeout=60)
            answer.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"cannot read the input file {name}: {_first_line(e)}") from None
        return answer.text
    try:
        return Path(name).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the input file {name}: {e}") from None


def parse_requests(text: str) -> list[BatchRequest]:
    """The input's requests, blank lines skipped; ValueError naming each bad line (the first ten)."""
    requests, problems = [], []
    # JSON Lines end at "\n" only: str.splitlines would also split a string holding U+2028 or U+0085, which JSON
    # may carry unescaped
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            requests.append(_request(number, line))
        except ValueError as e:
            problems.append(f"line {number}: {e}")
    if problems:
        more = len(problems) - SHOWN_PROBLEMS
        shown = "\n  ".join(problems[:SHOWN_PROBLEMS]) + (f"\n  and {more} more" if more > 0 else "")
        raise ValueError(f"{len(problems)} bad lines in the input (each a JSON object of custom_id, method POST, url "
                         f"and body):\n  {shown}")
    if not requests:
        raise ValueError("the input holds no requests")
    _warn_twice_named(requests)
    if extra := [r for r in requests if r.ignored]:
        log.warning("%d lines hold keys besides %s, ignored (line %d: %s)", len(extra), ", ".join(LINE_KEYS),
                    extra[0].line, ", ".join(extra[0].ignored))
    return requests


def _request(number: int, line: str) -> BatchRequest:
    try:
        value = json.loads(line, parse_constant=_not_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at column {e.colno}") from None
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object is needed, got {type(value).__name__}")
    missing = [key for key in LINE_KEYS if key not in value]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    if not isinstance(value["custom_id"], str):
        raise ValueError(f"custom_id must be a string, got {json.dumps(value['custom_id'])[:40]}")
    if not isinstance(value["method"], str) or value["method"].upper() != "POST":
        raise ValueError(f"method must be POST, got {json.dumps(value['method'])[:40]}")
    if value["url"] not in BATCH_ROUTES:
        raise ValueError(f"url {json.dumps(value['url'])[:80]} is not one this runs; it runs "
                         f"{', '.join(BATCH_ROUTES)}")
    if not isinstance(value["body"], dict):
        raise ValueError(f"body must be a JSON object, got {type(value['body']).__name__}")
    ignored = tuple(sorted(set(value) - set(LINE_KEYS)))
    model = value["body"].get("model")
    url = BATCH_ROUTES[BATCH_ROUTES.index(value["url"])]  # one string for every line naming it
    return BatchRequest(number, value["custom_id"], url, line, model if isinstance(model, str) else None, ignored)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON (Python's json module writes it; JSON has no such number)")


def _warn_twice_named(requests: list[BatchRequest]) -> None:
    """OpenAI's Batch API refuses a custom_id used twice; vLLM runs them: so does this, and says so."""
    seen: dict[str, int] = {}
    twice = [(r.line, seen[r.custom_id]) for r in requests if seen.setdefault(r.custom_id, r.line) != r.line]
    if twice:
        log.warning("%d requests reuse an earlier line's custom_id (line %d reuses line %d's): the answers are in the "
                    "input's order, so match them by position", len(twice), *twice[0])


class Output:
    """Where the answers go: a path (written to PATH.part, renamed when every answer is in), `-` (standard output)
    or an http(s) URL (a file in `tmp_dir`, or the system's, PUT when done). Opened before the package loads, so
    that an output that cannot be written stops the run first. `resume`: a path's PATH.part from a stopped run is
    kept and added to (`kept`: the custom_ids it answers, in order); else it is replaced."""

    def __init__(self, name: str, tmp_dir: str | None = None, resume: bool = False):
        self.name, self.written, self.kept = name, 0, []
        if resume and (name == "-" or is_url(name)):
            raise ValueError("resume continues a local output file's .part file: not standard output or a URL")
        if name == "-":
            self.path, self.file = None, sys.stdout
            return
        if is_url(name):
            import tempfile

            handle, path = tempfile.mkstemp(prefix="ortmodule-batch-", suffix=".jsonl", dir=tmp_dir)
            os.close(handle)
            self.path = Path(path)
        else:
            self.path = Path(name + ".part")
            if resume:
                self.kept = _kept_answers(self.path)
            elif self.path.exists():
                log.warning("%s, an earlier run's answers, is replaced (--resume continues it)", self.path)
        try:
            # line-buffered: each answer is on the disk once written, whatever stops the run
            self.file = open(self.path, "a" if resume else "w", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as e:
            raise ValueError(f"cannot write the output file {name}: {e}") from None
        self.written = len(self.kept)

    def write(self, line: str) -> None:
        self.file.write(line + "\n")
        self.written += 1

    def finish(self) -> None:
        """Every answer is in: the file closed and renamed, or uploaded (and then removed)."""
        if self.path is None:
            self.file.flush()
            return
        self.file.close()
        if is_url(self.name):
            _upload(self.name, self.path)
            self.path.unlink()
        else:
            os.replace(self.path, self.name)

    def abandon(self) -> None:
        """The run stopped early: what was answered stays in the file it was written to."""
        if self.path is None:
            return
        self.file.close()
        if self.written:
            log.warning("stopped: the first %d answers are in %s", self.written, self.path)
        else:
            self.path.unlink(missing_ok=True)


def _kept_answers(path: Path) -> list[str]:
    """The custom_ids a stopped run's PATH.part answers, in order; a last line cut short (the run killed while
    writing it) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    try:
        kept = [json.loads(line)["custom_id"] for line in whole.decode("utf-8").split("\n") if line]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a run's answers ({e!r:.80}): remove it, or run without --resume") from None
    if len(whole) < len(data):
        with open(path, "r+b") as file:
            file.truncate(len(whole))
    return kept


def _upload(url: str, path: Path) -> None:
    import httpx

    for attempt in range(1, UPLOAD_TRIES + 1):
        try:
            with open(path, "rb") as data:
                httpx.put(url, content=data, timeout=1000).raise_for_status()
            return
        except httpx.HTTPError as e:
            if attempt == UPLOAD_TRIES:
                raise ValueError(f"cannot upload the answers to {url} ({attempt} tries): {_first_line(e)}; they are in "
                                 f"{path}") from None
            log.warning("uploading the answers to %s failed (%s); retrying in %g s", url, _first_line(e), UPLOAD_WAIT_S)
            time.sleep(UPLOAD_WAIT_S)


def _first_line(error: Exception) -> str:
    """httpx's message without the line of advice it adds under a status error."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


class MetricsServer:
    """vLLM's `run-batch --enable-metrics`: the engine's Prometheus series (telemetry.py's, vLLM's names) at
    `http://ADDR:PORT/metrics` while the batch runs, in the text format `ortmodule serve`'s `/metrics` answers.
    The port is taken when made (before the package loads: a port in use stops the run first)."""

    def __init__(self, addr: str, port: int):
        import http.server

        from prometheus_client.exposition import generate_latest

        from .telemetry import TEXT_FORMAT

        self.registry = None
        metrics = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  (http.server's name)
                asked = self.path.split("?")[0] == "/metrics"
                ready = asked and metrics.registry is not None
                if ready:
                    body = generate_latest(metrics.registry)
                else:  # the package is loading (503), or another path (404)
                    body = b"the package is loading\n" if asked else b"not found: GET /metrics\n"
                self.send_response(200 if ready else 503 if asked else 404)
                self.send_header("Content-Type", TEXT_FORMAT if ready else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no line per scrape
                pass

        family = socket.AF_INET6 if ":" in addr else socket.AF_INET  # an IPv6 address (::1) as the server's own
        server = type("MetricsHTTPServer", (http.server.ThreadingHTTPServer,), {"address_family": family})
        try:
            self.server = server((addr, port), Handler)
        except (OSError, OverflowError) as e:
            raise ValueError(f"cannot serve metrics on {addr} port {port}: {getattr(e, 'strerror', None) or e}") \
                from None
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="ortmodule-batch-metrics", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def show(self, engine, model_name: str) -> None:
        from .telemetry import registry_of

        self.registry = registry_of(engine, model_name)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Summary:
    """What a run did: answers by HTTP status, the tokens its answers' usage counts, its wall time."""

    statuses: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def count(self, status: int, body) -> None:
        self.statuses[status] += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):  # OpenAI's names, or the Responses and Messages APIs'
            self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
            self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0

    def line(self) -> str:
        done = sum(self.statuses.values())
        failed = done - self.statuses[200]
        by_status = ", ".join(f"{count} x {status}" for status, count in sorted(self.statuses.items()) if status != 200)
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"{done} requests in {self.seconds:.1f} s: {self.statuses[200]} answered, {failed} failed"
                f"{f' ({by_status})' if failed else ''}; {self.prompt_tokens} prompt and {self.completion_tokens} "
                f"completion tokens ({rate:.1f} completion tokens/s)")


def run_requests(app, requests: list[BatchRequest], output: Output, concurrency: int, headers: dict | None = None,
                 progress: bool = True) -> Summary:
    """Each request through `app` (at most `concurrency` at once), its answer line written in the input's order;
    the app's lifespan entered and left around them (the engine stopped after the last)."""
    return asyncio.run(_run(app, requests, output, concurrency, headers or {}, progress))


async def _run(app, requests, output, concurrency, headers, progress) -> Summary:
    import httpx
    from tqdm import tqdm

    summary, done, next_line = Summary(), {}, 0
    gate = asyncio.Semaphore(concurrency)
    interactive = sys.stderr.isatty()
    bar = tqdm(total=len(requests), unit="req", desc="Running batch", disable=not progress, file=sys.stderr,
               mininterval=0.5 if interactive else 5,
               bar_format=None if interactive else "{desc}: {percentage:3.0f}% | {n_fmt}/{total_fmt} "
                                                   "[{elapsed}<{remaining}, {rate_fmt}]\n")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    started = time.perf_counter()
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://batch",
                                                                   headers=headers, timeout=None) as client:

        async def one(index: int, request: BatchRequest) -> None:
            nonlocal next_line
            try:
                status, body, answer = await _answer(client, request)
            finally:
                gate.release()
            summary.count(status, body)
            done[index] = answer
            while next_line in done:  # written in the input's order, as soon as those before are in
                output.write(done.pop(next_line))
                next_line += 1
            bar.update()

        running: set[asyncio.Task] = set()
        try:
            for index, request in enumerate(requests):  # tasks made as the gate lets them run, not all at once
                await gate.acquire()
                task = asyncio.create_task(one(index, request))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            bar.close()
    summary.seconds = time.perf_counter() - started
    return summary


async def _answer(client, request: BatchRequest) -> tuple[int, object, str]:
    """(HTTP status, the answer's body, the output line)."""
    ident, sent = f"ortmodule-batch-{uuid.uuid4().hex}", request.body
    if sent.get("stream"):
        status, body = 400, {"error": {"message": "stream is not taken in a batch: each answer is written whole",
                                       "type": "invalid_request_error", "param": "stream", "code": None}}
    else:
        try:
            reply = await client.post(request.url, json=sent, headers={"x-request-id": ident})
        except Exception as e:  # noqa: BLE001  (one request's failure is its line's, not the batch's)
            reply, status, body = None, 500, {"error": {"message": f"the request failed: {e!r}",
                                                        "type": "server_error", "param": None, "code": None}}
        if reply is not None:
            status = reply.status_code
            try:
                body = reply.json()
            except ValueError:  # an answer that is not JSON (the app's own 500 is text)
                body = reply.text
    ok = status == 200
    line = {"id": f"ortmodule-{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": status, "request_id": ident, "body": body if ok else None},
            "error": None if ok else body}
    return status, body, json.dumps(line)


def run_batch_file(input_file: str, output_file: str, path: str, output_tmp_dir: str | None = None,
                   progress: bool = True, device: str = "cpu", fp32_lm_head: bool = False,
                   prefill_attention: str | None = None, subfolder: str | None = None, revision: str | None = None,
                   chat_template: str | None = None, metrics: tuple[str, int] | None = None, resume: bool = False,
                   **options) -> Summary:
    """`ortmodule run-batch`: the input's lines checked, the output opened, the package at `path` loaded as
    `ortmodule serve` loads it (the same arguments; `options`: the settings' fields), every request run through the
    server's routes and the answers written. `metrics`: (address, port) where the engine's series are served
    meanwhile (`MetricsServer`). `resume`: a stopped run's OUT.part continued, its requests not run again.
    Returns what the run did (its answers by status, their tokens)."""
    from .app import load_app

    local = [name for name in (input_file, output_file) if name != "-" and not is_url(name)]
    if len(local) == 2 and Path(local[0]).resolve() == Path(local[1]).resolve():
        raise ValueError(f"the output file is the input file ({input_file}): the answers would replace the requests")
    requests = parse_requests(read_input(input_file))
    log.info("%d requests read from %s", len(requests), input_file)
    if resume and Path(output_file).exists() and not Path(output_file + ".part").exists():
        log.info("%s is complete: nothing to resume", output_file)
        return Summary()
    output, server = Output(output_file, output_tmp_dir, resume), None
    requests = _after_kept(requests, output)
    if not requests:
        output.finish()
        return Summary()
    try:
        if metrics is not None:  # the port taken before the package loads
            server = MetricsServer(*metrics)
        app, settings = load_app(path, "127.0.0.1", device, fp32_lm_head, prefill_attention, subfolder, revision,
                                 options, chat_template)
        _check_names(requests, app.state.served.name)
        if server is not None:
            server.show(app.state.served.engine, app.state.served.name)
            log.info("metrics at http://%s:%d/metrics while the batch runs", metrics[0], server.port)
        headers = {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        summary = run_requests(app, requests, output, min(2 * settings.max_rows, settings.max_queue), headers,
                               progress)
    except BaseException:
        output.abandon()
        raise
    finally:
        if server is not None:
            server.close()
    output.finish()
    log.info("%s; answers in %s", summary.line(), output_file)
    return summary


def _after_kept(requests: list[BatchRequest], output: Output) -> list[BatchRequest]:
    """The requests a resumed output does not answer yet: those after the ones its kept answers name, in order."""
    kept = output.kept
    if not kept:
        return requests
    first = [r.custom_id for r in requests[:len(kept)]]
    if first != kept:
        at = next((i for i, (a, b) in enumerate(zip(first, kept)) if a != b), len(first))
        output.file.close()  # the .part left as it was
        raise ValueError(f"{output.path} answers other requests than this input's first {len(kept)}: its answer "
                         f"{at + 1} is {kept[at]!r}, the input's request {at + 1} is "
                         f"{first[at] if at < len(first) else None!r}; resume runs the same input")
    log.info("resuming: %d of %d requests are answered in %s", len(kept), len(requests), output.path)
    return requests[len(kept):]


def _check_names(requests: list[BatchRequest], served: str) -> None:
    """A body's `model` must be the served name (else its route answers 404): where every request names another
    model, a ValueError before any runs (the served name is likely not set); where some do, a warning."""
    # a model that is not a string is its route's 400
    others = Counter(r.model for r in requests if r.model is not None and r.model not in ("", served))
    if not others:
        return
    name, count = others.most_common(1)[0]
    flag = f"--served-model-name {shlex.quote(str(name))}"
    message = (f"{sum(others.values())} of {len(requests)} requests name another model than the one served, "
               f"{served!r} ({count} name {name!r}): their answers are 404s; {flag} serves the package under that "
               "name")
    if sum(others.values()) == len(requests):
        raise ValueError(message)
    log.warning(message)
