"""`ortmodule serve`: SGLang's and vLLM's score APIs and OpenAI's completions over one OrtModelForCausalLM.

Layers, imported one way: app (auth, limits, errors, HTTP server) -> routes (score_routes,
openai_routes; wire schemas in schemas.py) -> engine (one model thread, one scheduler over the
job protocol of jobs.py, continuous batching) -> the model.

Its public names are imported at their first use (as ortmodule's own, ortmodule/__init__.py): `ortmodule serve
--help` and the flags' errors need the settings alone, not the app, FastAPI and the model.
"""

import importlib

_PUBLIC = {"create_app": "app", "serve": "app", "ServingError": "errors", "Settings": "settings"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
