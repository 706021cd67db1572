"""Which of the model builder's graph options make a decoder's prefill faster, one at a time
(issue 26, item 3): each option exports its own variant of the package (same weights), and one
run times every variant's forward on the same batch, round-robin so that a drift of the machine's
speed falls on all of them alike. Beside each: what the option changed in the graph (node counts
by op type against the default export), the largest difference of its logits from transformers
fp32 on the same weights, and on CUDA the kernel time by part of the model (profile_gpu.py's
split: matmul, element-wise, rotary + KV append, attention, norms).

    python benchmarks/graph_options.py [--spec qwen3-0.6b-bf16] [--size gpu] [--device cuda]
        [--batch 32] [--length 512] [--option fuse_mlp_gate_up=true ...] [--json FILE]

The options tried by default (the builder's names; `--option` replaces the list, and `default`
names the package as exported without options):
- `fuse_mlp_gate_up=true`: the gate and up projections as one MatMul, then a Split;
- `fuse_qkv=false`: the query, key and value projections as three MatMuls (packed by default);
- `fuse_qk_norm_gqa=false` (CUDA exports of models with query/key norms, Qwen3): the norms as
  nodes before GroupQueryAttention instead of inside it.
- `prefill_attention=onnx` (not a builder option: `OrtModelForCausalLM`'s): the default export loaded
  with its runs without a cache in the prefill graph (ortmodule/extend.py: every GroupQueryAttention
  rewritten into norms, rotary and ONNX's `Attention` op, no KV written), to tell whether
  GroupQueryAttention's prologue kernel (`UnpackRoPEAppend`, 21% of an MMLU-shaped batch on an H200)
  is worth replacing; its graph column compares the prefill graph with the default's (LM head
  rewritten in both).
A variant whose graph comes out the same as the default's is reported and not timed.
On a CPU: `--size cpu --device cpu --spec smollm2-fp32 --batch 8 --length 128`.
"""

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import onnx
import torch
from conftest import GPU_DATASHEET, SIZES, cpu_limits, flop_count, reference_model
from profile_gpu import kernel_table

from ortmodule import OrtModelForCausalLM, extend, projections

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

OPTIONS = ["default", "fuse_mlp_gate_up=true", "fuse_qkv=false", "fuse_qk_norm_gqa=false", "prefill_attention=onnx"]
LOAD_OPTIONS = {"prefill_attention"}  # OrtModelForCausalLM's options: the default export loaded with them


def load_options(option: str) -> dict:
    """The `from_pretrained` options of a variant (a whole row runs in one prefill, not in chunks)."""
    key, _, value = option.partition("=")
    return {key: value, "prefill_chunk": 0} if key in LOAD_OPTIONS else {}


def variant(spec: fixtures.FixtureSpec, option: str) -> fixtures.FixtureSpec:
    """`spec` exported with the builder option `KEY=VALUE` added ('default': as it is)."""
    if option == "default":
        return spec
    key, sep, value = option.partition("=")
    if not sep or not key or not value:
        raise SystemExit(f"--option {option!r}: expected KEY=VALUE (a model builder option) or 'default'")
    return dataclasses.replace(spec, extra_options=tuple(sorted((dict(spec.extra_options) | {key: value}).items())))


def op_counts(package_dir: Path) -> collections.Counter:
    proto = onnx.load(str(package_dir / "model.onnx"), load_external_data=False)
    return collections.Counter(node.op_type for node in proto.graph.node)


def changed(counts: collections.Counter, default: collections.Counter) -> str:
    """The op types whose node count differs from the default export's, e.g. 'MatMul 211 -> 183'."""
    return ", ".join(f"{op} {default[op]} -> {counts[op]}" for op in sorted(set(counts) | set(default))
                     if counts[op] != default[op]) or "(the default export)"


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def median_times(calls: dict, device: str, rounds: int, repeats: int) -> dict:
    """Seconds per call of each of `calls`, the median over `rounds` rounds that each time every
    call `repeats` times in turn."""
    times = {name: [] for name in calls}
    for fn in calls.values():  # warm-up: first runs allocate and pick kernels
        fn()
    for _ in range(rounds):
        for name, fn in calls.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            sync(device)
            times[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(values) for name, values in times.items()}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="qwen3-0.6b-bf16", help="a model key of the size's benchmarks")
    parser.add_argument("--size", default="gpu", choices=list(SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--keep", type=int, default=4, help="logits kept per row (cont_len)")
    parser.add_argument("--option", action="append", metavar="KEY=VALUE", help=f"default: {' '.join(OPTIONS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    size = SIZES[args.size]
    models = size["decoders"] | {key: spec for key, (spec, _, _) in size["forward"].items()}
    if args.spec not in models:
        parser.error(f"--spec {args.spec!r} is not one of the {args.size} size's models: {', '.join(models)}")
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here (use --device cpu --size cpu)")
    return args, models[args.spec]


def main():
    args, spec = parse_args()
    options = ["default"] + [o for o in (args.option or OPTIONS) if o != "default"]
    built = {}
    for option in options:
        print(f"exporting or finding the package: {option}", file=sys.stderr, flush=True)
        built[option] = built["default"] if load_options(option) else fixtures.build(variant(spec, option))
    counts = {option: op_counts(fixture.package_dir) for option, fixture in built.items()}
    rows = {option: {"option": option, "graph": changed(counts[option], counts["default"])} for option in options}
    for option in options[1:]:
        if counts[option] == counts["default"] and not load_options(option):
            rows[option]["graph"] = "the same graph as the default export: not timed"
            del built[option]

    gen = torch.Generator().manual_seed(0)
    vocab = min(spec.vocab_size, 32000)
    ids = torch.randint(4, vocab, (args.batch, args.length), generator=gen)
    hf = reference_model(built["default"], args.device, "fp32")
    with torch.inference_mode():
        expected = hf(ids.to(args.device), logits_to_keep=args.keep).logits.float().cpu()
    del hf
    if args.device != "cpu":
        torch.cuda.empty_cache()
    models = loaded(built, rows, ids, expected, args)
    calls = {option: (lambda m=model: m(ids, cont_len=args.keep)) for option, model in models.items()}
    seconds = median_times(calls, args.device, args.rounds, args.repeats)

    if args.device == "cpu":
        name, peak = "CPU", cpu_limits()["peak_flops"]
    else:
        name = torch.cuda.get_device_name()
        peak = next((flops for key, (flops, _) in GPU_DATASHEET.items() if key in name), 0.0)
    flops = flop_count(built["default"], args.batch * args.length, args.batch * args.keep)
    for option, s in seconds.items():
        rows[option].update(ms=1e3 * s, vs_default=seconds["default"] / s, tokens_per_s=args.batch * args.length / s,
                            of_peak=flops / s / peak if peak else None)
        if args.device != "cpu":
            kernel_ms, table = kernel_table(calls[option], rows=0)
            rows[option]["kernels"] = table.rsplit("\n", 1)[-1]
    report(rows, name, spec, args)


def loaded(built: dict, rows: dict, ids, expected, args) -> dict:
    """Each variant loaded and run once, its logits' largest difference from `expected` recorded; a
    variant that ONNX Runtime will not load or run is reported as such and left out of the timing
    (the default's failure ends the run)."""
    models = {}
    for option, fixture in built.items():
        try:
            model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=args.device,
                                                        **load_options(option))
            if load_options(option):
                rows[option]["graph"] = prefill_graph_changes(model)
            logits = model(ids, cont_len=args.keep).logits.float().cpu()
        except Exception as error:
            if option == "default":
                raise
            rows[option]["graph"] += f"; failed to load or run: {str(error).splitlines()[0][:300]}"
            continue
        rows[option]["max_diff_vs_fp32"] = float((logits - expected).abs().max())
        models[option] = model
    return models


def prefill_graph_changes(model) -> str:
    """What the prefill graph changes against the package's (LM-head-rewritten) graph; an error where
    ortmodule did not make it (the reason is in its log)."""
    decoder = model.decoder
    if decoder.causal is None:
        raise RuntimeError("ortmodule made no prefill graph for this package (its log says why)")
    data = extend.extend_graph_bytes(decoder.graph_bytes, decoder.spec.path.stem, decoder.spec.layers[0].head_size,
                                     False, decoder.cache_dir, layout="prefill",
                                     unpack_qkv=projections.applies(decoder.device.type, decoder.session_options))

    def count(graph: bytes) -> collections.Counter:
        return collections.Counter(node.op_type for node in onnx.load_from_string(graph).graph.node)

    return "prefill graph: " + changed(count(data), count(decoder.graph_bytes))


def report(rows: dict, name: str, spec, args) -> None:
    print(f"\n{name}; {args.spec} ({spec.precision}), forward of {args.batch} x {args.length} tokens, "
          f"cont_len={args.keep}; median of {args.rounds} rounds of {args.repeats} calls each, round-robin\n")
    print("| builder option | graph against the default export | ms | speed vs default | tokens/s | of peak | "
          "max diff vs transformers fp32 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows.values():
        timed = "ms" in row
        print(f"| {row['option']} | {row['graph']} | " + (
            f"{row['ms']:.1f} | {row['vs_default']:.2f}x | {row['tokens_per_s']:.0f} | "
            + (f"{100 * row['of_peak']:.0f}%" if row["of_peak"] else "") + f" | {row['max_diff_vs_fp32']:.2g} |"
            if timed else "| | | | |"))
    for row in rows.values():
        if "kernels" in row:
            print(f"{row['option']}: {row['kernels']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": name, "spec": args.spec, "batch": args.batch,
                                         "length": args.length, "keep": args.keep, "rows": list(rows.values())},
                                        indent=1))


if __name__ == "__main__":
    main()
