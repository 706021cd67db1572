"""`OrtModelForCausalLM`: a torch.nn.Module with the Hugging Face model surface over a `Decoder`.

This file keeps the Hugging Face surface and the argument handling; `decoder.py` runs the
sessions. Forward is prefill only, or with `past_key_values` a step over a `KVCache`: rows are
checked and brought to the right-padded layout (`inputs.check_batch`; left-padded rows are
rolled, because the builder's GroupQueryAttention graphs get left padding wrong), the positions
asked for become the decoder's flat indices (`inputs.flat_index`), and the logits come back in
the caller's layout.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import torch
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import generation, inputs, runtime
from .cache import KVCache
from .decoder import Decoder
from .hf import build_config, build_generation_config, load_tokenizer
from .package import Package, read_package

__all__ = ["OrtModelForCausalLM", "build_config", "build_generation_config", "load_tokenizer"]


class OrtModelForCausalLM(torch.nn.Module):
    """A causal LM over an ONNX GenAI package with the Hugging Face model surface.

    `model(input_ids, attention_mask, cont_len=k).logits` is a torch tensor on `model.device`,
    `[B, k, V]` for the last k positions of the padded input (`[B, T, V]` when k is None or 0).
    Forward, `logits_at` and `generate` may run from several threads at once; a `KVCache` takes one
    run at a time.
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
        self.decoder = Decoder(package, runtime.parse_device(device), session_options, provider_options,
                               rewrite_lm_head, cache_dir)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        provider_options: dict | None = None,
        session_options: ort.SessionOptions | None = None,
        rewrite_lm_head: bool = True,
        cache_dir: str | Path | None = None,
    ) -> OrtModelForCausalLM:
        """Load a GenAI package folder onto `device` ('cpu', 'cuda' or 'cuda:N')."""
        return cls(read_package(path), device, session_options, provider_options, rewrite_lm_head, cache_dir)

    # ---- the Hugging Face surface -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.kv_dtype

    @property
    def keeps_positions(self) -> bool:
        """True when the LM head runs only at the positions asked for (the graph rewrite applied)."""
        return self.decoder.keeps_positions

    @property
    def session(self):
        """The decoder's ONNX Runtime session."""
        return self.decoder.session

    def to(self, *args, **kwargs) -> OrtModelForCausalLM:
        """Move the sessions to another device. The dtype is fixed by the exported package."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            raise TypeError(
                f"cannot convert an ONNX package to {dtype}: it was exported as {self.dtype}; "
                "export the model again with the precision you need"
            )
        if device is not None:
            device = runtime.parse_device(device)
            if device != self.device:
                self.decoder.load(device)
        return self

    def half(self) -> OrtModelForCausalLM:
        return self.to(torch.float16)

    def float(self) -> OrtModelForCausalLM:
        return self.to(torch.float32)

    def bfloat16(self) -> OrtModelForCausalLM:
        return self.to(torch.bfloat16)

    def double(self) -> OrtModelForCausalLM:
        return self.to(torch.float64)

    def cuda(self, device: int | None = None) -> OrtModelForCausalLM:
        return self.to("cuda" if device is None else f"cuda:{device}")

    def cpu(self) -> OrtModelForCausalLM:
        return self.to("cpu")

    def tie_weights(self) -> None:
        """Nothing to tie: the weights live in the ONNX graph."""

    def can_generate(self) -> bool:
        return True

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The number of weights in the decoder graph (the elements of its initializers; packed for
        quantized weights). None is trainable; `exclude_embeddings` leaves out the token embedding."""
        if only_trainable:
            return 0
        spec = self.package.decoder
        return spec.num_parameters - (spec.embedding_parameters if exclude_embeddings else 0)

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
            logits, cache = self._step(input_ids, attention_mask, past_key_values, keep), past_key_values
        else:
            logits, cache = self._prefill(input_ids, attention_mask, keep, bool(use_cache))
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

    def _rows(self, input_ids, attention_mask) -> inputs.Rows:
        package = self.package
        return inputs.check_batch(input_ids, attention_mask, package.vocab_size, package.context_length, self.device)

    def _prefill(self, input_ids, attention_mask, keep, use_cache: bool) -> tuple[torch.Tensor, KVCache | None]:
        """Logits `[B, k, V]` at the kept positions (every one when none are named) of a prompt batch."""
        rows = self._rows(input_ids, attention_mask)
        batch, width = rows.ids.shape
        cache = self.decoder.new_cache(batch, width) if use_cache else None
        positions = inputs.kept_positions(keep, width, self.device)
        if positions is None:
            index = inputs.every_position(rows)
        else:
            index = inputs.each_row(batch, width, positions, rows.shift)
        logits = self.decoder.prefill(rows, index, cache).view(batch, -1, self.package.vocab_size)
        if cache is not None:
            given = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            cache.caller_mask = given.to(self.device, torch.int64)
        return logits, cache

    def _step(self, input_ids, attention_mask, cache, keep) -> torch.Tensor:
        """Append `input_ids` [B, s] to every row of `cache`; logits `[B, s, V]` (or the kept ones)."""
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"past_key_values must be the KVCache this model returned (out.past_key_values), "
                f"got {type(cache).__name__}"
            )
        package = self.package
        ids = inputs.check_step(input_ids, attention_mask, cache, package.vocab_size, package.context_length,
                                self.device)
        batch, new = ids.shape
        kept = inputs.kept_positions(keep, new, self.device)
        index = inputs.each_row(batch, new, kept) if kept is not None else None
        logits = self.decoder.step(ids, cache, index)
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
        return generation.generate(self.decoder, self.generation_config, input_ids, generation_config, **kwargs)

    @runtime.out_of_memory_is_runtime_error
    def logits_at(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        """Logits `[n, V]` at the n positions `(rows[i], cols[i])` of the padded input, in the
        caller's layout. With the graph rewrite, only those n positions reach the LM head."""
        checked = self._rows(input_ids, attention_mask)
        batch, length = checked.ids.shape
        rows, cols = torch.as_tensor(rows), torch.as_tensor(cols)
        for name, value in (("rows", rows), ("cols", cols)):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise TypeError(f"{name} must hold integer positions, got dtype {value.dtype}")
        rows, cols = rows.to(self.device, torch.int64), cols.to(self.device, torch.int64)
        if rows.shape != cols.shape or rows.dim() != 1:
            raise ValueError(f"rows and cols must be 1-D of one length, got {tuple(rows.shape)} and "
                             f"{tuple(cols.shape)}")
        if ((rows < 0) | (rows >= batch) | (cols < 0) | (cols >= length)).any():
            raise ValueError(f"positions must lie inside the input of shape {(batch, length)}")
        return self.decoder.prefill(checked, inputs.flat_index(length, rows, cols, checked.shift))
