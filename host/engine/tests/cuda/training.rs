//! What the trainer relies on when its tensors live on a GPU (part of the `cuda_ops` test
//! binary): a loss backpropagated from GPU logits gives the CPU's gradients and leaves them on
//! the GPU, a strided GPU view can be written, a host tensor beside a GPU one in a binary op is
//! copied over, and a GPU tensor's bytes (a checkpoint) and sum of squares (the gradient norm)
//! are read without leaving it.

use super::*;

#[test]
fn a_loss_backpropagates_on_the_gpu_like_on_the_cpu() {
    if !gpu_or_skip("a_loss_backpropagates_on_the_gpu_like_on_the_cpu") {
        return;
    }
    let x = rand(&[6, 16], 30);
    let w = rand(&[16, 10], 31);
    let targets = Tensor::from_slice(&[1i64, 5, 9, 0, 7, 3], &[6]).expect("targets");
    // linear, a narrowed slice (its gradient lands in zeros), a maximum (a comparison mask),
    // cross-entropy (its row scales), backward from a single value (the seed).
    let grads = |device: Device| {
        let w = w.to_device(device).expect("w").requires_grad_();
        let x = x.to_device(device).expect("x");
        let h = x.matmul(&w).expect("matmul");
        let h = h
            .maximum(&h.narrow(1, 0, 10).expect("narrow"))
            .expect("max");
        let loss = h
            .cross_entropy(&targets.to_device(device).expect("t"), &Default::default())
            .expect("ce");
        assert_eq!(
            loss.device(),
            device,
            "the loss stays on its logits' device"
        );
        loss.backward().expect("backward");
        let g = w.grad().expect("a gradient");
        assert_eq!(
            g.device(),
            device,
            "the gradient stays on the parameter's device"
        );
        (loss.item().expect("loss"), g)
    };
    let (lc, gc) = grads(Device::Cpu);
    let (lg, gg) = grads(GPU);
    assert!(
        (lc - lg).abs() <= 1e-5 * lc.abs(),
        "loss cpu {lc} vs cuda {lg}"
    );
    close("weight gradient", &gg, &gc, 1e-5);
    let (sc, sg) = (gc.sum_of_squares(), gg.sum_of_squares());
    assert!(
        (sc - sg).abs() <= 1e-5 * sc,
        "sum of squares cpu {sc} vs cuda {sg}"
    );
    assert_eq!(
        gg.to_bytes(),
        gg.to_device(Device::Cpu).expect("back").to_bytes()
    );
}

#[test]
fn gpu_views_are_written_and_host_operands_copied_over() {
    if !gpu_or_skip("gpu_views_are_written_and_host_operands_copied_over") {
        return;
    }
    for dtype in [DType::F32, DType::BF16] {
        let buf = Tensor::zeros_on(&[2, 3, 8, 4], dtype, GPU).expect("zeros");
        let cpu = Tensor::zeros(&[2, 3, 8, 4], dtype);
        let new = rand(&[2, 3, 2, 4], 32);
        // A KV-cache append: positions 5..7 of dim 2, from a host source (copied over).
        for (b, src) in [(&buf, gpu(&new)), (&cpu, new.clone())] {
            b.narrow(2, 5, 2)
                .expect("view")
                .copy_from(&src)
                .expect("copy into the view");
        }
        buf.narrow(2, 0, 2)
            .expect("view")
            .copy_from(&new)
            .expect("a host source");
        cpu.narrow(2, 0, 2)
            .expect("view")
            .copy_from(&new)
            .expect("copy");
        close("strided write", &buf, &cpu, 0.0);
    }
    let a = rand(&[4, 5], 33);
    let b = rand(&[5], 34);
    let sum = gpu(&a).add(&b).expect("gpu + host");
    assert_eq!(sum.device(), GPU);
    close("gpu + host", &sum, &a.add(&b).expect("add"), 1e-6);
    let sum = a.mul(&gpu(&b)).expect("host * gpu");
    assert_eq!(sum.device(), GPU);
    close("host * gpu", &sum, &a.mul(&b).expect("mul"), 1e-6);
}

/// The gradient norm's parts in one pass: each tensor's sum of squares from two launches, f32
/// and bf16, sizes across the 16384-element chunks, an empty tensor, a strided view; the CPU's
/// f64 sums within f32 rounding.
#[test]
fn sums_of_squares_of_many_tensors_in_one_pass() {
    if !gpu_or_skip("sums_of_squares_of_many_tensors_in_one_pass") {
        return;
    }
    let host = [
        rand(&[3, 5], 60),
        rand(&[40_000], 61),
        rand(&[0], 62),
        rand(&[16_384], 63),
        rand(&[64, 300], 64)
            .transpose(0, 1)
            .expect("a strided view"),
        rand(&[7], 65),
    ];
    let on_gpu: Vec<Tensor> = host
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let g = t.to_device(GPU).expect("to the GPU");
            if i == 5 {
                g.to_dtype(DType::BF16).expect("bf16")
            } else {
                g
            }
        })
        .collect();
    let refs: Vec<&Tensor> = on_gpu.iter().collect();
    let sums = anneal_engine::ops::sum_of_squares_each(&refs).expect("sums");
    assert_eq!(sums.device(), GPU, "stays on the GPU");
    assert_eq!(sums.shape(), &[host.len()]);
    for (i, (got, t)) in sums.to_vec_f32().iter().zip(&on_gpu).enumerate() {
        let want = t.to_device(Device::Cpu).expect("back").sum_of_squares();
        assert!(
            (f64::from(*got) - want).abs() <= 1e-6 * want.max(1.0),
            "tensor {i}: {got} vs {want}"
        );
    }
    assert!(
        anneal_engine::ops::sum_of_squares_each(&[])
            .expect("none")
            .numel()
            == 0
    );
}
