"""`ortmodule run PROGRAM [ARGS...]`: a program run with transformers' auto classes loading GenAI packages
(auto.py). What it is given is checked before torch, transformers and the model's code are imported (some
3-4 s on 2 CPU cores), so that help and a mistyped program answer at once; a program that is not Python
(`accelerate`'s launcher, a shell script) is started without importing them at all."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

# `ortmodule run`'s hook for the Python processes a program starts (a folder holding a sitecustomize.py).
AUTOLOAD = Path(__file__).parent / "autoload"


def _refuse(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as the other commands' argument errors (argparse's)."""
    print(f"ortmodule run: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_module(name: str) -> None:
    """`-m name` names a module that can run, as `python -m` checks it, else one line (no runpy traceback)."""
    try:
        spec = importlib.util.find_spec(name)
        runnable = spec is None or spec.submodule_search_locations is None or importlib.util.find_spec(
            f"{name}.__main__") is not None
    except (ImportError, ValueError):  # a parent package missing, or a name Python cannot import
        spec = None
    if spec is None:
        _refuse(f"no module named {name}")
    if not runnable:
        _refuse(f"{name} is a package without a __main__ module: it cannot be run with -m")


def _start(argv: list[str]) -> None:
    """A program that is not Python, started in this process's place where the system can (POSIX's exec:
    its PID is this one, so a scheduler's SIGTERM or a Ctrl-C reaches it alone, and its exit status is
    the one seen), after what this process printed (a sitecustomize's lines) is flushed, before its own."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execvp(argv[0], argv)
    raise SystemExit(subprocess.call(argv))


def run_program(argv: list[str]) -> None:
    """`ortmodule run PROGRAM [ARGS...]`: PROGRAM (an installed Python command such as `lm_eval` or
    `lighteval`, a Python file, or `-m MODULE`) run in this process, with ARGS as its command line and
    the auto classes patched; any other program (`accelerate`'s launcher, `torchrun`, a shell script)
    takes this process's place (its PID: signals reach it alone). Either way the Python processes it
    starts patch them too, once they import transformers (autoload/sitecustomize.py, first on their
    PYTHONPATH). The exit status is the program's."""
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: ortmodule run PROGRAM [ARGS ...] | ortmodule run -m MODULE [ARGS ...]\n\n"
              + inspect.cleandoc(run_program.__doc__))
        raise SystemExit(0)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        _refuse("name the program to run: a command, a Python file, or -m MODULE")
    path = Path(argv[0])
    found = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == argv[0]]
    if argv[0] == "-m":
        kind = "module"
    elif path.suffix == ".py":
        if not path.is_file():
            _refuse(f"no file {argv[0]}")
        kind = "file"
    elif found and "/" not in argv[0]:
        kind = "command"
    elif shutil.which(argv[0]) is None:
        _refuse(f"{argv[0]!r} is no command of this environment, nor a Python file")
    else:
        kind = "other"
    os.environ["ORTMODULE_AUTO_CLASSES"] = "1"  # for the processes it starts
    os.environ["PYTHONPATH"] = os.pathsep.join([str(AUTOLOAD), *filter(None, [os.environ.get("PYTHONPATH")])])
    if kind == "module":
        _check_module(argv[1])
    if kind == "other":
        _start(argv)
    from .auto import enable_auto_classes

    enable_auto_classes()
    if kind == "module":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif kind == "file":
        sys.argv = list(argv)
        sys.path.insert(0, str(path.resolve().parent))
        runpy.run_path(str(path), run_name="__main__")
    else:
        sys.argv = list(argv)
        sys.exit(found[0].load()())
