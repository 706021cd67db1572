"""A seeded fuzz test of the plans that measured costs choose: random costs (so that sharing is
taken, refused and mixed in every way the planners allow), random request structures (few-shot
prefixes shared across questions, a question's choices, choices that are prefixes of one another or
equal, rows past `max_length`, prompts that share no token) and random batch settings, through
lm-eval's `loglikelihood` and the score server's call. Whatever the plan, every answer must be
transformers' on the same weights, request by request (`truth`: HFLM's definition of an answer).
`FUZZ_SEEDS=1000` runs more cases (about 40 s).
Session 42's 500 (a shared prefix of no tokens, under costs where an extend token was cheap) is the
kind of fault this looks for."""

import math
import os
import random

import pytest
import torch
from helpers import load_pair

from ortmodule import costs, load_tokenizer, scoring

VOCAB = 512


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
                       prefill_width=rng.choice([0, 16, 64]))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def loglikelihood_requests(rng: random.Random) -> list:
    """lm-eval's tokenized requests: subjects whose questions start with the same few-shot
    examples, each question's choices (one token, several, a prefix of another, the same twice),
    and lone requests."""
    requests = []
    for _ in range(rng.randint(1, 3)):
        examples = tokens(rng, rng.choice([0, 1, 8, 30, 60]))
        for _ in range(rng.randint(1, 4)):
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
    from the wrong positions (seed 348 here: log p(t | [478]) for log p(t | [478, 57]))."""
    _, context, continuation = request
    row = (context + continuation)[-(max_length + 1):][:-1]
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([row])).logits[0, -len(continuation):].double(), -1)
    wanted = torch.tensor(continuation)
    return scores.gather(1, wanted[:, None]).sum().item(), bool((scores.argmax(-1) == wanted).all())


@pytest.mark.parametrize("seed", range(int(os.environ.get("FUZZ_SEEDS", 48))))
def test_loglikelihood_plans_fuzz(build, monkeypatch, seed):
    from ortmodule.lm_eval import OrtModuleLM

    rng = random.Random(seed)
    fixture = build("llama")
    model, hf = load_pair(fixture)
    drawn = random_costs(rng)
    monkeypatch.setattr(model, "measured_costs", lambda refresh=False: drawn)
    requests = loglikelihood_requests(rng)
    max_length = rng.choice([None, None, 48])  # 48: the longer rows are cut on the left, as HFLM cuts them
    batch = rng.choice(["1", "3", "8", "auto"])
    options = {"token_budget": str(rng.choice([5, 40, 120, 4096]))} if batch == "auto" else {}
    share = rng.choice(["auto", "auto", "true", "false"])
    lm = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size=batch,
                     share_contexts=share, max_length=max_length, **options)
    case = f"seed {seed}: {len(requests)} requests, batch {batch} {options}, share {share}, costs {drawn}"
    for i, (request, (lp, greedy)) in enumerate(zip(requests, lm._loglikelihood_tokens(requests, disable_tqdm=True),
                                                    strict=True)):
        ref_lp, ref_greedy = truth(hf, request, lm.max_length)
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy, \
            f"request {i}: {lp} {greedy} against {ref_lp} {ref_greedy}; {case}"


def score_requests(rng: random.Random) -> list[list[list[int]]]:
    """The server's requests: a query and its items, or items that come first (no shared token),
    one item or several, some items the same or one the start of another."""
    requests = []
    for _ in range(rng.randint(1, 5)):
        items = [tokens(rng, rng.randint(1, 12)) for _ in range(rng.choice([1, 2, 4, 7]))]
        if len(items) > 1 and rng.random() < 0.3:
            items[-1] = items[0][: rng.randint(1, len(items[0]))]
        query = tokens(rng, rng.choice([1, 6, 30, 90, 240]))
        requests.append([item + query if rng.random() < 0.2 else query + item for item in items])
    return requests


@pytest.mark.parametrize("seed", range(int(os.environ.get("FUZZ_SEEDS", 48))))
def test_score_plans_fuzz(llama, monkeypatch, seed):
    rng = random.Random(1000 + seed)
    model, hf = load_pair(llama)
    drawn = random_costs(rng)
    monkeypatch.setattr(model, "measured_costs", lambda refresh=False: drawn)
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
        f"seed {1000 + seed}: off by {worst}; budget {budget}, reuse {reuse}, costs {drawn}, " \
        f"requests of {[[len(p) for p in r] for r in requests]} tokens"
