"""`OrtModelForCausalLM`: a torch.nn.Module over an ONNX Runtime decoder session.

Forward is prefill only: right-padded rows run as they are; left-padded rows (or any row whose
ones form one contiguous run) are rolled to the right-padded layout first, because the builder's
GroupQueryAttention graphs get left padding wrong. The logits come back for the positions asked
for, in the caller's layout, through the LM-head rewrite in `graph.py` when it applies.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import onnxruntime as ort
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import generation, graph, runtime
from .generation import KVCache
from .package import Package, PackageError, read_package

logger = logging.getLogger("ortmodule")


def load_tokenizer(path: str | Path, **kwargs):
    """The package's Hugging Face fast tokenizer, read from its own files (never the network)."""
    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise PackageError(f"{root}: no tokenizer.json in the package folder")
    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True, **kwargs)
    except Exception as e:  # tokenizers' and transformers' own errors for a damaged file
        raise PackageError(
            f"{root}: the tokenizer files cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        ) from None


def build_config(package: Package) -> PretrainedConfig:
    """The package's config.json when present, else a config built from genai_config.json."""
    config_file = package.root / "config.json"
    if config_file.is_file():
        try:
            return AutoConfig.from_pretrained(package.root, local_files_only=True)
        except (ValueError, KeyError):  # a model type this transformers does not know
            return PretrainedConfig.from_dict(json.loads(config_file.read_text()))
    decoder = package.genai_config["model"]["decoder"]
    fields = dict(
        vocab_size=package.vocab_size,
        hidden_size=package.hidden_size,
        num_hidden_layers=len(package.decoder.layers),
        num_attention_heads=package.num_attention_heads,
        num_key_value_heads=decoder.get("num_key_value_heads", package.num_attention_heads),
        head_dim=decoder["head_size"],
        max_position_embeddings=package.context_length,
        bos_token_id=package.bos_token_id,
        eos_token_id=package.eos_token_id,
        pad_token_id=package.pad_token_id,
    )
    try:
        config = AutoConfig.for_model(package.model_type, **fields)
    except (ValueError, KeyError, TypeError):
        config = PretrainedConfig(**fields)
    config._name_or_path = str(package.root)
    return config


def build_generation_config(package: Package) -> GenerationConfig:
    search = package.search
    return GenerationConfig(
        bos_token_id=package.bos_token_id,
        eos_token_id=package.eos_token_id,
        pad_token_id=package.pad_token_id,
        do_sample=search.get("do_sample", False),
        temperature=search.get("temperature", 1.0),
        top_k=search.get("top_k", 50),
        top_p=search.get("top_p", 1.0),
    )


class Batch(NamedTuple):
    """A checked input batch in the right-padded layout."""

    ids: torch.Tensor  # [B, T] int64 on the model's device, each row's tokens starting at column 0
    shift: torch.Tensor | None  # how far each row was rolled left to get there (None: not at all)
    lengths: torch.Tensor  # [B] real tokens per row
    longest: int  # max(lengths), on the host


class OrtModelForCausalLM(torch.nn.Module):
    """A causal LM over an ONNX GenAI package with the Hugging Face model surface.

    `model(input_ids, attention_mask, cont_len=k).logits` is a torch tensor on `model.device`,
    `[B, k, V]` for the last k positions of the padded input (`[B, T, V]` when k is None or 0).
    """

    main_input_name = "input_ids"
    _is_stateful = False

    def __init__(
        self,
        package: Package,
        device: str | torch.device = "cpu",
        session_options: ort.SessionOptions | None = None,
        provider_options: dict | None = None,
        rewrite_lm_head: bool = True,
        cache_dir: str | Path | None = None,
    ):
        super().__init__()
        self.package = package
        self.config = build_config(package)
        self.generation_config = build_generation_config(package)
        self.name_or_path = str(package.root)
        self._session_options = session_options
        self._provider_options = provider_options
        decoder = package.decoder
        self._graph_bytes = (
            graph.keep_positions_graph(decoder.path, decoder.logits, cache_dir) if rewrite_lm_head else None
        )
        self._id_dtype = runtime.torch_dtype(decoder.id_type)
        self._mask_dtype = runtime.torch_dtype(decoder.mask_type) if decoder.mask_type else None
        self._position_dtype = runtime.torch_dtype(decoder.position_type) if decoder.position_type else None
        self._kv_dtype = runtime.torch_dtype(decoder.kv_type)
        self._logits_dtype = runtime.torch_dtype(decoder.logits_type)
        # The prefill's present KV, which forward discards: one buffer per calling thread (grown as
        # needed), so that concurrent forwards on one model never write into each other's.
        self._scratch = threading.local()
        self._load(runtime.parse_device(device))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        provider_options: dict | None = None,
        session_options: ort.SessionOptions | None = None,
        rewrite_lm_head: bool = True,
        cache_dir: str | Path | None = None,
    ) -> "OrtModelForCausalLM":
        """Load a GenAI package folder onto `device` ('cpu', 'cuda' or 'cuda:N')."""
        return cls(read_package(path), device, session_options, provider_options, rewrite_lm_head, cache_dir)

    def _load(self, device: torch.device) -> None:
        decoder = self.package.decoder
        if self._graph_bytes is not None:
            source, folder = self._graph_bytes, decoder.path.parent
        else:
            source, folder = decoder.path, None
        self.session = runtime.make_session(source, device, folder, self._session_options, self._provider_options)
        self._device = device
        if device.type == "cuda" and self._kv_dtype == torch.float32:
            warnings.warn(
                f"{self.package.root} is an fp32 package: ONNX Runtime's CUDA GroupQueryAttention takes fp16 and "
                "bf16 only, so its attention runs on the CPU, with copies to the host at every layer (right, but "
                "slow). For the GPU, export with `ortmodule export SRC OUT --precision bf16 --device cuda`.",
                stacklevel=3,
            )
        embedding = self.package.embedding
        self.embedding_session = None
        if embedding is not None:  # text only: the vision and speech models are never loaded
            self.embedding_session = runtime.make_session(
                embedding.path, device, None, self._session_options, self._provider_options
            )
            self._no_media = [
                (name, torch.zeros(shape, dtype=runtime.torch_dtype(kind), device=device))
                for name, kind, shape in embedding.empty_inputs
            ]
        self._check_runs()

    def _check_runs(self) -> None:
        """Run one token at load, so that a genai_config.json that disagrees with the graph (head
        size, heads, names) is a PackageError now rather than an ONNX Runtime failure at every call."""
        try:
            self._logits(torch.zeros(1, 1, dtype=torch.int64, device=self._device), None)
        except Exception as e:  # ONNX Runtime's own exception types
            if "out of memory." in str(e):  # not the config's fault
                raise
            self._check_failed(e)

    def _check_failed(self, error: Exception) -> None:
        decoder = self.package.decoder
        heads = sorted({(kv.num_kv_heads, kv.head_size) for kv in decoder.layers})
        raise PackageError(
            f"{self.package.root / 'genai_config.json'}: ONNX Runtime cannot run {decoder.path.name} with this "
            f"configuration (KV heads and head sizes {heads}, vocab_size {self.package.vocab_size}); "
            f"is the config from another export? ONNX Runtime said: {' '.join(str(error).split())[:400]}"
        ) from None

    # ---- the Hugging Face surface -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_dtype

    @property
    def keeps_positions(self) -> bool:
        """True when the LM head runs only at the positions asked for (the graph rewrite applied)."""
        return self._graph_bytes is not None

    def to(self, *args, **kwargs) -> "OrtModelForCausalLM":
        """Move the sessions to another device. The dtype is fixed by the exported package."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            raise TypeError(
                f"cannot convert an ONNX package to {dtype}: it was exported as {self.dtype}; "
                "export the model again with the precision you need"
            )
        if device is not None:
            device = runtime.parse_device(device)
            if device != self._device:
                self._load(device)
        return self

    def half(self) -> "OrtModelForCausalLM":
        return self.to(torch.float16)

    def float(self) -> "OrtModelForCausalLM":
        return self.to(torch.float32)

    def bfloat16(self) -> "OrtModelForCausalLM":
        return self.to(torch.bfloat16)

    def double(self) -> "OrtModelForCausalLM":
        return self.to(torch.float64)

    def cuda(self, device: int | None = None) -> "OrtModelForCausalLM":
        return self.to("cuda" if device is None else f"cuda:{device}")

    def cpu(self) -> "OrtModelForCausalLM":
        return self.to("cpu")

    def tie_weights(self) -> None:
        """Nothing to tie: the weights live in the ONNX graph."""

    def can_generate(self) -> bool:
        return True

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The number of weights in the decoder graph (its initializers)."""
        return self.package.decoder.num_parameters

    def extra_repr(self) -> str:
        return f"path={self.name_or_path}, device={self.device}, dtype={self.dtype}"

    # ---- forward ------------------------------------------------------------------------------

    @runtime.out_of_memory_is_runtime_error
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cont_len: int | None = None,
        logits_to_keep: int | torch.Tensor | None = None,
        return_dict: bool = True,
        labels: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        """Logits of `input_ids` (and the loss when `labels` are given).

        With `use_cache=True` the output carries `past_key_values`, a `KVCache` on the device; pass
        it back with the next tokens (`input_ids` [B, s]: s new tokens for every row) to continue.
        """
        unsupported = {k for k, v in kwargs.items() if v is not None and v is not False}
        if unsupported:
            raise TypeError(f"OrtModelForCausalLM.forward does not support {', '.join(sorted(unsupported))}")
        keep = cont_len if cont_len is not None else logits_to_keep
        if past_key_values is not None:
            logits = self._step(input_ids, attention_mask, past_key_values, keep)
            cache = past_key_values
        else:
            ids, shift, lengths, longest = self._checked_inputs(input_ids, attention_mask)
            cache = KVCache(self, ids.shape[0], ids.shape[1]) if use_cache else None
            positions = self._positions(keep, ids.shape[1])
            if positions is None:
                logits = self._logits(ids, shift, cache=cache)
            else:
                batch, kept = ids.shape[0], positions.numel()
                rows = torch.arange(batch, device=self.device).repeat_interleave(kept)
                logits = self._logits(ids, shift, rows, positions.repeat(batch), cache).view(batch, kept, -1)
            if cache is not None:
                cache.start(lengths, longest, ids.shape[1])
                given = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
                cache.caller_mask = given.to(self.device, torch.int64)
        loss = None
        if labels is not None:
            if keep is not None and not (isinstance(keep, int) and keep == 0):
                raise ValueError("labels need the logits of every position: drop cont_len/logits_to_keep")
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels.to(logits.device)[:, 1:].flatten(), ignore_index=-100
            )
        if not use_cache:
            cache = None
        if not return_dict:
            return tuple(x for x in (loss, logits, cache) if x is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def _step(self, input_ids, attention_mask, cache, keep) -> torch.Tensor:
        """Append `input_ids` [B, s] to every row of `cache`; logits `[B, s, V]` (or the kept ones)."""
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"past_key_values must be the KVCache this model returned (out.past_key_values), "
                f"got {type(cache).__name__}"
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError("input_ids must be a 2-D integer tensor [batch, new tokens]")
        if input_ids.dtype == torch.bool or input_ids.is_complex():
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        batch, new = input_ids.shape
        if batch != cache.batch_size or new == 0:
            raise ValueError(
                f"input_ids of shape {tuple(input_ids.shape)} does not continue a cache of {cache.batch_size} rows"
            )
        if new > 1 and batch > 1:
            raise ValueError(
                "a step of several tokens over a cache works for batch 1 only (ONNX Runtime's "
                "GroupQueryAttention refuses it for batches); feed the tokens one at a time"
            )
        if cache.longest + new > self.package.context_length:
            raise ValueError(
                f"{cache.longest} cached + {new} new tokens exceeds the model's context length "
                f"{self.package.context_length}"
            )
        ids = input_ids.to(self.device, torch.int64)
        checks = [((ids < 0) | (ids >= self.package.vocab_size)).any()]
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
            expected = (batch, cache.seen + new)
            if tuple(attention_mask.shape) != expected:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not match the cache and the new "
                    f"tokens: expected {expected}"
                )
            mask = attention_mask.to(self.device)
            checks.append((mask[:, -new:] != 1).any())
            if cache.caller_mask is not None:
                checks.append((mask[:, :-new] != cache.caller_mask).any())
        flags = torch.stack(checks).tolist()  # the one host sync of the checks
        if flags[0]:
            self._raise_bad_id(ids)
        if len(flags) > 1 and flags[1]:
            raise ValueError("attention_mask must be 1 at every new token: a step appends to every row")
        if len(flags) > 2 and flags[2]:
            raise ValueError(
                "attention_mask's earlier columns differ from the mask this cache was built with: a step's "
                "mask is the mask so far followed by ones for the new tokens"
            )
        cache.reserve(cache.longest + new, self.package.context_length)
        positions = cache.lengths[:, None] + torch.arange(new, device=self.device)
        kept = self._positions(keep, new)
        flat = None
        if kept is not None:
            flat = (torch.arange(batch, device=self.device)[:, None] * new + kept[None, :]).flatten()
        binding = self.session.io_binding()
        cache.bind(binding, new)
        logits = self._run(binding, ids, flat, mask=cache.step_mask(new, self._mask_dtype), positions=positions)
        cache.advance(new, new)
        if cache.caller_mask is not None:
            cache.caller_mask = torch.cat([cache.caller_mask, cache.caller_mask.new_ones(batch, new)], 1)
        return logits.view(batch, -1, logits.shape[-1])

    @runtime.out_of_memory_is_runtime_error
    def generate(self, input_ids: torch.Tensor, generation_config: GenerationConfig | None = None, **kwargs):
        """Greedy decoding or sampling with transformers' semantics; the KV cache stays on the device.

        Takes transformers' arguments (`attention_mask`, `max_new_tokens`, `max_length`, `do_sample`,
        `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`, `no_repeat_ngram_size`,
        `min_new_tokens`, `eos_token_id`, `pad_token_id`, `stop_strings` with `tokenizer`,
        `stopping_criteria`, `logits_processor`, `streamer`, `return_dict_in_generate`,
        `output_scores`, `output_logits`) plus `generator`, a `torch.Generator` for sampling.
        Returns the prompts as given followed by the new tokens, padded with `pad_token_id` after
        a row's end-of-sequence token.
        """
        return generation.generate(self, input_ids, generation_config, **kwargs)

    def _decode_step(self, cache: KVCache) -> generation.DecodeStep:
        return generation.DecodeStep(self, cache)

    def _checked_inputs(self, input_ids, attention_mask) -> "Batch":
        """Validate on the device, with one host sync; return the batch in the right-padded layout."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, sequence], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        if batch == 0 or length == 0:
            raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
        if length > self.package.context_length:
            raise ValueError(
                f"input length {length} exceeds the model's context length {self.package.context_length}"
            )
        # The checks run where the caller's ids are: on the host for host tensors (no device-to-host
        # copy at all), else on the device with one read of a few flags.
        ids = input_ids.to(torch.int64)
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                    f"input_ids shape {tuple(input_ids.shape)}"
                )
            mask = attention_mask.to(ids.device)
        not_binary = ((mask != 0) & (mask != 1)).any()
        mask = mask.to(torch.int64)
        counts = mask.sum(1)
        lead = mask.argmax(1)  # index of each row's first 1
        steps = torch.arange(length, device=ids.device)
        contiguous = mask == ((steps >= lead[:, None]) & (steps < (lead + counts)[:, None]))
        bad_ids = (ids < 0) | (ids >= self.package.vocab_size)
        flags = torch.stack(
            [not_binary, bad_ids.any(), (counts == 0).any(), ~contiguous.all(), (lead > 0).any(), counts.max()]
        ).tolist()  # the one host sync of the checks
        if flags[0]:
            raise ValueError("attention_mask must hold only 0 and 1")
        if flags[1]:
            self._raise_bad_id(ids)
        if flags[2]:
            raise ValueError(f"attention_mask row {(counts == 0).nonzero()[0].item()} has no tokens")
        if flags[3]:
            row = (~contiguous).any(1).nonzero()[0].item()
            raise ValueError(
                f"attention_mask row {row} has gaps: each row's ones must be one contiguous run "
                "(left- or right-padded)"
            )
        def up(tensor):  # host tensors are copied up without waiting for the device
            return tensor.to(self.device, non_blocking=True)

        if not flags[4]:
            return Batch(up(ids), None, up(counts), flags[5])
        # Roll every row so that it starts at position 0 (right-padded layout).
        order = (steps[None, :] + lead[:, None]) % length
        return Batch(up(ids.gather(1, order)), up(lead), up(counts), flags[5])

    def _raise_bad_id(self, ids: torch.Tensor) -> None:
        """Name the first token id outside the vocabulary (the error path of the checks)."""
        row, col = ((ids < 0) | (ids >= self.package.vocab_size)).nonzero()[0].tolist()
        raise ValueError(
            f"token id {ids[row, col].item()} at input_ids[{row}, {col}] is outside the vocabulary "
            f"[0, {self.package.vocab_size})"
        )

    def _positions(self, keep, length: int) -> torch.Tensor | None:
        """Positions of the padded input to return logits for, or None for all of them."""
        if keep is None:
            return None
        if isinstance(keep, torch.Tensor):
            if keep.dim() != 1 or keep.is_floating_point() or keep.is_complex() or keep.dtype == torch.bool:
                raise ValueError("logits_to_keep as a tensor must be 1-D integer positions")
            if keep.numel() == 0:
                raise ValueError("logits_to_keep is an empty tensor: name at least one position")
            keep = keep.to(self.device, torch.int64)
            if ((keep < 0) | (keep >= length)).any():
                raise ValueError(f"logits_to_keep positions must lie in [0, {length})")
            return keep
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise TypeError(f"cont_len must be an int, got {type(keep).__name__}")
        if keep < 0:
            raise ValueError(f"cont_len must be >= 0, got {keep}")
        if keep == 0 or keep >= length:
            return None
        return torch.arange(length - keep, length, device=self.device)

    @runtime.out_of_memory_is_runtime_error
    def logits_at(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        """Logits `[n, V]` at the n positions `(rows[i], cols[i])` of the padded input, in the
        caller's layout. With the graph rewrite, only those n positions reach the LM head."""
        ids, shift, _, _ = self._checked_inputs(input_ids, attention_mask)
        batch, length = ids.shape
        rows, cols = torch.as_tensor(rows), torch.as_tensor(cols)
        for name, value in (("rows", rows), ("cols", cols)):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise TypeError(f"{name} must hold integer positions, got dtype {value.dtype}")
        rows, cols = rows.to(self.device, torch.int64), cols.to(self.device, torch.int64)
        if rows.shape != cols.shape or rows.dim() != 1:
            raise ValueError(f"rows and cols must be 1-D of one length, got {tuple(rows.shape)} and {tuple(cols.shape)}")
        if ((rows < 0) | (rows >= batch) | (cols < 0) | (cols >= length)).any():
            raise ValueError(f"positions must lie inside the input of shape {(batch, length)}")
        return self._logits(ids, shift, rows, cols)

    def _logits(self, ids, shift, rows=None, cols=None, cache=None) -> torch.Tensor:
        """Prefill right-padded `ids`; logits at flat positions `rows * T + cols` of the caller's
        layout (`shift` rolls them to where the rows now are), or at every position. The present KV
        goes into `cache` when given, else into a scratch buffer."""
        batch, length = ids.shape
        flat = None
        if rows is not None:
            if shift is not None:
                cols = (cols - shift[rows]) % length
            flat = rows * length + cols
        elif shift is not None:
            steps = torch.arange(length, device=self.device)
            flat = ((steps[None, :] - shift[:, None]) % length + length * torch.arange(batch, device=self.device)[:, None]).flatten()
        binding = self.session.io_binding()
        if cache is None:
            self._bind_prefill_cache(binding, batch, length)
        else:
            cache.bind(binding, length)
        logits = self._run(binding, ids, flat, prefill=True)
        return logits if rows is not None or shift is None else logits.view(batch, length, -1)

    def _run(self, binding, ids, flat=None, prefill=False, mask=None, positions=None) -> torch.Tensor:
        """Bind `ids` and run: logits `[n, V]` at the flat positions `flat` of `ids`, or `[B, T, V]`.

        A prefill binds an all-ones mask and positions 0..T-1: rows are right-padded, and attention
        is causal, so no real position sees the padding after it; the logits of the real positions
        are exact, and the attention kernels are spared the padded rows they mishandle (sliding
        windows, left padding). A step over a cache passes its own `mask` and `positions`.
        """
        batch, length = ids.shape
        decoder = self.package.decoder
        self.bind_tokens(binding, ids)
        if prefill:
            mask = torch.ones_like(ids, dtype=self._mask_dtype) if decoder.attention_mask else None
            positions = torch.arange(length, device=self.device).expand(batch, -1) if decoder.position_ids else None
        if decoder.attention_mask:
            runtime.bind_input(binding, decoder.attention_mask, mask.to(self._mask_dtype).contiguous())
        if decoder.position_ids:
            runtime.bind_input(binding, decoder.position_ids, self.position_input(positions))
        vocab = self.package.vocab_size
        if self.keeps_positions:
            kept = flat if flat is not None else torch.arange(batch * length, device=self.device)
            runtime.bind_input(binding, graph.LOGITS_INDICES, kept)
            logits = torch.empty(kept.numel(), vocab, dtype=self._logits_dtype, device=self.device)
        else:
            logits = torch.empty(batch, length, vocab, dtype=self._logits_dtype, device=self.device)
        runtime.bind_output(binding, decoder.logits, logits)
        runtime.run(self.session, binding)
        if flat is None:
            return logits.view(batch, length, vocab)
        if not self.keeps_positions:
            logits = logits.view(batch * length, vocab).index_select(0, flat)
        return logits

    def bind_tokens(self, binding: ort.IOBinding, ids: torch.Tensor) -> None:
        """Bind the decoder's token input: the ids, or what the embedding model makes of them
        (its outputs stay on the device and are bound to the decoder as they are)."""
        if self.embedding_session is None:
            runtime.bind_input(binding, self.package.decoder.input_ids, ids.to(self._id_dtype).contiguous())
            return
        embedding = self.package.embedding
        embed = self.embedding_session.io_binding()
        runtime.bind_input(embed, embedding.input_ids, ids.to(self._id_dtype).contiguous())
        for name, empty in self._no_media:
            runtime.bind_input(embed, name, empty)
        for output, _ in embedding.feeds:
            runtime.bind_output_to(embed, output, self.device)
        runtime.run(self.embedding_session, embed)
        for (_, decoder_input), value in zip(embedding.feeds, embed.get_outputs()):
            binding.bind_ortvalue_input(decoder_input, value)

    def position_input(self, positions: torch.Tensor) -> torch.Tensor:
        """`[B, S]` positions in the decoder's dtype and rank (mRoPE decoders take `[3, B, S]`:
        for text, the temporal, height and width positions are all the token's position)."""
        positions = positions.to(self._position_dtype)
        if self.package.decoder.position_rank == 3:
            positions = positions.expand(3, *positions.shape)
        return positions.contiguous()

    def _bind_prefill_cache(self, binding: ort.IOBinding, batch: int, length: int) -> None:
        """An empty past for every layer; the present is written into this thread's reused scratch buffer."""
        layers = self.package.decoder.layers
        sizes = [0 if kv.window else batch * kv.num_kv_heads * length * kv.head_size for kv in layers]
        needed = 2 * sum(sizes)
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.numel() < needed or scratch.device != self.device:
            scratch = self._scratch.buffer = torch.empty(needed, dtype=self._kv_dtype, device=self.device)
        offset = 0
        for kv, size in zip(layers, sizes):
            if kv.window:  # ORT's sliding-window attention wants a window-sized buffer shared by past and present
                for name_in, name_out in ((kv.past_key, kv.present_key), (kv.past_value, kv.present_value)):
                    ring = torch.zeros(batch, kv.num_kv_heads, kv.window, kv.head_size, dtype=self._kv_dtype, device=self.device)
                    runtime.bind_input(binding, name_in, ring)
                    runtime.bind_output(binding, name_out, ring)
                continue
            empty = torch.empty(batch, kv.num_kv_heads, 0, kv.head_size, dtype=self._kv_dtype, device=self.device)
            runtime.bind_input(binding, kv.past_key, empty)
            runtime.bind_input(binding, kv.past_value, empty)
            shape = (batch, kv.num_kv_heads, length, kv.head_size)
            runtime.bind_output(binding, kv.present_key, scratch[offset : offset + size].view(shape))
            runtime.bind_output(binding, kv.present_value, scratch[offset + size : offset + 2 * size].view(shape))
            offset += 2 * size
