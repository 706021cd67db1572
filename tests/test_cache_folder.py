"""ortmodule's cache folder (ortmodule/cache_folder.py, `ortmodule cache list|clear`): what loads
write there is listed with its size and last use, a load renews the last use of what it reads,
`clear` removes by kind and by age, and a package whose entries were cleared loads again with the
same numbers (its entries remade)."""

import os
import time
from pathlib import Path

import pytest
import torch

import ortmodule
from ortmodule import cache_folder, mapped
from ortmodule.cli import ortmodule as cli

DAY = 86400


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_CACHE", str(tmp_path))
    return tmp_path


def load(fixture):
    return ortmodule.OrtModelForCausalLM.from_pretrained(fixture.package_dir)


def logits(model):
    ids = torch.tensor([[5, 9, 14, 3, 7, 21]])
    return model(ids, cont_len=3).logits


def age(path, days):
    when = time.time() - days * DAY
    os.utime(path, (when, when))


def test_loads_fill_the_folder_and_a_cleared_package_loads_again_alike(llama, home, capsys):
    model = load(llama)
    before = logits(model)
    costs = model.measured_costs()
    graphs = sorted((home / "graphs").glob("*.onnx"))
    assert graphs and costs is not None and len(list((home / "costs").glob("*.json"))) == 1
    listed = cache_folder.entries()
    assert sorted(e.path for e in listed if e.kind == "graphs") == graphs
    assert all(e.bytes == e.path.stat().st_size > 0 for e in listed)
    cli(["cache", "list"])
    out = capsys.readouterr().out
    assert str(home) in out and f"graphs  {len(graphs):6} entries" in out and "costs        1 entries" in out
    cli(["cache", "clear", "--dry-run"])
    assert f"graphs: would remove {len(graphs)} entries" in capsys.readouterr().out
    assert sorted((home / "graphs").glob("*.onnx")) == graphs  # a dry run removes nothing
    cli(["cache", "clear", "graphs"])
    assert f"graphs: removed {len(graphs)} entries" in capsys.readouterr().out
    assert not list((home / "graphs").iterdir())
    assert len(list((home / "costs").glob("*.json"))) == 1  # only the kind named
    again = load(llama)  # its rewritten graph remade (the extend graph where sharing is first decided)
    remade = sorted((home / "graphs").glob("*.onnx"))
    assert torch.equal(logits(again), before) and remade and set(remade) < set(graphs)
    cli(["cache", "clear"])
    assert cache_folder.entries() == []
    assert [p.name for p in (home / "costs").iterdir()] == [".timing-cpu.lock"]  # the timings' lock: not an entry


def test_a_load_renews_what_it_reads_and_clear_older_than_removes_the_unused(llama, home, capsys):
    load(llama).measured_costs()
    used = list((home / "graphs").iterdir()) + list((home / "costs").iterdir())
    stale = home / "graphs" / "model-of-a-package-since-deleted.onnx"
    stale.write_bytes(b"x" * 100)
    for path in [*used, stale]:
        age(path, 10)
    again = load(llama)  # reads its graphs and costs: their last use is now
    again.measured_costs()
    again.decoder.extender()
    assert all(time.time() - p.stat().st_mtime < DAY for p in used)
    assert [e.path for e in cache_folder.entries()][0] == stale  # the oldest use first
    cli(["cache", "clear", "--older-than", "5"])
    assert "graphs: removed 1 entries, 100 B" in capsys.readouterr().out
    assert not stale.exists() and all(p.exists() for p in used)


def test_writes_in_progress_are_left_alone_for_an_hour(home):
    folder = home / "graphs"
    folder.mkdir()
    writing = folder / ".model-abc.onnx.123.456.tmp"
    writing.write_bytes(b"partial")
    assert cache_folder.entries() == []
    cli(["cache", "clear"])
    assert writing.exists()
    lock = cache_folder.timing_lock(home / "costs", "cpu")  # `exclusive`'s lock, a few bytes: never an entry
    with cache_folder.exclusive(lock):
        pass
    age(writing, 2 / 24)  # two hours: the remains of a killed process
    age(lock, 2 / 24)
    assert [e.path for e in cache_folder.entries()] == [writing]
    cli(["cache", "clear"])
    assert not writing.exists() and lock.exists()


def test_packed_weights_are_one_entry_each_their_last_use_renewed_by_a_load(llama, home, monkeypatch, capsys):
    monkeypatch.setenv(mapped.SWITCH, "1")
    monkeypatch.setattr(mapped, "HEADROOM", 0)  # a few MB of entry: no free gigabyte asked beyond it
    first = logits(load(llama))
    (entry,) = cache_folder.entries(["packed"])
    assert entry.path.is_dir() and entry.bytes == sum(p.stat().st_size for p in entry.path.rglob("*") if p.is_file())
    assert entry.bytes > sum(p.stat().st_size for p in llama.package_dir.glob("*.onnx.data"))  # the packed copies
    age(entry.path / "complete", 10)
    assert cache_folder.entries(["packed"])[0].last_used < time.time() - 9 * DAY
    load(llama)  # maps it again
    assert cache_folder.entries(["packed"])[0].last_used > time.time() - DAY
    cli(["cache", "clear", "packed"])
    assert "packed: removed 1 entries" in capsys.readouterr().out and not entry.path.exists()
    assert torch.equal(logits(load(llama)), first)


def test_bad_arguments_and_entries_that_cannot_be_removed_are_said(home, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        cli(["cache", "clear", "weights"])
    said = capsys.readouterr().err
    assert stop.value.code == 2 and "no cache kind 'weights': the kinds are graphs, costs, packed" in said
    with pytest.raises(SystemExit) as stop:
        cli(["cache", "clear", "--older-than", "-1"])
    assert stop.value.code == 2 and "must be at least 0" in capsys.readouterr().err
    (home / "costs").mkdir()
    kept = home / "costs" / "a.json"
    kept.write_text("{}")
    real = type(kept).unlink
    monkeypatch.setattr(type(kept), "unlink", lambda self, *a: (_ for _ in ()).throw(PermissionError("read-only"))
                        if self == kept else real(self, *a))
    with pytest.raises(SystemExit) as stop:
        cli(["cache", "clear"])
    assert stop.value.code == 1 and f"could not remove {kept}: read-only" in capsys.readouterr().err and kept.exists()


FORKS_WHILE_HOLDING = """
import fcntl, os, sys, time
from ortmodule import cache_folder
lock = sys.argv[1]
with cache_folder.exclusive(lock):
    child = os.fork()
    if child == 0:  # the child takes its own turn once the parent has let the lock go, then lingers
        with cache_folder.exclusive(lock):
            pass
        time.sleep(30)
        os._exit(0)
time.sleep(1)
fd = os.open(lock, os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("held")
os.kill(child, 9)
os.waitpid(child, 0)
"""


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    """A process that forks while one of its threads holds `exclusive`'s lock (the timing of a
    package's runs): the child's copy of the lock file is closed, so the lock goes when the parent
    lets it go, not when the child ends; the child takes turns of its own."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORKS_WHILE_HOLDING, str(tmp_path / ".timing-cpu.lock")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["free"], done


def test_the_lock_is_one_however_its_path_is_spelled(tmp_path, monkeypatch):
    """Taken again in the same thread through another spelling of its path (a relative `cache_dir`,
    say), the lock is re-entered, not waited for: a second `flock` on the same file from one process
    would wait for the first forever."""
    import threading

    monkeypatch.chdir(tmp_path)
    lock = tmp_path / "costs" / ".timing-cpu.lock"
    done = threading.Event()

    def nested():
        with cache_folder.exclusive(lock), cache_folder.exclusive(Path("costs/../costs/.timing-cpu.lock")):
            done.set()

    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert done.is_set()
