"""transformers' `generate_batch` (its continuous-batching entry point, which trl's and lighteval's batch
generation call) on `OrtModelForCausalLM`, against transformers' own `generate_batch` on the same weights
(its paged-attention manager over the PyTorch model)."""

import pytest
import torch
from helpers import load_pair
from transformers import ContinuousBatchingConfig, GenerationConfig

from ortmodule import NotSupportedError

PROMPTS = [[5, 6, 7, 8, 9, 10], [8, 9], list(range(20, 60)), [300, 301, 302]]


def greedy(new: int, eos=None) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=2)


def small(**options) -> ContinuousBatchingConfig:
    """transformers' manager sized for these prompts (sized by the machine's memory it takes 10-20 s a call)."""
    return ContinuousBatchingConfig(num_blocks=16, page_size=32, max_batch_tokens=256, **options)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_requests_equal_transformers_generate_batch(build, arch):
    """Each request's new tokens and their log-probabilities (`return_logprobs`) as transformers' `generate_batch`
    gives them, in the order of the prompts, with the prompts given back; an end of sequence ends its request
    (the token kept, as transformers keeps it) while the others go on."""
    model, hf = load_pair(build(arch))
    logprobs = small(return_logprobs=True)
    theirs = hf.generate_batch(PROMPTS, generation_config=greedy(8), continuous_batching_config=logprobs)
    ours = model.generate_batch(PROMPTS, generation_config=greedy(8), continuous_batching_config=logprobs)
    assert list(ours) == list(theirs) == [f"req_{i}" for i in range(len(PROMPTS))]
    for key, theirs_one in theirs.items():
        assert ours[key].generated_tokens == theirs_one.generated_tokens and len(theirs_one.generated_tokens) == 8
        assert ours[key].prompt_ids == theirs_one.prompt_ids and ours[key].is_finished()
        assert ours[key].logprobs == pytest.approx(theirs_one.logprobs, abs=1e-4)
    eos = theirs["req_0"].generated_tokens[2]
    ended = model.generate_batch(PROMPTS, generation_config=greedy(8, eos))
    assert ended["req_0"].generated_tokens == theirs["req_0"].generated_tokens[:3]
    reference = hf.generate_batch(PROMPTS, generation_config=greedy(8, eos), continuous_batching_config=small())
    assert {k: v.generated_tokens for k, v in ended.items()} == {k: v.generated_tokens for k, v in reference.items()}
    assert model.generate_batch(PROMPTS[:1], generation_config=greedy(8), max_new_tokens=3)["req_0"] \
        .generated_tokens == theirs["req_0"].generated_tokens[:3]  # the keyword over the config's


def test_sampled_copies_are_named_and_ordered_as_transformers_and_a_seed_repeats_them(llama):
    """`num_return_sequences` copies of each prompt: the children's names and order as transformers' (each
    prompt's children, then the prompt's own request), each a draw of its own; the config's `seed` draws the
    same again; timestamps one a token where asked for. The manager's entry points are refused by name."""
    model, hf = load_pair(llama)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.5, num_return_sequences=3,
                              eos_token_id=None, pad_token_id=2)
    theirs = hf.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=small())
    seeded = ContinuousBatchingConfig(seed=11)
    ours = model.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=seeded,
                                record_timestamps=True)
    assert list(ours) == list(theirs)
    assert all(len(out.generated_tokens) == 6 and len(out.timestamps) == 6 for out in ours.values())
    again = model.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=seeded)
    assert [o.generated_tokens for o in again.values()] == [o.generated_tokens for o in ours.values()]
    draws = [ours[f"req_2__child#{k}"].generated_tokens for k in range(2)] + [ours["req_2"].generated_tokens]
    assert len({tuple(d) for d in draws}) > 1
    for name in ("init_continuous_batching", "continuous_batching_context_manager"):
        with pytest.raises(NotSupportedError, match="call generate_batch"):
            getattr(model, name)()


def test_bad_prompts_are_named(llama):
    model, _ = load_pair(llama)
    for inputs, error, words in (([[5, 6], []], ValueError, r"inputs\[1\] is empty"),
                                 ([[5, 6], "7 8"], TypeError, r"inputs\[1\] must be a list of token ids"),
                                 (torch.tensor([[5, 6]]), TypeError, "takes a list of token-id lists"),
                                 ([[5, 600]], ValueError, "600")):
        with pytest.raises(error, match=words):
            model.generate_batch(inputs, generation_config=greedy(2))
    with pytest.raises(TypeError, match="takes max_new_tokens beside its arguments"):
        model.generate_batch([[5]], generation_config=greedy(2), temperature=0.5)
    assert model.generate_batch([], generation_config=greedy(2)) == {}
