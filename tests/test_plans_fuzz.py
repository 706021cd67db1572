"""A seeded fuzz test of the plans that measured costs choose: random costs (so that sharing is
taken, refused and mixed in every way the planners allow), random request structures (few-shot
prefixes shared across questions, a question's choices, choices that are prefixes of one another or
equal, rows past `max_length`, prompts that share no token) and random batch settings, through
lm-eval's `loglikelihood` and the score server's call; rolling documents, greedy `generate`
over prompts that begin alike and lm-eval's `generate_until`, with the CPU's chunks and both
extend layouts drawn too (the serving engine's own fuzz: tests/test_engine_fuzz.py). Whatever the
plan, every answer must be transformers' on the same weights, request by request (`truth`:
HFLM's definition of an answer).
`FUZZ_SEEDS=400` runs 5,200 cases (4,000 of them the lanes' fast checks; about 3 minutes on 2 cores,
session 77), and the count grows with it; a run at 2,000 found the extend run's padding positions past
the context (tests/test_score_api.py, `..._inside_the_context`).
Session 42's 500 (a shared prefix of no tokens, under costs where an extend token was cheap) is the
kind of fault this looks for."""

import math
import random

import pytest
import torch
from helpers import fuzz_seeds, load_pair

from ortmodule import OrtModelForCausalLM, costs, extend, load_tokenizer, scoring, sharing

VOCAB = 512  # every fixture's
# A Llama most often; Qwen3 (q/k norms), Gemma 3 (sliding-window layers: the extend graph's window
# bias), LFM2 (convolution states, no extend graph: shared prefixes continue by decode steps) and
# Phi-3 beside it.
ARCHES = ["llama", "llama", "llama", "qwen3", "gemma3", "lfm2", "phi3"]


def random_costs(rng: random.Random) -> costs.Costs:
    """Costs spread over four orders of magnitude around a small model's on a CPU, or none."""
    def spread(around: float) -> float:
        return around * 10 ** rng.uniform(-2, 2)

    extend = rng.random() < 0.8
    return costs.Costs(per_token=spread(1e-3), step=spread(2e-2), step_per_row=spread(2e-3),
                       extend_per_token=spread(1e-3) if extend else None,
                       extend_per_score=spread(1e-6) if extend and rng.random() < 0.5 else 0.0,
                       extend_fixed=spread(5e-2) if extend and rng.random() < 0.5 else 0.0,
                       prefill_per_score=spread(1e-6) if rng.random() < 0.5 else 0.0,
                       prefill_width=rng.choice([0, 16, 64]), prefill_chunk=rng.choice([0, 0, 32, 256]))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def loglikelihood_requests(rng: random.Random) -> list:
    """lm-eval's tokenized requests: subjects whose questions start with the same few-shot
    examples (sometimes more questions than a batch holds: `sharing.KeptPrefixes`), each question's
    choices (one token, several, a prefix of another, the same twice), and lone requests."""
    requests = []
    for _ in range(rng.randint(1, 3)):
        examples = tokens(rng, rng.choice([0, 1, 8, 30, 60, 200, 240]))  # 240: rows at and past the context
        for _ in range(rng.choice([1, 2, 3, 4, 12])):  # 12: a subject's questions in several batches
            context = examples + tokens(rng, rng.randint(0 if examples else 1, 20))
            choices = [tokens(rng, rng.choice([1, 1, 2, 5, 12])) for _ in range(rng.randint(1, 5))]
            if len(choices) > 1 and rng.random() < 0.3:
                choices[-1] = choices[0] + tokens(rng, 2)  # a choice that continues another
            if len(choices) > 1 and rng.random() < 0.2:
                choices[-1] = list(choices[0])  # the same choice twice
            requests += [(("", ""), context, choice) for choice in choices]
    requests += [(("", ""), tokens(rng, rng.randint(1, 70)), tokens(rng, rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 4))]
    rng.shuffle(requests)
    return requests


def truth(hf, request, max_length: int) -> tuple[float, bool]:
    """A request's answer as HFLM defines it (the row cut on the left to `max_length` + 1 tokens,
    less its last; the continuation's log-probabilities summed; whether each is the greedy token),
    from transformers on the request alone. Not lm-eval's hf backend on the whole set: its logits
    cache groups requests by context + continuation[:-1] and reads every member's logits at the
    first member's continuation length, so where a one-token request's context is another
    request's context plus the first of its several continuation tokens, hf answers one of them
    from the wrong positions (tests/test_lm_eval.py, `..._scored_at_its_own`)."""
    _, context, continuation = request
    row = (context + continuation)[-(max_length + 1):][:-1]
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([row])).logits[0, -len(continuation):].double(), -1)
    wanted = torch.tensor(continuation)
    return scores.gather(1, wanted[:, None]).sum().item(), bool((scores.argmax(-1) == wanted).all())


@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48))
def test_loglikelihood_plans_fuzz(build, monkeypatch, seed):
    from ortmodule.lm_eval import OrtModuleLM

    rng = random.Random(seed)
    fixture, hf, model, drawn_model, drawn = drawn_case(build, monkeypatch, rng)
    requests = loglikelihood_requests(rng)
    max_length = rng.choice([None, None, 48])  # 48: the longer rows are cut on the left, as HFLM cuts them
    batch = rng.choice(["1", "3", "8", "auto"])
    options = {"token_budget": str(rng.choice([5, 40, 120, 4096]))} if batch == "auto" else {}
    share = rng.choice(["auto", "auto", "true", "false"])
    lm = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size=batch,
                     share_contexts=share, max_length=max_length, **options)
    case = f"seed {seed}: {len(requests)} requests, batch {batch} {options}, share {share}, " \
        f"{drawn_model}, costs {drawn}"
    for i, (request, (lp, greedy)) in enumerate(zip(requests, lm._loglikelihood_tokens(requests, disable_tqdm=True),
                                                    strict=True)):
        ref_lp, ref_greedy = truth(hf, request, lm.max_length)
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy, \
            f"request {i}: {lp} {greedy} against {ref_lp} {ref_greedy}; {case}"


_variants = {}


def drawn_case(build, monkeypatch, rng: random.Random):
    """A fixture drawn from `ARCHES`, its transformers reference, the ortmodule model as drawn
    (`variant`) with drawn measured costs in place of its own: (fixture, hf, model, what, costs)."""
    fixture = build(rng.choice(ARCHES))
    _, hf = load_pair(fixture)
    model, what = variant(fixture, monkeypatch, rng)
    drawn = random_costs(rng)
    monkeypatch.setattr(model, "measured_costs", lambda refresh=False, measure=True: drawn)
    return fixture, hf, model, what, drawn


def variant(fixture, monkeypatch, rng: random.Random):
    """The fixture's model as drawn: the CPU's chunks for long rows (None: 256; 0: off; 7, 32) and
    the extend graph's layout (mask, the default, or cache: the new tokens' KV written into the
    rows' own buffers), each loaded once."""
    chunk, layout = rng.choice([None, None, 0, 7, 32]), rng.choice(["mask", "mask", "cache"])
    if fixture.spec.precision == "fp16":
        chunk = None  # its attention takes one new token over a cache: no chunks (tests/test_modeling.py)
    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cpu", layout)  # where the extend graph is made at first use
    key = (fixture.package_dir, chunk, layout)
    if key not in _variants:
        _variants[key] = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=chunk)
    return _variants[key], f"{fixture.spec.arch}, chunk {chunk}, extend layout {layout}"


WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "seven", "quiet", "rivers", "ran", "past", "old", "towns",
         "and", "bright", "fields", "of", "grain", "under", "heavy", "clouds", "that", "nobody", "counted", "again"]


@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48, 10))
def test_lanes_fuzz(seed):
    """`sharing.choose_lanes` over random remainders (empty ones too) of random prefixes: every
    remainder has a place of its own in a lane of its prefix, none overlapping another or past the
    lanes' width; without costs the run computes no more tokens and no more attention scores than a
    row per remainder, and with costs it is priced no higher."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 5, rng.randint(1, 60)]) for _ in range(rng.randint(1, 24))]
    lengths[rng.randrange(len(lengths))] = rng.randint(1, 60)
    owner = [rng.randrange(rng.randint(1, 4)) for _ in lengths]
    past = rng.choice([1, 16, 300])
    drawn = random_costs(rng) if rng.random() < 0.5 else None
    lanes = sharing.choose_lanes(lengths, owner, past, drawn)
    taken: dict[int, list[tuple[int, int]]] = {}
    for row, n in enumerate(lengths):
        if n:
            lane, at = lanes.place[row]
            assert lanes.owner[lane] == owner[row] and at + n <= lanes.width
            taken.setdefault(lane, []).append((at, at + n))
    for spans in taken.values():
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert sorted(taken) == list(range(len(lanes.owner)))  # no lane left empty
    rows, longest = sum(1 for n in lengths if n), max(lengths)
    count, width = len(lanes.owner), lanes.width
    if drawn is None or drawn.extend_per_token is None:
        assert count * width <= rows * longest and count * width * (past + width) <= rows * longest * (past + longest)
    else:
        def price(count, width):
            return drawn.extend_per_token * count * width + drawn.extend_per_score * count * width * (past + width)

        assert price(count, width) <= price(rows, longest) * (1 + 1e-9)


@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48, 1 / 4))
def test_rolling_plans_fuzz(build, monkeypatch, seed):
    """`loglikelihood_rolling`: every window of every document (lm-eval's disjoint windows of
    `max_length` tokens) batched by length in one call; each document's total must be the sum of
    transformers' answers to its windows, whatever the window length, batch setting and chunk."""
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from ortmodule.lm_eval import OrtModuleLM

    rng = random.Random(2000 + seed)
    fixture = build(rng.choice(ARCHES))
    _, hf = load_pair(fixture)
    model, drawn_model = variant(fixture, monkeypatch, rng)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 400))) for _ in range(rng.randint(1, 5))]
    batch = rng.choice(["1", "3", "auto"])
    options = {"token_budget": str(rng.choice([16, 200, 4096]))} if batch == "auto" else {}
    lm = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size=batch,
                     max_length=rng.choice([8, 33, 100, 256]), **options)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)],
                                   disable_tqdm=True)
    for text, total in zip(texts, got, strict=True):
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)]
        expected = sum(truth(hf, (None, context, continuation), lm.max_length)[0] for context, continuation in windows)
        case = f"batch {batch} {options}, {drawn_model}, max_length {lm.max_length}, {len(windows)} windows"
        assert math.isclose(total, expected, rel_tol=1e-5, abs_tol=1e-4), \
            f"seed {2000 + seed}: {total} against {expected}; {case}"  # float32 sums of ~1,000 terms


def score_requests(rng: random.Random) -> list[list[list[int]]]:
    """The server's requests: a query and its items, or items that come first (no shared token),
    one item or several, some items the same or one the start of another."""
    requests = []
    for _ in range(rng.randint(1, 5)):
        items = [tokens(rng, rng.randint(1, 12)) for _ in range(rng.choice([1, 2, 4, 7]))]
        if len(items) > 1 and rng.random() < 0.3:
            items[-1] = items[0][: rng.randint(1, len(items[0]))]
        query = tokens(rng, rng.choice([1, 6, 30, 90, 240, 244]))  # 244 + 12: the context (256) full
        requests.append([item + query if rng.random() < 0.2 else query + item for item in items])
    return requests


@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48))
def test_score_plans_fuzz(build, monkeypatch, seed):
    rng = random.Random(1000 + seed)
    _, hf, model, drawn_model, drawn = drawn_case(build, monkeypatch, rng)
    requests = score_requests(rng)
    labels = sorted(rng.sample(range(VOCAB), rng.randint(1, 3)))
    budget = rng.choice([1, 20, 64, 4096])
    reuse = rng.choice([None, None, True, False, "each"])
    if reuse == "each":
        reuse = [rng.random() < 0.5 for _ in requests]
    got = scoring.label_logprobs(model, requests, labels, budget, reuse).double().cpu()
    with torch.no_grad():
        expected = torch.cat([torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)[labels][None]
                              for prompts in requests for prompt in prompts])
    worst = (got - expected).abs().max().item()
    assert math.isfinite(worst) and worst < 1e-4, \
        f"seed {1000 + seed}: off by {worst}; budget {budget}, reuse {reuse}, {drawn_model}, costs {drawn}, " \
        f"requests of {[[len(p) for p in r] for r in requests]} tokens"


@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48, 1 / 4))
def test_generate_plans_fuzz(build, monkeypatch, seed):
    """Greedy `generate` over left-padded batches whose prompts begin alike (few-shot examples:
    on a CPU the common beginning runs once, shared_prompts.py) or not, long prompts in chunks or
    not, beams sometimes: the tokens must be transformers' on the same weights."""
    rng = random.Random(3000 + seed)
    fixture = build(rng.choice(ARCHES))
    _, hf = load_pair(fixture)
    model, drawn_model = variant(fixture, monkeypatch, rng)
    beginning = tokens(rng, rng.choice([0, 3, 50, 120]))
    prompts = [beginning + tokens(rng, rng.randint(1, 30)) for _ in range(rng.randint(1, 4))]
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = dict(max_new_tokens=rng.randint(1, 6), do_sample=False, pad_token_id=2, eos_token_id=None)
    if rng.random() < 0.25:
        options.update(num_beams=rng.choice([2, 3]))
    got = model.generate(ids, attention_mask=mask, **options)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=mask, **options)
    assert torch.equal(got, expected), f"seed {3000 + seed}: {drawn_model}, {len(beginning)} common tokens, " \
        f"prompts of {[len(p) for p in prompts]} tokens, {options}"


@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48, 1 / 4))
def test_generate_until_fuzz(build, monkeypatch, seed):
    """lm-eval's `generate_until` (HFLM's own loop: left-padded batches, stop sequences, `max_gen_toks`)
    over ortmodule as drawn, at batch sizes 1, 3 and 8 (ortmodule's batches by their work), against
    lm-eval's hf backend on the same weights one request at a time: the same strings. Stop sequences
    of one letter are in the special tokens' text too (`<s>`, `<pad>`), which lm-eval's criteria read
    and its answers leave out."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    rng = random.Random(4000 + seed)
    fixture = build(rng.choice(ARCHES))
    model, drawn_model = variant(fixture, monkeypatch, rng)
    # Half the time every prompt begins with the same examples (a few-shot task: shared_prompts.py, kept
    # between batches).
    examples = " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 0, 35, 45])))  # a word: 3-4 tokens
    texts = [f"{examples} " * bool(examples) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 15 if examples
                                                                                                     else 60)))
             for _ in range(rng.randint(1, 12))]
    def settings():  # lm-eval batches the requests of one generation settings (a task's) together
        return {"until": rng.sample(["e", " the", ".", "\n", "qq", "s", "a"], rng.randint(1, 2)),
                "max_gen_toks": rng.randint(1, 24), "do_sample": False}

    task = settings() if rng.random() < 0.5 else None
    requests = [Instance("generate_until", {}, (text, dict(task or settings())), i) for i, text in enumerate(texts)]
    batch = rng.choice([1, 3, 8])
    ours = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size=batch)
    theirs = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu", batch_size=1)
    assert ours.generate_until(requests, disable_tqdm=True) == theirs.generate_until(requests, disable_tqdm=True), \
        f"seed {4000 + seed}: batch {batch}, {drawn_model}"


# int4's per-token bound: on a CPU its matmuls round the activations to int8 (accuracy_level 4), so a float
# difference of 1e-6 between plans (a chunk's attention over its cache) can move an activation across a
# rounding edge. Seed 905151 (chunk 7) met 0.051 a token where the package's own cost against fp32 on the
# same requests was 0.075 (median) to 0.48 (largest); a wrong plan (positions, rows) costs whole nats.
@pytest.mark.parametrize("precision, per_token", [("fp16", 2e-3), ("int4", 0.1)])
@pytest.mark.parametrize("seed", fuzz_seeds("FUZZ_SEEDS", 48, 1 / 8))
def test_quantized_plans_agree_with_the_plain_path(build, monkeypatch, seed, precision, per_token):
    """Half-precision and 4-bit packages differ from transformers fp32 by their own rounding, so here
    every plan is held to the same package's plain path (each request alone: batch 1, no sharing,
    no chunks) within `per_token` a continuation token: what a plan adds must stay below what the
    precision already costs. (fp16 for a CPU takes no chunks: tests/test_modeling.py.)"""
    from ortmodule.lm_eval import OrtModuleLM

    rng = random.Random(5000 + seed)
    fixture = build("llama", precision=precision)
    tokenizer = load_tokenizer(fixture.package_dir)
    plain = OrtModuleLM(pretrained=chunked_off(fixture), tokenizer=tokenizer, batch_size=1, share_contexts="false")
    model, drawn_model = variant(fixture, monkeypatch, rng)
    drawn = random_costs(rng)
    monkeypatch.setattr(model, "measured_costs", lambda refresh=False, measure=True: drawn)
    requests = loglikelihood_requests(rng)
    batch, share = rng.choice(["1", "3", "auto"]), rng.choice(["auto", "true", "false"])
    lm = OrtModuleLM(pretrained=model, tokenizer=tokenizer, batch_size=batch, share_contexts=share)
    ours, theirs = (each._loglikelihood_tokens(requests, disable_tqdm=True) for each in (lm, plain))
    for i, (request, (lp, _), (ref, _)) in enumerate(zip(requests, ours, theirs, strict=True)):
        assert abs(lp - ref) <= per_token * len(request[2]), \
            f"seed {5000 + seed}, request {i}: {lp} against {ref}; batch {batch}, share {share}, {drawn_model}"


def chunked_off(fixture):
    key = (fixture.package_dir, "plain")
    if key not in _variants:
        _variants[key] = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=0)
    return _variants[key]
