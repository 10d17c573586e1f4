//! Write Anneal RL environments in Rust (`reward-wasm/ENVIRONMENTS.md`).
//!
//! Implement [`Environment`] and export it with [`crate::export_environment!`]; build the crate
//! as a `cdylib` for `wasm32-unknown-unknown`. The macro generates the environment ABI v1
//! exports (`alloc`, `env_init`, `env_step`, `env_close`, `output_ptr`, `output_len`,
//! `anneal_env_abi`); the module imports nothing.
//!
//! Memory: the instance lives for a whole episode, so nothing leaks per call: the input buffer
//! `alloc` hands out is freed after the call that reads it, and the output is kept only until
//! the next call.
//!
//! ```ignore
//! use anneal_reward_sdk::env::{Environment, Json, Start, Step, Turn};
//! struct Echo;
//! impl Environment for Echo {
//!     fn init(_task: &Json) -> Result<(Self, Start), String> {
//!         Ok((Echo, Start::text("Say something.")))
//!     }
//!     fn step(&mut self, turn: &Turn) -> Result<Step, String> {
//!         Ok(Step::done(1.0).with_observation(&turn.content))
//!     }
//! }
//! anneal_reward_sdk::export_environment!(Echo);
//! ```

pub use crate::json::{quote, Json};
use std::alloc::Layout;
use std::any::Any;
use std::cell::RefCell;

/// An environment: one value per episode, created by `init`, stepped once per policy turn.
pub trait Environment: Sized + 'static {
    /// Starts an episode for `task` (the JSON object the host was given).
    fn init(task: &Json) -> Result<(Self, Start), String>;
    /// Answers one policy turn.
    fn step(&mut self, turn: &Turn) -> Result<Step, String>;
    /// The episode is over (the value is dropped right after).
    fn close(&mut self) {}
}

/// One chat message.
pub struct Message {
    /// `system`, `user`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Message {
            role: "user".into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Message {
            role: "system".into(),
            content: content.into(),
        }
    }
}

/// What `init` returns: the first messages and the tools (OpenAI function specs as JSON text).
pub struct Start {
    /// The first messages.
    pub messages: Vec<Message>,
    /// Tool specs, each a JSON object as text.
    pub tools: Vec<String>,
}

impl Start {
    /// One user message.
    pub fn text(text: impl Into<String>) -> Self {
        Start::messages(vec![Message::user(text)])
    }

    /// These messages.
    pub fn messages(messages: Vec<Message>) -> Self {
        Start {
            messages,
            tools: Vec::new(),
        }
    }

    /// Adds a function tool; `parameters` is a JSON Schema object as text.
    pub fn with_tool(mut self, name: &str, description: &str, parameters: &str) -> Self {
        self.tools.push(format!(
            "{{\"type\":\"function\",\"function\":{{\"name\":{},\"description\":{},\"parameters\":{parameters}}}}}",
            quote(name),
            quote(description)
        ));
        self
    }

    fn to_json(&self) -> String {
        let messages: Vec<String> = self
            .messages
            .iter()
            .map(|m| {
                format!(
                    "{{\"role\":{},\"content\":{}}}",
                    quote(&m.role),
                    quote(&m.content)
                )
            })
            .collect();
        format!(
            "{{\"messages\":[{}],\"tools\":[{}]}}",
            messages.join(","),
            self.tools.join(",")
        )
    }
}

/// What `step` returns.
pub struct Step {
    /// The answer to the turn.
    pub observation: String,
    /// Its chat role (`tool` when `None`).
    pub role: Option<String>,
    /// This step's reward.
    pub reward: f64,
    /// Whether the episode is over.
    pub done: bool,
    /// A JSON object as text, to log.
    pub details: Option<String>,
}

impl Step {
    /// An observation; the episode goes on, reward 0.
    pub fn observation(text: impl Into<String>) -> Self {
        Step {
            observation: text.into(),
            role: None,
            reward: 0.0,
            done: false,
            details: None,
        }
    }

    /// The episode is over with this reward.
    pub fn done(reward: f64) -> Self {
        Step {
            reward,
            done: true,
            ..Step::observation("")
        }
    }

    /// Sets the observation.
    pub fn with_observation(mut self, text: &str) -> Self {
        self.observation = text.to_string();
        self
    }

    /// Sets the observation's role.
    pub fn with_role(mut self, role: &str) -> Self {
        self.role = Some(role.to_string());
        self
    }

    /// Sets the details (a JSON object as text).
    pub fn with_details(mut self, json_object: impl Into<String>) -> Self {
        self.details = Some(json_object.into());
        self
    }

    fn to_json(&self) -> String {
        let reward = if self.reward.is_finite() {
            format!("{:?}", self.reward)
        } else {
            "null".into() // the host refuses it: a reward must be finite
        };
        let mut out = format!(
            "{{\"observation\":{},\"reward\":{reward},\"done\":{}",
            quote(&self.observation),
            self.done
        );
        if let Some(role) = &self.role {
            out.push_str(&format!(",\"role\":{}", quote(role)));
        }
        if let Some(details) = &self.details {
            out.push_str(&format!(",\"details\":{details}"));
        }
        out.push('}');
        out
    }
}

/// One tool call of a turn.
pub struct ToolCall {
    /// `call_0`, `call_1`, ...
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments (a JSON object).
    pub arguments: Json,
}

/// One policy turn.
pub struct Turn {
    /// The whole text.
    pub text: String,
    /// The text outside tool calls.
    pub content: String,
    /// The tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// Why (some) tool calls could not be parsed.
    pub error: Option<String>,
}

impl Turn {
    /// The turn from the JSON object the host sends.
    pub fn from_json(v: &Json) -> Turn {
        let text = |key: &str| v.get(key).and_then(Json::as_str).unwrap_or("").to_string();
        Turn {
            text: text("text"),
            content: text("content"),
            tool_calls: v
                .get("tool_calls")
                .map(Json::items)
                .unwrap_or(&[])
                .iter()
                .map(|c| ToolCall {
                    id: c.get("id").and_then(Json::as_str).unwrap_or("").to_string(),
                    name: c
                        .get("name")
                        .and_then(Json::as_str)
                        .unwrap_or("")
                        .to_string(),
                    arguments: c.get("arguments").cloned().unwrap_or(Json::Null),
                })
                .collect(),
            error: v.get("error").and_then(Json::as_str).map(str::to_string),
        }
    }
}

/// The last integer of `text`: its last run of ASCII digits, with a `-` right before it.
pub fn last_integer(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let end = b.iter().rposition(u8::is_ascii_digit)? + 1;
    let mut start = end;
    while start > 0 && b[start - 1].is_ascii_digit() {
        start -= 1;
    }
    if start > 0 && b[start - 1] == b'-' {
        start -= 1;
    }
    Some(&text[start..end])
}

/// Whether the last integer of `text` equals `answer` (as integers when both are, else as
/// text): the final-answer rule of the example environments.
pub fn answer_matches(text: &str, answer: &str) -> bool {
    let answer = answer.trim();
    last_integer(text).is_some_and(|n| match (n.parse::<i128>(), answer.parse::<i128>()) {
        (Ok(a), Ok(b)) => a == b,
        _ => n == answer,
    })
}

/// The task of the question-and-answer environments, `{"question": .., "answer": ..}` (the
/// answer a string or a number): the question and the trimmed answer.
pub fn question_and_answer(task: &Json) -> Result<(&str, String), String> {
    let question = task
        .get("question")
        .and_then(Json::as_str)
        .ok_or("the task has no string `question`")?;
    let answer = task
        .get("answer")
        .and_then(Json::as_text)
        .ok_or("the task has no `answer`")?;
    Ok((question, answer.trim().to_string()))
}

/// A turn without tool calls, as the question-and-answer environments take it: a tool call
/// that could not be parsed is answered with its error (the episode goes on); otherwise the
/// turn is the final answer: reward 1 when its last integer equals `answer`, done, details
/// `{"correct": true|false}`. `None` for a turn with tool calls.
pub fn final_answer(turn: &Turn, answer: &str) -> Option<Step> {
    if !turn.tool_calls.is_empty() {
        return None;
    }
    if let Some(error) = &turn.error {
        return Some(Step::observation(format!("error: {error}")));
    }
    let correct = answer_matches(&turn.content, answer);
    Some(
        Step::done(if correct { 1.0 } else { 0.0 })
            .with_details(format!("{{\"correct\":{correct}}}")),
    )
}

/// The observation of a turn's tool calls from their results, in order: one result alone, or
/// each on its own line after its call's id (`call_0: ..`).
pub fn tool_results(turn: &Turn, results: &[String]) -> String {
    match results {
        [one] => one.clone(),
        many => turn
            .tool_calls
            .iter()
            .zip(many)
            .map(|(c, r)| format!("{}: {r}", c.id))
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

thread_local! {
    static STATE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
    static OUTPUT: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_output(text: String) {
    OUTPUT.with(|o| *o.borrow_mut() = text);
}

#[doc(hidden)]
pub fn __output_ptr() -> i32 {
    OUTPUT.with(|o| o.borrow().as_ptr() as i32)
}

#[doc(hidden)]
pub fn __output_len() -> i32 {
    OUTPUT.with(|o| o.borrow().len() as i32)
}

#[doc(hidden)]
pub fn __alloc(len: i32) -> i32 {
    match Layout::from_size_align(len.max(0) as usize, 1) {
        Ok(layout) if layout.size() > 0 => {
            // SAFETY: a non-zero size; freed by `take_input` with the same layout.
            unsafe { std::alloc::alloc(layout) as i32 }
        }
        _ => 1, // nothing is written for a zero length
    }
}

/// The input the host wrote at `ptr` (from `__alloc(len)`), as text; its buffer is freed.
///
/// # Safety
/// `ptr` and `len` must come from one `__alloc` call, not yet taken.
unsafe fn take_input(ptr: i32, len: i32) -> String {
    if len <= 0 {
        return String::new();
    }
    let len = len as usize;
    let bytes = std::slice::from_raw_parts(ptr as usize as *const u8, len);
    let text = String::from_utf8_lossy(bytes).into_owned();
    std::alloc::dealloc(
        ptr as usize as *mut u8,
        Layout::from_size_align_unchecked(len, 1),
    );
    text
}

/// Status 0 with the JSON output, or 1 with the error message.
fn finish(result: Result<String, String>) -> i32 {
    match result {
        Ok(json) => {
            set_output(json);
            0
        }
        Err(message) => {
            set_output(message);
            1
        }
    }
}

/// # Safety
/// `ptr`/`len` must describe a buffer from `alloc` the host wrote.
#[doc(hidden)]
pub unsafe fn __init<E: Environment>(ptr: i32, len: i32) -> i32 {
    let task = take_input(ptr, len);
    finish(Json::parse(&task).and_then(|task| {
        let (env, start) = E::init(&task)?;
        STATE.with(|s| *s.borrow_mut() = Some(Box::new(env)));
        Ok(start.to_json())
    }))
}

/// # Safety
/// `ptr`/`len` must describe a buffer from `alloc` the host wrote.
#[doc(hidden)]
pub unsafe fn __step<E: Environment>(ptr: i32, len: i32) -> i32 {
    let turn = take_input(ptr, len);
    finish(Json::parse(&turn).and_then(|turn| {
        let turn = Turn::from_json(&turn);
        STATE.with(|s| {
            let mut state = s.borrow_mut();
            let env = state
                .as_mut()
                .and_then(|b| b.downcast_mut::<E>())
                .ok_or("step before init")?;
            Ok(env.step(&turn)?.to_json())
        })
    }))
}

#[doc(hidden)]
pub fn __close<E: Environment>() {
    if let Some(mut state) = STATE.with(|s| s.borrow_mut().take()) {
        if let Some(env) = state.downcast_mut::<E>() {
            env.close();
        }
    }
    set_output(String::new());
}

/// Exports `$t: Environment` under the core-module environment ABI v1.
#[macro_export]
macro_rules! export_environment {
    ($t:ty) => {
        #[no_mangle]
        pub extern "C" fn alloc(len: i32) -> i32 {
            $crate::env::__alloc(len)
        }

        #[no_mangle]
        pub extern "C" fn env_init(ptr: i32, len: i32) -> i32 {
            // SAFETY: the host passes the buffer it wrote after `alloc`.
            unsafe { $crate::env::__init::<$t>(ptr, len) }
        }

        #[no_mangle]
        pub extern "C" fn env_step(ptr: i32, len: i32) -> i32 {
            // SAFETY: the host passes the buffer it wrote after `alloc`.
            unsafe { $crate::env::__step::<$t>(ptr, len) }
        }

        #[no_mangle]
        pub extern "C" fn env_close() {
            $crate::env::__close::<$t>()
        }

        #[no_mangle]
        pub extern "C" fn output_ptr() -> i32 {
            $crate::env::__output_ptr()
        }

        #[no_mangle]
        pub extern "C" fn output_len() -> i32 {
            $crate::env::__output_len()
        }

        #[no_mangle]
        pub extern "C" fn anneal_env_abi() -> i32 {
            1
        }
    };
}
