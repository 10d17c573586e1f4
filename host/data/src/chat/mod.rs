//! Chat data for supervised fine-tuning: JSON lines of conversations, rendered with the
//! model's chat template ([`template`]), tokenized with the loss on the assistant's replies
//! only, and images placed where the template puts their placeholder.
//!
//! One line is one conversation:
//! `{"messages": [{"role": "user", "content": [{"type": "image", "path": "cat.png"},
//! {"type": "text", "text": "What is this?"}]}, {"role": "assistant", "content": "A cat."}]}`.
//! A message's content is a string or a list of parts (`text`, or `image` with a `path`, or
//! an `image` string, relative to the JSONL file's folder). [`encode`] turns a conversation into
//! tokens, a per-token loss flag and its images; [`loader`] serves them as batches.

pub mod encode;
pub mod loader;
mod pyjson;
pub mod template;
pub mod tools;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{DataError, Result};
use template::{Content, Message, Part, Tools};

/// One conversation of a chat JSONL file.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    /// Its messages as the template sees them.
    pub messages: Vec<Message>,
    /// Its images in the order of their parts, as paths resolved against the file's folder.
    pub images: Vec<PathBuf>,
    /// The tools its first turn offers (the line's `tools`, OpenAI's function format), which
    /// the template renders as a request with tools renders them.
    pub tools: Option<Tools>,
    /// Where it came from (`file:line`), for errors.
    pub origin: String,
}

/// Whether the first record of the first record file in `files` (a non-empty line of a
/// `.jsonl` file, the first row of a Parquet or Arrow file) holds a `messages` list: how
/// `data.format = "auto"` tells chat data from text.
pub fn looks_like_chat(files: &[PathBuf]) -> bool {
    use crate::records::{first_row, record_file, RecordFile};
    let Some(file) = files.iter().find(|f| record_file(f).is_some()) else {
        return false;
    };
    let first = match record_file(file) {
        Some(RecordFile::JsonLines) => std::fs::read_to_string(file).ok().and_then(|text| {
            text.lines()
                .find(|l| !l.trim().is_empty())
                .and_then(|l| serde_json::from_str::<Value>(l).ok())
        }),
        _ => first_row(file).ok().flatten().map(|(_, v)| v),
    };
    first.is_some_and(|v| v.get("messages").is_some_and(Value::is_array))
}

/// Every conversation in `files` (JSON lines, Parquet or Arrow records), in file and record
/// order; blank lines are skipped. A record that is not a conversation is an error naming the
/// file, the line (or row) and the key.
pub fn read_conversations(files: &[PathBuf]) -> Result<Vec<Conversation>> {
    let mut out = Vec::new();
    for file in files {
        if crate::records::record_file(file).is_none() {
            return Err(DataError::Empty {
                path: file.clone(),
                what: "chat data is read from .jsonl, .parquet or .arrow files".into(),
            });
        }
        let folder = file.parent().unwrap_or(Path::new("."));
        for (number, value) in crate::records::read_records(file)? {
            let bad = |message: String| DataError::BadJsonLine {
                path: file.clone(),
                line: number,
                message,
            };
            let origin = format!("{}:{number}", file.display());
            out.push(conversation_of(&value, folder, &origin).map_err(bad)?);
        }
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: files.first().cloned().unwrap_or_default(),
            what: "no conversations".into(),
        });
    }
    Ok(out)
}

/// The conversation of one record (`messages`, optional `tools`), its images resolved against
/// `folder`; `origin` names it in later errors.
pub fn conversation_of(
    value: &Value,
    folder: &Path,
    origin: &str,
) -> std::result::Result<Conversation, String> {
    let (messages, images) = parse_messages(value, folder)?;
    Ok(Conversation {
        messages,
        images,
        tools: parse_tools(value)?,
        origin: origin.to_owned(),
    })
}

/// A line's `tools` list, if it has one.
fn parse_tools(value: &Value) -> std::result::Result<Option<Tools>, String> {
    match value.get("tools") {
        None | Some(Value::Null) => Ok(None),
        Some(list @ Value::Array(_)) => {
            let text = serde_json::to_string(list).map_err(|e| format!("tools: {e}"))?;
            Tools::from_json(&text).map(Some)
        }
        Some(_) => Err("tools: expected a list of tool specs".into()),
    }
}

/// The messages of one line and its images' paths.
fn parse_messages(
    value: &Value,
    folder: &Path,
) -> std::result::Result<(Vec<Message>, Vec<PathBuf>), String> {
    let list = value
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("expected an object with a `messages` list")?;
    let mut messages = Vec::with_capacity(list.len());
    let mut images = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = |key: &str| format!("messages[{i}].{key}");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{}: expected a string", at("role")))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => Content::Text(s.clone()),
            Some(Value::Array(parts)) => {
                let mut out = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    let here = format!("{}[{j}]", at("content"));
                    match p.get("type").and_then(Value::as_str) {
                        Some("text") => out.push(Part::Text {
                            text: p
                                .get("text")
                                .and_then(Value::as_str)
                                .ok_or_else(|| format!("{here}.text: expected a string"))?
                                .to_owned(),
                        }),
                        Some("image") => {
                            let path = p
                                .get("path")
                                .or_else(|| p.get("image"))
                                .and_then(Value::as_str)
                                .ok_or_else(|| {
                                    format!("{here}: an image part needs a `path` string")
                                })?;
                            if role == "assistant" {
                                return Err(format!(
                                    "{here}: an assistant message cannot hold an image (the \
                                     loss is on the assistant's text)"
                                ));
                            }
                            images.push(folder.join(path));
                            out.push(Part::Image);
                        }
                        other => {
                            return Err(format!(
                                "{here}.type: expected \"text\" or \"image\", got {}",
                                other.map_or("nothing".into(), |t| format!("{t:?}"))
                            ))
                        }
                    }
                }
                Content::Parts(out)
            }
            _ => {
                return Err(format!(
                    "{}: expected a string or a list of parts",
                    at("content")
                ))
            }
        };
        messages.push(Message::new(role, content));
    }
    if !messages.iter().any(|m| m.role == "assistant") {
        return Err("a conversation needs at least one assistant message to learn from".into());
    }
    Ok((messages, images))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_conversations_with_their_images_beside_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("chat.jsonl");
        std::fs::write(
            &f,
            concat!(
                r#"{"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "Colour?"}]}, {"role": "assistant", "content": "red"}]}"#,
                "\n\n",
                r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#,
                "\n"
            ),
        )
        .unwrap();
        assert!(looks_like_chat(std::slice::from_ref(&f)));
        let c = read_conversations(&[f]).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].images, vec![dir.path().join("a.png")]);
        assert_eq!(c[0].messages[0].content.text(), "Colour?");
        assert!(c[1].images.is_empty());
        assert!(c[1].origin.ends_with(":3"), "{}", c[1].origin);
    }

    #[test]
    fn bad_lines_name_the_line_and_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("chat.jsonl");
        let cases = [
            (r#"{"text": "x"}"#, "`messages` list"),
            (r#"{"messages": [{"content": "x"}]}"#, "messages[0].role"),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image"}]}]}"#,
                "messages[0].content[0]: an image part needs a `path`",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}"#,
                "messages[0].content[0].type",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "only a question"}]}"#,
                "at least one assistant message",
            ),
        ];
        for (line, want) in cases {
            std::fs::write(&f, format!("{line}\n")).unwrap();
            let err = read_conversations(std::slice::from_ref(&f))
                .unwrap_err()
                .to_string();
            assert!(err.contains("chat.jsonl:1"), "{err}");
            assert!(err.contains(want), "{err} lacks {want}");
        }
    }
}
