"""ONNX Runtime's two compute paths for 4-bit weights on this CPU (ortmodule/nbits.py): one
MatMulNBits (4 bits, blocks of 32, accuracy_level 4) in its int8 path and in its fp32 path
(`mlas.qnbit.force_fp32`), beside an fp32 MatMul of the same shape, over growing rows; then the
real SmolLM2-135M int4 package's prefill of 8 x 620 tokens under `quantized_prefill` package and fp32.

    python benchmarks/nbits_paths.py            # SmolLM2's MLP shape, 576 x 1,536
    python benchmarks/nbits_paths.py --no-model # the kernel table only
"""

import argparse
import sys
from pathlib import Path

import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from ortmodule import OrtModelForCausalLM, nbits
from ortmodule.costs import _best_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def session(k: int, n: int, kind: str) -> ort.InferenceSession:
    if kind != "fp32 MatMul":  # the probe ortmodule runs, in either path
        return nbits.probe_session(nbits.probe_graph(k, n, "rows"), fp32=kind == "fp32 path")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    weights = [numpy_helper.from_array(torch.randn(k, n, generator=torch.Generator().manual_seed(0)).numpy(), "w")]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], weights)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the probe's sessions
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def best(fn, repeats: int) -> float:
    return _best_time(fn, torch.device("cpu"), repeats)  # warm-up, then the best of `repeats`


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--no-model", action="store_true")
    args = parser.parse_args()
    kinds = ("fp32 MatMul", "int8 path (level 4)", "fp32 path (force_fp32)")
    sessions = [session(args.k, args.n, kind.split(" (")[0]) for kind in kinds]
    print(f"| rows | {' | '.join(kinds)} |\n|---|---|---|---|")
    for rows in (1, 8, 32, 256, 620):
        x = {"x": torch.randn(rows, args.k).numpy()}
        cells = []
        for s in sessions:
            seconds = best(lambda s=s, x=x: s.run(None, x), 20)
            cells.append(f"{seconds * 1e3:.3f} ms ({2 * rows * args.k * args.n / seconds / 1e9:.0f} GFLOP/s)")
        print(f"| {rows} | {' | '.join(cells)} |")
    if args.no_model:
        return
    package = fixtures.build(fixtures.SMOLLM2_INT4).package_dir
    ids = torch.randint(10, 40000, (8, 620), generator=torch.Generator().manual_seed(0))
    for choice in ("package", "fp32"):
        model = OrtModelForCausalLM.from_pretrained(package, quantized_prefill=choice, prefill_chunk=0)
        seconds = best(lambda m=model: m(ids, cont_len=4), 2)
        print(f"SmolLM2-135M int4, prefill 8 x 620 tokens, quantized_prefill={choice}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
