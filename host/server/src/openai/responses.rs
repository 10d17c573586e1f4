//! Response bodies and stream chunks, in the shapes OpenAI documents for `/v1/completions`
//! (`text_completion`) and `/v1/chat/completions` (`chat.completion`,
//! `chat.completion.chunk`).

use super::generate::{TokenLogprob, TokenText, Update, Usage};
use super::request::Api;
use super::tool_calls;
use serde_json::{json, Value};

/// What every body and chunk of one response shares.
pub struct Header {
    /// `cmpl-…` / `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// Which endpoint.
    pub api: Api,
}

impl Header {
    /// A fresh header for a response of `model` on `api`.
    pub fn new(api: Api, model: &str) -> Header {
        use std::hash::{BuildHasher, RandomState};
        let now = std::time::SystemTime::now();
        let created = now
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let prefix = match api {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
        };
        Header {
            id: format!("{prefix}-{:016x}", RandomState::new().hash_one(now)),
            created,
            model: model.to_string(),
            api,
        }
    }

    fn object(&self, streaming: bool) -> &'static str {
        match (self.api, streaming) {
            (Api::Completions, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, streaming: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(streaming),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// OpenAI's `usage` object.
pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.prompt + u.completion,
    })
}

/// Logprobs of some tokens of one choice, in the endpoint's shape. Chat entries carry each
/// token's exact `bytes`; the completions endpoint's `top_logprobs` maps are keyed by text, so
/// an alternative whose text an earlier one already took is keyed `token_id:<id>` (texts of
/// bytes that are not UTF-8 are `bytes:\xNN...`, so that only happens for two tokens of
/// the same bytes).
fn logprobs_json(api: Api, tokens: &[TokenLogprob]) -> Value {
    match api {
        Api::Completions => json!({
            "tokens": tokens.iter().map(|t| &t.token.text).collect::<Vec<_>>(),
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": tokens.iter().map(|t| top_map(&t.top)).collect::<Vec<_>>(),
            "text_offset": tokens.iter().map(|t| t.offset).collect::<Vec<_>>(),
        }),
        Api::Chat => {
            let entry = |t: &TokenText, lp: f32| json!({ "token": t.text, "logprob": lp, "bytes": t.bytes });
            json!({ "content": tokens.iter().map(|t| {
                let mut e = entry(&t.token, t.logprob);
                e["top_logprobs"] = t.top.iter().map(|(s, lp)| entry(s, *lp)).collect();
                e
            }).collect::<Vec<_>>() })
        }
    }
}

/// The completions endpoint's map of alternatives, one key per alternative.
fn top_map(top: &[(TokenText, f32)]) -> serde_json::Map<String, Value> {
    let mut map = serde_json::Map::new();
    for (t, lp) in top {
        let key = if map.contains_key(&t.text) {
            format!("token_id:{}", t.id)
        } else {
            t.text.clone()
        };
        map.insert(key, json!(lp));
    }
    map
}

/// One choice collected for a non-streaming response.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<&'static str>,
}

/// Gathers the updates of a non-streaming request into its response body.
pub struct Collector {
    choices: Vec<Choice>,
    logprobs: bool,
    tool_calls: bool,
}

impl Collector {
    /// For `n` choices; `logprobs` says whether the request asked for them.
    pub fn new(n: usize, logprobs: bool) -> Collector {
        Collector {
            choices: (0..n).map(|_| Choice::default()).collect(),
            logprobs,
            tool_calls: false,
        }
    }

    /// Chat choices read their tool calls out of their text (a request with tools).
    pub fn with_tool_calls(mut self, on: bool) -> Collector {
        self.tool_calls = on;
        self
    }

    /// Takes one update.
    pub fn add(&mut self, update: Update) {
        match update {
            Update::Delta {
                index,
                text,
                logprobs,
            } => {
                self.choices[index].text.push_str(&text);
                self.choices[index].logprobs.extend(logprobs);
            }
            Update::Finish { index, reason } => self.choices[index].finish = Some(reason),
        }
    }

    /// The response body.
    pub fn body(self, header: &Header, usage: Usage) -> Value {
        let api = header.api;
        let choices = self
            .choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let logprobs = if self.logprobs {
                    logprobs_json(api, &c.logprobs)
                } else {
                    Value::Null
                };
                match api {
                    Api::Completions => json!({
                        "index": index, "text": c.text, "logprobs": logprobs,
                        "finish_reason": c.finish,
                    }),
                    Api::Chat => {
                        let (message, finish) = if self.tool_calls {
                            tool_calls::message(c.text, c.finish)
                        } else {
                            (json!({ "role": "assistant", "content": c.text }), c.finish)
                        };
                        json!({
                            "index": index, "message": message,
                            "logprobs": logprobs, "finish_reason": finish,
                        })
                    }
                }
            })
            .collect();
        let mut body = header.wrap(false, choices);
        body["usage"] = usage_json(usage);
        body
    }
}

/// The stream chunk for one update.
pub fn chunk(header: &Header, update: &Update, logprobs: bool) -> Value {
    let api = header.api;
    let choice = match update {
        Update::Delta {
            index,
            text,
            logprobs: lps,
        } => {
            let lp = if logprobs {
                logprobs_json(api, lps)
            } else {
                Value::Null
            };
            match api {
                Api::Completions => {
                    json!({ "index": index, "text": text, "logprobs": lp, "finish_reason": null })
                }
                Api::Chat => json!({
                    "index": index, "delta": { "content": text }, "logprobs": lp,
                    "finish_reason": null,
                }),
            }
        }
        Update::Finish { index, reason } => match api {
            Api::Completions => {
                json!({ "index": index, "text": "", "logprobs": null, "finish_reason": reason })
            }
            Api::Chat => {
                json!({ "index": index, "delta": {}, "logprobs": null, "finish_reason": reason })
            }
        },
    };
    header.wrap(true, vec![choice])
}

/// A chat choice's tool calls as one stream chunk (`delta.tool_calls`, each entry with its
/// `index`, `id`, `type` and the whole `function`), sent before its finish chunk.
pub fn tool_calls_chunk(header: &Header, index: usize, calls: Vec<Value>) -> Value {
    header.wrap(
        true,
        vec![json!({
            "index": index, "delta": { "tool_calls": calls },
            "logprobs": null, "finish_reason": null,
        })],
    )
}

/// The first chunk of each chat choice: the assistant's role.
pub fn role_chunk(header: &Header, index: usize) -> Value {
    header.wrap(
        true,
        vec![json!({
            "index": index, "delta": { "role": "assistant", "content": "" },
            "logprobs": null, "finish_reason": null,
        })],
    )
}

/// The last chunk when the client asked for `stream_options.include_usage`.
pub fn usage_chunk(header: &Header, usage: Usage) -> Value {
    let mut c = header.wrap(true, vec![]);
    c["usage"] = usage_json(usage);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(id: i64, text: &str, bytes: &[u8]) -> TokenText {
        TokenText {
            id,
            text: text.into(),
            bytes: bytes.to_vec(),
        }
    }

    #[test]
    fn alternatives_keep_their_bytes_and_unique_keys() {
        let top = vec![
            (t(5, "a", b"a"), -0.5),
            (t(200, "bytes:\\xe2", &[0xe2]), -1.0),
            (t(201, "bytes:\\x80", &[0x80]), -1.5),
            (t(9, "a", b"a"), -2.0),
        ];
        let tokens = [TokenLogprob {
            token: t(5, "a", b"a"),
            logprob: -0.5,
            offset: 0,
            top,
        }];
        let legacy = logprobs_json(Api::Completions, &tokens);
        let map = legacy["top_logprobs"][0].as_object().unwrap();
        let keys: Vec<&str> = map.keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 4, "{legacy}");
        for key in ["a", "bytes:\\xe2", "bytes:\\x80", "token_id:9"] {
            assert!(map.contains_key(key), "{key}: {legacy}");
        }
        let chat = logprobs_json(Api::Chat, &tokens);
        let alts = chat["content"][0]["top_logprobs"].as_array().unwrap();
        assert_eq!(alts.len(), 4);
        assert_eq!(alts[1]["bytes"], json!([0xe2]));
        assert_eq!(alts[2]["token"], "bytes:\\x80");
    }
}
