//! `anneal logprobs` and `anneal generate` end to end: the binary, the llama plugin and the tiny
//! Hugging Face fixtures (written by host/runtime/tests/reference/make_hf_fixtures.py).

use anneal_tests::cli as common;

use common::{anneal, json_of, root};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    root().join("host/runtime/tests/fixtures")
}

#[test]
fn logprobs_prints_the_transformers_values() {
    let dir = fixtures().join("tiny_qwen3");
    let exp = anneal_engine::io::load_safetensors(dir.join("expected.safetensors")).unwrap();
    let tokens = exp["tokens"].narrow(0, 0, 1).unwrap().to_vec::<i64>();
    let want = exp["logprobs"].narrow(0, 0, 1).unwrap().to_vec_f32();
    let ids: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let out = anneal()
        .args(["logprobs", "--model-dir"])
        .arg(&dir)
        .args(["--tokens", &ids.join(",")])
        .output()
        .unwrap();
    let v = json_of(&out);
    let got: Vec<f64> = v["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - *w as f64).abs() < 1e-4, "{g} vs {w}");
    }
    let loss = v["loss"].as_f64().unwrap();
    let want_loss = -want.iter().map(|&x| x as f64).sum::<f64>() / want.len() as f64;
    assert!((loss - want_loss).abs() < 1e-5);
}

#[test]
fn generate_from_text_and_ids_agree() {
    let dir = fixtures().join("tiny_llama");
    let tok = fixtures().join("tiny_tokenizer.json");
    let run = |extra: &[&str]| {
        let out = anneal()
            .args(["generate", "--model-dir"])
            .arg(&dir)
            .args([
                "--max-new-tokens",
                "6",
                "--temperature",
                "0.7",
                "--seed",
                "9",
                "--tokenizer",
            ])
            .arg(&tok)
            .args(extra)
            .output()
            .unwrap();
        json_of(&out)
    };
    let a = run(&["--prompt", "the cat sat"]);
    let ids: Vec<String> = a["prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    let b = run(&["--prompt-tokens", &ids.join(",")]);
    assert_eq!(
        a["tokens"], b["tokens"],
        "same prompt and seed, same tokens"
    );
    assert_eq!(a["tokens"].as_array().unwrap().len(), 6);
    assert!(a["text"].is_string());
    assert_eq!(a["logprobs"].as_array().unwrap().len(), 6);
}

#[test]
fn bad_inputs_exit_2_with_one_line() {
    let dir = fixtures().join("tiny_llama");
    for args in [
        vec!["--tokens", "1,2,999"],
        vec!["--tokens", "1,x"],
        vec!["--text", "hello"],
    ] {
        let out = anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&dir)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.starts_with("error: "), "{err}");
    }
    let out = anneal()
        .args(["logprobs", "--model-dir", "/nonexistent", "--tokens", "1,2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
}

#[test]
fn deepseek_v3_decodes_from_its_latent_cache_like_its_training_forward() {
    let dir = fixtures().join("tiny_deepseek_v3");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap();
    let prompt = "5,17,3,88,41,9";
    let out = anneal()
        .args(["generate", "--model-dir"])
        .arg(&dir)
        .args(["--prompt-tokens", prompt, "--max-new-tokens", "8"])
        .args(["--temperature", "0.8", "--seed", "3"])
        .output()
        .unwrap();
    let g = json_of(&out);
    // One latent [kv_lora_rank] and shared RoPE key per token and layer, kept once as the key
    // [latent, RoPE key] (the values are read from it), f32: not the heads' expanded
    // keys/values.
    let (layers, r, dr) = (
        n("num_hidden_layers"),
        n("kv_lora_rank"),
        n("qk_rope_head_dim"),
    );
    assert_eq!(g["cache_bytes_per_token"], layers * (r + dr) * 4, "{g}");
    let expanded =
        layers * n("num_attention_heads") * (n("qk_nope_head_dim") + dr + n("v_head_dim")) * 4;
    assert!(g["cache_bytes_per_token"].as_u64().unwrap() * 5 < expanded);
    // The training forward over the generated sequence gives the same logprobs, bit for bit.
    let new: Vec<i64> = g["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    let all = format!(
        "{prompt},{}",
        new.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    let lp = json_of(
        &anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&dir)
            .args(["--tokens", &all])
            .output()
            .unwrap(),
    );
    let tail: Vec<f64> = lp["logprobs"].as_array().unwrap()[5..]
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let decoded: Vec<f64> = g["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(tail, decoded);
}

#[test]
fn prompt_and_text_may_start_with_a_dash() {
    let dir = fixtures().join("tiny_llama");
    let tok = fixtures().join("tiny_tokenizer.json");
    for prompt in ["-x the cat", "--the cat"] {
        let out = anneal()
            .args(["generate", "--model-dir"])
            .arg(&dir)
            .args(["--max-new-tokens", "2", "--tokenizer"])
            .arg(&tok)
            .args(["--prompt", prompt])
            .output()
            .unwrap();
        let g = json_of(&out);
        assert_eq!(g["tokens"].as_array().map(Vec::len), Some(2), "{g}");
        // The prompt is the text given, dash included.
        let scored = anneal()
            .args(["logprobs", "--model-dir"])
            .arg(&dir)
            .arg("--tokenizer")
            .arg(&tok)
            .args(["--text", prompt])
            .output()
            .unwrap();
        let lp = json_of(&scored);
        assert_eq!(lp["tokens"], g["prompt_tokens"], "{lp} {g}");
    }
}
