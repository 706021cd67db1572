"""Packed weights mapped from a file on a CPU (ortmodule/mapped.py, `ORTMODULE_MAP_PACKED_WEIGHTS=1`):
the same logits as the weights packed in memory, the entry written once and read at later loads, a
new entry where the weights change under the same graph, and a load as usual where no entry can be
written."""

import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import ortmodule
from ortmodule import mapped

HEADROOM = mapped.HEADROOM  # as the product has it, before a test's fixture sets it
IDS = torch.randint(4, 500, (3, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The entries' folder in tmp_path, the mapping switched on; the entries written, counted. The
    tiny fixtures' entries need a few MB: no gigabyte of free disk kept beyond them (CI's disk can be
    nearly full)."""
    monkeypatch.setattr(mapped, "entries", lambda: tmp_path / "cache" / "packed")
    monkeypatch.setattr(mapped, "HEADROOM", 0)
    monkeypatch.setenv(mapped.SWITCH, "1")
    written, real = [], mapped._write
    monkeypatch.setattr(mapped, "_write", lambda *args: written.append(args) or real(*args))
    return tmp_path / "cache" / "packed", written


def logits(path, **kwargs) -> torch.Tensor:
    model = ortmodule.OrtModelForCausalLM.from_pretrained(path, **kwargs)
    return model(IDS, attention_mask=torch.ones_like(IDS)).logits


@pytest.mark.parametrize("arch,precision", [("llama", "fp32"), ("qwen3", "fp32")])
def test_mapped_weights_give_the_package_logits_and_are_written_once(build, arch, precision, cache, monkeypatch):
    """Float weights (MatMul's packing), equal to the weights packed in memory and within 1e-4 of
    transformers."""
    folder, written = cache
    fixture = build(arch, precision=precision)
    hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)  # the same weights
    monkeypatch.setenv(mapped.SWITCH, "0")
    packed_in_memory = logits(fixture.package_dir)
    assert not written
    monkeypatch.setenv(mapped.SWITCH, "1")
    first = logits(fixture.package_dir)
    sessions = len(written)  # the main session
    assert sessions == 1 == len(list(folder.glob("*/complete")))
    assert torch.equal(first, packed_in_memory)
    later = logits(fixture.package_dir)  # a later process: read from the entries, nothing written
    assert len(written) == sessions and torch.equal(later, packed_in_memory)
    with torch.no_grad():
        expected = hf(IDS, attention_mask=torch.ones_like(IDS)).logits
    assert (later - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_weights_are_not_mapped(build, llama, bits, cache, caplog, tmp_path):
    """MatMulNBits packages load as they are (an 8-bit one's mapped packing gave NaN logits in ONNX
    Runtime 1.31), with the reason logged; their logits are whole numbers, not NaN."""
    from ortmodule import cli

    folder, written = cache
    if bits == 4:
        package = build("llama", precision="int4").package_dir
    else:  # the builder's 8-bit weights, as `ortmodule export --precision int8` writes them
        package = tmp_path / "int8"
        cli.ortmodule(["export", str(llama.hf_dir), str(package), "--precision", "int8", "--quiet"])
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        found = logits(package)
    assert not written and "float weights only" in caplog.text and torch.isfinite(found).all()


def test_the_extend_session_packs_mapped_weights(build, cache, monkeypatch):
    """The extend graph (packed at every run without the mapping) gets an entry of its own, and its
    logits stay the package graph's (the extender's own check at creation, and here)."""
    folder, written = cache
    fixture = build("llama")
    model = ortmodule.OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    extender = model.decoder.extender()
    assert extender is not None and len(written) == 2  # the main graph, then the extend graph
    scores = ortmodule.score(model, None, list(range(5, 40)), [[7, 8, 9], [10, 11]], [1, 2, 3], reuse_prefix=True)
    whole = ortmodule.score(model, None, list(range(5, 40)), [[7, 8, 9], [10, 11]], [1, 2, 3], reuse_prefix=False)
    assert (torch.tensor(scores) - torch.tensor(whole)).abs().max().item() < 1e-5


def test_new_weights_under_the_same_graph_get_a_new_entry(build, cache, tmp_path, monkeypatch):
    """A package exported again with other weights keeps its graph file byte for byte; its entry must
    not be the old one, or the old weights would answer."""
    folder, written = cache
    package = tmp_path / "package"
    shutil.copytree(build("llama").package_dir, package)
    before = logits(package)
    data = package / "model.onnx.data"
    weights = torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.float32)
    data.write_bytes((weights * 1.25).numpy().tobytes())  # the same size and graph, other weights
    after = logits(package)
    assert len(written) == 2 and len(list(folder.glob("*/complete"))) == 2
    assert not torch.allclose(after, before, atol=1e-3)
    monkeypatch.setenv(mapped.SWITCH, "0")
    assert torch.equal(after, logits(package))  # what the new weights give packed in memory


def test_a_cache_that_cannot_be_written_loads_as_usual(build, cache, tmp_path, monkeypatch, caplog):
    fixture = build("llama")
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setattr(mapped, "entries", lambda: blocked / "packed")
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        mapped_try = logits(fixture.package_dir)
    assert "cannot map" in caplog.text
    monkeypatch.setenv(mapped.SWITCH, "0")
    assert torch.equal(mapped_try, logits(fixture.package_dir))


def test_too_little_disk_loads_as_usual(build, cache, monkeypatch, caplog):
    folder, written = cache
    fixture = build("llama")
    monkeypatch.setattr(mapped, "HEADROOM", HEADROOM)  # the product's margin: 600 MB free is too little
    monkeypatch.setattr(mapped.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 600 * 10**6))
    with caplog.at_level(logging.WARNING, logger="ortmodule"):  # a warning: the mapping was asked for
        assert logits(fixture.package_dir).shape[0] == len(IDS)
    assert not written and "not mapping packed weights: 600 MB free" in caplog.text


def test_a_damaged_entry_is_removed_and_the_package_loads(build, cache, monkeypatch, caplog):
    """An entry whose data file lost its end (a full disk, a crash outside ortmodule's atomic write):
    ONNX Runtime refuses it at load, the entry goes, and the weights are packed in memory."""
    folder, written = cache
    fixture = build("llama")
    first = logits(fixture.package_dir)
    (entry,) = folder.glob("*/complete")
    data = entry.parent / "graph.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        again = logits(fixture.package_dir)
    assert "cannot be loaded" in caplog.text and not entry.parent.exists()
    assert torch.equal(again, first)
