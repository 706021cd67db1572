"""The fp32 reference of the at-scale rows of half-precision packages, kept between runs.

Every at-scale row of a bf16 or fp16 package is compared with transformers in fp32 on the same
weights (benchmarks/test_scale.py). On a GPU that reference is the slowest part of a workload's run
(10,000 MMLU-shaped requests in fp32 take longer than all of ortmodule's rows together), and the GPU
machine starts bare each session, so it was recomputed every time. Its answers depend only on the
weights, the tokenizer and the requests: a reference is stored with digests of all three
(`weights_digest`: every file of the transformers checkpoint, tokenizer included, less the version
of transformers that wrote its JSON files; `requests_digest`: every request's arguments, in order)
and reused only where both digests equal the run's, so a reused reference answers exactly the
requests the run answered, on exactly its weights. Anything else (a new tokenizer, another limit,
other weights) computes it again and stores it.

A reference made on another machine serves only where the requests are the same: the workloads'
text is cut from the documentation of the Python that runs them (`pydoc_data`), so a CPU here
(Python 3.11) and the GPU machine (Python 3.12.3) ask different requests of the same weights
(session 41: the fixture's weights digest equal on both, yet the first MMLU answers of transformers
in fp32 here up to 1.75 from the GPU's stored ones, where transformers and ONNX Runtime in fp32
agree to 6e-6 on the same ids here).

The store is benchmarks/results/references/ (or `$ORTMODULE_BENCH_REFERENCES`): one JSON per model
and workload, with what made it (transformers' version, the device, the date)."""

import datetime
import hashlib
import json
import os
import re
from pathlib import Path

STORE = Path(__file__).parent / "results" / "references"
CHUNK = 16 << 20


def store() -> Path:
    return Path(os.environ.get("ORTMODULE_BENCH_REFERENCES") or STORE)


# The version of transformers that saved a checkpoint, which its JSON files record: the same weights
# saved by transformers 5.23 on the GPU machine and 5.24 here differ in that line alone.
WRITER_STAMP = re.compile(rb'\n\s*"transformers_version": "[^"]*",?')


def weights_digest(checkpoint: Path) -> str:
    """sha256 over every file of a transformers checkpoint folder (names and contents, in name order),
    the `transformers_version` line of its JSON files left out: a fixture built from the same spec on
    another machine, under another transformers, has the same digest (its weights are the same,
    tests/test_benchmark_pages.py)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(checkpoint).rglob("*") if p.is_file()):
        digest.update(path.relative_to(checkpoint).as_posix().encode() + b"\0")
        if path.suffix == ".json":
            digest.update(WRITER_STAMP.sub(b"", path.read_bytes()))
            continue
        with path.open("rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
    return digest.hexdigest()


def requests_digest(result: dict, task: str) -> str:
    """sha256 over the arguments of every request of `task` in an lm-eval result (`log_samples`), in
    the order `evaluation.answers` reads their answers."""
    arguments = [sample["arguments"] for sample in result["samples"][task]]  # per sample, its requests' args
    return hashlib.sha256(json.dumps(arguments, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def path_of(name: str) -> Path:
    return store() / f"{name}.json"


def load_reference(name: str, weights: str, requests: str) -> dict | None:
    """The stored reference `name` if it was made on these weights for these requests, else None."""
    path = path_of(name)
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    if stored.get("weights_sha256") != weights or stored.get("requests_sha256") != requests:
        return None
    return stored


def save_reference(name: str, weights: str, requests: str, answers: list, made_with: dict) -> dict:
    """Store `answers` (per request, [loglikelihood, is_greedy]) as reference `name`; the record."""
    path = path_of(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"weights_sha256": weights, "requests_sha256": requests,
              "made": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              **made_with, "answers": [[float(a[0]), bool(a[1])] for a in answers]}
    path.write_text(json.dumps(record) + "\n")
    return record


def reference_answers(name: str, checkpoint: Path, result: dict, task: str, compute) -> tuple[list, str]:
    """(answers, provenance): the stored reference `name` where its digests match the checkpoint and
    `result`'s requests, else `compute()` (its answers and what made them: `(answers, made_with)`),
    stored for the next run. The provenance says when and on what device the answers were computed,
    and whether this run computed them."""
    weights, requests = weights_digest(checkpoint), requests_digest(result, task)
    record = load_reference(name, weights, requests)
    kept = record is not None
    if not kept:
        answers, made_with = compute()
        record = save_reference(name, weights, requests, answers, made_with)
    where = f"{record['made'][:10]}, {record.get('device', '?')}"
    return [tuple(a) for a in record["answers"]], f"{where} (kept)" if kept else f"{where} (this run)"
