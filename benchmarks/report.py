"""Turn pytest-benchmark JSON into docs/benchmarks.md: one table per workload, with ratios to
transformers on the same weights, the machine, and the command that reproduces it.

python benchmarks/report.py results.json [more.json ...] > docs/benchmarks.md
"""

import json
import re
import sys
from collections import defaultdict

COMMAND = "pytest benchmarks --bench-size cpu --benchmark-json=results.json && python benchmarks/report.py results.json"


def case(bench: dict) -> tuple[str, str]:
    """'test_ortmodule_forward[cont_len]' -> ('ortmodule', 'cont_len'); a benchmark that records
    its backend in extra_info (lm-eval's 'hf' is transformers) has no case."""
    if "backend" in bench["extra_info"]:
        backend = bench["extra_info"]["backend"]
        return ("transformers" if backend == "hf" else backend), ""
    match = re.match(r"test_([a-z0-9_]+?)_[a-z]+(?:\[(.*)\])?$", bench["name"])
    return (match.group(1), match.group(2) or "") if match else (bench["name"], "")


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    machine = runs[0]["machine_info"]
    print("# Benchmarks\n")
    print(f"Machine: {machine.get('cpu', {}).get('brand_raw', machine.get('processor'))}, "
          f"{machine.get('cpu', {}).get('count', '?')} logical CPUs, Python {machine['python_version']}; "
          f"run {runs[0]['datetime'][:10]}. Every row of a table was measured in the same run.\n")
    print(f"Reproduce: `{COMMAND}`\n")
    groups = defaultdict(list)
    for run in runs:
        for bench in run["benchmarks"]:
            groups[bench["group"]].append(bench)
    for group, benches in groups.items():
        reference = {case(b)[1]: b["stats"]["median"] for b in benches if case(b)[0] == "transformers"}
        extra_keys = sorted({k for b in benches for k in b["extra_info"]} - {"backend"})
        print(f"## {group}\n")
        print("| backend | case | median ms | x transformers | " + " | ".join(extra_keys) + " |")
        print("|---|---|---|---|" + "---|" * len(extra_keys))
        for b in sorted(benches, key=lambda b: (case(b)[1], b["stats"]["median"])):
            backend, variant = case(b)
            median = b["stats"]["median"]
            base = reference.get(variant, reference.get(""))  # a peer measured once stands for every case
            ratio = f"{base / median:.2f}x faster" if base else ""
            extras = " | ".join(str(b["extra_info"].get(k, "")) for k in extra_keys)
            print(f"| {backend} | {variant} | {median * 1e3:.1f} | {ratio} | {extras} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
