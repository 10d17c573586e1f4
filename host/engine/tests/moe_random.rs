//! Grouped (MoE) matmul, expert routing helpers, dropout and the random tensor constructors.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{histogram, sort_by_expert};
use anneal_engine::rng::RngKey;
use anneal_engine::{autograd, DType, Error, Tensor};
use common::*;

#[test]
fn grouped_matmul_matches_pytorch_with_grads() {
    let f = load_safetensors(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/index.safetensors"
    ))
    .unwrap();
    let x = f["gmm.x"].detach().requires_grad_();
    let w = f["gmm.w"].detach().requires_grad_();
    // Counts given as a tensor here, as a slice below.
    let out = x.grouped_matmul(&w, &f["gmm.counts"]).unwrap();
    assert_close(
        "gmm.out",
        &out.to_vec_f32(),
        &f["gmm.out"].to_vec_f32(),
        1e-5,
        1e-5,
    );
    out.backward_with(f["gmm.grad"].clone()).unwrap();
    let (gx, gw) = (x.grad().unwrap(), w.grad().unwrap());
    assert_eq!(gw.shape(), &[4, 8, 6]);
    assert_close(
        "gmm.grad_x",
        &gx.to_vec_f32(),
        &f["gmm.grad_x"].to_vec_f32(),
        1e-5,
        1e-5,
    );
    assert_close(
        "gmm.grad_w",
        &gw.to_vec_f32(),
        &f["gmm.grad_w"].to_vec_f32(),
        1e-5,
        1e-5,
    );
}

#[test]
fn grouped_matmul_grads_match_finite_differences() {
    let x = randn(&[9, 5], "x");
    let w = randn(&[3, 5, 4], "w");
    check_grad("grouped_matmul", &[x, w], &[], |t| {
        t[0].grouped_matmul(&t[1], &[2usize, 0, 7])
    });
}

#[test]
fn grouped_matmul_equals_per_expert_matmul_and_is_thread_invariant() {
    // Enough rows for several row blocks per expert.
    let counts = [300usize, 0, 129, 1, 70];
    let n: usize = counts.iter().sum();
    // K above the 128-row task block, so weight-gradient tasks split each expert.
    let x = randn(&[n, 160], "x");
    let w = randn(&[5, 160, 40], "w");
    let out = x.grouped_matmul(&w, &counts).unwrap();
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        let want = x
            .narrow(0, start, c)
            .unwrap()
            .matmul(&w.narrow(0, e, 1).unwrap().squeeze(0).unwrap())
            .unwrap();
        let got = out.narrow(0, start, c).unwrap();
        assert_close("expert", &got.to_vec_f32(), &want.to_vec_f32(), 1e-4, 1e-4);
        start += c;
    }
    let g = randn(&[n, 40], "g");
    assert_thread_invariant("grouped_matmul", || {
        let (xl, wl) = (x.detach().requires_grad_(), w.detach().requires_grad_());
        let out = xl.grouped_matmul(&wl, &counts).unwrap();
        out.backward_with(g.clone()).unwrap();
        vec![out, xl.grad().unwrap(), wl.grad().unwrap()]
    });
    let (xl, wl) = (x.detach().requires_grad_(), w.detach().requires_grad_());
    xl.grouped_matmul(&wl, &counts)
        .unwrap()
        .backward_with(g.clone())
        .unwrap();
    let gw = wl.grad().unwrap();
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        let xe = x.narrow(0, start, c).unwrap();
        let want = xe
            .transpose(0, 1)
            .unwrap()
            .matmul(&g.narrow(0, start, c).unwrap())
            .unwrap();
        let got = gw.narrow(0, e, 1).unwrap();
        assert_close("grad_w", &got.to_vec_f32(), &want.to_vec_f32(), 1e-4, 1e-3);
        start += c;
    }
    // bf16 operands give a bf16 result.
    let xb = x.to_dtype(DType::BF16).unwrap();
    let wb = w.to_dtype(DType::BF16).unwrap();
    assert_eq!(
        xb.grouped_matmul(&wb, &counts).unwrap().dtype(),
        DType::BF16
    );
}

#[test]
fn grouped_matmul_runs_each_expert_on_the_packed_kernel() {
    // The packed kernels (AVX-512, AVX2) give a row the same bits whatever the product's size,
    // so on such a CPU each expert's block (forward, input and weight gradients) is bitwise the
    // dense product of that expert alone. Elsewhere the grouped product uses `gemm` tasks.
    if !anneal_engine::matmul_kernels().starts_with("f32: packed") {
        return;
    }
    let counts = [300usize, 0, 129, 5, 70];
    let n: usize = counts.iter().sum();
    let x = randn(&[n, 160], "x").requires_grad_();
    let w = randn(&[5, 160, 40], "w").requires_grad_();
    let g = randn(&[n, 40], "g");
    let out = x.grouped_matmul(&w, &counts).unwrap();
    out.backward_with(g.clone()).unwrap();
    let (gx, gw) = (x.grad().unwrap(), w.grad().unwrap());
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        let (xe, ge) = (
            x.narrow(0, start, c).unwrap(),
            g.narrow(0, start, c).unwrap(),
        );
        let we = w.narrow(0, e, 1).unwrap().squeeze(0).unwrap();
        let rows = |t: &Tensor| t.narrow(0, start, c).unwrap();
        if c >= 4 {
            assert!(
                bits(&rows(&out)) == bits(&xe.matmul(&we).unwrap()),
                "out {e}"
            );
            let want = ge.matmul(&we.transpose(0, 1).unwrap()).unwrap();
            assert!(bits(&rows(&gx)) == bits(&want), "grad_x {e}");
        }
        let want = xe.transpose(0, 1).unwrap().matmul(&ge).unwrap();
        let got = gw.narrow(0, e, 1).unwrap().squeeze(0).unwrap();
        assert!(bits(&got) == bits(&want), "grad_w {e}");
        start += c;
    }
}

#[test]
fn grouped_matmul_in_bf16_and_under_autocast() {
    let counts = [300usize, 0, 129, 5, 70];
    let n: usize = counts.iter().sum();
    let x = randn(&[n, 160], "x");
    let w = randn(&[5, 160, 40], "w");
    let g = randn(&[n, 40], "g");
    let (xb, wb) = (
        x.to_dtype(DType::BF16).unwrap(),
        w.to_dtype(DType::BF16).unwrap(),
    );
    let out = xb.grouped_matmul(&wb, &counts).unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    // Close to the f32 product of the rounded operands (f32 accumulation inside).
    let want = xb
        .to_dtype(DType::F32)
        .unwrap()
        .grouped_matmul(&wb.to_dtype(DType::F32).unwrap(), &counts)
        .unwrap();
    assert_close("bf16", &out.to_vec_f32(), &want.to_vec_f32(), 1e-2, 5e-2);
    if anneal_engine::matmul_kernels().contains("bf16: AVX512-BF16") {
        // On the bf16 kernel each expert's block is bitwise the dense bf16 product.
        let mut start = 0;
        for (e, &c) in counts.iter().enumerate() {
            let we = wb.narrow(0, e, 1).unwrap().squeeze(0).unwrap();
            let dense = xb.narrow(0, start, c).unwrap().matmul(&we).unwrap();
            let got = out.narrow(0, start, c).unwrap();
            assert!(
                c < 4 || got.to_vec_f32() == dense.to_vec_f32(),
                "expert {e}"
            );
            start += c;
        }
    }
    // Autocast: f32 leaves, bf16 product, f32 gradients back to the leaves.
    let (xl, wl) = (x.detach().requires_grad_(), w.detach().requires_grad_());
    let out = {
        let _amp = anneal_engine::autocast::set_autocast(Some(DType::BF16));
        xl.grouped_matmul(&wl, &counts).unwrap()
    };
    assert_eq!(out.dtype(), DType::BF16);
    out.backward_with(g.to_dtype(DType::BF16).unwrap()).unwrap();
    let (gx, gw) = (xl.grad().unwrap(), wl.grad().unwrap());
    assert_eq!((gx.dtype(), gw.dtype()), (DType::F32, DType::F32));
    assert_eq!(gw.shape(), &[5, 160, 40]);
    assert_thread_invariant("grouped_matmul bf16", || {
        let (xl, wl) = (xb.detach().requires_grad_(), wb.detach().requires_grad_());
        let out = xl.grouped_matmul(&wl, &counts).unwrap();
        out.backward_with(g.to_dtype(DType::BF16).unwrap()).unwrap();
        vec![out, xl.grad().unwrap(), wl.grad().unwrap()]
    });
}

#[test]
fn grouped_matmul_nt_reads_linear_weights_in_place() {
    let counts = [7usize, 0, 20, 3];
    let n: usize = counts.iter().sum();
    let x = randn(&[n, 12], "x");
    // [E, out, in]: each w[e] is a Linear weight.
    let w_oi = randn(&[4, 9, 12], "w");
    let w_io = w_oi.transpose(1, 2).unwrap().contiguous().unwrap();
    let out = x.grouped_matmul_nt(&w_oi, &counts).unwrap();
    let want = x.grouped_matmul(&w_io, &counts).unwrap();
    assert_close("nt", &out.to_vec_f32(), &want.to_vec_f32(), 1e-6, 1e-6);
    check_grad("grouped_matmul_nt", &[x.clone(), w_oi.clone()], &[], |t| {
        t[0].grouped_matmul_nt(&t[1], &counts)
    });
    let msg = x.grouped_matmul_nt(&w_io, &counts).unwrap_err().to_string();
    assert!(msg.contains("grouped_matmul: shape mismatch"), "{msg}");
}

#[test]
fn grouped_matmul_is_bitwise_identical_for_1_to_4_threads() {
    // The split between experts spread over the pool and experts run one per task depends on
    // the thread count; the bits must not.
    let counts = [400usize, 3, 0, 150, 90, 60, 41];
    let n: usize = counts.iter().sum();
    let x = randn(&[n, 96], "x");
    let w = randn(&[7, 96, 80], "w");
    let g = randn(&[n, 80], "g");
    let run = |threads: usize| -> Vec<Vec<u32>> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let (xl, wl) = (x.detach().requires_grad_(), w.detach().requires_grad_());
                let out = xl.grouped_matmul(&wl, &counts).unwrap();
                out.backward_with(g.clone()).unwrap();
                [out, xl.grad().unwrap(), wl.grad().unwrap()]
                    .iter()
                    .map(|t| t.to_vec_f32().iter().map(|v| v.to_bits()).collect())
                    .collect()
            })
    };
    let one = run(1);
    for threads in 2..=4 {
        assert!(run(threads) == one, "{threads} threads differ from 1");
    }
}

#[test]
fn grouped_matmul_errors() {
    let x = randn(&[6, 4], "x");
    let w = randn(&[2, 4, 3], "w");
    let msg = x.grouped_matmul(&w, &[2usize, 3]).unwrap_err().to_string();
    assert!(
        msg.contains("grouped_matmul") && msg.contains("sum to 5"),
        "{msg}"
    );
    let msg = x.grouped_matmul(&w, &[6usize]).unwrap_err().to_string();
    assert!(msg.contains("1 counts for 2 experts"), "{msg}");
    assert!(matches!(
        x.grouped_matmul(&randn(&[2, 5, 3], "w5"), &[3usize, 3])
            .unwrap_err(),
        Error::ShapeMismatch {
            op: "grouped_matmul",
            ..
        }
    ));
    let neg = Tensor::from_slice(&[7i64, -1], &[2]).unwrap();
    assert!(x.grouped_matmul(&w, &neg).is_err());
    let fcounts = Tensor::from_slice(&[3.0f32, 3.0], &[2]).unwrap();
    assert!(x.grouped_matmul(&w, &fcounts).is_err());
}

#[test]
fn sort_by_expert_builds_a_stable_permutation() {
    // 4 tokens, top-2 routing over 3 experts.
    let ids = Tensor::from_slice(&[2i64, 0, 0, 1, 2, 1, 0, 2], &[4, 2]).unwrap();
    let r = sort_by_expert(&ids, 3).unwrap();
    assert_eq!(r.counts.to_vec::<i64>(), vec![3, 2, 3]);
    assert_eq!(r.order.to_vec::<i64>(), vec![1, 2, 6, 3, 5, 0, 4, 7]);
    assert_eq!(r.token.to_vec::<i64>(), vec![0, 1, 3, 1, 2, 0, 2, 3]);
    let inv = r.inverse.to_vec::<i64>();
    for (slot, &a) in r.order.to_vec::<i64>().iter().enumerate() {
        assert_eq!(inv[a as usize], slot as i64);
    }
    assert_eq!(
        histogram(&ids, 4).unwrap().to_vec::<i64>(),
        vec![3, 2, 3, 0]
    );

    // End to end: route, expert products, un-permute, combine = a per-token reference.
    let x = randn(&[4, 6], "x");
    let w = randn(&[3, 6, 5], "w");
    let sorted = x.index_select(0, &r.token).unwrap();
    let y = sorted.grouped_matmul(&w, &r.counts).unwrap();
    let back = y
        .index_select(0, &r.inverse)
        .unwrap()
        .reshape(&[4, 2, 5])
        .unwrap();
    let idv = ids.to_vec::<i64>();
    for t in 0..4 {
        for c in 0..2 {
            let e = idv[t * 2 + c] as usize;
            let want = x
                .narrow(0, t, 1)
                .unwrap()
                .matmul(&w.narrow(0, e, 1).unwrap().squeeze(0).unwrap())
                .unwrap();
            let got = back.narrow(0, t, 1).unwrap().narrow(1, c, 1).unwrap();
            assert_close("routed", &got.to_vec_f32(), &want.to_vec_f32(), 1e-5, 1e-5);
        }
    }
    // Gradients through the whole routed layer: gather rows, expert products, un-permute,
    // gate-weighted combine.
    let gates = rand(&[4, 2], 0.1, 1.0, "gates");
    check_grad("moe_layer", &[x, w, gates], &[], |t| {
        let y = t[0]
            .index_select(0, &r.token)?
            .grouped_matmul(&t[1], &r.counts)?
            .index_select(0, &r.inverse)?
            .reshape(&[4, 2, 5])?;
        y.mul(&t[2].unsqueeze(-1)?)?.sum_dims(&[1], false)
    });
    assert!(matches!(
        sort_by_expert(&ids, 2).unwrap_err(),
        Error::IndexOutOfRange {
            op: "sort_by_expert",
            index: 2,
            size: 2
        }
    ));
    assert!(sort_by_expert(&Tensor::zeros(&[4], DType::I64), 2).is_err());
}

#[test]
fn dropout_mask_is_reproducible_and_scaled() {
    let key = RngKey::new(5, "layer.0.dropout");
    let x = Tensor::ones(&[1000], DType::F32);
    let y = x.dropout(0.3, &key, 17).unwrap().to_vec_f32();
    let kept = y.iter().filter(|&&v| v != 0.0).count();
    assert!((600..800).contains(&kept), "kept {kept} of 1000");
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
    // Same (key, offset) → same mask; the mask of element i depends only on offset + i.
    assert_eq!(y, x.dropout(0.3, &key, 17).unwrap().to_vec_f32());
    let shifted = x.dropout(0.3, &key, 18).unwrap().to_vec_f32();
    assert_eq!(&y[1..], &shifted[..999]);
    assert_ne!(
        y,
        x.dropout(0.3, &key.fold("step1"), 17).unwrap().to_vec_f32()
    );
    assert_eq!(
        x.dropout(0.0, &key, 0).unwrap().to_vec_f32(),
        x.to_vec_f32()
    );
    assert!(x
        .dropout(1.0, &key, 0)
        .unwrap()
        .to_vec_f32()
        .iter()
        .all(|&v| v == 0.0));
    assert!(x.dropout(1.5, &key, 0).is_err());
    assert!(x.dropout(-0.1, &key, 0).is_err());
}

#[test]
fn dropout_backward_uses_the_forward_mask() {
    let key = RngKey::new(9, "drop");
    let x = randn(&[7, 9], "x");
    check_grad("dropout", std::slice::from_ref(&x), &[], |t| {
        t[0].dropout(0.4, &key, 3)
    });
    let xl = x.detach().requires_grad_();
    let y = xl.dropout(0.4, &key, 3).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let g = xl.grad().unwrap().to_vec_f32();
    let mask = Tensor::dropout_mask(&[7, 9], 0.4, &key, 3)
        .unwrap()
        .to_vec_f32();
    assert_eq!(g, mask);
    // Under recomputation (no grad) the forward gives the same values.
    let again = {
        let _g = autograd::no_grad();
        x.dropout(0.4, &key, 3).unwrap()
    };
    assert_eq!(again.to_vec_f32(), y.to_vec_f32());
}

#[test]
fn random_tensors_are_thread_invariant() {
    let key = RngKey::new(3, "init");
    assert_thread_invariant("random", || {
        vec![
            Tensor::rand_uniform(&[70_001], -1.0, 1.0, &key, 11, DType::F32).unwrap(),
            Tensor::rand_normal(&[300, 301], 0.0, 0.02, &key, 5, DType::F32).unwrap(),
            Tensor::rand_normal(&[999], 1.0, 2.0, &key, 0, DType::BF16).unwrap(),
            Tensor::ones(&[50_000], DType::F32)
                .dropout(0.1, &key, 7)
                .unwrap(),
            Tensor::bernoulli(&[20_000], 0.25, &key, 0, DType::F32).unwrap(),
        ]
    });
    let b = Tensor::bernoulli(&[20_000], 0.25, &key, 0, DType::I64).unwrap();
    let ones = b.to_vec::<i64>().iter().filter(|&&v| v == 1).count();
    assert!((4500..5500).contains(&ones), "{ones}");
}

/// Timing figures (not a check): `cargo test --release --test moe_random -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_moe_and_index_ops() {
    use std::time::Instant;
    let time = |name: &str, flops: f64, f: &dyn Fn()| {
        f();
        let reps = 5;
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        if flops > 0.0 {
            println!("{name}: {:.2} ms, {:.1} GFLOP/s", s * 1e3, flops / s / 1e9);
        } else {
            println!("{name}: {:.2} ms", s * 1e3);
        }
    };
    let (n, k, m, e) = (4096, 512, 1024, 8);
    let x = randn(&[n, k], "x");
    let w = randn(&[e, k, m], "w");
    let w0 = randn(&[k, m], "w0");
    let counts = vec![n / e; e];
    let flops = 2.0 * (n * k * m) as f64;
    time("matmul [4096,512]@[512,1024]", flops, &|| {
        x.matmul(&w0).unwrap();
    });
    time("grouped_matmul 8 experts, same shape", flops, &|| {
        x.grouped_matmul(&w, &counts).unwrap();
    });
    let g = randn(&[n, m], "g");
    time("grouped_matmul forward+backward", 3.0 * flops, &|| {
        let (xl, wl) = (x.detach().requires_grad_(), w.detach().requires_grad_());
        xl.grouped_matmul(&wl, &counts)
            .unwrap()
            .backward_with(g.clone())
            .unwrap();
    });
    let logits = randn(&[2048, 32_000], "logits");
    time("topk k=8 of [2048, 32000]", 0.0, &|| {
        logits.topk(8, 1, true, true).unwrap();
    });
    let router = randn(&[8192, 64], "router");
    time("topk k=8 of [8192, 64] (router)", 0.0, &|| {
        router.topk(8, 1, true, true).unwrap();
    });
    let table = randn(&[32_000, 512], "table");
    let ids = rand(&[8192], 0.0, 31_999.0, "ids")
        .to_dtype(DType::I64)
        .unwrap();
    time("index_select 8192 rows of [32000, 512]", 0.0, &|| {
        table.index_select(0, &ids).unwrap();
    });
    let rows = table.index_select(0, &ids).unwrap();
    time("index_add 8192 rows into [32000, 512]", 0.0, &|| {
        Tensor::zeros(&[32_000, 512], DType::F32)
            .index_add(0, &ids, &rows)
            .unwrap();
    });
    let a = randn(&[64, 256, 128], "a");
    time("cat 2x[64,256,128] dim 2", 0.0, &|| {
        anneal_engine::ops::cat(&[a.clone(), a.clone()], 2).unwrap();
    });
    let scores = randn(&[8, 8, 256, 256], "scores");
    let causal: Vec<i64> = (0..256 * 256)
        .map(|i| ((i % 256) > (i / 256)) as i64)
        .collect();
    let causal = Tensor::from_vec(causal, &[256, 256]).unwrap();
    time(
        "masked_fill [8,8,256,256] with a [256,256] mask",
        0.0,
        &|| {
            scores.masked_fill(&causal, f32::NEG_INFINITY).unwrap();
        },
    );
    let key = RngKey::new(1, "d");
    time("dropout 4M elements", 0.0, &|| {
        a.dropout(0.1, &key, 0).unwrap();
    });
}
