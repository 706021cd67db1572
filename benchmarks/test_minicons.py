"""A library-driven scoring run: minicons' IncrementalLMScorer handed ortmodule's model or
transformers' on the same weights (the real SmolLM2 packages at the CPU size), sentences/s of
`sequence_score`, and how far the two models' scores are apart."""

import json
from pathlib import Path

import pytest
from conftest import flop_count, model_label, record_rate, reference_model

import ortmodule
from ortmodule import OrtModelForCausalLM, load_tokenizer
from ortmodule_dev import fixtures

TASKS = Path(ortmodule.__file__).parent / "tasks"


def sentences(count: int) -> list[str]:
    """Short English sentences from the tasks shipped with ortmodule (no download)."""
    rows = [json.loads(line) for line in (TASKS / "knowledge.jsonl").read_text().splitlines()]
    found = [f"{r['question']} {choice}." for r in rows for choice in r["choices"]]
    rows = [json.loads(line) for line in (TASKS / "arithmetic_mc.jsonl").read_text().splitlines()]
    found += [f"What is {r['a']} plus {r['b']}? {choice}." for r in rows for choice in r["choices"]]
    for line in (TASKS / "sentences.jsonl").read_text().splitlines():
        found += [s.strip() + "." for s in json.loads(line)["text"].split(".") if s.strip()]
    return (found * (count // len(found) + 1))[:count]


@pytest.fixture(scope="module")
def workload(size, decoder_key):
    fixture = fixtures.build(size["decoders"][decoder_key])
    return fixture, sentences(size["minicons"]["sentences"]), size, decoder_key


def run_scorer(benchmark, model, workload, backend):
    from minicons import scorer

    fixture, texts, size, key = workload
    tokenizer = load_tokenizer(fixture.package_dir)
    lm = scorer.IncrementalLMScorer(model, device=size["device"], tokenizer=tokenizer)
    batch = size["minicons"]["batch_size"]
    # minicons asks for every position's logits of each right-padded batch: the LM head at every one.
    tokens = sum(len(chunk) * max(len(ids) for ids in tokenizer(chunk).input_ids)
                 for chunk in (texts[start : start + batch] for start in range(0, len(texts), batch)))
    benchmark.extra_info["flops"] = flop_count(fixture, tokens, tokens)

    def score():
        return [total for start in range(0, len(texts), batch)
                for total in lm.sequence_score(texts[start : start + batch], reduction=lambda x: x.sum(0).item())]

    benchmark.extra_info.update(model=model_label(key), case="", backend=backend)
    return record_rate(benchmark, score, len(texts), "sentences", size["device"], rounds=3)


_scores = {}


@pytest.mark.benchmark(group="minicons scoring")
def test_transformers_minicons(benchmark, workload):
    fixture, _, size, _ = workload
    _scores[workload[3]] = run_scorer(benchmark, reference_model(fixture, size["device"]), workload, "transformers")


@pytest.mark.benchmark(group="minicons scoring")
def test_ortmodule_minicons(benchmark, workload):
    fixture, texts, size, key = workload
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=size["device"])
    ours = run_scorer(benchmark, model, workload, "ortmodule")
    if key in _scores:
        diff = max(abs(a - b) for a, b in zip(ours, _scores[key]))
        benchmark.extra_info["max_diff_vs_transformers"] = round(diff, 5)
        if fixture.spec.precision == "fp32":
            assert diff < 1e-3
