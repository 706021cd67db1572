"""A seeded fuzz test of the KV cache as a `transformers.Cache`: random sequences of decode steps (one
token a row, or several in one call) and cache operations (crop, reorder, batch select, repeat), as
generation strategies and libraries string them, applied to ortmodule's cache and to transformers'
`DynamicCache` side by side; after every operation the next step's logits must agree
(tests/helpers.py's `CachePair`), and the lengths too. `CACHE_FUZZ_SEEDS=N` runs more."""

import random
import re

import pytest
import torch
from helpers import CachePair, fuzz_seeds, left_padded_batch, load_pair

# Builder packages (one buffer per layer written in place; Gemma 3's sliding-window layers; LFM2's
# convolution states; Qwen3.5's linear attention) and mobius-onnx's Gemma 4 (attention that concatenates
# past and new entries).
ARCHES = ["llama", "llama", "qwen3", "gemma3", "gemma4_mobius", "lfm2", "qwen3_5"]
# transformers' own sliding-window layers fail the next step after a crop past the window (a
# 15-column cache cropped by 4 on the Gemma 4 fixture: "The size of tensor a (5) must match the size
# of tensor b (8)"), so these draw no crops.
SLIDING = {"gemma3", "gemma4_mobius"}
TEXT_IDS = 505  # ids below the multimodal fixtures' media placeholders (docs/usage.md: those differ by design)
# transformers' hybrid caches (LinearAttentionLayer) have no batch select or repeat: LFM2 and Qwen3.5 draw neither.
# Their crops go wrong silently (transformers 5.24: a crop reaching before an earlier crop's point, the
# states kept only back to it; found here) or fail (5.25's Qwen3.5: an IndexError inside its crop), so a
# hybrid's reference is transformers on the whole sequence so far, run afresh, without a cache of its own.
HYBRID = {"lfm2", "qwen3_5"}
# A hybrid's crop goes back through the states its cache kept and runs tokens again; where it cannot
# (into a padded prompt batch, or past a reorder, select or repeat of the rows) it refuses, named
# (docs/usage.md, "Hybrid models"): then neither cache is cropped.
REFUSED = r"cannot crop a cache with layer states .*(inside a padded prompt batch|cannot be run again)"


@pytest.mark.parametrize("seed", fuzz_seeds("CACHE_FUZZ_SEEDS", 8))
def test_cache_operations_fuzz(build, seed):
    rng = random.Random(seed)
    arch = rng.choice(ARCHES)
    lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 4))]
    ids, mask = left_padded_batch(lengths, vocab=TEXT_IDS, seed=seed)
    pair = CachePair(load_pair(build(arch)), ids, mask, reference_cache=arch not in HYBRID)
    done, sequence = [], ids
    for _ in range(rng.randint(4, 14)):
        rows, columns = pair.mask.shape
        op = rng.choice(["step", "step", "step", "crop", "reorder"] + ([] if arch in HYBRID else ["select", "repeat"]))
        if op == "crop" and columns > 2 and arch not in SLIDING:
            n = rng.randint(1, min(4, columns - 1))
            try:
                pair.caches[0].crop(-n)
            except ValueError as e:
                assert arch in HYBRID and re.search(REFUSED, str(e)), (seed, str(e))
                continue
            if pair.caches[1] is not None:
                pair.caches[1].crop(-n)
            pair.mask, sequence = pair.mask[:, :-n], sequence[:, :-n]
            # a row whose real tokens were all cropped has nothing to attend to: the sequence ends
            if (pair.mask.sum(1) == 0).any():
                break
        elif op == "reorder":
            order = torch.tensor([rng.randrange(rows) for _ in range(rows)])
            pair.each("reorder_cache", order)
            pair.mask, sequence = pair.mask[order], sequence[order]
        elif op == "select" and rows > 1:
            keep = torch.tensor(sorted(rng.sample(range(rows), rng.randint(1, rows - 1))))
            pair.each("batch_select_indices", keep)
            pair.mask, sequence = pair.mask[keep], sequence[keep]
        elif op == "repeat" and rows < 6:
            times = rng.choice([2, 3])
            pair.each("batch_repeat_interleave", times)
            pair.mask, sequence = pair.mask.repeat_interleave(times, 0), sequence.repeat_interleave(times, 0)
        else:
            op = "step"
        done.append(op)
        # a step of one token a row, or now and then of several in one call (assisted decoding's
        # candidates: a crop inside it leaves a hybrid's kept tokens pending, cache.py)
        new = rng.choice([1, 1, 1, 2, 3, 4])
        tokens = torch.tensor([[rng.randrange(4, TEXT_IDS) for _ in range(new)] for _ in range(pair.mask.shape[0])])
        ours, theirs = pair.step(tokens)
        sequence = torch.cat([sequence, tokens], 1)
        if arch in HYBRID:
            positions = (pair.mask.cumsum(1) - 1).masked_fill(pair.mask == 0, 1)
            with torch.inference_mode():
                theirs = pair.models[1](sequence, attention_mask=pair.mask, position_ids=positions).logits[:, -1]
        worst = (ours - theirs).abs().max().item()
        assert worst < 1e-4, f"seed {seed}, {arch}, prompts of {lengths} tokens: off by {worst} after {done}"
        assert all(cache.get_seq_length() == pair.mask.shape[1] for cache in pair.caches if cache is not None), \
            f"seed {seed}, {arch}: lengths after {done}"


def _drawn_step_inputs(rng: random.Random, mask: torch.Tensor, width: int) -> tuple[dict, bool]:
    """A step's keywords as a caller may pass them over a prompt's cache of `mask`'s columns, and whether they
    describe the step (the mask of every column, in any dtype; each row's own positions; the cache's columns),
    or not (a mask one column short, new columns masked, positions or columns shifted by one)."""
    rows, columns = mask.shape
    whole = torch.cat([mask, torch.ones(rows, width, dtype=mask.dtype)], 1)
    given, right = {}, True
    draw = rng.random()
    if draw < 0.45:
        given["attention_mask"] = whole
    elif draw < 0.5:
        given["attention_mask"] = whole.bool()
    elif draw < 0.55:
        given["attention_mask"], right = whole[:, 1:], False
    elif draw < 0.6:
        given["attention_mask"], right = torch.cat([mask, torch.zeros(rows, width, dtype=mask.dtype)], 1), False
    own = (whole.cumsum(1) - 1)[:, -width:]
    draw = rng.random()
    if draw < 0.2:
        given["position_ids"] = own
    elif draw < 0.3:
        given["position_ids"], right = own + 1, False
    draw = rng.random()
    if draw < 0.2:
        given["cache_position"] = torch.arange(columns, columns + width)
    elif draw < 0.25:
        given["cache_position"], right = torch.arange(columns + 1, columns + width + 1), False
    if rng.random() < 0.1:
        given["logits_to_keep"] = 1
    return given, right


@pytest.mark.parametrize("seed", fuzz_seeds("CACHE_FUZZ_SEEDS", 8))
def test_a_steps_inputs_fuzz(build, seed):
    """A step of one to three tokens over a prompt's cache (left- or right-padded rows, the prompt's mask
    given or not where it is all ones), with the step's mask, `position_ids`, `cache_position` and
    `logits_to_keep` drawn as a caller may pass them: those that describe the step give each row's logits
    as transformers gives them on that row alone (its real tokens, then the step's: the truth whatever the
    padding, which transformers' own batch steps miss where a padded prompt was run without positions);
    those that do not are refused, by a ValueError or NotImplementedError naming them, never answered."""
    rng = random.Random(seed)
    model, hf = load_pair(build(rng.choice(ARCHES + ["phi3", "gemma2"])))
    lengths = [rng.randint(1, 8) for _ in range(rng.randint(1, 3))]
    ids, mask = left_padded_batch(lengths, vocab=TEXT_IDS, seed=seed)
    if rng.random() < 0.3:  # right-padded rows
        shifts = [int((row == 0).sum()) for row in mask]
        ids = torch.stack([torch.roll(row, -k) for row, k in zip(ids, shifts)])
        mask = torch.stack([torch.roll(row, -k) for row, k in zip(mask, shifts)])
    prompt = {"attention_mask": mask} if (mask == 0).any() or rng.random() < 0.5 else {}
    past = model(ids, use_cache=True, **prompt).past_key_values
    width = rng.randint(1, 3)
    step = torch.randint(3, TEXT_IDS, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    given, right = _drawn_step_inputs(rng, mask, width)
    if not right:
        with pytest.raises((ValueError, NotImplementedError)):
            model(step, past_key_values=past, **given)
        return
    logits = model(step, past_key_values=past, **given).logits
    with torch.no_grad():
        for row, real in enumerate(mask.bool()):
            alone = hf(torch.cat([ids[row][real], step[row]])[None]).logits[0, -logits.shape[1]:]
            assert (logits[row] - alone).abs().max().item() < 1e-3, (row, given.keys())
