//! `log Σ exp(x)` of one row, vectorized: the normaliser of every logprob a user sees
//! (generation, scoring, the RL trainer's policy ratio), over rows as long as the vocabulary.

use super::simd::{self, simd_kernel};

simd_kernel! {
    /// `(max, Σ exp(x - max))` with 16 lanes: the exponentials in f32, their sums in f64, the
    /// lanes folded by a fixed pairwise tree, so the result is the same bits on every SIMD level
    /// and for every caller.
    fn max_and_sum(row: &[f32]) -> (f32, f64) {
        let mut mx = [f32::NEG_INFINITY; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                mx[l] = mx[l].max(c[l]);
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            mx[l] = mx[l].max(v);
        }
        let m = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut acc = [0f64; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                acc[l] += simd::exp(c[l] - m) as f64;
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            acc[l] += simd::exp(v - m) as f64;
        }
        let mut width = 8;
        while width > 0 {
            for l in 0..width {
                acc[l] += acc[l + width];
            }
            width /= 2;
        }
        (m, acc[0])
    }
}

/// `log Σ_i exp(row[i])` in f64 (`-inf` for an empty row or one of `-inf` only; NaN entries are
/// ignored by the max). One fixed order of operations, whatever the CPU.
pub fn logsumexp(row: &[f32]) -> f64 {
    let (m, s) = max_and_sum(row);
    if m == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    m as f64 + s.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_an_f64_reference_and_handles_edges() {
        let row: Vec<f32> = (0..1000)
            .map(|i| ((i * 37) % 101) as f32 * 0.173 - 8.0)
            .collect();
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let want = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        assert!(
            (logsumexp(&row) - want).abs() < 1e-6,
            "{} vs {want}",
            logsumexp(&row)
        );
        assert_eq!(logsumexp(&[]), f64::NEG_INFINITY);
        assert_eq!(logsumexp(&[f32::NEG_INFINITY; 3]), f64::NEG_INFINITY);
        assert!((logsumexp(&[0.0, 0.0]) - 2f64.ln()).abs() < 1e-7);
        // Large logits do not overflow.
        assert!((logsumexp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-6);
    }
}
