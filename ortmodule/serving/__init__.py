"""`ortmodule serve`: SGLang's and vLLM's score APIs and OpenAI's completions over one OrtModelForCausalLM.

Layers, imported one way: app (auth, limits, errors, HTTP server) -> routes (score_routes,
openai_routes; wire schemas in schemas.py) -> engine (one model thread, one scheduler over the
job protocol of jobs.py, continuous batching) -> the model.
"""

from .app import create_app, serve
from .errors import ServingError
from .settings import Settings

__all__ = ["Settings", "ServingError", "create_app", "serve"]
