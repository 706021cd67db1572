"""The package's structure, read from its source: imports flow one way (no cycle), no module
reaches into another's private names, no function or class grows past what a reader holds at once,
and the product imports only what it declares."""

import ast
import json
import os
import platform
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PACKAGE = ROOT / "ortmodule"
# Every module of the package, by its dotted name inside it ("modeling", "serving.engine"); a
# subpackage's __init__ only gathers names, so it is not a module of its own here.
MODULES = {
    ".".join(path.relative_to(PACKAGE).with_suffix("").parts): ast.parse(path.read_text(), str(path))
    for path in sorted(PACKAGE.rglob("*.py")) if path.name != "__init__.py" and "tasks" not in path.parts
}
# Optional parts: what each needs beyond the core dependencies (their extras in pyproject.toml).
EXTRAS = {"lm_eval": "lmeval", "lm_eval_multimodal": "lmeval", "cli": "lmeval", "exporter": "export", "olive": "olive",
          **{name: "serve" for name in MODULES if name.startswith("serving.")}}


def internal_imports(name: str, tree: ast.Module) -> dict[str, set[str]]:
    """Module -> the names imported from it, for every relative import of another module."""
    package = name.split(".")[:-1]
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = package[: len(package) - node.level + 1]
            if node.module:
                found.setdefault(".".join(base + node.module.split(".")), set()).update(a.name for a in node.names)
            else:  # from . import a, b
                for alias in node.names:
                    found.setdefault(".".join(base + [alias.name]), set())
    return {module: names for module, names in found.items() if module in MODULES}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_imports_form_no_cycle():
    graph = {name: set(internal_imports(name, tree)) for name, tree in MODULES.items()}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in graph[name]:
            assert state.get(other) != "open", f"import cycle: {' -> '.join(path + [name, other])}"
            if other not in state:
                visit(other, path + [name])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [])


def test_no_module_uses_another_modules_private_names():
    own = {}  # module -> private names it defines (functions, classes, attributes set on self)
    for name, tree in MODULES.items():
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
                names.add(node.name)
            is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            if is_self and private(node.attr) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            if isinstance(node, ast.Name) and private(node.id) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        own[name] = names
    problems = []
    for name, tree in MODULES.items():
        imported = internal_imports(name, tree)
        for module, names in imported.items():
            problems += [f"{name} imports {module}.{n}" for n in names if private(n)]
        elsewhere = set().union(*(own[m] for m in MODULES if m != name)) - own[name]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not private(node.attr):
                continue
            base = node.value.id if isinstance(node.value, ast.Name) else None
            local_names = {module.split(".")[-1] for module in imported}
            if base in local_names or (base not in ("self", "cls") and node.attr in elsewhere):
                problems.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
    assert not problems, problems


def test_functions_and_classes_stay_short():
    long = []
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                limit = 250 if isinstance(node, ast.ClassDef) else 60
                if lines > limit:
                    long.append(f"{name}.{node.name}: {lines} lines (limit {limit})")
    assert not long, long


def test_the_product_imports_only_its_declared_dependencies():
    import_names = {"onnxruntime-gpu": "onnxruntime", "onnx-ir": "onnx_ir", "lm-eval": "lm_eval",
                    "onnxruntime-genai-cuda": "onnxruntime_genai", "olive-ai": "olive", "pillow": "PIL"}

    def names(requirements: list[str]) -> set[str]:
        out = set()
        for requirement in requirements:
            distribution = requirement.split(">")[0].split("=")[0].split("<")[0].strip()
            out.add(import_names.get(distribution, distribution.replace("-", "_")))
        return out

    core = names(PROJECT["dependencies"])
    extras = {extra: names(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}
    # What the declared packages bring themselves (transformers: tqdm; fastapi: pydantic, starlette).
    brought = {"tqdm", "pydantic", "starlette"}
    stdlib = sys.stdlib_module_names
    problems = []
    for name, tree in MODULES.items():
        # (`ortmodule` by name: autoload/sitecustomize.py, a top-level module in the processes it runs in)
        allowed = core | extras.get(EXTRAS.get(name, ""), set()) | brought | {"ortmodule"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = [node.module.split(".")[0]]
            else:
                continue
            problems += [f"{name} imports {top}" for top in tops if top not in stdlib and top not in allowed]
    assert not problems, problems
    unused = {dep for dep in core if not any(
        isinstance(n, (ast.Import,
                       ast.ImportFrom)) and dep in ast.unparse(n) for t in MODULES.values() for n in ast.walk(t)
    )}
    assert not unused, f"declared but never imported by ortmodule: {unused}"


def test_requires_python_is_the_oldest_python_the_dependencies_install_on():
    """pyproject's requires-python is the highest Python floor of the core dependencies as installed: lower, and pip
    on the older Python fails on a dependency with no release for it instead of naming the Python (it said >= 3.10
    until session 84, where transformers from 5.21 and onnxruntime-gpu 1.31 install on 3.11 and newer only: pip on
    3.10 answered that no onnxruntime-gpu>=1.31 exists); higher, and ortmodule refuses a Python it runs on. Should a
    dependency's newest release need a newer Python, check whether its floor release still installs on the older
    one (docs/reliability.md "Python versions") before raising ortmodule's."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    ours = SpecifierSet(PROJECT["requires-python"])
    floors = {}
    for requirement in PROJECT["dependencies"]:
        name = Requirement(requirement).name
        needs = SpecifierSet(metadata.metadata(name)["Requires-Python"] or "")
        floors[f"{name} {metadata.version(name)}"] = max(
            (Version(spec.version) for spec in needs if spec.operator == ">="), default=Version("0"))
    [floor] = [Version(spec.version) for spec in ours if spec.operator == ">="]
    assert floor == max(floors.values()), (str(ours), floors)
    assert platform.python_version() in ours


HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "lm_eval", "fastapi", "starlette")
# What each command does before anything heavy is needed: help, an argument's error, the cache's listing.
LIGHT_COMMANDS = (["--help"], ["--version"], ["serve", "--help"], ["serve"], ["export", "--help"], ["info", "--help"],
                  ["cache", "list"], ["run", "--help"], ["run"], ["run", "no-such-command-here"],
                  ["run", "missing.py"], ["run", "-m", "no_such_module"])


def test_the_package_and_its_command_lines_answers_import_nothing_heavy(tmp_path):
    """`import ortmodule` checks the dependencies and imports nothing else until a name is used, and the
    command line's help, argument errors and cache listing answer without torch, transformers, ONNX Runtime
    or lm-eval (each of which `ortmodule --help` used to wait for: 5 s, 8 s for `ortmodule run --help`, on 2
    CPU cores); the public names and submodules are there when used, as before."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import contextlib, io, json, sys\n"
        "import ortmodule\n"
        "from ortmodule.cli import ortmodule as command\n"
        "out, err, code = io.StringIO(), io.StringIO(), None\n"
        "with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "    try:\n"
        "        command(json.loads(sys.argv[1]))\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        f"print(json.dumps([code, err.getvalue(), sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n")
    for argv in LIGHT_COMMANDS:
        done = subprocess.run([sys.executable, str(probe), json.dumps(argv)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "ORTMODULE_CACHE": str(tmp_path / "c")})
        assert done.returncode == 0, done.stderr
        code, err, heavy = json.loads(done.stdout.strip().splitlines()[-1])
        assert heavy == [], (argv, heavy)
        assert (code in (0, None)) == (argv in (["--help"], ["--version"], ["serve", "--help"], ["export", "--help"],
                                                 ["info", "--help"], ["cache", "list"], ["run", "--help"])), (argv, err)
    import ortmodule

    assert ortmodule.OrtModelForCausalLM.__module__ == "ortmodule.modeling"
    assert ortmodule.scoring.score is ortmodule.score
    assert set(ortmodule.__all__) <= set(dir(ortmodule))
    namespace: dict = {}
    exec("from ortmodule import *", namespace)
    assert {name for name in namespace if not name.startswith("__")} == set(ortmodule.__all__)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = ortmodule.no_such_name
    assert not hasattr(ortmodule, "no_such.module")  # never an ImportError from hasattr
