"""What `ortmodule env` reports: the versions, devices and execution providers that decide what runs
(for a bug report), and the installs known to break it (`problems`)."""

from __future__ import annotations

import os
import platform
import re
import sys
from importlib import metadata

from .cache_folder import cache_home
from .mapped import cpu_info

# The CPU features ONNX Runtime's and torch's kernels pick their paths by (int8 and bf16 matmuls, AMX).
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# The distributions whose versions change what runs, in the order reported.
DISTRIBUTIONS = ("ortmodule", "torch", "onnxruntime-gpu", "onnxruntime", "onnxruntime-genai-cuda", "onnxruntime-genai",
                 "transformers", "tokenizers", "lm_eval", "accelerate", "onnx", "onnx-ir", "fastapi", "uvicorn")
# The oldest transformers ortmodule runs on (pyproject.toml's floor): its generate, cache and multimodal
# inputs are transformers' own internals, whose forms changed within 5.x (the suite, session 80: 5.18
# to 5.22 fail multimodal generate; 4.57 and 5.0 fail generate itself).
TRANSFORMERS_FLOOR = (5, 23)


def too_old_transformers(version: str | None = None) -> str | None:
    """What is wrong where the installed transformers (or `version`) is older than TRANSFORMERS_FLOOR,
    with its fix; None where it is new enough."""
    version = metadata.version("transformers") if version is None else version
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers >= TRANSFORMERS_FLOOR:
        return None
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    return (f"transformers {version} is older than ortmodule needs (>= {floor}: its generate, cache and "
            f"multimodal inputs changed within 5.x). Fix: pip install -U 'transformers>={floor}'")


def versions() -> dict[str, str | None]:
    """Each of DISTRIBUTIONS' installed version, None where it is not installed."""
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu() -> str:
    """The CPU's model name, logical CPUs and which of CPU_FEATURES it has (where Linux tells them)."""
    model, flags = cpu_info()
    features = ", ".join(feature for feature in CPU_FEATURES if feature in flags.split())
    return f"{model}, {os.cpu_count()} logical CPUs" + (f" ({features})" if features else "")


def report() -> list[tuple[str, str]]:
    """(name, value) lines: the platform, Python, CPU, the versions, torch's CUDA devices, ONNX Runtime's
    execution providers and ortmodule's cache folder."""
    import onnxruntime as ort
    import torch

    lines = [("platform", platform.platform()), ("python", sys.version.split()[0]),
             ("cpu", cpu())]
    lines += [(name, version or "not installed") for name, version in versions().items()]
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    lines.append(("torch CUDA", f"{torch.version.cuda}: {', '.join(gpus)}" if gpus else
                  f"{torch.version.cuda or 'a CPU build'}, no device seen"))
    lines.append(("onnxruntime providers", ", ".join(ort.get_available_providers())))
    lines.append(("cache folder", str(cache_home())))
    return lines


def problems(installed: dict[str, str | None] | None = None, providers: list[str] | None = None,
             torch_cuda: bool | None = None) -> list[str]:
    """What in this environment is known to break ortmodule, each with its fix: the CPU and GPU builds
    of ONNX Runtime (or of onnxruntime-genai) installed together, which write the same files (the one
    installed last wins, or a mix of both's files fails at import); a CUDA device torch sees that
    this ONNX Runtime build cannot run on; a transformers older than TRANSFORMERS_FLOOR. Arguments left
    None are read from this environment."""
    installed = versions() if installed is None else installed
    if providers is None:
        import onnxruntime as ort

        providers = ort.get_available_providers()
    if torch_cuda is None:
        import torch

        torch_cuda = torch.cuda.is_available()
    found = []
    if installed.get("transformers") and (old := too_old_transformers(installed["transformers"])):
        found.append(old)
    for gpu, cpu in (("onnxruntime-gpu", "onnxruntime"), ("onnxruntime-genai-cuda", "onnxruntime-genai")):
        if installed.get(gpu) and installed.get(cpu):
            found.append(f"{cpu} {installed[cpu]} and {gpu} {installed[gpu]} are both installed: they write the same "
                         f"files, so the one installed last wins, or a mix of both fails. Fix: pip uninstall -y {cpu} "
                         f"{gpu} && pip install {gpu}")
    cuda_provider = "CUDAExecutionProvider" in providers
    if torch_cuda and not cuda_provider:
        found.append("torch sees a CUDA device, but this onnxruntime has no CUDAExecutionProvider, so device='cuda' "
                     "cannot load a package. Fix: pip uninstall -y onnxruntime && pip install onnxruntime-gpu")
    return found


def print_report(out=None) -> int:
    """`ortmodule env`: the report as `- name: value` lines, then the problems found (exit status 1 where
    there is one)."""
    out = out or sys.stdout
    for name, value in report():
        print(f"- {name}: {value}", file=out)
    found = problems()
    for problem in found:
        print(f"problem: {problem}", file=out)
    return 1 if found else 0
