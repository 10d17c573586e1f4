//! Choosing the model plugin by the Hugging Face `model_type` of a directory, end to end:
//! `anneal plugins list` shows the types each plugin serves; `logprobs`, `generate`, `serve
//! --model` and a run's `checkpoint.init_from_hf` pick the plugin from `config.json`; `--plugin`
//! still overrides; an unknown type is one clear line with exit code 2.

use anneal_tests::cli::{anneal, error_line, ok, root, Job};
use std::path::{Path, PathBuf};
use std::process::Output;

fn fixture(name: &str) -> PathBuf {
    root().join("host/runtime/tests/fixtures").join(name)
}

/// A copy of the tiny Llama fixture whose `config.json` says `model_type` (or has none).
fn hf_dir(job: &Job, name: &str, model_type: Option<&str>) -> PathBuf {
    let src = fixture("tiny_llama");
    let dir = job.dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    std::fs::copy(
        root().join("host/runtime/tests/fixtures/tiny_tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    match model_type {
        Some(t) => cfg["model_type"] = t.into(),
        None => {
            cfg.as_object_mut().unwrap().remove("model_type");
        }
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// The one error line of a command that must fail with `code`.
fn logprobs(dir: &Path, extra: &[&str]) -> Output {
    anneal()
        .args(["logprobs", "--tokens", "1,2,3", "--model-dir"])
        .arg(dir)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn plugins_list_shows_the_model_types_each_plugin_serves() {
    let out = anneal().args(["plugins", "list"]).output().unwrap();
    let text = ok(&out);
    let header = text.lines().next().unwrap();
    assert!(header.contains("MODEL TYPES"), "{text}");
    // Every row's file stands under the FILE heading, however long its flavors or types.
    let file_at = header.find("FILE").expect("a FILE column");
    for row in text.lines().skip(1).filter(|l| l.contains(".so")) {
        assert_eq!(
            row.find('/'),
            Some(file_at),
            "misaligned row: {row}\n{text}"
        );
    }
    let llama = text
        .lines()
        .find(|l| l.starts_with("llama "))
        .expect("a llama row");
    assert!(llama.contains("llama,qwen3,qwen3_moe,mixtral"), "{llama}");
    let adamw = text.lines().find(|l| l.starts_with("adamw ")).unwrap();
    assert!(
        adamw.contains(" - "),
        "optimizers serve no model type: {adamw}"
    );
}

#[test]
fn inference_picks_the_plugin_by_model_type_and_refuses_unknown_types() {
    let job = Job::new("by-model-type");
    // Served by the llama plugin without naming it, for logprobs and generate alike.
    let llama = hf_dir(&job, "llama", Some("llama"));
    let v: serde_json::Value = serde_json::from_str(&ok(&logprobs(&llama, &[]))).unwrap();
    assert_eq!(v["logprobs"].as_array().map(Vec::len), Some(2), "{v}");
    let out = anneal()
        .args([
            "generate",
            "--prompt-tokens",
            "1,2",
            "--max-new-tokens",
            "2",
            "--model-dir",
        ])
        .arg(&llama)
        .output()
        .unwrap();
    ok(&out);

    // A type no plugin serves: one line naming it and what is served, exit 2.
    let unserved = hf_dir(&job, "falcon_h1", Some("falcon_h1"));
    let line = error_line(&logprobs(&unserved, &[]), 2);
    assert!(
        line.contains("model_type 'falcon_h1'")
            && line.contains("llama (llama, qwen3, qwen3_moe, mixtral, qwen3_vl, qwen3_vl_moe)")
            && line.contains("gpt_oss (gpt_oss)"),
        "{line}"
    );
    // --plugin overrides the choice: the llama plugin is asked, and refuses the type itself.
    let line = error_line(&logprobs(&unserved, &["--plugin", "llama"]), 2);
    assert!(
        line.contains("'falcon_h1' is not served by this plugin"),
        "{line}"
    );
    // No model_type at all.
    let untyped = hf_dir(&job, "untyped", None);
    let line = error_line(&logprobs(&untyped, &[]), 2);
    assert!(line.contains("no string 'model_type'"), "{line}");

    // `anneal serve --model` picks the same way, and refuses an unknown type before serving.
    let home = job.dir.join("home");
    let out = anneal()
        .args(["serve", "--addr", "127.0.0.1:0", "--model"])
        .arg(&unserved)
        .arg("--home")
        .arg(&home)
        .output()
        .unwrap();
    let line = error_line(&out, 2);
    assert!(line.contains("model_type 'falcon_h1'"), "{line}");

    // A run starting from a Hugging Face directory with no `model.plugin` takes the directory's.
    let out = anneal()
        .arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(job.dir.join("run"))
        .args(["--set", "model.plugin=\"\""])
        .args([
            "--set",
            &format!("checkpoint.init_from_hf=\"{}\"", unserved.display()),
        ])
        .output()
        .unwrap();
    let line = error_line(&out, 2);
    assert!(
        line.contains("checkpoint.init_from_hf") && line.contains("model_type 'falcon_h1'"),
        "{line}"
    );
}

#[test]
fn plugins_show_prints_total_and_active_parameters_without_allocating() {
    let out = anneal()
        .args([
            "plugins",
            "show",
            "deepseek_v3",
            "--flavor",
            "deepseek_v3_671b",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // 671.0B as transformers counts DeepSeek-V3, plus the 11.6B MTP module; 37.6B per token.
    assert!(text.contains("parameters        682.64B"), "{text}");
    assert!(text.contains("active per token  37.55B"), "{text}");
    let out = anneal()
        .args(["plugins", "show", "gpt_oss", "--flavor", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown flavor 'nope'"));
}
