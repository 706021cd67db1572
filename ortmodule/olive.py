"""Olive evaluator: `OrtModuleEvaluator` runs lm-eval tasks through ortmodule on the model an Olive
workflow produced, and returns Olive's `MetricResult`.

Importing this module registers the evaluator under the type name "OrtModuleEvaluator" in Olive's
evaluator registry. Olive's command line imports user code only through an evaluator's
`user_script`, so a workflow config names a one-line script that imports this module:

    # ortmodule_olive.py
    import ortmodule.olive  # registers "OrtModuleEvaluator"

    "evaluators": {"ortmodule": {"type": "OrtModuleEvaluator", "user_script": "ortmodule_olive.py",
                                 "tasks": ["hellaswag"], "batch_size": 8}}

From Python, `import ortmodule.olive` before `olive.workflows.run(config)` is enough.

The model it is handed is either the ModelBuilder pass's output (an ONNX model in a folder with
`genai_config.json`: run with `ortmodule`'s lm-eval backend, text or multimodal) or the workflow's
Hugging Face input model (Olive evaluates the input model for a goal relative to it: run with
lm-eval's own `hf` backend, the PyTorch reference). Every lm-eval request type works
(loglikelihood, loglikelihood_rolling for perplexity, generate_until).

Results are keyed as Olive's `LMEvaluator` keys them, "{task}-{metric}" (lm-eval's filter name
is appended, "-" made "_", when it is not "none"), with lm-eval's own higher_is_better. For
Olive's goals and search, name metrics in the evaluator config's `metrics`: a metric named after
the task, of type "accuracy" (Olive 0.13 cannot save a config with a "custom" metric), whose sub
types are Olive's accuracy sub types (accuracy_score means lm-eval's acc, f1_score f1,
perplexity word_perplexity, exact_match exact_match) with their priority and goal.

Olive 0.13's ModelBuilder pass calls onnxruntime-genai's builder the way genai 0.14 expected;
`patch_model_builder` (applied on import) lets it run with the genai releases ortmodule uses.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from olive.evaluator.metric_result import MetricResult, SubMetricResult, flatten_metric_result
from olive.evaluator.olive_evaluator import OliveEvaluator
from olive.evaluator.registry import Registry
from olive.hardware.accelerator import Device
from olive.model import CompositeModelHandler, HfModelHandler, ONNXModelHandler

from . import lm_eval as ortmodule_lm_eval
from .tasks import task_manager

logger = logging.getLogger(__name__)

# Execution providers ortmodule runs on, and the torch device each means.
PROVIDER_DEVICES = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}
# Olive's accuracy sub types and the lm-eval metrics they stand for (the first a task reports).
ALIASES = {"accuracy_score": ("acc",), "f1_score": ("f1",), "perplexity": ("word_perplexity", "perplexity")}
OPTIONS = ("tasks", "batch_size", "limit", "num_fewshot", "max_length", "device", "share_contexts",
           "provider_options", "include_path", "apply_chat_template", "fewshot_as_multiturn", "gen_kwargs",
           "bootstrap_iters", "seed")


class OliveEvaluatorError(ValueError):
    """A setting of the evaluator, or the model it was handed, that it cannot evaluate."""


@Registry.register("OrtModuleEvaluator")
class OrtModuleEvaluator(OliveEvaluator):
    """lm-eval tasks through ortmodule, as an Olive evaluator (type name "OrtModuleEvaluator").

    Settings (the evaluator config's keys beside "type"):
    tasks: lm-eval task names (a list, or a comma-separated string), or (from Python) task config
        dicts and Task objects, as lm-eval's `simple_evaluate` takes them; required.
    batch_size: int (default 8), or "auto" (lm-eval's search for the most that fits, which on a CPU
        cannot see the memory run out: the process may be killed instead).
    limit, num_fewshot, apply_chat_template, fewshot_as_multiturn, gen_kwargs, bootstrap_iters, seed:
        lm-eval's `simple_evaluate` arguments of those names (bootstrap_iters defaults to 0: no
        stderr resampling, which Olive does not read).
    max_length: the longest input in tokens (default: the package's context length).
    device: "cpu", "cuda" or "cuda:N" (default: from the workflow's accelerator: the CUDA provider
        or a GPU device means "cuda").
    share_contexts: auto, true or false (ortmodule's backend: a context shared by several requests
        runs once).
    provider_options: ONNX Runtime provider options (a dict), for the ONNX package.
    include_path: a folder (or a list of folders) of extra lm-eval task configs; ortmodule's shipped
        offline tasks (`ortmodule.tasks`: ortmodule_knowledge_mc, ortmodule_sentences_ppl, ...) are
        always there.
    """

    def __init__(self, tasks=None, **kwargs):
        super().__init__()
        unknown = sorted(set(kwargs) - set(OPTIONS))
        if unknown:
            raise OliveEvaluatorError(f"OrtModuleEvaluator: unknown setting(s) {unknown}; known: {list(OPTIONS)}")
        if isinstance(tasks, str):
            tasks = [t.strip() for t in tasks.split(",") if t.strip()]
        if not tasks or isinstance(tasks, dict) or not all(isinstance(t, (str, dict)) or hasattr(t, "config")
                                                           for t in tasks):
            raise OliveEvaluatorError(f"OrtModuleEvaluator needs `tasks`: lm-eval task names (a list, or one string "
                                      f"of comma-separated names), task config dicts or Task objects; got {tasks!r}")
        self.tasks = list(tasks)
        self.settings = {"batch_size": 8, "bootstrap_iters": 0, **kwargs}

    def evaluate(self, model, metrics, device: Device = Device.CPU, execution_providers=None) -> MetricResult:
        """Run the tasks on `model` (a GenAI package or a Hugging Face model) and return the metrics."""
        from lm_eval import simple_evaluate

        torch_device = self.torch_device(device, execution_providers)
        lm = self.language_model(model, torch_device)
        s = self.settings
        options = {k: s[k] for k in ("limit", "num_fewshot", "apply_chat_template", "fewshot_as_multiturn",
                                     "gen_kwargs", "bootstrap_iters") if k in s}
        if "seed" in s:
            options.update(random_seed=s["seed"], numpy_random_seed=s["seed"], torch_random_seed=s["seed"],
                           fewshot_random_seed=s["seed"])
        start = time.perf_counter()
        manager = task_manager(self.tasks, s.get("include_path"))  # lm-eval's own tasks indexed only if named
        results = simple_evaluate(model=lm, tasks=self.tasks, task_manager=manager, log_samples=False, **options)
        seconds = time.perf_counter() - start
        names = [t if isinstance(t, str) else t.get("task") if isinstance(t, dict) else t.config.task
                 for t in self.tasks]
        logger.info("OrtModuleEvaluator: %s on %s with %s: %.1f s", names, torch_device, type(lm).__name__, seconds)
        return metric_result(results, metrics)

    def torch_device(self, device, execution_providers) -> str:
        """The evaluator's `device` setting, else the workflow accelerator's."""
        if self.settings.get("device"):
            return str(self.settings["device"])
        providers = [execution_providers] if isinstance(execution_providers, str) else list(execution_providers or [])
        for provider in providers:
            if provider not in PROVIDER_DEVICES:
                raise OliveEvaluatorError(
                    f"OrtModuleEvaluator runs on ONNX Runtime's CPU and CUDA execution providers; the workflow's "
                    f"accelerator asks for {provider}. Set the evaluator's `device` to 'cpu' or 'cuda' to override."
                )
        if "CUDAExecutionProvider" in providers or (not providers and str(device) == Device.GPU.value):
            return "cuda"
        return "cpu"

    def language_model(self, model, torch_device: str):
        """lm-eval's model object for an Olive model handler."""
        batch_size = self.settings["batch_size"]
        max_length = self.settings.get("max_length")
        if isinstance(model, HfModelHandler):  # the workflow's input: the PyTorch reference, lm-eval's hf
            from lm_eval.models.huggingface import HFLM

            torch_model = model.load_model(cache_model=False).eval().to(torch_device)
            return HFLM(pretrained=torch_model, tokenizer=model.get_hf_tokenizer(), device=torch_device,
                        batch_size=batch_size, max_length=max_length)
        return ortmodule_lm_eval.OrtModuleLM(
            pretrained=str(package_folder(model)), device=torch_device, batch_size=batch_size, max_length=max_length,
            share_contexts=self.settings.get("share_contexts", "auto"),
            provider_options=self.settings.get("provider_options"),
        )


def package_folder(model) -> Path:
    """The GenAI package (the folder with genai_config.json) an ONNX or composite model handler is in."""
    if isinstance(model, (ONNXModelHandler, CompositeModelHandler)) and model.model_path:
        path = Path(model.model_path)
        folder = path if path.is_dir() else path.parent
        if (folder / "genai_config.json").is_file():
            return folder
        raise OliveEvaluatorError(
            f"OrtModuleEvaluator evaluates ONNX GenAI packages (a folder with genai_config.json, as Olive's "
            f"ModelBuilder pass writes); {folder} has none. Add a ModelBuilder pass (metadata_only: true adds the "
            f"config to an existing ONNX model) before this evaluator."
        )
    raise OliveEvaluatorError(
        f"OrtModuleEvaluator evaluates ONNX GenAI packages and Hugging Face models; it was handed a "
        f"{type(model).__name__}"
    )


def metric_result(results: dict, metrics=()) -> MetricResult:
    """lm-eval's results as Olive's MetricResult: "{task}-{metric}" with lm-eval's higher_is_better
    and priority -1, plus each metric the evaluator config names (a metric named after the task;
    each sub type an lm-eval metric, or an Olive accuracy sub type: `ALIASES`) with its priority."""
    reported: dict[str, dict[str, SubMetricResult]] = {}
    for task, values in sorted(results["results"].items()):
        directions = results.get("higher_is_better", {}).get(task, {})
        for key, value in sorted(values.items()):
            name, _, filter_name = key.partition(",")
            if name.endswith("_stderr") or name == "sample_len" or isinstance(value, bool) or not isinstance(
                    value, (int, float)):
                continue
            sub_name = name if filter_name in ("", "none") else f"{name}_{filter_name}".replace("-", "_")
            reported.setdefault(task, {})[sub_name] = SubMetricResult(
                value=value, priority=-1, higher_is_better=bool(directions.get(name, True)))
    configured: dict[str, dict[str, SubMetricResult]] = {}
    for metric in metrics or []:
        for sub in metric.sub_types:
            sub_name = str(getattr(sub.name, "value", sub.name))
            candidates = [c for c in (sub_name, *ALIASES.get(sub_name, ())) if c in reported.get(metric.name, {})]
            if not candidates:
                available = {task: sorted(subs) for task, subs in reported.items()}
                raise OliveEvaluatorError(
                    f"the evaluator config names metric {metric.name}-{sub_name}, which lm-eval did not report; "
                    f"a metric's name is an lm-eval task and its sub types that task's metrics: {available}")
            configured.setdefault(metric.name, {})[sub_name] = SubMetricResult(
                value=reported[metric.name][candidates[0]].value, priority=sub.priority,
                higher_is_better=sub.higher_is_better)
    merged = {task: {**subs, **configured.get(task, {})} for task, subs in reported.items()}
    return flatten_metric_result({task: MetricResult.model_validate(subs) for task, subs in merged.items()})


def patch_model_builder() -> bool:
    """Let Olive's ModelBuilder pass run with onnxruntime-genai 0.15 and newer.

    Olive 0.13 calls the builder's `create_model` with a dict of options, as genai 0.14 took them;
    genai 0.15 and newer want them prepared by `parse_extra_options` first, and dropped the
    `models.quantized_model` module that the pass patches for Olive-quantized checkpoints (genai
    now reads those itself). The patch prepares the options when they were not, and skips the
    obsolete quantization patch. Returns whether it patched (False when nothing needed it).
    """
    import importlib.util

    try:
        from olive.passes.onnx.model_builder import ModelBuilder
        from onnxruntime_genai.models import builder
    except ImportError:
        return False
    if (not hasattr(builder, "parse_extra_options") or getattr(builder.create_model, "ortmodule_patch", False)
            or importlib.util.find_spec("onnxruntime_genai.models.quantized_model") is not None):
        return False
    original = builder.create_model

    def create_model(model_name, input_path, output_dir, precision, execution_provider, cache_dir, **options):
        if "_effective_builder_config" not in options:
            options = builder.parse_extra_options(model_name, input_path, output_dir, precision, execution_provider,
                                                  cache_dir, [f"{k}={_option_text(k, v)}"
                                                              for k, v in current_names(options).items()])
        return original(model_name, input_path, output_dir, precision, execution_provider, cache_dir, **options)

    create_model.ortmodule_patch = True
    builder.create_model = create_model
    ModelBuilder.maybe_patch_quant = staticmethod(lambda: None)
    logger.info("ortmodule: Olive's ModelBuilder pass adapted to onnxruntime-genai's parse_extra_options")
    return True


def current_names(options: dict) -> dict:
    """Olive's ModelBuilder options under the names the installed builder reads: Olive 0.13 passes its
    `int4_block_size`, `int4_accuracy_level`, `int4_is_symmetric`, `int4_op_types_to_quantize`,
    `int4_nodes_to_exclude` and `int4_algo_config` as they are, which genai 0.18's help calls deprecated
    aliases but which it ignores without a word (an int4 package kept blocks of 32, whatever the pass
    said). Each is given its current name (`block_size`, ...), unless the options also hold that name."""
    from .exporter import builder_options

    known, renamed = builder_options(), {}
    for key, value in options.items():
        base = key.removeprefix("int4_")
        if base != key and key not in known and base in known:
            if base in options:
                logger.warning("ortmodule: Olive's %s=%r left out: the options also hold %s=%r, which the builder "
                               "reads", key, value, base, options[base])
                continue
            logger.info("ortmodule: Olive's %s=%r passed to the model builder as %s (genai 0.18 ignores the "
                        "int4_-prefixed name)", key, value, base)
            key = base
        renamed[key] = value
    ignored = sorted(key for key in renamed if known and key not in known)
    if ignored:
        logger.warning("ortmodule: the model builder reads none of the options %s: it will ignore them (its options: "
                       "python -m onnxruntime_genai.models.builder --help, under --extra_options)", ignored)
    return renamed


def _option_text(key: str, value) -> str:
    """An option's value as the builder's `KEY=VALUE` text: booleans in lower case, an enum's value, the
    lists of op types joined by "/" and of node names by ",", as the builder splits them."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ("/" if key == "op_types_to_quantize" else ",").join(map(str, value))
    return str(getattr(value, "value", value))


patch_model_builder()
