//! Launching and inspecting multi-rank `anneal train` jobs, shared by the distributed tests
//! (a module of each, not of `anneal-tests`' support library, which depends on no Anneal crate).

// Each test file uses its own part of these.
#![allow(dead_code)]

use anneal_tests::cli::{anneal_bin, rows, Job};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

/// `mpiexec -n <n> anneal train <job's config> --run-dir <run_dir> --set ...`, with `env`
/// exported to every rank (the plugins found next to the binary, as a launched rank finds them).
pub fn mpiexec_train_command(
    n: usize,
    job: &Job,
    run_dir: &Path,
    set: &[&str],
    env: &[(&str, String)],
) -> Command {
    let mut c = anneal_dist::launch::mpiexec_command(n, &anneal_bin(), env).expect("mpiexec");
    c.env_remove("ANNEAL_PLUGIN_PATH")
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    c
}

/// [`mpiexec_train_command`] run to its end.
pub fn mpiexec_train(n: usize, job: &Job, run_dir: &Path, set: &[&str]) -> Output {
    mpiexec_train_command(n, job, run_dir, set, &[])
        .output()
        .expect("run mpiexec")
}

/// `anneal train <job's config> --run-dir <run_dir> --set ...` in one process, run to its end:
/// how the tests resume a multi-rank run's checkpoint without parallelism.
pub fn train_one(job: &Job, run_dir: &Path, set: &[&str]) -> Output {
    let mut c = anneal_tests::cli::anneal();
    c.arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    c.output().expect("run anneal train")
}

/// `mpiexec -n <n> anneal rl <job's config> --run-dir <run_dir> --set ...`, run to its end.
pub fn mpiexec_rl(n: usize, job: &Job, run_dir: &Path, set: &[&str]) -> Output {
    let mut c = anneal_dist::launch::mpiexec_command(n, &anneal_bin(), &[]).expect("mpiexec");
    c.arg("rl").arg(job.config()).arg("--run-dir").arg(run_dir);
    for s in set {
        c.args(["--set", s]);
    }
    c.output().expect("run mpiexec")
}

/// The logged training losses.
pub fn loss_values(run_dir: &Path) -> Vec<f64> {
    rows(run_dir)
        .iter()
        .filter_map(|r| r["loss"].as_f64())
        .collect()
}

/// A data-parallel run `two` follows the single process `one` over `steps` logged steps:
/// step 1's loss bit for bit (the same rows, summed the same way), the rest within DDP's
/// rounding.
pub fn assert_follows(one: &Path, two: &Path, steps: usize) {
    let (a, b) = (loss_values(one), loss_values(two));
    assert_eq!((a.len(), b.len()), (steps, steps));
    assert_eq!(a[0].to_bits(), b[0].to_bits());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{a:?} vs {b:?}");
    }
}

/// Rows of `metrics.jsonl` so far (0 before it exists).
pub fn rows_now(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("metrics.jsonl")).map_or(0, |s| s.lines().count())
}

/// Waits (up to 120 s) until a job has logged `n` rows.
pub fn wait_for_rows(run_dir: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while rows_now(run_dir) < n {
        assert!(Instant::now() < deadline, "no metrics after 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pid of the process whose stdout is `<run_dir>/logs/rank-<rank>.log`.
pub fn rank_pid(run_dir: &Path, rank: usize) -> Option<u32> {
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

/// Kills rank `rank` of the job `child` launched (SIGKILL) and returns the job's exit status,
/// failing when the job still runs 30 s later.
pub fn kill_rank_and_wait(child: &mut Child, run_dir: &Path, rank: usize) -> ExitStatus {
    let pid = rank_pid(run_dir, rank).expect("the rank's pid");
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let started = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the job still runs 30 s after rank {rank} was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `manifest.json` of a checkpoint's step directory.
pub fn manifest_of(step_dir: &Path) -> serde_json::Value {
    let text = std::fs::read(step_dir.join("manifest.json")).expect("manifest.json");
    serde_json::from_slice(&text).expect("the manifest is JSON")
}

/// The piece of tensor `name` stored in `shard`, if any.
pub fn piece<'a>(
    manifest: &'a serde_json::Value,
    name: &str,
    shard: &str,
) -> Option<&'a serde_json::Value> {
    manifest["tensors"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == name && t["shard"] == shard)
}

/// Asserts where a checkpoint of `world` shards put its pieces: each `(tensor, shard, slice)`
/// of `present` lies in that shard as that `slice`, and no `(tensor, shard)` of `absent` does.
pub fn assert_pieces(
    manifest: &serde_json::Value,
    world: usize,
    present: &[(&str, usize, serde_json::Value)],
    absent: &[(&str, usize)],
) {
    assert_eq!(manifest["world_size"], world, "{manifest}");
    let slice_in = |name: &str, shard: usize| {
        let file = format!("shard-{shard:05}-of-{world:05}.safetensors");
        piece(manifest, name, &file).map(|p| p["slice"].clone())
    };
    for (name, shard, slice) in present {
        assert_eq!(
            slice_in(name, *shard).as_ref(),
            Some(slice),
            "{name} in shard {shard}"
        );
    }
    for &(name, shard) in absent {
        assert_eq!(slice_in(name, shard), None, "{name} not in shard {shard}");
    }
}

/// The `slice` of a 2-d piece: rows `a..b`, all `cols` columns.
pub fn rows_slice(a: usize, b: usize, cols: usize) -> serde_json::Value {
    serde_json::json!([[a, b], [0, cols]])
}

/// Copies the run dir `from` to `to`, without its checkpoints of `drop_steps`.
pub fn copy_run(from: &Path, to: &Path, drop_steps: &[u64]) {
    let copied = Command::new("cp").arg("-r").arg(from).arg(to).status();
    assert!(copied.is_ok_and(|s| s.success()));
    for step in drop_steps {
        std::fs::remove_dir_all(to.join(format!("checkpoints/step-{step}"))).unwrap();
    }
}

/// `from`'s run copied to `<job dir>/<name>` without its checkpoints of steps `dropped`, then
/// resumed with `set` on `n` ranks (`n = 1`: one process), which must say it resumed at `step`.
/// Returns the copy's losses: `from`'s rows up to `step`, then the resumed run's.
pub fn resumed_copy(
    job: &Job,
    name: &str,
    from: &Path,
    (dropped, step): (&[u64], u64),
    n: usize,
    set: &[&str],
) -> Vec<f64> {
    let dir = job.dir.join(name);
    copy_run(from, &dir, dropped);
    let out = match n {
        1 => train_one(job, &dir, set),
        _ => mpiexec_train(n, job, &dir, set),
    };
    let stdout = anneal_tests::cli::ok(&out);
    assert!(
        stdout.contains(&format!("(step {step})")),
        "{name}: resumed at {step}: {stdout}"
    );
    loss_values(&dir)
}

/// Asserts that a resumed run's losses `got` stay within 1e-4 (relative) of the single
/// process's `want` at every step after the first `resumed_at`.
pub fn follows_after(name: &str, want: &[f64], got: &[f64], resumed_at: usize) {
    assert_eq!(want.len(), got.len(), "{name}: steps");
    for (step, (a, b)) in want.iter().zip(got).enumerate().skip(resumed_at) {
        assert!(
            (a - b).abs() / a.abs() < 1e-4,
            "{name} resumed step {}: {b} vs {a}",
            step + 1
        );
    }
}

/// Asserts that a layout's losses `got` follow the single process's `want` (`name` in the
/// messages): step 1 within 1e-6 relative, every step within 1e-4.
pub fn follows_single(name: &str, want: &[f64], got: &[f64]) {
    assert_eq!(want.len(), got.len(), "{name}: steps");
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
    assert!(
        rel(want[0], got[0]) < 1e-6,
        "{name} step 1: {} vs {}",
        got[0],
        want[0]
    );
    for (step, (a, b)) in want.iter().zip(got).enumerate() {
        assert!(
            rel(*a, *b) < 1e-4,
            "{name} step {}: {b} vs {a} (rel {:e})",
            step + 1,
            rel(*a, *b)
        );
    }
}
