"""`generate`: greedy decoding and sampling over a `KVCache` kept on the device.

It follows transformers' sampling loop (`GenerationMixin._sample`) step for step, with
transformers' own logits processors and stopping criteria, so its tokens equal transformers'.
The prompts prefill into the cache (`Decoder.prefill`), then each new token is one
`Decoder.step`; nothing but the stop flag is read back to the host inside the loop.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

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

from . import inputs
from .decoder import Decoder

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


def resolve_config(default: GenerationConfig, vocab: int, generation_config: GenerationConfig | None, kwargs: dict):
    """transformers' merge: the model's generation config `default` (or the one given), updated by
    kwargs. Returns the config and the call arguments that are not config fields."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}; "
            "pass GenerationConfig(**options), or the options themselves as keyword arguments"
        )
    config = copy.deepcopy(generation_config if generation_config is not None else default)
    # The options given are checked before transformers' update validates them (and fails on a
    # string count with a raw TypeError); the merged config is checked after.
    given = {name: kwargs.get(name) for name in _CHECKED}
    check_config(SimpleNamespace(**given, do_sample=kwargs.get("do_sample", config.do_sample)), vocab)
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
    check_config(config, vocab)
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
            bracket = "(" if open_low else "["
            wanted = f"a number in {bracket}{low}, {high}]" if high != float("inf") else f"a number > {low}"
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
    return [int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else eos if isinstance(eos,
                                                                                                  list) else [eos])]


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
    decoder: Decoder,
    default: GenerationConfig,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig | None = None,
    **kwargs,
):
    """`OrtModelForCausalLM.generate`: `default` is the model's generation config."""
    config, call = resolve_config(default, decoder.vocab_size, generation_config, kwargs)
    context = decoder.package.context_length
    rows = inputs.check_batch(input_ids, call.get("attention_mask"), decoder.vocab_size, context, decoder.device)
    width = rows.ids.shape[1]
    max_new = config.max_new_tokens if config.max_new_tokens is not None else _value(config, "max_length", 20) - width
    if max_new < 1:
        raise ValueError(
            f"nothing to generate: max_length {config.max_length} is not above the prompt length {width}; "
            "set max_new_tokens"
        )
    if rows.longest + max_new > context:
        raise ValueError(
            f"prompt of {rows.longest} tokens + {max_new} new tokens exceeds the model's context length {context}"
        )
    generator = call.get("generator")
    if generator is not None and torch.device(generator.device).type != decoder.device.type:
        raise ValueError(f"generator is on {generator.device}, the model on {decoder.device}")
    return _Generation(decoder, config, call, input_ids, max_new).run(rows)


# On a GPU, how many decode steps run between two reads of the stop flag: a read waits for the
# device to catch up, so reading it every step keeps the host from queueing ahead (transformers'
# loop does). At most STOP_CHECK_EVERY - 1 steps run after every row has stopped, and are cut.
STOP_CHECK_EVERY = 8


class _Generation:
    """One generate call: its processors, criteria and output buffer, and the decoding loop."""

    def __init__(self, decoder: Decoder, config: GenerationConfig, call: dict, input_ids: torch.Tensor, max_new: int):
        device = decoder.device
        self.decoder, self.config, self.max_new = decoder, config, max_new
        size, self.width = input_ids.shape
        eos_ids = _eos_ids(config)
        self.eos = torch.tensor(eos_ids, device=device) if eos_ids else None
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
        mask = call.get("attention_mask")
        mask = torch.ones(size, self.width, dtype=torch.int64, device=device) if mask is None else mask.to(device)
        self.processors = logits_processors(config, self.width, mask, self.eos, call.get("logits_processor"), device)
        self.criteria = stopping_criteria(config, self.eos, call.get("tokenizer"), call.get("stopping_criteria"))
        self.do_sample = bool(_value(config, "do_sample", False))
        self.generator = call.get("generator")
        self.streamer = call.get("streamer")
        self.keep_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.keep_logits = bool(config.return_dict_in_generate and config.output_logits)
        # The output in the caller's layout: the prompt as given, then one column per step.
        self.sequences = torch.empty(size, self.width + max_new, dtype=torch.int64, device=device)
        self.sequences[:, : self.width] = input_ids.to(device)
        self.scores, self.raw = [], []

    def run(self, rows: inputs.Rows):
        decoder, size, width = self.decoder, self.sequences.shape[0], self.width
        if self.streamer is not None:
            self.streamer.put(self.sequences[:, :width].cpu())
        # The prefill writes every column of the padded prompt, so the cache holds at least that many.
        cache = decoder.new_cache(size, max(width, rows.longest + self.max_new))
        last = torch.arange(size, device=decoder.device) * width + rows.lengths - 1
        logits = decoder.prefill(rows, last, cache)
        unfinished = torch.ones(size, dtype=torch.bool, device=decoder.device)
        # The length at which every row had stopped (0 while one runs), kept on the device. On a GPU
        # it is read every STOP_CHECK_EVERY steps, so that the loop queues steps without waiting for
        # the device; on the CPU (where a read costs nothing) and with a streamer, every step. The
        # output is cut where transformers' loop would have stopped.
        stopped_at = torch.zeros((), dtype=torch.int64, device=decoder.device)
        check_every = 1 if decoder.device.type == "cpu" or self.streamer is not None else STOP_CHECK_EVERY
        length = width
        while True:
            tokens, scores = self._next_tokens(logits, length, unfinished)
            length += 1
            if length == width + self.max_new:
                break
            if len(self.criteria):
                unfinished &= ~self.criteria(self.sequences[:, :length], scores)
                stopped_at = torch.where((stopped_at == 0) & ~unfinished.any(), length, stopped_at)
                if (length - width) % check_every == 0 and stopped_at.item():
                    break  # the loop's one read from the device
            logits = decoder.step(tokens[:, None], cache).view(size, -1)
        if len(self.criteria):
            length = stopped_at.item() or length
        return self._finish(length)

    def _next_tokens(self, logits: torch.Tensor, length: int, unfinished: torch.Tensor):
        """Choose every row's next token from its logits and write it at column `length`; return
        the tokens and the processed scores they were chosen from."""
        next_scores = self.processors(self.sequences[:, :length], logits.float())
        if self.keep_scores:
            self.scores.append(next_scores)
        if self.keep_logits:
            self.raw.append(logits.float().clone())
        if self.do_sample:
            probs = torch.softmax(next_scores, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        else:
            tokens = next_scores.argmax(-1)
        if self.eos is not None:
            tokens = torch.where(unfinished, tokens, self.pad_id)
        self.sequences[:, length] = tokens
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        return tokens, next_scores

    def _finish(self, length: int):
        if self.streamer is not None:
            self.streamer.end()
        del self.scores[length - self.width :], self.raw[length - self.width :]
        sequences = self.sequences[:, :length]
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(self.scores) if self.keep_scores else None,
            logits=tuple(self.raw) if self.keep_logits else None,
        )
