"""Drives `anneal serve --model ...` with the official `openai` Python client.

Usage: openai_client.py BASE_URL STEP_MODEL CHAT_MODEL
  STEP_MODEL  a checkpoint step directory's model (no chat template: the fallback format)
  CHAT_MODEL  a Hugging Face export of it whose tokenizer_config.json has the Jinja template
              below

Covers /v1/models, completions and chat completions (streaming and not), stop strings,
logprobs, seeds, n, errors, and 16 concurrent requests that must equal the same requests made
one at a time (continuous batching does not change results). Exits non-zero on any failure.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import openai
from openai import OpenAI

BASE, STEP_MODEL, CHAT_MODEL = sys.argv[1:4]
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAIL: {what}")


def greedy(model, prompt, max_tokens=8, **kw):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


# /v1/models lists both, under their documented names.
ids = sorted(m.id for m in client.models.list())
check(ids == sorted([STEP_MODEL, CHAT_MODEL]), f"models: {ids}")
check(client.models.retrieve(STEP_MODEL).id == STEP_MODEL, "retrieve a model")

# Completions, non-streaming.
c = greedy(STEP_MODEL, "the king speaks of")
check(c.object == "text_completion" and c.model == STEP_MODEL, f"completion shape: {c}")
choice = c.choices[0]
check(choice.index == 0 and choice.finish_reason in ("stop", "length"), f"choice: {choice}")
check(c.usage.prompt_tokens > 0 and 0 < c.usage.completion_tokens <= 8, f"usage: {c.usage}")
check(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens, "total")
text = choice.text
check(len(text) > 0, "some text")
print(f"completion: {text!r} ({choice.finish_reason})")

# Streaming gives the same text, in pieces, and ends with the same finish reason.
chunks = list(
    client.completions.create(
        model=STEP_MODEL, prompt="the king speaks of", max_tokens=8, temperature=0, stream=True
    )
)
check(all(ch.object == "text_completion" for ch in chunks), "chunk objects")
streamed = "".join(ch.choices[0].text for ch in chunks)
check(streamed == text, f"stream {streamed!r} != {text!r}")
check(chunks[-1].choices[0].finish_reason == choice.finish_reason, "stream finish reason")

# A stop string cuts the text before it.
stop = text.strip()[:3]
cut = greedy(STEP_MODEL, "the king speaks of", stop=[stop, "zzzz"]).choices[0]
check(cut.text == text[: text.index(stop)] and cut.finish_reason == "stop", f"stop: {cut}")

# Logprobs: one entry per token, with the requested number of alternatives.
lp = greedy(STEP_MODEL, "the king speaks of", logprobs=2)
logprobs = lp.choices[0].logprobs
check(len(logprobs.token_logprobs) == len(logprobs.tokens) > 0, f"logprobs: {logprobs}")
check(all(len(t) == 2 for t in logprobs.top_logprobs), "two alternatives per token")
check(all(x <= 0 for x in logprobs.token_logprobs), "logprobs are <= 0")
check("".join(logprobs.tokens) == lp.choices[0].text, "logprob tokens spell the text")

# Sampling with a seed is reproducible; n gives n choices; a list of prompts one choice each.
def sampled(**kw):
    return client.completions.create(
        model=STEP_MODEL, prompt="a fool", max_tokens=6, temperature=1.0, seed=5, **kw
    )


check(sampled().choices[0].text == sampled().choices[0].text, "seeded sampling repeats")
two = sampled(n=2)
check([ch.index for ch in two.choices] == [0, 1], "n=2")
check(two.choices[0].text == sampled().choices[0].text, "choice 0 uses the seed itself")
many = greedy(STEP_MODEL, ["the king", "my lord", "a fool"], max_tokens=3)
check(len(many.choices) == 3, "one choice per prompt")
check(many.choices[1].text == greedy(STEP_MODEL, "my lord", max_tokens=3).choices[0].text,
      "prompt lists decode like single prompts")
# Token-id prompts.
check(greedy(STEP_MODEL, [5, 6, 7], max_tokens=2).usage.prompt_tokens == 3, "token prompt")

# Chat with the model's Jinja template: the prompt is the rendered template, so the reply
# equals a completion of that text.
messages = [{"role": "user", "content": "  the queen  "}]
# What Python jinja2 renders (trim_blocks and lstrip_blocks, as transformers sets them).
rendered = "<user> the queen\n\n<assistant>"
r = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=8, temperature=0)
check(r.object == "chat.completion" and r.choices[0].message.role == "assistant", f"chat: {r}")
reply = r.choices[0].message.content
same = greedy(CHAT_MODEL, rendered)
check(reply == same.choices[0].text, f"template: {reply!r} vs {same.choices[0].text!r}")
check(r.usage.prompt_tokens == same.usage.prompt_tokens, "template prompt length")
print(f"chat (template): {reply!r}")

# Streaming chat: a role chunk, content deltas, a finish chunk, then the usage chunk.
stream = client.chat.completions.create(
    model=CHAT_MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
chunks = list(stream)
check(chunks[0].choices[0].delta.role == "assistant", "role first")
check(all(ch.object == "chat.completion.chunk" for ch in chunks), "chunk objects")
content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
check(content == reply, f"streamed chat {content!r} != {reply!r}")
check(chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason, "chat finish")
check(chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens,
      "usage chunk")

# Chat on the step model uses the fallback format.
fb = client.chat.completions.create(
    model=STEP_MODEL, messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
    max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
)
check(fb.choices[0].message.content == greedy(STEP_MODEL, "system: x\nuser: y\nassistant:", max_tokens=4).choices[0].text,
      "fallback chat format")
check(len(fb.choices[0].logprobs.content) > 0, "chat logprobs")

# Errors in OpenAI's shape.
try:
    greedy("no-such-model", "x")
    check(False, "unknown model accepted")
except openai.NotFoundError as e:
    check(e.status_code == 404 and e.body["code"] == "model_not_found", f"404: {e.body}")
for bad, param in [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p")]:
    try:
        client.completions.create(model=STEP_MODEL, prompt="x", max_tokens=2, **bad)
        check(False, f"{bad} accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body["param"] == param, f"400 {param}: {e.body}")
try:
    greedy(STEP_MODEL, "the king speaks of the sea. " * 40)
    check(False, "an over-long prompt accepted")
except openai.BadRequestError as e:
    check(e.body["code"] == "context_length_exceeded", f"context: {e.body}")
# max_tokens beyond the context is capped, not refused.
capped = greedy(STEP_MODEL, "the king", max_tokens=100000)
check(capped.usage.total_tokens <= client.models.retrieve(STEP_MODEL).model_extra["max_model_len"],
      "max_tokens capped at the context")

# 16 concurrent requests give exactly what the same requests give one at a time.
subjects = ["the king", "a fool", "my lord", "the queen"]
verbs = ["speaks of", "waits for", "dreams of", "forgets"]
prompts = [f"{s} {v}" for s in subjects for v in verbs]
one_by_one = [greedy(STEP_MODEL, p, max_tokens=12).choices[0].text for p in prompts]
with ThreadPoolExecutor(max_workers=16) as pool:
    together = list(pool.map(lambda p: greedy(STEP_MODEL, p, max_tokens=12).choices[0].text, prompts))
check(together == one_by_one, f"concurrent results differ:\n{together}\n{one_by_one}")
with ThreadPoolExecutor(max_workers=16) as pool:
    streams = list(pool.map(
        lambda p: "".join(ch.choices[0].text for ch in client.completions.create(
            model=STEP_MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)),
        prompts))
check(streams == one_by_one, "concurrent streams differ")
print("ok: openai client checks passed (16 concurrent requests equal sequential ones)")
