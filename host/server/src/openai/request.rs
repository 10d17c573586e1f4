//! Reading and checking request bodies: each field by name, so an error names the field
//! (`param`) the way OpenAI's do, and every limit is checked before anything is queued.

use super::error::{OaiError, OaiResult, MAX_REQUEST_BYTES};
use super::images::{ImageUrl, MAX_IMAGES};
use super::models::ServedModel;
use super::template::{Content, Message, MessageToolCall, Part, Tools};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// A JSON object body.
pub struct Body(Map<String, Value>);

impl Body {
    /// Parses the raw body; anything but a JSON object is a 400.
    pub fn parse(bytes: &[u8]) -> OaiResult<Body> {
        match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(map)) => Ok(Body(map)),
            Ok(_) => Err(OaiError::invalid(None, "the body must be a JSON object")),
            Err(e) => Err(OaiError::invalid(
                None,
                format!("the body is not valid JSON: {e}"),
            )),
        }
    }

    /// Field `key` as `T`; absent or `null` is `None`.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> OaiResult<Option<T>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|e| OaiError::invalid(Some(key), format!("`{key}`: {e} (got {v})"))),
        }
    }

    /// A field that must be present.
    pub fn require<T: DeserializeOwned>(&self, key: &str) -> OaiResult<T> {
        self.get(key)?
            .ok_or_else(|| OaiError::invalid(Some(key), format!("`{key}` is required")))
    }

    /// The raw value of a field (`None` when absent or `null`).
    pub fn raw(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
}

/// Which endpoint a request came to (they differ in defaults and in a few fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// The sampling and output settings of a request, checked.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// `max_tokens` as asked (`None`: the endpoint's default).
    pub max_tokens: Option<usize>,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Nucleus threshold in (0, 1].
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = all); an extension, as in vLLM.
    pub top_k: usize,
    /// Completions per prompt.
    pub n: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Seed of choice 0 (choice `j` uses `seed + j`); random when not given.
    pub seed: Option<u64>,
    /// Answer as server-sent events.
    pub stream: bool,
    /// With `stream`, end with a chunk carrying the usage.
    pub include_usage: bool,
    /// Report logprobs, with this many alternatives per token.
    pub logprobs: Option<usize>,
}

/// Most completions per prompt.
pub const MAX_N: usize = 16;
/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 64;
/// Most alternatives per token in logprobs (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl GenOptions {
    /// Reads and checks the fields both endpoints share, and the endpoint's own.
    pub fn parse(body: &Body, api: Api) -> OaiResult<GenOptions> {
        let max_tokens = match api {
            Api::Completions => body.get::<i64>("max_tokens")?,
            Api::Chat => match body.get::<i64>("max_completion_tokens")? {
                Some(m) => Some(m),
                None => body.get::<i64>("max_tokens")?,
            },
        };
        let max_tokens = match max_tokens {
            Some(m) if m < 1 => {
                return Err(OaiError::invalid(
                    Some("max_tokens"),
                    format!("`max_tokens` must be at least 1, got {m}"),
                ))
            }
            m => m.map(|m| m as usize),
        };
        let SamplingFields {
            temperature,
            top_p,
            top_k,
            seed,
        } = SamplingFields::parse(body)?;
        let n = body.get::<i64>("n")?.unwrap_or(1);
        if !(1..=MAX_N as i64).contains(&n) {
            return Err(OaiError::invalid(
                Some("n"),
                format!("`n` must be between 1 and {MAX_N}, got {n}"),
            ));
        }
        let stop = match body.raw("stop") {
            None => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(list)) => list
                .iter()
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    OaiError::invalid(Some("stop"), "`stop` must be a string or a list of strings")
                })?,
            Some(_) => {
                return Err(OaiError::invalid(
                    Some("stop"),
                    "`stop` must be a string or a list of strings",
                ))
            }
        };
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(OaiError::invalid(
                Some("stop"),
                "`stop` takes up to 4 non-empty strings",
            ));
        }
        let stream = body.get::<bool>("stream")?.unwrap_or(false);
        let include_usage = body
            .raw("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        for key in ["presence_penalty", "frequency_penalty"] {
            if body.get::<f64>(key)?.is_some_and(|p| p != 0.0) {
                return Err(OaiError::unsupported(key, "only 0"));
            }
        }
        if body
            .raw("logit_bias")
            .is_some_and(|b| b.as_object().is_none_or(|m| !m.is_empty()))
        {
            return Err(OaiError::unsupported("logit_bias", "only {}"));
        }
        let logprobs = match api {
            Api::Completions => {
                if body.get::<bool>("echo")?.unwrap_or(false) {
                    return Err(OaiError::unsupported("echo", "only false"));
                }
                if body.raw("suffix").is_some() {
                    return Err(OaiError::unsupported("suffix", "no insertion"));
                }
                if body.get::<i64>("best_of")?.is_some_and(|b| b != n) {
                    return Err(OaiError::unsupported("best_of", "only equal to n"));
                }
                body.get::<i64>("logprobs")?
                    .map(|k| check_top("logprobs", k))
                    .transpose()?
            }
            Api::Chat => {
                for key in ["functions", "function_call"] {
                    if body.raw(key).is_some() {
                        return Err(OaiError::unsupported(key, "the legacy form: send `tools`"));
                    }
                }
                let format = body.raw("response_format").and_then(|f| f.get("type"));
                if format.is_some_and(|t| t != "text") {
                    return Err(OaiError::unsupported("response_format", "only text"));
                }
                let top = body
                    .get::<i64>("top_logprobs")?
                    .map(|k| check_top("top_logprobs", k))
                    .transpose()?;
                match (body.get::<bool>("logprobs")?.unwrap_or(false), top) {
                    (true, top) => Some(top.unwrap_or(0)),
                    (false, Some(_)) => {
                        return Err(OaiError::invalid(
                            Some("top_logprobs"),
                            "`top_logprobs` needs `logprobs: true`",
                        ))
                    }
                    (false, None) => None,
                }
            }
        };
        Ok(GenOptions {
            max_tokens,
            temperature,
            top_p,
            top_k,
            n: n as usize,
            stop,
            seed,
            stream,
            include_usage,
            logprobs,
        })
    }
}

/// The sampling fields every generating endpoint reads, checked: `temperature` (0 to 2, default
/// 1), `top_p` (in (0, 1], default 1), `top_k` (0 or -1 = all) and `seed`.
pub struct SamplingFields {
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Nucleus threshold.
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// The seed, when given.
    pub seed: Option<u64>,
}

impl SamplingFields {
    /// Reads and checks the fields.
    pub fn parse(body: &Body) -> OaiResult<SamplingFields> {
        let temperature = body.get::<f64>("temperature")?.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(OaiError::invalid(
                Some("temperature"),
                format!("`temperature` must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = body.get::<f64>("top_p")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(OaiError::invalid(
                Some("top_p"),
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match body.get::<i64>("top_k")?.unwrap_or(0) {
            k if k >= 0 => k as usize,
            -1 => 0,
            k => {
                return Err(OaiError::invalid(
                    Some("top_k"),
                    format!("`top_k` must be -1, 0 (all) or positive, got {k}"),
                ))
            }
        };
        Ok(SamplingFields {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed: body.get::<i64>("seed")?.map(|s| s as u64),
        })
    }
}

fn check_top(key: &str, k: i64) -> OaiResult<usize> {
    if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) {
        Ok(k as usize)
    } else {
        Err(OaiError::invalid(
            Some(key),
            format!("`{key}` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        ))
    }
}

/// The prompts of a completions request as token ids: `prompt` is a string, a list of strings,
/// a list of token ids or a list of such lists.
pub fn completion_prompts(body: &Body, model: &ServedModel) -> OaiResult<Vec<Vec<i64>>> {
    let bad = || {
        OaiError::invalid(
            Some("prompt"),
            "`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let ids = |v: &Value| -> OaiResult<Vec<i64>> {
        v.as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|t| t.as_i64().ok_or_else(bad))
            .collect()
    };
    let prompts = match body.raw("prompt") {
        None => return Err(OaiError::invalid(Some("prompt"), "`prompt` is required")),
        Some(Value::String(s)) => vec![encode(model, s, "prompt")?],
        Some(Value::Array(list)) if list.is_empty() => return Err(bad()),
        Some(Value::Array(list)) => match &list[0] {
            Value::String(_) => list
                .iter()
                .map(|s| encode(model, s.as_str().ok_or_else(bad)?, "prompt"))
                .collect::<OaiResult<_>>()?,
            Value::Number(_) => vec![ids(body.raw("prompt").ok_or_else(bad)?)?],
            Value::Array(_) => list.iter().map(ids).collect::<OaiResult<_>>()?,
            _ => return Err(bad()),
        },
        Some(_) => return Err(bad()),
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(OaiError::invalid(
            Some("prompt"),
            format!("at most {MAX_PROMPTS} prompts per request"),
        ));
    }
    Ok(prompts)
}

/// The messages of a chat request and the images its parts carry, in order.
pub struct ChatInput {
    /// The messages as the template sees them.
    pub messages: Vec<Message>,
    /// The `image_url` parts, in the order the template meets them.
    pub images: Vec<ImageUrl>,
    /// The tools the template is given (its `tools` variable).
    pub tools: Option<Tools>,
    /// End the prompt where the assistant's reply starts (always, for a completion).
    pub add_generation_prompt: bool,
}

/// A chat request's tool use: `tools` (OpenAI's function definitions) and `tool_choice`.
pub struct ChatTools {
    /// The tools, as sent (keys in their order).
    pub tools: Tools,
    /// Read tool calls out of the completion (`tool_choice` `auto`); `none` leaves the text as
    /// it is.
    pub parse_calls: bool,
}

/// The `tools` and `tool_choice` of a chat request. `tools` must be a list of
/// `{"type": "function", "function": {"name", ...}}`; `tool_choice` is `auto` (the default) or
/// `none`: `required` and a named function (forcing a call) are refused, as are tools for a
/// request that gives none. `bytes` is the raw body, read again so that every object of the
/// tools keeps its keys in the order they were sent (what the template writes).
pub fn chat_tools(body: &Body, bytes: &[u8]) -> OaiResult<Option<ChatTools>> {
    let choice = match body.raw("tool_choice") {
        None => "auto",
        Some(Value::String(s)) if s == "auto" || s == "none" => s.as_str(),
        Some(Value::String(s)) if s == "required" => {
            return Err(OaiError::unsupported(
                "tool_choice",
                "`auto` or `none`: a call cannot be forced",
            ))
        }
        Some(Value::Object(_)) => {
            return Err(OaiError::unsupported(
                "tool_choice",
                "`auto` or `none`: a named function cannot be forced",
            ))
        }
        Some(v) => {
            return Err(OaiError::invalid(
                Some("tool_choice"),
                format!("`tool_choice` must be \"auto\" or \"none\", got {v}"),
            ))
        }
    };
    body.get::<bool>("parallel_tool_calls")?;
    let list = match body.raw("tools") {
        None => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(OaiError::invalid(Some("tools"), "`tools` must be a list")),
    };
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let named = tool.get("type").and_then(Value::as_str) == Some("function")
            && tool
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
        if !named {
            return Err(OaiError::invalid(
                Some(&param),
                format!(
                    "`{param}` must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}"
                ),
            ));
        }
    }
    if list.is_empty() {
        return Ok(None);
    }
    #[derive(serde::Deserialize)]
    struct Ordered {
        tools: Tools,
    }
    let tools = serde_json::from_slice::<Ordered>(bytes)
        .map_err(|e| OaiError::invalid(Some("tools"), format!("`tools`: {e}")))?
        .tools;
    Ok(Some(ChatTools {
        tools,
        parse_calls: choice == "auto",
    }))
}

/// The `tool_calls` of an assistant message: `[{"id", "type": "function", "function":
/// {"name", "arguments"}}]`, the arguments JSON text (an object is taken too).
fn message_tool_calls(m: &Value, param: &str) -> OaiResult<Vec<MessageToolCall>> {
    let list = match m.get("tool_calls") {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(list)) => list,
        Some(_) => {
            return Err(OaiError::invalid(
                Some(param),
                format!("`{param}.tool_calls` must be a list"),
            ))
        }
    };
    list.iter()
        .enumerate()
        .map(|(j, call)| {
            let at = format!("{param}.tool_calls[{j}]");
            let bad = || {
                OaiError::invalid(
                    Some(&at),
                    format!("`{at}` must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"),
                )
            };
            let function = call.get("function").ok_or_else(bad)?;
            let name = function.get("name").and_then(Value::as_str).ok_or_else(bad)?;
            let arguments = match function.get("arguments") {
                Some(Value::String(text)) => text.clone(),
                None | Some(Value::Null) => "{}".into(),
                Some(v @ Value::Object(_)) => v.to_string(),
                Some(_) => return Err(bad()),
            };
            Ok(MessageToolCall {
                id: call.get("id").and_then(Value::as_str).map(str::to_owned),
                name: name.to_owned(),
                arguments,
            })
        })
        .collect()
}

/// The chat messages of a request; `content` may be a string or a list of parts: `text`, and
/// `image_url` (`{"url": "data:image/png;base64,..."}`, as OpenAI's clients send images).
/// A message with images shows the template its parts; others keep their text joined.
pub fn chat_messages(body: &Body) -> OaiResult<ChatInput> {
    let list: Vec<Value> = body.require("messages")?;
    if list.is_empty() {
        return Err(OaiError::invalid(
            Some("messages"),
            "`messages` must have at least one message",
        ));
    }
    let mut images = Vec::new();
    let mut text_bytes = 0;
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages[{i}]");
        let bad = |what: &str| OaiError::invalid(Some(&param), format!("`{param}`: {what}"));
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("needs a string `role`"))?;
        let content = match m.get("content") {
            None | Some(Value::Null) => Content::Text(String::new()),
            Some(Value::String(s)) => Content::Text(s.clone()),
            Some(Value::Array(items)) => {
                let mut parts = Vec::with_capacity(items.len());
                for (j, p) in items.iter().enumerate() {
                    let param = format!("{param}.content[{j}]");
                    let bad =
                        |what: &str| OaiError::invalid(Some(&param), format!("`{param}`: {what}"));
                    match p.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            let text = p
                                .get("text")
                                .and_then(Value::as_str)
                                .ok_or_else(|| bad("a text part needs `text`"))?;
                            parts.push(Part::Text { text: text.into() });
                        }
                        Some("image_url") => {
                            let url = p.get("image_url").and_then(|u| match u {
                                Value::String(s) => Some(s.as_str()),
                                u => u.get("url")?.as_str(),
                            });
                            let url = url.ok_or_else(|| {
                                bad("an image_url part needs `image_url: {\"url\": ...}`")
                            })?;
                            images.push(ImageUrl {
                                param,
                                url: url.into(),
                            });
                            parts.push(Part::Image);
                        }
                        _ => {
                            return Err(bad("only text and image_url content parts are supported"))
                        }
                    }
                }
                if parts.contains(&Part::Image) {
                    Content::Parts(parts)
                } else {
                    Content::Text(Content::Parts(parts).text())
                }
            }
            Some(_) => return Err(bad("`content` must be a string or a list of parts")),
        };
        text_bytes += content.text().len();
        let text_of = |key: &str| -> OaiResult<Option<String>> {
            match m.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(&format!("`{key}` must be a string"))),
            }
        };
        messages.push(Message {
            tool_calls: message_tool_calls(m, &param)?,
            tool_call_id: text_of("tool_call_id")?,
            name: text_of("name")?,
            ..Message::new(role, content)
        });
    }
    if text_bytes > MAX_REQUEST_BYTES {
        return Err(OaiError::invalid(
            Some("messages"),
            format!("the messages hold more than {MAX_REQUEST_BYTES} bytes of text"),
        ));
    }
    if images.len() > MAX_IMAGES {
        return Err(OaiError::invalid(
            Some("messages"),
            format!(
                "the messages hold {} images; at most {MAX_IMAGES} per request",
                images.len()
            ),
        ));
    }
    Ok(ChatInput {
        messages,
        images,
        tools: None,
        add_generation_prompt: true,
    })
}

/// Token ids of `text` with the model's tokenizer.
pub fn encode(model: &ServedModel, text: &str, param: &str) -> OaiResult<Vec<i64>> {
    let ids = model
        .tokenizer
        .encode(text)
        .map_err(|e| OaiError::invalid(Some(param), format!("cannot tokenize `{param}`: {e}")))?;
    Ok(ids.into_iter().map(i64::from).collect())
}

/// The number of new tokens a prompt may get: `max_tokens` (or the endpoint's default), capped
/// so that prompt + completion fit in the context. A prompt that fills the context is a 400.
pub fn token_budget(
    prompt_len: usize,
    model: &ServedModel,
    opts: &GenOptions,
    api: Api,
) -> OaiResult<usize> {
    let param = match api {
        Api::Completions => "prompt",
        Api::Chat => "messages",
    };
    if prompt_len == 0 {
        return Err(OaiError::invalid(Some(param), "the prompt is empty"));
    }
    if prompt_len >= model.context {
        return Err(OaiError::invalid(
            Some(param),
            format!(
                "This model's maximum context length is {} tokens, but the prompt has {prompt_len} tokens",
                model.context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = model.context - prompt_len;
    let default = match api {
        // OpenAI's default for the legacy endpoint.
        Api::Completions => 16,
        Api::Chat => room,
    };
    Ok(opts.max_tokens.unwrap_or(default).min(room))
}
