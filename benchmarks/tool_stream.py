"""The server's host time to stream a long tool call (serving/tools.py `ToolStream`): a call whose arguments hold a
file's text (a model writing code through a tool), given a few characters a piece as a stream's tokens come, under
"required" and the hermes, qwen3_coder, phi4_mini_json, mistral (its v11 form), pythonic, lfm2, gemma4,
functiongemma and openai parsers (openai: gpt-oss's harmony output read first, its analysis apart, as the server
reads it); prints the seconds each takes over the whole output and per piece. No model runs: this is the event
loop's own work per streamed token.

    python benchmarks/tool_stream.py [--lines 3000] [--piece 4]
"""

import argparse
import json
import time

from ortmodule.serving.harmony import HarmonyStream
from ortmodule.serving.tools import ToolPlan, ToolStream


def outputs(lines: int) -> dict[str, tuple[ToolPlan, str]]:
    code = "".join(f"<div>{i} > {i - 1}</div>\n" for i in range(lines))  # a value full of '>' and '<'
    arguments = json.dumps({"path": "page.html", "content": code})
    xml = (f"<tool_call>\n<function=write>\n<parameter=path>\npage.html\n</parameter>\n<parameter=content>\n{code}"
           "</parameter>\n</function>\n</tool_call>")
    return {"required": (ToolPlan("required"), f'[{{"name": "write", "parameters": {arguments}}}]'),
            "hermes": (ToolPlan("auto", parser="hermes"),
                       f'Writing it. <tool_call>\n{{"name": "write", "arguments": {arguments}}}\n</tool_call>'),
            "qwen3_coder": (ToolPlan("auto", parser="qwen3_coder"), xml),
            "phi4_mini_json": (ToolPlan("auto", parser="phi4_mini_json"),
                               f'functools[{{"name": "write", "arguments": {arguments}}}]'),
            "mistral": (ToolPlan("auto", parser="mistral"), f"[TOOL_CALLS]write[ARGS]{arguments}"),
            "pythonic": (ToolPlan("auto", parser="pythonic"), f"[write(path='page.html', content={code!r})]"),
            "lfm2": (ToolPlan("auto", parser="lfm2"),
                     f'<|tool_call_start|>[write(path="page.html", content="""{code}""")]<|tool_call_end|>'),
            "gemma4": (ToolPlan("auto", parser="gemma4"),
                       f'<|tool_call>call:write{{path:<|"|>page.html<|"|>,content:<|"|>{code}<|"|>}}<tool_call|>'),
            "functiongemma": (ToolPlan("auto", parser="functiongemma"), "<start_function_call>call:write{path:"
                              f"<escape>page.html<escape>,content:<escape>{code}<escape>}}<end_function_call>"),
            "openai": (ToolPlan("auto", parser="openai"),
                       "<|channel|>analysis<|message|>The user wants a page.<|end|><|start|>assistant<|channel|>"
                       f"commentary to=functions.write <|constrain|>json<|message|>{arguments}<|call|>")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--piece", type=int, default=4, help="characters a piece (about a token's)")
    args = parser.parse_args()
    for name, (plan, text) in outputs(args.lines).items():
        pieces = [text[i: i + args.piece] for i in range(0, len(text), args.piece)]
        stream, harmony = ToolStream(plan), HarmonyStream(calls=True) if plan.parser == "openai" else None
        start = time.perf_counter()
        if harmony is None:
            deltas = [stream.piece(piece) for piece in pieces] + stream.end(text, "stop")[0]
        else:  # the calls read from the content harmony's reading gives, piece by piece
            deltas = [stream.piece(harmony.piece(piece)[1]) for piece in pieces]
            deltas += stream.end(stream.text + harmony.end()[1], "stop")[0]
        seconds = time.perf_counter() - start
        sent = sum(1 for d in deltas if d.get("tool_calls"))
        print(f"{name:14s} {len(text):7d} characters, {len(pieces):6d} pieces: {seconds:.3f} s, "
              f"{seconds / len(pieces) * 1e6:.1f} us a piece, {sent} deltas with the call")


if __name__ == "__main__":
    main()
