"""Text decoders exported by mobius-onnx (`mobius build --runtime ort-genai`: decoder-only packages of standard
Attention ops), for families the model builder does not export or exports otherwise: SmolLM3's layers without
rotary positions, Apertus' xIELU activation and query/key norms, OLMo 2's norms after attention and MLP
(ortmodule_dev/fixtures.py, MOBIUS_TEXT). Each against transformers on the same weights: logits at every real
position, greedy and sampled `generate`, and the scoring graphs (prefill and extend) against the package's graph.
onnxruntime-genai 0.18 refuses these packages (`Unsupported model_type`), so transformers is the reference."""

import pytest
import torch
from helpers import grouped_rows, left_padded_batch, load_pair, right_padded_batch

from ortmodule_dev.fixtures import MOBIUS_TEXT

pytest.importorskip("mobius")


@pytest.fixture(scope="module", params=sorted(MOBIUS_TEXT))
def pair(request, build):
    return request.param, build(request.param)


def test_logits_and_generation_are_transformers(pair):
    """A right-padded batch's logits at every real position equal transformers' to fp32's rounding; greedy and
    seeded sampled `generate` on a left-padded batch give transformers' tokens."""
    _, fixture = pair
    model, hf = load_pair(fixture)
    ids, mask = right_padded_batch([14, 9, 5], seed=17)
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    scale = max(1.0, theirs.abs().max().item())
    assert (ours - theirs)[mask.bool()].abs().max().item() < 1e-4 * scale
    ids, mask = left_padded_batch([9, 5], seed=19)
    for options in ({"do_sample": False}, {"do_sample": True, "top_k": 20, "temperature": 0.8}):
        got, expected = [], []
        for generated, source in ((got, model), (expected, hf)):
            torch.manual_seed(5)
            generated.append(source.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=2, **options))
        assert torch.equal(got[0], expected[0]), options


def test_loglikelihoods_are_transformers(pair):
    """lm-eval's loglikelihoods (`scoring`'s, rows padded and rows of groups sharing their contexts, as lm-eval's
    multiple-choice requests come) on mobius-onnx's decoder are transformers' log-probabilities of the targets,
    and each answer's greedy flag the same either way. (ortmodule's prefill and extend graphs are made from the
    model builder's GroupQueryAttention decoders; these decoders run their own graph for both.)"""
    from ortmodule import scoring
    from ortmodule.inputs import pad_right

    _, fixture = pair
    model, hf = load_pair(fixture)
    rows, groups, starts, targets = grouped_rows((12, 7), (3, 1, 6), seed=29)
    padded_ids, padded_mask = pad_right(rows)
    padded = scoring.answers(scoring.loglikelihood_totals(model, padded_ids, padded_mask, starts, targets))
    shared = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets))
    with torch.no_grad():
        logits = hf(input_ids=padded_ids, attention_mask=padded_mask).logits.float().log_softmax(-1)
    for k, ((lp, greedy), (ref_lp, ref_greedy)) in enumerate(zip(shared, padded, strict=True)):
        wanted = torch.tensor(targets[k])
        reference = logits[k, starts[k]: starts[k] + len(wanted)]
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy
        assert abs(lp - reference.gather(-1, wanted[:, None]).sum().item()) < 1e-4
        assert greedy == bool((reference.argmax(-1) == wanted).all())
