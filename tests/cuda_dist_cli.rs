//! Multi-process jobs on GPUs (one rank per GPU; DDP's and FSDP's collectives over NCCL where it
//! loads, every other one staged through host memory): `job.device = "cuda"` under `mpiexec`
//! gives each rank its own device, and each layout on two emulated GPU ranks (DDP, FSDP, TP,
//! PP, CP, EP) follows the single process: step 1 within 1e-6 of the CPU's single process and
//! the curve within 1e-4, and bit for bit the GPU's single process where the CPU layout is bit
//! for bit the CPU's single process (the emulated GPU's f32 kernels sum in another order than
//! the CPU's, so bitwise claims compare GPU with GPU). DDP and FSDP give the same losses and
//! gradient norms, bit for bit, with their collectives staged over MPI and over NCCL
//! (`ANNEAL_COLLECTIVES`), and so does HSDP on four ranks; the rank's log says which path ran,
//! and on NCCL nothing of theirs is staged through host memory. So do TP, CP and EP, whose
//! groups' collectives then move device buffers, the bytes staged per step falling under a
//! bound. `anneal rl` under FSDP, TP,
//! PP and CP on GPU ranks keeps the logprob mismatch at exactly 0. A sharded checkpoint written
//! by two GPU ranks resumes on one CPU process and on two CPU ranks; a GPU rank killed mid-run
//! ends the job, and the rerun resumes; `generate --tp 2` on GPU ranks decodes the one
//! process's greedy tokens. Without a GPU (real or emulated) every test prints SKIP with the
//! reason and passes; under `ANNEAL_REQUIRE_CUDA=1` a missing GPU fails. A named `cuda:N`
//! shared by the ranks of one machine is one line naming `job.device` (on any machine).

mod dist_support;
mod rl_support;

use anneal_tests::cli as common;

use common::{anneal, gpus_here, losses, no_gpu, ok, Job};
use dist_support::{
    follows_after, kill_rank_and_wait, loss_values, mpiexec_train, mpiexec_train_command,
    resumed_copy, wait_for_rows,
};
use std::path::{Path, PathBuf};

const CUDA: &str = "job.device=\"cuda\"";

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
    // Each rank takes the GPU of its local rank (the emulator has two unless told otherwise).
    let want = format!("on cuda:{}", 1 % gpus_here());
    assert!(log.contains(&want), "rank 1 computes {want}: {log}");
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
fn data_parallel_gpu_ranks_follow_the_single_process() {
    if let Some(why) = no_gpu() {
        println!("SKIP data_parallel_gpu_ranks_follow_the_single_process: {why}");
        return;
    }
    let job = Job::new("cuda-dist-fsdp");
    let s = singles(&job, &[]);
    let dir = two_gpu_ranks(&job, "fsdp2", &["parallelism.dp_shard=2"]);
    follows("FSDP2", &s, &dir, true);
    // Replicas (the default mesh): gradients summed over the ranks, as on the CPU.
    let dir = two_gpu_ranks(&job, "ddp2", &[]);
    follows("DDP2", &s, &dir, true);
}

/// `anneal train` on `ranks` GPU ranks (as many emulated GPUs) with `layout` and
/// `ANNEAL_COLLECTIVES=path`: its run dir and rank 1's log.
fn gpu_ranks_on(job: &Job, ranks: usize, path: &str, layout: &[&'static str]) -> (PathBuf, String) {
    let name = format!("{}-{path}", layout.join("-").replace(['.', '='], "_"));
    let dir = job.dir.join(name);
    let mut set = with(layout);
    set.push(CUDA);
    let env = [
        ("ANNEAL_COLLECTIVES", path.to_string()),
        ("ANNEAL_CUDA_EMU_DEVICES", ranks.max(2).to_string()),
    ];
    let out = mpiexec_train_command(ranks, job, &dir, &set, &env)
        .output()
        .expect("run mpiexec");
    ok(&out);
    let log = std::fs::read_to_string(dir.join("logs/rank-1.log")).expect("rank 1's log");
    (dir, log)
}

/// Every step's loss and gradient norm, as bits.
fn loss_and_norm_bits(dir: &Path) -> Vec<(u64, u64)> {
    common::rows(dir)
        .iter()
        .filter_map(|r| Some((r["loss"].as_f64()?, r["grad_norm"].as_f64()?)))
        .map(|(l, g)| (l.to_bits(), g.to_bits()))
        .collect()
}

/// The bytes per step a rank's log says its collectives staged through host memory.
fn staged_per_step(log: &str) -> u64 {
    log.lines()
        .find_map(|l| {
            let (_, rest) = l.split_once("staged through host memory on this rank (")?;
            rest.strip_suffix(" per step)")?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no staged bytes line: {log}"))
}

#[test]
fn nccl_and_staged_collectives_give_the_same_bits() {
    if let Some(why) = no_gpu() {
        println!("SKIP nccl_and_staged_collectives_give_the_same_bits: {why}");
        return;
    }
    let job = Job::new("cuda-dist-nccl");
    // DDP's gradient sum, FSDP's gathers and reduce-scatters and HSDP's replica sum (4 ranks:
    // 2 replicas of 2 shards) on device buffers; int8-encoded gathers host-staged over NCCL.
    let fsdp = "FSDP's gathers and reduce-scatters on device buffers";
    for (ranks, layout, what, on_device) in [
        (2, &[][..], "DDP's gradient sum on device buffers", true),
        (2, &["parallelism.dp_shard=2"][..], fsdp, true),
        (
            4,
            &["parallelism.dp_replicate=2", "parallelism.dp_shard=2"][..],
            "FSDP's gathers and reduce-scatters and HSDP's replica sum on device buffers",
            true,
        ),
        (
            2,
            &[
                "parallelism.dp_shard=2",
                "parallelism.fsdp_all_gather_dtype=int8",
            ][..],
            fsdp,
            false,
        ),
    ] {
        let (staged, staged_log) = gpu_ranks_on(&job, ranks, "staged", layout);
        let (nccl, nccl_log) = gpu_ranks_on(&job, ranks, "nccl", layout);
        assert!(
            staged_log.contains("collectives: staged through host memory over MPI"),
            "{layout:?}: {staged_log}"
        );
        assert!(
            nccl_log.contains(&format!(
                "collectives: NCCL on cuda:{} for {what}",
                1 % gpus_here()
            )),
            "{layout:?}: {nccl_log}"
        );
        // Both sum in rank order on the emulator: the same bits, step by step.
        let (a, b) = (loss_and_norm_bits(&staged), loss_and_norm_bits(&nccl));
        assert_eq!(a.len(), 3, "{layout:?}: {a:?}");
        assert_eq!(a, b, "{layout:?}: staged vs NCCL (loss, grad norm) bits");
        // On NCCL every parameter and gradient byte of these layouts stays on the GPU (the
        // shards are even cut there at start); the step's scalars (losses, has-gradient flags)
        // are host values that never were on a device. So nothing is staged, against every
        // parameter and gradient byte (and more) on the staged path.
        let (host, device) = (staged_per_step(&staged_log), staged_per_step(&nccl_log));
        println!("{layout:?}: staged {host} bytes per step, NCCL {device}");
        assert!(host > 0, "{layout:?}: the staged path stages: {staged_log}");
        if !on_device {
            continue;
        }
        assert_eq!(
            device, 0,
            "{layout:?}: NCCL stages {device} bytes per step, the staged path {host}"
        );
    }
}

#[test]
fn tensor_pipeline_and_context_parallel_gpu_ranks_follow_the_single_process() {
    if let Some(why) = no_gpu() {
        println!(
            "SKIP tensor_pipeline_and_context_parallel_gpu_ranks_follow_the_single_process: {why}"
        );
        return;
    }
    let job = Job::new("cuda-dist-layouts");
    let s = singles(&job, &[]);
    // As on the CPU: TP and CP within 1e-6 at step 1, the pipeline's step 1 bit for bit.
    let tp = two_gpu_ranks(&job, "tp2", &["parallelism.tp=2"]);
    follows("TP2", &s, &tp, false);
    let pp = two_gpu_ranks(&job, "pp2", &["parallelism.pp=2"]);
    follows("PP2", &s, &pp, true);
    let cp = two_gpu_ranks(&job, "cp2", &["parallelism.cp=2"]);
    follows("CP2", &s, &cp, false);
}

/// The debug MoE model the CPU's expert-parallel test trains.
const MOE: [&str; 4] = [
    "model.flavor=\"debugmodel_qwen3_moe\"",
    "model.args.moe.n_experts=4",
    "model.args.moe.expert_ffn_dim=16",
    "model.args.moe.balance_rate=0.01",
];

#[test]
fn expert_parallel_gpu_ranks_follow_the_single_process() {
    if let Some(why) = no_gpu() {
        println!("SKIP expert_parallel_gpu_ranks_follow_the_single_process: {why}");
        return;
    }
    let job = Job::new("cuda-dist-ep");
    let s = singles(&job, &MOE);
    let layout: Vec<&'static str> = MOE
        .iter()
        .chain(&["parallelism.dp_shard=2", "parallelism.ep=2"])
        .copied()
        .collect();
    let ep = two_gpu_ranks(&job, "ep2", &layout);
    follows("EP2", &s, &ep, false);
}

#[test]
fn sharded_rl_on_gpu_ranks_keeps_the_logprobs_bitwise_equal() {
    if let Some(why) = no_gpu() {
        println!("SKIP sharded_rl_on_gpu_ranks_keeps_the_logprobs_bitwise_equal: {why}");
        return;
    }
    let dir = rl_support::rl_job("cuda-fsdp");
    let (out, one) = rl_support::rl(1, &dir, "one-gpu", &[CUDA]);
    ok(&out);
    let (out, two) = rl_support::rl(2, &dir, "fsdp2-gpu", &[CUDA, "parallelism.dp_shard=2"]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("fsdp: the policy sharded over 2"),
        "{stdout}"
    );
    let (one, two) = (rl_support::steps(&one), rl_support::steps(&two));
    assert_eq!((one.len(), two.len()), (4, 4));
    let loss = |r: &serde_json::Value| r["loss"].as_f64().expect("loss");
    for r in one.iter().chain(&two) {
        // Rollouts decode with the gathered policy the trainer's forward runs on, on the GPU.
        assert_eq!(r["logprob_mismatch_max"].as_f64(), Some(0.0), "{r}");
    }
    // As on the CPU: step 1 is the one process's bit for bit, the rest follows.
    assert_eq!(loss(&one[0]).to_bits(), loss(&two[0]).to_bits(), "step 1");
    for (a, b) in one.iter().zip(&two) {
        let (a, b) = (loss(a), loss(b));
        assert!((a - b).abs() <= 1e-4 * a.abs(), "{a} vs {b}");
    }
}

#[test]
fn a_gpu_ranks_sharded_checkpoint_resumes_on_the_cpu() {
    if let Some(why) = no_gpu() {
        println!("SKIP a_gpu_ranks_sharded_checkpoint_resumes_on_the_cpu: {why}");
        return;
    }
    let job = Job::new("cuda-dist-ckpt");
    let (out, cpu) = job.train("single-cpu", &with(&["training.steps=4"]));
    ok(&out);
    let want = loss_values(&cpu);
    let gpu = two_gpu_ranks(
        &job,
        "fsdp2",
        &["parallelism.dp_shard=2", "training.steps=4"],
    );
    let m = dist_support::manifest_of(&gpu.join("checkpoints/step-2"));
    assert!(
        m.to_string().contains("shard-00001-of-00002"),
        "one shard per rank: {m}"
    );
    // Continued from step 2 by one CPU process and by two CPU ranks (FSDP2), on the curve.
    let one = resumed_copy(
        &job,
        "as-one-cpu",
        &gpu,
        (&[4], 2),
        1,
        &with(&["training.steps=4"]),
    );
    follows_after("one CPU process", &want, &one, 2);
    let two = resumed_copy(
        &job,
        "as-two-cpu",
        &gpu,
        (&[4], 2),
        2,
        &with(&["training.steps=4", "parallelism.dp_shard=2"]),
    );
    follows_after("two CPU ranks", &want, &two, 2);
}

#[test]
fn a_killed_gpu_rank_ends_the_job_and_the_rerun_resumes() {
    if let Some(why) = no_gpu() {
        println!("SKIP a_killed_gpu_rank_ends_the_job_and_the_rerun_resumes: {why}");
        return;
    }
    let job = Job::new("cuda-dist-kill");
    let run_dir = job.dir.join("run");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=100000",
        "training.threads=1",
        "metrics.eval_freq=100000",
        "checkpoint.interval=2",
        "parallelism.dp_shard=2",
        CUDA,
    ];
    let mut child = mpiexec_train_command(2, &job, &run_dir, &set, &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mpiexec");
    // Past the step-2 checkpoint, and that checkpoint published (it is written in the
    // background: on a loaded machine step 3 can end before it is).
    wait_for_rows(&run_dir, 3);
    let published = run_dir.join("checkpoints/step-2");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !published.is_dir() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(published.is_dir(), "step 2's checkpoint published");
    let status = kill_rank_and_wait(&mut child, &run_dir, 1);
    assert!(
        !status.success(),
        "a killed GPU rank fails the job: {status}"
    );
    // The rerun on the same run dir resumes from the newest checkpoint.
    let mut again: Vec<&str> = set.to_vec();
    again[1] = "training.steps=6";
    let out = mpiexec_train(2, &job, &run_dir, &again);
    let stdout = ok(&out);
    assert!(
        stdout.contains("resuming from"),
        "the rerun resumes: {stdout}"
    );
    assert_eq!(loss_values(&run_dir).last().map(|_| ()), Some(()));
}

#[test]
fn a_named_gpu_shared_by_the_ranks_of_one_machine_is_refused() {
    // Checked before the device is probed, so this runs with or without a GPU.
    let job = Job::new("cuda-dist-named");
    let dir = job.dir.join("run");
    let out = mpiexec_train(2, &job, &dir, &with(&["job.device=\"cuda:0\""]));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`job.device` = cuda:0")
            && err.contains("2 ranks of this job share this machine"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn tensor_parallel_generation_runs_on_gpu_ranks() {
    if let Some(why) = no_gpu() {
        println!("SKIP tensor_parallel_generation_runs_on_gpu_ranks: {why}");
        return;
    }
    let model = common::root().join("host/runtime/tests/fixtures/tiny_llama");
    let run = |n: usize, extra: &[&str]| {
        let mut c = if n == 1 {
            anneal()
        } else {
            let mut c = anneal_dist::launch::mpiexec_command(n, &common::anneal_bin(), &[])
                .expect("mpiexec");
            c.env_remove("ANNEAL_PLUGIN_PATH");
            c
        };
        c.args(["generate", "--model-dir"])
            .arg(&model)
            .args(["--prompt-tokens", "1,5,9,3", "--max-new-tokens", "8"])
            .args(["--temperature", "0", "--device", "cuda"])
            .args(extra);
        let stdout = ok(&c.output().expect("anneal generate"));
        let line = stdout.lines().find(|l| l.starts_with('{')).expect("JSON");
        serde_json::from_str::<serde_json::Value>(line).expect("one JSON object")
    };
    let one = run(1, &[]);
    let two = run(2, &["--tp", "2"]);
    assert_eq!(two["tp"], 2);
    assert_eq!(one["tokens"], two["tokens"], "greedy: the same tokens");
}

#[test]
fn rl_layouts_on_gpu_ranks_keep_the_mismatch_at_zero() {
    if let Some(why) = no_gpu() {
        println!("SKIP rl_layouts_on_gpu_ranks_keep_the_mismatch_at_zero: {why}");
        return;
    }
    let dir = rl_support::rl_job("cuda-layouts");
    let (out, one) = rl_support::rl(1, &dir, "one-gpu", &[CUDA]);
    ok(&out);
    let one = rl_support::steps(&one);
    let loss = |r: &serde_json::Value| r["loss"].as_f64().expect("loss");
    for (name, layout) in [
        ("tp2", "parallelism.tp=2"),
        ("pp2", "parallelism.pp=2"),
        ("cp2", "parallelism.cp=2"),
    ] {
        let (out, two) = rl_support::rl(2, &dir, name, &[CUDA, layout]);
        ok(&out);
        let two = rl_support::steps(&two);
        assert_eq!(two.len(), 4, "{name}");
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(b["logprob_mismatch_max"].as_f64(), Some(0.0), "{name}: {b}");
            let (a, b) = (loss(a), loss(b));
            assert!((a - b).abs() <= 1e-4 * a.abs(), "{name}: {a} vs {b}");
        }
    }
}

/// TP, CP, EP and PP move their collectives' device buffers over NCCL: the same loss and
/// gradient norm bits as staged through host memory, and the staged bytes per step fall to a
/// bound.
#[test]
fn mesh_groups_over_nccl_give_the_staged_bits() {
    if let Some(why) = no_gpu() {
        println!("SKIP mesh_groups_over_nccl_give_the_staged_bits: {why}");
        return;
    }
    let job = Job::new("cuda-dist-groups");
    let ep: Vec<&'static str> = MOE
        .iter()
        .chain(&["parallelism.dp_shard=2", "parallelism.ep=2"])
        .copied()
        .collect();
    // The tiny model (tests/support/cli.rs): dim 32, 2 layers, ffn 64, vocab 320, 41 120
    // parameters; 4 micro-batches of 32 tokens per step.
    const PARAM_BYTES: u64 = 41_120 * 4;
    // What each layout still stages once its group runs on NCCL:
    // - TP2: the vocabulary-parallel loss's gradient, built on the host (4 micro-batches × 32
    //   rows × 160 columns × 4 B = 81 920 per step), plus one-time copies of parameters
    //   (this rank's slices at start, the checkpoint's gathers), at most the f32 parameters;
    // - CP2: dq, summed on the host by the ring's backward (2 layers × 4 micro-batches ×
    //   16 rows × 2 heads × 16 dims × 4 B = 16 KiB per step), and the positions each attention
    //   call places on the GPU (i64): under 64 KiB;
    // - EP2 (dp_shard 2): FSDP's units, whose buffers stay host-staged on both paths; the rows
    //   the exchanges moved (about a third of the staged path's bytes here) are gone, so
    //   asserted as at least a fifth less than the staged path.
    // - PP2 (1F1B, and ZB-H1): the activations and gradients move device buffers (the token ids a stage
    //   reads were never a collective's); a few scalars are left, under 64 bytes per step.
    let bound = |layout: &str, staged: u64| match layout {
        "tp" => 81_920 + PARAM_BYTES,
        "cp" => 64 * 1024,
        "pp" | "zb" => 64,
        _ => staged - staged / 5,
    };
    for (name, layout, what) in [
        (
            "tp",
            &["parallelism.tp=2"][..],
            "tensor parallelism's all-reduce",
        ),
        (
            "cp",
            &["parallelism.cp=2"][..],
            "context parallelism's ring pass",
        ),
        ("ep", &ep[..], "expert parallelism's all-to-all"),
        (
            "pp",
            &["parallelism.pp=2"][..],
            "pipeline stages' activations and gradients",
        ),
        (
            "zb",
            &["parallelism.pp=2", "parallelism.pp_schedule=zero_bubble"][..],
            "pipeline stages' activations and gradients",
        ),
    ] {
        let (staged, staged_log) = gpu_ranks_on(&job, 2, "staged", layout);
        let (nccl, nccl_log) = gpu_ranks_on(&job, 2, "nccl", layout);
        assert!(nccl_log.contains(what), "{name}: {nccl_log}");
        let (a, b) = (loss_and_norm_bits(&staged), loss_and_norm_bits(&nccl));
        assert_eq!(a.len(), 3, "{name}: {a:?}");
        assert_eq!(a, b, "{name}: staged vs NCCL (loss, grad norm) bits");
        let (s, n) = (staged_per_step(&staged_log), staged_per_step(&nccl_log));
        let most = bound(name, s);
        println!("{name}: staged {s} bytes per step, NCCL {n} (bound {most})");
        assert!(
            n <= most,
            "{name}: NCCL path stages {n} bytes per step, over {most}"
        );
        assert!(
            s > most,
            "{name}: the staged path ({s}) is within the bound {most}"
        );
    }
}
