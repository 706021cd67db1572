"""Packed weights mapped from a file, on a CPU (opt-in: `ORTMODULE_MAP_PACKED_WEIGHTS=1`).

ONNX Runtime packs a CPU session's float MatMul weights into a copy of its own at load, as large as
the weights (about 600 MB of the process's own memory for SmolLM2-135M in fp32), and ortmodule's
extend session, which keeps no packed copy, packs them again at every run. ONNX Runtime can write
the packed copies beside an optimized graph (`session.save_external_prepacked_constant_initializers`)
and map them from there at a later load, as file pages shared with the page cache. `source` writes
such an entry once per graph, weights, machine and ONNX Runtime version, in ortmodule's cache folder
(`packed`), and gives the graph to load instead; docs/usage.md, "Packed weights mapped from disk"
(benchmarks/mapped_prepack.py: the main session's own memory 897 -> 294 MB, the extend run 160 ->
110 ms on SmolLM2-135M fp32, logits equal).

Float weights only (MatMul's packing): a graph with quantized weights (MatMulNBits, ...) is loaded
as it is (ONNX Runtime 1.31 maps an 8-bit MatMulNBits' saved packing wrong: NaN logits).

An entry holds the weights themselves, so its key follows the weight files' identity (device, inode,
size, modification and change times of every file beside the graph), not only the graph's content:
a package exported again, with the same graph file over new weights, gets a new entry.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from . import cache_folder, graph

logger = logging.getLogger("ortmodule")

SWITCH = "ORTMODULE_MAP_PACKED_WEIGHTS"
SAVE = {"session.save_external_prepacked_constant_initializers": "1",
        "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
        "session.optimized_model_external_initializers_file_name": "graph.onnx.data"}
ENTRY_VERSION = "1"
# Free disk left after an entry is written: an entry never fills the disk to its last gigabyte.
HEADROOM = 10**9


def wanted() -> bool:
    return os.environ.get(SWITCH, "0").strip().lower() in ("1", "true", "yes", "on")


def entries() -> Path:
    """Where the entries are: ortmodule's cache folder's `packed`."""
    return graph.cache_home() / "packed"


def source(model: Path | bytes, weights_folder: Path | None, options: ort.SessionOptions,
           settings: tuple[tuple[str, str], ...]) -> Path | None:
    """The optimized graph with its packed weights to load instead of `model` (a file, or graph bytes
    whose weights are in `weights_folder`), written first where it is not in the cache yet with
    `options` (ortmodule's own, for graph bytes with their weights' folder set; `settings`, what in
    them the packed layout depends on); None where it cannot be (a folder that cannot be written,
    too little disk, a graph ONNX Runtime does not save), with the reason logged: the caller then
    loads `model` as it is."""
    if isinstance(model, bytes) and weights_folder is None:
        return None  # weights inside the bytes: nothing beside them to key an entry on
    folder = Path(weights_folder) if weights_folder is not None else Path(model).parent
    try:
        entry = entries() / f"{folder.name}-{key(model, folder, settings)}"
        if (entry / "complete").is_file():  # only ever written for float weights
            cache_folder.touch(entry / "complete")  # its last use, for `ortmodule cache clear --older-than`
            return entry / "graph.onnx"
        quantized = quantized_ops(model)
        if quantized:
            logger.info("ortmodule: not mapping %s's packed weights: its graph has %s (float weights only)", folder,
                        ", ".join(sorted(quantized)))
            return None
        entry.parent.mkdir(parents=True, exist_ok=True)
        needed, free = 2 * _bytes_beside(model, folder) + HEADROOM, shutil.disk_usage(entry.parent).free
        if free < needed:
            logger.warning("ortmodule: not mapping packed weights: %d MB free in %s, %d MB wanted (twice the weights "
                           "and %g GB); packing them in memory", free // 10**6, entry.parent, needed // 10**6,
                           HEADROOM / 1e9)
            return None
        logger.info("ortmodule: writing %s's packed weights to %s (once; about twice the weights)", folder, entry)
        _write_entry(model, options, entry)
    except Exception as e:  # noqa: BLE001  OSError, ONNX Runtime's own types: loaded as it is instead
        logger.warning("ortmodule: cannot map %s's packed weights from %s (%s); packing them in memory",
                       folder, entries(), " ".join(str(e).split())[:300])
        return None
    return entry / "graph.onnx"


# Ops over quantized weights. ONNX Runtime 1.31 maps an 8-bit MatMulNBits' saved packing wrong (an
# int8 export's logits came out NaN: tests/test_export.py, with the mapping on); only float weights
# (MatMul's packing, measured in benchmarks/mapped_prepack.py) are mapped.
QUANTIZED_OPS = {"MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul",
                 "GatherBlockQuantized", "QMoE", "MatMulBnb4", "QAttention", "QGemm"}


def quantized_ops(model: Path | bytes) -> set[str]:
    """The ops over quantized weights (`QUANTIZED_OPS`) in a graph file or serialized graph."""
    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
    return {node.op_type for node in proto.graph.node} & QUANTIZED_OPS


def _write_entry(model: Path | bytes, options: ort.SessionOptions, entry: Path) -> None:
    """The entry written into a folder of its own, then renamed into place (atomic: a reader sees a
    whole entry or none; where another process finished first, its entry stays)."""
    partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        _write(model, options, partial)
        (partial / "complete").write_text("")
        partial.rename(entry)
    except OSError:
        if not (entry / "complete").is_file():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def unusable(entry_graph: Path, error: Exception) -> None:
    """An entry ONNX Runtime could not load (damaged on disk): removed, with a warning; the caller
    loads the package's graph instead."""
    logger.warning("ortmodule: the packed weights at %s cannot be loaded (%s); removed, packing in memory",
                   entry_graph.parent, " ".join(str(error).split())[:300])
    shutil.rmtree(entry_graph.parent, ignore_errors=True)


def _write(model: Path | bytes, options: ort.SessionOptions, into: Path) -> None:
    """A session over `model` (its options the caller's: for graph bytes, with their weights' folder)
    that writes its optimized graph and packed weights into `into`."""
    options.optimized_model_filepath = str(into / "graph.onnx")
    for name, value in SAVE.items():
        options.add_session_config_entry(name, value)
    ort.InferenceSession(model if isinstance(model, bytes) else os.fspath(model), options,
                         providers=["CPUExecutionProvider"])
    if not (into / "graph.onnx").is_file():
        raise RuntimeError("ONNX Runtime wrote no optimized graph")


def key(model: Path | bytes, folder: Path, settings: tuple[tuple[str, str], ...]) -> str:
    """The graph's content, the identity of every file beside it (the weights), the settings, the
    CPU (its packed layouts follow its features) and ONNX Runtime's version."""
    digest = hashlib.sha256(model if isinstance(model, bytes) else graph.file_digest(model).encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"|{path.name}:{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:"
                      f"{stat.st_ctime_ns}".encode())
    digest.update(f"|{sorted(settings)}|{cpu_identity()}|{ort.__version__}|{ENTRY_VERSION}".encode())
    return digest.hexdigest()[:32]


def _bytes_beside(model: Path | bytes, folder: Path) -> int:
    graph_size = len(model) if isinstance(model, bytes) else Path(model).stat().st_size
    return graph_size + sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and "data" in p.name)


def cpu_identity() -> str:
    """The CPU's model name, and a digest of its feature flags where Linux gives them (a VM's model
    name can be the same generic "Intel(R) Xeon(R) Processor" on CPUs with and without AMX)."""
    name, flags = cpu_info()
    return f"{name} (flags {hashlib.sha256(flags.encode()).hexdigest()[:8]})" if flags else name


def cpu_info() -> tuple[str, str]:
    """The CPU's model name and its feature flags as Linux lists them ('' where it does not)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    found = dict(line.split(":", 1) for line in lines if line.startswith(("model name", "flags")) and ":" in line)
    named = {name.strip(): value.strip() for name, value in found.items()}
    return named.get("model name") or platform.processor() or platform.machine(), named.get("flags", "")

