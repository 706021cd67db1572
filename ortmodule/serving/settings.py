"""The server's settings and their defaults, written once (the command line and `create_app` read
them from here)."""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, fields

API_KEY_VARIABLE = "ORTMODULE_API_KEY"
# The parsers `tool_call_parser` and `reasoning_parser` name (vLLM's names: serving/tools.py, serving/reasoning.py);
# here, as this module imports nothing of the server's (`ortmodule serve --help` reads it without FastAPI).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "phi4_mini_json", "qwen3_coder", "pythonic", "lfm2",
                     "mistral", "gemma4", "functiongemma", "granite", "openai")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gemma4", "mistral", "granite", "openai_gptoss")
# apply_chat_template's own arguments, which `chat_template_kwargs` (a request's, or the server's defaults) may not
# set (the request's fields say whether the template adds the assistant's turn or continues the last message).
TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# `Settings.reuse_prefix` -> `scoring.label_logprobs`'s `reuse_prefix` (None: decided from measured costs).
REUSE_PREFIX = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class Settings:
    """How `ortmodule serve` batches and what it takes.

    Batching: `token_budget` prompt tokens of score and prompt-logprob requests per model call
    (None: `scoring.default_token_budget` of the model's device, 32,768 on CUDA and 8,192 on a CPU);
    `prefill_chunk` prompt tokens of generations started between two decode steps (a longer
    prompt runs in chunks this long); `max_rows` rows in the decode batch; `join_steps` decode steps
    new work may wait, while rows decode, to start together with more (every model call costs a
    pass over the weights); `window_ms` how long an idle engine waits for more score requests to
    batch with the first; `feed_tokens`: a prompt with at most this many tokens to run (past its
    cached prefix) joins a running decode batch at once, its prompt run a token per step (0: off);
    `prefix_cache_mb` MiB of recent prompts' KV kept for prompts that begin the same (0: off);
    `reuse_prefix` whether a score request's query (its items' common first tokens) runs once and
    its items over copies of its KV: "auto" (decided per request from the model's measured costs,
    `scoring.label_logprobs`), "on" or "off".

    Limits (a request beyond one is refused with 400, 413 or 503 before it is tokenized):
    `max_queue` requests waiting (being tokenized or queued); `max_body_bytes` per body;
    `max_items` choices (prompts x n) or score items per request; `max_labels` label ids per score request;
    `max_stop_chars` characters per stop string; `max_response_values` numbers in one answer
    (scores, log-probabilities); `max_connections` open connections (503 beyond);
    `header_timeout` and `body_timeout` seconds to receive a request's headers and its body;
    `keep_alive` seconds an idle connection stays open between requests (longer than clients keep
    one in their pools: httpx 5 s, aiohttp 15 s, Go 90 s; the client, not the server, closes it).

    `api_key`: when set, every `/v1` route and `/metrics` needs `Authorization: Bearer KEY`
    (else 401); default: the ORTMODULE_API_KEY environment variable, if set.

    `tokenizer_info`: whether `GET /tokenizer_info` answers (vLLM's `--enable-tokenizer-info-endpoint`:
    off by default, as it shows the tokenizer's settings and chat template).

    `trust_request_chat_template` (vLLM's `--trust-request-chat-template`): chat and tokenize requests may send their
    own `chat_template` (a template the server renders, or the name of one of the tokenizer's); off by default, as
    a template runs on the server (in Jinja's sandbox, but for as long as it loops): for trusted clients only.

    `trust_request_mm_kwargs` (vLLM's `--trust-request-mm-kwargs`): chat requests with images may send
    `mm_processor_kwargs`, the image processor's options of how many tokens an image becomes (serving/images.py's
    `REQUEST_OPTIONS`); off by default, as more pixels or crops cost the server more work.

    `enable_prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`): completions' and chat's usage carries
    `prompt_tokens_details.cached_tokens`, the prompt's tokens taken from the prefix cache (the Responses API's
    usage always does, as OpenAI's).

    `default_chat_template_kwargs` (vLLM's `--default-chat-template-kwargs`): the chat template's variables every
    chat request renders with (say `{"enable_thinking": false}`) unless the request's fields (`reasoning_effort`)
    or its own `chat_template_kwargs` set them. `mm_processor_kwargs` (vLLM's `--mm-processor-kwargs`): the image
    processor's options every request's images are made with, of those a request may send (serving/images.py's
    `REQUEST_OPTIONS`; needs `processor`), under a request's own.

    `processor`: a folder holding the checkpoint's image processor (`preprocessor_config.json`), for
    a package that takes images: chat messages may then hold `image_url` parts (serving/images.py).

    `generation_config`: where the OpenAI routes take the sampling fields a request leaves out
    (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`), as vLLM's `--generation-config`:
    "auto", the package's defaults (`model.generation_config`, from genai_config.json's search section);
    "vllm", OpenAI's (temperature 1, top_p 1, no top-k, min-p or penalty); or a folder holding a
    `generation_config.json` (the checkpoint's), its values (served.py's `sampling_defaults`); a `max_new_tokens`
    among them bounds a chat request that leaves its length out.

    `enable_auto_tool_choice` and `tool_call_parser` (vLLM's `--enable-auto-tool-choice` and `--tool-call-parser`):
    chat requests with tools may leave the choice to the model ("auto", the default beside tools), its calls read
    by the parser named (one of serving/tools.py's `PARSERS`). Without them only a named function, "required" or
    "none" is taken (serving/tools.py).

    `reasoning_parser` (vLLM's `--reasoning-parser`): a thinking model's `<think>...</think>` text answered apart
    from its content on the chat, responses and messages routes, by the parser named (one of
    serving/reasoning.py's `PARSERS`); None: the output is all content. A chat request's structured output (a
    grammar, a forced tool call) then holds the answer after the thinking, which stays free, unless
    `enable_in_reasoning` (vLLM's `--structured-outputs-config.enable_in_reasoning`): the grammar over the whole
    output, thinking included. `disable_any_whitespace` (vLLM's `--structured-outputs-config.disable_any_whitespace`):
    JSON kept to no whitespace between its tokens unless a request's `structured_outputs` says otherwise.

    `max_model_len` (vLLM's `--max-model-len`): the context requests are checked against, at most the package's
    (None: the package's).

    `allowed_origins` (vLLM's `--allowed-origins`): the web origins whose pages may call the server from a browser
    (CORS; `["*"]`: any); None, the default, answers no cross-origin request (vLLM's default is any origin: here a
    page from any site could read the server's answers, so it is asked for). `allowed_methods`, `allowed_headers`
    and `allow_credentials` (vLLM's `--allowed-methods`, `--allowed-headers`, `--allow-credentials`) go with it.

    `request_id_headers` (vLLM's `--enable-request-id-headers`): every answer carries an `X-Request-Id` header, the
    request's own or a new one (which the routes then see as the request's).

    `access_log` (off: vLLM's `--disable-uvicorn-access-log`): uvicorn's line per request; `uvicorn_log_level`
    (vLLM's `--uvicorn-log-level`): the HTTP server's log level, one of `UVICORN_LOG_LEVELS`.

    `ssl_keyfile`, `ssl_certfile` (vLLM's `--ssl-keyfile`, `--ssl-certfile`): serve HTTPS with this key and
    certificate (PEM files, checked to load together at start); `ssl_ca_certs` and `ssl_cert_reqs` (0 none, 1
    optional, 2 required: Python's `ssl.CERT_*`) ask clients for certificates signed by those authorities.

    `pooler_config` (vLLM's `--pooler-config`): how `/v1/embeddings` pools the final norm's outputs, `pooling_type`
    (or `seq_pooling_type`) `LAST` (the default, vLLM's for a decoder), `MEAN` or `CLS` (the first token), and
    whether it L2-normalizes them by default, `normalize` (or `use_activation`; true by default).

    `root_path` (vLLM's `--root-path`): the path a proxy serves the server under (say `/llm`, where the proxy sends
    `/llm/v1/completions` on, with the prefix or without it): routes answer under it and without it.
    """

    name: str | None = None
    token_budget: int | None = None
    prefill_chunk: int = 512
    max_rows: int = 32
    join_steps: int = 4
    feed_tokens: int = 16
    prefix_cache_mb: int = 512
    reuse_prefix: str = "auto"
    window_ms: float = 5.0
    max_queue: int = 256
    max_body_bytes: int = 8 * 2**20
    max_items: int = 1024
    max_labels: int = 1024
    max_stop_chars: int = 1000
    max_response_values: int = 2**20
    max_connections: int = 512
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive: float = 120.0
    api_key: str | None = None
    processor: str | None = None
    tokenizer_info: bool = False
    trust_request_chat_template: bool = False
    trust_request_mm_kwargs: bool = False
    enable_prompt_tokens_details: bool = False
    default_chat_template_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None
    generation_config: str = "auto"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    disable_any_whitespace: bool = False
    max_model_len: int | None = None
    allowed_origins: tuple | None = None
    allowed_methods: tuple = ("*",)
    allowed_headers: tuple = ("*",)
    allow_credentials: bool = False
    request_id_headers: bool = False
    access_log: bool = True
    uvicorn_log_level: str = "info"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    root_path: str | None = None
    pooler_config: dict | None = None

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in ("token_budget", "max_model_len", "allowed_origins", "root_path") and value is None:
                continue
            if field.name in ("allowed_origins", "allowed_methods", "allowed_headers"):
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
                    raise ValueError(f"{field.name} must be a list of strings, got {value!r}")
                continue
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{field.name} must be true or false, got {value!r}")
            elif field.name == "uvicorn_log_level":
                if value not in UVICORN_LOG_LEVELS:
                    raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got {value!r}")
            elif field.name == "reuse_prefix":
                if not isinstance(value, str) or value not in REUSE_PREFIX:
                    raise ValueError(f"reuse_prefix must be one of {', '.join(REUSE_PREFIX)}, got {value!r}")
            elif field.name in ("tool_call_parser", "reasoning_parser"):
                known = TOOL_CALL_PARSERS if field.name == "tool_call_parser" else REASONING_PARSERS
                if value is not None and value not in known:
                    raise ValueError(f"{field.name} must be one of {', '.join(known)}, got {value!r}")
            elif field.name == "root_path":
                if not isinstance(value, str) or not re.fullmatch(r"(/[^/?#\s]+)+", value):
                    raise ValueError(f"root_path must be a URL path such as /llm (a leading /, no trailing / or "
                                     f"query), got {value!r}")
            elif field.name == "ssl_cert_reqs":
                if value not in (0, 1, 2) or isinstance(value, bool):
                    raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2 (ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED), "
                                     f"got {value!r}")
            elif field.name in ("name", "api_key", "processor", "generation_config", "ssl_keyfile", "ssl_certfile",
                                "ssl_ca_certs"):
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"{field.name} must be a non-empty string, got {value!r}")
            elif field.type == "dict | None":
                if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                    raise ValueError(f"{field.name} must be a JSON object, got {value!r}")
            elif field.type == "float":
                low = 0 if field.name == "window_ms" else 1e-3
                high = 10_000 if field.name == "window_ms" else 86_400
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                    raise ValueError(f"{field.name} must be a number between {low} and {high}, got {value!r}")
            else:
                low = 0 if field.name in ("join_steps", "feed_tokens", "prefix_cache_mb") else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < low:
                    raise ValueError(f"{field.name} must be an integer >= {low}, got {value!r}")

        for key in self.default_chat_template_kwargs or {}:
            if key in TEMPLATE_ARGUMENTS:
                raise ValueError(f"default_chat_template_kwargs may not set {key!r}, an argument of the template's "
                                 "rendering itself")
        if self.mm_processor_kwargs and self.processor is None:
            raise ValueError("mm_processor_kwargs are the image processor's options: they need processor (--processor "
                             "FOLDER)")
        _check_tls(self)
        pooling(self.pooler_config)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser): the parser that "
                             f"reads the model's calls, one of {', '.join(TOOL_CALL_PARSERS)}")

    @property
    def tls(self) -> dict:
        """uvicorn's TLS options (none without a certificate)."""
        if self.ssl_certfile is None:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs}

    @classmethod
    def with_environment(cls, **given) -> Settings:
        """The settings given, the API key from the environment when not given."""
        if given.get("api_key") is None and os.environ.get(API_KEY_VARIABLE):
            given["api_key"] = os.environ[API_KEY_VARIABLE]
        return cls(**given)


POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's sequence pooling types
_POOLER_KEYS = {"pooling_type": POOLING_TYPES, "seq_pooling_type": POOLING_TYPES, "normalize": (True, False),
                "use_activation": (True, False)}


def pooling(config: dict | None) -> tuple[str, bool]:
    """vLLM's `--pooler-config` read: (the pooling type, whether embeddings are normalized by default); a
    ValueError naming a key this server does not carry out or a value it does not take."""
    config = config or {}
    for key, value in config.items():
        if key not in _POOLER_KEYS:
            raise ValueError(f"pooler_config {key!r} is not supported by this server; it takes "
                             f"{', '.join(_POOLER_KEYS)}")
        if not any(value == v and type(value) is type(v) for v in _POOLER_KEYS[key]):
            raise ValueError(f"pooler_config {key} must be one of {', '.join(map(str, _POOLER_KEYS[key]))}, got "
                             f"{value!r}")
    kinds = {config[key] for key in ("pooling_type", "seq_pooling_type") if key in config}
    flags = {config[key] for key in ("normalize", "use_activation") if key in config}
    if len(kinds) > 1 or len(flags) > 1:
        raise ValueError(f"pooler_config gives two values of one setting: {config}")
    return next(iter(kinds), "LAST"), next(iter(flags), True)


def _check_tls(settings: Settings) -> None:
    """The TLS files load together (ValueError naming the fault), before the package does."""
    if settings.ssl_keyfile is None and settings.ssl_certfile is None:
        if settings.ssl_ca_certs is not None or settings.ssl_cert_reqs:
            raise ValueError("ssl_ca_certs and ssl_cert_reqs need ssl_certfile and ssl_keyfile (HTTPS)")
        return
    if settings.ssl_certfile is None:
        raise ValueError("ssl_keyfile needs ssl_certfile (the certificate of that key)")
    if settings.ssl_cert_reqs and settings.ssl_ca_certs is None:  # else no client certificate could be verified
        raise ValueError(f"ssl_cert_reqs {settings.ssl_cert_reqs} (client certificates) needs ssl_ca_certs, the "
                         "authorities that sign them")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
        if settings.ssl_ca_certs is not None:
            context.load_verify_locations(settings.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"the TLS files do not load (ssl_certfile {settings.ssl_certfile}, ssl_keyfile "
                         f"{settings.ssl_keyfile}, ssl_ca_certs {settings.ssl_ca_certs}): {e}") from None
