//! Tool calls in a model's text, in the Hermes / Qwen format that Qwen2.5, Qwen3 and most open
//! tool-use fine-tunes are trained on:
//!
//! ```text
//! Let me compute that.
//! <tool_call>
//! {"name": "calculator", "arguments": {"expression": "347*86"}}
//! </tool_call>
//! ```
//!
//! A turn may hold several calls; the text outside them is the turn's `content`. The same parser
//! serves RL environments (the host parses the policy's turn and hands the calls to the
//! environment) and `anneal serve` (a chat completion's `tool_calls`). A call that cannot be
//! read — one that never closes, JSON that does not parse, no `name` — is reported in
//! [`ParsedTurn::error`], never guessed at: an environment sees the error and answers it, a
//! server returns the text as plain content.

use serde_json::Value;

/// What opens a tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// What closes a tool call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// One call of a tool, read from the model's text.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolCall {
    /// `call_0`, `call_1`, ... in the order of the turn.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments: the JSON value the model wrote (an object, for well-formed calls).
    pub arguments: Value,
}

/// A turn of the model split into its text and its tool calls.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ParsedTurn {
    /// The text outside the tool calls, trimmed.
    pub content: String,
    /// The calls that parsed, in order.
    pub calls: Vec<ToolCall>,
    /// Why a call could not be read, when one could not (the first such call; the calls before
    /// it are kept, nothing after it is read as a call).
    pub error: Option<String>,
}

impl ParsedTurn {
    /// The turn as the JSON object an environment's `step` receives: `text`, `content`,
    /// `tool_calls` (`[{"id", "name", "arguments"}]`) and `error` (null or why).
    pub fn to_step_json(&self, text: &str) -> Value {
        serde_json::json!({
            "text": text,
            "content": self.content,
            "tool_calls": self.calls,
            "error": self.error,
        })
    }
}

/// Splits `text` into its content and its `<tool_call>{json}</tool_call>` calls.
pub fn parse_tool_calls(text: &str) -> ParsedTurn {
    let mut turn = ParsedTurn::default();
    let mut content = String::new();
    let mut rest = text;
    while let Some(open) = rest.find(TOOL_CALL_OPEN) {
        content.push_str(&rest[..open]);
        let body_start = open + TOOL_CALL_OPEN.len();
        let at = text.len() - rest.len() + open;
        let Some(close) = rest[body_start..].find(TOOL_CALL_CLOSE) else {
            turn.error = Some(format!(
                "the tool call opened at byte {at} never closes (no `{TOOL_CALL_CLOSE}`)"
            ));
            content.push_str(&rest[open..]);
            rest = "";
            break;
        };
        let body = &rest[body_start..body_start + close];
        match read_call(body, turn.calls.len()) {
            Ok(call) => turn.calls.push(call),
            Err(why) => {
                turn.error = Some(format!("the tool call at byte {at} {why}"));
                content.push_str(&rest[open..]);
                rest = "";
                break;
            }
        }
        rest = &rest[body_start + close + TOOL_CALL_CLOSE.len()..];
    }
    content.push_str(rest);
    turn.content = content.trim().to_string();
    turn
}

/// One call's JSON: `{"name": string, "arguments": value}` (`parameters` is accepted for
/// `arguments`, as some fine-tunes write it; arguments written as a JSON string are parsed).
fn read_call(body: &str, index: usize) -> Result<ToolCall, String> {
    let value: Value =
        serde_json::from_str(body.trim()).map_err(|e| format!("is not valid JSON ({e})"))?;
    let Value::Object(mut fields) = value else {
        return Err("is not a JSON object".into());
    };
    let name = match fields.remove("name") {
        Some(Value::String(name)) if !name.is_empty() => name,
        Some(_) => return Err("has a `name` that is not a non-empty string".into()),
        None => return Err("has no `name`".into()),
    };
    let arguments = match fields
        .remove("arguments")
        .or_else(|| fields.remove("parameters"))
    {
        // OpenAI sends arguments as JSON text; a model trained on such transcripts may too.
        Some(Value::String(s)) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        Some(v) => v,
        None => Value::Object(Default::default()),
    };
    Ok(ToolCall {
        id: format!("call_{index}"),
        name,
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_and_content_are_split() {
        let t = parse_tool_calls(
            "Let me see.\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"e\": \"1+2\"}}\n</tool_call>\
             <tool_call>{\"name\":\"calc\",\"arguments\":\"{\\\"e\\\": \\\"3\\\"}\"}</tool_call> done",
        );
        assert_eq!(t.error, None);
        assert_eq!(t.content, "Let me see.\n done");
        assert_eq!(t.calls.len(), 2);
        assert_eq!(t.calls[0].id, "call_0");
        assert_eq!(t.calls[0].arguments, json!({"e": "1+2"}));
        assert_eq!(t.calls[1].arguments, json!({"e": "3"}));
    }

    #[test]
    fn plain_text_has_no_calls() {
        let t = parse_tool_calls("  42 ");
        assert_eq!(
            (t.content.as_str(), t.calls.len(), t.error),
            ("42", 0, None)
        );
    }

    #[test]
    fn a_call_that_never_closes_is_an_error_and_stays_text() {
        let text = "x <tool_call>{\"name\": \"calc\"";
        let t = parse_tool_calls(text);
        assert!(t.calls.is_empty());
        assert!(t.error.as_deref().unwrap().contains("never closes"));
        assert_eq!(t.content, text.trim());
    }

    #[test]
    fn bad_calls_are_named() {
        for (body, why) in [
            ("nope", "not valid JSON"),
            ("[1]", "not a JSON object"),
            ("{\"arguments\": {}}", "no `name`"),
            ("{\"name\": 3}", "not a non-empty string"),
        ] {
            let t = parse_tool_calls(&format!(
                "<tool_call>{{\"name\":\"a\"}}</tool_call><tool_call>{body}</tool_call>"
            ));
            assert_eq!(t.calls.len(), 1, "{body}");
            assert!(t.error.as_deref().unwrap().contains(why), "{body}: {t:?}");
        }
    }

    #[test]
    fn the_step_json_has_every_field() {
        let t = parse_tool_calls("<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>");
        assert_eq!(
            t.to_step_json("raw"),
            json!({"text": "raw", "content": "", "tool_calls": [{"id": "call_0", "name": "a", "arguments": {}}], "error": null})
        );
    }
}
