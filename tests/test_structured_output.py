"""Structured output on the server (serving/constraints.py): each form a request takes, against transformers'
greedy `generate` on the same weights under the same grammar (a logits processor written here on llguidance's
own matcher), through the chat, completions and responses routes, streamed and sampled; and the refusals."""

import json
import re

import httpx
import pytest
from helpers import OPENAI_NAME as NAME
from helpers import expected_text, grammar_greedy

llguidance = pytest.importorskip("llguidance")
from llguidance import LLMatcher  # noqa: E402

SCHEMA = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
          "required": ["pick", "n"], "additionalProperties": False}
REGEX = "[0-9]{3}-[a-z]{2}"


def reference(hf, tokenizer, ids: list[int], grammar: str, new: int) -> str:
    """transformers' greedy text after `ids` under `grammar` (the end token left out)."""
    return expected_text(tokenizer, grammar_greedy(hf, tokenizer, ids, grammar, new)[0])[0]


SQL = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
SQL_REGEX = r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
FORMS = [
    ("regex", {"structured_outputs": {"regex": REGEX}}, LLMatcher.grammar_from_regex(REGEX)),
    ("guided_regex", {"guided_regex": REGEX}, LLMatcher.grammar_from_regex(REGEX)),
    ("sglang_regex", {"regex": REGEX}, LLMatcher.grammar_from_regex(REGEX)),
    ("choice", {"structured_outputs": {"choice": ["red fox", "blue?"]}}, LLMatcher.grammar_from_regex(
        r"(red\x{20}fox)|(blue\x{3f})")),
    ("guided_choice", {"guided_choice": ["yes", "no"]}, LLMatcher.grammar_from_regex("(yes)|(no)")),
    ("grammar", {"structured_outputs": {"grammar": 'start: "A" x\nx: "B" | "C" x'}},
     LLMatcher.grammar_from_lark('start: "A" x\nx: "B" | "C" x')),
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
     LLMatcher.grammar_from_json_schema(SCHEMA)),
    ("guided_json", {"guided_json": json.dumps(SCHEMA)}, LLMatcher.grammar_from_json_schema(SCHEMA)),
    ("json_object", {"response_format": {"type": "json_object"}},
     LLMatcher.grammar_from_json_schema({"type": "object"})),
    # vLLM's documented EBNF example (llama.cpp's GBNF), and SGLang's `ebnf`: the same language as this regex
    ("ebnf_grammar", {"structured_outputs": {"grammar": SQL}}, LLMatcher.grammar_from_regex(SQL_REGEX)),
    ("sglang_ebnf", {"ebnf": SQL}, LLMatcher.grammar_from_regex(SQL_REGEX)),
]


@pytest.mark.parametrize(("name", "fields", "grammar"), FORMS, ids=[f[0] for f in FORMS])
def test_each_form_gives_transformers_greedy_text_under_the_grammar(openai_live, name, fields, grammar):
    """Chat and completions: the text is transformers' greedy generation under the same grammar, ended where
    the grammar is complete ("stop") or by the length."""
    live, _, hf, tokenizer, _ = openai_live
    messages = [{"role": "user", "content": "Answer, please."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    expected = reference(hf, tokenizer, ids, grammar, 40)
    chat = httpx.post(f"{live.url}/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 40,
                                                              "temperature": 0, **fields}).json()
    assert chat["choices"][0]["message"]["content"] == expected, chat
    if name in ("regex", "choice", "grammar", "ebnf_grammar", "sglang_ebnf"):
        assert chat["choices"][0]["finish_reason"] == "stop"
    prompt = "The quick brown fox"
    expected = reference(hf, tokenizer, tokenizer(prompt).input_ids, grammar, 40)
    done = httpx.post(f"{live.url}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 40,
                                                         "temperature": 0, **fields}).json()
    assert done["choices"][0]["text"] == expected, done


def test_streams_samples_and_responses_keep_to_the_grammar(openai_live):
    """A stream's deltas make the same text; sampled choices (`n` 4, a seed) each match the regex; the
    Responses API's `text.format` (its schema's fields flat) gives chat's answer."""
    live, _, hf, tokenizer, _ = openai_live
    messages = [{"role": "user", "content": "Answer, please."}]
    body = {"model": NAME, "messages": messages, "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"regex": REGEX}}
    whole = httpx.post(f"{live.url}/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    assert text == whole and re.fullmatch(REGEX, whole)
    sampled = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "temperature": 1.0, "seed": 7, "n": 4})
    assert all(re.fullmatch(REGEX, c["message"]["content"]) for c in sampled.json()["choices"])
    chat = httpx.post(f"{live.url}/v1/chat/completions", json={
        "model": NAME, "messages": messages, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}).json()
    answer = httpx.post(f"{live.url}/v1/responses", json={
        "model": NAME, "input": "Answer, please.", "max_output_tokens": 40, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}}}).json()
    assert answer["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"guided_regex": "["}, "guided_regex", "unclosed character class"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": [1]}, "guided_json", "a JSON schema is an object"),
    ({"guided_choice": []}, "guided_choice", "a non-empty list of strings"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "takes one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag: the structural tag is"),
    ({"structured_outputs": {"structural_tag": '{"format": {"type": "triggered_tags"}}'}}, "structured_outputs",
     "'format' form is not supported"),
    ({"structural_tag": json.dumps({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["<b"]})},
     "structural_tag", "starts with none of the triggers"),
    ({"guided_json": SCHEMA, "regex": "a"}, "regex", "both ask for structured output"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "needs a non-empty list of structures"),
    ({"response_format": {"type": "grammar"}}, "response_format", "is not supported"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "start"),
    ({"ebnf": 'root ::= other'}, "ebnf", "Rule 'other' not found"),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs", "not a grammar in Lark or EBNF"),
    ({"guided_choice": ["a"], "min_tokens": 3}, "min_tokens", "min_tokens with structured output"),
])
def test_forms_that_cannot_be_carried_out_are_refused_naming_their_field(openai_live, fields, param, words):
    live = openai_live[0]
    answer = httpx.post(f"{live.url}/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_servers_default_keeps_json_compact_unless_a_request_says_otherwise(openai_live):
    """vLLM's `--structured-outputs-config.disable_any_whitespace` (a server's `disable_any_whitespace`): a JSON
    form holds no whitespace between its tokens, transformers' greedy text under the compact grammar; a request's
    `structured_outputs.disable_any_whitespace: false` asks for the flexible one again."""
    from fastapi.testclient import TestClient

    from ortmodule.serving import create_app

    _, model, hf, tokenizer, _ = openai_live
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    compact = reference(hf, tokenizer, ids, LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}), 40)
    flexible = reference(hf, tokenizer, ids, LLMatcher.grammar_from_json_schema(SCHEMA), 40)
    assert compact != flexible  # the random model writes whitespace where it may
    with TestClient(create_app(model, tokenizer, name=NAME, disable_any_whitespace=True)) as client:
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == compact
        again = client.post("/v1/completions", json={**body, "structured_outputs": {"disable_any_whitespace": False}})
        assert again.json()["choices"][0]["text"] == flexible


def test_a_structural_tag_holds_what_follows_its_trigger(openai_live):
    """A structural tag (vLLM's `response_format` and `structured_outputs.structural_tag`, SGLang's
    `structural_tag` on completions and `/generate`): free text until a trigger, which here is a word the random
    model writes of itself, then the structure's JSON and its end; transformers' greedy text under the same
    grammar, written here in llguidance's Lark (what the tag means), on every route."""
    live, _, hf, tokenizer, _ = openai_live
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    free = reference(hf, tokenizer, ids, LLMatcher.grammar_from_regex(r"(.|\n)*"), 12)
    trigger = re.search(r"[a-z]{3,}", free).group()  # a word the model writes anyway
    tag = {"structures": [{"begin": trigger, "schema": {"enum": ["red", "blue"]}, "end": "."}], "triggers": [trigger]}
    lark = (f'%llguidance {{}}\nstart: (tag_0)* tag_end\ntag_end: TAG_TEXT\nTAG_TEXT: /(.|\\n)*/\n'
            f'tag_0_trig[lazy]: TAG_TEXT {json.dumps(trigger)}\n'
            f'tag_0: tag_0_trig %json {{"enum": ["red", "blue"]}} "."\n')
    expected = reference(hf, tokenizer, ids, LLMatcher.grammar_from_lark(lark), 30)
    assert f'{trigger}"red".' in expected or f'{trigger}"blue".' in expected  # the tag came, and was held
    for fields in ({"response_format": {"type": "structural_tag", **tag}},
                   {"structured_outputs": {"structural_tag": json.dumps(tag)}}, {"structural_tag": json.dumps(tag)}):
        done = httpx.post(f"{live.url}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 30,
                                                              "temperature": 0, **fields}).json()
        assert done["choices"][0]["text"] == expected, (fields, done)
    answer = httpx.post(f"{live.url}/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "structural_tag": json.dumps(tag)}}).json()
    assert answer["text"] == expected, answer


def test_sglangs_generate_keeps_to_its_regex_and_json_schema(openai_live):
    """SGLang's `/generate` with `sampling_params.regex`, `json_schema` (the schema's text) or `ebnf`: the completions
    route's answer under the same grammar, transformers' greedy text; a bad one named by SGLang's field."""
    live, _, hf, tokenizer, _ = openai_live
    prompt = "The quick brown fox"
    ids = tokenizer(prompt).input_ids
    for name, value, grammar in (("regex", REGEX, LLMatcher.grammar_from_regex(REGEX)),
                                 ("json_schema", json.dumps(SCHEMA), LLMatcher.grammar_from_json_schema(SCHEMA)),
                                 ("ebnf", SQL, LLMatcher.grammar_from_regex(SQL_REGEX))):
        answer = httpx.post(f"{live.url}/generate", json={
            "text": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0, name: value}}).json()
        assert answer["text"] == reference(hf, tokenizer, ids, grammar, 40), answer
    bad = httpx.post(f"{live.url}/generate", json={"text": prompt, "sampling_params": {"regex": "("}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.regex", bad.text


def test_rows_with_and_without_grammars_run_together_each_as_alone(build):
    """Concurrent completions, some kept to a grammar and some not, in one decode batch (two rows at a time,
    joining as others end): each answer is transformers' greedy text under its own grammar, or none."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import LiveServer, hf_greedy, load_pair

    from ortmodule import load_tokenizer
    from ortmodule.serving import create_app

    fixture = build("llama")
    model, hf = load_pair(fixture)
    tokenizer = load_tokenizer(fixture.package_dir)
    forms = [(fields, grammar) for _, fields, grammar in FORMS[::2]] + [({}, None)] * 3
    prompts = [f"The quick brown fox {i}" for i in range(len(forms))]
    live = LiveServer(create_app(model, tokenizer, name=NAME, max_rows=2, window_ms=20))
    try:
        def send(prompt: str, fields: dict) -> dict:
            return httpx.post(f"{live.url}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 24,
                                                                  "temperature": 0, **fields}, timeout=120).json()

        with ThreadPoolExecutor(len(forms)) as pool:
            answers = list(pool.map(send, prompts, [fields for fields, _ in forms]))
    finally:
        live.stop()
    for prompt, (fields, grammar), answer in zip(prompts, forms, answers, strict=True):
        ids = tokenizer(prompt).input_ids
        expected = reference(hf, tokenizer, ids, grammar, 24) if grammar else \
            expected_text(tokenizer, hf_greedy(hf, ids, 24))[0]
        assert answer["choices"][0]["text"] == expected, (fields, answer)
