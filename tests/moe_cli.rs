//! A mixture-of-experts model through `anneal train`: the Llama plugin's Qwen3-MoE flavor
//! reports each layer's tokens per expert, load imbalance and router entropy, and with
//! aux-loss-free balancing on it moves a checkpointed routing bias once per step, mean-centred,
//! by `balance_rate` per expert (towards the experts that got fewer tokens).

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
