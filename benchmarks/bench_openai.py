"""Closed-loop load on `ortmodule serve`: N clients mixing `/v1/score`, `/v1/completions` and
`/v1/chat/completions` (greedy), each sending its next request when the last is answered, for a
fixed time; every answer checked against the same request sent alone first.

    python benchmarks/bench_openai.py --package PATH --clients 1 8 32 --seconds 30
    python benchmarks/bench_openai.py --real --clients 1 8 32     # SmolLM2-135M-Instruct (the demo's package)
    python benchmarks/bench_openai.py --real --clients 32 --serve-option=--join-steps=0   # a server setting
    python benchmarks/bench_openai.py --real --clients 32 --seconds 25 --distinct 180    # no request repeats

The default mix repeats 6 requests of each kind, so a prefix cache answers most of a repeated
prompt from memory; `--distinct N` sends N different ones of each kind instead, alike only where
real traffic is alike (the chat template's system prompt, the score prompt's frame).

Prints P50 / P99 latency and requests/s per kind and overall, for each number of clients; first,
how long a short completion sent during a 200-token stream takes, against the same completion
alone (continuous batching: it joins the stream's batch rather than waiting for its end).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
from bench_score import LocalServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import load  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
             "Write a haiku about the sea.", "What is two plus two?", "Who wrote Hamlet?"]
PROMPTS = ["The history of the printing press", "Once upon a time, in a small village,",
           "The three laws of motion are", "A good breakfast includes"]
REVIEWS = [" I loved this film.", " The food was cold and bland.", " An average day.", " Best purchase ever!"]


def bodies(name: str, label_ids: list[int]) -> list[tuple[str, str, dict]]:
    out = []
    for i, question in enumerate(QUESTIONS):
        out.append(("chat", "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": question}],
                                                      "max_tokens": 32, "temperature": 0}))
        prompt = PROMPTS[i % len(PROMPTS)]
        out.append(("completions", "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 16,
                                                       "temperature": 0}))
        out.append(("score", "/v1/score", {"query": "Review:" + REVIEWS[i % len(REVIEWS)] + " Sentiment:",
                                           "items": [" positive", " negative"], "label_token_ids": label_ids,
                                           "model": name}))
    return out


# --distinct N: N different requests of each kind, alike only where real traffic is alike (the chat
# template's system prompt, the score prompt's frame), so that no cache can answer a repeat.
SUBJECTS = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "Egypt", "India", "Mexico", "Italy", "Peru",
            "Chile", "Spain", "Greece", "Turkey", "Vietnam", "Nepal", "Ghana", "Poland", "Sweden", "Ireland",
            "Morocco", "Cuba", "Iceland", "Finland", "Portugal", "Austria", "Thailand", "Argentina", "Australia"]
ASKS = ["What is the capital of {}?", "Name a famous dish from {}.", "What language is spoken in {}?",
        "Describe the weather in {} in one sentence.", "Which ocean or sea is closest to {}?",
        "Write a short poem about {}.", "What is {} known for?", "Name a river in {}."]
OPENINGS = ["The history of {} began", "A travel guide to {}:", "In {}, the most popular sport is",
            "The economy of {} depends on", "Every summer in {}, people", "The oldest city in {} is",
            "Travellers to {} should know that", "The national animal of {} is"]
THINGS = ["the hotel", "this phone", "the movie", "our waiter", "the book", "this laptop", "the concert", "the app"]
VERDICTS = ["was wonderful", "broke after a day", "was fine, nothing special", "exceeded every expectation",
            "was a waste of money", "made my week"]


def distinct_bodies(name: str, label_ids: list[int], n: int) -> list[tuple[str, str, dict]]:
    questions = [ask.format(subject) for ask in ASKS for subject in SUBJECTS]
    prompts = [opening.format(subject) for opening in OPENINGS for subject in SUBJECTS]
    reviews = [f" {thing.capitalize()} in {subject} {verdict}." for thing in THINGS for verdict in VERDICTS
               for subject in SUBJECTS]
    if n > min(len(questions), len(prompts)):
        raise SystemExit(f"--distinct takes at most {min(len(questions), len(prompts))}")
    out = []
    for i in range(n):
        chat = [{"role": "user", "content": questions[i]}]
        out.append(("chat", "/v1/chat/completions", {"model": name, "messages": chat, "max_tokens": 32,
                                                      "temperature": 0}))
        out.append(("completions", "/v1/completions", {"model": name, "prompt": prompts[i], "max_tokens": 16,
                                                       "temperature": 0}))
        out.append(("score", "/v1/score", {"query": "Review:" + reviews[i] + " Sentiment:",
                                           "items": [" positive", " negative"], "label_token_ids": label_ids,
                                           "model": name}))
    return out


def answer_of(kind: str, body: dict):
    if kind == "chat":
        return body["choices"][0]["message"]["content"]
    if kind == "completions":
        return body["choices"][0]["text"]
    return body["scores"]


def calls(url: str, name: str, label_ids: list[int], distinct: int = 0) -> list[load.Call]:
    """The mix, each request's expected answer taken from the server with nothing else running."""
    out = []
    mix = distinct_bodies(name, label_ids, distinct) if distinct else bodies(name, label_ids)
    with httpx.Client(base_url=url, timeout=300) as client:
        for kind, path, body in mix:
            response = client.post(path, json=body)
            response.raise_for_status()
            alone = answer_of(kind, response.json())

            def check(answer, kind=kind, alone=alone):
                got = answer_of(kind, answer)
                if kind == "score":
                    close = all(abs(a - b) < 1e-4 for row_a, row_b in zip(got, alone) for a, b in zip(row_a, row_b))
                    return None if close else f"scores {got} differ from {alone}"
                return None if got == alone else f"{got!r} differs from the answer alone {alone!r}"

            out.append(load.Call(kind, path, body, check))
    return out


def short_during_stream(url: str, name: str) -> dict:
    """Seconds a 6-token greedy completion takes alone, and sent while a 200-token stream runs
    (after the stream's first tokens), with the stream's own time; both answers checked equal."""
    short = {"model": name, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    long = {"model": name, "prompt": "Once upon a time, in a small village,", "max_tokens": 200, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=url, timeout=300) as client:
        client.post("/v1/completions", json=short)  # warm-up: the timed one below is the second
        start = time.perf_counter()
        alone_text = client.post("/v1/completions", json=short).json()["choices"][0]["text"]
        alone = time.perf_counter() - start
        started, stream_time = threading.Event(), {}

        def stream():
            begin = time.perf_counter()
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=300) as events:
                for n, _ in enumerate(events.iter_lines()):
                    if n == 4:
                        started.set()
            stream_time["seconds"] = time.perf_counter() - begin

        thread = threading.Thread(target=stream)
        thread.start()
        started.wait(300)
        start = time.perf_counter()
        during = client.post("/v1/completions", json=short).json()["choices"][0]["text"]
        joined = time.perf_counter() - start
        thread.join()
    return {"short_alone_s": round(alone, 4), "short_during_stream_s": round(joined, 4),
            "stream_s": round(stream_time["seconds"], 3), "same_answer": during == alone_text}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--package", help="a GenAI package folder (with a chat template)")
    where.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct fp32, exported as the demo does")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--distinct", type=int, default=0, metavar="N",
                        help="N different requests of each kind (each checked alone first) instead of the repeating "
                             "mix of 6: prompts share only what real traffic shares (the chat template's system "
                             "prompt); send fewer than 3N requests in all, or repeats begin")
    parser.add_argument("--serve-option", action="append", default=[], metavar="FLAG",
                        help="passed to `ortmodule serve` (repeatable), e.g. --serve-option=--join-steps=0")
    args = parser.parse_args(argv)
    if args.real:
        from conftest import SIZES

        from ortmodule_dev import fixtures

        args.package = fixtures.build(SIZES["cpu"]["decoders"]["smollm2-fp32"]).package_dir
    from ortmodule import load_tokenizer

    tokenizer = load_tokenizer(args.package)
    label_ids = [tokenizer(" positive").input_ids[0], tokenizer(" negative").input_ids[0]]
    results = []
    with LocalServer(args.package, extra=["--name", "model", *args.serve_option]) as server:
        joining = short_during_stream(server.url, "model")
        print(json.dumps(joining), flush=True)
        results.append(joining)
        mix = calls(server.url, "model", label_ids, args.distinct)
        for clients in args.clients:
            before = server.metrics()
            result = load.run(server.url, mix, clients=clients, seconds=args.seconds)
            after = server.metrics()
            if "decode_steps" in after:  # not from an older server
                result["engine"] = engine_figures(before, after)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "wrong"}), flush=True)
            if result["wrong"]:
                print("WRONG:", result["wrong"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def engine_figures(before: dict, after: dict) -> dict:
    """What the engine did between two reads of its metrics."""
    steps = after["decode_steps"] - before["decode_steps"]
    return {"decode_steps": steps, "largest_decode_batch": after["largest_decode_batch"],
            "mean_decode_batch": round((after["decoded_rows"] - before["decoded_rows"]) / max(steps, 1), 2),
            "score_batches": after["batches"].get("score", 0) - before["batches"].get("score", 0),
            "fed_tokens": after.get("fed_tokens", 0) - before.get("fed_tokens", 0),
            "prefix_cache": after.get("prefix_cache"),
            "seconds": {phase: round(seconds - before["seconds"].get(phase, 0.0), 1)
                        for phase, seconds in after["seconds"].items()}}


if __name__ == "__main__":
    main()
