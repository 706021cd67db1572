"""ONNX Runtime glue: devices, sessions, dtypes, and zero-copy binding of torch tensors.

The only module that knows ONNX Runtime's API. Tensors cross in both directions without copies:
inputs are wrapped with `OrtValue.from_dlpack`, outputs are preallocated torch tensors whose
memory ONNX Runtime writes into.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from . import linked_weights, mapped, nbits
from .package import PackageError

logger = logging.getLogger(__name__)

TORCH_DTYPE = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}
ONNX_TYPE = {v: k for k, v in TORCH_DTYPE.items()}

# The attention kernels ONNX Runtime's CUDA provider may choose (its `sdpa_kernel` bit mask): flash
# (1), memory-efficient (2) and unfused (16). Left to itself, ONNX Runtime >= 1.31 prefers cuDNN's
# SDPA (8) on Hopper and newer GPUs, and cuDNN builds an execution graph for every new input shape,
# a few hundred milliseconds each time: scoring and generation change shape at nearly every call.
# `provider_options={"sdpa_kernel": 0}` gives ONNX Runtime's own choice back.
CUDA_ATTENTION_KERNELS = 1 | 2 | 16

# Whether the main session of a half-precision package on CUDA has the provider option
# `enable_cuda_graph` (generate's decode steps captured as CUDA graphs and replayed: `default_cuda_graphs`)
# where the caller's provider options do not say. On an H200 batch-1 decoding ran 3x faster with it
# (490.5 against 163.8 tokens/s) and MMLU-shaped scoring lost nothing (docs/measurements.md, sessions
# 27 and 57); the whole CUDA test file passed with it on (sessions 90 and 92). `provider_options=
# {"enable_cuda_graph": "0"}` turns it off for one model; `pytest tests/test_cuda.py
# --no-cuda-graphs-by-default` runs the CUDA tests without it.
CUDA_GRAPHS_BY_DEFAULT = True

# Where external weights live when a graph is loaded from bytes (a rewritten graph).
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
# The session config entries of ortmodule's own options for ONNX Runtime's intra-op workers:
# spinning within a run, stopped when the run returns (make_session).
SPINNING = (("session.intra_op.allow_spinning", "1"), ("session.force_spinning_stop", "1"))


def torch_dtype(onnx_type: int) -> torch.dtype:
    if onnx_type not in TORCH_DTYPE:
        raise TypeError(f"ONNX element type {onnx.TensorProto.DataType.Name(onnx_type)} has no torch dtype")
    return TORCH_DTYPE[onnx_type]


# ONNX Runtime's names of tensor types ("tensor(float)", "tensor(bfloat16)") for TORCH_DTYPE's keys.
_TYPE_NAMES = {f"tensor({onnx.TensorProto.DataType.Name(kind).lower()})": dtype for kind, dtype in TORCH_DTYPE.items()}


def output_dtype(session: Session, name: str) -> torch.dtype:
    """The torch dtype of a session's float output `name`, as ONNX Runtime reports it."""
    return _float_dtype(session.ort_session.get_outputs(), name, "output")


def input_dtype(session: Session, name: str) -> torch.dtype:
    """The torch dtype of a session's float input `name`, as ONNX Runtime reports it."""
    return _float_dtype(session.ort_session.get_inputs(), name, "input")


def _float_dtype(values, name: str, what: str) -> torch.dtype:
    kind = next(v.type for v in values if v.name == name)
    if kind not in _TYPE_NAMES or not _TYPE_NAMES[kind].is_floating_point:
        raise TypeError(f"{what} {name!r} is {kind}, not a floating-point tensor")
    return _TYPE_NAMES[kind]


def parse_device(device: str | torch.device | int | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or an index -> a torch.device with an explicit index for CUDA."""
    if isinstance(device, int) and not isinstance(device, bool):  # an index is a CUDA device, as in transformers
        device = torch.device("cuda", device)
    try:
        device = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):  # torch's own lists every device type it knows
        raise ValueError(f"unsupported device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} asked for, but torch sees no CUDA device")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    elif device.type == "cpu":
        device = torch.device("cpu")  # accelerate names it cpu:0
    else:
        raise ValueError(f"unsupported device '{device}': use 'cpu', 'cuda' or 'cuda:N'")
    return device


def checked_options(session_options, provider_options, device: torch.device) -> None:
    """`session_options` (an onnxruntime.SessionOptions) and `provider_options` (a dict of the CUDA
    execution provider's options) of the right kinds, else a TypeError naming what was given; on a CPU,
    where ONNX Runtime ignores provider options, a warning that they do nothing."""
    if session_options is not None and not isinstance(session_options, ort.SessionOptions):
        raise TypeError(f"session_options must be an onnxruntime.SessionOptions, got {type(session_options).__name__}")
    if provider_options is not None and not isinstance(provider_options, Mapping):
        raise TypeError("provider_options must be a dict of CUDAExecutionProvider options, got "
                        f"{type(provider_options).__name__}")
    if provider_options and device.type == "cpu":
        warnings.warn(f"provider_options {sorted(provider_options)} have no effect on a CPU: they are the CUDA "
                      "execution provider's (ONNX Runtime's CPU provider takes none)", stacklevel=5)


def providers(device: torch.device, provider_options: dict | None = None, stream=None) -> list:
    """Execution providers for a torch device. On CUDA, ONNX Runtime runs on `stream`, a torch
    stream that `run` orders with the caller's current stream at every call."""
    if device.type == "cpu":
        return [("CPUExecutionProvider", dict(provider_options or {}))]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(
            "CUDA asked for, but this onnxruntime build has no CUDAExecutionProvider; install onnxruntime-gpu"
        )
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    options = {
        "device_id": str(index),
        "has_user_compute_stream": "1",
        "user_compute_stream": str(stream.cuda_stream),
        # fp32 MatMul in fp32, as PyTorch does by default: TF32 changes fp32 logits by ~5e-4.
        "use_tf32": "0",
        "sdpa_kernel": str(CUDA_ATTENTION_KERNELS),
    }
    for key, value in (provider_options or {}).items():
        if key in ("device_id", "user_compute_stream", "has_user_compute_stream"):
            raise ValueError(f"provider option {key!r} is set by ortmodule from the device (and torch's stream)")
        options[key] = str(value)
    return [("CUDAExecutionProvider", options), ("CPUExecutionProvider", {})]


def default_cuda_graphs(provider_options: dict | None, device_type: str, half_package: bool) -> dict | None:
    """`provider_options` with `enable_cuda_graph` on where `CUDA_GRAPHS_BY_DEFAULT` says so: on CUDA,
    for a half-precision package (an fp32 package's attention runs on the CPU, and ONNX Runtime refuses
    CUDA graphs for a session with nodes there), unless the caller set the option either way."""
    if not CUDA_GRAPHS_BY_DEFAULT or device_type != "cuda" or not half_package \
            or "enable_cuda_graph" in (provider_options or {}):
        return provider_options
    return {**(provider_options or {}), "enable_cuda_graph": "1"}


class CaptureGuard:
    """ONNX Runtime captures a CUDA graph in CUDA's global capture mode, in which a CUDA call that may
    synchronize or allocate, made by any other thread meanwhile, fails and breaks the capture (a run's
    arena growing, a copy to the host, torch pinning a batch's ids). So a run that may capture
    (`exclusive`) waits until every other thread inside ortmodule (a run, or a whole call of an entry
    point: `entry_point`) has left it or waits for a capture of its own, and runs alone; new entries wait
    while a capture waits or runs. A thread's entries nest, and a thread that waits to capture counts as
    out: two threads inside calls that both reach a capture take turns instead of waiting for each other.
    Held on the host only: a capture waits for other threads' host work, not for their queued kernels."""

    def __init__(self):
        self._changed = threading.Condition()
        self._inside: dict[int, int] = {}  # thread -> its nested entries now
        self._waiting: set[int] = set()  # threads waiting to capture (out, though inside)
        self._capturing = False

    def _alone(self, me: int) -> bool:
        return not self._capturing and all(t == me or t in self._waiting for t in self._inside)

    @contextlib.contextmanager
    def run(self, exclusive: bool):
        me = threading.get_ident()
        with self._changed:
            if exclusive:
                self._waiting.add(me)
                self._changed.wait_for(lambda: self._alone(me))
                self._waiting.discard(me)
                self._capturing = True
            elif me not in self._inside:  # a thread already inside goes on: a capture waits for it
                self._changed.wait_for(lambda: not self._capturing and not self._waiting)
            self._inside[me] = self._inside.get(me, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                if exclusive:
                    self._capturing = False
                self._inside[me] -= 1
                if not self._inside[me]:
                    del self._inside[me]
                self._changed.notify_all()


CAPTURES = CaptureGuard()  # the process's: a capture breaks on another thread's CUDA calls, whatever the session
# The runs of one graph id that may capture it on a thread: ONNX Runtime's CUDA provider keeps its graphs
# per thread and captures after two plain runs of an id (one in some versions), so the first three are
# taken for possible captures.
RUNS_BEFORE_REPLAY = 3


@dataclasses.dataclass(frozen=True)
class Session:
    """An ONNX Runtime session and how ortmodule runs it: on CUDA, the torch stream it runs on and
    the run options (ONNX Runtime's end-of-run synchronization off, unless asked for)."""

    ort_session: ort.InferenceSession
    stream: torch.cuda.Stream | None = None
    run_options: ort.RunOptions | None = None
    cuda_graphs: bool = False  # the CUDA provider's enable_cuda_graph is on
    synchronizes: bool = False  # ONNX Runtime waits for the device at the end of each run
    graph_options: dict = dataclasses.field(default_factory=dict)  # graph id -> its run options
    # With CUDA graphs, one run at a time: ONNX Runtime does not support `Run` from several threads at once on
    # such a session (its CUDA provider's documentation); `runs_seen` counts each thread's runs per graph id.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    runs_seen: threading.local = dataclasses.field(default_factory=threading.local)

    def io_binding(self) -> ort.IOBinding:
        return self.ort_session.io_binding()

    @functools.cached_property
    def input_names(self) -> frozenset[str]:
        return frozenset(value.name for value in self.ort_session.get_inputs())

    @functools.cached_property
    def output_names(self) -> frozenset[str]:
        return frozenset(value.name for value in self.ort_session.get_outputs())

    def _run_options(self, graph_id: int) -> ort.RunOptions | None:
        """The run options of a run: with CUDA graphs on, every run names its graph (-1: none, as
        ONNX Runtime would otherwise capture it under id 0 and replay that for every shape)."""
        if not self.cuda_graphs:
            return self.run_options
        options = self.graph_options.get(graph_id)
        if options is None:
            options = ort.RunOptions()
            if not self.synchronizes:
                options.add_run_config_entry("disable_synchronize_execution_providers", "1")
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
            options = self.graph_options.setdefault(graph_id, options)
        return options

    def run(self, binding: ort.IOBinding, graph_id: int = -1) -> None:
        """Run a bound session. On CUDA the run is queued on the session's stream without a host
        sync; when the caller's current torch stream is another one, the session's stream first
        waits for the work queued on it, and it waits for the run after (events on the device).
        With CUDA graphs on, a run with `graph_id` > 0 is captured under that id the first time and
        replayed after (every binding at the same addresses and shapes); -1 runs as it is."""
        stream = self.stream
        current = torch.cuda.current_stream(stream.device) if stream is not None else None
        if current is not None and current != stream:
            stream.wait_stream(current)
        try:
            with self._guarded(graph_id):
                retrying_on_torch_cache(self.retried_on(graph_id), self.ort_session.run_with_iobinding, binding,
                                        self._run_options(graph_id))
        finally:
            if current is not None and current != stream:
                current.wait_stream(stream)

    def retried_on(self, graph_id: int) -> torch.device | None:
        """The device whose torch cache an out-of-memory run may empty to run again (`retrying_on_torch_cache`):
        the CUDA device, but for a run under a CUDA graph's id, which is not run twice (a capture that failed is
        not replayed); an uncaptured run of a session with CUDA graphs (a prefill, a forward) is."""
        if self.stream is None or (self.cuda_graphs and graph_id >= 0):
            return None
        return self.stream.device

    @contextlib.contextmanager
    def _guarded(self, graph_id: int):
        """On CUDA, the run inside `CAPTURES` (alone where it may capture a graph); with CUDA graphs, also
        one run of this session at a time."""
        if self.stream is None:
            yield
            return
        capturing = False
        if self.cuda_graphs and graph_id >= 0:  # the thread's own count: no lock needed
            seen = self.runs_seen.__dict__.setdefault("counts", {})
            capturing = seen.get(graph_id, 0) < RUNS_BEFORE_REPLAY
            seen[graph_id] = seen.get(graph_id, 0) + 1
        # CAPTURES before the session's lock: a capture waits for the threads inside ortmodule with no lock held
        with CAPTURES.run(capturing), self.lock if self.cuda_graphs else contextlib.nullcontext():
            yield


def make_session(
    model: Path | bytes,
    device: torch.device,
    external_data_folder: Path | None = None,
    session_options: ort.SessionOptions | None = None,
    provider_options: dict | None = None,
    dedicated_stream: bool = True,
    sync_after_run: bool = False,
    prepack: bool = True,
    fp32_path: bool = False,
) -> Session:
    """A session for a graph file, or for graph bytes whose weights live in `external_data_folder`.

    `session_options` are used as given, with one exception: for graph bytes, ONNX Runtime reads
    the weights' folder from a config entry of the options (`EXTERNAL_DATA_FOLDER`), so that entry
    is set on them. ONNX Runtime's SessionOptions can be neither copied nor read back (config
    entries, dimension overrides, custom ops), so a copy would lose the caller's settings.
    On CUDA the session runs on a stream of its own (`dedicated_stream=False`: torch's current
    stream at load) and a run returns without waiting for the device (`sync_after_run=True`: ONNX
    Runtime synchronizes its stream after each run); the other settings are for diagnostics.
    `prepack=False` (with ortmodule's own options) keeps ONNX Runtime from packing a copy of the
    weights: a second session over a package's weights then reads the weight file's pages.
    `fp32_path=True` (with ortmodule's own options) runs 4-bit weights in ONNX Runtime's fp32 path
    instead of the int8 one of `accuracy_level` 4 (nbits.py). Weight files that are links (the Hugging
    Face hub's cache) are read where they lie (linked_weights.py)."""
    if isinstance(model, bytes) and external_data_folder is not None:
        model, external_data_folder = linked_weights.relocated(model, external_data_folder)
    if session_options is None and device.type == "cpu" and mapped.wanted():  # packed weights from a file
        saving = _with_folder(_own_options(True, fp32_path), model, external_data_folder)
        found = mapped.source(model, external_data_folder, saving, (("fp32_path", str(fp32_path)),))
        if found is not None:  # packed and mapped: no copy of the process's own, so packed wherever asked
            try:
                return Session(_inference_session(device, os.fspath(found), os.fspath(found),
                                                  _own_options(True, fp32_path), providers(device, provider_options)))
            except Exception as e:  # noqa: BLE001  a damaged entry: the package's graph instead
                mapped.unusable(found, e)
    options = session_options or _own_options(prepack, fp32_path)
    _with_folder(options, model, external_data_folder)
    source = model if isinstance(model, bytes) else os.fspath(model)
    stream = None
    if device.type == "cuda":
        # A stream of the session's own, never torch's default one: the default stream's handle is
        # 0, which ONNX Runtime cannot tell from "no stream given".
        stream = torch.cuda.Stream(device) if dedicated_stream else torch.cuda.current_stream(device)
    what = f"{external_data_folder}'s graph (as ortmodule rewrote it)" if isinstance(model, bytes) else os.fspath(model)
    session = _inference_session(device, what, source, options, providers(device, provider_options, stream))
    if device.type != "cuda":
        return Session(session)
    # `run` orders the session's stream with whatever stream is current at each call. No sync at
    # the end of a run: the outputs are torch tensors, ordered like any torch kernel's.
    run_options = ort.RunOptions()
    if not sync_after_run:
        run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    graphs = str((provider_options or {}).get("enable_cuda_graph", "0")).lower() in ("1", "true")
    return Session(session, stream, run_options, graphs, sync_after_run)


def _own_options(prepack: bool, fp32_path: bool) -> ort.SessionOptions:
    """ortmodule's own session options (`make_session`'s `prepack` and `fp32_path`)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ORT's warnings about unused initializers are noise here
    # ONNX Runtime's workers spin between the parallel sections of a run (a hand-off without a
    # wake-up) and stop as the run returns (`force_spinning_stop`). Spinning between runs starved
    # the torch ops of a decode step (sampling, stop checks: decoding 1.8x slower on 2 vCPUs); not
    # spinning at all paid a wake-up per section (generation 2-15% slower; docs/measurements.md,
    # session 39).
    for key, value in SPINNING:
        options.add_session_config_entry(key, value)
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if fp32_path:
        options.add_session_config_entry(nbits.FORCE_FP32, "1")
    return options


def _with_folder(options: ort.SessionOptions, model: Path | bytes, folder: Path | None) -> ort.SessionOptions:
    """For graph bytes, ONNX Runtime reads the weights' folder from a config entry of the options."""
    if folder is not None:
        value = os.fspath(Path(folder).resolve())
        try:
            held = options.get_session_config_entry(EXTERNAL_DATA_FOLDER)
        except RuntimeError:  # not set
            held = None
        if held != value:  # set again, ONNX Runtime warns that it overwrites it (a caller's options, several sessions)
            options.add_session_config_entry(EXTERNAL_DATA_FOLDER, value)
    return options


def _inference_session(device: torch.device, what: str, *args) -> ort.InferenceSession:
    """`ort.InferenceSession(*args)` (through `retrying_on_torch_cache`); a graph ONNX Runtime refuses
    is a PackageError naming `what` and ONNX Runtime's reason (the decoder adds the likely cause)."""
    try:
        # No fallback: ONNX Runtime would otherwise retry on the CPU alone when the CUDA provider
        # refuses its options (or a run fails), printing "EP Error" and going on on the host.
        session = retrying_on_torch_cache(device, functools.partial(ort.InferenceSession, enable_fallback=0), *args)
    except Exception as e:  # ONNX Runtime's own exception types, told apart by name
        if type(e).__name__ not in _GRAPH_REFUSED or "pybind11" not in type(e).__module__:
            raise
        reason = str(e).rstrip(".")
        raise PackageError(f"ONNX Runtime {ort.__version__} cannot load {what} for {device}: {reason}.") from e
    if device.type == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"ONNX Runtime {ort.__version__} did not start its CUDA provider for {what} on {device}")
    return session


# ONNX Runtime's exceptions for a graph it cannot take (types that do not match, an operator or type
# without a kernel, a malformed model); other failures (options, devices, memory) keep their own.
_GRAPH_REFUSED = ("Fail", "InvalidGraph", "InvalidProtobuf", "NotImplemented")


def bind_input(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
    """Bind a contiguous torch tensor as an input, sharing its memory."""
    binding.bind_ortvalue_input(name, ort.OrtValue.from_dlpack(tensor))


def bind_output(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
    """Bind a preallocated contiguous torch tensor as an output: ONNX Runtime writes into it."""
    device = tensor.device
    binding.bind_output(
        name,
        device.type,
        device.index or 0,
        ONNX_TYPE[tensor.dtype],
        list(tensor.shape),
        tensor.data_ptr(),
    )


def bind_output_to(binding: ort.IOBinding, name: str, device: torch.device) -> None:
    """Bind an output that ONNX Runtime allocates on `device` (read back with `get_outputs`)."""
    binding.bind_output(name, device.type, device.index or 0)


# How ONNX Runtime words an allocation failure: the CPU allocator, the CUDA driver, its BFC arena
# when `gpu_mem_limit` is reached ("Available memory of N is smaller than requested bytes"), and
# cuBLAS / cuDNN failing to create a handle at session start ("CUBLAS failure 3: the resource
# allocation failed", seen on an H100 while torch's cache held the memory; *_STATUS_ALLOC_FAILED).
_OOM_MARKERS = ("failed to allocate memory", "bad_alloc", "out of memory", "cudaerrormemoryallocation",
                "is smaller than requested bytes", "resource allocation failed", "status_alloc_failed")


def is_out_of_memory(error: Exception) -> bool:
    text = str(error).lower()
    return any(marker in text for marker in _OOM_MARKERS)


def raise_if_out_of_memory(error: Exception, device: torch.device | None = None) -> None:
    """Re-raise an ONNX Runtime allocation failure as the RuntimeError that accelerate's batch-size
    search (and lm-eval's --batch_size auto) recognises: its message contains 'out of memory.'.
    On a CUDA device the message says what is free and what torch's tensors hold."""
    if is_out_of_memory(error):
        where = ""
        if device is not None and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            where = (f" {device} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; torch's tensors hold "
                     f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB.")
        raise RuntimeError(f"ONNX Runtime ran out of memory.{where} ({error})") from error


def retrying_on_torch_cache(device: torch.device | None, action, *args):
    """`action(*args)`, ONNX Runtime's allocation failures raised as `raise_if_out_of_memory` does.
    On CUDA, where torch's caching allocator holds device memory that no tensor uses (after a
    transformers model ran in the same process, say: tens of GB), ONNX Runtime cannot have it: that
    memory is handed back to the driver (`torch.cuda.empty_cache()`) and `action` runs once more."""
    for retry in (False, True):
        try:
            return action(*args)
        except Exception as e:  # ORT raises its own exception types
            if retry or not (device is not None and device.type == "cuda" and is_out_of_memory(e)
                             and torch.cuda.memory_reserved(device) > torch.cuda.memory_allocated(device)):
                raise_if_out_of_memory(e, device)
                raise
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        logger.warning("ortmodule: ONNX Runtime ran out of memory on %s while torch's cache held %.1f GiB that no "
                       "tensor used; handed it back to the driver and trying again (work done twice; emptying "
                       "torch's cache before loading avoids it)", device, cached / 2**30)
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


def entry_point(function):
    """Decorate an entry point (forward, generate, scoring's calls). Inside it, the thread counts as inside
    ortmodule for `CAPTURES`: another thread's capture of a CUDA graph waits for the call to end, and
    the call waits for a capture underway, so that its own CUDA calls between runs (pinning and copying
    a batch, torch's allocations, the copy of the answers) never break a capture. And any allocation
    failure inside it, torch's included (on the CPU: "DefaultCPUAllocator: can't allocate memory";
    Python's MemoryError), is the RuntimeError with "out of memory." that batch-size searches retry on.
    ONNX Runtime's failures are turned so by `run` already."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            with CAPTURES.run(False):
                return function(*args, **kwargs)
        except MemoryError as e:
            raise RuntimeError(f"ran out of memory. ({type(e).__name__}: {e})") from e
        except RuntimeError as e:
            if "out of memory." not in str(e) and "can't allocate memory" in str(e):
                raise RuntimeError(f"torch ran out of memory. ({e})") from e
            raise

    return call


def default_token_budget(device) -> int:
    """Padded tokens per prefill when the caller leaves the batch to ortmodule (scoring, lm-eval's `auto` batches,
    the server, `generate_batch`): enough to keep a GPU's matrix units busy (a 0.6B model's 32k-token prefill is
    tens of milliseconds on an H100) and, on a CPU, a few seconds of work (a CPU reaches its throughput at a few
    rows already)."""
    return 32768 if device.type == "cuda" else 8192
