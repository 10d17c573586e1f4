//! The CUDA index, selection, dropout, LayerNorm and MoE kernels against the CPU backend (part of
//! the `cuda_ops` test binary). Copies and f32 accumulations in the CPU's order must match bit
//! for bit (tolerance 0); sums in another order within 1e-5 of the largest value.

use super::*;
use anneal_engine::backend::{backend_for, fused_backend_for};
use anneal_engine::rng::RngKey;

fn ids(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).expect("index")
}

/// Both indices and values equal bit for bit (NaN included), as `topk` must be.
fn same_topk(what: &str, got: &(Tensor, Tensor), want: &(Tensor, Tensor)) {
    assert_eq!(got.0.shape(), want.0.shape(), "{what}: shapes");
    assert_eq!(got.0.dtype(), want.0.dtype(), "{what}: value dtype");
    let bits = |t: &Tensor| -> Vec<u32> { t.to_vec_f32().iter().map(|v| v.to_bits()).collect() };
    assert_eq!(bits(&got.0), bits(&want.0), "{what}: values");
    assert_eq!(
        got.1.to_vec::<i64>(),
        want.1.to_vec::<i64>(),
        "{what}: indices"
    );
}

#[test]
fn index_kernels_match_the_cpu() {
    if !gpu_or_skip("index_kernels_match_the_cpu") {
        return;
    }
    let (cpu, cuda) = (
        backend_for(Device::Cpu).expect("cpu"),
        backend_for(GPU).expect("cuda"),
    );
    let x = rand(&[4, 6, 5], 100);
    let xb = x.to_dtype(DType::BF16).expect("bf16");
    let pick = ids(&[5, 0, 5, 2], &[4]);
    for (dim, t) in [(0usize, &x), (1, &x), (2, &x), (1, &xb)] {
        let p = ids(&[3, 0, 3], &[3]);
        let idx = if dim == 1 { &pick } else { &p };
        let got = cuda.index_select(&gpu(t), dim, &gpu(idx)).expect("cuda");
        let want = cpu.index_select(t, dim, idx).expect("cpu");
        assert_eq!(got.dtype(), want.dtype(), "index_select dtype");
        close(&format!("index_select dim {dim}"), &got, &want, 0.0);
    }
    let wide = ids(&[0, 9, 3, 9, 7], &[5]);
    let table = ids(&(0..40).collect::<Vec<i64>>(), &[10, 4]);
    assert_eq!(
        cuda.index_select(&gpu(&table), 0, &gpu(&wide))
            .expect("cuda")
            .to_vec::<i64>(),
        cpu.index_select(&table, 0, &wide)
            .expect("cpu")
            .to_vec::<i64>(),
        "index_select of i64 rows"
    );
    // Repeated targets accumulate in index order (bit for bit with the CPU).
    let src = rand(&[4, 4, 5], 101);
    close(
        "index_add",
        &cuda
            .index_add(&gpu(&x), 1, &gpu(&pick), &gpu(&src))
            .expect("cuda"),
        &cpu.index_add(&x, 1, &pick, &src).expect("cpu"),
        0.0,
    );
    // gather / scatter_add with an index smaller than x and src in the other dims.
    let gi = ids(
        &[0, 3, 3, 1, 5, 0, 2, 2, 4, 1, 0, 5, 3, 3, 3, 0, 1, 2],
        &[3, 3, 2],
    );
    close(
        "gather",
        &cuda.gather(&gpu(&x), 1, &gpu(&gi)).expect("cuda"),
        &cpu.gather(&x, 1, &gi).expect("cpu"),
        0.0,
    );
    let big = rand(&[4, 4, 3], 102);
    close(
        "scatter_add",
        &cuda
            .scatter_add(&gpu(&x), 1, &gpu(&gi), &gpu(&big))
            .expect("cuda"),
        &cpu.scatter_add(&x, 1, &gi, &big).expect("cpu"),
        0.0,
    );
    let bad = ids(&[0, 6], &[2]);
    let err = cuda
        .index_select(&gpu(&x), 1, &gpu(&bad))
        .expect_err("6 is past dim 1 of size 6");
    assert!(err.to_string().contains("index_select"), "{err}");

    // where over broadcast views (a row of conditions, a column of values), expanded on the
    // GPU so the kernel reads them as views.
    let cond = Tensor::from_slice(&[1.0f32, 0.0, 0.0, 2.0, 0.0], &[1, 5]).expect("cond");
    let a = rand(&[6, 1], 103);
    let b = rand(&[6, 5], 104);
    let wide = |t: &Tensor| t.expand(&[6, 5]).expect("view");
    for dtype in [DType::F32, DType::BF16] {
        close(
            "where",
            &cuda
                .where_(&wide(&gpu(&cond)), &wide(&gpu(&a)), &gpu(&b), dtype)
                .expect("cuda"),
            &cpu.where_(&wide(&cond), &wide(&a), &b, dtype).expect("cpu"),
            0.0,
        );
    }

    // cat of three inputs along a middle dim, one of them a strided view, in two dtypes.
    let parts = [
        rand(&[3, 2, 4], 105),
        rand(&[3, 5, 4], 106),
        rand(&[3, 1, 4], 107),
    ];
    let strided = rand(&[3, 4, 2], 108).transpose(1, 2).expect("view");
    for dtype in [DType::F32, DType::BF16] {
        let mut cpu_in: Vec<Tensor> = parts
            .iter()
            .map(|t| t.to_dtype(dtype).expect("cast"))
            .collect();
        cpu_in.push(strided.to_dtype(dtype).expect("cast"));
        let mut gpu_in: Vec<Tensor> = parts
            .iter()
            .map(|t| gpu(&t.to_dtype(dtype).expect("cast")))
            .collect();
        gpu_in.push(
            gpu(&rand(&[3, 4, 2], 108).to_dtype(dtype).expect("cast"))
                .transpose(1, 2)
                .expect("view"),
        );
        close(
            "cat",
            &cuda.cat(&gpu_in, 1).expect("cuda"),
            &cpu.cat(&cpu_in, 1).expect("cpu"),
            0.0,
        );
    }
}

#[test]
fn topk_matches_the_cpu_with_ties_and_nan() {
    if !gpu_or_skip("topk_matches_the_cpu_with_ties_and_nan") {
        return;
    }
    let (cpu, cuda) = (
        backend_for(Device::Cpu).expect("cpu"),
        backend_for(GPU).expect("cuda"),
    );
    // Ties (lower index first) and a NaN (above every number) in a row of 300: more than one
    // block's worth of threads, so the block reduction's order matters.
    let mut v = values(7 * 300, 110, 1.0);
    for (i, x) in v.iter_mut().enumerate() {
        *x = (*x * 8.0).round(); // few distinct values: many ties
        if i == 17 {
            *x = f32::NAN;
        }
    }
    let x = Tensor::from_vec(v, &[7, 300]).expect("x");
    for (k, largest, sorted) in [
        (1, true, true),
        (8, true, true),
        (8, false, true),
        (20, true, false),
        (300, false, false),
    ] {
        same_topk(
            &format!("topk k={k} largest={largest} sorted={sorted}"),
            &cuda.topk(&gpu(&x), k, 1, largest, sorted).expect("cuda"),
            &cpu.topk(&x, k, 1, largest, sorted).expect("cpu"),
        );
    }
    // Along a leading dim, and on bf16 (values stay bf16).
    let y = rand(&[9, 4, 3], 111).to_dtype(DType::BF16).expect("bf16");
    same_topk(
        "topk dim 0 bf16",
        &cuda.topk(&gpu(&y), 3, 0, true, true).expect("cuda"),
        &cpu.topk(&y, 3, 0, true, true).expect("cpu"),
    );
    // The op (a router's call) runs on the GPU end to end.
    let scores = rand(&[16, 8], 112);
    let (gv, gi) = gpu(&scores).topk(2, -1, true, true).expect("op");
    let (cv, ci) = scores.topk(2, -1, true, true).expect("op");
    same_topk("topk op", &(gv, gi), &(cv, ci));
}

#[test]
fn dropout_draws_the_cpu_mask_bit_for_bit() {
    if !gpu_or_skip("dropout_draws_the_cpu_mask_bit_for_bit") {
        return;
    }
    let key = RngKey::new(7, "layers.3.attn").fold("step 12");
    let x = rand(&[33, 65], 120);
    for dtype in [DType::F32, DType::BF16] {
        let x = x.to_dtype(dtype).expect("cast");
        // An offset that is not a multiple of four starts mid Philox block.
        let got = gpu(&x).dropout(0.3, &key, 4099).expect("cuda");
        let want = x.dropout(0.3, &key, 4099).expect("cpu");
        assert_eq!(got.dtype(), want.dtype());
        close("dropout", &got, &want, 0.0);
    }
}

#[test]
fn layer_norm_matches_the_cpu() {
    if !gpu_or_skip("layer_norm_matches_the_cpu") {
        return;
    }
    let (cpu, cuda) = (
        fused_backend_for(Device::Cpu).expect("cpu"),
        fused_backend_for(GPU).expect("cuda"),
    );
    // Rows of 700 (several elements per thread) with an offset, so centering matters.
    let shifted: Vec<f32> = values(9 * 700, 130, 2.0).iter().map(|v| v + 3.0).collect();
    let x = Tensor::from_vec(shifted, &[9, 700]).expect("x");
    let (w, b, g) = (rand(&[700], 131), rand(&[700], 132), rand(&[9, 700], 133));
    for (wo, bo) in [(Some(&w), Some(&b)), (None, None), (Some(&w), None)] {
        let (o_c, m_c, r_c) = cpu.layer_norm(&x, wo, bo, 1e-5).expect("cpu");
        let gw = wo.map(gpu);
        let gb = bo.map(gpu);
        let (o_g, m_g, r_g) = cuda
            .layer_norm(&gpu(&x), gw.as_ref(), gb.as_ref(), 1e-5)
            .expect("cuda");
        close("layer_norm", &o_g, &o_c, 1e-5);
        close("layer_norm mean", &m_g, &m_c, 1e-5);
        close("layer_norm rstd", &r_g, &r_c, 1e-5);
        let need = (wo.is_some(), true);
        let (dx_c, dw_c, db_c) = cpu
            .layer_norm_backward(&x, wo, &m_c, &r_c, &g, need)
            .expect("cpu");
        let (dx_g, dw_g, db_g) = cuda
            .layer_norm_backward(&gpu(&x), gw.as_ref(), &m_g, &r_g, &gpu(&g), need)
            .expect("cuda");
        close("layer_norm dx", &dx_g, &dx_c, 1e-5);
        assert_eq!(dw_g.is_some(), dw_c.is_some(), "dw presence");
        if let (Some(a), Some(c)) = (&dw_g, &dw_c) {
            close("layer_norm dw", a, c, 1e-5);
        }
        close(
            "layer_norm db",
            db_g.as_ref().expect("db asked"),
            db_c.as_ref().expect("db asked"),
            1e-5,
        );
    }
    let xb = x.to_dtype(DType::BF16).expect("bf16");
    let (o_c, _, _) = cpu.layer_norm(&xb, Some(&w), Some(&b), 1e-5).expect("cpu");
    let (o_g, _, _) = cuda
        .layer_norm(&gpu(&xb), Some(&gpu(&w)), Some(&gpu(&b)), 1e-5)
        .expect("cuda");
    // bf16 outputs: one rounding apart at most (2⁻⁸ relative).
    close("layer_norm bf16", &o_g, &o_c, 1e-2);
}

#[test]
fn moe_routing_and_grouped_gemm_match_the_cpu() {
    if !gpu_or_skip("moe_routing_and_grouped_gemm_match_the_cpu") {
        return;
    }
    let (cpu, cuda) = (
        backend_for(Device::Cpu).expect("cpu"),
        backend_for(GPU).expect("cuda"),
    );
    // 5 tokens, k = 2 choices each, sorted into expert order by `order`; inverse[a] is the
    // sorted slot of assignment a.
    let (n, k, d) = (5usize, 2usize, 24usize);
    let order: Vec<i64> = vec![3, 0, 8, 5, 1, 9, 2, 7, 4, 6];
    let mut inverse = vec![0i64; n * k];
    for (s, &a) in order.iter().enumerate() {
        inverse[a as usize] = s as i64;
    }
    let token: Vec<i64> = order.iter().map(|&a| a / k as i64).collect();
    let (order, inverse, token) = (
        ids(&order, &[n * k]),
        ids(&inverse, &[n * k]),
        ids(&token, &[n * k]),
    );
    let x = rand(&[n, d], 140);
    close(
        "moe_dispatch",
        &cuda
            .moe_dispatch(&gpu(&x), &gpu(&token), DType::F32)
            .expect("cuda"),
        &cpu.moe_dispatch(&x, &token, DType::F32).expect("cpu"),
        0.0,
    );
    let gs = rand(&[n * k, d], 141);
    close(
        "moe_dispatch_backward",
        &cuda
            .moe_dispatch_backward(&gpu(&gs), &gpu(&inverse), k, DType::F32)
            .expect("cuda"),
        &cpu.moe_dispatch_backward(&gs, &inverse, k, DType::F32)
            .expect("cpu"),
        0.0,
    );
    let (y, w, g) = (
        rand(&[n * k, d], 142),
        rand(&[n, k], 143),
        rand(&[n, d], 144),
    );
    close(
        "moe_combine",
        &cuda
            .moe_combine(&gpu(&y), &gpu(&w), &gpu(&inverse), DType::F32)
            .expect("cuda"),
        &cpu.moe_combine(&y, &w, &inverse, DType::F32).expect("cpu"),
        0.0,
    );
    let dtypes = (DType::F32, DType::F32);
    let (dy_g, dw_g) = cuda
        .moe_combine_backward(
            &gpu(&y),
            &gpu(&w),
            &gpu(&g),
            &gpu(&order),
            &gpu(&inverse),
            (true, true),
            dtypes,
        )
        .expect("cuda");
    let (dy_c, dw_c) = cpu
        .moe_combine_backward(&y, &w, &g, &order, &inverse, (true, true), dtypes)
        .expect("cpu");
    close(
        "moe_combine dy",
        &dy_g.expect("dy"),
        &dy_c.expect("dy"),
        0.0,
    );
    // f64 sums in another order, rounded to f32: equal up to the last bit.
    close(
        "moe_combine dw",
        &dw_g.expect("dw"),
        &dw_c.expect("dw"),
        1e-6,
    );
    // Indices the device computed are not checked on the host: one past x's rows reads zeros
    // (the host's values are checked: an error there).
    let bad = ids(&[0, 99], &[2]);
    let got = cuda
        .moe_dispatch(&gpu(&x), &gpu(&bad), DType::F32)
        .expect("cuda")
        .to_vec_f32();
    assert_eq!(&got[..d], &x.to_vec_f32()[..d]);
    assert!(got[d..].iter().all(|&v| v == 0.0), "row 99 reads as zeros");
    assert!(cpu.moe_dispatch(&x, &bad, DType::F32).is_err());

    // Grouped GEMM over 4 experts with an empty group, both weight orientations, and the
    // weight gradient (an empty group's is zero).
    let counts = ids(&[3, 0, 5, 2], &[4]);
    let rows = 10;
    let (kk, m) = (16usize, 12usize);
    let xs = rand(&[rows, kk], 150);
    let we = rand(&[4, kk, m], 151);
    close(
        "grouped_matmul",
        &cuda
            .grouped_matmul(&gpu(&xs), &gpu(&we), &gpu(&counts), false)
            .expect("cuda"),
        &cpu.grouped_matmul(&xs, &we, &counts, false).expect("cpu"),
        1e-5,
    );
    let gy = rand(&[rows, m], 152);
    close(
        "grouped_matmul transposed",
        &cuda
            .grouped_matmul(&gpu(&gy), &gpu(&we), &gpu(&counts), true)
            .expect("cuda"),
        &cpu.grouped_matmul(&gy, &we, &counts, true).expect("cpu"),
        1e-5,
    );
    close(
        "grouped_matmul_weight_grad",
        &cuda
            .grouped_matmul_weight_grad(&gpu(&xs), &gpu(&gy), &gpu(&counts))
            .expect("cuda"),
        &cpu.grouped_matmul_weight_grad(&xs, &gy, &counts)
            .expect("cpu"),
        1e-5,
    );
}

#[test]
fn experts_are_sorted_on_the_gpu_as_on_the_cpu() {
    if !gpu_or_skip("experts_are_sorted_on_the_gpu_as_on_the_cpu") {
        return;
    }
    let (cpu, cuda) = (
        backend_for(Device::Cpu).expect("cpu"),
        backend_for(GPU).expect("cuda"),
    );
    // 700 tokens × 3 choices over 5 experts (three chunks of the sort, expert 4 never chosen),
    // and an empty batch.
    let (n, k, e) = (700usize, 3usize, 5usize);
    let choices: Vec<i64> = (0..n * k).map(|a| ((a * 7 + a / 5) % 4) as i64).collect();
    for (ids_host, what) in [
        (ids(&choices, &[n, k]), "700 tokens"),
        (ids(&[], &[0, k]), "none"),
    ] {
        let want = cpu.sort_by_expert(&ids_host, e).expect("cpu");
        // Computed on the device (no host copy), as a router's top-k is.
        let on_gpu = gpu(&ids_host).to_dtype(DType::I32).expect("i32");
        let got = cuda.sort_by_expert(&on_gpu, e).expect("cuda");
        for (i, name) in ["order", "token", "inverse", "counts"].iter().enumerate() {
            assert_eq!(got[i].device(), GPU, "{what}: {name} stays on the GPU");
            assert_eq!(
                got[i].to_vec::<i64>(),
                want[i].to_vec::<i64>(),
                "{what}: {name}"
            );
        }
    }
}

#[test]
fn a_router_routes_on_the_gpu_as_on_the_cpu() {
    if !gpu_or_skip("a_router_routes_on_the_gpu_as_on_the_cpu") {
        return;
    }
    use anneal_engine::ops::{route, RouterScore, RouterSpec};
    // DeepSeek-V3's router: sigmoid scores, a bias steering the choice, group-limited top-k,
    // renormalised and scaled weights; and Mixtral's plain softmax top-2.
    let deepseek = RouterSpec {
        num_experts: 16,
        top_k: 4,
        score: RouterScore::Sigmoid,
        renormalize: true,
        route_scale: 2.5,
        groups: Some((4, 2)),
    };
    let logits = rand(&[37, 16], 160);
    let bias = rand(&[16], 161);
    for (spec, b) in [(deepseek, Some(&bias)), (RouterSpec::new(16, 2), None)] {
        let c = route(&logits, b, &spec).expect("cpu");
        let gb = b.map(gpu);
        let g = route(&gpu(&logits), gb.as_ref(), &spec).expect("cuda");
        assert_eq!(
            g.experts.to_vec::<i64>(),
            c.experts.to_vec::<i64>(),
            "experts"
        );
        close("router weights", &g.weights, &c.weights, 1e-5);
        close("router scores", &g.scores, &c.scores, 1e-5);
    }
}
