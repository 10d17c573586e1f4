//! The per-patch numbers of the vision tower, computed in the plugin as transformers computes
//! them (`transformers.vision_utils`), in f32 where it uses f32: each patch's `(row, col)` in
//! merge order, the bilinear taps into the learned position table, and the 2-D rotary tables.

/// `(row, col)` of every patch of an `h × w` frame in spatial-merge order: `m × m` blocks
/// row-major, and row-major inside each block (the order the processor emits patches in).
pub fn merge_order(h: usize, w: usize, m: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(h * w);
    for block_row in 0..h / m {
        for block_col in 0..w / m {
            for in_row in 0..m {
                for in_col in 0..m {
                    out.push((block_row * m + in_row, block_col * m + in_col));
                }
            }
        }
    }
    out
}

/// One axis of bilinear interpolation with aligned corners: for target `index` on an axis of
/// `size`, the two source taps into a `side`-long table and their weights.
fn axis_taps(index: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    // torch: index.float() * (side - 1) / clamp(size - 1, min=1), all in f32.
    let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let floor = src.floor();
    let mut taps = [0; 2];
    let mut weights = [0.0; 2];
    for (o, (tap, weight)) in taps.iter_mut().zip(&mut weights).enumerate() {
        *tap = (floor as usize + o).min(side - 1);
        let distance = (src - floor - o as f32).abs();
        *weight = (1.0 - distance).max(0.0);
    }
    (taps, weights)
}

/// The rows of frames `(h, w)` laid one after another, reordered so each `kh × kw` block of a
/// frame (row-major blocks, row-major inside) is consecutive: the order a patch merger reads.
pub fn block_order(frames: &[(usize, usize)], kh: usize, kw: usize) -> Vec<i64> {
    let (mut order, mut base) = (vec![], 0);
    for &(h, w) in frames {
        for br in 0..h / kh {
            for bc in 0..w / kw {
                for r in 0..kh {
                    for c in 0..kw {
                        order.push((base + (br * kh + r) * w + bc * kw + c) as i64);
                    }
                }
            }
        }
        base += h * w;
    }
    order
}

/// The four taps (flat indices into the `side × side` table) and weights of every patch of an
/// `h × w` frame, in merge order (`m`): row taps outer, column taps inner, as transformers'
/// `get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True)`.
pub fn interpolation_taps(h: usize, w: usize, m: usize, side: usize) -> (Vec<i64>, Vec<f32>) {
    let mut idx = Vec::with_capacity(4 * h * w);
    let mut wts = Vec::with_capacity(4 * h * w);
    for (row, col) in merge_order(h, w, m) {
        push_grid_taps(
            side,
            axis_taps(row, h, side),
            axis_taps(col, w, side),
            &mut idx,
            &mut wts,
        );
    }
    (idx, wts)
}

/// Appends one patch's taps into a `side × side` table as the outer product of its row taps
/// and column taps (row taps outer, column taps inner): flat indices to `idx`, weights to `wts`.
pub fn push_grid_taps<const N: usize>(
    side: usize,
    (rt, rw): ([usize; N], [f32; N]),
    (ct, cw): ([usize; N], [f32; N]),
    idx: &mut Vec<i64>,
    wts: &mut Vec<f32>,
) {
    for i in 0..N {
        for j in 0..N {
            idx.push((rt[i] * side + ct[j]) as i64);
            wts.push(rw[i] * cw[j]);
        }
    }
}

/// The 2-D rotary tables `(cos, sin)`, `[patches, head_dim]` each, for patches at `(row, col)`:
/// a quarter of the head's frequencies rotate by the row, a quarter by the column, and the
/// whole repeated for the `rotate_half` pairs (transformers' axial rope).
pub fn rotary_tables(pos: &[(usize, usize)], head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let spatial = head_dim / 2;
    let inv_freq: Vec<f32> = (0..spatial / 2)
        .map(|j| 1.0 / (theta as f32).powf((2 * j) as f32 / spatial as f32))
        .collect();
    let mut cos = Vec::with_capacity(pos.len() * head_dim);
    let mut sin = Vec::with_capacity(pos.len() * head_dim);
    for &(row, col) in pos {
        let angles: Vec<f32> = inv_freq
            .iter()
            .map(|f| row as f32 * f)
            .chain(inv_freq.iter().map(|f| col as f32 * f))
            .collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_order_walks_two_by_two_blocks() {
        let o = merge_order(2, 4, 2);
        assert_eq!(
            o,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }

    #[test]
    fn taps_hit_the_corners_and_weights_sum_to_one() {
        let side = 4;
        let (idx, w) = interpolation_taps(4, 6, 2, side);
        // The first patch is the table's corner, wholly.
        assert_eq!(idx[0], 0);
        assert_eq!(w[0], 1.0);
        // A grid as large as the table reads it unchanged.
        let (same, sw) = interpolation_taps(4, 4, 1, side);
        for p in 0..16 {
            assert_eq!(same[4 * p], p as i64);
            assert_eq!(sw[4 * p], 1.0);
        }
        for q in w.chunks(4) {
            assert!((q.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        // The last patch in merge order is the bottom-right corner.
        assert_eq!(idx[idx.len() - 4], (side * side - 1) as i64);
    }

    #[test]
    fn rotary_rows_and_columns_take_a_quarter_each() {
        let (cos, sin) = rotary_tables(&[(0, 0), (2, 3)], 8, 10_000.0);
        assert!(cos[..8].iter().all(|&c| c == 1.0));
        assert!(sin[..8].iter().all(|&s| s == 0.0));
        // head_dim 8: frequencies 1 and 0.01; row 2 then column 3, repeated.
        let want = [2.0f32, 0.02, 3.0, 0.03];
        for (k, a) in want.iter().enumerate() {
            assert!((cos[8 + k] - a.cos()).abs() < 1e-6);
            assert_eq!(cos[8 + k], cos[12 + k]);
        }
    }
}
