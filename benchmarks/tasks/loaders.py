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


# ---- Workloads at the scale users run (benchmarks/test_lm_eval.py's `at scale` group) -----------
# English prose available offline: the Python reference documentation that ships with Python
# (pydoc_data), cut into spans of exact token counts in the evaluated model's tokenizer (lm-eval
# passes the benchmark's `metadata`, here the tokenizer's folder, to the loader).

LETTERS = ["A", "B", "C", "D"]


class Spans:
    """Text spans of a given number of tokens, drawn from the prose at random places."""

    def __init__(self, tokenizer: str | None, seed: int):
        from pydoc_data.topics import topics

        from transformers import AutoTokenizer

        self.text = " ".join(" ".join(topics[key].split()) for key in sorted(topics))
        tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else train_tokenizer()
        self.offsets = tok(self.text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        self.rng = random.Random(seed)

    def __call__(self, tokens: int) -> str:
        start = self.rng.randrange(len(self.offsets) - tokens)
        return self.text[self.offsets[start][0] : self.offsets[start + tokens - 1][1]].strip()


def bench_mmlu(tokenizer: str | None = None, questions: int = 2500, **kwargs) -> dict:
    """MMLU-shaped: a 5-shot prompt of 300-900 tokens (five answered questions and the one asked,
    each with four short lettered options), answered by one of the letters A-D (one token each)."""
    spans = Spans(tokenizer, seed=1)
    docs = []
    for _ in range(questions):
        per_question = spans.rng.randint(300, 900) // 6  # tokens per block, five shots and the question
        blocks = []
        for shot in range(6):
            blocks.append(_mc_block(spans, per_question) + (f" {spans.rng.choice(LETTERS)}\n\n" if shot < 5 else ""))
        docs.append({"prompt": "".join(blocks), "label": spans.rng.randrange(4)})
    return {"test": datasets.Dataset.from_list(docs)}


def bench_fewshot(tokenizer: str | None = None, questions: int = 2500, per_subject: int = 250, **kwargs) -> dict:
    """MMLU as lm-eval runs it 5-shot (`--num_fewshot 5`: its `first_n` sampler takes a subject's
    first five dev questions for every test question of that subject): subjects of `per_subject`
    questions (MMLU's 14,042 over 57 subjects: about 246), each prompt the subject's description and
    its five answered examples (the same for all its questions), then the question; 300-900 tokens
    in all, four one-token letters A-D."""
    spans = Spans(tokenizer, seed=2)
    docs = []
    while len(docs) < questions:
        per_block = spans.rng.randint(300, 900) // 6  # tokens per block: five examples and the question
        examples = "".join(
            _mc_block(spans, per_block) + f" {spans.rng.choice(LETTERS)}\n\n" for _ in range(5))
        head = f"The following are multiple choice questions (with answers) about {spans(3)}.\n\n"
        for _ in range(min(per_subject, questions - len(docs))):
            docs.append({"prompt": head + examples + _mc_block(spans, per_block), "label": spans.rng.randrange(4)})
    return {"test": datasets.Dataset.from_list(docs)}


def _mc_block(spans: Spans, tokens: int) -> str:
    """A question of about `tokens` tokens with four short lettered options, ending in 'Answer:'."""
    options = "\n".join(f"{letter}. {spans(spans.rng.randint(2, 8))}" for letter in LETTERS)  # drawn first
    return f"Question: {spans(max(8, tokens - 30))}\n{options}\nAnswer:"


def bench_hellaswag(tokenizer: str | None = None, questions: int = 2000, **kwargs) -> dict:
    """HellaSwag-shaped: a context of 40-120 tokens and four continuations of 15-40 tokens each."""
    spans = Spans(tokenizer, seed=2)
    docs = [{"prompt": spans(spans.rng.randint(40, 120)),
             "choices": [spans(spans.rng.randint(15, 40)) for _ in LETTERS], "label": spans.rng.randrange(4)}
            for _ in range(questions)]
    return {"test": datasets.Dataset.from_list(docs)}


def bench_arc(tokenizer: str | None = None, questions: int = 2500, **kwargs) -> dict:
    """ARC-shaped: a short question (15-45 tokens, no shots) and four answers of 1-8 tokens each,
    where a question's context is too short for sharing it to pay on most devices."""
    spans = Spans(tokenizer, seed=4)
    docs = [{"prompt": f"Question: {spans(spans.rng.randint(15, 45))}\nAnswer:",
             "choices": [spans(spans.rng.randint(1, 8)) for _ in LETTERS], "label": spans.rng.randrange(4)}
            for _ in range(questions)]
    return {"test": datasets.Dataset.from_list(docs)}


def bench_rolling(tokenizer: str | None = None, documents: int = 100, **kwargs) -> dict:
    """wikitext-shaped: documents of 2,000-8,000 tokens, scored whole (`loglikelihood_rolling`)."""
    spans = Spans(tokenizer, seed=3)
    docs = [{"page": spans(spans.rng.randint(2000, 8000))} for _ in range(documents)]
    return {"test": datasets.Dataset.from_list(docs)}


def bench_gsm8k(tokenizer: str | None = None, questions: int = 1000, **kwargs) -> dict:
    """GSM8K-shaped (`generate_until`): a 4-shot prompt of 250-600 tokens (four questions of 40-100 tokens,
    each with its answer of 5-40 ending in a full stop, then the question asked), answered by greedy
    decoding up to "Question:" or a blank line, at most 128 tokens (SmolLM2-135M-Instruct writes
    answers of 5 to 40 tokens and, in about one row in five, runs on to the limit, as a small model does
    on GSM8K); the target is a span of prose (the answers are compared between backends, not scored)."""
    spans = Spans(tokenizer, seed=5)
    docs = []
    for _ in range(questions):
        shots = "".join(f"Question: {spans(spans.rng.randint(40, 100))}\nAnswer: {_sentence(spans, 5, 40)}\n\n"
                        for _ in range(4))
        docs.append({"prompt": f"{shots}Question: {spans(spans.rng.randint(40, 100))}\nAnswer:",
                     "answer": spans(spans.rng.randint(5, 20))})
    return {"test": datasets.Dataset.from_list(docs)}


def _sentence(spans: Spans, low: int, high: int) -> str:
    """A span of `low` to `high` tokens ending in one full stop."""
    return spans(spans.rng.randint(low, high)).rstrip(".") + "."
