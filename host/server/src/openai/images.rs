//! Images in chat requests: `image_url` parts carrying `data:` URLs (base64 PNG, JPEG or WebP),
//! read through the served model's image processor; the chat template places one placeholder
//! token per image, which is then expanded to the image's count of merged patches, as
//! transformers' processor expands it.
//!
//! The server fetches nothing: a remote (`http(s)://`) URL is refused, so a request cannot make
//! it reach other hosts or wait on them. Every image is held to the pixel limit of
//! `anneal_data::image` before any pixel buffer is made.

use super::error::{OaiError, OaiResult};
use anneal_data::image::{decode_image, ImageError, ImageProcessor, ProcessorConfig};
use anneal_runtime::plugins::ImageInputs;
use base64::Engine as _;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// Most images in one request.
pub const MAX_IMAGES: usize = 32;

/// How a served model reads images: its processor (`preprocessor_config.json`) and the token
/// its chat template places for each image (`config.json`'s `image_token_id`).
pub struct Vision {
    processor: ImageProcessor,
    image_token: i64,
}

impl Vision {
    /// The vision input of the model whose files are in `dir`, or `None` for a text-only model
    /// (no `preprocessor_config.json`). A processor without an `image_token_id` in
    /// `config.json`, or a bad processor config, is an error.
    pub fn load(dir: &Path) -> Result<Option<Vision>, String> {
        let config = match ProcessorConfig::from_dir(dir) {
            Ok(c) => c,
            Err(ImageError::Missing { .. }) => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let model = anneal_runtime::hf::read_config(dir).unwrap_or(Value::Null);
        let image_token = model
            .get("image_token_id")
            .and_then(Value::as_i64)
            .ok_or_else(|| {
                format!(
                    "{} has preprocessor_config.json but its config.json gives no image_token_id",
                    dir.display()
                )
            })?;
        Ok(Some(Vision {
            processor: ImageProcessor::new(config),
            image_token,
        }))
    }
}

/// An image part of a request: where it is (`messages[i].content[j]`) and its URL.
#[derive(Clone, Debug)]
pub struct ImageUrl {
    /// The part's place in the request, for errors.
    pub param: String,
    /// The URL as sent.
    pub url: String,
}

/// The bytes of a `data:[<type>];base64,<data>` URL.
fn data_url_bytes(image: &ImageUrl) -> OaiResult<Vec<u8>> {
    let bad = |what: &str| {
        OaiError::invalid(Some(&image.param), format!("`{}`: {what}", image.param))
            .with_code("invalid_image_url")
    };
    let url = image.url.trim();
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split(':').next().unwrap_or_default();
        return Err(bad(&format!(
            "only data: URLs are read (base64 PNG, JPEG or WebP); this server fetches no {scheme}: URL"
        )));
    };
    let (header, data) = rest
        .split_once(',')
        .ok_or_else(|| bad("a data: URL needs a comma before its data"))?;
    if !header.ends_with(";base64") {
        return Err(bad(
            "the data: URL must be base64 (data:image/png;base64,...)",
        ));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| bad(&format!("its base64 data does not decode: {e}")))
}

/// Reads `images` (in the order the template placed them) through the model's processor and
/// expands each placeholder token of `tokens` to its image's count of merged patches.
/// The template must have placed exactly one placeholder per image.
pub fn attach(
    vision: &Vision,
    tokens: Vec<i64>,
    images: &[ImageUrl],
) -> OaiResult<(Vec<i64>, Arc<ImageInputs>)> {
    let placed = tokens.iter().filter(|&&t| t == vision.image_token).count();
    if placed != images.len() {
        return Err(OaiError::invalid(
            Some("messages"),
            format!(
                "the chat template placed {placed} image placeholder(s) for {} image(s) in the messages",
                images.len()
            ),
        ));
    }
    let processed = images
        .iter()
        .map(|image| {
            let bad = |e: ImageError| {
                OaiError::invalid(Some(&image.param), e.to_string()).with_code("invalid_image")
            };
            let bytes = data_url_bytes(image)?;
            let rgb = decode_image(
                &bytes,
                Path::new(&image.param),
                anneal_data::image::DEFAULT_MAX_PIXELS,
            )
            .map_err(bad)?;
            vision.processor.process(&rgb).map_err(bad)
        })
        .collect::<OaiResult<Vec<_>>>()?;
    let counts: Vec<usize> = processed.iter().map(|p| p.placeholder_tokens()).collect();
    let expanded = anneal_data::image::expand_placeholders(&tokens, vision.image_token, &counts)
        .map_err(|e| OaiError::invalid(Some("messages"), e))?;
    let inputs = ImageInputs::from_processed(processed)
        .map_err(|e| OaiError::server(format!("cannot hold the images: {e}")))?;
    Ok((expanded, Arc::new(inputs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(url: &str) -> ImageUrl {
        ImageUrl {
            param: "messages[0].content[1]".into(),
            url: url.into(),
        }
    }

    #[test]
    fn data_urls_decode_and_others_are_refused_naming_the_part() {
        assert_eq!(
            data_url_bytes(&url("data:image/png;base64,aGVsbG8=")).unwrap(),
            b"hello"
        );
        for (bad, says) in [
            ("https://example.com/cat.png", "fetches no https: URL"),
            ("data:image/png,hello", "must be base64"),
            ("data:image/png;base64", "needs a comma"),
            ("data:image/png;base64,***", "does not decode"),
        ] {
            let e = data_url_bytes(&url(bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("messages[0].content[1]"));
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }
}
