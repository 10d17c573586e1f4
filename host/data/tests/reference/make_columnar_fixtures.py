#!/usr/bin/env python3
"""Writes `host/data/tests/fixtures/columnar/`: the same documents and conversations as JSON
lines, as Parquet (pyarrow, snappy-compressed, as `datasets`' `to_parquet` writes it) and as
datasets saved by Hugging Face `datasets` (`save_to_disk`: Arrow IPC stream files), so the
tests can check that every container trains on the very same records.

Run from the repository root (needs datasets and pyarrow):

    .venv/bin/python host/data/tests/reference/make_columnar_fixtures.py

- `docs.jsonl`, `docs.parquet`, `docs_hf/` (a `Dataset`): 160 short documents in `text`, with
  an `id` column beside it;
- `chat.jsonl`, `chat.parquet`, `chat_hf/` (a `DatasetDict` with `train` and `test` splits,
  whose `train` split holds the conversations): 48 conversations in `messages`.
"""
import json
import pathlib
import random

import datasets

OUT = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "columnar"
WORDS = ("the king a queen speaks of storm upon sea crown night fair lord lady sword "
         "river castle light shadow gold winter spring field heart").split()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5)
    docs = []
    for i in range(160):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 10))).capitalize() + "."
                     for _ in range(rng.randrange(1, 4))]
        docs.append({"id": i, "text": " ".join(sentences)})
    chats = []
    for i in range(48):
        a, b = rng.randrange(2, 30), rng.randrange(2, 30)
        chats.append({"messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]})
    for name, rows in [("docs", docs), ("chat", chats)]:
        with open(OUT / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    text = datasets.Dataset.from_list(docs)
    text.to_parquet(str(OUT / "docs.parquet"))
    text.save_to_disk(str(OUT / "docs_hf"))
    chat = datasets.Dataset.from_list(chats)
    chat.to_parquet(str(OUT / "chat.parquet"))
    datasets.DatasetDict({"train": chat, "test": chat.select(range(4))}).save_to_disk(str(OUT / "chat_hf"))
    print(f"{OUT}: {len(docs)} documents, {len(chats)} conversations")


if __name__ == "__main__":
    main()
