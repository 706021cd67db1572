"""transformers' batch generation entry point, `generate_batch` (transformers 5's `ContinuousMixin`), which trl's
GRPO and RLOO trainers (`use_transformers_paged`) and lighteval (`continuous_batching`) call: token-id prompts in,
each request's new tokens out, as transformers' `GenerationOutput`s keyed by request id.

transformers runs it through its paged-attention manager over the model's own attention layers, which a package
does not have; here each prompt runs through ortmodule's own `generate` with the generation config, prompts of
like length batched together (left-padded, as many rows as a token budget holds) and each row ending at its own
end of sequence or length, so that a request's tokens are the ones it would get alone. The manager itself
(`init_continuous_batching`, `continuous_batching_context_manager`: requests added and read from a running
thread) is refused by name: serve the package with `ortmodule serve` for that."""

from __future__ import annotations

import copy
import time

import torch

from . import runtime
from .package import NotSupportedError

_MANAGER = ("transformers' continuous-batching manager runs PyTorch paged attention over the model's own layers, "
            "which an ONNX package does not have: call generate_batch(inputs, generation_config) for a batch of "
            "prompts, or serve the package with `ortmodule serve` (continuous batching over HTTP)")


class BatchGeneration:
    """`generate_batch` on `OrtModelForCausalLM`, and the manager's entry points refused by name."""

    def generate_batch(self, inputs: list[list[int]], generation_config=None, continuous_batching_config=None,
                       record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = True, **kwargs) -> dict:
        """transformers' `generate_batch`: each prompt of `inputs` (token ids) generated as `generation_config` (or
        the model's) says, `max_new_tokens` given here or there, `num_return_sequences` samples of each (request
        `req_{i}` and its children `req_{i}__child#{k}`, in that order after them); with
        `continuous_batching_config`, its `return_logprobs` (each new token's log-probability under the processed
        scores, as transformers gives it), `seed` (the sampling's generator) and `max_requests_per_batch`. The
        outputs in the order of `inputs`. `persistent_manager` and `warmup` have nothing to keep or warm here."""
        from tqdm.auto import tqdm

        config = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        max_new = kwargs.pop("max_new_tokens", None)
        if kwargs:
            raise TypeError(f"generate_batch() takes max_new_tokens beside its arguments, not {sorted(kwargs)}")
        if max_new is not None:
            config.max_new_tokens = max_new
        ends = [token for token in _all(config.eos_token_id) if token >= 0]  # transformers' -1: no end of sequence
        config.eos_token_id = ends or None
        _check_prompts(inputs)
        if not inputs:
            return {}
        copies = config.num_return_sequences or 1
        seed = getattr(continuous_batching_config, "seed", None)
        generator = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        logprobs = bool(getattr(continuous_batching_config, "return_logprobs", False))
        outputs = {}
        with tqdm(total=len(inputs) * copies, disable=not progress_bar, desc=f"Solving {len(inputs) * copies} "
                  "requests", unit="request") as bar:
            for rows in _batches(self, inputs, config, continuous_batching_config):
                outputs.update(_generate_rows(self, inputs, rows, config, copies, generator, logprobs,
                                              record_timestamps))
                bar.update(len(rows) * copies)
        return {key: outputs[key] for key in _request_order(len(inputs), copies)}

    def init_continuous_batching(self, *args, **kwargs):
        raise NotSupportedError(f"OrtModelForCausalLM.init_continuous_batching(): {_MANAGER}")

    def continuous_batching_context_manager(self, *args, **kwargs):
        raise NotSupportedError(f"OrtModelForCausalLM.continuous_batching_context_manager(): {_MANAGER}")


def _check_prompts(inputs) -> None:
    """`inputs` as transformers takes them: a list of non-empty lists of token ids (a TypeError or ValueError
    naming the prompt otherwise; the ids' range is the decoder's to check)."""
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"generate_batch(inputs=...) takes a list of token-id lists, got {type(inputs).__name__}")
    for i, prompt in enumerate(inputs):
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            raise TypeError(f"generate_batch: inputs[{i}] must be a list of token ids (ints)")
        if not prompt:
            raise ValueError(f"generate_batch: inputs[{i}] is empty; a prompt needs at least one token")


def _batches(model, inputs: list[list[int]], config, cb_config):
    """The prompts' indices in batches of like length: sorted by length, as many rows as the device's token
    budget holds with their new tokens (runtime.default_token_budget), at most `max_requests_per_batch`."""
    budget = runtime.default_token_budget(model.device)
    most = getattr(cb_config, "max_requests_per_batch", None) or len(inputs)
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    new = (config.max_new_tokens or 0) * (config.num_return_sequences or 1)
    batch: list[int] = []
    for index in order:
        width = len(inputs[index]) + new
        if batch and ((len(batch) + 1) * width > budget or len(batch) >= most):
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


def _generate_rows(model, inputs, rows: list[int], config, copies: int, generator, logprobs: bool,
                   timestamps: bool) -> dict:
    """One batch's requests through `generate`: each row's new tokens through its first end of sequence."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    steps: list[float] = []

    class _Clock(StoppingCriteria):  # each step's time, for `record_timestamps`; never stops a row
        def __call__(self, input_ids, scores, **kwargs):
            steps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    width = max(len(inputs[i]) for i in rows)
    pad = config.pad_token_id if config.pad_token_id is not None else _first(config.eos_token_id, 0)
    ids = torch.tensor([[pad] * (width - len(inputs[i])) + list(inputs[i]) for i in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(inputs[i])) + [1] * len(inputs[i]) for i in rows], device=model.device)
    config = copy.copy(config)
    config.pad_token_id, config.return_dict_in_generate, config.output_scores = pad, True, logprobs
    begun = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, generator=generator,
                         stopping_criteria=StoppingCriteriaList([_Clock()]) if timestamps else None)
    ended = time.perf_counter()
    ends, new = set(_all(config.eos_token_id)), out.sequences[:, width:]
    chosen = _chosen_logprobs(out.scores, new) if logprobs else None
    made = {}
    for row, sequence in enumerate(new.tolist()):
        index, copy_ = rows[row // copies], row % copies
        taken = next((k + 1 for k, token in enumerate(sequence) if token in ends), len(sequence))
        scores = chosen[row][:taken] if logprobs else []
        key = f"req_{index}" if copy_ == copies - 1 else f"req_{index}__child#{copy_}"
        made[key] = GenerationOutput(request_id=key, prompt_ids=list(inputs[index]),
                                     generated_tokens=sequence[:taken], logprobs=scores,
                                     status=RequestStatus.FINISHED, created_time=begun, lifespan=(begun, ended),
                                     timestamps=steps[:taken] if timestamps else None)
    return made


def _chosen_logprobs(scores: tuple, tokens: torch.Tensor) -> list[list[float]]:
    """Each row's chosen tokens' log-probabilities under the processed `scores` (one `[rows, vocab]` a step), on the
    scores' device, read back once."""
    steps = [torch.log_softmax(step.float(), -1).gather(1, tokens[:, k:k + 1]) for k, step in enumerate(scores)]
    return torch.cat(steps, 1).tolist()


def _request_order(prompts: int, copies: int) -> list[str]:
    """transformers' order of the outputs: each prompt's children, then the prompt's own request."""
    return [key for i in range(prompts)
            for key in [f"req_{i}__child#{k}" for k in range(copies - 1)] + [f"req_{i}"]]


def _all(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _first(value, default: int) -> int:
    values = _all(value)
    return values[0] if values else default
