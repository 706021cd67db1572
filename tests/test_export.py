"""`ortmodule export`: a Hugging Face folder to a package that loads and matches transformers, and
a clear error for every bad source, before the builder runs."""

import json
import re
import shutil
import subprocess
import sys
from collections import namedtuple

import onnx
import pytest
import torch
from helpers import load_pair

from ortmodule import ExportError, OrtModelForCausalLM, cli, export
from ortmodule import exporter as export_module


def test_cli_exports_a_hugging_face_folder(llama, tmp_path, capsys):
    out = tmp_path / "package"
    cli.ortmodule(["export", str(llama.hf_dir), str(out), "--precision", "fp32"])
    progress = capsys.readouterr().err
    assert "[ortmodule export] exporting LlamaForCausalLM to fp32 for cpu" in progress
    assert f"wrote {out}" in progress
    assert "algo_config" not in progress  # the int4 hint is for int4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder left behind
    model = OrtModelForCausalLM.from_pretrained(out)
    _, reference = load_pair(llama)
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    assert (model(ids).logits - expected).abs().max().item() < 1e-4
    # the checkpoint's config kept in the package: model.config is transformers' (the MLP's width, the rotary
    # base, tied embeddings, ... not the config class's defaults), the path and the package's dtype aside
    ours, theirs = model.config.to_dict(), reference.config.to_dict()
    differ = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
    assert differ <= {"_name_or_path", "dtype"} and ours["dtype"] == "float32", differ


def multimodal_checkpoint(kind: str, tokenizer):
    """A tiny multimodal checkpoint of `kind` (its class and config) whose text model the builder
    exports: a vision tower of one layer, image tokens at the top of a 600-token vocabulary."""
    import transformers

    text = dict(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    if kind == "gemma3":  # sliding layers: the rows below are longer than the 8-token window
        text.update(sliding_window=8, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
        return transformers.Gemma3ForConditionalGeneration, transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=599,
            boi_token_index=597, eoi_token_index=598)
    if kind == "mistral3":
        return transformers.Mistral3ForConditionalGeneration, transformers.Mistral3Config(
            text_config=dict(model_type="mistral", **text), image_token_index=599,
            vision_config=dict(model_type="pixtral", head_dim=16, **vision))
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if kind == "qwen2_5_vl":
        return transformers.Qwen2_5_VLForConditionalGeneration, transformers.Qwen2_5_VLConfig(
            text_config={k: v for k, v in text.items() if k != "head_dim"}, image_token_id=599, video_token_id=598,
            vision_start_token_id=597, vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                fullatt_block_indexes=[0], window_size=28))
    text["rope_parameters"]["mrope_interleaved"] = True
    return transformers.Qwen3VLForConditionalGeneration, transformers.Qwen3VLConfig(
        text_config=text, image_token_id=599, video_token_id=598, vision_start_token_id=597, vision_end_token_id=596,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], patch_size=14, temporal_patch_size=2, spatial_merge_size=2))


@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl"])
def test_a_multimodal_checkpoint_exports_its_text_model(tmp_path, kind):
    """Multimodal checkpoints whose text model the builder exports as a text package: Gemma 3 from
    4B up (`Gemma3ForConditionalGeneration`, its RoPE settings nested per layer type inside
    `text_config` by transformers 5, which the builder 0.18 reads flat: `ortmodule export` flattens
    them there too), Mistral 3 (Ministral 3, Mistral Small 3.1), Qwen2.5-VL and Qwen3-VL (whose
    configs the Gemma 4 shim once broke). The package's logits and greedy tokens are transformers' on the same
    weights (the vision tower left out)."""
    from ortmodule_dev import fixtures

    tokenizer = fixtures.spec_tokenizer(fixtures.FixtureSpec("llama"))
    model_class, config = multimodal_checkpoint(kind, tokenizer)
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    export(tmp_path / "hf", tmp_path / "package", progress=False)
    assert json.loads((tmp_path / "package" / "genai_config.json").read_text())["model"]["type"].endswith("_text")
    assert not (tmp_path / "package" / "config.json").exists()  # the checkpoint's describes more than this package
    model = OrtModelForCausalLM.from_pretrained(tmp_path / "package")
    reference = model_class.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert_left_padded_batch_matches(model, reference, seed=2)


def assert_left_padded_batch_matches(model, reference, seed: int):
    """A left-padded batch's logits within 1e-4 of `reference`'s at the real positions, and its greedy tokens."""
    ids = torch.randint(4, 500, (2, 14), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert (model(ids, attention_mask=mask).logits - expected)[mask.bool()].abs().max().item() < 1e-4
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(input_ids=ids, **kwargs))


def test_a_qwen3_5_checkpoint_exports_its_text_model(tmp_path):
    """`ortmodule export` on a Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`: linear attention layers
    keeping convolution and recurrent states, the builder's 3-D position ids): a text package whose logits on
    a left-padded batch and greedy tokens are transformers' (the fixtures' Qwen3.5 checkpoint)."""
    from transformers import AutoModelForCausalLM

    from ortmodule_dev import fixtures

    fixtures.make_checkpoint(fixtures.FixtureSpec("qwen3_5", num_layers=4), tmp_path / "hf")
    export(tmp_path / "hf", tmp_path / "package", progress=False)
    assert json.loads((tmp_path / "package" / "genai_config.json").read_text())["model"]["type"] == "qwen3_5_text"
    model = OrtModelForCausalLM.from_pretrained(tmp_path / "package")
    assert {state.kind for state in model.decoder.spec.states} == {"conv", "recurrent"}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert_left_padded_batch_matches(model, reference, seed=3)


def test_cli_exports_a_gemma3_checkpoint_with_its_images(tmp_path, capsys):
    """`ortmodule export --images` on a Gemma 3 checkpoint: the decoder taking embeddings beside the
    vision tower and the embeddings exported, and the package takes a prompt's images as transformers'
    model does (each image attended both ways where token_type_ids mark it), logits within 1e-4."""
    import numpy as np
    import transformers
    from PIL import Image

    from ortmodule_dev import fixtures

    tokenizer = fixtures.spec_tokenizer(fixtures.FixtureSpec("llama"))
    model_class, config = multimodal_checkpoint("gemma3", tokenizer)
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    cli.ortmodule(["export", str(tmp_path / "hf"), str(tmp_path / "package"), "--images"])
    assert "exporting the vision tower and the embeddings" in capsys.readouterr().err
    model = OrtModelForCausalLM.from_pretrained(tmp_path / "package")
    reference = model_class.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    state = np.random.RandomState(0)
    pictures = [Image.fromarray((state.rand(30 + 9 * i, 40, 3) * 255).astype("uint8")) for i in range(2)]
    pixels = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})(pictures, return_tensors="pt")
    image = [597, *[599] * 4, 598]  # begin, the image's 4 tokens, end
    ids = torch.tensor([[5, 6, *image, 7, 8, *image, 9], [2] * 10 + list(range(10, 17))])  # the second left-padded
    given = dict(input_ids=ids, attention_mask=(torch.arange(17) >= torch.tensor([[0], [10]])).long(),
                 pixel_values=pixels["pixel_values"], token_type_ids=(ids == 599).long())
    real = given["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**given).logits[real]
    assert (model(**given).logits[real] - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("source, options, message", [
    ("llama", [], "the vision tower of Gemma3ForConditionalGeneration checkpoints is exported; this one is "
                  "LlamaForCausalLM"),
    ("gemma3", ["--precision", "fp16", "--device", "cuda"], "not fp16 for cuda"),
])
def test_images_are_refused_where_they_cannot_be_exported(llama, tmp_path, capsys, source, options, message):
    if source == "gemma3":
        from ortmodule_dev import fixtures

        model_class, config = multimodal_checkpoint("gemma3", fixtures.spec_tokenizer(fixtures.FixtureSpec("llama")))
        model_class(config).save_pretrained(tmp_path / "hf")
        fixtures.spec_tokenizer(fixtures.FixtureSpec("llama")).save_pretrained(tmp_path / "hf")
    folder = llama.hf_dir if source == "llama" else tmp_path / "hf"
    with pytest.raises(SystemExit):
        cli.ortmodule(["export", str(folder), str(tmp_path / "package"), "--images", *options])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "package").exists()


def test_int8_export_holds_8_bit_weights_and_keeps_the_answers(llama, tmp_path):
    """`--precision int8`: the builder's 8-bit MatMulNBits weights; logits near transformers fp32 on
    the same weights (within 2% of their spread), and each greedily generated token transformers
    fp32's choice after the tokens before it, or within that tolerance of it (a near-tie may go
    either way)."""
    import onnx

    out = tmp_path / "package"
    cli.ortmodule(["export", str(llama.hf_dir), str(out), "--precision", "int8", "--quiet"])
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
    bits = {a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {8}
    model = OrtModelForCausalLM.from_pretrained(out)
    _, reference = load_pair(llama)
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(ids).logits
    tolerance = 0.02 * (expected.max() - expected.min()).item()
    assert (model(ids).logits - expected).abs().max().item() < tolerance
    tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = reference(tokens).logits[:, 8:-1]  # what predicts each new token
    chosen = logits.gather(2, tokens[:, 9:, None]).squeeze(2)
    assert (logits.max(-1).values - chosen).max().item() < tolerance


@pytest.mark.parametrize("options,hinted", [([], True), (["--extra-option", "algo_config=rtn"], False)])
def test_int4_export_points_to_the_exports_that_keep_the_answers(llama, tmp_path, capsys, options, hinted):
    """An int4 export with the builder's default algorithm says, at its end, which exports keep closer
    to the model (docs/usage.md's measurements); one that chose its algorithm is not told."""
    out = tmp_path / "package"
    cli.ortmodule(["export", str(llama.hf_dir), str(out), "--precision", "int4", *options])
    progress = capsys.readouterr().err
    assert f"wrote {out}" in progress
    assert ("algo_config=k_quant_mixed, or --precision int8, keep closer" in progress) is hinted
    OrtModelForCausalLM.from_pretrained(out)


def copy_checkpoint(llama, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(llama.hf_dir, folder)
    return folder


@pytest.mark.parametrize("device, given, expected", [
    ("cuda", None, {"fuse_qkv": "false"}),
    ("cuda", {"fuse_qkv": "true", "algo_config": "rtn"}, {"fuse_qkv": "true", "algo_config": "rtn"}),
    ("cpu", None, None),
])
def test_cuda_exports_unpack_qkv_unless_told_otherwise(llama, tmp_path, monkeypatch, capsys, device, given,
                                                       expected):
    """The builder's options `export` passes: `fuse_qkv=false` for CUDA (measured faster there), the
    caller's own options kept and winning, nothing added for the CPU; the progress line names them."""
    seen = []

    def builder(checkpoint, out, precision, device, options, progress):
        seen.append(options)
        raise ExportError("stopped before the builder")

    monkeypatch.setattr(export_module, "run_builder", builder)
    precision = "bf16" if device == "cuda" else "fp32"  # bf16 is for CUDA (refused for the CPU)
    with pytest.raises(ExportError, match="stopped before the builder"):
        export(llama.hf_dir, tmp_path / "out", precision=precision, device=device, extra_options=given)
    assert seen == [expected]
    progress = capsys.readouterr().err
    assert f"to {precision} for {device} with onnxruntime-genai's model builder" in progress
    assert ("(options: fuse_qkv=" in progress) == (device == "cuda")


def test_the_builders_command_line_reads_its_help_on_every_python():
    """The builder 0.18's `--extra_options` help holds a bare "%", which Python 3.14's argparse refuses as the
    argument is added (every export failed there) and every Python's argparse when it prints the help: run
    as `ortmodule export` runs it, the builder prints its whole help, "%" signs, defaults and all."""
    command = [sys.executable, "-c", export_module.BUILDER_SCRIPT, "--help"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--extra_options" in run.stdout and "N % 64" in run.stdout and "%%" not in run.stdout


def test_unknown_architecture(llama, tmp_path):
    folder = copy_checkpoint(llama, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FrobnicatorForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="architecture FrobnicatorForCausalLM is not one the model builder exports"):
        export(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer(llama, tmp_path):
    folder = copy_checkpoint(llama, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="no tokenizer"):
        export(folder, tmp_path / "out", progress=False)


def test_no_disk_space(llama, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ExportError, match="not enough disk space .* 0.0 GB are free"):
        export(llama.hf_dir, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: tmp / "nowhere", "source not found"),
        (lambda tmp: tmp.joinpath("weights.bin").write_bytes(b"x") and tmp / "weights.bin", "must be a .gguf file"),
        (lambda tmp: tmp.joinpath("empty").mkdir() or tmp / "empty", "no config.json .* and no .gguf file"),
        (lambda tmp: tmp.joinpath("bad.gguf").write_bytes(b"not gguf") and tmp / "bad.gguf",
         "not a readable GGUF file"),
        (lambda tmp: tmp.joinpath("cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00") and tmp / "cut.gguf",
         "not a readable GGUF file"),
        (lambda tmp: [tmp.joinpath(name).write_bytes(b"") for name in ("a.gguf", "b.gguf")] and tmp,
         r"holds several GGUF files \(a.gguf, b.gguf\): pass one of them"),
        (lambda tmp: tmp.joinpath("config.json").write_text("{not json") and tmp, "cannot read config.json"),
        (lambda tmp: tmp.joinpath("config.json").write_text('{"model_type": "llama"}') and tmp,
         "no 'architectures' list; which model class is this"),
    ],
    ids=["missing", "not-gguf", "empty-folder", "garbage-gguf", "cut-gguf", "two-ggufs", "bad-config",
         "no-architectures"],
)
def test_bad_sources(tmp_path, make, message):
    with pytest.raises(ExportError, match=message):
        export(make(tmp_path), tmp_path / "out", progress=False)


def test_images_from_a_gguf_file_are_refused_before_it_is_read(tmp_path, monkeypatch):
    """A GGUF file holds the text model only: `images` is refused before the minutes of dequantizing it."""
    from ortmodule import exporter

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(exporter, "gguf_to_checkpoint", lambda *a: pytest.fail("the GGUF file was read"))
    with pytest.raises(ExportError, match="images: a GGUF file holds the text model only"):
        export(gguf, tmp_path / "out", progress=False, images=True)


def test_bad_options_and_existing_output(llama, tmp_path):
    with pytest.raises(ExportError, match="precision 'int3'"):
        export(llama.hf_dir, tmp_path / "out", precision="int3")
    with pytest.raises(ExportError, match="device 'tpu'"):
        export(llama.hf_dir, tmp_path / "out", device="tpu")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists and is not empty"):
        export(llama.hf_dir, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("option, message", [
    ("int4_block_size=128", "extra option 'int4_block_size': the installed model builder .* ignores the "
                            "int4_-prefixed names .*; pass block_size=128"),
    ("blok_size=16", "extra option 'blok_size' is not one the installed model builder .* documents or reads: it "
                     "would be ignored; did you mean block_size"),
    ("frobnicate=1", "extra option 'frobnicate' is not one the installed model builder"),
])
def test_options_the_builder_would_ignore_are_refused(llama, tmp_path, capsys, option, message):
    """The builder exports its defaults past an option it does not read, without a word; `export` refuses
    one before anything is written, naming the option the builder reads where one is close."""
    with pytest.raises(SystemExit) as exit_info:
        cli.ortmodule(["export", str(llama.hf_dir), str(tmp_path / "out"), "--precision", "int4",
                       "--extra-option", option])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ExportError, match="extra_options must be a dict of the builder's options .*, got list"):
        export(llama.hf_dir, tmp_path / "out", extra_options=["block_size=16"])  # Python's dict() error before


def test_bf16_for_the_cpu_is_refused_as_onnx_runtime_cannot_load_it(llama, tmp_path):
    """`--precision bf16 --device cpu`: the builder writes such a package, which the installed ONNX Runtime
    cannot load for the CPU (no kernel for its bf16 Where, among others); `export` refuses it before the
    builder runs, saying what to export instead. If a newer ONNX Runtime loads it, this test says to lift
    the refusal."""
    from ortmodule import PackageError
    from ortmodule_dev import fixtures

    with pytest.raises(ExportError, match="bf16 is for --device cuda: .* for the CPU export fp32, or int8 / int4"):
        export(llama.hf_dir, tmp_path / "out", precision="bf16", device="cpu")
    assert not (tmp_path / "out").exists()
    fixtures.export(llama.hf_dir, tmp_path / "builder", "bf16")  # the builder itself, for the CPU
    with pytest.raises(PackageError, match="It is a bf16 package.*load it with device='cuda'"):
        OrtModelForCausalLM.from_pretrained(tmp_path / "builder")


def test_the_options_ortmodule_passes_are_ones_the_builder_reads(llama, tmp_path):
    """Every builder option ortmodule, its fixtures and its docs pass is in the set `export` accepts (read
    from the installed builder's help and code), and the builder does ignore the `int4_`-prefixed name
    that set leaves out (an int4 export with it keeps blocks of 32; with `block_size` it takes 128): if a
    newer builder reads it again, this says to accept it."""
    from ortmodule_dev import fixtures

    used = {"algo_config", "block_size", "accuracy_level", "is_symmetric", "exclude_embeds", "include_hidden_states",
            "fuse_qkv", "fuse_mlp_gate_up", "fuse_qk_norm_gqa", "prune_lm_head", "exclude_lm_head",
            *export_module.CUDA_OPTIONS}
    assert used <= export_module.builder_options()
    assert "int4_block_size" not in export_module.builder_options()
    sizes = {}
    for option in ("int4_block_size", "block_size"):
        out = tmp_path / option
        fixtures.export(llama.hf_dir, out, "int4", ((option, "128"),), checked=False)
        graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
        sizes[option] = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                         if a.name == "block_size"}
    assert sizes == {"int4_block_size": {32}, "block_size": {128}}


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.ortmodule(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "ortmodule export: error: source not found" in capsys.readouterr().err


def test_the_checkpoints_generation_defaults_reach_generate(tmp_path):
    """A checkpoint's generation_config.json (repetition_penalty and no_repeat_ngram_size, as Qwen2.5's
    instruct models ship a repetition penalty; beams) goes into genai_config's search section at export,
    and ortmodule's generate applies it by default as transformers' generate does on the checkpoint: the
    same tokens, which differ from plain greedy decoding's."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from ortmodule_dev import fixtures

    shutil.copytree(fixtures.build(fixtures.FixtureSpec("llama")).hf_dir, tmp_path / "hf")
    defaults = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, num_beams=2, length_penalty=0.5)
    GenerationConfig(bos_token_id=1, eos_token_id=None, **defaults).save_pretrained(tmp_path / "hf")
    export(tmp_path / "hf", tmp_path / "package", progress=False)
    model = OrtModelForCausalLM.from_pretrained(tmp_path / "package")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert {name: getattr(model.generation_config, name) for name in defaults} == defaults
    ids = torch.tensor([[5, 9, 17, 33, 5, 9, 17]])
    options = dict(max_new_tokens=12, pad_token_id=2, eos_token_id=None)
    with torch.no_grad():
        ours = model.generate(ids, **options)
        assert torch.equal(ours, reference.generate(ids, **options))
        plain = model.generate(ids, **options, repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1)
    assert not torch.equal(ours, plain)
