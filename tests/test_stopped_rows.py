"""Rows that stop before the others: on a CPU they leave `generate`'s decode steps (generation.py's
`_Running`), and lm-eval's `generate_until` stops each row at its own stop sequences
(lm_eval.py's `StopSequences`); transformers' tokens and lm-eval's `hf` answers either way."""

import random

import pytest
import torch
from helpers import drop_restored_methods, left_padded_batch, load_pair, stop_requests
from lm_eval.models.huggingface import HFLM, postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria

from ortmodule import load_tokenizer
from ortmodule.decoder import Decoder
from ortmodule.lm_eval import OrtModuleLM, StopSequences
from ortmodule.steps import FixedSteps

NEW_TOKENS = 24


@pytest.fixture
def step_rows(monkeypatch):
    """The rows of every decode step, in order: `Decoder.step`'s and the fixed steps' (steps.py)."""
    rows = []
    step, fixed = Decoder.step, FixedSteps.step

    def counted(self, tokens, cache, logit_index=None):
        rows.append(tokens.shape[0])
        return step(self, tokens, cache, logit_index)

    def counted_fixed(self, tokens):
        rows.append(tokens.shape[0])
        return fixed(self, tokens)

    monkeypatch.setattr(Decoder, "step", counted)
    monkeypatch.setattr(FixedSteps, "step", counted_fixed)
    return rows


def ends_at(hf, ids, mask, steps, seed=3, **options):
    """End-of-sequence ids such that row i of a free generation (greedy, or sampled under `seed`)
    ends at step `steps[i]` or before."""
    torch.manual_seed(seed)
    with torch.inference_mode():
        free = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=2,
                           **({"do_sample": False} | options))
    return sorted({int(free[row, ids.shape[1] + step]) for row, step in enumerate(steps)})


@pytest.mark.parametrize("arch", ["llama", "gemma3", "lfm2"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_stopped_rows_leave_the_decode_steps_with_transformers_tokens(build, arch, sampled, step_rows):
    """Four rows ending at different steps (dense, sliding-window and hybrid decoders): the steps run
    fewer rows once some have ended, and every token is transformers' (sampled under one seed too:
    the ended rows' draws are still made, on zeros, so the others' draws are unchanged)."""
    model, hf = load_pair(build(arch))
    ids, mask = left_padded_batch([5, 9, 7, 12], seed=6)
    sampling = dict(do_sample=sampled, **({"top_k": 20} if sampled else {}))
    eos = ends_at(hf, ids, mask, [1, 4, 8], **sampling)
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=2, eos_token_id=eos, **sampling)
    torch.manual_seed(3)
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(3)
    tokens = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(tokens, expected)
    assert (tokens[:, ids.shape[1]:] == 2).any(1).sum() >= 2  # rows ended early
    assert step_rows[0] == 4 and step_rows[-1] < 4 and step_rows == sorted(step_rows, reverse=True)


def test_rows_stay_where_the_caller_gets_the_cache(llama_pair, step_rows):
    """Rows stay in the steps where generate returns its cache (every row's, as transformers')."""
    model, hf = llama_pair
    ids, mask = left_padded_batch([5, 9, 7, 12], seed=6)
    eos = ends_at(hf, ids, mask, [1, 4, 8])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=2, eos_token_id=eos,
                         return_dict_in_generate=True)
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=2, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert out.past_key_values.batch_size == 4 and set(step_rows) == {4}


def test_rows_stay_where_no_end_of_sequence_pads_them(llama_pair, llama, step_rows):
    """Without an end-of-sequence id, a row stopped by its stop string is not padded: transformers
    writes its tokens on until every row has stopped, and so do the steps."""
    model, hf = llama_pair
    tokenizer = load_tokenizer(llama.package_dir)
    ids, mask = left_padded_batch([5, 9, 7, 12], seed=6)
    with torch.inference_mode():
        free = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    stops = [tokenizer.decode(free[row, ids.shape[1] + step]) for row, step in ((0, 1), (1, 4))]
    options = dict(max_new_tokens=NEW_TOKENS, pad_token_id=2, eos_token_id=None, stop_strings=stops,
                   tokenizer=tokenizer)
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask, **options)
    assert torch.equal(model.generate(ids, attention_mask=mask, **options), expected)
    assert set(step_rows) == {4}


def test_a_method_left_on_a_shared_decoder_is_taken_off(llama_pair):
    """What pytest before 9.2 leaves after another test's `monkeypatch.setattr(decoder, "step", ...)`, the
    bound method set back on the shared decoder, hid `step_rows`' patch of the class (every step after
    rows stopped went uncounted): conftest's autouse fixture takes such leftovers off after each test,
    and only them (an object's own replacement stays)."""
    model, _ = llama_pair
    decoder, step, counted = model.decoder, Decoder.step, []

    def counted_steps():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Decoder, "step", lambda self, *args: counted.append(1) or step(self, *args))
            decoder.step(torch.tensor([[5]]), decoder.new_cache(1, 4))
        return len(counted)

    decoder.step = decoder.step  # as pytest 8's undo
    decoder.prefill = print  # a replacement of the instance's own: not a leftover
    try:
        assert counted_steps() == 0  # hidden from the class's patch
        assert drop_restored_methods(decoder) == ["step"] and drop_restored_methods(model) == []
        assert counted_steps() == 1 and decoder.prefill is print
    finally:
        vars(decoder).pop("step", None), vars(decoder).pop("prefill")


@pytest.fixture(scope="module")
def llama_pair(llama):
    return load_pair(llama)


@pytest.fixture(scope="module")
def lms(llama):
    ours = OrtModuleLM(pretrained=str(llama.package_dir), batch_size=4)
    theirs = HFLM(pretrained=str(llama.hf_dir), dtype="float32", batch_size=4, device="cpu")
    return ours, theirs


def test_generate_until_stops_rows_early_with_hfs_answers(lms, step_rows, monkeypatch):
    """lm-eval requests whose rows write different stop sequences, neither of them every row: the
    answers are the `hf` backend's, and the rows stop early: fewer steps, and fewer rows in them, than
    with lm-eval's own criteria (a batch runs until one sequence has been written by every row)."""
    ours, theirs = lms
    requests, free = stop_requests(theirs, seed=4)
    expected = theirs.generate_until(requests, disable_tqdm=True)
    step_rows.clear()
    assert ours.generate_until(requests, disable_tqdm=True) == expected
    assert all(len(a) < len(b) for a, b in zip(expected, free))  # every answer cut by a stop sequence
    stopped_each = list(step_rows)
    step_rows.clear()
    monkeypatch.setattr(ours, "_model_generate", HFLM._model_generate.__get__(ours))  # lm-eval's own criteria
    assert ours.generate_until(requests, disable_tqdm=True) == expected
    assert len(stopped_each) < len(step_rows) and sum(stopped_each) < sum(step_rows) * 0.7


STOPS = [["\n\n", "Question:"], ["Question:", "on"], ["."], ["\n", "ab"], ["", "x y"]]
PIECES = ["one", " two", "\n", "\n\n", ".", " Question", ":", " on", "ab", " x", " y", "Questi"]


def stream(tokenizer, rng: random.Random, pieces=PIECES, count: int = 40) -> list[int]:
    return tokenizer("".join(rng.choice(pieces) for _ in range(count)), add_special_tokens=False).input_ids


def stopped_at(criterion, streams: list[list[int]], pad: int) -> tuple[list[int | None], int | None]:
    """Feed `criterion` the streams a token a step (a row stopped gets `pad` after, as generate writes
    it): each row's step of stopping (None: never), and the step where all had (None: never)."""
    rows, at, written = len(streams), [None] * len(streams), [[0] for _ in streams]  # one prompt token
    for step in range(max(map(len, streams))):
        for row in range(rows):
            written[row].append(streams[row][step] if at[row] is None and step < len(streams[row]) else pad)
        stopped = criterion(torch.tensor(written), None)
        at = [at[row] if at[row] is not None or not stopped[row] else step + 1 for row in range(rows)]
        if all(a is not None for a in at):
            return at, step + 1
    return at, None


@pytest.mark.parametrize("seed", range(40))
def test_a_row_stops_only_once_its_answer_is_fixed(lms, seed):
    """Random streams of words, newlines and stop sequences (one a piece of another, so that cutting at
    one sequence then the next depends on which comes first), beside a row that writes none: wherever
    `StopSequences` stops the row, lm-eval's answer from its text so far (pad tokens after) is its
    answer from the whole stream."""
    ours, _ = lms
    tokenizer, rng = ours.tokenizer, random.Random(seed)
    stops, pad = rng.choice([s for s in STOPS if "" not in s]), 2  # an empty one stops every row at once
    row, other = stream(tokenizer, rng), stream(tokenizer, rng, [" zz", " w"])
    answer = postprocess_generated_text(ours.tok_decode(row), stops, None)
    at, _ = stopped_at(StopSequences(ours, stops, 1, 2), [row, other], pad)
    assert at[1] is None
    if at[0] is not None:
        padded = row[: at[0]] + [pad] * (len(row) - at[0])
        assert postprocess_generated_text(ours.tok_decode(padded), stops, None) == answer, (stops, at[0])
    elif any(s and s in ours.tok_decode(row)[: -StopSequences(ours, stops, 1, 1).margin] for s in stops):
        pytest.fail(f"never stopped, though a stop sequence was written well before the end: {stops}")


@pytest.mark.parametrize("seed", range(40))
def test_a_batch_never_runs_longer_than_under_lm_evals_criteria(lms, seed):
    """Batches of 1-4 random streams: `StopSequences` has stopped every row by the step at which
    lm-eval's own criteria (`stop_sequences_criteria`) stop the batch."""
    ours, _ = lms
    tokenizer, rng = ours.tokenizer, random.Random(100 + seed)
    stops, rows = rng.choice(STOPS), rng.randint(1, 4)
    streams = [stream(tokenizer, rng, count=rng.randint(5, 40)) for _ in range(rows)]
    longest = max(map(len, streams))
    streams = [s + stream(tokenizer, rng, [" zz"], longest) for s in streams]  # a row that ended goes on
    theirs = stop_sequences_criteria(tokenizer, stops, 1, rows)
    _, ours_at = stopped_at(StopSequences(ours, stops, 1, rows), streams, 2)
    _, theirs_at = stopped_at(theirs, streams, 2)  # a tensor of the batch's one answer, every row alike
    if theirs_at is not None:
        assert ours_at is not None and ours_at <= theirs_at, (stops, ours_at, theirs_at)


def test_a_thinking_models_task_keeps_lm_evals_criteria(lms, monkeypatch):
    """With `think_end_token` the stop sequences apply to the text after the thinking, which a row has
    not written when it first writes one: lm-eval's own `_model_generate` runs, its criteria with it."""
    ours, _ = lms
    called = []
    monkeypatch.setattr(HFLM, "_model_generate", lambda lm, *args, **kwargs: called.append(kwargs) or "theirs")
    monkeypatch.setattr(ours, "think_end_token", "</think>")
    context = torch.tensor([[5, 6, 7]])
    assert ours._model_generate(context, max_length=8, stop=["\n"]) == "theirs" and len(called) == 1
    monkeypatch.setattr(ours, "think_end_token", None)
    assert ours._model_generate(context, max_length=5, stop=["\n"]).shape[0] == 1 and len(called) == 1
