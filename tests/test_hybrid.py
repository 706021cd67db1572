"""Hybrid decoders: LFM2's packages, whose convolution layers keep a state each beside the attention
layers' KV, and Qwen3.5's, whose linear attention layers keep a convolution and a recurrent state each
(ortmodule/states.py), against transformers on the same weights through everything that
carries a cache: a cache continued from rows of different lengths, generate (greedy, beams,
sampling's shapes), long rows in chunks, shared contexts (the extend graph), lm-eval's requests,
the score API, and the server's continuous batch, where rows join and leave."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import LiveServer, expected_text, hold_decode, left_padded_batch, load_pair, right_padded_batch

from ortmodule import OrtModelForCausalLM, load_tokenizer
from ortmodule.cache import CHECKPOINTS


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5"])
def pair(build, request):
    # lfm2: conv, conv, attention, conv; qwen3_5: linear attention x 3, then attention (conftest.ARCH_FIELDS)
    fixture = build(request.param)
    return (*load_pair(fixture), fixture)


def test_the_package_keeps_a_state_per_convolution_layer(pair):
    model, _, fixture = pair
    spec = model.decoder.spec
    if fixture.spec.arch == "lfm2":
        assert [state.layer for state in spec.states] == [0, 1, 3] and len(spec.layers) == 1
        assert all(state.shape == (64, 2) and state.kind == "conv" for state in spec.states)  # conv_L_cache 3
    else:  # each linear-attention layer: its convolution's last 3 inputs (q, k, v: 128 channels), a 4 x 16 x 16 state
        assert [(state.layer, state.kind) for state in spec.states] == \
            [(i, kind) for i in range(3) for kind in ("conv", "recurrent")] and len(spec.layers) == 1
        assert {state.shape for state in spec.states} == {(128, 3), (4, 16, 16)}
        assert spec.position_rank == 2  # the graph's 3-D ids feed plain rotary nodes (graph.plain_positions)


def test_describe_counts_the_stateful_layers(pair):
    """`ortmodule describe` tells a hybrid's stateful layers by kind (a Qwen3.5 layer's convolution and
    recurrent states count as one linear-attention layer)."""
    from ortmodule.describe import describe

    _, _, fixture = pair
    said = describe(fixture.package_dir)
    linear = fixture.spec.arch == "qwen3_5"
    assert (said["convolution layers"], said["linear-attention layers"]) == ((None, 3) if linear else (3, None))


def edited_copy(fixture, tmp_path, edit):
    """A copy of `fixture`'s package whose decoder graph `edit(graph)` changed (the weights shared)."""
    import shutil

    import onnx

    package = tmp_path / "package"
    shutil.copytree(fixture.package_dir, package)
    graph = onnx.load(str(package / "model.onnx"), load_external_data=False)
    edit(graph.graph)
    onnx.save(graph, str(package / "model.onnx"))
    return package


def test_a_state_of_another_element_type_is_refused_at_load(pair, tmp_path):
    """A convolution state whose element type is not the KV cache's (the cache holds both in one
    dtype) is a PackageError naming it, not an ONNX Runtime type error at the first run."""
    import onnx

    from ortmodule import PackageError

    def half_state(graph):
        next(i for i in graph.input if i.name == "past.0.conv").type.tensor_type.elem_type = onnx.TensorProto.FLOAT16

    package = edited_copy(pair[2], tmp_path, half_state)
    with pytest.raises(PackageError, match="states are not of its KV cache's element type"):
        OrtModelForCausalLM.from_pretrained(package)


def test_a_windowed_state_is_refused_at_load(pair, tmp_path):
    """The builder's `state_window` (a state widened to the states after each of the last W tokens)
    is not a state ortmodule takes at each row's length: a PackageError names it at load."""
    import onnx

    from ortmodule import PackageError

    def windowed(graph):
        conv = next(node for node in graph.node if node.op_type == "CausalConvWithState")
        conv.attribute.append(onnx.helper.make_attribute("state_window", 4))

    package = edited_copy(pair[2], tmp_path, windowed)
    with pytest.raises(PackageError, match="state_window=4"):
        OrtModelForCausalLM.from_pretrained(package, cache_dir=tmp_path / "graphs")


@pytest.mark.parametrize("change", ["gated_delta_net", "windowed", "no gates"])
def test_a_linear_attention_of_another_form_is_refused_at_load(build, tmp_path, change):
    """Qwen3.5's linear attention in a form the rewrite does not know is a PackageError naming the node and
    what is wrong, at load: the builder's CUDA-only `GatedDeltaNet` (`linear_attn_op=gated_delta_net`,
    its gates applied inside the kernel), a windowed recurrent state (`state_window`), a LinearAttention
    without its decay and beta gates (another update rule)."""
    import onnx

    from ortmodule import PackageError

    def edit(graph):
        node = next(node for node in graph.node if node.op_type == "LinearAttention")
        if change == "gated_delta_net":
            node.op_type = "GatedDeltaNet"
        elif change == "windowed":
            node.attribute.append(onnx.helper.make_attribute("state_window", 4))
        else:
            del node.input[4:]

    package = edited_copy(build("qwen3_5"), tmp_path, edit)
    said = {"gated_delta_net": "GatedDeltaNet .* is not supported; export with the default linear_attn_op",
            "windowed": "state_window=4", "no gates": "without its decay and beta gates"}[change]
    with pytest.raises(PackageError, match=f"cannot run this decoder's layer states: .*LinearAttention.*{said}"
                       if change != "gated_delta_net" else said):
        OrtModelForCausalLM.from_pretrained(package, cache_dir=tmp_path / "graphs")


def test_a_cpu_session_writes_the_gated_norm_as_standard_ops(build, tmp_path):
    """On a CPU, Qwen3.5's `GatedRMSNorm` (whose CPU kernel is slow) runs as standard ops (cpu_forms.py):
    the graph a CPU decoder runs has none left, another device's keeps them, and ONNX Runtime's run of
    either graph gives the same logits and states for a right-padded batch."""
    import numpy as np

    from ortmodule import graph, runtime

    fixture = build("qwen3_5")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, cache_dir=tmp_path / "graphs")
    assert b"GatedRMSNorm" not in model.decoder.graph_bytes
    path = fixture.package_dir / "model.onnx"
    outputs = []
    for cpu in (True, False):
        data = graph.repaired_graph(path, cpu)
        assert (b"GatedRMSNorm" in data) is not cpu
        session = runtime.make_session(data, torch.device("cpu"), fixture.package_dir).ort_session
        ids, mask = right_padded_batch([9, 4], seed=51)
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": mask.cumsum(1).numpy() - 1,
                 "ortmodule_state_lengths": mask.sum(1).numpy()}
        for value in session.get_inputs():
            if value.name not in feeds:
                shape = [2 if d == "batch_size" else 0 if isinstance(d, str) else d for d in value.shape]
                feeds[value.name] = np.zeros([16 if d == "kv_cache_dim" else s for d, s in zip(value.shape, shape)],
                                             np.float32)
        outputs.append(session.run(None, feeds))
    for ours, theirs in zip(*outputs, strict=True):
        assert np.abs(ours - theirs).max() < 1e-5


def test_a_cache_continues_rows_of_different_lengths(pair):
    """A right-padded prefill into a cache, then three tokens a row, one run each: every row's logits
    equal transformers' on the row's whole sequence (each row's states taken at its own last token,
    not after the padding)."""
    model, hf, _ = pair
    ids, mask = right_padded_batch([11, 4, 7], seed=41)
    steps = torch.randint(4, 512, (3, 3), generator=torch.Generator().manual_seed(42))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        got, cache, seen = [], out.past_key_values, mask
        for s in range(3):
            seen = torch.cat([seen, torch.ones(3, 1, dtype=mask.dtype)], 1)
            out = model(steps[:, s : s + 1], attention_mask=seen, past_key_values=cache, use_cache=True)
            got.append(out.logits[:, -1])
            cache = out.past_key_values
        for row in range(3):
            real = int(mask[row].sum())
            whole = torch.cat([ids[row, :real], steps[row]])[None]
            expected = hf(whole).logits[0, real:]
            assert (torch.stack([g[row] for g in got]) - expected).abs().max().item() < 1e-4


def test_greedy_beams_and_sampling_shapes_follow_transformers(pair):
    """Left-padded batches through generate: greedy with a stop token among the rows, beam search
    (rows reordered every step, states with them) and several sequences per prompt (rows repeated)
    give transformers' tokens."""
    model, hf, _ = pair
    ids, mask = left_padded_batch([9, 5, 2], seed=43)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, pad_token_id=2)
    with torch.no_grad():
        for extra in ({"do_sample": False}, {"do_sample": False, "num_beams": 3},
                      {"do_sample": False, "num_beams": 2, "num_return_sequences": 2}):
            ours, theirs = model.generate(ids, **kwargs, **extra), hf.generate(ids, **kwargs, **extra)
            assert torch.equal(ours, theirs), extra


def test_the_package_graph_without_the_lm_head_rewrite_takes_states_per_row(pair):
    """`rewrite_lm_head=False` (logits at every position): the package's graph still has its states
    taken at each row's last token (graph.py applies states.py to it as well), so a left-padded
    batch's greedy tokens are transformers'."""
    _, hf, fixture = pair
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head=False)
    assert not model.decoder.keeps_positions
    ids, mask = left_padded_batch([12, 7, 3], seed=54)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), hf.generate(ids, **kwargs))


def test_a_generation_after_another_starts_from_no_state(pair):
    """The decoder keeps the last generations' decode-step buffers for the next of the same shape
    (steps.py); their cache then holds the earlier batch's states, which a prefill must not read:
    two batches of the same shape one after the other each give transformers' tokens."""
    model, hf, _ = pair
    for seed in (56, 57):
        ids, mask = left_padded_batch([8, 3, 6], seed=seed)
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
        with torch.no_grad():
            assert torch.equal(model.generate(ids, **kwargs), hf.generate(ids, **kwargs)), seed


def test_generate_returns_a_cache_to_continue_from(pair):
    """`return_dict_in_generate`: the cache holds every token but the last (transformers'
    convention), its states included, so that one more forward step over the last token gives
    transformers' logits of the whole sequence."""
    model, hf, _ = pair
    ids, mask = left_padded_batch([7, 3], seed=51)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=2,
                         return_dict_in_generate=True)
    sequences = out.sequences
    assert out.past_key_values.seen == sequences.shape[1] - 1
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1)
    with torch.no_grad():
        step = model(sequences[:, -1:], attention_mask=full_mask, past_key_values=out.past_key_values, use_cache=True)
        expected = hf(sequences, attention_mask=full_mask).logits[:, -1]
    assert (step.logits[:, -1] - expected).abs().max().item() < 1e-4


def test_long_rows_in_chunks_carry_their_states(pair):
    """Rows run in chunks over their own cache (chunked.py, the CPU's way for long rows): the
    states pass from chunk to chunk, and the logits equal transformers'."""
    _, hf, fixture = pair
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=5)
    ids, mask = right_padded_batch([23, 12], seed=44)
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    assert (ours - theirs)[mask.bool()].abs().max().item() < 1e-4


def _steps(model, cache, mask, tokens, one_by_one=False):
    """Run `tokens` `[B, s]` over `cache` (in one run, or one token a run): the logits `[B, s, V]`
    and the mask so far."""
    ones = torch.ones(tokens.shape[0], 1, dtype=mask.dtype)
    got = []
    for part in (tokens.split(1, 1) if one_by_one else [tokens]):
        mask = torch.cat([mask, ones.expand(-1, part.shape[1])], 1)
        got.append(model(part, attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    return torch.cat(got, 1), mask


def _whole(hf, ids, mask, tokens):
    """transformers' logits of the rows' whole sequences, at the positions of `tokens`."""
    full = torch.cat([ids, tokens], 1)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], 1)
    return hf(full, attention_mask=full_mask).logits[:, -tokens.shape[1]:]


# where: (prompt lengths, columns cropped, runs of the drafted tokens, what the crop runs again)
CROPS = {"inside a step": ([7], 3, 1, []),  # one row: the 8 drafted tokens in one run, 5 left pending
         "inside a batch's step": ([7, 7], 3, 1, []),  # two rows: one token a run (decoder.py), run ends
         "at a step's end": ([5, 5], 2, 3, []),
         "inside the prompt": ([9], 12, 1, ["prompt"]),  # the 8 drafted, then 4 of the prompt's 9
         "past the kept states": ([6], CHECKPOINTS + 4, CHECKPOINTS + 6, ["prompt", "step"])}


@pytest.mark.parametrize("where", list(CROPS))
def test_a_cropped_cache_continues_as_transformers(pair, monkeypatch, where):
    """A crop goes back to the newest convolution states the cache kept at or before the kept
    columns and runs the tokens from there again (cache.py's `Checkpoint`s): inside a multi-token
    step (assisted decoding's candidates: those tokens left pending, run with the next step's), at
    the end of one, inside an unpadded prompt (assisted decoding's first run: the prompt and the
    candidates in one), and further back than the states of the last CHECKPOINTS runs (the prompt
    and the steps run again). Every later logit equals transformers' on the kept sequence, and what
    ran again at the crop is as expected (counted)."""
    from ortmodule import decoder

    model, hf, _ = pair
    lengths, removed, runs, expected_reruns = CROPS[where]
    ids, mask = right_padded_batch(lengths, seed=45)
    gen = torch.Generator().manual_seed(46)
    batch, drafted = len(lengths), 8 if runs == 1 else runs
    draft = torch.randint(4, 512, (batch, drafted), generator=gen)
    then = torch.randint(4, 512, (batch, 3), generator=gen)
    reran, original = [], decoder.rerun
    monkeypatch.setattr(decoder, "rerun", lambda *args: reran.append(args[2]) or original(*args))
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        _, seen = _steps(model, cache, mask, draft, one_by_one=runs > 1)
        cache.crop(-removed)
        keep = ids.shape[1] + drafted - removed
        assert cache.get_seq_length() == keep
        assert reran == expected_reruns
        assert (cache.pending is not None) == (where == "inside a step")
        kept_ids = torch.cat([ids, draft], 1)[:, :keep]
        kept_mask = seen[:, :keep]
        got, _ = _steps(model, cache, kept_mask, then)
        expected = _whole(hf, kept_ids, kept_mask, then)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("then", ["reorder", "hidden states", "copy", "crop again", "prompt"])
def test_tokens_a_crop_left_pending_run_before_anything_else(pair, then):
    """The tokens a crop inside a step leaves pending (their KV kept, their convolution states not)
    run before anything that reads the states: a reorder of the rows, a step with hidden states (its
    own graph), a copy of the rows (`start_from`, as the score paths and generate's returned cache
    make), another crop within them; a new prompt drops them. The next logits are transformers' on
    the kept sequence."""
    model, hf, _ = pair
    ids, _ = right_padded_batch([6], seed=47)
    draft = torch.randint(4, 512, (1, 6), generator=torch.Generator().manual_seed(48))
    step = torch.tensor([[99]])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        model(draft, attention_mask=torch.ones(1, 12, dtype=torch.int64), past_key_values=cache, use_cache=True)
        cache.crop(-4)  # 2 of the 6 kept, pending
        assert cache.pending is not None and cache.pending.shape == (1, 2)
        kept = torch.cat([ids, draft[:, :2]], 1)
        if then == "reorder":
            cache.reorder_cache(torch.tensor([0]))
        elif then == "hidden states":
            out = model(step, attention_mask=torch.ones(1, 9, dtype=torch.int64), past_key_values=cache,
                        use_cache=True, output_hidden_states=True)
            assert (out.logits[:, -1] - hf(torch.cat([kept, step], 1)).logits[:, -1]).abs().max().item() < 1e-4
            kept = torch.cat([kept, step], 1)
        elif then == "copy":
            copy = model.decoder.new_cache(1, 16)
            copy.start_from(cache, torch.tensor([0]), cache.lengths.clone(), cache.longest)
            copy.seen, cache = cache.seen, copy
        elif then == "crop again":
            cache.crop(-1)
            kept = kept[:, :-1]
        else:  # the decoder's prefill into the same cache (generate's fixed steps reuse theirs so)
            model.decoder.prefill(model._rows(ids[:, :4], None), None, cache)
            kept, cache.caller_mask = ids[:, :4], torch.ones(1, 4, dtype=torch.int64)
        assert cache.pending is None or then == "crop again"
        got = model(step, attention_mask=torch.ones(1, kept.shape[1] + 1, dtype=torch.int64), past_key_values=cache,
                    use_cache=True).logits[:, -1]
        expected = hf(torch.cat([kept, step], 1)).logits[:, -1]
    assert (got - expected).abs().max().item() < 1e-4


def test_generate_keeps_states_only_for_a_cache_it_returns(pair, monkeypatch):
    """generate's own loop copies the convolution states after each step (for a crop) only where it
    returns the cache (`return_dict_in_generate`, as transformers' assisted decoding asks of its
    assistant): otherwise nothing can crop it, and the copies would be memory kept for nothing
    (32 copies of a hybrid's whole state per row). Counted as checkpoints made."""
    from ortmodule import cache as caches

    model, _, _ = pair
    made, original = [], caches.Checkpoint
    monkeypatch.setattr(caches, "Checkpoint", lambda *args, **kwargs: made.append(args[0]) or original(*args, **kwargs))
    ids, mask = left_padded_batch([6, 3], seed=52)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        model.generate(ids, **kwargs)
        alone = len(made)
        made.clear()
        out = model.generate(ids, **kwargs, return_dict_in_generate=True)
    assert alone <= 3  # the new cache's first, and the prompt's before and after it
    assert len(made) >= 10
    out.past_key_values.crop(-3)  # back over the last steps: their states kept
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 4


def test_a_crop_that_cannot_run_again_is_refused(pair):
    """Where the tokens before the kept columns cannot be run again, a ValueError that says why, not a
    wrong number: inside a padded prompt batch, inside a step that returned hidden states (a run of
    its own graph); starting a cache from part of another's rows, as before."""
    model, _, _ = pair
    ids, mask = right_padded_batch([6, 4], seed=45)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        with pytest.raises(ValueError, match="inside a padded prompt batch"):
            cache.crop(-3)
        copy = model.decoder.new_cache(2, 8)
        with pytest.raises(ValueError, match="starts only from whole rows"):
            copy.start_from(cache, torch.tensor([0, 1]), torch.tensor([4, 3]), 4)
        one = model(ids[:1], use_cache=True).past_key_values
        model(torch.tensor([[7, 8, 9]]), attention_mask=torch.ones(1, 9, dtype=torch.int64), past_key_values=one,
              use_cache=True, output_hidden_states=True)
        with pytest.raises(ValueError, match="the run from column 6 .* cannot be run again"):
            one.crop(-1)
        one.crop(-3)  # where that run started: allowed
        assert one.get_seq_length() == 6


def test_large_states_keep_fewer_checkpoints(pair, monkeypatch):
    """Where a batch's states are large (a linear attention's recurrent states), the cache keeps the
    states of fewer runs than CHECKPOINTS, at most CHECKPOINT_BYTES of copies (here two runs' worth):
    the log then holds two copies, and a crop further back runs the prompt and the steps again, its
    logits still transformers'."""
    from ortmodule import cache as cache_module
    from ortmodule import decoder

    model, hf, _ = pair
    ids, mask = right_padded_batch([6], seed=47)
    draft = torch.randint(4, 512, (1, 6), generator=torch.Generator().manual_seed(48))
    then = torch.randint(4, 512, (1, 3), generator=torch.Generator().manual_seed(49))
    reran, original = [], decoder.rerun
    monkeypatch.setattr(decoder, "rerun", lambda *args: reran.append(args[2]) or original(*args))
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        size = sum(state.numel() * state.element_size() for state in cache.states.current)
        monkeypatch.setattr(cache_module, "CHECKPOINT_BYTES", 2 * size)
        assert cache.states.kept_runs() == 2
        _, seen = _steps(model, cache, mask, draft, one_by_one=True)
        assert sum(point.states is not None for point in cache.states.log) == 2
        cache.crop(-4)  # back to the second step: its states were dropped
        assert reran == ["prompt", "step"]
        kept = torch.cat([ids, draft], 1)[:, :-4]
        got, _ = _steps(model, cache, seen[:, :-4], then)
        expected = _whole(hf, kept, seen[:, :-4], then)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_assisted_decoding_equals_transformers(pair, build, monkeypatch, mode):
    """Prompt lookup and assisted decoding (transformers' loops: the candidates run over the cache in
    one run, then the cache cropped to the accepted ones) give transformers' tokens (for Qwen3.5 its plain
    greedy ones: its own assisted loops go wrong after a crop, tests/test_generate_fuzz.py). The prompt
    repeats its beginning after that beginning's own continuation, so that lookup drafts tokens the
    model then mostly rejects; the assistant is another LFM2 (other weights), whose drafts the model
    mostly rejects, and whose own cache is cropped back over several of its runs. The first crop
    runs the prompt's kept part again; later ones leave the accepted tokens pending, run with the
    next candidates (both counted)."""
    from ortmodule import decoder

    model, hf, _ = pair
    if mode == "assistant":
        helpers = load_pair(build("lfm2", seed=1))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        ahead = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=2)
    ids = torch.cat([ahead, prompt], 1)
    reran, original, taken = [], decoder.rerun, decoder.take_back
    monkeypatch.setattr(decoder, "rerun", lambda *args: reran.append(args[2]) or original(*args))
    monkeypatch.setattr(decoder, "take_back", lambda cache: reran.append("pending") or taken(cache))
    got = []
    for m, helper in ((model, helpers[0] if mode == "assistant" else None),
                      (hf, helpers[1] if mode == "assistant" else None)):
        extra = dict(prompt_lookup_num_tokens=3) if mode == "prompt_lookup" else dict(assistant_model=helper)
        if m is hf and pair[2].spec.arch == "qwen3_5":
            extra = {}  # transformers 5.25's Qwen3.5 goes wrong in its own assisted loops: its greedy tokens
        with torch.no_grad():
            got.append(m.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=2, **extra))
    assert torch.equal(got[0], got[1])
    # which crops come depends on the drafts the model takes: both kinds with LFM2's fixture
    assert ("prompt" in reran and "pending" in reran) if pair[2].spec.arch == "lfm2" else reran


def test_lm_eval_requests_equal_the_hf_backend(pair):
    """lm-eval's loglikelihood requests (contexts shared by their choices, run once; the choices in
    one extend run over copies of their context's KV and states) and rolling loglikelihoods through
    ortmodule's backend equal lm-eval's `hf` backend on the same weights."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    _, _, fixture = pair
    rng = random.Random(46)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away", "from", "home"]

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    contexts = [text(rng.randrange(6, 14)) for _ in range(3)]
    pairs = [(context, " " + text(rng.randrange(1, 4))) for context in contexts for _ in range(4)]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, (text(30),), i) for i in range(2)]
    ours = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4, share_contexts=True)
    assert ours._model.decoder.extender() is not None  # the choices in one run over their context's states
    theirs = HFLM(pretrained=str(fixture.hf_dir), batch_size=4, dtype="float32", device="cpu")
    got, expected = ours.loglikelihood(requests, disable_tqdm=True), theirs.loglikelihood(requests, disable_tqdm=True)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected, strict=True):
        assert abs(lp - ref_lp) < 1e-3 and greedy == ref_greedy
    got, expected = (lm.loglikelihood_rolling(rolling, disable_tqdm=True) for lm in (ours, theirs))
    for lp, ref_lp in zip(got, expected, strict=True):
        assert abs(lp - ref_lp) < 1e-3


@pytest.mark.parametrize("reuse", [True, False], ids=["queries-shared", "padded"])
def test_score_requests_equal_transformers(pair, reuse):
    """The score API's requests (items sharing their query, the queries run once and the items in one
    extend run over their query's KV and states; or every prompt whole in a padded batch): each item's label
    log-probabilities are transformers' on the item's whole prompt."""
    from ortmodule import scoring

    model, hf, _ = pair
    generator = torch.Generator().manual_seed(52)
    requests = [[query + torch.randint(4, 500, (k,), generator=generator).tolist() for k in items]
                for query, items in ((torch.randint(4, 500, (n,), generator=generator).tolist(), items)
                                     for n, items in ((12, (3, 6, 1)), (7, (5, 2)), (20, (4, 1, 2))))]
    labels = [5, 6, 7]
    got = scoring.label_logprobs(model, requests, labels, 4096, reuse)
    prompts = [prompt for request in requests for prompt in request]
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1].log_softmax(-1)[labels] for p in prompts])
    assert got.shape == (len(prompts), 3) and (got - expected).abs().max().item() < 1e-4


def test_the_servers_continuous_batch_carries_states(pair):
    """Twenty prompts at once into a batch of six rows, while a long generation runs: rows join the
    running batch (their states copied into its slots), are fed their prompts' last tokens by decode
    steps, and leave (the last row's states moved into the freed slot); every answer equals
    transformers' greedy tokens on the prompt alone. Half the prompts share a cached prompt's first
    20 tokens but not its end, which holds the only states kept: none is started past it."""
    from ortmodule.serving import create_app

    model, hf, fixture = pair
    tokenizer = load_tokenizer(fixture.package_dir)
    live = LiveServer(create_app(model, tokenizer, name="tiny", prefill_chunk=16, max_rows=6, feed_tokens=4))
    rng = random.Random(47)
    system = [rng.randrange(4, 512) for _ in range(20)]
    prompts = [(system if i % 2 else []) + [rng.randrange(4, 512) for _ in range(rng.randrange(1, 30))]
               for i in range(20)]

    def complete(prompt, max_tokens):
        response = live.client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0,
                                                             "max_tokens": max_tokens}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    def check(prompt, new, choice):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        text, reason = expected_text(tokenizer, out[0, len(prompt):].tolist())
        assert (choice["text"], choice["finish_reason"]) == (text, reason), f"prompt of {len(prompt)} tokens"

    try:
        complete(system + [5, 6], 4)  # a prompt the others begin with, sent first
        barrier = threading.Barrier(len(prompts) + 1)
        long_prompt = [rng.randrange(4, 512) for _ in range(40)]  # past prefill_chunk: prefilled in chunks

        def send(prompt, new):
            barrier.wait()
            return complete(prompt, new)

        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            running = pool.submit(send, long_prompt, 60)
            answers = list(pool.map(lambda p: send(p, 7), prompts))
            check(long_prompt, 60, running.result())
        for prompt, answer in zip(prompts, answers):
            check(prompt, 7, answer)
        assert live.client.get("/metrics?format=json").json()["prefix_cache"]["hits"] == 0
    finally:
        live.stop()


def test_a_4bit_package_generates_as_onnxruntime_genai(build):
    """LFM2 exported with 4-bit weights (what a CPU deployment ships; its prompt runs in ONNX
    Runtime's fp32 path, a second session that carries the states too, nbits.py): greedy tokens
    equal onnxruntime-genai's Generator's on the same package."""
    import numpy as np

    og = pytest.importorskip("onnxruntime_genai")
    fixture = build("lfm2", precision="int4", hidden_size=128, intermediate_size=256)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert model.decoder.fp32_path
    prompt = torch.randint(4, 500, (1, 20), generator=torch.Generator().manual_seed(53))
    ours = model.generate(prompt, max_new_tokens=12, do_sample=False)
    reference = og.Model(str(fixture.package_dir))
    params = og.GeneratorParams(reference)
    params.set_search_options(max_length=32, do_sample=False)
    generator = og.Generator(reference, params)
    generator.append_tokens(prompt.numpy().astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    assert ours[0].tolist() == [int(t) for t in generator.get_sequence(0)]


def test_the_server_continues_a_conversation_past_its_cached_prompt(pair):
    """A multi-turn chat: each turn's prompt is the last one, its answer and a new message. The
    whole earlier prompt is cached with its states (a hybrid entry serves a prompt that extends
    all of it), so the next turn starts past it: alone in a run of its own when idle, or fed into
    a running batch by decode steps. Every answer equals transformers' greedy tokens, and their
    log-probabilities transformers' (which states after a wrong token would move)."""
    from ortmodule.serving import create_app

    model, hf, fixture = pair
    tokenizer = load_tokenizer(fixture.package_dir)
    live = LiveServer(create_app(model, tokenizer, name="tiny", prefill_chunk=64, max_rows=4, feed_tokens=8))
    rng = random.Random(55)

    def complete(prompt, max_tokens):
        response = live.client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0,
                                                             "max_tokens": max_tokens, "logprobs": 1}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    def expected(prompt, new):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens = out[0, len(prompt):].tolist()
            logprobs = hf(out).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        return tokens, [logprobs[k, token].item() for k, token in enumerate(tokens)]

    def check(choice, prompt, new):
        """The answer's text and its tokens' log-probabilities; the tokens, to continue with."""
        tokens, logprobs = expected(prompt, new)
        assert choice["text"] == expected_text(tokenizer, tokens)[0]
        got = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=False)) < 1e-4, (got, logprobs)
        return tokens

    def reuse():
        cache = live.client.get("/metrics?format=json").json()["prefix_cache"]
        return cache["hits"], cache["reused_tokens"]

    try:
        prompt = [rng.randrange(4, 512) for _ in range(30)]
        answer = check(complete(prompt, 5), prompt, 5)
        for _ in range(3):  # idle: the next turn starts past the cached prompt, alone, its rest in chunks
            before, previous = reuse(), len(prompt)
            prompt = prompt + answer + [rng.randrange(4, 512) for _ in range(20)]
            answer = check(complete(prompt, 5), prompt, 5)
            assert reuse() == (before[0] + 1, before[1] + previous)
        # fed into a running batch: a cached prompt's continuation by at most feed_tokens tokens
        base = [rng.randrange(4, 512) for _ in range(24)]
        complete(base, 1)
        follow = base + [rng.randrange(4, 512) for _ in range(6)]
        long_prompt = [rng.randrange(4, 512) for _ in range(10)]
        before, fed = reuse(), live.client.get("/metrics?format=json").json()["fed_tokens"]
        started, release = hold_decode(live.app.state.served)  # the long answer's first step waits for follow
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(complete, long_prompt, 60)
            assert started.wait(30), running.exception(0) if running.done() else "no decode step began"
            following = pool.submit(complete, follow, 6)
            deadline = time.monotonic() + 10
            while live.client.get("/metrics?format=json").json()["waiting"] < 1:
                assert time.monotonic() < deadline, "the follow-up never reached the queue"
                time.sleep(0.01)
            release.set()
            check(running.result(), long_prompt, 60)
            got = following.result()
        check(got, follow, 6)
        assert reuse() == (before[0] + 1, before[1] + len(base))
        assert live.client.get("/metrics?format=json").json()["fed_tokens"] == fed + len(follow) - len(base)
    finally:
        live.stop()
