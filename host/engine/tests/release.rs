//! Releasing a tensor's storage and restoring it in place (what FSDP does to a block's gathered
//! parameters between its forward and its backward). One test function owns the allocator
//! counters; the panics run in threads of their own.

mod common;

use anneal_engine::alloc::memory_stats;
use anneal_engine::Tensor;
use common::randn;

#[test]
fn release_frees_restore_refills_in_place_and_a_released_read_panics() {
    // Memory: the storage's bytes go back to the allocator, shapes stay.
    let w = randn(&[512, 512], "w").requires_grad_();
    let x = randn(&[4, 512], "x").requires_grad_();
    let kept = w.to_vec_f32();
    let y = x.matmul(&w).unwrap();
    let before = memory_stats().current_bytes;
    w.release_storage();
    assert!(w.is_released());
    assert_eq!(w.shape(), [512, 512]);
    let after = memory_stats().current_bytes;
    assert!(
        before - after >= 512 * 512 * 4,
        "released {} bytes",
        before - after
    );

    // Backward through the matmul, whose saved weight was released, once it is restored in
    // place: the gradient is the one from the original values.
    let values = Tensor::from_vec(kept.clone(), &[512, 512]).unwrap();
    w.restore_storage(&values).unwrap();
    assert!(!w.is_released());
    y.sum_all().unwrap().backward().unwrap();
    let reference = {
        let x2 = x.detach().requires_grad_();
        x2.matmul(&values)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        x2.grad().unwrap().to_vec_f32()
    };
    assert_eq!(x.grad().unwrap().to_vec_f32(), reference);

    // Restoring only applies to a released storage, with the right number of elements.
    assert!(w.restore_storage(&values).is_err());
    w.release_storage();
    assert!(w
        .restore_storage(&Tensor::ones(&[3], anneal_engine::DType::F32))
        .is_err());
    assert!(w.restore_storage(&w.detach()).is_err());

    // A product whose right operand was packed into the cache (seen twice unchanged), then
    // released and restored with other values, uses the new values.
    let b = randn(&[512, 256], "b");
    let row = randn(&[1, 512], "row");
    let _ = row.matmul(&b).unwrap();
    let _ = row.matmul(&b).unwrap();
    b.release_storage();
    let other = randn(&[512, 256], "other");
    b.restore_storage(&other).unwrap();
    assert_eq!(
        row.matmul(&b).unwrap().to_vec_f32(),
        row.matmul(&other).unwrap().to_vec_f32()
    );

    // Reading a released tensor is never a silent stale or zero read: it panics.
    let r = randn(&[8, 8], "r");
    r.release_storage();
    let read = std::thread::spawn(move || r.to_vec_f32()).join();
    let msg = read.expect_err("reading a released tensor panics");
    let msg = msg
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| msg.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains("released storage"), "{msg}");
}
