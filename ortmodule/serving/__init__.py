"""`ortmodule serve`: SGLang's and vLLM's score APIs and OpenAI's completions over one OrtModelForCausalLM.

Layers, imported one way: app (auth, limits, errors, HTTP server) -> routes (score_routes,
openai_routes; wire schemas in schemas.py) -> engine (one model thread, one scheduler over the
job protocol of jobs.py, continuous batching) -> the model.

Its public names are imported at their first use (as ortmodule's own: lazy.py): `ortmodule serve
--help` and the flags' errors need the settings alone, not the app, FastAPI and the model.
"""

from ..lazy import public_names

_PUBLIC = {"create_app": "app", "serve": "app", "ServingError": "errors", "Settings": "settings"}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = public_names(__name__, _PUBLIC)
