//! Images for vision-language models: decoding, and the Qwen2-VL / Qwen3-VL image processor's
//! steps up to the model's input.
//!
//! The path of one image:
//! [`load_image`] (PNG / JPEG / WebP, refused from its header above a pixel limit, alpha composited
//! on white) → [`ImageProcessor::process`] (smart resize to the patch grid with PIL's bicubic
//! resampling, rescale, normalize, temporal duplication, patchify) → [`ProcessedImage`]
//! (`pixel_values [patches, C·t·p·p]`, `image_grid_thw`, and the number of placeholder tokens a
//! prompt holds for it). [`ProcessorConfig`] reads a checkpoint's `preprocessor_config.json`.
//!
//! The output matches transformers' slow (PIL) processor bit for bit; see `docs/vision.md` for the
//! measured difference where it resizes and how the reference fixtures are made.

mod config;
mod load;
mod processor;
mod resample;

use std::path::PathBuf;

pub use config::ProcessorConfig;
pub use load::{decode_image, load_image, load_image_with_limit, DEFAULT_MAX_PIXELS};
pub use processor::{
    expand_placeholder_runs, expand_placeholders, smart_resize, ImageProcessor, ProcessedImage,
};
pub use resample::resize_bicubic;

/// An 8-bit RGB image, rows top to bottom, each pixel `[r, g, b]` (`height · width · 3` bytes).
/// The fields are private so the buffer always fits the size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

impl RgbImage {
    /// Wraps a pixel buffer; `None` when its length is not `width · height · 3`.
    pub fn new(width: u32, height: u32, pixels: Vec<u8>) -> Option<Self> {
        let expected = (width as usize)
            .checked_mul(height as usize)?
            .checked_mul(3)?;
        (pixels.len() == expected).then_some(Self {
            width,
            height,
            pixels,
        })
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The pixels, row-major, 3 bytes each.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// The pixel buffer, giving up the image.
    pub fn into_pixels(self) -> Vec<u8> {
        self.pixels
    }
}

/// Everything that can go wrong reading an image or a processor config. Each message is one line
/// naming the file (or config key) involved.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The image file does not exist.
    #[error("{}: image file not found", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// The file exists but could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not an image in a format this crate reads (PNG, JPEG, WebP).
    #[error("{}: unsupported image format ({detail}); expected PNG, JPEG or WebP", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What was found.
        detail: String,
    },
    /// The image is truncated or corrupt.
    #[error("{}: corrupt or truncated image: {message}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The decoder's message.
        message: String,
    },
    /// The header declares more pixels than the limit; nothing was decoded.
    #[error(
        "{}: image of {width} x {height} = {} pixels is over the limit of {limit} pixels",
        path.display(),
        *width as u64 * *height as u64
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Width declared by the header.
        width: u32,
        /// Height declared by the header.
        height: u32,
        /// The pixel limit in force.
        limit: u64,
    },
    /// The image's shape cannot be processed (an empty side, an aspect ratio over 200, a side
    /// that is not a multiple of the patch grid when resizing is off).
    #[error("image of {width} x {height}: {message}")]
    BadShape {
        /// Width in pixels.
        width: u32,
        /// Height in pixels.
        height: u32,
        /// Why it is refused.
        message: String,
    },
    /// A processor config value is missing its expected type or out of range.
    #[error("{origin}: {key}: {message}")]
    BadConfig {
        /// The config file (or `<json>` for an in-memory value).
        origin: String,
        /// The key, e.g. `size.longest_edge`.
        key: String,
        /// Why the value is rejected.
        message: String,
    },
}

/// The result type of the image module.
pub type Result<T> = std::result::Result<T, ImageError>;
