"""`ortmodule serve` in a child process, for the tests and the benchmarks that talk to it over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import httpx


class ServeProcess:
    """`ortmodule serve PACKAGE ARGS` in a child process on a free port of 127.0.0.1, up once /health
    answers (a context manager: terminated on exit). `launcher`: what runs the `ortmodule` command
    line instead of `python -m ortmodule` (e.g. benchmarks/serve_with_extend.py). Its output goes to
    a file (a pipe nobody reads would stall it once full), read back by `output()`."""

    def __init__(self, package, *args: str, env: dict | None = None, launcher=(), timeout: float = 180):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [*(launcher or [sys.executable, "-m", "ortmodule"]), "serve", str(package), "--port", str(self.port),
                   *args]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115  open for the process's lifetime
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ortmodule serve exited with {self.process.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health").status_code == 200:  # /health needs no key
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"ortmodule serve did not answer /health in {timeout:g} s")
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
