//! The 3-D positions of a prompt holding images and the interleaved MRoPE that turns queries
//! and keys by them (Qwen3-VL's and Qwen3.5's text decoders): transformers' `get_rope_index`
//! (each run of image placeholder tokens is one image, whose tokens take `(t, row, col)` offsets
//! from where it starts; text after it continues from there plus its larger merged side) and the
//! rotary embedding that turns each frequency pair by the time, height or width position.

use crate::sdk::{Ctx, Result, Rope, Tensor};

/// The `[3, B, T]` positions (time, height, width) of tokens `[B, T]` whose runs of
/// `image_token` are the images of `grids` in order, at merge size `m`; also each row's
/// `max + 1 - T` (transformers' `rope_deltas`).
pub fn rope_index(
    tokens: &[i64],
    (b, t): (usize, usize),
    grids: &[[usize; 3]],
    image_token: i64,
    m: usize,
) -> Result<(Vec<i64>, Vec<i64>)> {
    let mut pos = vec![0i64; 3 * b * t];
    let mut deltas = Vec::with_capacity(b);
    let mut images = grids.iter().enumerate();
    for row in 0..b {
        let ids = &tokens[row * t..(row + 1) * t];
        let mut set = |i: usize, p: [i64; 3]| {
            for (axis, v) in p.into_iter().enumerate() {
                pos[(axis * b + row) * t + i] = v;
            }
        };
        let (mut i, mut current, mut max) = (0usize, 0i64, -1i64);
        while i < t {
            if ids[i] != image_token {
                set(i, [current; 3]);
                max = max.max(current);
                current += 1;
                i += 1;
                continue;
            }
            let run = ids[i..].iter().take_while(|&&id| id == image_token).count();
            let (k, &[gt, gh, gw]) = images.next().ok_or_else(|| {
                format!(
                    "row {row}: more runs of image tokens than the {} images",
                    grids.len()
                )
            })?;
            let (lh, lw) = (gh / m, gw / m);
            if run != gt * lh * lw {
                return Err(format!(
                    "row {row}: image {k} has {} placeholder tokens for its grid ({gt}, {gh}, \
                     {gw}), the prompt has {run} in a row",
                    gt * lh * lw
                )
                .into());
            }
            let mut j = i;
            for ti in 0..gt as i64 {
                for hi in 0..lh as i64 {
                    for wi in 0..lw as i64 {
                        set(j, [current + ti, current + hi, current + wi]);
                        j += 1;
                    }
                }
            }
            max = max.max(current + (gt as i64 - 1).max(lh.max(lw) as i64 - 1));
            current += lh.max(lw) as i64;
            i += run;
        }
        deltas.push(max + 1 - t as i64);
    }
    if let Some((k, _)) = images.next() {
        return Err(format!(
            "{} images but only {k} runs of image tokens in the prompt",
            grids.len()
        )
        .into());
    }
    Ok((pos, deltas))
}

/// Which of time (0), height (1), width (2) turns frequency pair `j`: transformers'
/// interleaved layout, height at `j ≡ 1 (mod 3)` below `3·section[1]`, width at `j ≡ 2`
/// below `3·section[2]`, time elsewhere.
pub fn axis_of(j: usize, section: &[usize]) -> usize {
    let sec = |k: usize| section.get(k).copied().unwrap_or(0);
    match j % 3 {
        1 if j < 3 * sec(1) => 1,
        2 if j < 3 * sec(2) => 2,
        _ => 0,
    }
}

/// `x [B, H, T, D]` turned by `rope`: by interleaved MRoPE ([`apply`]) at `pos3` when the
/// hidden state carries 3-D positions (a prompt with images, or decode after one) and the model
/// has MRoPE sections (`section`), else by the forward's 1-D positions.
pub fn rotate<'h>(
    ctx: &Ctx<'h>,
    x: Tensor<'h>,
    pos3: Option<&Tensor<'h>>,
    section: Option<&[usize]>,
    rope: &Rope,
) -> Result<Tensor<'h>> {
    match (pos3, section) {
        (Some(p), Some(section)) => apply(ctx, &x, p, rope, section),
        _ => x.rope(&ctx.positions, rope),
    }
}

/// `x [B, H, T, D]` rotated by interleaved MRoPE at `pos3` (f32 `[3, B, T]`): rotated once per
/// axis with the host's rope (the first `rope.rot_dim` of the `D` features; the rest pass
/// through, kept from the time axis), each feature then taken from its pair's axis (an exact
/// select).
pub fn apply<'h>(
    ctx: &Ctx<'h>,
    x: &Tensor<'h>,
    pos3: &Tensor<'h>,
    rope: &Rope,
    section: &[usize],
) -> Result<Tensor<'h>> {
    let s = pos3.shape()?;
    let (b, t) = (s[1] as i64, s[2] as i64);
    let d = *x
        .shape()?
        .last()
        .ok_or("mrope: queries and keys must be [B, H, T, D]")?;
    let rot = rope.rot_dim;
    if rot == 0 || rot > d || !rot.is_multiple_of(2) {
        return Err(format!("mrope: {rot} rotated dims of a head of {d}").into());
    }
    let mut out: Option<Tensor<'h>> = None;
    for axis in 0..3 {
        let p = pos3.narrow(0, axis, 1)?.reshape(&[b, t])?.to_dtype("i64")?;
        let mask: Vec<f32> = (0..d)
            .map(|f| {
                let owner = if f < rot {
                    axis_of(f % (rot / 2), section)
                } else {
                    0
                };
                f32::from(u8::from(owner == axis))
            })
            .collect();
        let mask = ctx.host.constant_f32(&[d], &mask, x)?;
        let part = x.rope(&p, rope)?.mul(&mask)?;
        out = Some(match out {
            None => part,
            Some(o) => o.add(&part)?,
        });
    }
    out.ok_or_else(|| "mrope: no axes".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_get_rope_index() {
        // text, image (1, 4, 4) -> 2 × 2 tokens, text.
        let tokens = [5, 9, 9, 9, 9, 6, 7];
        let (pos, deltas) = rope_index(&tokens, (1, 7), &[[1, 4, 4]], 9, 2).unwrap();
        assert_eq!(&pos[0..7], &[0, 1, 1, 1, 1, 3, 4]);
        assert_eq!(&pos[7..14], &[0, 1, 1, 2, 2, 3, 4]);
        assert_eq!(&pos[14..21], &[0, 1, 2, 1, 2, 3, 4]);
        assert_eq!(deltas, [5 - 7]);
        assert!(rope_index(&tokens, (1, 7), &[[1, 2, 4]], 9, 2).is_err());
        assert!(rope_index(&tokens, (1, 7), &[[1, 4, 4], [1, 2, 2]], 9, 2).is_err());
    }

    #[test]
    fn interleaved_axes() {
        let section = [24, 20, 20];
        let axes: Vec<usize> = (0..8).map(|j| axis_of(j, &section)).collect();
        assert_eq!(axes, [0, 1, 2, 0, 1, 2, 0, 1]);
        // Past three times a section, the pairs go back to time.
        assert_eq!(axis_of(58, &section), 1);
        assert_eq!(axis_of(61, &section), 0);
        assert_eq!(axis_of(62, &section), 0);
    }
}
