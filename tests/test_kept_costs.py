"""Measured costs kept on disk between processes (ortmodule/kept_costs.py): measured once per graph,
machine and settings, checked by one small prefill at each later load, measured again where that
prefill's time moved, where asked, or where the stored record is not whole."""

import json
import logging
import time

import onnxruntime as ort
import pytest
import torch
from helpers import float32_logits_copy

import ortmodule
from ortmodule import costs, kept_costs, nbits


@pytest.fixture
def store(tmp_path, monkeypatch):
    """ortmodule's cache folder in tmp_path; the calls of costs.measure, counted."""
    monkeypatch.setenv("ORTMODULE_CACHE", str(tmp_path))
    calls, real = [], costs.measure
    monkeypatch.setattr(costs, "measure", lambda decoder, *shown: calls.append(decoder) or real(decoder, *shown))
    return tmp_path / "costs", calls


def load(fixture, **kwargs):
    return ortmodule.OrtModelForCausalLM.from_pretrained(fixture.package_dir, **kwargs)


def test_costs_are_measured_once_and_kept_for_later_loads(llama, store, monkeypatch, capsys):
    """Measured with a progress bar on stderr (seconds to minutes on a CPU), its five parts each done
    once, in order; read back silently at later loads."""
    folder, calls = store
    # The check prefill's time held fixed: on a busy machine it can move past the tolerance between
    # two loads, which measures again (the next test's case), not what this one is about.
    monkeypatch.setattr(costs, "check_seconds", lambda decoder: 0.05)
    first = load(llama).measured_costs()
    assert len(calls) == 1 and first.per_token > 0 and first.extend_per_token > 0
    shown = capsys.readouterr().err
    assert "ortmodule: timing package's runs" in shown and "5/5" in shown and "6/5" not in shown
    parts = ["prefill batches", "prefill attention", "decode steps", "extend batches", "extend attention"]
    assert [shown.index(f"{part} done") for part in parts] == sorted(shown.index(f"{part} done") for part in parts)
    (entry,) = folder.glob("*.json")
    record = json.loads(entry.read_text())
    assert costs.Costs(**record["costs"]) == first and record["check_seconds"] > 0
    assert record["machine"] == kept_costs.machine(first_device := load(llama).device) and first_device.type == "cpu"
    later = load(llama)  # a later process: a new model object over the same package
    assert later.measured_costs(measure=False) is None  # what the shared path asks: nothing read or timed
    assert later.measured_costs() == first and len(calls) == 1  # read back (and checked), not measured
    assert later.measured_costs(measure=False) == first  # now the model has them
    assert "ortmodule: timing" not in capsys.readouterr().err
    assert later.measured_costs() is later.measured_costs()
    assert later.measured_costs(refresh=True) is not None and len(calls) == 2  # asked for: measured again
    other = load(llama, prefill_chunk=0)  # another setting, other costs
    assert other.measured_costs() is not None and len(calls) == 3 and len(list(folder.glob("*.json"))) == 2


def test_the_extend_session_the_probes_grew_is_made_again(llama, store):
    """The costs' extend probes run over 2,048 cached positions a row, and ONNX Runtime's CPU arena keeps what
    a session's largest run took until the session goes (1 GB of RSS for SmolLM2-135M fp32, held for the
    rest of the process): after timing, the extend session that ran them is let go, made again, and runs as
    before."""
    import gc
    import weakref

    model = load(llama)
    tokens = [[7, 8, 9, 10], [11, 12]]
    before = ortmodule.score(model, None, list(range(20, 60)), tokens, [1, 2], reuse_prefix=True)
    probed = weakref.ref(model.decoder.extender().session.ort_session)
    model.measured_costs()
    gc.collect()
    assert probed() is None  # its session (and arena) gone
    assert model.decoder.extender() is not None
    after = ortmodule.score(model, None, list(range(20, 60)), tokens, [1, 2], reuse_prefix=True)
    assert torch.allclose(torch.tensor(after), torch.tensor(before), rtol=1e-5, atol=0)


def test_the_server_makes_the_extend_session_again_at_load(llama, store, monkeypatch):
    """`ortmodule serve` (as lm-eval's backend) times the costs at load; the extend session the timing let go
    is made again then, not in the first request that needs it."""
    import uvicorn

    from ortmodule import cli, extend

    events, made = [], extend.make_extender
    monkeypatch.setattr(extend, "make_extender", lambda *args, **kwargs: events.append("made") or made(*args, **kwargs))
    timed = costs.measure
    monkeypatch.setattr(costs, "measure", lambda *args: events.append("timed") or timed(*args))
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: events.append("serving"))
    cli.ortmodule(["serve", str(llama.package_dir), "--port", "0"])
    assert events[-3:] == ["timed", "made", "serving"] and events.count("made") == 2, events


def test_the_costs_are_measured_again_where_the_check_prefill_took_another_time(llama, store, monkeypatch, caplog):
    folder, calls = store
    clock = [0.10]
    monkeypatch.setattr(costs, "check_seconds", lambda decoder: clock[0])
    load(llama).measured_costs()
    assert len(calls) == 1
    clock[0] = 0.13  # within 1.5x: the stored costs
    load(llama).measured_costs()
    assert len(calls) == 1
    clock[0] = 0.16  # 1.6x slower than at the measurement (a busy machine now, or then)
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        load(llama).measured_costs()
    assert len(calls) == 2 and "took 0.160 s where it took 0.100 s" in caplog.text
    assert json.loads(next(folder.glob("*.json")).read_text())["check_seconds"] == 0.16  # stored anew
    clock[0] = 0.16 / 1.6  # faster, the same way
    load(llama).measured_costs()
    assert len(calls) == 3


@pytest.mark.parametrize("damage", ["not json", "costs", "negative", "check"])
def test_a_stored_record_that_is_not_whole_is_measured_again(llama, store, caplog, damage):
    folder, calls = store
    load(llama).measured_costs()
    (entry,) = folder.glob("*.json")
    record = json.loads(entry.read_text())
    if damage == "not json":
        text = entry.read_text()[:40]
    else:
        if damage == "costs":
            del record["costs"]["per_token"]
        elif damage == "negative":
            record["costs"]["step"] = -1.0
        else:
            record["check_seconds"] = "fast"
        text = json.dumps(record)
    entry.write_text(text)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        measured = load(llama).measured_costs()
    assert measured.per_token > 0 and len(calls) == 2
    assert ("cannot read" if damage == "not json" else "damaged or not ortmodule's") in caplog.text
    assert costs.Costs(**json.loads(entry.read_text())["costs"]) == measured  # replaced by a whole one


def test_a_folder_that_cannot_be_written_costs_a_measurement_per_load(llama, store, caplog, tmp_path, monkeypatch):
    _, calls = store
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("ORTMODULE_CACHE", str(blocked))  # its `costs` folder cannot be made
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        assert load(llama).measured_costs().per_token > 0
        assert load(llama).measured_costs().per_token > 0
    assert len(calls) == 2 and "cannot keep the measured costs" in caplog.text
    assert "cannot write the rewrite cache" in caplog.text  # the graphs' cache too: a warning, not a failed load


def test_the_key_follows_the_graph_the_machine_and_the_settings(llama, build, monkeypatch, tmp_path):
    """The key follows what the runs' time depends on: the graph that runs (the LM head as it runs,
    not as asked for), the machine, the session options and ortmodule's settings."""
    monkeypatch.setenv("ORTMODULE_MAP_PACKED_WEIGHTS", "0")
    model = load(llama)
    key = kept_costs.settings_key(model.decoder)
    assert kept_costs.settings_key(load(llama).decoder) == key
    assert kept_costs.settings_key(load(build("qwen3")).decoder) != key  # another graph
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    assert kept_costs.settings_key(load(llama, session_options=options).decoder) != key
    assert kept_costs.settings_key(load(llama, rewrite_lm_head=False).decoder) != key
    # lm-eval's default head, float32, runs the same graph as the default where the package's head
    # already gives float32 sums: one entry, not a second measurement of the same runs; on a package that
    # casts a half-precision head's logits to float32 it is another head, with costs of its own.
    assert kept_costs.settings_key(load(llama, rewrite_lm_head="float32").decoder) == key
    half = build("llama", precision="fp16")
    assert kept_costs.settings_key(load(half, rewrite_lm_head="float32").decoder) == \
        kept_costs.settings_key(load(half).decoder)  # a half-precision head whose logits are not cast: no rewrite
    casting = float32_logits_copy(half, tmp_path / "casting")
    float32_head = ortmodule.OrtModelForCausalLM.from_pretrained(casting, rewrite_lm_head="float32").decoder
    assert float32_head.head_dtype == torch.float32
    assert kept_costs.settings_key(float32_head) != kept_costs.settings_key(
        ortmodule.OrtModelForCausalLM.from_pretrained(casting).decoder)
    # A 4-bit package's costs follow the path its runs take: "auto" shares the key of the path it chose.
    four = build("llama", precision="int4")
    keys = {choice: kept_costs.settings_key(load(four, quantized_prefill=choice).decoder) for choice in ("fp32",
                                                                                                       "package")}
    chosen = load(four).decoder
    assert keys["fp32"] != keys["package"]
    assert kept_costs.settings_key(chosen) == keys["fp32" if chosen.fp32_path else "package"]
    monkeypatch.setenv("ORTMODULE_MAP_PACKED_WEIGHTS", "1")  # the extend session then packs nothing at a run
    assert kept_costs.settings_key(model.decoder) != key
    monkeypatch.setenv("ORTMODULE_MAP_PACKED_WEIGHTS", "0")
    monkeypatch.setattr(kept_costs, "machine", lambda device: "another CPU, 64 cores")
    assert kept_costs.settings_key(model.decoder) != key
    assert kept_costs.machine(model.device).endswith(" cores")


def test_the_4_bit_path_chosen_for_this_cpu_is_kept(build, monkeypatch, tmp_path):
    """`quantized_prefill="auto"` probes the two paths once per CPU, ONNX Runtime and shape and keeps
    the answer, so that later loads (later processes) take the same path and give the same numbers;
    a record that is not whole probes again, and so does another shape."""
    monkeypatch.setenv("ORTMODULE_CACHE", str(tmp_path))
    answers, probes = iter([False, True, True]), []
    monkeypatch.setattr(nbits, "probe_paths", lambda *shape: probes.append(shape) or next(answers))
    four = build("llama", precision="int4")

    def fresh_process_chooses() -> bool:
        nbits.fp32_path_is_faster.cache_clear()  # what a new process starts with
        return load(four).decoder.fp32_path

    assert not fresh_process_chooses() and len(probes) == 1  # probed: the package's path
    assert not fresh_process_chooses() and not fresh_process_chooses() and len(probes) == 1  # kept, not probed
    (entry,) = (tmp_path / "costs").glob("nbits-path-*.json")
    assert json.loads(entry.read_text())["fp32_path_is_faster"] is False
    entry.write_text("{")  # damaged
    assert fresh_process_chooses() and len(probes) == 2
    assert fresh_process_chooses() and len(probes) == 2
    nbits.fp32_path_is_faster.cache_clear()
    assert nbits.fp32_path_is_faster(64, 96, 32) and len(probes) == 3  # another shape: its own probe
    assert len(list((tmp_path / "costs").glob("nbits-path-*.json"))) == 2
    nbits.fp32_path_is_faster.cache_clear()


# Two processes that load at once: each waits at a barrier (both ready files; for the costs, with the
# model loaded), then asks for the same kept answer; the work that answer takes is stretched (a sleep)
# so that the second asks while the first works.
AT_ONCE = """
import pathlib, sys, time
import torch
import ortmodule
from ortmodule import costs, nbits
folder, me, what, package = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
work_log = folder / "work.log"
real_probe, real_measure, real_check = nbits.probe_paths, costs.measure, costs.check_seconds
def check(decoder):
    with work_log.open("a") as f:
        f.write("check\\n")
    return real_check(decoder)
def probe(*shape):
    with work_log.open("a") as f:
        f.write("probe\\n")
    time.sleep(2)
    return real_probe(*shape)
def measure(decoder, *shown):
    with work_log.open("a") as f:
        f.write("measure\\n")
    time.sleep(2)
    return real_measure(decoder, *shown)
nbits.probe_paths, costs.measure, costs.check_seconds = probe, measure, check
def barrier():
    (folder / f"ready-{me}").touch()
    deadline = time.monotonic() + 120
    while len(list(folder.glob("ready-*"))) < 2:
        assert time.monotonic() < deadline, "the other process never got ready"
        time.sleep(0.01)
if what == "path":
    barrier()
    print(nbits.fp32_path_is_faster(576, 1536))
else:
    model = ortmodule.OrtModelForCausalLM.from_pretrained(package)
    barrier()  # both loaded: they ask for the costs at once
    torch.save(model.measured_costs()._asdict(), folder / f"costs-{me}.pt")
"""


@pytest.mark.parametrize("what", ["path", "costs"])
def test_processes_that_load_at_once_take_turns(llama, tmp_path, what):
    """Processes that ask for the same kept answer at once (lm-eval's data-parallel ranks loading a
    package): the 4-bit path is probed once, the costs measured once (not twice, side by side,
    each slowing the other), and every process reads the first one's answer; the one that waits says
    for which process, as it may wait minutes, and does not check costs measured while it waited."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ORTMODULE_CACHE=str(tmp_path / "cache"))
    processes = [subprocess.Popen([sys.executable, "-c", AT_ONCE, str(tmp_path), str(i), what, str(llama.package_dir)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for i in range(2)]
    finished = [process.communicate(timeout=300) for process in processes]
    assert all(process.returncode == 0 for process in processes), finished
    work = (tmp_path / "work.log").read_text().split()
    # The costs' check prefill: timed once, for the record; the process that waited reads the costs
    # measured meanwhile unchecked (timed beside the other process, it would measure them all again).
    assert work == (["probe"] if what == "path" else ["measure", "check"]), work
    if what == "path":
        assert len({out for out, _ in finished}) == 1
    else:
        answers = [torch.load(tmp_path / f"costs-{i}.pt") for i in range(2)]
        assert answers[0] == answers[1]
    waiting = [i for i, (_, err) in enumerate(finished) if "ortmodule: waiting for process" in err]
    assert len(waiting) == 1, finished
    assert f"waiting for process {processes[1 - waiting[0]].pid}," in finished[waiting[0]][1]


def test_a_waiter_names_a_holder_that_has_not_written_its_pid_yet(tmp_path, capsys):
    """The holder of a timing lock writes its pid just after its `flock` returns: a process that
    finds the lock held in between reads the file again until the pid is there (it said "waiting
    for process unknown" before); and a holder leaves no pid behind for the next one's waiters."""
    import fcntl
    import os
    import threading

    from ortmodule import cache_folder

    lock = tmp_path / ".timing-cpu"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: it holds the lock against this process's too

    def write_then_release():
        try:
            time.sleep(0.2)
            os.pwrite(holder, b"424242", 0)
            time.sleep(0.2)
        finally:
            os.close(holder)  # whatever happens, the lock goes: the test cannot hang

    thread = threading.Thread(target=write_then_release)
    thread.start()
    with cache_folder.exclusive(lock) as waited_since:
        assert waited_since is not None
        assert lock.read_text() == str(os.getpid())
    thread.join()
    assert "waiting for process 424242, which is timing runs on cpu" in capsys.readouterr().err
    assert lock.read_text() == ""  # released: no pid left behind


def test_threads_that_ask_at_once_take_turns(llama, store, monkeypatch):
    """Two threads of one process asking for the costs of one package at once: measured once."""
    import threading
    import time

    _, calls = store
    monkeypatch.setattr(costs, "check_seconds", lambda decoder: 0.05)
    counted = costs.measure  # the store's: counts its calls
    monkeypatch.setattr(costs, "measure", lambda decoder, *shown: time.sleep(1) or counted(decoder, *shown))
    decoders = [load(llama).decoder for _ in range(2)]
    found = [None, None]
    threads = [threading.Thread(target=lambda i=i: found.__setitem__(i, kept_costs.measured(decoders[i])))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and found[0] == found[1] and found[0] is not None


def test_a_copy_of_the_package_reads_the_costs_of_the_original(llama, store, monkeypatch, tmp_path):
    """The same graph in another folder (`save_pretrained`, Olive's output folder, a Hub revision's snapshot):
    its costs are the original's, not timed again (a copy's costs had been timed anew, 30 s to minutes on a
    CPU), and kept under the copy's name too; another graph is still timed."""
    import shutil

    folder, calls = store
    monkeypatch.setattr(costs, "check_seconds", lambda decoder: 0.05)
    first = load(llama).measured_costs()
    copy = tmp_path / "copied-package"
    shutil.copytree(llama.package_dir, copy)
    again = ortmodule.OrtModelForCausalLM.from_pretrained(copy).measured_costs()
    assert again == first and len(calls) == 1
    assert sorted(p.name.split("-model-")[0] for p in folder.glob("*.json")) == ["copied-package", "package"]
    (folder / next(p.name for p in folder.glob("package-*.json"))).unlink()  # the copy's own entry now
    assert ortmodule.OrtModelForCausalLM.from_pretrained(copy).measured_costs() == first and len(calls) == 1
    load(llama, prefill_chunk=0).measured_costs()  # other settings: timed
    assert len(calls) == 2
