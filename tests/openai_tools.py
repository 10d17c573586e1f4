"""Tool calls through `anneal serve` with the official `openai` client.

Usage: openai_tools.py BASE_URL MODEL
  MODEL  the fixture of tests/openai_tools.rs: a tiny model trained to answer a weather
         question with a get_weather call, and the tool's answer with "It is sunny in Paris."

Checks the tool call (non-streaming and streamed), the turn after the tool's answer, that
tool_choice "none" leaves the text alone, that "required" is refused, and that /v1/tokenize of
the same messages and tools counts the prompt the completion used. Exits non-zero on failure.
"""

import json
import sys

import urllib.request
import openai
from openai import OpenAI

BASE, MODEL = sys.argv[1:3]
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAIL: {what}")


def chat(messages, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=60, **kw
    )


# The call, whole.
r = chat(ASK)
choice = r.choices[0]
msg = choice.message
print(f"first turn: {msg.model_dump(exclude_none=True)} ({choice.finish_reason})")
check(choice.finish_reason == "tool_calls", f"finish_reason: {choice.finish_reason}")
check(msg.content is None, f"content: {msg.content!r}")
check(len(msg.tool_calls) == 1, f"tool_calls: {msg.tool_calls}")
call = msg.tool_calls[0]
check(call.id == "call_0" and call.type == "function", f"call: {call}")
check(call.function.name == "get_weather", f"name: {call.function.name}")
check(json.loads(call.function.arguments) == {"city": "Paris"}, f"arguments: {call.function.arguments}")

# The same call, streamed: deltas accumulate to it, before the finish chunk.
calls, content, finish = {}, "", None
for chunk in chat(ASK, stream=True):
    if not chunk.choices:
        continue
    c = chunk.choices[0]
    check(finish is None, "nothing after the finish chunk")
    content += c.delta.content or ""
    for d in c.delta.tool_calls or []:
        entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = d.id or entry["id"]
        entry["name"] += d.function.name or ""
        entry["arguments"] += d.function.arguments or ""
    finish = c.finish_reason or finish
check(finish == "tool_calls", f"streamed finish: {finish}")
check(content == "", f"streamed content: {content!r}")
check(
    calls == {0: {"id": "call_0", "name": "get_weather", "arguments": call.function.arguments}},
    f"streamed calls: {calls}",
)

# The next turn: the assistant's message as the client returns it, and the tool's answer.
turn = ASK + [
    msg.model_dump(exclude_none=True),
    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
]
r2 = chat(turn)
print(f"second turn: {r2.choices[0].message.model_dump(exclude_none=True)}")
check(r2.choices[0].finish_reason == "stop", f"second finish: {r2.choices[0].finish_reason}")
check(r2.choices[0].message.tool_calls is None, "no call in the answer")
check(r2.choices[0].message.content == "It is sunny in Paris.", f"answer: {r2.choices[0].message.content!r}")

# tool_choice "none": the text stays text.
r3 = chat(ASK, tool_choice="none")
check(r3.choices[0].message.tool_calls is None, "none: no tool_calls")
check("<tool_call>" in (r3.choices[0].message.content or ""), f"none: {r3.choices[0].message.content!r}")
check(r3.choices[0].finish_reason == "stop", f"none: {r3.choices[0].finish_reason}")

# Forcing a call is refused, naming the field.
try:
    chat(ASK, tool_choice="required")
    raise SystemExit("FAIL: tool_choice=required was accepted")
except openai.BadRequestError as e:
    check(e.body.get("param") == "tool_choice", f"required: {e.body}")

# /v1/tokenize renders the prompt the completion used.
req = urllib.request.Request(
    BASE + "/v1/tokenize",
    data=json.dumps({"model": MODEL, "messages": turn, "tools": TOOLS}).encode(),
    headers={"Content-Type": "application/json"},
)
t = json.load(urllib.request.urlopen(req, timeout=60))
check(t["count"] == r2.usage.prompt_tokens, f"tokenize {t['count']} != {r2.usage.prompt_tokens}")

print("ok: tool call checks passed")
