"""`ortmodule run`'s hook in the Python processes that a program it runs starts (`accelerate launch`'s
workers, a shell script's `python ...`): `ortmodule run` puts this folder first on their PYTHONPATH and sets
ORTMODULE_AUTO_CLASSES=1, and Python imports this file at start. Nothing is imported here: once the
process imports transformers, its auto classes are patched to load GenAI packages (ortmodule/auto.py), as
in `ortmodule run`'s own process. The sitecustomize this file hides (one further on the path), if any,
runs after it. A failure leaves the process as it was, with one line on stderr."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _AfterTransformers:
    """Finds `transformers` as the other finders do, and patches the auto classes once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                try:
                    import ortmodule

                    ortmodule.enable_auto_classes()
                except Exception as e:  # noqa: BLE001  the program runs on, as without ortmodule run
                    print(f"ortmodule run: transformers' auto classes not patched in this process "
                          f"({type(e).__name__}: {e})", file=sys.stderr)

            spec.loader.exec_module = exec_module
        return spec


def _chain() -> None:
    """Run the sitecustomize module that this one hides, as Python would have run it."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("ORTMODULE_AUTO_CLASSES") == "1" and "transformers" not in sys.modules:
    sys.meta_path.insert(0, _AfterTransformers())
_chain()
