"""A seeded fuzz test of `generate` and of stepping a cache, against transformers on the same weights.

Drawn per case: an architecture (sliding windows, convolution states, soft-capping, experts, mixed
head sizes), a left-padded batch, and a generation setting (greedy, sampling under one seed, beams
with returned sequences and length penalties, beam sampling) with logits processors, end-of-sequence
ids (often ones the rows reach, so that rows end at different steps and, on a CPU, leave the decode
steps), scores and logits returned, or no cache; or a cache stepped on: `generate` continued from the
cache it returned with more text, a batch stepped by `forward` several tokens at a time, prompt
lookup and assisted decoding. The tokens must be transformers' and the scores and logits within
1e-3; a sampled token may differ only where a top-k or top-p filter met a tie within float rounding
(`assert_a_filters_tie`), and a sampled beam only where two candidates did (`assert_beam_samples_tie`).
Token ids stay below 500: Gemma 4's media placeholder ids (505-511 in its fixture) run as the package
embeds them, not as transformers does without media (docs/usage.md), so its generations suppress them.
`GENERATE_FUZZ_SEEDS=3000` runs 3,000 cases of each test (about 3 minutes on 2 cores).
"""

import itertools
import random
import warnings
from unittest import mock

import pytest
import torch
from helpers import fuzz_seeds, load_pair

ARCHES = ["llama", "llama", "qwen3", "gemma3", "gemma2", "lfm2", "phi3", "gpt_oss", "granite", "gemma4", "qwen3_5"]
SEEDS = fuzz_seeds("GENERATE_FUZZ_SEEDS", 48)
HYBRID = {"lfm2", "qwen3_5"}  # layer states (crops run tokens again from the states kept: cache.py)
# transformers 5.25's Qwen3.5 goes wrong in its own prompt lookup and assisted decoding (its linear attention's
# states after a crop: seed 1051285, the lookup's tokens leave its plain greedy ones, which ortmodule's equal), so
# there the reference is its plain greedy generation
PLAIN_REFERENCE = {"qwen3_5"}
TEXT = 500  # ids below every fixture's media placeholders


def never_media(arch: str) -> dict:
    return {"suppress_tokens": list(range(TEXT, 512))} if arch.startswith("gemma4") else {}


def left_padded(rng: random.Random, batch: int, longest: int):
    lengths = [rng.randint(1, longest) for _ in range(batch)]
    width = max(lengths)
    ids = torch.tensor([[2] * (width - n) + [rng.randrange(3, TEXT) for _ in range(n)] for n in lengths])
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    return ids, mask


def drawn_options(rng: random.Random) -> dict:
    mode = rng.choice(["greedy", "greedy", "sample", "beams", "beam_sample"])
    options = dict(max_new_tokens=rng.randint(1, 16), pad_token_id=2, do_sample=mode in ("sample", "beam_sample"))
    if mode == "sample":
        options.update(top_k=rng.choice([0, 5, 50]), temperature=rng.choice([0.5, 1.0, 1.5]))
        if rng.random() < 0.5:
            options["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            options["num_return_sequences"] = rng.choice([2, 3])
    elif mode == "beams":
        beams = rng.choice([2, 3, 4])
        options.update(num_beams=beams, num_return_sequences=rng.randint(1, beams),
                       length_penalty=rng.choice([1.0, 0.5, 2.0]), early_stopping=rng.choice([True, False, "never"]))
    elif mode == "beam_sample":
        options.update(num_beams=2, top_k=10)
    if rng.random() < 0.3:
        options["repetition_penalty"] = rng.choice([1.2, 0.8])
    if rng.random() < 0.2:
        options["no_repeat_ngram_size"] = rng.choice([2, 3])
    if rng.random() < 0.2:
        options["bad_words_ids"] = [[rng.randrange(512)] for _ in range(3)]
    options["eos_token_id"] = None
    if rng.random() < 0.3:
        options["eos_token_id"] = rng.choice([rng.randrange(512), [rng.randrange(512), rng.randrange(512)]])
        if rng.random() < 0.5:
            options["min_new_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        options.update(output_scores=True, return_dict_in_generate=True, output_logits=rng.random() < 0.5)
    if rng.random() < 0.15:
        options["use_cache"] = False
    return options


def assert_close(name: str, ours, theirs, what: str, filters: bool = False):
    """Steps' scores or logits within 1e-3 of transformers', -inf at the same tokens; where a top-k or top-p
    filter ran (`filters`), a row may keep other tokens at its cut where they tie within float rounding."""
    assert (ours is None) == (theirs is None), f"{name}: {what}"
    if ours is None:
        return
    ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
    assert len(ours) == len(theirs), f"{name}: {len(ours)} against {len(theirs)} steps; {what}"
    for a, b in zip(ours, theirs):
        finite, kept = torch.isfinite(b), torch.isfinite(a)
        if not torch.equal(kept, finite):
            assert filters, f"{name}: other infinities; {what}"
            assert_a_cut_ties(a, b, f"{name}: {what}")
        both = kept & finite
        if both.any():
            assert (a[both] - b[both]).abs().max().item() < 1e-3, f"{name} differ; {what}"


def assert_a_cut_ties(ours: torch.Tensor, theirs: torch.Tensor, what: str):
    """A step's filtered scores `[rows, V]` that keep other tokens than transformers' in some rows: right only
    as a tie at the filter's cut: every token that one side keeps and the other does not scores within 1e-5
    of the other side's cut (the lowest score it keeps). Seed 807805: Gemma 3, top-p 0.5, the 18th and 19th
    tokens' logits 4e-7 apart, ranked the other way, the drawn tokens the same; seed 958071: Qwen3's beam
    sampling, top-k 10, the 10th and 11th scores equal in ours (top-k keeps both) and one float32 step apart
    in transformers' (it keeps one)."""
    kept, finite = torch.isfinite(ours), torch.isfinite(theirs)
    for row in (kept != finite).any(-1).nonzero().flatten().tolist():
        for one, other, only in ((ours, theirs, kept & ~finite), (theirs, ours, finite & ~kept)):
            if only[row].any():
                cut = other[row][torch.isfinite(other[row])].min()
                gap = (one[row][only[row]] - cut).abs().max().item()
                assert gap < 1e-5, f"other infinities, not a tie at the cut ({gap:.2g} from it); {what}"


@pytest.mark.parametrize("seed", SEEDS)
def test_generate_options_fuzz(build, seed):
    rng = random.Random(5000 + seed)
    arch = rng.choice(ARCHES)
    model, hf = load_pair(build(arch, **({"num_layers": 4} if arch in HYBRID else {})))
    ids, mask = left_padded(rng, rng.randint(1, 4), rng.choice([5, 20, 40]))
    options = {**drawn_options(rng), **never_media(arch)}
    if options["eos_token_id"] is not None and rng.random() < 0.6:  # ends the rows reach, at different steps
        options["eos_token_id"] = ends_reached(hf, ids, mask, options, rng)
    what = f"seed {5000 + seed}: {arch}, prompts of {mask.sum(1).tolist()} tokens, {options}"
    torch.manual_seed(seed)
    ours = model.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(seed)
    # transformers 5.25's hybrid cache goes wrong in beam search: seed 1050780 (LFM2, 3 beams, one prompt's beams
    # ended), a beam's logits 2.9 off at one step in its cached run, where its run without a cache gives
    # ortmodule's (within 3e-6); the reference then runs without one
    reference = {**options, "use_cache": False} if arch in HYBRID and options.get("num_beams") else options
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **reference)
    sequences = [out if isinstance(out, torch.Tensor) else out.sequences for out in (ours, theirs)]
    if not torch.equal(*sequences):
        if options.get("num_beams"):
            tie = assert_beam_samples_tie if options["do_sample"] else assert_beam_scores_tie
            tie(model, hf, ids, mask, options, seed, what)
        elif not options["do_sample"]:  # seed 1036031: Gemma 2's two best logits 7e-7 apart
            assert_greedy_tie(hf, *sequences, ids.shape[1] - mask.sum(1), what)
        else:
            assert_a_filters_tie(model, hf, ids, mask, options, seed, what)
        return
    if isinstance(theirs, torch.Tensor):
        return
    filters = bool(options.get("do_sample")) and bool(options.get("top_k") or options.get("top_p"))
    for name in ("scores", "logits", "sequences_scores"):
        assert_close(name, getattr(ours, name, None), getattr(theirs, name, None), what, filters)


def ends_reached(hf, ids, mask, options: dict, rng: random.Random) -> list[int]:
    """1-2 end-of-sequence ids drawn from what the rows generate greedily without one, so that rows
    end, at different steps (on a CPU the ended rows then leave the decode steps: generation.py)."""
    free = {k: v for k, v in options.items() if k not in ("eos_token_id", "min_new_tokens")}
    free.update(do_sample=False, num_beams=1, num_return_sequences=1, return_dict_in_generate=False,
                output_scores=False, output_logits=False)
    with torch.no_grad():
        new = hf.generate(ids, attention_mask=mask, **free)[:, ids.shape[1]:]
    reached = sorted(set(new.flatten().tolist()) - {2}) or [3]
    return rng.sample(reached, k=min(len(reached), rng.randint(1, 2)))


def assert_a_filters_tie(model, hf, ids, mask, options: dict, seed: int, what: str):
    """Sampled tokens that differ from transformers' are right only where a top-k or top-p filter met
    a tie within float rounding: the step's two sets of kept tokens differ (seed 7976: LFM2's 5th and
    6th logits 1.9e-6 apart, ours 1.2e-6 from transformers', in the other order), all before that
    step equal. Run again with each step's scores to see that."""
    assert options["do_sample"] and not options.get("num_beams") and (options.get("top_k") or options.get("top_p")), \
        what
    shown = {**options, "output_scores": True, "return_dict_in_generate": True}
    torch.manual_seed(seed)
    ours = model.generate(ids, attention_mask=mask, **shown)
    torch.manual_seed(seed)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **shown)
    differ = (ours.sequences != theirs.sequences).any(0).nonzero()
    step = differ[0].item() - ids.shape[1]
    for earlier in range(step):
        assert torch.equal(torch.isfinite(ours.scores[earlier]), torch.isfinite(theirs.scores[earlier])), what
    row = (ours.sequences[:, ids.shape[1] + step] != theirs.sequences[:, ids.shape[1] + step]).nonzero()[0].item()
    kept = torch.isfinite(ours.scores[step][row]), torch.isfinite(theirs.scores[step][row])
    assert not torch.equal(*kept), f"tokens differ at new token {step} of row {row} with the same kept set; {what}"


def assert_beam_scores_tie(model, hf, ids, mask, options: dict, seed: int, what: str):
    """Beam search (greedy) keeps other beams than transformers' only where two candidates score within float
    rounding of each other: at the end (seed 1007033: Llama, a row's third beam -8.166255 in ours and another of
    -8.166254 in transformers', kept in the other order: every returned sequence's score within 1e-5 of
    transformers' at its place), or at a step before, where the beams kept then lead to other ends (seed
    1013096: Llama, the 4th and 5th candidates of a row's 4th step both -16.677132, kept the other way, its
    returned beams then 0.044 apart): transformers' own search, run again, meets candidates within 1e-5 of each
    other at the edge of the beams it keeps in a row whose returned sequences differ."""
    assert not options["do_sample"], what
    shown = {**options, "output_scores": True, "return_dict_in_generate": True}
    ours = model.generate(ids, attention_mask=mask, **shown)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, **shown)
    gap = (ours.sequences_scores - theirs.sequences_scores).abs().max().item()
    if gap < 1e-5:
        return
    returned = options.get("num_return_sequences") or 1
    rows = {i // returned for i in (ours.sequences != theirs.sequences).any(1).nonzero().flatten().tolist()}
    edges = beam_edges(hf, ids, mask, options)
    assert any(edges[row] < 1e-5 for row in rows), f"other beams, not a tie ({gap:.2g} apart, the search's " \
        f"closest edge {min(edges[row] for row in rows):.2g}); {what}"


def beam_edges(hf, ids, mask, options: dict) -> list[float]:
    """transformers' beam search run again, each row's smallest gap over the steps between the candidates
    (a beam's score so far and its next token's, processed) at the edge of the beams it keeps: the `num_beams`-th
    and the next, among all candidates (those that end the row too) and among those that go on."""
    from transformers import LogitsProcessor, LogitsProcessorList

    beams, eos = options["num_beams"], options.get("eos_token_id")
    ends = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    so_far: dict[tuple, float] = {}  # each sequence's score so far
    after: dict[tuple, torch.Tensor] = {}  # each sequence's next tokens' processed log-probabilities
    edges = [float("inf")] * ids.shape[0]

    class Edges(LogitsProcessor):  # the last processor: it sees the scores the search ranks
        def __call__(self, input_ids, scores):
            for row in range(ids.shape[0]):
                found = {}
                for i in range(row * beams, (row + 1) * beams):
                    key = tuple(input_ids[i].tolist())
                    if key not in so_far:
                        so_far[key] = so_far[key[:-1]] + after[key[:-1]][key[-1]].item() if key[:-1] in after else 0.0
                    after[key] = scores[i].detach().clone()
                    found[key] = so_far[key] + after[key]
                every = torch.stack(list(found.values()))
                going = every.clone()
                going[:, ends] = float("-inf")
                for candidates in (every, going):
                    top = torch.topk(candidates.flatten(), min(beams + 1, candidates.numel())).values
                    if len(top) > beams and torch.isfinite(top[beams]):
                        edges[row] = min(edges[row], (top[beams - 1] - top[beams]).item())
            return scores

    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, **{**options, "logits_processor": LogitsProcessorList([Edges()])})
    return edges


def sampling_draws(generate, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`generate()` under `seed`, and every `torch.multinomial` it called: (probabilities, draws) each."""
    draws, real = [], torch.multinomial

    def recorded(probs, num_samples, *args, **kwargs):
        drawn = real(probs, num_samples, *args, **kwargs)
        draws.append((probs.detach().clone(), drawn.clone()))
        return drawn

    with mock.patch.object(torch, "multinomial", recorded):
        torch.manual_seed(seed)
        generate()
    return draws


def assert_beam_samples_tie(model, hf, ids, mask, options: dict, seed: int, what: str):
    """Beam sampling draws candidates for every row's beams, then keeps the highest scored: where two of
    them are within float rounding of each other, ours and transformers' may keep different beams
    (seed 207532: Granite, two drawn candidates 2e-7 apart in transformers' probabilities, equal in
    ours), and their beams and tokens part from that step on. Run again with every draw recorded: the
    draws equal and their probabilities within 1e-5 up to the step where they part; there, a draw
    that differs from the same probabilities (a near-tie of the draw itself), or probabilities that differ only
    at top_k's edge (`top_k_edge_tie`), or at the step before, two drawn candidates of a row within 1e-5 of each
    other."""
    assert options["do_sample"], what
    with torch.no_grad():
        ours = sampling_draws(lambda: model.generate(ids, attention_mask=mask, **options), seed)
        theirs = sampling_draws(lambda: hf.generate(ids, attention_mask=mask, **options), seed)
    parted = next((step for step, ((p, d), (q, e)) in enumerate(zip(ours, theirs))
                   if not torch.equal(d, e) or (p - q).abs().max().item() > 1e-5), None)
    assert parted is not None, f"the tokens differ, every draw equal; {what}"
    if (ours[parted][0] - theirs[parted][0]).abs().max().item() <= 1e-5:
        return  # the same probabilities, another draw
    if top_k_edge_tie(ours[parted][0], theirs[parted][0], hf.config.vocab_size):
        return  # two tokens of one beam as likely as each other at top_k's edge, each library keeping one
    assert parted > 0, f"the first draw's probabilities differ; {what}"
    probs, drawn = ours[parted - 1]
    assert any(torch.isclose(probs[row, a], probs[row, b], rtol=1e-5, atol=0)
               for row in range(drawn.shape[0]) for a, b in itertools.combinations(drawn[row].tolist(), 2)), \
        f"beams part after draw {parted - 1} without two drawn candidates within rounding; {what}"


def top_k_edge_tie(ours: torch.Tensor, theirs: torch.Tensor, vocab: int) -> bool:
    """Whether two steps' probabilities (rows of beams x vocabulary) differ only where top_k's edge fell between two
    tokens of a beam with the same score (seed 1022548: Phi-3, top_k 10, a beam's 10th and 11th tokens both
    0.0534292): in each row that differs, one token kept by ours alone, one by transformers' alone, in the same beam
    and within 1e-5 of each other."""
    for row in range(ours.shape[0]):
        apart = ((ours[row] - theirs[row]).abs() > 1e-5).nonzero().flatten().tolist()
        if not apart:
            continue
        if len(apart) != 2:
            return False
        a, b = apart if theirs[row, apart[0]] == 0 else apart[::-1]  # a: kept by ours alone
        if theirs[row, a] != 0 or ours[row, b] != 0 or a // vocab != b // vocab or \
                not torch.isclose(ours[row, a], theirs[row, b], rtol=1e-5, atol=0):
            return False
    return True


def continued(model, rng: random.Random, ids, mask, options: dict):
    """`generate`, then `generate` again from the cache it returned with 0-4 more tokens of text."""
    first = model.generate(ids, attention_mask=mask, max_new_tokens=rng.randint(1, 8), return_dict_in_generate=True,
                           **options)
    more = torch.tensor([[rng.randrange(3, TEXT) for _ in range(rng.randint(0, 4))]] * ids.shape[0], dtype=ids.dtype)
    text = torch.cat([first.sequences, more], 1)
    mask = torch.cat([mask, torch.ones(text.shape[0], text.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    return model.generate(text, attention_mask=mask, past_key_values=first.past_key_values,
                          max_new_tokens=rng.randint(1, 8), **options)


def stepped(model, rng: random.Random, ids, mask):
    """`forward` over the prompts, then 1-4 steps of 1-4 tokens over the cache: every step's logits."""
    out = model(ids, attention_mask=mask, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(rng.randint(1, 4)):
        new = rng.randint(1, 4)
        step = torch.tensor([[rng.randrange(3, TEXT) for _ in range(new)]] * ids.shape[0], dtype=ids.dtype)
        mask = torch.cat([mask, torch.ones(ids.shape[0], new, dtype=mask.dtype)], 1)
        out = model(step, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    return logits


@pytest.mark.parametrize("seed", SEEDS)
def test_cache_continuation_fuzz(build, seed):
    rng = random.Random(6000 + seed)
    arch = rng.choice(ARCHES)
    model, hf = load_pair(build(arch, **({"num_layers": 4} if arch in HYBRID else {})))
    kinds = ["continued", "stepped", "lookup", "assistant"]
    kind = rng.choice(kinds)
    ids, mask = left_padded(rng, 1 if kind in ("lookup", "assistant") else rng.randint(1, 3), 30)
    what = f"seed {6000 + seed}: {arch}, {kind}, prompts of {mask.sum(1).tolist()} tokens"
    options = dict(do_sample=False, pad_token_id=2, eos_token_id=None, **never_media(arch))
    state = rng.getstate()

    def run(m):
        rng.setstate(state)  # the same draws for both models
        with torch.no_grad():
            if kind == "continued":
                return continued(m, rng, ids, mask, options)
            if kind == "stepped":
                return stepped(m, rng, ids, mask)
            extra = dict(prompt_lookup_num_tokens=rng.randint(1, 5)) if kind == "lookup" else dict(assistant_model=m)
            if m is hf and arch in PLAIN_REFERENCE:
                extra = {}  # its greedy tokens are the same
            # the pad token (2) may be drafted: transformers' assistant masks it, ortmodule's counts it (a warning)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "generate got no attention_mask, continues a cache", UserWarning)
                return m.generate(ids, attention_mask=mask, max_new_tokens=rng.randint(1, 15), **options, **extra)

    ours, theirs = run(model), run(hf)
    if kind == "stepped":
        assert_close("logits", tuple(ours), tuple(theirs), what)
    elif not torch.equal(ours, theirs):
        assert_greedy_tie(hf, ours, theirs, ids.shape[1] - mask.sum(1), what)


def assert_greedy_tie(hf, ours: torch.Tensor, theirs: torch.Tensor, pads: torch.Tensor, what: str):
    """Greedy sequences that differ, as a tie within float rounding: at each row's first difference the two tokens'
    logits in transformers' forward over the common prefix (run whole, without the padding) are within 1e-5 (seed
    1024391: Phi-3's prompt lookup, two tokens 2.4e-7 apart, each library's batched steps rounding the other way;
    1025860: Qwen3's assisted decoding, the same)."""
    assert ours.shape == theirs.shape, what
    for row in range(ours.shape[0]):
        differ = (ours[row] != theirs[row]).nonzero()
        if len(differ) == 0:
            continue
        at = int(differ[0])
        with torch.no_grad():
            logits = hf(ours[row:row + 1, int(pads[row]):at]).logits[0, -1].float()
        gap = (logits[ours[row, at]] - logits[theirs[row, at]]).abs().item()
        assert gap < 1e-5 * max(1.0, logits.abs().max().item()), \
            f"row {row} differs at {at}, not a tie ({gap:.2g}); {what}"
