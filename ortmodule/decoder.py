"""`Decoder`: the ONNX Runtime sessions of one package on one device, and every IOBinding.

Two calls run the model: `prefill(rows, logit_index, cache)` over a right-padded batch, and
`step(tokens, cache, logit_index)` that appends tokens to every row of a `KVCache`. Both compute
logits only at `logit_index`, flat indices `row * width + column` of the tokens run (all of them
when None), through the LM-head rewrite in `graph.py` when it applied, else by selecting rows of
the full logits. Nothing here is copied to the host.

A prefill binds an all-ones mask and positions 0..T-1: rows are right-padded and attention is
causal, so no real position sees the padding after it; the logits of the real positions are exact,
and the attention kernels are spared the padded rows they mishandle (sliding windows, left
padding). A step passes the cache's mask and each row's next positions.

Generation's decode loop steps through `steps.FixedSteps` where it can (buffers that never move;
CUDA graphs); the decoder keeps the most recent ones and numbers their graphs.

Runs of more than one token per row (prefills, chunks) go to `wide_session`, decode steps to
`session`: the same session, except on a CPU where a package's 4-bit weights run faster in ONNX
Runtime's fp32 path for many rows (nbits.py); then `wide_session` is a second one on that path.

Threads: any number may prefill at once (each thread has its own scratch buffer for the prefill's
discarded KV); runs over one `KVCache` are refused while another thread runs over it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
import warnings
import weakref
from pathlib import Path

import onnxruntime as ort
import torch

from . import chunked, extend, graph, nbits, projections, runtime, shared_prompts, states
from .cache import KVCache, settle, take_back
from .inputs import Rows
from .package import Package, PackageError

logger = logging.getLogger("ortmodule")


def _warn_fp32_on_cuda(package: Package) -> None:
    warnings.warn(
        f"{package.root} is an fp32 package: ONNX Runtime's CUDA GroupQueryAttention takes fp16 and bf16 only, so "
        "its attention runs on the CPU, with copies to the host at every layer (right, but slow). For the GPU: "
        "`ortmodule export SRC OUT --precision bf16 --device cuda`.", stacklevel=5)


def noted(decoder: Decoder, cache: KVCache | None, kind: str, tokens) -> tuple | None:
    """For a hybrid's cache, how to run a prompt (`Rows`) or a step (`[B, s]` token ids) again: what
    `KVCache.start` and `advance` keep for a crop (cache.py's `Checkpoint`): the decoder, held weakly,
    `rerun`, and the run's input."""
    if cache is None or not cache.states:
        return None
    held = decoder if isinstance(decoder, weakref.ProxyType) else weakref.proxy(decoder)  # steps.py's is one
    return held, rerun, (kind, tokens)


def rerun(decoder: Decoder, cache: KVCache, kind: str, tokens, columns: int) -> None:
    """Run the first `columns` columns of a prompt (`Rows`, whose rows must then be unpadded) or the
    step tokens `[B, columns]` again into `cache` (a hybrid's crop, `KVCache.crop`)."""
    if kind == "prompt":
        if columns < tokens.ids.shape[1]:
            tokens = Rows(tokens.ids[:, :columns], None, torch.full_like(tokens.lengths, columns), columns)
        width = tokens.ids.shape[1]
        rows = torch.arange(tokens.ids.shape[0], device=decoder.device)
        decoder.prefill(tokens, rows * width + tokens.lengths - 1, cache)  # one logit a row, dropped
    else:
        last = torch.arange(tokens.shape[0], device=decoder.device) * columns + columns - 1
        decoder.step(tokens, cache, last)


def _after_pending(decoder: Decoder, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None):
    """`Decoder.step` over a hybrid cache with `pending` tokens (cache.py): those and `tokens` in one
    step, the logits of `tokens` only."""
    pending = take_back(cache)
    batch, new = tokens.shape
    before, width = pending.shape[1], pending.shape[1] + new
    if logit_index is None:
        rows = torch.arange(batch, device=tokens.device)[:, None]
        index = (rows * width + before + torch.arange(new, device=tokens.device)).reshape(-1)
    else:
        index = logit_index // new * width + before + logit_index % new
    logits = decoder.step(torch.cat([pending, tokens.to(pending.device)], 1), cache, index)
    return logits if logit_index is not None else logits.view(batch, new, -1)


def _several_tokens(decoder: Decoder, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None):
    """`Decoder.step` of several tokens where the package's attention takes one new token over the
    cache (`_token_by_token`). On a CPU, where the tokens are enough to pay for it, they run instead
    through the writing extender (extend.py's cache layout: every row's new tokens over its past in one
    run, their KV written into the cache's buffers), a prefill chunk of tokens a row at a time."""
    batch, new = tokens.shape
    extender = _one_run_extender(decoder, cache, new)
    if extender is None:
        return _token_by_token(decoder, tokens, cache, logit_index)
    index = torch.arange(batch * new, device=tokens.device) if logit_index is None else logit_index
    chunk = decoder.prefill_chunk or new
    if new <= chunk and index.numel():
        with decoder.holding(cache):
            logits = extender.run(tokens, cache, index)
            cache.advance(new, new)  # the run wrote the tokens' KV past each row's end, counting none
        return logits if logit_index is not None else logits.view(batch, new, -1)
    out = torch.empty(index.numel(), decoder.vocab_size, dtype=decoder.head_dtype, device=tokens.device)
    row, column = index // new, index % new
    for start in range(0, new, chunk):
        width = min(chunk, new - start)
        asked = torch.nonzero((column >= start) & (column < start + width)).squeeze(1)
        wanted = row[asked] * width + column[asked] - start
        if not asked.numel():  # a chunk asked for nothing: one logit, dropped (an empty output cannot be bound)
            wanted = wanted.new_zeros(1)
        with decoder.holding(cache):
            logits = extender.run(tokens[:, start : start + width].contiguous(), cache, wanted)
            cache.advance(width, width)
        out[asked] = logits[: asked.numel()]
    return out if logit_index is not None else out.view(batch, new, -1)


def _one_run_extender(decoder: Decoder, cache: KVCache, new: int) -> extend.Extender | None:
    """The writing extender for `_several_tokens`, or None where the tokens run a step each: off a CPU,
    over a cache it cannot write (`shared_prompts.continues_in_place`), or where `new` tokens a row are
    too few to pay for a run of the extend graph (`shared_prompts.several_tokens_pay`)."""
    if not shared_prompts.continues_in_place(decoder, cache) or not shared_prompts.several_tokens_pay(new):
        return None
    return extend.writing_extender(decoder)


def _token_by_token(decoder: Decoder, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None):
    """`Decoder.step` of several tokens where the package's attention takes one new token over a
    cache (GroupQueryAttention for more than one row: "batch_size must be 1 when sequence_length > 1
    and past context is given"; the MultiHeadAttention of fp16 exports for a CPU sees only the new
    tokens): one step per token, the same logits, only the asked-for columns kept."""
    batch, new = tokens.shape
    rows = torch.arange(batch, device=tokens.device)
    if logit_index is None:
        return torch.stack([decoder.step(tokens[:, i : i + 1], cache, rows) for i in range(new)], 1)
    wanted = sorted(set((logit_index % new).tolist()))  # the columns asked for (a read of a small index)
    slot = torch.full((new,), -1, dtype=torch.int64, device=tokens.device)
    slot[wanted] = torch.arange(len(wanted), device=tokens.device)
    kept, asked = [], set(wanted)
    for i in range(new):
        logits = decoder.step(tokens[:, i : i + 1], cache, rows)
        if i in asked:
            kept.append(logits)
    return torch.stack(kept, 1)[logit_index // new, slot[logit_index % new]]


@dataclasses.dataclass
class _CacheRuns:
    """What running over one KVCache needs beside its data: per session, the IOBinding kept for it
    and the version of the cache's buffers it holds; and the lock of the run in progress."""

    bindings: dict = dataclasses.field(default_factory=dict)  # id(session) -> [IOBinding, version bound]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Decoder:
    """Runs a package's decoder (and its embedding model, for multimodal packages) on one device."""

    def __init__(
        self,
        package: Package,
        device: torch.device,
        session_options: ort.SessionOptions | None = None,
        provider_options: dict | None = None,
        rewrite_lm_head: bool = True,
        cache_dir: str | Path | None = None,
        prefill_chunk: int | None = None,
        quantized_prefill: str | None = None,
        prefill_attention: str | None = None,
    ):
        self.package = package
        runtime.checked_options(session_options, provider_options, device)
        self.quantized_prefill = nbits.checked_choice(quantized_prefill)
        self.prefill_attention = extend.checked_attention(prefill_attention)
        self.chosen_chunk = chunked.checked_chunk(prefill_chunk)  # None: chunked.default_chunk by device
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a folder's path (a str or a Path), got {type(cache_dir).__name__}")
        self.spec = spec = package.decoder
        self.session_options, self.provider_options, self.cache_dir = session_options, provider_options, cache_dir
        self.rewrite_lm_head, self.graph_bytes, self.plain_bytes = rewrite_lm_head, None, None  # graphs: `load`'s
        self.id_dtype = runtime.torch_dtype(spec.id_type)
        self.mask_dtype = runtime.torch_dtype(spec.mask_type) if spec.mask_type else None
        self.position_dtype = runtime.torch_dtype(spec.position_type) if spec.position_type else None
        self.kv_dtype = runtime.torch_dtype(spec.kv_type)
        self.logits_dtype = runtime.torch_dtype(spec.logits_type)  # what forward returns
        # On the CPU a binding reads its tensors at run time, so a cache's buffers are bound once. On CUDA, ONNX
        # Runtime copies the inputs of nodes it placed on the CPU (an fp32 GQA) when bound: every run binds again.
        self.rebind = False
        self.scratch = _ScratchKV()  # the prefill's discarded present KV, one buffer per thread
        # Per KVCache run by this decoder: its binding, the buffers' version bound, the run's lock.
        self.runs, self.runs_lock = weakref.WeakKeyDictionary(), threading.Lock()
        self.fixed, self.graph_ids = collections.OrderedDict(), itertools.count(1)  # FixedSteps; graph ids (0 is ORT's)
        self.graphs_failed = False  # a decode step's CUDA graph failed: steps run uncaptured from then on (steps.py)
        self.load(device)

    @property
    def keeps_positions(self) -> bool:
        """True when the LM head runs only at the positions asked for (the graph rewrite applied)."""
        return self.graph_bytes is not None

    @property
    def vocab_size(self) -> int:
        return self.package.vocab_size

    def public(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` in the package's declared dtype: a copy where the sessions write another."""
        return logits.to(self.logits_dtype)

    # ---- sessions -----------------------------------------------------------------------------

    def again(self) -> Decoder:
        """A decoder of the same package with the same options on the same device, with sessions of its
        own (ONNX Runtime's sessions cannot be copied): what a deep copy of the model runs."""
        return Decoder(self.package, self.device, self.session_options, **self.options())

    def options(self) -> dict:
        """The loading options a decoder is made with, but the session options (`again`; a pickled model's)."""
        return dict(provider_options=self.provider_options, rewrite_lm_head=self.rewrite_lm_head,  # noqa: C408
                    cache_dir=self.cache_dir, prefill_chunk=self.chosen_chunk, quantized_prefill=self.quantized_prefill,
                    prefill_attention=self.prefill_attention)

    def load(self, device: torch.device, **run_settings) -> None:
        """Create the sessions on `device` and check that the package's config fits its graph.
        `run_settings`: `runtime.make_session`'s stream settings (for diagnostics)."""
        spec = self.spec
        self.graph_bytes, self.plain_bytes = _graphs(self, device)
        source = self.graph_bytes if self.keeps_positions else self.plain_bytes
        source, folder = (spec.path, None) if source is None else (source, spec.path.parent)
        half = self.kv_dtype in (torch.float16, torch.bfloat16)
        options = graph.head_provider_options(self.provider_options, device.type, self.graph_bytes, half)
        self.run_provider_options = options  # the rewrites' sessions (extend.py) run as this one does
        self.session = _open_main(self, source, device, folder, options, half, run_settings)
        self.fp32_path = nbits.use_fp32_path(self.quantized_prefill, device, self.session_options, source)
        self.head_dtype = runtime.output_dtype(self.session, spec.logits)  # bf16 where graph.py left the cast
        self.wide_session = self.session  # runs of more than one token per row
        if self.fp32_path:
            self.wide_session = _open(self.package, source, device, folder, fp32_path=True, provider_options=options,
                                      **run_settings)
        self.runs.clear()  # bindings of the previous session
        self.fixed.clear()
        self.extender = extend.lazy_extender(self)  # runs new tokens over a cache for a batch (extend.py)
        self.causal = None  # the prefill graph's runner, for runs without a cache (extend.py), made below
        self.device = device
        self.rebind = device.type != "cpu"
        self.prefill_chunk = chunked.chunk_for(self, device, self.chosen_chunk)
        if device.type == "cuda" and self.kv_dtype == torch.float32:
            _warn_fp32_on_cuda(self.package)
        self.embedding_session, self.no_media = _open_embedding(self, device, run_settings)
        _check_runs(self)
        if extend.uses_prefill_graph(self.prefill_attention, device):
            self.causal = extend.make_prefill(self)
            if self.causal is not None:
                logger.info("ortmodule: runs without a cache take the prefill graph (prefill_attention=%s) on %s",
                            self.prefill_attention, device)

    # ---- runs ---------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache of `batch` rows with room for `capacity` positions, on this device."""
        return KVCache(self.spec, batch, capacity, self.device)

    def renew_extender(self) -> None:
        """Make the extend session again (the old one goes once no thread runs it). ONNX Runtime's CPU arena
        keeps what a session's largest run took until the session goes: after the costs' probes over 2,048
        cached positions a row (costs.py), about 0.9 GB more for SmolLM2-135M fp32 than its scoring ever holds.
        Made at once, so that the time it takes falls in the timing's, not in the next call's."""
        self.extender = extend.lazy_extender(self)
        self.extender()

    def prefill(self, rows: Rows, logit_index: torch.Tensor | None = None, cache: KVCache | None = None,
                pieces: chunked.Pieces | None = None) -> torch.Tensor | None:
        """Run right-padded `rows`: logits `[n, V]` at the flat indices `logit_index`, else `[B, T, V]`.
        The present KV goes into `cache` (which then holds the rows) when given, else is discarded.
        `pieces(places, logits)` takes the logits instead, as they come (chunked.prefill); result None."""
        if chunked.wanted(rows, logit_index, cache, self.prefill_chunk):  # long rows on the CPU
            return chunked.prefill(self, rows, logit_index, cache, self.prefill_chunk, pieces)
        in_graph = cache is None and self.causal is not None  # the prefill graph (extend.py)
        logits = self.causal.run(rows.ids, logit_index) if in_graph else self.package_prefill(rows, logit_index, cache)
        return logits if pieces is None else pieces(None, logits)

    def package_prefill(self, rows: Rows, logit_index: torch.Tensor | None = None,
                        cache: KVCache | None = None) -> torch.Tensor:
        """`prefill` in the package's own graph, in one run."""
        mask, positions = self._prefill_mask(rows.ids), self._prefill_positions(rows.ids)
        ran = noted(self, cache, "prompt", rows)
        return run_prefill(self, self.wide_session, rows, rows.ids, logit_index, mask, positions, cache, ran=ran)[0]

    def step(self, tokens: torch.Tensor, cache: KVCache, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Append `tokens` `[B, s]` to every row of `cache`: logits `[n, V]` at the flat indices
        `logit_index` of the tokens (`row * s + i`), else `[B, s, V]`."""
        batch, new = tokens.shape
        if cache.pending is not None:  # a hybrid's tokens left by a crop: run first, in the same run
            return _after_pending(self, tokens, cache, logit_index)
        if new > 1 and (batch > 1 or (self.spec.steps_one_token and cache.longest > 0)):
            return _several_tokens(self, tokens, cache, logit_index)
        session = self.wide_session if new > 1 else self.session
        with self.holding(cache) as runs:
            cache.reserve(cache.longest + new, self.package.context_length)
            binding = self.cache_binding(runs, cache, new, session)
            mask = cache.step_mask(new, self.mask_dtype) if self.mask_dtype is not None else None
            logits = self.run_bound(session, binding, tokens, logit_index, mask, cache.next_positions(new))
            cache.advance(new, new, noted(self, cache, "step", tokens))
        return logits

    @contextlib.contextmanager
    def holding(self, cache: KVCache):
        """Hold the cache for one run (yields its `_CacheRuns`); a second thread's run over it is
        refused, not raced. A hybrid's tokens left pending by a crop run first (cache.py's `settle`)."""
        settle(cache)
        runs = self._runs_of(cache)
        if not runs.lock.acquire(blocking=False):
            raise RuntimeError(
                "this KVCache is being run by another thread: a cache holds one sequence batch and takes one "
                "run at a time; give each thread its own (model(..., use_cache=True) or generate per thread)"
            )
        try:
            yield runs
        finally:
            runs.lock.release()

    def _runs_of(self, cache: KVCache) -> _CacheRuns:
        with self.runs_lock:  # two threads meeting a new cache get the same record
            runs = self.runs.get(cache)
            if runs is None:
                runs = self.runs[cache] = _CacheRuns()
            return runs

    def cache_binding(self, runs: _CacheRuns, cache: KVCache, new: int, session) -> ort.IOBinding:
        """The cache's own binding for `session`, its KV bound again only when stale (new buffers, CUDA)."""
        entry = runs.bindings.get(id(session))
        if entry is None:
            entry = runs.bindings[id(session)] = [session.io_binding(), None]
        if self.rebind or not cache.shared or entry[1] != cache.version:
            bind_cache(entry[0], cache, new)
            entry[1] = cache.version
        return entry[0]

    def _prefill_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        return torch.ones_like(ids, dtype=self.mask_dtype) if self.spec.attention_mask else None

    def _prefill_positions(self, ids: torch.Tensor) -> torch.Tensor | None:
        positions = torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        return positions if self.spec.position_ids else None

    def run_bound(self, session, binding, ids, logit_index, mask, positions, lengths=None) -> torch.Tensor:
        """Bind the tokens (embeddings `[B, T, H]` are the caller's to bind), mask and positions (None:
        not inputs of `session`) and the logits, and run `session`: logits `[n, V]` at the flat indices
        `logit_index`, else `[B, T, V]`; None from a session without the logits output (variants.LAST).
        `lengths`: each row's real tokens (None: all), for hybrids."""
        spec = self.spec
        batch, length = ids.shape[:2]
        bind_state_lengths(self, session, binding, lengths, ids)
        if not ids.is_floating_point():  # embeddings (variants.py) are bound by their caller
            self.bind_tokens(binding, ids)
        if spec.attention_mask and mask is not None:
            runtime.bind_input(binding, spec.attention_mask, mask.to(self.mask_dtype).contiguous())
        if spec.position_ids and positions is not None:
            runtime.bind_input(binding, spec.position_ids, self.position_input(positions))
        vocab = self.vocab_size
        shape = (batch, length, vocab)
        if self.keeps_positions:
            kept = logit_index if logit_index is not None else torch.arange(batch * length, device=self.device)
            runtime.bind_input(binding, graph.LOGITS_INDICES, kept)
            shape = (kept.numel(), vocab)
        if spec.logits not in session.output_names:  # a variant without the LM head (variants.LAST)
            session.run(binding)
            return None
        logits = torch.empty(shape, dtype=self.head_dtype, device=self.device)
        runtime.bind_output(binding, spec.logits, logits)
        session.run(binding)
        if logit_index is None:
            return logits.view(batch, length, vocab)
        if not self.keeps_positions:
            logits = logits.view(batch * length, vocab).index_select(0, logit_index)
        return logits

    def bind_tokens(self, binding: ort.IOBinding, ids: torch.Tensor) -> None:
        """Bind the decoder's token input: the ids, or what the embedding model makes of them
        (its outputs stay on the device and are bound to the decoder as they are)."""
        if self.embedding_session is None:
            runtime.bind_input(binding, self.spec.input_ids, ids.to(self.id_dtype).contiguous())
            return
        embedding = self.package.embedding
        embed = self.embedding_session.io_binding()
        runtime.bind_input(embed, embedding.input_ids, ids.to(self.id_dtype).contiguous())
        for name, empty in self.no_media:
            runtime.bind_input(embed, name, no_media(empty, ids.shape[1]))
        for output, _ in embedding.feeds:
            runtime.bind_output_to(embed, output, self.device)
        self.embedding_session.run(embed)
        for (_, decoder_input), value in zip(embedding.feeds, embed.get_outputs()):
            binding.bind_ortvalue_input(decoder_input, value)

    def position_input(self, positions: torch.Tensor) -> torch.Tensor:
        """`[B, S]` positions in the decoder's dtype and rank (mRoPE decoders take `[3, B, S]`:
        for text, the temporal, height and width positions are all the token's position; images'
        come as `[3, B, S]`, images.py)."""
        positions = positions.to(self.position_dtype)
        if self.spec.position_rank == 3 and positions.dim() == 2:
            positions = positions.expand(3, *positions.shape)
        return positions.contiguous()


_ZEROS: dict = {}  # (device, dtype, row shape) -> a zero tensor, grown as needed and never written


def run_prefill(decoder: Decoder, session, rows: Rows, ids: torch.Tensor, logit_index: torch.Tensor | None,
                mask: torch.Tensor | None, positions: torch.Tensor | None, cache: KVCache | None, bind=None,
                ran: tuple | None = None):
    """One prefill run of `session` (the package's graph or a variant of it) over `rows`, fed `ids`
    (the token ids, or their embeddings): its keys and values into `cache`, whose rows start from
    nothing, or into scratch buffers without one. `bind(binding)` binds more outputs before the
    run (`ran`: how to run it again, `Decoder.ran`). The logits (`run_bound`'s) and what `bind` returned."""
    batch, width = rows.ids.shape
    if cache is None:
        binding = session.io_binding()
        decoder.scratch.bind(binding, decoder, batch, width)
        extra = bind(binding) if bind is not None else None
        return decoder.run_bound(session, binding, ids, logit_index, mask, positions, rows.lengths), extra
    cache.pending = None  # a prompt starts the rows over
    with decoder.holding(cache) as runs:
        binding = decoder.cache_binding(runs, cache, width, session)
        cache.states.zero()  # a reused cache holds an earlier batch's layer states
        extra = bind(binding) if bind is not None else None
        logits = decoder.run_bound(session, binding, ids, logit_index, mask, positions, rows.lengths)
        cache.start(rows.lengths, rows.longest, width, ran)
    return logits, extra


def no_media(empty: torch.Tensor, width: int) -> torch.Tensor:
    """What a text run binds to an embedding model's media input (`empty`: 0 in each open
    dimension): media features of one open first dimension get `width` rows of zeros, so that image
    placeholder ids in text take the graph's own zero row however many a row holds (mobius-onnx's
    Qwen2.5-VL graph counts them along each row into the features, padded with one zero row: two
    in a row indexed past an empty input inside ONNX Runtime), and features `[images, tokens, hidden]`
    with both open `[1, width, hidden]`; other media inputs stay empty."""
    if empty.dim() == 3 and tuple(empty.shape[:2]) == (0, 0) and empty.shape[2] > 0:
        return no_media(empty.reshape(0, empty.shape[2]), width)[None]
    rest = tuple(empty.shape[1:])
    if empty.dim() < 2 or empty.shape[0] != 0 or 0 in rest:
        return empty
    key = (empty.device, empty.dtype, rest)
    zeros = _ZEROS.get(key)
    if zeros is None or zeros.shape[0] < width:
        zeros = _ZEROS[key] = torch.zeros(max(width, 2 * (0 if zeros is None else zeros.shape[0])), *rest,
                                          dtype=empty.dtype, device=empty.device)
    return zeros[:width]


def bind_state_lengths(decoder: Decoder, session, binding: ort.IOBinding, lengths: torch.Tensor | None,
                       ids: torch.Tensor) -> None:
    """A hybrid decoder's run of `ids` in `session`: each row's real tokens (None: every row's all),
    where its layer states are taken (states.py; the extend and prefill graphs keep none)."""
    if decoder.spec.states and states.STATE_LENGTHS in session.input_names:
        lengths = lengths if lengths is not None else torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
        runtime.bind_input(binding, states.STATE_LENGTHS, lengths.to(decoder.device, torch.int64).contiguous())


def bind_cache(binding: ort.IOBinding, cache: KVCache, new: int) -> None:
    """Bind every layer's past and present for a run that adds `new` columns. A shared buffer
    is both (ONNX Runtime writes in place); otherwise the presents go to new buffers."""
    if not cache.shared:
        cache.presents = ([], [])
    for spec, state, written in zip(cache.states.specs, cache.states.current, cache.states.written):
        runtime.bind_input(binding, spec.past, state)
        runtime.bind_output(binding, spec.present, written)
    for kv, key, value in zip(cache.specs, cache.keys, cache.values):
        runtime.bind_input(binding, kv.past_key, key)
        runtime.bind_input(binding, kv.past_value, value)
        if cache.shared:
            runtime.bind_output(binding, kv.present_key, key)
            runtime.bind_output(binding, kv.present_value, value)
            continue
        shape = (*key.shape[:2], key.shape[2] + new, key.shape[3])
        for name, buffers in ((kv.present_key, cache.presents[0]), (kv.present_value, cache.presents[1])):
            buffers.append(key.new_empty(shape))
            runtime.bind_output(binding, name, buffers[-1])


_OTHER_EXPORT = "a config from another export, or a package kind not supported (docs/usage.md)?"


def _check_runs(decoder: Decoder) -> None:
    """Run one token, so that a genai_config.json that disagrees with the graph (head size,
    heads, names) is a PackageError at load rather than an ONNX Runtime failure at every call."""
    one = torch.zeros(1, 1, dtype=torch.int64, device=decoder.device)
    try:
        decoder.prefill(Rows(one, None, torch.ones(1, dtype=torch.int64, device=decoder.device), 1))
    except Exception as e:  # ONNX Runtime's own exception types
        if "out of memory." in str(e):  # not the config's fault
            raise
        heads = sorted({(kv.num_kv_heads, kv.head_size) for kv in decoder.spec.layers})
        cause, said = _mismatch(decoder.package, decoder.device, _OTHER_EXPORT), " ".join(str(e).split())[:400]
        raise PackageError(f"{decoder.package.root / 'genai_config.json'}: ONNX Runtime cannot run "
                           f"{decoder.spec.path.name} with this configuration (KV heads and head sizes {heads}, "
                           f"vocab_size {decoder.vocab_size}): {cause} It said: {said}") from None


def _mismatch(package, device: torch.device, otherwise: str) -> str:
    """What most likely keeps ONNX Runtime from loading or running a package on `device`: an export
    for another execution provider (whose graph may hold what only that provider's kernels take: bf16
    matmuls, the query/key norms inside a CUDA export's GroupQueryAttention), else `otherwise`."""
    ep = package.exported_for
    if ep is None or ep.lower() == device.type:
        return otherwise
    fixes = f"load it with device='cuda', or export it for {device.type}" if ep.lower() == "cuda" else \
        f"export it for {device.type}"
    return (f"the package was exported for {ep} (genai_config's decoder session options), and its graph may use "
            f"what only {ep}'s kernels run: {fixes}.")


def _graphs(decoder: Decoder, device: torch.device) -> tuple[bytes | None, bytes | None]:
    """The decoder's graph for `device`: the rewrite's bytes (graph.py), and without the rewrite (off,
    or skipped for this graph) the package's graph where it needs repairs. Packed projections that a
    `Split` node splits are unpacked on CUDA (projections.py), where ortmodule's own session options
    fold the weights' slices at load (a caller's may not optimize the graph at all); on a CPU, contrib ops
    whose CPU kernels are slow are written as standard ones (cpu_forms.py)."""
    spec = decoder.spec
    unpack, cpu = projections.applies(device.type, decoder.session_options), device.type == "cpu"
    rewritten = graph.lm_head_graph(spec.path, spec.logits, decoder.rewrite_lm_head, decoder.cache_dir, unpack, cpu)
    return rewritten, graph.repaired_graph(spec.path, cpu) if rewritten is None else None


def _open_embedding(decoder: Decoder, device: torch.device, run_settings: dict) -> tuple[runtime.Session | None, list]:
    """A multimodal package's embedding model and the empty media inputs its text-only runs bind (the
    vision and speech models are never loaded); (None, []) for a text package."""
    embedding = decoder.package.embedding
    if embedding is None:
        return None, []
    session = _open(decoder.package, embedding.path, device, None, decoder.session_options, decoder.provider_options,
                    **run_settings)
    return session, [(name, torch.zeros(shape, dtype=runtime.torch_dtype(kind), device=device))
                     for name, kind, shape in embedding.empty_inputs]


def _open_main(decoder: Decoder, source, device: torch.device, folder, options: dict | None, half: bool,
               run_settings: dict) -> runtime.Session:
    """The decoder's session, with CUDA graphs where `runtime.CUDA_GRAPHS_BY_DEFAULT` turns them on (its
    decode steps only: the rewrites' sessions run without); where ONNX Runtime refuses them for the
    graph (control flow, nodes on the CPU), a warning and the session without them."""
    graphs = runtime.default_cuda_graphs(options, device.type, half)
    open_with = functools.partial(_open, decoder.package, source, device, folder, decoder.session_options,
                                  dtype=decoder.kv_dtype, **run_settings)
    if graphs is not options:
        try:
            return open_with(graphs)
        except Exception as e:
            if "out of memory" in str(e).lower():
                raise
            logger.warning("ortmodule: %s does not run with CUDA graphs (%s: %s); loaded without them",
                           decoder.package.root, type(e).__name__, e)
    return open_with(options)


def _open(package, source, device: torch.device, *args, dtype: torch.dtype | None = None, **kwargs) -> runtime.Session:
    """`runtime.make_session`; a graph ONNX Runtime refuses is a PackageError with its likely cause
    (`dtype`: the package's precision, where a bf16 graph on a CPU is the likely one)."""
    try:
        return runtime.make_session(source, device, *args, **kwargs)
    except PackageError as e:
        otherwise = ("the exporter wrote a graph this ONNX Runtime refuses: export the package again (without the "
                     "option that made it, if one did), or use the ONNX Runtime it was made for.")
        if dtype == torch.bfloat16 and device.type == "cpu":
            otherwise = ("it is a bf16 package, and ONNX Runtime has CPU kernels for few bf16 operators: load it with "
                         "device='cuda', or export it in fp32, fp16 or int4 for the CPU.")
        cause = _mismatch(package, device, otherwise)
        raise PackageError(f"{e} {cause[0].upper()}{cause[1:]}") from e.__cause__


class _ScratchKV(threading.local):
    """The prefill's discarded present KV: one reused buffer per thread, so that any number of
    threads may prefill at once."""

    buffer: torch.Tensor | None = None

    def bind(self, binding: ort.IOBinding, decoder: Decoder, batch: int, length: int) -> None:
        """An empty past for every layer of `decoder`; the present goes into this thread's buffer."""
        layers, dtype, device = decoder.spec.layers, decoder.kv_dtype, decoder.device
        sizes = [batch * kv.num_kv_heads * length * kv.head_size for kv in layers]
        shapes = [(batch, *state.shape) for state in decoder.spec.states]
        needed = 2 * sum(sizes) + sum(math.prod(shape) for shape in shapes)
        scratch = self.buffer
        if scratch is None or scratch.numel() < needed or scratch.device != device or scratch.dtype != dtype:
            scratch = self.buffer = torch.empty(needed, dtype=dtype, device=device)
        offset = 0
        for state, shape in zip(decoder.spec.states, shapes):  # zeros before the first token; the present is dropped
            runtime.bind_input(binding, state.past, torch.zeros(shape, dtype=dtype, device=device))
            size = math.prod(shape)
            runtime.bind_output(binding, state.present, scratch[offset : offset + size].view(shape))
            offset += size
        for kv, size in zip(layers, sizes):
            empty = torch.empty(batch, kv.num_kv_heads, 0, kv.head_size, dtype=dtype, device=device)
            runtime.bind_input(binding, kv.past_key, empty)
            runtime.bind_input(binding, kv.past_value, empty)
            shape = (batch, kv.num_kv_heads, length, kv.head_size)
            runtime.bind_output(binding, kv.present_key, scratch[offset : offset + size].view(shape))
            runtime.bind_output(binding, kv.present_value, scratch[offset + size : offset + 2 * size].view(shape))
            offset += 2 * size


def embed_rows(decoder: Decoder, features_input: str, ids: torch.Tensor,
               features: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The embedding model's outputs for `ids` `[B, T]` with each row's media features (the
    embedding model's input `features_input`; None: a row without media), as {decoder input:
    `[B, T, ...]`} on the device. One run per row: an exporter's graph may number the media tokens
    within each row (mobius-onnx's counts them along the row), so each row gets its own features."""
    embedding, session, device = decoder.package.embedding, decoder.embedding_session, decoder.device
    shapes = {value.name: value.shape for value in session.ort_session.get_outputs()}
    made = {}
    for output, target in embedding.feeds:
        rest = shapes[output][2:]
        if not all(isinstance(size, int) for size in rest):
            raise PackageError(f"{embedding.path}: its output '{output}' has open dimensions {rest} after batch and "
                               "sequence; ortmodule needs them fixed to run it with media")
        made[target] = torch.empty(*ids.shape, *rest, dtype=runtime.output_dtype(session, output), device=device)
    ids = ids.to(device, decoder.id_dtype)
    none = dict(decoder.no_media)[features_input][:0]  # a row without media: no feature rows
    batched = none.dim() == 3  # features `[batch, tokens, hidden]`: a row's as a batch of one
    for row, row_features in enumerate(features):
        binding = session.io_binding()
        runtime.bind_input(binding, embedding.input_ids, ids[row : row + 1].contiguous())
        given = none if row_features is None else row_features[None] if batched else row_features
        runtime.bind_input(binding, features_input, given.contiguous())
        for name, value in decoder.no_media:
            if name != features_input:
                runtime.bind_input(binding, name, value)
        for output, target in embedding.feeds:
            runtime.bind_output(binding, output, made[target][row : row + 1])
        session.run(binding)
    return made
