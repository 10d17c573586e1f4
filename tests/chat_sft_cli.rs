//! Fine-tuning a Hugging Face checkpoint on chat data, as a user brings both: the tiny Qwen3
//! of `host/runtime/tests/fixtures/tiny_qwen3_chat` (saved by transformers with its own
//! tokenizer and chat template; see make_chat_fixture.py) and its `chat.jsonl`.
//! - The loss is on the assistant's tokens only: a user token that no reply follows changes
//!   no loss and no gradient, packed or not, while an assistant token does.
//! - Packed conversations keep apart: packing changes no conversation's loss (the held-out
//!   loss packed equals it unpacked), and the flipped user token reaches no neighbour.
//! - The export carries the chat template and end-of-turn token, and a run started from it
//!   evaluates exactly as the run it came from.

#[path = "sft_support.rs"]
mod sft_support;

use anneal_tests::cli as common;

use common::{anneal, ok, rows};
use sft_support::{fixture, job, train};
use std::path::Path;

/// Every logged loss, gradient norm and held-out loss, as bits.
fn curve(run: &Path) -> Vec<(String, u64)> {
    rows(run)
        .iter()
        .flat_map(|r| {
            ["loss", "grad_norm", "val_loss"]
                .into_iter()
                .filter_map(|k| r[k].as_f64().map(|v| (k.to_string(), v.to_bits())))
        })
        .collect()
}

#[test]
fn the_loss_is_on_the_assistants_tokens_only_and_packing_keeps_conversations_apart() {
    // Conversation 2 ends with a user turn that no reply follows ("Thanks, Fay!"); its reply
    // is "29 plus 40 is 69.". Both edits keep every token count.
    let same = job("same", |s| s);
    let user = job("user", |s| s.replacen("Thanks, Fay!", "Thanks, Gus!", 1));
    let reply = job("reply", |s| {
        s.replacen("\"29 plus 40 is 69.\"", "\"29 plus 40 is 68.\"", 1)
    });
    for pack in ["data.pack=false", "data.pack=true"] {
        let base = curve(&train(&same, pack, &[pack]));
        assert_eq!(base.len(), 5, "{base:?}");
        assert_eq!(
            curve(&train(&user, pack, &[pack])),
            base,
            "{pack}: a user token changed the loss or a gradient"
        );
        assert_ne!(
            curve(&train(&reply, pack, &[pack])),
            base,
            "{pack}: an assistant token changed nothing"
        );
    }
    // Packed rows hold several conversations (the user token's neighbours among them), and
    // every conversation's loss is its loss alone: the held-out mean (over the tokens of one
    // held-out batch either way) is the same, as the checkpoint's weights score it.
    let val = |pack: &str| {
        let run = train(
            &same,
            &format!("val-{pack}"),
            &[
                pack,
                "training.steps=1",
                "optimizer.lr=0.0",
                "metrics.eval_freq=1",
            ],
        );
        rows(&run)
            .iter()
            .find_map(|r| r["val_loss"].as_f64())
            .unwrap()
    };
    let (packed, alone) = (val("data.pack=true"), val("data.pack=false"));
    assert!(
        (packed - alone).abs() <= 1e-6 * alone,
        "held-out loss {packed} packed, {alone} one conversation per row"
    );
    for dir in [same, user, reply] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn a_fine_tuned_qwen3_learns_and_its_export_renders_chats_as_the_original() {
    let dir = job("export", |s| s);
    let run = train(
        &dir,
        "run",
        &[
            "training.steps=40",
            "data.pack=true",
            "metrics.eval_freq=20",
            "checkpoint.interval=40",
        ],
    );
    let vals: Vec<f64> = rows(&run)
        .iter()
        .filter_map(|r| r["val_loss"].as_f64())
        .collect();
    assert_eq!(vals.len(), 2, "{vals:?}");
    let start = rows(&run)[0]["loss"].as_f64().unwrap();
    assert!(
        vals[1] < 0.6 * start,
        "held-out loss {vals:?} after a first training loss of {start}"
    );
    let recorded = std::fs::read_to_string(run.join("config.toml")).unwrap();
    // The plugin serving config.json's model_type (the Llama plugin builds Qwen3).
    assert!(recorded.contains("plugin = \"llama\""), "{recorded}");
    let hf = dir.join("hf");
    ok(&anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(run.join("checkpoints/step-40"))
        .output()
        .unwrap());
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(hf.join(f)).expect(f)).unwrap()
    };
    let original = |f: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(fixture().join(f)).unwrap()).unwrap()
    };
    let (cfg, tc) = (read("config.json"), read("tokenizer_config.json"));
    assert_eq!(cfg["model_type"], "qwen3");
    // Every argument of the checkpoint's config.json, not only shapes (rope_theta is 1e6).
    let value = |c: &serde_json::Value, key: &str| match &c[key] {
        serde_json::Value::Null => c["rope_parameters"][key].clone(),
        v => v.clone(),
    };
    let source = original("config.json");
    for key in [
        "rope_theta",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "eos_token_id",
    ] {
        let want = value(&source, key);
        assert!(!want.is_null(), "{key}");
        assert_eq!(value(&cfg, key), want, "config.json `{key}`");
    }
    let want = original("tokenizer_config.json");
    assert_eq!(tc["chat_template"], want["chat_template"]);
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(read("generation_config.json")["eos_token_id"], 2);
    // The export's tokenizer is the checkpoint's own.
    assert_eq!(
        std::fs::read(hf.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture().join("tokenizer.json")).unwrap()
    );
    // Started from the export with a zero learning rate, a run evaluates as the source did.
    let val = sft_support::held_out_loss_of(&dir, &hf);
    assert_eq!(val.to_bits(), vals[1].to_bits(), "{val} vs {vals:?}");
    let _ = std::fs::remove_dir_all(dir);
}
