"""vLLM's `--max-model-len` (the context requests are checked against), its CORS flags (`--allowed-origins`
and the rest: which browser pages may call the server) and its request ids (`X-Request-Id`,
`--enable-request-id-headers`)."""

import json
import re

import pytest
from helpers import CHAT_TEMPLATE, OPENAI_NAME, served_live

import ortmodule.serving
from ortmodule import cli

UI = "http://ui.example:3000"


def test_max_model_len_bounds_every_route_and_is_reported(build):
    """With `max_model_len` 64 (the package holds 256): a completion whose prompt and max_tokens pass 64 is refused
    naming 64, one within it answers transformers' greedy text as without the limit; chat, score, tokenize
    and SGLang's /generate are held to 64 too; /v1/models and /tokenize report it; above the package's context
    it is refused before the server starts."""
    from helpers import expected_text, hf_greedy

    fixture = build("llama")
    live, model, hf, tokenizer = served_live(fixture, CHAT_TEMPLATE, max_model_len=64)
    try:
        client = live.client
        prompt = tokenizer("The quick brown fox jumps over the lazy dog " * 3)["input_ids"]
        assert 32 < len(prompt) < 60
        refused = client.post("/v1/completions", json={"model": OPENAI_NAME, "prompt": prompt,
                                                       "max_tokens": 64 - len(prompt) + 1, "temperature": 0})
        assert refused.status_code == 400 and "context length 64" in refused.text, refused.text
        fits = client.post("/v1/completions", json={"model": OPENAI_NAME, "prompt": prompt,
                                                    "max_tokens": 64 - len(prompt), "temperature": 0})
        assert fits.status_code == 200, fits.text
        text, _ = expected_text(tokenizer, hf_greedy(hf, prompt, 64 - len(prompt)))
        assert fits.json()["choices"][0]["text"] == text
        long = tokenizer("word " * 70)["input_ids"][:70]
        for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 20}],
                                                      "max_tokens": 1}),
                            ("/v1/score", {"query": long, "items": [[5]], "label_token_ids": [5]}),
                            ("/generate", {"input_ids": long, "sampling_params": {"max_new_tokens": 1}})):
            answer = client.post(route, json=body if route == "/generate" else {"model": OPENAI_NAME, **body})
            assert answer.status_code == 400 and "64" in answer.text, (route, answer.text)
        assert client.post("/tokenize", json={"model": OPENAI_NAME, "prompt": "hi"}).json()["max_model_len"] == 64
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64
    finally:
        live.stop()
    with pytest.raises(ValueError, match="max_model_len 257 is longer than the package's context of 256"):
        served_live(fixture, CHAT_TEMPLATE, max_model_len=257)


def test_the_command_line_takes_vllms_forms_of_the_flags(build, monkeypatch, capsys):
    """`--max-model-len` as vLLM reads it (1k 1,000, 1K 1,024, auto or -1 the package's); the CORS flags as JSON
    lists; a malformed value stops the command naming the flag."""
    fixture = build("llama")
    captured = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: captured.update(options))
    cli.ortmodule(["serve", str(fixture.package_dir), "--max-num-seqs", "8"])  # vLLM's name of --max-rows
    assert captured["max_rows"] == 8
    for given, expected in (("1k", 1000), ("1K", 1024), ("100", 100), ("auto", None), ("-1", None)):
        cli.ortmodule(["serve", str(fixture.package_dir), "--max-model-len", given])
        assert captured["max_model_len"] == expected, given
    cli.ortmodule(["serve", str(fixture.package_dir)])
    assert (captured["max_model_len"], captured["allowed_origins"], captured["allow_credentials"]) == \
        (None, None, False)
    assert captured["request_id_headers"] is False
    cli.ortmodule(["serve", str(fixture.package_dir), "--allowed-origins", f'["{UI}"]', "--allowed-methods",
                   '["GET", "POST"]', "--allow-credentials", "--enable-request-id-headers"])
    assert (captured["allowed_origins"], captured["allowed_methods"], captured["allowed_headers"],
            captured["allow_credentials"], captured["request_id_headers"]) == \
        ([UI], ["GET", "POST"], ("*",), True, True)
    for flag, value in (("--max-model-len", "0"), ("--max-model-len", "2.5"), ("--allowed-origins", UI),
                        ("--allowed-origins", '{"a": 1}')):
        with pytest.raises(SystemExit) as stopped:
            cli.ortmodule(["serve", str(fixture.package_dir), flag, value])
        assert stopped.value.code == 2 and flag in capsys.readouterr().err, (flag, value)


@pytest.mark.parametrize("key", [None, "secret"])
def test_cors_answers_the_allowed_origins_pages_only(build, key):
    """Without `allowed_origins` no answer carries CORS headers (a browser keeps a page of another origin from
    reading it) and a preflight is not answered; with it, a page of the allowed origin gets its preflight
    answered (without the API key, which a browser's preflight never carries) and its answers, a 401 included,
    carry the origin; another origin gets none. `/server_info` never shows the key."""
    fixture = build("llama")
    preflight = {"Origin": UI, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"model": OPENAI_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    for origins in (None, [UI]):
        live, *_ = served_live(fixture, CHAT_TEMPLATE, allowed_origins=origins, api_key=key)
        try:
            client = live.client
            checked = client.options("/v1/completions", headers=preflight)
            answer = client.post("/v1/completions", json=body, headers={"Origin": UI, **auth})
            assert answer.status_code == 200, answer.text
            other = client.post("/v1/completions", json=body, headers={"Origin": "http://evil.example", **auth})
            assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
            if origins is None:
                assert checked.status_code in (401, 405) and "access-control-allow-origin" not in checked.headers
                assert "access-control-allow-origin" not in answer.headers
                continue
            assert checked.status_code == 200 and checked.headers["access-control-allow-origin"] == UI
            assert "POST" in checked.headers["access-control-allow-methods"]
            assert answer.headers["access-control-allow-origin"] == UI
            denied = client.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
            assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
            if key:
                unkeyed = client.post("/v1/completions", json=body, headers={"Origin": UI})
                assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == UI
                # SGLang's /server_info shows the settings, never the key itself (a page allowed in reads it)
                info = client.get("/server_info", headers=auth)
                assert info.json()["api_key"] == "<set>" and key not in info.text
        finally:
            live.stop()


def test_answer_ids_follow_the_request_id_as_vllms(build):
    """A completion's id is `cmpl-` and the request's X-Request-Id header (chat's `chatcmpl-`), else its
    `request_id` field, else a random one, streamed chunks too; without `--enable-request-id-headers` no answer
    carries the header; a `request_id` that is not a string is a 400 naming it."""
    live, *_ = served_live(build("llama"), CHAT_TEMPLATE)
    body = {"model": OPENAI_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    chat = {"model": OPENAI_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    try:
        client = live.client
        answer = client.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
        assert answer.json()["id"] == "cmpl-trace-7" and "x-request-id" not in answer.headers
        assert client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-8"}).json()["id"] == \
            "chatcmpl-trace-8"
        assert client.post("/v1/completions", json={**body, "request_id": "mine"}).json()["id"] == "cmpl-mine"
        assert client.post("/v1/completions", json={**body, "request_id": "mine"},
                           headers={"X-Request-Id": "header"}).json()["id"] == "cmpl-header"
        assert re.fullmatch(r"cmpl-[0-9a-f]{24}", client.post("/v1/completions", json=body).json()["id"])
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                           headers={"X-Request-Id": "s-1"}) as stream:
            ids = {json.loads(line[6:])["id"] for line in stream.iter_lines() if line.startswith("data: {")}
        assert ids == {"chatcmpl-s-1"}
        refused = client.post("/v1/completions", json={**body, "request_id": 5})
        assert refused.status_code == 400 and "request_id" in refused.text
    finally:
        live.stop()


def test_request_id_headers_answer_every_request_with_its_id(build):
    """With `request_id_headers` every answer carries X-Request-Id: the request's own, or a new one that the
    completion's id then ends with; a refusal (401 without the key) and /health carry one too."""
    live, *_ = served_live(build("llama"), CHAT_TEMPLATE, request_id_headers=True, api_key="k")
    body = {"model": OPENAI_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    key = {"Authorization": "Bearer k"}
    try:
        client = live.client
        answer = client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc", **key})
        assert answer.headers["x-request-id"] == "abc" and answer.json()["id"] == "cmpl-abc"
        answer = client.post("/v1/completions", json=body, headers=key)
        made = answer.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made) and answer.json()["id"] == f"cmpl-{made}"
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
        assert client.get("/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    finally:
        live.stop()


def test_uvicorns_log_flags_reach_its_config(build, monkeypatch):
    """vLLM's `--disable-uvicorn-access-log` and `--uvicorn-log-level` set uvicorn's config (default: a line per
    request, level info); another level stops the command naming the choices."""
    import uvicorn

    from ortmodule.serving import app as serving_app

    fixture = build("llama")
    configs = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: configs.append(server.config))
    serving_app.serve(str(fixture.package_dir), port=0)
    serving_app.serve(str(fixture.package_dir), port=0, access_log=False, uvicorn_log_level="warning")
    assert [(c.access_log, c.log_level) for c in configs] == [(True, "info"), (False, "warning")]
    captured = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: captured.update(options))
    cli.ortmodule(["serve", str(fixture.package_dir), "--disable-uvicorn-access-log", "--uvicorn-log-level", "error"])
    assert (captured["access_log"], captured["uvicorn_log_level"]) == (False, "error")
    with pytest.raises(ValueError, match="uvicorn_log_level must be one of critical, error, warning, info"):
        serving_app.serve(str(fixture.package_dir), port=0, uvicorn_log_level="loud")


def test_vllms_ping_and_version(build):
    """vLLM's `/ping` (SageMaker's health check, GET or POST) answers as `/health`, without the API key as
    `/health`; `/version` the installed ortmodule's version, with the key."""
    from importlib import metadata

    live, *_ = served_live(build("llama"), CHAT_TEMPLATE, api_key="k")
    try:
        client = live.client
        health = client.get("/health")
        for method in ("GET", "POST"):
            ping = client.request(method, "/ping")
            assert (ping.status_code, ping.json()) == (health.status_code, health.json()) == (200, {"status": "ok"})
        assert client.get("/version").status_code == 401
        assert client.get("/version", headers={"Authorization": "Bearer k"}).json() == \
            {"version": metadata.version("ortmodule")}
    finally:
        live.stop()


def test_https_with_vllms_ssl_flags(build, tmp_path, monkeypatch):
    """`ssl_certfile` and `ssl_keyfile` (vLLM's `--ssl-certfile`, `--ssl-keyfile`) serve HTTPS: a client that trusts
    the certificate gets its answers, one speaking plain HTTP none; files that do not load, or a key without its
    certificate, stop the server before the package loads, naming them."""
    import shutil
    import socket
    import subprocess
    import threading
    import time

    import httpx
    import uvicorn

    from ortmodule import OrtModelForCausalLM
    from ortmodule.serving import app as serving_app

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command makes the test's certificate")
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    fixture = build("llama")
    servers = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: servers.append(server))
    serving_app.serve(str(fixture.package_dir), port=0, ssl_keyfile=key, ssl_certfile=cert)
    monkeypatch.undo()
    config = servers[0].config
    assert (config.ssl_certfile, config.ssl_keyfile) == (cert, key)
    server, listening = uvicorn.Server(config), socket.socket()
    listening.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = listening.getsockname()[1]
        with httpx.Client(verify=cert, timeout=30) as client:
            answer = client.post(f"https://127.0.0.1:{port}/v1/completions",
                                 json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
            info = client.get(f"https://127.0.0.1:{port}/server_info").json()  # where the host keeps its key: not said
            assert info["ssl_keyfile"] == info["ssl_certfile"] == "<set>" and str(tmp_path) not in json.dumps(info)
        with pytest.raises(httpx.HTTPError), httpx.Client(timeout=10) as client:
            client.get(f"http://127.0.0.1:{port}/health")
    finally:
        server.should_exit = True
        thread.join(10)

    def loaded(*args, **kwargs):
        raise AssertionError("the package was loaded before the TLS files were checked")

    monkeypatch.setattr(OrtModelForCausalLM, "from_pretrained", loaded)
    for options, message in (({"ssl_certfile": str(tmp_path / "absent.pem"), "ssl_keyfile": key},
                              "the TLS files do not load"),
                             ({"ssl_certfile": key, "ssl_keyfile": key}, "the TLS files do not load"),
                             ({"ssl_keyfile": key}, "ssl_keyfile needs ssl_certfile"),
                             ({"ssl_cert_reqs": 2}, "need ssl_certfile and ssl_keyfile"),
                             ({"ssl_certfile": cert, "ssl_keyfile": key, "ssl_cert_reqs": 2}, "needs ssl_ca_certs"),
                             ({"max_model_len": 300}, "max_model_len 300 is longer than the package's context of 256")):
        with pytest.raises(ValueError, match=message):
            serving_app.serve(str(fixture.package_dir), port=0, **options)


def test_root_path_serves_routes_under_the_proxys_prefix_and_without_it(build, monkeypatch):
    """vLLM's `--root-path /llm`: a completion sent as `/llm/v1/completions` (a proxy that keeps the prefix) and as
    `/v1/completions` (one that strips it) answers transformers' greedy text; a refusal under the prefix keeps
    OpenAI's error shape; the health check under it needs no key, other routes do; a malformed path is refused."""
    from helpers import expected_text, hf_greedy

    fixture = build("llama")
    live, _, hf, tokenizer = served_live(fixture, CHAT_TEMPLATE, root_path="/llm", api_key="secret")
    try:
        key = {"Authorization": "Bearer secret"}
        prompt = "The quick brown fox"
        text, _ = expected_text(tokenizer, hf_greedy(hf, tokenizer(prompt)["input_ids"], 6))
        for path in ("/llm/v1/completions", "/v1/completions"):
            answer = live.client.post(path, headers=key, json={"model": OPENAI_NAME, "prompt": prompt,
                                                               "max_tokens": 6, "temperature": 0})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == text, (path, answer.text)
        refused = live.client.post("/llm/v1/completions", headers=key, json={"prompt": prompt, "max_tokens": -1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens", refused.text
        assert live.client.get("/llm/health").status_code == 200
        assert live.client.get("/llm/v1/models").status_code == 401
        unkeyed = live.client.post("/llm/v1/completions", json={"prompt": prompt})
        assert unkeyed.status_code == 401 and unkeyed.json()["error"]["type"] == "invalid_request_error"
    finally:
        live.stop()
    captured = {}
    monkeypatch.setattr(ortmodule.serving, "serve", lambda path, **options: captured.update(options))
    cli.ortmodule(["serve", str(fixture.package_dir), "--root-path", "/llm/v2"])
    assert captured["root_path"] == "/llm/v2"
    for bad in ("llm", "/llm/", "/llm?x=1", "/", ""):
        with pytest.raises(ValueError, match="root_path must be a URL path"):
            ortmodule.serving.Settings(root_path=bad)
