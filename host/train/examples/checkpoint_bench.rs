//! How long a checkpoint save blocks the training thread, asynchronous vs synchronous, for the
//! debug Llama and a ~134M-parameter Llama (parameters + AdamW's two state tensors).
//! Run through `bash bench/checkpoint_bench.sh` (needs the llama plugin built in target/release).

use anneal_engine::Tensor;
use anneal_runtime::plugins::{find, PluginModel};
use anneal_train::checkpoint::{write_checkpoint, Checkpointer, Snapshot, TrainState};
use std::path::Path;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn state(step: u64) -> TrainState {
    TrainState {
        step,
        seed: 0,
        loader: anneal_data::LoaderState {
            epoch: 0,
            cursor: 0,
            mixture: None,
            stream: None,
        },
        lr: 0.0,
        tokens: 0,
        elapsed_s: 0.0,
        model: "llama".into(),
        optimizer: "adamw".into(),
        config: String::new(),
        tokenizer_sha256: None,
        data_sha256: None,
        rl: None,
    }
}

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/tmp/checkpoint_bench".into());
    let reps = 3;
    let plugin = find("llama")?;
    let large = serde_json::json!({"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "ffn_dim": 2048, "vocab_size": 32000});
    println!(
        "{:<12} {:>12} {:>10} {:>12} {:>12} {:>10}",
        "model", "params", "bytes", "sync s", "async blocked s", "ratio"
    );
    for (name, args) in [("debugmodel", serde_json::json!({})), ("llama-134m", large)] {
        let model = PluginModel::new("llama", plugin.create(Some("debugmodel"), &args)?)?;
        let params = model.init_params(0)?;
        let n: usize = params.values().map(Tensor::numel).sum();
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for (k, p) in &params {
            tensors.push((format!("model/{k}"), p.clone()));
            tensors.push((format!("optim/{k}.exp_avg"), p.zeros_like()));
            tensors.push((format!("optim/{k}.exp_avg_sq"), p.zeros_like()));
        }
        let bytes: usize = tensors.iter().map(|(_, t)| t.numel() * 4).sum();
        let root = Path::new(&dir).join(name);
        let _ = std::fs::remove_dir_all(&root);
        let mut sync = Vec::new();
        let mut blocked = Vec::new();
        let mut ckpt = Checkpointer::new(root.join("async"), 1, true);
        for i in 0..reps {
            let t = Instant::now();
            let snap = Snapshot::capture(
                state(i),
                tensors.iter().map(|(n, t)| (n.clone(), t)),
                Vec::new(),
            );
            write_checkpoint(&root.join("sync"), &snap)?;
            sync.push(t.elapsed().as_secs_f64());
            drop(snap);
            let t = Instant::now();
            ckpt.save(|spare| {
                Snapshot::capture(state(i), tensors.iter().map(|(n, t)| (n.clone(), t)), spare)
            })?;
            blocked.push(t.elapsed().as_secs_f64());
            // A real run trains between saves; here the next save must not count this one's write.
            if let Some(e) = ckpt.wait() {
                anyhow::bail!(e);
            }
        }
        let (s, b) = (median(sync), median(blocked));
        println!(
            "{name:<12} {n:>12} {:>9.0}M {s:>12.3} {b:>15.3} {:>9.1}%",
            bytes as f64 / 1e6,
            100.0 * b / s
        );
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(())
}
