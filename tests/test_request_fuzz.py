"""A seeded fuzz of the server's request checks: rich valid requests of every route (tools, tool calls
given back, structured output, log-probabilities, images refused by the text model, score lists, SGLang's
sampling parameters), a few of their fields, at any depth, replaced by values of another type, out of
range, empty, huge, malformed JSON schemas and grammars, or removed, and fields of the route added with such
values; sent by a few clients at once to a server with tool calling, a reasoning parser and request chat
templates on. Every answer must be a success or the client's error (4xx) with a message, never a 5xx or a
dropped connection, a stream must end (`[DONE]` or an error event), and afterwards the server must still
answer a plain request with transformers' greedy text. `REQUEST_FUZZ_SEEDS=N` runs more
(docs/reliability.md)."""

import copy
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import OPENAI_NAME as NAME
from helpers import expected_text, fuzz_seeds, hf_greedy, served_live

from ortmodule.serving import schemas

pytest.importorskip("llguidance")
from test_tool_calling import TOOL_TEMPLATE, TOOLS  # noqa: E402

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLED = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
          "required": ["a"], "additionalProperties": False}
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJ"
         "RU5ErkJggg==")

# (route, valid body): each route's fields in use, so that a change deep inside one reaches the code that reads it.
BASES = [
    ("/v1/completions", {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
                         "logprobs": 2, "echo": True, "stop": ["zz"], "logit_bias": {"5": 3}}),
    ("/v1/completions", {"model": NAME, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "temperature": 0.7,
                         "seed": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True},
                         "prompt_logprobs": 1, "return_token_ids": True, "min_tokens": 2}),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 5, "temperature": 0,
                         "structured_outputs": {"regex": "[a-z]{1,4}"}, "allowed_token_ids": [5, 6, 7, 8, 9, 10],
                         "bad_words": ["fox"], "logprob_token_ids": [5, 6], "logprobs": 1}),
    ("/v1/chat/completions", {"model": NAME, "messages": CALLED, "tools": TOOLS, "tool_choice": "auto",
                              "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 8,
                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                              "stream": True, "temperature": 0}),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "system", "content": "Be brief."}, *ASK],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "r",
                                                                                         "schema": SCHEMA}},
                              "max_completion_tokens": 8, "temperature": 0, "chat_template_kwargs": {"x": 1},
                              "documents": [{"title": "t", "text": "d"}], "reasoning_effort": "low"}),
    ("/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 8, "temperature": 0,
                              "response_format": {"type": "structural_tag", "structures": [
                                  {"begin": "<a>", "schema": SCHEMA, "end": "</a>"}], "triggers": ["<a>"]},
                              "stop_token_ids": [9], "top_k": 5, "min_p": 0.1,
                              "repetition_penalty": 1.2, "presence_penalty": 0.5, "truncate_prompt_tokens": 20,
                              "include_reasoning": False, "parallel_tool_calls": False}),
    ("/v1/completions", {"model": NAME, "prompt": ["a", "b"], "max_tokens": 3, "ignore_eos": True,
                         "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}, "frequency_penalty": 1.0,
                         "include_stop_str_in_output": True, "skip_special_tokens": False,
                         "return_tokens_as_token_ids": True, "logprobs": 0, "add_special_tokens": False}),
    ("/tokenize", {"model": NAME, "messages": [*ASK, {"role": "assistant", "content": "It is"}],
                   "continue_final_message": True, "add_generation_prompt": False,
                   "chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": PIXEL}}]}],
        "max_tokens": 4}),
    ("/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 4, "temperature": 0,
                              "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                              "continue_final_message": False, "echo": True, "thinking_token_budget": 3}),
    ("/v1/responses", {"model": NAME, "input": [{"role": "user", "content": [{"type": "input_text",
                                                                               "text": "hi"}]}],
                       "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0, "tools": [
                           {"type": "function", "name": "get_time", "parameters": TOOLS[1]["function"]["parameters"]}],
                       "text": {"format": {"type": "json_schema", "name": "r", "schema": SCHEMA}},
                       "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"],
                       "top_logprobs": 1}),
    ("/v1/messages", {"model": NAME, "max_tokens": 5, "system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time",
                                           "input": {"zone": "utc"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "noon"}]}],
        "tools": [{"name": "get_time", "input_schema": TOOLS[1]["function"]["parameters"]}],
        "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 3}, "stream": True}),
    ("/v1/messages/count_tokens", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                   "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    ("/tokenize", {"model": NAME, "messages": ASK, "tools": TOOLS, "return_token_strs": True}),
    ("/tokenize", {"model": NAME, "prompt": "hello there", "add_special_tokens": False}),
    ("/detokenize", {"model": NAME, "tokens": [5, 6, 7]}),
    ("/v1/embeddings", {"model": NAME, "input": ["Hello there", "Hi"], "encoding_format": "base64",
                        "embed_dtype": "float16", "endianness": "big", "truncate_prompt_tokens": 3, "dimensions": 64}),
    ("/v1/embeddings", {"model": NAME, "messages": ASK, "add_generation_prompt": True, "normalize": False,
                        "chat_template_kwargs": {"enable_thinking": False}, "request_id": "r1"}),
    ("/v1/score", {"model": NAME, "query": "Is it", "items": [" yes", " no"], "label_token_ids": [5, 6],
                   "apply_softmax": True}),
    ("/v1/score", {"query": [5, 6, 7], "items": [[8], [9, 10]], "label_token_ids": [[5, 6], [7]],
                   "return_token_logprobs": True, "temperature": 0.5, "apply_softmax": True}),
    ("/generative_scoring", {"model": NAME, "query": "Is it", "items": [" yes", " no"], "label_token_ids": [5, 6]}),
    ("/generate", {"text": ["Hello", "Hi"], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                "stop": ["zz"], "regex": "[a-z ]+"},
                   "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": [{"max_new_tokens": 3, "temperature": 0.5,
                                                                "sampling_seed": 4, "n": 1}],
                   "stream": True}),
]
# The fields each route's schema declares, and the extras it reads by name.
FIELDS = {
    "/v1/completions": [*schemas.CompletionRequest.model_fields, "structured_outputs", "guided_json", "guided_regex",
                        "guided_choice", "guided_grammar", "response_format", "regex", "json_schema", "ebnf",
                        "structural_tag", "use_beam_search", "stop_regex"],
    "/v1/chat/completions": [*schemas.ChatRequest.model_fields, "structured_outputs", "guided_json", "guided_choice"],
    "/v1/responses": list(schemas.ResponsesRequest.model_fields),
    "/v1/messages": list(schemas.MessagesRequest.model_fields),
    "/v1/messages/count_tokens": list(schemas.MessagesRequest.model_fields),
    "/tokenize": list(schemas.TokenizeRequest.model_fields),
    "/detokenize": list(schemas.DetokenizeRequest.model_fields),
    "/v1/embeddings": list(schemas.EmbeddingRequest.model_fields),
    "/v1/score": list(schemas.ScoreRequest.model_fields),
    "/generative_scoring": list(schemas.GenerativeScoringRequest.model_fields),
    "/generate": list(schemas.GenerateRequest.model_fields),
}
KEYS = ["type", "name", "function", "parameters", "properties", "json_schema", "schema", "strict", "content",
        "text", "role", "url", "image_url", "arguments", "items", "enum", "pattern", "anyOf", "$ref", "$defs",
        "required", "choice", "regex", "grammar", "json", "structural_tag", "begin", "end", "triggers",
        "structures", "format", "include_usage", "input", "tool_use_id", "id", "source", "data", "effort",
        "budget_tokens", "tool_calls", "tool_call_id", "minLength", "maxItems", "const", "additionalProperties"]
STRINGS = ["", "a", " ", "x" * 3000, "{", "[1,", "null", '{"type": "object"}', "\ud800", "\x00", "<tool_call>",
           "</think>", "<s>", "{{ messages }}", "{% for %}", "function", "json_schema", "json_object", "text",
           "auto", "required", "none", "get_weather", "user", "assistant", "tool", "system", "developer",
           "image_url", "input_text", "tool_use", "tool_result", "enabled", "disabled", "low", "max", PIXEL,
           "data:image/png;base64,AAAA", "http://127.0.0.1:1/x.png", "[a-z", "a{99999}", "root ::= \"a\"", "5",
           "-1", "fuzz", "string", "integer", "object", "array"]
NUMBERS = [0, 1, 2, -1, 7, 255, 256, 511, 512, 1023, 2**31, 2**63, -(2**63) - 1, 10**30, 0.0, 0.5, -0.5, 1e-9,
           2.5, 1e308]


def junk(rng: random.Random, depth: int = 0):
    """A random JSON value: a scalar of the kinds above, or a list or object of them."""
    kind = rng.random()
    if kind < 0.1:
        return rng.choice([None, True, False])
    if kind < 0.35:
        return rng.choice(NUMBERS)
    if kind < 0.7 or depth > 2:
        return rng.choice(STRINGS)
    if kind < 0.85:
        return [junk(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 3, 40]))]
    return {rng.choice(KEYS): junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def like(rng: random.Random, value):
    """A value of the same JSON type as `value` (which the schema's types then let through to the checks
    of its meaning): another string, number or flag, a list emptied, cut, repeated or reversed, an object
    less one key."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([n for n in NUMBERS if isinstance(n, int)] + [value - 1, value + 1])
    if isinstance(value, float):
        return rng.choice([n for n in NUMBERS if isinstance(n, float)] + [value * 2, -value])
    if isinstance(value, str):
        return rng.choice(STRINGS)
    if isinstance(value, list):
        return rng.choice([[], value[:1], value * 2, value[::-1]])
    if isinstance(value, dict) and value:
        return {k: v for k, v in value.items() if k != rng.choice(list(value))}
    return junk(rng)


def places(value, path=()):
    """Every object and list inside a request, with its path."""
    if isinstance(value, (dict, list)):
        yield path, value
        for key, inner in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from places(inner, (*path, key))


def mutated(rng: random.Random, route: str, body: dict) -> dict:
    """The body with 1-3 changes: a value replaced (by junk, or by another value of the request), an entry
    removed or duplicated, a key added (one of the route's fields at the top)."""
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        path, target = rng.choice(list(places(body)))
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        action = rng.random()
        if not path and action < 0.3:
            target[rng.choice(FIELDS[route])] = junk(rng)
        elif keys and action < 0.75:
            key = rng.choice(keys)
            draw = rng.random()
            target[key] = (like(rng, target[key]) if draw < 0.5 else junk(rng) if draw < 0.85
                           else copy.deepcopy(rng.choice(list(places(body)))[1]))
        elif keys and action < 0.9:
            key = rng.choice(keys)
            if isinstance(target, dict):
                del target[key]
            else:
                target.pop(key)
        elif isinstance(target, list) and target:
            target.append(copy.deepcopy(rng.choice(target)))
        elif isinstance(target, dict):
            target[rng.choice(KEYS)] = junk(rng)
    return body


def error_message(payload) -> str:
    """An error answer's message, in OpenAI's, SGLang's or Anthropic's shape."""
    error = payload.get("error", payload) if isinstance(payload, dict) else None
    return error.get("message") if isinstance(error, dict) else None


def send(url: str, route: str, body: dict) -> str | None:
    """One request; what was wrong with the answer, or None."""
    content = json.dumps(body, ensure_ascii=True)
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=120) as client:
        try:
            if body.get("stream") is True:
                with client.stream("POST", route, content=content, headers=headers) as response:
                    if response.status_code != 200:
                        response.read()
                        return _error_problem(response)
                    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
                if not events:
                    return "a stream without events"
                last = events[-1]
                if last != "[DONE]" and error_message(json.loads(last)) is None and route != "/v1/messages":
                    return f"a stream that ends with {last[:200]}"
                return None
            response = client.post(route, content=content, headers=headers)
        except httpx.HTTPError as e:
            return f"the connection failed: {e!r}"
    if response.status_code == 200:
        response.json()
        return None
    return _error_problem(response)


def _error_problem(response) -> str | None:
    if not 400 <= response.status_code < 500 or response.status_code == 404 and "model" not in response.text:
        return f"status {response.status_code}: {response.text[:300]}"
    try:
        message = error_message(response.json())
    except ValueError:
        return f"status {response.status_code} without JSON: {response.text[:300]}"
    return None if message else f"status {response.status_code} without a message: {response.text[:300]}"


@pytest.fixture(scope="module")
def served(build):
    live, _, hf, tokenizer = served_live(build("llama"), TOOL_TEMPLATE, enable_auto_tool_choice=True,
                                         tool_call_parser="hermes", reasoning_parser="qwen3",
                                         trust_request_chat_template=True, tokenizer_info=True)
    yield live, hf, tokenizer
    live.stop()


def test_every_valid_base_request_is_answered(served):
    """The fuzz's starting points are requests the server carries out (the image one refused by name: this
    text package takes no images), so that their changes reach past the first checks."""
    live, _, _ = served
    for route, body in BASES:
        problem = send(live.url, route, body)
        assert problem is None, (route, problem)
        if "image_url" not in json.dumps(body):
            response = live.client.post(route, json={**body, **({"stream": False} if "stream" in body else {})})
            assert response.status_code == 200, (route, response.text)


@pytest.mark.parametrize("seed", fuzz_seeds("REQUEST_FUZZ_SEEDS", 40))
def test_mutated_requests_get_an_answer_or_a_clients_error(served, seed):
    live, hf, tokenizer = served
    rng = random.Random(seed)
    cases = []
    for _ in range(12):
        route, body = rng.choice(BASES)
        cases.append((route, mutated(rng, route, body)))
    with ThreadPoolExecutor(4) as pool:
        problems = list(pool.map(lambda case: send(live.url, *case), cases))
    for (route, body), problem in zip(cases, problems, strict=True):
        assert problem is None, f"seed {seed}: {route} {json.dumps(body)[:1500]}: {problem}"
    ids = tokenizer("The quick brown fox").input_ids
    answer = live.client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 5,
                                                       "temperature": 0}).json()
    assert answer["choices"][0]["text"] == expected_text(tokenizer, hf_greedy(hf, ids, 5))[0]
