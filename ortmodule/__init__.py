"""ortmodule: Hugging Face-style causal LMs over ONNX GenAI packages, zero-copy through DLPack.

The public names below are imported at their first use (PEP 562's module `__getattr__`), as transformers'
are: `import ortmodule` costs the dependency check alone, so that the command lines (`ortmodule --help`,
`ortmodule cache`, an argument's error) answer without loading torch, transformers and ONNX Runtime (some
3-4 s on 2 CPU cores). `from ortmodule import OrtModelForCausalLM` and `ortmodule.score(...)` work as
ever, and so does a submodule named as an attribute (`ortmodule.scoring`)."""

import importlib
import importlib.util

from .environment import too_old_dependencies

if _too_old := too_old_dependencies():  # said here, not as a failure deep in generate or a graph rewrite
    raise ImportError("; ".join(_too_old))

# Each public name -> the submodule that defines it.
_PUBLIC = {
    "auto_classes": "auto", "disable_auto_classes": "auto", "enable_auto_classes": "auto",
    "ExportError": "exporter", "export": "exporter",
    "load_tokenizer": "hf",
    "NotSupportedError": "modeling", "OrtModelForCausalLM": "modeling",
    "PackageError": "package", "read_package": "package",
    "loglikelihood": "scoring", "score": "scoring",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name, imported from its submodule at its first use; a submodule, imported."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value  # later uses do not come here
        return value
    if name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
