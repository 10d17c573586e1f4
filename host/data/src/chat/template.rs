//! Chat templates: how a list of messages becomes one prompt string.
//!
//! A Hugging Face model ships its template as Jinja, in `chat_template.jinja` or in the
//! `chat_template` of `tokenizer_config.json` (a string, or a list of named templates of which
//! `default` is used). It is rendered as `transformers` renders it: with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string/dict methods, `raise_exception(msg)`, and the
//! variables `messages`, `add_generation_prompt` (true when the model is to write the next
//! assistant turn, false when a whole conversation is rendered for training), `bos_token` and
//! `eos_token` (from `tokenizer_config.json`).
//!
//! Without a template the prompt is one line per message, `<role>: <content>`, then
//! `assistant:` (the documented fallback, fit for models trained on plain text). Tokenizers
//! trained here for chat data use [`CHATML`], Qwen's format.
//!
//! A template is code from the model's files, so a render is held to [`RenderLimits`]: fuel
//! (minijinja's count of instructions and of the bytes a template creates, which bounds both its
//! time and its memory), the size of the prompt it writes, and wall time; and it stops when its
//! caller sets the cancel flag (a client that went away). Time, size and the flag are checked
//! whenever the template writes; a template that loops without writing runs out of fuel.

use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One chat message, as the template sees it: `role`, `content`, and for tool use OpenAI's
/// `tool_calls` (an assistant's calls), `tool_call_id` and `name` (a `tool` message's answer).
/// Fields a message lacks are left out, as transformers drops the keys whose value is `None`;
/// so is the empty `content` of an assistant message that only calls tools (OpenAI's `null`).
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Its text, or its parts when it holds images.
    pub content: Content,
    /// The tool calls of an assistant message, in order.
    pub tool_calls: Vec<MessageToolCall>,
    /// For a `tool` message: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// For a `tool` message: the function's name, when given.
    pub name: Option<String>,
}

impl Message {
    /// A message of `role` with `content` and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<Content>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

impl Serialize for Message {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let no_content =
            !self.tool_calls.is_empty() && self.content == Content::Text(String::new());
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("role", &self.role)?;
        if !no_content {
            m.serialize_entry("content", &self.content)?;
        }
        if !self.tool_calls.is_empty() {
            m.serialize_entry("tool_calls", &self.tool_calls)?;
        }
        if let Some(id) = &self.tool_call_id {
            m.serialize_entry("tool_call_id", id)?;
        }
        if let Some(name) = &self.name {
            m.serialize_entry("name", name)?;
        }
        m.end()
    }
}

/// One tool call of an assistant message, as OpenAI sends it back: its arguments are JSON
/// text. The template sees `{"id", "type": "function", "function": {"name", "arguments"}}`
/// with the arguments parsed into an object (keys in their order), as vLLM and SGLang hand
/// them to templates (transformers' documented form; Qwen's template takes both); text that
/// is not JSON stays a string.
#[derive(Clone, Debug, PartialEq)]
pub struct MessageToolCall {
    /// The call's id (`call_0`, ...), when given.
    pub id: Option<String>,
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl Serialize for MessageToolCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let arguments = serde_json::from_str::<minijinja::Value>(&self.arguments)
            .unwrap_or_else(|_| minijinja::Value::from(self.arguments.as_str()));
        let function = minijinja::context! { name => self.name.as_str(), arguments => arguments };
        let mut m = s.serialize_map(None)?;
        if let Some(id) = &self.id {
            m.serialize_entry("id", id)?;
        }
        m.serialize_entry("type", "function")?;
        m.serialize_entry("function", &function)?;
        m.end()
    }
}

/// The `tools` a request gives the template: OpenAI's function definitions
/// (`[{"type": "function", "function": {"name", "description", "parameters"}}]`), kept as they
/// were sent, keys in their order, so `tool | tojson` writes them as transformers would.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools(Vec<minijinja::Value>);

impl Tools {
    /// The tools of a JSON list (text, so that the order of every object's keys survives).
    pub fn from_json(text: &str) -> Result<Tools, String> {
        serde_json::from_str::<Vec<minijinja::Value>>(text)
            .map(Tools)
            .map_err(|e| format!("`tools` must be a list of objects: {e}"))
    }

    /// How many tools.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'de> serde::Deserialize<'de> for Tools {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Tools, D::Error> {
        Vec::<minijinja::Value>::deserialize(d).map(Tools)
    }
}

/// A message's content as the template sees it: a string (text parts already joined), or, for
/// a message holding images, the list of parts Hugging Face's vision templates take:
/// `{"type": "text", "text": ...}` and `{"type": "image"}` (the image itself is kept apart; the
/// template only places its placeholder).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Content {
    /// The text.
    Text(String),
    /// Text and image parts in order.
    Parts(Vec<Part>),
}

/// One part of a [`Content::Parts`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// An image's place.
    Image,
}

impl Content {
    /// The text parts joined (what a template without image support, or the fallback, shows).
    pub fn text(&self) -> String {
        match self {
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => parts
                .iter()
                .filter_map(|p| match p {
                    Part::Text { text } => Some(text.as_str()),
                    Part::Image => None,
                })
                .collect(),
        }
    }
}

impl From<&str> for Content {
    fn from(text: &str) -> Content {
        Content::Text(text.to_owned())
    }
}

impl From<String> for Content {
    fn from(text: String) -> Content {
        Content::Text(text)
    }
}

/// Why a template could not be read or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// `tokenizer_config.json` or `chat_template.jinja` could not be read or parsed.
    #[error("{}: {msg}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// The template is not valid Jinja (for this engine).
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    /// Rendering failed (the template raised an exception or used something unsupported).
    #[error("the chat template failed: {0}")]
    Render(String),
    /// Rendering went past one of its [`RenderLimits`].
    #[error("the chat template exceeded its limits: {0}")]
    Limit(String),
    /// The caller gave up on the render (its client went away).
    #[error("the chat template render was cancelled")]
    Cancelled,
}

/// What one render of a chat template may spend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderLimits {
    /// minijinja fuel: about one per instruction plus one per 64 bytes the template creates.
    pub fuel: u64,
    /// The longest prompt the template may write, in bytes.
    pub max_output_bytes: usize,
    /// Wall time.
    pub max_time: Duration,
}

impl RenderLimits {
    /// Fuel per render. Real templates (ChatML, Llama 3, Qwen3 with its reasoning logic) spend
    /// a few hundred per message plus one per 16 or so bytes of content, so a full-size request
    /// (2 MiB of messages) stays well below; a loop of 10^10 steps stops after a fraction of a
    /// second, having allocated at most 64 bytes per fuel (320 MiB, usually far less at once).
    pub const FUEL: u64 = 5_000_000;
    /// The longest prompt: four times the largest request body, far beyond any context.
    pub const MAX_OUTPUT_BYTES: usize = 8 << 20;
    /// Wall time per render (a backstop: fuel ends a runaway render sooner).
    pub const MAX_TIME: Duration = Duration::from_secs(10);
}

impl Default for RenderLimits {
    fn default() -> Self {
        RenderLimits {
            fuel: Self::FUEL,
            max_output_bytes: Self::MAX_OUTPUT_BYTES,
            max_time: Self::MAX_TIME,
        }
    }
}

impl std::fmt::Display for RenderLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} fuel, {} bytes of output, {} s",
            self.fuel,
            self.max_output_bytes,
            self.max_time.as_secs_f64()
        )
    }
}

/// A model's chat template (or the fallback format).
pub struct ChatTemplate {
    env: Option<Environment<'static>>,
    /// The environment also holds [`TOOL_USE`], the template for requests with tools.
    tool_use: bool,
    bos: String,
    eos: String,
    limits: RenderLimits,
}

const NAME: &str = "chat";
/// A `tokenizer_config.json`'s template named `tool_use`, which transformers renders instead
/// of the default when tools are given.
const TOOL_USE: &str = "chat_tool_use";

/// The chat template of tokenizers trained here on chat data: ChatML as Qwen writes it, each
/// message `<|im_start|>role\n...<|im_end|>\n`, an image part as
/// `<|vision_start|><|image_pad|><|vision_end|>` (one placeholder, expanded to the image's
/// tokens after tokenizing).
///
/// Tool use is Qwen3's: `tools` go into the system turn (after the system message's text, when
/// the conversation starts with one) as one JSON object per line between `<tools>` and
/// `</tools>`, with Qwen's instructions; an assistant's `tool_calls` follow its text as
/// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one per call, separated by a
/// newline; and `tool` messages are answered inside a `user` turn, as Qwen does, each as
/// `\n<tool_response>\n...\n</tool_response>` (consecutive ones share the turn). Conversations
/// without tools render as before.
pub const CHATML: &str = concat!(
    "{%- if tools %}{{- '<|im_start|>system\\n' }}",
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}",
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n",
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}",
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}",
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ",
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n",
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- for message in messages %}",
    "{%- if tools and loop.first and message.role == 'system' %}",
    "{%- elif message.role == 'tool' %}",
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}",
    "{{- '\\n<tool_response>\\n' }}{{- message.content if message.content is string else '' }}",
    "{{- '\\n</tool_response>' }}",
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' }}",
    "{%- if message.content is string %}{{- message.content }}",
    "{%- elif message.content %}{%- for part in message.content %}",
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}",
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}",
    "{%- for tool_call in message.tool_calls or [] %}",
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}",
    "{%- set call = tool_call.function if tool_call.function else tool_call %}",
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}",
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}",
    "{{- '}\\n</tool_call>' }}{%- endfor %}",
    "{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
);

/// The special tokens [`CHATML`] writes, in the order tokenizers trained for chat data number
/// them (right after `<|endoftext|>`, id 0): message bounds, then the vision tokens.
pub const CHATML_SPECIALS: [&str; 6] = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
];

impl ChatTemplate {
    /// The fallback: `<role>: <content>` lines, then `assistant:`.
    pub fn fallback() -> ChatTemplate {
        ChatTemplate {
            env: None,
            tool_use: false,
            bos: String::new(),
            eos: String::new(),
            limits: RenderLimits::default(),
        }
    }

    /// The template of the model whose tokenizer files are in `dir`: `chat_template.jinja`,
    /// else `tokenizer_config.json`'s `chat_template`, else the fallback.
    pub fn load(dir: &Path) -> Result<ChatTemplate, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| TemplateError::Read {
                path: config_path.clone(),
                msg: format!("not valid JSON: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => {
                return Err(TemplateError::Read {
                    path: config_path,
                    msg: e.to_string(),
                })
            }
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(
                std::fs::read_to_string(&jinja_path).map_err(|e| TemplateError::Read {
                    path: jinja_path,
                    msg: e.to_string(),
                })?,
            )
        } else {
            template_in_config(&config, "default")
        };
        let token = |key: &str| special_token(config.get(key));
        let template = ChatTemplate::new(source, token("bos_token"), token("eos_token"))?;
        match named_template(&config, "tool_use") {
            Some(tool_use) => template.with_tool_use_template(tool_use),
            None => Ok(template),
        }
    }

    /// A Jinja template (or the fallback for `None`) with the tokenizer's BOS and EOS texts,
    /// held to the default [`RenderLimits`].
    pub fn new(
        source: Option<String>,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<ChatTemplate, TemplateError> {
        let Some(source) = source else {
            return Ok(ChatTemplate::fallback());
        };
        let limits = RenderLimits::default();
        let mut env = Environment::new();
        env.set_fuel(Some(limits.fuel));
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TemplateError::Compile(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", super::pyjson::tojson);
        env.add_template_owned(NAME, source)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env: Some(env),
            tool_use: false,
            bos: bos.unwrap_or_default(),
            eos: eos.unwrap_or_default(),
            limits,
        })
    }

    /// The same template, rendering `source` instead for requests that give tools (a
    /// `tokenizer_config.json`'s template named `tool_use`).
    pub fn with_tool_use_template(mut self, source: String) -> Result<ChatTemplate, TemplateError> {
        if let Some(env) = &mut self.env {
            env.add_template_owned(TOOL_USE, source)
                .map_err(|e| TemplateError::Compile(e.to_string()))?;
            self.tool_use = true;
        }
        Ok(self)
    }

    /// The same template held to other limits.
    pub fn with_limits(mut self, limits: RenderLimits) -> ChatTemplate {
        if let Some(env) = &mut self.env {
            env.set_fuel(Some(limits.fuel));
        }
        self.limits = limits;
        self
    }

    /// What one render may spend.
    pub fn limits(&self) -> RenderLimits {
        self.limits
    }

    /// True when the model has no template of its own.
    pub fn is_fallback(&self) -> bool {
        self.env.is_none()
    }

    /// The prompt for `messages`, ending where the assistant's reply starts.
    pub fn render(&self, messages: &[Message]) -> Result<String, TemplateError> {
        self.render_cancellable(messages, &AtomicBool::new(false))
    }

    /// `messages` as a whole conversation (`add_generation_prompt` false): what a model is
    /// trained on.
    pub fn render_conversation(&self, messages: &[Message]) -> Result<String, TemplateError> {
        self.render_with(messages, None, false, &AtomicBool::new(false))
    }

    /// [`ChatTemplate::render`] that stops, failing with [`TemplateError::Cancelled`], once
    /// `cancel` is set. Renders take long only by looping, so call this off async workers.
    pub fn render_cancellable(
        &self,
        messages: &[Message],
        cancel: &AtomicBool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, None, true, cancel)
    }

    /// `messages` with `tools` (the template's `tools` variable; `none` without), ending where
    /// the assistant's reply starts when `add_generation_prompt`: what a request to the model
    /// renders. Stops, failing with [`TemplateError::Cancelled`], once `cancel` is set. The
    /// fallback format cannot show tools: it refuses them with [`TemplateError::Render`].
    pub fn render_request(
        &self,
        messages: &[Message],
        tools: Option<&Tools>,
        add_generation_prompt: bool,
        cancel: &AtomicBool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, tools, add_generation_prompt, cancel)
    }

    fn render_with(
        &self,
        messages: &[Message],
        tools: Option<&Tools>,
        add_generation_prompt: bool,
        cancel: &AtomicBool,
    ) -> Result<String, TemplateError> {
        let Some(env) = &self.env else {
            return fallback(messages, tools, add_generation_prompt);
        };
        let name = match (tools, self.tool_use) {
            (Some(_), true) => TOOL_USE,
            _ => NAME,
        };
        let template = env
            .get_template(name)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        let mut out = BoundedWriter {
            buf: Vec::new(),
            max: self.limits.max_output_bytes,
            deadline: Instant::now() + self.limits.max_time,
            cancel,
            stopped: None,
        };
        let rendered = template.render_captured_to(
            minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                tools => tools.map(|t| minijinja::Value::from(t.0.clone())),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos,
                eos_token => &self.eos,
            },
            &mut out,
        );
        match (rendered, out.stopped) {
            (Ok(_), _) => String::from_utf8(out.buf)
                .map_err(|_| TemplateError::Render("the output is not UTF-8".into())),
            (Err(_), Some(Stop::Cancelled)) => Err(TemplateError::Cancelled),
            (Err(_), Some(Stop::Output)) => Err(self.limit_error(format!(
                "its output passed {} bytes",
                self.limits.max_output_bytes
            ))),
            (Err(_), Some(Stop::Time)) => Err(self.limit_error(format!(
                "it ran past {} s",
                self.limits.max_time.as_secs_f64()
            ))),
            (Err(e), None) if e.kind() == ErrorKind::OutOfFuel => {
                Err(self.limit_error(format!("it ran out of fuel ({})", self.limits.fuel)))
            }
            (Err(e), None) => Err(TemplateError::Render(describe(&e))),
        }
    }

    fn limit_error(&self, what: String) -> TemplateError {
        TemplateError::Limit(format!(
            "{what}; a render may use {} (the template loops too long for these messages)",
            self.limits
        ))
    }
}

/// Why a [`BoundedWriter`] refused a write.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Output,
    Time,
    Cancelled,
}

/// The render's output: refuses to grow past `max` bytes, after `deadline` or once `cancel`
/// is set, which ends the render at the template's next write.
struct BoundedWriter<'a> {
    buf: Vec<u8>,
    max: usize,
    deadline: Instant,
    cancel: &'a AtomicBool,
    stopped: Option<Stop>,
}

impl std::io::Write for BoundedWriter<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let stop = if self.cancel.load(Ordering::Relaxed) {
            Some(Stop::Cancelled)
        } else if self.buf.len() + data.len() > self.max {
            Some(Stop::Output)
        } else if Instant::now() > self.deadline {
            Some(Stop::Time)
        } else {
            None
        };
        if let Some(stop) = stop {
            self.stopped = Some(stop);
            return Err(std::io::Error::other("render stopped"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An error with its cause chain on one line.
fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// The arguments of one tool call's JSON (`{"name": ..., "arguments": {...}}`, the text between
/// `<tool_call>` and `</tool_call>`) as JSON text, the way Python's `json.dumps` writes it (as
/// vLLM returns a Hermes call's arguments) with the keys in the order the model wrote them, so
/// that the call rendered back by a template reads as the model wrote it. Arguments written as
/// a JSON string are read as JSON first (as [`crate::chat::tools::parse_tool_calls`] does);
/// `parameters` stands for `arguments`; none at all is `{}`. `None` when the text is not a
/// JSON object.
pub fn tool_call_arguments(call: &str) -> Option<String> {
    let value: minijinja::Value = serde_json::from_str(call.trim()).ok()?;
    if value.kind() != minijinja::value::ValueKind::Map {
        return None;
    }
    let arguments = ["arguments", "parameters"]
        .iter()
        .filter_map(|k| value.get_attr(k).ok())
        .find(|a| !a.is_undefined());
    let arguments = match arguments {
        None => return Some("{}".into()),
        Some(a) => match a.as_str().map(serde_json::from_str::<minijinja::Value>) {
            Some(Ok(parsed)) => parsed,
            _ => a,
        },
    };
    super::pyjson::dumps(&arguments).ok()
}

/// `chat_template` of a `tokenizer_config.json`: a string, or a list of `{name, template}` of
/// which `default` (else the first) is used.
fn template_in_config(config: &Value, name: &str) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => named_template(config, name)
            .or_else(|| list.first()?.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// The template called `name` in a `tokenizer_config.json`'s list of named templates.
fn named_template(config: &Value, name: &str) -> Option<String> {
    config
        .get("chat_template")?
        .as_array()?
        .iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|t| t.get("template")?.as_str())
        .map(str::to_owned)
}

/// The format of models without a template: `<role>: <content>` lines (an assistant's tool
/// calls after its text as Qwen writes them), then `assistant:`. It has no place for tools.
fn fallback(
    messages: &[Message],
    tools: Option<&Tools>,
    add_generation_prompt: bool,
) -> Result<String, TemplateError> {
    if tools.is_some() {
        return Err(TemplateError::Render(
            "this model has no chat template, and the plain `role: content` format it falls back \
             to cannot show tools"
                .into(),
        ));
    }
    let mut out = String::new();
    for m in messages {
        let mut text = m.content.text();
        for call in &m.tool_calls {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&format!(
                "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                serde_json::Value::from(call.name.as_str()),
                call.arguments
            ));
        }
        out.push_str(&format!("{}: {text}\n", m.role));
    }
    if add_generation_prompt {
        out.push_str("assistant:");
    }
    Ok(out)
}

/// A special token's text in `tokenizer_config.json`: a string or `{"content": ...}`.
pub fn special_token(v: Option<&Value>) -> Option<String> {
    let v = v?;
    v.as_str()
        .or_else(|| v.get("content")?.as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<Message> {
        vec![
            Message::new("system", "Be brief."),
            Message::new("user", " Hi "),
        ]
    }

    #[test]
    fn chatml_renders_as_transformers_does() {
        // Expected strings are Python jinja2 3.1's output with transformers' settings
        // (trim_blocks, lstrip_blocks): block tags lose their newline, `{{` keeps its
        // indentation unless `{{-`, and Python's str.strip() works.
        let src = "{% for message in messages %}\n    {{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>\\n' }}\n{%- endfor %}\n{% if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";
        let t = ChatTemplate::new(Some(src.into()), None, Some("<|im_end|>".into())).unwrap();
        assert_eq!(
            t.render(&msgs()).unwrap(),
            "    <|im_start|>system\nBe brief.<|im_end|>\n    <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let src = "{% for message in messages %}\n{{ '<' + message['role'] + '> ' + message['content'].strip() + '\\n' }}\n{% endfor %}\n{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}";
        let t = ChatTemplate::new(Some(src.into()), None, None).unwrap();
        assert_eq!(t.render(&msgs()[1..]).unwrap(), "<user> Hi\n\n<assistant>");
    }

    #[test]
    fn bos_token_loop_controls_and_raise_exception() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.role|upper }}]{{ m.content }}{% endfor %}{% if messages|length > 5 %}{{ raise_exception('too many messages') }}{% endif %}";
        let t = ChatTemplate::new(Some(src.into()), Some("<s>".into()), None).unwrap();
        assert_eq!(t.render(&msgs()).unwrap(), "<s>[USER] Hi ");
        let many = vec![msgs()[1].clone(); 6];
        let err = t.render(&many).unwrap_err().to_string();
        assert!(err.contains("too many messages"), "{err}");
        let err = ChatTemplate::new(Some("{% for %}".into()), None, None)
            .err()
            .unwrap();
        assert!(matches!(err, TemplateError::Compile(_)), "{err}");
    }

    /// A ChatML template in the style of Qwen's (a system default, a branch per role).
    const CHATML: &str = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    /// Image parts reach the template as Hugging Face's vision templates expect them, in the
    /// style of Qwen-VL's: a string content stays a string, and parts keep their order.
    #[test]
    fn image_parts_reach_the_template_as_typed_parts() {
        let src = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}{{- message.content }}{%- else %}{%- for part in message.content %}{%- if part.type == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif 'text' in part %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}{{- '<|im_start|>assistant\\n' }}";
        let t = ChatTemplate::new(Some(src.into()), None, None).unwrap();
        let messages = vec![
            msgs()[0].clone(),
            Message::new(
                "user",
                Content::Parts(vec![
                    Part::Image,
                    Part::Text {
                        text: "What is this?".into(),
                    },
                    Part::Image,
                ]),
            ),
        ];
        assert_eq!(
            t.render(&messages).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
        );
        // The fallback shows the text parts.
        let plain = ChatTemplate::fallback().render(&messages[1..]).unwrap();
        assert_eq!(plain, "user: What is this?\nassistant:");
    }

    /// Tools, tool calls and tool messages through [`super::CHATML`]: the expected strings are
    /// transformers' `render_jinja_template` of the same template and messages (with the
    /// arguments as objects, as the template receives them here from JSON text).
    #[test]
    fn chatml_renders_tools_as_transformers_and_qwen_do() {
        let call = |id: &str, args: &str| MessageToolCall {
            id: Some(id.into()),
            name: "get_weather".into(),
            arguments: args.into(),
        };
        let tool = |id: &str, content: &str| Message {
            tool_call_id: Some(id.into()),
            ..Message::new("tool", content)
        };
        let messages = vec![
            Message::new("system", "Be brief."),
            Message::new("user", "Weather in Paris and Nice?"),
            Message {
                tool_calls: vec![
                    call("call_0", r#"{"city": "Paris", "unit": "°C"}"#),
                    call("call_1", r#"{"city":"Nice"}"#),
                ],
                ..Message::new("assistant", "Let me check.")
            },
            tool("call_0", "21"),
            tool("call_1", "24"),
            Message {
                tool_calls: vec![call("call_2", r#"{"city": "Lyon"}"#)],
                ..Message::new("assistant", "")
            },
            tool("call_2", "19"),
        ];
        let tools = Tools::from_json(
            r#"[{"type": "function", "function": {"name": "get_weather", "description": "The weather in the user's city <now>", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#,
        )
        .unwrap();
        let t = ChatTemplate::new(Some(super::CHATML.into()), None, None).unwrap();
        let cancel = AtomicBool::new(false);
        let out = t
            .render_request(&messages, Some(&tools), true, &cancel)
            .unwrap();
        assert_eq!(out, "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The weather in the user's city <now>\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris and Nice?<|im_end|>\n<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Nice\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n24\n</tool_response><|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
        let out = t
            .render_request(&messages[1..3], None, false, &cancel)
            .unwrap();
        assert_eq!(out, "<|im_start|>user\nWeather in Paris and Nice?<|im_end|>\n<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Nice\"}}\n</tool_call><|im_end|>\n");
        // Without tool use, ChatML is what it was.
        assert_eq!(
            t.render(&msgs()).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\n"
        );
        // The fallback writes the calls after the text and refuses tools.
        let plain = ChatTemplate::fallback();
        assert_eq!(
            plain.render(&messages[5..7]).unwrap(),
            "assistant: <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call>\ntool: 19\nassistant:"
        );
        let err = plain.render_request(&messages, Some(&tools), true, &cancel);
        assert!(matches!(err, Err(TemplateError::Render(_))), "{err:?}");
    }

    #[test]
    fn tool_call_arguments_keep_the_models_order_in_pythons_form() {
        let args = |call: &str| tool_call_arguments(call);
        assert_eq!(
            args(r#" {"name": "f", "arguments": {"z":1,"a":[1.0,"é"]}} "#).as_deref(),
            Some(r#"{"z": 1, "a": [1.0, "é"]}"#)
        );
        assert_eq!(
            args(r#"{"name": "f", "arguments": "{\"b\":2,\"a\":1}"}"#).as_deref(),
            Some(r#"{"b": 2, "a": 1}"#)
        );
        assert_eq!(args(r#"{"name": "f"}"#).as_deref(), Some("{}"));
        assert_eq!(
            args(r#"{"name": "f", "parameters": {"x": null}}"#).as_deref(),
            Some(r#"{"x": null}"#)
        );
        assert_eq!(args("[1]"), None);
    }

    /// A `tokenizer_config.json` with a template named `tool_use` renders it for requests with
    /// tools, as transformers does.
    #[test]
    fn the_tool_use_template_is_rendered_for_requests_with_tools() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({"chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "{% for t in tools %}{{ t.function.name }}{% endfor %}"}
        ]});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::load(dir.path()).unwrap();
        let tools =
            Tools::from_json(r#"[{"type": "function", "function": {"name": "f"}}]"#).unwrap();
        let cancel = AtomicBool::new(false);
        assert_eq!(
            t.render_request(&msgs(), Some(&tools), true, &cancel)
                .unwrap(),
            "f"
        );
        assert_eq!(
            t.render_request(&msgs(), None, true, &cancel).unwrap(),
            "plain"
        );
    }

    #[test]
    fn a_real_template_renders_a_full_size_request_within_the_limits() {
        // 2 MiB of messages, the most a request body holds.
        let many: Vec<Message> = (0..2048)
            .map(|i| {
                Message::new(
                    if i % 2 == 0 { "user" } else { "assistant" },
                    "x".repeat(1000),
                )
            })
            .collect();
        let t = ChatTemplate::new(Some(CHATML.into()), None, None).unwrap();
        let out = t.render(&many).unwrap();
        assert!(out.len() > 2_000_000 && out.ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn endless_templates_stop_at_their_limits() {
        let endless = |body: &str| {
            ChatTemplate::new(
                Some(format!(
                    "{{% for a in range(100000) %}}{{% for b in range(100000) %}}{body}{{% endfor %}}{{% endfor %}}"
                )),
                None,
                None,
            )
            .unwrap()
        };
        let limit = |t: &ChatTemplate| match t.render(&msgs()) {
            Err(TemplateError::Limit(m)) => m,
            other => panic!("not a limit: {other:?}"),
        };
        // Writing nothing: the fuel ends it.
        let quiet = endless("");
        assert!(limit(&quiet).contains("ran out of fuel"));
        // Writing: the fuel or the output cap, whichever comes first.
        let loud = endless("{{ messages[0].content * 100 }}");
        let m = limit(&loud);
        assert!(m.contains("fuel") && m.contains("bytes of output"), "{m}");
        let capped = endless("{{ messages[0].content * 100 }}").with_limits(RenderLimits {
            max_output_bytes: 1000,
            ..RenderLimits::default()
        });
        assert!(limit(&capped).contains("output passed 1000 bytes"));
        let slow = endless("x").with_limits(RenderLimits {
            fuel: u64::MAX / 128,
            max_output_bytes: usize::MAX,
            max_time: Duration::from_millis(200),
        });
        assert!(limit(&slow).contains("ran past 0.2 s"));
        // A cancelled render stops at its next write.
        let cancel = AtomicBool::new(true);
        assert!(matches!(
            loud.render_cancellable(&msgs(), &cancel),
            Err(TemplateError::Cancelled)
        ));
        let err = TemplateError::Limit(String::new()).to_string();
        assert!(err.starts_with("the chat template exceeded its limits"));
    }

    #[test]
    fn the_fallback_and_tokenizer_config_forms() {
        assert_eq!(
            ChatTemplate::fallback().render(&msgs()).unwrap(),
            "system: Be brief.\nuser:  Hi \nassistant:"
        );
        let dir = std::env::temp_dir().join(format!("anneal-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({
            "bos_token": {"content": "<B>", "lstrip": false},
            "eos_token": "<E>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[1].content }}{{ eos_token }}"}
            ]
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::load(&dir).unwrap();
        assert!(!t.is_fallback());
        assert_eq!(t.render(&msgs()).unwrap(), "<B> Hi <E>");
        std::fs::write(dir.join("chat_template.jinja"), "{{ messages|length }}").unwrap();
        assert_eq!(
            ChatTemplate::load(&dir).unwrap().render(&msgs()).unwrap(),
            "2"
        );
        std::fs::write(dir.join("tokenizer_config.json"), "{").unwrap();
        let err = ChatTemplate::load(&dir).err().unwrap().to_string();
        assert!(
            err.contains("tokenizer_config.json: not valid JSON"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(ChatTemplate::load(&dir).unwrap().is_fallback());
    }
}
