"""`ortmodule env` and `ortmodule --version`: what a bug report needs, read from this environment."""

import functools
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import onnxruntime as ort
import pytest
import torch
from helpers import CHAT_TEMPLATE

import ortmodule
from ortmodule import cli, environment, hf


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.ortmodule(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.strip() == f"ortmodule {ortmodule.__version__}"
    assert ortmodule.__version__ == metadata.version("ortmodule")


def test_env_reports_this_environment():
    """The console command's lines: the versions as pip sees them, ONNX Runtime's providers as it lists
    them, torch's CUDA as torch sees it; no problem in this environment (one GPU build of each)."""
    run = subprocess.run([sys.executable, "-m", "ortmodule", "env"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = dict(line[2:].split(": ", 1) for line in run.stdout.splitlines())
    for name in ("torch", "onnxruntime-gpu", "transformers", "onnx"):
        assert lines[name] == metadata.version(name)
    assert lines["onnxruntime"] == "not installed"  # the CPU build beside the GPU one would be a problem
    assert lines["onnxruntime providers"] == ", ".join(ort.get_available_providers())
    assert ("no device seen" in lines["torch CUDA"]) == (not torch.cuda.is_available())
    assert lines["python"] == sys.version.split()[0] and "logical CPUs" in lines["cpu"]
    assert not any(line.startswith("problem") for line in run.stdout.splitlines())


def test_env_says_the_cache_folders_free_disk_and_the_mapping_switch(tmp_path, monkeypatch):
    """The cache folder with its disk's free space (a folder not made yet: the disk it would be made on,
    as `df` reports it), and whether packed weights are mapped from it, as the environment asks."""
    folder = tmp_path / "not" / "made"
    monkeypatch.setenv("ORTMODULE_CACHE", str(folder))
    monkeypatch.setenv("ORTMODULE_MAP_PACKED_WEIGHTS", "yes")
    lines = dict(environment.report())
    df = subprocess.run(["df", "-B1", "--output=avail", str(tmp_path)], capture_output=True, text=True, check=True)
    free = float(re.fullmatch(rf"{re.escape(str(folder))} \((\d+\.\d) GB free\)", lines["cache folder"])[1])
    assert abs(free - int(df.stdout.split()[-1]) / 1e9) < 0.5  # the same disk (other writers move it a little)
    assert lines["packed weights mapped from disk"] == "on (ORTMODULE_MAP_PACKED_WEIGHTS=yes)"
    assert environment.mapping_problems() == []  # this disk has room
    monkeypatch.setattr(environment.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40,
                                                                                                 300 * 10**6))
    (found,) = environment.mapping_problems()
    assert f"{folder}'s disk has 0.3 GB free: no packed weights are written" in found and "Fix:" in found
    monkeypatch.delenv("ORTMODULE_MAP_PACKED_WEIGHTS")
    assert dict(environment.report())["packed weights mapped from disk"] == "off (ORTMODULE_MAP_PACKED_WEIGHTS=unset)"
    assert environment.mapping_problems() == []  # switched off: nothing to write


def test_env_names_the_installs_that_break_ortmodule():
    """Both builds of ONNX Runtime (or of onnxruntime-genai) installed, each named with the fix; a CUDA
    device torch sees that ONNX Runtime has no provider for; none where the environment is sound."""
    both = {"onnxruntime-gpu": "1.31.1", "onnxruntime": "1.31.1", "onnxruntime-genai-cuda": "0.18.0"}
    cpu_only = ["CPUExecutionProvider"]
    found = environment.problems(both, cpu_only, torch_cuda=False)
    assert len(found) == 1 and "onnxruntime 1.31.1 and onnxruntime-gpu 1.31.1 are both installed" in found[0]
    assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu" in found[0]
    found = environment.problems({**both, "onnxruntime-genai": "0.10.0", "onnxruntime": None}, cpu_only, True)
    assert [problem.split(" ")[0] for problem in found] == ["onnxruntime-genai", "torch"]
    assert "no CUDAExecutionProvider" in found[1]
    sound = {"onnxruntime-gpu": "1.31.1", "onnxruntime-genai-cuda": "0.18.0"}
    assert environment.problems(sound, ["CUDAExecutionProvider", "CPUExecutionProvider"], torch_cuda=True) == []


def test_info_describes_a_package_as_transformers_sees_its_checkpoint(build):
    """`ortmodule info --json` on the int4 Llama fixture: the shape, the weights' kind and count, the
    bytes `get_memory_footprint()` gives, all read from the files without a session, against
    transformers' config and parameter count on the same checkpoint; a folder that is no package
    is a one-line error with exit status 2, no traceback."""
    import json

    import transformers

    from ortmodule import OrtModelForCausalLM

    fixture = build("llama", precision="int4")
    run = subprocess.run([sys.executable, "-m", "ortmodule", "info", str(fixture.package_dir), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    info = json.loads(run.stdout)
    hf = transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir)
    config = hf.config
    assert (info["layers"], info["hidden size"], info["attention heads"], info["KV heads"], info["vocabulary"]) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
        config.vocab_size)
    assert info["head size"] == config.hidden_size // config.num_attention_heads
    assert info["parameters"] == hf.num_parameters()
    assert info["parameters without embeddings"] == hf.num_parameters(exclude_embeddings=True)
    assert info["weights"].startswith("quantized (MatMulNBits") and "4-bit" in info["weights"]
    assert info["exported for"] == "cpu" and info["graphs"] == ["model.onnx"] and info["token input"] == "input ids"
    assert info["bytes on disk"] == OrtModelForCausalLM.from_pretrained(fixture.package_dir).get_memory_footprint()
    lines = subprocess.run([sys.executable, "-m", "ortmodule", "info", str(fixture.package_dir)],
                           capture_output=True, text=True).stdout.splitlines()
    assert f"- parameters: {hf.num_parameters():,}" in lines
    bad = subprocess.run([sys.executable, "-m", "ortmodule", "info", str(fixture.hf_dir)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "genai_config.json" in bad.stderr and "Traceback" not in bad.stderr
    # One line naming the command (the top-level usage was printed before it, and "ortmodule: error:").
    assert bad.stderr.splitlines()[0].startswith(f"ortmodule info: error: {fixture.hf_dir}: no genai_config.json")
    assert len(bad.stderr.splitlines()) == 1
    served = subprocess.run([sys.executable, "-m", "ortmodule", "serve", str(fixture.hf_dir / "absent")],
                            capture_output=True, text=True)
    assert served.returncode == 2
    absent = fixture.hf_dir / "absent"
    assert served.stderr.splitlines() == [f"ortmodule serve: error: package folder not found: {absent}"]


@pytest.mark.parametrize("command", [["info", "--json", "PACKAGE"], ["env"], ["cache", "list"]])
def test_a_report_whose_reader_left_ends_quietly(build, command):
    """`ortmodule info --json PACKAGE | head` and the like: the reader closes the pipe before the report is
    written; the command ends with status 1 and nothing on stderr, not a BrokenPipeError's traceback."""
    package = str(build("llama").package_dir)
    arguments = [package if a == "PACKAGE" else a for a in command]
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout as a shell's pipe has it
    process = subprocess.Popen([sys.executable, "-m", "ortmodule", *arguments], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=buffered)
    process.stdout.close()  # before the interpreter has started: every write fails
    error = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1 and "Traceback" not in error and "BrokenPipe" not in error, error


def test_a_dependency_older_than_its_floor_is_named_at_import():
    """transformers before 5.23 (the suite fails there: generate on 4.57 and 5.0, multimodal generate on
    5.18 to 5.22), onnx-ir before 0.1.12 (the graph rewrites fail), onnxruntime-gpu before 1.31 (4-bit
    prefills' fp32 path is silently int8; so is the CPU build's, `onnxruntime`, installed instead) and torch
    before 2.6 (transformers turns PyTorch off) are refused when ortmodule is imported, and by `ortmodule
    env`, with the fix; each floor is the one pyproject.toml declares, so pip and the check agree."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    start = pyproject.index("\ndependencies = [")
    dependencies = pyproject[start:pyproject.index("\n]\n", start)]  # the [project] dependencies alone
    declared = dict(re.findall(r'^\s+"([a-z-]+)>=([\d.]+)"', dependencies, re.MULTILINE))
    assert set(environment.FLOORS) <= set(declared)
    assert set(environment.FLOORS) <= set(environment.DISTRIBUTIONS)  # what versions() reads
    for name, (floor, _) in environment.FLOORS.items():
        assert tuple(int(part) for part in declared[name].split(".")) == floor, name
    cases = {"transformers": (("4.57.6", "5.0.0", "5.22.2"), ("5.23.0", "5.23.1", "5.24.0", "6.0.0.dev0")),
             "onnx-ir": (("0.1.10", "0.1.11"), ("0.1.12", "0.2.1", "1.1.0")),
             "torch": (("2.4.1", "2.5.1+cu124"), ("2.6.0", "2.13.0+cpu", "3.0.0")),
             "onnxruntime-gpu": (("1.20.2", "1.30.0"), ("1.31.0", "1.31.1", "1.32.0.dev20261201"))}
    assert set(cases) == set(environment.FLOORS)
    for name, (olds, news) in cases.items():
        floor = declared[name]
        for old in olds:
            message = environment.too_old(name, old)
            assert f"{name} {old} is older than ortmodule needs (>= {floor}:" in message
            assert f"pip install -U '{name}>={floor}'" in message
        for new in (*news, metadata.version(name)):
            assert environment.too_old(name, new) is None, (name, new)
    found = environment.problems({"transformers": "5.0.0", "onnx-ir": "0.1.10", "torch": None,
                                  "onnxruntime-gpu": "1.31.1"}, ["CPUExecutionProvider"], torch_cuda=False)
    assert len(found) == 2 and found[0].startswith("transformers 5.0.0 is older")
    assert found[1].startswith("onnx-ir 0.1.10 is older")
    # ONNX Runtime's CPU build installed instead of the GPU one (no onnxruntime-gpu wheel: macOS) has its floor
    found = environment.problems({"onnxruntime": "1.25.0", "transformers": "5.24.0"}, ["CPUExecutionProvider"],
                                 torch_cuda=False)
    assert len(found) == 1 and found[0].startswith("onnxruntime 1.25.0 is older than ortmodule needs (>= 1.31:")
    assert found[0].endswith("Fix: pip install -U 'onnxruntime>=1.31'")
    assert environment.problems({"onnxruntime": "1.31.1"}, ["CPUExecutionProvider"], torch_cuda=False) == []
    fake = ("import importlib.metadata as m; real = m.version; "
            "old = {'transformers': '5.0.0', 'onnx-ir': '0.1.10', 'gguf': '0.10.0'}; "
            "m.version = lambda name: old.get(name) or real(name); import ortmodule")
    run = subprocess.run([sys.executable, "-c", fake], capture_output=True, text=True, timeout=300)
    # the error's own line: from Python 3.13 the traceback also quotes the -c source, which names gguf
    [error] = [line for line in run.stderr.splitlines() if line.startswith("ImportError: ")]
    assert run.returncode == 1 and error.startswith("ImportError: transformers 5.0.0 is older than ortmodule needs")
    assert "; onnx-ir 0.1.10 is older than ortmodule needs (>= 0.1.12" in error
    assert "gguf" not in error  # an extra's floor is checked where the extra is used, not at import


def test_a_shadowed_older_onnxruntime_is_not_the_one_checked(tmp_path):
    """An older CPU build of ONNX Runtime (`onnxruntime` 1.30.0) installed later on sys.path than the GPU build
    (as on a machine whose system site-packages has one, the GPU build installed to a folder on PYTHONPATH)
    is never imported: ortmodule imports, and `env` neither names it too old nor installed beside the GPU
    build. The same install first on sys.path is the one imported, and is refused by name."""
    site = tmp_path / "site"
    (site / "onnxruntime").mkdir(parents=True)
    (site / "onnxruntime" / "__init__.py").write_text('__version__ = "1.30.0"\n')
    (site / "onnxruntime-1.30.0.dist-info").mkdir()
    (site / "onnxruntime-1.30.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime\n"
                                                                    "Version: 1.30.0\n")
    check = ("import sys; {}; from importlib import metadata; assert metadata.version('onnxruntime') == '1.30.0'; "
             "import ortmodule, onnxruntime; from ortmodule import environment; "
             "print(onnxruntime.__version__, environment.versions()['onnxruntime'], environment.problems()); "
             "print(dict(environment.report())['onnxruntime'])")
    later = subprocess.run([sys.executable, "-c", check.format(f"sys.path.append({str(site)!r})")],
                           capture_output=True, text=True, timeout=300)
    assert later.returncode == 0, later.stderr
    checked, reported = later.stdout.splitlines()
    assert checked.split() == [ort.__version__, "None", "[]"]
    # `env` still shows it, for a bug report, as what it is
    assert reported == "1.30.0, shadowed: another install of onnxruntime comes first on sys.path"
    first = subprocess.run([sys.executable, "-c", check.format(f"sys.path.insert(0, {str(site)!r})")],
                           capture_output=True, text=True, timeout=300)
    [error] = [line for line in first.stderr.splitlines() if line.startswith("ImportError: ")]
    assert first.returncode == 1 and error.startswith("ImportError: onnxruntime 1.30.0 is older than ortmodule needs")


def _faked_versions(monkeypatch, old: dict[str, str]) -> None:
    """importlib.metadata.version answering `old`'s versions for those names, the installed one for the rest."""
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: old.get(name) or real(name))


def test_an_extra_older_than_its_floor_is_named_where_it_is_used(llama, tmp_path, monkeypatch, caplog):
    """The extras' floors (gguf 0.13: older readers fail under numpy 2; accelerate 1.1: transformers' device_map,
    lm-eval's hf backend; jinja2 3.1.6: transformers' chat templates; uvicorn 0.32.1: a stream's client leaving
    is heard) are each extra's floor in pyproject.toml; `ortmodule env` names one installed older with its fix,
    and so does the place that needs it: `ortmodule export` of a GGUF file (before it reads the file) and
    `ortmodule serve` (warnings: jinja2 where the package has a chat template; its scores still run).
    `import ortmodule` does not refuse them (test above: gguf faked old)."""
    from ortmodule.exporter import ExportError, export
    from ortmodule.serving import app

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    start = pyproject.index("[project.optional-dependencies]")
    extras = pyproject[start:pyproject.index("\n[", start + 1)]
    assert set(environment.EXTRA_FLOORS) <= set(environment.DISTRIBUTIONS)  # what versions(), so env, reads
    for name, (floor, _) in environment.EXTRA_FLOORS.items():
        declared = set(re.findall(rf'"{name}>=([\d.]+)"', extras, re.IGNORECASE))
        assert declared == {".".join(map(str, floor))}, (name, declared)  # every extra that names it, alike
    cases = {"gguf": (("0.10.0", "0.11.0"), ("0.13.0", "0.19.0")),
             "accelerate": (("1.0.0", "1.0.1"), ("1.1.0", "1.16.0")),
             "jinja2": (("3.1.0", "3.1.5"), ("3.1.6", "3.2.0")),
             "uvicorn": (("0.29.0", "0.32.0"), ("0.32.1", "0.55.0"))}
    assert set(cases) == set(environment.EXTRA_FLOORS)
    for name, (olds, news) in cases.items():
        for old in olds:
            assert f"{name} {old} is older than ortmodule needs" in environment.too_old(name, old)
        for new in (*news, metadata.version(name)):
            assert environment.too_old(name, new) is None, (name, new)
    sound = {"onnxruntime-gpu": "1.31.1", "transformers": "5.24.0"}
    found = environment.problems({**sound, "gguf": "0.11.0", "jinja2": "3.1.6", "accelerate": "1.0.1"},
                                 ["CPUExecutionProvider"], torch_cuda=False)
    assert [problem.split(" ")[:2] for problem in found] == [["gguf", "0.11.0"], ["accelerate", "1.0.1"]]
    assert "pip install -U 'accelerate>=1.1'" in found[1]

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not gguf")
    with pytest.raises(ExportError, match="not a readable GGUF file"):  # the installed gguf reads it
        export(bad, tmp_path / "out")
    _faked_versions(monkeypatch, {"gguf": "0.11.0", "jinja2": "3.1.0", "uvicorn": "0.32.0"})
    with pytest.raises(ExportError, match=re.escape("gguf 0.11.0 is older than ortmodule needs (>= 0.13: older "
                                                    "releases cannot read a GGUF file under numpy 2")):
        export(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    load = functools.partial(app.load_app, str(llama.package_dir), "127.0.0.1", "cpu", False, None, None, None)
    with caplog.at_level("WARNING", logger=app.log.name):
        load({"reuse_prefix": "on"})  # the fixture's tokenizer has no chat template: nothing to warn of
        assert "jinja2" not in caplog.text
        plain = hf.load_tokenizer
        monkeypatch.setattr(hf, "load_tokenizer", lambda path: setattr(tokenizer := plain(path), "chat_template",
                                                                      CHAT_TEMPLATE) or tokenizer)
        load({"reuse_prefix": "on"})
    assert "chat requests will fail (scores and completions will not): jinja2 3.1.0 is older than ortmodule needs" \
        in caplog.text and "pip install -U 'jinja2>=3.1.6'" in caplog.text
    assert "a stream whose client leaves will run to its end: uvicorn 0.32.0 is older" in caplog.text
