//! Preference pairs for DPO-style tuning: records `{"prompt", "chosen", "rejected"}` (JSON
//! lines, Parquet or Arrow), as TRL reads them, in two forms:
//! - text: the three fields are strings; the prompt and each completion are tokenized apart
//!   and joined, EOS after the completion;
//! - conversational: `prompt` is a list of messages and `chosen` / `rejected` are lists of
//!   (assistant) messages or strings; each side is rendered with the chat template as one
//!   conversation.
//!
//! Each pair becomes two rows, chosen then rejected, whose trained tokens are the completion's
//! (where the two sides part, for conversations: what they share adds the same log-probability
//! to both and cancels in DPO's margin).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::chat::encode::{ChatEncoder, EncodedChat};
use crate::records::{read_records, record_file};
use crate::tokenizer::TextTokenizer;
use crate::{DataError, Result};

/// Whether the first record of `files` is a preference pair (`chosen` and `rejected` fields).
pub fn looks_like_pairs(files: &[PathBuf]) -> bool {
    let Some(file) = files.iter().find(|f| record_file(f).is_some()) else {
        return false;
    };
    let first = match record_file(file) {
        Some(crate::records::RecordFile::JsonLines) => {
            std::fs::read_to_string(file).ok().and_then(|text| {
                text.lines()
                    .find(|l| !l.trim().is_empty())
                    .and_then(|l| serde_json::from_str::<Value>(l).ok())
            })
        }
        _ => crate::records::first_row(file)
            .ok()
            .flatten()
            .map(|(_, v)| v),
    };
    first.is_some_and(|v| v.get("chosen").is_some() && v.get("rejected").is_some())
}

/// One pair as read.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    /// The prompt: a string, or a list of messages.
    pub prompt: Value,
    /// The preferred completion: a string, or a list of messages.
    pub chosen: Value,
    /// The other completion.
    pub rejected: Value,
    /// Where it came from (`file:line`), for errors.
    pub origin: String,
}

/// Every pair of `files`, in file and record order.
pub fn read_pairs(files: &[PathBuf]) -> Result<Vec<Pair>> {
    let mut out = Vec::new();
    for file in files {
        for (number, value) in read_records(file)? {
            let bad = |message: String| DataError::BadJsonLine {
                path: file.clone(),
                line: number,
                message,
            };
            let field = |k: &str| {
                value
                    .get(k)
                    .cloned()
                    .filter(|v| v.is_string() || v.is_array())
                    .ok_or_else(|| bad(format!("`{k}`: expected a string or a list of messages")))
            };
            out.push(Pair {
                prompt: field("prompt")?,
                chosen: field("chosen")?,
                rejected: field("rejected")?,
                origin: format!("{}:{number}", file.display()),
            });
        }
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: files.first().cloned().unwrap_or_default(),
            what: "no preference pairs".into(),
        });
    }
    Ok(out)
}

/// The text of every pair (prompts, completions and their messages' contents): what a
/// tokenizer trained for them learns from.
pub fn texts(pairs: &[Pair]) -> Vec<String> {
    fn strings(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(items) => items.iter().for_each(|i| strings(i, out)),
            Value::Object(m) => m.values().for_each(|i| strings(i, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for p in pairs {
        for v in [&p.prompt, &p.chosen, &p.rejected] {
            strings(v, &mut out);
        }
    }
    out
}

/// Every pair as two rows (chosen, then rejected), the completion's tokens trained: text pairs
/// with `tokenizer`, conversational ones with `encoder` (the chat template).
pub fn encode_pairs(
    pairs: &[Pair],
    tokenizer: &TextTokenizer,
    encoder: &ChatEncoder<'_>,
) -> Result<Vec<EncodedChat>> {
    let mut out = Vec::with_capacity(2 * pairs.len());
    for p in pairs {
        let (chosen, rejected) = match &p.prompt {
            Value::String(prompt) => (
                text_row(tokenizer, prompt, &p.chosen, p)?,
                text_row(tokenizer, prompt, &p.rejected, p)?,
            ),
            _ => {
                let mut c = chat_row(encoder, &p.prompt, &p.chosen, p)?;
                let mut r = chat_row(encoder, &p.prompt, &p.rejected, p)?;
                // Train where the two sides part.
                let shared = c
                    .tokens
                    .iter()
                    .zip(&r.tokens)
                    .take_while(|(a, b)| a == b)
                    .count();
                for row in [&mut c, &mut r] {
                    let end = shared.min(row.trained.len());
                    row.trained[..end].iter_mut().for_each(|t| *t = false);
                }
                (c, r)
            }
        };
        for row in [&chosen, &rejected] {
            if !row.trained.iter().any(|&t| t) {
                return Err(DataError::Chat {
                    origin: p.origin.clone(),
                    message: "a completion with no tokens of its own".into(),
                });
            }
        }
        out.push(chosen);
        out.push(rejected);
    }
    Ok(out)
}

/// A text pair's side: the prompt's tokens, then the completion's and EOS, trained.
fn text_row(
    tok: &TextTokenizer,
    prompt: &str,
    completion: &Value,
    p: &Pair,
) -> Result<EncodedChat> {
    let Value::String(completion) = completion else {
        return Err(DataError::Chat {
            origin: p.origin.clone(),
            message: "a text prompt takes text completions".into(),
        });
    };
    let prompt = tok.encode(prompt)?;
    let mut tokens = prompt.clone();
    tokens.extend(tok.encode(completion)?);
    tokens.push(tok.eos_id());
    let mut trained = vec![false; prompt.len()];
    trained.resize(tokens.len(), true);
    Ok(EncodedChat {
        tokens,
        trained,
        images: Vec::new(),
        image_spans: Vec::new(),
    })
}

/// A conversational pair's side: the prompt's messages and the completion as one conversation.
fn chat_row(
    encoder: &ChatEncoder<'_>,
    prompt: &Value,
    completion: &Value,
    p: &Pair,
) -> Result<EncodedChat> {
    let mut messages = prompt.as_array().cloned().unwrap_or_default();
    match completion {
        Value::String(text) => messages.push(json!({"role": "assistant", "content": text})),
        Value::Array(more) => messages.extend(more.iter().cloned()),
        _ => {}
    }
    let record = json!({ "messages": messages });
    let folder = Path::new(".");
    let conversation =
        crate::chat::conversation_of(&record, folder, &p.origin).map_err(|m| DataError::Chat {
            origin: p.origin.clone(),
            message: m,
        })?;
    encoder.encode(&conversation)
}

/// Pairs in a seeded, resumable order, two rows each (chosen, then rejected), one row per side
/// (never packed): a batch of `rows` rows holds `rows / 2` whole pairs.
#[derive(Clone, Debug)]
pub struct PairLoader {
    rows: std::sync::Arc<[EncodedChat]>,
    shape: crate::chat::loader::RowShape,
    order: crate::loader::EpochOrder,
}

impl PairLoader {
    /// A loader at epoch 0, cursor 0 over `rows` (the two rows of each pair in turn, from
    /// [`encode_pairs`]; at least one pair).
    pub fn new(
        rows: std::sync::Arc<[EncodedChat]>,
        shape: crate::chat::loader::RowShape,
        seed: u64,
        shuffle: bool,
    ) -> Result<Self> {
        if rows.len() < 2 || !rows.len().is_multiple_of(2) {
            return Err(DataError::InvalidArgument {
                name: "preference pairs",
                message: format!("{} rows are not whole pairs", rows.len()),
            });
        }
        let order = crate::loader::EpochOrder::new(rows.len() / 2, seed, shuffle, "pairs")?;
        Ok(PairLoader { rows, shape, order })
    }

    /// The next `rows / 2` pairs (`rows` even).
    pub fn next_batch(&mut self, rows: usize) -> Result<crate::Batch> {
        let mut b = crate::Batch::with_capacity(rows, self.shape.seq_len);
        for _ in 0..rows / 2 {
            let pair = self.order.next();
            for side in 0..2 {
                let row = 2 * pair + side;
                self.shape.fill_row(&mut b, &self.rows, |_| Some(row))?;
            }
        }
        Ok(b)
    }

    /// Where the loader stands now.
    pub fn state(&self) -> crate::LoaderState {
        self.order.state()
    }

    /// Moves the loader to `s` (taken from a loader over the same pairs and seed).
    pub fn restore(&mut self, s: &crate::LoaderState) -> Result<()> {
        self.order.restore(s)
    }
}
