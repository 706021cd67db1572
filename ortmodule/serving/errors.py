"""The server's one error type, and its shape in each API.

A refusal anywhere (a check, the queue, the model's work) is a `ServingError` with the HTTP status
and the field at fault; the app writes it as OpenAI's `{"error": {...}}` on the OpenAI routes, as
Anthropic's `{"type": "error", "error": {...}}` on `/v1/messages`, and as SGLang's `{"object": "error",
"message", "code"}` elsewhere. Bodies are written with every
non-ASCII character escaped, so that no text a client sent (a lone surrogate included) can break
the JSON of the answer.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

# Routes whose errors take OpenAI's shape (vLLM's tokenizer and generative scoring routes answer in it too).
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/embeddings", "/tokenize",
                "/detokenize", "/tokenizer_info", "/generative_scoring", "/generate")


class ServingError(Exception):
    """A request refused: HTTP `status`, `param` the field at fault, `code` OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def openai_body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def sglang_body(self) -> dict:
        return {"object": "error", "message": str(self), "code": self.status}

    def anthropic_body(self) -> dict:
        """Anthropic's error shape (`/v1/messages`), its type by the status as Anthropic's API names them."""
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": str(self)}}

    def body(self, path: str) -> dict:
        if path.startswith("/v1/messages"):
            return self.anthropic_body()
        return self.openai_body() if path.startswith(OPENAI_PATHS) else self.sglang_body()

    def response(self, path: str) -> JSONResponse:
        return AsciiJSON(self.body(path), status_code=self.status)


def busy(waiting: int) -> ServingError:
    return ServingError(f"the server is busy: {waiting} requests are waiting; retry later", status=503)


def gone() -> ServingError:
    return ServingError("the client closed the connection before the answer", status=499)


def failed(what: str, error: BaseException) -> ServingError:
    return ServingError(f"{what} failed: {type(error).__name__}: {error}", status=500)


class AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate in a client's text becomes `\\ud800`, valid JSON."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def dumps(content) -> str:
    """A server-sent event's data, escaped as `AsciiJSON` is."""
    return json.dumps(content, ensure_ascii=True, separators=(",", ":"))
