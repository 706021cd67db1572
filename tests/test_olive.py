"""ortmodule as the evaluator of an Olive workflow (olive-ai 0.13, the `olive` extra): a workflow
config builds a GenAI package from a tiny checkpoint with Olive's ModelBuilder pass and evaluates
it with OrtModuleEvaluator; the metrics equal `lm_eval --model ortmodule` on the same package,
and the input model's (lm-eval's hf backend, transformers) within float noise."""

import json
import math
from pathlib import Path

import lm_eval
import pytest
from helpers import cuda

olive = pytest.importorskip("olive", reason="the olive extra: pip install 'ortmodule[olive]'")

from olive.evaluator.metric import Metric  # noqa: E402
from olive.evaluator.olive_evaluator import OliveEvaluatorConfig  # noqa: E402
from olive.model import CompositeModelHandler, ONNXModelHandler  # noqa: E402
from olive.telemetry import telemetry as olive_telemetry  # noqa: E402
from olive.telemetry.library import telemetry_logger as olive_telemetry_logger  # noqa: E402
from olive.workflows import run as olive_run  # noqa: E402

import ortmodule.lm_eval  # noqa: E402, F401  (registers the lm-eval backend)
import ortmodule.olive  # noqa: E402, F401  (registers OrtModuleEvaluator, for the configs below without user_script)
from ortmodule import tasks  # noqa: E402

# Olive 0.13's telemetry, with OLIVE_DISABLE_TELEMETRY=1 (conftest.py), still (1) queues its
# device-id heartbeat before it reads the variable, and (2) makes its exporter OpenTelemetry's
# global logger provider, so that FastAPI's own telemetry (0.165) sends the servers of the other
# tests' validation failures and exceptions to Olive's collector: 16 send attempts counted in one
# run of the suite. Both are turned off here (docs/olive.md, "Olive's telemetry"); Olive's events
# still go to its own provider, disabled by the variable.
olive_telemetry.Telemetry._log_heartbeat = lambda self, metadata=None: None
olive_telemetry_logger.set_logger_provider = lambda provider: None

USER_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "olive" / "ortmodule_olive.py"
TASKS = ["ortmodule_knowledge_mc", "ortmodule_sentences_ppl", "ortmodule_knowledge_gen"]
LIMIT = 12


@pytest.fixture(scope="module")
def workflow(build, tmp_path_factory):
    """The workflow run once, as `olive run --config` runs it: the evaluator comes in by user_script."""
    fixture = build("llama")
    out = tmp_path_factory.mktemp("olive") / "output"
    config = {
        "input_model": {"type": "HfModel", "model_path": str(fixture.hf_dir)},
        "systems": {"local_system": {"type": "LocalSystem", "accelerators": [
            {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
        "passes": {"builder": {"type": "ModelBuilder", "precision": "fp32"}},
        "evaluators": {"ortmodule": {
            "type": "OrtModuleEvaluator", "user_script": str(USER_SCRIPT), "tasks": TASKS, "limit": LIMIT,
            "batch_size": 4,
            # A goal relative to the input model: Olive evaluates the input model too.
            "metrics": [{"name": "ortmodule_sentences_ppl", "type": "accuracy", "sub_types": [
                {"name": "perplexity", "priority": 1, "higher_is_better": False,
                 "goal": {"type": "max-degradation", "value": 1.0}}]}],
        }},
        "evaluator": "ortmodule", "host": "local_system", "target": "local_system",
        "output_dir": str(out), "cache_dir": str(out.parent / "cache"),
    }
    (out.parent / "workflow.json").write_text(json.dumps(config))
    olive_run(str(out.parent / "workflow.json"))
    read = lambda name: json.loads((out / name).read_text())  # noqa: E731
    return out, read("metrics.json"), read("input_model_metrics.json")


def test_workflow_metrics_equal_lm_eval_ortmodule_on_the_same_package(workflow):
    out, metrics, _ = workflow
    assert (out / "genai_config.json").is_file()
    reference = reference_metrics(out)
    # share_contexts=auto decides by the model's costs as timed in each run: on this tiny model a
    # close call, so the two runs may take different paths for the rolling documents, whose
    # numbers differ in float rounding (word perplexity 452798.416 unshared, .364 shared: 1.1e-7).
    for key, value in reference.items():
        assert metrics[key]["value"] == pytest.approx(value, rel=1e-6), key
    assert len(reference) >= 6  # acc, acc_norm, word/byte perplexity, bits_per_byte, exact_match


def test_configured_metric_carries_its_priority_and_direction(workflow):
    _, metrics, _ = workflow
    configured = metrics["ortmodule_sentences_ppl-perplexity"]
    assert configured == {"value": metrics["ortmodule_sentences_ppl-word_perplexity"]["value"], "priority": 1,
                          "higher_is_better": False}
    # lm-eval's own direction where the config names none: perplexity lower, accuracy higher.
    assert metrics["ortmodule_sentences_ppl-bits_per_byte"]["higher_is_better"] is False
    assert metrics["ortmodule_knowledge_mc-acc"]["higher_is_better"] is True


def test_input_model_is_evaluated_with_transformers_and_agrees(workflow):
    """The workflow's input (a Hugging Face model) runs through lm-eval's hf backend: an independent
    reference that the package's perplexity matches."""
    _, metrics, baseline = workflow
    for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        key = f"ortmodule_sentences_ppl-{name}"
        assert math.isclose(metrics[key]["value"], baseline[key]["value"], rel_tol=1e-4), key


def test_settings_and_models_it_cannot_evaluate_are_clear_errors(build, tmp_path):
    make = lambda **settings: OliveEvaluatorConfig(type="OrtModuleEvaluator", **settings).create_evaluator()  # noqa: E731
    with pytest.raises(ValueError, match="unknown setting.*batchsize"):
        make(tasks=TASKS, batchsize=4)
    with pytest.raises(ValueError, match="needs `tasks`"):
        make(tasks=[])
    evaluator = make(tasks=["ortmodule_knowledge_mc"], limit=2)
    with pytest.raises(ValueError, match="CPU and CUDA execution providers.*DmlExecutionProvider"):
        evaluator.evaluate(None, [], "gpu", "DmlExecutionProvider")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.onnx").write_bytes((build("llama").package_dir / "model.onnx").read_bytes())
    with pytest.raises(ValueError, match="genai_config.json.*ModelBuilder"):
        evaluator.evaluate(ONNXModelHandler(model_path=str(bare / "model.onnx")), [], "cpu", "CPUExecutionProvider")
    package = ONNXModelHandler(model_path=str(build("llama").package_dir / "model.onnx"))
    wrong = Metric(name="ortmodule_knowledge_mc", type="accuracy", sub_types=[{"name": "f1_score", "priority": 1}])
    with pytest.raises(ValueError, match="ortmodule_knowledge_mc-f1_score.*did not report.*acc_norm"):
        evaluator.evaluate(package, [wrong], "cpu", "CPUExecutionProvider")



def reference_metrics(package, device="cpu"):
    """`lm_eval --model ortmodule` on a package: {task-metric: value}."""
    results = lm_eval.simple_evaluate(
        model="ortmodule", model_args=f"pretrained={package}", device=device, tasks=TASKS, limit=LIMIT,
        batch_size=4, task_manager=tasks.task_manager(TASKS), bootstrap_iters=0)
    return {f"{task}-{key.partition(',')[0]}": value for task, values in results["results"].items()
            for key, value in values.items() if isinstance(value, float) and "_stderr" not in key}


def evaluate_directly(model, device="cpu", provider="CPUExecutionProvider"):
    evaluator = OliveEvaluatorConfig(type="OrtModuleEvaluator", tasks=TASKS, limit=LIMIT,
                                     batch_size=4).create_evaluator()
    return {key: value.value for key, value in evaluator.evaluate(model, [], device, provider).root.items()}


def test_multimodal_package_as_a_composite_model(build):
    """A multimodal package (decoder, embedding and vision models: what Olive holds as a
    CompositeModelHandler) is evaluated through its text path, equal to lm-eval on it."""
    package = build("gemma4_embeds").package_dir
    parts = ["embedding", "vision", "model"]
    model = CompositeModelHandler([ONNXModelHandler(model_path=str(package / f"{p}.onnx")) for p in parts], parts,
                                  model_path=str(package))
    ours, reference = evaluate_directly(model), reference_metrics(package)
    assert reference and all(ours[key] == pytest.approx(value, rel=1e-9) for key, value in reference.items())


@cuda
def test_cuda_accelerator_runs_on_the_gpu_and_agrees_with_the_cpu(build):
    """The workflow's CUDA provider puts the evaluation on the GPU: metrics within float noise of
    lm-eval on the CPU (a fp32 package, the same kernels' order differs)."""
    package = build("llama").package_dir
    model = ONNXModelHandler(model_path=str(package / "model.onnx"))
    ours, reference = evaluate_directly(model, "gpu", "CUDAExecutionProvider"), reference_metrics(package)
    assert all(ours[key] == pytest.approx(value, rel=1e-3) for key, value in reference.items())


def test_model_builder_pass_int4_options_reach_the_builder(build, tmp_path):
    """Olive 0.13's ModelBuilder pass passes its int4 settings as `int4_block_size`, `int4_accuracy_level`, ...,
    names onnxruntime-genai 0.18 no longer reads (an int4 package kept blocks of 32 and accuracy level 4);
    ortmodule's adaptation of the pass gives them the builder's current names, so the package holds what
    the workflow asked for, as the builder exports it given those names itself."""
    import onnx

    from ortmodule_dev import fixtures

    fixture = build("llama")
    out = tmp_path / "output"
    settings = {"int4_block_size": 128, "int4_accuracy_level": 1, "int4_op_types_to_quantize": ["MatMul"],
                "int4_algo_config": "rtn"}
    config = {
        "input_model": {"type": "HfModel", "model_path": str(fixture.hf_dir)},
        "systems": {"local_system": {"type": "LocalSystem", "accelerators": [
            {"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}]}},
        "passes": {"builder": {"type": "ModelBuilder", "precision": "int4", **settings}},
        "host": "local_system", "target": "local_system", "output_dir": str(out), "cache_dir": str(tmp_path / "cache"),
    }
    (tmp_path / "workflow.json").write_text(json.dumps(config))
    olive_run(str(tmp_path / "workflow.json"))
    fixtures.export(fixture.hf_dir, tmp_path / "reference", "int4",
                    tuple((key.removeprefix("int4_"), "MatMul" if isinstance(value, list) else str(value))
                          for key, value in settings.items()))

    def quantized(folder: Path) -> set:
        graph = onnx.load(str(next(folder.rglob("model.onnx"))), load_external_data=False).graph
        return {tuple(sorted((a.name, a.i) for a in node.attribute if a.name in ("block_size", "accuracy_level")))
                for node in graph.node if node.op_type == "MatMulNBits"}

    assert quantized(out) == quantized(tmp_path / "reference") == {(("accuracy_level", 1), ("block_size", 128))}


def test_model_builder_options_the_builder_would_ignore_are_named(caplog):
    """An `extra_options` entry of the current name wins over Olive's int4_ setting (a warning names the one
    left out), and an option the builder reads under no name is kept but named in a warning: the builder
    would export its default without a word."""
    from ortmodule.olive import current_names

    with caplog.at_level("WARNING", logger="ortmodule.olive"):
        given = current_names({"int4_block_size": 128, "block_size": 64, "int4_accuracy_level": 1, "blok_size": 3})
    assert given == {"block_size": 64, "accuracy_level": 1, "blok_size": 3}
    warned = caplog.text
    assert "int4_block_size=128 left out: the options also hold block_size=64" in warned
    assert "reads none of the options ['blok_size']" in warned
