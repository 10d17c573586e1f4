//! Muse Spark Open's audio tower, in host ops: a fully causal convolutional pyramid over the raw
//! mono waveform (24 kHz), no attention and no spectrogram. Each stage folds `p` steps into one
//! and runs depthwise causal convolution blocks; the last stage's steps, projected into the
//! decoder's width, are the audio tokens (one per `Π p` samples: 1920, 80 ms, released).
//!
//! ```text
//! x = RMSNorm(W_p · reshape(x, [B, T/p, p·C]) + b_p)                       per stage, then
//! x = x + fc2(GELU(fc1(RMSNorm(DWConv_causal(x) + b_c))))                  per block
//! y = RMSNorm₀(RMSNorm(W · RMSNorm(x) + b))      RMSNorm = w · x̂ (plain gain), RMSNorm₀: no gain
//! ```
//!
//! `RMSNorm₀` is the decoder's embedding norm, which transformers' `get_audio_features`
//! applies to the tower's output as it does to the token embeddings. A clip of `n` samples
//! keeps its first `⌈n / Π p⌉` tokens (the rest of its row is padding to the batch's longest).

use crate::config::AudioArgs;
use anneal_plugin_api::sdk::kit::blocks::{scaleless_rms_norm, Proj};
use anneal_plugin_api::sdk::{Audio, Ctx, Param, Result, Tensor};

/// One convolution block: depthwise causal convolution, norm, MLP, residual.
pub struct ConvBlock {
    /// The depthwise kernels `[C, 1, K]`.
    pub conv: Param,
    /// The convolution's bias `[C]`.
    pub conv_bias: Param,
    /// RMSNorm after the convolution (a plain gain).
    pub norm: Param,
    /// The MLP's two layers, with biases.
    pub mlp: [Proj; 2],
}

/// One stage of the pyramid: its patch embedding and its blocks.
pub struct Stage {
    /// `[hidden, p · C_in]`, with a bias.
    pub patch: Proj,
    /// RMSNorm after the patch embedding (a plain gain).
    pub patch_norm: Param,
    /// The convolution blocks.
    pub blocks: Vec<ConvBlock>,
}

/// The audio tower's parameters.
pub struct AudioTower {
    /// The stages, finest first.
    pub stages: Vec<Stage>,
    /// RMSNorm after the last stage.
    pub norm: Param,
    /// Into the decoder's width, with a bias.
    pub proj: Proj,
    /// RMSNorm after the projection.
    pub post_proj_norm: Param,
}

impl AudioTower {
    /// The audio embeddings `[tokens, text_dim]` of `audio`, clip after clip, each clip's
    /// `⌈length / Π p⌉` tokens, normed as the decoder's embeddings are (`text_eps`).
    pub fn forward<'h>(
        &self,
        ctx: &Ctx<'h>,
        a: &AudioArgs,
        text_eps: f64,
        audio: &Audio<'h>,
    ) -> Result<Tensor<'h>> {
        let values = &audio.input_values;
        let shape = values.shape()?;
        let per_token = a.samples_per_token();
        let &[clips, samples] = &shape[..] else {
            return Err(
                format!("audio input_values must be [clips, samples], got {shape:?}").into(),
            );
        };
        if audio.lengths.len() != clips {
            return Err(format!(
                "audio: {} clip lengths for {clips} rows of input_values",
                audio.lengths.len()
            )
            .into());
        }
        if let Some(&n) = audio.lengths.iter().find(|&&n| n > samples) {
            return Err(
                format!("audio: a clip of {n} samples in rows of {samples} samples").into(),
            );
        }
        if !samples.is_multiple_of(per_token) {
            return Err(format!(
                "audio input_values of {samples} samples per row: not a multiple of the {per_token} \
                 samples an audio token takes (pad each row with zeros on the right)"
            )
            .into());
        }
        let dtype = ctx
            .w(&self
                .stages
                .first()
                .ok_or("an audio tower without stages")?
                .patch
                .weight)?
            .dtype()?;
        let b = clips as i64;
        let mut x = values.to_dtype(&dtype)?.reshape(&[b, samples as i64, 1])?;
        let (mut steps, mut width) = (samples, 1);
        for ((stage, &p), &hidden) in self.stages.iter().zip(&a.patch_sizes).zip(&a.hidden_sizes) {
            steps /= p;
            let folded = x.reshape(&[b, steps as i64, (p * width) as i64])?;
            x = stage
                .patch
                .apply(ctx, &folded)?
                .rms_norm(&ctx.w(&stage.patch_norm)?, a.norm_eps)?;
            for block in &stage.blocks {
                x = self.block(ctx, a, block, &x, hidden)?;
            }
            width = hidden;
        }
        let x = x.rms_norm(&ctx.w(&self.norm)?, a.norm_eps)?;
        let y = self
            .proj
            .apply(ctx, &x)?
            .rms_norm(&ctx.w(&self.post_proj_norm)?, a.norm_eps)?;
        let d = *y.shape()?.last().ok_or("audio: a scalar projection")? as i64;
        let rows = y.reshape(&[b * steps as i64, d])?;
        let kept: Vec<i64> = audio
            .lengths
            .iter()
            .enumerate()
            .flat_map(|(c, &n)| (0..n.div_ceil(per_token)).map(move |j| (c * steps + j) as i64))
            .collect();
        let rows = if kept.len() == clips * steps {
            rows
        } else {
            let idx = ctx.host.constant_i64(&[kept.len()], &kept, values)?;
            rows.index_select(0, &idx)?
        };
        scaleless_rms_norm(ctx, &rows, text_eps)
    }

    /// `x + fc2(GELU(fc1(RMSNorm(conv(x) + b))))` on `x [B, T, C]`: the convolution sees each
    /// step and the `K − 1` before it, zeros before the clip.
    fn block<'h>(
        &self,
        ctx: &Ctx<'h>,
        a: &AudioArgs,
        b: &ConvBlock,
        x: &Tensor<'h>,
        channels: usize,
    ) -> Result<Tensor<'h>> {
        let kernel = ctx
            .w(&b.conv)?
            .reshape(&[channels as i64, a.conv_kernel_size as i64])?;
        let conv = x
            .causal_conv1d(&kernel, false, None)?
            .add(&ctx.w(&b.conv_bias)?)?;
        let normed = conv.rms_norm(&ctx.w(&b.norm)?, a.norm_eps)?;
        let [fc1, fc2] = &b.mlp;
        let hidden = fc1.apply(ctx, &normed)?.unary("gelu_erf")?;
        x.add(&fc2.apply(ctx, &hidden)?)
    }
}
