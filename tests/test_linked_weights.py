"""A package in the Hugging Face hub's cache layout: `snapshots/<commit>/` holds links to
`blobs/<sha256>` (what `snapshot_download` and `huggingface-cli download` without `--local-dir`
make). Every session ortmodule makes from a rewritten graph (the decoder, hidden states, the extend
graph, mapped packed weights) reads the weights where the links lead (ortmodule/linked_weights.py);
ONNX Runtime 1.31 refused them there ("External data path escapes model directory")."""

import hashlib
import os
import shutil

import pytest
import torch
from helpers import load_pair

import ortmodule
from ortmodule import OrtModelForCausalLM, PackageError, mapped
from ortmodule.linked_weights import relocated


def hub_layout(package, root):
    """`package`'s files as the hub's cache holds them: content-named blobs, a snapshot of links."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for entry in package.iterdir():
        blob = blobs / hashlib.sha256(entry.read_bytes()).hexdigest()
        shutil.copy(entry, blob)
        (snapshot / entry.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture(scope="module")
def linked(build, tmp_path_factory):
    fixture = build("llama")
    return fixture, hub_layout(fixture.package_dir, tmp_path_factory.mktemp("hub") / "models--org--name")


def test_a_package_in_the_hub_cache_runs_as_transformers(linked):
    fixture, snapshot = linked
    assert (snapshot / "model.onnx.data").is_symlink()
    _, hf = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(snapshot)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        expected = hf(ids, output_hidden_states=True)
    out = model(ids, output_hidden_states=True)  # the rewritten graph, and a second session for the states
    assert torch.allclose(out.logits, expected.logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(out.hidden_states[-1], expected.hidden_states[-1], atol=1e-4, rtol=1e-4)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                       hf.generate(ids, max_new_tokens=6, do_sample=False))
    # A shared query run once, its items over copies of its cache (the extend path's sessions).
    tokenizer = ortmodule.load_tokenizer(snapshot)
    items = [[20, 21, 22], [23, 24], [25, 26, 27, 28]]
    query = list(range(30, 60))
    shared = ortmodule.score(model, tokenizer, query, items, [40, 41], reuse_prefix=True)
    whole = ortmodule.score(OrtModelForCausalLM.from_pretrained(fixture.package_dir), tokenizer, query, items,
                            [40, 41], reuse_prefix=False)
    assert torch.allclose(torch.tensor(shared), torch.tensor(whole), atol=1e-5, rtol=1e-4)


def test_mapped_packed_weights_from_the_hub_cache(linked, monkeypatch, tmp_path):
    fixture, snapshot = linked
    monkeypatch.setenv("ORTMODULE_CACHE", str(tmp_path))
    monkeypatch.setattr(mapped, "HEADROOM", 0)  # a few MB of entry: no free gigabyte asked beyond it
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = OrtModelForCausalLM.from_pretrained(fixture.package_dir)(ids).logits
    monkeypatch.setenv("ORTMODULE_MAP_PACKED_WEIGHTS", "1")
    assert torch.allclose(OrtModelForCausalLM.from_pretrained(snapshot)(ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert len(list((tmp_path / "packed").glob("*/complete"))) == 1  # mapped, not loaded as usual


def test_graph_bytes_of_a_plain_package_are_left_unparsed(linked):
    fixture, _ = linked
    data = b"not a graph: a folder without links is never parsed"
    assert relocated(data, fixture.package_dir) == (data, fixture.package_dir)


def test_weights_linked_into_several_folders_are_refused_by_name(build, tmp_path):
    """Two weight files whose links lead to two folders: no one folder holds both."""
    import onnx

    fixture = build("llama")
    proto = onnx.load(str(fixture.package_dir / "model.onnx"), load_external_data=False)
    tensors = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for entry in tensors[0].external_data:
        if entry.key == "location":
            entry.value = "other.data"
    for name, place in (("model.onnx.data", "a"), ("other.data", "b")):
        (tmp_path / place).mkdir()
        shutil.copy(fixture.package_dir / "model.onnx.data", tmp_path / place / name)
        (tmp_path / name).symlink_to(tmp_path / place / name)
    with pytest.raises(PackageError, match="links into several folders"):
        relocated(proto.SerializeToString(), tmp_path)


def test_save_pretrained_makes_a_folder_of_its_own(linked, tmp_path):
    """`model.save_pretrained(folder)`, as HF-style code saves a model: a package from the hub's cache
    becomes files of its own (no links), which load to the same logits."""
    _, snapshot = linked
    model = OrtModelForCausalLM.from_pretrained(snapshot)
    model.save_pretrained(tmp_path / "saved", safe_serialization=True)
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert saved == sorted(p.name for p in snapshot.iterdir())
    assert not any(p.is_symlink() for p in (tmp_path / "saved").iterdir())
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(OrtModelForCausalLM.from_pretrained(tmp_path / "saved")(ids).logits, model(ids).logits)
    with pytest.raises(ortmodule.NotSupportedError, match="upload_folder"):
        model.save_pretrained(tmp_path / "again", push_to_hub=True)
    with pytest.raises(ValueError, match="that is the package's own folder"):
        model.save_pretrained(snapshot)
