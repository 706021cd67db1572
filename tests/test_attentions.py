"""`output_attentions=True` against transformers' `attentions` (its eager attention) on the same weights."""

import random

import pytest
import torch
from helpers import check_config_default, fuzz_seeds, left_padded_batch, load_pair, reference_class, steps_beside

from ortmodule import NotSupportedError, OrtModelForCausalLM

# The builder's architectures, each for what its attention adds: sliding windows (Gemma 2 and 3, gpt-oss),
# soft-capping (Gemma 2), sinks (gpt-oss), a partial rotary (Phi-3), query/key norms (Qwen3), attention
# multipliers (Granite), layers of mixed head sizes reusing others' keys (Gemma 4), a hybrid's one
# attention layer among convolutions (LFM2: transformers' tuple holds the attention layers only); mobius-onnx's
# packages (ONNX's Attention; its Gemma 4 records no sliding window, so a sliding layer's step spans every column).
ARCHS = {"llama": {}, "qwen3": {}, "gemma3": {}, "gemma2": {}, "gpt_oss": {}, "phi3": {}, "granite": {},
         "gemma4": {}, "gemma4_embeds": {}, "lfm2": {"num_layers": 4},
         "gemma4_mobius": {}, "qwen2_5_vl": {}, "qwen2_vl": {}, "qwen3_vl": {}, "mistral3": {}}
QUICK = {"llama", "gemma3", "gpt_oss", "lfm2"}


def eager(fixture):
    """transformers' model with its eager attention, the one that returns weights."""
    return reference_class(fixture).from_pretrained(fixture.hf_dir, dtype=torch.float32,
                                                    attn_implementation="eager").eval()


def assert_weights(ours: tuple, theirs: tuple, real_queries: torch.Tensor | None = None, wider: bool = False) -> None:
    """As many layers of one shape each, equal to 1e-5 at the real queries; a padding query's row zeros.
    `wider`: ours may span more columns (a sliding-window layer's step where the package records no
    window), zeros before transformers' last ones."""
    assert len(ours) == len(theirs) > 0
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        if wider and a.shape[3] > b.shape[3]:
            assert (a[..., : a.shape[3] - b.shape[3]] == 0).all(), layer
            a = a[..., a.shape[3] - b.shape[3] :]
        assert a.shape == b.shape, (layer, a.shape, b.shape)
        if real_queries is not None:
            pad = ~real_queries[:, None, :, None].expand_as(a)
            assert (a[pad] == 0).all(), f"attentions[{layer}] at padding queries"
            a, b = a[~pad], b[~pad]
        assert (a - b).abs().max().item() < 1e-5, f"attentions[{layer}]"


@pytest.mark.parametrize("arch", [arch if arch in QUICK else pytest.param(arch, marks=pytest.mark.slow)
                                  for arch in ARCHS])
def test_attentions_equal_transformers(build, arch):
    """A left-padded batch with a cache, then steps of two tokens (one run each inside: several new
    tokens over a batch's cache) and of one: every attention layer's weights over the caller's
    columns (a sliding-window layer's in a step over those its cache keeps), as transformers gives
    them; the same batch right-padded."""
    fixture = build(arch, **ARCHS[arch])
    model, hf = load_pair(fixture)[0], eager(fixture)
    ids, mask = left_padded_batch([13, 6], vocab=500, seed=3)  # past the fixtures' 8-token windows
    out = model(ids, attention_mask=mask, use_cache=True, output_attentions=True)
    with torch.inference_mode():
        ref = hf(ids, attention_mask=mask, use_cache=True, output_attentions=True)
    assert_weights(out.attentions, ref.attentions, mask.bool())
    assert (out.logits - ref.logits)[mask.bool()].abs().max().item() < 1e-4
    for step, theirs in steps_beside(model, hf, out, ref, mask, output_attentions=True):
        assert_weights(step.attentions, theirs.attentions, wider=arch == "gemma4_mobius")
    right = mask.flip(1)
    out = model(ids, attention_mask=right, output_attentions=True)
    with torch.inference_mode():
        ref = hf(ids, attention_mask=right, output_attentions=True, use_cache=False)
    assert_weights(out.attentions, ref.attentions, right.bool())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generate_returns_transformers_attentions(build, arch):
    """generate(output_attentions=True, return_dict_in_generate=True), greedy and beams: the same tokens
    and, step by step, the same weights as transformers' (the prompt's at its real queries)."""
    fixture = build(arch)
    model, hf = load_pair(fixture)[0], eager(fixture)
    ids, mask = left_padded_batch([9, 5], vocab=500, seed=6)
    for options in ({}, {"num_beams": 2}):
        kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=2, output_attentions=True,
                      return_dict_in_generate=True, **options)
        ours = model.generate(ids, **kwargs)
        with torch.inference_mode():
            theirs = hf.generate(ids, **kwargs)
        assert torch.equal(ours.sequences, theirs.sequences)
        assert len(ours.attentions) == len(theirs.attentions) == 4
        rows = ours.attentions[0][0].shape[0] // 2
        assert_weights(ours.attentions[0], theirs.attentions[0], mask.bool().repeat_interleave(rows, 0))
        for a, b in zip(ours.attentions[1:], theirs.attentions[1:]):
            assert_weights(a, b)


def test_attentions_beside_hidden_states_embeddings_tuples_and_the_config(build):
    """Weights with hidden states, from `inputs_embeds`, in the tuple output (loss, logits, hidden
    states, attentions), and from the config's `output_attentions`; the plain path after them unchanged."""
    fixture = build("llama")
    model, hf = load_pair(fixture)[0], eager(fixture)
    ids, mask = left_padded_batch([7, 5], vocab=500, seed=5)
    with torch.inference_mode():
        ref = hf(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    both = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True, logits_to_keep=1)
    assert_weights(both.attentions, ref.attentions, mask.bool())
    assert len(both.hidden_states) == 3 and both.logits.shape == (2, 1, 512)
    model.set_attn_implementation("eager")  # what transformers' docs have code do first: no effect here
    with pytest.raises(TypeError, match="attn_implementation must be a string"):
        model.set_attn_implementation(3)
    embeds = model.get_input_embeddings()(ids)
    assert_weights(model(inputs_embeds=embeds, attention_mask=mask, output_attentions=True).attentions,
                   ref.attentions, mask.bool())
    loss, logits, states, weights = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True,
                                          output_attentions=True, return_dict=False)
    assert len(states) == 3
    assert_weights(weights, ref.attentions, mask.bool())
    check_config_default(model, ids, mask, "output_attentions", "attentions", 2)
    plain = model(ids, attention_mask=mask)
    assert plain.attentions is None and (plain.logits - ref.logits)[mask.bool()].abs().max().item() < 1e-4


def test_attentions_over_generate_s_cache_take_its_columns(build):
    """generate's cache keeps the prompt's mask: a step over it gives its weights in those columns with
    or without the step's attention_mask. A cache that knows no columns (as scoring's, inside) refuses
    a padded batch's step without the mask by name, and runs one over unpadded rows."""
    model = load_pair(build("llama"))[0]
    ids, mask = left_padded_batch([6, 4], vocab=500, seed=7)
    made, again = (model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=2,
                                  return_dict_in_generate=True) for _ in range(2))  # a cache each
    tokens = made.sequences[:, -1:]
    step_mask = torch.cat([mask, torch.ones(2, made.sequences.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    given = model(tokens, attention_mask=step_mask, past_key_values=made.past_key_values, output_attentions=True)
    taken = model(tokens, past_key_values=again.past_key_values, output_attentions=True)
    weights = given.attentions[0]
    assert weights.shape == (2, 4, 1, step_mask.shape[1])
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 1)) and (weights[(step_mask == 0)[:, None, None]
                                                                              .expand_as(weights)] == 0).all()
    assert all(torch.equal(a, b) for a, b in zip(given.attentions, taken.attentions))
    given.past_key_values.caller_mask = None
    with pytest.raises(ValueError, match="needs the step's attention_mask"):
        model(tokens, past_key_values=given.past_key_values, output_attentions=True)
    whole = model.generate(ids[:1, 2:], max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    whole.past_key_values.caller_mask = None
    assert model(whole.sequences[:, -1:], past_key_values=whole.past_key_values,
                 output_attentions=True).attentions[0].shape == (1, 4, 1, whole.sequences.shape[1])


def test_packages_without_weights_are_refused_by_name(build):
    """Attention that ONNX Runtime gives no weights from, the builder's fp16 CPU export's MultiHeadAttention:
    a NotSupportedError naming it, the model usable after."""
    model = OrtModelForCausalLM.from_pretrained(build("llama", precision="fp16").package_dir)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(NotSupportedError, match="output_attentions=True: its attention is com.microsoft's "
                                                "MultiHeadAttention"):
        model(ids, output_attentions=True)
    with pytest.raises(NotSupportedError, match="output_attentions=True"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    assert model(ids).logits.shape[:2] == (1, 3)


FUZZ = ["llama", "gemma3", "gemma2", "gpt_oss", "qwen2_5_vl", "gemma4"]


@pytest.mark.parametrize("seed", fuzz_seeds("ATTENTION_FUZZ_SEEDS", 6))
def test_attentions_fuzz(build, seed):
    """Random architectures, row lengths (past the fixtures' 8-token windows or not), padding sides and
    steps of 1-3 tokens over the cache (with or without the step's mask): every step's weights as
    transformers' eager attention gives them. `ATTENTION_FUZZ_SEEDS=N` runs more."""
    rng = random.Random(7000 + seed)
    arch = rng.choice(FUZZ)
    fixture = build(arch)
    model, hf = load_pair(fixture)[0], eager(fixture)
    lengths = [rng.randint(1, 14) for _ in range(rng.randint(1, 3))]
    ids, mask = left_padded_batch(lengths, vocab=500, seed=seed)
    what = f"seed {7000 + seed}: {arch}, prompts of {lengths} tokens"
    out = model(ids, attention_mask=mask, use_cache=True, output_attentions=True)
    with torch.inference_mode():
        ref = hf(ids, attention_mask=mask, use_cache=True, output_attentions=True)
    assert_weights(out.attentions, ref.attentions, mask.bool())
    ours, theirs = out.past_key_values, ref.past_key_values
    for step in range(rng.randint(1, 3)):
        new = rng.randint(1, 3)
        tokens = torch.randint(4, 500, (len(lengths), new), generator=torch.Generator().manual_seed(seed + step))
        mask = torch.cat([mask, torch.ones(len(lengths), new, dtype=mask.dtype)], 1)
        given = {"attention_mask": mask} if rng.random() < 0.7 else {}  # else the cache's own columns
        out = model(tokens, past_key_values=ours, output_attentions=True, **given)
        with torch.inference_mode():
            ref = hf(tokens, attention_mask=mask, past_key_values=theirs, output_attentions=True)
        try:
            assert_weights(out.attentions, ref.attentions)
        except AssertionError as failure:
            raise AssertionError(f"{what}, step {step} of {new} tokens: {failure}") from None
        ours, theirs = out.past_key_values, ref.past_key_values
