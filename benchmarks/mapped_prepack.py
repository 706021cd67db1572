"""ONNX Runtime's packed weights saved to disk and mapped at load, on a CPU: the measurement behind
ortmodule/mapped.py (`ORTMODULE_MAP_PACKED_WEIGHTS=1`; docs/measurements.md, session 41), with raw
sessions, so that each way's memory is the session's own.

On a CPU, ONNX Runtime packs a session's float MatMul weights into a copy of its own at load (as
large as the weights: ortmodule's main session on SmolLM2-135M fp32 holds ~620 MB of process memory
for it), and ortmodule's extend session, which keeps no packed copy (session 15's memory choice),
packs them again at every run (`Costs.extend_fixed`: 80 ms a run on SmolLM2-135M, 180 ms on a 0.6B
model). ONNX Runtime (1.21 on) can write the packed copies beside an optimized graph
(`session.save_external_prepacked_constant_initializers`) and map them from that file at the next
load, as file pages shared with the page cache instead of the process's own memory. Each way runs
in a fresh process, so that its memory is its own:

- `main, packed at load`: the package's graph as ONNX Runtime loads it (what ortmodule's main session does);
- `main, packed copy mapped`: the same graph saved once with its packed weights, loaded from that file;
- `extend, not packed` / `extend, packed copy mapped`: ortmodule's extend graph (16 new tokens a row
  over a 64-token prefix) as ortmodule loads it, and saved with its packed weights.

    python benchmarks/mapped_prepack.py                 # the real SmolLM2-135M fp32 package
    python benchmarks/mapped_prepack.py --rows 16

Reported: load seconds, the process's own (anonymous) and file-backed resident memory after the
load and after the runs, a run's best time, and the largest difference of the logits from the
first way's.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

from ortmodule import OrtModelForCausalLM, extend, runtime
from ortmodule.costs import _best_time
from ortmodule.inputs import Rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

SAVE = {"session.save_external_prepacked_constant_initializers": "1",
        "session.optimized_model_external_initializers_min_size_in_bytes": "1024"}


def memory() -> dict:
    status = Path("/proc/self/status").read_text()
    def mb(key: str) -> int:
        return int(status.split(f"{key}:")[1].split()[0]) // 1024
    return {"anon_mb": mb("RssAnon"), "file_mb": mb("RssFile")}


def options(save_to: Path | None = None) -> ort.SessionOptions:
    """ortmodule's own session options (spinning as runtime.make_session sets them), and where
    asked, the optimized graph and its packed weights written to `save_to`."""
    chosen = ort.SessionOptions()
    chosen.log_severity_level = 3
    for key, value in runtime.SPINNING:
        chosen.add_session_config_entry(key, value)
    if save_to is not None:
        chosen.optimized_model_filepath = str(save_to)
        data_file = "session.optimized_model_external_initializers_file_name"
        chosen.add_session_config_entry(data_file, save_to.name + ".data")
        for key, value in SAVE.items():
            chosen.add_session_config_entry(key, value)
    return chosen


def main_way(package: Path, mapped: Path | None, rows: int) -> dict:
    """The package graph's prefill of `rows` x 128 tokens (logits at every position), loaded as it is or
    from `mapped` (its optimized copy with the packed weights)."""
    start = time.perf_counter()
    session = ort.InferenceSession(str(mapped or package / "model.onnx"), options(), providers=["CPUExecutionProvider"])
    loaded, after_load = time.perf_counter() - start, memory()
    ids = torch.randint(4, 40000, (rows, 128), generator=torch.Generator().manual_seed(0))
    feeds = {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy()}
    for name in (i.name for i in session.get_inputs()):
        if name.startswith("past_key_values"):
            feeds[name] = torch.zeros(rows, 3, 0, 64).numpy()
    out = {}
    seconds = _best_time(lambda: out.update(logits=session.run(["logits"], feeds)[0]), torch.device("cpu"))
    return {"load_s": loaded, "after_load": after_load, "run_s": seconds, "after_runs": memory(),
            "logits": torch.from_numpy(out["logits"][:, -1]).tolist()}


def extend_way(package: Path, save_to: Path | None, mapped: Path | None, rows: int) -> dict:
    """ortmodule's extend run of `rows` x 16 new tokens over a 64-token prefix, in the extend session
    as ortmodule makes it (no packed copy), or from `mapped`; with `save_to`, the graph and its packed
    weights are written there first."""
    model = OrtModelForCausalLM.from_pretrained(package)
    decoder = model.decoder
    data = extend.extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem, 64, False)
    start = time.perf_counter()
    if save_to is not None:  # written with the packed weights, then read back as a later process would
        ort.InferenceSession(data, _with_folder(options(save_to), package), providers=["CPUExecutionProvider"])
    if mapped is not None or save_to is not None:
        ort_session = ort.InferenceSession(str(mapped or save_to), options(), providers=["CPUExecutionProvider"])
        session = runtime.Session(ort_session)
    else:
        session = runtime.make_session(data, decoder.device, package, prepack=False)
    loaded, after_load = time.perf_counter() - start, memory()
    extender = extend.Extender(decoder, session)
    prefix = torch.randint(4, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    past = decoder.new_cache(1, 64)
    decoder.prefill(Rows(prefix, None, torch.full((1,), 64), 64), torch.full((1,), 63), past)
    cache = decoder.new_cache(rows, 64 + extender.room(16))
    cache.start_from(past, torch.zeros(rows, dtype=torch.int64), torch.full((rows,), 64), 64)
    tokens = torch.randint(4, 40000, (rows, 16), generator=torch.Generator().manual_seed(1))
    index = torch.arange(rows) * 16 + 15
    out = {}
    seconds = _best_time(lambda: out.update(logits=extender.run(tokens, cache, index)), torch.device("cpu"))
    return {"load_s": loaded, "after_load": after_load, "run_s": seconds, "after_runs": memory(),
            "logits": out["logits"].tolist()}


def _with_folder(chosen: ort.SessionOptions, package: Path) -> ort.SessionOptions:
    chosen.add_session_config_entry(runtime.EXTERNAL_DATA_FOLDER, str(package.resolve()))
    return chosen


def in_process(argv: list[str]) -> dict:
    """Run one way in a fresh process (its memory its own) and return what it printed."""
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(name: str, found: dict, reference: dict) -> None:
    diff = (torch.tensor(found["logits"]) - torch.tensor(reference["logits"])).abs().max().item()
    loaded, ran = found["after_load"], found["after_runs"]
    print(f"| {name} | {found['load_s']:.2f} | {loaded['anon_mb']} / {loaded['file_mb']} | "
          f"{ran['anon_mb']} / {ran['file_mb']} | {found['run_s'] * 1e3:.1f} | {diff:.2g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--one", nargs=4, metavar=("KIND", "PACKAGE", "SAVE", "MAPPED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        kind, package, save, mapped = args.one
        optional = {"save": Path(save) if save != "-" else None, "mapped": Path(mapped) if mapped != "-" else None}
        found = (main_way(Path(package), optional["mapped"], args.rows) if kind == "main"
                 else extend_way(Path(package), optional["save"], optional["mapped"], args.rows))
        print(json.dumps(found))
        return
    package = fixtures.build(fixtures.SMOLLM2).package_dir
    rows = ["--rows", str(args.rows)]
    with tempfile.TemporaryDirectory() as folder:
        saved_main, saved_extend = Path(folder) / "main.onnx", Path(folder) / "extend.onnx"
        ort.InferenceSession(str(package / "model.onnx"), options(saved_main), providers=["CPUExecutionProvider"])
        print(f"SmolLM2-135M fp32; ONNX Runtime {ort.__version__}; {args.rows} rows; the packed "
              f"copies written: {sum(p.stat().st_size for p in Path(folder).glob('main.onnx*')) >> 20} MB (main graph)")
        print("| way | load s | after load: own / file MB | after runs: own / file MB | run ms | logits vs first |")
        print("|---|---|---|---|---|---|")
        first = in_process(["--one", "main", str(package), "-", "-", *rows])
        report("main, packed at load", first, first)
        report("main, packed copy mapped", in_process(["--one", "main", str(package), "-", str(saved_main), *rows]),
               first)
        unpacked = in_process(["--one", "extend", str(package), "-", "-", *rows])
        report("extend, not packed (16 new tokens a row)", unpacked, unpacked)
        in_process(["--one", "extend", str(package), str(saved_extend), "-", *rows])  # writes it
        report("extend, packed copy mapped", in_process(["--one", "extend", str(package), "-", str(saved_extend),
                                                        *rows]), unpacked)


if __name__ == "__main__":
    main()
