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


def rests_run_together(monkeypatch) -> list[int]:
    """The batches whose rests generate runs in one extend run (shared_prompts.prefill's `_rests_together`):
    each one's rows."""
    seen, together = [], shared_prompts._rests_together

    def counted(extender, rows, *args):
        assert extender.layout == "cache"
        seen.append(rows.ids.shape[0])
        return together(extender, rows, *args)

    monkeypatch.setattr(shared_prompts, "_rests_together", counted)
    return seen


def one_way(monkeypatch, way: str) -> None:
    """The rests run `way`: "together" where that pays (the default), or "apart" (a run a row) always."""
    if way == "apart":
        monkeypatch.setattr(shared_prompts, "EXTEND_TOKENS", 10**9)


def beginning_run_once(model, ids, mask) -> int:
    rows = check_batch(ids, mask, model.decoder.vocab_size, model.decoder.package.context_length, model.device)
    width = rows.ids.shape[1]
    last = torch.arange(ids.shape[0]) * width + rows.lengths - 1
    return shared_prompts.way(model.decoder, rows, last, model.decoder.new_cache(ids.shape[0], width))[0]


@pytest.mark.parametrize("way", ["together", "apart"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompts_beginning_alike_generate_what_transformers_does(build, arch, way, monkeypatch):
    """A batch whose rows share 100 tokens, then 1-17 of their own: the beginning runs once (one row),
    the rests over copies of its KV, all in one extend run (cheaper here) or a run a row, and greedy
    decoding gives transformers' tokens and first logits."""
    model, hf = load_pair(build(arch))
    one_way(monkeypatch, way)
    ids, mask = prompts_beginning_alike(100, [1, 9, 17, 4], seed=5)
    assert beginning_run_once(model, ids, mask) == 100
    alone, together = rows_run_alone(monkeypatch), rests_run_together(monkeypatch)
    out = greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    assert (alone, together) == (([], [4]) if way == "together" else ([0, 1, 2, 3], []))
    expected = greedy(hf, ids, mask, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert (out.logits[0] - expected.logits[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("way,chunk,rests", [("apart", 16, [40, 3, 22]), ("together", None, [9, 3, 12, 5])])
def test_the_beginning_run_once_gives_the_whole_prompts_cache(llama, monkeypatch, way, chunk, rests):
    """Against ortmodule's own prefill of the whole prompts: the same tokens, every step's logits
    within float32 rounding, and the same cache after (each row's entries), also with the decode steps'
    fixed buffers lent twice in a row: the rests a run a row, with chunks (a beginning and rests longer
    than `prefill_chunk`, which one run does not take), and all in one extend run (through a cache as
    wide as the prompts, then the generation's wider one)."""
    kwargs = {} if chunk is None else {"prefill_chunk": chunk}
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir, **kwargs)
    ids, mask = prompts_beginning_alike(70, rests, seed=6)
    # a column of padding in every row: the caller's columns (the cache's length) are one more than the longest row's
    ids, mask = torch.cat([torch.full_like(ids[:, :1], 2), ids], 1), torch.cat([torch.zeros_like(mask[:, :1]), mask], 1)
    assert beginning_run_once(model, ids, mask) == 70
    alone, together = rows_run_alone(monkeypatch), rests_run_together(monkeypatch)
    runs = [greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True) for _ in range(2)]
    ran = ([], [len(rests)] * 2) if way == "together" else (list(range(len(rests))) * 2, [])
    assert (alone, together) == ran
    monkeypatch.setattr(shared_prompts, "RUN_TOKENS", 10**9)  # never pays: the whole prompts' prefill
    monkeypatch.setattr(shared_prompts, "EXTEND_TOKENS", 10**9)
    assert beginning_run_once(model, ids, mask) == 0
    whole = greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    assert (alone, together) == ran
    for out in runs:
        assert torch.equal(out.sequences, whole.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, whole.logits)) < 1e-4
        cache, cache_whole = getattr(out, CACHE_NAME), getattr(whole, CACHE_NAME)
        assert torch.equal(cache.lengths, cache_whole.lengths)
        assert cache.get_seq_length() == cache_whole.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1
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
    padding = (9 - 2) + (9 - 5) + (9 - 7)  # spared by a run a row, with the beginning in three rows
    assert runs > 30 * 3 + padding and shared_prompts.EXTEND_TOKENS > 30 * 3  # one run spares no padding
    assert beginning_run_once(model, *prompts_beginning_alike(30, [5, 7, 9, 2], seed=7)) == 0
    assert runs < 80 * 3 + padding
    assert beginning_run_once(model, *prompts_beginning_alike(80, [5, 7, 9, 2], seed=7)) == 80
    # Between them: one run pays where a run a row does not, and only for rests the prefill chunk holds.
    assert shared_prompts.EXTEND_TOKENS < 40 * 3 < runs - padding
    assert beginning_run_once(model, *prompts_beginning_alike(40, [5, 7, 9, 2], seed=7)) == 40
    chunked = OrtModelForCausalLM.from_pretrained(llama.package_dir, prefill_chunk=8)
    assert beginning_run_once(chunked, *prompts_beginning_alike(40, [5, 7, 9, 2], seed=7)) == 0
    assert beginning_run_once(model, *prompts_beginning_alike(0, [90, 90, 90], seed=7)) == 0
    assert beginning_run_once(model, *prompts_beginning_alike(200, [5], seed=7)) == 0
    hybrid = OrtModelForCausalLM.from_pretrained(build("lfm2").package_dir)
    assert beginning_run_once(hybrid, *prompts_beginning_alike(100, [5, 7, 9], seed=7)) == 0


@pytest.mark.parametrize("way", ["together", "apart"])
def test_a_kept_beginning_serves_the_next_batches(build, monkeypatch, way):
    """Within `shared_prompts.keeping` (lm-eval's `generate_until`), batches whose prompts begin with the
    beginning an earlier batch ran start from its kept cache: the same beginning, a longer one (each row
    runs the few tokens past it), a shorter one; a beginning that shares too little, or whose kept cache
    would not fit the batch's, runs its own (and is kept). Every batch generates transformers' tokens,
    with the rests in one extend run and a run a row."""
    model, hf = load_pair(build("llama"))
    one_way(monkeypatch, way)
    together = rests_run_together(monkeypatch)
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
    assert together == ([4] * 7 if way == "together" else [])
    ids, mask = batches[1]
    greedy(model, ids, mask)
    assert kept.reused == 4  # outside `keeping`, nothing kept is used


def test_without_a_writing_extender_the_rests_run_a_row_at_a_time(llama, monkeypatch):
    """Where the extend graph's cache layout cannot be made for a package (`writing_extender` None: its
    graph does not match, or its check failed), one run is not taken: a run a row where that pays, else
    the whole prompts, and the tokens are the same."""
    from ortmodule import extend

    model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    pays_together = prompts_beginning_alike(40, [5, 7, 9, 2], seed=7)  # one run pays, a run a row does not
    pays_apart = prompts_beginning_alike(100, [1, 9, 17, 4], seed=5)
    expected = [greedy(model, *prompts) for prompts in (pays_together, pays_apart)]
    monkeypatch.setattr(extend, "writing_extender", lambda decoder: None)
    assert beginning_run_once(model, *pays_together) == 0
    assert beginning_run_once(model, *pays_apart) == 100
    alone, together = rows_run_alone(monkeypatch), rests_run_together(monkeypatch)
    got = [greedy(model, *prompts) for prompts in (pays_together, pays_apart)]
    assert (alone, together) == ([0, 1, 2, 3], [])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))

