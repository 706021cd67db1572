"""lm-eval's texts as token ids, fast: each text once, in batches on a thread per core (the same
ids as lm-eval's `HFLM.tok_encode`), and for `loglikelihood` in waves, so that the texts of later
requests are encoded while the device scores earlier ones (`lm_eval.OrtModuleLM`)."""

from __future__ import annotations

import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

# Pre-tokenizer regexes (Split, "Isolated") of Llama 3 and Qwen2 (GPT-2's is ByteLevel's own,
# `use_regex`): none of their matches runs from a letter into a space or line break after it, and none
# looks behind, so a text cut there pre-tokenizes as its two parts do (`splits_at_word_ends`).
SAFE_SPLIT_PATTERNS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+",
})


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


def backend_encoder(tokenizer):
    """The Rust tokenizer's own batch encoder (without offsets), where it gives the ids
    transformers' `tokenizer(texts)` does: a fast tokenizer with no truncation or padding set on its
    backend and special tokens not split; transformers' call builds a Python dict per text on top
    (about 15% of the time on MMLU-length prompts, docs/measurements.md). None where it does not apply."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or getattr(tokenizer, "split_special_tokens", False)):
        return None
    return getattr(backend, "encode_batch_fast", backend.encode_batch)


def tokenize_on_every_core(tokenizer, texts: list[str], special: dict, chars_per_thread: int = 100_000
                            ) -> list[list[int]]:
    """`tokenizer(texts, **special)["input_ids"]`, in contiguous parts of about equal length on a
    thread per core, a part at least `chars_per_thread` characters (some 25,000 tokens: a thread
    costs far less than its part), through the Rust tokenizer's own batch encoder where it gives the
    same ids (`backend_encoder`). The Rust tokenizer releases the GIL while it encodes, and
    lm-eval's command line turns the tokenizer's own threads off (TOKENIZERS_PARALLELISM=false,
    for its forks); on MMLU-length prompts, tokenizing is most of the host's time per request
    (docs/measurements.md)."""
    encoder = backend_encoder(tokenizer)
    if encoder is not None:
        add = special.get("add_special_tokens", True)

        def encode(part):
            return [encoding.ids for encoding in encoder(part, add_special_tokens=add)]
    else:
        def encode(part):
            return tokenizer(part, **special)["input_ids"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cores, len(texts), max(1, sum(len(text) for text in texts) // chars_per_thread))
    if workers <= 1:
        return encode(texts) if texts else []
    if encoder is None:
        # transformers sets the tokenizer's truncation and padding before encoding when they differ
        # from the call's (a mutation that would meet another thread's encoding): settled here first.
        tokenizer(texts[:1], **special)
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(encode, contiguous_parts(texts, workers)))
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


def splits_at_word_ends(tokenizer) -> bool:
    """Whether `tokenizer` (a fast one) encodes a text cut at a space or line break that follows an
    ASCII letter as the concatenation of its two parts' encodings (the first with the special
    tokens, the second without): a byte-level BPE (no dropout) behind a known splitting
    pre-tokenizer (GPT-2's, Llama 3's or Qwen2's regex, digits apart or not), no normalizer but
    NFC, and no added token that holds a space or line break, or strips the whitespace beside it.
    Then no pre-tokenized piece spans the cut: the letters' piece ends at it, in the text and in its
    first part alike (no regex alternative takes a letter and what follows together, and none looks
    behind), the pieces after it start there, and NFC composes nothing across it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE" or backend.model.dropout:
        return False  # a slow tokenizer, or another model
    try:
        normalizer, pre = (json.loads(part.__getstate__()) if part is not None else None
                           for part in (backend.normalizer, backend.pre_tokenizer))
    except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception for a custom Python component)
        return False
    if (normalizer and normalizer.get("type") != "NFC") or not pre:
        return False
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits, mapped = 0, False
    for part in parts:
        kind = part.get("type")
        if kind == "ByteLevel" and not part.get("add_prefix_space"):
            splits += bool(part.get("use_regex", True))
            mapped = True  # bytes as printable characters from here on: a space is "Ġ", a letter to a regex
        elif kind == "Split" and part.get("behavior") == "Isolated" and not part.get("invert") and not mapped:
            if (part.get("pattern") or {}).get("Regex") not in SAFE_SPLIT_PATTERNS:
                return False
            splits += 1
        elif kind != "Digits":
            return False
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    return splits > 0 and not any(" " in t.content or "\n" in t.content or t.rstrip or t.lstrip or t.single_word
                                  for t in added)


_WORD_END_REVERSED = re.compile(r"[ \n][A-Za-z]")


def word_end_cut(text: str) -> int:
    """Where `text` may be cut for `splits_at_word_ends`: its last space or line break that follows
    an ASCII letter (0: none)."""
    found = _WORD_END_REVERSED.search(text[::-1])
    return len(text) - 1 - found.start() if found else 0


def encode_pairs_as_tok_encode(tokenizer, pairs, add_bos_token: bool | None, bos: str | None, check: int = 4
                               ) -> dict[str, list[int]]:
    """`HFLM.tok_encode` of the texts `_encode_pair` encodes for (context, continuation) pairs
    (`texts_to_encode`), each shared context encoded once: where the tokenizer allows it
    (`splits_at_word_ends`), a context and every context + continuation after it are cut at the
    context's last space or line break after a letter, the part before encoded once for all of
    them and the short parts after it each. A multiple-choice question's texts are then one
    prompt's tokens and not five times them. `check` of the texts are also encoded whole; should
    one differ, every text is encoded whole (with a warning), as HFLM does."""
    pairs = list(pairs)
    texts = texts_to_encode(pairs)
    special = {} if add_bos_token is None else {"add_special_tokens": add_bos_token}
    if (not splits_at_word_ends(tokenizer) or (bos and _WORD_END_REVERSED.search(bos[::-1]))  # or one that appends:
            or tokenizer("ab cd", **special)["input_ids"] != tokenizer("ab", **special)["input_ids"]
            + tokenizer(" cd", add_special_tokens=False)["input_ids"]):
        return encode_as_tok_encode(tokenizer, texts, add_bos_token, bos)
    cuts: dict[str, int] = {}
    for context, continuation in pairs:
        stripped = context.rstrip()
        cut = word_end_cut(stripped)
        if cut and (not bos or cut >= len(bos)):
            cuts.setdefault(stripped, cut)
            cuts.setdefault(context + continuation, cut)
    whole = [text for text in texts if text not in cuts]
    heads = encode_as_tok_encode(tokenizer, list(dict.fromkeys([t[:cuts[t]] for t in cuts] + whole)), add_bos_token,
                                 bos)
    tails = list(dict.fromkeys(text[cut:] for text, cut in cuts.items()))
    tails = dict(zip(tails, tokenize_on_every_core(tokenizer, tails, {"add_special_tokens": False})))
    encoded = {text: heads[text[:cut]] + tails[text[cut:]] for text, cut in cuts.items()}
    sample = list(cuts)[:: max(1, len(cuts) // check)][:check] if check else []
    if sample and encode_as_tok_encode(tokenizer, sample, add_bos_token, bos) != {t: encoded[t] for t in sample}:
        warnings.warn(f"{type(tokenizer).__name__}: encoding texts in parts at a word's end differs from encoding "
                      "them whole; every text is encoded whole (slower)", RuntimeWarning, stacklevel=2)
        return encode_as_tok_encode(tokenizer, texts, add_bos_token, bos)
    encoded.update((text, heads[text]) for text in whole)
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
