"""Decode steps at fixed addresses (`FixedSteps`), lent to generation's loop by `lend`.

A step appends one token to every row. Here its cache, tokens, mask, positions, LM-head indices
and logits are buffers that never move and are written in place, so the binding is made once,
and with the CUDA provider option `enable_cuda_graph` ONNX Runtime captures the step as a CUDA
graph and replays it: one launch per step instead of one per kernel. The decoder keeps the most
recent ones (`Decoder.fixed`), so that the next generation of the same shape finds them bound
(and captured).
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from . import graph, runtime, states
from .cache import KVCache
from .decoder import Decoder, bind_cache, noted

logger = logging.getLogger("ortmodule")


def lend(decoder: Decoder, batch: int, needed: int) -> FixedSteps | None:
    """Decode steps for `batch` rows of up to `needed` positions, held for the caller until
    `release()`; None where the package's steps cannot run so (an embedding model before the
    decoder, a cache written by concatenation, attention on the CPU under CUDA) or another thread
    holds the steps of this shape."""
    if decoder.embedding_session is not None or not decoder.spec.shares_kv_buffer:
        return None
    if decoder.device.type == "cuda" and decoder.kv_dtype == torch.float32:
        return None  # its attention runs on the CPU, whose inputs are copied when bound: see `Decoder.rebind`
    capacity = needed
    if decoder.session.cuda_graphs:  # similar lengths share one graph
        capacity = min(-(-needed // FixedSteps.ROUND) * FixedSteps.ROUND, decoder.package.context_length)
    key = (batch, max(capacity, needed))
    with decoder.runs_lock:
        steps = decoder.fixed.get(key)
        if steps is None:
            steps = FixedSteps(decoder, *key)
            steps.kept = steps.bytes <= FixedSteps.KEPT_BYTES
            if steps.kept:
                decoder.fixed[key] = steps
            while len(decoder.fixed) > FixedSteps.KEPT or \
                    sum(kept.bytes for kept in decoder.fixed.values()) > FixedSteps.KEPT_BYTES:
                oldest = decoder.fixed.popitem(last=False)[1]  # its buffers go, and its graph
                oldest.kept = False  # (by its holder's release, where a generation holds it now)
                oldest.forget()
        else:
            decoder.fixed.move_to_end(key)
    return steps if steps.acquire() else None


class FixedSteps:
    """Decode steps of one token per row over a cache of fixed capacity, every buffer at a fixed
    address: the tokens, the mask (`[batch, capacity]`, a row's ones up to its length), the
    positions, the LM head's row indices and the logits are written in place, and the binding is
    made once (on CUDA the small inputs are bound again each step, to the same buffers, as
    `Decoder.rebind` asks). A session with the CUDA provider option `enable_cuda_graph` captures
    the step under its own graph id.

    Lent by `lend` to one generation at a time (`release()`)."""

    ROUND = 256  # with CUDA graphs, capacities are rounded up to this
    KEPT = 2  # shapes kept per decoder for the next generation
    KEPT_BYTES = 512 << 20  # and at most this much cache kept (larger steps serve their one call)

    def __init__(self, decoder: Decoder, batch: int, capacity: int):
        # The decoder keeps its steps (`Decoder.fixed`): a weak reference back, so that a model
        # dropped frees its sessions and caches at once (no cycle for the garbage collector).
        self.decoder, device = weakref.proxy(decoder), decoder.device
        self.lock = threading.Lock()
        self.released: torch.cuda.Event | None = None  # on CUDA: the last holder's work queued so far
        self.cache = decoder.new_cache(batch, capacity)
        self.capacity = self.cache.capacity
        self.bytes = sum(b.numel() * b.element_size() for b in self.cache.keys + self.cache.values)
        self.kept = False  # whether the decoder keeps these steps after their call
        self.graph_id = -1 if decoder.graphs_failed else next(decoder.graph_ids)  # -1: never captured
        self.tokens = torch.zeros(batch, 1, dtype=decoder.id_dtype, device=device)
        spec = decoder.spec
        self.mask = torch.zeros(batch, self.capacity, dtype=decoder.mask_dtype, device=device) \
            if spec.attention_mask else None
        self.positions = None
        if spec.position_ids:
            shape = (3, batch, 1) if spec.position_rank == 3 else (batch, 1)
            self.positions = torch.zeros(shape, dtype=decoder.position_dtype, device=device)
        self.head_rows = torch.arange(batch, device=device) if decoder.keeps_positions else None
        # a hybrid decoder's layer states: every row takes its one token (states.py)
        self.state_lengths = torch.ones(batch, dtype=torch.int64, device=device) if spec.states else None
        # The LM head's rows as the graph writes them: one per row, or one per token without the rewrite.
        shape = (batch, decoder.vocab_size) if decoder.keeps_positions else (batch, 1, decoder.vocab_size)
        self.logits = torch.empty(shape, dtype=decoder.head_dtype, device=device)
        self.binding = decoder.session.io_binding()
        bind_cache(self.binding, self.cache, 1)
        runtime.bind_output(self.binding, spec.logits, self.logits)
        self._bind_inputs()

    def _bind_inputs(self) -> None:
        spec, binding = self.decoder.spec, self.binding
        runtime.bind_input(binding, spec.input_ids, self.tokens)
        if self.mask is not None:
            runtime.bind_input(binding, spec.attention_mask, self.mask)
        if self.positions is not None:
            runtime.bind_input(binding, spec.position_ids, self.positions)
        if self.head_rows is not None:
            runtime.bind_input(binding, graph.LOGITS_INDICES, self.head_rows)
        if self.state_lengths is not None:
            runtime.bind_input(binding, states.STATE_LENGTHS, self.state_lengths)

    def start(self) -> None:
        """After the prefill into `cache`: the mask of the rows it holds."""
        if self.mask is not None:
            columns = torch.arange(self.capacity, device=self.decoder.device)
            self.mask.copy_(columns[None, :] < self.cache.lengths[:, None])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append `tokens` `[batch]` to the rows; their logits `[batch, V]` (this object's buffer,
        overwritten by the next step). Called inside generation's inference mode, as the buffers
        were made."""
        cache = self.cache
        if cache.longest >= self.capacity:
            raise RuntimeError(f"decode steps past the cache's capacity of {self.capacity} positions")
        self.tokens.copy_(tokens.view(-1, 1))
        if self.mask is not None:
            self.mask.scatter_(1, cache.lengths[:, None], 1)
        if self.positions is not None:
            self.positions.copy_(cache.lengths[:, None])
        if self.decoder.rebind:
            self._bind_inputs()
        self._run()
        cache.advance(1, 1, noted(self.decoder, cache, "step", tokens.view(-1, 1)))
        return self.logits.view(len(self.logits), -1)

    def _run(self) -> None:
        """The step's run; with CUDA graphs, captured or replayed under the steps' graph id. Where that
        run fails (a graph ONNX Runtime could not capture: CUDA graphs are on by default, and a
        package's kernels may not all allow a capture), the step runs again uncaptured (its writes are the
        same), and where that passes, the model's decode steps run uncaptured from then on, said in a warning."""
        session, graph_id = self.decoder.session, -1 if self.decoder.graphs_failed else self.graph_id
        try:
            session.run(self.binding, graph_id)
        except Exception as e:
            if not session.cuda_graphs or graph_id < 0 or "out of memory" in str(e).lower():
                raise
            session.run(self.binding, -1)  # where this fails too, its error is the step's own, raised
            first_line = (str(e).splitlines() or [""])[0]
            logger.warning("ortmodule: a decode step of %s failed with CUDA graphs on (%s: %s); its decode steps run "
                           "without them from now on (provider_options={'enable_cuda_graph': '0'} at load says so "
                           "from the start)", self.decoder.package.root, type(e).__name__, first_line)
            self.decoder.graphs_failed = True

    def copy_cache(self) -> KVCache:
        """A cache of the rows so far in buffers of its own."""
        cache = self.cache
        copy = self.decoder.new_cache(cache.batch_size, cache.longest)
        copy.start_from(cache, torch.arange(cache.batch_size, device=self.decoder.device), cache.lengths,
                        cache.longest)
        copy.seen = cache.seen
        copy.states.log = cache.states.copied_log()
        return copy

    def forget(self) -> None:
        """Let ONNX Runtime free the graph captured for these steps, once no thread holds them and
        the device has run them (one held now keeps its graph until the session goes)."""
        if not self.decoder.session.cuda_graphs or self.graph_id < 0 or not self.lock.acquire(blocking=False):
            return
        session = self.decoder.session
        try:
            # Not beside a run of the session (`runtime.Session.lock`), nor beside another thread's capture,
            # which the wait for the device would break (`runtime.CAPTURES`; the locks in `Session.run`'s order).
            with runtime.CAPTURES.run(False), session.lock:
                if self.released is not None:
                    self.released.synchronize()
                session.ort_session.release_captured_graph(self.graph_id)
        finally:
            self.lock.release()

    def acquire(self) -> bool:
        """Hold the steps, if no other thread does. The caller's stream then waits for the work the
        last holder queued on its own (which may read the logits, or copy the cache, still)."""
        if not self.lock.acquire(blocking=False):
            return False
        if self.released is not None:
            torch.cuda.current_stream(self.decoder.device).wait_event(self.released)
        return True

    def release(self) -> None:
        if self.decoder.device.type == "cuda":
            self.released = torch.cuda.Event()
            self.released.record(torch.cuda.current_stream(self.decoder.device))
        self.lock.release()
        if not self.kept:
            self.forget()
