//! LoRA fine-tuning of a Hugging Face checkpoint (`[lora]`), on the tiny Qwen3 fixture and its
//! chat data:
//! - only the adapters train: the run reports them (and their optimizer bytes) against the
//!   frozen base, checkpoints hold them alone, and a resumed run continues bit for bit;
//! - the merged export evaluates exactly as the run did;
//! - the adapter export is PEFT's layout: `adapter_config.json` and
//!   `base_model.model.<module>.lora_{A,B}.weight`, whose `W + alpha/r · B·A` on the base
//!   checkpoint is the merged export's weight (`host/runtime/tests/reference/check_lora_peft.py`
//!   loads it with `peft` itself);
//! - two data-parallel ranks train the same adapters as one process;
//! - what LoRA cannot do yet is refused by its key.

#[path = "dist_support.rs"]
mod dist_support;
#[path = "sft_support.rs"]
mod sft_support;

use anneal_engine::io::load_safetensors;
use anneal_tests::cli as common;

use common::{anneal, ok, rows};
use sft_support::{fixture, job, train};
use std::path::Path;

/// The tensors of every `.safetensors` file in `dir`, by name.
fn tensors_in(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            names.extend(load_safetensors(&p).unwrap().into_keys());
        }
    }
    names
}

fn export(step: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(out)
        .arg(step)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn lora_trains_only_its_adapters_and_exports_merged_and_as_peft() {
    let dir = job("lora", |s| s);
    let set = [
        "lora.rank=4",
        "lora.alpha=8.0",
        "optimizer.lr=2e-2",
        "training.steps=30",
        "data.pack=true",
        "metrics.eval_freq=15",
        "checkpoint.interval=15",
    ];
    let run = train(&dir, "run", &set);
    let all = rows(&run);
    // q_proj (64 -> 64) and v_proj (64 -> 32) of 2 layers at rank 4: 2 * 4 * (128 + 96).
    let row = all.iter().find(|r| r["loss"].is_number()).unwrap();
    assert_eq!(row["trainable_params"], 1792, "{row}");
    let frozen = row["frozen_params"].as_u64().unwrap();
    assert!(frozen > 40 * 1792, "{row}");
    // AdamW's two moments of every adapter, in f32.
    assert_eq!(row["optimizer_bytes"], 2 * 4 * 1792, "{row}");
    let vals: Vec<f64> = all.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    let start = all[0]["loss"].as_f64().unwrap();
    assert_eq!(vals.len(), 2);
    // The embeddings and the head stay frozen, so it learns slower than full fine-tuning.
    assert!(
        vals[1] < vals[0] && vals[0] < start - 0.2,
        "held-out {vals:?} after a first loss of {start}"
    );

    // The checkpoint holds the adapters, not the base.
    let step = run.join("checkpoints/step-30");
    let names = tensors_in(&step);
    let weights: Vec<&String> = names.iter().filter(|n| n.starts_with("model/")).collect();
    assert_eq!(weights.len(), 2 * 2 * 2, "{weights:?}");
    assert!(weights.iter().all(|n| n.contains(".lora_")), "{weights:?}");

    // Resumed from step 15, the run continues the same curve.
    let want: Vec<u64> = all
        .iter()
        .filter_map(|r| r["loss"].as_f64())
        .map(f64::to_bits)
        .collect();
    std::fs::remove_dir_all(&step).unwrap();
    let run = train(&dir, "run", &set);
    let got: Vec<u64> = rows(&run)
        .iter()
        .filter_map(|r| r["loss"].as_f64())
        .map(f64::to_bits)
        .collect();
    assert_eq!(got, want);

    // The merged export evaluates exactly as the run's last evaluation.
    let merged = dir.join("merged");
    ok(&export(&step, &merged, &[]));
    let val = sft_support::held_out_loss_of(&dir, &merged);
    assert_eq!(val.to_bits(), vals[1].to_bits(), "{val} vs {vals:?}");

    // The adapter alone, as PEFT saves it.
    let peft = dir.join("peft");
    ok(&export(&step, &peft, &["--adapter"]));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(peft.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(config["target_modules"].as_array().unwrap().len(), 4);
    let adapter = load_safetensors(peft.join("adapter_model.safetensors")).unwrap();
    let base = load_safetensors(fixture().join("model.safetensors")).unwrap();
    let out = load_safetensors(merged.join("model.safetensors")).unwrap();
    for module in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ] {
        let a = &adapter[&format!("base_model.model.{module}.lora_A.weight")];
        let b = &adapter[&format!("base_model.model.{module}.lora_B.weight")];
        assert_eq!((a.shape()[0], b.shape()[1]), (4, 4));
        // PEFT's forward: W + (lora_alpha / r) B·A.
        let delta = b.matmul(a).unwrap().mul_scalar(2.0).unwrap();
        let w = base[&format!("{module}.weight")]
            .to_dtype(anneal_engine::DType::F32)
            .unwrap();
        let want = w.add(&delta).unwrap().to_vec_f32();
        let got = out[&format!("{module}.weight")].to_vec_f32();
        let worst = want
            .iter()
            .zip(&got)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= 1e-6, "{module}: {worst}");
        assert!(
            delta.to_vec_f32().iter().any(|&d| d != 0.0),
            "{module} trained"
        );
    }
    // A run without adapters has none to export.
    let plain = train(&dir, "plain", &["checkpoint.interval=2"]);
    let out = export(
        &plain.join("checkpoints/step-2"),
        &dir.join("none"),
        &["--adapter"],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a LoRA run"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn what_lora_cannot_do_is_refused_by_its_key() {
    let dir = job("lora-bad", |s| s);
    let refused = |set: &[&str], needles: &[&str]| sft_support::refused(&dir, set, needles);
    refused(
        &["lora.rank=4", "lora.targets=[\"qkv\"]"],
        &["`lora.targets`", "names no weight", "q_proj"],
    );
    refused(&["lora.rank=4", "lora.alpha=0.0"], &["lora.alpha"]);
    refused(
        &["lora.rank=4", "lora.base_dtype=\"int4\""],
        &["lora.base_dtype"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn two_data_parallel_ranks_train_the_adapters_of_one_process() {
    // The tiny Llama from its seeded initialisation, adapters on every attention projection.
    let job = common::Job::new("lora-ddp");
    let set = [
        "lora.rank=2",
        "lora.targets=[\"*_proj\"]",
        "training.steps=6",
        "training.micro_batch_size=2",
        "training.threads=1",
        "metrics.eval_freq=0",
    ];
    let (out, one) = job.train("one", &set);
    let log = ok(&out);
    assert!(log.contains("lora: rank 2"), "{log}");
    let two = job.dir.join("two");
    ok(&dist_support::mpiexec_train(2, &job, &two, &set));
    dist_support::assert_follows(&one, &two, 6);
    // FSDP shards what LoRA does not yet hand to adapters: refused by its key.
    let out = dist_support::mpiexec_train(
        2,
        &job,
        &job.dir.join("fsdp"),
        &[&set[..], &["parallelism.dp_shard=2"]].concat(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`lora.rank`") && err.contains("dp_shard"),
        "{err}"
    );
}
