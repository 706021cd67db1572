"""Long rows run one at a time in chunks over their own cache (chunked.py, on by default on a
CPU for rows of two chunks or more): the logits of one prefill, transformers' logits, the same
generations, and lm-eval's answers as its `hf` backend's."""

import pytest
import torch
from helpers import MODEL_ARCHES, load_pair, right_padded_batch

from ortmodule import OrtModelForCausalLM, chunked, scoring
from ortmodule.inputs import Rows

CHUNK = 4  # small enough that the fixtures' short rows run in several chunks


def whole_rows(ids):
    return Rows(ids, None, torch.full((ids.shape[0],), ids.shape[1]), ids.shape[1])


def counting_steps(model, monkeypatch):
    """Count the decoder's steps: a chunked prefill runs its second and later chunks as steps."""
    calls = []
    step = model.decoder.step
    monkeypatch.setattr(model.decoder, "step", lambda *a, **k: calls.append(a[0].shape) or step(*a, **k))
    return calls


@pytest.mark.parametrize("arch", MODEL_ARCHES)
def test_chunks_give_the_logits_of_one_prefill(build, arch, monkeypatch):
    """Right- and left-padded rows, every position and the last three: the chunked run's logits
    equal the unchunked run's and transformers' on the real positions."""
    fixture = build(arch)
    plain, hf = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=CHUNK)
    steps = counting_steps(model, monkeypatch)
    ids, mask = right_padded_batch([21, 13, 6], seed=7)
    for layout in (mask, mask.flip(1)):
        real = layout.bool()
        with torch.no_grad():
            expected = hf(input_ids=ids, attention_mask=layout).logits
        for keep in (None, 3):
            logits = model(ids, attention_mask=layout, cont_len=keep).logits
            unchunked = plain(ids, attention_mask=layout, cont_len=keep).logits
            part = real[:, -keep:] if keep else real
            assert (logits - unchunked)[part].abs().max().item() < 1e-5
            assert (logits - (expected[:, -keep:] if keep else expected))[part].abs().max().item() < 1e-4
    assert steps and all(shape[0] == 1 and shape[1] <= CHUNK for shape in steps)


def test_rows_run_only_as_far_as_asked(build, monkeypatch):
    """Logits asked at the first positions only: the row stops there (later tokens cannot change
    them), and a row asked nothing does not run."""
    fixture = build("llama")
    plain, _ = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=CHUNK)
    steps = counting_steps(model, monkeypatch)
    ids, _ = right_padded_batch([24, 24], seed=8)
    asked = torch.tensor([0, 8, 9])  # row 0, columns 0, 8 and 9; nothing of row 1
    got = model.decoder.prefill(whole_rows(ids), asked)
    expected = plain.decoder.prefill(whole_rows(ids), asked)
    assert torch.equal(got, expected)
    assert len(steps) == 2  # columns 4-7 and 8-9: the row ran 10 tokens, not 24, and row 1 none


def test_positions_asked_out_of_row_order(build):
    """Positions asked in any order, rows interleaved and a column asked twice: each row's logits
    land where they were asked (a row's chunk is written as one slice where its places are
    consecutive, by index where they are not), as one unchunked prefill gives them."""
    fixture = build("llama")
    plain, _ = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=CHUNK)
    ids, _ = right_padded_batch([20, 20], seed=10)
    width = ids.shape[1]
    for asked in ([width + 5, 3, width + 9, 10, 11, 12, width + 9],  # rows interleaved: places 1, 3, 4, 5 of row 0
                  [width + 2, width + 3, width + 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]):  # consecutive places per row
        asked = torch.tensor(asked)
        got = model.decoder.prefill(whole_rows(ids), asked)
        assert (got - plain.decoder.prefill(whole_rows(ids), asked)).abs().max().item() < 1e-5


def test_scores_come_chunk_by_chunk(build, monkeypatch):
    """Every position of long rows scored (rolling documents): the logits reach the totals a chunk at
    a time, never as one `[positions, V]` buffer, and the totals and greedy misses are transformers'
    log-softmax over the same rows (and the unchunked run's)."""
    fixture = build("llama")
    plain, hf = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=CHUNK)
    lengths = [21, 13, 6]
    ids, mask = right_padded_batch(lengths, seed=11)
    targets = [ids[i, 1:n].tolist() for i, n in enumerate(lengths)]  # each row's next tokens, every position
    pieces = []
    add = scoring._Totals.add
    monkeypatch.setattr(scoring._Totals, "add",
                        lambda self, logits, *a: pieces.append(len(logits)) or add(self, logits, *a))
    got = scoring.loglikelihood_totals(model, ids, mask, [0, 0, 0], targets)
    assert max(pieces) <= CHUNK and sum(pieces) == sum(len(t) for t in targets)
    with torch.no_grad():
        log_probs = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits.double(), -1)
    for i, row in enumerate(targets):
        picked = log_probs[i, torch.arange(len(row)), torch.tensor(row)]
        missed = (log_probs[i, : len(row)].argmax(-1) != torch.tensor(row)).sum().item()
        assert abs(got[0, i].item() - picked.sum().item()) < 1e-3 and got[1, i].item() == missed
    pieces.clear()
    unchunked = scoring.loglikelihood_totals(plain, ids, mask, [0, 0, 0], targets)
    assert pieces == [sum(len(t) for t in targets)]  # one piece: the rows run whole
    assert (got - unchunked).abs().max().item() < 1e-4


def test_logits_at_in_pieces(build):
    """`logits_at(..., pieces=...)` hands every asked position's logits over once, in pieces of a
    chunk where the rows run in chunks, at once where they do not: the logits `logits_at` returns."""
    fixture = build("llama")
    plain, _ = load_pair(fixture)
    ids, mask = right_padded_batch([20, 20], seed=12)
    rows, cols = torch.tensor([1, 0, 0, 1, 1]), torch.tensor([1, 17, 2, 19, 2])  # row 1: columns 1 and 2 in one chunk
    for model, most in ((OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=CHUNK), 2),
                        (plain, 5)):
        whole = model.logits_at(ids, mask, rows, cols)
        assembled, sizes = torch.full_like(whole, float("nan")), []

        def put(places, logits, assembled=assembled, sizes=sizes):
            sizes.append(len(logits))
            assembled[places if places is not None else slice(None)] = logits
            return "a value that is not passed on"

        assert model.logits_at(ids, mask, rows, cols, pieces=put) is None
        assert torch.equal(assembled, whole) and max(sizes) == most and sum(sizes) == len(rows)


def test_generate_from_a_chunked_prompt(build, monkeypatch):
    """A one-row prompt fills generate's cache chunk by chunk; the greedy tokens are transformers'."""
    fixture = build("qwen3")
    plain, hf = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=CHUNK)
    prompt = right_padded_batch([15], seed=9)[0]
    steps = counting_steps(model, monkeypatch)
    ours = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert any(shape[1] > 1 for shape in steps)  # the prompt's chunks
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, plain.generate(prompt, max_new_tokens=6, do_sample=False))


def test_chunk_defaults_and_bad_values(build):
    """256 tokens on a CPU, off for sliding-window packages and when asked (0); a chunk that is
    not a non-negative number is refused by name."""
    assert OrtModelForCausalLM.from_pretrained(build("llama").package_dir).decoder.prefill_chunk == chunked.CPU_CHUNK
    assert OrtModelForCausalLM.from_pretrained(build("gemma3").package_dir).decoder.prefill_chunk == 0
    assert OrtModelForCausalLM.from_pretrained(build("llama").package_dir, prefill_chunk=0).decoder.prefill_chunk == 0
    for bad in (-1, 2.5, "64", True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            OrtModelForCausalLM.from_pretrained(build("llama").package_dir, prefill_chunk=bad)
