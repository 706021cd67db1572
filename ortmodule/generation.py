"""Decoding with the KV cache kept on the device.

`KVCache` holds one key and one value buffer per layer, `[batch, kv_heads, capacity, head_size]`
with each layer's own heads and head size, bound as both the past and the present of every step:
ONNX Runtime's GroupQueryAttention writes the new entries in place (the packages'
`past_present_share_buffer` layout), so the cache never moves and never passes through the host.

Rows are kept right-padded: row b's tokens fill positions `[0, lengths[b])`, and each step writes
row b's new entries at `lengths[b]` (the attention mask tells GroupQueryAttention each row's
length). A prompt batch prefills with an all-ones mask, which is exact because attention is
causal; the entries the padding leaves behind lie past each row's length and are overwritten.

`generate` follows transformers' sampling loop (`GenerationMixin._sample`) step for step, with
transformers' own logits processors and stopping criteria, so its tokens equal transformers'.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import TYPE_CHECKING

import onnxruntime as ort
import torch
from transformers import GenerationConfig
from transformers.generation import (
    EosTokenCriteria,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import graph, runtime

if TYPE_CHECKING:
    from .modeling import OrtModelForCausalLM


class KVCache:
    """The KV cache of one batch on the model's device, returned as `past_key_values`.

    Rows are right-padded: `cache[i]` is layer i's `(key, value)`, each `[B, kv_heads, T, head_size]`
    with T the longest row; row b's entries past `lengths[b]` are not part of its sequence.
    """

    def __init__(self, model: OrtModelForCausalLM, batch: int, capacity: int):
        self.layers = model.package.decoder.layers
        self.shared = model.package.decoder.shares_kv_buffer
        if self.shared:
            # Sliding-window attention in ONNX Runtime wants a buffer of at least the window.
            capacity = max([capacity] + [kv.window or 0 for kv in self.layers])
        else:
            # Attention that concatenates past and new entries into a new present: the buffers
            # hold exactly the columns taken in, and `valid` marks the padding among them.
            capacity = 0
            self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=model.device)
        self.keys, self.values = [], []
        for kv in self.layers:
            shape = (batch, kv.num_kv_heads, capacity, kv.head_size)
            self.keys.append(torch.zeros(shape, dtype=model.dtype, device=model.device))
            self.values.append(torch.zeros(shape, dtype=model.dtype, device=model.device))
        self._next: tuple[list, list] | None = None  # the presents being written (concatenating attention)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=model.device)  # tokens held per row
        self.longest = 0  # max(lengths), kept on the host
        self.seen = 0  # columns of the caller's input_ids (padding included) this cache has taken in
        # The caller's attention mask so far ([B, seen]), for checking a step's mask; None inside
        # generate and scoring, which build their own steps.
        self.caller_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, needed: int, limit: int) -> None:
        """Grow every buffer to hold `needed` positions (doubling, up to `limit`), copying on the device."""
        if not self.shared or needed <= self.capacity:
            return
        capacity = min(max(needed, 2 * self.capacity), limit)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                new[:, :, : old.shape[2]] = old
                buffers[i] = new

    def bind(self, binding: ort.IOBinding, new: int) -> None:
        """Bind every layer's past and present for a run that adds `new` columns. A shared buffer
        is both (ONNX Runtime writes in place); otherwise the presents go to new buffers."""
        if not self.shared:
            self._next = ([], [])
        for kv, key, value in zip(self.layers, self.keys, self.values):
            runtime.bind_input(binding, kv.past_key, key)
            runtime.bind_input(binding, kv.past_value, value)
            if self.shared:
                runtime.bind_output(binding, kv.present_key, key)
                runtime.bind_output(binding, kv.present_value, value)
                continue
            shape = (*key.shape[:2], key.shape[2] + new, key.shape[3])
            for name, buffers in ((kv.present_key, self._next[0]), (kv.present_value, self._next[1])):
                buffers.append(key.new_empty(shape))
                runtime.bind_output(binding, name, buffers[-1])

    def step_mask(self, new: int, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask of a step that appends `new` tokens to every row."""
        if not self.shared:
            return torch.cat([self.valid, self.valid.new_ones(self.batch_size, new)], 1).to(dtype)
        steps = torch.arange(self.longest + new, device=self.lengths.device)
        return (steps[None, :] < (self.lengths + new)[:, None]).to(dtype)

    def start(self, lengths: torch.Tensor, longest: int, columns: int) -> None:
        """Record a prefilled prompt batch: per-row lengths, the longest, the caller's width."""
        self.lengths.copy_(lengths)
        self.longest = longest
        self.seen = columns
        if not self.shared:
            self._take_presents()
            self.valid = torch.arange(columns, device=lengths.device)[None, :] < lengths[:, None]

    def start_from(self, source: "KVCache", rows: torch.Tensor, lengths: torch.Tensor, longest: int) -> None:
        """Start row i as row `rows[i]` of `source`, holding its first `lengths[i]` entries (prefixes
        shared by several rows, run once in `source`)."""
        width = source.longest if source.shared else source.capacity
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for i, buffer in enumerate(theirs):
                picked = buffer.index_select(0, rows)[:, :, :width]
                if self.shared:
                    mine[i][:, :, :width] = picked
                else:
                    mine[i] = picked.contiguous()
        if not self.shared:
            self.valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        self.lengths.copy_(lengths)
        self.longest = longest
        self.seen = width

    def advance(self, new: int, columns: int) -> None:
        self.lengths += new
        self.longest += new
        self.seen += columns
        if not self.shared:
            self._take_presents()
            self.valid = torch.cat([self.valid, self.valid.new_ones(self.batch_size, new)], 1)

    def _take_presents(self) -> None:
        self.keys, self.values = self._next
        self._next = None

    def _span(self) -> int:
        return self.longest if self.shared else self.capacity

    # The parts of transformers' Cache interface that user code reads.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, : self._span()], self.values[layer][:, :, : self._span()]

    def __repr__(self) -> str:
        return f"KVCache(batch={self.batch_size}, layers={len(self)}, longest={self.longest}, capacity={self.capacity})"


# Options of transformers' GenerationConfig that generate() carries out, with their neutral values.
_NEUTRAL = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "guidance_scale": 1.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "encoder_repetition_penalty": 1.0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "max_time": None,
    "watermarking_config": None,
    "prompt_lookup_num_tokens": None,
    "dola_layers": None,
    "constraints": None,
}

# Arguments of generate() that are not GenerationConfig fields.
_CALL_ARGUMENTS = {"attention_mask", "stopping_criteria", "logits_processor", "tokenizer", "generator", "streamer"}


def resolve_config(model: OrtModelForCausalLM, generation_config: GenerationConfig | None, kwargs: dict):
    """transformers' merge: the model's generation config (or the one given), updated by kwargs.
    Returns the config and the call arguments that are not config fields."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}; "
            "pass GenerationConfig(**options), or the options themselves as keyword arguments"
        )
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    # The options given are checked before transformers' update validates them (and fails on a
    # string count with a raw TypeError); the merged config is checked after.
    given = {name: kwargs.get(name) for name in _CHECKED}
    check_config(SimpleNamespace(**given, do_sample=kwargs.get("do_sample", config.do_sample)),
                 model.package.vocab_size)
    rest = config.update(**kwargs)
    rest.pop("use_cache", None)  # the cache is always used
    unknown = sorted(set(rest) - _CALL_ARGUMENTS)
    if unknown:
        raise ValueError(f"generate() got arguments it does not use: {', '.join(unknown)}")
    unsupported = [
        f"{name}={getattr(config, name)!r}"
        for name, neutral in _NEUTRAL.items()
        if getattr(config, name, None) not in (None, neutral)
    ]
    if unsupported:
        raise ValueError(
            f"generate() does greedy decoding and sampling only; not supported: {', '.join(unsupported)}"
        )
    check_config(config, model.package.vocab_size)
    return config, rest


_CHECKED = ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "top_k", "no_repeat_ngram_size", "top_p",
            "min_p", "temperature", "repetition_penalty", "pad_token_id", "eos_token_id")


def _bad(name: str, value, wanted: str) -> ValueError:
    return ValueError(f"{name} must be {wanted}, got {value!r}")


def check_config(config: GenerationConfig, vocab: int) -> None:
    """Every option generate() reads, checked before anything runs (a ValueError naming it)."""
    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for name, low in (("max_new_tokens", 1), ("max_length", 1), ("min_new_tokens", 0), ("min_length", 0),
                      ("top_k", 0), ("no_repeat_ngram_size", 0)):
        value = getattr(config, name, None)
        if value is not None and (not integer(value) or value < low):
            raise _bad(name, value, f"an integer >= {low}")
    for name, low, high, open_low in (("top_p", 0.0, 1.0, True), ("min_p", 0.0, 1.0, False),
                                      ("temperature", 0.0, float("inf"), True),
                                      ("repetition_penalty", 0.0, float("inf"), True)):
        value = getattr(config, name, None)
        if value is None or (name == "temperature" and not config.do_sample):  # greedy ignores it (0.0 is common)
            continue
        if not number(value) or value != value or value > high or value < low or (open_low and value == low):
            wanted = f"a number in {'(' if open_low else '['}{low}, {high}]" if high != float("inf") else f"a number > {low}"
            raise _bad(name, value, wanted)
    pad = config.pad_token_id
    if pad is not None and (not integer(pad) or not 0 <= pad < vocab):
        raise _bad("pad_token_id", pad, f"a token id in [0, {vocab})")
    eos = config.eos_token_id
    if eos is not None and not (isinstance(eos, list) and not eos):
        ids = eos.tolist() if isinstance(eos, torch.Tensor) else eos if isinstance(eos, list) else [eos]
        for value in ids:
            if not integer(value) or not 0 <= value < vocab:
                raise _bad("eos_token_id", eos, f"a token id (or a list of them) in [0, {vocab})")


def _value(config: GenerationConfig, name: str, default):
    value = getattr(config, name, None)
    return default if value is None else value


def _eos_ids(config: GenerationConfig) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else eos if isinstance(eos, list) else [eos])]


def logits_processors(config: GenerationConfig, prompt_length: int, mask, eos, extra, device):
    """transformers' processors for the options set, in transformers' order (warpers last)."""
    processors = LogitsProcessorList()
    penalty = _value(config, "repetition_penalty", 1.0)
    if penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=(mask != 0).int().argmax(1)))
    if _value(config, "no_repeat_ngram_size", 0) > 0:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if eos is not None and _value(config, "min_length", 0) > 0:
        processors.append(MinLengthLogitsProcessor(config.min_length, eos, device=device))
    if eos is not None and _value(config, "min_new_tokens", 0) > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos, device=device))
    for custom in extra or []:
        processors = LogitsProcessorList([p for p in processors if type(p) is not type(custom)] + [custom])
    if _value(config, "do_sample", False):
        temperature = _value(config, "temperature", 1.0)
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        top_k = _value(config, "top_k", 50)
        if top_k != 0:
            processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        top_p = _value(config, "top_p", 1.0)
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return processors


def stopping_criteria(config: GenerationConfig, eos, tokenizer, extra) -> StoppingCriteriaList:
    """Stop strings, end-of-sequence ids and the caller's criteria (the length limit is the loop's)."""
    criteria = StoppingCriteriaList()
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer=... to generate()")
        criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    if eos is not None:
        criteria.append(EosTokenCriteria(eos_token_id=eos))
    criteria.extend(extra or [])
    return criteria


@torch.inference_mode()
def generate(
    model: OrtModelForCausalLM,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig | None = None,
    **kwargs,
):
    config, call = resolve_config(model, generation_config, kwargs)
    device = model.device
    batch = model._checked_inputs(input_ids, call.get("attention_mask"))
    size, width = batch.ids.shape
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = _value(config, "max_length", 20) - width
    if max_new < 1:
        raise ValueError(
            f"nothing to generate: max_length {config.max_length} is not above the prompt length {width}; "
            "set max_new_tokens"
        )
    if batch.longest + max_new > model.package.context_length:
        raise ValueError(
            f"prompt of {batch.longest} tokens + {max_new} new tokens exceeds the model's context length "
            f"{model.package.context_length}"
        )
    generator = call.get("generator")
    if generator is not None and torch.device(generator.device).type != device.type:
        raise ValueError(f"generator is on {generator.device}, the model on {device}")

    eos_ids = _eos_ids(config)
    eos = torch.tensor(eos_ids, device=device) if eos_ids else None
    pad_id = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    mask = call.get("attention_mask")
    mask = torch.ones_like(batch.ids) if mask is None else mask.to(device)
    processors = logits_processors(config, width, mask, eos, call.get("logits_processor"), device)
    criteria = stopping_criteria(config, eos, call.get("tokenizer"), call.get("stopping_criteria"))
    do_sample = bool(_value(config, "do_sample", False))
    streamer = call.get("streamer")
    keep_scores = bool(config.return_dict_in_generate and config.output_scores)
    keep_logits = bool(config.return_dict_in_generate and config.output_logits)

    # The output in the caller's layout: the prompt as given, then one column per step.
    sequences = torch.empty(size, width + max_new, dtype=torch.int64, device=device)
    sequences[:, :width] = input_ids.to(device)
    if streamer is not None:
        streamer.put(sequences[:, :width].cpu())

    # The prefill writes every column of the padded prompt, so the cache holds at least that many.
    cache = KVCache(model, size, max(width, batch.longest + max_new))
    step = model._decode_step(cache)
    logits = step.prefill(batch)
    unfinished = torch.ones(size, dtype=torch.bool, device=device)
    # The length at which every row had stopped (0 while one runs), kept on the device. On a GPU
    # it is read every STOP_CHECK_EVERY steps, so that the loop queues steps without waiting for
    # the device; on the CPU (where a read costs nothing) and with a streamer, every step. The
    # output is cut where transformers' loop would have stopped.
    stopped_at = torch.zeros((), dtype=torch.int64, device=device)
    check_every = 1 if device.type == "cpu" or streamer is not None else STOP_CHECK_EVERY
    scores, raw = [], []
    length = width
    while True:
        next_scores = processors(sequences[:, :length], logits.float())
        if keep_scores:
            scores.append(next_scores)
        if keep_logits:
            raw.append(logits.float().clone())
        if do_sample:
            probs = torch.softmax(next_scores, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            tokens = next_scores.argmax(-1)
        if eos is not None:
            tokens = torch.where(unfinished, tokens, pad_id)
        sequences[:, length] = tokens
        length += 1
        if streamer is not None:
            streamer.put(tokens.cpu())
        if length == width + max_new:
            break
        if len(criteria):
            unfinished &= ~criteria(sequences[:, :length], next_scores)
            stopped_at = torch.where((stopped_at == 0) & ~unfinished.any(), length, stopped_at)
            if (length - width) % check_every == 0 and stopped_at.item():
                break  # the loop's one read from the device
        logits = step.decode(tokens)
    if streamer is not None:
        streamer.end()
    if len(criteria):
        length = stopped_at.item() or length
        del scores[length - width :], raw[length - width :]
    sequences = sequences[:, :length]
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(scores) if keep_scores else None,
            logits=tuple(raw) if keep_logits else None,
        )
    return sequences


# On a GPU, how many decode steps run between two reads of the stop flag: a read waits for the
# device to catch up, so reading it every step keeps the host from queueing ahead (transformers'
# loop does). At most STOP_CHECK_EVERY - 1 steps run after every row has stopped, and are cut.
STOP_CHECK_EVERY = 8


class DecodeStep:
    """Runs the decoder over a KVCache, one binding reused for every step. On the CPU the cache,
    token, position and logits buffers are bound once and each step rebinds only the attention
    mask; on CUDA each step binds them all again (see `_bind_decode_buffers`)."""

    def __init__(self, model: OrtModelForCausalLM, cache: KVCache):
        self.model = model
        self.cache = cache
        self.decoder = model.package.decoder
        self.binding = model.session.io_binding()

    def prefill(self, batch) -> torch.Tensor:
        """Run the right-padded prompts; return each row's last logits `[B, V]`."""
        model, cache = self.model, self.cache
        size, width = batch.ids.shape
        last = torch.arange(size, device=model.device) * width + batch.lengths - 1
        cache.bind(self.binding, width)
        logits = model._run(self.binding, batch.ids, last, prefill=True)
        cache.start(batch.lengths, batch.longest, width)
        self._bind_decode_buffers()
        return logits

    def _bind_decode_buffers(self) -> None:
        model, size = self.model, self.cache.batch_size
        self.tokens = torch.empty(size, 1, dtype=model._id_dtype, device=model.device)
        self.positions = None
        if self.decoder.position_ids:
            self.positions = model.position_input(torch.zeros(size, 1, dtype=torch.int64, device=model.device))
        self.rows = torch.arange(size, device=model.device) if model.keeps_positions else None
        vocab = model.package.vocab_size
        shape = (size, vocab) if model.keeps_positions else (size, 1, vocab)
        self.logits = torch.empty(shape, dtype=model._logits_dtype, device=model.device)
        # On the CPU a binding reads its tensors at run time, so the buffers are bound once and
        # updated in place. On CUDA, ONNX Runtime copies the inputs of nodes it placed on the CPU
        # (an fp32 GroupQueryAttention) when they are bound, so every step binds them again.
        self.rebind = model.device.type != "cpu"
        self._bind_step_buffers()

    def _bind_step_buffers(self) -> None:
        binding, decoder = self.binding, self.decoder
        if decoder.input_ids:
            runtime.bind_input(binding, decoder.input_ids, self.tokens)
        if self.positions is not None:
            runtime.bind_input(binding, decoder.position_ids, self.positions)
        if self.rows is not None:
            runtime.bind_input(binding, graph.LOGITS_INDICES, self.rows)
        runtime.bind_output(binding, decoder.logits, self.logits)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token to every row; return the next logits `[B, V]`."""
        cache, decoder = self.cache, self.decoder
        self.tokens.copy_(tokens[:, None])
        if self.positions is not None:
            self.positions.copy_(cache.lengths[:, None])  # broadcast over mRoPE's 3 sections, cast in place
        if self.rebind:
            self._bind_step_buffers()
        if not decoder.input_ids:  # the embedding model turns the tokens into the decoder's inputs
            self.model.bind_tokens(self.binding, self.tokens)
        if decoder.attention_mask:
            runtime.bind_input(self.binding, decoder.attention_mask, cache.step_mask(1, self.model._mask_dtype))
        if self.rebind or not cache.shared:
            cache.bind(self.binding, 1)
        runtime.run(self.model.session, self.binding)
        cache.advance(1, 1)
        return self.logits.view(cache.batch_size, -1)
