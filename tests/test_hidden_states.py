"""`forward(..., output_hidden_states=True)` against transformers' `hidden_states` on the same weights."""

import pytest
import torch
from helpers import MODEL_ARCHES, check_config_default, left_padded_batch, load_pair, steps_beside

from ortmodule import NotSupportedError, OrtModelForCausalLM

# The builder's fixtures and mobius-onnx's (Gemma 4 multimodal, Qwen2.5-VL, Qwen2-VL and Qwen3-VL in its form),
# whose norms are found by their weights' names.
ARCHS = [*MODEL_ARCHES, "qwen2_vl", "qwen3_vl"]
# More of the builder's architectures whose packages give transformers' numbers (tests/test_architectures.py).
MORE = {"lfm2": {"num_layers": 4}, "gemma2": {}, "granite": {}, "gpt_oss": {}, "gemma": {}, "hunyuan": {},
        "lfm2_moe": {"num_layers": 4}, "ernie4_5": {}}
QUICK = {*ARCHS, "lfm2"}


def assert_close(ours: tuple, theirs: tuple, real: torch.Tensor | None = None) -> None:
    """As many hidden states, each within 1e-4 of transformers' (relative to its scale) at the real positions."""
    assert len(ours) == len(theirs)
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, layer
        if real is not None:
            a, b = a[real], b[real]
        scale = max(1.0, b.abs().max().item())
        assert (a.float() - b).abs().max().item() < 1e-4 * scale, f"hidden_states[{layer}]"


@pytest.mark.parametrize("arch", [arch if arch in QUICK else pytest.param(arch, marks=pytest.mark.slow)
                                  for arch in [*ARCHS, *MORE]])
def test_hidden_states_equal_transformers(build, arch):
    """A left-padded batch with a cache, then steps of two tokens (one at a time inside: several new
    tokens over a batch's cache) and of one: every layer's input and the final norm's output at every
    real position, and the logits, as transformers gives them."""
    model, hf = load_pair(build(arch, **MORE.get(arch, {})))
    ids, mask = left_padded_batch([9, 6], vocab=500, seed=3)  # below Gemma 4's media ids (500-511)
    out = model(ids, attention_mask=mask, use_cache=True, output_hidden_states=True)
    with torch.inference_mode():
        ref = hf(ids, attention_mask=mask, use_cache=True, output_hidden_states=True)
    assert len(out.hidden_states) == model.package.num_hidden_layers + 1
    assert_close(out.hidden_states, ref.hidden_states, mask.bool())
    assert_close((out.logits,), (ref.logits,), mask.bool())
    for step, theirs in steps_beside(model, hf, out, ref, mask, output_hidden_states=True):
        assert_close(step.hidden_states, theirs.hidden_states)
        assert_close((step.logits,), (theirs.logits,))


def test_hidden_states_beside_kept_logits_labels_and_tuples(build):
    """transformers' hidden states are every position's whatever `logits_to_keep` keeps; the loss
    and the tuple output (loss, logits, cache, hidden states) come as without them."""
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded_batch([7, 5], vocab=500, seed=5)
    whole = model(ids, attention_mask=mask, output_hidden_states=True)
    kept = model(ids, attention_mask=mask, logits_to_keep=2, output_hidden_states=True)
    assert kept.logits.shape == (2, 2, 512)
    assert torch.equal(kept.logits, whole.logits[:, -2:])
    assert all(torch.equal(a, b) for a, b in zip(kept.hidden_states, whole.hidden_states))
    plain = model(ids, attention_mask=mask, labels=ids)
    loss, logits, states = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True, return_dict=False)
    assert abs(loss.item() - plain.loss.item()) < 1e-5
    assert (logits - plain.logits)[mask.bool()].abs().max().item() < 1e-5
    with torch.inference_mode():
        assert_close(states, hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states, mask.bool())
    check_config_default(model, ids, mask, "output_hidden_states", "hidden_states", 3)
    # a prompt of one row without a mask, and the plain path after it, unchanged
    one = model(ids[:1], output_hidden_states=True)
    assert [tuple(s.shape) for s in one.hidden_states] == [(1, 7, 64)] * 3
    assert torch.equal(model(ids, attention_mask=mask).logits, plain.logits)


def test_half_precision_and_int4_packages_give_their_own_hidden_states(build):
    """An fp16 package (one token a step over a cache) and an int4 one: hidden states in the
    package's precision, the logits of the same call as the package gives them without."""
    for precision in ("fp16", "int4"):
        model = OrtModelForCausalLM.from_pretrained(build("llama", precision=precision).package_dir)
        ids, mask = left_padded_batch([8, 5], vocab=500, seed=6)
        plain = model(ids, attention_mask=mask, use_cache=True)
        out = model(ids, attention_mask=mask, use_cache=True, output_hidden_states=True)
        assert torch.equal(out.logits[mask.bool()], plain.logits[mask.bool()])
        assert {s.dtype for s in out.hidden_states} == {model.decoder.kv_dtype}
        step = model(torch.tensor([[7, 8], [9, 10]]), attention_mask=torch.cat([mask, torch.ones_like(mask[:, :2])], 1),
                     past_key_values=out.past_key_values, output_hidden_states=True)
        assert [tuple(s.shape) for s in step.hidden_states] == [(2, 2, 64)] * 3
        assert torch.isfinite(step.logits).all()


def test_graphs_named_neither_way_are_refused_by_reason(build, tmp_path):
    """A graph whose nodes and norm weights are named as neither exporter names them (the Llama
    fixture's, renamed): `NotSupportedError` with the reason; the same model's logits unchanged."""
    import shutil

    import onnx

    source = build("llama").package_dir
    package = tmp_path / "package"
    shutil.copytree(source, package)
    proto = onnx.load(str(source / "model.onnx"), load_external_data=False)
    renamed = {t.name: f"w{i}" for i, t in enumerate(proto.graph.initializer)}
    for tensor in proto.graph.initializer:
        tensor.name = renamed[tensor.name]
    for i, node in enumerate(proto.graph.node):
        node.name = f"n{i}"
        node.input[:] = [renamed.get(name, name) for name in node.input]
    onnx.save(proto, str(package / "model.onnx"))
    model = OrtModelForCausalLM.from_pretrained(package)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(NotSupportedError, match="output_hidden_states=True: neither the graph's nodes nor its norms' "
                                                "weights are named as the model builder or mobius-onnx names them"):
        model(ids, output_hidden_states=True)
    assert torch.equal(model(ids).logits, OrtModelForCausalLM.from_pretrained(source)(ids).logits)


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=True, top_k=20), dict(num_beams=2)])
def test_generate_returns_each_steps_hidden_states_as_transformers(build, mode):
    """`generate(output_hidden_states=True, return_dict_in_generate=True)` runs transformers' own loop
    over forward: the same sequences, and per step the hidden states of the tokens it ran."""
    model, hf = load_pair(build("llama"))
    ids, mask = left_padded_batch([7, 5], vocab=500, seed=1)
    outputs = []
    for m in (model, hf):
        torch.manual_seed(11)
        outputs.append(m.generate(ids, attention_mask=mask, max_new_tokens=4, output_hidden_states=True,
                                  return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **mode))
    ours, theirs = outputs
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 4
    rows = mask.bool().repeat_interleave(mode.get("num_beams", 1), 0)
    assert_close(ours.hidden_states[0], theirs.hidden_states[0], rows)  # the prompt's, at its real positions
    for step in range(1, 4):
        assert_close(ours.hidden_states[step], theirs.hidden_states[step])
    with pytest.raises(ValueError, match="generator= cannot be combined with .*output_hidden_states"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, output_hidden_states=True,
                       return_dict_in_generate=True, generator=torch.Generator().manual_seed(0))
