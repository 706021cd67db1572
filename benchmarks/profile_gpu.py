"""Where the time of GPU scoring goes: one lm-eval-shaped loglikelihood batch (32 rows of ~200
tokens, 4 continuation tokens each) through ortmodule and through transformers (bf16, sdpa) on the
same weights, profiled with torch's profiler, which records ONNX Runtime's kernels as well (CUPTI
sees every kernel in the process). Prints wall time per batch, the summed kernel time (the rest is
the host: launches, Python, syncs), and the top kernels of each.

    python benchmarks/profile_gpu.py [--spec qwen3-0.6b-bf16] [--batch 32] [--length 200]
        [--extra-option KEY=VALUE ...] [--only ortmodule] [--shared | --rolling | --score N | --decode N]

`--shared` profiles context sharing instead (lm-eval's `share_contexts`): a HellaSwag-shaped batch
(`--batch` rows: groups of 4 continuations of 15-40 tokens after a context of about `--length`
tokens) as padded rows (`scoring.loglikelihood_totals`, what sharing off runs) and with each context
run once and the continuations in one extend run over copies of its KV
(`scoring.grouped_loglikelihood_totals`), with the time of each of the shared path's steps. On an
H100 the shared path ran 1.8-2.4x slower than the padded rows at lm-eval's scale
(docs/measurements.md); this shows where. `--size cpu --spec smollm2-fp32 --device cpu` runs it on
a CPU (the device's kernels then are not recorded).

`--rolling` profiles lm-eval's `loglikelihood_rolling` instead: `--batch` windows of `--length` tokens
(on the GPU suite's rolling workload, 8 windows of 4,096), every position scored, through the lm-eval
backend's path (`scoring.loglikelihood_totals(..., greedy=False)`: the logits of every position, their
normalizers, the targets' log-probabilities, no greedy token) and through transformers as lm-eval's
`hf` scores them (a log-softmax over all the logits in the model's precision, then the gather).
Rolling ran at 1.38x transformers on an H100 where the target is 2x; the kernel split shows how much
of it is the LM head and the normalizers (on an H200, session 58: 35 of a batch's 195 ms went to the
normalizers' float32 conversion and log-softmax). `--compiled-normalizers` runs them as one compiled
reduction instead (scoring.COMPILED_NORMALIZERS; it compiles during the untimed first call).
`--float32-head` loads the model as the lm-eval backend does (`rewrite_lm_head="float32"`: a bf16
package's LM head multiplies in float32, float32 logits) where the profile's default is the bf16 head.

`--shapes N` replays an lm-eval run's stream of batches instead: N batches of `--batch` rows of
`--length` +- 300 tokens (MMLU-shaped: four one-token requests per row), longest first, so that
nearly every batch has a width not seen before, as in lm-eval; each batch is queued as lm-eval's
backend queues it (`scoring.loglikelihood_totals`, no wait for the device), and the answers are read
once at the end. Four passes: the widths as they come (new shapes), the same batches again (shapes
seen), then the widths rounded up to a multiple of `--pad-multiple` (new, then seen). Per pass: the
wall time, the host's time inside the calls and inside ONNX Runtime's runs, and the device's time
(CUDA events): the GPU suite's MMLU rows spent 11.3 s in their batches where one batch's profile
says ~5.9 s of device work, and this tells whether new shapes are what costs the rest.

`--lm-eval WORKLOAD` (mmlu, fewshot, hellaswag, arc) profiles the real thing: `--questions` questions
of the suite's at-scale workload through lm-eval's ortmodule backend (`--share` its share_contexts),
first clocked with where the batches' time went (host inside the calls and ONNX Runtime's runs,
device between events), then under the profiler with the kernels' whole names. On an H200 it showed
MMLU device-bound, ONNX Runtime's rotary + KV append its largest kernel (docs/measurements.md).

`--score N` profiles the score server's call instead (`scoring.label_logprobs`, what a group of
requests runs): N requests of SGLang's score shape (`--query-tokens` 120, `--items` 10 of
`--item-tokens` 180, 2 labels) at the server's token budget, every prompt whole and each query run
once (its KV copied to its items' rows, the items in one extend run), with the shared path's steps and
the way the model's measured costs choose: on an H200 the server saturated at about 930 items/s, the
padded rows' rate, and this tells whether running each query once pays on the device.

`--decode N` profiles greedy decoding instead: `--batch` rows after prompts of `--length` tokens, N
steps (no end of sequence), through ortmodule's generate and onnxruntime-genai's Generator on the
same package: a step's time (N + 1 new tokens less 1, over N), for ortmodule the host's time inside
ONNX Runtime's runs (on CUDA, launching the kernels) and outside them (ortmodule's own Python), and
under the profiler the kernels a step launches and their device time. On an H200 ortmodule without
CUDA graphs took about 6 ms a step at batch 1 where the Generator took 3.7 (docs/measurements.md,
session 57); on a CPU ortmodule's own Python is some 40 us a step: this says which kernels differ.

`--repeat-kv` builds the extend graph (the shared path's run: `--shared`, `--score`, `--lm-eval` with
sharing) with each KV head repeated for its query heads before `Attention` on CUDA, as ortmodule did
until session 58 (extend.REPEAT_KV_HEADS_ON_CUDA; its `Attention` now takes the grouped heads as they
are, 15-17% faster on an H200): run a mode with and without it to see what the repeat costs.

`--extend-layout cache` builds the extend graph in ONNX's external-cache form (extend.extend_graph:
the new KV written after each row's past by `TensorScatter`, `Attention` over each row's keys with
`is_causal`), which ONNX Runtime's CUDA kernel runs as flash attention where the default mask form
falls back to its unfused kernel: run `--shared` or `--lm-eval fewshot --share true` with and without it.

`--prefill-attention onnx` loads the model with its runs without a cache (scoring's padded rows,
every mode but the shared path's extend runs) in the prefill graph (extend.py: ONNX's `Attention`
instead of GroupQueryAttention, no KV written): run a mode with and without it to see what
GroupQueryAttention's prologue kernel costs there.

`--provider-option KEY=VALUE` and `--session-option NAME=VALUE` (repeatable) load the sessions with
that CUDA provider option or ONNX Runtime session option (e.g. `--session-option enable_mem_pattern=0`,
`--provider-option arena_extend_strategy=kSameAsRequested`), to tell which of ONNX Runtime's
per-shape mechanisms a cost belongs to.

`--extra-option` exports a variant of the package with that model-builder option (repeatable, e.g.
fuse_mlp_gate_up=true, fuse_qkv=false), so that graph options can be measured one at a time;
`of peak` counts 2 x the decoder's body weights x the real tokens (`conftest.weight_counts`: neither the
embedding nor the LM head), plus 2 x the LM head's weights x the positions scored, over the data sheet's
dense bf16 peak (before session 77 the LM head was counted at every token too: 1.26-1.35x too high).
"""

import argparse
import contextlib
import dataclasses
import re
import sys
import time
from pathlib import Path

import torch
from conftest import GPU_DATASHEET, SIZES, weight_counts
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from ortmodule import OrtModelForCausalLM, extend, runtime, scoring
from ortmodule.cache import KVCache
from ortmodule.inputs import pad_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats=10):
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


@contextlib.contextmanager
def runs_clocked():
    """While open, the host's time inside ONNX Runtime's runs (ortmodule's `Session.run`) adds up in
    the list it yields (one float)."""
    inside, original = [0.0], runtime.Session.run

    def clocked_run(self, *a, **k):
        start = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            inside[0] += time.perf_counter() - start

    runtime.Session.run = clocked_run
    try:
        yield inside
    finally:
        runtime.Session.run = original


# Kernel names -> the parts of a decoder the profile names (first match wins). Triton's
# kernels are the compiled normalizers' (`--compiled-normalizers`), the only ones torch.compile makes here.
CATEGORIES = [
    ("scoring: log-softmax, argmax, gather", re.compile(r"softmaxforward|logsoftmax|log_softmax|argmax|"
                                                        r"gather_kernel|index_add|logsumexp|triton_", re.I)),
    ("rotary + KV append", re.compile(r"rope|rotary|append|unpack|concatnewtopast", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|softmax|xqa|mha", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|sm\d+_|cublas|matmul|ampere_|hopper", re.I)),
    ("norms", re.compile(r"layernorm|layer_norm|rmsnorm|skiplayer", re.I)),
    ("element-wise", re.compile(r"elementwise|binary|unary|quickgelu|gelu|silu|sigmoid|mul|add|cast|split|"
                                r"copy|fill|where|expand|gather|slice|concat|transpose", re.I)),
]


def kernel_table(fn, rows=12):
    fn()
    sync()
    device = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])) as prof:
        fn()
        sync()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1e3
    order = "self_device_time_total" if device else "self_cpu_time_total"
    return total, events.table(sort_by=order, row_limit=rows, max_name_column_width=70) + \
        "\n" + category_shares(events)


def category_shares(events) -> str:
    """The device time of the kernels by part of the model (CATEGORIES), as shares of their sum."""
    parts: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA or not e.self_device_time_total:
            continue
        label = next((name for name, pattern in CATEGORIES if pattern.search(e.key)), "other")
        parts[label] = parts.get(label, 0.0) + e.self_device_time_total
    kernels = sum(parts.values()) or 1.0
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    return "kernel time by part: " + ", ".join(
        f"{name} {100 * t / kernels:.0f}% ({t / 1e3:.2f} ms)" for name, t in ranked)


def shared_steps(model, run, repeats=10) -> str:
    """The shared path's steps, timed inside real runs of it (`run`, which calls
    `sharing.shared_prefix_logits`): the decoder's prefill of the contexts, the copies of their KV
    into every row (`KVCache.start_from`) and the extend run, each call synced on both sides; the
    rest of the time is the scoring."""
    decoder, extender = model.decoder, model.decoder.extender()
    spent: dict[str, float] = {}

    def clocked(name, fn):
        def call(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return out
        return call

    run()
    decoder.prefill = clocked("contexts' prefill", decoder.prefill)
    KVCache.start_from = clocked("KV copied to every row", original_start := KVCache.start_from)
    if extender is not None:
        extender.run = clocked("extend run", extender.run)
    try:
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        sync()
        total = (time.perf_counter() - start) / repeats
    finally:
        del decoder.prefill
        KVCache.start_from = original_start
        if extender is not None:
            del extender.run
    steps = ", ".join(f"{name} {1e3 * t / repeats:.2f} ms" for name, t in spent.items())
    return f"shared path, {1e3 * total:.2f} ms a run (synced at each step): {steps}"


def hellaswag_shaped(batch: int, length: int, gen: torch.Generator, top: int = 32000):
    """Rows of groups of 4 continuations (15-40 tokens) after a shared context of about `length`."""
    rows, groups, starts, targets = [], [], [], []
    for group in range(max(1, batch // 4)):
        context = torch.randint(4, top, (int(torch.randint(length - 40, length + 1, (), generator=gen)),),
                                generator=gen).tolist()
        for _ in range(4):
            ending = torch.randint(4, top, (int(torch.randint(15, 41, (), generator=gen)),), generator=gen).tolist()
            rows.append(context + ending[:-1])
            groups.append(group)
            starts.append(len(context) - 1)
            targets.append(ending)
    return rows, groups, starts, targets


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's settings (`argv`: sys.argv's by default)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="qwen3-0.6b-bf16")
    parser.add_argument("--size", default="gpu", choices=list(SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--extra-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", choices=["ortmodule", "transformers"])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--shared", action="store_true", help="profile context sharing against padded rows")
    mode.add_argument("--rolling", action="store_true", help="profile rolling windows, every position scored")
    mode.add_argument("--shapes", type=int, metavar="N", help="replay N batches of new widths (lm-eval's stream)")
    mode.add_argument("--lm-eval", choices=["mmlu", "fewshot", "hellaswag", "arc"], dest="workload",
                      help="an at-scale lm-eval workload through the ortmodule backend, profiled")
    mode.add_argument("--score", type=int, metavar="N",
                      help="the score server's call over N requests of SGLang's shape, query run once or not")
    mode.add_argument("--decode", type=int, metavar="N",
                      help="N greedy decode steps through ortmodule's generate and onnxruntime-genai's Generator")
    parser.add_argument("--query-tokens", type=int, default=120, help="with --score")
    parser.add_argument("--items", type=int, default=10, help="with --score: items per request")
    parser.add_argument("--item-tokens", type=int, default=180, help="with --score")
    parser.add_argument("--questions", type=int, default=500, help="with --lm-eval: the questions profiled")
    parser.add_argument("--share", default="auto", help="with --lm-eval: share_contexts")
    parser.add_argument("--clock-only", action="store_true",
                        help="with --lm-eval: the clocked run only (prefills, padded tokens, device time), no profiler")
    parser.add_argument("--repeat-kv", action="store_true",
                        help="the extend graph repeats each KV head for its query heads on CUDA (grouped by default)")
    parser.add_argument("--float32-head", action="store_true",
                        help="the LM head in float32 (rewrite_lm_head='float32', the lm-eval backend's default)")
    parser.add_argument("--compiled-normalizers", action="store_true",
                        help="scoring's normalizers as one compiled reduction (scoring.COMPILED_NORMALIZERS)")
    parser.add_argument("--extend-layout", choices=["mask", "cache"],
                        help="the extend graph's layout on this device (extend.EXTEND_LAYOUT; default: ortmodule's)")
    parser.add_argument("--prefill-attention", choices=["auto", "package", "onnx"], default="auto",
                        help="runs without a cache in the package's graph or the prefill graph (extend.py)")
    parser.add_argument("--pad-multiple", type=int, default=64, help="with --shapes: the bucketed passes' multiple")
    parser.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a CUDA provider option (e.g. arena_extend_strategy=kSameAsRequested)")
    parser.add_argument("--session-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a SessionOptions attribute (enable_mem_pattern=0) or, with a dot, a config entry")
    return parser.parse_args(argv)


def main():
    args = arguments()
    extend.REPEAT_KV_HEADS_ON_CUDA = args.repeat_kv
    scoring.COMPILED_NORMALIZERS[torch.device(args.device).type] = args.compiled_normalizers
    if args.extend_layout:
        extend.EXTEND_LAYOUT[torch.device(args.device).type] = args.extend_layout
    spec = SIZES[args.size]["decoders"][args.spec]
    if args.extra_option:
        options = dict(spec.extra_options) | dict(item.split("=", 1) for item in args.extra_option)
        spec = dataclasses.replace(spec, extra_options=tuple(sorted(options.items())))
    fixture = fixtures.build(spec)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=args.device,
                                                session_options=session_options(args.session_option),
                                                provider_options=dict(o.split("=", 1) for o in args.provider_option),
                                                prefill_attention=args.prefill_attention,
                                                rewrite_lm_head="float32" if args.float32_head else True)
    name = torch.cuda.get_device_name() if model.device.type == "cuda" else "CPU"
    peak = next((flops for key, (flops, _) in GPU_DATASHEET.items() if key in name), None)
    print(f"{name}; package {fixture.package_dir.name}, builder options {dict(spec.extra_options) or 'default'}; "
          f"runs without a cache in {'the prefill graph' if model.decoder.causal else 'the package graph'}")
    if args.shared:
        return profile_sharing(model, fixture, args, peak)
    if args.score:
        return profile_score(model, fixture, args, peak)
    if args.decode:
        return profile_decode(model, fixture, args)
    if args.shapes:
        return replay_shapes(model, args)
    if args.workload:
        return profile_workload(model, fixture, args)
    gen, top = torch.Generator().manual_seed(0), min(32000, model.config.vocab_size)
    if args.rolling:  # windows of exactly `length` tokens, each predicting its next `length` tokens
        ids = torch.randint(4, top, (args.batch, args.length + 1), generator=gen)
        ids, targets, mask, starts = ids[:, :-1], ids[:, 1:].tolist(), None, [0] * args.batch
        tokens = args.batch * args.length
    else:
        lengths = torch.randint(args.length - 40, args.length + 1, (args.batch,), generator=gen)
        width = int(lengths.max())
        ids = torch.randint(4, top, (args.batch, width), generator=gen)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        starts = [int(n) - 5 for n in lengths]
        targets = [[int(t) for t in ids[i, s + 1 : s + 5]] for i, s in enumerate(starts)]
        tokens = int(lengths.sum())
    if args.rolling:  # as the lm-eval backend scores rolling windows: no greedy token, one read at the end
        ours = lambda: scoring.loglikelihood_totals(model, ids, mask, starts, targets, greedy=False)[0].sum().item()  # noqa: E731
    else:
        ours = lambda: scoring.loglikelihood(model, ids, mask, starts, targets)  # noqa: E731
    profile_both(model, ours, fixture, args, peak, (ids, mask, starts, targets, tokens))


def session_options(items: list[str]):
    """ortmodule's own session options (runtime.make_session's) with `NAME=VALUE` changes, or None."""
    if not items:
        return None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    for key, value in runtime.SPINNING:
        options.add_session_config_entry(key, value)
    for item in items:
        name, value = item.split("=", 1)
        if "." in name:
            options.add_session_config_entry(name, value)
        else:
            kind = type(getattr(options, name))
            setattr(options, name, bool(int(value)) if kind is bool else kind(value))
    return options


def profile_both(model, ours, fixture, args, peak, batch) -> None:
    """Time and profile `ours` and transformers (bf16, sdpa) scoring the same batch: (input ids, mask,
    starts, targets, real tokens)."""
    ids, mask, starts, targets, tokens = batch
    hf = None

    @torch.inference_mode()
    def theirs():
        device = model.device
        logits = hf(input_ids=ids.to(device), attention_mask=None if mask is None else mask.to(device)).logits
        if args.rolling:  # lm-eval's hf: log-softmax over every position in the model's dtype, then the gather
            return torch.log_softmax(logits, -1).gather(2, torch.tensor(targets, device=device)[..., None]).sum().item()
        rows = torch.arange(args.batch, device=device).repeat_interleave(4)
        cols = torch.tensor([s + i for s in starts for i in range(4)], device=device)
        lp = torch.log_softmax(logits[rows, cols].float(), -1)
        return lp.gather(1, torch.tensor([t for row in targets for t in row], device=device)[:, None]).sum().item()

    # Matmul FLOPs: the decoder's weights at every real token, the LM head at every position scored.
    scored = sum(len(t) for t in targets)
    body, head = weight_counts(fixture)
    flops = 2 * body * tokens + 2 * head * scored
    for label, fn in {"ortmodule": ours, "transformers": theirs}.items():
        if args.only and label != args.only:
            continue
        if label == "transformers":
            hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
            hf = hf.to(model.device).eval()
        seconds = timed(fn)
        kernel_ms, table = kernel_table(fn)
        share = f", {100 * flops / seconds / peak:.1f}% of the dense bf16 peak" if peak else ""
        print(f"== {label}: {seconds * 1e3:.2f} ms per batch of {args.batch} rows ({tokens} tokens, {scored} scored, "
              f"{tokens / seconds:.0f} tokens/s{share}); summed device time {kernel_ms:.2f} ms "
              f"({100 * kernel_ms / (seconds * 1e3):.0f}% of the wall time)")
        print(table)


def profile_sharing(model, fixture, args, peak) -> None:
    rows, groups, starts, targets = hellaswag_shaped(args.batch, args.length, torch.Generator().manual_seed(0),
                                                     min(32000, model.config.vocab_size))
    ids, mask = pad_right(rows)
    runs = {"padded rows (sharing off)": lambda: scoring.loglikelihood_totals(model, ids, mask, starts, targets),
            "shared contexts": lambda: scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets)}
    padded, shared = (fn()[0].cpu() for fn in runs.values())  # the summed log-probabilities, per row
    print(f"largest difference between the two paths' loglikelihoods: {(padded - shared).abs().max():.4f}")
    contexts = {g: starts[i] + 1 for i, g in enumerate(groups)}
    computed = {"padded rows (sharing off)": int(mask.sum()),
                "shared contexts": sum(contexts.values()) + sum(len(r) - s - 1 for r, s in zip(rows, starts))}
    profile_ways(model, fixture, runs, computed, peak, lambda seconds: f"{len(rows)} rows")


def profile_ways(model, fixture, runs: dict, computed: dict, peak, what) -> None:
    """Time and profile each of `runs` (label -> call; the last one the shared path, whose steps are
    timed too): wall time for `what(seconds)`, the share of the peak of `computed[label]` tokens, the
    summed device time and the kernels."""
    weights = weight_counts(fixture)[0]  # the body's: the LM head runs at a few positions
    for label, fn in runs.items():
        seconds = timed(fn)
        kernel_ms, table = kernel_table(fn)
        share = f", {100 * 2 * weights * computed[label] / seconds / peak:.1f}% of the dense bf16 peak" if peak else ""
        print(f"== {label}: {seconds * 1e3:.2f} ms for {what(seconds)} ({computed[label]} tokens computed{share}); "
              f"summed device time {kernel_ms:.2f} ms")
        print(table)
    print(shared_steps(model, list(runs.values())[-1]))


def decode_kernels(make, steps: int) -> tuple[float, float]:
    """The device kernels one decode step launches, and their device time in ms: the profile of
    `steps` + 1 new tokens less that of 1, over `steps` (0, 0 without a GPU)."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    counts = []
    for new in (1, steps + 1):
        make(new)()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            make(new)()
            sync()
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total]
        counts.append((sum(e.count for e in kernels), sum(e.self_device_time_total for e in kernels) / 1e3))
    return (counts[1][0] - counts[0][0]) / steps, (counts[1][1] - counts[0][1]) / steps


def profile_decode(model, fixture, args) -> None:
    """Greedy decoding of `--batch` rows after prompts of `--length` tokens, `--decode` steps: ortmodule's
    generate and onnxruntime-genai's Generator on the same package (the mode's notes, above)."""
    import numpy as np
    import onnxruntime_genai as og

    steps, gen = args.decode, torch.Generator().manual_seed(0)
    ids = torch.randint(4, min(32000, model.config.vocab_size), (args.batch, args.length), generator=gen)
    on_device = ids.to(model.device)
    genai = None if args.only == "ortmodule" else og.Model(str(fixture.package_dir))

    def ours(new):
        return lambda: model.generate(on_device, max_new_tokens=new, eos_token_id=None, pad_token_id=0)

    def theirs(new):
        def run():
            params = og.GeneratorParams(genai)
            total = args.length + new
            params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=args.batch)
            generator = og.Generator(genai, params)
            generator.append_tokens(ids.numpy().astype(np.int32))
            while not generator.is_done():
                generator.generate_next_token()
        return run

    def split(fn) -> tuple[float, float]:
        """One call of `fn`: its wall time and the host's time inside ONNX Runtime's runs."""
        with runs_clocked() as inside:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start, inside[0]

    for label, make in (("ortmodule", ours), ("onnxruntime-genai", theirs)):
        if label == "onnxruntime-genai" and genai is None:
            continue
        first, whole = timed(make(1), 3), timed(make(steps + 1), 3)
        line = (f"== {label}: {1e3 * (whole - first) / steps:.3f} ms a step at batch {args.batch} "
                f"({1e3 * first:.2f} ms the prompt and first token)")
        if label == "ortmodule":  # the host's time of a step inside ONNX Runtime's runs and outside them
            (short, short_in), (long, long_in) = split(make(1)), split(make(steps + 1))
            inside = (long_in - short_in) / steps
            line += (f"; of one clocked run's {1e3 * (long - short) / steps:.3f} ms a step, inside ONNX Runtime's "
                     f"runs {1e3 * inside:.3f} ms, outside {1e3 * ((long - short) / steps - inside):.3f} ms")
        launches, kernel_ms = decode_kernels(make, steps)
        if launches:
            line += f"; {launches:.0f} kernels a step, {kernel_ms:.3f} ms of device time"
        print(line)


def profile_score(model, fixture, args, peak) -> None:
    """The score server's call (`scoring.label_logprobs`) over `args.score` requests of SGLang's shape
    (a `--query-tokens` query and `--items` items of `--item-tokens` tokens, 2 labels) at the server's
    token budget, each prompt whole (padded rows) and each query run once: wall time, summed device
    time, the kernels, the shared path's steps, and which way the measured costs choose."""
    gen, top = torch.Generator().manual_seed(0), min(32000, model.config.vocab_size)
    requests = []
    for _ in range(args.score):
        query = torch.randint(4, top, (args.query_tokens,), generator=gen).tolist()
        requests.append([query + torch.randint(4, top, (args.item_tokens,), generator=gen).tolist()
                         for _ in range(args.items)])
    budget, labels = scoring.default_token_budget(model.device), [10, 20]
    chosen = scoring.prefix_reuse(model, requests, budget, None)
    print(f"{args.score} requests of a {args.query_tokens}-token query and {args.items} items of {args.item_tokens} "
          f"tokens, token budget {budget}: the measured costs run {sum(chosen)} of them with the query once")
    runs = {"whole prompts (reuse off)": lambda: scoring.label_logprobs(model, requests, labels, budget, False),
            "query once (reuse on)": lambda: scoring.label_logprobs(model, requests, labels, budget, True)}
    whole, once = (fn().cpu() for fn in runs.values())
    print(f"largest difference between the two ways' log-probabilities: {(whole - once).abs().max():.4f}")
    items = args.score * args.items
    computed = {"whole prompts (reuse off)": items * (args.query_tokens + args.item_tokens),
                "query once (reuse on)": args.score * args.query_tokens + items * args.item_tokens}
    profile_ways(model, fixture, runs, computed, peak, lambda seconds: f"{items} items, {items / seconds:.0f} items/s")


def shape_stream(batches: int, rows: int, length: int, gen: torch.Generator, top: int, multiple: int = 1):
    """lm-eval's MMLU stream: `batches` x `rows` rows of `length` +- 300 tokens, longest first, cut
    into batches (each as wide as its longest row, rounded up to `multiple`); four one-token
    requests per row. Per batch: (ids, mask, starts, targets, rows_of)."""
    lengths = sorted(torch.randint(max(8, length - 300), length + 301, (batches * rows,), generator=gen).tolist(),
                     reverse=True)
    stream = []
    for b in range(batches):
        chunk = lengths[b * rows:(b + 1) * rows]
        width = -(-chunk[0] // multiple) * multiple
        ids = torch.randint(4, top, (rows, width), generator=gen)
        mask = (torch.arange(width)[None, :] < torch.tensor(chunk)[:, None]).long()
        rows_of = [r for r in range(rows) for _ in range(4)]
        starts = [chunk[r] - 1 for r in rows_of]
        targets = [[int(t)] for t in torch.randint(4, top, (len(rows_of),), generator=gen)]
        stream.append((ids, mask, starts, targets, rows_of))
    return stream


def replay_shapes(model, args) -> None:
    """`--shapes`: the stream of batches in four passes (module docstring), a line per pass."""
    top = min(32000, model.config.vocab_size)
    plain = shape_stream(args.shapes, args.batch, args.length, torch.Generator().manual_seed(0), top)
    padded = shape_stream(args.shapes, args.batch, args.length, torch.Generator().manual_seed(0), top,
                          args.pad_multiple)
    with runs_clocked() as in_runs:
        replay_passes(model, args, plain, padded, in_runs)


def replay_passes(model, args, plain, padded, in_runs) -> None:
    """`--shapes`' four passes (its notes, above); `in_runs` adds up the host's time in ONNX Runtime's runs."""
    on_cuda = model.device.type == "cuda"
    scoring.loglikelihood_totals(model, *plain[-1][:2], [1], [[5]], [0])  # the session's first run, outside the clock
    sync()
    real = sum(int(m.sum()) for _, m, *_ in plain)
    print(f"{len(plain)} batches of {args.batch} rows, {real} real tokens; widths {plain[0][0].shape[1]} .. "
          f"{plain[-1][0].shape[1]} ({len({b[0].shape[1] for b in plain})} distinct), rounded up to "
          f"{args.pad_multiple}: {len({b[0].shape[1] for b in padded})} distinct")
    for label, stream in (("new widths", plain), ("the same widths again", plain),
                          (f"widths rounded up to {args.pad_multiple}, new", padded),
                          (f"widths rounded up to {args.pad_multiple}, seen", padded)):
        in_runs[0], in_calls, device_ms, answers = 0.0, 0.0, 0.0, []
        events = []
        sync()
        start = time.perf_counter()
        for batch in stream:
            if on_cuda:
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
            call = time.perf_counter()
            answers.append(scoring.loglikelihood_totals(model, *batch))
            in_calls += time.perf_counter() - call
            if on_cuda:
                events[-1][1].record()
        torch.cat(answers, 1).cpu()  # the one read-back, as lm-eval's backend does
        wall = time.perf_counter() - start
        if on_cuda:
            device_ms = sum(a.elapsed_time(b) for a, b in events)
        padded_tokens = sum(b[0].numel() for b in stream)
        print(f"== {label}: {wall:.3f} s wall ({1e3 * wall / len(stream):.1f} ms per batch), host inside the calls "
              f"{in_calls:.3f} s, of which ONNX Runtime's runs {in_runs[0]:.3f} s; device (events) "
              f"{device_ms / 1e3:.3f} s; {padded_tokens} padded tokens ({padded_tokens / real:.3f}x the real ones)")


def profile_workload(model, fixture, args) -> None:
    """`--lm-eval WORKLOAD`: `--questions` questions of an at-scale workload (benchmarks/test_scale.py)
    through lm-eval's ortmodule backend, as the suite's row runs them (batch size auto): once
    clocked, with where the batches' time went (evaluation.BatchTimes: the host inside the calls
    and inside ONNX Runtime's runs, the device between events), then under torch's profiler: the
    kernels' time against the wall time, the kernels by device time and the host's calls by their
    own time (a host waiting for the launch queue shows as 'Command Buffer Full')."""
    import lm_eval
    import pytest
    from evaluation import TASK_DIR, BatchTimes, Clock, ShapeLog
    from lm_eval.tasks import TaskManager
    from test_scale import WORKLOADS

    from ortmodule import load_tokenizer
    from ortmodule.lm_eval import OrtModuleLM

    tasks = TaskManager(include_path=TASK_DIR, include_defaults=False, metadata={"tokenizer": str(fixture.hf_dir)})
    lm = OrtModuleLM(pretrained=model, tokenizer=load_tokenizer(fixture.package_dir), batch_size="auto",
                     share_contexts=args.share)
    run = lambda n: lm_eval.simple_evaluate(model=lm, tasks=[WORKLOADS[args.workload]], task_manager=tasks,  # noqa: E731
                                            limit=n, verbosity="ERROR")
    run(2)  # the first calls (kernel selection, cuBLAS handles) off the clock
    patches = pytest.MonkeyPatch()
    clock, logs = Clock(patches, lm, "loglikelihood"), [ShapeLog(patches), BatchTimes(patches, model.device.type)]
    requests = len(run(args.questions)["samples"][WORKLOADS[args.workload]]) * 4
    found = {"requests_per_s": round(requests / clock.seconds, 1), "loglikelihood_s": round(clock.seconds, 3)}
    for log in logs:
        found |= log.summary()
    found["token_budget"] = lm.token_budget  # halved after any out-of-memory retry (logged)
    patches.undo()
    print(f"{args.workload}, {args.questions} questions ({requests} requests), share_contexts={args.share}: {found}")
    if args.clock_only:
        return
    device = model.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])) as prof:
        start = time.perf_counter()
        run(args.questions)
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 1e6
    print(f"under the profiler: {wall:.2f} s wall, kernels {kernels:.2f} s ({100 * kernels / wall:.0f}% of it)")
    for order in (["self_device_time_total"] if device else []) + ["self_cpu_time_total"]:
        print(events.table(sort_by=order, row_limit=20, max_name_column_width=160))
    if device:
        print(category_shares(events))


if __name__ == "__main__":
    main()
