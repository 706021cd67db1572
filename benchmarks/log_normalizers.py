"""The log-softmax normalizers of scoring (`scoring.log_normalizers`): every scored position's
log-sum-exp over the vocabulary, in float32, the step after the LM head. Three ways, timed on the
same logits in turns (synthetic logits of the workloads' shapes, labelled so):

- `composite, 256 MB pieces` (ortmodule before): `torch.logsumexp(piece.float())` on 256 MB of
  float32 at a time; logsumexp is five passes (max, subtract, exp, sum, log), two of them writing
  a tensor as large as the input.
- `composite, 4 MB pieces` (the CPU's way now): the same on pieces that stay in the cache.
- `fused log_softmax, 256 MB pieces` (CUDA's way now): one float32 `torch.log_softmax` kernel per
  piece, the normalizer read at the greedy token.
- with `--compiled`, `compiled, whole` (`scoring.compiled_normalizers`, what
  `scoring.COMPILED_NORMALIZERS` turns on): the float32 logsumexp and the greedy token's argmax as
  Inductor's generated reductions (C++ on a CPU, Triton on CUDA), which write nothing per logit, on
  all the logits at once; it compiles on its first call (seconds, outside the clock).

Each row: the time, the logits' bytes read once per second, that as a fraction of the device's
measured copy bandwidth (bytes read + written per second of a large copy), and the largest
difference from float64. Positions: a HellaSwag-shaped batch (32 questions x 4 continuations of
about 28 tokens), one 4,096-token rolling window, and on CUDA a rolling batch (8 windows).

    python benchmarks/log_normalizers.py                      # the device's default: cuda if present
    python benchmarks/log_normalizers.py --device cpu --vocab 49152 --dtype float32   # SmolLM2 on a CPU
"""

import argparse

import torch

from ortmodule import scoring
from ortmodule.costs import _best_times


def composite(logits: torch.Tensor, piece_bytes: int) -> torch.Tensor:
    rows = max(1, piece_bytes // (4 * logits.shape[-1]))
    return torch.cat([torch.logsumexp(part.float(), dim=-1) for part in logits.split(rows)])


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a 1 GiB copy, the best of 5."""
    big = torch.empty(2**28, dtype=torch.float32, device=device)
    out = torch.empty_like(big)
    seconds = _best_times([lambda: out.copy_(big)], device, 5)[0]
    return 2 * big.numel() * 4 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's 151,936 by default")
    parser.add_argument("--dtype", default=None, help="the logits' dtype: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiled", action="store_true",
                        help="also torch.compile's logsumexp (Inductor's fused reduction; compiles on the first call)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shapes = {"HellaSwag-shaped batch": 32 * 4 * 28, "one rolling window": 4096}
    if device.type == "cuda":
        shapes["rolling batch of 8 windows"] = 8 * 4096
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bandwidth = copy_bandwidth(device)
    print(f"{name}: copy {bandwidth / 1e9:.0f} GB/s (read + written); synthetic logits, vocabulary {args.vocab}, "
          f"{str(dtype).removeprefix('torch.')}")
    ways = {
        "composite, 256 MB pieces": lambda x: composite(x, 1 << 28),
        "composite, 4 MB pieces": lambda x: composite(x, 1 << 22),
        "fused log_softmax, 256 MB pieces": lambda x: scoring.log_normalizers(x, fused=True)[0],
    }
    if args.compiled:  # reductions that read each logit and write one float and one index per row
        ways["compiled, whole"] = lambda x: scoring.log_normalizers(x, compiled=True)[0]
    gen = torch.Generator(device=device).manual_seed(0)
    print("| positions | way | ms | logits read GB/s | of copy bandwidth | max diff vs float64 |")
    print("|---|---|---|---|---|---|")
    for label, positions in shapes.items():
        logits = (torch.randn(positions, args.vocab, generator=gen, device=device) * 4).to(dtype)
        sample = torch.logsumexp(logits[:64].double(), dim=-1)
        times = _best_times([lambda f=f, x=logits: f(x) for f in ways.values()], device, args.repeats)
        for (way, fn), seconds in zip(ways.items(), times):
            rate = logits.numel() * logits.element_size() / seconds
            diff = (fn(logits[:64]).double() - sample).abs().max().item()
            print(f"| {label} ({positions:,}) | {way} | {seconds * 1e3:.2f} | {rate / 1e9:.0f} | "
                  f"{rate / bandwidth:.0%} | {diff:.1e} |")
        del logits


if __name__ == "__main__":
    main()
