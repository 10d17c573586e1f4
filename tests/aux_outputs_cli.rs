//! A model's auxiliary losses and statistics through `anneal train`: the loss trained on gets
//! the weighted auxiliary losses (`training.aux_loss_weights`), and `metrics.jsonl` carries
//! `aux_loss`, each `aux_loss.<name>` and each statistic; a buffer is updated by the model's hook
//! before each optimizer step (in `anneal train` and `anneal rl`) and checkpointed. The test
//! model is the `aux` flavor of the test plugin in plugins/test-bad-logits.

use anneal_tests::cli::{anneal, badlogits_plugin_dir, ok, root, rows, Job};

#[test]
fn auxiliary_losses_are_weighted_and_statistics_reach_metrics() {
    let job = Job::new("aux-outputs");
    let dir = badlogits_plugin_dir(&job.dir);
    let train = |run: &str, extra: &[&str]| {
        let mut c = anneal();
        c.env("ANNEAL_PLUGIN_PATH", &dir)
            .arg("train")
            .arg(job.config())
            .arg("--run-dir")
            .arg(job.dir.join(run))
            .args(["--set", "model.plugin=\"badlogits\""])
            .args(["--set", "model.flavor=\"aux\""])
            .args(["--set", "training.steps=2"]);
        for s in extra {
            c.args(["--set", s]);
        }
        c.output().unwrap()
    };
    ok(&train(
        "weighted",
        &["training.aux_loss_weights.l2=0.5", "checkpoint.interval=1"],
    ));
    let rs = rows(&job.dir.join("weighted"));
    let row = rs
        .iter()
        .find(|r| r["step"] == 1 && r["loss"].is_number())
        .unwrap();
    let l2 = row["aux_loss.l2"].as_f64().expect("aux_loss.l2");
    let total = row["aux_loss"].as_f64().expect("aux_loss");
    assert!(
        (total - 0.5 * l2).abs() <= 1e-6 * l2.abs().max(1.0),
        "{row}"
    );
    let mean = row["hidden_mean"].as_array().expect("hidden_mean");
    assert_eq!(mean.len(), 8, "{row}");

    // The buffer `seen` is not trained, is updated by the model's hook before each optimizer
    // step with the step's `hidden_mean`, and is saved in the checkpoint.
    let step = |s: u64| -> Vec<f64> {
        let r = rs
            .iter()
            .find(|r| r["step"] == s && r["loss"].is_number())
            .unwrap();
        r["hidden_mean"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let want: Vec<f64> = step(1).iter().zip(step(2)).map(|(a, b)| a + b).collect();
    let shard = job
        .dir
        .join("weighted/checkpoints/step-2/shard-00000-of-00001.safetensors");
    let saved = anneal_engine::io::load_safetensors(&shard).unwrap();
    assert!(
        !saved.contains_key("optim/seen.exp_avg"),
        "no optimizer state"
    );
    let seen = saved["model/seen"].to_vec_f32();
    for (s, w) in seen.iter().zip(&want) {
        assert!((*s as f64 - w).abs() <= 1e-5, "{seen:?} vs {want:?}");
    }

    // `anneal rl` calls the hook too: after its one step the buffer in its checkpoint holds
    // that step's `hidden_mean`, and the frozen KL reference keeps the buffer at its start.
    let reward = root().join("reward-wasm/examples/exact_match/reward.wat");
    let tokenizer = job.dir.join("weighted/tokenizer.json");
    let out = anneal()
        .env("ANNEAL_PLUGIN_PATH", &dir)
        .arg("rl")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("rl"))
        .args(["--set", "model.plugin=\"badlogits\""])
        .args(["--set", "model.flavor=\"aux\""])
        .args(["--set", "training.steps=1"])
        .args(["--set", "checkpoint.interval=1"])
        .args(["--set", "rl.kl_coef=0.1"])
        .args([
            "--set",
            &format!("rl.tokenizer=\"{}\"", tokenizer.display()),
        ])
        .args([
            "--set",
            &format!("rl.rewards=[{{path=\"{}\"}}]", reward.display()),
        ])
        .output()
        .unwrap();
    ok(&out);
    let row = rows(&job.dir.join("rl"))
        .into_iter()
        .find(|r| r["step"] == 1)
        .expect("an RL row for step 1");
    let saved = anneal_engine::io::load_safetensors(
        job.dir
            .join("rl/checkpoints/step-1/shard-00000-of-00001.safetensors"),
    )
    .unwrap();
    let mean: Vec<f64> = row["hidden_mean"]
        .as_array()
        .expect("hidden_mean")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let seen = saved["model/seen"].to_vec_f32();
    for (s, w) in seen.iter().zip(&mean) {
        assert!((*s as f64 - w).abs() <= 1e-5, "{seen:?} vs {mean:?}");
    }
    assert!(saved["ref/seen"].to_vec_f32().iter().all(|v| *v == 0.0));
    assert!(!saved.contains_key("optim/seen.exp_avg"));

    // Recomputing the block that emits the loss trains it all the same: the same losses,
    // gradient norms and weights, bit for bit, as keeping its activations.
    ok(&train(
        "recompute",
        &[
            "training.aux_loss_weights.l2=0.5",
            "checkpoint.interval=1",
            "activation_checkpoint.mode=\"full\"",
        ],
    ));
    let curve = |run: &str| -> Vec<(u64, u64, u64)> {
        rows(&job.dir.join(run))
            .iter()
            .filter(|r| r["loss"].is_number())
            .map(|r| {
                let bits = |k: &str| r[k].as_f64().unwrap().to_bits();
                (bits("loss"), bits("grad_norm"), bits("aux_loss"))
            })
            .collect()
    };
    assert_eq!(curve("recompute"), curve("weighted"));
    let weights = |run: &str| {
        anneal_engine::io::load_safetensors(
            job.dir
                .join(run)
                .join("checkpoints/step-2/shard-00000-of-00001.safetensors"),
        )
        .unwrap()
    };
    let (plain, recomputed) = (weights("weighted"), weights("recompute"));
    for (k, v) in &plain {
        assert_eq!(recomputed[k].to_vec_f32(), v.to_vec_f32(), "{k}");
    }
}

#[test]
fn rl_trains_on_the_weighted_auxiliary_losses_and_logs_the_statistics() {
    let job = Job::new("aux-outputs-rl");
    let dir = badlogits_plugin_dir(&job.dir);
    let model = [
        "model.plugin=\"badlogits\"",
        "model.flavor=\"aux_rl\"",
        "training.steps=1",
    ];
    // A short training run of the same model leaves the tokenizer the RL runs read.
    let mut c = anneal();
    c.env("ANNEAL_PLUGIN_PATH", &dir)
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("train"));
    for s in model {
        c.args(["--set", s]);
    }
    ok(&c.output().unwrap());
    let reward = root().join("reward-wasm/examples/exact_match/reward.wat");
    let tokenizer = job.dir.join("train/tokenizer.json");
    let rl = |run: &str, weight: f64| {
        let mut c = anneal();
        c.env("ANNEAL_PLUGIN_PATH", &dir)
            .arg("rl")
            .arg(job.config())
            .arg("--run-dir")
            .arg(job.dir.join(run));
        for s in model {
            c.args(["--set", s]);
        }
        c.args(["--set", &format!("training.aux_loss_weights.l2={weight}")])
            .args([
                "--set",
                &format!("rl.tokenizer=\"{}\"", tokenizer.display()),
            ])
            .args([
                "--set",
                &format!("rl.rewards=[{{path=\"{}\"}}]", reward.display()),
            ]);
        ok(&c.output().unwrap());
        rows(&job.dir.join(run))
            .into_iter()
            .find(|r| r["step"] == 1)
            .expect("a row for step 1")
    };
    let (off, on) = (rl("rl-off", 0.0), rl("rl-on", 1000.0));
    let l2 = on["aux_loss.l2"].as_f64().expect("aux_loss.l2");
    let total = on["aux_loss"].as_f64().expect("aux_loss");
    assert!(l2 > 0.0, "{on}");
    assert!((total - 1000.0 * l2).abs() <= 1e-4 * total.abs(), "{on}");
    assert_eq!(on["hidden_mean"].as_array().map(Vec::len), Some(8), "{on}");
    assert_eq!(off["aux_loss"].as_f64(), Some(0.0), "{off}");
    // Same seed, same rollouts: only the weighted auxiliary loss changes the gradient.
    let norm = |r: &serde_json::Value| r["grad_norm"].as_f64().expect("grad_norm");
    assert!(norm(&on) > norm(&off), "{off}\n{on}");
}

#[test]
fn a_plugin_moe_layer_trains_with_its_balancing_loss_and_router_statistics() {
    let job = Job::new("aux-outputs-moe");
    let dir = badlogits_plugin_dir(&job.dir);
    let out = anneal()
        .env("ANNEAL_PLUGIN_PATH", &dir)
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("moe"))
        .args(["--set", "model.plugin=\"badlogits\""])
        .args(["--set", "model.flavor=\"moe\""])
        .args(["--set", "training.steps=2"])
        .output()
        .unwrap();
    ok(&out);
    let rs = rows(&job.dir.join("moe"));
    let row = rs
        .iter()
        .find(|r| r["step"] == 2 && r["loss"].is_number())
        .unwrap();
    let balance = row["aux_loss.balance"].as_f64().expect("aux_loss.balance");
    // 0.01 · E · Σ f·p is 0.01 · k = 0.02 when the load is even, more when it is not.
    assert!((0.0199..0.08).contains(&balance), "{row}");
    assert_eq!(row["aux_loss"].as_f64(), Some(balance), "{row}");
    assert!(
        row["router_imbalance"].as_f64().expect("imbalance") >= 1.0,
        "{row}"
    );
    let entropy = row["router_entropy"].as_f64().expect("entropy");
    assert!(entropy > 0.0 && entropy <= 4f64.ln() + 1e-6, "{row}");
    // Every token of the micro-batch (4 × 32) went to its 2 experts.
    let tokens: f64 = row["tokens_per_expert"]
        .as_array()
        .expect("tokens_per_expert")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert_eq!(tokens, 256.0, "{row}");
    assert!(row["loss"].as_f64().unwrap().is_finite());
}
