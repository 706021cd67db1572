"""A seeded fuzz test of the input checks: random shapes, dtypes, masks, ids and options through
`forward`, `generate` and `score`. Every case is made valid or broken on purpose; a valid one must
equal transformers on the same weights, a broken one must raise ValueError or TypeError (never an
ONNX Runtime error, never another exception, never a silent answer)."""

import random

import pytest
import torch
from helpers import load_pair

import ortmodule

VOCAB, CONTEXT, HIDDEN = 512, 256, 64
BROKEN_FORWARD = ["id_negative", "id_vocab", "id_huge", "float_ids", "bool_ids", "one_d", "three_d", "empty",
                  "mask_two", "mask_gap", "mask_zero_row", "mask_shape", "mask_list", "too_long", "cont_negative",
                  "cont_string", "cont_float", "keep_empty", "keep_out_of_range", "not_a_tensor", "embeds_int",
                  "embeds_width", "embeds_two_d", "embeds_and_ids", "embeds_too_long", "embeds_mask_gap"]
BROKEN_GENERATE = ["max_new_float", "max_new_zero", "top_p", "eos_negative", "pad_huge", "unknown_option",
                   "temperature_zero", "too_long"]
BROKEN_SCORE = ["label_vocab", "label_bool", "labels_empty", "item_empty", "items_empty", "id_huge", "float_id",
                "mixed_items", "too_long"]


def random_batch(rng: random.Random):
    batch, length = rng.randint(1, 3), rng.randint(1, 40)
    ids = torch.tensor([[rng.randrange(VOCAB) for _ in range(length)] for _ in range(batch)])
    layout = rng.choice(["none", "right", "left"])
    if layout == "none":
        return ids, None
    lengths = [rng.randint(1, length) for _ in range(batch)]
    mask = torch.zeros(batch, length, dtype=torch.int64)
    for row, n in enumerate(lengths):
        if layout == "right":
            mask[row, :n] = 1
        else:
            mask[row, length - n:] = 1
    return ids, mask


def broken_embeds(rng, ids, mask, kind):
    """(args, kwargs) for model(...) with `inputs_embeds` and one thing wrong."""
    embeds, kwargs = torch.randn(*ids.shape, HIDDEN), {"attention_mask": mask}
    if kind == "embeds_int":
        embeds = embeds.long()
    elif kind == "embeds_width":
        embeds = embeds[..., : rng.randint(1, HIDDEN - 1)]
    elif kind == "embeds_two_d":
        embeds, kwargs["attention_mask"] = embeds[0], None
    elif kind == "embeds_and_ids":
        return ids, {**kwargs, "inputs_embeds": embeds}
    elif kind == "embeds_too_long":
        embeds, kwargs["attention_mask"] = torch.randn(1, CONTEXT + rng.randint(1, 50), HIDDEN), None
    elif kind == "embeds_mask_gap":
        mask = torch.ones(ids.shape[0], max(ids.shape[1], 3), dtype=torch.int64)
        embeds = torch.randn(*mask.shape, HIDDEN)
        mask[0, 1] = 0
        kwargs["attention_mask"] = mask
    return None, {**kwargs, "inputs_embeds": embeds}


def broken_forward(rng, ids, mask, kind):
    """(args, kwargs) for model(...) with one thing wrong."""
    if kind.startswith("embeds"):
        return broken_embeds(rng, ids, mask, kind)
    kwargs = {"attention_mask": mask}
    if kind == "id_negative":
        ids = ids.clone()
        ids[0, -1] = -1
    elif kind == "id_vocab":
        ids = ids.clone()
        ids[-1, 0] = VOCAB
    elif kind == "id_huge":
        ids = ids.clone()
        ids[0, 0] = 2**40
    elif kind == "float_ids":
        ids = ids.float()
    elif kind == "bool_ids":
        ids = ids > 100
    elif kind == "one_d":
        ids, kwargs["attention_mask"] = ids[0], None
    elif kind == "three_d":
        ids, kwargs["attention_mask"] = ids[None], None
    elif kind == "empty":
        ids, kwargs["attention_mask"] = ids[:, :0], None
    elif kind == "mask_two":
        kwargs["attention_mask"] = torch.full_like(ids, 2)
    elif kind == "mask_gap":
        mask = torch.ones(ids.shape[0], max(ids.shape[1], 3), dtype=torch.int64)
        ids = torch.randint(0, VOCAB, mask.shape)
        mask[0, 1] = 0
        kwargs["attention_mask"] = mask
    elif kind == "mask_zero_row":
        mask = torch.ones_like(ids)
        mask[-1] = 0
        kwargs["attention_mask"] = mask
    elif kind == "mask_shape":
        kwargs["attention_mask"] = torch.ones(ids.shape[0], ids.shape[1] + 1, dtype=torch.int64)
    elif kind == "mask_list":
        kwargs["attention_mask"] = torch.ones_like(ids).tolist()
    elif kind == "too_long":
        ids, kwargs["attention_mask"] = torch.randint(0, VOCAB, (1, CONTEXT + rng.randint(1, 50))), None
    elif kind == "cont_negative":
        kwargs["cont_len"] = -rng.randint(1, 5)
    elif kind == "cont_string":
        kwargs["cont_len"] = "3"
    elif kind == "cont_float":
        kwargs["cont_len"] = 1.5
    elif kind == "keep_empty":
        kwargs["logits_to_keep"] = torch.tensor([], dtype=torch.int64)
    elif kind == "keep_out_of_range":
        kwargs["logits_to_keep"] = torch.tensor([ids.shape[1]])
    elif kind == "not_a_tensor":
        ids = ids.tolist()
    return ids, kwargs


@pytest.fixture(scope="module", params=["llama", "lfm2", "qwen3_5", "gemma3"])
def fixture(request, build):
    """The Llama fixture, LFM2's and Qwen3.5's (hybrids: convolution and recurrent states beside the KV,
    states.py) and Gemma 3's
    (sliding-window layers, an 8-token window: most fuzzed rows run past it)."""
    return build(request.param)


def reference_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(ids, attention_mask=mask).logits


def test_forward_fuzz(fixture):
    model, hf = load_pair(fixture)
    rng = random.Random(1234)
    broken = valid = 0
    for case in range(200):
        ids, mask = random_batch(rng)
        if rng.random() < 0.5:
            kind = rng.choice(BROKEN_FORWARD)
            args, kwargs = broken_forward(rng, ids, mask, kind)
            with pytest.raises((ValueError, TypeError)):
                model(args, **kwargs)
            broken += 1
            continue
        if rng.random() < 0.3:
            ids = ids.to(rng.choice([torch.int32, torch.int16]))
        keep = rng.choice([None, 0, rng.randint(1, ids.shape[1])])
        mode = rng.choice(["ids", "ids", "embeds", "hidden"])  # embeddings off the table; hidden states too
        if mode == "embeds":
            with torch.no_grad():
                embeds = hf.get_input_embeddings()(ids.long()) * (1 + rng.random() / 10)
                expected = hf(inputs_embeds=embeds, attention_mask=mask).logits
            logits = model(inputs_embeds=embeds, attention_mask=mask, cont_len=keep).logits
        else:
            out = model(ids, attention_mask=mask, cont_len=keep, output_hidden_states=mode == "hidden")
            logits, expected = out.logits, reference_logits(hf, ids.long(), mask)
        if mode == "hidden":
            with torch.no_grad():
                states = hf(ids.long(), attention_mask=mask, output_hidden_states=True).hidden_states
            every = (mask if mask is not None else torch.ones_like(ids)).bool()
            for ours, theirs in zip(out.hidden_states, states, strict=True):
                assert (ours - theirs)[every].abs().max().item() < 1e-4 * max(1.0, theirs.abs().max().item()), case
        if keep:
            expected = expected[:, -keep:]
            real = (mask if mask is not None else torch.ones_like(ids))[:, -keep:].bool()
        else:
            real = (mask if mask is not None else torch.ones_like(ids)).bool()
        assert logits.shape == expected.shape, f"case {case}"
        if real.any():  # a kept tail may lie wholly in right padding: nothing to compare there
            assert (logits - expected)[real].abs().max().item() < 1e-4, f"case {case}"
        valid += 1
    assert broken > 50 and valid > 50


def test_generate_fuzz(fixture):
    model, hf = load_pair(fixture)
    rng = random.Random(99)
    for case in range(40):
        ids, mask = random_batch(rng)
        if mask is not None:  # generate takes left-padded prompts, as transformers does
            steps = torch.arange(mask.shape[1])
            mask = (steps[None, :] >= mask.shape[1] - mask.sum(1)[:, None]).long()
        options = dict(max_new_tokens=rng.randint(1, 5), do_sample=False, pad_token_id=2)
        if rng.random() < 0.5:
            kind = rng.choice(BROKEN_GENERATE)
            options.update({"max_new_float": dict(max_new_tokens=2.5), "max_new_zero": dict(max_new_tokens=0),
                            "top_p": dict(do_sample=True, top_p=1.5), "eos_negative": dict(eos_token_id=-3),
                            "pad_huge": dict(pad_token_id=10**6), "unknown_option": dict(frobnicate=True),
                            "temperature_zero": dict(do_sample=True, temperature=0.0),
                            "too_long": dict(max_new_tokens=CONTEXT)}[kind])
            with pytest.raises((ValueError, TypeError)):
                model.generate(ids, attention_mask=mask, **options)
            continue
        tokens = model.generate(ids, attention_mask=mask, eos_token_id=None, **options)
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=mask, eos_token_id=None, **options)
        assert torch.equal(tokens, expected), f"case {case}"


def test_score_fuzz(fixture):
    model, hf = load_pair(fixture)
    rng = random.Random(7)
    for case in range(60):
        query = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
        items = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 5))]
        labels = rng.sample(range(VOCAB), rng.randint(1, 4))
        if rng.random() < 0.5:
            kind = rng.choice(BROKEN_SCORE)
            if kind == "label_vocab":
                labels = [*labels, VOCAB + rng.randint(0, 100)]
            elif kind == "label_bool":
                labels = [True]
            elif kind == "labels_empty":
                labels = []
            elif kind == "item_empty":
                query, items = [], [[]]
            elif kind == "items_empty":
                items = []
            elif kind == "id_huge":
                items[-1] = [*items[-1], 2**70]
            elif kind == "float_id":
                items[0] = [float(items[0][0])]
            elif kind == "mixed_items":
                items = [*items, "text"]
            elif kind == "too_long":
                query = [5] * CONTEXT
            if kind == "items_empty":  # no items get no scores, as SGLang answers them
                assert ortmodule.score(model, None, query, items, labels, apply_softmax=rng.random() < 0.5) == []
                continue
            with pytest.raises((ValueError, TypeError)):
                ortmodule.score(model, None, query, items, labels, apply_softmax=rng.random() < 0.5)
            continue
        softmax = rng.random() < 0.5
        scores = torch.tensor(ortmodule.score(model, None, query, items, labels, apply_softmax=softmax),
                              dtype=torch.float64)
        for i, item in enumerate(items):
            with torch.no_grad():
                last = hf(torch.tensor([query + item])).logits[0, -1].double()
            picked = torch.log_softmax(last, -1)[labels]
            expected = torch.softmax(picked, -1) if softmax else picked.exp()
            assert (scores[i] - expected).abs().max().item() < 1e-5, f"case {case}, item {i}"
