"""One command for the benchmark suite: run it, keep the JSON, write the page.

    python benchmarks/run.py --size cpu    # -> benchmarks/results/cpu.json, docs/benchmarks.md
    python benchmarks/run.py --size gpu    # -> benchmarks/results/gpu.json, docs/benchmarks-gpu.md

The JSON is kept in the repository beside the page it makes (benchmarks/results/); the page is
rendered from every JSON of its size there (benchmarks/report.py, PAGES). With `--json` elsewhere
the page is rendered from that run alone; to commit such a page, put its JSON in
benchmarks/results/ (SIZE*.json, the older ones of that size removed) and check with
`python benchmarks/report.py --check`.

Extra arguments go to pytest (for example `-k lm_eval` for one workload).
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description="run the benchmark suite and write its page")
    parser.add_argument("--size", default="cpu", choices=["cpu", "gpu", "smoke"])
    parser.add_argument("--json", help="where the pytest-benchmark JSON goes (default benchmarks/results/SIZE.json)")
    parser.add_argument("--out", help="the page (default docs/benchmarks.md for cpu, docs/benchmarks-gpu.md for gpu, "
                                      "none for smoke)")
    args, pytest_args = parser.parse_known_args()
    json_path = Path(args.json or report.RESULTS / f"{args.size}.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    page = args.out or (report.PAGES[args.size][0] if args.size in report.PAGES else None)
    command = [sys.executable, "-m", "pytest", str(ROOT / "benchmarks"), "--benchmark-only", "-q", "-rx",
               f"--bench-size={args.size}", f"--benchmark-json={json_path}", *pytest_args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env)

    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        process.send_signal(signal.SIGTERM)  # where it did not reach pytest too (benchmarks/conftest.py)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    try:
        returncode = process.wait()
    except KeyboardInterrupt:
        # Ctrl-C, SIGTERM or `timeout` reached pytest too: it stops the running test and
        # pytest-benchmark still writes the JSON of the rows that finished, so wait for it.
        print("interrupted: the rows that finished are kept", flush=True)
        returncode = process.wait()
    print(f"suite finished in {time.perf_counter() - start:.0f} s (exit {returncode})", flush=True)
    if not json_path.is_file() or not json_path.stat().st_size:  # stopped before pytest-benchmark wrote a row
        print(f"no row finished, so no page written (and {json_path} is not a result)", flush=True)
        json_path.unlink(missing_ok=True)
        sys.exit(returncode or 1)
    if page is None:  # smoke: shapes too small to time, no page
        sys.exit(returncode)
    if not args.out and json_path.parent.resolve() == report.RESULTS.resolve():
        Path(page).write_text(report.render_page(args.size))  # from every JSON of this size kept there
    else:  # a JSON elsewhere (e.g. a lent machine's output folder): the page of this run alone
        Path(page).write_text(report.render([__import__("json").loads(json_path.read_text())], args.size) + "\n")
    print(f"wrote {page}")
    sys.exit(returncode)


if __name__ == "__main__":
    main()
