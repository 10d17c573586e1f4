//! Data-parallel `anneal train` on real MPI ranks (2 processes, one compute thread each):
//! the step-1 loss is bitwise the single process's, later losses stay within 1e-4 and a rerun
//! is bitwise identical; `--nproc` launches and resumes; meshes that do not fit are one-line
//! errors with exit code 2; a rank killed with SIGKILL ends the job. Checkpoints of sharded runs
//! are one shard per rank and reshard: they resume on other world sizes and layouts, export
//! like whole ones, and a missing shard or a writer killed mid-save loses nothing.

use anneal_tests::cli as common;

use common::{anneal, anneal_bin, losses, ok, rows, user_error, Job};
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

/// The held-out losses of a run.
fn val_losses(run_dir: &Path) -> Vec<f64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect()
}

/// The losses and the `state_bytes` of the last row of a run.
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
        "training.steps=50",
        "training.threads=1",
        "checkpoint.interval=10",
        "checkpoint.keep_latest=5",
    ];
    let with =
        |extra: &[&'static str]| -> Vec<&str> { base.iter().chain(extra).copied().collect() };
    let (single, single_dir) = job.train("single", &base);
    ok(&single);
    let (one, one_bytes) = losses_and_state(&single_dir);
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
        assert_eq!(losses.len(), 50, "{name}");
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
    // The same sharded layouts run twice give the same bits.
    for (name, n, extra) in [
        ("fsdp2", 2, &["parallelism.dp_shard=2"][..]),
        ("hsdp2x2", 4, &["parallelism.dp_shard=2"][..]),
    ] {
        let again = job.dir.join(format!("{name}-again"));
        ok(&mpiexec_train(n, &job, &again, &with(extra)));
        assert_eq!(
            losses(&again),
            losses(&job.dir.join(name)),
            "{name} twice is bitwise identical"
        );
    }
    // Parameters + gradients + AdamW's two moments: 4 copies of 41k f32 in one process and
    // with DDP; sharding divides them by dp_shard (up to the padding of the last rows).
    state.insert("single", one_bytes);
    for (n, name) in [(1, "single"), (2, "fsdp2"), (4, "fsdp4")] {
        println!(
            "FSDP({n}): {} parameter + gradient + optimizer bytes per rank ({:.3} of one process)",
            state[name],
            state[name] as f64 / one_bytes as f64
        );
    }
    println!("per-rank parameter + gradient + optimizer bytes: {state:?}");
    let single = one_bytes as f64;
    assert!(single > 4.0 * 4.0 * 40_000.0, "{state:?}");
    assert_eq!(state["ddp2"], one_bytes, "DDP holds the whole model");
    for (name, part) in [("fsdp2", 0.5), ("hsdp2x2", 0.5), ("fsdp4", 0.25)] {
        let ratio = state[name] as f64 / single;
        assert!(
            (ratio - part).abs() < 0.05,
            "{name}: {ratio} of one process's bytes"
        );
    }

    // DDP saves whole on rank 0; FSDP and HSDP save a shard per rank of one replica group.
    for (name, shards) in [("ddp2", 1), ("fsdp2", 2), ("fsdp4", 4), ("hsdp2x2", 2)] {
        let manifest = manifest_of(&job.dir.join(name).join("checkpoints/step-50"));
        assert_eq!(manifest["world_size"], shards, "{name}");
    }
    // FSDP(2) saved step 10 as two shards, each with its rows of every parameter and moment.
    let manifest = manifest_of(&job.dir.join("fsdp2/checkpoints/step-10"));
    assert_eq!(manifest["world_size"], 2);
    for (rank, rows) in [(0, [0, 16]), (1, [16, 32])] {
        let shard = format!("shard-{rank:05}-of-00002.safetensors");
        for name in [
            "model/layers.0.attention.wq.weight",
            "optim/layers.0.attention.wq.weight.exp_avg",
        ] {
            let piece = piece(&manifest, name, &shard)
                .unwrap_or_else(|| panic!("no piece of {name} in {shard}"));
            assert_eq!(piece["slice"], serde_json::json!([rows, [0, 32]]), "{name}");
            assert_eq!(piece["global_shape"], serde_json::json!([32, 32]), "{name}");
        }
    }

    // FSDP(2)'s sharded checkpoint of step 10 resumes on 1, 2 and 4 ranks and as HSDP(2x2):
    // step 11 is bitwise the 2-rank run's (the same parameters, data and kernels; the issue
    // asks for 1e-6).
    let fsdp2 = loss_values(&job.dir.join("fsdp2"));
    for (name, n, extra) in [
        ("resume1", 1, &[][..]),
        ("resume2", 2, &["parallelism.dp_shard=2"][..]),
        (
            "resume4",
            4,
            &["parallelism.dp_shard=-1", "parallelism.dp_replicate=1"][..],
        ),
        ("resume2x2", 4, &["parallelism.dp_shard=2"][..]),
    ] {
        let dir = job.dir.join(name);
        let copied = Command::new("cp")
            .arg("-r")
            .arg(job.dir.join("fsdp2"))
            .arg(&dir)
            .status()
            .unwrap();
        assert!(copied.success());
        for later in [20, 30, 40, 50] {
            std::fs::remove_dir_all(dir.join(format!("checkpoints/step-{later}"))).unwrap();
        }
        // One step past the checkpoint: the loss of step 11 is computed before its update, so
        // it depends only on the resumed parameters and data.
        let mut set = with(extra);
        set.push("training.steps=11");
        let out = if n == 1 {
            job.train(name, &set).0
        } else {
            mpiexec_train(n, &job, &dir, &set)
        };
        let stdout = ok(&out);
        assert!(
            stdout.contains("step 10"),
            "{name} resumes from step 10: {stdout}"
        );
        let resumed = loss_values(&dir);
        assert_eq!(resumed.len(), 11, "{name}");
        assert!(
            (resumed[10] - fsdp2[10]).abs() <= 1e-6 * fsdp2[10].abs(),
            "{name}: step 11 {} vs {}",
            resumed[10],
            fsdp2[10]
        );
        assert_eq!(
            resumed[10].to_bits(),
            fsdp2[10].to_bits(),
            "{name}: step 11"
        );
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
    // RL runs data parallel, without sharding.
    let mut c = anneal_dist::launch::mpiexec_command(2, &anneal_bin(), &[]).unwrap();
    let out = c
        .arg("rl")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("rl"))
        .args(["--set", "parallelism.dp_shard=2"])
        .output()
        .unwrap();
    user_error(&out, &["parallelism.dp_shard", "anneal rl", "FSDP"]);
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

/// `manifest.json` of a checkpoint's step directory.
fn manifest_of(step_dir: &Path) -> serde_json::Value {
    let text = std::fs::read(step_dir.join("manifest.json")).expect("manifest.json");
    serde_json::from_slice(&text).expect("the manifest is JSON")
}

/// The piece of tensor `name` stored in `shard`, if any.
fn piece<'a>(
    manifest: &'a serde_json::Value,
    name: &str,
    shard: &str,
) -> Option<&'a serde_json::Value> {
    manifest["tensors"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == name && t["shard"] == shard)
}

/// Copies the run dir `from` to `to`, without its checkpoint of `drop_step` if given.
fn copy_run(from: &Path, to: &Path, drop_step: Option<u64>) {
    let copied = Command::new("cp").arg("-r").arg(from).arg(to).status();
    assert!(copied.is_ok_and(|s| s.success()));
    if let Some(step) = drop_step {
        std::fs::remove_dir_all(to.join(format!("checkpoints/step-{step}"))).unwrap();
    }
}

#[test]
fn a_single_process_checkpoint_resumes_on_fsdp4_and_saves_four_shards() {
    let job = Job::new("one-to-four");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
    ];
    let (single, single_dir) = job.train("single", &set);
    ok(&single);
    let dir = job.dir.join("fsdp4");
    copy_run(&single_dir, &dir, Some(10));
    let mut sharded = set.to_vec();
    sharded.push("parallelism.dp_shard=4");
    let stdout = ok(&mpiexec_train(4, &job, &dir, &sharded));
    assert!(stdout.contains("step 5"), "resumes from step 5: {stdout}");
    let log = std::fs::read_to_string(dir.join("logs/rank-3.log")).unwrap();
    assert!(log.contains("resuming from"), "rank 3 resumes too: {log}");
    let (one, four) = (loss_values(&single_dir), loss_values(&dir));
    assert_eq!(four.len(), 10);
    assert!(
        (one[5] - four[5]).abs() < 1e-6,
        "step 6: {} vs {}",
        one[5],
        four[5]
    );
    for (a, b) in one.iter().zip(&four) {
        assert!((a - b).abs() / a < 1e-4, "{a} vs {b}");
    }
    let step10 = dir.join("checkpoints/step-10");
    assert_eq!(manifest_of(&step10)["world_size"], 4);
    for r in 0..4 {
        let shard = step10.join(format!("shard-{r:05}-of-00004.safetensors"));
        assert!(shard.is_file(), "{}", shard.display());
    }
}

#[test]
fn export_of_a_sharded_checkpoint_equals_the_whole_one() {
    use anneal_engine::{Storage, Tensor};
    use anneal_train::checkpoint::{write_checkpoint, Snapshot, TrainState};
    let job = Job::new("export-sharded");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=4",
        "training.threads=1",
        "parallelism.dp_shard=2",
    ];
    let run = job.dir.join("fsdp2");
    ok(&mpiexec_train(2, &job, &run, &set));
    let sharded = run.join("checkpoints/step-4");
    let manifest = manifest_of(&sharded);
    assert_eq!(manifest["world_size"], 2);

    // The same step saved whole, assembled here from the shard files' own tensors (not
    // through the checkpoint reader): every piece's rows, in order.
    type Parts = Vec<(u64, Tensor)>;
    let mut pieces: std::collections::BTreeMap<String, Parts> = Default::default();
    for r in 0..2 {
        let shard = format!("shard-{r:05}-of-00002.safetensors");
        for (name, t) in anneal_engine::io::load_safetensors(sharded.join(&shard)).unwrap() {
            let listed = piece(&manifest, &name, &shard).expect("every tensor is listed");
            let start = listed["slice"][0][0].as_u64().unwrap_or(0);
            pieces.entry(name).or_default().push((start, t));
        }
    }
    let whole: Vec<(String, Tensor)> = pieces
        .into_iter()
        .map(|(name, mut parts)| {
            parts.sort_by_key(|p| p.0);
            let entry = (0..2)
                .find_map(|r| {
                    piece(
                        &manifest,
                        &name,
                        &format!("shard-{r:05}-of-00002.safetensors"),
                    )
                })
                .expect("listed");
            let shape: Vec<usize> = serde_json::from_value(entry["global_shape"].clone()).unwrap();
            let bytes: Vec<u8> = parts.iter().flat_map(|(_, t)| t.to_bytes()).collect();
            let dtype = parts[0].1.dtype();
            let t = Tensor::from_storage(Storage::from_bytes(dtype, &bytes), &shape).unwrap();
            (name, t)
        })
        .collect();
    let state: TrainState =
        serde_json::from_slice(&std::fs::read(sharded.join("train_state.json")).unwrap()).unwrap();
    let whole_run = job.dir.join("whole");
    std::fs::create_dir_all(&whole_run).unwrap();
    std::fs::copy(run.join("tokenizer.json"), whole_run.join("tokenizer.json")).unwrap();
    let snap = Snapshot::capture(state, whole.iter().map(|(n, t)| (n.clone(), t)), Vec::new());
    let whole_dir = write_checkpoint(&whole_run.join("checkpoints"), &snap).unwrap();
    assert_eq!(manifest_of(&whole_dir)["world_size"], 1);

    let export = |step_dir: &Path, out: &str| {
        let out = job.dir.join(out);
        let res = anneal()
            .args(["checkpoint", "export", "--to-hf"])
            .arg(&out)
            .arg(step_dir)
            .output()
            .unwrap();
        ok(&res);
        out
    };
    let (a, b) = (
        export(&sharded, "hf-sharded"),
        export(&whole_dir, "hf-whole"),
    );
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(
            x == y,
            "{f} differs between the sharded and the whole export"
        );
    }
}

#[test]
fn a_missing_shard_or_a_killed_writer_loses_nothing() {
    let job = Job::new("shard-loss");
    let set = [
        "training.micro_batch_size=1",
        "training.steps=10",
        "training.threads=1",
        "checkpoint.interval=5",
        "parallelism.dp_shard=2",
    ];
    let reference = job.dir.join("reference");
    ok(&mpiexec_train(2, &job, &reference, &set));
    let want = losses(&reference);

    // A shard gone from the newest checkpoint: it is skipped with the file's name, and the
    // one before it resumes to the same curve.
    let dir = job.dir.join("missing");
    copy_run(&reference, &dir, None);
    std::fs::remove_file(dir.join("checkpoints/step-10/shard-00001-of-00002.safetensors")).unwrap();
    let stdout = ok(&mpiexec_train(2, &job, &dir, &set));
    assert!(
        stdout.contains("missing file shard-00001-of-00002.safetensors"),
        "{stdout}"
    );
    let step5 = dir.join("checkpoints/step-5");
    assert!(
        stdout.contains(&format!("resuming from {}", step5.display())),
        "{stdout}"
    );
    assert_eq!(losses(&dir), want);

    // Rank 1 killed while its shard of step 80 is written (every writer pauses after its
    // shard): the job ends, step 80 never appears, and the same command resumes from the
    // newest complete checkpoint to the reference's curve.
    let long = [
        "training.micro_batch_size=1",
        "training.steps=200",
        "training.threads=1",
        "checkpoint.interval=40",
        "metrics.eval_freq=0",
        "parallelism.dp_shard=2",
    ];
    let reference = job.dir.join("reference-long");
    ok(&mpiexec_train(2, &job, &reference, &long));
    let want = losses(&reference);
    let run_dir = job.dir.join("killed");
    let pause = [("ANNEAL_TEST_CHECKPOINT_PAUSE_MS", "1500".to_string())];
    let mut c = anneal_dist::launch::mpiexec_command(2, &anneal_bin(), &pause).unwrap();
    c.env_remove("ANNEAL_PLUGIN_PATH")
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for s in long {
        c.args(["--set", s]);
    }
    let mut child = c.spawn().unwrap();
    let ckpt = run_dir.join("checkpoints");
    let half_written = || {
        std::fs::read_dir(&ckpt).is_ok_and(|d| {
            d.filter_map(|e| e.ok()).any(|e| {
                e.file_name().to_string_lossy().starts_with("step-80.tmp-")
                    && e.path().join("shard-00001-of-00002.safetensors").exists()
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(ckpt.join("step-40").is_dir() && half_written()) {
        assert!(Instant::now() < deadline, "no half-written step 80");
        std::thread::sleep(Duration::from_millis(2));
    }
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
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the job outlived rank 1"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    assert!(
        !ckpt.join("step-80").exists(),
        "a half-written save is never published"
    );
    let stdout = ok(&mpiexec_train(2, &job, &run_dir, &long));
    assert!(
        stdout.contains("removed the incomplete save step-80.tmp-"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("resuming from {}", ckpt.join("step-40").display())),
        "{stdout}"
    );
    assert_eq!(
        losses(&run_dir),
        want,
        "the resumed curve is the reference's"
    );
}
