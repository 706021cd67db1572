"""The fixtures' exports forked from a process that imported the exporters once.

A tiny fixture's export by onnxruntime-genai's model builder is mostly the builder's imports (torch,
transformers and the builder's own: 8 of its 9 s on a 2-vCPU AMD EPYC, Zen 1), and a fresh fixture
cache exports about 60 of them. `run` runs an exporter's `[python, "-c", script, *arguments]` command
(`ortmodule.exporter.builder_command`, the fixtures' mobius command) in a child forked from a process
that imported PRELOAD once (a "zygote", started at the first export and ended with this process):
the command's own process still (an export leaves nothing behind for the next one), its arguments,
environment and working folder this process's, its output kept, and a failure the ExportError
`ortmodule.exporter.run_subprocess` raises. Where the zygote cannot answer, the command runs as a
subprocess of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

from ortmodule.exporter import EXPORT_ENV, exit_error, run_subprocess

PRELOAD = ("torch", "transformers", "onnx", "onnxruntime_genai.models.builder", "mobius.__main__")
# The longest an export may take before the zygote and its child are killed (SmolLM2-135M's int4 export
# takes about 2 minutes on 2 vCPUs), and the zygote's imports.
TIMEOUT_SECONDS = 1800
START_SECONDS = 600

# The zygote: imports what it is given and says it is ready; then for each job line on stdin forks a child
# that runs the job's script as `python -c` would (its output into the job's log file), and answers its
# exit status.
ZYGOTE = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            nothing = os.open(os.devnull, os.O_RDONLY)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.dup2(nothing, 0)
            os.close(log)
            os.close(nothing)
            os.environ.clear()
            os.environ.update(job["env"])
            os.chdir(job["cwd"])
            sys.argv = ["-c", *job["arguments"]]
            try:
                exec(compile(job["script"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""

_lock = threading.Lock()
_zygotes: list[subprocess.Popen] = []


def run(command: list[str], what: str) -> None:
    """Run `command`, `[python, "-c", script, *arguments]`, in a child of the zygote; raise the
    ExportError of `ortmodule.exporter.exit_error` if it fails."""
    if len(command) < 3 or command[1] != "-c":
        raise ValueError(f"preloaded.run takes [python, '-c', script, *arguments], not {command[:2]}")
    with _lock, tempfile.TemporaryDirectory(prefix="ortmodule-export-") as folder:
        log = Path(folder) / "output"
        job = {"script": command[2], "arguments": command[3:], "log": str(log), "cwd": os.getcwd(),
               "env": dict(os.environ, **EXPORT_ENV)}
        code = _answer(job)
        if code is None:  # no zygote: the command in a process of its own
            run_subprocess(command, what, progress=False)
            return
        text = log.read_text(errors="replace") if log.is_file() else ""
        output = "\n".join(deque((line for line in text.splitlines() if line.strip()), maxlen=40))
    if code == "timeout":
        raise exit_error(what, command, -signal.SIGKILL, f"{output}\n(killed after {TIMEOUT_SECONDS} s)")
    if code != 0:
        raise exit_error(what, command, code, output)


def _answer(job: dict) -> int | str | None:
    """The job's exit status from the zygote (started if need be), "timeout" where it ran past
    TIMEOUT_SECONDS (the zygote and its child killed), or None where no zygote answers."""
    zygote = _started()
    if zygote is None:
        return None
    try:
        zygote.stdin.write(json.dumps(job) + "\n")
        zygote.stdin.flush()
        answer = _line(zygote, TIMEOUT_SECONDS)
    except OSError:  # it had ended
        answer = ""
    if answer and answer.strip():
        return int(answer)
    _stop(zygote)
    return "timeout" if answer is None else None


def _started() -> subprocess.Popen | None:
    """The running zygote, started if need be; None where it does not start."""
    if _zygotes and _zygotes[0].poll() is None:
        return _zygotes[0]
    _zygotes.clear()
    try:
        # -u: its children's stdout and stderr are the zygote's, unbuffered as an exporter's own process
        # has them (EXPORT_ENV), so that a failure's output keeps its lines' order
        zygote = subprocess.Popen([sys.executable, "-u", "-c", ZYGOTE, *PRELOAD], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  start_new_session=True)  # its children in its process group
    except OSError:
        return None
    if _line(zygote, START_SECONDS) != "ready\n":
        _stop(zygote)
        return None
    _zygotes.append(zygote)
    return zygote


def stop() -> None:
    """End the zygote, if one runs (the next export starts another)."""
    with _lock:
        for zygote in list(_zygotes):
            _stop(zygote)


def _stop(zygote: subprocess.Popen) -> None:
    """Kill the zygote and the child it runs."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(zygote.pid, signal.SIGKILL)
    zygote.wait()
    _zygotes.clear()


def _line(zygote: subprocess.Popen, seconds: float) -> str | None:
    """The zygote's next line ("" where it ended), or None after `seconds` without one."""
    ready, _, _ = select.select([zygote.stdout], [], [], seconds)
    return zygote.stdout.readline() if ready else None
