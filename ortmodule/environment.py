"""What `ortmodule env` reports: the versions, devices and execution providers that decide what runs
(for a bug report), and the installs known to break it (`problems`)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
from importlib import metadata, util
from pathlib import Path

from .cache_folder import cache_home

# The CPU features ONNX Runtime's and torch's kernels pick their paths by (int8 and bf16 matmuls, AMX).
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# The distributions whose versions change what runs, in the order reported.
DISTRIBUTIONS = ("ortmodule", "torch", "onnxruntime-gpu", "onnxruntime", "onnxruntime-genai-cuda", "onnxruntime-genai",
                 "transformers", "tokenizers", "lm_eval", "accelerate", "onnx", "onnx-ir", "fastapi", "uvicorn",
                 "jinja2", "gguf", "llguidance")
# The oldest release of each dependency ortmodule runs on, with what breaks below it: pyproject.toml
# declares the same floors (a test compares them). The suite was run at and below each
# (docs/reliability.md "Older dependencies"); torch's is transformers' own.
FLOORS = {
    "transformers": ((5, 23), "its generate, cache and multimodal inputs changed within 5.x"),
    "torch": ((2, 6), "transformers 5 turns PyTorch off below 2.6"),
    "onnx-ir": ((0, 1, 12), "the graph rewrites use Value.replace_all_uses_with"),
    # Before 1.31 the fp32 path of 4-bit prefills (nbits.FORCE_FP32) is silently the int8 one, and the
    # model builder's packages (GroupQueryAttention's 12 inputs, LFM2's state_window) fail to load.
    "onnxruntime-gpu": ((1, 31), "4-bit prefills' fp32 path, the model builder's newest operators"),
}
# Distributions that install the same module as a FLOORS one, with its floor where installed instead of it:
# the CPU build of ONNX Runtime (`--no-deps` beside ortmodule, where onnxruntime-gpu has no wheel: macOS).
SAME_MODULE = {"onnxruntime": "onnxruntime-gpu"}
# The optional dependencies' floors that pyproject's extras declare, where a release above pip's lowest
# is needed (each extra that names one declares the same floor; a test compares them; docs/reliability.md
# "Older dependencies" says how each was found). Not checked at import, since ortmodule runs without them:
# where each is used (`ortmodule export` of a GGUF file, `ortmodule serve`) and by `ortmodule env`.
EXTRA_FLOORS = {
    "gguf": ((0, 13), "older releases cannot read a GGUF file under numpy 2, which removed ndarray.newbyteorder"),
    "accelerate": ((1, 1), "below it transformers loads no model with a device_map, as lm-eval's hf backend does"),
    "jinja2": ((3, 1, 6), "transformers' apply_chat_template needs it: chat requests, lm-eval's chat templates"),
    # 0.29 to 0.32.0 announce ASGI 2.4 without raising on a send to a closed connection, so a newer
    # starlette (0.48 tried) stops listening for the client to leave: a stream outlives its reader
    "uvicorn": ((0, 32, 1), "below it a stream's client leaving goes unheard under newer starlette, its rows run on"),
}


def too_old(name: str, version: str) -> str | None:
    """What is wrong where `name` at `version` is older than its FLOORS (SAME_MODULE's) or EXTRA_FLOORS
    entry, with the fix; None where it is new enough."""
    floor, why = {**FLOORS, **EXTRA_FLOORS}[SAME_MODULE.get(name, name)]
    if tuple(int(part) for part in re.findall(r"\d+", version)[:len(floor)]) >= floor:
        return None
    floor = ".".join(map(str, floor))
    return f"{name} {version} is older than ortmodule needs (>= {floor}: {why}). Fix: pip install -U '{name}>={floor}'"


def too_old_dependencies(installed: dict[str, str | None] | None = None, floors: dict = FLOORS) -> list[str]:
    """too_old's message for each of `floors`' distributions installed older than its floor (`installed`:
    name -> version, None where absent, as `versions()` gives it; this environment's where None)."""
    installed = versions() if installed is None else installed
    names = [*floors, *(name for name, same in SAME_MODULE.items() if same in floors)]
    return [message for name in names if installed.get(name) and (message := too_old(name, installed[name]))]


def installed_too_old(name: str) -> str | None:
    """too_old's message where `name` (a FLOORS, SAME_MODULE or EXTRA_FLOORS distribution) is installed older than its
    floor; None where it is new enough or not installed (the caller's ImportError says that)."""
    version = installed_version(name)
    return None if version is None else too_old(name, version)


# The module each of the distributions that install the same module installs (the CPU and GPU builds).
MODULE_OF = {"onnxruntime": "onnxruntime", "onnxruntime-gpu": "onnxruntime",
             "onnxruntime-genai": "onnxruntime_genai", "onnxruntime-genai-cuda": "onnxruntime_genai"}


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name`; None where it is not installed, or where it installs
    a MODULE_OF module that another install earlier on the import path shadows (an older CPU build in
    the system's site-packages under a GPU build on PYTHONPATH is never imported, so never checked)."""
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    return None if _shadowed(name) else version


def _shadowed(name: str) -> bool:
    """Whether distribution `name`'s MODULE_OF module is not the one `import` finds (another install of
    it comes earlier on sys.path)."""
    module = MODULE_OF.get(name)
    spec = util.find_spec(module) if module else None
    if spec is None or spec.origin is None:
        return False
    try:
        files = Path(metadata.distribution(name).locate_file(module)).resolve()
    except metadata.PackageNotFoundError:  # version() answered from elsewhere (a test's fake): nothing to compare
        return False
    # an editable or .pth install has no folder where its metadata is: that one is checked, never taken for shadowed
    return files.is_dir() and files != Path(spec.origin).resolve().parent


def versions() -> dict[str, str | None]:
    """Each of DISTRIBUTIONS' installed version, None where it is not installed."""
    return {name: installed_version(name) for name in DISTRIBUTIONS}


def cpu() -> str:
    """The CPU's model name, logical CPUs and which of CPU_FEATURES it has (where Linux tells them)."""
    from .mapped import cpu_info  # onnx and ONNX Runtime: imported where a report is made, not with the package

    model, flags = cpu_info()
    features = ", ".join(feature for feature in CPU_FEATURES if feature in flags.split())
    return f"{model}, {os.cpu_count()} logical CPUs" + (f" ({features})" if features else "")


def _not_imported(name: str) -> str:
    """What `env` says of a distribution `versions()` leaves out: shadowed (with its version), or not installed."""
    try:
        return f"{metadata.version(name)}, shadowed: another install of {MODULE_OF[name]} comes first on sys.path" \
            if _shadowed(name) else "not installed"
    except metadata.PackageNotFoundError:
        return "not installed"


def report() -> list[tuple[str, str]]:
    """(name, value) lines: the platform, Python, CPU, the versions, torch's CUDA devices, ONNX Runtime's
    execution providers, ortmodule's cache folder with its disk's free space, and whether packed weights are
    mapped from it (mapped.py)."""
    import onnxruntime as ort
    import torch

    lines = [("platform", platform.platform()), ("python", sys.version.split()[0]),
             ("cpu", cpu())]
    lines += [(name, version or _not_imported(name)) for name, version in versions().items()]
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    lines.append(("torch CUDA", f"{torch.version.cuda}: {', '.join(gpus)}" if gpus else
                  f"{torch.version.cuda or 'a CPU build'}, no device seen"))
    lines.append(("onnxruntime providers", ", ".join(ort.get_available_providers())))
    lines.append(("cache folder", f"{cache_home()} ({free_disk(cache_home())})"))
    from . import mapped  # with onnx: imported where a report is made

    lines.append(("packed weights mapped from disk", f"{'on' if mapped.wanted() else 'off'} ({mapped.SWITCH}="
                                                     f"{os.environ.get(mapped.SWITCH, 'unset')})"))
    return lines


def free_disk(folder: Path) -> str:
    """The free space on the disk that holds `folder` (or would hold it: its nearest existing parent)."""
    free = free_bytes(folder)
    return f"{free / 1e9:.1f} GB free" if isinstance(free, int) else free


def free_bytes(folder: Path) -> int | str:
    """Free bytes on the disk of `folder` or its nearest existing parent; why not, where they cannot be read."""
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    try:
        return shutil.disk_usage(existing).free if existing else "no such folder"
    except OSError as e:
        return f"free space unknown: {e.strerror or e}"


def mapping_problems(folder: Path | None = None) -> list[str]:
    """The packed weights' mapping switched on (mapped.py) where no entry can be written, whatever the
    model: the cache folder's disk has less free than the margin an entry leaves."""
    from . import mapped

    folder = folder or cache_home()
    free = free_bytes(folder)
    if not mapped.wanted() or not isinstance(free, int) or free >= mapped.HEADROOM:
        return []
    return [f"{mapped.SWITCH} is on, but {folder}'s disk has {free / 1e9:.1f} GB free: no packed weights are written "
            f"(an entry takes twice the weights and leaves {mapped.HEADROOM / 1e9:g} GB free), so each load packs "
            f"them in memory. Fix: free disk space there, or set ORTMODULE_CACHE to a folder on a larger disk"]


def problems(installed: dict[str, str | None] | None = None, providers: list[str] | None = None,
             torch_cuda: bool | None = None) -> list[str]:
    """What in this environment is known to break ortmodule, each with its fix: the CPU and GPU builds
    of ONNX Runtime (or of onnxruntime-genai) installed together, which write the same files (the one
    installed last wins, or a mix of both's files fails at import); a CUDA device torch sees that
    this ONNX Runtime build cannot run on; a dependency older than its FLOORS or EXTRA_FLOORS entry.
    Arguments left None are read from this environment."""
    installed = versions() if installed is None else installed
    if providers is None:
        import onnxruntime as ort

        providers = ort.get_available_providers()
    if torch_cuda is None:
        import torch

        torch_cuda = torch.cuda.is_available()
    found = too_old_dependencies(installed) + too_old_dependencies(installed, EXTRA_FLOORS)
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
    found = problems() + mapping_problems()
    for problem in found:
        print(f"problem: {problem}", file=out)
    return 1 if found else 0
