"""What the lm-eval benchmarks share: loading each backend, the clock on its loglikelihood calls,
and the agreement of two runs' answers."""

import gc
import time
from pathlib import Path

import torch
from lm_eval.api.registry import get_model

import ortmodule.lm_eval  # noqa: F401  (registers the backend)

TASK_DIR = str(Path(__file__).parent / "tasks")
# ortmodule with its context sharing decided from the measured costs (auto), off, and always on.
# `ortmodule-compiled-normalizers` and `ortmodule-lm-eval-stops` load as `ortmodule` (their tests set
# scoring.COMPILED_NORMALIZERS, and lm-eval's own stopping criteria).
SHARING = {"ortmodule": "auto", "ortmodule-share-off": "false", "ortmodule-share-on": "true",
           "ortmodule-compiled-normalizers": "auto", "ortmodule-lanes-off": "auto", "ortmodule-lm-eval-stops": "auto"}


# Per backend of the at-scale suite (benchmarks/test_scale.py): where it runs (`at_scale_skip`), and why only there.
_WHERE = {
    "ortmodule-chunks-off": (lambda w, d, p: d == "cpu" and w not in ("hellaswag", "arc", "fewshot"),
                             "prefill chunks are a CPU choice, for rows of 512 tokens and more (not HellaSwag's or "
                             "ARC's; MMLU's measures it, not its 5-shot subjects')"),
    "ortmodule-tokenize-first": (lambda w, d, p: d != "cpu" and w != "rolling",
                                 "tokenizing ahead is CUDA's choice, for loglikelihood requests (a CPU encodes every "
                                 "text first)"),
    "transformers-bf16": (lambda w, d, p: d == "cpu" and p == "fp32",
                          "transformers in bf16 beside an fp32 package on a CPU (lm-eval's dtype auto on SmolLM2's "
                          "bf16 checkpoint; AMX runs bf16 matmuls); a GPU's packages are bf16 and so is its "
                          "transformers row"),
    "ortmodule-bf16-head": (lambda w, d, p: p == "bf16" and w in ("mmlu", "rolling"),
                            "the LM head's precision is a bf16 package's choice, measured where bf16 ties cost "
                            "choices (mmlu) and where every position reaches the head (rolling)"),
    "ortmodule-pad64": (lambda w, d, p: d != "cpu" and w in ("mmlu", "rolling"),
                        "rounding widths up to few shapes is a question of CUDA's per-shape costs, asked where widths "
                        "vary most (mmlu) and where most windows are one width (rolling)"),
    "ortmodule-prefill-onnx": (lambda w, d, p: d != "cpu" and w in ("mmlu", "rolling"),
                               "the prefill graph (prefill_attention=onnx) replaces CUDA's GroupQueryAttention "
                               "prologue, asked where it took 21% (mmlu) and where every row is long (rolling); a CPU "
                               "runs long rows in chunks"),
    "ortmodule-compiled-normalizers": (lambda w, d, p: d != "cpu" and w == "rolling",
                                       "the normalizers as one compiled reduction (scoring.COMPILED_NORMALIZERS): "
                                       "where every position is scored (rolling: about a fifth of a batch's device "
                                       "time on an H200), to make it CUDA's default"),
    "ortmodule-lanes-off": (lambda w, d, p: d == "cpu" and w in ("hellaswag", "arc", "fewshot"),
                            "a shared context's continuations packed several to a row of the extend run "
                            "(sharing.choose_lanes) are measured where a CPU shares contexts by default and "
                            "continuations differ in length"),
    "ortmodule-no-cuda-graph": (lambda w, d, p: d != "cpu" and w == "mmlu",
                                "CUDA graphs are CUDA's (on by default for half-precision packages since 2026-12-04): "
                                "does scoring run as fast with them on as off (mmlu)"),
    "ortmodule-lm-eval-stops": (lambda w, d, p: w == "gsm8k",
                                "lm-eval's own stopping criteria are a generation's choice (gsm8k)"),
}
GENERATION_BACKENDS = ("hf", "ortmodule", "ortmodule-lm-eval-stops")


def at_scale_skip(workload: str, backend: str, device: str, precision: str) -> str | None:
    """Why `backend` does not run `workload` on `device` with a package of `precision`, or None where it runs."""
    if workload == "rolling" and backend in ("ortmodule-share-off", "ortmodule-share-on"):
        return "documents share no context: the sharing choice does not apply"
    if workload == "gsm8k" and backend not in GENERATION_BACKENDS:
        return "generation (gsm8k) has no context sharing, chunks or head variants to compare"
    runs, reason = _WHERE.get(backend, (lambda w, d, p: True, ""))
    return None if runs(workload, device, precision) else reason


def load(backend, fixture, batch_size, device):
    """lm-eval's model object for a benchmark row. On a GPU, what earlier rows left in torch's caching
    allocator (tens of GB after transformers' rows: all-position logits of 64 rows) goes back to the
    driver first, so that every row starts from the same free memory."""
    if device != "cpu":
        gc.collect()
        torch.cuda.empty_cache()
    if backend in SHARING:
        lm = get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                    share_contexts=SHARING[backend])
        extender = lm.model.decoder.extender()
        if backend == "ortmodule-lanes-off" and extender is not None:  # a shared context's rows one to a lane
            extender.packs = False
        return lm
    if backend == "ortmodule-chunks-off":  # long rows in one prefill (ortmodule/chunked.py's choice undone)
        return get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                      prefill_chunk=0)
    if backend == "ortmodule-bf16-head":  # the package's own bf16 LM head (lm-eval's default is float32's)
        return get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                      rewrite_lm_head=True)
    if backend == "ortmodule-pad64":  # batch widths rounded up to a multiple of 64 tokens: few distinct shapes
        return get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                      pad_to_multiple_of=64)
    if backend == "ortmodule-prefill-onnx":  # padded rows in the prefill graph (ONNX's Attention, no KV written)
        return get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                      prefill_attention="onnx")
    if backend == "ortmodule-no-cuda-graph":  # the session without generate's CUDA graphs (on by default), scoring
        return get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size,
                                      provider_options={"enable_cuda_graph": "0"})
    if backend == "ortmodule-tokenize-first":  # every text encoded before the first batch, as on a CPU
        lm = get_model("ortmodule")(pretrained=str(fixture.package_dir), device=device, batch_size=batch_size)
        lm._first_wave = None
        return lm
    if backend == "hf":
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int4": "float32"}[fixture.spec.precision]
        return get_model("hf")(pretrained=str(fixture.hf_dir), dtype=dtype, device=device, batch_size=batch_size)
    if backend == "transformers-bf16":  # what lm-eval's `hf` runs by default (dtype auto) on a bf16 checkpoint
        return get_model("hf")(pretrained=str(fixture.hf_dir), dtype="bfloat16", device=device, batch_size=batch_size)
    # lm-eval's ONNX backends, and the two peers built on their base, run batch 1 only.
    return get_model(backend)(pretrained=str(fixture.package_dir),
                              execution_provider="cuda" if device != "cpu" else "cpu")


class Clock:
    """Seconds spent inside `owner.name` while the test runs (patched through `monkeypatch`): for
    lm-eval, the backend's `loglikelihood` (or `loglikelihood_rolling`: tokenizing and scoring the
    requests, answers on the host), the part of an evaluation that depends on the backend."""

    def __init__(self, monkeypatch, owner, name: str = "loglikelihood"):
        self.seconds = 0.0
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        monkeypatch.setattr(owner, name, timed)


class ShapeLog:
    """The `[rows, width]` of every prefill ortmodule's decoder runs while the test runs: how many
    prefills, how many distinct input shapes ONNX Runtime met (a device may pay per new one), their
    rows (an MMLU question is one row when its four letters are one token each) and padded tokens
    (rows x width: with the device's time, its cost per token, comparable with profile_gpu.py's
    replay of one batch stream)."""

    def __init__(self, monkeypatch):
        from ortmodule.decoder import Decoder

        self.shapes = []
        original = Decoder.prefill

        def logged(decoder, rows, *args, **kwargs):
            self.shapes.append(tuple(rows.ids.shape))
            return original(decoder, rows, *args, **kwargs)

        monkeypatch.setattr(Decoder, "prefill", logged)

    def summary(self) -> dict:
        return {"prefills": len(self.shapes), "distinct_shapes": len(set(self.shapes)),
                "rows": sum(rows for rows, _ in self.shapes),
                "padded_tokens": sum(rows * width for rows, width in self.shapes)}


class BatchTimes:
    """Where an lm-eval run's batches spend their time (ortmodule rows): the host's seconds inside
    `loglikelihood_totals` and `grouped_loglikelihood_totals` (a batch built, queued and, on CUDA,
    not waited for; padded rows or shared prefixes) and inside ONNX
    Runtime's runs, and on CUDA the device's seconds between events recorded around each batch
    (the batch's kernels, and any wait of the device for the host inside it). Host inside the runs
    near the batches' time: ONNX Runtime blocks; the device's time near it: the device is slower
    than one batch's profile says (a cost per new shape); neither: the host's Python."""

    def __init__(self, monkeypatch, device: str):
        from ortmodule import lm_eval as backend
        from ortmodule import runtime

        self.events = []
        names = ("loglikelihood_totals", "grouped_loglikelihood_totals")
        if device != "cpu":
            for name in names:
                monkeypatch.setattr(backend, name, self._between_events(getattr(backend, name)))
        self.calls = [Clock(monkeypatch, backend, name) for name in names]
        self.runs = Clock(monkeypatch, runtime.Session, "run")

    def _between_events(self, totals):
        def between_events(*args, **kwargs):
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
            try:
                return totals(*args, **kwargs)
            finally:
                self.events[-1][1].record()

        return between_events

    def summary(self) -> dict:
        found = {"calls_host_s": round(sum(clock.seconds for clock in self.calls), 3),
                 "runs_host_s": round(self.runs.seconds, 3)}
        if self.events:
            torch.cuda.synchronize()
            found["device_s"] = round(sum(a.elapsed_time(b) for a, b in self.events) / 1e3, 3)
        return found


def answers(result, task: str) -> list[tuple[float, bool]]:
    """Per request, (loglikelihood, is_greedy); a rolling request's answer is its loglikelihood alone, a
    generation's (text, False)."""
    found = []
    for sample in result.get("samples", {}).get(task, []):
        for resp in sample["resps"]:
            answer = resp[0]
            found.append(tuple(answer) if isinstance(answer, (list, tuple)) else (answer, False))
    return found


def record_agreement(benchmark, name: str, mine, theirs, choices: int = 4) -> None:
    """`max_ll_diff_vs_<name>`: the largest loglikelihood difference between two runs' answers;
    `same_choice_as_<name>`: the share of questions whose chosen answer (the argmax over the four
    choices) is the same (none for `choices=0`: whole documents); for generations (text answers)
    `same_answer_as_<name>`, the share of answers that are the same text. Nothing when the runs
    answered different requests."""
    if not theirs or len(theirs) != len(mine):
        return
    if isinstance(mine[0][0], str):  # generations: `same_answer_as_<name>`, the share of equal texts
        benchmark.extra_info[f"same_answer_as_{name}"] = round(sum(a == b for a, b in zip(mine, theirs)) / len(mine), 4)
        return
    benchmark.extra_info[f"max_ll_diff_vs_{name}"] = round(max(abs(a[0] - b[0]) for a, b in zip(mine, theirs)), 4)
    if not choices:
        return
    chosen = [[max(range(choices), key=lambda i, r=rows: r[i][0]) for rows in zip(*[iter(x)] * choices)]
              for x in (mine, theirs)]
    benchmark.extra_info[f"same_choice_as_{name}"] = round(sum(a == b for a, b in zip(*chosen)) / len(chosen[0]), 4)
