//! Chat templates: how a list of messages becomes one prompt string.
//!
//! A Hugging Face model ships its template as Jinja, in `chat_template.jinja` or in the
//! `chat_template` of `tokenizer_config.json` (a string, or a list of named templates of which
//! `default` is used). It is rendered as `transformers` renders it: with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python string/dict methods, `raise_exception(msg)`, and the
//! variables `messages`, `add_generation_prompt` (always true: the model writes the next
//! assistant turn), `bos_token` and `eos_token` (from `tokenizer_config.json`).
//!
//! Without a template the prompt is one line per message, `<role>: <content>`, then
//! `assistant:` (the documented fallback, fit for models trained on plain text).

use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One chat message, as the template sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text (content parts already joined).
    pub content: String,
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
}

/// A model's chat template (or the fallback format).
pub struct ChatTemplate {
    env: Option<Environment<'static>>,
    bos: String,
    eos: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// The fallback: `<role>: <content>` lines, then `assistant:`.
    pub fn fallback() -> ChatTemplate {
        ChatTemplate {
            env: None,
            bos: String::new(),
            eos: String::new(),
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

    /// A Jinja template (or the fallback for `None`) with the tokenizer's BOS and EOS texts.
    pub fn new(
        source: Option<String>,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<ChatTemplate, TemplateError> {
        let Some(source) = source else {
            return Ok(ChatTemplate::fallback());
        };
        let mut env = Environment::new();
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
        })
    }

    /// True when the model has no template of its own.
    pub fn is_fallback(&self) -> bool {
        self.env.is_none()
    }

    /// The prompt for `messages`, ending where the assistant's reply starts.
    pub fn render(&self, messages: &[Message]) -> Result<String, TemplateError> {
        let Some(env) = &self.env else {
            let mut out: String = messages
                .iter()
                .map(|m| format!("{}: {}\n", m.role, m.content))
                .collect();
            out.push_str("assistant:");
            return Ok(out);
        };
        let template = env
            .get_template(NAME)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => true,
                bos_token => &self.bos,
                eos_token => &self.eos,
            })
            .map_err(|e| TemplateError::Render(describe(&e)))
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
