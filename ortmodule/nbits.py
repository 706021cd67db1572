"""4-bit weights on the CPU: which of ONNX Runtime's compute paths runs the runs of many tokens.

The model builder's CPU packages multiply by 4-bit weights with `MatMulNBits` at `accuracy_level`
4: ONNX Runtime quantizes each block of the activations to int8 and multiplies in int8. For a
decode step (one token per row) that is the fast path; for a prefill of hundreds of tokens, on some
CPUs, ONNX Runtime's fp32-compute path over the same 4-bit weights is faster (session config
`mlas.qnbit.force_fp32`, ONNX Runtime 1.31; ONNX Runtime's own advice is a second session for
batched work). Measured on a 2-vCPU Intel Xeon (AVX-512, AMX), SmolLM2-135M's 576 x 1,536 weight:
256 rows 2.08 ms in int8 against 1.21 ms in fp32 (fp32 weights: 1.10 ms); one row 0.021 against
0.062 ms; the two cross between 8 and 32 rows. The real int4 package's prefill of 8 x 620 tokens:
6.8 s against 5.1 s (benchmarks/nbits_paths.py). The fp32 path is no less accurate: against the
fp32 package it was made from, on 4,096 tokens of English prose, KL 0.375 against 0.379
(docs/measurements.md, session 18).

So on the CPU, where a probe of the package's own weight shape finds the fp32 path faster,
ortmodule runs every run of more than one token per row (prefills, chunks, the extend graph) in a
second session with that setting, and decode steps in the package's own. Which path a call takes
depends on the call, never on the batch: a prefill's numbers do not change with what else is in
the batch. (A step of 2 tokens over a cache of several rows is the exception: it runs as two decode
steps, where one run does not pay, decoder.py's `_several_tokens`; 3 or more run in one.) The
paths' numbers differ (up to ~0.7 in a token's log-probability on SmolLM2-135M int4, as int8 and
fp32 arithmetic do); `quantized_prefill="package"` keeps the package's path
everywhere, as onnxruntime-genai runs it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import logging
import time
from pathlib import Path

import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from . import cache_folder, mapped

logger = logging.getLogger("ortmodule")

FORCE_FP32 = "mlas.qnbit.force_fp32"  # ONNX Runtime's session config entry
CHOICES = ("auto", "package", "fp32")
PROBE_ROWS = 256  # a prefill's rows: where the paths differ most
FASTER_BY = 1.1  # the fp32 path must be this much faster to be worth a second session


def checked_choice(value) -> str:
    """A caller's `quantized_prefill`: "auto" (None), "package" or "fp32"."""
    value = "auto" if value is None else value
    if value not in CHOICES:
        raise ValueError(f"quantized_prefill must be one of {', '.join(CHOICES)}, not {value!r}")
    return value


def int8_weight_shape(graph: bytes | Path) -> tuple[int, int] | None:
    """(K, N) of the `MatMulNBits` shape that holds the most weights in all (the MLP's, in a
    decoder) among those ONNX Runtime's fp32 path can take over (4 bits, blocks of 32,
    accuracy_level 4, the int8 path), or None where the graph has none."""
    if isinstance(graph, bytes) and b"MatMulNBits" not in graph:  # a float package: no parse
        return None
    model = onnx.load_from_string(graph) if isinstance(graph, bytes) else onnx.load(graph, load_external_data=False)
    shapes = collections.Counter()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("bits", 4) == 4 and attrs.get("block_size") == 32 and attrs.get("accuracy_level", 0) == 4:
            shapes[attrs["K"], attrs["N"]] += 1
    return max(shapes, key=lambda kn: shapes[kn] * kn[0] * kn[1]) if shapes else None


def probe_graph(k: int, n: int, rows: int | str) -> bytes:
    """One `MatMulNBits` of random 4-bit `k` x `n` weights as the builder writes a CPU package's
    (blocks of 32, accuracy_level 4), over `rows` x `k` activations (`rows` a number or a name)."""
    generator = torch.Generator().manual_seed(0)
    blocks = k // 32
    weights = [numpy_helper.from_array(torch.randint(0, 256, (n, blocks, 16), dtype=torch.uint8,
                                                     generator=generator).numpy(), "b"),
               numpy_helper.from_array((torch.rand(n * blocks, generator=generator) * 0.01).numpy(), "s")]
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=32, accuracy_level=4)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], weights)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def probe_session(model: bytes, fp32: bool, threads: int = 0) -> ort.InferenceSession:
    """A CPU session of `model` in ONNX Runtime's fp32 path for 4-bit weights, or its int8 path
    (`threads`: ONNX Runtime's intra-op threads, 0 for its default)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if fp32:
        options.add_session_config_entry(FORCE_FP32, "1")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@functools.cache
def fp32_path_is_faster(k: int, n: int, rows: int = PROBE_ROWS) -> bool:
    """Whether this CPU runs a `rows` x `k` by 4-bit `k` x `n` product faster in ONNX Runtime's
    fp32 path than in its int8 path (`probe_paths`), kept in ortmodule's cache folder per CPU (its
    model and feature flags), ONNX Runtime version and shape (`costs/nbits-path-*.json`): the choice
    changes the numbers, so a machine takes the same path at every load and an evaluation run twice
    gives the same numbers, where a probe near the edge could choose either way from one process to
    the next; processes loading at once wait for the first one's probe (`cache_folder.exclusive`).
    `ortmodule cache clear costs` probes again at the next load."""
    cpu = mapped.cpu_identity()
    key = "|".join(map(str, (cpu, ort.__version__, k, n, rows, FASTER_BY)))
    entry = cache_folder.cache_home() / "costs" / f"nbits-path-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    # Processes that load the package at once (lm-eval's data-parallel ranks) probe one after the other,
    # the first one only: each of its own probes could choose the other path, and the ranks' numbers differ.
    then = "this CPU's path for 4-bit weights is read or probed here"
    with cache_folder.exclusive(cache_folder.timing_lock(entry.parent, "cpu"), then):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            stored = json.loads(entry.read_text())["fp32_path_is_faster"]
            if isinstance(stored, bool):
                cache_folder.touch(entry)  # its last use, for `ortmodule cache clear --older-than`
                return stored
        faster = probe_paths(k, n, rows)
        record = {"fp32_path_is_faster": faster, "shape": [rows, k, n], "cpu": cpu,
                  "onnxruntime": ort.__version__}
        error = cache_folder.write_atomically(entry, json.dumps(record, indent=1) + "\n")
    if error is not None:
        logger.info("ortmodule: cannot keep the 4-bit path chosen for this CPU in %s (%s)", entry.parent, error)
    return faster


def probe_paths(k: int, n: int, rows: int = PROBE_ROWS) -> bool:
    """Time both paths once (random weights; ~60 ms). The two paths' runs alternate, on one thread
    each, and the best of five runs of each is compared: the choice changes the numbers, so it must
    not follow the machine's momentary load (timed on all threads, one path after the other, a busy
    core beside the probe could make the int8 path win on a CPU where the fp32 path is 1.7x faster,
    and a run's numbers then differed from the last run's)."""
    model = probe_graph(k, n, rows)
    x = {"x": torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).numpy()}
    sessions = [probe_session(model, fp32, threads=1) for fp32 in (False, True)]
    for session in sessions:
        session.run(None, x)
    times: list[list[float]] = [[], []]
    for _ in range(5):
        for session, taken in zip(sessions, times):
            start = time.perf_counter()
            session.run(None, x)
            taken.append(time.perf_counter() - start)
    return min(times[1]) * FASTER_BY < min(times[0])


def use_fp32_path(choice: str, device: torch.device, session_options, graph: bytes | Path) -> bool:
    """Whether the decoder runs its runs of many tokens in a second session on the fp32 path."""
    if choice == "package" or device.type != "cpu":
        return False
    shape = int8_weight_shape(graph)
    if shape is None:
        return False
    if session_options is not None:  # ONNX Runtime's options cannot be copied, and are the caller's
        if choice == "fp32":
            raise ValueError(f"quantized_prefill='fp32' makes a session with ortmodule's own options; with your "
                             f"session_options, add their config entry {FORCE_FP32!r} = '1' yourself (it then "
                             "applies to every run) or leave quantized_prefill at 'auto'")
        return False
    return choice == "fp32" or fp32_path_is_faster(*shape)
