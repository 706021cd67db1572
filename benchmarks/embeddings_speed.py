"""`/v1/embeddings` on the real SmolLM2-135M-Instruct (fp32 package), against what a transformers user writes for the
same texts (sentence-transformers' `encode` with last-token pooling: the texts sorted by length, right-padded batches
of 32 through the backbone, each row's last real token, L2-normalized). Requests of `--per-request` texts go through
the server's app in this process (run-batch's path: several requests at once, batched by the engine);
`scoring.pooled_hidden_states` is the same work called from Python. Prints each way's time, texts/s and tokens/s, and
the largest difference from transformers' embeddings.

    python benchmarks/embeddings_speed.py [--texts 512] [--per-request 8] [--repeats 2] [--threads 2]
"""

import argparse
import collections
import datetime
import decimal
import fractions
import functools
import inspect
import itertools
import json
import logging
import pathlib
import random
import shutil
import statistics
import subprocess
import tempfile
import textwrap
import threading
import time
import typing
import unittest
from pathlib import Path

import torch
from run_batch_speed import answered, real_model_arguments  # this folder's: run-batch's path, the real model

import ortmodule
from ortmodule import scoring

TASKS = Path(ortmodule.__file__).parent / "tasks"


def texts(count: int) -> list[str]:
    """Distinct English sentences: from the tasks shipped with ortmodule, then from the docstrings of Python's
    standard library (no download); 3 to 60 tokens each."""
    found = []
    for line in (TASKS / "sentences.jsonl").read_text().splitlines():
        found += [s.strip() + "." for s in json.loads(line)["text"].split(".") if len(s.strip()) > 20]
    for line in (TASKS / "knowledge.jsonl").read_text().splitlines():
        row = json.loads(line)
        found += [f"{row['question']} {choice}." for choice in row["choices"]]
    for module in (argparse, json, tempfile, pathlib, collections, functools, itertools, textwrap, inspect, logging,
                   threading, subprocess, shutil, datetime, random, statistics, decimal, fractions, typing, unittest):
        members = [member for _, member in inspect.getmembers(module)]
        members += [method for member in members if inspect.isclass(member)
                    for _, method in inspect.getmembers(member, inspect.isfunction)]
        for member in members:
            doc = inspect.getdoc(member) or ""
            found += [" ".join(s.split()).rstrip(".") + "." for s in doc.split(". ")
                      if 30 < len(s) < 300 and "\n\n" not in s]
    found = list(dict.fromkeys(found))
    if len(found) < count:
        raise SystemExit(f"--texts {count}: there are {len(found)} distinct texts")
    return found[:count]


def served(model, tokenizer, inputs: list[str], per_request: int) -> tuple[float, torch.Tensor]:
    bodies = [{"input": inputs[i : i + per_request], "encoding_format": "float"}
              for i in range(0, len(inputs), per_request)]
    seconds, answers = answered(model, tokenizer, "/v1/embeddings", bodies, 64)
    return seconds, torch.tensor([item["embedding"] for answer in answers for item in answer["data"]])


def python_call(model, tokenizer, inputs: list[str]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    ids = tokenizer(inputs)["input_ids"]
    states = scoring.pooled_hidden_states(model, ids, scoring.default_token_budget(model.device))
    return time.perf_counter() - start, torch.nn.functional.normalize(states, dim=-1)


def transformers_batches(hf, tokenizer, inputs: list[str], rows: int) -> tuple[float, torch.Tensor]:
    """As sentence-transformers' `encode` runs them: the texts sorted by length (longest first), batches of `rows`."""
    tokenizer.padding_side = "right"
    start = time.perf_counter()
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    out = torch.empty(len(inputs), hf.config.hidden_size)
    for i in range(0, len(inputs), rows):
        taken = order[i : i + rows]
        batch = tokenizer([inputs[k] for k in taken], return_tensors="pt", padding=True)
        with torch.inference_mode():
            states = hf.model(**batch).last_hidden_state
        last = batch["attention_mask"].sum(1) - 1
        out[taken] = torch.nn.functional.normalize(states[torch.arange(len(last)), last], dim=-1)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32, help="transformers' batch size")
    args, model, tokenizer, hf = real_model_arguments(parser)
    inputs = texts(args.texts)
    tokens = sum(map(len, tokenizer(inputs)["input_ids"]))
    print(f"{len(inputs)} texts, {tokens} tokens ({tokens / len(inputs):.1f} a text)", flush=True)
    for repeat in range(args.repeats):
        ways = {f"/v1/embeddings, {args.per_request} texts a request": lambda: served(model, tokenizer, inputs,
                                                                                     args.per_request),
                "scoring.pooled_hidden_states": lambda: python_call(model, tokenizer, inputs),
                f"transformers, batches of {args.rows}": lambda: transformers_batches(hf, tokenizer, inputs,
                                                                                     args.rows)}
        results = {name: way() for name, way in ways.items()}
        reference = results[f"transformers, batches of {args.rows}"][1]
        for name, (seconds, rows) in results.items():
            gap = (rows - reference).abs().max().item()
            print(f"run {repeat}: {name:36s} {seconds:6.2f} s  {len(inputs) / seconds:7.1f} texts/s  "
                  f"{tokens / seconds:7.0f} tokens/s  largest difference from transformers' {gap:.1e}", flush=True)


if __name__ == "__main__":
    main()
