"""ortmodule.score (SGLang's Generative Score API) against transformers on the same weights."""

import weakref

import pytest
import torch
from helpers import MODEL_ARCHES, labels_for, load_pair
from helpers import SCORE_ITEMS as ITEMS
from helpers import SCORE_QUERY as QUERY
from helpers import score_reference as reference

import ortmodule
from ortmodule import costs, load_tokenizer, scoring, sharing


@pytest.mark.parametrize("arch", MODEL_ARCHES)
@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_scores_match_transformers(build, arch, apply_softmax, item_first):
    fixture = build(arch)
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    labels = labels_for(tokenizer)
    expected = reference(hf, tokenizer, QUERY, ITEMS, labels, apply_softmax, item_first)
    for reuse in (False, True):
        got = ortmodule.score(model, tokenizer, QUERY, ITEMS, labels, apply_softmax, item_first, reuse_prefix=reuse)
        assert len(got) == len(ITEMS) and all(len(row) == len(labels) for row in got)
        assert (torch.tensor(got, dtype=torch.float64) - expected).abs().max().item() < 1e-5, reuse
    if apply_softmax:
        assert torch.allclose(torch.tensor(got).sum(-1), torch.ones(len(ITEMS)), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("item_first", [False, True])
def test_token_scores_match_transformers_in_small_batches(build, arch, item_first):
    fixture = build(arch)
    model, hf = load_pair(fixture)
    gen = torch.Generator().manual_seed(3)
    query = torch.randint(4, 512, (30,), generator=gen).tolist()
    items = [torch.randint(4, 512, (n,), generator=gen).tolist() for n in (1, 7, 3, 12, 5, 2)]
    labels = [7, 8, 9, 100]
    for apply_softmax in (False, True):
        expected = reference(hf, None, query, items, labels, apply_softmax, item_first)
        # A budget this small splits the items over several batches (longest first, order kept).
        for reuse in (None, False, True):
            got = ortmodule.score(model, None, query, items, labels, apply_softmax, item_first,
                                  token_budget=60, reuse_prefix=reuse)
            assert (torch.tensor(got, dtype=torch.float64) - expected).abs().max().item() < 1e-5


def test_a_long_query_is_prefilled_once_for_all_its_runs(llama, monkeypatch):
    """Items over several runs (a token budget a few items fill, the query counted in each row) start from
    the query's KV the first run prefilled (`sharing.KeptPrefixes`), where every run prefilled the query
    again: a 2,000-token query with 64 items of 5 tokens took 58 s on SmolLM2 on a 2-vCPU EPYC, 6 s now.
    The scores equal transformers'."""
    from ortmodule.decoder import Decoder
    model, hf = load_pair(llama)
    gen = torch.Generator().manual_seed(8)
    query = torch.randint(4, 512, (100,), generator=gen).tolist()
    items = [torch.randint(4, 512, (n,), generator=gen).tolist() for n in (3, 5, 1, 4, 2, 6, 3, 5, 2, 4, 1, 3)]
    labels = [7, 8, 9]
    widths, prefill = [], Decoder.prefill

    def counted(decoder, rows, *args, **kwargs):
        widths.append(rows.ids.shape[1])
        return prefill(decoder, rows, *args, **kwargs)

    model.decoder.extender()  # made (and checked, with a prefill of its own) before the count
    monkeypatch.setattr(Decoder, "prefill", counted)
    got = ortmodule.score(model, None, query, items, labels, apply_softmax=True, token_budget=320, reuse_prefix=True)
    assert widths == [100], widths  # the query's prefill, once; the runs after it (4 items at most each) extend it
    expected = reference(hf, None, query, items, labels, True, False)
    assert (torch.tensor(got, dtype=torch.float64) - expected).abs().max().item() < 1e-5


def test_one_text_item_may_be_given_as_a_string(llama):
    """As in SGLang: `items="..."` is one item."""
    model, hf = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    labels = labels_for(tokenizer)
    got = ortmodule.score(model, tokenizer, QUERY, ITEMS[1], labels)
    assert got == ortmodule.score(model, tokenizer, QUERY, [ITEMS[1]], labels)
    expected = reference(hf, tokenizer, QUERY, [ITEMS[1]], labels, False, False)
    assert (torch.tensor(got, dtype=torch.float64) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("apply_softmax, temperature", [(False, 1.0), (True, 1.0), (True, 0.25)])
def test_a_label_list_per_item_and_a_temperature_match_transformers(llama, apply_softmax, temperature):
    """As SGLang 0.5.23 takes them: a list of labels per item (of different lengths), and `temperature`
    dividing the label log-probabilities before the softmax over them."""
    model, hf = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    labels = [[5, 300], [7, 8, 9], [10], [11, 12]]
    got = ortmodule.score(model, tokenizer, QUERY, ITEMS, labels, apply_softmax=apply_softmax,
                          temperature=temperature)
    for item, own, scores in zip(ITEMS, labels, got, strict=True):
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(tokenizer(QUERY + item, return_tensors="pt").input_ids).logits[0, -1]
                                         .double(), -1)[own]
        expected = torch.softmax(logprobs / temperature, -1) if apply_softmax else logprobs.exp()
        assert len(scores) == len(own) and max(abs(a - b) for a, b in zip(scores, expected.tolist())) < 1e-5


def test_shared_prefix_reuse_is_chosen_only_where_it_saves_work():
    long_query = list(range(100, 160))
    def last(prompts):  # score reads each prompt's last position
        return [len(p) - 1 for p in prompts]

    assert sharing.common_prefix([long_query + [1, 2], long_query + [1, 3]]) == 61
    prompts = [long_query + [1, 2], long_query + [3]]
    assert sharing.worth_sharing(prompts, last(prompts))
    assert not sharing.worth_sharing([long_query + [1, 2]], [61])  # one item: nothing to share
    prompts = [[5, 1, 2, 3], [5, 4, 5, 6]]
    assert not sharing.worth_sharing(prompts, last(prompts))  # item_first: only BOS shared


def test_rows_that_share_no_token_are_never_shared(llama, monkeypatch):
    """Costs under which an extend token is cheaper than a prefill token (a noisy measurement of a
    model whose runs cost their launches) chose to run a prefix of no tokens once for a score request
    whose items come first, and the server answered 500 ("the rows of group 0 do not start with the
    same token"): rows that share no token are never shared, and such a request is scored whole."""
    cheap_extends = costs.Costs(per_token=1e-3, step=1e-3, step_per_row=1e-4, extend_per_token=1e-5,
                                extend_per_score=0.0, extend_fixed=0.0)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert not sharing.worth_sharing(prompts, [3, 3], cheap_extends)
    assert sharing.worth_sharing([[9, 1, 2, 3], [9, 4, 5, 6]], [3, 3], cheap_extends)  # one token shared
    model, _ = load_pair(llama)
    monkeypatch.setattr(model, "measured_costs", lambda refresh=False, measure=True: cheap_extends)
    assert scoring.prefix_reuse(model, [prompts], 64, None) == [False]
    whole = scoring.label_logprobs(model, [prompts], [1, 2], 64, [False])
    assert torch.equal(scoring.label_logprobs(model, [prompts], [1, 2], 64, None), whole)
    # A choice given per request (the server's list) to reuse a prefix that is not there: scored whole.
    assert torch.equal(scoring.label_logprobs(model, [prompts], [1, 2], 64, [True]), whole)


def test_small_calls_are_scored_without_timing_the_costs(llama, monkeypatch):
    """Timing the costs takes seconds to minutes the first time on a machine (23 s for SmolLM2-135M on
    2 vCPUs), more than a few small calls' runs take whichever way they go: calls whose prompts share
    no prefix (one item; items that begin differently after no query) never time them, calls decide by
    token counts until the model's calls have held `UNTIMED_TOKENS` tokens, then the costs are timed,
    and once the model has them every call uses them. The answers are the same either way."""
    model, _ = load_pair(llama)
    asked, have = [], [None]
    cheap_extends = costs.Costs(per_token=1e-3, step=1e-3, step_per_row=1e-4, extend_per_token=1e-5,
                                extend_per_score=0.0, extend_fixed=0.0)

    def measured_costs(refresh=False, measure=True):
        asked.append(measure)
        if measure:
            have[0] = cheap_extends
        return have[0]

    monkeypatch.setattr(model, "measured_costs", measured_costs)
    monkeypatch.setattr(scoring, "UNTIMED_TOKENS", 30)
    monkeypatch.setattr(scoring, "_untimed_tokens", weakref.WeakKeyDictionary())  # the model's calls in other tests
    one = ortmodule.score(model, None, [5, 6, 7], [[8, 9]], [1, 2])
    apart = ortmodule.score(model, None, [], [[8, 9], [10, 11, 12]], [1, 2])
    assert asked == []
    expected = [scoring.label_logprobs(model, [[[5, 6, 7, 8, 9]]], [1, 2], 64, [False]),
                scoring.label_logprobs(model, [[[8, 9], [10, 11, 12]]], [1, 2], 64, [False])]
    for got, want in zip((one, apart), expected):
        assert torch.allclose(torch.tensor(got).log(), want.cpu(), atol=1e-5)
    # A query of 3 tokens before items of 1: by token counts, worth running once (8 tokens so far).
    assert scoring.prefix_reuse(model, [[[5, 6, 7, 8], [5, 6, 7, 9]]], 64, None) == [True] and asked == [False]
    # With items of 4 tokens: not worth it by token counts (22 tokens so far), worth it by these costs.
    longer = [[[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12, 13, 14, 15]]]
    assert scoring.prefix_reuse(model, longer, 64, None) == [False] and asked == [False, False]
    assert scoring.prefix_reuse(model, longer, 64, None) == [True] and asked[-2:] == [False, True]  # 36: timed
    assert scoring.prefix_reuse(model, longer, 64, None) == [True] and asked[-1] is False  # now the model has them
    got = ortmodule.score(model, None, [5, 6, 7], [[8, 9, 10, 11], [12, 13, 14, 15]], [1, 2])
    want = scoring.label_logprobs(model, longer, [1, 2], 64, [False])
    assert torch.allclose(torch.tensor(got).log(), want.cpu(), atol=1e-5)


def test_sharing_is_decided_from_the_measured_costs(llama):
    """A short prefix with long remainders loses when each decode step costs ~20 prefill tokens (a
    small model on a CPU); a long prefix wins; the costs are measured once per device and kept."""
    cpu_like = costs.Costs(per_token=1.2e-3, step=24e-3, step_per_row=3e-3)
    short = [list(range(100, 120)) + list(range(10 * i, 10 * i + 10)) for i in range(1, 5)]
    assert not sharing.worth_sharing(short, [len(r) - 10 for r in short], cpu_like)
    assert sharing.worth_sharing(short, [len(r) - 10 for r in short])  # token counts alone would share
    long = [list(range(100, 300)) + list(range(10 * i, 10 * i + 13)) for i in range(1, 5)]
    assert sharing.worth_sharing(long, [len(r) - 13 for r in long], cpu_like)
    model, _ = load_pair(llama)
    measured = model.measured_costs()
    assert measured.per_token > 0 and measured.step > 0 and measured.step_per_row >= 0
    assert measured.extend_per_token > 0  # the llama fixture has an extend graph (extend.py)
    assert measured.prefill_per_score >= 0 and measured.prefill_width == 64  # read past 64-token rows
    assert measured.prefill_chunk == model.decoder.prefill_chunk  # long rows priced by their chunks
    assert model.measured_costs() is measured


def test_sharing_with_an_extend_graph_pays_for_the_remaining_tokens_once():
    """HellaSwag's shape (an 80-token context, four 30-token endings): continued by decode steps
    it loses on a CPU-like device (30 steps of 24 ms), continued by one extend it wins (the endings'
    120 tokens instead of four contexts); endings much longer than the context still lose."""
    steps_only = costs.Costs(per_token=1.2e-3, step=24e-3, step_per_row=3e-3)
    extends = steps_only._replace(extend_per_token=1.5e-3)
    context = list(range(100, 180))
    rows = [context + list(range(1000 * i, 1000 * i + 30)) for i in range(1, 5)]
    starts = [79] * 4
    assert not sharing.worth_sharing(rows, starts, steps_only)
    assert sharing.worth_sharing(rows, starts, extends)
    long_endings = [context[:5] + list(range(1000 * i, 1000 * i + 200)) for i in range(1, 5)]
    assert not sharing.worth_sharing(long_endings, [4] * 4, extends)


def test_an_extends_own_run_cost_keeps_short_contexts_unshared():
    """ARC-like questions (a 13-token context, answers of 1-3 more tokens, lm-eval's batch of 8):
    the extend's tokens are few, but its run is not free. Measured for SmolLM2-135M fp32 on 2 vCPUs:
    a run costs ~85 ms beyond its tokens (the extend session packs its weights per run) against a
    23 ms decode step. Priced at the step, sharing looked 25% cheaper and ran 1.7x slower (2.03 s
    against 1.17 s for lm-eval's 160 requests); priced at its measured cost it is not chosen, while
    HellaSwag's shape still shares."""
    measured = costs.Costs(per_token=0.58e-3, step=23e-3, step_per_row=1.5e-3, extend_per_token=0.77e-3,
                           extend_per_score=1.9e-7, extend_fixed=85e-3)
    context = list(range(100, 113))
    rows = [context + list(range(1000 * i, 1000 * i + n)) for i, n in enumerate((1, 3, 2, 3), 1)]
    starts = [12] * 4
    assert sharing.worth_sharing(rows, starts, measured._replace(extend_fixed=0.0), 8)  # the step's price
    assert not sharing.worth_sharing(rows, starts, measured, 8)
    hellaswag = [list(range(100, 180)) + list(range(1000 * i, 1000 * i + 30)) for i in range(1, 5)]
    assert sharing.worth_sharing(hellaswag, [79] * 4, measured, 8)


def test_long_remainders_pay_for_the_extends_attention():
    """lm-eval's rolling documents start with the same one token: sharing it saves nothing, and the
    extend's unfused attention over 4,000-token remainders costs more than their prefill. Where the
    extend's token costs less than a prefill's (an int4 package measured so on a CPU), only the
    attention term keeps such rows in one prefill; HellaSwag's shape still shares."""
    int4_like = costs.Costs(per_token=1.07e-3, step=6e-3, step_per_row=2e-3, extend_per_token=0.75e-3)
    documents = [[0] + list(range(5, 4005)), [0] + list(range(7, 3507))]
    assert sharing.worth_sharing(documents, [0, 0], int4_like, 8)  # per token alone: the extend looks cheaper
    measured_attention = int4_like._replace(extend_per_score=3e-7)
    assert not sharing.worth_sharing(documents, [0, 0], measured_attention, 8)
    context = list(range(100, 180))
    rows = [context + list(range(1000 * i, 1000 * i + 30)) for i in range(1, 5)]
    assert sharing.worth_sharing(rows, [79] * 4, measured_attention, 32)


def test_long_documents_are_priced_by_the_chunks_their_prefill_runs():
    """The costs a CI run measured for SmolLM2-135M int4 on a 2-vCPU Xeon (`quantized_prefill=
    "package"`): priced as one run of 3,001 positions, two documents that share their first token
    looked dearer whole (30.4 s) than shared (27.2 s), were shared, and ran 1.5x slower (28.4 against
    19.2 s, timed here); their prefill runs in 256-token chunks, about half the scores, and they are
    kept whole."""
    measured = costs.Costs(per_token=1.8246e-3, step=5.705e-3, step_per_row=2.767e-3, extend_per_token=1.4875e-3,
                           extend_per_score=1.0177e-6, extend_fixed=17.08e-3, prefill_per_score=1.1018e-6,
                           prefill_width=64)
    generator = torch.Generator().manual_seed(4)
    documents = [[0] + torch.randint(10, 40000, (n,), generator=generator).tolist() for n in (3000, 2500)]
    assert sharing.worth_sharing(documents, [0, 0], measured, 8)
    chunked = measured._replace(prefill_chunk=256)
    assert not sharing.worth_sharing(documents, [0, 0], chunked, 8)
    assert chunked.prefill(2, 511) == measured.prefill(2, 511)  # short of two chunks: one run


def test_a_prefills_price_counts_the_scores_its_chunks_compute(llama, monkeypatch):
    """`Costs.prefill`'s attention against the runs a forward over two long rows makes (recorded):
    each chunk's tokens attend to the positions up to the chunk's end, less the `prefill_width` the
    token cost was read at; without chunks, every row's tokens over all of its positions."""
    unit = costs.Costs(per_token=0.0, step=0.0, step_per_row=0.0, prefill_per_score=1.0, prefill_width=16)
    model, _ = load_pair(llama)
    decoder = model.decoder
    prefill, step = decoder.prefill, decoder.step
    for chunk in (0, 48):
        monkeypatch.setattr(decoder, "prefill_chunk", chunk)
        width, scores, ends = 3 * 48 + 20, [], []

        def recorded_prefill(rows, *args, chunk=chunk, ends=ends, scores=scores):
            if not chunk or rows.ids.shape[1] <= chunk:  # a run, not the chunked prefill calling its own
                ends.append(rows.ids.shape[1])
                scores.append(rows.ids.shape[0] * ends[-1] * max(0, ends[-1] - 16))
            return prefill(rows, *args)

        def recorded_step(tokens, *args, ends=ends, scores=scores):
            ends[-1] += tokens.shape[1]
            scores.append(tokens.shape[1] * max(0, ends[-1] - 16))
            return step(tokens, *args)

        monkeypatch.setattr(decoder, "prefill", recorded_prefill)
        monkeypatch.setattr(decoder, "step", recorded_step)
        model(torch.randint(3, 500, (2, width), generator=torch.Generator().manual_seed(0)))
        assert len(ends) == (2 if chunk else 1) and all(end == width for end in ends)
        assert unit._replace(prefill_chunk=chunk).prefill(2, width) == sum(scores)


def test_a_query_run_once_is_priced_against_whole_prompts_with_their_attention():
    """SGLang's score shape (a 120-token query, 10 items of 180 tokens) with the costs measured for
    SmolLM2-135M fp32 on 2 vCPUs: priced by the token alone the whole prompts look as cheap as the
    query run once (2.01 against 2.02 s), where they ran 1.5x slower (5.5 against 3.6 s for two
    requests, profile_gpu.py --score 2); with the attention a 300-token row adds past the 64-token
    rows its token cost was read on, the query runs once. Short rows are priced as before."""
    measured = costs.Costs(per_token=0.669e-3, step=21.8e-3, step_per_row=1.27e-3, extend_per_token=0.767e-3,
                           extend_per_score=9.1e-7, extend_fixed=66e-3)
    query = list(range(100, 220))
    prompts = [query + list(range(1000 * i, 1000 * i + 180)) for i in range(1, 11)]
    last = [len(p) - 1 for p in prompts]
    assert not sharing.worth_sharing(prompts, last, measured, 10)
    attention = measured._replace(prefill_per_score=6e-7, prefill_width=64)
    assert attention.prefill(10, 300) == pytest.approx(measured.prefill(10, 300) + 6e-7 * 10 * 300 * 236)
    assert attention.prefill(8, 64) == measured.prefill(8, 64) == pytest.approx(0.669e-3 * 8 * 64)
    assert sharing.worth_sharing(prompts, last, attention, 10)


def test_the_prefills_attention_is_read_from_rows_eight_times_as_long(llama, monkeypatch):
    """`prefill_per_score`: the same tokens in rows of 8 x 64 tokens (511 on a CPU: one prefill, short of
    two chunks) and in rows of 64, as many of the long rows as make the tokens of the rows where the
    token cost showed (4 on a CPU, 32 on a GPU-like device); their difference over the extra
    positions, 1 ns a score here."""
    model, _ = load_pair(llama)
    decoder = model.decoder
    runs = []
    original = decoder.prefill
    monkeypatch.setattr(decoder, "prefill", lambda rows, *a: runs.append(tuple(rows.ids.shape)) or original(rows, *a))
    longer = min(8 * 64, 2 * decoder.prefill_chunk - 1, model.package.context_length - 2)
    for rows, long_rows in ((4, max(1, round(4 * 64 / longer))), (32, round(32 * 64 / longer))):
        tokens = long_rows * longer
        extra = 1e-9 * tokens * (longer - 64)
        def timed(fns, device, repeats, e=extra):  # each run once (recorded); 1 us a token, the long rows e more
            for fn in fns:
                fn()
            (a, b), (c, d) = runs[-2:]
            return [[1e-6 * a * b, 1e-6 * c * d + e]]

        monkeypatch.setattr(costs, "_timed_rounds", timed)
        runs.clear()
        assert costs._prefill_attention(decoder, rows, 64) == pytest.approx(1e-9)
        assert runs == [(tokens // 64, 64), (long_rows, longer)]


def test_a_prefills_attention_that_cannot_be_measured_leaves_the_rest_measured(llama, monkeypatch):
    """Rows six times 64 tokens long that the package cannot take (mobius-onnx's Gemma 4 export says
    4,096 tokens of context and holds rotary tables for 256): a warning, whole prompts priced by the
    token, and the other costs measured as before."""
    model, _ = load_pair(llama)

    def refused(*args):
        raise RuntimeError("indices element out of data bounds")

    monkeypatch.setattr(costs, "_prefill_attention", refused)
    with pytest.warns(UserWarning, match="could not measure a prefill's attention .*out of data bounds"):
        measured = costs.measure(model.decoder)
    assert measured.prefill_per_score == 0.0 and measured.per_token > 0 and measured.extend_per_token > 0


def test_a_runs_own_cost_is_read_from_the_same_two_runs():
    """A run of fixed cost plus a cost per token (a CPU extend that packs its weights per run)
    gives back both; a run whose time grows faster than its tokens has no negative fixed part."""
    assert costs.run_costs(lambda rows: 85e-3 + 0.7e-3 * rows * 16, 16) == pytest.approx((0.7e-3, 85e-3))
    assert costs.run_costs(lambda rows: 1e-3 * (rows * 16) ** 2, 16)[1] == 0.0


def test_the_token_cost_is_read_where_tokens_cost():
    """On a CPU-like device (time linear in the tokens) the first doubling gives the cost of a
    token; on a GPU-like one (a fixed launch cost dominating small batches) the doubling goes on
    until the tokens show, and the slope is the marginal cost, not the small batch's average."""
    asked = []

    def cpu(rows):
        asked.append(rows)
        return 1e-3 * rows * 64

    assert costs.run_costs(cpu, 64)[0] == pytest.approx(1e-3)
    assert asked == [2, 4, 8]  # the doubling, then four times the smaller run for the slope

    def gpu(rows):  # 5 ms of launches, 2 us a token
        return 5e-3 + 2e-6 * rows * 64

    slope = costs.run_costs(gpu, 64)[0]
    assert slope == pytest.approx(2e-6)
    assert slope * 2 * 64 < gpu(2) / 10  # the average of a 2-row run would overstate it > 10x
    assert costs.run_costs(lambda rows: 5e-3, 64)[0] > 0  # flat: still a positive cost


def test_the_token_cost_is_read_over_a_wide_span():
    """The slope is read from the doubling's smaller run to one of four times its rows, and a run's
    own cost at the smallest run: whichever run is 10% slow, the slope moves at most 17% and the
    fixed cost 21%; read from the doubling's two runs (2 and 4 rows here), the 4-row run 10% slow
    moved the slope 29% and the fixed cost 31%."""
    def noisy(rows, slow_at):  # 30 ms of its own and 1 ms a token, the run at `slow_at` rows 10% slow
        return (30e-3 + 1e-3 * rows * 16) * (1.1 if rows == slow_at else 1.0)

    for slow_at in (2, 4, 8, 16, 32):
        slope, fixed = costs.run_costs(lambda rows, s=slow_at: noisy(rows, s), 16)
        assert slope == pytest.approx(1e-3, rel=0.17) and fixed == pytest.approx(30e-3, rel=0.21), slow_at
    two_runs = (noisy(4, 4) - noisy(2, 4)) / (2 * 16)  # the slope from the doubling's own runs
    assert two_runs == pytest.approx(1.29e-3, rel=0.01)


def test_the_extend_attention_is_timed_at_the_rows_where_tokens_showed(build, monkeypatch):
    """The attention term (the extra time of a longer prefix) is read from extends of 4 rows on a
    CPU, wherever the token doubling ended (there now and then at 8, where the probe read 1.8x
    apart), and of the doubling's rows on a GPU (32 where small runs cost their launches: 4 rows
    over either prefix would take the same time and the prefix look free). The longer prefix holds
    EXTEND_PROBE_POSITIONS over the rows (2,048 tokens at 4 rows, where over 512 the attention's
    readings spread twice as far), at least 512."""
    assert [costs.extend_probe_rows(r, torch.device("cpu")) for r in (4, 8, 32)] == [4, 4, 4]
    assert [costs.extend_probe_rows(r, torch.device("cuda")) for r in (4, 8, 32)] == [4, 8, 32]
    model, _ = load_pair(build("llama", context_length=4096))
    decoder = model.decoder
    extender, length = decoder.extender(), 64
    ids = torch.randint(4, 500, (64, length), generator=torch.Generator().manual_seed(0))
    made = []
    original = decoder.new_cache
    monkeypatch.setattr(decoder, "new_cache", lambda rows, width: made.append((rows, width)) or original(rows, width))
    monkeypatch.setattr(costs, "_best_time", lambda fn, device: 1.0)
    for doubled, rows in ((4, 4), (8, 4), (32, 32)):  # 1 ns a score: rows x 16 x the extra positions ns more
        if rows == 32:  # as on a GPU: the doubling's rows
            monkeypatch.setattr(costs, "extend_probe_rows", lambda doubled, device: doubled)
        longer = min(max(512, costs.EXTEND_PROBE_POSITIONS // rows), model.package.context_length - 16)
        extra = 1e-9 * rows * 16 * (longer - length)
        monkeypatch.setattr(costs, "_doubling", lambda seconds, new, r=doubled: (1e-6, 1e-3, r))
        monkeypatch.setattr(costs, "_timed_rounds", lambda fns, device, repeats, e=extra: [[0.010, 0.010 + e]])
        made.clear()
        per_token, per_score, fixed = costs._extend_costs(decoder, extender, ids, length)
        assert (per_token, fixed) == (1e-6, 1e-3)
        assert per_score == pytest.approx(1e-9)
        assert (rows, length) in made and (rows, longer) in made  # the two timed extends, at those rows
        assert longer == {4: 2048, 32: 512}[rows]


def test_the_scores_leave_the_device_once(llama, monkeypatch):
    """Three batches (a budget of 4 tokens), one copy to the host: [items, labels] at the end."""
    model, _ = load_pair(llama)
    copies = []
    original = torch.Tensor.cpu
    def counted(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    ortmodule.score(model, None, [5, 6, 7], [[8], [9, 10], [11]], [1, 2], token_budget=4)
    assert copies == [(3, 2)]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(items=[], temperature=0), ValueError, "temperature must be finite"),
        (dict(items={"a": 1}), TypeError, "items must be a list"),
        (dict(label_token_ids=[]), ValueError, "label_token_ids is empty"),
        (dict(label_token_ids=[3, 512]), ValueError, "label token id 512 is outside the vocabulary"),
        (dict(label_token_ids=[-1]), ValueError, "label token id -1"),
        (dict(label_token_ids=[1.5]), TypeError, "integer token ids"),
        (dict(label_token_ids=3), TypeError, "label_token_ids must be a list of token ids .* got int"),
        (dict(items=[[5, 6], "text"]), TypeError, "item 1 is text"),
        (dict(query="text", items=[[5, 6]]), TypeError, "item 0 is list"),
        (dict(items=[[5, 999]]), ValueError, "token id 999"),
        (dict(items=[[5] * 300]), ValueError, "item 0: the prompt has 303 tokens, over the model's context length 256"),
        (dict(query=[], items=[[]]), ValueError, "item 0: the prompt has no tokens"),
        (dict(token_budget=0), ValueError, "token_budget must be a positive int"),
        (dict(label_token_ids=[[1], [2], [3]]), ValueError, "label_token_ids has 3 lists for 2 items"),
        (dict(temperature=0.5), ValueError, "temperature requires apply_softmax=True"),
        (dict(temperature=-1.0, apply_softmax=True), ValueError, "temperature must be finite and greater than zero"),
        # Switches given as text (a config file's "false" was taken as on; "yes" as three per-request choices).
        (dict(reuse_prefix="yes"), TypeError, "reuse_prefix must be True, False or None, got str 'yes'"),
        (dict(reuse_prefix=[True, False]), TypeError, "reuse_prefix must be True, False or None, got list"),
        (dict(apply_softmax="false"), TypeError, "apply_softmax must be a bool, got str 'false'"),
        (dict(item_first="false", items=[]), TypeError, "item_first must be a bool"),
    ],
)
def test_bad_requests_get_errors_that_name_the_problem(llama, kwargs, error, message):
    model, _ = load_pair(llama)
    args = dict(query=[4, 5, 6], items=[[7], [8, 9]], label_token_ids=[1, 2])
    args.update(kwargs)
    with pytest.raises(error, match=message):
        ortmodule.score(model, None, **args)


def test_label_token_ids_as_a_tensor_are_its_lists(llama):
    """A tensor of label ids, as code that builds them with a tokenizer holds them: 1-D, one list for every
    item; 2-D, a list per item; the scores of the same ids as lists."""
    model, _ = load_pair(llama)
    args = dict(query=[4, 5, 6], items=[[7], [8, 9]])
    for labels in ([1, 2], [[1, 2], [3, 4]]):
        assert ortmodule.score(model, None, **args, label_token_ids=torch.tensor(labels)) == \
            ortmodule.score(model, None, **args, label_token_ids=labels)
    with pytest.raises(ValueError, match="label token id 512 is outside the vocabulary"):
        ortmodule.score(model, None, **args, label_token_ids=torch.tensor([3, 512]))


def test_no_items_get_no_scores_without_running_the_model(llama, monkeypatch):
    """As SGLang's `Engine.score` answers an empty list of items."""
    model, _ = load_pair(llama)
    monkeypatch.setattr(model.decoder, "prefill", None)  # any run would fail
    assert ortmodule.score(model, None, [4, 5, 6], [], [1, 2]) == []
    assert ortmodule.score(model, None, "a text query", [], [1, 2], apply_softmax=True, temperature=0.5) == []


def prefill_rows(model, monkeypatch) -> list[int]:
    """The rows of each prefill the decoder runs from now on, in a list that fills as they run."""
    rows_run = []
    original = model.decoder.prefill

    def counted(rows, *args, **kwargs):
        rows_run.append(rows.ids.shape[0])
        return original(rows, *args, **kwargs)

    monkeypatch.setattr(model.decoder, "prefill", counted)
    return rows_run


@pytest.mark.parametrize("budget", [4096, 40])
def test_requests_sharing_their_prefixes_run_together(llama, monkeypatch, budget):
    """The server's call: several requests, each a query and its items. With reuse, their queries
    run in one prefill and all their items in one run over copies of the queries' KV caches (a budget
    of 40 tokens splits them over several runs, a request's items too); every score equals
    transformers' on that request alone."""
    from ortmodule import scoring

    model, hf = load_pair(llama)
    gen = torch.Generator().manual_seed(5)
    requests = [(torch.randint(4, 512, (n,), generator=gen).tolist(),
                 [torch.randint(4, 512, (k,), generator=gen).tolist() for k in items])
                for n, items in ((12, (3, 5, 1)), (7, (4, 2)), (20, (6, 1, 2, 3)))]
    labels = [7, 8, 9]
    scoring.label_logprobs(model, [[[5, 6, 7], [5, 6, 8]]], labels, budget, True)  # the extend graph's first-use check
    prefixes = prefill_rows(model, monkeypatch)
    got = scoring.label_logprobs(model, [[query + item for item in items] for query, items in requests], labels,
                                 budget, True).exp().double().cpu()
    expected = torch.cat([reference(hf, None, query, items, labels, False, False) for query, items in requests])
    assert (got - expected).abs().max().item() < 1e-5
    if budget == 4096:
        assert prefixes == [3]  # the three queries in one prefill
    else:
        assert len(prefixes) > 2 and sum(prefixes) > 3


def test_reuse_chosen_per_request(llama, monkeypatch):
    """`label_logprobs` with a choice per request (the server's, from `prefix_reuse`): the chosen
    requests' queries run once, in one prefill, the other's prompts whole in a padded batch; every
    score equals transformers' on its request alone. A list of the wrong length is refused."""
    from ortmodule import scoring

    model, hf = load_pair(llama)
    gen = torch.Generator().manual_seed(6)
    requests = [(torch.randint(4, 512, (n,), generator=gen).tolist(),
                 [torch.randint(4, 512, (k,), generator=gen).tolist() for k in items])
                for n, items in ((12, (3, 5, 1)), (7, (4, 2)), (20, (6, 1, 2, 3)))]
    prompts = [[query + item for item in items] for query, items in requests]
    labels = [7, 8, 9]
    assert scoring.prefix_reuse(model, prompts, 4096, True) == [True, True, True]
    assert scoring.prefix_reuse(model, prompts + [prompts[0][:1]], 4096, True)[-1] is False  # one prompt
    scoring.label_logprobs(model, [[[5, 6, 7], [5, 6, 8]]], labels, 4096, True)  # the extend graph's first-use check
    runs = prefill_rows(model, monkeypatch)
    got = scoring.label_logprobs(model, prompts, labels, 4096, [True, False, True]).exp().double().cpu()
    expected = torch.cat([reference(hf, None, query, items, labels, False, False) for query, items in requests])
    assert (got - expected).abs().max().item() < 1e-5
    assert sorted(runs) == [2, 2]  # two queries in one prefill; the second request's two prompts whole
    with pytest.raises(ValueError, match="reuse_prefix has 2 choices for 3 requests"):
        scoring.label_logprobs(model, prompts, labels, 4096, [True, False])


def assert_shared_scores_are_transformers(model, hf, requests, labels):
    """`label_logprobs` of `requests` in one call, their queries run once, within 1e-4 of transformers on
    each prompt alone."""
    got = scoring.label_logprobs(model, requests, labels, 4096, True).double().cpu()
    with torch.no_grad():
        expected = torch.stack([torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].double(), -1)[labels]
                                for prompts in requests for p in prompts])
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["mask", "cache"])
def test_a_long_query_among_shorter_ones_runs_its_padding_inside_the_context(build, monkeypatch, layout):
    """Requests run together in one extend run pad every row's new tokens to the longest: a row past a
    query near the context's end (250 of the fixture's 256 positions) padded to another request's
    12-token items reached position 261, and ONNX Runtime stopped ("position_ids value 256 ... out
    of range"; in the cache layout its KV went past the buffers). The padding's positions stay
    inside the context and the cache grows past it: every score is transformers'."""
    from ortmodule import OrtModelForCausalLM, extend

    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cpu", layout)
    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)  # its extend graph made in this layout
    _, hf = load_pair(fixture)
    gen = torch.Generator().manual_seed(11)
    long_query, short_query = torch.randint(4, 512, (250,), generator=gen).tolist(), [7, 8, 9]
    requests = [[long_query + [5], long_query + [6, 7, 8, 9, 10]],
                [short_query + torch.randint(4, 512, (12,), generator=gen).tolist() for _ in range(2)]]
    labels = [3, 4]
    assert_shared_scores_are_transformers(model, hf, requests, labels)


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3"])
def test_rows_stepped_past_their_prefixes_stay_inside_the_context(build, monkeypatch, arch):
    """Without an extend graph (gpt-oss's attention sinks; Gemma 3's sliding windows in the cache layout)
    the rows continue from their prefixes one decode step at a time, every row of the batch at each
    step: a row past a 250-token query (of the fixture's 256 positions) stepped on through the padding
    of another request's 245-token items, and ONNX Runtime stopped ("cos_cache dimension 0 shall not
    be less than total_sequence_length"). The rows now go in passes that fit the context: every score
    is transformers'."""
    from ortmodule import OrtModelForCausalLM, extend

    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cpu", "cache")  # Gemma 3's windows: no extend graph
    fixture = build(arch)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert model.decoder.extender() is None
    _, hf = load_pair(fixture)
    gen = torch.Generator().manual_seed(12)
    tokens = lambda n: torch.randint(4, 500, (n,), generator=gen).tolist()  # noqa: E731
    long_query, short_query = tokens(250), tokens(5)
    requests = [[long_query + tokens(2), long_query + tokens(3)],
                [short_query + tokens(240), short_query + tokens(245)]]
    labels = [3, 4]
    assert_shared_scores_are_transformers(model, hf, requests, labels)


def test_a_kept_query_continued_by_decode_steps_stays_inside_the_context(build):
    """A query kept for a call's later runs (`sharing.KeptPrefixes`) counted the earlier run's whole width
    as every row's length: items after a 240-token query (of 256 positions), each run continuing from
    the query's 240 tokens by decode steps (gpt-oss: no extend graph), stepped from position 250 and
    ran past the context (ONNX Runtime stopped). The scores equal transformers'."""
    fixture = build("gpt_oss")
    model, hf = load_pair(fixture)
    gen = torch.Generator().manual_seed(13)
    query = torch.randint(4, 500, (240,), generator=gen).tolist()
    items = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (10, 6, 5, 10, 3)]
    labels = [7, 8]
    got = ortmodule.score(model, None, query, items, labels, token_budget=20, reuse_prefix=True)
    expected = reference(hf, None, query, items, labels, False, False)
    assert (torch.tensor(got, dtype=torch.float64) - expected).abs().max().item() < 1e-5


def test_decode_passes_keep_every_row_inside_the_context():
    """`sharing.decode_passes` over 500 drawn batches: every row with tokens after its prefix in one pass,
    in row order; a pass's longest prefix and longest rest fit the context together wherever each row fits
    alone; one pass where the whole batch fits."""
    import random

    for seed in range(500):
        rng = random.Random(seed)
        context = rng.choice([16, 64, 256])
        starts = [rng.randint(1, context - 1) for _ in range(rng.randint(1, 12))]
        counts = [rng.choice([0, rng.randint(0, context - start)]) for start in starts]
        passes = sharing.decode_passes(starts, counts, context)
        rows = [row for row, n in enumerate(counts) if n]
        assert sorted(row for part in passes for row in part) == rows, seed
        for part in passes:
            assert part == sorted(part) and max(starts[r] for r in part) + max(counts[r] for r in part) <= context
        if rows and max(starts[r] for r in rows) + max(counts[r] for r in rows) <= context:
            assert len(passes) == 1, seed
