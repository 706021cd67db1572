"""OrtModelForCausalLM against transformers on the same weights."""

import copy

import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import ScalarReads, cuda, load_pair, right_padded_batch
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from ortmodule import NotSupportedError, OrtModelForCausalLM, PackageError, load_tokenizer, loglikelihood, runtime
from ortmodule.hf import CACHE_NAME

FP32_TOL = 1e-4


def reference(hf_model, ids, mask):
    with torch.no_grad():
        return hf_model(ids, attention_mask=mask).logits


def max_diff_on_real(a, b, mask):
    return max((a[i][mask[i].bool()] - b[i][mask[i].bool()]).abs().max().item() for i in range(len(mask)))


def test_single_row_matches_transformers(arch_pair):
    model, hf = arch_pair
    ids, mask = right_padded_batch([17], seed=1)
    out = model(ids)
    assert isinstance(out, CausalLMOutputWithPast)
    assert out.logits.shape == (1, 17, model.config.vocab_size)
    assert out.logits.device == model.device
    assert (out.logits - reference(hf, ids, mask)).abs().max().item() < FP32_TOL


def test_right_padded_batch_matches_transformers(arch_pair):
    model, hf = arch_pair
    ids, mask = right_padded_batch([20, 12, 5], seed=2)
    logits = model(ids, attention_mask=mask).logits
    assert logits.shape == (3, 20, model.config.vocab_size)
    assert max_diff_on_real(logits, reference(hf, ids, mask), mask) < FP32_TOL


def test_left_padded_batch_matches_transformers(arch_pair):
    model, hf = arch_pair
    ids, mask = right_padded_batch([20, 12, 5], seed=3)
    left = torch.flip(mask, [1])  # the same lengths, padded on the left
    logits = model(ids, attention_mask=left).logits
    assert max_diff_on_real(logits, reference(hf, ids, left), left) < FP32_TOL


def test_cont_len_is_the_tail_of_the_full_logits(arch_pair):
    model, _ = arch_pair
    ids, mask = right_padded_batch([20, 12, 5], seed=4)
    full = model(ids, attention_mask=mask).logits
    tail = model(ids, attention_mask=mask, cont_len=5).logits
    assert tail.shape == (3, 5, model.config.vocab_size)
    assert torch.equal(tail, full[:, -5:])
    assert torch.equal(model(ids, attention_mask=mask, logits_to_keep=5).logits, tail)
    assert torch.equal(model.forward(ids, mask, 5).logits, tail)  # positional
    assert model(ids, attention_mask=mask, cont_len=0).logits.shape == full.shape


def test_cont_len_with_left_padding(llama):
    model, _ = load_pair(llama)
    ids, mask = right_padded_batch([20, 12, 5], seed=5)
    left = torch.flip(mask, [1])
    full = model(ids, attention_mask=left).logits
    assert torch.equal(model(ids, attention_mask=left, cont_len=4).logits, full[:, -4:])


def test_logits_to_keep_tensor_selects_positions(llama):
    model, _ = load_pair(llama)
    ids, mask = right_padded_batch([12, 9], seed=6)
    full = model(ids, attention_mask=mask).logits
    picked = model(ids, attention_mask=mask, logits_to_keep=torch.tensor([0, 3, 8])).logits
    assert torch.equal(picked, full[:, [0, 3, 8]])
    # transformers indexes the sequence with the tensor: a negative position counts from the end
    _, reference = load_pair(llama)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask, logits_to_keep=torch.tensor([-1, 0, -3])).logits
    picked = model(ids, attention_mask=mask, logits_to_keep=torch.tensor([-1, 0, -3])).logits
    assert torch.equal(picked, full[:, [11, 0, 9]])
    assert (picked[0] - expected[0]).abs().max() < 1e-4  # row 0's are its tokens' (row 1's 9 and 11 are padding)
    with pytest.raises(ValueError, match=r"logits_to_keep positions must lie in \[-12, 12\)"):
        model(ids, attention_mask=mask, logits_to_keep=torch.tensor([-13]))


def test_num_logits_to_keep_is_logits_to_keep_under_its_former_name(llama):
    """transformers 4.45-4.49 named it num_logits_to_keep; code written for them still passes it."""
    model, _ = load_pair(llama)
    ids, mask = right_padded_batch([12, 9], seed=6)
    full = model(ids, attention_mask=mask).logits
    assert torch.equal(model(ids, attention_mask=mask, num_logits_to_keep=1).logits, full[:, -1:])
    assert model(ids, attention_mask=mask, num_logits_to_keep=None).logits.shape == full.shape
    with pytest.raises(TypeError, match="pass one of logits_to_keep and num_logits_to_keep .*not both"):
        model(ids, attention_mask=mask, logits_to_keep=2, num_logits_to_keep=1)
    # cont_len is ortmodule's name of the same argument: with another of them, one was silently taken
    with pytest.raises(TypeError, match="pass one of cont_len and logits_to_keep .*not both"):
        model(ids, attention_mask=mask, cont_len=1, logits_to_keep=2)
    assert torch.equal(model(ids, attention_mask=mask, cont_len=1, num_logits_to_keep=None).logits, full[:, -1:])
    with pytest.raises(TypeError, match="does not support num_logits"):  # any other name is still refused
        model(ids, attention_mask=mask, num_logits=1)


def test_rewrite_off_gives_the_same_logits(llama):
    model, hf = load_pair(llama)
    plain = OrtModelForCausalLM.from_pretrained(llama.package_dir, rewrite_lm_head=False)
    assert model.keeps_positions and not plain.keeps_positions
    ids, mask = right_padded_batch([15, 7], seed=7)
    assert torch.allclose(plain(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, atol=1e-6)
    left = torch.flip(mask, [1])
    assert torch.allclose(
        plain(ids, attention_mask=left, cont_len=3).logits, model(ids, attention_mask=left,
                                                                  cont_len=3).logits, atol=1e-6
    )


def test_int32_ids_and_bool_mask(llama):
    model, hf = load_pair(llama)
    ids, mask = right_padded_batch([9, 6], seed=8)
    logits = model(ids.int(), attention_mask=mask.bool()).logits
    assert max_diff_on_real(logits, reference(hf, ids, mask), mask) < FP32_TOL


def test_labels_give_the_transformers_loss(llama):
    model, hf = load_pair(llama)
    ids, _ = right_padded_batch([16], seed=9)
    with torch.no_grad():
        expected = hf(ids, labels=ids).loss
    assert abs(model(ids, labels=ids).loss.item() - expected.item()) < 1e-5


@pytest.mark.parametrize("side", ["left", "right"])
def test_labels_of_a_padded_batch_give_the_loss_of_its_rows_unpadded(llama, side):
    """Pad labels at -100, as usual: the loss is transformers' over the rows without their padding.
    On left-padded rows transformers' own batch loss also counts each row's first token, predicted
    from a padded position whose logits mean nothing; ortmodule leaves that prediction out."""
    model, hf = load_pair(llama)
    lengths, width = [9, 4, 13], 13
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 512, (n,), generator=gen) for n in lengths]
    ids, mask = torch.full((3, width), 2), torch.zeros(3, width, dtype=torch.int64)
    for r, row in enumerate(rows):
        columns = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[r, columns], mask[r, columns] = row, 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, -1 if side == "left" else 2] = -100  # a label left out on purpose
    total, count = 0.0, 0
    with torch.no_grad():
        for r, row in enumerate(rows):
            row_labels = labels[r][mask[r] == 1][None]
            pairs = int((row_labels[0, 1:] != -100).sum())
            total += hf(row[None], labels=row_labels).loss.item() * pairs
            count += pairs
    loss = model(ids, attention_mask=mask, labels=labels).loss
    assert abs(loss.item() - total / count) < 1e-5
    if side == "right":  # no label predicted from padding: transformers' batch loss is the same
        with torch.no_grad():
            assert abs(loss.item() - hf(ids, attention_mask=mask, labels=labels).loss.item()) < 1e-5
    with pytest.raises(ValueError, match=r"labels must be a tensor of input_ids' shape \(3, 13\), got \(3, 12\)"):
        model(ids, attention_mask=mask, labels=labels[:, 1:])


def test_labels_that_are_no_token_ids_are_named(llama):
    """Labels outside the vocabulary (other than -100) are a ValueError naming the first, where torch's
    cross_entropy raised an IndexError on a CPU and stops the CUDA context with a device-side assert on a
    GPU; float or bool labels a TypeError (transformers' own refuses them inside cross_entropy). A label
    never predicted (the first column, a padded position's) is not read, as transformers does not."""
    model, _ = load_pair(llama)
    ids, mask = right_padded_batch([8, 6], seed=11)
    labels = ids.masked_fill(mask == 0, -100)
    for value in (512, -5):
        bad = labels.clone()
        bad[1, 3] = value
        with pytest.raises(ValueError, match=rf"labels\[1, 3\] is {value}, outside the vocabulary \[0, 512\)"):
            model(ids, attention_mask=mask, labels=bad)
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError, match=f"labels must hold integer token ids .*got dtype {dtype}"):
            model(ids, attention_mask=mask, labels=labels.to(dtype))
    unread = labels.clone()
    unread[:, 0] = -1
    unread[1, 7] = -7  # row 1's padding (its mask is 0 from column 6)
    assert torch.equal(model(ids, attention_mask=mask, labels=unread).loss, model(ids, attention_mask=mask,
                                                                                  labels=labels).loss)


def test_transformers_loss_keywords_ignore_index_and_shift_labels(llama):
    """transformers' loss keywords beside `labels`: `ignore_index` (the label skipped, -100 by default) and
    `shift_labels` (labels already shifted, one per position, as sequence parallelism passes them), alone
    and with `num_items_in_batch`: transformers' loss on the same batch (they were a TypeError). What they
    cannot be is named."""
    model, hf = load_pair(llama)
    ids, mask = right_padded_batch([10, 7], seed=5)
    labels = ids.masked_fill(mask == 0, -100)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shifted[0, 2] = -100
    cases = [dict(labels=labels.masked_fill(labels == -100, 600), ignore_index=600),
             dict(labels=labels, shift_labels=shifted), dict(labels=labels, shift_labels=shifted, num_items_in_batch=9)]
    with torch.no_grad():
        for given in cases:
            ours, theirs = (m(ids, attention_mask=mask, **given).loss.item() for m in (model, hf))
            assert abs(ours - theirs) < 1e-5, given
    assert abs(model(ids, attention_mask=mask, **cases[1]).loss.item() -
               model(ids, attention_mask=mask, labels=labels).loss.item()) > 1e-3  # shift_labels was read
    with pytest.raises(ValueError, match=r"shift_labels must be an integer tensor of input_ids' shape \(2, 10\)"):
        model(ids, labels=labels, shift_labels=shifted[:, 1:])
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        model(ids, labels=labels, ignore_index="-100")
    bad = shifted.clone()
    bad[1, 2] = 512
    with pytest.raises(ValueError, match=r"shift_labels\[1, 2\] is 512, outside the vocabulary"):
        model(ids, attention_mask=mask, labels=labels, shift_labels=bad)


def test_fp16_package_matches_within_half_precision(build):
    fixture = build("llama", precision="fp16")
    model, hf = load_pair(fixture)
    assert model.dtype == torch.float16
    ids, mask = right_padded_batch([20, 11], seed=10)
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.float16
    assert max_diff_on_real(logits.float(), reference(hf, ids, mask), mask) < 2e-2
    # Decode steps over the cache (the builder's repeat_kv shapes, which broke every step on a CPU,
    # are dropped at load: graph.forget_wrong_shapes), with the rewrite and without it.
    full = reference(hf, ids[:1], None)
    for each in (model, OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head=False)):
        out = each(ids[:1, :12], use_cache=True)
        for column in range(12, 20):
            out = each(ids[:1, column : column + 1], past_key_values=out.past_key_values, use_cache=True)
            assert (out.logits[0, -1].float() - full[0, column]).abs().max().item() < 2e-2


def test_fp16_package_decodes_where_the_rewrite_is_skipped(build, monkeypatch):
    """Where the LM-head rewrite does not apply to a graph (graph.py skips it), the package's own
    graph is still repaired at load (the builder's repeat_kv shapes): decode steps run and equal the
    prefill's logits, as with the rewrite off."""
    from ortmodule import graph

    fixture = build("llama", precision="fp16")
    monkeypatch.setattr(graph, "lm_head_graph", lambda *args, **kwargs: None)  # as for a graph it cannot rewrite
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert not model.keeps_positions
    ids, _ = right_padded_batch([16], seed=13)
    full = model(ids).logits
    out = model(ids[:, :10], use_cache=True)
    for column in range(10, 16):
        out = model(ids[:, column : column + 1], past_key_values=out.past_key_values, use_cache=True)
        assert (out.logits[0, -1].float() - full[0, column].float()).abs().max().item() < 2e-2


def test_fp16_cpu_package_runs_one_new_token_at_a_time_over_a_cache(build):
    """The model builder's fp16 export for a CPU attends with MultiHeadAttention and builds its
    causal mask over the new tokens alone: several new tokens over a past failed inside ONNX Runtime
    ("invalid expand shape"), which the CPU's long rows in chunks (prefill_chunk, default 256: rows of
    512 tokens and more) and the server's long prompts (in chunks of `--prefill-chunk`) ran into.
    Such a package chunks nothing by default and refuses a chunk asked for, with an error that says
    why; a step of several tokens over a cache runs one token at a time, with the same logits; the
    server prefills its prompts whole."""
    fixture = build("llama", precision="fp16")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert model.decoder.spec.steps_one_token and model.decoder.prefill_chunk == 0
    assert not OrtModelForCausalLM.from_pretrained(build("llama").package_dir).decoder.spec.steps_one_token
    with pytest.raises(ValueError, match="MultiHeadAttention .* use prefill_chunk=0"):
        OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=7)
    ids, _ = right_padded_batch([20], seed=4)
    out = model(ids[:, :12], use_cache=True)
    full = model(ids).logits
    out = model(ids[:, 12:15], past_key_values=out.past_key_values, use_cache=True)  # three tokens in one step
    assert (out.logits[0].float() - full[0, 12:15].float()).abs().max().item() < 2e-2
    for column in range(15, 20):
        out = model(ids[:, column : column + 1], past_key_values=out.past_key_values, use_cache=True)
        assert (out.logits[0, -1].float() - full[0, column].float()).abs().max().item() < 2e-2

    from helpers import LiveServer

    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    prompt = ids[0].tolist()
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)[0, 20:].tolist()
    server = LiveServer(create_app(model, load_tokenizer(fixture.package_dir), name="fp16", prefill_chunk=8))
    try:
        answer = server.client.post("/v1/completions", json={"model": "fp16", "prompt": prompt, "max_tokens": 5,
                                                             "temperature": 0, "logprobs": 0}).json()
    finally:
        server.stop()
    text = load_tokenizer(fixture.package_dir).decode(expected, skip_special_tokens=True)
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == 5 and answer["choices"][0]["text"] == text


def test_sliding_window_layers_keep_a_cache_as_long_as_their_rows(build):
    """Builder 0.18 marks a sliding-window layer's GroupQueryAttention `sliding_window_cache` (a KV
    buffer of exactly the window, as a ring), which ONNX Runtime's CUDA kernel enforces; ortmodule
    drops the mark at load (graph.unbounded_window_caches) and keeps every layer's cache as long as
    its rows: a prefill and decode steps past the window (Gemma 3's fixture: 8) give transformers'
    logits, with the LM-head rewrite and without it."""
    fixture = build("gemma3")
    package_graph = onnx.load(str(fixture.package_dir / "model.onnx"), load_external_data=False)
    marked = [n for n in package_graph.graph.node
              if any(a.name == "sliding_window_cache" and a.i for a in n.attribute)]
    assert marked, "the builder no longer marks windowed caches: this test checks nothing"
    model, hf = load_pair(fixture)
    ids, _ = right_padded_batch([24], seed=21)
    full = reference(hf, ids, None)
    for each in (model, OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head=False)):
        loaded = onnx.load_from_string(each.decoder.graph_bytes or each.decoder.plain_bytes)
        assert not any(a.name == "sliding_window_cache" for n in loaded.graph.node for a in n.attribute)
        out = each(ids[:, :14], use_cache=True)
        assert out.past_key_values.keys[0].shape[2] >= 14  # the windowed layer's buffer holds every column
        for column in range(14, 24):
            out = each(ids[:, column : column + 1], past_key_values=out.past_key_values, use_cache=True)
            assert (out.logits[0, -1] - full[0, column]).abs().max().item() < 1e-3


def test_a_sliding_window_package_whose_attention_ignores_the_window_is_refused(build):
    """The model builder's fp16 export of Gemma 3 for a CPU attends with MultiHeadAttention, which
    sees every past position: past the 8-token window its logits differed from transformers' by up to
    3.0 where they reach 3.1. Loading it is a PackageError that says so (it once failed inside ONNX
    Runtime at load, by chance, and ran wrong once the windowed layers' buffers were unbounded)."""
    fixture = build("gemma3", precision="fp16")
    with pytest.raises(PackageError, match="MultiHeadAttention, which sees every past position"):
        OrtModelForCausalLM.from_pretrained(fixture.package_dir)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "lfm2"])
def test_forward_and_cache_steps_read_no_value_back(build, arch):
    """A forward (`cont_len`, right padding) and a cache continued by decode steps read no value out
    of a tensor (on CUDA each such read waits for the device: tests/test_cuda.py counts the copies
    there, and this catches a new one on any machine), for a plain decoder, sliding windows and a
    hybrid's convolution states."""
    model = OrtModelForCausalLM.from_pretrained(build(arch).package_dir)
    ids, mask = right_padded_batch([20, 11, 6], seed=1)

    def steps():
        out, seen = model(ids, attention_mask=mask, use_cache=True), mask
        for _ in range(3):
            seen = torch.cat([seen, torch.ones(3, 1, dtype=mask.dtype)], 1)
            out = model(ids[:, :1], attention_mask=seen, past_key_values=out.past_key_values, use_cache=True)

    for call in (lambda: model(ids, attention_mask=mask, cont_len=4), steps):
        call()
        with ScalarReads() as reads:
            call()
        assert reads.count == 0


# The model builder's graph options (`ortmodule export --extra-option` / `extra_options`) that change
# the decoder's graph: the gate and up projections in one MatMul then a Split, the query, key and
# value projections as three MatMuls instead of one packed.
BUILDER_GRAPH_OPTIONS = [("llama", "fuse_mlp_gate_up"), ("llama", "fuse_qkv=false"), ("qwen3", "fuse_qkv=false")]


@pytest.mark.parametrize("arch,option", BUILDER_GRAPH_OPTIONS)
def test_packages_exported_with_graph_options_match_transformers(build, arch, option):
    """A package exported with one of the builder's graph options: its graph differs from the
    default export's, and its logits (padded batch, decode steps) and greedy tokens equal
    transformers' on the same weights."""
    key, _, value = option.partition("=")
    fixture = build(arch, extra_options=((key, value or "true"),))
    ops = [n.op_type for n in onnx.load(str(fixture.package_dir / "model.onnx"), load_external_data=False).graph.node]
    default = [n.op_type for n in onnx.load(str(build(arch).package_dir / "model.onnx"),
                                            load_external_data=False).graph.node]
    assert ops.count("MatMul") != default.count("MatMul")  # the option took effect
    model, hf = load_pair(fixture)
    ids, mask = right_padded_batch([20, 12, 5], seed=12)
    assert max_diff_on_real(model(ids, attention_mask=mask).logits, reference(hf, ids, mask), mask) < FP32_TOL
    full = reference(hf, ids[:1], None)
    out = model(ids[:1, :12], use_cache=True)
    for column in range(12, 20):
        out = model(ids[:1, column : column + 1], past_key_values=out.past_key_values, use_cache=True)
        assert (out.logits[0, -1] - full[0, column]).abs().max().item() < FP32_TOL
    prompt = ids[:2, :9]
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)


def test_zero_copy_binding(llama, monkeypatch):
    """Inputs are bound to the caller's memory and logits are written in place: no numpy, no copies."""
    model, _ = load_pair(llama)
    bound_inputs, bound_outputs = {}, {}
    from_dlpack = ort.OrtValue.from_dlpack

    def spy_input(binding, name, tensor):
        value = from_dlpack(tensor)
        bound_inputs[name] = (tensor.data_ptr(), value.data_ptr())
        binding.bind_ortvalue_input(name, value)

    real_bind_output = runtime.bind_output

    def spy_output(binding, name, tensor):
        bound_outputs[name] = tensor.data_ptr()
        real_bind_output(binding, name, tensor)

    def forbidden(*args, **kwargs):
        raise AssertionError("a host copy through numpy")

    monkeypatch.setattr(runtime, "bind_input", spy_input)
    monkeypatch.setattr(runtime, "bind_output", spy_output)
    monkeypatch.setattr(ort.OrtValue, "numpy", forbidden)
    monkeypatch.setattr(ort.IOBinding, "copy_outputs_to_cpu", forbidden)
    ids = torch.randint(4, 512, (2, 10))
    logits = model(ids, cont_len=3).logits
    torch_ptr, ort_ptr = bound_inputs[model.package.decoder.input_ids]
    assert torch_ptr == ids.data_ptr() == ort_ptr  # the caller's int64 CPU tensor itself
    assert logits.data_ptr() == bound_outputs[model.package.decoder.logits]


def test_hf_surface(llama):
    model, hf = load_pair(llama)
    assert isinstance(model, torch.nn.Module)
    assert isinstance(model.config, PretrainedConfig)
    for field in ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]:
        assert getattr(model.config, field) == getattr(hf.config, field), field
    assert model.config.max_position_embeddings == hf.config.max_position_embeddings
    assert model.config.model_type == "llama"
    assert model.generation_config.eos_token_id == hf.config.eos_token_id
    assert model.generation_config.pad_token_id == hf.config.pad_token_id
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.name_or_path == str(llama.package_dir)
    assert model.main_input_name == "input_ids"
    assert model.eval() is model and model.to("cpu") is model and model.cpu() is model
    assert model.can_generate()
    assert model.tie_weights() is None
    assert model.num_parameters() == hf.num_parameters()  # test_num_parameters_are_transformers_count
    with pytest.raises(TypeError, match="exported as torch.float32"):
        model.to(torch.float16)


@pytest.mark.parametrize("arch, fields", [("llama", {}), ("qwen3", {}), ("gemma3", {}), ("phi3", {}),
                                          ("lfm2", {"num_layers": 4}), ("llama", {"precision": "int4"})],
                         ids=["llama", "qwen3", "gemma3", "phi3", "lfm2", "llama-int4"])
def test_num_parameters_are_transformers_count(build, arch, fields):
    """`num_parameters()` and `num_parameters(exclude_embeddings=True)` (lm-eval's results record the
    first as `model_num_parameters`) are transformers' on the same weights: the graph's rotary tables
    left out, a tied embedding counted once (Gemma 3's), a 4-bit package's weights at their elements."""
    model, hf = load_pair(build(arch, **fields))
    assert model.num_parameters() == hf.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == hf.num_parameters(exclude_embeddings=True)
    assert model.num_parameters(only_trainable=True) == 0


def test_the_first_parameter_tells_the_device_and_dtype(build):
    """`next(model.parameters())`, how much scoring code finds where to put its inputs: an empty, frozen
    parameter on the model's device in the package's dtype (fp16 here), the same one each time, seen
    through a wrapping module too; the graph's weights are still what `num_parameters()` counts."""
    model = OrtModelForCausalLM.from_pretrained(build("llama", precision="fp16").package_dir)
    first = next(model.parameters())
    assert isinstance(first, torch.nn.Parameter) and first.numel() == 0 and not first.requires_grad
    assert (first.device, first.dtype) == (model.device, model.dtype) == (torch.device("cpu"), torch.float16)
    assert [name for name, _ in model.named_parameters()] == ["device_anchor"] and next(model.parameters()) is first
    assert [name for name, _ in torch.nn.ModuleDict({"lm": model}).named_parameters()] == ["lm.device_anchor"]
    assert list(model.state_dict()) == ["device_anchor", "package_fingerprint"] and model.num_parameters() > 1000
    assert model.load_state_dict(model.state_dict()) is not None  # torch's strict load takes its own state back


def test_a_state_dict_of_weights_is_refused_naming_why(build):
    """`load_state_dict` of a checkpoint's weights (transformers' state dict on the same architecture, a
    fine-tuned one, say) cannot change a package's numbers: a NotSupportedError saying to export, where torch
    named unexpected keys, and with `strict=False` skipped them and left the package's logits unchanged.
    Inside a wrapping module only its own keys count; its own state still loads back."""
    fixture = build("llama")
    model, hf = load_pair(fixture)
    weights = hf.state_dict()
    for strict in (True, False):
        with pytest.raises(NotSupportedError, match=r"load_state_dict: model.embed_tokens.weight, .* and \d+ more "
                                                    r"are weights.*ortmodule export"):
            model.load_state_dict(weights, strict=strict)
    wrapper = torch.nn.ModuleDict({"lm": model, "head": torch.nn.Linear(2, 2)})
    state = wrapper.state_dict()
    assert sorted(state) == ["head.bias", "head.weight", "lm.device_anchor", "lm.package_fingerprint"]
    wrapper.load_state_dict(state)
    with pytest.raises(NotSupportedError, match="lm_head.weight are weights"):
        wrapper.load_state_dict({**state, "lm.lm_head.weight": weights["lm_head.weight"]})


def test_a_weight_written_into_the_first_parameter_is_refused_naming_why(build):
    """Code that copies or averages another model's weights into this one's parameters (trl's sync_ref_model, an
    EMA) finds only the empty anchor: a NotSupportedError naming why, through `.data` too, where torch would say
    that sizes do not match. What works on an empty tensor still does, and copies keep the anchor's type."""
    model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    anchor, weight = next(model.parameters()), torch.ones(4, 8)
    writes = [("copy_", lambda t: t.copy_(weight)), ("add_", lambda t: t.mul_(0.5).add_(weight, alpha=0.5)),
              ("lerp_", lambda t: t.lerp_(weight, 0.1)), ("add_", lambda t: t.__iadd__(weight))]  # `+=`
    for name, write in writes:
        for target in (anchor.data, anchor):
            with torch.no_grad(), pytest.raises(NotSupportedError, match=f"{name}.. into .*device_anchor: .*sync_ref"):
                write(target)
    with pytest.raises(RuntimeError, match="size") as raised:  # not a write: torch's own error
        anchor + weight
    assert not isinstance(raised.value, NotSupportedError)
    with torch.no_grad():
        anchor.data.mul_(0.5).zero_()
        anchor.copy_(torch.empty(0))
    assert anchor.shape == (0,) and not anchor.requires_grad and (anchor * 2).shape == (0,)
    assert type(copy.deepcopy(model).device_anchor) is type(anchor) and repr(anchor).startswith("Parameter containing")


def test_config_json_in_package_is_used(llama, tmp_path):
    import shutil

    package = tmp_path / "pkg"
    shutil.copytree(llama.package_dir, package)
    shutil.copy(llama.hf_dir / "config.json", package / "config.json")
    model = OrtModelForCausalLM.from_pretrained(package)
    assert type(model.config).__name__ == "LlamaConfig"
    assert model.config.initializer_range == llama.spec.initializer_range  # only config.json has it


def test_load_tokenizer_matches_the_checkpoint(llama):
    from transformers import AutoTokenizer

    ours = load_tokenizer(llama.package_dir)
    theirs = AutoTokenizer.from_pretrained(llama.hf_dir)
    text = "The capital of France is Paris. ONNX Runtime runs fast."
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.eos_token_id == theirs.eos_token_id


@cuda
def test_cuda_matches_transformers(llama):
    model, hf = load_pair(llama, device="cuda")
    ids, mask = right_padded_batch([20, 12, 5], seed=11)
    logits = model(ids, attention_mask=mask, cont_len=4).logits  # CPU inputs, CUDA outputs
    assert logits.device.type == "cuda"
    ref = reference(hf, ids, mask)[:, -4:]
    assert torch.allclose(logits.cpu()[0], ref[0], atol=FP32_TOL)
    cuda_ids = ids.cuda()
    assert torch.equal(model(cuda_ids, attention_mask=mask.cuda(), cont_len=4).logits, logits)


@cuda
def test_to_moves_the_sessions(llama):
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    ids = torch.randint(4, 512, (2, 8))
    cpu_logits = model(ids).logits
    assert next(model.parameters()).device.type == "cpu"
    model.to("cuda")
    assert model.device.type == "cuda" and next(model.parameters()).device == model.device
    assert torch.allclose(model(ids).logits.cpu(), cpu_logits, atol=1e-5)


def test_cuda_provider_options_pin_the_attention_kernels():
    """CUDA sessions get ortmodule's attention kernels (no cuDNN SDPA, which builds a graph per new
    shape) unless the caller names `sdpa_kernel`; the stream and device options stay ortmodule's."""
    from types import SimpleNamespace

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime build has no CUDA provider")
    stream = SimpleNamespace(cuda_stream=1234)  # stands for a torch stream: only its handle is read
    (name, options), _ = runtime.providers(torch.device("cuda", 0), None, stream)
    assert name == "CUDAExecutionProvider"
    assert options["sdpa_kernel"] == str(runtime.CUDA_ATTENTION_KERNELS) == "19"  # flash | efficient | unfused
    assert options["user_compute_stream"] == "1234" and options["use_tf32"] == "0"
    (_, options), _ = runtime.providers(torch.device("cuda", 0), {"sdpa_kernel": 0}, stream)
    assert options["sdpa_kernel"] == "0"
    with pytest.raises(ValueError, match="user_compute_stream"):
        runtime.providers(torch.device("cuda", 0), {"user_compute_stream": "1"}, stream)


def test_cuda_graphs_by_default_only_where_they_can_run(monkeypatch, llama):
    """`runtime.CUDA_GRAPHS_BY_DEFAULT` (on since the GPU ran the CUDA tests with it): on CUDA a
    half-precision package's provider options get `enable_cuda_graph`, unless the caller set it either
    way; never an fp32 package's (its attention runs on the CPU, which CUDA graphs refuse) nor the
    CPU's, and a CPU model loads with it on as without. tests/test_cuda.py checks what it does there."""
    assert runtime.CUDA_GRAPHS_BY_DEFAULT
    monkeypatch.setattr(runtime, "CUDA_GRAPHS_BY_DEFAULT", False)
    assert runtime.default_cuda_graphs({"x": "1"}, "cuda", True) == {"x": "1"}  # off: as given
    monkeypatch.setattr(runtime, "CUDA_GRAPHS_BY_DEFAULT", True)
    assert runtime.default_cuda_graphs(None, "cuda", True) == {"enable_cuda_graph": "1"}
    assert runtime.default_cuda_graphs({"use_tf32": "1"}, "cuda", True) == {"use_tf32": "1", "enable_cuda_graph": "1"}
    assert runtime.default_cuda_graphs({"enable_cuda_graph": "0"}, "cuda", True) == {"enable_cuda_graph": "0"}
    assert runtime.default_cuda_graphs(None, "cuda", False) is None
    assert runtime.default_cuda_graphs(None, "cpu", True) is None
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    assert not model.decoder.session.cuda_graphs
    ids, hf = torch.tensor([[15, 19, 22, 27]]), load_pair(llama)[1]
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **settings), hf.generate(ids, **settings))


def test_a_graph_refused_with_default_cuda_graphs_loads_without_them(monkeypatch, llama, caplog):
    """Where ONNX Runtime refuses the default CUDA graphs for a package's graph (control flow, nodes on
    the CPU), the model loads without them and says so; where the caller asked for them, the refusal is
    the caller's error. (On a CPU, the CUDA provider's refusal stands in: an option that the open fails.)"""
    from ortmodule import decoder as decoder_module

    opened, original = [], decoder_module._open

    def refusing(package, source, device, folder, session_options, options, **kwargs):
        opened.append(dict(options or {}))
        if "enable_cuda_graph" in (options or {}):
            raise RuntimeError("This session cannot use the CUDA Graph feature as requested by the user")
        return original(package, source, device, folder, session_options, options, **kwargs)

    monkeypatch.setattr(decoder_module, "_open", refusing)
    monkeypatch.setattr(runtime, "default_cuda_graphs", lambda options, device_type, half: {
        **(options or {}), "enable_cuda_graph": "1"})
    with caplog.at_level("WARNING", logger="ortmodule"):
        model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    assert [("enable_cuda_graph" in o) for o in opened[:2]] == [True, False]
    assert "does not run with CUDA graphs" in caplog.text and "CUDA Graph feature" in caplog.text
    assert not model.decoder.session.cuda_graphs
    ids = torch.tensor([[15, 19, 22, 27]])
    assert model(ids).logits.shape[:2] == (1, 4)
    monkeypatch.setattr(runtime, "default_cuda_graphs", lambda options, device_type, half: options)
    with pytest.raises(RuntimeError, match="CUDA Graph feature"):
        OrtModelForCausalLM.from_pretrained(llama.package_dir, provider_options={"enable_cuda_graph": "1"})


def test_an_uncaptured_run_of_a_session_with_cuda_graphs_may_run_again_after_out_of_memory():
    """An out-of-memory run on CUDA empties torch's cache and runs again (`runtime.retrying_on_torch_cache`);
    with CUDA graphs on by default, the prefills and forwards of such a session (graph id -1) keep that,
    and only a run under a graph's id, which may be a capture, is not run twice."""
    from types import SimpleNamespace

    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    graphs = runtime.Session(None, stream=cuda, cuda_graphs=True)
    assert graphs.retried_on(-1) == torch.device("cuda", 0) and graphs.retried_on(3) is None
    assert runtime.Session(None, stream=cuda).retried_on(3) == torch.device("cuda", 0)
    assert runtime.Session(None).retried_on(-1) is None  # a CPU session


def test_a_decode_step_whose_cuda_graph_fails_runs_again_without(llama, caplog):
    """CUDA graphs are a half-precision package's default on CUDA, and a package's kernels may not all
    allow a capture: a decode step whose run under its graph id fails runs again uncaptured, the model's
    steps run uncaptured from then on (a warning says so), and generate gives transformers' tokens. (On a
    CPU, a session that claims CUDA graphs and refuses every run under a graph id stands in.)"""
    import dataclasses

    class Refusing:  # the session's ONNX Runtime session, failing the runs that would capture
        def __init__(self, inner):
            self.inner, self.refused = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run_with_iobinding(self, binding, options=None):
            if options is not None and int(options.get_run_config_entry("gpu_graph_id")) >= 0:
                self.refused += 1
                raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")
            return self.inner.run_with_iobinding(binding, options)

    model = OrtModelForCausalLM.from_pretrained(llama.package_dir)
    refusing = Refusing(model.decoder.session.ort_session)
    model.decoder.session = dataclasses.replace(model.decoder.session, ort_session=refusing, cuda_graphs=True)
    hf = load_pair(llama)[1]
    ids = torch.tensor([[15, 19, 22, 27], [5, 6, 7, 8]])
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with caplog.at_level("WARNING", logger="ortmodule"):
        assert torch.equal(model.generate(ids, **settings), hf.generate(ids, **settings))
    assert refusing.refused == 1 and model.decoder.graphs_failed
    assert "failed with CUDA graphs on" in caplog.text and "operation not permitted" in caplog.text
    wider = torch.tensor([[15, 19, 22, 27, 31]])  # other steps (another shape): uncaptured from the start
    more = dict(settings, attention_mask=torch.ones_like(wider))
    assert torch.equal(model.generate(wider, **more), hf.generate(wider, **more))
    assert refusing.refused == 1


def test_cuda_device_without_index_and_a_cuda_session_that_falls_to_the_cpu(monkeypatch):
    """`torch.device("cuda")` (no index) names torch's current device to the CUDA provider (it was
    passed as "None", which the provider refuses); and a CUDA session that ONNX Runtime made without
    its CUDA provider (refused options or missing CUDA libraries: it prints an error and goes on on
    the CPU) is an error, not a model that silently runs on the host."""
    from types import SimpleNamespace

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime build has no CUDA provider")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    stream = SimpleNamespace(cuda_stream=1234)
    (_, options), _ = runtime.providers(torch.device("cuda"), None, stream)
    assert options["device_id"] == "3"
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=10)
    providers = [("CUDAExecutionProvider", {"device_id": "0"}), ("CPUExecutionProvider", {})]
    if torch.cuda.is_available():  # a provider option the CUDA provider refuses
        providers[0][1]["device_id"] = "None"
    with pytest.raises(RuntimeError, match="CUDA"):
        runtime._inference_session(torch.device("cuda", 0), "a test graph", model.SerializeToString(),
                                   ort.SessionOptions(), providers)


@cuda
def test_cuda_sessions_run_with_the_pinned_attention_kernels(build):
    fixture = build("llama", precision="fp16", execution_provider="cuda")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    assert model.session.get_provider_options()["CUDAExecutionProvider"]["sdpa_kernel"] == "19"
    chosen = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda",
                                                 provider_options={"sdpa_kernel": 0})
    assert chosen.session.get_provider_options()["CUDAExecutionProvider"]["sdpa_kernel"] == "0"
    ids = torch.randint(4, 512, (3, 37))
    assert (model(ids).logits - chosen(ids).logits).abs().max().item() < 2e-2  # the same numbers in fp16


def test_a_dropped_model_frees_its_sessions_at_once(llama):
    """`del model` frees its ONNX Runtime sessions and the runners made on the way (decode steps at
    fixed addresses, the extend and prefill graphs) without waiting for Python's cyclic garbage
    collector: none of them refers back to the decoder strongly. (With cycles, a benchmark that
    loaded three models in turn held ~10 GB of the first two until a collection.)"""
    import gc
    import weakref

    import ortmodule

    gc.collect()
    gc.disable()
    try:
        model = OrtModelForCausalLM.from_pretrained(llama.package_dir, prefill_attention="onnx")
        ids = torch.randint(4, 500, (2, 12), generator=torch.Generator().manual_seed(0))
        model(ids, cont_len=2)
        model.generate(ids, max_new_tokens=3, do_sample=False)
        model.measured_costs()
        ortmodule.score(model, None, [5, 6, 7, 8], [[9, 10], [11]], [1, 2], reuse_prefix=True)
        step = model(ids[:, :1], past_key_values=model(ids, use_cache=True)[CACHE_NAME])
        decoder = model.decoder
        assert decoder.causal is not None and decoder.extender() is not None and decoder.fixed
        made = {"model": model, "decoder": decoder, "session": decoder.session, "extender": decoder.extender(),
                "prefill graph": decoder.causal, "decode steps": next(iter(decoder.fixed.values()))}
        alive = {name: weakref.ref(thing) for name, thing in made.items()}
        del model, decoder, made, step
        assert [name for name, ref in alive.items() if ref() is not None] == []
    finally:
        gc.enable()


def test_a_callers_session_options_load_and_run_without_onnx_runtimes_warnings(llama, capfd):
    """A caller's `session_options` serve every session a model makes (the package graph rewritten,
    the extend graph's): the weights' folder entry they need is set once, where setting it again on the
    same object printed ONNX Runtime's "Config with key ... already exists ... will be overwritten"
    warning on every session after the first. The logits are the default options'."""
    own = ort.SessionOptions()
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir, session_options=own)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits = model(ids).logits
    model.decoder.extender()  # a second session over the same options
    loglikelihood(model, torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12]]), torch.ones(2, 6, dtype=torch.int64),
                  starts=[3, 3], targets=[[9, 10], [11, 12]])
    assert "already exists" not in capfd.readouterr().err
    assert torch.equal(logits, OrtModelForCausalLM.from_pretrained(llama.package_dir)(ids).logits)


def test_sessions_spin_only_within_a_run(llama):
    """ortmodule's own session options let ONNX Runtime's workers spin between a run's parallel
    sections and stop them when the run returns, on every session a model makes (the package
    graph's, the prefill and extend graphs'); a caller's `session_options` are used as given."""
    model = OrtModelForCausalLM.from_pretrained(llama.package_dir, prefill_attention="onnx")
    sessions = {"package graph": model.session, "prefill graph": model.decoder.causal.session.ort_session,
                "extend graph": model.decoder.extender().session.ort_session}
    for name, session in sessions.items():
        options = session.get_session_options()
        assert [options.get_session_config_entry(key) for key, _ in runtime.SPINNING] == ["1", "1"], name
    own = ort.SessionOptions()
    own.add_session_config_entry("session.intra_op.allow_spinning", "0")
    chosen = OrtModelForCausalLM.from_pretrained(llama.package_dir, session_options=own).session.get_session_options()
    assert chosen.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(RuntimeError, match="does not have"):
        chosen.get_session_config_entry("session.force_spinning_stop")
