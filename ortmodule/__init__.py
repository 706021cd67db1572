"""ortmodule: Hugging Face-style causal LMs over ONNX GenAI packages, zero-copy through DLPack."""

from .environment import too_old_dependencies

if _too_old := too_old_dependencies():  # said here, not as a failure deep in generate or a graph rewrite
    raise ImportError("; ".join(_too_old))
from .auto import auto_classes, disable_auto_classes, enable_auto_classes
from .exporter import ExportError, export
from .hf import load_tokenizer
from .modeling import NotSupportedError, OrtModelForCausalLM
from .package import PackageError, read_package
from .scoring import loglikelihood, score

__all__ = ["ExportError", "NotSupportedError", "OrtModelForCausalLM", "PackageError", "auto_classes",
           "disable_auto_classes", "enable_auto_classes", "export", "load_tokenizer", "loglikelihood", "read_package",
           "score"]
__version__ = "0.1.0"
