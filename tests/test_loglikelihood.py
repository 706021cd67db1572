"""The LM-head rewrite and the loglikelihood primitive against independent references."""

import re

import numpy as np
import pytest
import torch
from helpers import MODEL_ARCHES, float32_logits_copy, kept_prefix_calls, load_pair, right_padded_batch

import ortmodule
from ortmodule import OrtModelForCausalLM, inputs, scoring, sharing
from ortmodule.inputs import pad_right


@pytest.mark.parametrize("arch", MODEL_ARCHES)
def test_rewritten_graph_equals_the_unmodified_graph(build, arch):
    fixture = build(arch)
    rewritten = load_pair(fixture)[0]
    plain = OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head=False)
    assert rewritten.keeps_positions and not plain.keeps_positions
    ids, mask = right_padded_batch([24, 17, 9], seed=20)
    full = plain(ids, attention_mask=mask).logits
    for k in (1, 5):
        assert (rewritten(ids, attention_mask=mask, cont_len=k).logits - full[:, -k:]).abs().max().item() < 1e-5


def test_rewritten_fp16_graph_equals_the_unmodified_graph(build):
    fixture = build("llama", precision="fp16")
    rewritten = load_pair(fixture)[0]
    plain = OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head=False)
    ids, mask = right_padded_batch([24, 9], seed=21)
    tail = rewritten(ids, attention_mask=mask, cont_len=4).logits.float()
    assert_within_fp16_rounding(tail, plain(ids, attention_mask=mask).logits[:, -4:].float())


def assert_within_fp16_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Two units in the last place of fp16 at the logits' scale: the rewritten graph's last layer
    and head multiply the kept rows as one flat batch (ortmodule/tail.py), which may round a
    half-precision product differently from the whole batch's."""
    assert (got - expected).abs().max().item() <= 2 * torch.finfo(torch.float16).eps * expected.abs().max().item()


def test_a_cast_of_half_logits_to_float32_is_left_to_forward(build, tmp_path):
    """A package that casts its half-precision logits to float32 (the builder's bf16 packages):
    the rewritten graph returns them before the cast, `forward` returns them as the package does
    (float32), and scoring reads the half-precision values: every answer equals that of the
    same package without the cast, where ONNX Runtime's own cast stays without the rewrite."""
    fixture = build("llama", precision="fp16")
    casting = float32_logits_copy(fixture, tmp_path / "package")
    model = OrtModelForCausalLM.from_pretrained(casting, cache_dir=tmp_path / "graphs")
    half = load_pair(fixture)[0]
    plain = OrtModelForCausalLM.from_pretrained(casting, rewrite_lm_head=False)
    assert (model.decoder.head_dtype, half.decoder.head_dtype, plain.decoder.head_dtype) == (
        torch.float16, torch.float16, torch.float32)
    ids, mask = right_padded_batch([24, 9], seed=24)
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.float32 == plain(ids, attention_mask=mask).logits.dtype
    assert torch.equal(logits, half(ids, attention_mask=mask).logits.float())
    assert_within_fp16_rounding(logits, plain(ids, attention_mask=mask).logits)
    rows, cols = torch.tensor([0, 1, 0]), torch.tensor([3, 8, 23])
    kept = model.logits_at(ids, mask, rows, cols, upcast=False)
    assert kept.dtype == torch.float16 and torch.equal(kept, half.logits_at(ids, mask, rows, cols))
    assert torch.equal(model.logits_at(ids, mask, rows, cols), kept.float())
    starts, targets = [10, 2], [ids[0, 11:20].tolist(), ids[1, 3:9].tolist()]
    assert ortmodule.loglikelihood(model, ids, mask, starts, targets) == ortmodule.loglikelihood(
        half, ids, mask, starts, targets)
    rows = [ids[0, :16].tolist(), ids[0, :20].tolist(), ids[1, :9].tolist()]
    grouped = [scoring.answers(scoring.grouped_loglikelihood_totals(each, rows, [0, 0, 1], [10, 10, 2],
                                                                    [row[11:] or row[3:] for row in rows]))
               for each in (model, half)]  # the extend run over copies of the contexts' KV
    assert grouped[0] == grouped[1]
    prompt = ids[:1, :12]
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False),
                       plain.generate(prompt, max_new_tokens=6, do_sample=False))


def test_a_float32_lm_head_for_a_package_casting_half_logits(build, tmp_path):
    """`rewrite_lm_head="float32"` on a package that casts half-precision logits to float32: the
    head multiplies in float32, so the logits are the half-precision head's before their rounding
    (within one rounding step of them, and almost none of them a half-precision number); scoring
    and generation run on them. On a package without the cast it changes nothing; a wrong value
    is refused."""
    fixture = build("llama", precision="fp16")
    casting = float32_logits_copy(fixture, tmp_path / "package")
    precise = OrtModelForCausalLM.from_pretrained(casting, rewrite_lm_head="float32", cache_dir=tmp_path / "graphs")
    rounded = OrtModelForCausalLM.from_pretrained(casting, cache_dir=tmp_path / "graphs")
    assert precise.decoder.head_dtype == torch.float32 and rounded.decoder.head_dtype == torch.float16
    ids, mask = right_padded_batch([24, 9], seed=25)
    real = mask.bool()
    logits, half = precise(ids, attention_mask=mask).logits[real], rounded(ids, attention_mask=mask).logits[real]
    assert ((logits - half).abs() <= half.abs() * 2**-11 + 2**-24).all()  # fp16's rounding: half a step
    assert (logits != logits.half().float()).float().mean().item() > 0.9
    starts, targets = [10, 2], [ids[0, 11:20].tolist(), ids[1, 3:9].tolist()]
    for (lp, _), (ref, _) in zip(ortmodule.loglikelihood(precise, ids, mask, starts, targets),
                                 ortmodule.loglikelihood(rounded, ids, mask, starts, targets)):
        assert lp != ref and abs(lp - ref) < 1e-2
    assert precise.generate(ids[:1, :12], max_new_tokens=4, do_sample=False).shape == (1, 16)
    unchanged = OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head="float32",
                                                    cache_dir=tmp_path / "graphs")
    assert unchanged.decoder.head_dtype == torch.float16
    plain = load_pair(fixture)[0]
    assert torch.equal(unchanged(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="rewrite_lm_head must be True, False or 'float32'"):
        OrtModelForCausalLM.from_pretrained(casting, rewrite_lm_head="fp32")


def _head_graph(weights, softcap: bool, cast: bool):
    """A hidden-states input, a MatMul LM head (soft-capped: Div, Tanh, Mul), a final cast to float32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    half = weights.dtype == np.float16
    kind = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    nodes, last = [helper.make_node("MatMul", ["hidden", "W"], ["mm"], name="/lm_head/MatMul")], "mm"
    if softcap:
        nodes += [helper.make_node("Div", ["mm", "cap"], ["d"]), helper.make_node("Tanh", ["d"], ["t"]),
                  helper.make_node("Mul", ["t", "cap"], ["m"])]
        last = "m"
    if cast:
        nodes.append(helper.make_node("Cast", [last], ["logits"], to=TensorProto.FLOAT, name="/lm_head/Cast"))
    else:
        nodes[-1].output[0] = "logits"
    output = TensorProto.FLOAT if cast else kind
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("hidden", kind, ["b", "s", 8])],
                              [helper.make_tensor_value_info("logits", output, ["b", "s", 16])],
                              [numpy_helper.from_array(weights, "W"),
                               numpy_helper.from_array(np.array(3.0, weights.dtype), "cap")])
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_the_float32_head_of_a_half_package_turns_tf32_on_for_cuda(build, tmp_path):
    """The float32 head's inputs are half-precision values, which TF32 holds exactly: on CUDA its
    session runs with `use_tf32=1` (tensor cores, not the CUDA cores' float32), unless the caller set
    `use_tf32`; never for the CPU, a package without the float32 head, or an fp32 package."""
    from ortmodule import graph

    fixture = build("llama", precision="fp16")
    casting = float32_logits_copy(fixture, tmp_path / "package")
    precise = OrtModelForCausalLM.from_pretrained(casting, rewrite_lm_head="float32", cache_dir=tmp_path / "graphs")
    rounded = OrtModelForCausalLM.from_pretrained(casting, cache_dir=tmp_path / "graphs")
    head, plain = precise.decoder.graph_bytes, rounded.decoder.graph_bytes
    assert graph.has_float32_head(head) and not graph.has_float32_head(plain) and not graph.has_float32_head(None)
    given = {"arena_extend_strategy": "kSameAsRequested"}
    assert graph.head_provider_options(given, "cuda", head, True) == {**given, "use_tf32": "1"}
    assert given == {"arena_extend_strategy": "kSameAsRequested"}  # the caller's dict is left as it was
    assert graph.head_provider_options(None, "cuda", head, True) == {"use_tf32": "1"}
    assert graph.head_provider_options({"use_tf32": "0"}, "cuda", head, True) == {"use_tf32": "0"}
    for args in (("cpu", head, True), ("cuda", plain, True), ("cuda", head, False)):
        assert graph.head_provider_options(given, *args) is given


@pytest.mark.parametrize("case,float32_head,expected", [
    ("half, cast", False, np.float16), ("half, cast", True, np.float32), ("half, soft cap, cast", False, np.float16),
    ("half, soft cap, cast", True, np.float16), ("float32", True, np.float32)])
def test_the_logits_cast_and_the_float32_head_in_the_graph(case, float32_head, expected):
    """graph.py on small heads: a final cast of half-precision logits to float32 is left out (a
    soft cap before it stays in half precision), a plain MatMul head multiplies in float32 when
    asked, a float32 head is left as it is; each rewritten graph's logits at the kept positions
    equal numpy's on the same numbers, within their precision's rounding."""
    import onnxruntime as ort

    from ortmodule import graph

    gen = np.random.default_rng(0)
    weights = gen.standard_normal((8, 16)).astype(np.float32 if case == "float32" else np.float16)
    proto = _head_graph(weights, "soft cap" in case, "cast" in case)
    rewritten = graph.rewrite_keep_positions(proto, "logits", float32_head)
    assert all(node.op_type != "Cast" or node.name.startswith("/ortmodule/") for node in rewritten.graph.node)
    session = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    hidden = gen.standard_normal((2, 3, 8)).astype(weights.dtype)
    logits = session.run(None, {"hidden": hidden, graph.LOGITS_INDICES: np.array([0, 4], np.int64)})[0]
    reference = hidden.reshape(6, 8)[[0, 4]].astype(np.float64) @ weights.astype(np.float64)
    if "soft cap" in case:
        reference = np.tanh(reference / 3) * 3
    assert logits.dtype == expected
    assert np.abs(logits - reference).max() < (1e-5 if expected == np.float32 else 1e-2)


def reference_loglikelihood(hf, ids, mask, starts, targets):
    """Per row, from transformers' full logits: sum log_softmax at the target positions."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids, attention_mask=mask).logits.double(), dim=-1)
    out = []
    for row, (start, target) in enumerate(zip(starts, targets)):
        positions = torch.arange(start, start + len(target))
        picked = logprobs[row, positions, torch.tensor(target)]
        greedy = bool((logprobs[row, positions].argmax(-1) == torch.tensor(target)).all())
        out.append((picked.sum().item(), greedy))
    return out


@pytest.mark.parametrize("left_padded", [False, True])
def test_loglikelihood_matches_transformers(arch_pair, left_padded):
    model, hf = arch_pair
    ids, mask = right_padded_batch([20, 12, 7], seed=22)
    lengths = mask.sum(1).tolist()
    # Score each row's last 4 tokens given what comes before them.
    starts = [n - 5 for n in lengths]
    targets = [ids[i, n - 4 : n].tolist() for i, n in enumerate(lengths)]
    # Make row 1's continuation the greedy one, so both flag values are tested.
    with torch.no_grad():
        greedy_ids = ids.clone()
        for j in range(4):
            pos = lengths[1] - 5 + j
            greedy_ids[1, pos + 1] = hf(greedy_ids[1:2, : pos + 1]).logits[0, -1].argmax()
    targets[1] = greedy_ids[1, lengths[1] - 4 : lengths[1]].tolist()
    expected = reference_loglikelihood(hf, greedy_ids, mask, starts, targets)
    if left_padded:
        shift = [ids.shape[1] - n for n in lengths]
        greedy_ids = torch.stack([torch.roll(r, s) for r, s in zip(greedy_ids, shift)])
        mask = torch.flip(mask, [1])
        starts = [s + d for s, d in zip(starts, shift)]
    got = ortmodule.loglikelihood(model, greedy_ids, mask, starts, targets)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected):
        assert abs(lp - ref_lp) < 1e-4
        assert greedy == ref_greedy
    assert got[1][1] is True


@pytest.mark.parametrize("way", ["pieces", "fused", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_log_normalizers_equal_float64_log_sum_exp(monkeypatch, way, dtype):
    """Every way (the CPU's cached pieces of `torch.logsumexp`, CUDA's fused float32 log-softmax
    read at the greedy token, the compiled reduction), on pieces that split the rows unevenly,
    against float64: the normalizer to float32's rounding and the greedy token equal to argmax,
    whatever the logits' precision; rows of large logits (near float16's limit) and of one dominant
    token included, and a row with a NaN (its greedy token the NaN's, as torch's argmax says)."""
    gen = torch.Generator().manual_seed(31)
    vocab = 1000
    logits = torch.randn(23, vocab, generator=gen) * 6
    logits[3] += 2000 if dtype != torch.float16 else 60000 - logits[3].max()
    logits[5, 17] = 80  # one token takes nearly all the probability
    logits[9, 400] = float("nan")
    logits = logits.to(dtype)
    monkeypatch.setattr(scoring, "CPU_CHUNK_BYTES", 4 * vocab * 5)  # pieces of 5 rows: 5+5+5+5+3
    monkeypatch.setattr(scoring, "CUDA_CHUNK_BYTES", 4 * vocab * 5)
    if way == "compiled":  # as the device's setting picks it
        monkeypatch.setitem(scoring.COMPILED_NORMALIZERS, "cpu", True)
    kwargs = {} if way == "compiled" else {"fused": way == "fused", "compiled": False}
    lse, greedy = scoring.log_normalizers(logits, **kwargs)
    reference = torch.logsumexp(logits.double(), dim=-1)
    finite = ~torch.isnan(reference)
    assert lse.dtype == torch.float32 and lse.shape == (23,)
    assert torch.equal(torch.isnan(lse), ~finite)
    assert ((lse.double() - reference).abs() / reference.abs().clamp(min=1))[finite].max().item() < 1e-6
    assert torch.equal(greedy, logits.argmax(-1))
    # Read at given columns (the targets, far from the greedy token), without a greedy token.
    at = torch.randint(0, vocab, (23,), generator=gen)
    lse, greedy = scoring.log_normalizers(logits, at=at, **kwargs)
    assert greedy is None
    assert ((lse.double() - reference).abs() / reference.abs().clamp(min=1))[finite].max().item() < 1e-6


def test_requests_that_read_distinct_rows_answer_as_the_rows_in_their_order(build):
    """`rows_of` naming every row once, in any order (lm-eval's rolling windows, batched by length):
    each request's answers are those of its row given as the request's own row, rows moved to the
    requests' order, greedy flags included; and where no greedy check is asked for, the same totals."""
    model = load_pair(build("llama"))[0]
    rows = [[5, 9, 2, 7, 3, 8], [4, 4, 1, 30, 31], [6, 2, 9, 9, 5, 1, 3]]
    ids, mask = pad_right(rows)
    rows_of, starts, targets = [2, 0, 1], [1, 2, 0], [[2, 9, 9, 5], [7, 3, 8], [4, 1, 30, 31]]
    mine = pad_right([rows[r] for r in rows_of])
    for greedy in (True, False):
        got = scoring.loglikelihood_totals(model, ids, mask, starts, targets, rows_of=rows_of, greedy=greedy)
        want = scoring.loglikelihood_totals(model, *mine, starts, targets, greedy=greedy)
        assert torch.equal(got, want), greedy
    assert got[0].lt(0).all()


def test_compiled_normalizers_give_the_same_answers(build, monkeypatch):
    """With `scoring.COMPILED_NORMALIZERS` on, lm-eval's scoring paths (requests with a greedy check,
    several reading one row; rolling windows without one) answer what they answer without it."""
    model = load_pair(build("llama"))[0]
    rows = [[5, 9, 2, 7, 3, 8], [4, 4, 1], [6, 2, 9, 9, 5, 1, 3]]
    ids, mask = pad_right(rows)
    starts, targets, rows_of = [2, 3, 0, 1], [[7, 3, 8], [8], [4, 1], [2, 9, 9, 5]], [0, 0, 1, 2]

    def answers() -> tuple[torch.Tensor, torch.Tensor]:
        return (scoring.loglikelihood_totals(model, ids, mask, starts, targets, rows_of=rows_of),
                scoring.loglikelihood_totals(model, ids, mask, [0, 0, 1], [[9, 2, 7], [4, 1], [2, 9, 9, 5]],
                                             greedy=False))

    expected = answers()
    monkeypatch.setitem(scoring.COMPILED_NORMALIZERS, "cpu", True)
    calls, compiled = [], scoring.compiled_normalizers
    monkeypatch.setattr(scoring, "compiled_normalizers", lambda logits, greedy: calls.append(greedy) or
                        compiled(logits, greedy))
    for got, want in zip(answers(), expected):
        assert torch.allclose(got[0], want[0], atol=1e-5) and torch.equal(got[1], want[1])
    assert True in calls and False in calls  # both ways ran compiled
    assert expected[0][1].sum() > 0  # the greedy check counts misses


def test_compiled_normalizers_that_fail_fall_back_with_a_warning(monkeypatch, caplog):
    """Where the compiled reduction cannot be made (no Triton or C++ compiler where it runs), the
    normalizers come from the uncompiled way, a warning names the setting, and it is not tried
    again; running out of memory stays an error."""
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(2))
    expected = scoring.log_normalizers(logits, compiled=False)
    monkeypatch.setitem(scoring.COMPILED_NORMALIZERS, "cpu", True)
    tries = []

    def broken(values, greedy):
        tries.append(greedy)
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(scoring, "compiled_normalizers", broken)
    with caplog.at_level("WARNING", logger="ortmodule"):
        got = scoring.log_normalizers(logits)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert "scoring.COMPILED_NORMALIZERS" in caplog.text and "cc is not found" in caplog.text
    assert scoring.COMPILED_NORMALIZERS["cpu"] is False
    scoring.log_normalizers(logits)
    assert tries == [True]  # not tried again
    monkeypatch.setitem(scoring.COMPILED_NORMALIZERS, "cpu", True)
    monkeypatch.setattr(scoring, "compiled_normalizers", lambda values, greedy: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory.")))
    with pytest.raises(torch.OutOfMemoryError):
        scoring.log_normalizers(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_argmax_equals_torchs(dtype):
    """`inputs.argmax` (NumPy's for float32 on the CPU) is torch's `argmax(-1)`: the first of equal
    maxima, a NaN taken as the maximum, a row of -inf's at 0, on strided views and 1-D and 3-D input."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randint(-3, 4, (6, 50), generator=gen).to(dtype)  # many ties
    if dtype.is_floating_point:
        values[2, 7] = values[2, 30] = float("nan")
        values[3] = float("-inf")
        values[4, 11] = float("inf")
    for case in (values, values[:, 5:40:3], values.t(), values[1], values.reshape(2, 3, 50)):
        got = inputs.argmax(case)
        assert got.dtype == torch.int64 and torch.equal(got, case.argmax(-1)), case


def test_loglikelihood_errors(llama):
    model = load_pair(llama)[0]
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="target token id 9999"):
        ortmodule.loglikelihood(model, ids, None, [1], [[9999]])
    with pytest.raises(ValueError, match="target token id -2 is outside"):
        ortmodule.loglikelihood(model, ids[[0, 0]], None, [1, 1], [[6, 7], [7, -2]])
    with pytest.raises(ValueError, match=f"target token id {2**70}"):
        ortmodule.loglikelihood(model, ids, None, [1], [[6, 2**70]])
    with pytest.raises(TypeError, match="target token ids must be integers"):
        ortmodule.loglikelihood(model, ids, None, [1], [[6, 7.0]])
    with pytest.raises(TypeError, match=r"target token ids must be integers, got \['bool'\]"):  # was token 1
        ortmodule.loglikelihood(model, ids, None, [1], [[6, True]])
    with pytest.raises(ValueError, match="row 0 has no target tokens"):
        ortmodule.loglikelihood(model, ids, None, [1], [[]])
    with pytest.raises(ValueError, match=r"row 0: starts\[0\] = 3 with 2 target token\(s\) asks for the logits at "
                                         r"columns 3 to 4, outside the input's 4 columns"):
        ortmodule.loglikelihood(model, ids, None, [3], [[5, 6]])
    with pytest.raises(ValueError, match=r"row 1: starts\[1\] = -1 with 1 target token\(s\) asks for the logits at "
                                         r"column -1,"):
        ortmodule.loglikelihood(model, ids[[0, 0]], None, [1, -1], [[6], [5]])
    with pytest.raises(ValueError, match="starts and targets need one entry per row: 2, got 1 and 2"):
        ortmodule.loglikelihood(model, ids[[0, 0]], None, [1], [[6], [7]])
    with pytest.raises(ValueError, match="no requests to score"):
        ortmodule.loglikelihood(model, ids[:0], None, [], [])
    for rows in ([1], [True], [-1]):  # rows_of indexes the batch's one row; a bool is not an index
        with pytest.raises(ValueError, match=r"rows_of must hold row indices in \[0, 1\)"):
            scoring.loglikelihood_totals(model, ids, None, [1], [[6]], rows_of=rows)
    with pytest.raises(ValueError, match="need one entry per entry of rows_of: 2, got 1 and 1"):
        scoring.loglikelihood_totals(model, ids, None, [1], [[6]], rows_of=[0, 0])
    with pytest.raises(ValueError, match=r"request 1: starts\[1\] = 4 "):  # requests reading rows (rows_of)
        scoring.loglikelihood_totals(model, ids, None, [0, 4], [[6], [5]], rows_of=[0, 0])
    # Starts that are not int columns, named, where Python or torch would say something else or take a bool as 1.
    for start, shown in ((1.0, "float 1.0"), (None, "NoneType None"), ("1", "str '1'"), (True, "the bool True"),
                         (torch.tensor(True), "the bool tensor(True)")):
        with pytest.raises(TypeError, match=rf"starts\[0\] must be an int column, got {re.escape(shown)}"):
            ortmodule.loglikelihood(model, ids, None, [start], [[6]])
    # Integer columns of any kind are taken: numpy's, torch's, a tensor of starts.
    expected = ortmodule.loglikelihood(model, ids, None, [1], [[6, 7]])
    assert ortmodule.loglikelihood(model, ids, None, [np.int64(1)], [[6, 7]]) == expected
    assert ortmodule.loglikelihood(model, ids, None, torch.tensor([1]), [[6, 7]]) == expected


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_asked_for_at_padding_are_refused_naming_the_position(llama, side):
    """A padded position's logits mean nothing: a loglikelihood whose targets run past its row's own
    tokens, or `logits_at` a padded column, is a ValueError naming the position, where it gave a number.
    Every position of a row's own tokens still answers, in either padding layout."""
    model = load_pair(llama)[0]
    ids, mask = right_padded_batch([10, 7], seed=8)
    if side == "left":
        mask = mask.flip(1)
    first = 0 if side == "right" else 3  # row 1's first real column
    last = first + 6
    padded = first - 1 if side == "left" else last + 1  # the padding column next to row 1's own tokens
    start = last if side == "right" else padded  # its targets run past its end, or begin before its start
    with pytest.raises(ValueError, match=rf"position \(1, {padded}\) is padding .*start plus its number of targets"):
        ortmodule.loglikelihood(model, ids, mask, [2, start], [[5], [6, 7]])
    named = rf"position \(1, {padded}\) is padding \(attention_mask\[1, {padded}\] is 0\)"
    with pytest.raises(ValueError, match=named):
        model.logits_at(ids, mask, [0, 1], [9, padded])
    full = model(ids, attention_mask=mask).logits
    own = model.logits_at(ids, mask, [1, 1, 0], [first, last, 9])
    assert torch.allclose(own, full[[1, 1, 0], [first, last, 9]], atol=1e-5)


@pytest.mark.parametrize("arch", MODEL_ARCHES)
def test_grouped_loglikelihood_equals_the_padded_batch(build, arch):
    """Three contexts (24, 17 and 9 tokens; longer than Gemma's 8-token windows), each with
    continuations of 1 to 5 tokens: the contexts run once, the continuations over copies of their
    KV caches, and the answers equal one right-padded prefill of every row."""
    model, _ = load_pair(build(arch))
    gen = torch.Generator().manual_seed(23)
    contexts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (24, 17, 9)]
    rows, groups, starts, targets = [], [], [], []
    for g, context in enumerate(contexts):
        for n in (1, 3, 5, 2):
            continuation = torch.randint(4, 500, (n,), generator=gen).tolist()
            rows.append((context + continuation)[:-1])
            groups.append(g)
            starts.append(len(context) - 1)
            targets.append(continuation)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), 2)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    expected = ortmodule.loglikelihood(model, ids, mask, starts, targets)
    got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets))
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected):
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy


def test_the_sharing_plan_without_a_model():
    """plan_sharing lays out prefixes, the pairs their last logits answer, and the steps after them."""
    rows = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8, 9], [7, 8, 10, 11]]
    groups = [0, 0, 1, 1]
    needed = [[3, 4], [2, 3], [1, 2], [2, 3]]  # positions whose logits each row asks for
    plan = sharing.plan_sharing(rows, groups, needed)
    # group 0 shares [1, 2, 3] but row 1 asks from position 2, so its prefix ends there: [1, 2, 3];
    # group 1 shares [7, 8] and row 2 asks from position 1: the prefix is [7, 8].
    assert plan.prefixes == [[1, 2, 3], [7, 8]]
    assert plan.owner == [0, 0, 1, 1]
    # pairs are numbered row by row: row 0 -> 0, 1; row 1 -> 2, 3; row 2 -> 4, 5; row 3 -> 6, 7
    assert plan.at_prefix == [(2, 0), (4, 1)]  # row 1 at position 2, row 2 at position 1
    assert plan.tokens == [[4, 5], [6], [9], [10, 11]]
    assert plan.steps == [([0, 1, 2, 3], [0, 3, 5, 6]), ([0, 3], [1, 7])]
    with pytest.raises(ValueError, match="the rows of group 1 do not start with the same token"):
        sharing.plan_sharing([[1, 2], [3, 4]], [1, 1], [[1], [1]])


def test_pad_right_places_every_row_at_the_left():
    """`pad_right` (all rows copied at once) gives what filling the batch row by row gives: ids
    from column 0, `pad` after them, a mask of ones over each row; as wide as the longest row or
    `width`; empty rows, tuples and a batch of only empty rows included."""
    generator = torch.Generator().manual_seed(3)
    cases = [([torch.randint(0, 50000, (n,), generator=generator).tolist() for n in (5, 0, 12, 1)], 7, 0),
             ([(1, 2), [3]], 0, 6), ([[]], 9, 2), ([[2**40, 4]], 0, 0)]
    for rows, pad, width in cases:
        wide = max(width, max(len(row) for row in rows))
        expected_ids = torch.full((len(rows), wide), pad, dtype=torch.int64)
        expected_mask = torch.zeros(len(rows), wide, dtype=torch.int64)
        for r, row in enumerate(rows):
            for c, token in enumerate(row):
                expected_ids[r, c], expected_mask[r, c] = token, 1
        ids, mask = pad_right(rows, pad, width)
        assert torch.equal(ids, expected_ids) and torch.equal(mask, expected_mask)


def test_prefix_groups_keep_the_long_shared_parts_together():
    """Rows that start with the same long prefix (a subject's few-shot examples) are grouped, in
    sorted order, each group's prefix as long as its rows share; a row that shares only a short
    start with a block, or fewer than `least` tokens with anyone, stays out; limits cut the
    prefix at a row's first scored position."""
    subject_a = list(range(100, 140))  # 40 tokens
    subject_b = list(range(200, 250))  # 50 tokens
    rows = [subject_a + [1, 2], subject_b + [3], subject_a + [4, 5, 6], subject_b + [7, 8],
            subject_a[:10] + [9, 9, 9],  # shares 10 tokens with subject a: alone
            subject_b + [7, 9], list(range(300, 340))]
    limits = [len(row) for row in rows]
    groups = sharing.prefix_groups(rows, limits, least=32)
    assert sorted(sorted(g) for g in groups) == [[0, 2], [1, 3, 5]]
    # A row whose first scored position comes early shares only that far: with a limit of 20 it
    # no longer shares 32 tokens with anyone.
    limits[2] = 20
    assert sorted(sorted(g) for g in sharing.prefix_groups(rows, limits, least=32)) == [[1, 3, 5]]
    # A row sharing 33 tokens with a block that shares 100: it stays alone rather than pulling the
    # block's prefix down to 33.
    block = list(range(400, 500))
    rows = [block[:33] + [1] * 20, block + [2], block + [3], block + [4]]
    groups = sharing.prefix_groups(rows, [len(r) for r in rows], least=32)
    assert sorted(sorted(g) for g in groups) == [[1, 2, 3]]


def test_grouped_totals_with_requests_sharing_rows(build):
    """`rows_of`: one-token choices after one row read its logits once; answers equal those of
    every request on its own row."""
    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    prefix = list(range(10, 40))
    rows = [prefix + [5, 6, 7], prefix + [8, 9], prefix + [11]]
    # Requests 0-3: four one-token choices after row 0; request 4: two tokens on row 1; 5: row 2.
    rows_of = [0, 0, 0, 0, 1, 2]
    starts = [32, 32, 32, 32, 30, 30]
    targets = [[3], [4], [12], [13], [9, 14], [11]]
    got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, [0, 0, 0], starts, targets, rows_of))
    with pytest.raises(ValueError, match="row 2 is read by no request"):
        scoring.grouped_loglikelihood_totals(model, rows, [0, 0, 0], starts[:5], targets[:5], rows_of[:5])
    ids, mask = pad_right([rows[r] for r in rows_of])
    expected = ortmodule.loglikelihood(model, ids, mask, starts, targets)
    assert len(got) == len(expected) == 6
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected):
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy


@pytest.mark.parametrize("arch", ["llama", "gemma3", "lfm2"])
def test_kept_prefixes_carry_a_prefix_to_the_next_call(build, arch):
    """`KeptPrefixes` between `grouped_loglikelihood_totals` calls (lm-eval's batches of one subject):
    a call whose groups begin with a kept prefix starts from its KV, whether its rows share exactly it,
    more than it, or less of it (the first position scored right at the end of the shorter prefix: the
    kept logits there are not kept, so it starts one token before); a prefix that shares too little
    with the kept ones is prefilled and kept instead. Every answer equals the padded rows' (and a hybrid
    model's convolution states start only from a kept prefix whole). Gemma 3's layers slide 8-token
    windows over the 40-token examples."""
    model, _ = load_pair(build(arch))
    kept = sharing.KeptPrefixes()
    reused = []
    for rows, groups, starts, targets in kept_prefix_calls(seed=7):
        before = kept.reused
        got = scoring.answers(scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets, kept=kept))
        reused.append(kept.reused - before)
        ids, mask = pad_right(rows)
        for (lp, greedy), (ref_lp, ref_greedy) in zip(got, ortmodule.loglikelihood(model, ids, mask, starts, targets)):
            assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy
    # A hybrid prefills the shorter prefix (call 4) and keeps it for the next call instead.
    assert reused == [0, 1, 1, 0 if arch == "lfm2" else 1, 1, 0, 1]
