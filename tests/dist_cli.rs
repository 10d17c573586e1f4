//! Data-parallel `anneal train` on real MPI ranks (2 processes, one compute thread each):
//! the step-1 loss is bitwise the single process's, later losses stay within 1e-4 and a rerun
//! is bitwise identical; `--nproc` launches and resumes; meshes that do not fit are one-line
//! errors with exit code 2; a rank killed with SIGKILL ends the job.

use anneal_tests::cli as common;

use common::{anneal, anneal_bin, losses, ok, rows, Job};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Two micro-batches of 2 sequences per step, so 2 ranks take one each; one thread per rank.
const LAYOUT: [&str; 4] = [
    "training.micro_batch_size=2",
    "training.steps=20",
    "training.threads=1",
    "metrics.eval_freq=10",
];

/// `mpiexec -n <n> anneal train <config> --run-dir <run_dir> --set ...`.
fn mpiexec_train(n: usize, job: &Job, run_dir: &Path, set: &[&str]) -> Output {
    let mut c = anneal_dist::launch::mpiexec_command(n, &anneal_bin(), &[]).expect("mpiexec");
    c.env_remove("ANNEAL_PLUGIN_PATH")
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    c.output().expect("run mpiexec")
}

fn loss_values(run_dir: &Path) -> Vec<f64> {
    losses(run_dir).into_iter().map(f64::from_bits).collect()
}

#[test]
fn ddp_matches_the_single_process_and_reruns_bitwise() {
    let job = Job::new("ddp");
    let (single, single_dir) = job.train("single", &LAYOUT);
    ok(&single);
    let ddp_dir = job.dir.join("ddp-a");
    let out = mpiexec_train(2, &job, &ddp_dir, &LAYOUT);
    let stdout = ok(&out);
    assert!(stdout.contains("rank 0 of 2"), "{stdout}");
    let again_dir = job.dir.join("ddp-b");
    ok(&mpiexec_train(2, &job, &again_dir, &LAYOUT));

    let (one, two) = (loss_values(&single_dir), loss_values(&ddp_dir));
    assert_eq!((one.len(), two.len()), (20, 20));
    assert_eq!(
        one[0].to_bits(),
        two[0].to_bits(),
        "step 1: same global batch, same seed: {} vs {}",
        one[0],
        two[0]
    );
    for (step, (a, b)) in one.iter().zip(&two).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(rel < 1e-4, "step {}: {a} vs {b} (rel {rel:e})", step + 1);
    }
    assert!(
        two[19] < two[0] - 0.5,
        "DDP learns: {} -> {}",
        two[0],
        two[19]
    );
    assert_eq!(
        losses(&ddp_dir),
        losses(&again_dir),
        "DDP(2) twice is bitwise identical"
    );

    // Rank 0 writes the metrics (with the collectives' bytes); rank 1 logs to its own file.
    let ddp_rows = rows(&ddp_dir);
    let comm = ddp_rows[0]["comm_bytes"]
        .as_u64()
        .expect("comm_bytes in a DDP row");
    assert!(
        comm > 40_000 * 4,
        "the gradients of ~41k parameters: {comm} B"
    );
    assert!(ddp_rows[0]["mem_peak_bytes"]
        .as_u64()
        .is_some_and(|m| m > 0));
    assert!(ddp_rows.iter().any(|r| r["val_loss"].is_number()));
    assert!(rows(&single_dir)[0].get("comm_bytes").is_none());
    let log = std::fs::read_to_string(ddp_dir.join("logs/rank-1.log")).expect("rank 1's log");
    assert!(log.contains("rank 1 of 2"), "{log}");
    assert!(log.contains("done after step 20"), "{log}");
    // Every replica ends with the same parameters, bit for bit.
    let digest = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("replicas identical"))
            .map(str::to_string)
    };
    assert!(digest(&stdout).is_some(), "{stdout}");
    assert_eq!(digest(&stdout), digest(&log));
    assert!(!ddp_dir.join("logs/rank-0.log").exists());
}

#[test]
fn ddp_on_4_ranks_matches_the_single_process() {
    let job = Job::new("ddp4");
    // Four micro-batches of one sequence: one per rank (4 ranks oversubscribe 2 cores).
    let layout = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
    ];
    let (single, single_dir) = job.train("single", &layout);
    ok(&single);
    let ddp_dir = job.dir.join("ddp");
    ok(&mpiexec_train(4, &job, &ddp_dir, &layout));
    let (one, four) = (loss_values(&single_dir), loss_values(&ddp_dir));
    assert_eq!(four.len(), 10);
    assert_eq!(one[0].to_bits(), four[0].to_bits(), "step 1 bitwise");
    for (a, b) in one.iter().zip(&four) {
        assert!((a - b).abs() / a < 1e-4, "{a} vs {b}");
    }
    for r in 1..4 {
        assert!(ddp_dir.join(format!("logs/rank-{r}.log")).is_file());
    }
}

/// The losses and the `state_bytes` of the last row of a run.
fn val_losses(run_dir: &Path) -> Vec<f64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

fn losses_and_state(run_dir: &Path) -> (Vec<f64>, u64) {
    let rows = rows(run_dir);
    let state = rows
        .iter()
        .filter_map(|r| r["state_bytes"].as_u64())
        .next_back()
        .unwrap_or(0);
    (loss_values(run_dir), state)
}

#[test]
fn fsdp_and_hsdp_match_the_single_process_and_shard_the_state() {
    let job = Job::new("fsdp");
    let base = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
    ];
    let with =
        |extra: &[&'static str]| -> Vec<&str> { base.iter().chain(extra).copied().collect() };
    let (single, single_dir) = job.train("single", &base);
    ok(&single);
    let (one, _) = losses_and_state(&single_dir);
    let layouts: [(&str, usize, &[&str]); 4] = [
        ("ddp2", 2, &[]),
        ("fsdp2", 2, &["parallelism.dp_shard=2"]),
        (
            "fsdp4",
            4,
            &["parallelism.dp_shard=-1", "parallelism.dp_replicate=1"],
        ),
        ("hsdp2x2", 4, &["parallelism.dp_shard=2"]),
    ];
    let mut state = std::collections::BTreeMap::new();
    for (name, n, extra) in layouts {
        let dir = job.dir.join(name);
        ok(&mpiexec_train(n, &job, &dir, &with(extra)));
        let (losses, bytes) = losses_and_state(&dir);
        assert_eq!(losses.len(), 10, "{name}");
        assert_eq!(
            one[0].to_bits(),
            losses[0].to_bits(),
            "{name}: step 1 bitwise"
        );
        for (step, (a, b)) in one.iter().zip(&losses).enumerate() {
            assert!(
                (a - b).abs() / a < 1e-4,
                "{name} step {}: {a} vs {b}",
                step + 1
            );
        }
        // Evaluation (block by block under FSDP) sees the same parameters.
        let (v1, v2) = (val_losses(&single_dir), val_losses(&dir));
        assert!(v1.len() >= 2, "evaluations every 4 steps: {v1:?}");
        assert_eq!(v1.len(), v2.len(), "{name}");
        for (a, b) in v1.iter().zip(&v2) {
            assert!((a - b).abs() / a < 1e-4, "{name} val_loss: {a} vs {b}");
        }
        state.insert(name, bytes);
    }
    // Parameters + gradients + AdamW's two moments: 4 copies of 41k f32 with DDP; sharding
    // divides them by dp_shard (up to the padding of the last rows).
    println!("per-rank parameter + gradient + optimizer bytes: {state:?}");
    let ddp = state["ddp2"] as f64;
    assert!(ddp > 4.0 * 4.0 * 40_000.0, "{state:?}");
    for (name, part) in [("fsdp2", 0.5), ("hsdp2x2", 0.5), ("fsdp4", 0.25)] {
        let ratio = state[name] as f64 / ddp;
        assert!(
            (ratio - part).abs() < 0.05,
            "{name}: {ratio} of DDP's bytes"
        );
    }

    // FSDP(2)'s checkpoint of step 5 resumes on 1 and on 4 ranks: step 6 is bitwise the
    // 2-rank run's (the same parameters, data and kernels), the rest within 1e-4.
    let fsdp2 = loss_values(&job.dir.join("fsdp2"));
    for (name, n, extra) in [
        ("resume1", 1, &[][..]),
        (
            "resume4",
            4,
            &["parallelism.dp_shard=-1", "parallelism.dp_replicate=1"][..],
        ),
    ] {
        let dir = job.dir.join(name);
        let copied = Command::new("cp")
            .arg("-r")
            .arg(job.dir.join("fsdp2"))
            .arg(&dir)
            .status()
            .unwrap();
        assert!(copied.success());
        std::fs::remove_dir_all(dir.join("checkpoints/step-10")).unwrap();
        let out = if n == 1 {
            job.train(name, &with(extra)).0
        } else {
            mpiexec_train(n, &job, &dir, &with(extra))
        };
        let stdout = ok(&out);
        assert!(
            stdout.contains("step 5"),
            "{name} resumes from step 5: {stdout}"
        );
        let resumed = loss_values(&dir);
        assert_eq!(resumed.len(), 10, "{name}");
        assert_eq!(resumed[5].to_bits(), fsdp2[5].to_bits(), "{name}: step 6");
        for (a, b) in fsdp2.iter().zip(&resumed) {
            assert!((a - b).abs() / a < 1e-4, "{name}: {a} vs {b}");
        }
    }
}

#[test]
fn fsdp_composes_with_recompute_and_moe() {
    let job = Job::new("fsdp-more");
    let moe = [
        "model.flavor=\"debugmodel_qwen3_moe\"",
        "model.args.moe.n_experts=4",
        "model.args.moe.expert_ffn_dim=16",
        "model.args.moe.balance_rate=0.01",
    ];
    let common = [
        "training.micro_batch_size=1",
        "training.steps=6",
        "training.threads=1",
    ];
    let recompute = ["activation_checkpoint.mode=\"full\""];
    for (name, extra) in [("recompute", &recompute[..]), ("moe", &moe[..])] {
        let set: Vec<&str> = common.iter().chain(extra).copied().collect();
        let (single, single_dir) = job.train(&format!("{name}-single"), &set);
        ok(&single);
        let mut sharded = set.clone();
        sharded.push("parallelism.dp_shard=2");
        let dir = job.dir.join(format!("{name}-fsdp2"));
        let out = ok(&mpiexec_train(2, &job, &dir, &sharded));
        assert!(
            !out.contains("replicas identical"),
            "FSDP(2) has no replicas: {out}"
        );
        let (one, two) = (loss_values(&single_dir), loss_values(&dir));
        assert_eq!(one[0].to_bits(), two[0].to_bits(), "{name}: step 1");
        for (a, b) in one.iter().zip(&two) {
            assert!((a - b).abs() / a < 1e-4, "{name}: {a} vs {b}");
        }
        if name == "moe" {
            // The experts' token counts (and so the balancing bias) are the whole step's.
            let last = |d: &Path| rows(d).last().unwrap()["moe.layer0.tokens_per_expert"].clone();
            assert_eq!(last(&single_dir), last(&dir));
        }
    }
}

/// The byte counts of the trainer's `fsdp: ...` note: (largest block, outer unit).
fn unit_bytes(stdout: &str) -> (u64, u64) {
    let line = stdout
        .lines()
        .find(|l| l.contains("fsdp: ") && l.contains("block units"))
        .unwrap_or_else(|| panic!("no FSDP unit note: {stdout}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    // "<n> block units (largest <block> bytes in full) and an outer unit of <outer> bytes"
    match numbers[..] {
        [_, block, outer, ..] => (block, outer),
        _ => panic!("unexpected FSDP unit note: {line}"),
    }
}

#[test]
fn fsdp_holds_a_few_blocks_in_full_not_the_whole_model() {
    let job = Job::new("fsdp-blocks");
    let base = [
        "training.micro_batch_size=1",
        "training.steps=3",
        "training.threads=1",
        "parallelism.dp_shard=2",
    ];
    for (name, layers, mode) in [
        ("deep", 8u64, "none"),
        ("deep-recompute", 8, "full"),
        ("deep-selective", 8, "selective"),
    ] {
        let layers_set = format!("model.args.n_layers={layers}");
        let mode_set = format!("activation_checkpoint.mode=\"{mode}\"");
        let mut set: Vec<&str> = base.to_vec();
        set.extend([layers_set.as_str(), mode_set.as_str()]);
        let dir = job.dir.join(name);
        let stdout = ok(&mpiexec_train(2, &job, &dir, &set));
        let (block, outer) = unit_bytes(&stdout);
        let whole = outer + layers * block;
        let peaks: Vec<u64> = rows(&dir)
            .iter()
            .filter_map(|r| r["fsdp_full_bytes_peak"].as_u64())
            .collect();
        assert_eq!(peaks.len(), 3, "{name}: a peak per step");
        let peak = peaks.iter().copied().max().unwrap_or(0);
        println!(
            "{name}: full parameters held at once {peak} B of {whole} B (outer {outer} B, blocks {block} B)"
        );
        // The outer unit, the block running and the one prefetched (one more at the turn from
        // a block's backward to the next one's, while its reduce-scatter is not issued yet).
        assert!(
            peak >= outer + block && peak <= outer + 3 * block,
            "{name}: {peak} B held, outer {outer} B, blocks {block} B"
        );
        assert!(2 * peak < whole, "{name}: {peak} B of {whole} B");
        // Every block's reduce-scatter started while the backward was still running (2
        // micro-batches per rank), none was left for the end.
        for r in rows(&dir) {
            assert_eq!(
                r["fsdp_early_scatters"].as_u64(),
                Some(2 * layers),
                "{name}"
            );
        }
    }
}

#[test]
fn nproc_launches_and_resumes_from_the_checkpoint() {
    let job = Job::new("nproc");
    let run_dir = job.dir.join("run");
    let run = |steps: &str| {
        anneal()
            .args(["train", "--nproc", "2"])
            .arg(job.config())
            .arg("--run-dir")
            .arg(&run_dir)
            .args(["--set", "training.micro_batch_size=2", "--set", steps])
            .output()
            .unwrap()
    };
    let first = ok(&run("training.steps=4"));
    assert!(first.contains("rank 0 of 2"), "{first}");
    assert!(run_dir.join("checkpoints/step-4").is_dir());
    let second = ok(&run("training.steps=6"));
    assert!(second.contains("resuming from"), "{second}");
    let log = std::fs::read_to_string(run_dir.join("logs/rank-1.log")).unwrap();
    assert!(log.contains("resuming from"), "rank 1 resumes too: {log}");
    assert_eq!(losses(&run_dir).len(), 6);
    // Rank 0's checkpoint is an ordinary one: a single process continues it.
    let mut c = anneal();
    c.arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .args([
            "--set",
            "training.micro_batch_size=2",
            "--set",
            "training.steps=7",
        ]);
    let third = ok(&c.output().unwrap());
    assert!(third.contains("resuming from"), "{third}");
    assert_eq!(losses(&run_dir).len(), 7);

    // The same two runs (4 steps, resumed to 6) in one process give the same losses.
    let mut single_dir = job.dir.join("single");
    for steps in ["training.steps=4", "training.steps=6"] {
        let (out, dir) = job.train("single", &["training.micro_batch_size=2", steps]);
        ok(&out);
        single_dir = dir;
    }
    let (one, two) = (
        loss_values(&single_dir),
        loss_values(&run_dir)[..6].to_vec(),
    );
    assert_eq!(one.len(), 6);
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() / a < 1e-4, "{a} vs {b}");
    }
}

#[test]
fn sigterm_to_nproc_stops_every_rank_with_a_checkpoint() {
    let job = Job::new("term");
    let run_dir = job.dir.join("run");
    let child = anneal()
        .args(["train", "--nproc", "2"])
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .args([
            "--set",
            "training.micro_batch_size=2",
            "--set",
            "training.steps=100000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while rows_now(&run_dir) < 2 {
        assert!(Instant::now() < deadline, "no metrics after 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    let stdout = ok(&out);
    assert!(stdout.contains("stop requested"), "{stdout}");
    let step = losses(&run_dir).len();
    assert!(step < 100_000);
    assert!(
        run_dir.join(format!("checkpoints/step-{step}")).is_dir(),
        "rank 0 saved the last step ({step})"
    );
    let log = std::fs::read_to_string(run_dir.join("logs/rank-1.log")).unwrap();
    assert!(log.contains(&format!("stopped after step {step}")), "{log}");
}

/// Exit code 2 and the error on one line that names `needles`.
fn user_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    for n in needles {
        assert!(line.contains(n), "{n} not in {line}");
    }
}

#[test]
fn meshes_that_do_not_fit_are_user_errors() {
    let job = Job::new("mesh");
    // Degrees that do not multiply to the world size, under mpiexec and in one process.
    let out = mpiexec_train(2, &job, &job.dir.join("a"), &["parallelism.dp_replicate=3"]);
    user_error(&out, &["dp_replicate (3)", "2 process"]);
    let (out, _) = job.train("b", &["parallelism.dp_replicate=2"]);
    user_error(&out, &["dp_replicate (2)", "1 process"]);
    // Dimensions that do not run yet.
    let (out, _) = job.train("c", &["parallelism.tp=2"]);
    user_error(&out, &["parallelism.tp", "not implemented"]);
    // RL runs in one process so far.
    let mut c = anneal_dist::launch::mpiexec_command(2, &anneal_bin(), &[]).unwrap();
    let out = c.arg("rl").arg(job.config()).output().unwrap();
    user_error(&out, &["anneal rl", "one process"]);
    // --nproc without an MPI launcher on PATH.
    let out = anneal()
        .args(["train", "--nproc", "2"])
        .arg(job.config())
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    user_error(&out, &["mpiexec", "PATH"]);
    // The old keys are gone.
    let (out, _) = job.train("d", &["parallelism.data_parallel=2"]);
    user_error(&out, &["data_parallel"]);
    // A global batch that does not split over the ranks.
    let out = mpiexec_train(2, &job, &job.dir.join("e"), &[]);
    user_error(&out, &["training.batch_size", "micro_batch_size"]);
}

#[test]
fn a_killed_rank_ends_the_job() {
    let job = Job::new("kill");
    let run_dir = job.dir.join("run");
    let mut child = anneal()
        .args(["train", "--nproc", "2"])
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .args([
            "--set",
            "training.micro_batch_size=2",
            "--set",
            "training.steps=100000",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while rows_now(&run_dir) < 2 {
        assert!(Instant::now() < deadline, "no metrics after 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Rank 1 is the `anneal` process that writes logs/rank-1.log: find its pid.
    let pid = rank_pid(&run_dir, 1).expect("rank 1's pid");
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the job still runs 30 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "a killed rank fails the job: {status}");
}

fn rows_now(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("metrics.jsonl")).map_or(0, |s| s.lines().count())
}

/// The pid of the process whose stdout is `<run_dir>/logs/rank-<rank>.log`.
fn rank_pid(run_dir: &Path, rank: usize) -> Option<u32> {
    let log = run_dir
        .join(format!("logs/rank-{rank}.log"))
        .canonicalize()
        .ok()?;
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let out = std::fs::read_link(format!("/proc/{pid}/fd/1")).ok()?;
        (out == log).then_some(pid)
    })
}
