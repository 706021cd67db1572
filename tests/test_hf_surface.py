"""transformers' model surface beyond forward, against transformers on the same weights: the KV cache
as a `transformers.Cache` (crop, reorder, batch select, repeat), beam search, GenerationMixin's
helpers, forward's keywords, and clear errors for what an ONNX package does not have."""

import logging
import shutil

import pytest
import torch
import transformers
from helpers import MODEL_ARCHES, load_pair
from helpers import CachePair as Pair
from helpers import left_padded_batch as left_padded
from transformers import DynamicCache, GenerationMixin

from ortmodule import NotSupportedError, OrtModelForCausalLM, variants
from ortmodule.cache import KVCache, carried
from ortmodule.hf import CACHE_NAME
from ortmodule_dev import fixtures

CACHES = ["llama", "gemma4_mobius"]  # one buffer written in place (GQA); a concatenating attention
# Builder packages; on the mobius-onnx Gemma 4 fixture transformers' own batched beams differ from its
# one-prompt beams (near-tied random weights), so it is no reference there.
BEAMS = ["llama", "qwen3", "gemma3", "gemma4"]


@pytest.mark.parametrize("arch", CACHES)
def test_cache_operations_equal_transformers(build, arch):
    """After each Cache operation, the next step's logits equal transformers' on a DynamicCache."""
    pair = Pair(load_pair(build(arch)), *left_padded([5, 9], seed=1))
    for token in (20, 21, 22):
        pair.agree(torch.tensor([token, token + 10]))
    pair.each("crop", -2)  # transformers 5: a negative count removes that many columns
    pair.mask = pair.mask[:, :-2]
    pair.agree(torch.tensor([30, 31]))
    pair.each("batch_repeat_interleave", 2)
    pair.mask = pair.mask.repeat_interleave(2, 0)
    pair.agree(torch.tensor([40, 41, 42, 43]))
    pair.each("reorder_cache", torch.tensor([3, 3, 0, 1]))
    pair.mask = pair.mask[torch.tensor([3, 3, 0, 1])]
    pair.agree(torch.tensor([50, 51, 52, 53]))
    pair.each("batch_select_indices", torch.tensor([1, 2]))
    pair.mask = pair.mask[torch.tensor([1, 2])]
    pair.agree(torch.tensor([60, 61]))


def test_crop_to_a_length_as_transformers_4_did(build):
    """`crop(n)` with n > 0 keeps the first n columns (transformers 4; 5.23's caches refuse it)."""
    pair = Pair(load_pair(build("llama")), *left_padded([4, 7], seed=2))
    for token in (20, 21, 22):
        pair.agree(torch.tensor([token, token]))
    pair.caches[0].crop(8)
    pair.caches[1].crop(8 - pair.caches[1].get_seq_length())
    pair.mask = pair.mask[:, :8]
    pair.agree(torch.tensor([33, 34]))
    with pytest.raises(ValueError, match="cannot crop 20 columns from a cache holding 9"):
        pair.caches[0].crop(-20)
    pair.caches[0].reset()
    assert pair.caches[0].get_seq_length() == 0


@pytest.mark.parametrize("arch", [*CACHES, "lfm2"])
def test_an_emptied_cache_takes_a_new_prompt_in_place(build, arch):
    """A cache emptied by `reset()` or a crop of every column, given with a new (padded) prompt, is that
    prompt's cache, filled in place as transformers fills its own (the steps after it equal transformers');
    generate given one answers as from the prompt alone. It was taken as a step: padding refused."""
    model, hf = load_pair(build(arch))
    pair = Pair((model, hf), *left_padded([5, 9], seed=1))
    ids, mask = left_padded([4, 6, 3], seed=5)
    for empty in ("reset", "crop"):
        with torch.inference_mode():  # transformers' cache holds inference tensors
            for cache in pair.caches:
                cache.reset() if empty == "reset" else cache.crop(-cache.get_seq_length())
        positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
        with torch.inference_mode():
            outs = [m(ids, attention_mask=mask, position_ids=positions, past_key_values=c, use_cache=True)
                    for m, c in zip(pair.models, pair.caches)]
        assert outs[0][CACHE_NAME] is pair.caches[0]
        assert (outs[0].logits - outs[1].logits)[mask.bool()].abs().max().item() < 1e-4
        pair.mask = mask
        pair.agree(torch.tensor([20, 21, 22]))
        pair.agree(torch.tensor([30, 31, 32]))
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=2)
    cache = pair.caches[0]
    cache.reset()
    with model.decoder.holding(cache), pytest.raises(RuntimeError, match="being run by another thread"):
        model(ids, attention_mask=mask, past_key_values=cache)  # filled under the cache's hold, as every run
    assert cache.get_seq_length() == 0
    ours = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
    with torch.inference_mode():
        assert torch.equal(ours, hf.generate(ids, attention_mask=mask, **options))
    assert cache.get_seq_length() == ours.shape[1] - 1  # filled in place, as transformers' generate fills its own


def test_cache_views_and_refusals(build):
    model, _ = load_pair(build("llama"))
    ids, mask = left_padded([3, 6], seed=3)
    cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    assert cache.get_mask_sizes(1, 0) == (7, 0) and cache.get_max_length() == -1
    assert not cache.is_compileable and cache.is_croppable and cache.batch_size == 2
    assert len(cache.layers) == len(cache) and cache.layers[0].keys.shape[2] == 6
    with pytest.raises(NotImplementedError, match="written by ONNX Runtime"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)
    with pytest.raises(ValueError, match=r"row indices must lie in \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 2]))
    # torch would take float rows through as_tensor and truncate them, and fail inside on a zero or
    # negative repeat (a row-index message before, for 0) or a float one
    with pytest.raises(TypeError, match="row indices must be integers, got torch.float32"):
        cache.reorder_cache(torch.tensor([0.7, 1.0]))
    for repeats in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"batch_repeat_interleave takes a positive int, got {repeats!r}"):
            cache.batch_repeat_interleave(repeats)
    assert cache.batch_size == 2  # nothing changed by the refusals


def test_an_empty_transformers_cache_starts_one_and_a_full_one_is_refused(build):
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded([5, 5], seed=4)
    out = model(ids, attention_mask=mask, past_key_values=DynamicCache())
    assert isinstance(out.past_key_values, KVCache) and out.past_key_values.get_seq_length() == 5
    full = hf(ids, attention_mask=mask, use_cache=True).past_key_values
    with pytest.raises(TypeError, match="got DynamicCache holding 5 positions"):
        model(ids[:, :1], past_key_values=full)


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_one_dynamic_cache_through_a_manual_decoding_loop(build, arch):
    """transformers' documented manual loop: one `DynamicCache()` passed to every forward (with the growing mask
    and `cache_position`), only the new token given after the first. The object stays empty, but stands for the
    KVCache ortmodule made for it (the same one each step), so the tokens and logits are transformers' on its own
    DynamicCache; a prompt given later with a mask of its own length is a new prompt (transformers' caller would
    have emptied its cache)."""
    model, hf = load_pair(build(arch))

    def loop(m, past, steps=5):
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        fields = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "cache_position": torch.arange(5)}
        made, logits = [], []
        for _ in range(steps):
            out = m(**fields, past_key_values=past, use_cache=True)
            logits.append(out.logits[:, -1].float())
            made.append(out.logits[:, -1:].argmax(-1))
            mask = torch.cat([fields["attention_mask"], torch.ones(1, 1, dtype=torch.long)], 1)
            position = fields["cache_position"][-1:] + 1
            fields = {"input_ids": made[-1], "attention_mask": mask, "cache_position": position}
        return torch.cat(made, 1), torch.stack(logits)

    past = DynamicCache()
    with torch.inference_mode():
        expected, expected_logits = loop(hf, DynamicCache(config=hf.config))
        ours, our_logits = loop(model, past)
        assert torch.equal(ours, expected)
        assert (our_logits - expected_logits).abs().max().item() < 1e-4
        assert past.get_seq_length() == 0  # transformers' object: ortmodule's entries cannot live in it
        assert carried(past, model.decoder).get_seq_length() == 5 + 5 - 1
        ids = torch.tensor([[9, 8, 7]])
        again = model(ids, attention_mask=torch.ones_like(ids), past_key_values=past).logits
        assert (again - hf(ids).logits).abs().max().item() < 1e-4


def test_one_dynamic_cache_through_every_turn_of_generate(build):
    """transformers' multi-turn pattern: one `DynamicCache()` passed to every turn's `generate`, each turn's ids
    the conversation so far. Each turn equals transformers' on its own DynamicCache and continues the KVCache the
    object stands for (one object, holding the conversation: only the new columns run); a turn whose ids leave
    it (an edited history) is cropped back and equals transformers from the ids alone; another model given the
    object starts its own."""
    model, hf = load_pair(build("llama"))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=2)
    past, theirs = DynamicCache(), DynamicCache(config=hf.config)
    ids, kept = torch.tensor([[5, 6, 7, 8, 9]]), None
    for turn in range(3):
        with torch.inference_mode():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=theirs, **options)
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=past, **options)
        assert torch.equal(ours, expected), turn
        cache = carried(past, model.decoder)
        assert cache.get_seq_length() == ours.shape[1] - 1 and (kept is None or cache is kept)
        kept, ids = cache, torch.cat([ours, torch.tensor([[10 + turn, 11]])], 1)
    edited = torch.cat([ids[:, :7], torch.tensor([[30, 31]])], 1)
    with torch.inference_mode():
        expected = hf.generate(edited, attention_mask=torch.ones_like(edited), **options)
    assert torch.equal(model.generate(edited, attention_mask=torch.ones_like(edited), past_key_values=past, **options),
                       expected)
    other, other_hf = load_pair(build("lfm2"))
    with torch.inference_mode():
        expected = other_hf.generate(edited, attention_mask=torch.ones_like(edited), **options)
    assert torch.equal(other.generate(edited, attention_mask=torch.ones_like(edited), past_key_values=past, **options),
                       expected)
    assert carried(past, other.decoder) is not None and carried(past, model.decoder) is None


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_prompts_cache_deep_copied_for_each_continuation(build, arch):
    """transformers' documented prompt reuse ("Re-use Cache to continue generation"): the shared prompt's cache
    made once (a forward given `DynamicCache()`), then for each continuation `generate` given a deep copy of it
    and the prompt and continuation's ids. The output's cache (a KVCache) copies with its columns and its tokens,
    so each answer equals transformers' same pattern, runs only the continuation's columns, and the prompt's cache
    is left as it was for the next one (a hybrid's too: it could not be copied); a copy cropped back runs again."""
    import copy

    model, hf = load_pair(build(arch))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        ours = model(prompt, past_key_values=DynamicCache(), use_cache=True).past_key_values
        theirs = hf(prompt, past_key_values=DynamicCache(config=hf.config), use_cache=True).past_key_values
    for suffix in ([11, 12], [13, 14, 15]):
        ids = torch.cat([prompt, torch.tensor([suffix])], 1)
        copied = copy.deepcopy(ours)
        assert isinstance(copied, KVCache) and copied.get_seq_length() == prompt.shape[1]
        with torch.inference_mode():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=copy.deepcopy(theirs),
                                   **options)
        assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=copied,
                                          **options), expected), suffix
        assert copied.get_seq_length() == expected.shape[1] - 1  # the copy continued
        copied.crop(prompt.shape[1])  # back to the prompt (a hybrid's states run again, into the copy)
        assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=copied,
                                          **options), expected), suffix
        assert ours.get_seq_length() == prompt.shape[1]  # the prompt's own cache as it was


@pytest.mark.parametrize("arch", BEAMS)
def test_beam_search_equals_transformers(build, arch):
    model, hf = load_pair(build(arch))
    ids, mask = left_padded([6, 11], seed=5)
    options = dict(max_new_tokens=12, num_beams=4, num_return_sequences=2, length_penalty=0.7, early_stopping=True,
                   return_dict_in_generate=True, output_scores=True, pad_token_id=2, eos_token_id=1)
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask, **options)
        out = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.equal(out.beam_indices, expected.beam_indices)
    assert (out.sequences_scores - expected.sequences_scores).abs().max().item() < 1e-4
    ours = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    theirs = hf.compute_transition_scores(expected.sequences, expected.scores, expected.beam_indices)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_transition_scores_of_a_greedy_generation(build):
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded([4, 8], seed=6)
    options = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True,
                   output_logits=True, pad_token_id=2)
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask, **options)
    out = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(out.sequences, expected.sequences)
    for normalize in (False, True):
        ours = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=normalize)
        theirs = hf.compute_transition_scores(expected.sequences, expected.scores, normalize_logits=normalize)
        assert (ours - theirs).abs().max().item() < 1e-4


def test_generate_continues_from_a_returned_cache(build):
    """The cache a generate returns continues like transformers' (transformers' loop over forward)."""
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded([5], seed=7)
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, pad_token_id=2)
    first = model.generate(ids, attention_mask=mask, **options)
    assert isinstance(first.past_key_values, KVCache)
    assert first.past_key_values.get_seq_length() == first.sequences.shape[1] - 1
    more = torch.cat([first.sequences, torch.tensor([[40, 41]])], 1)
    mask = torch.ones_like(more)
    with torch.inference_mode():
        expected = hf.generate(more, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
    ours = model.generate(more, attention_mask=mask, past_key_values=first.past_key_values, max_new_tokens=6,
                          do_sample=False, pad_token_id=2)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("arch", ["llama", "lfm2", "qwen2_5_vl", "gemma4_mobius"])
def test_generate_continuing_ids_that_leave_the_cache_runs_them_again(build, arch):
    """generate given a cache that holds columns the ids do not continue (a rejected draft's, or as many
    as the ids: what transformers 5.25's assistant across tokenizers passes): the cache is cropped back
    to the columns the ids share with it and the rest run again, so the tokens are transformers' from
    the ids alone, after a cache from generate and from forward's prompt and step (dense, hybrid, and the
    cache of packages without GroupQueryAttention, whose buffers grow by each run)."""
    model, hf = load_pair(build(arch))
    ids, mask = left_padded([5], seed=7)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=2)
    first = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options).sequences
    stepped = torch.cat([first, torch.tensor([[40, 41]])], 1)
    for more in (first, first[:, :-2], torch.cat([first[:, :-3], torch.tensor([[33, 34]])], 1), stepped):
        for cache in ("generate", "forward"):
            if cache == "generate":
                past = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options)[CACHE_NAME]
            else:
                prompt = model(stepped[:, :-2], use_cache=True)[CACHE_NAME]
                past = model(stepped[:, -2:], past_key_values=prompt, use_cache=True)[CACHE_NAME]
            with torch.inference_mode():
                expected = hf.generate(more, attention_mask=torch.ones_like(more), **options)
            ours = model.generate(more, attention_mask=torch.ones_like(more), past_key_values=past, **options)
            assert torch.equal(ours, expected), (cache, more.shape)
            assert past.get_seq_length() == expected.shape[1] - 1


def test_forward_keywords_transformers_passes(build):
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded([4, 7], seed=8)
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # what transformers' generate computes
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache_position=torch.arange(7),
                use_cache=True, return_dict=True, output_attentions=False, output_hidden_states=False)
    with torch.inference_mode():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert (out.logits - expected)[real].abs().max().item() < 1e-4
    step = model(torch.tensor([[9], [9]]), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                 position_ids=torch.tensor([[4], [7]]), cache_position=torch.tensor([7]),
                 past_key_values=out.past_key_values)
    assert step.logits.shape == (2, 1, 512)
    with pytest.raises(NotImplementedError, match="position_ids or cache_position other than each row's own"):
        model(ids, attention_mask=mask, position_ids=torch.arange(7).expand(2, 7) + 3)
    with pytest.raises(NotImplementedError, match="position_ids or cache_position other than each row's own"):
        model(torch.tensor([[9], [9]]), position_ids=torch.tensor([[0], [0]]), past_key_values=step.past_key_values)


def test_generate_takes_the_prompts_own_positions_and_refuses_others(build):
    """`generate(..., position_ids=)`: transformers runs the prompt at the positions given; ortmodule's loop
    numbers each row from its mask, so it takes the positions transformers computes (the same tokens and
    scores) and refuses others by name, as forward does, where it ran the prompt at its own positions."""
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded([4, 7], seed=8)
    options = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    own = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # what transformers' generate computes
    ours = model.generate(ids, attention_mask=mask, position_ids=own, **options)
    expected = hf.generate(ids, attention_mask=mask, position_ids=own, **options)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ours.logits, expected.logits)) < 1e-4
    elsewhere = torch.zeros_like(ids)  # every prompt token at position 0: transformers' answer changes
    moved = hf.generate(ids, attention_mask=mask, position_ids=elsewhere, **options)
    assert max((a - b).abs().max().item() for a, b in zip(moved.logits, expected.logits)) > 1e-2
    with pytest.raises(NotImplementedError, match="position_ids or cache_position other than each row's own"):
        model.generate(ids, attention_mask=mask, position_ids=elsewhere, **options)
    with pytest.raises(ValueError, match=r"position_ids of shape \(9,\) do not match the input \(2, 7\)"):
        model.generate(ids, attention_mask=mask, position_ids=torch.arange(9), **options)


def test_a_steps_positions_in_every_form_transformers_takes(build):
    """A step over the cache takes position_ids `[B, s]`, `[1, s]` (one row for all), `[s]` and mRoPE's
    `[3, B, s]` (text: three equal sections), and `cache_position`, each giving transformers' logits;
    other forms are named."""
    model, hf = load_pair(build("llama"))
    ids, new = torch.arange(5, 17).view(2, 6), torch.tensor([[20], [21]])
    with torch.inference_mode():
        expected = hf(new, past_key_values=hf(ids, use_cache=True).past_key_values).logits

    def step(**options):
        return model(new, past_key_values=model(ids, use_cache=True).past_key_values, **options).logits

    positions = torch.tensor([[6], [6]])
    for options in ({"position_ids": positions}, {"position_ids": positions[:1]}, {"position_ids": torch.tensor([6])},
                    {"position_ids": positions[None].expand(3, 2, 1)}, {"cache_position": torch.tensor([6])}):
        assert (step(**options) - expected).abs().max().item() < 1e-4, options
    for options, error, message in [
        ({"position_ids": positions.float()}, TypeError, "position_ids must be an integer tensor, got dtype "
                                                        "torch.float32"),
        ({"position_ids": [[6], [6]]}, TypeError, "position_ids must be an integer tensor, got list"),
        ({"position_ids": torch.tensor([[6, 7], [6, 7]])}, ValueError, r"position_ids of shape \(2, 2\) do not match "
                                                                       r"the input \(2, 1\)"),
        ({"position_ids": torch.stack([positions, positions, positions + 1])}, NotImplementedError,
         "other than each row's own positions"),
        ({"cache_position": torch.tensor([[6]])}, ValueError, "cache_position must be a 1-D tensor of 1 columns"),
        ({"cache_position": torch.tensor([7])}, NotImplementedError, "other than each row's own positions"),
    ]:
        with pytest.raises(error, match=message):
            step(**options)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype torch.bool"):
        model(new.bool(), past_key_values=model(ids, use_cache=True).past_key_values)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_a_device_the_machine_or_ortmodule_lacks_is_named(build):
    """`device`, accelerate's `device_map` and `.to()`: a CUDA device on a machine without one, and a
    device type ONNX Runtime's providers here do not cover, refused naming the device before anything
    loads; the CPU however named."""
    package = build("llama").package_dir
    for options in ({"device": "cuda"}, {"device": 0}, {"device_map": {"": 0}}, {"device_map": "cuda:1"}):
        with pytest.raises(RuntimeError, match=r"device cuda(:\d)? asked for, but torch sees no CUDA device"):
            OrtModelForCausalLM.from_pretrained(package, **options)
    for name in ("mps", "meta", "xpu"):
        with pytest.raises(ValueError, match=f"unsupported device '{name}': use 'cpu', 'cuda' or 'cuda:N'"):
            OrtModelForCausalLM.from_pretrained(package, device=name)
    for options in ({"device": "cpu:0"}, {"device_map": "auto"}, {"device_map": {"": "cpu"}}):
        assert OrtModelForCausalLM.from_pretrained(package, **options).device == torch.device("cpu")
    model = OrtModelForCausalLM.from_pretrained(package)
    with pytest.raises(ValueError, match="unsupported device 'mps'"):
        model.to("mps")
    with pytest.raises(RuntimeError, match="device cuda asked for"):
        model.cuda()


def test_printing_the_model_names_its_package_device_and_dtype(build):
    package = build("llama").package_dir
    model = OrtModelForCausalLM.from_pretrained(package)
    assert repr(model) == f"OrtModelForCausalLM(path={package}, device=cpu, dtype=torch.float32)"


def test_autocast_is_named_and_changes_nothing(build):
    """Under torch.autocast(bf16), transformers computes in bf16; an fp32 package computes as exported, the
    same logits as without autocast, and a warning says so (none without autocast)."""
    import warnings

    model, _ = load_pair(build("llama"))
    ids, mask = left_padded([4, 7], seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = model(ids, attention_mask=mask).logits
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=r"autocast\(cpu, bfloat16\) does not change .* computes in float32"), bf16:
        under = model(ids, attention_mask=mask).logits
    assert under.dtype == torch.float32 and torch.equal(under, plain)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=2)
    with pytest.warns(UserWarning, match=r"autocast\(cpu, bfloat16\) does not change"), bf16:  # no forward runs
        tokens = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(tokens, model.generate(ids, attention_mask=mask, **options))


@pytest.mark.parametrize("arch", [*MODEL_ARCHES, "lfm2"])
def test_the_backbone_gives_transformers_last_hidden_state_without_the_lm_head(build, arch):
    """`model.model`, `model.base_model` and `model.get_decoder()`, called as transformers' backbone, give its
    `last_hidden_state` (a left-padded batch, compared at the real positions); the run's graph has no logits
    output (no LM head computed); asked for more, the hidden states of every layer and a cache."""
    model, reference = load_pair(build(arch))
    ids, mask = left_padded([5, 12, 9], seed=3)
    real = mask.bool()
    with torch.no_grad():
        expected = reference.model(ids, attention_mask=mask, output_hidden_states=True)
    for backbone in (model.model, model.base_model, model.get_decoder()):
        out = backbone(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)  # as trl calls it
        assert out.last_hidden_state.shape == expected.last_hidden_state.shape
        assert torch.allclose(out.last_hidden_state[real], expected.last_hidden_state[real], atol=1e-4)
        assert out.hidden_states is None and out.past_key_values is None
    headless = variants.for_decoder(model.decoder, variants.LAST, False).session
    assert model.decoder.spec.logits not in headless.output_names
    plain = model(ids, attention_mask=mask, output_hidden_states=True)
    logits = model.get_output_embeddings()(model.model(ids, attention_mask=mask).last_hidden_state)
    assert torch.allclose(logits[real], plain.logits[real], atol=1e-5)
    asked = model.model(ids, attention_mask=mask, output_hidden_states=True, use_cache=True, return_dict=False)
    last, cache, states = asked
    assert isinstance(cache, KVCache) and len(states) == len(expected.hidden_states)
    for ours, theirs in zip(states, expected.hidden_states):
        assert torch.allclose(ours[real], theirs[real], atol=1e-4)
    assert torch.equal(last, states[-1])
    cached = model.model(ids, attention_mask=mask, use_cache=True).past_key_values  # the headless run's cache
    longer, token = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), torch.full((len(ids), 1), 7)
    step = model(token, attention_mask=longer, past_key_values=cached).logits
    assert torch.allclose(step, model(torch.cat([ids, token], 1), attention_mask=longer).logits[:, -1:], atol=1e-4)
    assert list(model.model.parameters()) == [] and len(list(model.parameters())) == 1  # not a submodule
    assert torch.equal(model.model.embed_tokens.weight, model.get_input_embeddings().weight)
    backbone = model.model
    assert backbone.config is model.config and (backbone.device, backbone.dtype) == (model.device, model.dtype)
    with pytest.raises(TypeError, match="the backbone takes no labels"):
        model.model(ids, labels=ids)
    for register in ("register_forward_hook", "register_forward_pre_hook"):  # they would never fire in forward
        with pytest.raises(NotSupportedError, match="hooks on model.model: .* run the ONNX graph whole"):
            getattr(model.model, register)(lambda *args: None)


def test_what_an_onnx_package_lacks_is_a_clear_error(build):
    model, _ = load_pair(build("llama"))
    assert isinstance(model, GenerationMixin) and model.can_generate()
    assert not hasattr(model, "lm_head")
    with pytest.raises(NotSupportedError, match="has no lm_head: the ONNX graph holds the weights"):
        getattr(model, "lm_head")  # noqa: B009
    for name in ("layers", "norm"):  # the backbone's modules
        assert not hasattr(model.model, name)
        with pytest.raises(NotSupportedError, match=f"backbone of an ONNX package has no {name}"):
            getattr(model.model, name)
    for name in ("gradient_checkpointing_enable", "enable_input_require_grads"):
        with pytest.raises(NotSupportedError, match=f"has no {name}: an ONNX package runs inference only"):
            getattr(model, name)()
    assert not model.supports_gradient_checkpointing and not model.is_gradient_checkpointing
    with pytest.raises(NotSupportedError, match="has no push_to_hub: save the package with save_pretrained"):
        model.push_to_hub("me/model")
    for name in ("load_adapter", "add_adapter", "set_adapter", "active_adapters"):  # transformers' PEFT integration
        assert not hasattr(model, name)
        with pytest.raises(NotSupportedError, match=f"has no {name}: .* merge the adapter into the checkpoint"):
            getattr(model, name)("adapter")
    with pytest.raises(NotSupportedError, match="has no set_input_embeddings: .* export it again"):
        model.set_input_embeddings(torch.nn.Embedding(4, 2))
    with pytest.raises(NotSupportedError, match="assistant_early_exit .* pass assistant_model="):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=2, assistant_early_exit=1, pad_token_id=0)
    with pytest.raises(NotImplementedError, match="exported package"):
        model.resize_token_embeddings(9)


def test_the_loss_function_and_memory_footprint_as_transformers_models_give_them(build):
    """`loss_function` is transformers' causal-LM loss (forward's loss from the logits), and
    `get_memory_footprint()` the package's weight files: at least the bytes of transformers' parameters
    on the same weights, and little more (the graph's rotary tables)."""
    model, hf = load_pair(build("llama"))
    ids = torch.tensor([[5, 9, 17, 33, 8]])
    out = model(ids, labels=ids)
    assert torch.allclose(model.loss_function(out.logits, ids, vocab_size=model.config.vocab_size), out.loss)
    assert hf.get_memory_footprint() <= model.get_memory_footprint() < 1.2 * hf.get_memory_footprint()


def test_the_memory_footprint_counts_only_what_the_package_loads(build, tmp_path):
    """Another variant's graph and weights in the same folder (not named by genai_config) are not
    counted: the footprint stays what the package's own graph and weight file weigh; graphs in
    subfolders (mobius-onnx's packages) are."""
    package = build("llama").package_dir
    folder = tmp_path / "package"
    shutil.copytree(package, folder)
    own = sum((package / name).stat().st_size for name in ("model.onnx", "model.onnx.data"))
    shutil.copy(package / "model.onnx", folder / "model_int4.onnx")
    shutil.copy(package / "model.onnx.data", folder / "model_int4.onnx.data")
    assert OrtModelForCausalLM.from_pretrained(folder).get_memory_footprint() == own
    # mobius-onnx's packages keep each graph in a folder of its own (counted 0 bytes before session 57)
    mobius = build("gemma4_mobius").package_dir
    graphs = sum(f.stat().st_size for f in mobius.rglob("*") if f.name.endswith((".onnx", ".data")))
    assert graphs > 0 and OrtModelForCausalLM.from_pretrained(mobius).get_memory_footprint() == graphs


def test_a_graph_text_never_loads_is_not_read_for_the_footprint_or_the_parameter_count(build, caplog):
    """The gemma4_embeds fixture's vision model is a text file (a test fails if anything loads it for
    text): `get_memory_footprint()` counts its bytes without reading it as a graph, and
    `num_parameters()` counts the other graphs, saying that it left that one out (transformers' count,
    but for the builder's few constants: test_lm_eval.py's `test_results_record_hfs_parameter_count`)."""
    fixture = build("gemma4_embeds")
    model, hf = load_pair(fixture)
    files = [fixture.package_dir / name for name in ("model.onnx", "model.onnx.data", "embedding.onnx", "vision.onnx")]
    assert model.get_memory_footprint() == sum(f.stat().st_size for f in files)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        counted = model.num_parameters()
    assert "vision.onnx is not a readable ONNX graph" in caplog.text
    assert counted == pytest.approx(hf.num_parameters(), rel=1e-3)


WIDE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}  # Phi-2's rotary


@pytest.mark.parametrize("arch", [*MODEL_ARCHES, "gemma2", "granite", "lfm2", "phi"])
def test_input_and_output_embeddings_are_transformers(build, arch):
    """`get_input_embeddings()`: the table transformers' module holds, and its forward (Gemma's
    scaled inside the module, Granite's multiplier left to the model), frozen, not a submodule;
    `get_output_embeddings()`: the LM head's weight (and Phi-2's bias) as transformers' Linear."""
    model, hf = load_pair(build(arch, **({"num_layers": 4} if arch == "lfm2" else WIDE if arch == "phi" else {})))
    head, theirs_head = model.get_output_embeddings(), hf.get_output_embeddings()
    assert model.get_output_embeddings() is head
    assert torch.equal(head.weight, theirs_head.weight) and not head.weight.requires_grad
    assert (head.bias is None) == (theirs_head.bias is None)
    assert head.bias is None or torch.equal(head.bias, theirs_head.bias)
    ours, theirs = model.get_input_embeddings(), hf.get_input_embeddings()
    assert model.get_input_embeddings() is ours  # read once
    ids = torch.tensor([[3, 7, 100, 499], [0, 1, 2, 511]])
    with torch.inference_mode():
        assert torch.equal(ours.weight, theirs.weight)
        assert torch.equal(ours(ids), theirs(ids))
    assert not ours.weight.requires_grad
    assert [name for name, _ in model.named_parameters()] == ["device_anchor"]  # the tables are not registered


def dequantized_head(package_dir) -> torch.Tensor:
    """The `[vocab, hidden]` weight of a package's MatMulNBits LM head by the op's documented format, read
    here with onnx_ir: `bits`-bit values packed low nibble first, per row blocks of `block_size` with a
    scale and a zero point (2 ** (bits - 1) where the graph gives none)."""
    import onnx_ir as ir

    head = [n for n in ir.load(package_dir / "model.onnx").graph if n.op_type == "MatMulNBits"][-1]
    take = lambda value, dtype: torch.frombuffer(bytearray(value.const_value.tobytes()), dtype=dtype)  # noqa: E731
    bits, block = head.attributes["bits"].as_int(), head.attributes["block_size"].as_int()
    hidden, vocab = head.attributes["K"].as_int(), head.attributes["N"].as_int()

    def unpacked(data: torch.Tensor) -> torch.Tensor:
        return (torch.stack([data & 15, data >> 4], -1) if bits == 4 else data).view(vocab, -1).float()

    scales = take(head.inputs[2], torch.float32).view(vocab, -1)
    zero = unpacked(take(head.inputs[3], torch.uint8))[:, : scales.shape[1]] if len(head.inputs) > 3 \
        and head.inputs[3] is not None else torch.full_like(scales, 2 ** (bits - 1))
    values = unpacked(take(head.inputs[1], torch.uint8))[:, :hidden]
    return (values - zero.repeat_interleave(block, 1)[:, :hidden]) * scales.repeat_interleave(block, 1)[:, :hidden]


@pytest.mark.parametrize("spec", [fixtures.SMOLLM2_INT4, fixtures.FixtureSpec("llama", precision="int8"),
                                  fixtures.FixtureSpec("llama", precision="int4",
                                                       extra_options=(("is_symmetric", "false"),))],
                         ids=["smollm2-int4-tied", "llama-int8", "llama-int4-zero-points"])
def test_block_quantized_embeddings_and_head_are_the_weights_they_dequantize_to(spec):
    """A 4-bit or 8-bit LM head (`MatMulNBits`) is given as its weight dequantizes, against the op's
    format read apart; the real SmolLM2's int4 package reads its tied token table through the head's
    4-bit weight (`GatherBlockQuantized`): `get_input_embeddings()` is that table, its rows the
    embeddings the graph itself feeds its first layer, and `inputs_embeds` of them give the ids' logits."""
    fixture = fixtures.build(spec)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    head = model.get_output_embeddings()
    assert torch.equal(head.weight, dequantized_head(fixture.package_dir))
    ids = torch.tensor([[3, 7, 100, 499, 20, 21], [0, 1, 2, 300, 4, 5]])
    out = model(ids, output_hidden_states=True)
    table = model.get_input_embeddings()
    with torch.inference_mode():
        assert torch.equal(table(ids), out.hidden_states[0])
        assert torch.equal(model(inputs_embeds=table(ids)).logits, out.logits)
    if spec.arch == "smollm2":
        assert torch.equal(table.weight, head.weight)  # tied: one 4-bit weight behind both


def test_the_head_on_the_last_hidden_state_gives_the_logits(build):
    """A logit lens's last step: `get_output_embeddings()` of `hidden_states[-1]` is the logits."""
    for arch, fields in (("llama", {}), ("phi", WIDE)):
        model = OrtModelForCausalLM.from_pretrained(build(arch, **fields).package_dir)
        ids, mask = left_padded([6, 4], seed=5)
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        with torch.inference_mode():
            logits = model.get_output_embeddings()(out.hidden_states[-1])
        real = mask.bool()
        assert (logits - out.logits)[real].abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant", "guidance_scale"])
def test_other_generation_modes_equal_transformers(build, mode):
    """Prompt lookup and assisted decoding (multi-token steps over the cache, then crop: batch 1, as
    transformers allows) and classifier-free guidance, through transformers' own loops."""
    model, hf = load_pair(build("llama"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])

    def run(m):
        extra = {"prompt_lookup": dict(prompt_lookup_num_tokens=3), "assistant": dict(assistant_model=m),
                 "guidance_scale": dict(guidance_scale=1.5)}[mode]
        with torch.inference_mode():
            return m.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=2, **extra)

    assert torch.equal(run(model), run(hf))


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_an_assistant_drafting_the_pad_token_equals_transformers(build, arch):
    """transformers' assistant infers its mask from pad tokens each round, so a drafted pad token (not
    the EOS) gets a 0 inside the text, which a step over ortmodule's cache cannot hide: continuing a
    cache, ortmodule counts it as a token (with a warning). The main model decides the output, so the
    tokens equal transformers'; a fresh prompt with a pad token inside is still refused by name."""
    model, hf = load_pair(build(arch, **({"num_layers": 4} if arch == "lfm2" else {})))
    ids = torch.tensor([[5, 9, 17, 33, 8, 40, 11, 12]])
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None)
    with torch.inference_mode():
        greedy = hf.generate(ids, pad_token_id=0, **options)[0, ids.shape[1]:]
    pad = int(greedy[2])  # a token greedy decoding makes, so the assistant drafts it
    assert pad not in ids[0].tolist()
    with torch.inference_mode():
        theirs = hf.generate(ids, assistant_model=hf, pad_token_id=pad, **options)
        with pytest.warns(UserWarning, match=f"holds pad_token_id {pad} after a row's first token"):
            ours = model.generate(ids, assistant_model=model, pad_token_id=pad, **options)
    assert torch.equal(ours, theirs) and torch.equal(ours[0, ids.shape[1]:], greedy)
    inside = torch.tensor([[5, 9, pad, 33, 8]])  # no cache: transformers masks it, ortmodule cannot
    with pytest.raises(ValueError, match=f"masks out every pad token \\({pad}\\).*row 0 holds it at position 2"), \
            torch.inference_mode():
        model.generate(inside, max_new_tokens=2, do_sample=False, pad_token_id=pad, eos_token_id=None)


def test_generate_returns_ordinary_tensors_outside_inference_mode(build):
    """generate runs in inference mode; called outside it, its tensors are ordinary ones, as
    transformers' (updated in place by code such as transformers' universal assisted decoding), and
    inside it they are inference tensors, not copied."""
    model, _ = load_pair(build("llama"))
    ids = torch.tensor([[5, 9, 17, 33]])
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                   output_scores=True, output_logits=True, output_hidden_states=True)
    for beams in (1, 2):
        with torch.no_grad():
            out = model.generate(ids, num_beams=beams, **options)
        parts = [out.sequences, *out.scores, *out.logits, *(t for step in out.hidden_states for t in step)]
        assert not any(t.is_inference() for t in parts)
        out.sequences[:, -1] = 0  # as transformers' outputs allow
        assert isinstance(out.past_key_values, KVCache)
        with torch.inference_mode():
            assert model.generate(ids, num_beams=beams, **options).sequences.is_inference()


def test_universal_assisted_decoding_with_an_ortmodule_assistant():
    """transformers' assisted decoding across tokenizers (`assistant_tokenizer`) with ortmodule on either
    side: the main model's greedy tokens. With transformers as the main model it edits its assistant's
    sequences in place outside inference mode, which ortmodule's generate once refused (inference tensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    main, assistant = fixtures.build(fixtures.SMOLLM2), fixtures.build(fixtures.FixtureSpec("llama"))
    tokenizer, its_tokenizer = (AutoTokenizer.from_pretrained(f.hf_dir) for f in (main, assistant))
    prompt = tokenizer(["The capital of France is"], return_tensors="pt")
    options = dict(**prompt, max_new_tokens=12, do_sample=False, tokenizer=tokenizer, assistant_tokenizer=its_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(main.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        greedy = hf.generate(**prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(hf.generate(assistant_model=OrtModelForCausalLM.from_pretrained(assistant.package_dir),
                                       **options), greedy)
        # transformers' own assistant: where transformers' pair fails (5.25 appends the assistant's ids to a
        # cache already holding them, and its attention reshapes zero new tokens), ortmodule's main fails alike
        theirs = load_pair(assistant)[1]
        try:
            expected = hf.generate(assistant_model=theirs, **options)
        except RuntimeError as error:
            with pytest.raises(type(error)):
                OrtModelForCausalLM.from_pretrained(main.package_dir).generate(assistant_model=theirs, **options)
        else:
            assert torch.equal(expected, greedy)
            assert torch.equal(OrtModelForCausalLM.from_pretrained(main.package_dir).generate(
                assistant_model=theirs, **options), greedy)


def test_a_deep_copy_runs_sessions_of_its_own(build):
    """copy.deepcopy loads the package again with the same options (ONNX Runtime's sessions cannot be
    copied): the same logits and tokens, sessions and settings of its own."""
    import copy

    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir, prefill_chunk=0, rewrite_lm_head=False)
    model.generation_config.max_new_tokens = 4
    copied = copy.deepcopy(model)
    assert copied.decoder is not model.decoder and copied.decoder.session is not model.decoder.session
    assert (copied.decoder.prefill_chunk, copied.keeps_positions) == (0, False)
    ids = torch.tensor([[5, 9, 17, 33]])
    assert torch.equal(copied(ids).logits, model(ids).logits)
    copied.generation_config.max_new_tokens = 2
    assert model.generate(ids, do_sample=False, pad_token_id=0).shape[1] == 8
    assert torch.equal(copied.generate(ids, do_sample=False, pad_token_id=0), model.generate(
        ids, do_sample=False, pad_token_id=0, max_new_tokens=2))
    with pytest.raises(NotSupportedError, match="model.model's last hidden state: it needs the LM-head rewrite"):
        model.model(ids)  # without the rewrite, no graph to take the LM head out of


def _logits_in_a_worker(model, ids):
    return model(ids).logits, model.decoder.chosen_chunk, model.generation_config.max_new_tokens, model.note


def test_a_pickled_model_loads_its_package_again_where_it_is_unpickled(build, tmp_path, monkeypatch):
    """pickle keeps the package's folder, device, loading options and fingerprint in place of the sessions (a
    few KB, no weights), and what a deep copy copies: a model passed to another process (multiprocessing's
    spawn here) computes there what it computes here. A package whose files changed since is refused at
    unpickling; a model loaded with session_options (which ONNX Runtime cannot pickle) at pickling."""
    import multiprocessing
    import pickle
    import shutil

    import onnxruntime as ort

    from ortmodule import PackageError

    package = tmp_path / "package"
    shutil.copytree(build("llama").package_dir, package)
    model = OrtModelForCausalLM.from_pretrained(package, prefill_chunk=0)
    model.generation_config.max_new_tokens, model.note = 3, "set on the model"
    model.get_output_embeddings()  # a table made on the model: made again, not pickled
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    pickled = pickle.dumps(model)
    assert len(pickled) < 20_000
    again = pickle.loads(pickled)
    assert again.decoder is not model.decoder and again.package is again.decoder.package
    assert torch.equal(again(ids).logits, model(ids).logits) and [n for n, _ in again.named_parameters()] == [
        "device_anchor"]
    assert torch.equal(again.generate(ids, do_sample=False), model.generate(ids, do_sample=False))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        logits, chunk, new, note = pool.apply(_logits_in_a_worker, (model, ids))
    assert torch.equal(logits, model(ids).logits) and (chunk, new, note) == (0, 3, "set on the model")
    (package / "genai_config.json").write_text((package / "genai_config.json").read_text() + "\n")
    with pytest.raises(PackageError, match="files changed since the model was pickled"):
        pickle.loads(pickled)
    with pytest.raises(TypeError, match="session_options cannot be pickled"):
        pickle.dumps(OrtModelForCausalLM.from_pretrained(package, session_options=ort.SessionOptions()))
    with monkeypatch.context() as patch:  # loaded by a relative path, unpickled where the working folder is another
        patch.chdir(tmp_path)
        relative = pickle.dumps(OrtModelForCausalLM.from_pretrained("package"))
        patch.chdir(package)
        assert pickle.loads(relative).package.root == package


def test_trainer_evaluate_and_predict_equal_transformers(build, tmp_path):
    """transformers' Trainer evaluating a causal LM (loss over a collated dataset, predictions): it passes
    `num_items_in_batch`, counted over the shifted labels by the model's `loss_type`, and the loss is the
    sum over the targets divided by it, as transformers' loss; the same eval loss and logits."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    fixture = build("llama")
    # Models of their own, not load_pair's shared ones: Trainer sets their config's `use_cache` to False, which
    # a later test comparing the shared reference's config with a package's found changed.
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(fixture.hf_dir)
    texts = ["the cat sat on the mat", "a dog ran in the park today", "hello world", "one two three four five six"]
    data = [tokenizer(text) for text in texts]
    results = []
    for m in (model, hf):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True)
        trainer = Trainer(model=m, args=args, eval_dataset=data,
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
        predicted = trainer.predict(data)
        results.append((trainer.evaluate()["eval_loss"], predicted.predictions[predicted.label_ids != -100]))
    (ours, our_logits), (theirs, their_logits) = results  # the logits at the tokens, not at the padding
    assert abs(ours - theirs) < 1e-5 and abs(our_logits - their_logits).max() < 1e-4
    batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)(data[:2])
    with torch.no_grad():
        for count in (7, torch.tensor(30)):
            losses = [m(**batch, num_items_in_batch=count).loss for m in (model, hf)]
            assert abs(losses[0] - losses[1]) < 1e-5


def test_a_training_step_says_that_nothing_trains(build, tmp_path):
    """Loaded in eval mode, as transformers' `from_pretrained` leaves its models. In train mode with
    gradients on (Trainer.train, a training loop) the loss keeps its value and its `backward()` raises
    NotSupportedError naming the cause, where torch would say that the loss does not require grad; in
    eval mode or under no_grad the loss is a plain tensor."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert model.training is AutoModelForCausalLM.from_pretrained(fixture.hf_dir).training is False
    ids = torch.randint(4, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    evaluated = model(ids, labels=ids).loss
    assert not evaluated.requires_grad
    model.train()
    loss = model(ids, labels=ids).loss
    assert loss.item() == evaluated.item() and loss.requires_grad
    with pytest.raises(NotSupportedError, match="runs inference only"):
        loss.backward()
    with torch.no_grad():
        assert not model(ids, labels=ids).loss.requires_grad
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in ids.tolist()])
    with pytest.raises(NotSupportedError, match=r"Trainer\.train"):
        trainer.train()


def test_the_text_generation_pipelines_own_defaults_apply_as_on_transformers(build):
    """transformers 5 leaves a generation config's fields unset (None) unless the checkpoint sets them, and
    the text-generation pipeline fills the unset ones with its own defaults (sampling at temperature 0.7,
    256 new tokens). ortmodule's config sets only what the package's search section changes from
    transformers' defaults, so the pipeline called without options samples as on transformers' model."""
    from transformers import AutoTokenizer, pipeline

    fixture = build("llama")
    model, hf = load_pair(fixture)
    tokenizer = AutoTokenizer.from_pretrained(fixture.hf_dir)
    assert model.generation_config.do_sample is None and model.generation_config.temperature is None
    texts = []
    for m in (model, hf):
        torch.manual_seed(0)
        texts.append(pipeline("text-generation", model=m, tokenizer=tokenizer)("the cat sat", max_new_tokens=24))
    assert texts[0] == texts[1]


def test_from_pretrained_takes_transformers_loading_arguments(build, monkeypatch):
    """transformers' `from_pretrained` keywords, as HF-style code passes them: `dtype`/`torch_dtype`
    (the package's own precision, or "auto"), `device_map` (one device; "auto" the GPU where torch sees
    one), and arguments without effect on a package load the same model; the rest are refused by name."""
    package = build("llama").package_dir
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = OrtModelForCausalLM.from_pretrained(package)(ids).logits
    for kwargs in (dict(torch_dtype=torch.float32, device_map="cpu"), dict(dtype="float32", device_map={"": "cpu"}),
                   dict(dtype="auto", device_map="auto", trust_remote_code=True, attn_implementation="sdpa",
                        low_cpu_mem_usage=True)):
        model = OrtModelForCausalLM.from_pretrained(package, **kwargs)
        assert model.device == torch.device("cpu") and torch.equal(model(ids).logits, plain)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16: .* computes in float32, fixed when it was exported"):
        OrtModelForCausalLM.from_pretrained(package, torch_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a package runs on one device"):
        OrtModelForCausalLM.from_pretrained(package, device_map={"model.layers.0": 0, "lm_head": "cpu"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device_map="auto" takes the GPU torch sees
    with pytest.raises(ValueError, match="device='cpu' and device_map='auto' name different devices"):
        OrtModelForCausalLM.from_pretrained(package, device="cpu", device_map="auto")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="load_in_4bit, quantization_config: a GenAI package's weights and precision"):
        OrtModelForCausalLM.from_pretrained(package, load_in_4bit=True, quantization_config={"bits": 4})
    with pytest.raises(TypeError, match=r"unexpected keyword arguments: \['revison'\]"):
        OrtModelForCausalLM.from_pretrained(package, revison="main")
    # config fields, as transformers sets them from its keywords (AutoModel...(name, output_attentions=True))
    inspecting = OrtModelForCausalLM.from_pretrained(package, output_attentions=True, output_hidden_states=True)
    out = inspecting(ids)
    assert len(out.attentions) == 2 and len(out.hidden_states) == 3 and torch.allclose(out.logits, plain, atol=1e-5)
    assert OrtModelForCausalLM.from_pretrained(package)(ids).attentions is None  # its own config
    with pytest.raises(TypeError, match="output_attentions must be True or False, got 'yes'"):
        OrtModelForCausalLM.from_pretrained(package, output_attentions="yes")
    # transformers sets any field of the config from its keywords; a package takes those that leave its numbers
    # alone (use_cache, the special token ids: code that loads with use_cache=False or its own pad id), as
    # transformers' model on the same checkpoint shows them
    fields = dict(use_cache=False, pad_token_id=3, eos_token_id=[2, 3], bos_token_id=None)
    reference = transformers.AutoModelForCausalLM.from_pretrained(build("llama").hf_dir, **fields)
    model = OrtModelForCausalLM.from_pretrained(package, **fields)
    assert {name: getattr(model.config, name) for name in fields} == \
        {name: getattr(reference.config, name) for name in fields} == fields
    assert torch.equal(model(ids).logits, plain)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"pad_token_id={vocab} is outside the vocabulary \[0, {vocab}\)"):
        OrtModelForCausalLM.from_pretrained(package, pad_token_id=vocab)
    with pytest.raises(TypeError, match="eos_token_id must be a token id .or a list of them. or None, got 'x'"):
        OrtModelForCausalLM.from_pretrained(package, eos_token_id="x")
    with pytest.raises(TypeError, match=r"\['sliding_window'\] .* the model's shape and settings, were fixed when"):
        OrtModelForCausalLM.from_pretrained(package, sliding_window=4)



@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("fp16", torch.float16)])
def test_the_configs_dtype_is_the_packages_as_transformers_sets_a_loaded_models(build, tmp_path, precision, dtype):
    """transformers sets a loaded model's `config.dtype` (and its text config's) to the precision it loaded
    in; a package's config says the package's, whether built from genai_config.json or read from the
    checkpoint's config.json kept in the package (a float32 checkpoint's here)."""
    fixture = build("llama", precision=precision)
    reference = transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=dtype)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert model.config.dtype == model.config.get_text_config().dtype == reference.config.dtype == model.dtype == dtype
    folder = shutil.copytree(fixture.package_dir, tmp_path / "package")
    shutil.copy(fixture.hf_dir / "config.json", folder)
    assert transformers.AutoConfig.from_pretrained(folder).dtype == torch.float32  # what the checkpoint says
    assert OrtModelForCausalLM.from_pretrained(folder).config.dtype == dtype
