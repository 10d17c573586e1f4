"""The example reward in Python (a component built with componentize-py): 1.0 when the last
number in the completion equals metadata.answer, plus 0.1 when it contains "Answer:"."""

import wit_world


def is_digit(c: str) -> bool:
    return "0" <= c <= "9"


def is_ws(c: str) -> bool:
    return c in " \t\n\r"


def last_number(s: str):
    end = len(s) - 1
    while end >= 0 and not is_digit(s[end]):
        end -= 1
    if end < 0:
        return None
    b = end
    while b > 0 and (is_digit(s[b - 1]) or (s[b - 1] == "." and is_digit(s[b]))):
        b -= 1
    if s[b] == ".":
        b += 1
    if b > 0 and s[b - 1] == "-":
        b -= 1
    return s[b : end + 1]


def answer_field(j: str):
    k = j.find('"answer"')
    if k < 0:
        return None
    i = k + 8
    while i < len(j) and is_ws(j[i]):
        i += 1
    if i >= len(j) or j[i] != ":":
        return None
    i += 1
    while i < len(j) and is_ws(j[i]):
        i += 1
    if i < len(j) and j[i] == '"':
        e = j.find('"', i + 1)
        return None if e < 0 else j[i + 1 : e]
    b = i
    while i < len(j) and not is_ws(j[i]) and j[i] not in ",}]":
        i += 1
    return j[b:i] if i > b else None


class WitWorld(wit_world.WitWorld):
    def score(self, prompt: str, completion: str, metadata: str) -> wit_world.Scored:
        got = last_number(completion)
        want = answer_field(metadata)
        correct = got is not None and want is not None and got == want
        bonus = 0.1 if "Answer:" in completion else 0.0
        details = '{"correct":true}' if correct else '{"correct":false}'
        return wit_world.Scored((1.0 if correct else 0.0) + bonus, details)
