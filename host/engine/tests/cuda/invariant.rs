//! Batch-invariant mode on the GPU (part of the `cuda_ops` test binary): a row computed alone
//! (a decode step) equals, bit for bit, the same row inside a larger batch (a full forward), for
//! products and attention, as RL's zero logprob mismatch needs; and f32 products give the CPU's
//! packed-kernel bits (each element one FMA chain over k).

use super::*;
use anneal_engine::invariant::set_batch_invariant;
use anneal_engine::ops::AttentionParams;

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|x| x.to_bits()).collect()
}

fn positions(start: usize, n: usize) -> Tensor {
    Tensor::from_vec((start as i64..(start + n) as i64).collect(), &[n]).expect("positions")
}

#[test]
fn products_are_row_invariant_and_match_the_cpu_bits() {
    if !gpu_or_skip("products_are_row_invariant_and_match_the_cpu_bits") {
        return;
    }
    let _mode = set_batch_invariant(true);
    // Rows across a 64-row tile, k across several 16-wide steps and a ragged end, n ragged.
    let t = 80;
    for (k, n) in [(64usize, 112usize), (37, 16), (112, 65)] {
        let x = rand(&[1, t, k], 40 + k as u64);
        let w = rand(&[n, k], 41 + n as u64).transpose(0, 1).expect("view");
        let full = gpu(&x).matmul(&gpu(&w)).expect("matmul");
        for r in [0, 10, 63, 64, 79] {
            let one = gpu(&x.narrow(1, r, 1).expect("row"))
                .matmul(&gpu(&w))
                .expect("row matmul");
            assert_eq!(
                bits(&one),
                bits(&full.narrow(1, r, 1).expect("row")),
                "k={k} n={n} row {r}"
            );
        }
        if anneal_engine::matmul_kernels().starts_with("f32: packed") {
            assert_eq!(
                bits(&full),
                bits(&x.matmul(&w).expect("cpu")),
                "k={k} n={n}: the CPU's bits"
            );
        }
        // bf16 operands: invariant too (one chain in f32, rounded once).
        let (xb, wb) = (
            x.to_dtype(DType::BF16).expect("bf16"),
            w.to_dtype(DType::BF16).expect("bf16"),
        );
        let full = gpu(&xb).matmul(&gpu(&wb)).expect("bf16 matmul");
        assert_eq!(full.dtype(), DType::BF16);
        close(
            "bf16 invariant product",
            &full,
            &xb.to_dtype(DType::F32)
                .expect("f32")
                .matmul(&wb.to_dtype(DType::F32).expect("f32"))
                .expect("cpu"),
            1e-2,
        );
        for r in [0, 64, 79] {
            let one = gpu(&xb.narrow(1, r, 1).expect("row"))
                .matmul(&gpu(&wb))
                .expect("row");
            assert_eq!(
                bits(&one),
                bits(&full.narrow(1, r, 1).expect("row")),
                "bf16 row {r}"
            );
        }
    }
    // Batched (3-d by 3-d) products, as attention-free MLA and MoE use them.
    let a = rand(&[3, 20, 24], 50);
    let b = rand(&[3, 24, 9], 51);
    let full = gpu(&a).matmul(&gpu(&b)).expect("batched");
    let one = gpu(&a.narrow(1, 7, 1).expect("row"))
        .matmul(&gpu(&b))
        .expect("batched row");
    assert_eq!(bits(&one), bits(&full.narrow(1, 7, 1).expect("row")));
    if anneal_engine::matmul_kernels().starts_with("f32: packed") {
        assert_eq!(bits(&full), bits(&a.matmul(&b).expect("cpu")));
    }
}

#[test]
fn attention_rows_are_invariant_between_decode_and_full_forward() {
    if !gpu_or_skip("attention_rows_are_invariant_between_decode_and_full_forward") {
        return;
    }
    let _mode = set_batch_invariant(true);
    let t = 40; // crosses two 16-row query and key tiles
    for (d, window) in [(16usize, None), (32, None), (16, Some(7usize))] {
        let q = gpu(&rand(&[1, 4, t, d], 60 + d as u64));
        let k = gpu(&rand(&[1, 2, t, d], 61 + d as u64));
        let v = gpu(&rand(&[1, 2, t, d], 62 + d as u64));
        let p = AttentionParams {
            causal: true,
            sliding_window: window,
            q_pos: Some(positions(0, t)),
            k_pos: Some(positions(0, t)),
            ..Default::default()
        };
        let full = q.attention(&k, &v, &p).expect("full");
        for r in [0, 10, 15, 16, 31, 39] {
            let pr = AttentionParams {
                causal: true,
                sliding_window: window,
                q_pos: Some(positions(r, 1)),
                k_pos: Some(positions(0, r + 1)),
                ..Default::default()
            };
            let one = q
                .narrow(2, r, 1)
                .expect("q row")
                .attention(
                    &k.narrow(2, 0, r + 1).expect("keys"),
                    &v.narrow(2, 0, r + 1).expect("values"),
                    &pr,
                )
                .expect("decode step");
            assert_eq!(
                bits(&one),
                bits(&full.narrow(2, r, 1).expect("row")),
                "d={d} window={window:?} row {r}"
            );
        }
    }
}
