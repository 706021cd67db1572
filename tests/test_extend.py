"""The extend graph (ortmodule/extend.py): several new tokens for several rows over their caches in
one run, against transformers on the same weights."""

import collections
import logging

import onnx
import pytest
import torch
from helpers import (
    BlockingUploads,
    ScalarReads,
    grouped_rows,
    left_padded_batch,
    load_pair,
    mis_scale_attention,
    right_padded_batch,
)

from ortmodule import OrtModelForCausalLM, extend, graph, runtime, scoring
from ortmodule.inputs import Rows, pad_right
from ortmodule.package import read_package

GQA_ARCHES = ["llama", "qwen3", "phi3", "mistral", "qwen2"]


def extender_of(model, expand_kv_heads, layout="mask", unpack_qkv=False):
    decoder = model.decoder
    data = extend.extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem, decoder.spec.layers[0].head_size,
                                     expand_kv_heads, layout=layout, unpack_qkv=unpack_qkv)
    return extend.Extender(decoder, runtime.make_session(data, decoder.device, decoder.spec.path.parent))


def rows_over_prefixes(seed):
    """Two prefixes (11 and 6 tokens) and three rows continuing them by 4, 7 and 2 tokens."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (11, 6)]
    rests = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (4, 7, 2)]
    return prefixes, rests, [0, 0, 1]


def prefix_cache(model, prefixes, owner):
    decoder = model.decoder
    ids, mask = pad_right(prefixes)
    lengths, width = mask.sum(1), ids.shape[1]
    source = decoder.new_cache(len(prefixes), width)
    decoder.prefill(Rows(ids, None, lengths, width), None, source)
    cache = decoder.new_cache(len(owner), width)
    rows = torch.tensor(owner)
    cache.start_from(source, rows, lengths[rows], width)
    return cache


@pytest.mark.parametrize("layout,expand_kv_heads", [("mask", False), ("mask", True), ("cache", False)])
@pytest.mark.parametrize("arch", GQA_ARCHES)
def test_extend_equals_transformers_on_the_whole_rows(build, arch, layout, expand_kv_heads):
    """Rows continuing prefixes of different lengths by different numbers of tokens, in one run:
    every new position's logits equal transformers' on the whole row (right-padded rows and
    prefixes, the rows' own positions for the rotary embedding, grouped heads shared or repeated;
    in the mask layout and in the cache layout, whose new KV is written after each row's past)."""
    cache = assert_extend_matches(*load_pair(build(arch)), expand_kv_heads, seed=31, layout=layout)
    assert cache.lengths.tolist() == [11, 11, 6]  # the rows are read, not extended


def test_the_cache_layout_writes_the_new_kv_in_the_caches_own_buffers(build):
    """In the cache layout the new tokens' keys and values are written into the cache's buffers past
    each row's end (TensorScatter's output bound to its input's memory: no copy of the buffers), and
    they are transformers' keys and values of the whole rows there; the rows' lengths are unchanged."""
    model, hf = load_pair(build("qwen3"))
    cache = assert_extend_matches(model, hf, False, seed=35, layout="cache")
    prefixes, rests, owner = rows_over_prefixes(35)
    assert cache.lengths.tolist() == [len(prefixes[o]) for o in owner]
    for row, rest in enumerate(rests):
        prefix = prefixes[owner[row]]
        with torch.no_grad():
            past = hf(torch.tensor([prefix + rest]), use_cache=True).past_key_values
        for layer, (keys, values) in enumerate(zip(cache.keys, cache.values)):
            written = slice(len(prefix), len(prefix) + len(rest))
            assert (keys[row, :, written] - past.layers[layer].keys[0, :, written]).abs().max().item() < 1e-4
            assert (values[row, :, written] - past.layers[layer].values[0, :, written]).abs().max().item() < 1e-4


def assert_extend_matches(model, hf, expand_kv_heads, seed, layout="mask", unpack_qkv=False):
    """Rows over prefixes (`rows_over_prefixes`) continued in one extend run: every new position's
    logits equal transformers' on the whole row. Returns the prefixes' cache."""
    prefixes, rests, owner = rows_over_prefixes(seed)
    cache = prefix_cache(model, prefixes, owner)
    tokens = pad_right(rests)[0]
    new = tokens.shape[1]
    extender = extender_of(model, expand_kv_heads, layout, unpack_qkv)
    assert extender.layout == layout
    logits = extender.run(tokens, cache, torch.arange(len(rests) * new))
    logits = logits.view(len(rests), new, -1)
    for row, rest in enumerate(rests):
        whole = prefixes[owner[row]] + rest
        with torch.no_grad():
            expected = hf(torch.tensor([whole])).logits[0, len(whole) - len(rest):]
        assert (logits[row, : len(rest)] - expected).abs().max().item() < 1e-4
    return cache


@pytest.mark.parametrize("layout", ["mask", "cache"])
@pytest.mark.parametrize("arch,options", [("llama", (("fuse_qkv", "false"),)), ("qwen3", (("fuse_qkv", "false"),)),
                                          ("qwen3", (("fuse_mlp_gate_up", "true"),))])
def test_extend_on_packages_exported_with_graph_options(build, arch, options, layout):
    """The extend graph of a package whose GroupQueryAttention takes the query, key and value
    unpacked (the builder's fuse_qkv=false), or whose MLP is one gate/up MatMul: the new positions'
    logits equal transformers' on the whole rows."""
    assert_extend_matches(*load_pair(build(arch, extra_options=options)), False, seed=33, layout=layout)


@pytest.mark.parametrize("layout", ["mask", "cache"])
def test_a_packed_input_is_unpacked_where_projections_are(build, layout):
    """GroupQueryAttention's packed input, which the rewrite splits with a Split node, becomes three
    MatMuls over slices of the packed weight with `unpack_qkv` (ortmodule's extend graph on CUDA,
    projections.py): no Split left, and the new positions' logits equal transformers' on the whole
    rows."""
    model, hf = load_pair(build("llama"))
    decoder, layers = model.decoder, len(model.decoder.spec.layers)
    counts = {unpack: collections.Counter(n.op_type for n in onnx.load_from_string(extend.extend_graph_bytes(
        decoder.graph_bytes, decoder.spec.path.stem, decoder.spec.layers[0].head_size, False, layout=layout,
        unpack_qkv=unpack)).graph.node) for unpack in (False, True)}
    assert counts[False]["Split"] == layers and counts[True]["Split"] == 0
    assert counts[True]["MatMul"] == counts[False]["MatMul"] + 2 * layers
    assert_extend_matches(model, hf, False, seed=35, layout=layout, unpack_qkv=True)


@pytest.mark.parametrize("layout", ["mask", "cache"])
def test_the_norms_grouped_query_attention_applies_itself_are_kept(build, layout):
    """A Qwen3 package exported for CUDA passes the query and key norms to GroupQueryAttention
    (which only the CUDA kernel applies). Its extend graph applies them as nodes, so it runs here:
    over transformers' own KV cache of a prefix, the logits of the rest equal transformers' (fp16)."""
    fixture = build("qwen3", precision="fp16", execution_provider="cuda")
    proto = onnx.load(str(fixture.package_dir / "model.onnx"), load_external_data=False)
    assert any(n.op_type == "GroupQueryAttention" and len(n.input) > 14 and n.input[14] for n in proto.graph.node)
    spec = read_package(fixture.package_dir).decoder
    rewritten = graph.rewrite_keep_positions(proto, spec.logits)
    data = extend.extend_graph(rewritten, spec.layers[0].head_size, expand_kv_heads=True,
                               layout=layout).SerializeToString()
    session = runtime.make_session(data, torch.device("cpu"), fixture.package_dir)
    hf = load_pair(build("qwen3"))[1]  # the same weights, fp32
    gen = torch.Generator().manual_seed(32)
    prefix, rest = torch.randint(4, 500, (1, 9), generator=gen), torch.randint(4, 500, (1, 5), generator=gen)
    with torch.no_grad():
        past = hf(prefix, use_cache=True).past_key_values
        expected = hf(torch.cat([prefix, rest], 1)).logits[0, 9:]
    binding = session.io_binding()
    runtime.bind_input(binding, spec.input_ids, rest)
    runtime.bind_input(binding, extend.POSITIONS, torch.arange(9, 14)[None])
    room = 5 if layout == "cache" else 0  # the cache layout writes the new KV after the past
    if layout == "cache":
        runtime.bind_input(binding, extend.WRITE_AT, torch.tensor([9]))
        runtime.bind_input(binding, extend.KV_LENGTHS, torch.tensor([14]))
    else:
        runtime.bind_input(binding, extend.ATTENTION_BIAS, torch.zeros(1, 1, 5, 14, dtype=torch.float16).masked_fill(
            torch.arange(14)[None, :] - 9 > torch.arange(5)[:, None], torch.finfo(torch.float16).min))
    for kv, layer in zip(spec.layers, past.layers):
        for name, tensor in ((kv.past_key, layer.keys), (kv.past_value, layer.values)):
            runtime.bind_input(binding, name, torch.nn.functional.pad(tensor.half(), (0, 0, 0, room)).contiguous())
    runtime.bind_input(binding, graph.LOGITS_INDICES, torch.arange(5))
    logits = torch.empty(5, 512, dtype=torch.float16)
    runtime.bind_output(binding, spec.logits, logits)
    session.run(binding)
    assert (logits.float() - expected).abs().max().item() < 2e-2


def test_shared_contexts_continue_in_one_run(build, monkeypatch):
    """lm-eval's shared contexts: the continuations run as one extend, no decode steps."""
    model, _ = load_pair(build("llama"))
    decoder = model.decoder
    assert decoder.extender() is not None  # made (with its check run) before counting
    calls = {"step": 0, "extend": 0}
    step, run = decoder.step, extend.Extender.run
    monkeypatch.setattr(decoder, "step", lambda *a, **k: calls.__setitem__("step", calls["step"] + 1) or step(*a, **k))
    monkeypatch.setattr(extend.Extender, "run",
                        lambda *a, **k: calls.__setitem__("extend", calls["extend"] + 1) or run(*a, **k))
    prefixes, rests, owner = rows_over_prefixes(33)
    rows = [(prefixes[o] + r)[:-1] for o, r in zip(owner, rests)]
    starts = [len(prefixes[o]) - 1 for o in owner]
    expected = scoring.answers(scoring.loglikelihood_totals(model, pad_right(rows)[0], pad_right(rows)[1], starts,
                                                            rests))
    got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, owner, starts, rests))
    assert calls == {"step": 0, "extend": 1}
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected):
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_sliding_window_layers_in_the_mask_layout(build, arch, monkeypatch):
    """Sliding-window layers (Gemma 3's and Gemma 2's window of 8 tokens, alternating with full
    layers) take a mask of their own in the extend graph's mask layout: rows over prefixes longer
    than the window, continued by more tokens than it, give transformers' logits on the whole rows;
    the cache layout (and the prefill graph) leave such a package to the decode steps, saying why."""
    model, hf = load_pair(build(arch))
    decoder = model.decoder
    windows = {kv.window for kv in decoder.spec.layers if kv.window}
    assert windows == {8}
    prefixes, rests, owner = rows_over_prefixes(37)
    assert max(map(len, prefixes)) + max(map(len, rests)) > 2 * 8  # the window slides within the rows
    extender = extender_of(model, False)
    assert extender.windows == [8]
    assert_extend_matches(model, hf, False, seed=37)
    with pytest.raises(graph.RewriteSkipped, match="sliding-window layer, which the cache layout does not take"):
        extender_of(model, False, layout="cache")
    monkeypatch.setitem(extend.EXTEND_LAYOUT, "cpu", "mask")
    assert OrtModelForCausalLM.from_pretrained(build(arch).package_dir).decoder.extender() is not None


def test_where_there_is_no_extend_graph(build, caplog):
    """Sliding-window layers in the cache layout and an unrewritten LM head keep the decode steps,
    with the reason logged; a cache of other rows than the tokens' is refused by name, and one
    longer than its rows (as a sliding-window package's is) gives the logits of one as long."""
    with caplog.at_level(logging.INFO, logger="ortmodule"), pytest.MonkeyPatch.context() as patch:
        patch.setitem(extend.EXTEND_LAYOUT, "cpu", "cache")
        assert OrtModelForCausalLM.from_pretrained(build("gemma3").package_dir).decoder.extender() is None
    assert "sliding-window layer" in caplog.text
    plain = OrtModelForCausalLM.from_pretrained(build("llama").package_dir, rewrite_lm_head=False)
    assert plain.decoder.extender() is None
    model = load_pair(build("llama"))[0]
    extender = model.decoder.extender()
    logits = []
    for capacity in (8, 3):
        cache = model.decoder.new_cache(1, capacity)
        model.decoder.prefill(Rows(torch.tensor([[5, 6, 7]]), None, torch.tensor([3]), 3), None, cache)
        assert cache.keys[0].shape[2] == capacity
        logits.append(extender.run(torch.tensor([[8, 9]]), cache, torch.arange(2)))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="extend needs a cache of 2 rows, got 1"):
        extender.run(torch.tensor([[8, 9], [4, 5]]), cache, torch.arange(2))



@pytest.mark.parametrize("arch", GQA_ARCHES)
def test_prefill_graph_equals_transformers(build, arch):
    """`prefill_attention="onnx"`: runs without a cache take the prefill graph (ONNX's `Attention`,
    causal, no KV written); its logits at every real position of right- and left-padded batches equal
    transformers'; a run that keeps a cache keeps the package's graph."""
    fixture = build(arch)
    hf = load_pair(fixture)[1]
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=0, prefill_attention="onnx")
    assert model.decoder.causal is not None
    runs = []
    run = model.decoder.causal.run
    model.decoder.causal.run = lambda *a: runs.append(a) or run(*a)
    for batch in (right_padded_batch([17, 9, 3], seed=5), left_padded_batch([12, 4], seed=6)):
        ids, mask = batch
        with torch.no_grad():
            expected = hf(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
        real = mask.bool()
        assert (got - expected)[real].abs().max().item() < 1e-4 * max(1.0, expected[real].abs().max().item())
    assert len(runs) == 2
    with torch.no_grad():  # a run over a cache keeps the package's graph
        out = model(ids, attention_mask=mask, use_cache=True)
    assert len(runs) == 2 and out.past_key_values.get_seq_length() == ids.shape[1]


def test_prefill_graph_choices(build, caplog):
    """The default keeps the package's graph; sliding-window layers (Gemma 3) keep it too, with the
    reason logged, and their answers; a choice not known is refused by name."""
    assert OrtModelForCausalLM.from_pretrained(build("llama").package_dir).decoder.causal is None
    fixture = build("gemma3")
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_attention="onnx")
    assert model.decoder.causal is None and "no prefill graph" in caplog.text and "sliding-window" in caplog.text
    hf = load_pair(fixture)[1]
    ids, mask = right_padded_batch([9, 5], seed=8)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
    assert (model(ids, attention_mask=mask).logits - expected)[mask.bool()].abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, package, onnx, not 'flash'"):
        OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_attention="flash")


def test_rewrites_that_differ_are_not_used(build, monkeypatch, caplog):
    """The prefill and extend graphs' first runs are checked against the package graph on the same
    tokens: a rewrite that computes something else (here: attention scaled twice as much) is set
    aside with a warning, and the package's graph answers (shared prefixes by decode steps)."""
    mis_scale_attention(monkeypatch)
    fixture = build("llama")
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_attention="onnx")
        assert model.decoder.causal is None and model.decoder.extender() is None
    for what in ("prefill graph", "extend graph"):
        assert f"the {what} of" in caplog.text
    assert caplog.text.count("differ from the package graph's") == 2
    hf = load_pair(fixture)[1]
    ids, mask = right_padded_batch([7, 4], seed=9)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
    assert (model(ids, attention_mask=mask).logits - expected)[mask.bool()].abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_scoring_paths_neither_read_back_nor_wait_to_copy_up(build, arch):
    """lm-eval's shared contexts (`grouped_loglikelihood_totals`), its padded rows
    (`loglikelihood_totals`) and the score server's calls (`label_logprobs`, each query run once and
    not) read no value out of a tensor and copy host data up only without waiting (`to_device`):
    on CUDA either would make the host wait for the device in the middle of every call, so the
    device would idle while the host builds the rest (a hybrid's state check did so for every model
    until session 36; six blocking copies in the shared path and four in the padded score path until
    session 38). On a CPU the read count includes reads of host tensors, which the shared paths have none of."""
    model = OrtModelForCausalLM.from_pretrained(build(arch).package_dir)
    rows, groups, starts, targets = grouped_rows((21, 12), (9, 2, 5), seed=47)
    generator = torch.Generator().manual_seed(48)
    requests = [[query + torch.randint(4, 400, (k,), generator=generator).tolist() for k in (12, 5, 9)]
                for query in (torch.randint(4, 400, (n,), generator=generator).tolist() for n in (30, 17))]
    ids, mask = right_padded_batch([20, 11, 6], seed=1)
    shared = [lambda: scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets),
              lambda: scoring.label_logprobs(model, requests, [5, 6], 8192, True)]
    padded = [lambda: scoring.loglikelihood_totals(model, ids, mask, [3, 4, 2], [[5, 6], [7], [8, 9]]),
              lambda: scoring.label_logprobs(model, requests, [5, 6], 8192, False)]
    for call in shared + padded:
        call()  # the extend graph made and checked at its first use
        with ScalarReads() as reads, BlockingUploads() as uploads:
            call()
        assert uploads.calls == []
        if call in shared:  # the padded paths check their host inputs on the host (reads of host tensors)
            assert reads.count == 0


def lanes_over(rests: list[list[int]], lanes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`lanes` (per lane, the indices of `rests` it holds, one after another) as the extend run's
    right-padded tokens and `starts` (each padding token a segment of its own)."""
    tokens = pad_right([[t for r in lane for t in rests[r]] for lane in lanes])[0]
    starts = torch.arange(tokens.shape[1]).repeat(len(lanes), 1)
    for row, lane in enumerate(lanes):
        at = 0
        for r in lane:
            starts[row, at : at + len(rests[r])] = at
            at += len(rests[r])
    return tokens, starts


@pytest.mark.parametrize("arch", [*GQA_ARCHES, "qwen2_5_vl_builder"])
def test_continuations_share_a_row_of_the_extend_run(build, arch):
    """Several continuations of one prefix in one row of the extend run (`Extender.run`'s `starts`):
    each gives transformers' logits on its prefix and itself, as if it ran alone (its positions
    restart after the past, it sees neither the other continuations nor the padding); the
    builder's 3-D mRoPE positions of Qwen2.5-VL's decoder too."""
    model, hf = load_pair(build(arch))
    extender = model.decoder.extender()
    assert extender.packs
    prefixes, rests, owner = rows_over_prefixes(41)
    lanes = [[1, 0], [2]]  # prefix 0's two continuations in one row, prefix 1's in another
    tokens, starts = lanes_over(rests, lanes)
    new = tokens.shape[1]
    logits = extender.run(tokens, prefix_cache(model, prefixes, [0, 1]), torch.arange(2 * new), starts)
    logits = logits.view(2, new, -1)
    for row, lane in enumerate(lanes):
        at = 0
        for r in lane:
            whole = prefixes[owner[r]] + rests[r]
            with torch.no_grad():
                expected = hf(torch.tensor([whole])).logits[0, len(prefixes[owner[r]]):]
            assert (logits[row, at : at + len(rests[r])] - expected).abs().max().item() < 1e-4
            at += len(rests[r])


def test_where_continuations_cannot_share_a_row(build):
    """A row of several segments needs the mask layout without windows and a decoder without
    convolution states: the cache layout writes each segment's KV after the row's past, where the
    next would overwrite it; a sliding window's mask has no segments; a hybrid's convolution state
    would run on from one segment into the next. There `packs` is False, `starts` is refused by
    name, and shared contexts run one continuation a row, still transformers' answers."""
    llama = load_pair(build("llama"))[0]
    assert not extender_of(llama, False, layout="cache").packs
    assert not extender_of(load_pair(build("gemma3"))[0], False).packs
    extender = extender_of(llama, False, layout="cache")
    prefixes, rests, _ = rows_over_prefixes(43)
    tokens, starts = lanes_over(rests, [[0, 1]])
    with pytest.raises(ValueError, match="takes no segments"):
        extender.run(tokens, prefix_cache(llama, prefixes, [0]), torch.arange(3), starts)
    lfm2 = OrtModelForCausalLM.from_pretrained(build("lfm2").package_dir)
    assert lfm2.decoder.extender() is None or not lfm2.decoder.extender().packs


def test_a_questions_short_answers_run_several_to_a_row(build, monkeypatch):
    """lm-eval's shared contexts: a question's answers of 1, 2, 3 and 6 tokens ran each in a row of
    6 (24 tokens, 18 of them padding); now the shorter ones share a row (`sharing.choose_lanes`):
    fewer tokens run, and every answer is still the padded rows' and transformers'."""
    model, hf = load_pair(build("llama"))
    gen = torch.Generator().manual_seed(45)
    context = torch.randint(4, 500, (20,), generator=gen).tolist()
    answers = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (1, 2, 3, 6)]
    rows = [(context + a)[:-1] for a in answers]
    starts = [len(context) - 1] * 4
    shapes = []
    run = extend.Extender.run
    monkeypatch.setattr(extend.Extender, "run", lambda self, tokens, *a: shapes.append(tuple(tokens.shape)) or
                        run(self, tokens, *a))
    got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, [0] * 4, starts, answers))
    assert len(shapes) == 1 and shapes[0][0] * shapes[0][1] < 4 * 5  # the rows' rests: 0, 1, 2 and 5 tokens
    expected = scoring.answers(scoring.loglikelihood_totals(model, *pad_right(rows), starts, answers))
    for (lp, greedy), (ref_lp, ref_greedy), answer in zip(got, expected, answers):
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy
        with torch.no_grad():
            logits = hf(torch.tensor([context + answer])).logits[0, len(context) - 1 : -1].log_softmax(-1)
        assert abs(lp - logits.gather(1, torch.tensor(answer)[:, None]).sum().item()) < 1e-3
