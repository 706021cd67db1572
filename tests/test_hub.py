"""A package named by its Hugging Face Hub repository (ortmodule/hub.py): `from_pretrained`,
`load_tokenizer` and lm-eval's `pretrained=org/name,subfolder=...` take a repository id, as
transformers' models do. Offline here: the repositories are written into a hub cache of the test's
own (the layout `snapshot_download` makes: blobs, a snapshot of links, refs/main), and
huggingface_hub reads that cache alone."""

import hashlib
import os
import shutil

import huggingface_hub
import pytest
import torch
from helpers import load_pair
from lm_eval.api.instance import Instance

import ortmodule
from ortmodule import OrtModelForCausalLM, PackageError, hub
from ortmodule.lm_eval import OrtModuleLM

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(cache, repo, packages: dict):
    """`repo` in the hub cache `cache`: each package folder of `packages` ({subfolder: folder}, '' the root)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    blobs, snapshot = root / "blobs", root / "snapshots" / COMMIT
    blobs.mkdir(parents=True, exist_ok=True)
    for subfolder, folder in packages.items():
        target = snapshot / subfolder
        target.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():
            blob = blobs / hashlib.sha256(entry.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copy(entry, blob)
            (target / entry.name).symlink_to(os.path.relpath(blob, target))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def hub_cache(build, tmp_path_factory):
    fixture = build("llama")
    cache = tmp_path_factory.mktemp("hub")
    cached_repo(cache, "ortmodule-test/one-package", {"": fixture.package_dir})
    cached_repo(cache, "ortmodule-test/two-packages", {"cpu/fp32": fixture.package_dir,
                                                       "cpu/int4": build("llama", precision="int4").package_dir})
    cached_repo(cache, "ortmodule-test/no-package", {"": fixture.hf_dir})
    ggufs = tmp_path_factory.mktemp("ggufs")
    for name in ("model-Q4_K_M.gguf", "model-Q8_0.gguf"):
        (ggufs / name).write_bytes(b"not a GGUF file: " + name.encode())
    cached_repo(cache, "ortmodule-test/model-GGUF", {"": ggufs})
    other, graphs = tmp_path_factory.mktemp("onnx-community"), tmp_path_factory.mktemp("onnx")
    with_config = tmp_path_factory.mktemp("with-config")  # a package that keeps its checkpoint's config.json
    for entry in [*fixture.package_dir.iterdir(), fixture.hf_dir / "config.json"]:
        shutil.copy(entry, with_config / entry.name)
    cached_repo(cache, "ortmodule-test/with-config", {"": with_config})
    shutil.copy(fixture.hf_dir / "config.json", other / "config.json")  # transformers.js's layout
    (graphs / "model.onnx").write_bytes(b"an ONNX graph")
    cached_repo(cache, "ortmodule-test/other-onnx", {"": other, "onnx": graphs})
    return fixture, cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """huggingface_hub on the test's cache, offline (its settings are read at import, so patched here)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache[1]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache[0]


def test_a_repository_id_loads_its_package(offline):
    _, hf = load_pair(offline)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    with torch.no_grad():
        expected = hf(ids).logits
    model = OrtModelForCausalLM.from_pretrained("ortmodule-test/one-package", local_files_only=True)  # its one package
    assert torch.allclose(model(ids).logits, expected, atol=1e-4, rtol=1e-4)
    chosen = OrtModelForCausalLM.from_pretrained("ortmodule-test/two-packages", subfolder="cpu/fp32", revision="main")
    assert torch.allclose(chosen(ids).logits, expected, atol=1e-4, rtol=1e-4)
    assert chosen.package.root.parts[-2:] == ("cpu", "fp32")
    tokenizer = ortmodule.load_tokenizer("ortmodule-test/two-packages", subfolder="cpu/fp32")
    assert tokenizer("hello world").input_ids == ortmodule.load_tokenizer(offline.package_dir)("hello world").input_ids


def test_a_repositorys_package_gives_its_tables_and_config_fields_through_the_caches_links(offline, caplog):
    """The hub cache's files are links to its blobs, which onnx-ir refuses to read through ("may indicate a path
    traversal attack via a symbolic link"): `get_input_embeddings` and `get_output_embeddings` were a
    NotSupportedError there (trl's fused head, steering by embeddings), and the config fields read from the
    graph were the class's defaults. Now the same tables and config as the package's own folder."""
    import logging

    local = OrtModelForCausalLM.from_pretrained(offline.package_dir)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        model = OrtModelForCausalLM.from_pretrained("ortmodule-test/one-package")
    assert (model.package.root / "model.onnx.data").is_symlink() and "were not read" not in caplog.text
    for name in ("get_input_embeddings", "get_output_embeddings"):
        assert torch.equal(getattr(model, name)().weight, getattr(local, name)().weight)
    ours, theirs = model.config.to_dict(), local.config.to_dict()
    assert {k for k in ours if ours[k] != theirs.get(k)} == {"_name_or_path"}


def test_what_a_repository_id_cannot_give_is_named(offline):
    with pytest.raises(PackageError, match="holds 2 GenAI packages; pass subfolder= one of: cpu/fp32, cpu/int4"):
        OrtModelForCausalLM.from_pretrained("ortmodule-test/two-packages")
    with pytest.raises(PackageError, match="holds no genai_config.json: not an ONNX GenAI package"):
        OrtModelForCausalLM.from_pretrained("ortmodule-test/no-package")
    with pytest.raises(PackageError, match="not an ONNX GenAI package: ONNX files of another exporter"):
        OrtModelForCausalLM.from_pretrained("ortmodule-test/other-onnx")
    with pytest.raises(PackageError, match="package folder not found: ortmodule-test/absent, and as a Hugging Face "
                                           "Hub repository it could not be listed"):
        OrtModelForCausalLM.from_pretrained("ortmodule-test/absent")
    with pytest.raises(PackageError, match="has no folder 'cuda/fp16'; its GenAI packages: cpu/fp32, cpu/int4"):
        OrtModelForCausalLM.from_pretrained("ortmodule-test/two-packages", subfolder="cuda/fp16")
    with pytest.raises(PackageError, match="package folder not found: no/such/folder"):
        OrtModelForCausalLM.from_pretrained("no/such/folder")  # not a repository id: a missing folder


def test_the_auto_classes_load_a_repositorys_package_and_leave_its_checkpoint(offline):
    """With `ortmodule.auto_classes()`, `AutoModelForCausalLM.from_pretrained(org/name, subfolder=...)` of a
    repository holding a package gives its model, one of several packages is named; a repository of a
    checkpoint, or of another exporter's ONNX files beside a config.json, is transformers' to load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, hf = load_pair(offline)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = hf(ids).logits
    with ortmodule.auto_classes():
        for name, subfolder in (("ortmodule-test/one-package", None), ("ortmodule-test/two-packages", "cpu/fp32")):
            model = AutoModelForCausalLM.from_pretrained(name, subfolder=subfolder, revision="main")
            assert isinstance(model, OrtModelForCausalLM)
            assert torch.allclose(model(ids).logits, expected, atol=1e-4, rtol=1e-4)
            assert AutoConfig.from_pretrained(name, subfolder=subfolder).to_dict() == model.config.to_dict()
        with pytest.raises(PackageError, match="holds 2 GenAI packages; pass subfolder= one of: cpu/fp32, cpu/int4"):
            AutoModelForCausalLM.from_pretrained("ortmodule-test/two-packages")
        checkpoint = AutoModelForCausalLM.from_pretrained("ortmodule-test/no-package", dtype=torch.float32)
        assert type(checkpoint) is type(hf)
        with pytest.raises(OSError, match="does not appear to have"):  # transformers' own: no weights beside config
            AutoModelForCausalLM.from_pretrained("ortmodule-test/other-onnx")


def test_a_repositorys_config_is_fetched_alone_and_the_repository_listed_once(offline, monkeypatch):
    """Under the auto classes, `AutoConfig.from_pretrained(org/name)` of a package that keeps its
    checkpoint's config.json fetches the package's JSON files alone (as transformers fetches config.json
    alone), not its graphs and weights; a package without one is fetched whole, its config built from
    it. Every load lists the repository once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fetched, listed = [], []
    download, files = huggingface_hub.snapshot_download, hub._files

    def recording_download(repo, **kwargs):
        if not kwargs.get("local_files_only"):  # the offline listing's own reads of the cache aside
            fetched.append((repo, kwargs.get("allow_patterns")))
        return download(repo, **kwargs)

    def recording_files(repo, revision, fetching):
        listed.append(repo)
        return files(repo, revision, fetching)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording_download)
    monkeypatch.setattr(hub, "_files", recording_files)
    reference = AutoConfig.from_pretrained(offline.hf_dir).to_dict()  # transformers on the checkpoint
    with ortmodule.auto_classes():
        config = AutoConfig.from_pretrained("ortmodule-test/with-config")
        assert (fetched, listed) == ([("ortmodule-test/with-config", ["*.json"])], ["ortmodule-test/with-config"])
        model = AutoModelForCausalLM.from_pretrained("ortmodule-test/with-config")
        assert fetched[1:] == [("ortmodule-test/with-config", None)] and len(listed) == 2
        fetched.clear(), listed.clear()
        built = AutoConfig.from_pretrained("ortmodule-test/two-packages", subfolder="cpu/fp32")  # no config.json
        assert (fetched, listed) == ([("ortmodule-test/two-packages", ["cpu/fp32/*"])], ["ortmodule-test/two-packages"])
    ignored = {"name_or_path", "_name_or_path", "transformers_version", "dtype", "torch_dtype"}
    assert {k: v for k, v in config.to_dict().items() if k not in ignored} == \
        {k: v for k, v in reference.items() if k not in ignored}
    assert config.to_dict() == model.config.to_dict()
    assert built.num_hidden_layers == reference["num_hidden_layers"] and built.vocab_size == reference["vocab_size"]


def test_lm_eval_takes_a_repository_and_its_subfolder(offline):
    """`--model_args pretrained=org/name,subfolder=...`: the same answers as the package's folder."""
    pairs = [("The capital of France is", " Paris"), ("Two plus two is", " four"), ("Water boils at", " 100 C")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    local = OrtModuleLM(pretrained=str(offline.package_dir), device="cpu", batch_size=2)
    named = OrtModuleLM(pretrained="ortmodule-test/two-packages", subfolder="cpu/fp32", device="cpu", batch_size=2)
    assert named._package.root.parts[-2:] == ("cpu", "fp32")
    assert named.loglikelihood(requests) == local.loglikelihood(requests)


def test_serve_takes_a_repository_and_names_the_model_by_it(offline, monkeypatch, capsys, tmp_path):
    """`ortmodule serve org/name --subfolder ...`: the model is reported by its repository, not by the
    snapshot's hash (a local folder's subfolder by its own name: the path is never shown); a repository
    of several packages without --subfolder stops with a usage error."""
    import uvicorn
    from fastapi.testclient import TestClient

    from ortmodule import cli

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: served.append(server.config.app))
    cli.ortmodule(["serve", "ortmodule-test/two-packages", "--subfolder", "cpu/fp32", "--port", "0"])
    with TestClient(served[0]) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["ortmodule-test/two-packages/cpu/fp32"]
    shutil.copytree(offline.package_dir, tmp_path / "download" / "cpu" / "fp32")
    cli.ortmodule(["serve", str(tmp_path / "download"), "--subfolder", "cpu/fp32", "--port", "0"])
    with TestClient(served[1]) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fp32"]
    with pytest.raises(SystemExit):
        cli.ortmodule(["serve", "ortmodule-test/two-packages", "--port", "0"])
    assert "pass subfolder= one of: cpu/fp32, cpu/int4" in capsys.readouterr().err


def test_export_takes_a_checkpoint_repository(offline, tmp_path):
    """`ortmodule export org/name OUT`: the checkpoint's files from the hub's cache, exported; the
    package answers as transformers on those weights."""
    _, hf = load_pair(offline)
    out = ortmodule.export("ortmodule-test/no-package", tmp_path / "package", progress=False)  # a checkpoint
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = hf(ids).logits
    assert torch.allclose(OrtModelForCausalLM.from_pretrained(out)(ids).logits, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ortmodule.ExportError, match="source not found: ortmodule-test/absent, and as a Hugging Face"):
        ortmodule.export("ortmodule-test/absent", tmp_path / "other", progress=False)


def test_a_local_folder_of_several_packages_names_them(offline, tmp_path):
    """A download of a whole repository (`huggingface-cli download org/name --local-dir DIR`): the
    folder holds packages in subfolders, which the error names; `subfolder=` loads one."""
    for name in ("cpu/fp32", "cuda/bf16/v2"):
        shutil.copytree(offline.package_dir, tmp_path / name)
    with pytest.raises(PackageError, match="but packages in its subfolders: cpu/fp32, cuda/bf16/v2"):
        OrtModelForCausalLM.from_pretrained(tmp_path)
    model = OrtModelForCausalLM.from_pretrained(tmp_path, subfolder="cpu/fp32")
    assert model.package.root == tmp_path / "cpu" / "fp32"


def test_export_takes_a_gguf_file_of_a_repository(offline, tmp_path):
    """A repository of GGUF files: `--gguf-file` names the one to export (it reaches the GGUF reader,
    which refuses these stand-in bytes by name); without it the files are listed."""
    with pytest.raises(ortmodule.ExportError, match="holds GGUF files, not a Hugging Face checkpoint: pass the one to "
                                                    "export .*: model-Q4_K_M.gguf, model-Q8_0.gguf"):
        ortmodule.export("ortmodule-test/model-GGUF", tmp_path / "out", progress=False)
    with pytest.raises(ortmodule.ExportError, match=r"model-Q8_0.gguf.*not a readable GGUF file"):
        ortmodule.export("ortmodule-test/model-GGUF", tmp_path / "out", progress=False, gguf_file="model-Q8_0.gguf")
    with pytest.raises(ortmodule.ExportError, match="has no file model-F16.gguf"):
        ortmodule.export("ortmodule-test/model-GGUF", tmp_path / "out", progress=False, gguf_file="model-F16.gguf")
