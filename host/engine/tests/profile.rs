//! The op profiler: a window of steps is recorded, rows add up to the step time, phases name
//! the ops, the Chrome trace is valid JSON, and the allocator's hit rate is reported.
//! (One test: the profiler is process-wide.)

use anneal_engine::profile::{self, Kind, Window};
use anneal_engine::{DType, Tensor};

fn one_step(n: u64, w: &Tensor, x: &Tensor) {
    let _s = profile::step(n);
    let loss = {
        let _p = profile::phase("forward");
        x.matmul(w).unwrap().silu().unwrap().sum_all().unwrap()
    };
    loss.backward().unwrap();
    w.zero_grad();
}

#[test]
fn records_a_window_of_steps_op_by_op() {
    let w = Tensor::ones(&[64, 32], DType::F32).requires_grad_();
    let x = Tensor::ones(&[16, 64], DType::F32);
    // Not configured: steps record nothing.
    one_step(0, &w, &x);
    assert!(profile::finish().is_none());

    profile::configure(Window { skip: 1, steps: 2 });
    for n in 1..=4 {
        one_step(n, &w, &x);
    }
    let p = profile::finish().expect("configured");
    assert_eq!(p.steps, 2, "steps 2 and 3 of 4");
    let steps: Vec<_> = p.events.iter().filter(|e| e.kind == Kind::Step).collect();
    assert_eq!(steps.len(), 2);
    assert_eq!(
        steps
            .iter()
            .map(|e| e.detail.clone().unwrap())
            .collect::<Vec<_>>(),
        ["step 2", "step 3"]
    );

    let rows = p.rows();
    let find = |name: &str, phase: &str| {
        rows.iter()
            .find(|r| r.name == name && r.phase == phase)
            .unwrap_or_else(|| panic!("no row {name} / {phase} in {rows:?}"))
    };
    assert_eq!(find("matmul", "forward").calls, 1.0);
    // The gradient of x @ w with respect to w is one matmul (x is a constant).
    assert_eq!(find("matmul", "backward").calls, 1.0);
    assert_eq!(find("unary silu", "forward").calls, 1.0);
    assert_eq!(find("unary_grad silu", "backward").calls, 1.0);
    // Self times partition the step: the rows sum to the step time.
    let sum: f64 = rows.iter().map(|r| r.ms).sum();
    assert!(
        (sum - p.step_ms()).abs() <= 1e-6 * p.step_ms().max(1.0),
        "rows {sum} ms vs step {} ms",
        p.step_ms()
    );
    // Matmul shapes are kept for the shape table.
    let details = p.detail_rows();
    assert!(
        details
            .iter()
            .any(|d| d.0 == "m=16 k=64 n=32 a=n b=n" && d.2 == "forward"),
        "{details:?}"
    );
    assert!(
        details
            .iter()
            .any(|d| d.0 == "m=64 k=16 n=32 a=t b=n" && d.2 == "backward"),
        "{details:?}"
    );
    // Same sizes every step: the allocator serves the recorded steps from its cache.
    assert!(p.cache_hits > 0);
    assert_eq!(p.system_allocs, 0, "steady state allocates nothing new");
    let table = p.table();
    assert!(table.contains("| matmul"), "{table}");
    assert!(table.contains("100.00% served from the cache"), "{table}");

    let trace: serde_json::Value = serde_json::from_str(&p.chrome_trace()).expect("valid JSON");
    let events = trace["traceEvents"].as_array().unwrap();
    assert_eq!(events.len(), p.events.len());
    assert!(events
        .iter()
        .all(|e| e["ph"] == "X" && e["dur"].is_number()));
    assert!(events
        .iter()
        .any(|e| e["cat"] == "phase" && e["name"] == "backward"));

    // After the window, nothing is recorded.
    assert!(!profile::enabled());

    // A linear layer (`x @ wᵀ`, batched x) runs its backward without copies: the weight's
    // gradient is computed in the weight's own layout and kept without a copy.
    let w = common_randn(&[48, 40], "w").requires_grad_();
    let x = common_randn(&[2, 16, 40], "x").requires_grad_();
    profile::configure(Window { skip: 0, steps: 1 });
    {
        let _s = profile::step(1);
        let y = x.matmul(&w.transpose(0, 1).unwrap()).unwrap();
        y.backward_with(Tensor::ones(&[2, 16, 48], DType::F32))
            .unwrap();
    }
    let p = profile::finish().unwrap();
    let copies: Vec<_> = p
        .rows()
        .into_iter()
        .filter(|r| r.phase == "backward" && r.name.starts_with("copy"))
        .collect();
    assert!(copies.is_empty(), "backward copied: {copies:?}");
    let g = w.grad().unwrap();
    assert!(g.is_contiguous());
    // dw[o, i] = Σ_rows x[row, i] (the upstream gradient is all ones).
    let xs = x
        .reshape(&[32, 40])
        .unwrap()
        .sum_dims(&[0], false)
        .unwrap()
        .to_vec_f32();
    for (o, row) in g.to_vec_f32().chunks(40).enumerate() {
        for (i, (&a, &b)) in row.iter().zip(&xs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "dw[{o}, {i}] = {a}, want {b}"
            );
        }
    }
}

fn common_randn(shape: &[usize], name: &str) -> Tensor {
    Tensor::rand_normal(
        shape,
        0.0,
        1.0,
        &anneal_engine::rng::RngKey::new(3, name),
        0,
        DType::F32,
    )
    .unwrap()
}
