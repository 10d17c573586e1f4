//! The retrieval environment (reward-wasm/ENVIRONMENTS.md): search over a document set, in the
//! manner of Search-R1. The task `{"question": "Code of the town where \"Tavor\" lives?",
//! "answer": "4821"}` opens as one user message; the policy may call `search(query)`, which
//! returns the documents of `corpus.tsv` (embedded at build time) whose titles are closest to
//! the query, one per line; a turn without tool calls is the final answer: reward 1 when its
//! last integer equals the answer, and the episode is done.
//!
//! The questions of the demo corpus take two searches (the person's town, then the town's
//! code), so an episode holds four documents per search on top of the policy's turns: it grows
//! well past one turn's budget. `scripts/retrieval-data.py` writes the corpus and mirrors
//! [`search`] for its transcripts.

use anneal_reward_sdk::env::{
    final_answer, question_and_answer, tool_results, Environment, Json, Start, Step, ToolCall, Turn,
};
use anneal_reward_sdk::export_environment;
use std::collections::BTreeSet;

/// `title \t text` lines.
const CORPUS: &str = include_str!("../corpus.tsv");

/// Documents a search returns at most.
const RESULTS: usize = 4;

const PARAMETERS: &str = r#"{"type":"object","properties":{"query":{"type":"string","description":"a name"}},"required":["query"]}"#;

struct Retrieval {
    answer: String,
}

impl Environment for Retrieval {
    fn init(task: &Json) -> Result<(Self, Start), String> {
        let (question, answer) = question_and_answer(task)?;
        let start = Start::text(question).with_tool(
            "search",
            "Searches the documents by title; returns the closest ones, one per line.",
            PARAMETERS,
        );
        Ok((Retrieval { answer }, start))
    }

    fn step(&mut self, turn: &Turn) -> Result<Step, String> {
        if let Some(end) = final_answer(turn, &self.answer) {
            return Ok(end);
        }
        let results: Vec<String> = turn.tool_calls.iter().map(call).collect();
        Ok(Step::observation(tool_results(turn, &results)))
    }
}

/// The result of one tool call, or an error text.
fn call(c: &ToolCall) -> String {
    if c.name != "search" {
        return format!("error: unknown tool `{}` (the tool is `search`)", c.name);
    }
    match c.arguments.get("query").and_then(Json::as_text) {
        Some(query) => search(query),
        None => "error: search takes {\"query\": string}".into(),
    }
}

/// The documents whose titles are closest to `query` (Jaccard similarity of character
/// trigrams, best first, ties to the earlier document; titles sharing no trigram are left
/// out), one per line, or `no results`.
pub fn search(query: &str) -> String {
    let q = trigrams(query);
    let mut scored: Vec<(usize, usize, usize, &str)> = CORPUS
        .lines()
        .enumerate()
        .filter_map(|(i, line)| {
            let (title, text) = line.split_once('\t')?;
            let t = trigrams(title);
            let shared = q.intersection(&t).count();
            (shared > 0).then(|| (shared, q.union(&t).count(), i, text))
        })
        .collect();
    // shared_a / union_a > shared_b / union_b, compared exactly.
    scored.sort_by(|a, b| (b.0 * a.1).cmp(&(a.0 * b.1)).then(a.2.cmp(&b.2)));
    let lines: Vec<&str> = scored.iter().take(RESULTS).map(|s| s.3).collect();
    match lines.is_empty() {
        true => "no results".into(),
        false => lines.join("\n"),
    }
}

/// The character trigrams of ` text ` (trimmed, lowercased).
fn trigrams(text: &str) -> BTreeSet<String> {
    let padded: Vec<char> = format!(" {} ", text.trim().to_lowercase())
        .chars()
        .collect();
    padded.windows(3).map(|w| w.iter().collect()).collect()
}

export_environment!(Retrieval);
