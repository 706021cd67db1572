"""The benchmark's multiple-choice workload, made on the fly from ortmodule's fixture corpus (no
download): 200 questions, each a ~200-token passage and four ~13-token continuations."""

import random

import datasets

from ortmodule.fixtures import CORPUS


def bench_mc(**kwargs) -> dict:
    rng = random.Random(0)
    words = CORPUS.split()
    docs = []
    for _ in range(200):
        start = rng.randrange(len(words) - 120)
        passage = " ".join(words[start : start + 110])
        choices = []
        for _ in range(4):
            at = rng.randrange(len(words) - 8)
            choices.append(" " + " ".join(words[at : at + 7]))
        docs.append({"passage": passage, "choices": choices, "label": rng.randrange(4)})
    return {"test": datasets.Dataset.from_list(docs)}
