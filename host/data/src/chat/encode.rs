//! A conversation as training tokens: rendered by the chat template, tokenized, each token
//! flagged when it belongs to an assistant reply (what the loss is on), each image's one
//! placeholder token expanded to the image's count of merged patches, as transformers'
//! processor expands it.

use std::path::PathBuf;

use rayon::prelude::*;

use super::template::{ChatTemplate, Message};
use super::Conversation;
use crate::image::{load_image_with_limit, ImageProcessor, DEFAULT_MAX_PIXELS};
use crate::tokenizer::TextTokenizer;
use crate::{DataError, Result};

/// How a vision model takes images: the token its template places per image and its
/// processor.
#[derive(Clone, Debug)]
pub struct VisionTokens {
    /// The image placeholder (`<|image_pad|>`'s id).
    pub image_token: u32,
    /// The model's image processor.
    pub processor: ImageProcessor,
}

/// One conversation ready for training.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedChat {
    /// Its tokens, image placeholders expanded.
    pub tokens: Vec<u32>,
    /// Per token: whether it is an assistant token, predicted with a loss.
    pub trained: Vec<bool>,
    /// Its images, in placeholder order.
    pub images: Vec<PathBuf>,
    /// Per image: where its run of placeholders starts and how long it is.
    pub image_spans: Vec<(usize, usize)>,
}

/// Renders and tokenizes conversations for one model.
pub struct ChatEncoder<'a> {
    /// The chat template.
    pub template: &'a ChatTemplate,
    /// The tokenizer.
    pub tokenizer: &'a TextTokenizer,
    /// The model's vision input; `None` for a text-only model, which refuses images.
    pub vision: Option<&'a VisionTokens>,
}

impl ChatEncoder<'_> {
    /// Every conversation encoded (in parallel; the result, and the error of the first bad
    /// conversation, do not depend on the thread count).
    pub fn encode_all(&self, conversations: &[Conversation]) -> Result<Vec<EncodedChat>> {
        let each: Vec<Result<EncodedChat>> =
            conversations.par_iter().map(|c| self.encode(c)).collect();
        each.into_iter().collect()
    }

    /// One conversation. The assistant replies are found by rendering: message `i`'s reply is
    /// what the conversation up to `i` adds to the prompt before it (with the generation
    /// prompt), so it holds the reply's text and its end-of-turn token; a template that does
    /// not render conversations as growing prefixes is refused.
    pub fn encode(&self, c: &Conversation) -> Result<EncodedChat> {
        let bad = |message: String| DataError::Chat {
            origin: c.origin.clone(),
            message,
        };
        let never = std::sync::atomic::AtomicBool::new(false);
        let render = |messages: &[Message], prompt: bool| {
            self.template
                .render_request(messages, c.tools.as_ref(), prompt, &never)
                .map_err(|e| bad(e.to_string()))
        };
        let full = render(&c.messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in c.messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let prompt = render(&c.messages[..i], true)?;
            let upto = render(&c.messages[..=i], false)?;
            if !upto.starts_with(&prompt) || !full.starts_with(&upto) {
                return Err(bad(format!(
                    "the chat template does not render this conversation as growing prefixes \
                     (at message {i}), so the assistant's tokens cannot be told apart"
                )));
            }
            spans.push(prompt.len()..upto.len());
        }
        let (ids, offsets) = self.tokenizer.encode_with_offsets(&full)?;
        let in_reply = |start: usize| spans.iter().any(|s| s.contains(&start));
        let mut tokens = Vec::with_capacity(ids.len());
        let mut trained = Vec::with_capacity(ids.len());
        let mut image_spans = Vec::with_capacity(c.images.len());
        let mut images = c.images.iter();
        for (&id, &(start, _)) in ids.iter().zip(&offsets) {
            match self.vision {
                Some(v) if id == v.image_token => {
                    let path = images.next().ok_or_else(|| {
                        bad(format!(
                            "the template placed more image placeholders than the {} image(s)",
                            c.images.len()
                        ))
                    })?;
                    let n = placeholders(v, path).map_err(|e| bad(e.to_string()))?;
                    image_spans.push((tokens.len(), n));
                    tokens.extend(std::iter::repeat_n(id, n));
                    trained.extend(std::iter::repeat_n(false, n));
                }
                _ => {
                    tokens.push(id);
                    trained.push(in_reply(start));
                }
            }
        }
        if image_spans.len() != c.images.len() {
            return Err(bad(match self.vision {
                None => format!(
                    "it holds {} image(s) but the model reads no images (a text-only model)",
                    c.images.len()
                ),
                Some(_) => format!(
                    "{} image(s) but the chat template placed {} placeholder(s)",
                    c.images.len(),
                    image_spans.len()
                ),
            }));
        }
        Ok(EncodedChat {
            tokens,
            trained,
            images: c.images.clone(),
            image_spans,
        })
    }
}

/// The placeholder tokens of the image at `path`: decoded here (under the pixel limit), so a
/// missing, corrupt or oversized image fails before training starts.
fn placeholders(v: &VisionTokens, path: &std::path::Path) -> Result<usize> {
    let image = load_image_with_limit(path, DEFAULT_MAX_PIXELS)?;
    Ok(v.processor
        .placeholder_tokens(image.height(), image.width())?)
}

#[cfg(test)]
mod tests {
    use super::super::template::{Content, Part, CHATML};
    use super::*;
    use crate::image::ProcessorConfig;

    fn tokenizer() -> TextTokenizer {
        let texts = vec!["What colour is the shape? red green blue".to_string(); 4];
        TextTokenizer::train_bpe_with_specials(&texts, 400, &crate::chat::template::CHATML_SPECIALS)
            .unwrap()
    }

    fn png(path: &std::path::Path, w: u32, h: u32) {
        let img = ::image::RgbImage::from_pixel(w, h, ::image::Rgb([200, 10, 10]));
        img.save(path).unwrap();
    }

    fn conversation(images: Vec<PathBuf>) -> Conversation {
        let mut parts: Vec<Part> = images.iter().map(|_| Part::Image).collect();
        parts.push(Part::Text {
            text: "What colour is the shape?".into(),
        });
        Conversation {
            messages: vec![
                Message::new("user", Content::Parts(parts)),
                Message::new("assistant", "red"),
            ],
            images,
            tools: None,
            origin: "test:1".into(),
        }
    }

    #[test]
    fn tool_turns_train_the_calls_and_answers_but_not_the_tools_replies() {
        let tok = tokenizer();
        let template = ChatTemplate::new(Some(CHATML.into()), None, None).unwrap();
        let enc = ChatEncoder {
            template: &template,
            tokenizer: &tok,
            vision: None,
        };
        let call = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2*3\"}}\n</tool_call>";
        let tools = r#"[{"type": "function", "function": {"name": "calculator"}}]"#;
        let c = Conversation {
            messages: vec![
                Message::new("user", "2*3="),
                Message::new("assistant", call),
                Message::new("tool", "6"),
                Message::new("assistant", "6"),
            ],
            images: vec![],
            tools: Some(super::super::template::Tools::from_json(tools).unwrap()),
            origin: "test:1".into(),
        };
        let e = enc.encode(&c).unwrap();
        let text = tok.decode(&e.tokens).unwrap();
        assert!(text.starts_with("<|im_start|>system\n# Tools") && text.contains("\"calculator\""));
        let trained: Vec<u32> = e
            .tokens
            .iter()
            .zip(&e.trained)
            .filter(|(_, &t)| t)
            .map(|(&id, _)| id)
            .collect();
        assert_eq!(
            tok.decode(&trained).unwrap(),
            format!("{call}<|im_end|>\n6<|im_end|>\n")
        );
    }

    #[test]
    fn the_loss_is_on_the_reply_and_images_expand_to_their_patches() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.png"), dir.path().join("b.png"));
        png(&a, 64, 64);
        png(&b, 64, 128);
        let tok = tokenizer();
        let template = ChatTemplate::new(Some(CHATML.into()), None, None).unwrap();
        let processor = ImageProcessor::new(ProcessorConfig {
            patch_size: 16,
            min_pixels: 1024,
            max_pixels: 1 << 20,
            ..ProcessorConfig::default()
        });
        let image_token = tok.token_id("<|image_pad|>").unwrap();
        let vision = VisionTokens {
            image_token,
            processor,
        };
        let enc = ChatEncoder {
            template: &template,
            tokenizer: &tok,
            vision: Some(&vision),
        };
        let e = enc.encode(&conversation(vec![a.clone(), b])).unwrap();
        // 64x64 at patch 16, merge 2: 2x2 tokens; 64x128: 2x4.
        assert_eq!(e.image_spans.len(), 2);
        assert_eq!((e.image_spans[0].1, e.image_spans[1].1), (4, 8));
        let n_image = e.tokens.iter().filter(|&&t| t == image_token).count();
        assert_eq!(n_image, 12);
        // The trained tokens are the reply, its end of turn and the newline after it.
        let reply: Vec<u32> = e
            .tokens
            .iter()
            .zip(&e.trained)
            .filter(|(_, &t)| t)
            .map(|(&id, _)| id)
            .collect();
        assert_eq!(tok.decode(&reply).unwrap(), "red<|im_end|>\n");
        let first = e.trained.iter().position(|&t| t).unwrap();
        assert!(
            e.trained[first..].iter().all(|&t| t),
            "the reply is the conversation's end"
        );

        // A text-only model refuses the images; a missing image is named.
        let text_only = ChatEncoder {
            vision: None,
            ..enc
        };
        let err = text_only
            .encode(&conversation(vec![a]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("reads no images") && err.contains("test:1"),
            "{err}"
        );
        let err = enc
            .encode(&conversation(vec![dir.path().join("gone.png")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gone.png"), "{err}");
    }
}
