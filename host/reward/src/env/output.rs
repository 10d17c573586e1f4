//! What an environment returns, checked: the init JSON (`messages` or `text`, and `tools`) and
//! the step JSON (`observation`, `role`, `reward`, `done`, `details`). Anything else is
//! `bad_output` with a message saying what is wrong.

use super::{EnvMessage, EpisodeStart, StepOutcome};
use crate::exec::{bad, Failure};
use serde_json::{Map, Value};

/// The role of an observation when the environment names none.
pub(super) const DEFAULT_ROLE: &str = "tool";

fn object<'a>(value: &'a Value, what: &str) -> Result<&'a Map<String, Value>, Failure> {
    value
        .as_object()
        .ok_or_else(|| bad(format!("{what} is not a JSON object")))
}

fn parse(text: &str, what: &str) -> Result<Value, Failure> {
    serde_json::from_str(text).map_err(|e| bad(format!("{what} is not valid JSON: {e}")))
}

/// The init output: `{"messages": [{"role", "content"}, ...]}` or `{"text": "..."}`, with an
/// optional `"tools": [...]`.
pub(super) fn parse_start(text: &str) -> Result<EpisodeStart, Failure> {
    let value = parse(text, "init output")?;
    let map = object(&value, "init output")?;
    let messages = match (map.get("messages"), map.get("text")) {
        (Some(_), Some(_)) => return Err(bad("init output has both `messages` and `text`")),
        (None, None) => return Err(bad("init output has neither `messages` nor `text`")),
        (None, Some(Value::String(t))) => vec![user(t.clone())],
        (None, Some(_)) => return Err(bad("init output `text` is not a string")),
        (Some(Value::Array(list)), None) => list
            .iter()
            .enumerate()
            .map(|(i, m)| message(m, i))
            .collect::<Result<_, _>>()?,
        (Some(_), None) => return Err(bad("init output `messages` is not a list")),
    };
    let tools = match map.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list.clone(),
        Some(_) => return Err(bad("init output `tools` is not a list")),
    };
    start(messages, tools)
}

/// An episode start, its messages and tools checked.
pub(super) fn start(messages: Vec<EnvMessage>, tools: Vec<Value>) -> Result<EpisodeStart, Failure> {
    if messages.is_empty() {
        return Err(bad("init returned no messages"));
    }
    for (i, tool) in tools.iter().enumerate() {
        check_tool(tool, i)?;
    }
    Ok(EpisodeStart { messages, tools })
}

/// One user message.
pub(super) fn user(content: String) -> EnvMessage {
    EnvMessage {
        role: "user".into(),
        content,
    }
}

fn message(value: &Value, i: usize) -> Result<EnvMessage, Failure> {
    let what = format!("init output messages[{i}]");
    let map = object(value, &what)?;
    let field = |name: &str| match map.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(bad(format!("{what} has no string `{name}`"))),
    };
    let m = EnvMessage {
        role: field("role")?,
        content: field("content")?,
    };
    check_role(&m.role, &what)?;
    Ok(m)
}

/// A role is a short non-empty word.
pub(super) fn check_role(role: &str, what: &str) -> Result<(), Failure> {
    if role.is_empty() || role.len() > 64 {
        return Err(bad(format!(
            "{what}: role {role:?} is empty or over 64 bytes"
        )));
    }
    Ok(())
}

/// A tool spec in the OpenAI function format: `{"type": "function", "function": {"name": ..}}`.
fn check_tool(tool: &Value, i: usize) -> Result<(), Failure> {
    let what = format!("tools[{i}]");
    let map = object(tool, &what)?;
    if map.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad(format!("{what} does not have \"type\": \"function\"")));
    }
    let function = map
        .get("function")
        .ok_or_else(|| bad(format!("{what} has no `function` object")))?;
    let function = object(function, &format!("{what}.function"))?;
    match function.get("name") {
        Some(Value::String(name)) if !name.is_empty() => Ok(()),
        _ => Err(bad(format!("{what}.function has no string `name`"))),
    }
}

/// The step output: `{"observation": "...", "role": "tool", "reward": 0.0, "done": false,
/// "details": {...}}`; all fields are optional but `observation` (empty) and `reward` (0) and
/// `done` (false) and `role` (`tool`) have these defaults.
pub(super) fn parse_step(text: &str) -> Result<StepOutcome, Failure> {
    let value = parse(text, "step output")?;
    let map = object(&value, "step output")?;
    let observation = match map.get("observation") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(bad("step output `observation` is not a string")),
    };
    let role = match map.get("role") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("step output `role` is not a string")),
    };
    let reward = match map.get("reward") {
        None | Some(Value::Null) => 0.0,
        Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
        Some(_) => return Err(bad("step output `reward` is not a number")),
    };
    let done = match map.get("done") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("step output `done` is not true or false")),
    };
    let details = match map.get("details") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(_) => return Err(bad("step output `details` is not a JSON object")),
    };
    outcome(observation, role, reward, done, details)
}

/// A step outcome, its role and reward checked.
pub(super) fn outcome(
    observation: String,
    role: Option<String>,
    reward: f64,
    done: bool,
    details: Option<Map<String, Value>>,
) -> Result<StepOutcome, Failure> {
    let role = role.unwrap_or_else(|| DEFAULT_ROLE.to_string());
    check_role(&role, "step output")?;
    if !reward.is_finite() {
        return Err(bad(format!("reward is {reward}, not a finite number")));
    }
    Ok(StepOutcome {
        observation,
        role,
        reward,
        done,
        details,
    })
}

/// Details text (a component's `details`) as a JSON object.
pub(super) fn parse_details(text: &str) -> Result<Map<String, Value>, Failure> {
    match parse(text, "details")? {
        Value::Object(map) => Ok(map),
        _ => Err(bad("details is not a JSON object")),
    }
}

/// Tools text (a component's `tools`) as a list.
pub(super) fn parse_tools(text: &str) -> Result<Vec<Value>, Failure> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    match parse(text, "tools")? {
        Value::Array(list) => Ok(list),
        _ => Err(bad("tools is not a JSON list")),
    }
}
