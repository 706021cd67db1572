"""`forward(inputs_embeds=...)` and `generate(inputs_embeds=...)` against transformers on the same
weights: embeddings that are not any token's (the table's rows scaled and shifted), in prompts,
in steps over a cache, with hidden states, and through generate's modes."""

import pytest
import torch
from helpers import MODEL_ARCHES, left_padded_batch, load_pair

from ortmodule import NotSupportedError, OrtModelForCausalLM

# Every fixture architecture but mobius-onnx's Gemma 4, whose embedding model also makes
# per-layer inputs from the ids (refused below); more of the builder's in the slow run.
ARCHES = [arch for arch in MODEL_ARCHES if arch != "gemma4_mobius"]
MORE = {"lfm2": {"num_layers": 4}, "gemma2": {}, "granite": {}, "gemma": {}, "ernie4_5": {}, "gpt_oss": {}}
QUICK = {*ARCHES, "lfm2", "granite"}


def steered(model, ids: torch.Tensor) -> torch.Tensor:
    """Embeddings of `ids` moved off the table: no token's embedding."""
    with torch.inference_mode():
        table = model.get_input_embeddings()(ids)
    return table * 1.01 + 0.003 * torch.sin(torch.arange(table.numel(), dtype=table.dtype)).view(table.shape)


def reference(hf, **kwargs):
    if hasattr(getattr(hf, "model", None), "rope_deltas"):
        hf.model.rope_deltas = None  # Qwen2.5-VL keeps an earlier call's
    with torch.inference_mode():
        return hf(**kwargs)


def close(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor | None = None) -> bool:
    if real is not None:
        a, b = a[real], b[real]
    return (a.float() - b).abs().max().item() < 1e-4 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("arch", [arch if arch in QUICK else pytest.param(arch, marks=pytest.mark.slow)
                                  for arch in [*ARCHES, *MORE]])
def test_inputs_embeds_equal_transformers(build, arch):
    """A left-padded prompt of embeddings with a cache, a step of token ids, then a step of two
    embeddings for both rows: the logits and the hidden states as transformers'."""
    model, hf = load_pair(build(arch, **MORE.get(arch, {})))
    ids, mask = left_padded_batch([8, 5], vocab=500, seed=2)
    out = model(inputs_embeds=steered(model, ids), attention_mask=mask, use_cache=True, output_hidden_states=True)
    ref = reference(hf, inputs_embeds=steered(hf, ids), attention_mask=mask, use_cache=True,
                    output_hidden_states=True)
    real = mask.bool()
    assert close(out.logits, ref.logits, real)
    assert all(close(a, b, real) for a, b in zip(out.hidden_states, ref.hidden_states))
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    tokens = torch.tensor([[9], [10]])
    out = model(tokens, attention_mask=mask, past_key_values=out.past_key_values)
    with torch.inference_mode():
        ref = hf(tokens, attention_mask=mask, past_key_values=ref.past_key_values)
    assert close(out.logits, ref.logits)
    mask = torch.cat([mask, torch.ones_like(mask[:, :2])], 1)
    tokens = torch.tensor([[11, 12], [13, 14]])
    out = model(inputs_embeds=steered(model, tokens), attention_mask=mask, past_key_values=out.past_key_values)
    with torch.inference_mode():
        ref = hf(inputs_embeds=steered(hf, tokens), attention_mask=mask, past_key_values=ref.past_key_values)
    assert close(out.logits, ref.logits)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int4"])
def test_the_ids_embeddings_give_the_ids_logits(build, precision):
    """`get_input_embeddings()(ids)` as inputs_embeds: exactly the logits of the ids, with the loss
    and kept positions as for ids."""
    model = OrtModelForCausalLM.from_pretrained(build("llama", precision=precision).package_dir)
    ids, mask = left_padded_batch([9, 4], vocab=500, seed=4)
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(ids)
    plain = model(ids, attention_mask=mask, labels=ids)
    out = model(inputs_embeds=embeds, attention_mask=mask, labels=ids)
    real = mask.bool()
    assert torch.equal(out.logits[real], plain.logits[real])
    assert out.loss.item() == plain.loss.item()
    kept = model(inputs_embeds=embeds, attention_mask=mask, logits_to_keep=2).logits
    assert torch.equal(kept, model(ids, attention_mask=mask, logits_to_keep=2).logits)


def test_embeddings_that_require_grad(build):
    """A soft prompt or steering vector being trained (a tensor that requires grad): with gradients on, a
    NotSupportedError naming why (ONNX Runtime refused it with DLPack's BufferError); under no_grad the
    embeddings' values run, as transformers runs them, with the same logits and tokens."""
    from ortmodule import NotSupportedError

    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    ids, mask = left_padded_batch([6, 3], vocab=500, seed=5)
    direction = torch.nn.Parameter(torch.full((model.config.hidden_size,), 0.01))
    with torch.no_grad():
        plain = model(inputs_embeds=model.get_input_embeddings()(ids) + direction.detach(), attention_mask=mask).logits
    steered = model.get_input_embeddings()(ids) + direction
    with pytest.raises(NotSupportedError, match="inputs_embeds require grad .*pass inputs_embeds.detach"):
        model(inputs_embeds=steered, attention_mask=mask)
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=steered, attention_mask=mask).logits, plain)
    tokens = model.generate(inputs_embeds=steered, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, model.generate(inputs_embeds=steered.detach(), attention_mask=mask, max_new_tokens=3,
                                              do_sample=False))


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=True, top_k=20), dict(num_beams=2)])
@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_generate_from_inputs_embeds_equals_transformers(build, arch, mode):
    """transformers' own loop over forward: the new tokens (generate returns only those, as
    transformers does from embeddings) of every mode."""
    model, hf = load_pair(build(arch, **MORE.get(arch, {})))
    ids, mask = left_padded_batch([7, 5], vocab=500, seed=2)
    outputs = []
    for m in (model, hf):
        torch.manual_seed(3)
        outputs.append(m.generate(inputs_embeds=steered(m, ids), attention_mask=mask, max_new_tokens=5,
                                  pad_token_id=0, eos_token_id=None, **mode))
    assert outputs[0].shape == (2, 5)
    assert torch.equal(outputs[0], outputs[1])


def test_an_embedding_model_that_makes_more_than_embeddings_is_refused(build):
    model = OrtModelForCausalLM.from_pretrained(build("gemma4_mobius").package_dir)
    with pytest.raises(NotSupportedError, match=r"inputs_embeds: the package's embedding model also gives "
                                                r"\['per_layer_inputs'\]"):
        model(inputs_embeds=torch.zeros(1, 3, model.package.hidden_size))
    assert model(torch.tensor([[5, 6, 7]])).logits.shape[:2] == (1, 3)


def test_without_the_lm_head_rewrite_a_text_package_says_why(build):
    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir, rewrite_lm_head=False)
    with pytest.raises(NotSupportedError, match=r"inputs_embeds: it needs the LM-head rewrite, which is off"):
        model(inputs_embeds=torch.zeros(1, 3, 64))
    with pytest.raises(NotSupportedError, match=r"output_hidden_states=True: it needs the LM-head rewrite"):
        model(torch.tensor([[5, 6, 7]]), output_hidden_states=True)


def test_generating_from_right_padded_prompts_through_transformers_loop_says_pad_left(build):
    """transformers' loop (from embeddings, beams) gives a right-padded row's new tokens positions that
    are not the row's own (it warns): a ValueError that says to pad on the left."""
    model, _ = load_pair(build("llama"))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    for kwargs in (dict(inputs_embeds=steered(model, ids)), dict(input_ids=ids, num_beams=2)):
        with pytest.raises(ValueError, match="continue a right-padded prompt batch.*padding_side = 'left'"):
            model.generate(attention_mask=mask, max_new_tokens=3, pad_token_id=0, **kwargs)
