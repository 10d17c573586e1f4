//! `compressed_mask`: DeepSeek-V4's compressed sparse attention mask, built on the host from
//! positions (and the indexer's top-k choice) as a constant tensor; the scores it is added to
//! carry the gradient.

use anneal_engine::Tensor;
use anneal_plugin_api::ops as o;

type R<T> = Result<T, String>;

/// Positions as rows: `[T]` is one row shared by the batch, `[B, T]` one row each.
fn rows(op: &str, t: &Tensor, what: &str) -> R<(usize, usize, Vec<i64>)> {
    match t.shape() {
        [n] => Ok((1, *n, t.to_vec::<i64>())),
        [b, n] => Ok((*b, *n, t.to_vec::<i64>())),
        s => Err(format!("{op}: {what} must be [T] or [B, T], got {s:?}")),
    }
}

/// The batch size of inputs with batch sizes `sizes` (1 broadcasts).
fn batch(op: &str, sizes: &[usize]) -> R<usize> {
    let b = sizes.iter().copied().max().unwrap_or(1);
    if sizes.iter().any(|&s| s != 1 && s != b) {
        return Err(format!("{op}: batch sizes {sizes:?} do not agree"));
    }
    Ok(b)
}

/// A column of the mask: window key `j` or compressed block `w`.
#[derive(Clone, Copy)]
enum Column {
    Key(usize),
    Block(usize),
}

/// The columns in order: `s` keys then `n` blocks, or each block after its last key.
fn columns(s: usize, n: usize, rate: usize, interleaved: bool) -> Vec<Column> {
    if !interleaved {
        return (0..s)
            .map(Column::Key)
            .chain((0..n).map(Column::Block))
            .collect();
    }
    let mut cols = Vec::with_capacity(s + n);
    for w in 0..n {
        cols.extend((w * rate..((w + 1) * rate).min(s)).map(Column::Key));
        cols.push(Column::Block(w));
    }
    cols.extend((n * rate..s).map(Column::Key));
    cols
}

/// See [`o::CompressedMask`].
pub(super) fn compressed_mask(inputs: &[Tensor], a: o::CompressedMask) -> R<Vec<Tensor>> {
    let op = o::CompressedMask::OP;
    let get = |i: usize| inputs.get(i).ok_or_else(|| format!("{op} needs input {i}"));
    let rate = usize::try_from(a.compress_rate)
        .ok()
        .filter(|&r| r > 0)
        .ok_or_else(|| format!("{op}: compress_rate {} must be positive", a.compress_rate))?;
    let n_blocks = usize::try_from(a.n_blocks)
        .map_err(|_| format!("{op}: n_blocks {} must not be negative", a.n_blocks))?;
    let (qb, t, q) = rows(op, get(0)?, "query positions")?;
    let (kb, s, k, window) = match a.window {
        Some(w) if w > 0 => {
            let (kb, s, k) = rows(op, get(1)?, "key positions")?;
            (kb, s, k, w)
        }
        Some(w) => return Err(format!("{op}: window {w} must be positive")),
        None => (1, 0, Vec::new(), 0),
    };
    let sel = if a.selected {
        let x = get(if a.window.is_some() { 2 } else { 1 })?;
        match x.shape() {
            [b, st, kk] if *st == t => Some((*b, *kk, x.to_vec::<i64>())),
            sh => return Err(format!("{op}: selected must be [B, {t}, k], got {sh:?}")),
        }
    } else {
        None
    };
    let b = batch(op, &[qb, kb, sel.as_ref().map_or(1, |s| s.0)])?;
    let cols = columns(s, n_blocks, rate, a.interleaved);
    let width = cols.len();
    let mut out = vec![f32::NEG_INFINITY; b * t * width];
    let mut chosen = vec![false; n_blocks];
    for r in 0..b {
        let qr = &q[(r % qb) * t..][..t];
        let kr = &k[(r % kb.max(1)) * s..][..s];
        for (i, &qp) in qr.iter().enumerate() {
            // Blocks whose every token is at or before the query.
            let ready = (usize::try_from((qp + 1).max(0)).unwrap_or(0) / rate).min(n_blocks);
            match &sel {
                None => chosen
                    .iter_mut()
                    .enumerate()
                    .for_each(|(w, c)| *c = w < ready),
                Some((sb, kk, idx)) => {
                    chosen.iter_mut().for_each(|c| *c = false);
                    for &w in &idx[((r % sb) * t + i) * kk..][..*kk] {
                        if let Some(c) = usize::try_from(w).ok().filter(|&w| w < ready) {
                            chosen[c] = true;
                        }
                    }
                }
            }
            let row = &mut out[(r * t + i) * width..][..width];
            for (v, col) in row.iter_mut().zip(&cols) {
                let visible = match *col {
                    Column::Key(j) => kr[j] <= qp && qp - kr[j] < window,
                    Column::Block(w) => chosen[w],
                };
                if visible {
                    *v = 0.0;
                }
            }
        }
    }
    Tensor::from_vec(out, &[b, t, width])
        .map(|t| vec![t])
        .map_err(|e| e.to_string())
}

/// See [`o::GatheredAttention`]: inputs q, keys, query positions, key positions, then the
/// sinks, the blocks and the selection when their flags say so.
pub(super) fn gathered_attention(inputs: &[Tensor], a: o::GatheredAttention) -> R<Vec<Tensor>> {
    let op = o::GatheredAttention::OP;
    let mut next = inputs.iter();
    let mut get = |what: &str| {
        next.next()
            .ok_or_else(|| format!("{op} needs its {what} input"))
    };
    let (q, keys, q_pos, k_pos) = (get("q")?, get("keys")?, get("q_pos")?, get("k_pos")?);
    let sinks = a.sinks.then(|| get("sinks")).transpose()?.cloned();
    let blocks = a.blocks.then(|| get("blocks")).transpose()?.cloned();
    let selected = a.selected.then(|| get("selected")).transpose()?.cloned();
    let positive = |v: i64, what: &str| {
        usize::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{op}: {what} {v} must be positive"))
    };
    let params = anneal_engine::ops::GatheredAttentionParams {
        q_pos: q_pos.clone(),
        k_pos: k_pos.clone(),
        blocks,
        selected,
        sinks,
        window: positive(a.window, "window")?,
        compress_rate: positive(a.compress_rate, "compress_rate")?,
        scale: a.scale.map(|s| s as f32),
    };
    q.gathered_attention(keys, &params)
        .map(|t| vec![t])
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(inputs: &[Tensor], a: o::CompressedMask) -> Vec<f32> {
        compressed_mask(inputs, a).unwrap()[0].to_vec_f32()
    }

    #[test]
    fn window_and_complete_blocks_are_visible() {
        let pos = Tensor::from_vec((0..6i64).collect::<Vec<_>>(), &[6]).unwrap();
        let a = o::CompressedMask {
            window: Some(2),
            compress_rate: 2,
            n_blocks: 3,
            selected: false,
            interleaved: false,
        };
        let m = mask(&[pos.clone(), pos.clone()], a);
        let vis: Vec<String> = m
            .chunks(9)
            .map(|r| {
                r.iter()
                    .map(|v| if *v == 0.0 { '1' } else { '.' })
                    .collect()
            })
            .collect();
        assert_eq!(
            vis,
            [
                "1........",
                "11....1..",
                ".11...1..",
                "..11..11.",
                "...11.11.",
                "....11111"
            ]
        );
        // With a selection only the named blocks that are complete (query 2 names block 1,
        // which ends at position 3); -1 names none.
        let sel = Tensor::from_vec(vec![2i64, 0, 1, -1, 1, 2], &[1, 6, 1]).unwrap();
        let a = o::CompressedMask {
            window: None,
            compress_rate: 2,
            n_blocks: 3,
            selected: true,
            interleaved: false,
        };
        let m = mask(&[pos.clone(), sel], a);
        let vis: String = m
            .iter()
            .map(|v| if *v == 0.0 { '1' } else { '.' })
            .collect();
        assert_eq!(vis, concat!("...", "1..", "...", "...", ".1.", "..1"));
        // Interleaved: block w right after key 2w + 1, so each row's visible columns lead.
        let a = o::CompressedMask {
            window: Some(2),
            compress_rate: 2,
            n_blocks: 2,
            selected: false,
            interleaved: true,
        };
        let m = mask(&[pos.clone(), pos], a);
        let vis: Vec<String> = m
            .chunks(8)
            .map(|r| {
                r.iter()
                    .map(|v| if *v == 0.0 { '1' } else { '.' })
                    .collect()
            })
            .collect();
        assert_eq!(
            vis,
            ["1.......", "111.....", ".111....", "..1111..", "..1.111.", "..1..111"]
        );
    }
}
