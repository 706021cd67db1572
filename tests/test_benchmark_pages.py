"""The benchmark pages are generated: each equals what benchmarks/report.py renders from the JSON
of its run kept in benchmarks/results/ (a hand edit, or a JSON not committed, fails here)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import transformers

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"
spec = importlib.util.spec_from_file_location("benchmark_report", REPORT)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def load_benchmark_module(name: str):
    """A module of benchmarks/ by path (its folder is not a package)."""
    found = importlib.util.spec_from_file_location(f"benchmark_{name}", REPORT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


@pytest.mark.parametrize("size", sorted(report.PAGES))
def test_page_regenerates_unchanged_from_its_json(size):
    page, _ = report.PAGES[size]
    assert report.page_sources(size), f"no JSON in {report.RESULTS} for {page.name}"
    assert page.read_text() == report.render_page(size), f"{page.name} differs from its JSON's rendering"


def test_speed_ratio_compares_only_the_same_workload():
    """A transformers row of no case stands for every case of its group (score's reuse on and off); one
    of a named case only for that case (host time's `mmlu` requests, not its `decode` beside them)."""
    def bench(name, group, backend, case, seconds):
        return {"name": name, "group": group, "stats": {"median": seconds},
                "extra_info": {"backend": backend, "case": case, "model": "m"}}

    run = {"machine_info": {"python_version": "3.11"}, "commit_info": {}, "datetime": "2026-11-24T00:00:00",
           "benchmarks": [bench("a", "score", "ortmodule", "", 1.0), bench("b", "score", "hf", "", 4.0),
                          bench("d", "score", "ortmodule", "reuse", 2.0),
                          bench("e", "host time", "ortmodule", "mmlu", 1.0), bench("f", "host time", "hf", "mmlu", 8.0),
                          bench("g", "host time", "ortmodule", "decode", 0.5)]}
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[4].strip()
            for line in report.render([run], "cpu").splitlines() if line.startswith("| ortmodule")}
    assert rows == {("ortmodule", ""): "4.00x", ("ortmodule", "reuse"): "2.00x", ("ortmodule", "mmlu"): "8.00x",
                    ("ortmodule", "decode"): ""}


def test_a_workload_run_again_replaces_its_rows_and_speeds_compare_within_a_run():
    """Two runs of one machine: a row the later run measured again shows once, the later one; a
    speed is taken against the transformers row of its own run, or, where its run has none, against
    another run's and marked so (two runs' times compare less well than one's)."""
    def run(when, rows):
        return {"machine_info": {"python_version": "3.11"}, "commit_info": {}, "datetime": when,
                "benchmarks": [{"name": f"{backend}-{when}", "group": "generate", "stats": {"median": seconds},
                                "extra_info": {"backend": backend, "case": "b1", "model": "m"}}
                               for backend, seconds in rows]}

    first = run("2026-11-24T00:00:00", [("ortmodule", 2.0), ("hf", 6.0), ("ortmodule-graphs", 1.0)])
    again = run("2026-11-25T00:00:00", [("ortmodule", 1.0), ("hf", 3.0)])
    page = report.render([first, again], "cpu").splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:5]] for line in page
            if line.startswith("| ortmodule") or line.startswith("| transformers")]
    assert sorted(rows) == [["ortmodule", "b1", "1000.0", "3.00x"],
                            ["ortmodule-graphs", "b1", "1000.0", "3.00x (another run)"],
                            ["transformers", "b1", "3000.0", "1.00x"]]


@pytest.mark.slow
def test_cpus_of_one_name_are_told_apart():
    """Two CPUs a VM names alike (clock, cache or AMX differ) get a part each; two runs on one get one, also
    where the advertised clock differs in its last digits."""
    def run(when, hz, l3, flags):
        cpu = {"brand_raw": "Intel(R) Xeon(R) Processor", "count": 2, "hz_advertised_friendly": hz,
               "l3_cache_size": l3, "flags": flags}
        return {"machine_info": {"python_version": "3.11", "cpu": cpu}, "commit_info": {}, "datetime": when,
                "benchmarks": [{"name": "a", "group": "forward", "stats": {"median": 1.0},
                                "extra_info": {"backend": "ortmodule", "case": "all", "model": "m"}}]}

    older = run("2026-11-26T00:00:00", "2.3000 GHz", 260 << 20, ["avx512f"])
    newer = run("2026-11-27T00:00:00", "2.6000 GHz", 480 << 20, ["avx512f", "amx_tile"])
    again = run("2026-11-27T01:00:00", "2.5998 GHz", 480 << 20, ["avx512f", "amx_tile"])
    assert report.machine_key(newer) == "Intel(R) Xeon(R) Processor (2.60 GHz, 480 MiB L3, AMX)"
    page = report.render([older, newer, again], "cpu")
    parts = [line for line in page.splitlines() if line.startswith("## On ")]
    assert parts == ["## On Intel(R) Xeon(R) Processor (2.60 GHz, 480 MiB L3, AMX)",
                     "## On Intel(R) Xeon(R) Processor (2.30 GHz, 260 MiB L3)"]


def test_a_stopped_suite_keeps_the_rows_that_finished(tmp_path):
    """SIGTERM to the suite's process group (what `timeout` sends) after a row finished: the JSON
    still holds every finished row, each with its timings (the running one is dropped)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run.json"
    process = subprocess.Popen(
        [sys.executable, str(REPORT.parent / "run.py"), "--size", "smoke", "--json", str(out), "-k", "forward"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = process.stdout.readline()  # run.py's pytest command
    while not seen.endswith("."):  # then pytest -q's progress: a dot per test passed
        char = process.stdout.read(1)
        assert char, f"the suite ended before a row finished:\n{seen}"
        seen += char
    os.killpg(process.pid, signal.SIGTERM)
    rest, _ = process.communicate(timeout=120)
    assert "interrupted: the rows that finished are kept" in rest, seen + rest
    rows = json.loads(out.read_text())["benchmarks"]
    assert rows and all(row["stats"]["median"] > 0 for row in rows), seen + rest


def test_a_suite_stopped_before_its_first_row_says_so(tmp_path):
    """A run that ends before any row finished (a deadline during the first row's setup, or a `-k` that
    selects nothing) leaves pytest-benchmark's empty JSON: run.py says that no row finished, writes no
    page and leaves no empty file behind, instead of failing inside the JSON parser."""
    import subprocess
    import sys

    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, str(REPORT.parent / "run.py"), "--size", "cpu", "--json", str(out), "--out",
         str(tmp_path / "page.md"), "-k", "no_workload_has_this_name"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "no row finished, so no page written" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not out.exists() and not (tmp_path / "page.md").exists()


@pytest.mark.slow
def test_graph_options_script_times_each_variant(tmp_path):
    """benchmarks/graph_options.py on the smoke model: a row per builder option, the graph change it
    made named, each variant timed and as close to transformers fp32 as an fp32 package is; the
    option that leaves a CPU export's graph unchanged (the query/key norm fusion) is not timed; the
    default export loaded with `prefill_attention=onnx` runs a prefill graph without GroupQueryAttention,
    as exact."""
    import json
    import subprocess
    import sys

    out = tmp_path / "options.json"
    command = [sys.executable, str(REPORT.parent / "graph_options.py"), "--size", "smoke", "--spec", "tiny",
               "--device", "cpu", "--batch", "2", "--length", "16", "--rounds", "1", "--repeats", "1",
               "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["option"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["default", "fuse_mlp_gate_up=true", "fuse_qkv=false", "fuse_qk_norm_gqa=false",
                          "prefill_attention=onnx"]
    assert "Split 0 -> " in rows["fuse_mlp_gate_up=true"]["graph"]
    assert "MatMul" in rows["fuse_qkv=false"]["graph"]
    assert "not timed" in rows["fuse_qk_norm_gqa=false"]["graph"] and "ms" not in rows["fuse_qk_norm_gqa=false"]
    assert "prefill graph: " in rows["prefill_attention=onnx"]["graph"]
    assert "GroupQueryAttention 2 -> 0" in rows["prefill_attention=onnx"]["graph"]
    for option in ["default", "fuse_mlp_gate_up=true", "fuse_qkv=false", "prefill_attention=onnx"]:
        assert rows[option]["ms"] > 0 and rows[option]["max_diff_vs_fp32"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--rolling"], ["--shared"], ["--lm-eval", "fewshot", "--questions", "3"],
                                  ["--lm-eval", "mmlu", "--questions", "3", "--clock-only"],
                                  ["--rolling", "--prefill-attention", "onnx"], ["--rolling", "--compiled-normalizers"],
                                  ["--score", "3", "--query-tokens", "20", "--item-tokens", "12", "--items", "4"],
                                  ["--decode", "4"]])
def test_profile_script_runs_each_mode_on_a_cpu(mode):
    """benchmarks/profile_gpu.py, which GPU sessions run with little time to spare, runs each of its
    modes to the end on the smoke model on a CPU (transformers' side needs CUDA: `--only ortmodule`
    except for `--shared`, which profiles ortmodule's two paths and checks they agree, `--score`, and
    `--decode`, whose other side is onnxruntime-genai's Generator on the same package)."""
    import subprocess
    import sys

    command = [sys.executable, str(REPORT.parent / "profile_gpu.py"), "--size", "smoke", "--spec", "tiny",
               "--device", "cpu", "--batch", "8", "--length", "60", *mode]
    both = mode[:1] in (["--shared"], ["--score"], ["--decode"])
    done = subprocess.run(command + ([] if both else ["--only", "ortmodule"]),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    if mode[:1] == ["--score"]:  # both ways agree (fp32), and the shared path's steps are timed
        assert "largest difference between the two ways' log-probabilities: 0.0000" in done.stdout, done.stdout
        assert "== query once (reuse on): " in done.stdout and "for 12 items" in done.stdout, done.stdout
        assert "extend run" in done.stdout and "the measured costs run" in done.stdout, done.stdout
    elif mode[:1] == ["--decode"]:  # a step's time for both, ortmodule's split inside and outside the runs
        assert "== ortmodule: " in done.stdout and "== onnxruntime-genai: " in done.stdout, done.stdout
        assert "inside ONNX Runtime's runs" in done.stdout, done.stdout
    elif mode == ["--shared"]:
        assert "largest difference between the two paths' loglikelihoods: 0.0000" in done.stdout, done.stdout
        assert "extend run" in done.stdout
    elif "--clock-only" in mode:
        assert "mmlu, 3 questions (12 requests)" in done.stdout and "under the profiler" not in done.stdout
        assert "'padded_tokens': " in done.stdout and "'token_budget': " in done.stdout, done.stdout
    elif mode[:1] == ["--lm-eval"]:
        assert "fewshot, 3 questions (12 requests)" in done.stdout and "under the profiler" in done.stdout, done.stdout
    else:
        scored = "480 scored" if "--rolling" in mode else "32 scored"
        graph = "the prefill graph" if "--prefill-attention" in mode else "the package graph"
        assert f"runs without a cache in {graph}" in done.stdout, done.stdout
        assert "== ortmodule: " in done.stdout and scored in done.stdout, done.stdout


def test_the_at_scale_models_encode_mmlus_letters_as_one_token_each():
    """Every model the CPU and GPU suites run lm-eval at scale on encodes " A" to " D" after a prompt
    as one token each, as real tokenizers do, so that an MMLU question is one row, as it is for real
    models (the fixtures' own 512-token tokenizer makes two tokens of " B", " C" and " D": the GPU
    suite's Qwen3 rows did twice real MMLU's work until they took SmolLM2's tokenizer)."""
    import os
    from unittest import mock

    from ortmodule_dev import fixtures

    suite = importlib.util.spec_from_file_location("benchmark_conftest", REPORT.parent / "conftest.py")
    sizes = importlib.util.module_from_spec(suite)
    with mock.patch.dict(os.environ):  # the suite's environment defaults stay out of the other tests
        suite.loader.exec_module(sizes)
    specs = {key: spec for size in ("cpu", "gpu") for key, spec in sizes.SIZES[size]["decoders"].items()}
    assert {"smollm2-fp32", "qwen3-0.6b-bf16"} <= set(specs)
    for key, spec in specs.items():
        tokenizer = fixtures.spec_tokenizer(spec)
        prompt = tokenizer("Which is it?\nAnswer:")["input_ids"]
        for letter in " A", " B", " C", " D":
            assert len(tokenizer("Which is it?\nAnswer:" + letter)["input_ids"]) == len(prompt) + 1, (key, letter)
    toy = fixtures.spec_tokenizer(fixtures.FixtureSpec("qwen3", vocab_size=151936))  # the test can fail
    assert len(toy("Answer: B")["input_ids"]) == len(toy("Answer:")["input_ids"]) + 2


def test_the_fp32_reference_is_kept_for_the_same_weights_and_requests_only(tmp_path, monkeypatch, llama):
    """benchmarks/references.py: transformers' fp32 answers to an at-scale workload, stored with the
    digests of the weights and the requests, come back only for the same checkpoint and the same
    requests (equal to what transformers computes again); another limit or another checkpoint computes
    them anew."""
    import lm_eval
    from lm_eval.api.registry import get_model

    from ortmodule.tasks import task_manager

    references = load_benchmark_module("references")
    monkeypatch.setenv("ORTMODULE_BENCH_REFERENCES", str(tmp_path / "store"))
    task, runs = "ortmodule_bench_mmlu", []
    tasks = task_manager([task], REPORT.parent / "tasks", metadata={"tokenizer": str(llama.hf_dir)})

    def evaluate(checkpoint, limit):
        model = get_model("hf")(pretrained=str(checkpoint), dtype="float32", device="cpu", batch_size=4)
        result = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=tasks, limit=limit, verbosity="ERROR")
        return result, [tuple(r[0]) for sample in result["samples"][task] for r in sample["resps"]]

    def reference(checkpoint, result):
        def compute():
            runs.append(checkpoint)
            return evaluate(checkpoint, len(result["samples"][task]))[1], {"device": "cpu"}
        return references.reference_answers("tiny-mmlu", checkpoint, result, task, compute)

    result, mine = evaluate(llama.hf_dir, 2)
    first, made = reference(llama.hf_dir, result)
    assert made.endswith("(this run)") and len(runs) == 1 and len(first) == 8
    kept, made = reference(llama.hf_dir, result)
    assert made.endswith("(kept)") and len(runs) == 1
    assert kept == first == mine  # transformers' fp32 answers to the same requests, computed twice
    longer, _ = evaluate(llama.hf_dir, 3)
    assert reference(llama.hf_dir, longer)[1].endswith("(this run)") and len(runs) == 2
    other = tmp_path / "other"
    shutil.copytree(llama.hf_dir, other)
    assert references.weights_digest(other) == references.weights_digest(llama.hf_dir)
    config = other / "config.json"  # saved by another transformers (the GPU machine's): the same weights
    stamped = config.read_text().replace(f'"transformers_version": "{transformers.__version__}"',
                                         '"transformers_version": "4.0.0"')
    assert stamped != config.read_text()
    config.write_text(stamped)
    assert references.weights_digest(other) == references.weights_digest(llama.hf_dir)
    config.write_text(stamped.replace('"vocab_size"', '"vocab_size_"'))  # anything else in it counts
    assert references.weights_digest(other) != references.weights_digest(llama.hf_dir)
    config.write_text(stamped)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert references.weights_digest(other) != references.weights_digest(llama.hf_dir)
    assert reference(other, longer)[1].endswith("(this run)") and len(runs) == 3


def test_the_gpu_runs_selections_collect():
    """benchmarks/next_gpu_run.sh and targets_gpu_run.sh (the plans a rare GPU session runs without
    editing): each script parses, every benchmark selection of them (their variables filled in)
    collects at the GPU size, every profile's arguments are profile_gpu.py's, the package steps'
    imports resolve, and each name of a CUDA test selection matches a test, so that no step is found
    empty or refused on the device. Both plans are checked in the same processes (each spends most of
    its time importing)."""
    import os
    import re
    import subprocess
    import sys

    root = REPORT.parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    suites, profiles, imports, cuda_selections = [], [], set(), []
    for name in ("next_gpu_run.sh", "targets_gpu_run.sh"):
        script = REPORT.parent / name
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, name
        text = script.read_text()
        for variable, value in re.findall(r'^(\w+)="([^"]*)"$', text, re.M):
            text = text.replace(f"${variable}", value)
        selections = re.findall(r'^\s*suite \S+ \d+ "([^"]+)"', text, re.M)
        assert selections or name == "next_gpu_run.sh", f"{name} runs no part of the benchmark suite"
        suites += [(name, selection) for selection in selections]
        profiles += re.findall(r'python3 profile_gpu\.py ([^"]+)"', text)
        built = re.search(r"^\s*step package \d+ bash -c \"cd benchmarks && python3 -c '([^']+)'", text, re.M)
        imports.add(built.group(1).split("; print")[0])
        cuda_selections += re.findall(r'tests/test_cuda\.py -k \\\n\s+"([^"]+)"', text)
        if name == "next_gpu_run.sh":  # the plan of decisions profiles and runs CUDA tests; the targets run neither
            assert re.search(r'python3 profile_gpu\.py ', text) and "tests/test_cuda.py" in text
    # One process collects every selection in turn (a process each spent most of a minute importing).
    collect = ("import sys, pytest\n"
               "for selection in sys.argv[1:]:\n"
               "    print('=== selection', flush=True)\n"
               "    pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'benchmarks', '--bench-size', 'gpu',"
               " '-k', selection])\n")
    listed = subprocess.run([sys.executable, "-c", collect, *(s for _, s in suites)], cwd=root, capture_output=True,
                            text=True).stdout
    parts = listed.split("=== selection\n")[1:]
    assert len(parts) == len(suites), listed[-1000:]
    for (name, selection), part in zip(suites, parts):
        assert re.search(r"^\d+/\d+ tests collected", part, re.M), f"{name}, {selection}: {part[-300:]}"
    check = "import shlex, sys, profile_gpu; [profile_gpu.arguments(shlex.split(line)) for line in sys.argv[1:]]"
    parsed = subprocess.run([sys.executable, "-c", check, *profiles], cwd=root / "benchmarks", capture_output=True,
                            text=True, env=env)
    assert parsed.returncode == 0, parsed.stderr[-1000:]
    for code in imports:
        done = subprocess.run([sys.executable, "-c", code], cwd=root / "benchmarks", capture_output=True, text=True,
                              env=env)
        assert done.returncode == 0, done.stderr[-1000:]
    if cuda_selections:
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 "tests/test_cuda.py"], cwd=root, capture_output=True, text=True).stdout
        tests = [line for line in listed.splitlines() if "::" in line]
    for selection in cuda_selections:
        for test in selection.split(" or "):
            assert any(test in line for line in tests), f"no CUDA test matches {test!r}"


# A GPU session's device time (the device tool's limits: 15 minutes, the machine's start and every idle
# wait counted), what the machine's start and the staging calls took (session 36: about 60 s), and
# the most one device call may run.
SESSION_DEVICE_SECONDS, START_AND_STAGING_SECONDS, CALL_SECONDS = 900, 90, 600


@pytest.mark.parametrize("name", ["next_gpu_run.sh", "targets_gpu_run.sh"])
def test_the_gpu_runs_fit_one_sessions_device_time(name):
    """Each plan runs whole in one GPU session: its parts' budgets, each within one call's limit (with
    room for the call's own start), after the machine's start and the staging, within the session's
    device time (session 41's targets run asked for two calls of 570 s: 21 minutes of a 15-minute
    session)."""
    import re

    text = (REPORT.parent / name).read_text()
    parts = re.search(r"^PART_BUDGETS=\(([\d ]+)\)", text, re.M)
    assert parts or "PART=" not in text, "a plan in parts names each part's budget (PART_BUDGETS)"
    budgets = [int(b) for b in parts.group(1).split()] if parts else [
        int(re.search(r"^BUDGET=\$\{BUDGET:-(\d+)\}", (REPORT.parent / "gpu_run_lib.sh").read_text(), re.M).group(1))]
    assert all(budget <= CALL_SECONDS - 20 for budget in budgets), budgets
    assert START_AND_STAGING_SECONDS + sum(budgets) + 10 * len(budgets) <= SESSION_DEVICE_SECONDS, budgets


def test_a_gpu_run_stops_at_its_preflight_where_a_piece_is_missing(tmp_path):
    """benchmarks/next_gpu_run.sh first checks what every step needs (ortmodule's import, the staged
    packages, a CUDA device) and, where something is missing, stops in seconds with it named, no step
    run, its logs still packed into $OUT/run.tgz (session 90's H200 spent its run failing every step in
    turn on one missing wheel). Here, without a GPU or SmolLM2's installed package, it stops so."""
    import os
    import subprocess
    import sys
    import tarfile

    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(REPORT.parent / "next_gpu_run.sh")], capture_output=True, text=True, env=env,
                         cwd=REPORT.parents[1], timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("preflight failed, no step run:"), run.stdout
    assert "not importable here: " in run.stdout or "torch sees no CUDA device" in run.stdout, run.stdout
    plan = (tmp_path / "work" / "plan.log").read_text()
    assert "up to" not in plan and "preflight failed" in plan
    with tarfile.open(tmp_path / "out" / "run.tgz") as packed:
        assert {"./plan.log", "./preflight.log"} <= set(packed.getnames())


def test_the_targets_run_refuses_a_part_it_does_not_have(tmp_path):
    """benchmarks/targets_gpu_run.sh runs part 1 or 2; anything else is an error before any step."""
    import subprocess

    run = subprocess.run(["bash", str(REPORT.parent / "targets_gpu_run.sh"), "3"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)},
                         cwd=REPORT.parents[1])
    assert run.returncode == 2 and "there are parts 1 and 2" in run.stderr


def test_serve_with_extend_serves_the_extend_graph_it_names(build):
    """benchmarks/serve_with_extend.py (the suite's `--server-extend`): the server it starts runs each
    query once in the cache layout with grouped heads, and scores as ortmodule does in-process."""
    import httpx
    import torch

    import ortmodule

    bench_score = load_benchmark_module("bench_score")
    fixture = build("llama")
    body = dict(query=[5, 6, 9, 11, 12, 13], items=[[7, 3], [8], [40, 41, 42]], label_token_ids=[1, 2, 30],
                apply_softmax=False)
    model = ortmodule.OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    expected = torch.tensor(ortmodule.score(model, None, body["query"], body["items"], body["label_token_ids"],
                                            reuse_prefix=False))
    launcher = [sys.executable, str(REPORT.parent / "serve_with_extend.py"), "cache", "grouped"]
    with bench_score.LocalServer(fixture.package_dir, "cpu", ["--reuse-prefix", "on"], launcher) as server:
        scores = torch.tensor(httpx.post(server.url + "/v1/score", json=body, timeout=60).json()["scores"])
        assert server.metrics()["reused_prefixes"] == 1
        server.log.seek(0)
        log = server.log.read()
    assert ((scores - expected).abs() / expected).max().item() < 1e-4
    assert "shared prefixes continue in the extend graph on cpu (cache layout, KV heads grouped)" in log, log[-2000:]


def test_every_at_scale_workload_runs_hf_and_ortmodule_as_it_loads():
    """benchmarks/test_scale.py's rows: `hf` and `ortmodule` (the backend as users load it) run every workload
    on both devices, and each variant runs somewhere (a skip rule that caught the plain `ortmodule` row left the
    CPU page's rows from earlier runs for a session unnoticed); lm-eval's own stopping only on generation."""
    evaluation = load_benchmark_module("evaluation")
    workloads = ["mmlu", "fewshot", "hellaswag", "arc", "rolling", "gsm8k"]
    machines = [("cpu", "fp32"), ("cpu", "int4"), ("cuda", "bf16")]
    for workload in workloads:
        for device, precision in machines:
            for backend in ("hf", "ortmodule"):
                assert evaluation.at_scale_skip(workload, backend, device, precision) is None, (workload, device)
            runs = evaluation.at_scale_skip(workload, "ortmodule-lm-eval-stops", device, precision) is None
            assert runs == (workload == "gsm8k")
    scale = (REPORT.parent / "test_scale.py").read_text()
    backends = scale[scale.index("SCALE_BACKENDS = ["):].split("]", 1)[0]
    for backend in [b.strip(' "\n') for b in backends.split("[", 1)[1].split(",")]:
        assert any(evaluation.at_scale_skip(w, backend, d, p) is None for w in workloads for d, p in machines), backend
