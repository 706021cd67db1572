"""Measured costs kept on disk between processes (`measured`): timing a model's runs (costs.py)
takes about 30 s for SmolLM2-135M and 130 s for a 0.6B model in fp32 on 2 CPU cores, which every
lm-eval run and `ortmodule serve` paid at load. The costs depend on the package's graph, the
machine and ortmodule's settings, not on the process, so they are kept per (graph, machine,
settings, code) in ortmodule's cache folder (a copy of the package in another folder reads them
too: the key holds the graph's content), and each later load checks them with one small timed
prefill (under a second on a CPU): where it runs 1.5x faster or slower than when the costs were
measured (a busy machine then or now, another clock), they are measured again.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import glob
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import onnxruntime as ort
import torch
from tqdm import tqdm

from . import cache_folder, costs, graph, mapped

logger = logging.getLogger("ortmodule")

TOLERANCE = 1.5  # the check's time against the stored one, either way, before the costs are measured again
_FIELDS = costs.Costs._fields


def measured(decoder, refresh: bool = False) -> costs.Costs | None:
    """`costs.measure(decoder)`, or the costs stored for the same graph, machine, settings and
    ortmodule code where one small prefill still takes the time it took when they were measured.
    `refresh`: measure again regardless. The costs go to the decoder's `cache_dir`, else ortmodule's
    cache folder's `costs`; a folder that cannot be written costs a measurement per process, with a
    warning. Processes and threads that ask at once take turns (`cache_folder.exclusive`, one lock per
    device): the first measures, the others then read its costs, and none times its runs beside another's."""
    where = Path(decoder.cache_dir or graph.cache_home() / "costs")
    package = decoder.spec.path.parent
    key = settings_key(decoder)
    entry = where / f"{package.name}-{decoder.spec.path.stem}-{key}.json"

    # Processes that load packages at once (lm-eval's data-parallel ranks, say) time one device one after
    # the other: a timing taken beside another is slowed by it, and the costs of one package are timed once.
    lock = cache_folder.timing_lock(where, device_name(decoder.device))
    with cache_folder.exclusive(lock, f"the costs of {package.name} are read or timed here") as waited_since:
        found_at = entry if refresh or entry.exists() else _copy_of(where, decoder.spec.path.stem, key) or entry
        stored = None if refresh else _read(found_at)
        if stored is not None and _still_true(decoder, found_at, stored, waited_since):
            if found_at == entry:
                cache_folder.touch(entry)  # its last use, for `ortmodule cache clear --older-than`
            else:  # another folder's copy of the same graph: kept under this package's name too
                _write(entry, stored)
            return costs.Costs(**stored["costs"])
        logger.info("ortmodule: timing the runs of %s on %s, from which context sharing is decided (seconds to "
                    "minutes on a CPU; kept in %s for later loads)", package, decoder.device, where)
        start = time.perf_counter()
        with tqdm(total=costs.phases(decoder), desc=f"ortmodule: timing {package.name}'s runs", unit="part") as bar:
            found = costs.measure(decoder, lambda part: (bar.update(), bar.set_postfix_str(f"{part} done")))
        if found is not None:
            record = {"costs": found._asdict(), "check_seconds": costs.check_seconds(decoder),
                      "seconds": round(time.perf_counter() - start, 1), "machine": machine(decoder.device),
                      "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
            _write(entry, record)
    return found


def _copy_of(where: Path, stem: str, key: str) -> Path | None:
    """The newest record of the same graph and settings (the key holds the graph's content, not its path)
    kept under another package folder's name: a package copied (`save_pretrained`, Olive's output folder,
    a Hub revision's snapshot) is not timed again."""
    def modified(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile (`ortmodule cache clear` in another process)
            return -1.0

    return max(where.glob(f"*-{glob.escape(stem)}-{key}.json"), key=modified, default=None)


def _still_true(decoder, entry: Path, stored: dict, waited_since: float | None) -> bool:
    """Whether stored costs hold: measured, or checked, by another process while this one waited for
    it (then the check's prefill would be timed beside that process's own work, which follows at once:
    lm-eval's other ranks scoring), or one small prefill still takes the time it took when they were
    measured."""
    with contextlib.suppress(OSError):
        if waited_since is not None and entry.stat().st_mtime >= waited_since:
            return True
    now = costs.check_seconds(decoder)
    if 1 / TOLERANCE <= now / stored["check_seconds"] <= TOLERANCE:
        return True
    logger.info("ortmodule: a prefill took %.3f s where it took %.3f s when the costs of %s were measured (%s); "
                "measuring them again", now, stored["check_seconds"], decoder.spec.path.parent, stored["measured"])
    return False


def settings_key(decoder) -> str:
    """What the costs depend on: the decoder graph's content, the machine (the CPU's model and the
    cores this process may use, or the GPU), ONNX Runtime's and torch's versions, the caller's
    session and provider options, ortmodule's settings of the decoder, ortmodule's own code, and
    whether the CPU sessions' packed weights are mapped (mapped.py). A 4-bit package's runs are keyed
    by the path they take (nbits.py: `quantized_prefill`'s "auto" resolved, so "auto" and the path it
    chose share their costs, and costs measured on one path are never read for the other)."""
    options = decoder.session_options
    described = None if options is None else [getattr(options, name) for name in (
        "intra_op_num_threads", "inter_op_num_threads", "execution_mode", "graph_optimization_level")]
    parts = [graph.file_digest(decoder.spec.path), machine(decoder.device), ort.__version__, torch.__version__,
             repr(described), repr(sorted((decoder.provider_options or {}).items())), decoder.prefill_chunk,
             f"fp32_path={decoder.fp32_path}", decoder.prefill_attention, head_key(decoder), code_digest(),
             f"mapped={mapped.wanted() and decoder.device.type == 'cpu'}"]  # mapped: no packing in a run
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:32]


def head_key(decoder) -> str:
    """The LM head as it runs, not as it was asked for: `rewrite_lm_head="float32"` (lm-eval's
    default) on a package whose head already multiplies in float32 runs the same graph as True (the
    Python API's and `ortmodule serve`'s default), so their costs are one entry, not two measurements
    of the same runs; a rewrite the graph did not take runs the package's own head."""
    if not decoder.keeps_positions:
        return "package head"
    return "float32 head at kept positions" if graph.has_float32_head(decoder.graph_bytes) else "kept positions"


def device_name(device: torch.device) -> str:
    """"cpu", or "cuda" and the GPU's index: the device whose timings `measured` holds apart."""
    return "cpu" if device.type == "cpu" else f"cuda{device.index if device.index is not None else 0}"


def machine(device: torch.device) -> str:
    """The device as its speed depends on it: the GPU's name, or the CPU's model, flags and usable cores."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{torch.cuda.get_device_name(index)} ({index})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{mapped.cpu_identity()}, {cores} cores"


@functools.cache
def code_digest() -> str:
    """A digest of ortmodule's own modules: costs measured by other code are measured again."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _read(entry: Path) -> dict | None:
    """The stored record, or None: none yet, or (with a warning) one that is not whole."""
    try:
        record = json.loads(entry.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ortmodule: cannot read the measured costs %s (%s); measuring them again", entry, e)
        return None
    numbers = record.get("costs") if isinstance(record, dict) else None
    check = record.get("check_seconds") if isinstance(record, dict) else None
    if (not isinstance(numbers, dict) or set(numbers) != set(_FIELDS) or not _positive(check)
            or not all(_positive(v) or v is None or v == 0 for v in numbers.values())):
        logger.warning("ortmodule: the measured costs %s are damaged or not ortmodule's; measuring them again", entry)
        return None
    return record


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _write(entry: Path, record: dict) -> None:
    """Write atomically; a folder that cannot be written, a warning."""
    error = cache_folder.write_atomically(entry, json.dumps(record, indent=1) + "\n")
    if error is not None:
        logger.warning("ortmodule: cannot keep the measured costs in %s (%s); they are measured at every load",
                       entry.parent, error)
