#!/usr/bin/env python3
"""Writes the data of the retrieval RL demo (configs/rl_retrieval_sft.toml, configs/rl_retrieval.toml).

The document set is reward-wasm/envs/retrieval/corpus.tsv (committed; the environment embeds it):
people and the town each lives in ('Tavor lives in "Bemilo".'), towns and their codes
('Bemilo has code "4821".'). A question, 'Code of the town where "Tavor" lives?', takes two searches:
the person's town, then the town's code. (Names and codes are quoted, or start a line, wherever
they are read or written, so the byte-level BPE splits a value the same way where the policy reads
it and where it copies it: " 8154" and "8154" are different tokens.) The environment's `search(query)` returns the
documents whose titles share the most character trigrams with the query (an exact title first);
`Index.search` below mirrors it, so the transcripts hold what the environment would answer.

The warm start learns in another world: a generated one with as many people as conversations
(names disjoint from the corpus), so it cannot learn who lives where by heart, only how to read
search results. RL and its evaluation ask about the corpus's people, whom it never saw:
  search.jsonl  user Q | search(person) | tool: 4 docs | search(town) | tool: 4 docs | code
  direct.jsonl  user Q | code (answered from memory: the tool-less baseline)
  mixed.jsonl   the search transcript for SEARCH_SHARE of the questions, the direct answer for
                the rest: the RL demo's warm start, which searches too rarely
  prompts.jsonl RL's prompts {"prompt", "metadata": {"question", "answer"}}: 900 of the
                corpus's people
  eval.jsonl    eval_accuracy's prompts (rl.eval_prompts_path): the other 100

Usage: scripts/retrieval-data.py [OUT_DIR] [N] [SEED] [SEARCH_SHARE]   (default data/rl_retrieval 20000 1 0.8)
       scripts/retrieval-data.py --corpus    regenerates the committed corpus (seed 7)
"""
import heapq
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "reward-wasm", "envs", "retrieval", "corpus.tsv")
RESULTS = 4  # documents per search, as the environment returns them

# The environment's tool, as its init returns it.
TOOLS = [{
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the documents by title; returns the closest ones, one per line.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "a name"}},
            "required": ["query"],
        },
    },
}]


def make_world(people, towns, seed, taken=()):
    """Documents of invented people (two syllables and a final consonant) and towns (three
    syllables), unique and not in `taken`: `(title, text)` pairs, towns first."""
    rng = random.Random(seed)
    onset, vowel, coda = "bdfgklmnprstvz", "aeiou", "lmnrst"

    def name(syllables, final):
        s = "".join(rng.choice(onset) + rng.choice(vowel) for _ in range(syllables))
        return (s + (rng.choice(coda) if final else "")).capitalize()

    def unique(n, make):
        seen = set()
        while len(seen) < n:
            candidate = make()
            if candidate not in taken:
                seen.add(candidate)
        out = sorted(seen)
        rng.shuffle(out)
        return out

    town_names = unique(towns, lambda: name(3, False))
    codes = rng.sample(range(1000, 10000), towns)
    docs = [(town, f'{town} has code "{code}".') for town, code in zip(town_names, codes)]
    for person in unique(people, lambda: name(2, True)):
        docs.append((person, f'{person} lives in "{rng.choice(town_names)}".'))
    return docs


def write_corpus():
    docs = make_world(1000, 200, seed=7)
    with open(CORPUS, "w") as f:
        f.writelines(f"{title}\t{text}\n" for title, text in docs)
    print(f"wrote {len(docs)} documents to {CORPUS}")


def read_corpus():
    with open(CORPUS) as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f]


def trigrams(text):
    t = f" {text.strip().lower()} "
    return {t[i:i + 3] for i in range(len(t) - 2)}


class Index:
    """The environment's search over `docs`: Jaccard similarity of the character trigrams of
    the query and each title, best first, ties to the earlier document; titles sharing no
    trigram are left out (an inverted index finds the candidates)."""

    def __init__(self, docs):
        self.docs = docs
        self.grams = [trigrams(title) for title, _ in docs]
        self.postings = {}
        for i, grams in enumerate(self.grams):
            for g in grams:
                self.postings.setdefault(g, []).append(i)

    def search(self, query):
        q = trigrams(query)
        shared = {}
        for g in q:
            for i in self.postings.get(g, ()):
                shared[i] = shared.get(i, 0) + 1
        # Jaccard indices of short titles are fractions with small denominators: as floats,
        # equal ones are equal and different ones differ, so they order exactly.
        best = heapq.nsmallest(RESULTS, ((-n / (len(q) + len(self.grams[i]) - n), i) for i, n in shared.items()))
        return "\n".join(self.docs[i][1] for _, i in best) or "no results"


def call(query):
    args = json.dumps({"name": "search", "arguments": {"query": query}})
    return f"<tool_call>\n{args}\n</tool_call>"


def main():
    if sys.argv[1:] == ["--corpus"]:
        write_corpus()
        return
    out = sys.argv[1] if len(sys.argv) > 1 else "data/rl_retrieval"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    search_share = float(sys.argv[4]) if len(sys.argv) > 4 else 0.8
    os.makedirs(out, exist_ok=True)
    deployed = read_corpus()
    # The warm start's world: as many people as conversations, so a model cannot learn who
    # lives where by heart, only how to read the search results.
    world = make_world(n, n // 10, seed=rng.randrange(1 << 30), taken={t for t, _ in deployed})
    index = Index(world)

    def facts(docs):
        value = {title: text.split('"')[1] for title, text in docs}
        people = [title for title, text in docs if " lives in " in text]
        return value, people

    def question(person, value):
        return f'Code of the town where "{person}" lives?', value[value[person]]

    value, people = facts(world)
    files = {name: open(os.path.join(out, f"{name}.jsonl"), "w") for name in ("search", "direct", "mixed")}
    for _ in range(n):
        person = rng.choice(people)
        town = value[person]
        q, answer = question(person, value)
        user = {"role": "user", "content": q}
        searched = json.dumps({"tools": TOOLS, "messages": [
            user,
            {"role": "assistant", "content": call(person)},
            {"role": "tool", "content": index.search(person)},
            {"role": "assistant", "content": call(town)},
            {"role": "tool", "content": index.search(town)},
            {"role": "assistant", "content": answer},
        ]}) + "\n"
        direct = json.dumps({"tools": TOOLS, "messages": [user, {"role": "assistant", "content": answer}]}) + "\n"
        files["search"].write(searched)
        files["direct"].write(direct)
        files["mixed"].write(searched if rng.random() < search_share else direct)
    for f in files.values():
        f.close()
    value, people = facts(deployed)
    rl, held = people[:900], people[900:]
    for name, group in (("prompts", rl), ("eval", held)):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for person in group:
                q, answer = question(person, value)
                f.write(json.dumps({"prompt": q, "metadata": {"question": q, "answer": answer}}) + "\n")
    print(f"wrote {n} conversations each to {out}/search.jsonl, direct.jsonl and mixed.jsonl; "
          f"{len(rl)} RL prompts to prompts.jsonl, {len(held)} held-out ones to eval.jsonl")


main()
