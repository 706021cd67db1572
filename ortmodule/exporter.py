"""`ortmodule export`: a GenAI package from a Hugging Face folder or a GGUF file.

The package is written by onnxruntime-genai's model builder (`onnxruntime_genai.models.builder`),
run in its own process with a few shims for configs of transformers 5 that the builder predates.
A GGUF file (quantized or not) is first dequantized by transformers into an fp32 checkpoint
beside the output, so the builder sees a plain Hugging Face folder and can quantize it again
(int4, int8) the way ONNX Runtime's kernels want it. Everything is checked before the builder starts:
the source, its architecture, its tokenizer, the disk space; problems are an `ExportError` that
names them. The package appears at `out` only once complete (written beside it, then renamed).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from .environment import installed_too_old, installed_version

PRECISIONS = ("fp32", "fp16", "bf16", "int4", "int8")
DEVICES = ("cpu", "cuda")
# Bytes per parameter of the exported weights (int4, int8: 4 or 8 bits, plus scales and the fp32/fp16 embedding).
_OUT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int4": 1.0, "int8": 2.0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ExportError(ValueError):
    """The source cannot be exported: the message names what is wrong and what to do."""


def _say(progress, message: str) -> None:
    if progress:
        print(f"[ortmodule export] {message}", file=sys.stderr, flush=True)


# The builder's options that `export` sets for CUDA unless told otherwise: the query, key and value
# projections as three MatMuls instead of one packed MatMul and a Split (the Split's copies cost more
# than the two launches saved: prefill 1.04x on an H200, Qwen3-0.6B's config in bf16, 32 x 512
# tokens; on a CPU within the noise; docs/measurements.md).
CUDA_OPTIONS = {"fuse_qkv": "false"}


def export(
    source: str | Path,
    out: str | Path,
    precision: str = "fp32",
    device: str = "cpu",
    extra_options: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
    revision: str | None = None,
    gguf_file: str | None = None,
    images: bool = False,
) -> Path:
    """Export `source` (a Hugging Face checkpoint folder or Hub repository id, at `revision`; a
    `.gguf` file, or `gguf_file` of such a folder or repository) to a GenAI package folder `out` for
    `device` ('cpu' or 'cuda') in `precision` (fp32, fp16, bf16, int4 or int8).

    `extra_options` go to the builder's `--extra_options` (for example `{"algo_config": "k_quant_mixed"}`);
    for CUDA, `fuse_qkv=false` unless they say otherwise (`CUDA_OPTIONS`). `images`: a Gemma 3
    checkpoint's vision tower too, the decoder taking embeddings (export_images.py; fp32, int4 or int8
    for the CPU). Returns `out`. Progress goes to stderr unless `progress=False`.
    """
    check_extra_options(extra_options)
    source, out = _checked_source(source, precision, device, revision, gguf_file), Path(out)
    gguf = _gguf_file(source)
    if images and gguf is not None:  # said before the minutes of dequantizing it
        raise ExportError("images: a GGUF file holds the text model only; export the Hugging Face checkpoint")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} already exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-export-", dir=out.parent))
    try:
        if gguf is not None:
            check_disk(out.parent, _gguf_parameters(gguf), precision, with_checkpoint=True)
            _say(progress, f"dequantizing {gguf.name} with transformers into an fp32 checkpoint")
            checkpoint = work / "checkpoint"
            gguf_to_checkpoint(gguf, checkpoint)
        else:
            checkpoint = source
        architecture = check_checkpoint(checkpoint, source)
        if images:
            _check_images(architecture, precision, device)
        check_disk(out.parent, checkpoint_parameters(checkpoint), precision)
        _write(checkpoint, architecture, work / "package", precision, device, extra_options, progress, images)
        if out.exists():
            shutil.rmtree(out)
        (work / "package").rename(out)
    except OSError as e:
        if e.errno == 28:  # ENOSPC
            raise ExportError(f"no space left on the disk of {out.parent} while exporting ({e})") from e
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    _say(progress, f"wrote {out} ({size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s")
    if precision == "int4" and "algo_config" not in (extra_options or {}):  # int4_algo_config is refused above
        _say(progress, "int4 by round-to-nearest (the builder's default) moves a model's answers furthest from its "
                       "own; --extra-option algo_config=k_quant_mixed, or --precision int8, keep closer to them "
                       "(docs/usage.md, \"4 or 8 bits\")")
    return out


def _write(checkpoint: Path, architecture: str, package: Path, precision: str, device: str,
           extra_options: dict | None, progress: bool, images: bool) -> None:
    """The package of `checkpoint` at `package` (with `images`, its vision tower: export_images.py)."""
    options = {**CUDA_OPTIONS, **(extra_options or {})} if device == "cuda" else extra_options
    if images:
        options = {**(options or {}), "exclude_embeds": "true"}
    told = f" (options: {', '.join(f'{k}={v}' for k, v in options.items())})" if options else ""
    _say(progress, f"exporting {architecture} to {precision} for {device} with onnxruntime-genai's model builder{told}")
    run_builder(checkpoint, package, precision, device, options, progress)
    if images:
        from .export_images import add_images

        _say(progress, "exporting the vision tower and the embeddings (torch.onnx)")
        add_images(checkpoint, package)
    carry_generation_defaults(checkpoint, package)
    keep_checkpoint_config(checkpoint, package)
    _check_package(package, checkpoint)


def keep_checkpoint_config(checkpoint: Path, package: Path) -> None:
    """The checkpoint's config.json copied into a text package, where `model.config` reads it (hf.build_config)
    as transformers reads the checkpoint's: without it, the fields genai_config.json does not say (the MLP's
    width, the rotary base, tied embeddings, the norms' epsilon, the architecture) are the config class's
    defaults. A multimodal checkpoint's (a `text_config` inside) is left out of its text-only export, which
    it does not describe; `--images` writes its own."""
    if (package / "config.json").is_file():
        return
    config = json.loads((checkpoint / "config.json").read_text())
    if isinstance(config, dict) and "text_config" not in config:
        shutil.copyfile(checkpoint / "config.json", package / "config.json")


def carry_generation_defaults(checkpoint: Path, package: Path) -> None:
    """The checkpoint's generation defaults (its generation_config.json) in genai_config's search section,
    where transformers' `generate` applies them by default: the model builder copies only do_sample,
    temperature, top_k and top_p from there and writes the others (repetition_penalty, ...) from config.json,
    which transformers 5's configs no longer carry. Each of `hf.SEARCH_DEFAULTS` the checkpoint sets
    otherwise than transformers' default is written; onnxruntime-genai's Generator reads them too."""
    from transformers import GenerationConfig

    from .hf import SEARCH_DEFAULTS

    if not (checkpoint / "generation_config.json").is_file():
        return
    given = GenerationConfig.from_pretrained(checkpoint)
    path = package / "genai_config.json"
    genai = json.loads(path.read_text())
    changed = {name: getattr(given, name) for name, default in SEARCH_DEFAULTS.items()
               if getattr(given, name) not in (None, default)}
    if changed:
        genai.setdefault("search", {}).update(changed)
        path.write_text(json.dumps(genai, indent=4))


def _check_images(architecture: str, precision: str, device: str) -> None:
    """`images=True` is for a Gemma 3 checkpoint's folder (not a GGUF file: `export` says so first),
    exported with float32 embeddings."""
    from .export_images import ARCHITECTURES

    if architecture not in ARCHITECTURES:
        raise ExportError(f"images: the vision tower of {', '.join(ARCHITECTURES)} checkpoints is exported; this one "
                          f"is {architecture} (its text model exports without images)")
    if device != "cpu" or precision not in ("fp32", "int4", "int8"):
        raise ExportError(f"images: the vision and embedding models are written in float32, for a decoder taking "
                          f"float32 embeddings (fp32, int4 or int8 for the CPU), not {precision} for {device}")


def _checked_source(source: str | Path, precision: str, device: str, revision: str | None,
                    gguf_file: str | None) -> Path:
    """`export`'s choices checked, and its source as a local path (a Hub repository's checkpoint fetched)."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if device not in DEVICES:
        raise ExportError(f"device '{device}' is not one of {', '.join(DEVICES)}")
    if precision == "bf16" and device == "cpu":  # the builder writes one; ONNX Runtime 1.31 then cannot load it
        raise ExportError("bf16 is for --device cuda: ONNX Runtime has CPU kernels for few bf16 operators, and the "
                          "builder's bf16 graph for the CPU does not load; for the CPU export fp32, or int8 / int4 "
                          "(4 or 8-bit weights)")
    from . import hub
    from .package import PackageError

    try:
        return hub.checkpoint(source, revision, gguf_file)
    except PackageError as e:
        raise ExportError(str(e)) from None


def check_extra_options(extra_options: dict | None) -> None:
    """Each of `extra_options` is an option the installed model builder documents or reads: the builder
    ignores any other without a word, so that a misspelt option (or 0.18's `int4_`-prefixed names, which
    its help calls deprecated aliases that still work, but which it no longer reads) exported the
    defaults. Where the builder's options cannot be read from its source, nothing is checked."""
    if extra_options is not None and not isinstance(extra_options, Mapping):
        raise ExportError(f"extra_options must be a dict of the builder's options (e.g. {{'algo_config': "
                          f"'k_quant_mixed'}}), got {type(extra_options).__name__}")
    known = builder_options()
    if not known:
        return
    for key, value in dict(extra_options or {}).items():
        if not isinstance(key, str):
            raise ExportError(f"extra option names are strings, got {key!r}")
        if key in known:
            continue
        version = _builder_version()
        base = key.removeprefix("int4_")
        if base != key and base in known:
            raise ExportError(f"extra option '{key}': the installed model builder (onnxruntime-genai {version}) "
                              f"ignores the int4_-prefixed names its help calls deprecated aliases (the package "
                              f"would keep the default); pass {base}={value}")
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ExportError(f"extra option '{key}' is not one the installed model builder (onnxruntime-genai {version}) "
                          f"documents or reads: it would be ignored{hint} (the builder's options: python -m "
                          f"onnxruntime_genai.models.builder --help, under --extra_options)")


@functools.lru_cache(maxsize=1)
def builder_options() -> frozenset[str]:
    """The `--extra_options` keys of the installed model builder: those its help lists (the first level
    of `KEY = ...` lines) and those its code reads (`extra_options["KEY"]`, `.get("KEY"`, `"KEY" in
    extra_options`), read from its source without importing it; empty where it cannot be found."""
    spec = importlib.util.find_spec("onnxruntime_genai")
    folder = Path(spec.origin).parent / "models" if spec and spec.origin else None
    if folder is None or not (folder / "builder.py").is_file():
        return frozenset()
    keys = set()
    for call in ast.walk(ast.parse((folder / "builder.py").read_text(encoding="utf-8"))):
        if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument" and call.args
                and getattr(call.args[0], "value", None) == "--extra_options"):
            texts = [n.value for k in call.keywords if k.arg == "help" for n in ast.walk(k.value)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            keys.update(re.findall(r"^ {4}([a-z][a-z0-9_]*) = ", textwrap.dedent("".join(texts)), re.M))
    if not keys:
        return frozenset()
    reads = re.compile(r"""extra_options(?:\.get\(|\[)["']([a-z][a-z0-9_]*)["']"""
                       r"""|["']([a-z][a-z0-9_]*)["'] (?:not )?in extra_options""")
    for source in folder.rglob("*.py"):
        for found in reads.findall(source.read_text(encoding="utf-8", errors="replace")):
            keys.update(k for k in found if k)
    return frozenset(keys)


def _builder_version() -> str:
    found = map(installed_version, ("onnxruntime-genai-cuda", "onnxruntime-genai"))
    return next(filter(None, found), "of unknown version")


def _gguf_file(source: Path) -> Path | None:
    """The GGUF file `source` names (a file, or a folder holding exactly one), or None for a
    Hugging Face folder."""
    if not source.exists():
        raise ExportError(f"source not found: {source}")
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise ExportError(f"{source}: a file source must be a .gguf file; otherwise pass a Hugging Face folder")
        return source
    if (source / "config.json").is_file():
        return None
    found = sorted(source.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if found:
        raise ExportError(f"{source} holds several GGUF files ({', '.join(f.name for f in found)}): pass one of them")
    raise ExportError(f"{source}: no config.json (a Hugging Face checkpoint) and no .gguf file in the folder")


def gguf_to_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as an fp32 Hugging Face checkpoint
    (weights and tokenizer) in `out`."""
    _gguf_package()  # transformers reads GGUF files through it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ExportError(f"{gguf}: transformers cannot read this GGUF file: {e}") from e
    # save_pretrained refuses a model loaded from GGUF: rebuild it without its quantization_config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = str(gguf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def supported_architectures() -> set[str]:
    """Architectures the installed model builder exports (read from its source), or an empty
    set when that cannot be read (then the builder's own error is the check)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("onnxruntime_genai.models.builder")
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        raise ExportError(
            "exporting needs onnxruntime-genai's model builder: pip install onnxruntime-genai-cuda "
            "(or onnxruntime-genai in an environment without onnxruntime-gpu)"
        )
    return set(re.findall(r'config\.architectures\[0\] == "(\w+)"', Path(spec.origin).read_text()))


def check_checkpoint(checkpoint: Path, source: Path) -> str:
    """The checkpoint's architecture, after checking that the builder exports it and that the
    folder has a tokenizer."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{source}: cannot read config.json ({e})") from e
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not architectures or not isinstance(architectures, list):
        raise ExportError(f"{checkpoint / 'config.json'}: no 'architectures' list; which model class is this?")
    architecture = architectures[0]
    supported = supported_architectures()
    if supported and architecture not in supported:
        raise ExportError(
            f"{source}: architecture {architecture} is not one the model builder exports; "
            f"it exports {', '.join(sorted(supported))}"
        )
    if not any((checkpoint / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(
            f"{source}: no tokenizer ({', '.join(TOKENIZER_FILES)}); save the tokenizer into the folder "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
        )
    return architecture


def checkpoint_parameters(checkpoint: Path) -> int:
    """Weights in a checkpoint (tied weights once), from its safetensors headers (or file sizes for
    other formats)."""
    total = 0
    for shard in checkpoint.glob("*.safetensors"):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    if total == 0:  # .bin or other formats: assume 2 bytes a weight, the common checkpoint dtype
        total = sum(f.stat().st_size for f in checkpoint.glob("*.bin")) // 2
    return total


def _gguf_package():
    """The gguf package, or an ExportError naming what to install where it is missing or older than
    environment.EXTRA_FLOORS' (whose reader fails under numpy 2 deep inside)."""
    try:
        import gguf
    except ImportError:
        raise ExportError("reading a GGUF file needs the gguf package: pip install 'gguf>=0.13'") from None
    if message := installed_too_old("gguf"):
        raise ExportError(message)
    return gguf


def _gguf_parameters(gguf: Path) -> int:
    """Weights in a GGUF file, from its tensor table."""
    reader = _gguf_package().GGUFReader
    try:
        return sum(int(t.n_elements) for t in reader(gguf).tensors)
    except Exception as e:  # the reader raises ValueError, struct errors... on a bad file
        raise ExportError(f"{gguf}: not a readable GGUF file ({e})") from e


def check_disk(folder: Path, parameters: int, precision: str, with_checkpoint: bool = False) -> None:
    """Refuse to start an export that cannot fit on the disk of `folder`."""
    need = parameters * _OUT_BYTES[precision] * 1.2
    if with_checkpoint:
        need += parameters * 4  # the fp32 checkpoint dequantized from GGUF
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ExportError(
            f"not enough disk space in {folder}: the export needs about {need / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB are free"
        )


# Configs of transformers 5 brought into the form the builder 0.18 (and mobius-onnx 0.1) read, in
# the exporting process: Gemma 3's RoPE settings flat as in transformers 4 (`rope_parameters` for
# full attention, `rope_local_base_freq` for sliding layers), while transformers 5 nests them per
# layer type; and Gemma 4's `global_head_dim` and `head_dim`, which transformers 5 keeps per layer
# (`per_layer_config`).
CONFIG_SHIM = """
import transformers
load = transformers.AutoConfig.from_pretrained
def shimmed(*args, **kwargs):
    config = load(*args, **kwargs)
    text = getattr(config, "text_config", None)
    for part in (config, text):  # Gemma 3's own text model, or the one inside a multimodal Gemma 3 (4B and up)
        rope = getattr(part, "rope_parameters", None)
        if getattr(part, "model_type", "") == "gemma3_text" and isinstance(rope, dict) and "full_attention" in rope:
            part.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
            part.rope_parameters = dict(rope["full_attention"])
    gemma4 = str(getattr(text, "model_type", "")).startswith("gemma4")  # every config has a per_layer_config view
    if gemma4 and getattr(text, "per_layer_config", None) is not None:
        for part in (config, text):  # the builder copies text_config's keys to the top level
            part.allow_global_per_layer_attribute_access = True
        if "full_attention" in text.layer_types:
            full = text.per_layer_config[text.layer_types.index("full_attention")]
            for part in (config, text):
                part.global_head_dim = full.head_dim
                part.num_global_key_value_heads = full.num_key_value_heads
    return config
transformers.AutoConfig.from_pretrained = shimmed
"""
# Python 3.14's argparse formats every help string as it is added, and the builder 0.18's `--extra_options`
# help holds a bare "%" (e.g. "N % 64"): its command line failed with "badly formed help string" before
# reading an argument. A bare "%" in a help string is doubled, which argparse prints as one ("%%" and
# "%(default)s" are left as they are).
ARGPARSE_SHIM = """
import argparse, re
add_argument = argparse.ArgumentParser.add_argument
def escaped(self, *args, **kwargs):
    if isinstance(kwargs.get("help"), str):
        kwargs["help"] = re.sub(r"%([(%])?", lambda m: m.group() if m.group(1) else "%%", kwargs["help"])
    return add_argument(self, *args, **kwargs)
argparse.ArgumentParser.add_argument = escaped
"""
BUILDER_SCRIPT = CONFIG_SHIM + ARGPARSE_SHIM + """
import runpy, sys
sys.argv[0] = "builder"
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""
_PROGRESS_BAR = re.compile(r"\d+%\|")


def run_subprocess(command: list[str], what: str, progress: bool) -> None:
    """Run an exporter, echoing its lines when `progress` (progress bars only when they finish);
    on failure raise an ExportError with the end of its output."""
    env = dict(os.environ, **EXPORT_ENV)
    tail = deque(maxlen=40)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as process:
        for line in process.stdout:
            line = line.rstrip()
            if not line:
                continue
            tail.append(line)
            if progress and (not _PROGRESS_BAR.search(line) or "100%|" in line):
                print(f"  {line}", file=sys.stderr, flush=True)
    if process.returncode != 0:
        raise exit_error(what, command, process.returncode, "\n".join(tail))


# What an exporter's process runs with: no hub (a checkpoint is a local folder), its output unbuffered.
EXPORT_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def exit_error(what: str, command: list[str], returncode: int, output: str) -> ExportError:
    """The error for an exporter that exited with `returncode`, from the end of its `output`."""
    if "is not currently supported" in output:
        return ExportError(f"{what}: the model builder does not support this architecture:\n{output}")
    if "No space left on device" in output:
        return ExportError(f"{what}: the disk filled up while exporting:\n{output}")
    return ExportError(f"{what} failed (exit {returncode}): {' '.join(command)}\n{output}")


def builder_command(checkpoint: Path, out: Path, precision: str, device: str,
                    extra_options: dict | None = None) -> list[str]:
    """The model builder's command line for a Hugging Face checkpoint folder (`run_builder`)."""
    command = [sys.executable, "-c", BUILDER_SCRIPT, "-i", str(checkpoint), "-o", str(out)]
    command += ["-p", precision, "-e", device, "-c", str(out.parent / "builder-cache")]
    if extra_options:
        command += ["--extra_options", *[f"{k}={v}" for k, v in dict(extra_options).items()]]
    return command


def run_builder(
    checkpoint: Path, out: Path, precision: str, device: str, extra_options: dict | None = None, progress: bool = False
) -> None:
    """Run the model builder on a Hugging Face checkpoint folder, writing the package to `out`."""
    supported_architectures()  # a clear error when the builder is not installed
    try:
        run_subprocess(builder_command(checkpoint, out, precision, device, extra_options), "the model builder",
                       progress)
    finally:
        shutil.rmtree(out.parent / "builder-cache", ignore_errors=True)


def _check_package(package: Path, checkpoint: Path) -> None:
    """The builder's package loads as ortmodule reads it, with a fast tokenizer beside it."""
    from .package import read_package

    read_package(package)
    if not (package / "tokenizer.json").is_file():  # a sentencepiece-only checkpoint: write the fast one
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(package)
