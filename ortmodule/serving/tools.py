"""Tool calling on `/v1/chat/completions`, as vLLM carries it out.

A request's `tools` (`{"type": "function", "function": {"name", "description", "parameters"}}`) go to the
chat template (`apply_chat_template(tools=...)`, which renders them where the template has a place for them),
and its `tool_choice` says what the answer may be:
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is kept to that
  function's `parameters` schema (structured output, constraints.py) and answered as one call of it;
- "required": the output is kept to a JSON list of one or more `{"name", "parameters"}` objects, one of the
  tools each (at most one with `parallel_tool_calls` false), and answered as those calls;
- "auto" (the default beside tools): the model writes text or calls in its own format, read by the parser
  the server was started with (`--enable-auto-tool-choice --tool-call-parser NAME`, as vLLM's flags);
- "none": text, the tools still shown to the template (as vLLM shows them by default).
An assistant message's `tool_calls` (their `arguments` as JSON objects) and a tool message's `tool_call_id`
go to the template as transformers' chat templates take them.

The parsers (vLLM's of the same names): `hermes` (Hermes, Qwen2.5, Qwen3, SmolLM3: `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`, text before the first call its content), `llama3_json` (Llama 3.1-3.3's
JSON calls: output that starts with `<|python_tag|>` or `{`, calls `{"name", "parameters"}` separated by
";"), `phi4_mini_json` (Phi-4-mini's `functools[{"name", "arguments"}, ...]`, text before it its content),
`qwen3_coder` (Qwen3.5, Qwen3-Coder: `<tool_call><function=NAME><parameter=P>value</parameter>...</function>
</tool_call>`, each value typed by the tool's schema, text before the first call its content), `pythonic` (Llama
3.2's and Llama 4's Python calls: output that is `[f(a=1), g(b="x")]`, Llama 4's `<|python_start|>` around it
taken), `lfm2` (LFM2's and LFM2.5's: the same list between `<|tool_call_start|>` and `<|tool_call_end|>`, the
text around it its content) and `mistral` (Mistral's `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` after
it, or, from its v11 tokenizers, `name[ARGS]{...}` after each; the text before the first its content; every call's
id nine letters and digits, which Mistral's chat templates require of the calls given back), `gemma4` (Gemma 4's
`<|tool_call>call:NAME{...}<tool_call|>`: gemma4_calls.py), `functiongemma` (FunctionGemma's
`<start_function_call>call:NAME{...}<end_function_call>`, Gemma 4's form with `<escape>` around strings),
`granite` (Granite 3's JSON list after `<|tool_call|>` or `<tool_call>`: listed_calls.py) and `openai` (gpt-oss's
harmony messages to `functions.NAME`, beside `--reasoning-parser openai_gptoss`: harmony.py).
Output that does not parse is the answer's text, as in vLLM.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
import uuid
from dataclasses import dataclass

from . import gemma4_calls, harmony, listed_calls, python_calls
from .errors import ServingError
from .json_calls import CallScanner
from .settings import TOOL_CALL_PARSERS
from .text import safe_before, special_tokens

PARSERS = TOOL_CALL_PARSERS
CHOICES = ("none", "auto", "required")
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PHI4 = listed_calls.PHI4
# Where a parser's calls begin, for the parsers whose calls may follow text.
_LFM2_START, _PYTHON_START = python_calls.LFM2_START, python_calls.PYTHON_START
_MISTRAL = listed_calls.MISTRAL
_STARTS = {"hermes": _HERMES_START, "phi4_mini_json": _PHI4, "qwen3_coder": _HERMES_START, "lfm2": _LFM2_START,
           "mistral": _MISTRAL, **{name: form.start for name, form in gemma4_calls.FORMS.items()},
           harmony.TOOL_PARSER: harmony.CHANNEL}
_PYTHON_TAG = listed_calls.PYTHON_TAG
# Where a parser's calls begin for the parsers whose calls are the whole output.
_OPENINGS = {"llama3_json": (_PYTHON_TAG, "{"), "pythonic": (_PYTHON_START, "["),
             "granite": (listed_calls.GRANITE[0], "[")}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its answer (module docstring): `mode` one of "none", "named",
    "required", "auto"; `name` the named function; `parser` auto's; `parallel` whether more than one call
    is kept; `tools` the request's tools as the template takes them; `schema` the JSON schema the output is
    kept to (named, required), else None; `short_ids` Mistral's ids for the calls."""

    mode: str
    tools: tuple[dict, ...] = ()
    name: str | None = None
    parser: str | None = None
    parallel: bool = True
    schema: dict | None = None
    short_ids: bool = False  # the calls' ids nine letters and digits (the server's parser is mistral)

    @property
    def calls(self) -> bool:
        """Whether the answer is read for calls (every mode but "none")."""
        return self.mode != "none"


NO_TOOLS = ToolPlan("none")


def tool_plan(served, body) -> ToolPlan:
    """The request's tools and choice checked and planned (module docstring); each mistake a 400 naming its
    field, as vLLM's checks word them where they have one."""
    neutral = {"functions": (None, []),  # OpenAI's older form, which vLLM does not take either
               "function_call": (None, "none", "auto") if body.functions == [] else (None, "none")}
    for name, values in neutral.items():
        if getattr(body, name, None) not in values:
            raise ServingError(f"{name} is OpenAI's deprecated form of tools and is not supported: send tools and "
                               "tool_choice", name)
    tools = checked_tools(body.tools)
    plan = _plan(served, body, tools)
    return dataclasses.replace(plan, short_ids=True) if served.settings.tool_call_parser == "mistral" and \
        plan.calls else plan


def _plan(served, body, tools: tuple[dict, ...]) -> ToolPlan:
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in CHOICES:
        raise ServingError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                           f"{{'name': ...}}}}, got {choice!r}", "tool_choice")
    if choice is not None and body.tools is None and choice != "none":
        raise ServingError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    if not tools:  # nothing to call: "auto" and "required" are "none" (OpenAI's rule, vLLM's from 0.34)
        if isinstance(choice, dict):
            raise ServingError(f"tool_choice names {_named(choice)!r}, which is not among tools (none given)",
                               "tool_choice")
        return NO_TOOLS
    if choice is None or choice == "auto":
        settings = served.settings
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise ServingError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               f"set{_parser_hint(served.tokenizer)}; or send tool_choice 'required', 'none' or a "
                               "named function", "tool_choice")
        return ToolPlan("auto", tools, parser=settings.tool_call_parser, parallel=parallel)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel, schema=_calls_schema(tools, parallel))
    name = _named(choice)  # what is left: an object (the schema takes a string or an object)
    found = [t["function"] for t in tools if t["function"]["name"] == name]
    if not found:
        raise ServingError(f"Tool name {name!r} has not been passed in `tools`.", "tool_choice")
    return ToolPlan("named", tools, name=name, parallel=parallel, schema=found[0].get("parameters") or EMPTY_PARAMETERS)


def _named(choice: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ServingError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return function["name"]


def checked_tools(tools) -> tuple[dict, ...]:
    """The request's tools, each `{"type": "function", "function": {"name": a non-empty string, "description":
    a string, "parameters": a JSON schema object, "strict": a boolean}}` (parts left out may be)."""
    checked = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ServingError(f"{where}: a tool is {{'type': 'function', 'function': {{...}}}} (this server calls "
                               "functions only)", where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ServingError(f"{where}.function must be an object with a non-empty name", f"{where}.function")
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "true or false")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise ServingError(f"{where}.function.{key} must be {what}", f"{where}.function.{key}")
        checked.append({"type": "function", "function": function})
    return tuple(checked)


def _calls_schema(tools: tuple[dict, ...], parallel: bool) -> dict:
    """"required"'s output: a JSON list of `{"name": one tool's name, "parameters": its parameters}`, the tools'
    `$defs` gathered at the top (where their references point), as vLLM builds it; no other key beside the two
    (vLLM's schema lets a model add some, which no call carries)."""
    options, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = dict(function.get("parameters") or EMPTY_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ServingError(f"tools[{i}]: its parameters' $defs {key!r} differs from another tool's of that "
                                   "name", f"tools[{i}].function.parameters")
            defs[key] = value
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                         "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parser_hint(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    if "<|channel|>" in template:
        return " (this model's chat template writes gpt-oss's harmony calls: --reasoning-parser openai_gptoss " \
            "--tool-call-parser openai)"
    if listed_calls.GRANITE[0] in template:
        return " (this model's chat template writes Granite's calls: --tool-call-parser granite)"
    if "<function=" in template:
        return " (this model's chat template writes Qwen3.5's XML calls: --tool-call-parser qwen3_coder)"
    if _HERMES_START in template:
        return " (this model's chat template writes hermes calls: --tool-call-parser hermes)"
    if _LFM2_START in template:
        return " (this model's chat template writes LFM2's calls: --tool-call-parser lfm2)"
    if "<|tool_call>call:" in template:
        return " (this model's chat template writes Gemma 4's calls: --tool-call-parser gemma4)"
    if gemma4_calls.FUNCTIONGEMMA.start in template:
        return " (this model's chat template writes FunctionGemma's calls: --tool-call-parser functiongemma)"
    if _MISTRAL in template:
        return " (this model's chat template writes Mistral's calls: --tool-call-parser mistral)"
    if _PYTHON_TAG in template:
        return " (this model's chat template writes Llama 3's JSON calls: --tool-call-parser llama3_json)"
    if "functools" in template:
        return " (this model's chat template writes Phi-4-mini's calls: --tool-call-parser phi4_mini_json)"
    return ""


def markers_are_special(plan: ToolPlan, tokenizer) -> bool:
    """Whether the parser's markers are special tokens of this tokenizer (Hermes' `<tool_call>`), which the
    text must then keep for the parser to see them (vLLM turns `skip_special_tokens` off the same way)."""
    if plan.mode != "auto":
        return False
    marker = _STARTS.get(plan.parser, _OPENINGS.get(plan.parser, (_PYTHON_TAG,))[0])
    return marker in special_tokens(tokenizer)


# ---- answers --------------------------------------------------------------------------------------

def new_call_id(short: bool = False) -> str:
    """A call's id: vLLM's, or Mistral's nine letters and digits (`short`)."""
    if short:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str, ident: str) -> dict:
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """The answer's content and its calls (name, arguments as JSON text) read from the output `text`; calls
    None where the output holds none (or does not parse), the content then the whole text."""
    if plan.mode == "named":
        return None, [(plan.name, text)]
    try:
        if plan.mode == "required":
            content, calls = None, _json_calls(text, "parameters", listed=True)
        elif plan.parser == "qwen3_coder":  # the one that types the arguments by the tools' schemas
            content, calls = _qwen3_coder(text, plan.tools)
        else:
            content, calls = _READERS[plan.parser](text)
    except (ValueError, KeyError, TypeError, SyntaxError, RecursionError, MemoryError):
        return text, None
    if calls is None:
        return text, None
    return content, calls if plan.parallel else calls[:1]


def _tool_call_bodies(text: str) -> list[str]:
    """What each `<tool_call>` holds, to its `</tool_call>` or, where that never comes, the end (as vLLM reads
    the hermes and qwen3_coder calls): the stream's reading (`CallReading.bodies`) of the whole text."""
    return [text[begin:end] for _, begin, end, _ in CallReading().bodies(text)]


def _json_calls(text: str, key: str, listed: bool) -> list[tuple[str, str]]:
    """JSON calls' names and arguments (json_calls.py: `key`'s value, as the model wrote it); a `ValueError`
    where the text is not JSON, or not calls of that form."""
    json.loads(text)
    scanner = CallScanner(key, listed)
    scanner.feed(text)
    if scanner.broken or not scanner.calls or any(c.name is None or not c.closed for c in scanner.calls):
        raise ValueError("not calls")
    return [(c.name, scanner.arguments(c)) for c in scanner.calls]


def _hermes(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    if _HERMES_START not in text:
        return text, None
    calls = [call for body in _tool_call_bodies(text) for call in _json_calls(body, "arguments", listed=False)]
    content = text[: text.find(_HERMES_START)]
    return content or None, calls


def _qwen3_coder(text: str, tools: tuple[dict, ...]) -> tuple[str | None, list[tuple[str, str]] | None]:
    """Qwen3.5's and Qwen3-Coder's XML calls, as vLLM's `qwen3_coder` parser reads them: each `<tool_call>`'s
    `<function=NAME>` and its `<parameter=P>` values (one newline trimmed each side), typed by the schema."""
    if _HERMES_START not in text:
        return text, None
    calls = []
    for body in _tool_call_bodies(text):
        name, pairs, _ = _coder_call(body, tools, whole=True)
        if name is None:
            raise ValueError("a tool call without a function")
        calls.append((name, _arguments_text(pairs)))
    return text[: text.find(_HERMES_START)] or None, calls


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _coder_call(body: str, tools: tuple[dict, ...], whole: bool) -> tuple[str | None, list[tuple[str, object]], bool]:
    """A qwen3_coder call as far as it is written: its name (None until `<function=NAME>` is), its parameters
    whose values are whole (each ended by `</parameter>`, the next `<parameter=` or the function's end; all of
    them where the call is `whole`), typed by the tool's schema, and whether the function has ended."""
    function = _FUNCTION.search(body)
    if function is None:
        return None, [], False
    name = function.group(1).strip()
    found = [t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name]
    properties = found[0].get("properties", {}) if found and isinstance(found[0], dict) else {}
    ended, inner, pairs = whole or bool(function.group(3)), function.group(2), []
    for parameter in _PARAMETER.finditer(inner):
        if not (ended or parameter.group(3) or parameter.end() < len(inner)):
            break
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value[1:] if value.startswith("\n") else value
        pairs.append((key, _typed(value[:-1] if value.endswith("\n") else value, properties.get(key))))
    return name, pairs, ended


def _arguments_text(pairs: list[tuple[str, object]]) -> str:
    """Parameters as a JSON object's text, in their order (as `json.dumps` writes a dict: ", " and ": "), so
    that a stream can give it a parameter at a time."""
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                           for k, v in pairs) + "}"


def _typed(value: str, schema) -> object:
    """A parameter's text as its schema's type says, as vLLM converts it: a string as written (null where the
    schema admits null and the text is null or None, as for every other type); an integer or a number where
    the text is one, a boolean (true where the text is "true"), JSON or else a Python literal for the rest;
    the text itself where it does not convert, and for a parameter the tool does not name."""
    if not isinstance(schema, dict):
        return value
    kinds = schema.get("type", [o.get("type") for o in schema.get("anyOf", []) if isinstance(o, dict)] or "string")
    kinds = [str(k).strip().lower() for k in (kinds if isinstance(kinds, list) else [kinds])]
    kind = next((k for k in kinds if k != "null"), "string")
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return None if "null" in kinds and value.lower() in ("null", "none") else value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number == int(number) else number
    except (ValueError, OverflowError):
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _gemma_calls(form: gemma4_calls.Form):
    """The reader of Gemma 4's or FunctionGemma's calls (gemma4_calls.py), as vLLM's `gemma4` and `functiongemma`
    parsers read them: each `<|tool_call>call:NAME{...}<tool_call|>` (`<start_function_call>call:NAME{...}
    <end_function_call>`, the last one read to the end where it never closes); the text before the first the
    content (as streamed: vLLM trims it in a whole answer only)."""
    def read(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
        calls = form.calls(text)
        return (text[: text.find(form.start)] or None, calls) if calls else (text, None)

    return read


_READERS = {"hermes": _hermes, "llama3_json": listed_calls.llama3_json, "phi4_mini_json": listed_calls.phi4_mini_json,
            "pythonic": python_calls.pythonic, "lfm2": python_calls.lfm2, "mistral": listed_calls.mistral,
            **{name: _gemma_calls(form) for name, form in gemma4_calls.FORMS.items()}, "granite": listed_calls.granite,
            harmony.TOOL_PARSER: harmony.read_calls}


def tool_message(plan: ToolPlan, text: str, finish: str) -> tuple[dict, str]:
    """A choice's `message` and `finish_reason` as vLLM answers them: calls under `tool_calls` (content None,
    or auto's text before them), finish "tool_calls" where required's or auto's calls were read ("stop" for a
    named function, which OpenAI also answers); the text as content where there are none. Calls the length
    cut short (a named function's, required's and hermes') come as far as they were written, as they stream."""
    if not plan.calls:
        return {"role": "assistant", "content": text}, finish
    content, calls = read_calls(plan, text)
    if calls is None and finish == "length":
        found = [(name, source[start:reach]) for name, source, start, reach in calls_so_far(plan, text, CallReading())
                 if name is not None]
        if found:
            marker = _STARTS.get(plan.parser, "") if plan.mode == "auto" else ""
            content = text[: text.find(marker)] or None if marker and marker in text else None
            calls = found if plan.parallel else found[:1]
    if calls is None:
        return {"role": "assistant", "content": content}, finish
    message = {"role": "assistant", "content": content,
               "tool_calls": [_call(n, a, new_call_id(plan.short_ids)) for n, a in calls]}
    return message, finish if plan.mode == "named" or finish == "length" else "tool_calls"


class CallReading:
    """What a stream has read of its calls so far (`calls_so_far`), so that each piece is read once: the JSON
    scanners (one for "required"'s list, one a hermes `<tool_call>`), how many `<tool_call>`s closed, where the
    open one's text begins and how far the text was looked at for their markers, and each qwen3_coder call's last
    reading with where its tags stood (a parameter, the name and the function's end only come at a tag)."""

    def __init__(self):
        self.scanners: list[CallScanner] = []
        self.closed, self.begin, self.looked = 0, None, 0  # calls closed; the open one's text; where to look
        # a qwen3_coder call's last reading: whether whole, its name, its arguments' text so far
        self.coder: dict[int, tuple[bool, str | None, str]] = {}
        self.seen: dict[int, int] = {}  # how far each qwen3_coder call's text was looked at
        self.harmony = harmony.CallsRead()  # the openai parser's calls (gpt-oss's harmony messages)
        self.listed: listed_calls.ListedReading | None = None  # llama3_json's, phi4_mini_json's, mistral's
        self.gemma: gemma4_calls.Reading | None = None  # Gemma 4's or FunctionGemma's calls, each once it closes
        self.python: python_calls.PythonReading | None = None  # pythonic's and lfm2's

    def bodies(self, text: str):
        """Each `<tool_call>` from the first not yet closed: (its number, where its text begins, where it ends: its
        `</tool_call>`, or the text's end for the last, whether closed); each character looked at once for the
        markers."""
        while True:
            if self.begin is None:  # no call open: the next <tool_call>, looked for in what came since
                start = text.find(_HERMES_START, self.looked)
                if start < 0:
                    self.looked = max(self.looked, len(text) - len(_HERMES_START) + 1)
                    return
                self.begin = self.looked = start + len(_HERMES_START)
            end = text.find(_HERMES_END, self.looked)
            if end < 0:
                self.looked = max(self.begin, len(text) - len(_HERMES_END) + 1)
                yield self.closed, self.begin, len(text), False
                return
            yield self.closed, self.begin, end, True  # read whole once: not again
            self.closed, self.begin, self.looked = self.closed + 1, None, end + len(_HERMES_END)

    def coder_call(self, j: int, text: str, begin: int, end: int, tools: tuple[dict, ...], whole: bool) -> None:
        """qwen3_coder's call `j` read again where a tag that ends a parameter, the name or the function has come
        in what the text added since its last reading (a value's own text does not)."""
        seen = self.seen.get(j, begin)
        fresh = text[max(begin, seen - len(_CODER_TAGS[0])): end]
        last = self.coder.get(j)
        if last is None or last[0] != whole or any(tag in fresh for tag in _CODER_TAGS) or \
                (last[1] is None and ">" in fresh):
            name, pairs, ended = _coder_call(text[begin:end], tools, whole)
            self.coder[j] = (whole, name, _arguments_text(pairs)[: None if ended else -1])
        self.seen[j] = end


_CODER_TAGS = ("</parameter>", "<parameter=", "</function>")  # the longest first
_LISTED = ("llama3_json", "phi4_mini_json", "mistral", "granite")  # listed_calls.py's parsers


def calls_so_far(plan: ToolPlan, text: str, reading: CallReading) -> list[tuple[str | None, str, int, int]]:
    """The calls in the output so far that are read as they are written, in order: each one's name (None until
    it is whole and its arguments have begun) and its arguments as far as they are written, as a text and the
    span of it they are (so that a stream takes only what they grew by). JSON calls
    ("required"'s list; hermes' `<tool_call>`s), fed to `reading`'s scanners what the text added; qwen3_coder's
    a parameter at a time (`_arguments_text` less its closing brace until the function ends); openai's (harmony's
    messages to functions) as written (harmony.py's `CallsRead`); llama3_json's, phi4_mini_json's, mistral's and
    granite's as written (listed_calls.py); pythonic's and lfm2's a keyword's value at a time, a string value as
    written (python_calls.py); gemma4's and functiongemma's each whole once it closes."""
    scanners = reading.scanners
    if plan.mode == "required":
        if not scanners:
            scanners.append(CallScanner("parameters", listed=True))
        scanners[0].read(text)
        return [(c.name if c.name is not None and c.start is not None else None, scanners[0].text, c.start or 0,
                 c.reach or 0) for c in scanners[0].calls]
    if plan.mode == "auto" and plan.parser == harmony.TOOL_PARSER:
        return reading.harmony.read(text)
    if plan.mode == "auto" and plan.parser in gemma4_calls.FORMS:
        reading.gemma = reading.gemma or gemma4_calls.Reading(gemma4_calls.FORMS[plan.parser])
        return reading.gemma.read(text)
    if plan.mode == "auto" and plan.parser in _LISTED:
        reading.listed = reading.listed or listed_calls.ListedReading(plan.parser)
        return reading.listed.read(text)
    if plan.mode == "auto" and plan.parser in ("pythonic", "lfm2"):
        reading.python = reading.python or python_calls.PythonReading(plan.parser)
        return reading.python.read(text)
    if plan.mode != "auto" or plan.parser not in ("hermes", "qwen3_coder"):
        return []
    for j, begin, end, closed in reading.bodies(text):
        if plan.parser == "qwen3_coder":
            reading.coder_call(j, text, begin, end, plan.tools, closed)
            continue
        if j == len(scanners):
            scanners.append(CallScanner("arguments", listed=False, origin=begin))
        scanners[j].read(text, end)
    if plan.parser == "qwen3_coder" and plan.mode == "auto":
        return [(name, arguments, 0, len(arguments))
                for _, name, arguments in (reading.coder[j] for j in sorted(reading.coder))]
    return [(c.name if c.name is not None and c.start is not None else None, scanner.text, c.start or 0,
             c.reach or 0) for scanner in scanners for c in scanner.calls]


class ToolStream:
    """One streamed choice's deltas under a plan: a named function's arguments as they come (its call's id,
    type and name in the first); "required"'s and auto's calls (`calls_so_far`) each once its name is whole and
    its arguments have begun, then its arguments in pieces as they are written (qwen3_coder's a parameter at a
    time, pythonic's and lfm2's a value at a time, a string as written; gemma4's and functiongemma's each whole
    once it closes);
    auto's text streamed until it may start a call (the rest held). `end` gives what was held: the rest of the
    content, the rest of each call."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent, self.named_id = plan, "", 0, None
        self.reading = CallReading()
        self.streamed: list[list] = []  # each call streamed: its id and how much of its arguments was sent

    def piece(self, text: str) -> dict:
        """The delta's fields for this piece of output (maybe none: held)."""
        self.text += text
        if self.plan.mode == "named":
            if self.named_id is None:
                self.named_id = new_call_id(self.plan.short_ids)
                return {"tool_calls": [{"index": 0, **_call(self.plan.name, text, self.named_id)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        delta = {}
        safe = self._safe_length() if self.plan.mode == "auto" else 0
        if safe > self.sent:
            delta["content"], self.sent = self.text[self.sent: safe], safe
        calls = self._call_deltas()
        return {**delta, "tool_calls": calls} if calls else delta

    def _call_deltas(self) -> list[dict]:
        """The calls' deltas since the last piece: a call's id, type, name and arguments so far once its name is
        whole, then what its arguments grew by."""
        deltas = []
        found = calls_so_far(self.plan, self.text, self.reading)
        for k, (name, source, start, reach) in enumerate(found if self.plan.parallel else found[:1]):
            if name is None:
                break
            if k == len(self.streamed):
                self.streamed.append([new_call_id(self.plan.short_ids), reach - start])
                deltas.append({"index": k, **_call(name, source[start:reach], self.streamed[k][0])})
            elif reach - start > self.streamed[k][1]:
                deltas.append({"index": k, "function": {"arguments": source[start + self.streamed[k][1]: reach]}})
                self.streamed[k][1] = reach - start
        return deltas

    def _safe_length(self) -> int:
        """How much of the text so far cannot be part of a call (auto: before any marker, or a marker's start)."""
        if self.plan.mode == "none":
            return len(self.text)
        if self.plan.parser == "granite":  # the whole output is calls or text: held where it may be calls
            return len(self.text) if listed_calls.granite_origin(self.text) is None else 0
        if self.plan.parser in _OPENINGS:  # the whole output is calls or text: held where it may be calls
            tag, opening = _OPENINGS[self.plan.parser]
            text = self.text
            if text.startswith(opening) or text.startswith(tag) or tag.startswith(text):
                return 0
            return len(text)
        return safe_before(self.text, _STARTS[self.plan.parser], self.sent)  # none begins in what was sent

    def end(self, text: str, finish: str) -> tuple[list[dict], str]:
        """The deltas still to send once the output is whole (`text`), and the choice's finish reason."""
        if self.plan.mode == "named":
            rest = text[len(self.text):]
            first = self.named_id is None
            return [self.piece(rest)] if rest or first else [], finish
        self.text = text
        message, reason = tool_message(self.plan, text, finish)
        deltas = []
        rest = (message["content"] or "")[self.sent:]
        if rest:
            deltas.append({"content": rest})
        for k, call in enumerate(message.get("tool_calls", ())):
            if k < len(self.streamed):  # its arguments' rest (the whole answer's are the same text)
                more = call["function"]["arguments"][self.streamed[k][1]:]
                deltas += [{"tool_calls": [{"index": k, "function": {"arguments": more}}]}] if more else []
            else:
                deltas.append({"tool_calls": [{"index": k, **call}]})
        return deltas, reason
