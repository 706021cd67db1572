"""A package's public names imported at their first use (PEP 562's module `__getattr__`, as transformers does),
so that importing the package costs nothing until a name is used: `ortmodule` and `ortmodule.serving`, whose
command lines answer help and argument errors without torch, transformers or ONNX Runtime."""

from __future__ import annotations

import importlib
import importlib.util
import sys


def public_names(package: str, public: dict[str, str]):
    """The `__getattr__` and `__dir__` of `package`: each of `public`'s names (name -> the submodule that
    defines it) imported from its submodule at its first use and kept in the package; any submodule named
    as an attribute (`ortmodule.scoring`) imported too. Any other name is an AttributeError."""

    def __getattr__(name: str):
        if name in public:
            value = getattr(importlib.import_module(f".{public[name]}", package), name)
            vars(sys.modules[package])[name] = value  # later uses do not come here
            return value
        if name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return __getattr__, __dir__
