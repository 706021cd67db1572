"""ortmodule_dev/preloaded.py: the fixtures' exports forked from a process that imported the exporters
once, against the same commands run as processes of their own (ortmodule.exporter.run_subprocess)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ortmodule.exporter import ExportError, builder_command, run_builder, run_subprocess
from ortmodule_dev import fixtures, preloaded

# A command as the exporters' are given: [python, "-c", script, *arguments]. It records what it was run
# with, prints, and exits with its second argument's status.
RECORD = """
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ORTMODULE_PRELOADED_PROBE"),
               "offline": os.environ.get("HF_HUB_OFFLINE"), "main": __name__}, f)
print("a line of output")
print("the last line", file=sys.stderr)
raise SystemExit(int(sys.argv[2]))
"""


def test_a_command_runs_as_in_a_process_of_its_own(tmp_path, monkeypatch, light_zygote):
    """Its arguments, this process's working folder and environment (the exporters' offline settings
    added), `__main__`; a failure the same ExportError, with the output's end in the same order (the
    zygote started where stdout is buffered by default)."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ORTMODULE_PRELOADED_PROBE", "as the zygote started")
    preloaded.run([sys.executable, "-c", "pass"], "warm-up")  # the zygote runs before the variable changes
    monkeypatch.setenv("ORTMODULE_PRELOADED_PROBE", "changed")
    records = {}
    for name, runner in (("preloaded", preloaded.run), ("subprocess", lambda c, w: run_subprocess(c, w, False))):
        runner([sys.executable, "-c", RECORD, str(tmp_path / name), "0"], "probe")
        records[name] = json.loads((tmp_path / name).read_text())
        records[name]["argv"][1] = "<file>"
    assert records["preloaded"] == records["subprocess"]
    assert records["preloaded"]["env"] == "changed" and records["preloaded"]["offline"] == "1"
    errors = {}
    for name, runner in (("preloaded", preloaded.run), ("subprocess", lambda c, w: run_subprocess(c, w, False))):
        with pytest.raises(ExportError) as caught:
            runner([sys.executable, "-c", RECORD, str(tmp_path / "fails"), "3"], "the probe")
        errors[name] = str(caught.value)
    assert errors["preloaded"] == errors["subprocess"]
    assert "the probe failed (exit 3)" in errors["preloaded"] and errors["preloaded"].endswith("the last line")


def test_the_builder_forked_writes_the_same_package_as_its_own_process(tmp_path):
    """A fixture's checkpoint exported by the zygote's child and by the model builder's own process
    (`run_builder`, as `ortmodule export` runs it): the same files, byte for byte."""
    checkpoint = fixtures.build(fixtures.FixtureSpec("llama")).hf_dir
    run_builder(checkpoint, tmp_path / "own", "fp32", "cpu")
    preloaded.run(builder_command(checkpoint, tmp_path / "forked", "fp32", "cpu"), "the model builder")
    own = sorted(p.name for p in (tmp_path / "own").iterdir())
    assert own == sorted(p.name for p in (tmp_path / "forked").iterdir()) and "model.onnx" in own
    for name in own:
        assert (tmp_path / "own" / name).read_bytes() == (tmp_path / "forked" / name).read_bytes(), name


@pytest.fixture
def light_zygote(monkeypatch):
    """A zygote that imports nothing (one that imports the exporters takes seconds to start again),
    stopped afterwards: the next export starts the fixtures' own."""
    monkeypatch.setattr(preloaded, "PRELOAD", ())
    preloaded.stop()
    yield
    preloaded.stop()


def test_an_export_past_the_timeout_is_killed_and_the_next_one_runs(tmp_path, monkeypatch, light_zygote):
    monkeypatch.setattr(preloaded, "TIMEOUT_SECONDS", 2)
    start = time.perf_counter()
    with pytest.raises(ExportError, match=r"killed after 2 s"):
        preloaded.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], "a sleeper")
    assert time.perf_counter() - start < 30
    preloaded.run([sys.executable, "-c", RECORD, str(tmp_path / "after"), "0"], "probe")
    assert json.loads((tmp_path / "after").read_text())["main"] == "__main__"


def test_a_zygote_that_died_is_started_again(tmp_path, light_zygote):
    """The next export runs in a new zygote's child, not in a process of its own."""
    parent = [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'w').write(str(os.getppid()))"]
    preloaded.run([*parent, str(tmp_path / "first")], "probe")
    zygote = int((tmp_path / "first").read_text())
    assert zygote != os.getpid()
    os.kill(zygote, signal.SIGKILL)
    deadline = time.monotonic() + 10  # dead: gone, or a zombie until its parent (this process) reaps it
    while time.monotonic() < deadline and Path(f"/proc/{zygote}/stat").is_file() and \
            Path(f"/proc/{zygote}/stat").read_text().split(") ")[-1][:1] != "Z":
        time.sleep(0.05)
    preloaded.run([*parent, str(tmp_path / "second")], "probe")
    assert int((tmp_path / "second").read_text()) not in (zygote, os.getpid())
