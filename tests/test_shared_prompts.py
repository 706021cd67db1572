"""generate() on prompts that begin alike (shared_prompts.py): the common beginning run once on a
CPU, against transformers' generate and ortmodule's own whole-prompt prefill on the same weights."""

import pytest
import torch
from helpers import load_pair

from ortmodule import OrtModelForCausalLM, shared_prompts
from ortmodule.hf import CACHE_NAME
from ortmodule.inputs import check_batch

NEW_TOKENS = 12


def prompts_beginning_alike(beginning: int, rests: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of a common `beginning` and rests of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randint(4, 500, (beginning,), generator=generator).tolist()
    rows = [common + torch.randint(4, 500, (n,), generator=generator).tolist() for n in rests]
    width = max(map(len, rows))
    ids = torch.tensor([[2] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def greedy(model, ids, mask, **kwargs):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2,
                              **kwargs)


def rows_run_alone(monkeypatch) -> list[int]:
    """The rows whose rest generate runs over a copy of the beginning's KV (shared_prompts.prefill's views)."""
    seen, view = [], shared_prompts.rows_view

    def counted(cache, start, stop, longest):
        seen.append(start)
        return view(cache, start, stop, longest)

    monkeypatch.setattr(shared_prompts, "rows_view", counted)
    return seen


def beginning_run_once(model, ids, mask) -> int:
    rows = check_batch(ids, mask, model.decoder.vocab_size, model.decoder.package.context_length, model.device)
    width = rows.ids.shape[1]
    last = torch.arange(ids.shape[0]) * width + rows.lengths - 1
    return shared_prompts.wanted(model.decoder, rows, last, model.decoder.new_cache(ids.shape[0], width))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompts_beginning_alike_generate_what_transformers_does(build, arch, monkeypatch):
    """A batch whose rows share 100 tokens, then 1-17 of their own: the beginning runs once (one row),
    each rest over a copy of its KV, and greedy decoding gives transformers' tokens and first logits."""
    model, hf = load_pair(build(arch))
    ids, mask = prompts_beginning_alike(100, [1, 9, 17, 4], seed=5)
    assert beginning_run_once(model, ids, mask) == 100
    alone = rows_run_alone(monkeypatch)
    out = greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    assert alone == [0, 1, 2, 3]
    expected = greedy(hf, ids, mask, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.logits[0] - expected.logits[0]).abs().max().item() < 1e-4


def test_the_beginning_run_once_gives_the_whole_prompts_cache(llama, monkeypatch):
    """Against ortmodule's own prefill of the whole prompts: the same tokens, every step's logits
    within float32 rounding, and the same cache after, also with chunks (a beginning and rests
    longer than `prefill_chunk`) and with the decode steps' fixed buffers lent twice in a row."""
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir, prefill_chunk=16)
    ids, mask = prompts_beginning_alike(70, [40, 3, 22], seed=6)
    assert beginning_run_once(model, ids, mask) == 70
    alone = rows_run_alone(monkeypatch)
    runs = [greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True) for _ in range(2)]
    assert alone == [0, 1, 2] * 2
    monkeypatch.setattr(shared_prompts, "RUN_TOKENS", 10**9)  # never pays: the whole prompts' prefill
    assert beginning_run_once(model, ids, mask) == 0
    whole = greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    assert alone == [0, 1, 2] * 2
    for out in runs:
        assert torch.equal(out.sequences, whole.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, whole.logits)) < 1e-4
        cache, cache_whole = getattr(out, CACHE_NAME), getattr(whole, CACHE_NAME)
        assert torch.equal(cache.lengths, cache_whole.lengths)
        for layer, whole_layer in zip(cache, cache_whole):  # each row's entries (past them: padding's)
            for mine, theirs in zip(layer, whole_layer):
                for row, length in enumerate(cache.lengths.tolist()):
                    assert (mine[row, :, :length] - theirs[row, :, :length]).abs().max().item() < 1e-4


def test_the_beginning_runs_once_only_where_it_pays_and_can(build, llama):
    """Not where the tokens spared (the beginning in all rows but one, the batch's padding) do not
    outweigh a run per row, for rows that differ from the first token, one row, or a hybrid decoder
    (its convolution states start only from whole rows)."""
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    runs = shared_prompts.RUN_TOKENS * 4  # what four rows' runs cost, in prompt tokens
    assert runs > 30 * 3 + (9 - 2) + (9 - 5) + (9 - 7)  # the beginning, three times, and the padding spared
    assert beginning_run_once(model, *prompts_beginning_alike(30, [5, 7, 9, 2], seed=7)) == 0
    assert runs < 80 * 3 + (9 - 2) + (9 - 5) + (9 - 7)
    assert beginning_run_once(model, *prompts_beginning_alike(80, [5, 7, 9, 2], seed=7)) == 80
    assert beginning_run_once(model, *prompts_beginning_alike(0, [90, 90, 90], seed=7)) == 0
    assert beginning_run_once(model, *prompts_beginning_alike(200, [5], seed=7)) == 0
    hybrid = OrtModelForCausalLM.from_pretrained(build("lfm2").package_dir)
    assert beginning_run_once(hybrid, *prompts_beginning_alike(100, [5, 7, 9], seed=7)) == 0


def test_a_kept_beginning_serves_the_next_batches(build, monkeypatch):
    """Within `shared_prompts.keeping` (lm-eval's `generate_until`), batches whose prompts begin with the
    beginning an earlier batch ran start from its kept cache: the same beginning, a longer one (each row
    runs the few tokens past it), a shorter one; a beginning that shares too little, or whose kept cache
    would not fit the batch's, runs its own (and is kept). Every batch generates transformers' tokens."""
    model, hf = load_pair(build("llama"))
    generator = torch.Generator().manual_seed(8)
    examples = torch.randint(4, 500, (100,), generator=generator).tolist()
    other = torch.randint(4, 500, (90,), generator=generator).tolist()

    def batch(beginning, rests):
        rows = [beginning + torch.randint(4, 500, (n,), generator=generator).tolist() for n in rests]
        width = max(map(len, rows))
        return (torch.tensor([[2] * (width - len(row)) + row for row in rows]),
                torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows]))

    batches = [batch(examples, [5, 9, 3, 7]), batch(examples, [7, 2, 11, 4]), batch(examples + [7, 8, 9], [4, 6, 1, 2]),
               batch(examples[:85], [3, 8, 5, 6]), batch(examples[:70], [1, 2, 3, 1]), batch(other, [6, 2, 9, 4]),
               batch(other, [3, 5, 2, 7])]
    reused = []
    with shared_prompts.keeping(shared_prompts.KeptBeginning()) as kept:
        for ids, mask in batches:
            assert beginning_run_once(model, ids, mask) > 0
            before = kept.reused
            assert torch.equal(greedy(model, ids, mask), greedy(hf, ids, mask))
            reused.append(kept.reused - before)
    # The 5th's cache (73 + 12 columns) cannot take the 100 kept columns; the 6th shares nothing kept.
    assert reused == [0, 1, 1, 1, 0, 0, 1]
    ids, mask = batches[1]
    greedy(model, ids, mask)
    assert kept.reused == 4  # outside `keeping`, nothing kept is used
