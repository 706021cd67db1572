"""lm-eval through `ortmodule serve` against `--model ortmodule` in-process, on the demo's real model.

    python examples/lm_eval_server.py

Starts `ortmodule serve` on the demo's SmolLM2-135M-Instruct package (exported by examples/demo.py
if it is not there yet), runs ortmodule's general-knowledge tasks (multiple choice and generation,
40 questions each) through lm-eval's `local-completions` backend against it, then the same tasks
with `--model ortmodule` in the same process, and prints both tables, the largest loglikelihood
difference, how many generated answers are identical, and both times.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
import lm_eval
from demo import TASKS, prepare
from lm_eval.utils import make_table

import ortmodule.lm_eval  # noqa: F401  (registers the ortmodule backend)
from ortmodule import tasks


def start_server(package: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ortmodule", "serve", str(package), "--port", str(port),
               "--name", "smollm2"]
    print("$", " ".join(command), flush=True)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit("ortmodule serve did not start")
        time.sleep(0.2)


def samples(result: dict, task: str) -> list[dict]:
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


def main() -> None:
    package, _ = prepare("fp32")
    task_manager = tasks.task_manager(TASKS)
    context = ortmodule.read_package(package).context_length
    server, url = start_server(package)
    try:
        start = time.perf_counter()
        remote = lm_eval.simple_evaluate(
            model="local-completions", tasks=TASKS, task_manager=task_manager, log_samples=True, verbosity="ERROR",
            model_args=f"base_url={url}/v1/completions,model=smollm2,tokenizer={package},tokenizer_backend=huggingface,"
                       f"tokenized_requests=True,max_length={context},num_concurrent=8")
        remote_time = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(30)
    start = time.perf_counter()
    local = lm_eval.simple_evaluate(model="ortmodule", model_args=f"pretrained={package}", batch_size=8,
                                    device="cpu", tasks=TASKS, task_manager=task_manager, log_samples=True,
                                    verbosity="ERROR")
    local_time = time.perf_counter() - start
    print(f"\nlm-eval --model local-completions (ortmodule serve, {url}/v1/completions):")
    print(make_table(remote))
    print("lm-eval --model ortmodule (in-process, batch 8):")
    print(make_table(local))
    largest = max(abs(float(a[0]) - float(b[0]))
                  for x, y in zip(samples(local, TASKS[0]), samples(remote, TASKS[0]))
                  for a, b in zip(x["filtered_resps"], y["filtered_resps"]))
    pairs = list(zip(samples(local, TASKS[1]), samples(remote, TASKS[1])))
    same = sum(x["resps"] == y["resps"] for x, y in pairs)
    print(f"Largest loglikelihood difference: {largest:.2e}; identical generated answers: {same} of {len(pairs)}")
    print(f"Time for both tasks: through the server {remote_time:.1f} s, in-process {local_time:.1f} s")


if __name__ == "__main__":
    main()
