//! `preprocessor_config.json` of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint: the fields the
//! image processor uses, with transformers' defaults for those left out. Unknown keys are ignored
//! (the file also carries the processor class, video settings and so on).

use std::path::Path;

use serde_json::{Map, Value};

use super::{ImageError, Result, DEFAULT_MAX_PIXELS};

/// PIL's code for bicubic resampling, the only `resample` this processor implements.
const PIL_BICUBIC: u64 = 3;

/// The image processor's settings. [`Default`] is transformers' `Qwen2VLImageProcessor` with no
/// config: patch 14, temporal patch 2, merge 2, 3,136 to 1,003,520 pixels, CLIP's mean and std.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorConfig {
    /// Side of a square patch in pixels (`patch_size`: 14 for Qwen2-VL, 16 for Qwen3-VL).
    pub patch_size: usize,
    /// Frames per temporal patch (`temporal_patch_size`); a still image is repeated this often.
    pub temporal_patch_size: usize,
    /// Side of the square of patches the merger folds into one token (`merge_size`).
    pub merge_size: usize,
    /// Fewest pixels after resizing (`min_pixels`, or `size.shortest_edge`).
    pub min_pixels: u64,
    /// Most pixels after resizing (`max_pixels`, or `size.longest_edge`).
    pub max_pixels: u64,
    /// Per-channel mean subtracted after rescaling (`image_mean`).
    pub image_mean: [f64; 3],
    /// Per-channel standard deviation divided by (`image_std`).
    pub image_std: [f64; 3],
    /// Factor the 0..=255 samples are multiplied by (`rescale_factor`, 1/255).
    pub rescale_factor: f64,
    /// Resize to the patch grid (`do_resize`); when off, both sides must already be multiples
    /// of `patch_size · merge_size`.
    pub do_resize: bool,
    /// Multiply by `rescale_factor` (`do_rescale`).
    pub do_rescale: bool,
    /// Subtract the mean and divide by the std (`do_normalize`).
    pub do_normalize: bool,
    /// Convert to RGB (`do_convert_rgb`). Read for completeness: [`super::load_image`] always
    /// yields RGB, which is what the vision tower takes.
    pub do_convert_rgb: bool,
}

impl Default for ProcessorConfig {
    fn default() -> Self {
        Self {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            image_mean: [0.48145466, 0.4578275, 0.40821073],
            image_std: [0.26862954, 0.26130258, 0.27577711],
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
            do_convert_rgb: true,
        }
    }
}

impl ProcessorConfig {
    /// Reads a checkpoint's `preprocessor_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => ImageError::Missing {
                path: path.to_path_buf(),
            },
            _ => ImageError::Io {
                path: path.to_path_buf(),
                source,
            },
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Reads `preprocessor_config.json` from a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("preprocessor_config.json"))
    }

    /// The `preprocessor_config.json` transformers reads these settings from (as
    /// `Qwen2VLImageProcessor`, which Qwen3-VL's processor is); [`ProcessorConfig::from_json_str`]
    /// reads it back to the same settings.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "image_processor_type": "Qwen2VLImageProcessor",
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "rescale_factor": self.rescale_factor,
            "resample": PIL_BICUBIC,
            "do_resize": self.do_resize,
            "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize,
            "do_convert_rgb": self.do_convert_rgb,
        })
    }

    /// Parses the JSON text of a `preprocessor_config.json`; `origin` names it in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| bad(origin, "(file)", e))?;
        let Value::Object(map) = value else {
            return Err(bad(origin, "(file)", "expected a JSON object"));
        };
        Reader { origin, map: &map }.config()
    }
}

fn bad(origin: &str, key: &str, message: impl std::fmt::Display) -> ImageError {
    ImageError::BadConfig {
        origin: origin.to_string(),
        key: key.to_string(),
        message: message.to_string(),
    }
}

struct Reader<'a> {
    origin: &'a str,
    map: &'a Map<String, Value>,
}

impl Reader<'_> {
    fn config(&self) -> Result<ProcessorConfig> {
        let d = ProcessorConfig::default();
        let (mut min_pixels, mut max_pixels) = (d.min_pixels, d.max_pixels);
        // Which key set `min_pixels`, so an error names the one in the file.
        let mut min_key = "min_pixels".to_string();
        if let Some(size) = self.map.get("size") {
            let Value::Object(size) = size else {
                return Err(bad(self.origin, "size", "expected an object"));
            };
            // `shortest_edge` / `longest_edge` are pixel counts here, not sides (transformers'
            // naming); older files spell them `min_pixels` / `max_pixels`.
            let sub = Reader {
                origin: self.origin,
                map: size,
            };
            for (key, is_min) in [
                ("shortest_edge", true),
                ("min_pixels", true),
                ("longest_edge", false),
                ("max_pixels", false),
            ] {
                if let Some(v) = sub.positive(key, &format!("size.{key}"))? {
                    if is_min {
                        min_pixels = v;
                        min_key = format!("size.{key}");
                    } else {
                        max_pixels = v;
                    }
                }
            }
        }
        // Top-level `min_pixels` / `max_pixels` override `size`, as in transformers' __init__.
        if let Some(v) = self.positive("min_pixels", "min_pixels")? {
            min_pixels = v;
            min_key = "min_pixels".into();
        }
        if let Some(v) = self.positive("max_pixels", "max_pixels")? {
            max_pixels = v;
        }
        // The processor makes about `min_pixels` pixels from a small image: bound it by the
        // loader's limit so a config cannot ask for an arbitrarily large output.
        if min_pixels > DEFAULT_MAX_PIXELS {
            return Err(bad(
                self.origin,
                &min_key,
                format!("{min_pixels} is above the pixel limit of {DEFAULT_MAX_PIXELS}"),
            ));
        }
        if min_pixels > max_pixels {
            return Err(bad(
                self.origin,
                &min_key,
                format!("{min_pixels} is above max_pixels {max_pixels}"),
            ));
        }
        if let Some(r) = self.positive("resample", "resample")? {
            if r != PIL_BICUBIC {
                return Err(bad(
                    self.origin,
                    "resample",
                    format!("{r} is not supported; only {PIL_BICUBIC} (bicubic) is"),
                ));
            }
        }
        let image_std = self.triple("image_std")?.unwrap_or(d.image_std);
        if image_std.contains(&0.0) {
            return Err(bad(self.origin, "image_std", "must not contain 0"));
        }
        let rescale_factor = match self.map.get("rescale_factor") {
            None => d.rescale_factor,
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| bad(self.origin, "rescale_factor", "expected a number"))?,
        };
        let size = |key: &str, default: usize| -> Result<usize> {
            Ok(self.positive(key, key)?.map_or(default, |v| v as usize))
        };
        Ok(ProcessorConfig {
            patch_size: size("patch_size", d.patch_size)?,
            temporal_patch_size: size("temporal_patch_size", d.temporal_patch_size)?,
            merge_size: size("merge_size", d.merge_size)?,
            min_pixels,
            max_pixels,
            image_mean: self.triple("image_mean")?.unwrap_or(d.image_mean),
            image_std,
            rescale_factor,
            do_resize: self.flag("do_resize", d.do_resize)?,
            do_rescale: self.flag("do_rescale", d.do_rescale)?,
            do_normalize: self.flag("do_normalize", d.do_normalize)?,
            do_convert_rgb: self.flag("do_convert_rgb", d.do_convert_rgb)?,
        })
    }

    /// A positive integer (below 2^32), absent or `null` as `None`.
    fn positive(&self, key: &str, path: &str) -> Result<Option<u64>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n < 1 << 32 => Ok(Some(n)),
                _ => Err(bad(
                    self.origin,
                    path,
                    format!("expected a positive integer, got {v}"),
                )),
            },
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(bad(
                self.origin,
                key,
                format!("expected true or false, got {v}"),
            )),
        }
    }

    /// Three per-channel numbers, or one number for all three.
    fn triple(&self, key: &str) -> Result<Option<[f64; 3]>> {
        let err = |v: &Value| bad(self.origin, key, format!("expected 3 numbers, got {v}"));
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().ok_or_else(|| err(&Value::Number(n.clone())))?;
                Ok(Some([x; 3]))
            }
            Some(v @ Value::Array(items)) if items.len() == 3 => {
                let mut out = [0.0; 3];
                for (o, item) in out.iter_mut().zip(items) {
                    *o = item.as_f64().ok_or_else(|| err(v))?;
                }
                Ok(Some(out))
            }
            Some(v) => Err(err(v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_settings_read_back_the_same() {
        let c = ProcessorConfig {
            patch_size: 16,
            min_pixels: 4096,
            max_pixels: 65_536,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            ..ProcessorConfig::default()
        };
        let text = c.to_json().to_string();
        assert_eq!(ProcessorConfig::from_json_str(&text, "<json>").unwrap(), c);
    }
}
