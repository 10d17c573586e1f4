//! Gathered sparse attention (DeepSeek-V4's CSA/HCA) on CUDA against the CPU op on the same
//! inputs (part of the `cuda_ops` test binary): the output and every gradient, determinism,
//! batch invariance, and that a forward and backward read nothing back to the host.

use super::*;
use anneal_engine::ops::{gathered_attention, GatheredAttentionParams};

/// One call's inputs, on the host.
#[derive(Clone)]
struct Case {
    name: &'static str,
    q: Tensor,
    keys: Tensor,
    blocks: Option<Tensor>,
    sinks: Option<Tensor>,
    q_pos: Tensor,
    k_pos: Tensor,
    selected: Option<Tensor>,
    window: usize,
    rate: usize,
    /// The output's gradient.
    go: Tensor,
    /// Positions and selection stay on the host for the GPU run (uploaded by the op) instead
    /// of being device tensors.
    host_index: bool,
}

fn pos(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).expect("positions")
}

/// A selection `[sb, t, k]` with repeats, negative, too-large and not-yet-complete entries.
fn selection(sb: usize, t: usize, k: usize, n: usize) -> Tensor {
    let n = n as i64;
    let mut v: Vec<i64> = (0..(sb * t * k) as i64)
        .map(|i| (i * 7 + i / 3) % (n + 3) - 1)
        .collect();
    // Every row repeats its second choice last.
    for row in v.chunks_mut(k).filter(|r| r.len() >= 3) {
        row[k - 1] = row[1];
    }
    pos(&v, &[sb, t, k])
}

/// Random q, keys, blocks (`n` of them, none for 0), sinks and output gradient.
#[allow(clippy::too_many_arguments)]
fn case(
    name: &'static str,
    [b, h, t, s, n, d]: [usize; 6],
    q_pos: Tensor,
    k_pos: Tensor,
    selected: Option<Tensor>,
    sinks: bool,
    [window, rate]: [usize; 2],
    seed: u64,
) -> Case {
    Case {
        name,
        q: rand(&[b, h, t, d], seed),
        keys: rand(&[b, s, d], seed + 1),
        blocks: (n > 0).then(|| rand(&[b, n, d], seed + 2)),
        sinks: sinks.then(|| rand(&[h], seed + 3)),
        q_pos,
        k_pos,
        selected,
        window,
        rate,
        go: rand(&[b, h, t, d], seed + 4),
        host_index: false,
    }
}

fn seq(from: i64, n: usize) -> Vec<i64> {
    (from..from + n as i64).collect()
}

fn cases() -> Vec<Case> {
    // Batch rows at their own positions; query 0 of row 0 (at −3) sees nothing and has no sink.
    let mut hca_q = seq(0, 13);
    hca_q[0] = -3;
    hca_q.extend(seq(5, 13));
    let hca_k: Vec<i32> = seq(0, 13)
        .into_iter()
        .chain(seq(5, 13))
        .map(|p| p as i32)
        .collect();
    vec![
        Case {
            host_index: true,
            ..case(
                "window-sinks",
                [2, 2, 12, 12, 0, 8],
                pos(&seq(0, 12), &[12]),
                pos(&seq(0, 12), &[12]),
                None,
                true,
                [4, 4],
                10,
            )
        },
        case(
            "hca",
            [2, 1, 13, 13, 3, 12],
            pos(&hca_q, &[2, 13]),
            Tensor::from_slice(&hca_k, &[2, 13]).expect("i32 positions"),
            None,
            false,
            [3, 4],
            20,
        ),
        case(
            "csa",
            [2, 2, 19, 19, 6, 16],
            pos(&seq(0, 19), &[19]),
            pos(&seq(0, 19), &[19]),
            Some(selection(2, 19, 4, 6)),
            true,
            [4, 3],
            30,
        ),
        // Unsorted positions (repeats among the keys), a selection shared by the batch.
        Case {
            host_index: true,
            ..case(
                "unsorted",
                [2, 2, 10, 14, 5, 8],
                pos(&[7, 3, 9, 0, 5, 11, 2, 8, 4, 6], &[10]),
                pos(&[5, 1, 9, 3, 3, 12, 0, 7, 10, 2, 8, 6, 11, 4], &[14]),
                Some(selection(1, 10, 3, 5)),
                true,
                [5, 2],
                40,
            )
        },
        // Rows longer than a kernel chunk (128 columns) and a selection of k = 300: the online
        // softmax's rescaling and the chunked list and sort.
        case(
            "long",
            [1, 1, 3, 300, 8, 4],
            pos(&[299, 150, 320], &[3]),
            pos(&seq(0, 300), &[300]),
            Some(selection(1, 3, 300, 8)),
            true,
            [400, 40],
            50,
        ),
    ]
}

/// The output and the gradients of q, keys, blocks and sinks of `c` on `dev` in `dtype`.
fn run(c: &Case, dev: Device, dtype: DType) -> (Tensor, Vec<Option<Tensor>>) {
    let put = |t: &Tensor| {
        t.to_dtype(dtype)
            .and_then(|t| t.to_device(dev))
            .expect("input")
            .requires_grad_()
    };
    let index = |t: &Tensor| {
        if c.host_index {
            t.clone()
        } else {
            t.to_device(dev).expect("index")
        }
    };
    let (q, keys) = (put(&c.q), put(&c.keys));
    let (blocks, sinks) = (c.blocks.as_ref().map(put), c.sinks.as_ref().map(put));
    let params = GatheredAttentionParams {
        q_pos: index(&c.q_pos),
        k_pos: index(&c.k_pos),
        blocks: blocks.clone(),
        selected: c.selected.as_ref().map(index),
        sinks: sinks.clone(),
        window: c.window,
        compress_rate: c.rate,
        scale: None,
    };
    let out = gathered_attention(&q, &keys, &params).expect("gathered_attention");
    let go = c.go.to_dtype(dtype).and_then(|g| g.to_device(dev));
    out.backward_with(go.expect("go")).expect("backward");
    let grads = vec![
        q.grad(),
        keys.grad(),
        blocks.and_then(|b| b.grad()),
        sinks.and_then(|s| s.grad()),
    ];
    (out, grads)
}

const GRADS: [&str; 4] = ["dq", "dkeys", "dblocks", "dsinks"];

/// The GPU run of `c` against the CPU's, each value within `tol` of the largest.
fn matches_cpu(c: &Case, dtype: DType, tol: f32) {
    let (want, want_grads) = run(c, Device::Cpu, dtype);
    let (got, got_grads) = run(c, GPU, dtype);
    assert_eq!(got.device(), GPU, "{}: output device", c.name);
    assert_eq!(got.dtype(), dtype, "{}: output dtype", c.name);
    close(&format!("{}.out", c.name), &got, &want, tol);
    for (i, what) in GRADS.iter().enumerate() {
        let name = format!("{}.{what}", c.name);
        match (&got_grads[i], &want_grads[i]) {
            (Some(g), Some(w)) => {
                assert_eq!(g.dtype(), dtype, "{name}: dtype");
                assert_eq!(g.device(), GPU, "{name}: device");
                close(&name, g, w, tol);
            }
            (None, None) => {}
            _ => panic!("{name}: a gradient on one device only"),
        }
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn gathered_attention_matches_the_cpu_f32() {
    if !gpu_or_skip("gathered_attention_matches_the_cpu_f32") {
        return;
    }
    for c in cases() {
        matches_cpu(&c, DType::F32, 1e-5);
    }
}

#[test]
fn gathered_attention_matches_the_cpu_bf16() {
    if !gpu_or_skip("gathered_attention_matches_the_cpu_bf16") {
        return;
    }
    let c = cases().remove(2);
    matches_cpu(&c, DType::BF16, 2e-2);
}

#[test]
fn a_row_that_sees_nothing_is_zero_with_finite_gradients() {
    if !gpu_or_skip("a_row_that_sees_nothing_is_zero_with_finite_gradients") {
        return;
    }
    let c = cases().remove(1);
    let (out, grads) = run(&c, GPU, DType::F32);
    let (t, d) = (c.q.shape()[2], c.q.shape()[3]);
    let row0 = out.to_vec_f32();
    assert!(row0[..d].iter().all(|&v| v == 0.0), "query at −3: {row0:?}");
    assert!(
        row0[d..t * d].iter().any(|&v| v != 0.0),
        "the others see keys"
    );
    for g in grads.iter().flatten() {
        assert!(g.to_vec_f32().iter().all(|v| v.is_finite()));
    }
}

#[test]
fn gathered_attention_on_cuda_is_deterministic() {
    if !gpu_or_skip("gathered_attention_on_cuda_is_deterministic") {
        return;
    }
    for c in cases() {
        let (a, ga) = run(&c, GPU, DType::F32);
        let (b, gb) = run(&c, GPU, DType::F32);
        assert_eq!(bits(&a), bits(&b), "{}: output", c.name);
        for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
            let (x, y) = (x.as_ref().map(bits), y.as_ref().map(bits));
            assert_eq!(x, y, "{}.{}", c.name, GRADS[i]);
        }
    }
}

/// `c` narrowed to batch row 1 and, with `query`, to that query alone (positions and selection
/// rows with it).
fn narrowed(c: &Case, query: Option<usize>) -> Case {
    let row = |t: &Tensor| -> Tensor {
        if t.rank() >= 2 && t.shape()[0] == 2 {
            t.narrow(0, 1, 1).expect("row")
        } else {
            t.clone()
        }
    };
    let mut one = Case {
        q: c.q.narrow(0, 1, 1).expect("q"),
        keys: row(&c.keys),
        blocks: c.blocks.as_ref().map(row),
        q_pos: row(&c.q_pos),
        k_pos: row(&c.k_pos),
        selected: c.selected.as_ref().map(row),
        go: c.go.narrow(0, 1, 1).expect("go"),
        ..c.clone()
    };
    if let Some(t) = query {
        one.q = one.q.narrow(2, t, 1).expect("query");
        one.go = one.go.narrow(2, t, 1).expect("go");
        let last = one.q_pos.rank() as isize - 1;
        one.q_pos = one.q_pos.narrow(last, t, 1).expect("q_pos");
        one.selected = one.selected.map(|s| s.narrow(1, t, 1).expect("selected"));
    }
    one
}

#[test]
fn a_query_row_does_not_depend_on_the_batch_or_the_other_queries_on_cuda() {
    if !gpu_or_skip("a_query_row_does_not_depend_on_the_batch_or_the_other_queries_on_cuda") {
        return;
    }
    for c in cases().into_iter().filter(|c| c.q.shape()[0] == 2) {
        let (full, _) = run(&c, GPU, DType::F32);
        let (alone, _) = run(&narrowed(&c, None), GPU, DType::F32);
        let row1 = full
            .narrow(0, 1, 1)
            .expect("row 1")
            .contiguous()
            .expect("copy");
        assert_eq!(bits(&alone), bits(&row1), "{}: batch row 1 alone", c.name);
        let t = c.q.shape()[2] - 2;
        let (one, _) = run(&narrowed(&c, Some(t)), GPU, DType::F32);
        let q1 = row1
            .narrow(2, t, 1)
            .expect("query")
            .contiguous()
            .expect("copy");
        assert_eq!(bits(&one), bits(&q1), "{}: query {t} alone", c.name);
    }
}

/// Set in the child process of `gathered_attention_reads_nothing_back`.
const PROBE: &str = "ANNEAL_GATHERED_TRANSFER_PROBE";

/// The emulator reads `ANNEAL_CUDA_EMU_TRANSFER_LOG` once per process and this binary runs its
/// tests in parallel, so the count runs in a child process of its own: this binary again, with
/// only [`transfer_probe`] and the log set.
#[test]
fn gathered_attention_reads_nothing_back() {
    if !gpu_or_skip("gathered_attention_reads_nothing_back") {
        return;
    }
    let log = std::env::temp_dir().join(format!("anneal-gathered-dtoh-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "gathered::transfer_probe",
            "--ignored",
            "--nocapture",
        ])
        .env("ANNEAL_CUDA_EMU_TRANSFER_LOG", &log)
        .env(PROBE, "1")
        .output()
        .expect("run the probe");
    let _ = std::fs::remove_file(&log);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("1 passed"), "the probe did not run: {text}");
    println!(
        "{}",
        text.lines()
            .filter(|l| l.starts_with("probe"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The lines of the transfer log that start with `what` (`dtoh`: a device→host copy; `wait`:
/// the host waiting for the device).
fn logged(log: &str, what: &str) -> usize {
    std::fs::read_to_string(log)
        .map(|s| s.lines().filter(|l| l.starts_with(what)).count())
        .unwrap_or(0)
}

#[test]
#[ignore = "run by gathered_attention_reads_nothing_back in a process of its own"]
fn transfer_probe() {
    if std::env::var(PROBE).is_err() || !gpu_or_skip("transfer_probe") {
        return;
    }
    let log = std::env::var("ANNEAL_CUDA_EMU_TRANSFER_LOG").expect("the log is set");
    // Device positions and selection (the csa case) and host ones (the unsorted case); each
    // twice, the second after a warm-up (kernels loaded, the memory pool grown), whose host
    // waits are reported.
    let all = cases();
    for (i, c) in [&all[2], &all[2], &all[3], &all[3]].into_iter().enumerate() {
        let (out, grads) = run(c, GPU, DType::F32);
        let (copies, waits) = (logged(&log, "dtoh"), logged(&log, "wait"));
        assert_eq!(
            copies, 0,
            "{}: inputs, forward and backward read {copies} times",
            c.name
        );
        assert_eq!(grads.iter().flatten().count(), 4);
        // The log works in this process: reading the output back is logged.
        let _ = out.to_vec_f32();
        if std::fs::metadata(&log).is_err() {
            println!("probe: no transfer log (not the emulator): nothing counted");
            return;
        }
        assert!(logged(&log, "dtoh") > 0, "a read back was not logged");
        std::fs::remove_file(&log).expect("reset the log");
        let run = if i % 2 == 0 { "first" } else { "second" };
        println!(
            "probe {} ({run} run): no device-to-host copy in uploads, forward and backward; \
             {waits} host waits",
            c.name
        );
    }
}
