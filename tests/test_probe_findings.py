"""Faults found in a probe, each a clear error naming the problem, at load or at the call (never
inside ONNX Runtime, never a raw Python error): the rewrite cache, genai_config.json against the
graph, the library's arguments, and the server's types, flags, error shape and abandoned requests."""

import dataclasses
import json
import logging
import os
import shutil
import threading
import time

import httpx
import onnx
import pytest
import torch
from helpers import LiveServer, hold_worker, load_pair

import ortmodule
from ortmodule import OrtModelForCausalLM, PackageError, cli, graph, load_tokenizer, read_package
from ortmodule.serving import create_app

IDS = torch.tensor([[5, 9, 33, 70, 101, 7, 64, 12]])


def copy_package(fixture, tmp_path, name="package"):
    folder = tmp_path / name
    shutil.copytree(fixture.package_dir, folder)
    return folder


def logits(folder, cache_dir):
    return OrtModelForCausalLM.from_pretrained(folder, cache_dir=cache_dir)(IDS).logits


# ---- the rewrite cache ------------------------------------------------------------------------


def cache_entry(cache_dir):
    (entry,) = [p for p in cache_dir.iterdir() if p.suffix == ".onnx"]
    return entry


@pytest.mark.parametrize("damage", ["garbage", "empty", "unrewritten", "truncated"])
def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(llama, tmp_path, damage, caplog):
    cache_dir = tmp_path / "graphs"
    expected = logits(llama.package_dir, cache_dir)
    entry = cache_entry(cache_dir)
    good = entry.read_bytes()
    entry.write_bytes({"garbage": os.urandom(4096), "empty": b"",
                       "unrewritten": (llama.package_dir / "model.onnx").read_bytes(),
                       "truncated": good[: len(good) // 2]}[damage])
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        model = OrtModelForCausalLM.from_pretrained(llama.package_dir, cache_dir=cache_dir)
    assert model.keeps_positions
    assert torch.equal(model(IDS).logits, expected)
    assert any("damaged" in r.message and str(entry) in r.getMessage() for r in caplog.records)
    assert entry.read_bytes() == good  # rebuilt in place


def test_an_entry_made_by_other_rewrite_code_is_not_reused(llama, tmp_path, monkeypatch):
    """The rewrites' source code is a part of the cache key (graph.code_digest): after a change to it
    (an upgrade, or a change that did not bump REWRITE_VERSION) the graph is rewritten again instead
    of an old entry being read, and the entry made before stays where it was."""
    cache_dir = tmp_path / "graphs"
    expected = logits(llama.package_dir, cache_dir)
    before = cache_entry(cache_dir)
    assert graph.code_digest() == graph.code_digest.__wrapped__()  # the files' own digest, computed once
    monkeypatch.setattr(graph, "code_digest", lambda: "other code")
    made = []
    rewrite = graph.rewrite_keep_positions
    monkeypatch.setattr(graph, "rewrite_keep_positions", lambda *a, **k: made.append(1) or rewrite(*a, **k))
    assert torch.equal(logits(llama.package_dir, cache_dir), expected)
    assert made == [1] and before.is_file()
    assert len([p for p in cache_dir.iterdir() if p.suffix == ".onnx"]) == 2


def embedded_copy(fixture, folder):
    """The package with its weights inside model.onnx: graphs of different weights, one size."""
    shutil.copytree(fixture.package_dir, folder)
    model = onnx.load(str(folder / "model.onnx"))
    (folder / "model.onnx.data").unlink()
    onnx.save(model, str(folder / "model.onnx"))
    return folder


def test_a_decoder_replaced_with_the_same_size_and_time_gets_its_own_rewrite(llama, build, tmp_path):
    """`cp -p` of another graph of the same size over the decoder: the key is the content."""
    other = build("llama", seed=1)
    mine, theirs = embedded_copy(llama, tmp_path / "a"), embedded_copy(other, tmp_path / "b")
    assert (mine / "model.onnx").stat().st_size == (theirs / "model.onnx").stat().st_size
    cache_dir = tmp_path / "graphs"
    before = logits(mine, cache_dir)
    expected = logits(theirs, tmp_path / "other-graphs")
    stat = (mine / "model.onnx").stat()
    shutil.copyfile(theirs / "model.onnx", mine / "model.onnx")
    os.utime(mine / "model.onnx", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = logits(mine, cache_dir)
    assert torch.equal(after, expected) and not torch.equal(after, before)


def test_a_full_disk_leaves_no_partial_file_and_warns_once(llama, tmp_path, monkeypatch, caplog):
    cache_dir = tmp_path / "graphs"
    real_open = open

    class Full:
        def __init__(self, path, mode):
            self.file = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[:100])
            raise OSError(28, "No space left on device")

    def fake_open(path, mode="r", *args, **kwargs):
        return Full(path, mode) if "w" in mode else real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(graph, "open", fake_open, raising=False)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        first = logits(llama.package_dir, cache_dir)
        second = logits(llama.package_dir, cache_dir)
    assert torch.equal(first, second)
    assert list(cache_dir.iterdir()) == []  # no entry, no .tmp
    assert sum("cannot write the rewrite cache" in r.getMessage() for r in caplog.records) == 1


# ---- genai_config.json against the graph ------------------------------------------------------


def edit_config(folder, change):
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def setter(*keys, value):
    def change(config):
        section = config
        for key in keys[:-1]:
            section = section[key]
        section[keys[-1]] = value
    return change


CONFIG_FAULTS = [
    (setter("model", "vocab_size", value=500), "model.vocab_size is 500 but the decoder's 'logits' output has 512"),
    (setter("model", "vocab_size", value=1000), "model.vocab_size is 1000 but"),
    (setter("model", "vocab_size", value=0), "'model.vocab_size' must be a positive integer, got 0"),
    (setter("model", "vocab_size", value=-5), "'model.vocab_size' must be a positive integer, got -5"),
    (setter("model", "vocab_size", value="700"), "'model.vocab_size' must be a positive integer, got \"700\""),
    (setter("model", "context_length", value=0), "'model.context_length' must be a positive integer, got 0"),
    (setter("model", "decoder", "filename", value=None), "'model.decoder.filename' must be a non-empty string"),
    (setter("model", "decoder", "num_hidden_layers", value="3"),
     "'model.decoder.num_hidden_layers' must be a positive"),
    (setter("model", "decoder", "num_key_value_heads", value=4), "num_key_value_heads is 4 but model.onnx's attention"),
    (setter("model", "decoder", "head_size", value=8), "ONNX Runtime cannot run model.onnx with this configuration"),
    (setter("search", value="x"), "'search' must be a JSON object"),
    (setter("model", "decoder", value=[]), "'model.decoder' must be a JSON object"),
]


@pytest.mark.parametrize("change, message", CONFIG_FAULTS, ids=[m[:40] for _, m in CONFIG_FAULTS])
def test_an_inconsistent_config_is_refused_at_load(llama, tmp_path, change, message):
    folder = copy_package(llama, tmp_path)
    edit_config(folder, change)
    with pytest.raises(PackageError, match="genai_config.json") as error:
        OrtModelForCausalLM.from_pretrained(folder, cache_dir=tmp_path / "graphs")
    assert message in str(error.value)


@pytest.mark.parametrize(
    "content, message",
    [(os.urandom(64) + b"\xff\xfe", "not UTF-8 text"), (b"[1, 2, 3]", "must hold a JSON object, got list"),
     (b"{\"model\": ", "not valid JSON")],
    ids=["binary", "not-an-object", "cut-short"],
)
def test_an_unreadable_config_is_a_package_error(llama, tmp_path, content, message):
    folder = copy_package(llama, tmp_path)
    (folder / "genai_config.json").write_bytes(content)
    with pytest.raises(PackageError, match=message):
        read_package(folder)


@pytest.mark.parametrize("damage", ["truncated-graph", "truncated-weights", "missing-weights"])
def test_damaged_model_files_are_package_errors_naming_the_file(llama, tmp_path, damage):
    folder = copy_package(llama, tmp_path)
    graph_file, weights = folder / "model.onnx", folder / "model.onnx.data"
    if damage == "truncated-graph":
        graph_file.write_bytes(graph_file.read_bytes()[:1000])
        message = f"{graph_file}: not a readable ONNX graph"
    elif damage == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:5000])
        message = f"{weights}: truncated"
    else:
        weights.unlink()
        message = f"its weights file {weights} does not exist"
    with pytest.raises(PackageError) as error:
        OrtModelForCausalLM.from_pretrained(folder, cache_dir=tmp_path / "graphs")
    assert message in str(error.value)


# ---- the library's arguments ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(llama):
    return load_pair(llama)[0]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(generation_config={"max_new_tokens": 3}), TypeError,
         "generation_config must be a transformers.GenerationConfig"),
        (dict(max_new_tokens=2.5), ValueError, "max_new_tokens must be an integer >= 1, got 2.5"),
        (dict(max_new_tokens="4"), ValueError, "max_new_tokens must be an integer >= 1, got '4'"),
        (dict(max_new_tokens=True), ValueError, "max_new_tokens must be an integer"),
        (dict(max_new_tokens=3, do_sample=True, top_p=1.5), ValueError, "top_p must be a number in (0.0, 1.0]"),
        (dict(max_new_tokens=3, do_sample=True, temperature=-1.0), ValueError, "temperature must be a number > 0"),
        (dict(max_new_tokens=3, eos_token_id=-1), ValueError, "eos_token_id must be a token id"),
        (dict(max_new_tokens=3, eos_token_id=[1, 512]), ValueError, "eos_token_id must be a token id"),
        (dict(max_new_tokens=3, pad_token_id=10**6), ValueError, "pad_token_id must be a token id in [0, 512)"),
        # transformers' processors index the logits with these: an IndexError, or -1 the vocabulary's last token
        (dict(max_new_tokens=3, forced_eos_token_id=512), ValueError, "forced_eos_token_id must be a token id"),
        (dict(max_new_tokens=3, forced_bos_token_id=-1), ValueError, "forced_bos_token_id must be a token id"),
        # transformers' generate fails on these with a ZeroDivisionError, or a TypeError in its beam scorer
        (dict(max_new_tokens=3, num_beams=0), ValueError, "num_beams must be an integer >= 1, got 0"),
        (dict(max_new_tokens=3, do_sample=True, num_return_sequences=0), ValueError,
         "num_return_sequences must be an integer >= 1, got 0"),
        (dict(max_new_tokens=3, num_beams=2, length_penalty="x"), ValueError,
         "length_penalty must be a number, got 'x'"),
        # an all-ones mask of another shape: transformers drops it before the loop (its positions from it)
        (dict(max_new_tokens=3, attention_mask=torch.ones(1, 2, dtype=torch.long)), ValueError,
         "attention_mask shape (1, 2) does not match input_ids shape"),
    ],
)
def test_bad_generate_options(model, kwargs, error, message):
    with pytest.raises(error) as raised:
        model.generate(IDS, **kwargs)
    assert message in str(raised.value)


@pytest.mark.parametrize("options", [dict(top_p=0.0), dict(top_k=-1), dict(min_p=2.0, temperature=0.0),
                                     dict(num_beams=2, top_p=1.5)])
def test_calls_that_do_not_sample_ignore_the_sampling_filters_as_transformers(llama, options):
    """Greedy decoding and beam search take no top-k, top-p, min-p or temperature: transformers runs them
    whatever those hold (top_p 0 and temperature 0 are common ways to ask for greedy text), and so does
    ortmodule, with transformers' tokens; a sampled call checks them (test_bad_generate_options)."""
    model, hf = load_pair(llama)
    assert torch.equal(model.generate(IDS, max_new_tokens=4, **options), hf.generate(IDS, max_new_tokens=4, **options))


@pytest.mark.parametrize("prompt, error, message", [
    ([[5, 6, 7]], TypeError, "input_ids must be a torch.Tensor [batch, sequence] of token ids, got list"),
    (torch.tensor([5, 6, 7]), ValueError, "must be 2-D [batch, sequence], got shape (3,): ids[None] adds the batch"),
    (torch.tensor([[[5, 6]]]), ValueError, "must be 2-D [batch, sequence], got shape (1, 1, 2)"),
    ({"input_ids": torch.tensor([[5, 6]])}, TypeError, "got dict (a tokenizer's output goes in as keywords"),
])
def test_a_prompt_of_the_wrong_form_is_named_before_generate_runs(model, prompt, error, message):
    """transformers' generate fails deep inside on these (a list has no `shape`; a 1-D tensor's IndexError)."""
    for call in (lambda: model.generate(prompt, max_new_tokens=2), lambda: model.generate(input_ids=prompt,
                                                                                         max_new_tokens=2)):
        with pytest.raises(error) as raised:
            call()
        assert message in str(raised.value)


def test_bad_forward_and_step_inputs(model):
    with pytest.raises(ValueError, match="logits_to_keep is an empty tensor"):
        model(IDS, logits_to_keep=torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D integer positions"):
        model(IDS, logits_to_keep=torch.tensor([True, False]))
    with pytest.raises(TypeError, match="rows must hold integer positions"):
        model.logits_at(IDS, None, torch.tensor([0.7]), torch.tensor([3]))
    with pytest.raises(TypeError, match="cols must hold integer positions"):
        model.logits_at(IDS, None, [0], [2.5])
    with pytest.raises(TypeError, match="pieces must be a function of"):
        model.logits_at(IDS, None, [0], [2], pieces=[])
    out = model(IDS, use_cache=True)
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.bool"):
        model(torch.tensor([[True]]), past_key_values=out.past_key_values)
    wrong = torch.ones(1, IDS.shape[1] + 1, dtype=torch.int64)
    wrong[0, 2] = 0  # the first call's mask was all ones
    with pytest.raises(ValueError, match="earlier columns differ"):
        model(torch.tensor([[5]]), attention_mask=wrong, past_key_values=out.past_key_values)
    step = model(torch.tensor([[5]]), attention_mask=torch.ones_like(wrong), past_key_values=out.past_key_values,
                 use_cache=True)
    assert step.logits.shape == (1, 1, 512)  # the right mask still steps after the refusals


@pytest.mark.parametrize("convert", ["half", "bfloat16", "double", "type"])
def test_converting_the_precision_is_refused(model, convert):
    """Every conversion torch has for a module, `type(dtype)` too (torch's own changed only the empty
    parameter's dtype, which then no longer told what the model computes in)."""
    call = (lambda: model.type(torch.float16)) if convert == "type" else getattr(model, convert)
    with pytest.raises(TypeError, match="cannot convert an ONNX package"):
        call()
    assert next(model.parameters()).dtype == model.dtype == torch.float32
    assert model.float() is model and model.type(torch.float32) is model  # the package's own precision is fine
    with pytest.raises(TypeError, match=r"type\('torch.HalfTensor'\): give a torch.dtype"):
        model.type("torch.HalfTensor")
    assert model.to_empty(device="cpu") is model and next(model.parameters()).device == model.device


def test_a_huge_id_in_a_score_query_names_the_item(model):
    with pytest.raises(ValueError, match=f"item 1: token id {2**70} is outside the vocabulary"):
        ortmodule.score(model, None, query=[5, 6], items=[[7], [8, 2**70]], label_token_ids=[1])
    with pytest.raises(TypeError, match="must hold integer token ids"):
        ortmodule.score(model, None, query=[5, 6], items=[[7], [8, 9.0]], label_token_ids=[1])


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(llama):
    model, _ = load_pair(llama)
    server = LiveServer(create_app(model, load_tokenizer(llama.package_dir), name="tiny", window_ms=0))
    yield server
    server.stop()


GOOD = dict(query=[5, 6, 7], items=[[8], [9]], label_token_ids=[1, 2])


@pytest.mark.parametrize(
    "change, field",
    [(dict(label_token_ids=["5"]), "label_token_ids"), (dict(label_token_ids=[5.0]), "label_token_ids"),
     (dict(label_token_ids=[True]), "label_token_ids"), (dict(apply_softmax="yes"), "apply_softmax"),
     (dict(item_first=1), "item_first"), (dict(query=[5, "6"]), "query"), (dict(model=3), "model")],
)
def test_server_types_are_strict(live, change, field):
    response = live.client.post("/v1/score", json={**GOOD, **change})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400 and field in body["message"]


@pytest.mark.parametrize("content", [b'{"query": "\xff\xfe", "items": ["a"], "label_token_ids": [1]}',
                                     b"[" * 100_000 + b"]" * 100_000], ids=["invalid-utf8", "deeply-nested"])
def test_unparseable_bodies_get_the_error_object_and_are_counted(live, content):
    before = live.client.get("/metrics?format=json").json()["rejected_bad"]
    response = live.client.post("/v1/score", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400 and "message" in body
    assert live.client.get("/metrics?format=json").json()["rejected_bad"] == before + 1
    assert live.client.post("/v1/score", json=GOOD).status_code == 200


def test_requests_of_clients_that_left_are_not_scored(llama):
    model, _ = load_pair(llama)
    app = create_app(model, load_tokenizer(llama.package_dir), window_ms=0)
    server = app.state.served
    started, release, scored = hold_worker(server)  # the first group waits for the abandoned requests
    live = LiveServer(app)
    try:
        first = threading.Thread(target=live.client.post, args=("/v1/score",), kwargs=dict(json=GOOD))
        first.start()
        assert started.wait(30)
        for _ in range(5):  # clients that give up after 0.3 s
            with pytest.raises(httpx.TimeoutException):
                httpx.post(live.url + "/v1/score", json=GOOD, timeout=0.3)
        deadline = time.monotonic() + 30
        while live.client.get("/metrics?format=json").json()["abandoned"] < 5:
            assert time.monotonic() < deadline, live.client.get("/metrics?format=json").json()
            time.sleep(0.05)
        release.set()
        first.join(30)
        assert live.client.post("/v1/score", json=GOOD).status_code == 200
        metrics = live.client.get("/metrics?format=json").json()
        assert metrics["abandoned"] == 5 and metrics["requests"]["score"] == 2  # only the two whose clients waited
        assert sum(scored) == 2
    finally:
        release.set()
        live.stop()


@pytest.mark.parametrize("flag", [["--token-budget", "0"], ["--max-queue", "0"], ["--max-queue", "-1"],
                                  ["--window-ms", "-5"], ["--token-budget", "lots"], ["--reuse-prefix", "always"]])
def test_server_flags_are_checked(llama, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.ortmodule(["serve", str(llama.package_dir), *flag])
    assert exit_info.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_server_flags_reach_the_settings(llama, monkeypatch):
    """The serving flags become `Settings` fields (`--reuse-prefix` among them) unchanged."""
    given = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: given.update(options, path=path))
    cli.ortmodule(["serve", str(llama.package_dir), "--reuse-prefix", "on", "--token-budget", "4096"])
    fields = {field.name for field in dataclasses.fields(ortmodule.serving.Settings)}
    assert given["path"] == str(llama.package_dir)
    assert {k: v for k, v in given.items() if k in fields} == {**dataclasses.asdict(ortmodule.serving.Settings()),
                                                                "reuse_prefix": "on", "token_budget": 4096}


def test_create_app_checks_its_options(llama):
    model, _ = load_pair(llama)
    for options, message in ((dict(token_budget=0), "token_budget"), (dict(max_queue=0), "max_queue"),
                             (dict(max_queue=-1), "max_queue"), (dict(window_ms=-1), "window_ms"),
                             (dict(reuse_prefix="yes"), "reuse_prefix must be one of auto, on, off, got 'yes'")):
        with pytest.raises(ValueError, match=message):
            create_app(model, load_tokenizer(llama.package_dir), **options)


# ---- tokenizer files, and two processes loading a package for the first time -------------------


@pytest.mark.parametrize("damage", ["missing", "garbage", "config-garbage"])
def test_damaged_tokenizer_files_are_package_errors(llama, tmp_path, damage):
    folder = copy_package(llama, tmp_path)
    if damage == "missing":
        (folder / "tokenizer.json").unlink()
        message = "no tokenizer.json"
    elif damage == "garbage":
        (folder / "tokenizer.json").write_bytes(os.urandom(300))
        message = "the tokenizer files cannot be read"
    else:
        (folder / "tokenizer_config.json").write_text("{not json")
        message = "the tokenizer files cannot be read"
    with pytest.raises(PackageError, match=message):
        load_tokenizer(folder)


LOADER = """
import sys, torch
from ortmodule import OrtModelForCausalLM
model = OrtModelForCausalLM.from_pretrained(sys.argv[1], cache_dir=sys.argv[2])
assert model.keeps_positions
torch.save(model(torch.tensor([[5, 9, 33, 70, 101, 7, 64, 12]])).logits, sys.argv[3])
"""


@pytest.mark.slow
def test_processes_loading_a_package_for_the_first_time_at_once(llama, tmp_path):
    """Four processes race to build the same rewrite cache entry: all load, all agree, and the
    entry left behind passes its check."""
    import subprocess
    import sys

    cache_dir = tmp_path / "graphs"
    outs = [tmp_path / f"out{i}.pt" for i in range(4)]
    processes = [subprocess.Popen([sys.executable, "-c", LOADER, str(llama.package_dir), str(cache_dir), str(out)],
                                  stderr=subprocess.PIPE, text=True) for out in outs]
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    results = [torch.load(out) for out in outs]
    assert all(torch.equal(r, results[0]) for r in results)
    assert graph._read_entry(cache_entry(cache_dir)) is not None
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]


# ---- out of memory, for real: a process with its address space capped ------------------------

OUT_OF_MEMORY = """
import resource, sys, torch
import ortmodule
from ortmodule import OrtModelForCausalLM
model = OrtModelForCausalLM.from_pretrained(sys.argv[1], cache_dir=sys.argv[2])
small = torch.randint(4, 500, (2, 16), generator=torch.Generator().manual_seed(0))
expected = model(small).logits
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + 600 * 2**20, resource.RLIM_INFINITY))
big = torch.randint(4, 500, (1200, 256), generator=torch.Generator().manual_seed(1))
calls = {
    "prefill": lambda: model(big, cont_len=1),
    "generate": lambda: model.generate(big[:, :200], max_new_tokens=40, do_sample=False),
    "score": lambda: ortmodule.score(model, None, big[0, :100].tolist(), big[:, :150].tolist(), [5],
                                     token_budget=10**6),
}
for name, call in calls.items():
    try:
        call()
        print(name, "no error")
    except RuntimeError as e:
        print(name, "out of memory." in str(e), str(e)[:160].replace(chr(10), " "))
    assert torch.equal(model(small).logits, expected), name  # still usable, same numbers
print("usable")
"""


def test_allocation_failures_are_out_of_memory_errors_and_the_model_stays_usable(llama, tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY, str(llama.package_dir), str(tmp_path / "graphs")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    for name in ("prefill", "generate", "score"):
        assert lines[name].startswith("True"), result.stdout
    assert "usable" in result.stdout


# ONNX Runtime's words when its CUDA provider could not create a cuBLAS handle at session start, on an
# H100 after transformers had run in the same process (torch's cache held the memory; session 24).
CUBLAS_AT_SESSION_START = (
    "[ONNXRuntimeError] : 1 : FAIL : Exception during initialization: /onnxruntime_src/onnxruntime/core/providers/"
    "cuda/cuda_call.cc:154 ... CUBLAS failure 3: the resource allocation failed ; GPU=0 ; hostname=vm ; "
    "file=/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_execution_provider.cc ; line=245 ; "
    "expr=cublasCreate(&cublas_handle_);")


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """torch.cuda's memory calls on a machine without a GPU: 40 GiB reserved by torch's cache, 1 GiB
    of it in tensors, 2 GiB free on the device; `released` counts empty_cache calls."""
    state = {"reserved": 40 << 30, "released": 0}

    def empty_cache():
        state["released"] += 1
        state["reserved"] = 1 << 30

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    return state


def test_device_allocation_failure_hands_torch_cache_back_and_retries(fake_cuda_memory, caplog):
    """An allocation failure on CUDA while torch's cache holds memory no tensor uses: that memory goes
    back to the driver and the session starts (or the run runs) once more; where nothing is cached
    (or the retry fails too) the error is the "out of memory." one that batch-size searches retry on,
    saying what the device has free; other errors and CPU devices pass through untouched."""
    from accelerate.utils.memory import should_reduce_batch_size

    from ortmodule import runtime

    cuda, calls = torch.device("cuda", 0), []

    def start_once_released():
        calls.append(fake_cuda_memory["released"])
        if not fake_cuda_memory["released"]:
            raise RuntimeError(CUBLAS_AT_SESSION_START)
        return "session"

    with caplog.at_level("WARNING", logger="ortmodule.runtime"):
        assert runtime.retrying_on_torch_cache(cuda, start_once_released) == "session"
    assert calls == [0, 1]  # failed, the cache was handed back, started
    assert "ran out of memory on cuda:0 while torch's cache held 39.0 GiB" in caplog.text  # the cost is told

    def never():  # the cache is empty now: no second try
        calls.append("never")
        raise RuntimeError(CUBLAS_AT_SESSION_START)

    calls.clear()
    with pytest.raises(RuntimeError, match=r"out of memory\. cuda:0 has 2\.0 GiB free of 80\.0 GiB; torch's "
                                           r"tensors hold 1\.0 GiB\. .*CUBLAS failure 3") as caught:
        runtime.retrying_on_torch_cache(cuda, never)
    assert calls == ["never"] and should_reduce_batch_size(caught.value)

    fake_cuda_memory["reserved"] = 40 << 30  # cached again, and the retry fails as well: one retry only
    calls.clear()
    with pytest.raises(RuntimeError, match=r"out of memory\. cuda:0 has") as caught:
        runtime.retrying_on_torch_cache(cuda, never)
    assert calls == ["never", "never"] and fake_cuda_memory["released"] == 2

    def broken():
        calls.append("broken")
        raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : a graph error")

    calls.clear()
    with pytest.raises(RuntimeError, match="INVALID_GRAPH") as caught:
        runtime.retrying_on_torch_cache(cuda, broken)
    assert calls == ["broken"] and "out of memory" not in str(caught.value)

    calls.clear()  # on the CPU: no cache to hand back, the failure named as out of memory
    with pytest.raises(RuntimeError, match=r"ONNX Runtime ran out of memory\. \(") as caught:
        runtime.retrying_on_torch_cache(torch.device("cpu"), never)
    assert calls == ["never"] and should_reduce_batch_size(caught.value)
