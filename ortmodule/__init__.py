"""ortmodule: Hugging Face-style causal LMs over ONNX GenAI packages, zero-copy through DLPack.

The public names below are imported at their first use (lazy.py): `import ortmodule` costs the dependency
check alone, so that the command lines (`ortmodule --help`, `ortmodule cache`, an argument's error) answer
without loading torch, transformers and ONNX Runtime (some 3-4 s on 2 CPU cores). `from ortmodule import
OrtModelForCausalLM` and `ortmodule.score(...)` work as ever, and so does a submodule named as an attribute
(`ortmodule.scoring`)."""

from .environment import too_old_dependencies
from .lazy import public_names

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

__getattr__, __dir__ = public_names(__name__, _PUBLIC)
