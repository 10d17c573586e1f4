//! Mixture-of-experts models through `anneal train`: the Llama plugin's Qwen3-MoE flavor
//! reports each layer's tokens per expert, load imbalance and router entropy, and with
//! aux-loss-free balancing on it moves a checkpointed routing bias once per step, mean-centred,
//! by `balance_rate` per expert (towards the experts that got fewer tokens); gpt-oss does the
//! same and resumes from a checkpoint (bias included) on the same curve, bit for bit.

use anneal_tests::cli::{anneal, ok, rows, Job};

#[test]
fn aux_loss_free_balancing_moves_the_routing_bias_and_metrics_carry_the_load() {
    let job = Job::new("moe-balance");
    let train = |run: &str, rate: &str| {
        let mut c = anneal();
        c.arg("train")
            .arg(job.config())
            .arg("--run-dir")
            .arg(job.dir.join(run));
        for s in [
            "model.flavor=\"debugmodel_qwen3_moe\"",
            "model.args.moe.n_experts=4",
            "model.args.moe.expert_ffn_dim=16",
            &format!("model.args.moe.balance_rate={rate}"),
            "training.steps=3",
            "checkpoint.interval=3",
        ] {
            c.args(["--set", s]);
        }
        ok(&c.output().unwrap());
        job.dir.join(run)
    };
    let on = train("on", "0.01");
    let rows_on = rows(&on);
    let last = rows_on.last().unwrap();
    // 4 rows × 32 tokens, each routed to 2 experts.
    let tokens: Vec<f64> = last["moe.layer0.tokens_per_expert"]
        .as_array()
        .expect("tokens per expert")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(tokens.len(), 4);
    assert_eq!(tokens.iter().sum::<f64>(), 256.0, "{last}");
    assert!(
        last["moe.layer1.imbalance"].as_f64().unwrap() >= 1.0,
        "{last}"
    );
    assert!(
        last["moe.layer1.entropy"].as_f64().unwrap() <= 4f64.ln() + 1e-6,
        "{last}"
    );
    assert!(
        last["aux_loss.load_balance"].as_f64().unwrap() > 0.0,
        "{last}"
    );

    let shard = |run: &std::path::Path| {
        anneal_engine::io::load_safetensors(
            run.join("checkpoints/step-3/shard-00000-of-00001.safetensors"),
        )
        .unwrap()
    };
    let saved = shard(&on);
    for layer in 0..2 {
        let bias =
            saved[&format!("model/layers.{layer}.feed_forward.router.balance_bias")].to_vec_f32();
        // Three steps of ±0.01 moves (0 where an expert sat exactly at the mean), centred.
        assert!(
            bias.iter().any(|b| b.abs() > 1e-3),
            "layer {layer}: {bias:?}"
        );
        assert!(bias.iter().all(|b| b.abs() <= 0.03 + 1e-6), "{bias:?}");
        assert!(
            bias.iter().sum::<f32>().abs() < 1e-5,
            "not centred: {bias:?}"
        );
    }
    // Off: no bias is declared, saved or logged.
    let off = train("off", "0");
    assert!(!shard(&off).keys().any(|k| k.contains("balance_bias")));
    assert!(rows(&off).last().unwrap()["moe.layer0.tokens_per_expert"].is_null());
}

#[test]
fn gpt_oss_trains_balances_and_resumes_bitwise() {
    let job = Job::new("gpt-oss");
    let config = job.config_with_model("gpt_oss", "gpt_oss", anneal_tests::tiny::GPT_OSS);
    let train = |run: &std::path::Path| {
        let mut c = anneal();
        c.arg("train").arg(&config).arg("--run-dir").arg(run);
        for s in ["training.steps=4", "checkpoint.interval=2"] {
            c.args(["--set", s]);
        }
        ok(&c.output().unwrap())
    };
    let bias_at_4 = |run: &std::path::Path| {
        anneal_engine::io::load_safetensors(
            run.join("checkpoints/step-4/shard-00000-of-00001.safetensors"),
        )
        .unwrap()["model/layers.1.feed_forward.router.balance_bias"]
            .to_vec_f32()
    };
    let full = job.dir.join("full");
    train(&full);
    let last = rows(&full).last().unwrap().clone();
    assert_eq!(last["step"], 4);
    for key in [
        "aux_loss.load_balance",
        "moe.imbalance",
        "moe.imbalance_max",
    ] {
        assert!(last[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {last}");
    }
    let bias = bias_at_4(&full);
    assert!(bias.iter().any(|b| b.abs() > 1e-3), "{bias:?}");

    // The same run stopped after its step-2 checkpoint continues on the same curve.
    let resumed = job.dir.join("resumed");
    std::fs::create_dir_all(resumed.join("checkpoints")).unwrap();
    for f in ["config.toml", "tokenizer.json", "metrics.jsonl"] {
        let _ = std::fs::copy(full.join(f), resumed.join(f));
    }
    copy_dir(
        &full.join("checkpoints/step-2"),
        &resumed.join("checkpoints/step-2"),
    );
    let stdout = train(&resumed);
    let from = format!(
        "resuming from {}",
        resumed.join("checkpoints/step-2").display()
    );
    assert!(stdout.contains(&from), "{stdout}");
    // The balancing bias came back with the weights: four steps of moves, as in the full run.
    assert_eq!(bias_at_4(&resumed), bias);
    let loss_at = |run: &std::path::Path, step: u64| {
        rows(run)
            .iter()
            .rev()
            .find(|r| r["step"] == step)
            .and_then(|r| r["loss"].as_f64())
            .map(f64::to_bits)
    };
    for step in [3, 4] {
        assert_eq!(loss_at(&resumed, step), loss_at(&full, step), "step {step}");
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn deepseek_v3_trains_with_multi_token_prediction_and_balances_every_sparse_block() {
    let job = Job::new("deepseek-v3");
    let config = job.config_with_model(
        "deepseek_v3",
        "deepseek_v3",
        anneal_tests::tiny::DEEPSEEK_V3,
    );
    let train = |name: &str, mode: &str| {
        let run = job.dir.join(name);
        let mut c = anneal();
        c.arg("train").arg(&config).arg("--run-dir").arg(&run);
        let mode = format!("activation_checkpoint.mode=\"{mode}\"");
        for s in ["training.steps=3", "checkpoint.interval=3", mode.as_str()] {
            c.args(["--set", s]);
        }
        ok(&c.output().unwrap());
        run
    };
    let run = train("run", "none");
    // Recomputing every block (which passes MTP's inputs through and emits the routing
    // statistics) changes nothing, bit for bit.
    let recomputed = train("recomputed", "full");
    let curve = |run: &std::path::Path| -> Vec<(u64, u64)> {
        rows(run)
            .iter()
            .map(|r| {
                let bits = |k: &str| r[k].as_f64().unwrap().to_bits();
                (bits("loss"), bits("mtp_loss"))
            })
            .collect()
    };
    assert_eq!(curve(&recomputed), curve(&run));
    let last = rows(&run).last().unwrap().clone();
    for key in [
        "mtp_loss",
        "aux_loss.mtp",
        "moe.layer1.imbalance",
        "moe.layer2.imbalance",
    ] {
        assert!(last[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {last}");
    }
    // The MTP loss is near the main loss's scale (both start near ln(320)).
    let (mtp, loss) = (
        last["mtp_loss"].as_f64().unwrap(),
        last["loss"].as_f64().unwrap(),
    );
    assert!((mtp - loss).abs() < 2.0, "{last}");
    let saved = anneal_engine::io::load_safetensors(
        run.join("checkpoints/step-3/shard-00000-of-00001.safetensors"),
    )
    .unwrap();
    assert!(saved.contains_key("model/mtp.eh_proj.weight"));
    // Both sparse blocks (block 1 and the MTP block) moved their routing bias.
    for bias in [
        "model/layers.1.feed_forward.router.balance_bias",
        "model/mtp.block.feed_forward.router.balance_bias",
    ] {
        let b = saved[bias].to_vec_f32();
        assert!(b.iter().any(|v| v.abs() > 1e-3), "{bias}: {b:?}");
    }
}
