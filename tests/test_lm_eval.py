"""The `ortmodule` lm-eval backend against lm-eval's own `hf` backend on the same weights."""

import contextlib
import functools
import json
import logging
import math

import lm_eval
import pytest
import torch
from helpers import ARCHES, load_pair, stop_requests

import ortmodule.lm_eval  # noqa: F401  (registers the backend)
from ortmodule import scoring, tasks


def evaluate(model, model_args, batch_size=8):
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks.TASKS,
        task_manager=tasks.task_manager(tasks.TASKS),
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
    )


def loglikelihoods(result, task):
    """Every request's (loglikelihood, is_greedy), or rolling loglikelihood, in document order."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [r for s in samples for r in s["filtered_resps"]]


# The full lm-eval comparison on three architectures by default (dense, sliding-window, multimodal);
# the others in the slow run.
DEFAULT_ARCHES = ("llama", "gemma3", "gemma4_embeds")


@pytest.fixture(scope="module", params=[a if a in DEFAULT_ARCHES else pytest.param(a, marks=pytest.mark.slow)
                                        for a in ARCHES])
def both(request, build):
    fixture = build(request.param)
    ours = evaluate("ortmodule", f"pretrained={fixture.package_dir}")
    # The same rolling window for both: HFLM reads max_position_embeddings from the top of the
    # config, where a multimodal config (Gemma 4) does not have it, and would fall back to 2048.
    theirs = evaluate("hf", f"pretrained={fixture.hf_dir},dtype=float32,max_length={fixture.spec.context_length}")
    return ours, theirs


def test_multiple_choice_matches_hf(both):
    ours, theirs = both
    task = "ortmodule_arithmetic_mc"
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][task][metric] == theirs["results"][task][metric]
    a, b = loglikelihoods(ours, task), loglikelihoods(theirs, task)
    assert len(a) == len(b) == 160  # 40 questions x 4 choices
    for (lp, greedy), (ref_lp, ref_greedy) in zip(a, b):
        assert abs(lp - ref_lp) < 1e-4
        assert greedy == ref_greedy


def test_generations_match_hf(both):
    """generate_until: greedy decoding with lm-eval's stop sequences, batched and left-padded."""
    ours, theirs = both
    task = "ortmodule_arithmetic_gen"
    assert ours["results"][task]["exact_match,none"] == theirs["results"][task]["exact_match,none"]
    a, b = loglikelihoods(ours, task), loglikelihoods(theirs, task)
    assert len(a) == len(b) == 40
    assert a == b
    assert len(set(a)) > 1  # the generations are not all one string


def test_rolling_perplexity_matches_hf(both):
    ours, theirs = both
    task = "ortmodule_sentences_ppl"
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(ours["results"][task][metric], theirs["results"][task][metric], rel_tol=1e-4)
    for a, b in zip(loglikelihoods(ours, task), loglikelihoods(theirs, task)):
        assert math.isclose(a, b, rel_tol=1e-5)


def test_results_record_hfs_parameter_count(both):
    """lm-eval's results record `model_num_parameters` (the backend's `get_model_info`): ortmodule's
    count of the package's weights is the `hf` backend's on the same weights, where the package holds
    those weights. Two fixtures' packages do not quite: the Gemma 4 exports keep a few constants as
    initializers (49 elements of 119,456; mobius-onnx's 125 of 148,936), and the builder leaves out
    the Qwen2 fixture's all-zero query, key and value biases (256 of 139,840)."""
    ours, theirs = (result["config"]["model_num_parameters"] for result in both)
    if any(arch in both[0]["config"]["model_args"] for arch in ("gemma4", "qwen2-")):
        assert ours == pytest.approx(theirs, rel=2e-3)
    else:
        assert ours == theirs


def test_long_rows_in_chunks_match_hf(build):
    """Every row in chunks of 8 tokens (the CPU's default chunk scaled down to the fixtures' rows):
    multiple choice, generations and rolling loglikelihoods as lm-eval's hf backend's."""
    fixture = build("qwen3")
    ours = evaluate("ortmodule", f"pretrained={fixture.package_dir},prefill_chunk=8")
    theirs = evaluate("hf", f"pretrained={fixture.hf_dir},dtype=float32,max_length={fixture.spec.context_length}")
    choices = [loglikelihoods(r, "ortmodule_arithmetic_mc") for r in (ours, theirs)]
    for (lp, greedy), (ref_lp, ref_greedy) in zip(*choices):
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy
    assert loglikelihoods(ours, "ortmodule_arithmetic_gen") == loglikelihoods(theirs, "ortmodule_arithmetic_gen")
    rolling = [loglikelihoods(r, "ortmodule_sentences_ppl") for r in (ours, theirs)]
    assert len(rolling[0]) == len(rolling[1]) > 0
    for a, b in zip(*rolling):
        assert math.isclose(a, b, rel_tol=1e-5)


@pytest.mark.slow
def test_batch_size_one_equals_batch_size_eight(build):
    fixture = build("llama")
    one = evaluate("ortmodule", f"pretrained={fixture.package_dir}", batch_size=1)
    eight = evaluate("ortmodule", f"pretrained={fixture.package_dir}", batch_size=8)
    for a, b in zip(loglikelihoods(one, "ortmodule_arithmetic_mc"), loglikelihoods(eight, "ortmodule_arithmetic_mc")):
        assert abs(a[0] - b[0]) < 1e-5 and a[1] == b[1]


@pytest.mark.slow
def test_context_sharing_on_off_and_auto_agree(build):
    """share_contexts=true (every multiple-choice context run once), false (every request its own
    row) and auto give the same loglikelihoods; a bad value is refused."""
    fixture = build("llama")
    results = {share: evaluate("ortmodule", f"pretrained={fixture.package_dir},share_contexts={share}")
               for share in ("true", "false", "auto")}
    reference = loglikelihoods(results["false"], "ortmodule_arithmetic_mc")
    for share in ("true", "auto"):
        for a, b in zip(loglikelihoods(results[share], "ortmodule_arithmetic_mc"), reference):
            assert abs(a[0] - b[0]) < 1e-4 and a[1] == b[1]
    with pytest.raises(ValueError, match="share_contexts must be auto, true or false"):
        evaluate("ortmodule", f"pretrained={fixture.package_dir},share_contexts=sometimes")


def test_auto_sharing_is_off_on_cuda_and_timed_at_load_elsewhere(build, monkeypatch):
    """`share_contexts=auto` resolved when the backend loads: on CUDA it does not share (the extend
    run lost to the padded rows on every lm-eval shape an H100 ran) and nothing is timed; on the CPU
    the model's costs are measured then; true and false stay as given."""
    import torch

    from ortmodule import OrtModelForCausalLM
    from ortmodule.lm_eval import _sharing_at_load

    llama_model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    timed = []
    monkeypatch.setattr(type(llama_model), "measured_costs", lambda self: timed.append(self.device.type))
    assert _sharing_at_load("auto", llama_model) == "auto" and timed == ["cpu"]
    monkeypatch.setattr(type(llama_model), "device", property(lambda self: torch.device("cuda", 0)))
    assert _sharing_at_load("auto", llama_model) is False and timed == ["cpu"]
    assert _sharing_at_load(True, llama_model) is True and _sharing_at_load(False, llama_model) is False
    assert _sharing_at_load("auto", object()) == "auto"  # another model object: decided per batch as before


def test_contexts_cut_to_max_length_score_alike_shared_or_not(build):
    """A context longer than max_length, with continuations of different lengths: every row is cut
    on the left by a different amount, so the rows of one context no longer start alike. Sharing
    on, auto and off all give lm-eval hf's loglikelihoods on the same weights and max_length."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    context = list(range(40, 70))
    requests = [(("", ""), context, list(range(100, 100 + n))) for n in (1, 3, 5)]
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", max_length=20, device="cpu",
                     batch_size=4)._loglikelihood_tokens(requests, disable_tqdm=True)
    for share in ("true", "auto", "false"):
        lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", max_length=20, batch_size=4,
                         share_contexts=share)
        for (lp, greedy), (ref_lp, ref_greedy) in zip(lm._loglikelihood_tokens(requests, disable_tqdm=True),
                                                      reference, strict=True):
            assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy


@pytest.mark.parametrize("add_bos_token", [None, True, False])
def test_batched_encoding_equals_hflm_tok_encode(build, add_bos_token):
    """The texts a loglikelihood call tokenizes are encoded in batches beforehand: each the same ids
    as lm-eval's own `HFLM.tok_encode`, with and without add_bos_token, with a leading BOS or not."""
    from lm_eval.models.huggingface import HFLM
    from tokenizers.processors import TemplateProcessing

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    extra = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    ours = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", **extra)
    theirs = HFLM(pretrained=str(fixture.hf_dir), device="cpu", **extra)
    for lm in (ours, theirs):  # a tokenizer that adds BOS, so that the special-token rules show
        lm.tokenizer._tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", lm.tokenizer.bos_token_id)])
    bos = theirs.tokenizer.decode(theirs.prefix_token_id)
    assert theirs.tokenizer("a")["input_ids"][0] == theirs.prefix_token_id
    texts = ["the cat sat", " the cat sat ", bos + "the cat", "3 + 4 = 7", "", "x" * 500]
    encoded = ours._encode_batched(texts)
    assert encoded == {text: theirs.tok_encode(text) for text in texts}
    many = [f"{i} and {i * 7} make {i * 8}" + " word" * (i % 50) for i in range(300)] + [bos + "a"] * 3
    assert ours._encode_batched(many) == {text: theirs.tok_encode(text) for text in many}  # on threads
    documents = [f"document {i}: " + "the cat sat on the mat. " * 5000 for i in range(3)]  # long: a thread each
    assert ours._encode_batched(documents) == {text: theirs.tok_encode(text) for text in documents}
    ours._encoded = encoded
    assert ours.tok_encode("3 + 4 = 7", left_truncate_len=2) == theirs.tok_encode("3 + 4 = 7", left_truncate_len=2)


def text_requests():
    """lm-eval's loglikelihood Instances as texts: questions with four one-word choices, with longer
    choices, a context ending in spaces (HFLM moves them to the continuation), an empty context
    (HFLM's prefix token), and lone requests."""
    from lm_eval.api.instance import Instance

    words = ["the", "cat", "sat", "on", "a", "mat", "and", "two", "plus", "three", "is", "five", "while", "four",
             "plus", "four", "is", "eight"]
    pairs = []
    for q in range(10):
        context = " ".join(words[(q + k) % len(words)] for k in range(3 + 4 * q)) + ("  " if q == 3 else "")
        choices = [" " + w for w in words[q:q + 4]] if q % 2 else [" " + " ".join(words[q + k:q + k + 5])
                                                                   for k in range(4)]
        pairs += [(context, choice) for choice in choices]
    pairs += [("", "two plus two"), ("five", " is five"), ("a mat", " and")]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


class RecordingCacheHook:
    def __init__(self):
        self.answers = {}

    def add_partial(self, attr, request, result):
        self.answers[request] = result


def test_loglikelihood_in_waves_equals_hf(build):
    """Requests tokenized ahead of the device, wave by wave (CUDA's path, forced here with small
    waves), give lm-eval hf's answers on the same weights, in the requests' order, as one wave does,
    and every answer reaches lm-eval's cache hook under its request's texts."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.encoding import request_waves
    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    requests = text_requests()
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=4).loglikelihood(requests, disable_tqdm=True)
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4)
    assert lm._first_wave is None  # on a CPU: one wave
    for first in (None, 4):
        lm._first_wave = first
        lm.set_cache_hook(hook := RecordingCacheHook())
        assert len(request_waves([r.args for r in requests], first or len(requests))) == (1 if first is None else 4)
        got = lm.loglikelihood(requests, disable_tqdm=True)
        assert_same_answers(got, reference)
        assert hook.answers == {r.args: answer for r, answer in zip(requests, got)}


def test_waves_keep_a_context_together_longest_first():
    from ortmodule.encoding import request_waves

    pairs = [("q" * (i % 7), " a" * (i % 5)) for i in range(100)] + [("long " * 50, " x")]
    waves = request_waves(pairs, 4)
    order = [i for wave in waves for i in wave]
    assert sorted(order) == list(range(len(pairs)))
    assert order[0] == 100  # the longest text first
    assert all(len(later) >= 2 * 4 for later in waves[1:-1])
    where = {i: w for w, wave in enumerate(waves) for i in wave}
    for i, (context, _) in enumerate(pairs):
        assert {where[j] for j, (c, _) in enumerate(pairs) if c.rstrip() == context.rstrip()} == {where[i]}
    assert len(request_waves(pairs, len(pairs))) == 1
    assert request_waves([], 1) == []


def test_the_next_waves_are_tokenized_while_a_wave_runs(build):
    """While the first wave's batches run, the texts of the next wave are encoded on another thread:
    the first wave's scoring waits until that encoding has begun (it would wait forever, and fail,
    if the encoding came after it)."""
    import threading

    from ortmodule.lm_eval import OrtModuleLM

    lm = OrtModuleLM(pretrained=str(build("llama").package_dir), device="cpu", batch_size=4)
    lm._first_wave = 4
    second_wave_encoding = threading.Event()
    encode, score = lm._encode_pairs, lm._totals_on_device
    encoders, calls = [], []

    def encoding(pairs):
        encoders.append(threading.current_thread().name)
        if len(encoders) == 2:
            second_wave_encoding.set()
        return encode(pairs)

    def scoring(requests, *args, **kwargs):
        calls.append(len(requests))
        if len(calls) == 1:
            assert second_wave_encoding.wait(30), "the next wave was not encoded while the first one ran"
        return score(requests, *args, **kwargs)

    lm._encode_pairs, lm._totals_on_device = encoding, scoring
    requests = text_requests()
    assert len(lm.loglikelihood(requests, disable_tqdm=True)) == len(requests)
    assert len(calls) == len(encoders) == 4 and sum(calls) == len(requests)
    assert all(name.startswith("ortmodule-tokenize") for name in encoders)


def test_texts_are_cut_into_parts_of_about_equal_length():
    from ortmodule.encoding import contiguous_parts

    texts = ["x" * n for n in (5, 1, 1, 1, 1, 1, 5, 3, 2)]
    parts = contiguous_parts(texts, 3)
    assert [t for part in parts for t in part] == texts
    assert [sum(map(len, part)) for part in parts] == [7, 8, 5]
    assert contiguous_parts(texts, 1) == [texts]
    assert len(contiguous_parts(["a" * 100, "b"], 4)) == 2  # never an empty part
    assert contiguous_parts([], 4) == []


def test_rolling_documents_are_encoded_in_one_batched_call(build, monkeypatch):
    """`loglikelihood_rolling` encodes its documents before HFLM asks, in batches: HFLM's one-by-one
    `tok_encode` reaches the tokenizer for none of them, and the totals equal hf's on the same weights."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    documents = [Instance("loglikelihood_rolling", {}, (" ".join(["two plus three is five"] * n),), n)
                 for n in (3, 40, 90)]
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=4).loglikelihood_rolling(documents, disable_tqdm=True)
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4)
    one_by_one = []
    encode = HFLM.tok_encode
    monkeypatch.setattr(HFLM, "tok_encode", lambda self, string, *a, **k: one_by_one.append(string) or encode(
        self, string, *a, **k))
    got = lm.loglikelihood_rolling(documents, disable_tqdm=True)
    assert not one_by_one
    assert got == pytest.approx(reference, rel=1e-5)


def test_rolling_requests_in_lm_eval_0_5s_form_are_answered_in_it(build):
    """lm-eval 0.5's rolling requests (its `next0.5` branch; 0.5.0.dev1 on PyPI) carry ("", document) and
    take (total, False) answers, as its loglikelihood's do; 0.4's carry (document,) and take the total.
    The same documents in both forms: hf's totals, each in its form (reading the empty first argument as
    the document scored nothing and answered 0)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    texts = [" ".join(["two plus three is five"] * n) for n in (3, 40)]
    old = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    new = [Instance("loglikelihood_rolling", {}, ("", text), i) for i, text in enumerate(texts)]
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=4).loglikelihood_rolling(old, disable_tqdm=True)
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4)
    totals = lm.loglikelihood_rolling(old, disable_tqdm=True)
    assert totals == pytest.approx(reference, rel=1e-5) and all(isinstance(t, float) for t in totals)
    assert lm.loglikelihood_rolling(new, disable_tqdm=True) == [(total, False) for total in totals]


def test_rolling_windows_run_in_batches_by_length_and_come_back_once(build, monkeypatch):
    """Every window of every document in one call: two long documents (two windows of the 256-token
    context each) and two short ones (one window each), 2 rows a batch. HFLM batches the windows in
    document order, padding each short window to a long one beside it; here the long windows fill
    two batches and the short ones share the third. One copy of the answers comes back for the call,
    and the totals equal hf's on the same weights."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    import ortmodule.lm_eval as backend

    fixture = build("llama")
    phrases = ["two plus three is five", "three times four is twelve", "six minus one is five", "ten over two is five"]
    documents = [Instance("loglikelihood_rolling", {}, (" ".join([phrase] * n),), n)  # about 13 tokens a phrase
                 for phrase, n in zip(phrases, (35, 3, 38, 6))]
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu", max_length=256,
                     batch_size=2).loglikelihood_rolling(documents, disable_tqdm=True)
    lm = backend.OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=2, prefill_chunk=0)
    widths, copies = [], []
    totals, answers = backend.loglikelihood_totals, backend.answers
    monkeypatch.setattr(backend, "loglikelihood_totals",
                        lambda model, ids, mask, *a: widths.append((ids.shape, mask.sum().item())) or totals(
                            model, ids, mask, *a))
    monkeypatch.setattr(backend, "answers", lambda t: copies.append(t.shape) or answers(t))
    argmax = []  # lm-eval reads no greedy flag of a rolling window: none is computed
    normalizers = scoring.log_normalizers
    monkeypatch.setattr(scoring, "log_normalizers", lambda logits, *a, **k: argmax.append(k.get("at") is None) or
                        normalizers(logits, *a, **k))
    got = lm.loglikelihood_rolling(documents, disable_tqdm=True)
    assert got == pytest.approx(reference, rel=1e-5)
    assert argmax and not any(argmax)
    # The windows' row lengths in document order, as lm-eval cuts them.
    rows = [len(context) + len(continuation) - 1 for doc in documents
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                lm.tok_encode(doc.args[0]), lm.prefix_token_id, 256, 1))]
    assert len(rows) >= 6 and 256 in rows and min(rows) < 128
    assert copies == [(2, len(rows))]  # every window's answer, read back at once
    by_length = sorted(rows, reverse=True)
    assert [(shape[0], shape[1]) for shape, _ in widths] == [
        (len(by_length[i : i + 2]), by_length[i]) for i in range(0, len(rows), 2)]
    padded = sum(shape[0] * shape[1] for shape, _ in widths)
    in_document_order = sum(len(rows[i : i + 2]) * max(rows[i : i + 2]) for i in range(0, len(rows), 2))
    assert sum(real for _, real in widths) == sum(rows) and padded < in_document_order


def test_hflm_accepts_a_loaded_model(build):
    """`OrtModuleLM(pretrained=<OrtModelForCausalLM>, tokenizer=...)` as with HFLM and a PreTrainedModel."""
    from ortmodule import OrtModelForCausalLM, load_tokenizer
    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    lm = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size=4)
    assert lm.max_length == model.package.context_length
    by_path = evaluate("ortmodule", f"pretrained={fixture.package_dir}")
    result = lm_eval.simple_evaluate(model=lm, tasks=["ortmodule_arithmetic_mc"],
                                     task_manager=tasks.task_manager(tasks.TASKS), log_samples=True)
    for a, b in zip(loglikelihoods(result, "ortmodule_arithmetic_mc"), loglikelihoods(by_path,
                                                                                      "ortmodule_arithmetic_mc")):
        assert abs(a[0] - b[0]) < 1e-5


def test_task_manager_indexes_lm_evals_own_tasks_only_where_the_tasks_need_them(tmp_path, caplog, monkeypatch):
    """`tasks.task_manager`: for ortmodule's tasks alone, none of lm-eval's ~14,700 built-in task configs
    (seconds to index, every manager); for a group of the user's folder (its tasks may be built-in ones),
    lm-eval's tasks too, as `TaskManager(include_path=...)` indexes them. `ortmodule-eval` resolves
    `--tasks` through it: ortmodule's tasks without `--include_path`, a task of the user's folder, and
    the group over a built-in task (lm-eval's `EvaluatorConfig.process_tasks`, which the command calls)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from ortmodule import cli

    own = tasks.task_manager(tasks.TASKS)
    assert set(tasks.TASKS) <= set(own.all_subtasks) and "arc_easy" not in own.all_tasks
    loaded = own.load(tasks.TASKS)["tasks"]
    assert set(loaded) == set(tasks.TASKS)
    objects = [*loaded.values(), "ortmodule_knowledge_gen"]  # Task objects (Olive's evaluators pass them) and a name
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        assert "arc_easy" not in tasks.task_manager(objects).all_tasks
    assert "indexing" not in caplog.text
    from lm_eval._cli.ls import List
    from lm_eval._cli.validate import Validate

    for cls, method in ((EvaluatorConfig, "process_tasks"), (List, "_execute"), (Validate, "_execute")):
        monkeypatch.setattr(cls, method, getattr(cls, method))  # restored after
    cli.resolve_tasks_as_ortmodule()
    cli.resolve_tasks_as_ortmodule()  # once only
    config = EvaluatorConfig(tasks="ortmodule_knowledge_mc,ortmodule_knowledge_gen")
    manager = config.process_tasks()
    assert config.tasks == ["ortmodule_knowledge_mc", "ortmodule_knowledge_gen"] and "arc_easy" not in manager.all_tasks
    (tmp_path / "my_task.yaml").write_text(f"task: my_task\ninclude: {tasks.TASK_DIR}/ortmodule_knowledge_mc.yaml\n")
    config = EvaluatorConfig(tasks=["my_task"], include_path=str(tmp_path))
    assert "arc_easy" not in config.process_tasks().all_tasks and config.tasks == ["my_task"]
    (tmp_path / "my_group.yaml").write_text("group: my_group\ntask:\n  - arc_easy\n  - ortmodule_arithmetic_mc\n")
    config = EvaluatorConfig(tasks="my_group", include_path=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        manager = config.process_tasks()
    assert "my_group" in manager.all_groups and "arc_easy" in manager.all_subtasks and config.tasks == ["my_group"]
    assert "indexing lm-eval's built-in tasks" in caplog.text


def test_ortmodule_eval_validate_and_ls_find_ortmodules_tasks(monkeypatch, capsys, caplog):
    """`ortmodule-eval validate --tasks ...` (and `ls`, through the same wrapper) finds ortmodule's
    shipped tasks without `--include_path`, and without indexing lm-eval's built-in tasks where every
    name is ortmodule's; lm-eval's own `validate` says they are not found."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval._cli.ls import List
    from lm_eval._cli.validate import Validate
    from lm_eval.tasks import TaskManager

    from ortmodule import cli

    def validate(names, found=True):
        monkeypatch.setattr("sys.argv", ["ortmodule-eval", "validate", "--tasks", names])
        harness = HarnessCLI()
        with contextlib.nullcontext() if found else pytest.raises(SystemExit):
            harness.execute(harness.parse_args())
        return capsys.readouterr().out

    names = "ortmodule_arithmetic_mc,ortmodule_knowledge_gen"
    for cls in (List, Validate):
        monkeypatch.setattr(cls, "_execute", cls._execute)  # restored after
    with monkeypatch.context() as patch:  # lm-eval's own validate (its built-in tasks left out: 15 s to index)
        patch.setattr(TaskManager, "__init__", functools.partialmethod(TaskManager.__init__, include_defaults=False))
        assert "Tasks not found: ortmodule_arithmetic_mc, ortmodule_knowledge_gen" in validate(names, found=False)
    cli.resolve_tasks_as_ortmodule()
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        assert "All tasks found and valid" in validate(names)
    assert "indexing lm-eval's built-in tasks" not in caplog.text


def test_chat_template_with_multi_turn_few_shot_matches_hf():
    """`--apply_chat_template --fewshot_as_multiturn --system_instruction` on an instruct model
    (the real SmolLM2-135M-Instruct and its chat template): the same chat-formatted requests as the
    `hf` backend, the same generations and choices, log-likelihoods within 1e-4. A question's choices
    share its chat-formatted context (`share_contexts=true`: the shared path, set rather than decided
    from costs whose first measurement takes a minute on a small CPU)."""
    from ortmodule_dev import fixtures

    fixture = fixtures.build(fixtures.SMOLLM2)
    manager = tasks.task_manager(["ortmodule_knowledge_mc", "ortmodule_knowledge_gen"])

    def chat_evaluate(model, model_args):
        return lm_eval.simple_evaluate(model=model, model_args=model_args, task_manager=manager,
                                       tasks=["ortmodule_knowledge_mc", "ortmodule_knowledge_gen"],
                                       num_fewshot=2, apply_chat_template=True, fewshot_as_multiturn=True,
                                       system_instruction="Answer in a word.", limit=8, batch_size=8,
                                       device="cpu", log_samples=True)

    ours = chat_evaluate("ortmodule", f"pretrained={fixture.package_dir},share_contexts=true")
    theirs = chat_evaluate("hf", f"pretrained={fixture.hf_dir},dtype=float32")
    for task, metric in (("ortmodule_knowledge_mc", "acc,none"), ("ortmodule_knowledge_gen", "exact_match,none")):
        assert ours["results"][task][metric] == theirs["results"][task][metric]
        a = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert [s["arguments"] for s in a] == [s["arguments"] for s in b]
        assert all("<|im_start|>assistant" in s["arguments"][0][0] for s in a)  # chat-formatted, not plain
        if task.endswith("_gen"):
            assert [s["filtered_resps"] for s in a] == [s["filtered_resps"] for s in b]
            continue
        for ours_row, theirs_row in zip(loglikelihoods(ours, task), loglikelihoods(theirs, task)):
            assert abs(ours_row[0] - theirs_row[0]) < 1e-4
            assert ours_row[1] == theirs_row[1]


def test_console_logs_ortmodule_through_lm_evals_handlers_at_its_level():
    """ortmodule-eval's handler passes ortmodule's records to lm-eval's own handlers, at lm-eval's
    level (an INFO record is dropped at WARNING), and to stderr's last resort for warnings before
    lm-eval has set its handlers up."""
    import logging

    from ortmodule.cli import _ThroughLmEval

    target = logging.getLogger("lm_eval")
    handlers, level = target.handlers[:], target.level
    seen = []
    capture = logging.Handler()
    capture.emit = seen.append
    relay = _ThroughLmEval()
    record = lambda level: logging.LogRecord("ortmodule", level, __file__, 1, "told", None, None)  # noqa: E731
    try:
        target.handlers[:] = [capture]
        target.setLevel(logging.INFO)
        relay.handle(record(logging.INFO))
        target.setLevel(logging.WARNING)
        relay.handle(record(logging.INFO))
        relay.handle(record(logging.WARNING))
        assert [(r.name, r.levelno) for r in seen] == [("ortmodule", logging.INFO), ("ortmodule", logging.WARNING)]
        target.handlers[:] = []
        last_resort, logging.lastResort = logging.lastResort, capture
        try:
            relay.handle(record(logging.WARNING))
        finally:
            logging.lastResort = last_resort
        assert len(seen) == 3
    finally:
        target.handlers[:] = handlers
        target.setLevel(level)


@pytest.mark.slow
def test_console_script_runs(build, tmp_path):
    import json
    import subprocess
    import sys

    fixture = build("llama")
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "ortmodule.cli", "--model", "ortmodule", "--model_args",
         f"pretrained={fixture.package_dir}",
         "--device", "cpu", "--tasks", "ortmodule_arithmetic_mc", "--include_path", tasks.TASK_DIR,
         "--batch_size", "8", "--output_path", str(out)],
        check=True, capture_output=True, text=True,
    )
    result = json.loads(next(out.rglob("results_*.json")).read_text())
    assert "acc,none" in result["results"]["ortmodule_arithmetic_mc"]


def mixed_requests():
    """Loglikelihood requests as lm-eval's tokenized ones: questions with four one-token choices
    (rows the same but for the target), questions with longer choices, and lone requests, of
    lengths 5 to 60."""
    import random

    rng = random.Random(0)
    requests = []
    for q in range(12):
        context = [rng.randrange(3, 500) for _ in range(rng.randrange(5, 50))]
        width = 1 if q % 2 == 0 else rng.randrange(2, 9)
        requests += [(("", ""), context, [rng.randrange(3, 500) for _ in range(width)]) for _ in range(4)]
    requests += [(("", ""), [rng.randrange(3, 500) for _ in range(n)], [rng.randrange(3, 500)]) for n in (7, 33, 60)]
    return requests


def prefill_sizes(monkeypatch):
    """The `[rows, width]` of every prefill the decoder runs, recorded."""
    from ortmodule.decoder import Decoder

    sizes, prefill = [], Decoder.prefill

    def recording(self, rows, *args, **kwargs):
        sizes.append(tuple(rows.ids.shape))
        return prefill(self, rows, *args, **kwargs)

    monkeypatch.setattr(Decoder, "prefill", recording)
    return sizes


def assert_same_answers(ours, reference):
    for (lp, greedy), (ref_lp, ref_greedy) in zip(ours, reference, strict=True):
        assert abs(lp - ref_lp) < 1e-4 and greedy == ref_greedy


@pytest.fixture(scope="module")
def hf_answers(build):
    """lm-eval hf's answers to `mixed_requests` on the llama fixture's weights."""
    from lm_eval.models.huggingface import HFLM

    fixture = build("llama")
    return HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                batch_size=4)._loglikelihood_tokens(mixed_requests(), disable_tqdm=True)


def test_requests_on_the_same_row_run_it_once(build, hf_answers, monkeypatch):
    """One-token choices after one context (the same row, HFLM's logits cache) reach the model once;
    every answer equals hf's."""
    from ortmodule.lm_eval import OrtModuleLM

    requests = mixed_requests()
    lm = OrtModuleLM(pretrained=str(build("llama").package_dir), device="cpu", batch_size=4, share_contexts="false")
    sizes = prefill_sizes(monkeypatch)
    assert_same_answers(lm._loglikelihood_tokens(requests, disable_tqdm=True), hf_answers)
    distinct = {(tuple((c + t)[:-1]), len(c)) for _, c, t in requests}
    assert sum(rows for rows, _ in sizes) == len(distinct) == len(requests) - 6 * 3


def test_a_row_that_is_another_requests_row_at_other_positions_is_scored_at_its_own(build):
    """Context [a] with continuation [b, c] and context [a, b] with [d] feed the model the same row
    [a, b]; the first is scored at both positions, the second at the last only. lm-eval 0.4.13's hf
    groups them by that row and reads both at the first one's positions (docs/lm-eval.md); ortmodule
    answers each as transformers does on the request alone."""
    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    _, hf = load_pair(fixture)
    requests = [(("", ""), [478], [57, 12]), (("", ""), [478, 57], [220]), (("", ""), [478, 57], [221])]
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4, share_contexts="false")
    for (_, context, continuation), (lp, _) in zip(requests, lm._loglikelihood_tokens(requests, disable_tqdm=True),
                                                   strict=True):
        with torch.no_grad():
            scores = torch.log_softmax(hf(torch.tensor([(context + continuation)[:-1]])).logits[0].double(), -1)
        expected = sum(scores[len(context) - 1 + k, token].item() for k, token in enumerate(continuation))
        assert abs(lp - expected) < 1e-5


def test_rolling_windows_of_the_same_tokens_split_elsewhere_are_each_scored_at_their_own(build):
    """A document that repeats itself ("word " 250 times: 1,000 tokens, windows of the fixture's 256) has a
    last window whose tokens are another window's, split at another point (25 of context and 232 scored,
    against 1 and 256): the same row, scored at other positions. lm-eval 0.4.13's hf reads the last one at
    the other's positions (-1551.2 where the window's own is -1548.7); ortmodule's total is the sum of each
    window's log-probabilities as transformers gives them on the window alone."""
    from lm_eval import utils
    from lm_eval.api.instance import Instance

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    _, hf = load_pair(fixture)
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4)
    document = "word " * 250
    windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
        token_list=lm.tok_encode(document), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)]
    (context, scored), (last_context, last_scored) = windows[1], windows[-1]
    assert len(last_context) > len(context) and (context + scored)[:-1] == (last_context + last_scored)[:-1]
    expected = 0.0
    for context, continuation in windows:
        row = (context + continuation)[-(lm.max_length + 1):][:-1]
        with torch.no_grad():
            scores = torch.log_softmax(hf(torch.tensor([row])).logits[0].double(), -1)
        expected += sum(scores[len(row) - len(continuation) + k, token].item() for k, token in enumerate(continuation))
    total = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)], disable_tqdm=True)[0]
    assert abs(total - expected) < 1e-2  # float32 sums of 1,000 log-probabilities; hf's is 2.5 off


def test_pad_to_multiple_of_rounds_every_width_up_with_the_same_answers(build, hf_answers, monkeypatch):
    """`pad_to_multiple_of=16`: every padded batch is a multiple of 16 tokens wide, except where
    rounding up would pass the context length, the answers are still hf's (the padding is masked),
    and under `batch_size=auto` the token budget holds for the padded widths."""
    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4, share_contexts="false",
                     pad_to_multiple_of="16")
    sizes = prefill_sizes(monkeypatch)
    assert_same_answers(lm._loglikelihood_tokens(mixed_requests(), disable_tqdm=True), hf_answers)
    assert sizes and all(width % 16 == 0 for _, width in sizes)
    assert len({width for _, width in sizes}) < len({len((c + t)[:-1]) for _, c, t in mixed_requests()})
    # Under batch_size=auto the token budget holds for the padded widths.
    auto = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size="auto", token_budget="120",
                       share_contexts="false", pad_to_multiple_of="16")
    sizes.clear()
    assert_same_answers(auto._loglikelihood_tokens(mixed_requests(), disable_tqdm=True), hf_answers)
    assert all(width % 16 == 0 and (rows * width <= 120 or rows == 1) for rows, width in sizes)
    assert any(rows > 1 for rows, _ in sizes)
    # A 60-token row under a 60-token context: 64 would not fit, so that batch stays 60 wide.
    monkeypatch.setattr(OrtModuleLM, "max_length", property(lambda self: 60))
    sizes.clear()
    lm._loglikelihood_tokens(mixed_requests(), disable_tqdm=True)
    assert max(width for _, width in sizes) == 60
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive integer"):
        OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", pad_to_multiple_of="0")


def test_one_token_choices_run_the_same_prefills_whatever_the_sharing(build, hf_answers, monkeypatch):
    """MMLU's shape (four one-token letters after a context): a question's four rows are one row, so
    `share_contexts` true, auto and false run the same prefills, each context once, with hf's answers."""
    from ortmodule import OrtModelForCausalLM, load_tokenizer
    from ortmodule.lm_eval import OrtModuleLM

    requests = [r for r in mixed_requests() if len(r[2]) == 1]
    reference = [a for r, a in zip(mixed_requests(), hf_answers, strict=True) if len(r[2]) == 1]
    fixture = build("llama")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cpu")
    sizes, runs = prefill_sizes(monkeypatch), {}
    for share in ("true", "auto", "false"):
        lm = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size=4,
                         share_contexts=share)
        start = len(sizes)
        assert_same_answers(lm._loglikelihood_tokens(requests, disable_tqdm=True), reference)
        runs[share] = sizes[start:]
    assert runs["true"] == runs["auto"] == runs["false"]
    assert sum(rows for rows, _ in runs["auto"]) == len({tuple(c) for _, c, _ in requests})


def test_batch_size_auto_batches_by_the_token_budget(build, hf_answers, monkeypatch):
    """Under `auto`, every prefill holds at most `token_budget` padded tokens (a lone longer row
    runs alone), the rows sorted by length so that little is padding; answers equal hf's, with
    context sharing on or off."""
    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    for share in ("false", "true"):
        lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size="auto", token_budget="120",
                         share_contexts=share)
        sizes = prefill_sizes(monkeypatch)
        assert_same_answers(lm._loglikelihood_tokens(mixed_requests(), disable_tqdm=True), hf_answers)
        assert all(rows * width <= 120 or rows == 1 for rows, width in sizes)
        if share == "false":  # the batched prefills: packed close to the budget, not one row each
            assert len(sizes) < sum(rows for rows, _ in sizes) / 2
            real = sum(len(row) for row in {tuple((c + t)[:-1]) for _, c, t in mixed_requests()})
            assert sum(rows * width for rows, width in sizes) < 1.2 * real
        monkeypatch.undo()
    assert lm._detect_batch_size() == max(1, 120 // lm.max_length)
    with pytest.raises(ValueError, match="token_budget must be a positive integer"):
        OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", token_budget="0")


def test_batch_size_auto_backs_off_on_onnx_runtime_out_of_memory(build, hf_answers, monkeypatch, caplog):
    """ONNX Runtime's allocation failure (simulated above 100 tokens a run: a CPU run cannot be
    made to run out of memory on purpose) halves the token budget, says so, and runs the batch
    again in halves; the answers equal hf's. With a fixed batch size the failure is the caller's error."""
    import onnxruntime as ort

    from ortmodule import runtime
    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    tokens, bind_input, run = {}, runtime.bind_input, ort.InferenceSession.run_with_iobinding
    ran = []

    def recording_bind_input(binding, name, tensor):
        if name == "input_ids":
            tokens[id(binding)] = tensor.numel()
        bind_input(binding, name, tensor)

    def limited_run(session, binding, run_options=None):
        if tokens.get(id(binding), 0) > 100:
            raise ort.capi.onnxruntime_pybind11_state.RuntimeException(
                "Failed to allocate memory for requested buffer of size 123456789")
        ran.append(tokens.get(id(binding), 0))
        return run(session, binding, run_options)

    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size="auto", share_contexts="false")
    monkeypatch.setattr(runtime, "bind_input", recording_bind_input)
    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", limited_run)
    assert_same_answers(lm._loglikelihood_tokens(mixed_requests(), disable_tqdm=True), hf_answers)
    assert lm.token_budget <= 100 and max(ran) <= 100
    assert f"batches now hold at most {lm.token_budget} padded tokens" in caplog.text
    fixed = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=16, share_contexts="false")
    with pytest.raises(RuntimeError, match="out of memory"):
        fixed._loglikelihood_tokens(mixed_requests(), disable_tqdm=True)


def run_cli(launcher, fixture, out, env=None, extra=(), model_args=""):
    import os
    import subprocess

    command = launcher + [
        "--model", "ortmodule", "--model_args", f"pretrained={fixture.package_dir}{model_args}", "--device", "cpu",
        "--tasks", "ortmodule_arithmetic_mc,ortmodule_arithmetic_gen",  # ortmodule's: no --include_path
        "--batch_size", "8", "--output_path", str(out), "--log_samples", *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-4000:]}"
    return done.stderr, {path.name.split("_2")[0]: sorted(map(json.loads, path.read_text().splitlines()),
                                                          key=lambda s: s["doc_id"])
            for path in out.rglob("samples_*.jsonl")}


def test_ortmodule_eval_names_a_bad_package_without_a_traceback(tmp_path):
    """A package that cannot be read (here: no folder) ends `ortmodule-eval` with ortmodule's message,
    as `ortmodule export` and `ortmodule serve` end, not with a traceback through lm-eval's."""
    import subprocess
    import sys

    missing = tmp_path / "no-package"
    done = subprocess.run([sys.executable, "-m", "ortmodule.cli", "--model", "ortmodule", "--model_args",
                           f"pretrained={missing}", "--device", "cpu", "--tasks", "ortmodule_arithmetic_mc"],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == f"ortmodule-eval: error: package folder not found: {missing}"
    assert "Traceback" not in done.stderr


def test_ortmodule_eval_names_a_bad_model_arg_without_a_traceback(llama):
    """A model arg the backend refuses (a precision the package was not exported in, a misspelt name, a
    value out of range) and one given twice (in --model_args and as lm-eval's own option, whose default
    lm-eval's command line passes: `--model hf` fails there with Python's "multiple values for keyword
    argument") end `ortmodule-eval` with the backend's message, not a traceback; from Python the error
    is a ValueError (a TypeError too where Python's would be one)."""
    import os
    import subprocess
    import sys

    from ortmodule.lm_eval import ModelArgsError, OrtModuleLM

    expected = {",dtype=float16": "dtype='float16': ",
                ",batch_size=8": "batch_size given twice: in the model args and as lm-eval's own option (--batch_size,",
                ",rewrite_lm_head=bf16": "rewrite_lm_head must be True, False or 'float32', got 'bf16'"}
    for model_args, message in expected.items():
        done = subprocess.run([sys.executable, "-m", "ortmodule.cli", "--model", "ortmodule", "--model_args",
                               f"pretrained={llama.package_dir}{model_args}", "--tasks", "ortmodule_arithmetic_mc"],
                              capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 1, done.stderr[-2000:]
        assert done.stderr.strip().splitlines()[-1].startswith(f"ortmodule-eval: error: {message}"), done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    context = llama.spec.context_length  # a longer max_length would fail at the first request over it, hours in
    for model_args, message in ((",share_context=false", "unknown model_args for the OrtModuleLM backend"),
                                (",max_length=0", "max_length must be a positive integer, got 0"),
                                (f",max_length={context + 1}", f"max_length={context + 1} is over the package's "
                                                               f"context length {context}"),
                                (",rewrite_lm_head=bf16", "rewrite_lm_head must be True, False or 'float32'"),
                                (",prefill_attention=sdpa", "prefill_attention must be one of auto, package, onnx"),
                                (",quantized_prefill=int4", "quantized_prefill must be one of auto, package, fp32"),
                                (",provider_options=xyz", "provider_options must be a dict")):
        with pytest.raises(ModelArgsError, match=message):  # what the command line prints (above)
            OrtModuleLM.create_from_arg_string(f"pretrained={llama.package_dir}{model_args}", {"device": "cpu"})
    extra = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}  # what lm-eval's command line passes
    with pytest.raises(ModelArgsError, match="batch_size given twice") as raised:
        OrtModuleLM.create_from_arg_string(f"pretrained={llama.package_dir},batch_size=4", extra)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, TypeError)
    with pytest.raises(TypeError, match="device given twice"):
        OrtModuleLM.create_from_arg_obj({"pretrained": str(llama.package_dir), "device": "cpu"}, extra)
    lm = OrtModuleLM.create_from_arg_string(f"pretrained={llama.package_dir},max_length=64", {**extra, "device": None})
    assert lm.batch_size == 1 and lm.max_length == 64 and lm.device.type == "cpu"


# CPU processes: a GPU, if the machine has one, stays out of it (lm-eval would give rank 1 a second GPU).
CPU_ONLY = {"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}


def two_process_launch():
    """`accelerate launch` of ortmodule-eval in 2 processes, on a free port (not the default 29500,
    which another run on the machine may hold)."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port), "-m", "ortmodule.cli"]


@pytest.mark.slow
def test_data_parallel_with_two_cpu_processes_equals_one(build, tmp_path):
    """`accelerate launch` with 2 CPU processes: each scores half the requests, results as one process.
    Context sharing is set, not decided: `auto` decides from each process's timings, and two processes
    on two cores time differently; shared and unshared loglikelihoods differ by float32 rounding."""
    import sys

    fixture = build("llama")
    args = ",share_contexts=false"
    _, single = run_cli([sys.executable, "-m", "ortmodule.cli"], fixture, tmp_path / "one", model_args=args)
    log, double = run_cli(two_process_launch(), fixture, tmp_path / "two", env=CPU_ONLY, model_args=args)
    assert "on rank 1" in log and "0/80" in log  # two ranks, 80 of the 160 loglikelihood requests each
    # Both left the process group before their interpreters finalized (gloo's threads, docs/lm-eval.md).
    assert all(f"rank {rank} left torch.distributed's process group" in log for rank in (0, 1)), log[-3000:]
    assert sorted(single) == sorted(double) == ["samples_ortmodule_arithmetic_gen", "samples_ortmodule_arithmetic_mc"]
    for task in single:
        assert len(single[task]) == len(double[task]) == 40
        for a, b in zip(single[task], double[task]):
            assert a["doc_id"] == b["doc_id"]
            if task.endswith("_gen"):
                assert a["filtered_resps"] == b["filtered_resps"]
            else:
                for (lp, greedy), (ref_lp, ref_greedy) in zip(a["filtered_resps"], b["filtered_resps"]):
                    assert abs(float(lp) - float(ref_lp)) < 1e-5 and greedy == ref_greedy


def test_the_lm_head_computes_in_float32_unless_asked_otherwise(build, tmp_path):
    """lm-eval's backend loads a package that casts half-precision logits to float32 (the builder's
    bf16 packages) with a float32 LM head: its loglikelihoods are not rounded to half precision
    first. `rewrite_lm_head=True` keeps the package's precision; an fp32 package is left as it is."""
    import torch
    from helpers import float32_logits_copy
    from lm_eval.api.registry import get_model

    fixture = build("llama", precision="fp16")
    casting = float32_logits_copy(fixture, tmp_path / "package")
    backend = get_model("ortmodule")
    assert backend(pretrained=str(casting), device="cpu")._model.decoder.head_dtype == torch.float32
    assert backend(pretrained=str(casting), device="cpu", rewrite_lm_head=True)._model.decoder.head_dtype == \
        torch.float16
    assert backend(pretrained=str(build("llama").package_dir), device="cpu")._model.decoder.head_dtype == \
        torch.float32


def test_quantized_prefill_model_arg_is_checked(build):
    from lm_eval.api.registry import get_model

    with pytest.raises(ValueError, match="quantized_prefill must be one of auto, package, fp32"):
        get_model("ortmodule")(pretrained=str(build("qwen3").package_dir), quantized_prefill="int4")


def test_hflm_model_args_that_would_change_the_numbers_are_refused_by_name(build, caplog):
    """HFLM's loading args (`hf`'s model_args) mean nothing for a package, whose weights and precision
    the export fixed: each that would change what is computed is a ValueError naming it, not ignored;
    `dtype` is accepted where it is the package's own precision (the same answers) and `parallelize`
    (placement only) is a warning."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    package = str(build("llama").package_dir)
    requests = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0)]
    backend = get_model("ortmodule")
    plain = backend(pretrained=package, device="cpu").loglikelihood(requests)
    assert backend(pretrained=package, device="cpu", dtype="float32").loglikelihood(requests) == plain
    assert backend(pretrained=package, device="cpu", softmax_dtype="float32").loglikelihood(requests) == plain
    with caplog.at_level("WARNING", logger="ortmodule"):
        assert backend(pretrained=package, device="cpu", parallelize=True).loglikelihood(requests) == plain
    assert "parallelize=True is ignored" in caplog.text
    refused = {"dtype": ("bfloat16", "computes in float32, fixed when it was exported"),
               "peft": ("adapter-folder", "asks for a PEFT adapter"),
               "delta": ("delta-folder", "asks for delta weights"),
               "autogptq": (True, "asks for GPTQ weights"), "gguf_file": ("model.gguf", "asks for a GGUF file"),
               "mixed_precision_dtype": ("bfloat16", "asks for an autocast"),
               "softmax_dtype": ("float64", "computes log-softmax in float32"),
               "backend": ("seq2seq", "a causal \\(decoder-only\\) model")}
    for name, (value, message) in refused.items():
        with pytest.raises(ValueError, match=f"{name}={value!r}.*{message}"):
            backend(pretrained=package, device="cpu", **{name: value})


def test_unknown_model_args_are_refused_by_name(build):
    """A model arg that is neither HFLM's, ortmodule's nor a transformers loading argument is a TypeError
    naming it, as `--model hf` fails on it in transformers (a misspelt `share_context=false` was silently
    ignored: the run shared contexts anyway); transformers' loading arguments a package takes pass as
    `OrtModelForCausalLM.from_pretrained` takes them, without effect or checked; `max_length`,
    `max_batch_size` and the batch size are checked when the backend is made (a batch size of 0 was
    "max() arg is an empty sequence" at the first batch; hf runs it as one batch of everything)."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    package = str(build("llama").package_dir)
    backend = get_model("ortmodule")
    requests = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0)]
    plain = backend(pretrained=package, device="cpu").loglikelihood(requests)
    for name in ("share_context", "prefil_chunk", "foo"):
        with pytest.raises(TypeError, match=f"unknown model_args for the OrtModuleLM backend: {name} .*share_contexts"):
            backend(pretrained=package, device="cpu", **{name: False})
    accepted = {"attn_implementation": "sdpa", "low_cpu_mem_usage": True, "device_map": "cpu",
                "torch_dtype": "float32", "local_files_only": True}
    for name, value in accepted.items():
        assert backend(pretrained=package, device="cpu", **{name: value}).loglikelihood(requests) == plain, name
    checked = {"torch_dtype": ("float16", ValueError, "computes in float32"),
               "load_in_4bit": (True, ValueError, "load_in_4bit: a GenAI package's weights"),
               "device_map": ("cuda:1", ValueError, "name different devices"),
               "max_length": (-5, ValueError, "max_length must be a positive integer, got -5"),
               "max_batch_size": (0, ValueError, "max_batch_size must be a positive integer, got 0"),
               "batch_size": (0, ValueError, "batch_size must be a positive integer, auto or auto:N, got 0")}
    for name, (value, error, message) in checked.items():
        with pytest.raises(error, match=message):
            backend(pretrained=package, device="cpu", **{name: value})


def few_shot_requests(questions: int = 6):
    """Requests shaped as lm-eval's 5-shot MMLU: three subjects whose `questions` all start with the
    subject's 40-token examples, then a question of 3-10 tokens; four one-token letters for most
    questions, longer choices for some."""
    import random

    rng = random.Random(1)
    requests = []
    for _ in range(3):
        examples = [rng.randrange(3, 500) for _ in range(40)]
        for q in range(questions):
            context = examples + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 11))]
            width = 1 if q % 3 else rng.randrange(2, 5)
            requests += [(("", ""), context, [rng.randrange(3, 500) for _ in range(width)]) for _ in range(4)]
    return requests


def test_few_shot_questions_run_their_shared_examples_once(build, monkeypatch):
    """Questions that start with the same examples (5-shot MMLU's subjects): with sharing on, each
    subject's examples are prefilled once and every question continues from a copy of their KV, so
    the prefills hold far fewer tokens than the questions' rows; answers equal hf's with sharing
    on, auto and off."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    requests = few_shot_requests()
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=4)._loglikelihood_tokens(requests, disable_tqdm=True)
    sizes = prefill_sizes(monkeypatch)
    tokens = {}
    for share in ("true", "auto", "false"):
        lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=8, share_contexts=share)
        start = len(sizes)
        assert_same_answers(lm._loglikelihood_tokens(requests, disable_tqdm=True), reference)
        tokens[share] = sum(rows * width for rows, width in sizes[start:])
    rows = {(tuple((c + t)[:-1]), len(c)) for _, c, t in requests}
    assert tokens["false"] >= sum(len(row) for row, _ in rows)
    # Sharing on: 18 questions' rows, three subjects' prefixes (a batch of 8 rows runs its prefix once).
    assert tokens["true"] < tokens["false"] / 3


def test_a_subjects_examples_run_once_for_all_its_batches(build, monkeypatch):
    """A subject's questions in several batches (14 questions, batches of 4 rows): its examples are
    prefilled in the first batch only, the later batches start from their KV (`sharing.KeptPrefixes`),
    and every answer equals hf's."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    requests = few_shot_requests(questions=14)
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=4)._loglikelihood_tokens(requests, disable_tqdm=True)
    sizes = prefill_sizes(monkeypatch)
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=4, share_contexts="true")
    assert_same_answers(lm._loglikelihood_tokens(requests, disable_tqdm=True), reference)
    # Each subject's 40 tokens of examples once (without: once a batch, 21 times). The rest: the graphs'
    # checks at their first runs, a question whose choices share its context, the rows in no group.
    assert [size for size in sizes if size[1] == 40] == [(1, 40)] * 3


def test_a_few_shot_generation_tasks_examples_run_once_for_all_its_batches(build, monkeypatch):
    """`generate_until` over a few-shot task's prompts (the same examples, then a question) in several
    batches: on a CPU the examples run once, in the first batch, and the later batches start from their
    kept KV (`shared_prompts.keeping`); the answers are the `hf` backend's."""
    import random

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    ours = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=3, max_batch_size=3)
    theirs = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", batch_size=3, device="cpu")
    rng = random.Random(11)

    def words(n):
        return " ".join(ours.tokenizer.decode([rng.randrange(3, 500)]) for _ in range(n))

    examples = words(60)
    requests = [Instance("generate_until", None, (f"{examples} {words(rng.randint(3, 12))}",
                                                  {"until": ["\n\n"], "max_gen_toks": 12}), i) for i in range(9)]
    sizes = prefill_sizes(monkeypatch)
    assert ours.generate_until(requests, disable_tqdm=True) == theirs.generate_until(requests, disable_tqdm=True)
    beginnings = [width for rows, width in sizes if rows == 1]
    assert len(beginnings) == 1 and beginnings[0] > 100  # the examples, once for the three batches


def test_thinking_generations_are_cut_as_hflm_cuts_them(build):
    """`enable_thinking=True` with a `think_end_token` (text, or a token id): each answer is what follows
    the token, as HFLM gives it; a loglikelihood request gets HFLM's refusal."""
    import random

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    plain = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=3)
    rng = random.Random(5)
    requests = [Instance("generate_until", None, (" ".join(plain.tokenizer.decode([rng.randrange(3, 500)])
                                                           for _ in range(12 + i)),
                                                  {"until": ["\n\n"], "max_gen_toks": 12}), i) for i in range(5)]
    answers = plain.generate_until(requests, disable_tqdm=True)
    token = plain.tokenizer(answers[0]).input_ids[2]  # a token the first answer holds past its start
    for end in (token, plain.tokenizer.decode([token])):
        options = dict(enable_thinking=True, think_end_token=end, batch_size=3, device="cpu")
        ours = OrtModuleLM(pretrained=str(fixture.package_dir), **options)
        theirs = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", **options)
        got = ours.generate_until(requests, disable_tqdm=True)
        assert got == theirs.generate_until(requests, disable_tqdm=True) and got[0] != answers[0]
    with pytest.raises(ValueError, match="enable_thinking=True is not compatible with loglikelihood"):
        ours.loglikelihood([Instance("loglikelihood", None, ("a b", " c"), 0)], disable_tqdm=True)


def test_generation_batches_by_their_work():
    """`generate_until`'s batches (`generation_batches`): HFLM's order (requests grouped by their
    settings in the order they come, the longest first), as many to a batch as the budget holds at its
    first row's tokens, never fewer than a fixed size nor more than the most."""
    from ortmodule.lm_eval import generation_batches

    keys = ["a", "b", "a", "a", "b", "a", "a"]
    widths = [30, 5, 90, 10, 50, 30, 60]
    order = [(-w, f"text {i}") for i, w in enumerate(widths)]
    tokens = [w + (10 if k == "a" else 50) for w, k in zip(widths, keys)]
    # group a, longest first: 2 (100), 6 (70), 0 and 5 (40; ties by text), 3 (20); group b: 4 (100), 1 (55)
    assert generation_batches(keys, order, tokens, None, 200, 64) == [[2, 6], [0, 5, 3], [4, 1]]
    assert generation_batches(keys, order, tokens, 1, 200, 64) == [[2, 6], [0, 5, 3], [4, 1]]
    assert generation_batches(keys, order, tokens, None, 10_000, 2) == [[2, 6], [0, 5], [3], [4, 1]]
    assert generation_batches(keys, order, tokens, 3, 50, 64) == [[2, 6, 0], [5, 3], [4, 1]]  # at least 3
    assert generation_batches(keys, order, tokens, None, 50, 64) == [[2], [6], [0], [5], [3], [4], [1]]
    assert generation_batches([], [], [], 1, 100, 64) == []


def test_generate_until_runs_many_requests_a_batch_at_batch_size_one_and_auto(build, monkeypatch):
    """lm-eval's default batch size of 1 and `auto` (whose HFLM search sizes a generation batch for
    rows of the model's whole context: one row) run a task's requests in batches by their tokens,
    with the `hf` backend's answers at batch size 1 (on a CPU a row's numbers do not depend on the
    rows beside it); a token budget bounds the batches under `auto`, and `max_batch_size` both."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    theirs = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", batch_size=1, device="cpu")
    requests, _ = stop_requests(theirs, seed=4)
    requests += [Instance("generate_until", None, (req.args[0] + " b", {"until": ["\n"], "max_gen_toks": 6}), 8 + i)
                 for i, req in enumerate(requests[:4])]
    expected = theirs.generate_until(requests, disable_tqdm=True)
    longest = max(len(theirs.tok_encode(req.args[0])) for req in requests[:8]) + 32

    def batches(**args):
        ours = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", **args)
        rows, generate = [], ours._model_generate

        def counted(context, **kwargs):
            rows.append(context.shape[0])
            return generate(context=context, **kwargs)

        monkeypatch.setattr(ours, "_model_generate", counted)
        assert ours.generate_until(requests, disable_tqdm=True) == expected
        return rows

    assert batches(batch_size=1) == [8, 4]  # the two settings apart, as HFLM batches them
    assert batches(batch_size="auto") == [8, 4]
    assert batches(batch_size="auto", token_budget=2 * longest) == [2, 2, 2, 2, 4]
    assert batches(batch_size=1, max_batch_size=3) == [3, 3, 2, 3, 1]


def preamble_requests(preamble: int, question: tuple[int, int], seed: int = 2):
    """Questions after one fixed preamble (TruthfulQA's six example answers, or a short shared
    start), each with four multi-token choices."""
    import random

    rng = random.Random(seed)
    start = [rng.randrange(3, 500) for _ in range(preamble)]
    requests = []
    for _ in range(5):
        context = start + [rng.randrange(3, 500) for _ in range(rng.randrange(*question))]
        requests += [(("", ""), context, [rng.randrange(3, 500) for _ in range(rng.randrange(2, 5))])
                     for _ in range(4)]
    return requests


def short_questions(questions: int = 12):
    """Requests shaped as ARC's: a context of 6-12 tokens and four choices of 1-3 tokens each."""
    import random

    rng = random.Random(2)
    requests = []
    for _ in range(questions):
        context = [rng.randrange(3, 500) for _ in range(rng.randrange(6, 13))]
        requests += [(("", ""), context, [rng.randrange(3, 500) for _ in range(rng.randrange(1, 4))]) for _ in range(4)]
    return requests


def test_batches_hold_short_questions_and_rows_by_their_work():
    """`group_batches`: a batch takes groups while their rows fit the batch size, and more while their
    work stays under `SMALL_WORK`; a group without a work (a few-shot piece) by its rows only; a group
    over the budget alone; every request once, in order. `fixed_batch_end`: padded rows, the same way."""
    from ortmodule.lm_eval import SMALL_WORK, fixed_batch_end, group_batches

    rows = [[1] * 12] * 40 + [[1] * 200] * 8
    groups = [[4 * g + k for k in range(4)] for g in range(10)] + [[40, 41], [42, 43, 44, 45, 46, 47]]
    works = [100] * 10 + [None, 190]
    batches = list(group_batches(groups, works, rows, lambda width: 8, SMALL_WORK))
    assert [i for batch in batches for i, _ in batch] == list(range(48))
    assert all(g == next(h for h, group in enumerate(groups) if i in group) for batch in batches for i, g in batch)
    kept = [sorted({g for _, g in batch}) for batch in batches]
    per_batch = SMALL_WORK // 100  # by their rows alone: two questions a batch
    assert kept[:2] == [list(range(per_batch)), list(range(per_batch, 2 * per_batch))]
    assert kept[-1] == [10, 11]  # by their rows (2 + 6), not by their work
    def sizes(groups, works, width, most, small=SMALL_WORK):
        return [len(batch) for batch in group_batches(groups, works, [[1] * width] * 4, lambda _: most, small)]

    assert sizes([[0, 1], [2, 3]], [900, 10], 60, 2) == [2, 2]  # a group over the budget alone
    assert sizes([[0], [1], [2]], [10] * 3, 9, 1) == [3]  # at batch size 1 too
    assert sizes([[0], [1], [2]], [10] * 3, 9, 1, small=0) == [1] * 3  # under `auto`: by the token budget only
    widths = [100, 60, 60, 30] + [12] * 60
    ends = [0]
    while ends[-1] < len(widths):
        ends.append(fixed_batch_end(ends[-1], 2, widths, SMALL_WORK))
    assert ends == [0, 5, 47, 64]  # five rows padded to 100 (500 tokens), 42 of 12 (504), the last 17
    assert all((end - start) * widths[start] <= SMALL_WORK or end - start <= 2 for start, end in zip(ends, ends[1:]))


def test_short_questions_share_batches_and_score_as_hf(build, monkeypatch):
    """ARC-shaped questions with sharing on, batch size 8: several questions' contexts in one prefill
    (counted by rows, a batch of 8 held two questions, a prefill each), every answer equal to hf's."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    requests = short_questions()
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=8)._loglikelihood_tokens(requests, disable_tqdm=True)
    lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=8, share_contexts="true")
    lm.model.decoder.extender()  # made (and checked by a prefill of its own) before the prefills are counted
    sizes = prefill_sizes(monkeypatch)
    assert_same_answers(lm._loglikelihood_tokens(requests, disable_tqdm=True), reference)
    assert sum(rows for rows, _ in sizes) == 12 and len(sizes) <= 3  # by rows alone: 6 prefills of 2 contexts


def test_a_long_preamble_is_shared_across_questions_a_short_one_is_not():
    """`sharing_groups`: after a 40-token preamble, questions of 3-6 tokens run as one group (the
    preamble once, each choice's question and answer after it: fewer tokens than each question's
    context once); after a 33-token start, questions of 40-60 tokens keep their own context groups."""
    from ortmodule.lm_eval import distinct_rows, sharing_groups

    def groups_of(requests, worth=None):
        rows = [(c + t)[:-1] for _, c, t in requests]
        starts = [len(c) - 1 for _, c, _ in requests]
        return sorted(sorted(g) for g in sharing_groups(requests, rows, starts, distinct_rows(rows, starts),
                                                        lambda width: 64, worth))

    questions = [list(range(q, q + 4)) for q in range(0, 20, 4)]
    assert groups_of(preamble_requests(40, (3, 7))) == [list(range(20))]
    assert groups_of(preamble_requests(33, (40, 61))) == questions
    # A preamble's group that is not worth it (`auto`'s costs) leaves the questions their own groups.
    assert groups_of(preamble_requests(40, (3, 7)), worth=lambda group: len(group) < 10) == questions
    assert groups_of(preamble_requests(40, (3, 7)), worth=lambda group: False) == []


def test_questions_after_a_preamble_score_as_hf_does(build):
    """The preamble shared across questions: every answer equals hf's, with sharing on and off."""
    from lm_eval.models.huggingface import HFLM

    from ortmodule.lm_eval import OrtModuleLM

    fixture = build("llama")
    requests = preamble_requests(40, (3, 7))
    reference = HFLM(pretrained=str(fixture.hf_dir), dtype="float32", device="cpu",
                     batch_size=4)._loglikelihood_tokens(requests, disable_tqdm=True)
    for share in ("true", "false"):
        lm = OrtModuleLM(pretrained=str(fixture.package_dir), device="cpu", batch_size=32, share_contexts=share)
        assert_same_answers(lm._loglikelihood_tokens(requests, disable_tqdm=True), reference)


def test_prefill_attention_model_arg_runs_the_prefill_graph(build, hf_answers, monkeypatch):
    """`prefill_attention=onnx`: lm-eval's padded rows run in the prefill graph (extend.py) and the
    answers equal hf's; a choice not known is refused by name."""
    from lm_eval.api.registry import get_model

    from ortmodule import extend

    runs = []
    run = extend.CausalPrefill.run
    monkeypatch.setattr(extend.CausalPrefill, "run", lambda self, *a: runs.append(a) or run(self, *a))
    lm = get_model("ortmodule")(pretrained=str(build("llama").package_dir), device="cpu", batch_size=4,
                                share_contexts="false", prefill_attention="onnx", prefill_chunk="0")
    assert_same_answers(lm._loglikelihood_tokens(mixed_requests(), disable_tqdm=True), hf_answers)
    assert len(runs) > 1  # the load's check, then lm-eval's batches
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, package, onnx"):
        get_model("ortmodule")(pretrained=str(build("llama").package_dir), prefill_attention="sdpa")
