"""Command lines.

`ortmodule-eval`: lm-eval's command line with the `ortmodule` model registered (lm-eval discovers
no plugins, so the registration has to happen in the same process), and ortmodule's shipped tasks
found without `--include_path` (`resolve_tasks_as_ortmodule`).
`ortmodule export SRC OUT`: a GenAI package from a Hugging Face folder or a GGUF file (ortmodule/exporter.py).
`ortmodule serve PATH`: SGLang's `/v1/score`, vLLM's `/generative_scoring`, OpenAI's `/v1/completions`,
`/v1/chat/completions` and `/v1/responses`, Anthropic's `/v1/messages` (ortmodule/serving/).
`ortmodule cache list|clear`: what ortmodule keeps in its cache folder, and clearing it (ortmodule/cache_folder.py).
`ortmodule env`: the versions, devices and providers, for a bug report (ortmodule/environment.py).
`ortmodule info PATH`: what a package is, read from its files (ortmodule/describe.py).
"""

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import logging
import os
import re
import sys


class _ThroughLmEval(logging.Handler):
    """ortmodule's log records through lm-eval's own handlers, at lm-eval's level (`--verbosity`,
    `LMEVAL_LOG_LEVEL`): ortmodule-eval prints what the backend decides (the prefill graph, the rank
    that left the process group) beside lm-eval's lines, in their format."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("lm_eval")
        if record.levelno < target.getEffectiveLevel():
            return
        for handler in target.handlers or [logging.lastResort]:  # before lm-eval set its up: stderr
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import lm_eval_multimodal  # noqa: F401  importing it registers --model ortmodule-multimodal
    from .lm_eval import ModelArgsError, leave_process_group  # importing it registers --model ortmodule
    from .package import NotSupportedError, PackageError

    log = logging.getLogger("ortmodule")
    log.setLevel(logging.DEBUG)  # the handler applies lm-eval's level
    log.addHandler(_ThroughLmEval())
    log.propagate = False
    resolve_tasks_as_ortmodule()
    try:
        cli_evaluate()
    except (PackageError, NotSupportedError, ModelArgsError) as e:  # ortmodule's own, each naming the problem
        raise SystemExit(f"ortmodule-eval: error: {e}") from None
    finally:
        leave_process_group()  # data parallel: gloo's threads must not outlive the interpreter


def resolve_tasks_as_ortmodule() -> None:
    """lm-eval's command line resolves tasks through `tasks.task_manager` from now on: ortmodule's
    shipped tasks are found without `--include_path` by a run, `ls` and `validate`, and where every
    `--tasks` name of a run or `validate` is a task of those or of `--include_path`'s folders, lm-eval's
    ~14,700 built-in task configs are not indexed (15 s on a 2-vCPU AMD EPYC, every run). lm-eval 0.4.13
    builds each manager itself (`EvaluatorConfig.process_tasks`, `List._execute`, `Validate._execute`),
    so its `TaskManager` is swapped for those calls; a method an lm-eval lacks keeps lm-eval's way."""
    from . import tasks

    def names_of(given) -> list[str] | None:
        if given is None:
            return None
        return given.split(",") if isinstance(given, str) else [n for name in given for n in str(name).split(",")]

    def run(process):
        def process_tasks(config, metadata: dict | None = None):
            made = tasks.task_manager(names_of(config.tasks), config.include_path,
                                      (metadata or config.metadata) or {})
            return _with_task_manager(lambda *args, **kwargs: made, process, config, metadata)
        return process_tasks

    def listing(execute):
        def _execute(self, args):
            made = tasks.task_manager(names_of(getattr(args, "tasks", None)), args.include_path)
            return _with_task_manager(lambda *args, **kwargs: made, execute, self, args)
        return _execute

    for module, owner, method, wrap in (("lm_eval.config.evaluate_config", "EvaluatorConfig", "process_tasks", run),
                                        ("lm_eval._cli.ls", "List", "_execute", listing),
                                        ("lm_eval._cli.validate", "Validate", "_execute", listing)):
        try:
            cls = getattr(importlib.import_module(module), owner)
        except (ImportError, AttributeError):
            continue
        original = getattr(cls, method, None)
        if original is None or getattr(original, "ortmodule", False):
            continue
        wrapped = wrap(original)
        wrapped.ortmodule = True
        setattr(cls, method, wrapped)


def _with_task_manager(factory, call, *args):
    """`call(*args)` with `lm_eval.tasks.TaskManager` replaced by `factory` (the manager the call builds)."""
    from lm_eval import tasks as lm_eval_tasks

    manager = lm_eval_tasks.TaskManager
    lm_eval_tasks.TaskManager = factory
    try:
        return call(*args)
    finally:
        lm_eval_tasks.TaskManager = manager


def ortmodule(argv: list[str] | None = None) -> None:
    from . import __version__

    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["run"]:  # the program's arguments are not ortmodule's to parse
        _run(given[1:])
        return
    parser = argparse.ArgumentParser(prog="ortmodule", description="ortmodule command line")
    parser.add_argument("--version", action="version", version=f"ortmodule {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export", help="export a Hugging Face folder or a GGUF file to a GenAI package (onnxruntime-genai's "
                       "model builder)"
    )
    export.add_argument("source", help="a Hugging Face checkpoint folder (config.json, weights, tokenizer), a Hub "
                                       "repository id of one (org/name), or a .gguf file")
    export.add_argument("--revision", default=None, help="the repository's branch, tag or commit (default: main)")
    export.add_argument("--gguf-file", default=None, metavar="NAME",
                        help="the GGUF file of the repository (or folder) to export, e.g. model-Q8_0.gguf")
    export.add_argument("out", help="the package folder to write")
    export.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "int4", "int8"])
    export.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="the execution provider it is built for")
    export.add_argument("--extra-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to the builder's --extra_options (repeatable), e.g. algo_config=k_quant_mixed; "
                             "a key the installed builder does not read is refused")
    export.add_argument("--images", action="store_true",
                        help="a Gemma 3 checkpoint's vision tower too (fp32, int4 or int8 for the CPU), so that the "
                             "package takes images (docs/usage.md)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.add_argument("--quiet", action="store_true", help="no progress output")
    _serve_flags(commands)
    _run_batch_flags(commands)
    _cache_flags(commands)
    commands.add_parser("env", help="the versions, devices and execution providers ortmodule runs with (for a bug "
                                    "report), and the installs known to break it (exit status 1 where there is one)")
    _info_flags(commands)
    _run_flags(commands)
    args = parser.parse_args(argv)
    if args.command in ("env", "info", "cache"):
        _printing(parser, args)
        return
    if args.command == "export":
        _export(parser, args)
        return
    _serve(parser, args)


def _serve(parser: argparse.ArgumentParser, args) -> None:
    """`serve` and `run-batch`: the package loaded with the settings the flags give."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .serving import Settings

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)}
    for name, value in (args.structured_outputs_config or {}).items():  # the JSON form; its backend is ours
        if name != "backend":
            options[name] = value
    loading = dict(device=args.device, fp32_lm_head=args.enable_fp32_lm_head, prefill_attention=args.prefill_attention,
                   subfolder=args.subfolder, revision=args.revision, chat_template=args.chat_template)
    if args.command == "run-batch" and (args.path is None) == (args.model is None):
        parser.error("run-batch takes the package as PATH or as --model PACKAGE (vllm run-batch's), one of them")
    try:
        if args.command == "run-batch":
            from .serving.batch_file import run_batch_file

            logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request: the progress bar says it
            metrics = (args.url, args.port) if args.enable_metrics else None
            run_batch_file(args.input_file, args.output_file, args.path or args.model, metrics=metrics,
                           resume=args.resume, output_tmp_dir=args.output_tmp_dir, progress=args.progress, **loading,
                           **options)
        else:
            from .serving import serve

            serve(args.path, host=args.host, port=args.port, **loading, **options)
    except ValueError as e:  # what stops it before it serves: the package, a setting, --processor, the batch's file
        parser.exit(2, f"ortmodule {args.command}: error: {e}\n")  # one line, as `ortmodule export`'s
    except KeyboardInterrupt:  # run-batch stopped (serve's uvicorn takes Ctrl-C itself): its log said what was kept
        parser.exit(130, f"ortmodule {args.command}: stopped\n")


def _printing(parser: argparse.ArgumentParser, args) -> None:
    """The commands that print a report (env, info, cache); one whose reader left (`ortmodule info --json
    PACKAGE | head`) ends quietly, as other command-line tools do, not with a BrokenPipeError's traceback."""
    status = 0
    try:
        if args.command == "env":
            from .environment import print_report

            status = print_report()
        elif args.command == "info":
            _info(parser, args)
        else:
            _cache(args)
        sys.stdout.flush()  # here, where a reader's leaving is caught, not at exit (stdout is buffered in a pipe)
    except BrokenPipeError:
        # Python's own advice: stdout to devnull, so that the flush at exit does not fail again (where stdout
        # is a file: not a caller's capture)
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    if status:
        raise SystemExit(status)


def _run_flags(commands) -> None:
    """`ortmodule run`, parsed by `_run` before argparse sees it (its program's arguments are the program's)."""
    run = commands.add_parser(
        "run", help="run a program (an installed Python command such as lm_eval or lighteval, a Python file, or "
                    "-m MODULE) with transformers' auto classes loading GenAI packages: "
                    "AutoModelForCausalLM.from_pretrained(package) gives an OrtModelForCausalLM")
    run.add_argument("program", help="the command, file or -m MODULE, then its own arguments")


def _run(argv: list[str]) -> None:
    from .programs import run_program

    run_program(argv)


def _info_flags(commands) -> None:
    info = commands.add_parser("info", help="what a package is, read from its files: the model's shape, what it was "
                                            "exported for, its weights and graphs, its generation defaults")
    info.add_argument("path", help="the package folder, or a Hub repository id holding one")
    info.add_argument("--subfolder", default=None, help="the package's folder within the repository")
    info.add_argument("--revision", default=None, help="the repository's branch, tag or commit (default: main)")
    info.add_argument("--json", action="store_true", help="one JSON object instead of lines")


def _info(parser: argparse.ArgumentParser, args) -> None:
    from .describe import print_description
    from .package import PackageError

    try:
        print_description(args.path, args.subfolder, args.revision, as_json=args.json)
    except PackageError as e:  # one line, exit status 2, as for the other commands' bad arguments
        parser.exit(2, f"ortmodule info: error: {e}\n")


# The serving settings' flags (defaults: ortmodule/serving/settings.py).
_SETTING_HELP = {
    "token_budget": "prompt tokens of score and prompt-logprob requests per model call",
    "prefill_chunk": "prompt tokens of new generations run between two decode steps (longer prompts in chunks)",
    "max_rows": "generations decoded together (the continuous batch; vLLM's --max-num-seqs)",
    "join_steps": "decode steps new work may wait to start together with more (fewer model calls)",
    "feed_tokens": "a prompt with at most this many tokens to run past its cached prefix joins the running "
                   "batch at once, a token per step (0: off)",
    "prefix_cache_mb": "MiB of recent prompts' KV kept for prompts that begin the same (0: off)",
    "window_ms": "how long an idle server waits for more score requests to batch with the first",
    "max_queue": "requests waiting (being tokenized or queued) before answering 503",
    "max_body_bytes": "larger request bodies are refused with 413 before parsing",
    "max_items": "choices (prompts x n) or score items per request",
    "max_labels": "label_token_ids per score request",
    "max_stop_chars": "characters per stop string",
    "max_response_values": "numbers (scores, log-probabilities) in one answer",
    "max_connections": "open connections (503 beyond)",
    "header_timeout": "seconds to receive a request's headers",
    "body_timeout": "seconds to receive a request's body (408 beyond)",
    "keep_alive": "seconds an idle connection stays open between requests (longer than clients' pools keep one)",
}

# vLLM's names of the same settings
_SETTING_ALIASES = {"max_rows": ("--max-num-seqs",)}


def _serve_flags(commands) -> None:
    """The `serve` command's flags."""
    serve = commands.add_parser("serve", help="serve a GenAI package: SGLang's /v1/score, vLLM's /generative_scoring, "
                                              "OpenAI's /v1/completions, /v1/chat/completions and /v1/responses "
                                              "(FastAPI + uvicorn)")
    _answer_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on /v1 routes and "
                            "/metrics (default: the ORTMODULE_API_KEY environment variable)")
    serve.add_argument("--enable-tokenizer-info-endpoint", dest="tokenizer_info", action="store_true",
                       help="answer GET /tokenizer_info (the tokenizer's settings and chat template, which lm-eval's "
                            "tokenizer_backend=remote reads), as vLLM's flag of that name; off by default")
    _http_flags(serve)


def _run_batch_flags(commands) -> None:
    """The `run-batch` command's flags: serve's that shape the answers, the files'."""
    batch = commands.add_parser("run-batch", help="run a file of requests in OpenAI's batch format (JSONL: custom_id, "
                                                  "method, url, body; as vllm run-batch) through the server's routes, "
                                                  "no port opened; the answers in the input's order")
    batch.add_argument("-i", "--input-file", required=True, metavar="FILE|URL",
                       help="the requests: a JSONL file, - for standard input, or an http(s) URL to GET")
    batch.add_argument("-o", "--output-file", required=True, metavar="FILE|URL",
                       help="the answers: a JSONL file (written as FILE.part, renamed when complete), - for standard "
                            "output, or an http(s) URL to PUT them to when done")
    batch.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                       help="with a URL output, the folder the answers are written in before the upload")
    batch.add_argument("--disable-progress-bar", dest="progress", action="store_false",
                       help="no progress bar on standard error")
    batch.add_argument("--resume", action="store_true",
                       help="continue a stopped run of the same input: the answers in OUT.part are kept and the "
                            "requests after them run")
    batch.add_argument("--enable-metrics", action="store_true",
                       help="serve the engine's Prometheus metrics (vLLM's series) at http://URL:PORT/metrics while "
                            "the batch runs, as vllm run-batch's flag of that name")
    batch.add_argument("--url", default="127.0.0.1", metavar="ADDRESS",
                       help="with --enable-metrics, the address to listen on (default 127.0.0.1; 0.0.0.0: every "
                            "interface, vLLM's default)")
    batch.add_argument("--port", type=int, default=8000, help="with --enable-metrics, the port (default 8000)")
    batch.add_argument("--model", dest="model", default=None, metavar="PACKAGE",
                       help="the package, as vllm run-batch names it (in place of the PATH argument)")
    _answer_flags(batch, path_optional=True)


def _answer_flags(serve: argparse.ArgumentParser, path_optional: bool = False) -> None:
    """The flags of the package and of how requests are read and answered (serve's and run-batch's)."""
    serve.add_argument("path", nargs="?" if path_optional else None,
                       help="the GenAI package folder (genai_config.json, model.onnx, tokenizer), or a Hugging Face "
                            "Hub repository id (org/name) holding one")
    serve.add_argument("--subfolder", default=None, help="the package's folder inside the repository (default: its "
                                                         "one package)")
    serve.add_argument("--revision", default=None, help="the repository's branch, tag or commit (default: main)")
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument("--name", "--served-model-name", dest="name", default=None,
                       help="the model name reported and accepted (vLLM's --served-model-name; default: the package "
                            "folder's name; its path is never shown)")
    serve.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="the chat template for chat, responses and messages requests, in place of the package's "
                            "(as vLLM's flag of that name: a file, or the template itself); its syntax checked first")
    serve.add_argument("--enable-fp32-lm-head", action="store_true",
                       help="compute a bf16 package's LM head in float32: logits not rounded to bf16, as SGLang's and "
                            "vLLM's flag of that name (docs/graph-rewrite.md)")
    serve.add_argument("--prefill-attention", default="auto", choices=["auto", "package", "onnx"],
                       help="score and prompt-logprob runs in the package's graph or in the prefill graph "
                            "(onnx: ONNX's Attention, no KV written; docs/usage.md); auto: the package's for now")
    serve.add_argument("--reuse-prefix", default="auto", choices=["auto", "on", "off"],
                       help="run a score request's query (its items' common first tokens) once and its items over "
                            "copies of its KV (on), every prompt whole (off), or decide per request from the "
                            "model's measured costs (auto, the default; docs/scoring.md)")
    serve.add_argument("--processor", default=None, metavar="FOLDER",
                       help="the checkpoint's image processor (its preprocessor_config.json), for a package that takes "
                            "images: chat messages may then hold image_url parts (data: URLs)")
    serve.add_argument("--generation-config", dest="generation_config", default="auto", metavar="auto|vllm|FOLDER",
                       help="where completions and chat requests that leave out temperature, top_p, top_k, min_p or "
                            "repetition_penalty take them from, as vLLM's flag of that name: auto, the package's "
                            "defaults (genai_config.json's search section, what model.generate applies); vllm, "
                            "OpenAI's (temperature 1, top_p 1, no top-k or penalty); or a folder holding the "
                            "checkpoint's generation_config.json (default auto). A max_new_tokens there bounds chat "
                            "requests that leave max_tokens out")
    serve.add_argument("--max-model-len", dest="max_model_len", type=_token_count, default=None, metavar="N",
                       help="the context requests are checked against, at most the package's, as vLLM's flag of that "
                            "name (1k: 1,000 tokens, 1K: 1,024; -1 or auto: the package's, the default)")
    _frontend_flags(serve)
    _parser_flags(serve)
    _settings_flags(serve)


def _frontend_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's flags of what requests may send and what the server renders and reports."""
    serve.add_argument("--trust-request-chat-template", dest="trust_request_chat_template", action="store_true",
                       help="let chat and tokenize requests send their own chat_template, as vLLM's flag of that "
                            "name; off by default: a template runs on the server, so for trusted clients only")
    serve.add_argument("--trust-request-mm-kwargs", dest="trust_request_mm_kwargs", action="store_true",
                       help="let chat requests with images send mm_processor_kwargs (Qwen-VL's min_pixels and "
                            "max_pixels, Gemma 3's pan-and-scan options), as vLLM's flag of that name; off by "
                            "default")
    serve.add_argument("--enable-prompt-tokens-details", dest="enable_prompt_tokens_details", action="store_true",
                       help="give completions' and chat's usage prompt_tokens_details.cached_tokens (the prompt's "
                            "tokens taken from the prefix cache), as vLLM's flag of that name")
    serve.add_argument("--default-chat-template-kwargs", dest="default_chat_template_kwargs", type=_json_object,
                       default=None, metavar="JSON",
                       help="the chat template's variables every chat request renders with unless it sets them "
                            "itself, as vLLM's flag of that name: say '{\"enable_thinking\": false}' for Qwen3")
    serve.add_argument("--pooler-config", dest="pooler_config", type=_json_object, default=None, metavar="JSON",
                       help="how /v1/embeddings pools, as vLLM's flag of that name: '{\"pooling_type\": \"MEAN\"}' "
                            "(LAST, the default; MEAN; CLS) and '{\"normalize\": false}' (normalized by default)")
    serve.add_argument("--mm-processor-kwargs", dest="mm_processor_kwargs", type=_json_object, default=None,
                       metavar="JSON",
                       help="with --processor, the image processor's options every image is made with, as vLLM's "
                            "flag of that name: Qwen-VL's min_pixels and max_pixels, Gemma 3's pan-and-scan options")


def _http_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's flags of the browsers that may call the server (CORS), HTTPS, request ids and the HTTP server's logs."""
    from .serving.settings import UVICORN_LOG_LEVELS

    serve.add_argument("--allowed-origins", dest="allowed_origins", type=_json_strings, default=None, metavar="JSON",
                       help="the web origins whose pages may call the server from a browser (CORS), as vLLM's flag "
                            "of that name: '[\"http://localhost:3000\"]', or '[\"*\"]' for any; by default none "
                            "(vLLM's default is any origin)")
    serve.add_argument("--allowed-methods", dest="allowed_methods", type=_json_strings, default=("*",),
                       metavar="JSON", help="with --allowed-origins, the methods allowed (default [\"*\"])")
    serve.add_argument("--allowed-headers", dest="allowed_headers", type=_json_strings, default=("*",),
                       metavar="JSON", help="with --allowed-origins, the request headers allowed (default [\"*\"])")
    serve.add_argument("--allow-credentials", dest="allow_credentials", action="store_true",
                       help="with --allowed-origins, let browsers send cookies and HTTP authentication")
    serve.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                       help="no log line per request (uvicorn's access log), as vLLM's flag of that name")
    serve.add_argument("--uvicorn-log-level", dest="uvicorn_log_level", default="info",
                       choices=UVICORN_LOG_LEVELS,
                       help="the HTTP server's log level, as vLLM's flag of that name (default info)")
    serve.add_argument("--ssl-keyfile", dest="ssl_keyfile", default=None, metavar="FILE",
                       help="serve HTTPS with this private key (PEM), as vLLM's flag of that name")
    serve.add_argument("--ssl-certfile", dest="ssl_certfile", default=None, metavar="FILE",
                       help="serve HTTPS with this certificate (PEM), as vLLM's flag of that name")
    serve.add_argument("--ssl-ca-certs", dest="ssl_ca_certs", default=None, metavar="FILE",
                       help="with HTTPS, the authorities whose client certificates are taken, as vLLM's flag")
    serve.add_argument("--ssl-cert-reqs", dest="ssl_cert_reqs", type=int, default=0, choices=[0, 1, 2],
                       help="with HTTPS, whether clients need a certificate: 0 no, 1 optional, 2 required, as "
                            "vLLM's flag (default 0)")
    serve.add_argument("--root-path", dest="root_path", default=None, metavar="PATH",
                       help="the path a proxy serves the server under (e.g. /llm): routes answer with it and without "
                            "it, as vLLM's flag of that name (FastAPI's root_path)")
    serve.add_argument("--enable-request-id-headers", dest="request_id_headers", action="store_true",
                       help="answer every request with an X-Request-Id header, the request's own or a new one (then "
                            "the completion's id too), as vLLM's flag of that name")


def _token_count(text: str) -> int | None:
    """An argparse type: vLLM's `--max-model-len`, a number of tokens (`4096`, `1k` 1,000, `1K` 1,024, `25.6k`);
    None for -1 or auto (the package's context)."""
    if text.strip().lower() in ("-1", "auto"):
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    value = float(match.group(1)) * scale[match.group(2)] if match else 0
    if not match or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"a whole number of tokens >= 1 (4096, 1k, 1K), -1 or auto; got {text!r}")
    return int(value)


def _json_strings(text: str) -> list[str]:
    """An argparse type: a JSON list of strings, as vLLM's CORS flags take them."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings ([\"...\"]), got {text!r}")
    return value


def _parser_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's flags of the output's parsers: tool calls, reasoning, and structured output beside the reasoning."""
    from .serving.settings import REASONING_PARSERS, TOOL_CALL_PARSERS

    serve.add_argument("--enable-auto-tool-choice", dest="enable_auto_tool_choice", action="store_true",
                       help="let chat requests with tools leave the choice to the model (tool_choice auto, the default "
                            "beside tools), its calls read by --tool-call-parser, as vLLM's flag of that name "
                            "(docs/serving.md, Tool calling)")
    serve.add_argument("--tool-call-parser", dest="tool_call_parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how the model writes its calls: hermes (Hermes, Qwen2.5, Qwen3, SmolLM3: <tool_call>...)"
                            ", llama3_json (Llama 3.1-3.3's JSON calls), phi4_mini_json (Phi-4-mini's "
                            "functools[...]), qwen3_coder (Qwen3.5, Qwen3-Coder: <tool_call><function=...>), "
                            "pythonic (Llama 3.2, Llama 4: [f(a=1)]), lfm2 (LFM2, LFM2.5), mistral "
                            "([TOOL_CALLS]), gemma4 (Gemma 4: <|tool_call>call:...), functiongemma (FunctionGemma: "
                            "<start_function_call>call:...), granite (Granite 3: "
                            "<|tool_call|>[...]) or openai (gpt-oss's harmony messages to functions.NAME, with "
                            "--reasoning-parser openai_gptoss), as vLLM's parsers of those names")
    serve.add_argument("--reasoning-parser", dest="reasoning_parser", default=None, choices=REASONING_PARSERS,
                       help="answer a thinking model's <think>...</think> text apart from its content (chat's "
                            "message.reasoning), as vLLM's flag of that name: qwen3, deepseek_r1, gemma4 (Gemma "
                            "4's <|channel>thought...<channel|>), mistral ([THINK]...[/THINK]), granite (Granite "
                            "3.2's 'Here is my thought process:' ... 'Here is my response:') or openai_gptoss "
                            "(gpt-oss's harmony: the analysis channel the reasoning, the final channel the content). "
                            "Structured output then holds the answer after the thinking, which stays free")
    serve.add_argument("--structured-outputs-config.enable_in_reasoning", dest="enable_in_reasoning", nargs="?",
                       const=True, default=False, type=_true_or_false, metavar="true|false",
                       help="with --reasoning-parser, keep the thinking to a request's structured output too (the "
                            "grammar over the whole output), as vLLM's option of that name (default false)")
    serve.add_argument("--structured-outputs-config.disable_any_whitespace", dest="disable_any_whitespace",
                       nargs="?", const=True, default=False, type=_true_or_false, metavar="true|false",
                       help="keep structured output's JSON to no whitespace between its tokens unless a request says "
                            "otherwise, as vLLM's option of that name (default false)")
    serve.add_argument("--structured-outputs-config", dest="structured_outputs_config", type=_outputs_config,
                       default=None, metavar="JSON",
                       help="vLLM's structured-output options as one JSON object: enable_in_reasoning, "
                            "disable_any_whitespace, backend (auto or guidance: llguidance is this server's)")


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    from .serving.settings import Settings

    defaults = Settings()
    for name, help_text in _SETTING_HELP.items():
        default = getattr(defaults, name)
        low = 0 if name in ("window_ms", "join_steps", "feed_tokens", "prefix_cache_mb") else 1
        kind = type(default) if default is not None else int  # None: token_budget, set by device
        shown = default if default is not None else "by device: 32768 on CUDA, 8192 on a CPU"
        parser.add_argument("--" + name.replace("_", "-"), *_SETTING_ALIASES.get(name, ()), dest=name,
                            type=_at_least(low, kind), default=default, help=f"{help_text} (default {shown})")


def _outputs_config(text: str) -> dict:
    """An argparse type: vLLM's `--structured-outputs-config` JSON, the options this server takes."""
    config = _json_object(text)
    known = {"enable_in_reasoning", "disable_any_whitespace", "backend"}
    if config.keys() - known:
        raise argparse.ArgumentTypeError(f"options this server does not take: {sorted(config.keys() - known)} "
                                         f"(it takes {sorted(known)})")
    if config.get("backend", "auto") not in ("auto", "guidance"):
        raise argparse.ArgumentTypeError(f"backend {config['backend']!r}: this server's is llguidance (auto or "
                                         "guidance)")
    return config  # the values checked as the settings check theirs


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object, as vLLM's flags of JSON take it."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object ({{...}}), got {text!r}")
    return value


def _true_or_false(text: str) -> bool:
    """An argparse type: true or false, as vLLM's flags write them (True, false, 1, 0)."""
    value = {"true": True, "1": True, "false": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"not true or false: {text!r}")
    return value


def _at_least(low, kind):
    """An argparse type: a number of `kind` no smaller than `low`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


def _export(parser: argparse.ArgumentParser, args) -> None:
    from .exporter import ExportError, export

    options = {}
    for item in args.extra_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--extra-option takes KEY=VALUE, got '{item}'")
        options[key] = value
    try:
        export(args.source, args.out, args.precision, args.device, options, args.overwrite, not args.quiet,
               args.revision, args.gguf_file, args.images)
    except ExportError as e:
        parser.exit(2, f"ortmodule export: error: {e}\n")


def _cache_flags(commands) -> None:
    from .cache_folder import KINDS

    cache = commands.add_parser("cache", help="what ortmodule keeps in its cache folder ($ORTMODULE_CACHE, else "
                                              "~/.cache/ortmodule), and clearing it")
    actions = cache.add_subparsers(dest="action")
    actions.add_parser("list", help="each kind's entries, size and oldest use (the default)")
    clear = actions.add_parser("clear", help="remove entries; each is remade when a load needs it again")
    clear.add_argument("kinds", nargs="*", type=_cache_kind, metavar="KIND",
                       help=f"the kinds to clear: {', '.join(KINDS)} (default: all three)")
    clear.add_argument("--older-than", type=_at_least(0, float), default=None, metavar="DAYS",
                       help="only entries no load has used for more than DAYS days")
    clear.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def _cache_kind(text: str) -> str:
    from .cache_folder import KINDS

    if text not in KINDS:
        raise argparse.ArgumentTypeError(f"no cache kind {text!r}: the kinds are {', '.join(KINDS)}")
    return text


def _cache(args) -> None:
    import time

    from . import cache_folder as folder

    print(f"ortmodule's cache folder: {folder.cache_home()}")
    if args.action in (None, "list"):
        for kind, what in folder.KINDS.items():
            found = folder.entries([kind])
            oldest = f", oldest use {time.strftime('%Y-%m-%d', time.localtime(found[0].last_used))}" if found else ""
            size = folder.size_text(sum(e.bytes for e in found))
            print(f"  {kind:7} {len(found):6} entries {size:>9}{oldest}: {what}")
        for name, size in folder.other_folders():
            print(f"  {name} ({folder.size_text(size)}): not a cache kind, left by `ortmodule cache clear`")
        return
    kinds = args.kinds or list(folder.KINDS)
    chosen = folder.entries(kinds)
    if args.older_than is not None:
        chosen = [e for e in chosen if e.last_used < time.time() - args.older_than * 86400]
    failed = [] if args.dry_run else folder.remove(chosen)
    kept = {entry.path for entry, _ in failed}
    for kind in kinds:
        mine = [e for e in chosen if e.kind == kind and e.path not in kept]
        print(f"  {kind}: {'would remove' if args.dry_run else 'removed'} {len(mine)} entries, "
              f"{folder.size_text(sum(e.bytes for e in mine))}")
    for entry, error in failed:
        print(f"  could not remove {entry.path}: {error}", file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
