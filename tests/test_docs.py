"""The Python examples of the README and docs/ run as written, on the real SmolLM2-135M-Instruct package
(the demo's model): each ```python block is run here, its placeholders ("path/to/genai_package", the
checkpoint's path, the server's address) replaced by real ones and the names a fragment takes from the
text before it (`model`, `batch`, `input_ids`, ...) given, or it is listed with the reason it is not run
(a Hub download, a GPU). A new example fails `test_every_example_is_run_or_named_not_run` until it is
one or the other. What an example states in its comments (shapes, the scores it prints) is checked
against what it computed."""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import LiveServer

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE, CHECKPOINT = '"path/to/genai_package"', '"path/to/checkpoint"'

# (page, a piece of text that picks the block out) -> why it is not run here.
NOT_RUN = {
    ("docs/lm-eval.md", 'tasks=["hellaswag"]'): "hellaswag's data comes from the Hub (tests/test_lm_eval.py runs "
                                                "OrtModuleLM on a loaded model, and simple_evaluate by name)",
    ("docs/usage.md", "microsoft/Phi-3-mini-4k-instruct-onnx"): "a Hub download (tests/test_hub.py: a local Hub "
                                                                "cache)",
    ("docs/usage.md", "Qwen/Qwen2.5-VL-3B-Instruct"): "the checkpoint's processor is a Hub download "
                                                      "(tests/test_images.py: the fixtures' processors)",
    ("docs/usage.md", "google/gemma-4-E2B-it"): "a Hub download (tests/test_images_gemma4.py)",
    ("docs/usage.md", "mistralai/Ministral-3-3B-Instruct-2512"): "a Hub download (tests/test_images_pixtral.py)",
    ("docs/usage.md", "google/gemma-3-4b-it"): "a Hub download (tests/test_images_gemma3.py)",
    ("docs/usage.md", "videos=[frames]"): "a video model's processor and package (tests/test_videos.py)",
}


def python_blocks() -> list[tuple[str, int, str]]:
    """Every ```python block of the pages: (page relative to the repository, its first line, its code)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            found.append((str(page.relative_to(ROOT)), text[:match.start()].count("\n") + 2, match.group(1)))
    return found


def block(page: str, marker: str) -> str:
    """The one block of `page` holding `marker`."""
    codes = [code for where, _, code in python_blocks() if where == page and marker in code]
    assert len(codes) == 1, f"{page}: {len(codes)} python blocks hold {marker!r}"
    return codes[0]


def run(code: str, namespace: dict, name: str, **replace: str) -> dict:
    for old, new in replace.items():
        assert old in code, f"{name}: the example no longer holds {old!r}"
        code = code.replace(old, new)
    exec(compile(code, name, "exec"), namespace)  # noqa: S102  the repository's own documentation
    return namespace


def run_alone(code: str, check: str, **replace: str) -> str:
    """`code` with `replace` done, then `check`, in a fresh Python: an example whose imports register
    something (lm-eval's model, Olive's evaluator) is run where no other test has imported it first."""
    for old, new in replace.items():
        assert old in code, f"the example no longer holds {old!r}"
        code = code.replace(old, new)
    done = subprocess.run([sys.executable, "-c", code + "\n" + check], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def smollm2():
    from ortmodule import OrtModelForCausalLM, load_tokenizer
    from ortmodule_dev import fixtures

    fixture = fixtures.build(fixtures.SMOLLM2)
    return fixture, OrtModelForCausalLM.from_pretrained(fixture.package_dir), load_tokenizer(fixture.package_dir)


@pytest.fixture
def fragment(smollm2):
    """The names the usage guide's fragments take from its text: a model and tokenizer, a left-padded `batch`
    (as generate wants it), `input_ids` / `mask` of two rows of at least 8 tokens padded on `side`, and what
    the inspecting section steers with."""
    fixture, model, tokenizer = smollm2

    def names(side: str) -> dict:
        texts = ["The capital of France is Paris, and the capital of Italy is",
                 "Water boils at one hundred degrees Celsius at sea level."]
        plain = tokenizer(texts, return_tensors="pt", padding=True, padding_side=side)
        assert plain.attention_mask.sum(1).min() >= 8
        mask = plain.attention_mask
        return {"torch": torch, "ortmodule": __import__("ortmodule"), "model": model, "tokenizer": tokenizer,
                "path": str(fixture.package_dir), "input_ids": plain.input_ids, "mask": mask, "attention_mask": mask,
                "batch": tokenizer(texts, return_tensors="pt", padding=True, padding_side="left"), "k": 3,
                "rows": torch.tensor([0, 1, 1]), "cols": torch.tensor([2, 5, 7]),
                "direction": torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)),
                "next_ids": torch.tensor([[11], [12]]),
                "longer_mask": torch.cat([mask, torch.ones_like(mask[:, :1])], 1)}
    return names


def test_every_example_is_run_or_named_not_run():
    """Each python block is one that a test below runs (`RUN`) or one `NOT_RUN` names, and each entry of
    those still picks one block out."""
    entries = [*RUN, *NOT_RUN]
    for page, first_line, code in python_blocks():
        picked = [entry for entry in entries if entry[0] == page and entry[1] in code]
        assert len(picked) == 1, f"{page}:{first_line}: picked by {picked} (add it to RUN or NOT_RUN)"
    for page, marker in entries:
        block(page, marker)


def test_readme_example(smollm2):
    """The README's example; its logits are transformers' on the checkpoint the package was exported from."""
    from transformers import AutoModelForCausalLM

    fixture, _, _ = smollm2
    ns = run(block("README.md", "ortmodule.score("), {}, "README.md", **{PACKAGE: repr(str(fixture.package_dir))})
    logits, tail, batch = ns["logits"], ns["tail"], ns["batch"]
    assert logits.shape == (*batch.input_ids.shape, ns["model"].config.vocab_size)  # [B, T, V]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)(**batch).logits
    real = batch.attention_mask.bool()
    torch.testing.assert_close(logits[real], reference[real], atol=1e-4, rtol=1e-4)
    assert tail.shape == (len(batch.input_ids), 3, logits.shape[-1])  # [B, 3, V]
    torch.testing.assert_close(tail, logits[:, -3:], atol=1e-4, rtol=1e-4)
    assert len(ns["scores"]) == 2 and all(abs(sum(item) - 1) < 1e-5 for item in ns["scores"])


def test_scoring_example_prints_what_it_says(smollm2):
    """The scoring guide's example, and the scores its comment says SmolLM2-135M-Instruct gives."""
    fixture, _, _ = smollm2
    code = block("docs/scoring.md", "ortmodule.score(")
    stated = ast.literal_eval(re.search(r"the demo's package: (\[\[.*\]\])\)", code).group(1))
    ns = run(code, {}, "docs/scoring.md", **{PACKAGE: repr(str(fixture.package_dir))})
    torch.testing.assert_close(torch.tensor(ns["scores"]), torch.tensor(stated), atol=2e-3, rtol=0)


def test_loading_example(smollm2):
    fixture, _, _ = smollm2
    device = '"cuda:0"' if torch.cuda.is_available() else '"cpu"'
    ns = run(block("docs/usage.md", "session_options=None,"), {}, "docs/usage.md",
             **{PACKAGE: repr(str(fixture.package_dir)), '"cuda:0"': device})
    assert ns["model"].device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    options = run(block("docs/usage.md", "enable_cpu_mem_arena = False"), {"path": str(fixture.package_dir),
                  "onnxruntime": __import__("onnxruntime"), "ortmodule": __import__("ortmodule")}, "docs/usage.md")
    assert options["model"](torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 49152)


def test_auto_classes_example(smollm2):
    fixture, _, _ = smollm2
    from ortmodule import OrtModelForCausalLM

    ns = run(block("docs/usage.md", "ortmodule.auto_classes()"), {}, "docs/usage.md",
             **{PACKAGE: repr(str(fixture.package_dir)), CHECKPOINT: repr(str(fixture.hf_dir))})
    assert isinstance(ns["model"], OrtModelForCausalLM) and not isinstance(ns["reference"], OrtModelForCausalLM)
    assert isinstance(ns["generator"].model, OrtModelForCausalLM)


@pytest.mark.parametrize("marker", ["cont_len=k)", "max_new_tokens=32)", "past_key_values=cache, use_cache=True",
                                    "ortmodule.loglikelihood(", "output_hidden_states=True",
                                    "model.model(input_ids"])
def test_usage_fragments(fragment, marker):
    """The usage guide's fragments; the one that generates from its rows' embeddings on left-padded rows (as
    generate wants them), the others on right-padded ones (the scoring section's `starts` count from a row's
    first token)."""
    names = fragment("left" if marker == "output_hidden_states=True" else "right")
    ns = run(block("docs/usage.md", marker), names, f"docs/usage.md ({marker})")
    model, vocab = ns["model"], ns["model"].config.vocab_size
    if marker == "cont_len=k)":
        assert torch.isfinite(ns["out"].loss)
    elif marker == "max_new_tokens=32)":
        assert ns["tokens"].shape[0] == 2
    elif marker.startswith("past_key_values"):
        assert ns["out"].logits.shape == (2, 1, vocab)  # logits [B, 1, V]
    elif marker == "ortmodule.loglikelihood(":
        assert len(ns["results"]) == 2 and ns["logits"].shape == (3, vocab)  # [n, V]
    elif marker == "output_hidden_states=True":
        assert len(ns["out"].attentions) == model.config.num_hidden_layers
        assert ns["new_tokens"].shape == (2, 20)  # generate from embeddings returns the new tokens only
    else:
        assert ns["last"].shape == (*names["input_ids"].shape, model.config.hidden_size)


def test_lm_eval_shipped_tasks_example(llama):
    """On the tiny Llama fixture (the tasks' 20 questions to generate for take SmolLM2 15 s on 2 vCPUs), in a
    process of its own: `model="ortmodule"` is known to lm-eval only once `ortmodule.lm_eval` is imported."""
    out = run_alone(block("docs/lm-eval.md", "tasks.task_manager(names)"),
                    "print(sorted(results['results']) == sorted(names))",
                    **{PACKAGE.replace('"', ""): str(llama.package_dir)})
    assert out.splitlines()[-1] == "True"


def test_serving_example(smollm2, capsys):
    """The OpenAI client's example against `ortmodule serve`'s app on the package, named as the example names it."""
    _, model, tokenizer = smollm2
    from ortmodule.serving import create_app

    live = LiveServer(create_app(model, tokenizer, name="smollm2", window_ms=5))
    try:
        run(block("docs/serving.md", "from openai import OpenAI"), {}, "docs/serving.md",
            **{"http://127.0.0.1:30000/v1": f"{live.url}/v1"})
    finally:
        live.stop()
    out = capsys.readouterr().out
    assert out.strip() and "2 576" in out  # the streamed reply; the embeddings' count and size, as the comment says


def test_fixtures_and_olive_examples():
    ns = run(block("docs/fixtures.md", "fixtures.build("), {}, "docs/fixtures.md")
    assert (ns["fixture"].package_dir / "genai_config.json").is_file()
    assert (ns["fixture"].hf_dir / "config.json").is_file()
    run(block("docs/olive.md", "import ortmodule.olive"), {}, "docs/olive.md")  # its registration: test_olive.py
    from olive.evaluator.olive_evaluator import OliveEvaluatorConfig

    evaluator = OliveEvaluatorConfig(type="OrtModuleEvaluator", tasks=["t"]).create_evaluator()
    assert type(evaluator).__name__ == "OrtModuleEvaluator"


def shell_blocks(page: str) -> list[str]:
    """The ```bash blocks of `page`, each with its continued lines joined."""
    text = (ROOT / page).read_text()
    return [m.group(1).replace("\\\n", " ") for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M)]


def command_lines() -> list[tuple[str, list[str]]]:
    """The ortmodule, ortmodule-eval and lm_eval command lines of the pages' shell blocks, split as a shell
    would (a `$(...)` stands for a folder): (page, argv)."""
    found = []
    for page in PAGES:
        where = str(page.relative_to(ROOT))
        for code in shell_blocks(where):
            for line in code.splitlines():
                line = re.sub(r"\$\((?:[^()]|\([^()]*\))*\)", "SOME_FOLDER", line.split(" # ")[0].rstrip(" &"))
                if line.split(" ")[0] in ("ortmodule", "ortmodule-eval", "lm_eval"):
                    found.append((where, shlex.split(line)))
    return found


class Parsed(Exception):
    pass


def parsed(argv: list[str], monkeypatch) -> argparse.Namespace:
    """`argv` through its command's own argument parser (ortmodule's, or lm-eval's for ortmodule-eval and
    lm_eval), not run: argparse's exit (status 2, an unknown flag or a bad value) fails the test."""
    from ortmodule import cli

    if argv[0] == "ortmodule":
        original = argparse.ArgumentParser.parse_args

        def stop(self, args=None, namespace=None):
            raise Parsed(original(self, args, namespace))

        with monkeypatch.context() as patch, pytest.raises(Parsed) as done:
            patch.setattr(argparse.ArgumentParser, "parse_args", stop)
            cli.ortmodule(argv[1:])
        return done.value.args[0]
    from lm_eval._cli import HarnessCLI

    monkeypatch.setattr(sys, "argv", list(argv))
    return HarnessCLI().parse_args()


def test_command_lines_parse(monkeypatch):
    """Every command line the pages show takes the flags it is shown with (`ortmodule run`'s program
    arguments are the program's own)."""
    lines = command_lines()
    assert {argv[0] for _, argv in lines} == {"ortmodule", "ortmodule-eval", "lm_eval"}
    for page, argv in lines:
        if argv[:2] == ["ortmodule", "run"]:
            continue
        args = parsed(argv, monkeypatch)
        assert getattr(args, "command", None) or getattr(args, "model", None), (page, argv)


def curl_requests(code: str) -> list[tuple[str, dict, str]]:
    """The curl requests of a shell block: (the path, the JSON body, the comment lines that follow it)."""
    found = []
    pattern = r"curl -sN? (?:http://)?(?:127\.0\.0\.1|localhost):30000(\S+) (?:-H '[^']*'\s*)*-d '([^']*)'"
    for match in re.finditer(pattern, code, re.S):
        rest = code[match.end():].splitlines()[1:]
        comment = "\n".join(line.lstrip("# ") for line in itertools.takewhile(lambda s: s.startswith("#"), rest))
        found.append((match.group(1), json.loads(match.group(2)), comment))
    return found


VOLATILE = {"id", "created", "e2e_latency", "system_fingerprint"}


def stated_values(comment: str) -> list[tuple[str, object]]:
    """The `"key": value` pairs of a documented answer whose value is whole JSON (not cut with "…")."""
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer(r'"(\w+)":\s*', comment):
        try:
            value, _ = decoder.raw_decode(comment, match.end())
        except ValueError:
            continue
        if match.group(1) not in VOLATILE and not (isinstance(value, str) and "…" in value):
            found.append((match.group(1), value))
    return found


def values_of(answer, key: str) -> list:
    """Every value of `key` anywhere in a JSON answer."""
    if isinstance(answer, dict):
        return [v for k, v in answer.items() if k == key] + [x for v in answer.values() for x in values_of(v, key)]
    if isinstance(answer, list):
        return [x for v in answer for x in values_of(v, key)]
    return []


def agrees(stated, actual) -> bool:
    """A documented value against the server's: floats within 1e-3 (another CPU's rounding), dicts on the
    keys stated, the rest equal."""
    if isinstance(stated, dict):
        return isinstance(actual, dict) and all(k in VOLATILE or (k in actual and agrees(v, actual[k]))
                                                for k, v in stated.items())
    if isinstance(stated, list):
        return isinstance(actual, list) and len(stated) == len(actual) and all(map(agrees, stated, actual))
    if isinstance(stated, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return abs(stated - actual) <= 1e-3 * max(1.0, abs(stated))
    return stated == actual


def check_curl_examples(live, code: str, skip_models=()) -> int:
    """Each curl request of `code` sent to `live`, its answer against the documented one: the status (a
    documented error's code, else 200) and every whole value the comment shows. Returns how many ran."""
    ran = 0
    for path, body, comment in curl_requests(code):
        if body.get("model") in skip_models:
            continue
        status = re.search(r'\(HTTP (\d{3})\)|"code":\s*(\d{3})', comment)
        response = live.client.post(path, json=body)
        assert response.status_code == (int(next(filter(None, status.groups()))) if status else 200), response.text
        if body.get("stream"):
            chunks = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert chunks[-1] == "[DONE]"
            answer = [json.loads(chunk) for chunk in chunks[:-1]]
        else:
            answer = response.json()
        for key, value in stated_values(comment):
            assert any(agrees(value, actual) for actual in values_of(answer, key)), \
                f"{path} {body}: the docs show {key}={value!r}, the server gave {values_of(answer, key)!r}"
        ran += 1
    return ran


def test_serving_curl_examples(smollm2):
    """The serving guide's curl requests on the demo's model served as `--name smollm2`, with the answers it
    shows (greedy text and ids, log-probabilities, the chat reply, the error of an unknown model); the
    image request needs a vision package (tests/test_images.py serves one)."""
    _, model, tokenizer = smollm2
    from ortmodule.serving import create_app

    live = LiveServer(create_app(model, tokenizer, name="smollm2", window_ms=5))
    try:
        ran = sum(check_curl_examples(live, code, skip_models={"qwen-vl"}) for code in shell_blocks("docs/serving.md"))
    finally:
        live.stop()
    assert ran == 11


def test_serving_batch_example(smollm2, tmp_path):
    """The serving guide's batch file run as `ortmodule run-batch ... --name smollm2` runs it, on the demo's model:
    every whole value its answers' lines show (the reply, the greedy text, the usage, the statuses)."""
    from ortmodule.serving import create_app
    from ortmodule.serving.batch_file import Output, parse_requests, run_requests

    _, model, tokenizer = smollm2
    text = (ROOT / "docs/serving.md").read_text()
    lines = re.search(r"^```jsonl\n(.*?)^```", text, re.S | re.M).group(1)
    code = next(code for code in shell_blocks("docs/serving.md") if "ortmodule run-batch" in code)
    shown = code[code.index("cat answers.jsonl"):].splitlines()[1:]
    comment = "\n".join(line.lstrip("# ") for line in shown if line.startswith("#"))
    output = Output(str(tmp_path / "answers.jsonl"))
    run_requests(create_app(model, tokenizer, name="smollm2", window_ms=5), parse_requests(lines), output, 4,
                 progress=False)
    output.finish()
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    stated = stated_values(comment)
    assert {key for key, _ in stated} >= {"custom_id", "status_code", "content", "text", "usage", "error"}
    for key, value in stated:
        assert any(agrees(value, actual) for actual in values_of(answers, key)), \
            f"the docs show {key}={value!r}, the batch gave {values_of(answers, key)!r}"


def test_scoring_curl_example(tmp_path):
    """The scoring guide's example end to end: the arithmetic model in examples/ exported by the command shown,
    served as `--name arithmetic`, its scores and its error as shown."""
    from ortmodule import OrtModelForCausalLM, cli, load_tokenizer
    from ortmodule.serving import create_app

    code = next(code for code in shell_blocks("docs/scoring.md") if "examples/arithmetic_model" in code)
    export = next(line for line in code.splitlines() if line.startswith("ortmodule export"))
    package = tmp_path / "arithmetic-package"
    cli.ortmodule([*shlex.split(export)[1:-1], str(package), "--quiet"])
    model = OrtModelForCausalLM.from_pretrained(package)
    live = LiveServer(create_app(model, load_tokenizer(package), name="arithmetic", window_ms=5))
    try:
        assert check_curl_examples(live, code) == 2
    finally:
        live.stop()


# The blocks the tests above run, by the marker that picks each out.
RUN = [("README.md", "ortmodule.score("), ("docs/scoring.md", "ortmodule.score("),
       ("docs/usage.md", "session_options=None,"), ("docs/usage.md", "enable_cpu_mem_arena = False"),
       ("docs/usage.md", "ortmodule.auto_classes()"),
       *[("docs/usage.md", marker) for marker in test_usage_fragments.pytestmark[0].args[1]],
       ("docs/lm-eval.md", "tasks.task_manager(names)"), ("docs/serving.md", "from openai import OpenAI"),
       ("docs/fixtures.md", "fixtures.build("), ("docs/olive.md", "import ortmodule.olive")]
