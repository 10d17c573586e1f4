"""The calculator environment in Python, a component of the WIT world
anneal:environment/environment built with componentize-py (see ENVIRONMENTS.md and
envs/calculator): the question as the user message, a `calculator` tool evaluating integer
expressions exactly in the range of i128 (overflow and division by zero are error texts),
reward 1 when the last integer of the final answer equals the task's answer.

State lives in module globals: the instance serves one episode."""

import json

import wit_world
from componentize_py_types import Err

I128_MIN, I128_MAX = -(2**127), 2**127 - 1

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an integer arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "an integer expression, e.g. (12+3)*4",
                }
            },
            "required": ["expression"],
        },
    },
}

answer = None


class ExprError(Exception):
    pass


class Expr:
    """Sums of products of unary terms over `s`, as the Rust calculator parses them."""

    def __init__(self, s: str):
        self.s, self.i, self.depth = s, 0, 0

    def peek(self):
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else None

    def evaluate(self) -> int:
        v = self.sum()
        c = self.peek()
        if c is not None:
            raise ExprError(f"unexpected `{c}` at {self.i}")
        return v

    def sum(self) -> int:
        v = self.product()
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            r = self.product()
            v = checked(v + r if op == "+" else v - r)
        return v

    def product(self) -> int:
        v = self.unary()
        while self.peek() in ("*", "/", "%"):
            op = self.s[self.i]
            self.i += 1
            r = self.unary()
            if op == "*":
                v = checked(v * r)
                continue
            if r == 0:
                raise ExprError("division by zero")
            q = abs(v) // abs(r) * (1 if (v < 0) == (r < 0) else -1)  # toward zero
            v = checked(q if op == "/" else v - q * r)
        return v

    def unary(self) -> int:
        self.depth += 1
        if self.depth > 200:
            raise ExprError("expression nested too deeply")
        c = self.peek()
        if c == "-":
            self.i += 1
            v = checked(-self.unary())
        elif c == "+":
            self.i += 1
            v = self.unary()
        elif c == "(":
            self.i += 1
            v = self.sum()
            if self.peek() != ")":
                raise ExprError(f"expected `)` at {self.i}")
            self.i += 1
        elif c is not None and "0" <= c <= "9":
            start = self.i
            while self.i < len(self.s) and "0" <= self.s[self.i] <= "9":
                self.i += 1
            v = checked(int(self.s[start : self.i]))
        elif c is not None:
            raise ExprError(f"unexpected `{c}` at {self.i}")
        else:
            raise ExprError("unexpected end of expression")
        self.depth -= 1
        return v


def checked(v: int) -> int:
    if not I128_MIN <= v <= I128_MAX:
        raise ExprError("overflow")
    return v


def call(c: dict) -> str:
    if c.get("name") != "calculator":
        return f"error: unknown tool `{c.get('name')}` (the tool is `calculator`)"
    args = c.get("arguments")
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return 'error: calculator takes {"expression": string}'
    try:
        return str(Expr(expression).evaluate())
    except ExprError as e:
        return f"error: {e}"


def last_integer(text: str):
    end = len(text)
    while end > 0 and not ("0" <= text[end - 1] <= "9"):
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0 and "0" <= text[start - 1] <= "9":
        start -= 1
    if start > 0 and text[start - 1] == "-":
        start -= 1
    return text[start:end]


def matches(n, want: str) -> bool:
    if n is None:
        return False
    try:
        return int(n) == int(want)
    except ValueError:
        return n == want


class WitWorld(wit_world.WitWorld):
    def init(self, task: str) -> wit_world.Started:
        global answer
        t = json.loads(task)
        question = t.get("question")
        if not isinstance(question, str):
            raise Err("the task has no string `question`")
        if isinstance(t.get("answer"), (str, int)) and not isinstance(t.get("answer"), bool):
            answer = str(t["answer"]).strip()
        else:
            raise Err("the task has no `answer`")
        return wit_world.Started(wit_world.Prompt_Text(question), json.dumps([TOOL]))

    def step(self, turn: str) -> wit_world.Stepped:
        t = json.loads(turn)
        calls = t.get("tool_calls") or []
        if not calls:
            if t.get("error"):
                return wit_world.Stepped(f"error: {t['error']}", None, 0.0, False, None)
            correct = matches(last_integer(t.get("content") or ""), answer)
            details = json.dumps({"correct": correct})
            return wit_world.Stepped("", None, 1.0 if correct else 0.0, True, details)
        results = [call(c) for c in calls]
        if len(results) == 1:
            observation = results[0]
        else:
            observation = "\n".join(f"{c.get('id')}: {r}" for c, r in zip(calls, results))
        return wit_world.Stepped(observation, None, 0.0, False, None)

    def finish(self) -> None:
        global answer
        answer = None
