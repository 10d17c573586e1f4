#!/usr/bin/env python3
"""Writes `host/runtime/tests/fixtures/tiny_qwen3_chat/`: a tiny random Qwen3 checkpoint as a
user would bring it to fine-tune, with a tokenizer and chat template of its own, and chat data.

Run from the repository root (needs torch, tokenizers and transformers):

    .venv/bin/python host/runtime/tests/reference/make_chat_fixture.py

It writes, as `save_pretrained` and `tokenizers` write them:
- `config.json`, `model.safetensors`, `generation_config.json` (a Qwen3ForCausalLM);
- `tokenizer.json` (a byte-level BPE trained on the conversations) and `tokenizer_config.json`
  with a ChatML chat template and `<|im_end|>` as the end-of-turn token;
- `chat.jsonl`: conversations (`messages` with roles; some with a system turn, some with two
  exchanges, some ending with a user turn that no reply follows);
- `expected.safetensors`: `tokens` (i64 [T], the first conversation as transformers'
  `apply_chat_template` renders and tokenizes it) and `logits` (f32 [T, V]).
"""
import json
import os
import pathlib
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "tiny_qwen3_chat"

TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal"]


def conversations(n, rng):
    out = []
    for i in range(n):
        a, b = rng.randrange(10, 60), rng.randrange(10, 60)
        who = rng.choice(NAMES)
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": f"You are {who}'s calculator."})
        msgs += [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
        if i % 4 == 1:
            c = rng.randrange(2, 9)
            msgs += [
                {"role": "user", "content": f"And times {c}?"},
                {"role": "assistant", "content": f"{a + b} times {c} is {(a + b) * c}."},
            ]
        if i % 5 == 2:
            msgs.append({"role": "user", "content": f"Thanks, {who}!"})
        out.append({"messages": msgs})
    return out


def render(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    convs = conversations(64, rng)
    with open(OUT / "chat.jsonl", "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([render(c["messages"]) for c in convs], trainer)
    tok.save(str(OUT / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    with open(OUT / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
                   "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "model_max_length": 512}, f, indent=2)

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=eos,
                      pad_token_id=tok.token_to_id("<|endoftext|>"))
    model = Qwen3ForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, max_new_tokens=32, do_sample=False)
    model.save_pretrained(OUT)

    hf_tok = AutoTokenizer.from_pretrained(OUT)
    ids = hf_tok.apply_chat_template(convs[0]["messages"], tokenize=True, return_dict=False)
    ids = torch.tensor(ids, dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    save_file({"tokens": ids.contiguous(), "logits": logits.contiguous()}, OUT / "expected.safetensors")
    print(f"{OUT}: vocab {tok.get_vocab_size()}, {len(convs)} conversations, first renders to {len(ids)} tokens")


if __name__ == "__main__":
    main()
