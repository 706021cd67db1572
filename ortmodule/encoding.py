"""lm-eval's texts as token ids, fast: each text once, in batches on a thread per core (the same
ids as lm-eval's `HFLM.tok_encode`), and for `loglikelihood` in waves, so that the texts of later
requests are encoded while the device scores earlier ones (`lm_eval.OrtModuleLM`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor


def texts_to_encode(pairs) -> list[str]:
    """The texts `TemplateLM._encode_pair` tokenizes for (context, continuation) pairs, each once:
    context + continuation, and the context (trailing spaces moved to the continuation)."""
    texts: dict[str, None] = {}
    for context, continuation in pairs:
        if context:
            stripped = context.rstrip()
            texts[context + continuation] = None
            texts[stripped] = None
    return list(texts)


def request_waves(pairs, first: int) -> list[list[int]]:
    """Indices of (context, continuation) pairs in waves for tokenizing ahead of the device: the
    longest texts first (HFLM scores the longest first, so that a batch too large for memory fails
    early), a context's requests in one wave (they share its row or its prefill), each wave about
    twice the last; the first is small, so that the device starts soon."""
    by_context: dict[str, list[int]] = {}
    for i in sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1])):
        by_context.setdefault(pairs[i][0].rstrip(), []).append(i)
    waves, wave, size = [], [], max(1, first)
    for group in by_context.values():
        wave += group
        if len(wave) >= size:
            waves.append(wave)
            wave, size = [], 2 * size
    return waves + [wave] if wave else waves


def contiguous_parts(texts: list[str], parts: int) -> list[list[str]]:
    """`texts` cut into at most `parts` contiguous runs of about equal characters."""
    total = sum(len(text) for text in texts)
    runs, run, size = [], [], 0
    for text in texts:
        run.append(text)
        size += len(text)
        if size * parts >= total * (len(runs) + 1) and len(runs) < parts - 1:
            runs.append(run)
            run = []
    return runs + [run] if run else runs


def tokenize_on_every_core(tokenizer, texts: list[str], special: dict, chars_per_thread: int = 100_000
                            ) -> list[list[int]]:
    """`tokenizer(texts, **special)["input_ids"]`, in contiguous parts of about equal length on a
    thread per core, a part at least `chars_per_thread` characters (some 25,000 tokens: a thread
    costs far less than its part). The Rust tokenizer releases the GIL while it encodes, and
    lm-eval's command line turns the tokenizer's own threads off (TOKENIZERS_PARALLELISM=false,
    for its forks); on MMLU-length prompts, tokenizing is most of the host's time per request
    (docs/measurements.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cores, len(texts), max(1, sum(len(text) for text in texts) // chars_per_thread))
    if workers <= 1:
        return tokenizer(texts, **special)["input_ids"] if texts else []
    # transformers sets the tokenizer's truncation and padding before encoding when they differ
    # from the call's (a mutation that would meet another thread's encoding): settled here first.
    tokenizer(texts[:1], **special)
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda part: tokenizer(part, **special)["input_ids"], contiguous_parts(texts, workers)))
    return [ids for part in parts for ids in part]


def encode_as_tok_encode(tokenizer, texts: list[str], add_bos_token: bool | None, bos: str | None
                         ) -> dict[str, list[int]]:
    """`HFLM.tok_encode(text)` of every text, in batched tokenizer calls per special-token setting
    (`tokenize_on_every_core`). `bos`: the prefix token's text."""
    settings: dict[tuple, list[str]] = {}
    for text in texts:
        # tok_encode's rule: add_bos_token when set, and no special tokens before a text that starts with BOS
        special = {} if add_bos_token is None else {"add_special_tokens": add_bos_token}
        if bos and text.startswith(bos):
            special = {"add_special_tokens": False}
        settings.setdefault(tuple(special.items()), []).append(text)
    encoded = {}
    for special, group in settings.items():
        encoded.update(zip(group, tokenize_on_every_core(tokenizer, group, dict(special))))
    return encoded


def hflm_request(lm, context: str, continuation: str) -> tuple[tuple[str, str], list[int], list[int]]:
    """A (context, continuation) request as lm-eval's `TemplateLM.loglikelihood` hands it to
    `_loglikelihood_tokens`, through `lm`'s own encoding: the texts, the context's ids and the
    continuation's (an empty context is the prefix token)."""
    if context:
        return (context, continuation), *lm._encode_pair(context, continuation)
    ids = lm.tok_encode(continuation, add_special_tokens=False)
    if not ids:
        raise ValueError("a loglikelihood request needs a non-empty context or continuation")
    if lm.prefix_token_id != ids[0]:
        return (context, continuation), [lm.prefix_token_id], ids
    return (context, continuation), ids[:1], ids[1:]
