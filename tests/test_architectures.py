"""More of the model builder's text architectures, beyond the ones every parity test runs on
(helpers.ARCHES): each against onnxruntime-genai on the same package (the package's own numbers)
and against transformers on the same weights (ortmodule_dev/fixtures.py says what each adds).

Where the builder's package itself differs from transformers (OLMo, ERNIE 4.5 with this builder;
Phi-2 and Nemotron by their activations' approximations), ortmodule gives the package's numbers:
onnxruntime-genai's, and no farther from transformers than they are."""

import numpy as np
import pytest
import torch
from helpers import grouped_rows, left_padded_batch, load_pair, right_padded_batch

og = pytest.importorskip("onnxruntime_genai")

# Per architecture, the fixture's fields beyond the defaults (ONNX Runtime's rotary cache wants half
# of the rotated width a multiple of 8: partial rotary needs wider heads than the default 16).
WIDE = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
MORE_ARCHES = {"gemma2": {}, "granite": {}, "gpt_oss": {}, "phi": WIDE, "nemotron": WIDE, "olmo": {},
               "ernie4_5": {}, "gemma": {}, "hunyuan": {}, "lfm2": {}, "lfm2_moe": {}}
# Whose packages give transformers' numbers (to fp32's rounding) on the same weights.
EXACT = {"gemma2", "granite", "gpt_oss", "gemma", "hunyuan", "lfm2", "lfm2_moe", "ernie4_5"}


def genai_logits(model, tokens: list[int]) -> torch.Tensor:
    """onnxruntime-genai's logits (`model`: its `og.Model`) at every position of one row, the tokens
    appended one at a time."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(tokens) + 64)  # room for a sliding window
    generator = og.Generator(model, params)
    rows = []
    for token in tokens:
        generator.append_tokens(np.array([[token]], dtype=np.int32))
        rows.append(torch.from_numpy(np.asarray(generator.get_logits(), dtype=np.float32).reshape(-1)))
    return torch.stack(rows)


@pytest.fixture(scope="module", params=list(MORE_ARCHES))
def pair(request, build):
    return request.param, build(request.param, **MORE_ARCHES[request.param])


def test_logits_are_the_packages_own(pair):
    """A right-padded batch's logits at every real position equal onnxruntime-genai's on the same
    package (row by row, decode steps), and are as close to transformers' as onnxruntime-genai's are;
    for the exact packages, transformers' to fp32's rounding."""
    arch, fixture = pair
    model, hf = load_pair(fixture)
    ids, mask = right_padded_batch([14, 9, 5], seed=17)
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    reference = og.Model(str(fixture.package_dir))
    for row in range(ids.shape[0]):
        real = int(mask[row].sum())
        genai = genai_logits(reference, ids[row, :real].tolist())
        scale = max(1.0, genai.abs().max().item())
        assert (ours[row, :real] - genai).abs().max().item() < 1e-4 * scale
        package_distance = (genai - theirs[row, :real]).abs().max().item()
        assert (ours[row, :real] - theirs[row, :real]).abs().max().item() <= package_distance + 1e-4 * scale
        if arch in EXACT:
            assert package_distance < 1e-4 * scale


def test_greedy_generation_is_transformers(pair):
    """Greedy `generate` on a left-padded batch gives transformers' tokens where the package gives
    transformers' numbers; elsewhere each row's tokens are the ones onnxruntime-genai's Generator
    picks on the same package."""
    arch, fixture = pair
    model, hf = load_pair(fixture)
    ids, mask = left_padded_batch([9, 5], seed=19)
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=2)
    if arch in EXACT:
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=2)
        assert torch.equal(ours, expected)
        return
    genai = og.Model(str(fixture.package_dir))
    for row in range(ids.shape[0]):
        prompt = ids[row, ids.shape[1] - int(mask[row].sum()):].tolist()
        params = og.GeneratorParams(genai)
        params.set_search_options(max_length=len(prompt) + 10, do_sample=False)
        generator = og.Generator(genai, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        assert ours[row, ids.shape[1]:].tolist() == list(generator.get_sequence(0))[len(prompt):]


def test_scoring_graphs_give_the_package_graphs_answers(pair):
    """The prefill graph (`prefill_attention="onnx"`) and the extend graph (shared contexts, as
    lm-eval's sharing runs them) give the package graph's logits and loglikelihoods: partial rotary
    (Phi-2, Nemotron), interleaved rotary (ERNIE 4.5), Granite's multipliers, Gemma 2's soft-capping
    and sliding windows (the extend graph's mask layout only: no prefill graph). gpt-oss's attention
    sinks keep the package's graph for both. LFM2's convolutions read their rows' past states in
    both (zeros in the prefill graph)."""
    from ortmodule import OrtModelForCausalLM, scoring
    from ortmodule.inputs import pad_right

    arch, fixture = pair
    package = load_pair(fixture)[0]
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_attention="onnx")
    assert (model.decoder.causal is None) == (arch in ("gemma2", "gpt_oss"))
    assert (model.decoder.extender() is None) == (arch == "gpt_oss")
    if arch == "gpt_oss":
        return
    ids, mask = right_padded_batch([14, 9, 5], seed=23)
    with torch.no_grad():
        expected, got = package(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected)[mask.bool()].abs().max().item() < 1e-4 * scale
    rows, groups, starts, targets = grouped_rows((12, 7), (3, 1, 6), seed=29)  # past Gemma 2's 8-token window
    padded_ids, padded_mask = pad_right(rows)
    padded = scoring.answers(scoring.loglikelihood_totals(package, padded_ids, padded_mask, starts, targets))
    shared = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets))
    for (lp, greedy), (ref_lp, ref_greedy) in zip(shared, padded, strict=True):
        assert abs(lp - ref_lp) < 1e-4 * scale and greedy == ref_greedy


def test_a_state_ortmodule_does_not_keep_is_refused_by_name(build, tmp_path):
    """A decoder whose genai_config names a state ortmodule's cache does not hold (here a quantized KV
    cache's scales: the LFM2 package's config with the key added) is a PackageError that names the state
    and the layers, not a missing input deep inside ONNX Runtime."""
    import json
    import shutil

    from ortmodule import OrtModelForCausalLM, PackageError

    package = tmp_path / "package"
    shutil.copytree(build("lfm2").package_dir, package)
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"]["past_key_scale_names"] = "past_key_values.%d.key_scale"
    (package / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match=r"past_key_scale_names: the decoder keeps a quantized KV cache .*"
                                           r"layer_types: conv at layers 0, 1, 3\. ortmodule does not run"):
        OrtModelForCausalLM.from_pretrained(package)
