"""`ortmodule serve` with the extend graph set one way, for measuring the score server with each
(what profile_gpu.py's `--extend-layout` and `--repeat-kv` set in its own process):

    python benchmarks/serve_with_extend.py LAYOUT HEADS serve PATH [serve's flags]

LAYOUT: "mask" or "cache" (extend.EXTEND_LAYOUT on every device); HEADS: "repeated" (the KV heads
repeated for the query heads on CUDA, extend.REPEAT_KV_HEADS_ON_CUDA) or "grouped" (the default
since session 58). The benchmark suite's `--server-extend LAYOUT,HEADS` starts its servers this way.
"""

import sys

from ortmodule import cli, extend

LAYOUTS, HEADS = ("mask", "cache"), ("repeated", "grouped")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in LAYOUTS or argv[1] not in HEADS:
        sys.exit(f"usage: serve_with_extend.py {'|'.join(LAYOUTS)} {'|'.join(HEADS)} serve PATH [flags]; "
                 f"got {argv[:2]}")
    for device in extend.EXTEND_LAYOUT:
        extend.EXTEND_LAYOUT[device] = argv[0]
    extend.REPEAT_KV_HEADS_ON_CUDA = argv[1] == "repeated"
    cli.ortmodule(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
