#!/usr/bin/env python3
"""Writes the supervised warm-start data of the tool-use RL demo (configs/rl_tools_sft.toml):
chat JSON lines where a 3-digit number times a 2-digit one (`347*86=`) is answered by calling
the calculator environment's tool and copying its result, and the same questions answered
directly, for the tool-less baseline. Both offer the calculator tool exactly as the environment
(reward-wasm/envs/calculator) does, so the warm start sees the prompts RL will show it.

  tools.jsonl   user 347*86= | assistant <tool_call>{calculator 347*86}</tool_call> |
                tool 29842 | assistant 29842
  direct.jsonl  user 347*86= | assistant 29842
  mixed.jsonl   the tool transcript for a share of the questions (TOOL_SHARE, default 0.3), the
                direct answer for the rest: the warm start of the RL demo, which learns both
                behaviours and uses the tool on too few questions; RL has to learn when to use it.

Usage: scripts/tool-data.py [OUT_DIR] [N] [SEED] [TOOL_SHARE]   (default data/rl_tools 20000 1 0.3)
"""
import json
import os
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "data/rl_tools"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
tool_share = float(sys.argv[4]) if len(sys.argv) > 4 else 0.3
os.makedirs(out, exist_ok=True)

# The calculator environment's tool, as its init returns it.
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an integer arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "an integer expression, e.g. (12+3)*4"}},
            "required": ["expression"],
        },
    },
}]


def call(expression):
    args = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{args}\n</tool_call>"


files = {name: open(os.path.join(out, f"{name}.jsonl"), "w") for name in ("tools", "direct", "mixed")}
for _ in range(n):
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    question, answer = f"{a}*{b}=", str(a * b)
    user = {"role": "user", "content": question}
    with_tool = json.dumps({"tools": TOOLS, "messages": [
        user,
        {"role": "assistant", "content": call(f"{a}*{b}")},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]}) + "\n"
    direct = json.dumps({"tools": TOOLS, "messages": [user, {"role": "assistant", "content": answer}]}) + "\n"
    files["tools"].write(with_tool)
    files["direct"].write(direct)
    files["mixed"].write(with_tool if rng.random() < tool_share else direct)
for f in files.values():
    f.close()
print(f"wrote {n} conversations each to {out}/tools.jsonl, direct.jsonl and mixed.jsonl")
