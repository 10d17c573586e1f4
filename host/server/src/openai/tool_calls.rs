//! A chat completion's tool calls: the completion's text split by
//! [`anneal_data::chat::tools::parse_tool_calls`] (Hermes / Qwen `<tool_call>{json}</tool_call>`)
//! into `content` and OpenAI's `tool_calls`, whole ([`assemble`]) or as a stream goes
//! ([`ToolStream`]).
//!
//! A completion is a tool-call turn only when every call in it reads: one that never closes
//! (cut by `max_tokens`), is not JSON or has no name leaves the whole text as `content`, with
//! the usual `finish_reason` (as vLLM's Hermes parser does). Otherwise the answer has
//! `tool_calls: [{"id": "call_0", "type": "function", "function": {"name", "arguments"}}]`
//! (`arguments` JSON text written as Python's `json.dumps` writes it, keys in the model's
//! order), `content` the text outside the calls (trimmed; `null` when empty) and
//! `finish_reason: "tool_calls"`.

use anneal_data::chat::template::tool_call_arguments;
use anneal_data::chat::tools::{parse_tool_calls, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
use serde_json::{json, Value};

/// A completion that called tools.
#[derive(Debug, PartialEq)]
pub struct Called {
    /// The text outside the calls, trimmed.
    pub content: String,
    /// OpenAI's `tool_calls` entries, in order.
    pub calls: Vec<Value>,
}

/// The tool calls of a completion's `text`; `None` when it has none or one does not read.
pub fn assemble(text: &str) -> Option<Called> {
    let turn = parse_tool_calls(text);
    if turn.error.is_some() || turn.calls.is_empty() {
        return None;
    }
    let bodies = call_bodies(text);
    let calls = turn
        .calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            // The arguments as the model wrote them (key order), else as parsed.
            let arguments = bodies
                .get(i)
                .and_then(|b| tool_call_arguments(b))
                .unwrap_or_else(|| call.arguments.to_string());
            json!({
                "id": call.id,
                "type": "function",
                "function": { "name": call.name, "arguments": arguments },
            })
        })
        .collect();
    Some(Called {
        content: turn.content,
        calls,
    })
}

/// The text inside each closed `<tool_call>...</tool_call>`, in order.
fn call_bodies(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(TOOL_CALL_OPEN) {
        let body = &rest[open + TOOL_CALL_OPEN.len()..];
        let Some(close) = body.find(TOOL_CALL_CLOSE) else {
            break;
        };
        out.push(&body[..close]);
        rest = &body[close + TOOL_CALL_CLOSE.len()..];
    }
    out
}

/// The `message` of a non-streaming chat choice whose text is `text`, and its finish reason
/// (`finish` unless tool calls replace it).
pub fn message(text: String, finish: Option<&'static str>) -> (Value, Option<&'static str>) {
    match assemble(&text) {
        Some(called) => {
            let content = (!called.content.is_empty()).then_some(called.content);
            (
                json!({ "role": "assistant", "content": content, "tool_calls": called.calls }),
                Some("tool_calls"),
            )
        }
        None => (json!({ "role": "assistant", "content": text }), finish),
    }
}

/// One choice's text as a stream delivers it, with tool calls: text before the first
/// `<tool_call>` streams as it comes (holding back what could be the start of one); from
/// there on the text waits for the end, when it becomes tool calls, or content after all.
#[derive(Default)]
pub struct ToolStream {
    /// Text handed out so far.
    sent: String,
    /// Text held back.
    held: String,
    /// A call has opened: everything waits for the end.
    in_call: bool,
}

/// What is left of a choice when its stream ends.
#[derive(Debug, PartialEq)]
pub struct StreamEnd {
    /// Content still to send.
    pub content: String,
    /// The tool-call deltas to send (each entry with its `index`), empty when none.
    pub calls: Vec<Value>,
}

impl ToolStream {
    /// Takes a piece of text; returns what may be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        let ready = match self.held.find(TOOL_CALL_OPEN) {
            Some(at) => {
                self.in_call = true;
                at
            }
            None => self.held.len() - partial_open(&self.held),
        };
        let out: String = self.held.drain(..ready).collect();
        self.sent.push_str(&out);
        out
    }

    /// The end of the choice: the calls (as stream deltas) and the content still unsent.
    pub fn finish(&mut self) -> StreamEnd {
        let held = std::mem::take(&mut self.held);
        let text = format!("{}{held}", self.sent);
        match assemble(&text) {
            Some(called) => {
                // What of the content the stream has not sent yet (the parser trims it).
                let sent = self.sent.trim_start();
                let content = called
                    .content
                    .strip_prefix(sent)
                    .or_else(|| called.content.strip_prefix(sent.trim_end()))
                    .unwrap_or_default()
                    .to_string();
                let calls = called
                    .calls
                    .into_iter()
                    .enumerate()
                    .map(|(index, mut call)| {
                        call["index"] = json!(index);
                        call
                    })
                    .collect();
                StreamEnd { content, calls }
            }
            None => StreamEnd {
                content: held,
                calls: vec![],
            },
        }
    }
}

/// How many bytes at the end of `text` begin `<tool_call>` (and may grow into it).
fn partial_open(text: &str) -> usize {
    (1..TOOL_CALL_OPEN.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && TOOL_CALL_OPEN.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TURN: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"C\", \"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\"}\n</tool_call>";

    #[test]
    fn calls_become_openais_tool_calls_with_the_models_argument_text() {
        let (m, finish) = message(TURN.into(), Some("stop"));
        assert_eq!(finish, Some("tool_calls"));
        assert_eq!(
            m,
            json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"unit\": \"C\", \"city\": \"Paris\"}"}},
                {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ]})
        );
        // Only calls: content is null.
        let only = &TURN["Let me check.\n".len()..];
        let (m, _) = message(only.into(), Some("stop"));
        assert_eq!(m["content"], Value::Null);
        // A call cut short is text, and the finish reason stays.
        let cut = &TURN[..TURN.len() - 5];
        let (m, finish) = message(cut.into(), Some("length"));
        assert_eq!(finish, Some("length"));
        assert_eq!(m, json!({"role": "assistant", "content": cut}));
        assert_eq!(message(String::from("hi"), Some("stop")).0["content"], "hi");
    }

    #[test]
    fn a_stream_sends_the_text_before_the_calls_and_the_calls_at_the_end() {
        for size in [1, 3, 7, 1000] {
            let mut s = ToolStream::default();
            let bytes: Vec<char> = TURN.chars().collect();
            let sent: String = bytes
                .chunks(size)
                .map(|c| s.push(&c.iter().collect::<String>()))
                .collect();
            assert_eq!(sent, "Let me check.\n", "pieces of {size}");
            let end = s.finish();
            assert_eq!(end.content, "");
            assert_eq!(end.calls.len(), 2);
            assert_eq!(end.calls[1]["index"], 1);
            assert_eq!(end.calls[0]["function"]["name"], "get_weather");
        }
        // Text after the calls comes at the end; a broken call is sent as text.
        let mut s = ToolStream::default();
        assert_eq!(s.push("a <tool"), "a ");
        assert_eq!(s.push("_call>{\"name\": \"f\"}</tool_call> b"), "");
        let end = s.finish();
        assert_eq!((end.content.as_str(), end.calls.len()), (" b", 1));
        let mut s = ToolStream::default();
        assert_eq!(s.push("x <tool_call>{\"name\""), "x ");
        let end = s.finish();
        assert_eq!(end.content, "<tool_call>{\"name\"");
        assert!(end.calls.is_empty());
        // A `<` that does not start a call is sent once it cannot.
        let mut s = ToolStream::default();
        assert_eq!(s.push("1 <"), "1 ");
        assert_eq!(s.push(" 2"), "< 2");
    }
}
