"""`OrtModelForCausalLM`: a torch.nn.Module with the Hugging Face model surface over a `Decoder`.

This file keeps the Hugging Face surface and the argument handling; `decoder.py` runs the
sessions. Forward is prefill only, or with `past_key_values` a step over a `KVCache`: rows are
checked and brought to the right-padded layout (`inputs.check_batch`; left-padded rows are
rolled, because the builder's GroupQueryAttention graphs get left padding wrong), the positions
asked for become the decoder's flat indices (`inputs.flat_index`), and the logits come back in
the caller's layout.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import onnxruntime as ort
import torch
from transformers import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from . import (
    attentions,
    chunked,
    costs,
    hub,
    images,
    inputs,
    kept_costs,
    runtime,
    variants,
)
from .cache import KVCache, carried, carry, refill
from .decoder import Decoder
from .graph import RewriteSkipped
from .hf import (
    CACHE_NAME,
    build_config,
    build_generation_config,
    check_dtype,
    check_token_fields,
    load_tokenizer,
    loading_options,
)
from .hf_surface import HuggingFaceSurface, note_autocast, training_loss
from .package import NotSupportedError, Package, read_package

__all__ = ["OrtModelForCausalLM", "NotSupportedError", "build_config", "build_generation_config", "load_tokenizer"]


# transformers' pipelines compare a model's class name with these tables and log an error for others
# (text-generation; image-text-to-text, which a package that takes images runs).
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("ortmodule", "OrtModelForCausalLM")
MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.setdefault("ortmodule", "OrtModelForCausalLM")


class OrtModelForCausalLM(HuggingFaceSurface, torch.nn.Module):
    """A causal LM over an ONNX GenAI package with the Hugging Face model surface.

    `model(input_ids, attention_mask, cont_len=k).logits` is a torch tensor on `model.device`,
    `[B, k, V]` for the last k positions of the padded input (`[B, T, V]` when k is None or 0).
    Forward, `logits_at` and `generate` may run from several threads at once; a `KVCache` takes one
    run at a time. `generate` and its helpers (`compute_transition_scores`, ...) are transformers'
    own (`GenerationMixin`), with greedy decoding and sampling run on the device (generation.py).
    """

    main_input_name = "input_ids"
    base_model_prefix = "model"
    _is_stateful = False

    def __init__(
        self,
        package: Package,
        device: str | torch.device = "cpu",
        session_options: ort.SessionOptions | None = None,
        provider_options: dict | None = None,
        rewrite_lm_head: bool | str = True,
        cache_dir: str | Path | None = None,
        prefill_chunk: int | None = None,
        quantized_prefill: str | None = None,
        prefill_attention: str | None = None,
    ):
        super().__init__()
        self.package = package
        self.config = build_config(package)
        self.generation_config = build_generation_config(package)
        self.name_or_path = str(package.root)
        self.decoder = Decoder(package, runtime.parse_device(device), session_options, provider_options,
                               rewrite_lm_head, cache_dir, prefill_chunk, quantized_prefill, prefill_attention)
        self._costs: dict[torch.device, costs.Costs | None] = {}  # measured_costs(), per device
        self._anchor()  # `device_anchor`: next(model.parameters()) tells the device and dtype
        self.eval()  # as transformers' from_pretrained leaves its models

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        provider_options: dict | None = None,
        session_options: ort.SessionOptions | None = None,
        rewrite_lm_head: bool | str = True,
        cache_dir: str | Path | None = None,
        prefill_chunk: int | None = None,
        quantized_prefill: str | None = None,
        prefill_attention: str | None = None,
        subfolder: str | None = None,
        revision: str | None = None,
        **transformers_kwargs,
    ) -> OrtModelForCausalLM:
        """Load a GenAI package folder onto `device` ('cpu' by default, 'cuda' or 'cuda:N'); `path` may also be a
        Hugging Face Hub repository id, with the package's `subfolder` and a `revision` (hub.py).
        `rewrite_lm_head`: True (the LM head at the asked positions only), "float32" (also in float32
        where a half-precision package casts its logits to float32: bf16 logits not rounded) or False.
        `prefill_chunk`: long rows one at a time in chunks of this many tokens (None: 256 on a CPU, off on CUDA; 0: off;
        chunked.py). `quantized_prefill`: "auto" (None), "fp32" or "package", a 4-bit package's
        prefill path on the CPU (nbits.py). `prefill_attention`: "auto" (None: "package" for now),
        "package" or "onnx": runs without a cache (scoring, `forward` without `use_cache`) in a second
        graph whose attention is ONNX's `Attention` op and which writes no KV (extend.py). transformers'
        loading arguments are taken where they mean something here (`dtype`/`torch_dtype`: "auto" or the
        package's precision; `device_map`: one device; `token`, `local_files_only`; `output_attentions`,
        `output_hidden_states`, `use_cache`, the special token ids: set on the config), or have no effect
        (`trust_remote_code`, `attn_implementation`, ...), or are refused by name (hf.loading_options)."""
        device, fetching, dtype, fields = loading_options(device, transformers_kwargs)
        package = read_package(hub.resolve(path, subfolder, revision, **fetching))
        check_dtype(dtype, package)  # before any session is made
        check_token_fields(fields, package)
        return _configured(cls(package, device, session_options, provider_options, rewrite_lm_head, cache_dir,
                               prefill_chunk, quantized_prefill, prefill_attention), fields)

    # ---- the Hugging Face surface -------------------------------------------------------------

    @property
    def keeps_positions(self) -> bool:
        """True when the LM head runs only at the positions asked for (the graph rewrite applied)."""
        return self.decoder.keeps_positions

    @property
    def session(self):
        """The decoder's ONNX Runtime session (an `onnxruntime.InferenceSession`)."""
        return self.decoder.session.ort_session

    def measured_costs(self, refresh: bool = False, measure: bool = True) -> costs.Costs | None:
        """What runs of this model cost on its device (`Costs`), from which context sharing is decided
        (`share_contexts="auto"`, score's `reuse_prefix=None` after 16,384 tokens). Timed at the first call for
        each device (about 30 s for SmolLM2-135M on 2 CPU cores; lm-eval's backend and `ortmodule serve` at load),
        kept in the model and on disk for later processes (kept_costs.py); `refresh=True` times them
        again. None, with a warning, where the runs failed; with `measure=False`, None where this model
        has not got them yet (nothing timed or read)."""
        if not measure and not refresh:
            return self._costs.get(self.device)
        if refresh or self.device not in self._costs:
            self._costs[self.device] = kept_costs.measured(self.decoder, refresh)
        return self._costs[self.device]

    # ---- forward ------------------------------------------------------------------------------

    @runtime.entry_point
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cont_len: int | None = None,
        logits_to_keep: int | torch.Tensor | None = None,
        return_dict: bool | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        position_ids: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        cache: Cache | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        **kwargs,
    ):
        """Logits of `input_ids` (and the loss when `labels` are given).

        With `use_cache=True` the output carries `past_key_values`, a `KVCache` (a
        `transformers.Cache`) on the device; pass it back with the next tokens (`input_ids` [B, s]:
        s new tokens for every row) to continue. `cache`: the same, as transformers 5.24 names it (and
        the output's field). `position_ids` and `cache_position` are taken when they are what
        transformers computes for these rows (the graph derives positions from the mask), else refused.
        """
        keep = _logits_to_keep(logits_to_keep, kwargs, cont_len)
        _refuse_unsupported(input_ids, inputs_embeds, kwargs)
        note_autocast(self.device, self.dtype)
        past, use_cache, blank = _given_cache(past_key_values, cache, use_cache, self.decoder,
                                              input_ids if inputs_embeds is None else inputs_embeds, attention_mask)
        emptied, past = (past, None) if isinstance(past, KVCache) and past.seen == 0 else (None, past)
        asked = _asked(self.config, output_hidden_states, output_attentions)  # hidden states, attention weights
        embeds = None if inputs_embeds is None else \
            variants.checked_embeds(inputs_embeds, self.package.hidden_size, self.device)
        given = (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts,
                 mm_token_type_ids, image_position_ids, image_sizes, token_type_ids)  # images.Media's fields, in order
        media = None if all(value is None for value in given) else \
            images.prompt_media(self.decoder, past, embeds, images.Media(*given))  # text: no object made per call
        runs = _variant(self.decoder, *asked, embeds is not None, media)
        ids = input_ids if embeds is None else embeds.new_zeros(embeds.shape[:2], dtype=torch.int64)  # for the checks
        if past is not None:
            logits, states, weights = self._forward_step(ids, attention_mask, past, keep, position_ids,
                                                         cache_position, runs, embeds)
        else:
            logits, past, states, weights = self._forward_prompt(ids, attention_mask, keep, use_cache, position_ids,
                                                                 cache_position, runs, embeds, media, asked, emptied)
        loss = None if labels is None else _shifted_loss(logits, labels, keep, attention_mask, kwargs, self.training)
        return _output(loss, logits, _kept(past, blank, self.decoder) if use_cache else None, states, weights,
                       return_dict)

    def _rows(self, input_ids, attention_mask, position_ids=None, cache_position=None, positions=None) -> inputs.Rows:
        package = self.package
        return inputs.check_batch(input_ids, attention_mask, package.vocab_size, package.context_length, self.device,
                                  position_ids, cache_position, positions)

    def _forward_prompt(self, input_ids, attention_mask, keep, use_cache: bool, position_ids, cache_position, runs,
                        embeds=None, media=None, asked=(False, False), emptied: KVCache | None = None):
        """`_prompt_run`; where a cache `reset()` or cropped of every column was given (`emptied`), its cache is
        that object, filled in place as transformers' caches are (held meanwhile: another thread's run over it
        is refused, as over any cache)."""
        with contextlib.nullcontext() if emptied is None else self.decoder.holding(emptied):
            logits, cache, states, weights = self._prompt_run(input_ids, attention_mask, keep, use_cache, position_ids,
                                                              cache_position, runs, embeds, media, asked)
            if emptied is not None and cache is not None:
                cache = refill(emptied, cache)
        return logits, cache, states, weights

    def _prompt_run(self, input_ids, attention_mask, keep, use_cache: bool, position_ids, cache_position, runs,
                    embeds=None, media=None, asked=(False, False)):
        """Logits `[B, k, V]` at the kept positions (every one when none are named) of a prompt batch
        (of `embeds` where given; with `media`, `images.prompt_media`', its images), its cache, and from
        `runs` (a `variants.Variant`) the hidden states and attention weights (`asked`: which)."""
        rows = self._rows(input_ids, attention_mask, position_ids, cache_position)
        batch, width = rows.ids.shape
        cache = self.decoder.new_cache(batch, width) if use_cache else None
        positions = inputs.kept_positions(keep, width, self.device)
        if positions is None:
            index = inputs.every_position(rows)
        else:
            index = inputs.each_row(batch, width, positions, rows.shift)
        if media is not None:
            logits, states, weights = images.prefill(self.decoder, input_ids, attention_mask, rows, index, cache,
                                                     media, runs, asked)
        elif runs is not None:
            logits, states, weights = runs.prefill(rows, index, cache, None if embeds is None else
                                                   variants.rolled(rows, embeds), caller_mask=attention_mask)
        else:
            logits, states, weights = self.decoder.prefill(rows, index, cache), None, None
        if logits is not None:  # None from the backbone's run (variants.LAST)
            logits = self.decoder.public(logits).view(batch, -1, self.package.vocab_size)
        if cache is not None:
            given = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            cache.caller_mask = given.to(self.device, torch.int64)
            cache.tokens = None if embeds is not None else input_ids.to(self.device, torch.int64, copy=True)
        return logits, cache, states, weights

    def _forward_step(self, input_ids, attention_mask, cache, keep, position_ids, cache_position, runs, embeds=None):
        """Append `input_ids` [B, s] (or `embeds` [B, s, H]) to every row of `cache`; logits `[B, s, V]`
        (or the kept ones), and from `runs` the new tokens' hidden states and attention weights, else None."""
        _check_own_cache(cache)
        package = self.package
        ids = inputs.check_step(input_ids, attention_mask, cache, package.vocab_size, package.context_length,
                                self.device, position_ids, cache_position)
        batch, new = ids.shape
        kept = inputs.kept_positions(keep, new, self.device)
        index = inputs.each_row(batch, new, kept) if kept is not None else None
        if runs is not None:
            columns = attentions.step_columns(cache, attention_mask, new) if runs.weights else None
            logits, states, weights = runs.step(ids if embeds is None else embeds, cache, index, columns)
        else:
            logits, states, weights = self.decoder.step(ids, cache, index), None, None
        logits = self.decoder.public(logits)
        if cache.caller_mask is not None:
            cache.caller_mask = torch.cat([cache.caller_mask, cache.caller_mask.new_ones(batch, new)], 1)
        if cache.tokens is not None:
            cache.tokens = None if embeds is not None else torch.cat([cache.tokens, ids], 1)
        return logits.view(batch, -1, logits.shape[-1]), states, weights

    @runtime.entry_point
    def logits_at(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor,
                  cols: torch.Tensor, upcast: bool = True, pieces: chunked.Pieces | None = None) -> torch.Tensor | None:
        """Logits `[n, V]` at the n positions `(rows[i], cols[i])` of the padded input, in the
        caller's layout, each one of its row's own tokens (a padded one is a ValueError naming it);
        only those reach the LM head with the graph rewrite. `upcast=False`: in the
        LM head's own precision where the package casts half-precision logits to float32. With
        `pieces`, the logits are handed to `pieces(places, logits)` as they are computed (`places`:
        which of the n, None for all in order; a CPU's long rows come chunk by chunk, no `[n, V]`
        buffer made) and the result is None."""
        checked = self._rows(input_ids, attention_mask, positions=(rows, cols))
        length = checked.ids.shape[1]
        rows, cols = (inputs.to_device(v.to(torch.int64), self.device) for v in checked.positions)
        index = inputs.flat_index(length, rows, cols, checked.shift)
        public = self.decoder.public if upcast else (lambda logits: logits)
        if pieces is not None:
            if not callable(pieces):
                raise TypeError(f"pieces must be a function of (places, logits), got {type(pieces).__name__}")
            self.decoder.prefill(checked, index, pieces=lambda at, part: pieces(at, public(part)))
            return None
        return public(self.decoder.prefill(checked, index))


def _configured(model: OrtModelForCausalLM, fields: dict) -> OrtModelForCausalLM:
    """`model` with `fields` set on its config, as transformers' `from_pretrained` sets its keywords'."""
    for name, value in fields.items():
        setattr(model.config, name, value)
    return model


def _variant(decoder: Decoder, hidden_states: bool, weights: bool, embeds: bool, media: images.Media | None = None):
    """The decoder's runs (a `variants.Variant`) for hidden states, attention weights and/or
    embeddings (the caller's, or the embedding model's outputs for a prompt's `media`; None: none
    asked for, or media that run in blocks.py's graph, which gives their hidden states and weights
    itself); a `NotSupportedError` naming why where its graph cannot give them."""
    if weights and decoder.device.type != "cpu":  # blocks.py's graph too
        raise NotSupportedError(f"output_attentions=True: {attentions.ON_CPU_ONLY}")
    if not (hidden_states or weights or embeds or media is not None) or \
            (media is not None and images.in_blocks(decoder, media)):
        return None
    try:
        return variants.for_decoder(decoder, hidden_states, embeds or media is not None, extra_feeds=media is not None,
                                    attention_weights=weights)
    except RewriteSkipped as reason:
        hidden = "model.model's last hidden state" if hidden_states is variants.LAST else "output_hidden_states=True"
        asked = " with ".join(name for name, on in ((hidden, hidden_states),
                                                     ("output_attentions=True", weights),
                                                     ("inputs_embeds", embeds), ("pixel_values", media is not None))
                              if on)
        raise NotSupportedError(f"{asked}: {reason}") from None


def _asked(config, hidden_states: bool | None, weights: bool | None) -> tuple[bool, bool]:
    """forward's `output_hidden_states` and `output_attentions`, as transformers takes them: where
    the call leaves one out, the config's setting."""
    if hidden_states is None:
        hidden_states = getattr(config, "output_hidden_states", False)
    if weights is None:
        weights = getattr(config, "output_attentions", False)
    last = isinstance(hidden_states, str) and hidden_states == variants.LAST  # the backbone's (backbone.py)
    return (variants.LAST if last else bool(hidden_states)), bool(weights)


def _logits_to_keep(logits_to_keep, kwargs: dict, cont_len=None):
    """`cont_len`, `logits_to_keep` (its transformers name), or `num_logits_to_keep` (taken out of `kwargs`):
    its name in transformers 4.45 to 4.49, which code written for those still passes (transformers 5's models
    take it and ignore it); two of them given is a TypeError (one was silently taken)."""
    given = {name: value for name, value in (("cont_len", cont_len), ("logits_to_keep", logits_to_keep),
                                             ("num_logits_to_keep", kwargs.pop("num_logits_to_keep", None)))
             if value is not None}
    if len(given) > 1:
        raise TypeError(f"pass one of {' and '.join(given)} (names of the same argument), not both")
    return next(iter(given.values()), None)


# transformers' loss keywords that forward takes (with labels; transformers' Trainer passes them).
LOSS_KWARGS = {"num_items_in_batch", "ignore_index", "shift_labels"}


_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch 2.6's first releases may lack it


def _refuse_unsupported(input_ids, inputs_embeds, rest: dict) -> None:
    """forward's arguments that an ONNX package cannot honour, each refused by name; and a trace or export of
    it (torch.jit.trace, torch.export, torch.onnx.export), which would fail inside torch on ONNX Runtime's run."""
    if torch.jit.is_tracing() or _exporting():
        raise NotSupportedError("OrtModelForCausalLM cannot be traced or exported: its forward runs ONNX Runtime, "
                                "and the package's model.onnx already is the exported graph (to export again, "
                                "export the transformers model: `ortmodule export`)")
    unsupported = {k for k, v in rest.items() if v is not None and v is not False} - LOSS_KWARGS
    if unsupported:
        raise TypeError(f"OrtModelForCausalLM.forward does not support {', '.join(sorted(unsupported))}")
    if inputs_embeds is not None and input_ids is not None:
        raise ValueError("pass input_ids or inputs_embeds, not both")
    if input_ids is None and inputs_embeds is None:
        raise ValueError("forward() needs input_ids (or inputs_embeds)")


def _check_own_cache(cache) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"past_key_values must be the KVCache this model returned (out.past_key_values) or an empty "
            f"transformers Cache, got {type(cache).__name__}"
            + (f" holding {cache.get_seq_length()} positions" if isinstance(cache, Cache) else "")
        )


def _given_cache(past_key_values, cache, use_cache: bool | None, decoder, given, attention_mask) \
        -> tuple[Cache | None, bool, Cache | None]:
    """forward's cache, given under either name (`cache` is transformers 5.24's), whether the output
    carries one, and the empty transformers cache given (a `DynamicCache()`; else None). A cache given is
    returned unless use_cache=False; an empty transformers cache means start a KVCache, or, given again,
    continue the one it stands for (`cache.carried`) as transformers' own would hold the earlier calls'
    columns, unless the input is a new prompt: a mask as long as the input (`given`, the ids or embeddings)
    alone (the caller emptied its cache: transformers' `reset` or `crop`, which ortmodule cannot see)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache as past_key_values or as cache, not both")
    given_cache = cache if cache is not None else past_key_values
    if isinstance(given_cache, Cache) and not isinstance(given_cache, KVCache) and given_cache.get_seq_length() == 0:
        kept = carried(given_cache, decoder)
        new = attention_mask is not None and attention_mask.dim() == 2 and given is not None and \
            attention_mask.shape[1] == given.shape[1]
        return (None if kept is None or kept.seen == 0 or given is None or new else kept), True, given_cache
    return given_cache, (given_cache is not None) if use_cache is None else bool(use_cache), None


def _kept(past, blank, decoder):
    """forward's cache, for which the empty transformers cache the caller gave (`blank`) then stands."""
    if blank is not None and isinstance(past, KVCache):
        carry(blank, past, decoder)  # the next call given the same object continues this cache
    return past


def _output(loss, logits: torch.Tensor, past, states, weights, return_dict: bool | None):
    """forward's output as transformers returns it: a `CausalLMOutputWithPast`, or with `return_dict=False`
    the tuple of the fields that are set, in its order."""
    if return_dict is False:
        return tuple(x for x in (loss, logits, past, states, weights) if x is not None)
    return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states, attentions=weights,
                                  **{CACHE_NAME: past})


def _check_targets(targets: torch.Tensor, vocab: int, ignore: int, name: str, shift: int) -> None:
    """The loss's targets (labels shifted, padding's `ignore`), each a token id of the vocabulary or `ignore`:
    a ValueError naming the first other one (in `name`, `shift` columns on), where cross_entropy would raise
    an IndexError on a CPU and stop the process's CUDA context with a device-side assert on a GPU (one small
    read of a flag there)."""
    outside = ((targets < 0) | (targets >= vocab)) & (targets != ignore)
    if bool(outside.any()):
        row, col = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"{name}[{row}, {col + shift}] is {int(targets[row, col])}, outside the vocabulary "
                         f"[0, {vocab}) ({ignore} marks a position the loss ignores)")


def _loss_targets(logits: torch.Tensor, labels: torch.Tensor, loss_kwargs: dict, ignore: int):
    """The logits that predict and their targets: `labels` shifted one position left, or transformers'
    `shift_labels` as given (already shifted: one per position, the last one's included)."""
    shifted = loss_kwargs.get("shift_labels")
    if shifted is None:
        return logits[:, :-1], labels.to(logits.device, torch.int64)[:, 1:], "labels", 1
    if not isinstance(shifted, torch.Tensor) or tuple(shifted.shape) != tuple(logits.shape[:2]) or \
            shifted.is_floating_point() or shifted.dtype == torch.bool:
        got = f"{shifted.dtype} {tuple(shifted.shape)}" if isinstance(shifted, torch.Tensor) else type(shifted).__name__
        raise ValueError(f"shift_labels must be an integer tensor of input_ids' shape {tuple(logits.shape[:2])} "
                         f"(each position's next token, {ignore} to ignore it), got {got}")
    return logits, shifted.to(logits.device, torch.int64), "shift_labels", 0


def _shifted_loss(logits: torch.Tensor, labels, keep, attention_mask, loss_kwargs: dict,
                  training: bool = False) -> torch.Tensor:
    """transformers' causal-LM loss: each position predicts the next label, -100 ignored. A label
    predicted from a padded position (a left-padded row's first token) is left out too: the logits
    there are meaningless (transformers' depend on how its attention treats a query that sees no
    key), so the loss is that of the rows without their padding. With `num_items_in_batch` (transformers'
    Trainer passes it, counted over the gradient accumulation's batches) the sum over the targets divided
    by it, as transformers' loss does, else their mean; transformers' `ignore_index` and `shift_labels`
    (sequence parallelism's labels, already shifted) too. `training` (the model in train mode) with gradients
    on: `training_loss`, whose backward() says why nothing trains."""
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        raise ValueError("labels need the logits of every position: drop cont_len/logits_to_keep")
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(logits.shape[:2]):
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be a tensor of input_ids' shape {tuple(logits.shape[:2])}, got {shape}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer token ids (-100 to ignore a position), got dtype {labels.dtype}")
    ignore = loss_kwargs.get("ignore_index", -100)
    if not isinstance(ignore, int) or isinstance(ignore, bool):
        raise TypeError(f"ignore_index must be an int (the label the loss skips; default -100), got {ignore!r}")
    scored, targets, name, shift = _loss_targets(logits, labels, loss_kwargs, ignore)
    if attention_mask is not None:
        padded = attention_mask[:, -logits.shape[1]:].to(logits.device)[:, : targets.shape[1]] == 0
        targets = targets.masked_fill(padded, ignore)
    _check_targets(targets, logits.shape[-1], ignore, name, shift)
    items = loss_kwargs.get("num_items_in_batch")
    loss = torch.nn.functional.cross_entropy(scored.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore,
                                             reduction="mean" if items is None else "sum")
    loss = loss if items is None else loss / (items.to(loss.device) if torch.is_tensor(items) else items)
    return training_loss(loss) if training and torch.is_grad_enabled() else loss
