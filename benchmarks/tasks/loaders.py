"""The benchmark's multiple-choice workload, made on the fly from ortmodule's fixture corpus (no
download): 200 questions, each a ~200-token passage; half with four ~13-token continuations and
half with four single-token continuations (words the fixture tokenizer keeps whole). lm-eval puts
its target delimiter, a space, before each choice."""

import random

import datasets

from ortmodule_dev.fixtures import CORPUS, train_tokenizer


def bench_mc(**kwargs) -> dict:
    rng = random.Random(0)
    words = CORPUS.split()
    tokenizer = train_tokenizer()
    single = sorted({w for w in words if len(tokenizer(" " + w)["input_ids"]) == 1})
    docs = []
    for i in range(200):
        start = rng.randrange(len(words) - 120)
        passage = " ".join(words[start : start + 110])
        if i % 2:
            choices = list(rng.sample(single, 4))
        else:
            choices = []
            for _ in range(4):
                at = rng.randrange(len(words) - 8)
                choices.append(" ".join(words[at : at + 7]))
        docs.append({"passage": passage, "choices": choices, "label": rng.randrange(4)})
    return {"test": datasets.Dataset.from_list(docs)}
