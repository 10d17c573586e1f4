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

/// One chat message, as the template sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// Its text, or its parts when it holds images.
    pub content: Content,
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
    bos: String,
    eos: String,
    limits: RenderLimits,
}

const NAME: &str = "chat";

/// The chat template of tokenizers trained here on chat data: ChatML as Qwen writes it, each
/// message `<|im_start|>role\n...<|im_end|>\n`, an image part as
/// `<|vision_start|><|image_pad|><|vision_end|>` (one placeholder, expanded to the image's
/// tokens after tokenizing).
pub const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{% if message.content is string %}{{ message.content }}{% else %}\
{% for part in message.content %}{% if part.type == 'image' %}\
<|vision_start|><|image_pad|><|vision_end|>{% elif part.type == 'text' %}{{ part.text }}\
{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

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
            template_in_config(&config)
        };
        let token = |key: &str| special_token(config.get(key));
        ChatTemplate::new(source, token("bos_token"), token("eos_token"))
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
        env.add_template_owned(NAME, source)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env: Some(env),
            bos: bos.unwrap_or_default(),
            eos: eos.unwrap_or_default(),
            limits,
        })
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
        self.render_with(messages, false, &AtomicBool::new(false))
    }

    /// [`ChatTemplate::render`] that stops, failing with [`TemplateError::Cancelled`], once
    /// `cancel` is set. Renders take long only by looping, so call this off async workers.
    pub fn render_cancellable(
        &self,
        messages: &[Message],
        cancel: &AtomicBool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, true, cancel)
    }

    fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        cancel: &AtomicBool,
    ) -> Result<String, TemplateError> {
        let Some(env) = &self.env else {
            let mut out: String = messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content.text()))
                .collect();
            if add_generation_prompt {
                out.push_str("assistant:");
            }
            return Ok(out);
        };
        let template = env
            .get_template(NAME)
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

/// `chat_template` of a `tokenizer_config.json`: a string, or a list of `{name, template}` of
/// which `default` (else the first) is used.
fn template_in_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(n))
            };
            named("default")
                .or(list.first())
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_owned)
        }
        _ => None,
    }
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
            Message {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            Message {
                role: "user".into(),
                content: " Hi ".into(),
            },
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
            Message {
                role: "user".into(),
                content: Content::Parts(vec![
                    Part::Image,
                    Part::Text {
                        text: "What is this?".into(),
                    },
                    Part::Image,
                ]),
            },
        ];
        assert_eq!(
            t.render(&messages).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
        );
        // The fallback shows the text parts.
        let plain = ChatTemplate::fallback().render(&messages[1..]).unwrap();
        assert_eq!(plain, "user: What is this?\nassistant:");
    }

    #[test]
    fn a_real_template_renders_a_full_size_request_within_the_limits() {
        // 2 MiB of messages, the most a request body holds.
        let many: Vec<Message> = (0..2048)
            .map(|i| Message {
                role: if i % 2 == 0 { "user" } else { "assistant" }.into(),
                content: "x".repeat(1000).into(),
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
