"""vLLM's `--max-model-len` (the context requests are checked against) and its CORS flags (`--allowed-origins`
and the rest: which browser pages may call the server)."""

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
    for given, expected in (("1k", 1000), ("1K", 1024), ("100", 100), ("auto", None), ("-1", None)):
        cli.ortmodule(["serve", str(fixture.package_dir), "--max-model-len", given])
        assert captured["max_model_len"] == expected, given
    cli.ortmodule(["serve", str(fixture.package_dir)])
    assert (captured["max_model_len"], captured["allowed_origins"], captured["allow_credentials"]) == \
        (None, None, False)
    cli.ortmodule(["serve", str(fixture.package_dir), "--allowed-origins", f'["{UI}"]', "--allowed-methods",
                   '["GET", "POST"]', "--allow-credentials"])
    assert (captured["allowed_origins"], captured["allowed_methods"], captured["allowed_headers"],
            captured["allow_credentials"]) == ([UI], ["GET", "POST"], ("*",), True)
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
