"""Bad input and bad packages get clear errors, raised before ONNX Runtime runs."""

import json
import re
import shutil

import pytest
import torch
from helpers import load_pair

from ortmodule import NotSupportedError, OrtModelForCausalLM, PackageError, load_tokenizer, read_package


@pytest.fixture(scope="module")
def model(llama):
    return load_pair(llama)[0]


def test_out_of_vocabulary_id_is_named(model):
    ids = torch.tensor([[5, 6, 7, 512, 8]])
    with pytest.raises(ValueError, match=r"token id 512 at input_ids\[0, 3\].*\[0, 512\)"):
        model(ids)


def test_negative_id_is_named(model):
    with pytest.raises(ValueError, match="token id -3"):
        model(torch.tensor([[5, -3, 7]]))


def test_too_long_names_both_lengths(model):
    with pytest.raises(ValueError, match="input length 300 exceeds the model's context length 256"):
        model(torch.full((1, 300), 5))


@pytest.mark.parametrize("shape", [(1, 0), (3, 0), (0, 4)])
def test_no_tokens_are_named_in_forward_and_generate(model, shape):
    """Prompts without tokens: transformers' own generate fails on a batch of them with an IndexError."""
    with pytest.raises(ValueError, match=rf"input_ids is empty: shape \({shape[0]}, {shape[1]}\)"):
        model(torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"input_ids is empty: shape \({shape[0]}, {shape[1]}\)"):
        model.generate(torch.zeros(shape, dtype=torch.long), max_new_tokens=2)


def test_a_pad_token_inside_a_prompt_without_a_mask_is_named(llama):
    """Without an attention_mask, transformers' generate masks out every pad token and runs on with a gap in a
    row (other tokens than with the mask of ones); ortmodule refuses a gap, and names where it came from. Pad
    tokens that pad (left, or right as transformers takes them) run as transformers runs them."""
    model, hf = load_pair(llama)
    pad = model.generation_config.pad_token_id
    args = dict(max_new_tokens=3, do_sample=False)
    for ids, where in (([[4, pad, 5]], r"row 0 holds it at position 1, between its tokens"),
                       ([[4, 5, 6], [8, pad, 9]], r"row 1 holds it at position 1"),
                       ([[4, 5, 6], [pad, pad, pad]], r"row 1 holds nothing else")):
        with pytest.raises(ValueError, match=rf"got no attention_mask, so it masks out every pad token \({pad}\)"
                                             rf" of input_ids \(as transformers\): {where}"):
            model.generate(torch.tensor(ids), **args)
    inside = torch.tensor([[4, pad, 5]])
    assert torch.equal(model.generate(inside, attention_mask=torch.ones_like(inside), **args),
                       hf.generate(inside, attention_mask=torch.ones_like(inside), **args))
    assert torch.equal(model.generate(inside, pad_token_id=0, **args), hf.generate(inside, pad_token_id=0, **args))
    for padded in ([[pad, pad, 5], [4, 5, 6]], [[4, 5, pad]]):
        assert torch.equal(model.generate(torch.tensor(padded), **args), hf.generate(torch.tensor(padded), **args))


def test_float_ids_are_a_type_error(model):
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.ones(1, 4))


def test_ids_of_the_wrong_rank(model):
    with pytest.raises(ValueError, match="2-D"):
        model(torch.tensor([5, 6, 7]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        model([[5, 6, 7]])


def test_mask_shape_mismatch(model):
    with pytest.raises(ValueError, match=r"attention_mask shape \(1, 2\) does not match input_ids shape \(1, 3\)"):
        model(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 2, dtype=torch.long))


def test_mask_with_gaps_or_other_values(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="row 0 has gaps"):
        model(ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        model(ids, attention_mask=torch.tensor([[1, 2, 1, 1]]))
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        model(ids.repeat(2, 1), attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))


def test_bad_cont_len(model):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="cont_len must be >= 0"):
        model(ids, cont_len=-1)
    with pytest.raises(TypeError, match="cont_len must be an int"):
        model(ids, cont_len=1.5)


def test_a_step_that_does_not_continue_its_cache_is_named(model):
    """Tokens given with a cache (a decode step by hand) are checked against it before ONNX Runtime runs:
    their shape and type, the rows, the context left, the mask's type and its new columns."""
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])

    def step(new, step_mask=None):
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
        return model(new, attention_mask=step_mask, past_key_values=cache)

    with pytest.raises(ValueError, match=r"2-D integer tensor \[batch, new tokens\]"):
        step(torch.tensor([12, 13]))
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.bool"):
        step(torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"input_ids of shape \(3, 1\) does not continue a cache of 2 rows"):
        step(torch.ones(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids of shape \(2, 0\) does not continue"):
        step(torch.ones(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="4 cached \\+ 253 new tokens exceeds the model's context length 256"):
        step(torch.ones(2, 253, dtype=torch.long))
    assert step(torch.ones(2, 252, dtype=torch.long)).logits.shape == (2, 252, 512)  # the context's last position
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor, got list"):
        step(torch.ones(2, 1, dtype=torch.long), [[1] * 5] * 2)
    with pytest.raises(ValueError, match="attention_mask must be 1 at every new token"):
        step(torch.ones(2, 1, dtype=torch.long), torch.cat([mask, torch.tensor([[1], [0]])], 1))


def test_logits_at_positions_outside_the_input_are_named(model):
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match=r"inside the input of shape \(2, 3\): position 2 is \(row 1, col 3\)"):
        model.logits_at(ids, None, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 3]))
    with pytest.raises(ValueError, match=r"position 0 is \(row 2, col 0\)"):
        model.logits_at(ids, None, [2], [0])
    with pytest.raises(TypeError, match="cols must hold integer positions"):
        model.logits_at(ids, None, [0], [1.0])


def test_unsupported_arguments_are_named(model):
    with pytest.raises(ValueError, match="pass input_ids or inputs_embeds, not both"):
        model(torch.tensor([[5, 6]]), inputs_embeds=torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match=r"needs input_ids \(or inputs_embeds\)"):
        model(attention_mask=torch.ones(1, 2))
    with pytest.raises(TypeError, match="inputs_embeds must be a float tensor"):
        model(inputs_embeds=torch.zeros(1, 2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, sequence, 64\] .the model's hidden size."):
        model(inputs_embeds=torch.zeros(1, 2, 32))
    with pytest.raises(TypeError, match="does not support foo"):
        model(torch.tensor([[5, 6]]), foo=1)


def test_missing_folder(tmp_path):
    with pytest.raises(PackageError, match="package folder not found"):
        OrtModelForCausalLM.from_pretrained(tmp_path / "nowhere")


def test_an_empty_path_is_not_the_working_directory(llama, monkeypatch):
    """`from_pretrained(os.environ.get("PACKAGE", ""))` with the variable unset: an error, even where the
    working directory is a package (it loaded that one before)."""
    from ortmodule import load_tokenizer

    monkeypatch.chdir(llama.package_dir)
    for path in ("", "  "):
        with pytest.raises(PackageError, match="the package path is empty"):
            OrtModelForCausalLM.from_pretrained(path)
        with pytest.raises(PackageError, match="the package path is empty"):
            load_tokenizer(path)


def test_folder_without_genai_config_names_it(tmp_path):
    with pytest.raises(PackageError, match=rf"{tmp_path}: no genai_config.json in the folder; is this"):
        OrtModelForCausalLM.from_pretrained(tmp_path)


def test_a_checkpoint_or_gguf_file_given_for_a_package_says_to_export_it(build, tmp_path):
    """A Hugging Face checkpoint folder or a GGUF file where a package is expected: the error says how
    to make a package of it."""
    checkpoint = build("llama").hf_dir
    with pytest.raises(PackageError, match=rf"a Hugging Face checkpoint or GGUF file, not a GenAI package; make one "
                                           rf"with `ortmodule export {checkpoint} OUT`"):
        OrtModelForCausalLM.from_pretrained(checkpoint)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PackageError, match="a GGUF file exports to one with `ortmodule export"):
        OrtModelForCausalLM.from_pretrained(gguf)


def test_another_exporters_onnx_files_are_named_as_such(build, tmp_path):
    """Optimum's or transformers.js's export (config.json beside onnx/model.onnx, no genai_config.json)
    is not taken for a checkpoint to export: the error says what it is and what to export instead."""
    folder = tmp_path / "exported"
    (folder / "onnx").mkdir(parents=True)
    shutil.copy(build("llama").hf_dir / "config.json", folder / "config.json")
    (folder / "onnx" / "model.onnx").write_bytes(b"an ONNX graph")
    with pytest.raises(PackageError, match=r"ONNX files of another exporter \(Optimum's or transformers.js's"):
        OrtModelForCausalLM.from_pretrained(folder)


def test_a_file_of_a_package_given_for_it_names_its_folder(build):
    """The package's model.onnx or genai_config.json where its folder is expected: the error names the folder."""
    package = build("llama").package_dir
    for name in ("model.onnx", "genai_config.json"):
        with pytest.raises(PackageError, match=f"the folder of this file is one: {re.escape(str(package))}\\)$"):
            OrtModelForCausalLM.from_pretrained(package / name)


def copy_package(llama, tmp_path):
    package = tmp_path / "pkg"
    shutil.copytree(llama.package_dir, package)
    return package, json.loads((package / "genai_config.json").read_text())


def write_config(package, config):
    (package / "genai_config.json").write_text(json.dumps(config))


def test_missing_decoder_file(llama, tmp_path):
    package, config = copy_package(llama, tmp_path)
    (package / "model.onnx").unlink()
    with pytest.raises(PackageError, match=r"model.decoder.filename is 'model.onnx' but .*model.onnx does not exist"):
        read_package(package)


def test_missing_key_is_named(llama, tmp_path):
    package, config = copy_package(llama, tmp_path)
    del config["model"]["decoder"]["head_size"]
    write_config(package, config)
    with pytest.raises(PackageError, match=r"genai_config.json: missing key 'model.decoder.head_size'"):
        read_package(package)


@pytest.mark.parametrize("edit, message", [
    ({"hidden_size": 100}, r"model.decoder.hidden_size is 100 but the token embedding table of model.onnx is "
                           r"\[512, 64\]"),
    ({"head_size": 7}, r"ONNX Runtime cannot run model.onnx with this configuration \(KV heads and head sizes "
                       r"\[\(2, 7\)\]"),
    ({"eos_token_id": "x"}, r"'model.eos_token_id' must be a token id or a list of token ids, got \"x\""),
    ({"pad_token_id": [0, 1]}, r"'model.pad_token_id' must be a token id, got \[0, 1\]"),
    ({"bos_token_id": True}, r"'model.bos_token_id' must be a token id or a list of token ids, got true"),
])
def test_a_config_that_contradicts_its_graph_is_named(llama, tmp_path, edit, message):
    """genai_config.json's shape fields checked against the graph, and its special tokens' types, at load:
    not a failure inside ONNX Runtime's Reshape at `output_hidden_states`, an `inputs_embeds` width the
    embedding table does not give, or transformers' config validation naming no file (head_size 7: odd
    for its rotary check)."""
    package, config = copy_package(llama, tmp_path)
    for key, value in edit.items():
        (config["model"] if key.endswith("token_id") else config["model"]["decoder"])[key] = value
    write_config(package, config)
    with pytest.raises(PackageError, match=re.escape(str(package / "genai_config.json")) + ": " + message):
        OrtModelForCausalLM.from_pretrained(package)


@pytest.mark.parametrize("key, value, wanted", [("top_k", "x", "an integer"), ("top_k", 1.5, "an integer"),
                                                 ("do_sample", "yes", "a bool"), ("do_sample", 1, "a bool"),
                                                 ("repetition_penalty", None, "a number"),
                                                 ("temperature", True, "a number")])
def test_search_defaults_of_the_wrong_json_type_are_named(llama, tmp_path, key, value, wanted):
    """The search section's fields that become generate()'s defaults, of a JSON type onnxruntime-genai's parser
    refuses too: named at load (do_sample "yes" sampled, a string top_k failed in generate naming no file)."""
    package, config = copy_package(llama, tmp_path)
    config["search"][key] = value
    write_config(package, config)
    with pytest.raises(PackageError, match=re.escape(f"genai_config.json: 'search.{key}' must be {wanted}, got "
                                                     f"{json.dumps(value)}")):
        OrtModelForCausalLM.from_pretrained(package)


def test_search_defaults_out_of_range_are_named_as_the_packages(llama, tmp_path):
    """A default out of range (onnxruntime-genai loads it too) fails in generate() saying where it came from
    and how to override it; an integer written as a float is taken."""
    package, config = copy_package(llama, tmp_path)
    config["search"].update(top_p=2.0, do_sample=True, top_k=40.0)
    write_config(package, config)
    model = OrtModelForCausalLM.from_pretrained(package)
    assert model.generation_config.top_k == 40 and isinstance(model.generation_config.top_k, int)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0.0, 1.0\], got 2.0: model.generation_config's "
                                         r"top_p, from the package's genai_config.json .* pass top_p= to generate"):
        model.generate(ids, max_new_tokens=2)
    assert model.generate(ids, max_new_tokens=2, top_p=0.5).shape == (1, 5)


def test_special_tokens_may_be_lists_or_absent(llama, tmp_path):
    package, config = copy_package(llama, tmp_path)
    config["model"]["eos_token_id"] = [2, 3]
    del config["model"]["pad_token_id"]
    write_config(package, config)
    read = read_package(package)
    assert read.eos_token_id == [2, 3] and read.pad_token_id is None


def test_kv_template_matching_no_input(llama, tmp_path):
    package, config = copy_package(llama, tmp_path)
    config["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.k"
    write_config(package, config)
    with pytest.raises(PackageError, match=r"past_key_names 'past.%d.k' gives 'past.0.k' for layer 0"):
        read_package(package)


@pytest.mark.parametrize("option,message", [
    ("prune_lm_head", "its logits are pruned to the last position, so continuations cannot be scored. Re-export "
                      "without prune_lm_head"),
    ("exclude_lm_head", "the decoder returns hidden states instead of logits, as the model builder's exclude_lm_head "
                        "makes it: re-export without exclude_lm_head")])
def test_packages_without_every_positions_logits_are_refused(build, option, message):
    """Packages exported with the model builder's options that drop the logits ortmodule scores with
    (only the last position's, or hidden states instead) are refused at load, naming the option."""
    package = build("llama", extra_options=((option, "true"),)).package_dir
    with pytest.raises(PackageError, match=re.escape(message)):
        OrtModelForCausalLM.from_pretrained(package)


def test_a_graph_onnx_runtime_refuses_names_the_package(build):
    """The model builder 0.18 writes a graph ONNX Runtime refuses for a model with tied embeddings
    exported to int4 with is_symmetric=false (the tied embedding's Gather gets a uint8 output where
    float is declared). Loading it is a PackageError naming the package and ONNX Runtime's reason,
    with the rewrite (graph bytes) and without (the file)."""
    fixture = build("llama", precision="int4", tie_word_embeddings=True, extra_options=(("is_symmetric", "false"),))
    for rewrite, where in ((True, f"{fixture.package_dir}'s graph"), (False, str(fixture.package_dir / "model.onnx"))):
        with pytest.raises(PackageError, match=re.escape(f"cannot load {where}") + ".*Type Error.*export the package "
                           "again") as caught:
            OrtModelForCausalLM.from_pretrained(fixture.package_dir, rewrite_lm_head=rewrite)
        assert "embed_tokens" in str(caught.value)


@pytest.mark.parametrize("precision,reason", [("bf16", "Could not find an implementation for MatMul"),
                                              ("fp16", "q_norm_weight / k_norm_weight inputs are not supported")])
def test_a_cuda_export_that_cannot_run_on_the_cpu_says_so(build, precision, reason):
    """Packages exported for CUDA that a CPU cannot run: bf16 (no CPU kernels; refused at session
    start) and a Qwen3 fp16 export (its GroupQueryAttention applies the query/key norms, which only
    the CUDA kernel takes; refused at the load's one-token run). Each error names the export's
    provider and what to do, and quotes ONNX Runtime's reason."""
    fixture = build("qwen3", precision=precision, execution_provider="cuda")
    with pytest.raises(PackageError, match="(?i)the package was exported for cuda") as caught:
        OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    assert "load it with device='cuda', or export it for cpu" in str(caught.value)
    assert reason in str(caught.value)


def test_invalid_json(tmp_path):
    (tmp_path / "genai_config.json").write_text("{not json")
    with pytest.raises(PackageError, match="not valid JSON"):
        read_package(tmp_path)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(PackageError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_quantized_prefill_names_its_choices(llama):
    with pytest.raises(ValueError, match="quantized_prefill must be one of auto, package, fp32, not 'int8'"):
        OrtModelForCausalLM.from_pretrained(llama.package_dir, quantized_prefill="int8")


def test_quantized_prefill_leaves_float_packages_alone(llama):
    """No 4-bit weights: one session, whatever the choice."""
    for choice in ("auto", "fp32"):
        decoder = OrtModelForCausalLM.from_pretrained(llama.package_dir, quantized_prefill=choice).decoder
        assert not decoder.fp32_path and decoder.wide_session is decoder.session


def test_loading_options_of_the_wrong_kind_are_named(llama):
    """`session_options` and `provider_options` of the wrong kind are TypeErrors naming what was given
    (they were an AttributeError and a dict() error from inside ortmodule); provider options on a CPU,
    which ONNX Runtime's CPU provider ignores, are a warning that they do nothing; a device index
    means CUDA, as in transformers."""
    with pytest.raises(TypeError, match="session_options must be an onnxruntime.SessionOptions, got int"):
        OrtModelForCausalLM.from_pretrained(llama.package_dir, session_options=5)
    with pytest.raises(TypeError, match="provider_options must be a dict of CUDAExecutionProvider options, got str"):
        OrtModelForCausalLM.from_pretrained(llama.package_dir, provider_options="enable_cuda_graph=1")
    with pytest.warns(UserWarning, match=r"provider_options \['enable_cuda_graph'\] have no effect on a CPU"):
        OrtModelForCausalLM.from_pretrained(llama.package_dir, provider_options={"enable_cuda_graph": "1"})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device cuda:0 asked for, but torch sees no CUDA device"):
            OrtModelForCausalLM.from_pretrained(llama.package_dir, device=0)
    # A device torch cannot parse, and a cache folder that is not a path: named (torch listed its every device type;
    # Python said "expected str, bytes or os.PathLike object, not int" from inside the graph rewrite).
    for device in ("gpu", "cuda:x", 1.5):
        with pytest.raises(ValueError, match=rf"unsupported device {re.escape(repr(device))}: use 'cpu', 'cuda'"):
            OrtModelForCausalLM.from_pretrained(llama.package_dir, device=device)
    with pytest.raises(TypeError, match="cache_dir must be a folder's path .*, got int"):
        OrtModelForCausalLM.from_pretrained(llama.package_dir, cache_dir=123)


def test_a_trace_or_export_of_the_module_says_what_it_is(model):
    """torch.jit.trace and torch.export (torch.onnx.export's first step) run forward on tracers or fake tensors,
    which ONNX Runtime cannot take (torch's own errors before: a dict output, a fake tensor's data); refused
    naming why, while torch.compile runs it (dynamo leaves ONNX Runtime's call outside its graphs)."""
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(NotSupportedError, match="cannot be traced or exported: its forward runs ONNX Runtime"):
        torch.jit.trace(model, ids)
    with pytest.raises(NotSupportedError, match="already is the exported graph"):
        torch.export.export(model, (ids,))
    torch._dynamo.reset()
    compiled = torch.compile(model)
    assert torch.equal(compiled(ids).logits, model(ids).logits)
