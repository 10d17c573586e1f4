//! The turn an environment's `step` receives: the policy's text, split into the text outside
//! tool calls and the tool calls themselves.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One tool call of a turn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// An id unique within the turn (`call_0`, `call_1`, ...), to answer the call by.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments, a JSON object.
    pub arguments: Value,
}

/// One policy turn, as `step` receives it (serialized as JSON):
/// `{"text": .., "content": .., "tool_calls": [{"id","name","arguments"}], "error": null}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// The whole text of the turn.
    pub text: String,
    /// The text outside tool calls (trimmed).
    pub content: String,
    /// The tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// Why (some of) the tool calls could not be parsed, if they could not.
    pub error: Option<String>,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl Turn {
    /// Splits `text` in the Hermes / Qwen format: each tool call is
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (`arguments` may also be a
    /// string holding a JSON object). A call that does not parse is left out and named in
    /// `error`; text outside the tags is `content`.
    pub fn from_text(text: &str) -> Turn {
        let mut content = String::new();
        let mut tool_calls = Vec::new();
        let mut errors = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find(OPEN) {
            content.push_str(&rest[..open]);
            let body_start = open + OPEN.len();
            let (body, next) = match rest[body_start..].find(CLOSE) {
                Some(end) => (
                    &rest[body_start..body_start + end],
                    body_start + end + CLOSE.len(),
                ),
                None => (&rest[body_start..], rest.len()),
            };
            let index = tool_calls.len() + errors.len();
            match parse_call(body) {
                Ok((name, arguments)) => tool_calls.push(ToolCall {
                    id: format!("call_{}", tool_calls.len()),
                    name,
                    arguments,
                }),
                Err(why) => errors.push(format!("tool call {index}: {why}")),
            }
            rest = &rest[next..];
        }
        content.push_str(rest);
        Turn {
            text: text.to_string(),
            content: content.trim().to_string(),
            tool_calls,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        }
    }

    /// The turn as the JSON object `step` receives.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "text": self.text,
            "content": self.content,
            "tool_calls": self.tool_calls,
            "error": self.error,
        })
    }
}

/// `{"name": .., "arguments": ..}` → (name, arguments object).
fn parse_call(body: &str) -> Result<(String, Value), String> {
    let value: Value =
        serde_json::from_str(body.trim()).map_err(|e| format!("not valid JSON: {e}"))?;
    let name = match value.get("name") {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        _ => return Err("no string `name`".into()),
    };
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .ok_or("`arguments` is a string that is not a JSON object")?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err("`arguments` is not a JSON object".into()),
    };
    Ok((name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_content_and_tool_calls() {
        let t = Turn::from_text(
            "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": \
             {\"expression\": \"347*86\"}}\n</tool_call>",
        );
        assert_eq!(t.content, "Let me compute.");
        assert_eq!(t.tool_calls.len(), 1);
        assert_eq!(t.tool_calls[0].id, "call_0");
        assert_eq!(t.tool_calls[0].name, "calculator");
        assert_eq!(t.tool_calls[0].arguments["expression"], "347*86");
        assert_eq!(t.error, None);
    }

    #[test]
    fn a_broken_call_is_named_in_error() {
        let t = Turn::from_text("a <tool_call>{oops</tool_call> b <tool_call>{\"name\":\"x\"}");
        assert_eq!(t.content, "a  b");
        assert_eq!(t.tool_calls.len(), 1);
        assert_eq!(t.tool_calls[0].arguments, serde_json::json!({}));
        assert!(t
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("tool call 0: not valid JSON")));
        let plain = Turn::from_text("The answer is 42.");
        assert!(plain.tool_calls.is_empty() && plain.error.is_none());
        assert_eq!(plain.to_json()["content"], "The answer is 42.");
    }
}
