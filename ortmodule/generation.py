"""`generate`: transformers' own `generate`, with greedy decoding and sampling run on the device.

`OrtModelForCausalLM` is a `transformers.GenerationMixin`, so `generate` is transformers' code: it
merges the generation config, validates it, builds every logits processor and stopping criterion,
expands rows for `num_return_sequences`, and dispatches by mode. Beam search (and any other mode)
runs transformers' loop over `forward` and the `KVCache` (a `transformers.Cache`: reordered on the
device). Greedy decoding and sampling, what nearly every caller runs, replace transformers' `_sample`
loop with `sample` here: the prompts prefill into the cache (`Decoder.prefill`), each new token is one
`Decoder.step`, and nothing but the stop flag is read back to the host, with the very processors,
criteria and token choice of transformers' loop, so its tokens equal transformers'.

Checked before transformers sees them (a ValueError naming the option): the counts and ranges
generate reads, and arguments that are neither generation options nor inputs it takes.
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import GenerationConfig, GenerationMixin, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from . import images, inputs, shared_prompts
from . import steps as fixed_steps
from .cache import carry
from .hf import CACHE_NAME
from .package import NotSupportedError

# Model inputs generate() takes besides the generation options (`generator`: a torch.Generator
# for sampling, ortmodule's own; the KV cache as `cache` or, before transformers 5.24, `past_key_values`).
MODEL_INPUTS = {"attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "generator", "inputs_embeds",
                "logits_to_keep", *images.NAMES}
# generate()'s own arguments that are not GenerationConfig fields (transformers' signature).
_CALL_ARGUMENTS = {"logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                   "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                   "custom_generate", "tokenizer", "assistant_tokenizer", "trust_remote_code"}

_CHECKED = ("max_new_tokens", "max_length", "min_new_tokens", "min_length", "top_k", "no_repeat_ngram_size", "top_p",
            "min_p", "temperature", "repetition_penalty", "pad_token_id", "eos_token_id", "num_beams",
            "num_return_sequences", "length_penalty", "forced_eos_token_id", "forced_bos_token_id")


def _check_defaults(config, vocab: int, the_models: bool) -> None:
    """`check_config` on the merged config, whose values the call did not give (those were checked) are its
    generation config's: where that is the model's, the error says so (from the package's search section,
    unless changed) and how to override it."""
    try:
        check_config(config, vocab)
    except _OptionError as e:
        if not the_models:
            raise
        raise ValueError(f"{e}: model.generation_config's {e.option}, from the package's genai_config.json (its "
                         f"search section and special tokens) unless changed; pass {e.option}= to generate() to "
                         "override it") from None


class _OptionError(ValueError):
    """A generate() option out of its range or of the wrong type; `option` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def _bad(name: str, value, wanted: str) -> ValueError:
    return _OptionError(name, f"{name} must be {wanted}, got {value!r}")


def check_config(config, vocab: int) -> None:
    """The options generate() reads, checked before anything runs (a ValueError naming it)."""
    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    # The sampling filters (top_k, top_p, min_p, temperature) are checked where the call samples: greedy
    # decoding and beam search ignore them, as in transformers (temperature 0 and top_p 0 are common there).
    ignored = set() if config.do_sample else {"top_k", "top_p", "min_p", "temperature"}
    for name, low in (("max_new_tokens", 1), ("max_length", 1), ("min_new_tokens", 0), ("min_length", 0),
                      ("top_k", 0), ("no_repeat_ngram_size", 0), ("num_beams", 1), ("num_return_sequences", 1)):
        value = getattr(config, name, None)
        if value is not None and name not in ignored and (not integer(value) or value < low):
            raise _bad(name, value, f"an integer >= {low}")
    for name, low, high, open_low in (("top_p", 0.0, 1.0, True), ("min_p", 0.0, 1.0, False),
                                      ("temperature", 0.0, float("inf"), True),
                                      ("repetition_penalty", 0.0, float("inf"), True)):
        value = getattr(config, name, None)
        if value is None or name in ignored:
            continue
        if not number(value) or value != value or value > high or value < low or (open_low and value == low):
            bracket = "(" if open_low else "["
            wanted = f"a number in {bracket}{low}, {high}]" if high != float("inf") else f"a number > {low}"
            raise _bad(name, value, wanted)
    penalty = getattr(config, "length_penalty", None)
    if penalty is not None and (not number(penalty) or penalty != penalty):
        raise _bad("length_penalty", penalty, "a number")
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and (not integer(pad) or inputs.outside_vocabulary([pad], vocab) is not None):
        raise _bad("pad_token_id", pad, f"a token id in [0, {vocab})")
    for name in ("eos_token_id", "forced_eos_token_id", "forced_bos_token_id"):  # transformers indexes the logits
        given = getattr(config, name, None)
        for value in inputs.eos_token_ids(given):
            if not integer(value) or inputs.outside_vocabulary([value], vocab) is not None:
                raise _bad(name, given, f"a token id (or a list of them) in [0, {vocab})")


class _RightPaddingWarning(logging.Filter):
    """Drops transformers' "right-padding was detected" warning within ortmodule's `generate` on this
    thread: there right-padded prompts decode right (ortmodule's loop goes on from each row's own end), or,
    in transformers' loop, are refused with a ValueError saying to pad on the left; the warning's "for
    correct generation results" would tell a user that correct results are wrong."""

    inside = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(self.inside, "depth", 0) and "right-padding was detected" in record.getMessage())


logging.getLogger("transformers.generation.utils").addFilter(_RightPaddingWarning())


def generate(model, inputs_ids=None, generation_config=None, **kwargs):
    """`OrtModelForCausalLM.generate` for `model`: ortmodule's checks, then transformers' `generate`, in
    inference mode. Called outside it, what it returns is ordinary tensors, as transformers' `generate`
    returns (run under `no_grad`): code may update them in place, as transformers' universal assisted
    decoding does to its assistant's sequences; the returned cache is the exception (its methods enter
    inference mode themselves)."""
    inside = _RightPaddingWarning.inside
    inside.depth = getattr(inside, "depth", 0) + 1
    try:
        if torch.is_inference_mode_enabled():
            return _generate(model, inputs_ids, generation_config, **kwargs)
        with torch.inference_mode():
            held = [_generate(model, inputs_ids, generation_config, **kwargs)]
        ordinary(held, 0)
        return held[0]
    finally:
        inside.depth -= 1


def ordinary(held: list, k: int) -> None:
    """Make `held[k]` (a tensor, or transformers' generate output: tensors in tuples, nested) ordinary
    tensors: each inference tensor copied into an ordinary one and released once copied, where `held`
    is all that holds it (so that a long run's scores are never held twice over); anything else (the
    cache) as it is."""
    item = held[k]
    if isinstance(item, ModelOutput):
        for key in list(item.keys()):
            parts = [item[key]]
            item[key] = None
            ordinary(parts, 0)
            item[key] = parts[0]
    elif isinstance(item, tuple):
        items = list(item)
        held[k] = item = None  # the tuple gone: `items` alone holds its parts
        for j in range(len(items)):
            ordinary(items, j)
        held[k] = tuple(items)
    elif isinstance(item, torch.Tensor) and item.is_inference():
        held[k] = None
        held[k] = item.clone()


@torch.inference_mode()
def _generate(model, inputs_ids=None, generation_config=None, **kwargs):
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}; "
            "pass GenerationConfig(**options), or the options themselves as keyword arguments"
        )
    if inputs_ids is None:
        inputs_ids = kwargs.pop("input_ids", None)
    if inputs_ids is None and kwargs.get("inputs_embeds") is None:
        raise ValueError("generate() needs input_ids (the prompts as token ids) or inputs_embeds")
    if inputs_ids is not None:  # transformers' generate fails deep inside on a list, a dict, a 1-D tensor
        inputs.check_ids_form(inputs_ids)
        if kwargs.get("inputs_embeds") is None:  # and on no prompt (an IndexError)
            inputs.check_ids_present(inputs_ids)
    prompt, mask = inputs_ids if inputs_ids is not None else kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    if mask is not None and isinstance(prompt, torch.Tensor) and prompt.dim() >= 2:
        # here: transformers' generate drops a mask of ones before the loop sees it (its shape unchecked)
        inputs.check_mask_type(mask, prompt.shape[:2])
    if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2:  # ortmodule's loop numbers the rows from the mask
        inputs.check_prompt_positions(kwargs.get("position_ids"), tuple(prompt.shape[:2]), mask)
    vocab = model.decoder.vocab_size
    # The options given are checked before transformers' merge validates them (and fails on a
    # string count with a raw TypeError); the merged config is checked after.
    given = {name: kwargs.get(name) for name in _CHECKED}
    do_sample = kwargs.get("do_sample", (generation_config or model.generation_config).do_sample)
    check_config(type("Given", (), {**given, "do_sample": do_sample})(), vocab)
    # transformers' own test, before its merge fills in the defaults: no max_length set anywhere
    default_length = kwargs.get("max_length") is None and model.generation_config.max_length is None and (
        generation_config is None or generation_config.max_length is None)
    config, rest = model._prepare_generation_config(generation_config, **kwargs)  # transformers' merge
    unknown = sorted(set(rest) - MODEL_INPUTS - _CALL_ARGUMENTS - {"output_attentions", "output_hidden_states"})
    if unknown:
        raise ValueError(f"generate() got arguments it does not use: {', '.join(unknown)}")
    greedy_or_sample = (config.num_beams or 1) == 1 and kwargs.get("assistant_model") is None and \
        config.prompt_lookup_num_tokens is None
    if kwargs.get("generator") is not None and not greedy_or_sample:
        raise ValueError("generator= applies to greedy decoding and sampling (num_beams=1); beam search and assisted "
                         "decoding draw from torch's global generator, as in transformers")
    _check_defaults(config, vocab, generation_config is None)
    if getattr(config, "assistant_early_exit", None) is not None:
        raise NotSupportedError("assistant_early_exit (self-speculative decoding from the first layers) runs the "
                                "model's first layers alone, which a package's graph does not expose: pass "
                                "assistant_model= (a smaller package) or prompt_lookup_num_tokens= instead")
    _check_length(model, inputs_ids if inputs_ids is not None else kwargs.get("inputs_embeds"),
                  kwargs.get("attention_mask"), config, default_length)
    # transformers builds its criteria's tensors on the prompt's device: bring the inputs to the model's.
    if isinstance(inputs_ids, torch.Tensor):
        inputs_ids = inputs_ids.to(model.device, non_blocking=True)
    for name in ("attention_mask", "position_ids", "inputs_embeds"):
        if isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = kwargs[name].to(model.device, non_blocking=True)
    return GenerationMixin.generate(model, inputs_ids, generation_config, **kwargs)


def _check_length(model, prompt, mask, config: GenerationConfig, default_length: bool) -> None:
    """Something left to generate, within the context, as transformers counts the new tokens (ids, or
    `inputs_embeds` alone): `max_new_tokens`; else a `max_length` given (the prompt included); else, none set
    anywhere, its default of 20 new tokens, which transformers keeps within `max_position_embeddings` for ids.
    Checked before any run, for every mode (beams and the other loops of transformers' would stop at the
    step past the context)."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() < 2:
        return  # inputs.check_batch names the problem
    width, context = prompt.shape[1], model.decoder.package.context_length
    if config.max_new_tokens is not None:
        new = config.max_new_tokens
    elif not default_length:
        new = config.max_length - width
        if new < 1:
            raise ValueError(f"nothing to generate: max_length {config.max_length} is not above the prompt length "
                             f"{width}; set max_new_tokens")
    elif prompt.is_floating_point():  # inputs_embeds alone: transformers' 20 new tokens, unbounded
        new = config.max_length or 20
    else:
        new = min(width + (config.max_length or 20), context) - width
        if new < 1:
            raise ValueError(f"nothing to generate: the prompt's {width} tokens fill the model's {context} positions")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        real = mask.ne(0)  # its values are checked with the batch: any other than 0 counts here
    else:  # none given: transformers masks out the pad tokens (check_inferred_mask), unless they end sequences
        pad, eos = config.pad_token_id, config.eos_token_id
        infers = isinstance(pad, int) and not prompt.is_floating_point() and pad not in (
            eos if isinstance(eos, list) else [eos])
        real = prompt.ne(pad) if infers else None
    longest = int(real.sum(1).max()) if real is not None else width
    if longest + new > context:
        raise ValueError(f"prompt of {longest} tokens + {new} new tokens exceeds the model's context length {context}")


def check_inferred_mask(mask: torch.Tensor, pad: int) -> None:
    """The mask transformers' generate infers where it gets none (every pad token of the prompts masked out,
    unless the pad token ends sequences), for a fresh prompt: a pad token between a row's tokens makes a gap,
    and a row of pad tokens holds nothing, which ortmodule refuses (transformers runs on with them), named
    here as what they are, not as a mask the caller never passed. One host read, only where no mask was given."""
    if mask.dim() != 2 or bool(mask.all()):
        return
    kept = mask.bool()
    given = f"generate() got no attention_mask, so it masks out every pad token ({pad}) of input_ids (as transformers)"
    empty = ~kept.any(1)
    if empty.any():
        raise ValueError(f"{given}: row {int(empty.nonzero()[0])} holds nothing else; pass "
                         "attention_mask, or pad_token_id= a token the prompts lack")
    first, last = kept.int().argmax(1), kept.shape[1] - 1 - kept.flip(1).int().argmax(1)
    gaps = kept.sum(1) < last - first + 1
    if gaps.any():
        row = int(gaps.nonzero()[0])
        column = int(first[row]) + int((~kept[row, first[row]:]).int().argmax())
        raise ValueError(
            f"{given}: row {row} holds it at position {column}, between its tokens; pass attention_mask "
            "(torch.ones_like(input_ids) where no row is padded), or pad_token_id= a token the prompts lack"
        )


# On a GPU, how many decode steps run between two reads of the stop flag: a read waits for the
# device to catch up, so reading it every step keeps the host from queueing ahead (transformers'
# loop does). At most STOP_CHECK_EVERY - 1 steps run after every row has stopped, and are cut.
STOP_CHECK_EVERY = 8
# On a CPU, the rows that have stopped leave the decode steps once they are this share of the rows
# still run: a step's cost grows with its rows (SmolLM2-135M fp32 on a 2-vCPU Xeon, rows of 800
# tokens: 25 ms a step for one row, 60 ms for eight), and transformers' loop runs every row to the
# end, the stopped ones on pad tokens. The stopped rows' tokens are pad tokens either way; what
# the caller gets is the same.
DROP_STOPPED_ROWS = 0.25


def sample(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, media=None,
           carry_to=None, given=None, **model_kwargs):
    """transformers' `_sample` (greedy decoding and sampling) for `model` (an OrtModelForCausalLM),
    with the loop on the device; `media`: the prompts' images and videos (an `images.Media`), or None;
    `carry_to`: the empty transformers cache the caller passed, which then stands for this generation's
    cache (`cache.carry`: the caller's next call with it continues it); `given`: a KVCache holding the ids'
    first columns (already cropped to those it shares with them: `keep_known`), which the generation continues
    in place (its other columns run as one step over it)."""
    sampling = _Sampling(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                         model_kwargs, keeps_cache=carry_to is not None or given is not None)
    sampling.media = media
    out = sampling.run() if given is None else sampling.resume(model, given)
    if carry_to is not None:
        carry(carry_to, sampling.kept, model.decoder)
    return out


class _Sampling:
    """One greedy or sampled decoding: its output buffer and the loop over `Decoder.step`."""

    def __init__(self, model, input_ids, processors, criteria, config, streamer, model_kwargs, keeps_cache=False):
        decoder = self.decoder = model.decoder
        device = decoder.device
        self.processors, self.config, self.streamer = processors, config, streamer
        # The length limit is the loop's own; what is left (end of sequence, stop strings, time, the
        # caller's) is evaluated every step, and without it nothing is read back at all.
        self.criteria = StoppingCriteriaList(c for c in criteria if not isinstance(c, MaxLengthCriteria))
        self.mask = model_kwargs.get("attention_mask")
        self.rows = inputs.check_batch(input_ids, self.mask, decoder.vocab_size, decoder.package.context_length,
                                       device)
        size, self.width = input_ids.shape
        self.max_new = config.max_length - self.width
        context = decoder.package.context_length
        if self.rows.longest + self.max_new > context:
            raise ValueError(f"prompt of {self.rows.longest} tokens + {self.max_new} new tokens exceeds the model's "
                             f"context length {context}")
        self.do_sample = bool(config.do_sample)
        self.generator = model_kwargs.get("generator")
        if self.generator is not None and torch.device(self.generator.device).type != device.type:
            raise ValueError(f"generator is on {self.generator.device}, the model on {device}")
        self.pad = config._pad_token_tensor
        # As transformers: rows that ended get the pad token when an end-of-sequence criterion runs.
        self.pads_ended = self.pad is not None and any(hasattr(c, "eos_token_id") for c in self.criteria)
        # The cache outlives the generation where it is returned or carried on (`sample`'s `carry_to`).
        self.keeps_cache = bool(config.return_dict_in_generate) or keeps_cache
        self.kept = None  # that cache, once the generation is done
        self.keep_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.keep_logits = bool(config.return_dict_in_generate and config.output_logits)
        # The output in the caller's layout: the prompt as given, then one column per step.
        self.sequences = torch.empty(size, self.width + self.max_new, dtype=torch.int64, device=device)
        self.sequences[:, : self.width] = input_ids.to(device)
        self.scores, self.raw = [], []
        self.steps_reuse_logits = False  # set by run: the decode steps return one buffer every step
        # On a CPU (where the stop flags are read every step anyway), stopped rows leave the steps
        # (`_Running`) where their tokens are pad tokens and nothing of their steps is returned.
        self.drops_rows = (decoder.device.type == "cpu" and self.pads_ended and size > 1
                           and not self.keeps_cache)
        self.media = None  # the prompts' images and videos (sample)

    def run(self):
        decoder, rows, size, width = self.decoder, self.rows, self.sequences.shape[0], self.width
        # The prefill writes every column of the padded prompt, so the cache holds at least that many.
        needed = max(width, rows.longest + self.max_new)
        # Steps at fixed addresses where the package allows (on CUDA, captured as a graph when the
        # session has enable_cuda_graph); else steps that bind their inputs anew.
        steps = fixed_steps.lend(decoder, size, needed)
        self.steps_reuse_logits = steps is not None
        try:
            cache = steps.cache if steps is not None else decoder.new_cache(size, needed)
            last = torch.arange(size, device=decoder.device) * width + rows.lengths - 1
            if self.media is not None:
                logits = images.prefill(decoder, self.sequences[:, :width], self.mask, rows, last, cache,
                                        self.media)[0]
            else:
                logits = shared_prompts.prefill(decoder, rows, last, cache)  # a common beginning run once (CPU)
            if steps is not None:
                steps.start()
            # A hybrid's layer states kept after each step only where the cache is returned
            # (to be cropped: transformers' assisted decoding crops its assistant's).
            cache.states.keeping = self.keeps_cache
            length = self._loop(logits, _Running(decoder, cache, steps, needed))
            if steps is not None and self.keeps_cache:
                cache = steps.copy_cache()  # the caller's to keep: the fixed one serves the next generation
        finally:
            if steps is not None:
                steps.release()
        return self._finish(length, cache)

    def resume(self, model, cache):
        """`run` continuing `cache`, the caller's: the ids' columns past it run as one step through the model's
        forward (their mask and positions as a continued forward takes them), then the loop's steps over it."""
        seen = cache.seen
        out = model(self.sequences[:, seen: self.width], attention_mask=self.mask, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out[CACHE_NAME]  # the same object (an emptied one filled in place)
        cache.states.keeping = True
        needed = max(self.width, self.rows.longest + self.max_new)
        length = self._loop(out.logits[:, -1], _Running(self.decoder, cache, None, needed))
        return self._finish(length, cache)

    def _loop(self, logits: torch.Tensor, running: _Running) -> int:
        """Choose tokens and step until the length limit or every row has stopped: the length."""
        decoder, size, width = self.decoder, self.sequences.shape[0], self.width
        unfinished = torch.ones(size, dtype=torch.bool, device=decoder.device)
        # The length at which every row had stopped (0 while one runs), kept on the device. On a GPU
        # it is read every STOP_CHECK_EVERY steps, so that the loop queues steps without waiting for
        # the device; on the CPU (where a read costs nothing) and with a streamer, every step. The
        # output is cut where transformers' loop would have stopped.
        stopped_at = torch.zeros((), dtype=torch.int64, device=decoder.device)
        # A returned cache of a hybrid decoder is not cropped back from steps run past the end: the loop
        # reads the stop flag every step (such a crop would go back through the kept states, cache.py).
        every_step = self.streamer is not None or (self.keeps_cache and decoder.spec.states)
        check_every = 1 if decoder.device.type == "cpu" or every_step else STOP_CHECK_EVERY
        length = width
        while True:
            tokens = self._next_tokens(logits, length, unfinished)
            length += 1
            last = length == width + self.max_new
            if len(self.criteria):
                # As transformers: criteria see the scores kept so far (a tuple, or None when not kept), the last
                # token's too (a criterion may keep what it sees).
                kept = tuple(self.scores) if self.keep_scores else None
                unfinished &= ~self.criteria(self.sequences[:, :length], kept)
                stopped_at = torch.where((stopped_at == 0) & ~unfinished.any(), length, stopped_at)
                if last or (length - width) % check_every == 0 and stopped_at.item():
                    break  # the loop's one read from the device
                if self.drops_rows:
                    running.drop_stopped(unfinished)
            elif last:
                break
            logits = running.step(tokens)
        if len(self.criteria):
            length = stopped_at.item() or length
        return length

    def _next_tokens(self, logits: torch.Tensor, length: int, unfinished: torch.Tensor):
        """Choose every row's next token from its logits, write it at column `length` and return it."""
        # The fixed steps' logits are a buffer the next step overwrites: kept scores are a copy.
        logits = logits.float().clone() if self.keep_scores and self.steps_reuse_logits else logits.float()
        next_scores = self.processors(self.sequences[:, :length], logits)
        if self.keep_scores:
            self.scores.append(next_scores)
        if self.keep_logits:
            self.raw.append(logits.clone())
        if self.do_sample:
            probs = torch.softmax(next_scores, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        else:
            tokens = inputs.argmax(next_scores)
        if self.pads_ended:
            tokens = torch.where(unfinished, tokens, self.pad.to(tokens.device))
        self.sequences[:, length] = tokens
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        return tokens

    def _finish(self, length: int, cache):
        if self.streamer is not None:
            self.streamer.end()
        del self.scores[length - self.width :], self.raw[length - self.width :]
        sequences = self.sequences[:, :length]
        if self.keeps_cache:
            # The cache holds every token but the last, as transformers' does (steps run past the end on
            # a GPU are cropped); continuing from it needs the caller's mask so far.
            mask = self.mask if self.mask is not None else torch.ones_like(sequences[:, : self.width])
            mask = mask.to(sequences.device, torch.int64)
            cache.caller_mask = torch.cat([mask, mask.new_ones(mask.shape[0], cache.seen - self.width)], 1)
            if cache.seen > length - 1:
                cache.crop(length - 1)
            cache.tokens = sequences[:, : cache.seen].clone()  # the caller may write into its sequences
            self.kept = cache
        if not self.config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(self.scores) if self.keep_scores else None,
            logits=tuple(self.raw) if self.keep_logits else None,
            **{CACHE_NAME: cache},
        )


class _Running:
    """The decode steps of a generation: over every row (the fixed steps where lent, else the cache),
    or, once `drop_stopped` has dropped stopped rows, over the rest only, in a cache of their own;
    `step` gives logits `[batch, V]` either way (zeros for dropped rows, whose tokens are pad tokens)."""

    def __init__(self, decoder, cache, steps, capacity: int):
        self.decoder, self.cache, self.steps, self.capacity = decoder, cache, steps, capacity
        self.rows: torch.Tensor | None = None  # the batch's rows still run, in the cache's order; None: all
        self.logits: torch.Tensor | None = None  # the batch's logits once rows are dropped

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            if self.steps is not None:
                return self.steps.step(tokens)
            return self.decoder.step(tokens[:, None], self.cache).view(len(tokens), -1)
        logits = self.decoder.step(tokens.index_select(0, self.rows)[:, None], self.cache).view(len(self.rows), -1)
        if self.logits is None:
            self.logits = logits.new_zeros(len(tokens), logits.shape[-1])
        return self.logits.index_copy_(0, self.rows, logits)

    def drop_stopped(self, unfinished: torch.Tensor) -> None:
        """Leave out the rows that have stopped (`unfinished` False; a CPU tensor) once they are at least
        DROP_STOPPED_ROWS of the rows run, unless none is left (the loop ends)."""
        left = unfinished if self.rows is None else unfinished.index_select(0, self.rows)
        kept = int(left.sum())
        if kept == 0 or kept > len(left) * (1 - DROP_STOPPED_ROWS):
            return
        keep = left.nonzero().squeeze(1)
        if self.steps is not None:  # the fixed steps' rows are fixed: the rest go on in a cache of their own
            source = self.steps.cache
            lengths = source.lengths.index_select(0, keep)
            self.cache = self.decoder.new_cache(kept, self.capacity)
            self.cache.start_from(source, keep, lengths, int(lengths.max()))
            self.steps = None
        else:
            self.cache.batch_select_indices(keep)
        self.rows = keep if self.rows is None else self.rows.index_select(0, keep)
        if self.logits is not None:
            self.logits.zero_()  # the rows dropped now held their last step's logits
