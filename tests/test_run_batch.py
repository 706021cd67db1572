"""`ortmodule run-batch` (serving/batch_file.py): a file of requests in OpenAI's batch format, answered through the
server's routes in this process, against transformers' greedy tokens and scores on the same weights."""

import http.server
import json
import logging
import threading

import pytest
import torch
from helpers import (
    CHAT_TEMPLATE,
    OPENAI_NAME,
    SCORE_ITEMS,
    SCORE_QUERY,
    expected_text,
    hf_greedy,
    labels_for,
    load_pair,
    score_reference,
)

from ortmodule import load_tokenizer
from ortmodule.cli import ortmodule
from ortmodule.serving import create_app
from ortmodule.serving.batch_file import BATCH_ROUTES, Output, parse_requests, run_requests

TOPICS = ["the sea", "a red kite", "numbers", "winter roads", "old maps", "bread", "rain", "a small dog", "music",
          "stone walls", "trains", "the moon"]


def line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(topic, new=8):
    return {"model": OPENAI_NAME, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": new, "temperature": 0}


def chat_expected(hf, tokenizer, body):
    ids = list(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    return expected_text(tokenizer, hf_greedy(hf, ids, body["max_tokens"]))


@pytest.fixture(scope="module")
def served(llama):
    model, hf = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, hf, tokenizer


def run(served, lines, tmp_path, concurrency=8, **settings):
    """The lines run through a fresh app over the shared model: (the output's lines, the summary, the engine's
    counts)."""
    model, _, tokenizer = served
    output = Output(str(tmp_path / "out.jsonl"))
    app = create_app(model, tokenizer, name=OPENAI_NAME, window_ms=20, **settings)
    summary = run_requests(app, parse_requests("\n".join(lines)), output, concurrency, progress=False)
    output.finish()
    answers = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    return answers, summary, app.state.served.engine.stats


def test_a_batch_is_answered_in_order_as_transformers_greedy_tokens_and_scores(served, tmp_path):
    """Twelve chats run 8 at a time (the engine batches them) and a completion, a score request, a tokenize
    request and an embeddings request: each answer in its line's place, the texts transformers' greedy ones, the
    scores and embeddings transformers'; a refused request and a stream in vLLM's error shape; the summary's counts
    the answers'."""
    _, hf, tokenizer = served
    bodies = [chat(topic, new=6 + i % 5) for i, topic in enumerate(TOPICS)]
    labels = labels_for(tokenizer)
    lines = [line(f"chat-{i}", "/v1/chat/completions", body) for i, body in enumerate(bodies)]
    lines[3:3] = [line("score", "/v1/score", {"query": SCORE_QUERY, "items": SCORE_ITEMS, "label_token_ids": labels,
                                              "apply_softmax": True}),
                  line("refused", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
                  line("stream", "/v1/chat/completions", {**bodies[0], "stream": True}),
                  line("tokens", "/tokenize", {"prompt": "hello there"}),
                  line("embed", "/v1/embeddings", {"input": ["hello there", "The quick brown fox"]}),
                  line("text", "/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 7,
                                                   "temperature": 0})]
    answers, summary, stats = run(served, lines, tmp_path)
    assert stats.largest_decode_batch > 1  # run together, as a server's concurrent clients
    assert [a["custom_id"] for a in answers] == [json.loads(x)["custom_id"] for x in lines]
    by_id = {a["custom_id"]: a for a in answers}
    for i, body in enumerate(bodies):
        answer = by_id[f"chat-{i}"]
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        choice = answer["response"]["body"]["choices"][0]
        text, reason = chat_expected(hf, tokenizer, body)
        assert (choice["message"]["content"], choice["finish_reason"]) == (text, reason), (i, choice)
        # the request id is the answer's own (vLLM's chatcmpl- before it)
        assert answer["response"]["body"]["id"] == "chatcmpl-" + answer["response"]["request_id"]
    ids = tokenizer("The quick brown fox")["input_ids"]
    assert by_id["text"]["response"]["body"]["choices"][0]["text"] == \
        expected_text(tokenizer, hf_greedy(hf, ids, 7))[0]
    reference = score_reference(hf, tokenizer, SCORE_QUERY, SCORE_ITEMS, labels, True, False)
    for got, want in zip(by_id["score"]["response"]["body"]["scores"], reference, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert by_id["tokens"]["response"]["body"]["tokens"] == tokenizer("hello there")["input_ids"]
    for item, text in zip(by_id["embed"]["response"]["body"]["data"], ["hello there", "The quick brown fox"]):
        with torch.inference_mode():
            state = hf.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1]
        assert item["embedding"] == pytest.approx(torch.nn.functional.normalize(state, dim=-1).tolist(), abs=1e-5)
    for name, param in (("refused", "max_tokens"), ("stream", "stream")):
        answer = by_id[name]
        assert answer["response"]["status_code"] == 400 and answer["response"]["body"] is None
        assert answer["error"]["error"]["param"] == param, answer
    assert summary.statuses == {200: len(lines) - 2, 400: 2}
    bodies = [a["response"]["body"] for a in answers if a["error"] is None]
    usages = [body["usage"] for body in bodies if "usage" in body]
    assert summary.completion_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert summary.prompt_tokens == sum(u["prompt_tokens"] for u in usages)


def test_the_routes_a_line_may_name_are_the_apps_post_routes(served):
    model, _, tokenizer = served
    app = create_app(model, tokenizer, name=OPENAI_NAME)
    posts = {route.path for route in app.routes if "POST" in getattr(route, "methods", ())}
    assert set(BATCH_ROUTES) == posts - {"/ping", "/flush_cache"}


def test_bad_lines_are_each_named_before_the_package_loads(tmp_path, capsys):
    """Every bad line named (line numbers as the file's, blank lines counted), the package never looked at (it does
    not exist here), no output written."""
    lines = [line("a", "/v1/completions", {"prompt": "x"}), "", "{not json", json.dumps([1, 2]),
             json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}),
             line("b", "/v1/completions", {}, method="GET"),
             line("c", "/v1/rerank", {"query": "x", "documents": ["y"]}),
             json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions"}),
             '{"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {"temperature": NaN}}',
             line("f", "/v1/completions", [1])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as stopped:
        ortmodule(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                   str(tmp_path / "no-such-package")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "8 bad lines in the input" in error
    for expected in ("line 3: not JSON", "line 4: a JSON object is needed, got list",
                     "line 5: custom_id must be a string, got 7", 'line 6: method must be POST, got "GET"',
                     'line 7: url "/v1/rerank" is not one this runs', "line 8: body missing",
                     "line 9: not JSON: NaN is not JSON", "line 10: body must be a JSON object, got list"):
        assert expected in error, (expected, error)
    assert "line 1:" not in error and "line 2:" not in error
    assert "line 3: not JSON: Expecting property name enclosed in double quotes at column 2" in error
    assert not list(tmp_path.glob("out.jsonl*"))


def test_the_package_is_named_by_path_or_by_vllms_model_flag_once(tmp_path, capsys):
    """`ortmodule run-batch -i IN -o OUT PACKAGE`, or `--model PACKAGE` as vllm run-batch takes it; both or
    neither is a usage error."""
    (tmp_path / "in.jsonl").write_text("{bad\n")
    files = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    for extra, message in ((["--model", "pkg"], "1 bad lines in the input"), (["pkg"], "1 bad lines in the input"),
                           (["pkg", "--model", "pkg"], "one of them"), ([], "one of them")):
        with pytest.raises(SystemExit) as stopped:
            ortmodule(files + extra)
        assert stopped.value.code == 2 and message in capsys.readouterr().err, extra


def test_an_output_that_cannot_be_written_or_is_the_input_stops_the_run_first(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    for output, message in ((tmp_path / "missing" / "out.jsonl", "cannot write the output file"),
                            (tmp_path / "in.jsonl", "the output file is the input file")):
        with pytest.raises(SystemExit):
            ortmodule(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(output),
                       str(tmp_path / "no-such-package")])
        assert message in capsys.readouterr().err
    assert json.loads((tmp_path / "in.jsonl").read_text())["custom_id"] == "a"


def test_a_custom_id_used_twice_and_other_keys_are_warned_of_once(caplog):
    """A custom_id used twice is run (as vLLM runs it); keys besides the four are ignored: one warning each."""
    extra = json.dumps({"custom_id": "c", "method": "POST", "url": "/tokenize", "body": {"prompt": "w"}, "note": 1})
    with caplog.at_level(logging.WARNING, logger="ortmodule.serving"):
        requests = parse_requests("\n".join([line("a", "/tokenize", {"prompt": "x"}),
                                             line("b", "/tokenize", {"prompt": "y"}),
                                             line("a", "/tokenize", {"prompt": "z"}), extra, extra]))
    assert [r.custom_id for r in requests] == ["a", "b", "a", "c", "c"]
    assert "2 requests reuse an earlier line's custom_id (line 3 reuses line 1's)" in caplog.text
    assert "2 lines hold keys besides custom_id, method, url, body, ignored (line 4: note)" in caplog.text
    assert len(caplog.records) == 2


class Files(http.server.BaseHTTPRequestHandler):
    """GET the input, PUT the output (vLLM's run-batch's URLs), the PUT failing as often as `failures` says."""
    store: dict = {}
    failures = [0]

    def do_GET(self):  # noqa: N802
        data = self.store.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self):  # noqa: N802
        data = self.rfile.read(int(self.headers["content-length"]))
        if self.failures[0] > 0:
            self.failures[0] -= 1
            self.send_response(503)
        else:
            self.store[self.path] = data
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_command_reads_and_writes_urls_and_takes_the_api_key(llama, tmp_path, monkeypatch, caplog):
    """The whole command on the package: the input from a URL, the answers PUT to one (after a failed try), with
    ORTMODULE_API_KEY set (the in-process requests carry it); the texts transformers' greedy ones."""
    monkeypatch.setenv("ORTMODULE_API_KEY", "secret")
    monkeypatch.setattr("ortmodule.serving.batch_file.UPLOAD_WAIT_S", 0.01)
    _, hf = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    (tmp_path / "template.jinja").write_text(CHAT_TEMPLATE)
    bodies = [chat(topic) for topic in TOPICS[:3]]
    Files.store = {"/in.jsonl": "\n".join(line(str(i), "/v1/chat/completions", b)
                                          for i, b in enumerate(bodies)).encode()}
    Files.failures[0] = 1
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        ortmodule(["run-batch", "-i", f"{url}/in.jsonl", "-o", f"{url}/out.jsonl", str(llama.package_dir),
                   "--chat-template", str(tmp_path / "template.jinja"), "--served-model-name", OPENAI_NAME,
                   "--output-tmp-dir", str(tmp_path), "--disable-progress-bar"])
    finally:
        server.shutdown()
    answers = [json.loads(x) for x in Files.store["/out.jsonl"].decode().splitlines()]
    assert [a["custom_id"] for a in answers] == ["0", "1", "2"]
    for answer, body in zip(answers, bodies, strict=True):
        assert answer["response"]["status_code"] == 200, answer
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == \
            chat_expected(hf, tokenizer, body)[0]
    assert Files.failures[0] == 0 and not list(tmp_path.glob("ortmodule-batch-*"))  # uploaded on the second try
    assert "failed (Server error '503 Service Unavailable' for url" in caplog.text and "retrying" in caplog.text


def test_a_run_stopped_midway_keeps_its_answers_in_the_part_file(served, tmp_path, monkeypatch):
    """Interrupted (Ctrl-C) after some answers: those are in OUT.part, in order; OUT itself is never written."""
    import ortmodule.serving.batch_file as batch_file

    model, _, tokenizer = served
    real = batch_file._answer
    seen = []

    async def answer_then_stop(client, request):
        if len(seen) == 3:
            raise KeyboardInterrupt
        seen.append(request.custom_id)
        return await real(client, request)

    monkeypatch.setattr(batch_file, "_answer", answer_then_stop)
    output = Output(str(tmp_path / "out.jsonl"))
    lines = [line(str(i), "/tokenize", {"prompt": f"text {i}"}) for i in range(6)]
    with pytest.raises(KeyboardInterrupt):
        try:
            run_requests(create_app(model, tokenizer, name=OPENAI_NAME), parse_requests("\n".join(lines)), output,
                         concurrency=1, progress=False)
        except BaseException:
            output.abandon()
            raise
    kept = [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl.part").read_text().splitlines()]
    assert kept == ["0", "1", "2"] and not (tmp_path / "out.jsonl").exists()


def test_requests_naming_another_model_are_caught(llama, tmp_path, capsys, caplog):
    """Every request naming another model than the served one (the name not set): a usage error before any runs,
    naming the flag, no output left; some of them: a warning, and those lines answered 404 in their places."""
    args = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), str(llama.package_dir),
            "--disable-progress-bar"]
    (tmp_path / "in.jsonl").write_text("\n".join(line(str(i), "/tokenize", {"model": "gpt-4", "prompt": "x"})
                                                 for i in range(3)))
    with pytest.raises(SystemExit) as stopped:
        ortmodule(args)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "3 of 3 requests name another model than the one served, 'package' (3 name 'gpt-4')" in error
    assert "--served-model-name gpt-4 serves the package under that name" in error
    assert not list(tmp_path.glob("out.jsonl*"))
    (tmp_path / "in.jsonl").write_text("\n".join([line("a", "/tokenize", {"model": "gpt-4", "prompt": "x"}),
                                                  line("b", "/tokenize", {"model": "package", "prompt": "x"}),
                                                  line("c", "/tokenize", {"prompt": "x"}),
                                                  line("d", "/tokenize", {"model": ["a list"], "prompt": "x"})]))
    ortmodule(args)
    assert "1 of 4 requests name another model" in caplog.text
    answers = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["response"]["status_code"] for a in answers] == [404, 200, 200, 400]
    assert answers[0]["error"]["error"]["code"] == "model_not_found"


def test_the_engines_metrics_are_served_while_the_batch_runs(llama, tmp_path, monkeypatch, capsys):
    """`--enable-metrics --port P` (vllm run-batch's): during the run, GET /metrics answers vLLM's series in
    Prometheus' text format, read by prometheus_client's parser: the generation tokens and the finished rows equal
    the answers' usage and finish reasons; the port is closed once the run ends; a port in use stops the run before
    the package loads."""
    import socket

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    import ortmodule.serving.batch_file as batch_file

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    real, scraped = batch_file.run_requests, {}

    def run_then_scrape(*args, **kwargs):
        summary = real(*args, **kwargs)
        scraped["text"] = httpx.get(f"http://127.0.0.1:{port}/metrics").text  # the run over, the server still up
        return summary

    monkeypatch.setattr(batch_file, "run_requests", run_then_scrape)
    (tmp_path / "in.jsonl").write_text("\n".join(line(str(i), "/v1/completions", {"prompt": f"{topic} is",
                                                                                  "max_tokens": 4 + i,
                                                                                  "temperature": 0})
                                                 for i, topic in enumerate(TOPICS[:4])))
    ortmodule(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
               str(llama.package_dir), "--enable-metrics", "--port", str(port), "--disable-progress-bar"])
    answers = [json.loads(x)["response"]["body"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped["text"]) for s in family.samples}
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert samples[("vllm:generation_tokens_total", (("engine", "0"), ("model_name", "package")))] == generated
    reasons = [a["choices"][0]["finish_reason"] for a in answers]
    for reason in set(reasons):
        key = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", reason), ("model_name", "package")))
        assert samples[key] == reasons.count(reason)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as stopped:
            ortmodule(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "again.jsonl"),
                       str(tmp_path / "no-such-package"), "--enable-metrics", "--port", str(taken.getsockname()[1])])
    assert stopped.value.code == 2 and not list(tmp_path.glob("again.jsonl*"))
    assert "cannot serve metrics on 127.0.0.1 port" in capsys.readouterr().err


def test_resume_continues_a_stopped_runs_part_file(llama, tmp_path, caplog, capsys):
    """`--resume`: a stopped run's OUT.part (its last line cut short, as a kill while writing leaves it) is kept,
    only the requests after its answers run, and OUT is the whole run's answers in order, each transformers' greedy
    text; resumed again once complete, nothing runs; a .part of another input is refused; without --resume a .part
    is replaced, with a warning."""
    caplog.set_level(logging.INFO, logger="ortmodule.serving")
    _, hf = load_pair(llama)
    tokenizer = load_tokenizer(llama.package_dir)
    bodies = [{"prompt": f"{topic} is", "max_tokens": 5, "temperature": 0} for topic in TOPICS[:5]]
    lines = [line(f"r{i}", "/v1/completions", body) for i, body in enumerate(bodies)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines))
    (tmp_path / "first.jsonl").write_text("\n".join(lines[:2]))
    out = tmp_path / "out.jsonl"
    command = ["run-batch", "-o", str(out), str(llama.package_dir), "--disable-progress-bar"]
    ortmodule(command + ["-i", str(tmp_path / "first.jsonl")])
    kept = out.read_text()
    out.unlink()
    (tmp_path / "out.jsonl.part").write_text(kept + '{"id": "ortmodule-1", "custom_id": "r2", "resp')
    ortmodule(command + ["-i", str(tmp_path / "in.jsonl"), "--resume"])
    assert "resuming: 2 of 5 requests are answered" in caplog.text
    assert "3 requests in" in caplog.text and "5 requests in" not in caplog.text  # only those after the kept ran
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    assert out.read_text().startswith(kept) and not (tmp_path / "out.jsonl.part").exists()
    assert [a["custom_id"] for a in answers] == [f"r{i}" for i in range(5)]
    for answer, body in zip(answers, bodies, strict=True):
        tokens = hf_greedy(hf, tokenizer(body["prompt"])["input_ids"], 5)
        assert answer["response"]["body"]["choices"][0]["text"] == expected_text(tokenizer, tokens)[0]
    ortmodule(command + ["-i", str(tmp_path / "in.jsonl"), "--resume"])
    assert "is complete: nothing to resume" in caplog.text
    (tmp_path / "out.jsonl.part").write_text(kept.replace('"r1"', '"other"'))
    with pytest.raises(SystemExit):
        ortmodule(command + ["-i", str(tmp_path / "in.jsonl"), "--resume"])
    assert "answers other requests than this input's first 2: its answer 2 is 'other'" in capsys.readouterr().err
    ortmodule(command + ["-i", str(tmp_path / "first.jsonl")])
    assert "an earlier run's answers, is replaced (--resume continues it)" in caplog.text
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["r0", "r1"]


def test_lines_end_at_newlines_only_and_a_byte_order_mark_is_skipped(tmp_path):
    """JSON Lines as other tools write them: a UTF-8 byte order mark first, CRLF endings, and text holding U+2028
    and U+0085 unescaped (json.dumps with ensure_ascii=False), which str.splitlines would cut a line at."""
    from ortmodule.serving.batch_file import read_input

    prompts = ["one\u2028two", "three\u0085four", "plain"]
    text = "\r\n".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/tokenize", "body": {"prompt": p}},
                                  ensure_ascii=False) for i, p in enumerate(prompts))
    (tmp_path / "in.jsonl").write_bytes(("\ufeff" + text + "\r\n").encode("utf-8"))
    requests = parse_requests(read_input(str(tmp_path / "in.jsonl")))
    assert [r.body["prompt"] for r in requests] == prompts and [r.line for r in requests] == [1, 2, 3]


def test_the_metrics_port_answers_503_while_the_package_loads():
    import httpx

    from ortmodule.serving.batch_file import MetricsServer

    server = MetricsServer("127.0.0.1", 0)
    try:
        loading = httpx.get(f"http://127.0.0.1:{server.port}/metrics")
        assert (loading.status_code, loading.text) == (503, "the package is loading\n")
        assert httpx.get(f"http://127.0.0.1:{server.port}/other").status_code == 404
    finally:
        server.close()
