//! The Qwen2-VL / Qwen3-VL image processor (transformers' `Qwen2VLImageProcessor`): smart resize,
//! rescale, normalize, temporal duplication and patchify, in the slow processor's arithmetic.

use super::{resize_bicubic, ImageError, ProcessorConfig, Result, RgbImage};

/// The largest ratio of long side to short side transformers accepts.
const MAX_ASPECT_RATIO: f64 = 200.0;

/// transformers' `smart_resize`: the `(height, width)` nearest the image's whose sides are
/// multiples of `factor` (`patch_size · merge_size`) and whose area lies within
/// `[min_pixels, max_pixels]`, keeping the aspect ratio as well as those allow. Python's
/// arithmetic is kept (`round` to even on ties, `f64` square roots).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: usize,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32)> {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let shape_err = |message: String| ImageError::BadShape {
        width,
        height,
        message,
    };
    if height == 0 || width == 0 {
        return Err(shape_err("a side is 0 pixels".into()));
    }
    let ratio = h.max(w) / h.min(w);
    if ratio > MAX_ASPECT_RATIO {
        return Err(shape_err(format!(
            "aspect ratio {ratio:.1} is over {MAX_ASPECT_RATIO}"
        )));
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    let area = (height as u64 * width as u64) as f64;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (area / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / area).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    if h_bar > u32::MAX as f64 || w_bar > u32::MAX as f64 {
        return Err(shape_err("resized side overflows".into()));
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// One image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// `[patches, patch_dim]` row-major: one row per patch, patches in the merger's window order
    /// (for each `merge_size × merge_size` window, row by row, its patches row by row), each row
    /// `C · temporal_patch_size · patch_size · patch_size` values ordered channel, frame, y, x.
    pub pixel_values: Vec<f32>,
    /// Rows of `pixel_values`: `grid_thw[0] · grid_thw[1] · grid_thw[2]`.
    pub patches: usize,
    /// Columns of `pixel_values`: `3 · temporal_patch_size · patch_size²`.
    pub patch_dim: usize,
    /// `image_grid_thw`: `[1, height / patch_size, width / patch_size]` for a still image.
    pub grid_thw: [usize; 3],
    /// The merge size the grid was made for (tokens are `merge_size²` patches each).
    pub merge_size: usize,
}

impl ProcessedImage {
    /// How many image placeholder tokens a prompt holds for this image:
    /// `grid_t · grid_h · grid_w / merge_size²`.
    pub fn placeholder_tokens(&self) -> usize {
        self.patches / (self.merge_size * self.merge_size)
    }
}

/// `tokens` with each image's placeholders as the model reads them: run `k` of `image_token`
/// belongs to image `k`, which needs `counts[k]` placeholders; a run of one (as a chat template
/// writes it) is expanded to that count, a run already of that count is kept. Any other run
/// length, or a number of runs other than of images, is an error saying which.
pub fn expand_placeholders(
    tokens: &[i64],
    image_token: i64,
    counts: &[usize],
) -> std::result::Result<Vec<i64>, String> {
    expand_placeholder_runs(tokens, image_token, counts, "image")
}

/// [`expand_placeholders`] for inputs of any kind (`what`: `image`, `audio clip`), whose errors
/// name it.
pub fn expand_placeholder_runs(
    tokens: &[i64],
    token: i64,
    counts: &[usize],
    what: &str,
) -> std::result::Result<Vec<i64>, String> {
    let mut out = Vec::with_capacity(tokens.len() + counts.iter().sum::<usize>());
    let mut runs = 0;
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] != token {
            out.push(tokens[i]);
            i += 1;
            continue;
        }
        let run = tokens[i..].iter().take_while(|&&t| t == token).count();
        let Some(&need) = counts.get(runs) else {
            return Err(format!(
                "the prompt has more runs of {what} placeholders (token {token}) than the {} \
                 {what}(s)",
                counts.len()
            ));
        };
        if run != 1 && run != need {
            return Err(format!(
                "{what} {runs} needs {need} placeholder tokens (or one, which is expanded); the \
                 prompt has {run} in a row"
            ));
        }
        out.extend(std::iter::repeat_n(token, need));
        runs += 1;
        i += run;
    }
    if runs != counts.len() {
        return Err(format!(
            "{} {what}(s) but {runs} run(s) of {what} placeholders (token {token}) in the prompt",
            counts.len()
        ));
    }
    Ok(out)
}

/// The image processor of a Qwen2-VL / Qwen3-VL checkpoint.
#[derive(Debug, Clone, Default)]
pub struct ImageProcessor {
    config: ProcessorConfig,
}

impl ImageProcessor {
    /// A processor with the given settings.
    pub fn new(config: ProcessorConfig) -> Self {
        Self { config }
    }

    /// The settings in use.
    pub fn config(&self) -> &ProcessorConfig {
        &self.config
    }

    /// `(height, width)` an image of this size is resized to (unchanged when `do_resize` is off,
    /// where the sides must then be multiples of `patch_size · merge_size`).
    pub fn target_size(&self, height: u32, width: u32) -> Result<(u32, u32)> {
        let c = &self.config;
        let factor = c.patch_size * c.merge_size;
        if c.do_resize {
            return smart_resize(height, width, factor, c.min_pixels, c.max_pixels);
        }
        if height == 0
            || width == 0
            || !(height as usize).is_multiple_of(factor)
            || !(width as usize).is_multiple_of(factor)
        {
            return Err(ImageError::BadShape {
                width,
                height,
                message: format!(
                    "do_resize is off, so both sides must be non-zero multiples of \
                     patch_size · merge_size = {factor}"
                ),
            });
        }
        Ok((height, width))
    }

    /// Placeholder tokens an image of this size needs, without processing it.
    pub fn placeholder_tokens(&self, height: u32, width: u32) -> Result<usize> {
        let (h, w) = self.target_size(height, width)?;
        let p = self.config.patch_size * self.config.merge_size;
        Ok((h as usize / p) * (w as usize / p))
    }

    /// Runs the processor's steps on one image.
    pub fn process(&self, image: &RgbImage) -> Result<ProcessedImage> {
        let c = &self.config;
        let (h, w) = self.target_size(image.height, image.width)?;
        let resized;
        let image = if (h, w) == (image.height, image.width) {
            image
        } else {
            resized = resize_bicubic(image, w, h);
            &resized
        };
        let planes = self.to_planes(image);
        let (p, m, t) = (c.patch_size, c.merge_size, c.temporal_patch_size);
        let (w, h) = (w as usize, h as usize);
        let (grid_h, grid_w) = (h / p, w / p);
        let patch_dim = 3 * t * p * p;
        let patches = grid_h * grid_w;
        let mut out = Vec::with_capacity(patches * patch_dim);
        // numpy's reshape (C, gh/m, m, p, gw/m, m, p) → transpose (bh, bw, mh, mw, C, [t], ph, pw).
        for bh in 0..grid_h / m {
            for bw in 0..grid_w / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for plane in &planes {
                            for _ in 0..t {
                                for y in y0..y0 + p {
                                    out.extend_from_slice(&plane[y * w + x0..y * w + x0 + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ProcessedImage {
            pixel_values: out,
            patches,
            patch_dim,
            grid_thw: [1, grid_h, grid_w],
            merge_size: m,
        })
    }

    /// Rescale and normalize into three `f32` planes, in numpy's order of operations: the
    /// rescale in `f64` rounded to `f32`, the normalization in `f32`.
    fn to_planes(&self, image: &RgbImage) -> [Vec<f32>; 3] {
        let c = &self.config;
        let mean = c.image_mean.map(|v| v as f32);
        let std = c.image_std.map(|v| v as f32);
        std::array::from_fn(|ch| {
            image
                .pixels
                .iter()
                .skip(ch)
                .step_by(3)
                .map(|&x| {
                    let mut v = if c.do_rescale {
                        (x as f64 * c.rescale_factor) as f32
                    } else {
                        x as f32
                    };
                    if c.do_normalize {
                        v = (v - mean[ch]) / std[ch];
                    }
                    v
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_expand_from_one_or_stay_whole() {
        let x = 9;
        assert_eq!(
            expand_placeholders(&[1, x, 2, x, x, x], x, &[2, 3]).unwrap(),
            [1, x, x, 2, x, x, x]
        );
        let e = expand_placeholders(&[x, x, 2], x, &[3]).unwrap_err();
        assert!(e.contains("needs 3") && e.contains("has 2"), "{e}");
        let e = expand_placeholders(&[1, x], x, &[1, 1]).unwrap_err();
        assert!(e.contains("2 image(s) but 1 run"), "{e}");
        let e = expand_placeholders(&[x, 1, x], x, &[1]).unwrap_err();
        assert!(e.contains("more runs"), "{e}");
    }

    #[test]
    fn smart_resize_matches_python() {
        // Values from transformers' smart_resize (factor 28, min 3136, max 1003520).
        let r = |h, w| smart_resize(h, w, 28, 3136, 1_003_520).unwrap();
        assert_eq!(r(56, 84), (56, 84));
        assert_eq!(r(60, 90), (56, 84));
        assert_eq!(r(33, 47), (56, 84));
        assert_eq!(r(42, 70), (56, 56)); // 1.5 and 2.5 round to even: 2 and 2
        assert_eq!(r(2000, 1000), (1400, 700));
        assert!(smart_resize(1, 300, 28, 3136, 1_003_520).is_err());
    }
}
