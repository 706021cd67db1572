"""Libraries written for transformers models, run unchanged on OrtModelForCausalLM and on
transformers with the same weights (the real SmolLM2-135M-Instruct fp32 package): the same strings,
numbers within 1e-4. Versions pinned in the `libraries` extra (pyproject.toml)."""

import functools
import importlib.util
import logging
import sys
from typing import Literal

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

from ortmodule import NotSupportedError, OrtModelForCausalLM, load_tokenizer
from ortmodule_dev import fixtures

SENTENCES = [
    "The keys to the cabinet are on the table.",
    "The keys to the cabinet is on the table.",
    "Paris is the capital of France.",
    "Paris is the capital of Germany.",
]


@pytest.fixture(scope="module")
def pair():
    """(ortmodule model, transformers model, tokenizer) on the same SmolLM2 weights."""
    fixture = fixtures.build(fixtures.SMOLLM2)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    reference = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    return model, reference, load_tokenizer(fixture.package_dir), fixture


def each(pair, run):
    """`run(model, tokenizer)` for ortmodule's model and for transformers', with a fresh tokenizer each."""
    model, reference, _, fixture = pair
    return [run(m, load_tokenizer(fixture.package_dir)) for m in (model, reference)]


def test_guidance_gen_select_and_stop(pair):
    from guidance import gen, models, select

    def run(model, tokenizer):
        lm = models.Transformers(model, tokenizer)
        lm += "The capital of France is" + gen("city", max_tokens=8)
        lm += "\nIs the sky blue? Answer: " + select(["yes", "no"], name="choice")
        lm += ". Because" + gen("why", max_tokens=10, stop=".")
        return lm["city"], lm["choice"], lm["why"]

    ours, theirs = each(pair, run)
    assert ours == theirs


def test_guidance_reuses_a_shared_prefix_with_crop(pair, monkeypatch):
    """Prompts sharing a prefix make guidance 0.3.1 call `cache.crop(n)` with the length to keep,
    transformers 4's meaning. transformers 5.23's to 5.25's DynamicCache refuse a positive n; ortmodule's
    KVCache keeps the first n columns. The reference: transformers with 4's `crop` put back."""
    from guidance import gen, models
    from transformers.cache_utils import DynamicLayer

    prompts = ["The capital of France is", "The capital of Germany is", "The capital of Italy was"]

    def run(model, tokenizer):
        shared = models.Transformers(model, tokenizer)
        return [(shared + prompt + gen("x", max_tokens=6))["x"] for prompt in prompts]

    with pytest.raises(ValueError, match="positive value"):
        run(pair[1], pair[2])

    def crop_as_in_transformers_4(layer, max_length):
        if max_length < 0:
            max_length = layer.get_seq_length() - abs(max_length)
        if layer.get_seq_length() > max_length:
            layer.keys, layer.values = layer.keys[..., :max_length, :], layer.values[..., :max_length, :]

    monkeypatch.setattr(DynamicLayer, "crop", crop_as_in_transformers_4)
    ours, theirs = each(pair, run)
    assert ours == theirs


def test_minicons_sequence_and_token_scores(pair):
    from minicons import scorer

    def run(model, tokenizer):
        lm = scorer.IncrementalLMScorer(model, device="cpu", tokenizer=tokenizer)
        totals = lm.sequence_score(SENTENCES, reduction=lambda x: x.sum(0).item())
        tokens = lm.token_score(SENTENCES[:2])
        return totals, tokens

    (ours, our_tokens), (theirs, their_tokens) = each(pair, run)
    assert ours == pytest.approx(theirs, abs=1e-4)
    assert ours[0] > ours[1] and ours[2] > ours[3]  # the grammatical / true sentence scores higher
    for mine, other in zip(our_tokens, their_tokens):
        assert [t for t, _ in mine] == [t for t, _ in other]
        assert [s for _, s in mine] == pytest.approx([s for _, s in other], abs=1e-4)


# outlines 1.x declares Python < 3.14 (its Requires-Python), so the extra installs it on older Pythons only;
# anywhere else a missing outlines fails the test.
@pytest.mark.skipif(sys.version_info >= (3, 14) and importlib.util.find_spec("outlines") is None,
                    reason="outlines 1.3.3 installs on Python < 3.14 only (its Requires-Python)")
def test_outlines_choices_regex_batch_and_beams(pair):
    import outlines
    from outlines.types import Regex

    def run(model, tokenizer):
        generator = outlines.from_transformers(model, tokenizer)
        return (
            generator("Is the sky blue? Answer:", Literal[" yes", " no"], max_new_tokens=5),
            generator("The year the Eiffel tower was built:", Regex(r" [0-9]{4}"), max_new_tokens=8),
            generator.batch(["The capital of France is", "Two plus two is"], max_new_tokens=6),
            generator("Count: one, two,", max_new_tokens=6, num_beams=2),
        )

    ours, theirs = each(pair, run)
    assert ours == theirs


@pytest.fixture
def lighteval_model(pair, tmp_path, monkeypatch):
    from lighteval.models.transformers.transformers_model import TransformersModel, TransformersModelConfig

    monkeypatch.setenv("HF_HOME", str(tmp_path))

    def make(model, **options):
        # named from the package's parent folder: lighteval keeps its sample cache at cache_dir / model_name,
        # which an absolute name would put inside the package's own folder
        monkeypatch.chdir(pair[3].package_dir.parent)
        config = TransformersModelConfig(model_name=pair[3].package_dir.name, batch_size=4, device="cpu",
                                         cache_dir=str(tmp_path), **options)
        wrapped = TransformersModel.from_model(model, config)
        wrapped._cache = None  # lighteval's sample cache is keyed by model name: both models share it
        return wrapped

    yield make
    torch.set_grad_enabled(True)  # lighteval turns gradients off for the whole process, on import and at load


def test_lighteval_loglikelihood_and_greedy_generation(pair, lighteval_model):
    from lighteval.tasks.requests import Doc

    docs = [
        Doc(query="The capital of France is", choices=[" Paris", " Berlin", " Rome"], gold_index=0, task_name="t"),
        Doc(query="Two plus two is", choices=[" four", " five"], gold_index=0, task_name="t"),
    ]
    asks = [Doc(query="Name a color.", choices=[""], gold_index=0, task_name="t", generation_size=12,
                stop_sequences=["\n"])]
    results = []
    for model in pair[:2]:
        lm = lighteval_model(model)
        results.append(([r.logprobs for r in lm.loglikelihood(docs)], [r.text for r in lm.greedy_until(asks)]))
    (ours, our_text), (theirs, their_text) = results
    for mine, other in zip(ours, theirs):
        assert mine == pytest.approx(other, abs=1e-4)
    assert our_text == their_text


def test_lighteval_continuous_batching_generation(pair, lighteval_model, monkeypatch):
    """lighteval's `continuous_batching` generation, which calls transformers' `generate_batch` on the model:
    the same texts on the package as on transformers' model (its paged-attention `generate_batch`), greedy, with
    the same generation config on both."""
    from lighteval.tasks.requests import Doc
    from transformers import ContinuousBatchingConfig, GenerationConfig

    tokenizer = pair[2]
    asks = [Doc(query=query, choices=[""], gold_index=0, task_name="t", generation_size=12, stop_sequences=["\n"])
            for query in ("Name a color.", "The capital of France is", "Count to five: one,")]
    texts = []
    for model in pair[:2]:
        config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        monkeypatch.setattr(model, "generation_config", config)
        lm = lighteval_model(model, continuous_batching=True)
        if model is pair[1]:  # transformers' manager sized for these prompts, not by the machine's memory
            sized = ContinuousBatchingConfig(num_blocks=32, page_size=32, max_batch_tokens=256)
            monkeypatch.setattr(model, "generate_batch", functools.partial(model.generate_batch,
                                                                           continuous_batching_config=sized))
        texts.append([r.text for r in lm.greedy_until(asks)])
    assert texts[0] == texts[1] and all(text[0] for text in texts[0])


def test_text_generation_pipeline_logs_no_error(pair, caplog):
    model, reference, tokenizer, _ = pair
    with caplog.at_level(logging.WARNING, logger="transformers"):
        ours = pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    theirs = pipeline("text-generation", model=reference, tokenizer=tokenizer)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours(chat, max_new_tokens=12, do_sample=False) == theirs(chat, max_new_tokens=12, do_sample=False)


# trl's trainers on the tiny fixtures (they train the policy in PyTorch): with ortmodule's model as the reference or
# the teacher, and with transformers' on the same weights, every logged loss the same. `bf16=False`: trl's default
# trains under torch.autocast(bfloat16), where a transformers reference computes in bfloat16 too and ortmodule's in
# the package's precision (docs/usage.md).
PREFERENCES = {"prompt": ["The capital of France is", "Two plus two is", "Water boils at", "The sky is"],
               "chosen": [" Paris.", " four.", " one hundred degrees.", " blue."],
               "rejected": [" Rome.", " five.", " zero degrees.", " green."]}


def trl_run(build, tmp_path, trainer, config, dataset, frozen: dict, **options) -> list:
    """The losses `trainer` logs over 3 steps of a transformers llama fixture (seed 0) trained on `dataset`
    with `frozen` (its reference or teacher argument)."""
    policy = build("llama")
    torch.manual_seed(0)
    args = config(output_dir=str(tmp_path), max_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                  save_strategy="no", seed=0, bf16=False, **options)
    run = trainer(model=AutoModelForCausalLM.from_pretrained(policy.hf_dir, dtype=torch.float32), args=args,
                  train_dataset=dataset, processing_class=tokenizer_of(policy.hf_dir), **frozen)
    run.train()
    losses = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
    assert len(losses) == 3
    return losses


@functools.cache
def tokenizer_of(folder):
    """One tokenizer per checkpoint for every run, as a script makes one: trl's tokenized dataset, and so the
    key of its cache of reference log-probabilities, is then the same in each."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def frozen_model(fixture, kind: str):
    return OrtModelForCausalLM.from_pretrained(fixture.package_dir) if kind == "ortmodule" else \
        AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)


def trl_losses(build, tmp_path, trainer, config, data: dict, frozen: str, seed: int = 0, **options) -> list[list]:
    """`trl_run`'s losses given `frozen` (the reference or teacher argument's name) as ortmodule's model and as
    transformers' over the llama fixture of `seed`: [ortmodule's, transformers']."""
    from datasets import Dataset

    return [trl_run(build, tmp_path / kind, trainer, config, Dataset.from_dict(data),
                    {frozen: frozen_model(build("llama", seed=seed), kind)}, **options)
            for kind in ("ortmodule", "transformers")]


def test_trl_dpo_with_an_ortmodule_reference_model(build, tmp_path):
    """DPO's reference log-probabilities through trl's fused LM head over ortmodule's backbone (`model.model`)."""
    from trl import DPOConfig, DPOTrainer

    ours, theirs = trl_losses(build, tmp_path, DPOTrainer, DPOConfig, PREFERENCES, "ref_model",
                              per_device_train_batch_size=2, learning_rate=1e-3)
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert ours[0] == pytest.approx(0.6931, abs=1e-3) and ours[-1] < ours[0]  # log 2 before the policy moves


def test_trl_kto_with_an_ortmodule_reference_model(build, tmp_path):
    from trl import KTOConfig, KTOTrainer

    data = {"prompt": PREFERENCES["prompt"], "completion": [" Paris.", " five.", " one hundred degrees.", " green."],
            "label": [True, False, True, False]}
    ours, theirs = trl_losses(build, tmp_path, KTOTrainer, KTOConfig, data, "ref_model",
                              per_device_train_batch_size=4, learning_rate=1e-3)
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_trl_distillation_from_an_ortmodule_teacher(build, tmp_path):
    """The teacher's hidden states from ortmodule's backbone, projected by its `get_output_embeddings()`."""
    from trl import DistillationConfig, DistillationTrainer

    data = {"prompt": PREFERENCES["prompt"], "completion": PREFERENCES["chosen"]}
    ours, theirs = trl_losses(build, tmp_path, DistillationTrainer, DistillationConfig, data, "teacher_model",
                              seed=1, per_device_train_batch_size=2, max_completion_length=6)
    assert ours == pytest.approx(theirs, abs=1e-5) and min(ours) > 0.1  # another model's distribution


def test_trl_precomputed_reference_log_probs_are_each_packages_own(build, tmp_path):
    """trl keeps reference log-probabilities computed ahead (`precompute_ref_log_probs`) in a cache keyed by the
    dataset and a hash of the reference's `state_dict()`, which holds each package's `package_fingerprint`: a
    second package's run on the same dataset computes its own (the losses of transformers' reference on its
    weights), where one hash for every package would have reused the first's."""
    from datasets import Dataset, load_from_disk
    from trl import DPOConfig, DPOTrainer

    Dataset.from_dict(PREFERENCES).save_to_disk(tmp_path / "data")
    dataset = load_from_disk(tmp_path / "data")  # files, as load_dataset gives them: trl's cache goes beside them
    options = dict(per_device_train_batch_size=2, learning_rate=1e-3, precompute_ref_log_probs=True)
    runs = {(kind, seed): trl_run(build, tmp_path / "out", DPOTrainer, DPOConfig, dataset,  # one script run again
                                  {"ref_model": frozen_model(build("llama", seed=seed), kind)}, **options)
            for kind, seed in (("ortmodule", 0), ("ortmodule", 1), ("transformers", 1))}
    assert runs["ortmodule", 1] == pytest.approx(runs["transformers", 1], abs=1e-5)
    assert runs["ortmodule", 0][0] == pytest.approx(0.6931, abs=1e-3) != runs["ortmodule", 1][0]


def test_trl_training_the_package_itself_is_refused_naming_what_to_do(build, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    fixture = build("llama")
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False)
    refused = "add_model_tags: an ONNX package runs inference only.* train a transformers model .* ref_model="
    with pytest.raises(NotSupportedError, match=refused):
        DPOTrainer(model=OrtModelForCausalLM.from_pretrained(fixture.package_dir), args=args,
                   ref_model=frozen_model(fixture, "transformers"), train_dataset=Dataset.from_dict(PREFERENCES),
                   processing_class=tokenizer_of(fixture.hf_dir))


def test_trl_sync_ref_model_with_a_package_reference_is_refused_naming_why(build, tmp_path):
    """trl's `sync_ref_model` averages the policy's weights into the reference's parameters after a step: with a
    package as the reference there is nothing to write to, and the first sync says so (a NotSupportedError
    naming sync_ref_model) instead of torch's size mismatch inside trl's callback."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    fixture = build("llama")
    with pytest.raises(NotSupportedError, match="into OrtModelForCausalLM's device_anchor: .*trl's sync_ref_model"):
        trl_run(build, tmp_path, DPOTrainer, DPOConfig, Dataset.from_dict(PREFERENCES),
                {"ref_model": frozen_model(fixture, "ortmodule")}, per_device_train_batch_size=2,
                sync_ref_model=True, ref_model_sync_steps=1)
