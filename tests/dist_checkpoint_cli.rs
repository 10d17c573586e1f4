//! Sharded checkpoints on real MPI ranks (one compute thread each): a single-process
//! checkpoint resumes on FSDP(4) and saves one shard per rank; the export of a sharded
//! checkpoint equals the export of the same step saved whole; a missing shard or a writer
//! killed mid-save loses nothing. (Resharding FSDP(2) onto 1, 2, 4 ranks and HSDP is checked
//! beside the layouts in dist_cli.rs.)

mod dist_support;

use anneal_tests::cli as common;

use common::{anneal, losses, ok, Job};
use dist_support::{
    copy_run, kill_rank_and_wait, loss_values, manifest_of, mpiexec_train, mpiexec_train_command,
    piece,
};
use std::path::Path;
use std::time::{Duration, Instant};

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
    copy_run(&single_dir, &dir, &[10]);
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
    copy_run(&reference, &dir, &[]);
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
    let mut child = mpiexec_train_command(2, &job, &run_dir, &long, &pause)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
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
    let status = kill_rank_and_wait(&mut child, &run_dir, 1);
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
