"""transformers' auto classes on GenAI packages (ortmodule/auto.py): code that loads its model by name,
`AutoModelForCausalLM.from_pretrained(name)`, run unchanged on a package, against transformers on the
same weights; lm-eval's own `hf` backend and lighteval's transformers model loading a package by name;
`ortmodule run` starting a command, a file and a module so."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

import ortmodule
from ortmodule import OrtModelForCausalLM, tasks

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])


def patched_methods() -> list:
    return [getattr(transformers, name).__dict__["from_pretrained"]
            for name in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoConfig")]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_package_loads_by_name_and_a_checkpoint_as_transformers_loads_it(build, arch):
    fixture = build(arch)
    reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(IDS).logits
    before = patched_methods()
    with ortmodule.auto_classes():
        model = AutoModelForCausalLM.from_pretrained(fixture.package_dir)
        config = AutoConfig.from_pretrained(fixture.package_dir)
        checkpoint = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)
        assert isinstance(model, OrtModelForCausalLM) and type(checkpoint) is type(reference)
        assert torch.allclose(model(IDS).logits, expected, atol=1e-4, rtol=1e-4)
        assert config.to_dict() == model.config.to_dict()  # the package has no config.json: built from genai_config
        assert AutoConfig.from_pretrained(fixture.hf_dir).to_dict() == reference.config.to_dict()
    assert patched_methods() == before  # transformers' own methods again
    with pytest.raises(ValueError, match="Unrecognized model"):  # transformers' error: the package has no config.json
        AutoModelForCausalLM.from_pretrained(fixture.package_dir)


def test_transformers_loading_keywords_mean_what_they_mean_to_ortmodule(build):
    """lm-eval's and lighteval's keywords (`revision`, `subfolder=""`, `dtype`, `device_map`, `max_memory`,
    `gguf_file=None`, `quantization_config=None`, `trust_remote_code`, `config`), a `config` asking for hidden
    states, a `generation_config`, a config keyword; refusals named as ortmodule names them."""
    fixture = build("llama")
    package = fixture.package_dir
    with ortmodule.auto_classes():
        plain = AutoModelForCausalLM.from_pretrained(package)(IDS).logits
        config = AutoConfig.from_pretrained(package, revision="main", trust_remote_code=False, gguf_file=None,
                                            subfolder="")
        config.output_hidden_states = True
        model = AutoModelForCausalLM.from_pretrained(
            package, revision="main", subfolder="", dtype=torch.float32, device_map={"": "cpu"}, max_memory=None,
            gguf_file=None, quantization_config=None, trust_remote_code=True, config=config,
            generation_config=GenerationConfig(max_new_tokens=3, do_sample=False))
        out = model(IDS)
        assert len(out.hidden_states) == 3 and torch.equal(out.logits, plain)
        assert model.generate(IDS[:1]).shape == (1, 8)  # the generation config passed in: 3 new tokens
        assert AutoConfig.from_pretrained(package, output_attentions=True).output_attentions is True
        config, unused = AutoConfig.from_pretrained(package, return_unused_kwargs=True, not_a_field=1)
        assert unused == {"not_a_field": 1}
        with pytest.raises(ValueError, match="dtype=torch.bfloat16: .* computes in float32, fixed when it was"):
            AutoModelForCausalLM.from_pretrained(package, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match=r"unexpected keyword arguments: \['revison'\]"):
            AutoModelForCausalLM.from_pretrained(package, revison="main")
        with pytest.raises(TypeError, match="a GenAI package takes no positional model arguments"):
            AutoModelForCausalLM.from_pretrained(package, "extra")


def test_a_pipeline_by_name_runs_on_the_package(build):
    """`pipeline("text-generation", model=name)` loads through the auto classes: the package's model, and
    transformers' greedy text on the checkpoint with the same weights."""
    fixture = build("llama")
    with ortmodule.auto_classes():
        ours = transformers.pipeline("text-generation", model=str(fixture.package_dir))
    theirs = transformers.pipeline("text-generation", model=str(fixture.hf_dir))
    assert isinstance(ours.model, OrtModelForCausalLM)
    for prompt in ("Hello there", "The capital of France is"):
        assert ours(prompt, max_new_tokens=12, do_sample=False) == theirs(prompt, max_new_tokens=12, do_sample=False)


def test_an_image_text_to_text_load_gives_the_multimodal_package(build):
    fixture = build("qwen2_5_vl")
    with ortmodule.auto_classes():
        model = AutoModelForImageTextToText.from_pretrained(fixture.package_dir)
    assert isinstance(model, OrtModelForCausalLM) and "vision" in model.package.genai_config["model"]


def test_enabling_nests_and_disabling_without_it_is_an_error():
    before = patched_methods()
    ortmodule.enable_auto_classes()
    with ortmodule.auto_classes():
        assert patched_methods() != before
    assert patched_methods() != before  # the outer enable still holds
    ortmodule.disable_auto_classes()
    assert patched_methods() == before
    with pytest.raises(RuntimeError, match="without enable_auto_classes"):
        ortmodule.disable_auto_classes()


def evaluate(model_args: str, patched: bool):
    with ortmodule.auto_classes() if patched else contextlib.nullcontext():
        return lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks.TASKS,
                                       task_manager=tasks.task_manager(tasks.TASKS), batch_size=8, device="cpu",
                                       log_samples=True)


def test_lm_evals_own_hf_backend_runs_on_a_package_by_name(build):
    """lm-eval's `hf` backend, unchanged, given the package's folder as `pretrained`: every task's results
    and every request's answer those of `hf` on the checkpoint with the same weights."""
    fixture = build("llama")
    ours = evaluate(f"pretrained={fixture.package_dir}", patched=True)
    theirs = evaluate(f"pretrained={fixture.hf_dir},dtype=float32,max_length={fixture.spec.context_length}",
                      patched=False)
    assert ours["config"]["model_num_parameters"] == theirs["config"]["model_num_parameters"]
    for task in tasks.TASKS:
        mine = [r for s in sorted(ours["samples"][task], key=lambda s: s["doc_id"]) for r in s["filtered_resps"]]
        other = [r for s in sorted(theirs["samples"][task], key=lambda s: s["doc_id"]) for r in s["filtered_resps"]]
        assert len(mine) == len(other) > 0
        for a, b in zip(mine, other, strict=True):
            if isinstance(a, str):  # generate_until's answers
                assert a == b, task
            elif isinstance(a, (list, tuple)):  # (loglikelihood, is_greedy)
                assert abs(a[0] - b[0]) < 1e-4 and a[1] == b[1], task
            else:  # a rolling loglikelihood
                assert abs(a - b) < 1e-3, task


@pytest.fixture
def grad_mode_kept():
    """lighteval turns torch's gradients off for the whole process (at import and in its model's
    constructor): the tests after this one get the mode they had."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def test_lighteval_loads_a_package_by_name(build, tmp_path, monkeypatch, grad_mode_kept):
    from lighteval.models.transformers.transformers_model import TransformersModel, TransformersModelConfig
    from lighteval.tasks.requests import Doc

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    fixture = build("llama")
    docs = [Doc(query="The capital of France is", choices=[" Paris", " Berlin", " Rome"], gold_index=0, task_name="t"),
            Doc(query="Two plus two is", choices=[" four", " five"], gold_index=0, task_name="t")]
    asks = [Doc(query="Name a color.", choices=[""], gold_index=0, task_name="t", generation_size=12,
                stop_sequences=["\n"])]
    results = []
    for path, patched in ((fixture.package_dir, True), (fixture.hf_dir, False)):
        # named from its parent folder: lighteval keeps its sample cache at cache_dir / model_name, which an
        # absolute name would put inside the model's own folder
        monkeypatch.chdir(path.parent)
        with ortmodule.auto_classes() if patched else contextlib.nullcontext():
            lm = TransformersModel(TransformersModelConfig(model_name=path.name, batch_size=4, device="cpu",
                                                           dtype="float32", cache_dir=str(tmp_path)))
        lm._cache = None  # lighteval's sample cache is keyed by model name
        assert isinstance(lm.model, OrtModelForCausalLM) == patched
        results.append(([r.logprobs for r in lm.loglikelihood(docs)], [r.text for r in lm.greedy_until(asks)]))
    (ours, our_text), (theirs, their_text) = results
    for mine, other in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(other, abs=1e-4)
    assert our_text == their_text


SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__, model(torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1].argmax().item())
"""


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ortmodule", "run", *args], capture_output=True, text=True,
                          timeout=600, **kwargs)


def test_ortmodule_run_starts_a_file_a_module_and_a_command_with_the_auto_classes(build, tmp_path):
    fixture = build("llama")
    reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        token = reference(torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1].argmax().item()
    (tmp_path / "score_it.py").write_text(SCRIPT)
    for args in ((str(tmp_path / "score_it.py"), str(fixture.package_dir)),
                 ("-m", "score_it", str(fixture.package_dir))):
        done = run(*args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["OrtModelForCausalLM", str(token)]
    # lm-eval's command line, its `hf` backend unchanged, the package as `pretrained`
    out = tmp_path / "results"
    done = run("lm_eval", "--model", "hf", "--model_args", f"pretrained={fixture.package_dir}", "--tasks",
               "ortmodule_arithmetic_mc", "--include_path", tasks.TASK_DIR, "--limit", "8", "--device", "cpu",
               "--batch_size", "4", "--output_path", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(next(out.rglob("results_*.json")).read_text())
    expected = evaluate(f"pretrained={fixture.hf_dir},dtype=float32", patched=False)
    for metric in ("acc,none", "acc_norm,none"):  # on 8 of the 40 questions: the same share answered
        assert answer["results"]["ortmodule_arithmetic_mc"][metric] == pytest.approx(
            _first_eight(expected, metric), abs=1e-9)


def _first_eight(result, metric: str) -> float:
    """The task's `metric` on its first 8 questions, from a whole run's samples."""
    name = metric.split(",")[0]
    samples = sorted(result["samples"]["ortmodule_arithmetic_mc"], key=lambda s: s["doc_id"])[:8]
    return sum(s[name] for s in samples) / len(samples)


def test_ortmodule_run_reaches_the_processes_a_program_starts(build, tmp_path):
    """Python processes that a program run by `ortmodule run` starts (a shell's, a Python script's
    subprocess, `accelerate launch`'s worker) load packages by name too, once they import transformers;
    a sitecustomize of the user's on PYTHONPATH still runs; without `ortmodule run` the same child gets
    transformers' own error."""
    import os

    fixture = build("llama")
    reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        token = reference(torch.tensor([[5, 6, 7, 8, 9]])).logits[0, -1].argmax().item()
    expected = ["OrtModelForCausalLM", str(token)]
    child = tmp_path / "child.py"
    child.write_text(SCRIPT)
    arguments = [str(child), str(fixture.package_dir)]
    (tmp_path / "parent.py").write_text(
        f"import subprocess, sys\nsys.exit(subprocess.call([sys.executable, *{arguments!r}]))\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("print('mine ran')\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "PYTHONPATH": str(mine)}  # buffered
    shell = run("bash", "-c", f"{sys.executable} {child} {fixture.package_dir}", env=env)
    assert shell.returncode == 0, shell.stderr[-2000:]
    assert shell.stdout.split() == ["mine", "ran"] * 2 + expected  # at ortmodule's own start, then the child's
    parent = run(str(tmp_path / "parent.py"))
    assert parent.returncode == 0 and parent.stdout.split() == expected, parent.stderr[-2000:]
    launched = run("accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
                   "no", "--dynamo_backend", "no", str(child), str(fixture.package_dir))  # accelerate's worker
    assert launched.returncode == 0 and launched.stdout.split()[-2:] == expected, launched.stderr[-2000:]
    alone = subprocess.run([sys.executable, str(child), str(fixture.package_dir)], capture_output=True, text=True)
    assert alone.returncode != 0 and "Unrecognized model" in alone.stderr
    done = run("bash", "-c", "exit 3")
    assert done.returncode == 3


def test_a_program_that_is_not_python_runs_in_ortmodule_runs_place():
    """`ortmodule run PROGRAM` of a program that is not Python is that program's process (its PID): a
    SIGTERM sent to the PID a scheduler started ends the program, never leaving it running alone."""
    import signal
    import time

    marker = f"{time.time_ns() % 10**9}.5"  # the sleep's own argument (never reached), to find the process by
    started = subprocess.Popen([sys.executable, "-m", "ortmodule", "run", "sleep", marker], stdout=subprocess.PIPE)
    try:
        for _ in range(300):
            if Path(f"/proc/{started.pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                break  # ortmodule's process is now the sleep
            time.sleep(0.05)
        else:
            raise AssertionError(f"ortmodule run's process {started.pid} never became the program")
        started.send_signal(signal.SIGTERM)
        assert started.wait(timeout=30) == -signal.SIGTERM
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.split()
        assert not left, f"the program outlived ortmodule run's SIGTERM: {left}"
    finally:
        subprocess.run(["pkill", "-f", f"sleep {marker}"])
        started.kill()
    done = run("bash", "-c", "echo $PPID")  # bash's parent: this test's process, no ortmodule between
    assert done.returncode == 0 and done.stdout.split() == [str(os.getpid())]


def test_ortmodule_run_names_what_it_cannot_start():
    """One line and exit status 2, as the other commands' argument errors."""
    done = run("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: ortmodule run PROGRAM")
    done = run()
    assert done.returncode == 2 and "name the program to run" in done.stderr
    done = run("no-such-command-here")
    assert done.returncode == 2 and "'no-such-command-here' is no command of this environment" in done.stderr
    done = run("missing.py")
    assert done.returncode == 2 and "no file missing.py" in done.stderr
    for module, message in (("no_such_module", "no module named no_such_module"),
                            ("no_such_package.tool", "no module named no_such_package.tool"),
                            ("ortmodule.serving", "ortmodule.serving is a package without a __main__ module")):
        done = run("-m", module)  # as `python -m` says it, not runpy's traceback
        assert done.returncode == 2 and done.stderr.startswith(f"ortmodule run: error: {message}"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
