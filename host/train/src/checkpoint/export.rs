//! Checkpoint → Hugging Face directory: the model plugin is rebuilt from the run's saved config,
//! its parameters come from the checkpoint, and the plugin's adapter names the HF tensors.

use super::{load_model, CheckpointError};
use serde_json::Value;
use std::path::Path;

/// The files a run may keep beside its tokenizer that an export carries: the tokenizer's
/// settings (a chat run's template and end-of-turn token), a vision model's image processor,
/// and the generation settings of the Hugging Face directory the run started from.
pub const RUN_FILES: [&str; 3] = [
    "tokenizer_config.json",
    "preprocessor_config.json",
    "generation_config.json",
];

/// Writes `config.json`, `model.safetensors` and, when the run kept them, `tokenizer.json` and
/// [`RUN_FILES`] for the checkpoint in `step_dir` (a `<run_dir>/checkpoints/step-<N>`
/// directory) into `out`.
/// Files already in `out` are replaced only with `overwrite`; otherwise the first one found is
/// [`CheckpointError::WouldOverwrite`] and nothing is written.
pub fn export_hf(step_dir: &Path, out: &Path, overwrite: bool) -> Result<(), CheckpointError> {
    if !overwrite {
        if let Some(existing) = anneal_runtime::hf::EXPORT_FILES
            .iter()
            .chain(&RUN_FILES)
            .map(|f| out.join(f))
            .find(|p| p.symlink_metadata().is_ok())
        {
            return Err(CheckpointError::WouldOverwrite(existing));
        }
    }
    let m = load_model(step_dir)?;
    anneal_runtime::hf::export(out, m.model.spec(), &m.params, m.tokenizer.as_deref())
        .map_err(|e| CheckpointError::Mismatch(format!("{}: {e}", step_dir.display())))?;
    let run = step_dir.parent().and_then(Path::parent);
    if let Some(run) = run {
        for name in RUN_FILES {
            let (from, to) = (run.join(name), out.join(name));
            if from.is_file() {
                std::fs::copy(&from, &to).map_err(super::io_err(&to))?;
            }
        }
    }
    complete_config(out, m.hf_config.as_ref())
}

/// Completes the exported `config.json` with what the model plugin does not write: every key
/// of the Hugging Face checkpoint the run started from (`hf_config`: its token ids,
/// `initializer_range`, ...), and otherwise `eos_token_id` from the exported tokenizer's
/// end-of-turn token (`tokenizer_config.json`'s `eos_token`), so that generation stops where
/// the run's chats end a turn.
fn complete_config(out: &Path, hf_config: Option<&Value>) -> Result<(), CheckpointError> {
    let path = out.join("config.json");
    let read = |p: &Path| -> Option<Value> {
        serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
    };
    let Some(Value::Object(mut cfg)) = read(&path) else {
        return Ok(());
    };
    let before = cfg.len();
    if let Some(Value::Object(source)) = hf_config {
        for (k, v) in source {
            if cfg.get(k).is_none_or(Value::is_null) {
                cfg.insert(k.clone(), v.clone());
            }
        }
    }
    if cfg.get("eos_token_id").is_none_or(Value::is_null) {
        let eos = read(&out.join("tokenizer_config.json"))
            .and_then(|tc| anneal_data::chat::template::special_token(tc.get("eos_token")))
            .zip(read(&out.join("tokenizer.json")))
            .and_then(|(eos, tok)| eos_id(&tok, &eos));
        if let Some(id) = eos {
            cfg.insert("eos_token_id".into(), id.into());
        }
    }
    if cfg.len() == before {
        return Ok(());
    }
    let text = serde_json::to_string_pretty(&Value::Object(cfg)).unwrap_or_default();
    std::fs::write(&path, text).map_err(super::io_err(&path))
}

/// The id of `token` in a `tokenizer.json`: an added (special) token, or the model's vocabulary.
fn eos_id(tokenizer: &Value, token: &str) -> Option<u64> {
    let added = tokenizer["added_tokens"].as_array().and_then(|a| {
        a.iter()
            .find(|t| t["content"] == token)
            .and_then(|t| t["id"].as_u64())
    });
    added.or_else(|| tokenizer["model"]["vocab"][token].as_u64())
}

/// Writes a LoRA run's adapters alone, as PEFT saves them, into `out`:
/// `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` `[r, in]` and
/// `.lora_B.weight` `[out, r]`) and `adapter_config.json` (`r`, `lora_alpha`, the adapted
/// modules by their full names, the base model's directory), which `peft` loads onto the base
/// model (`PeftModel.from_pretrained`). Every adapted weight must map one to one to a Hugging
/// Face tensor; files in `out` are replaced only with `overwrite`.
pub fn export_peft(step_dir: &Path, out: &Path, overwrite: bool) -> Result<(), CheckpointError> {
    const FILES: [&str; 2] = ["adapter_model.safetensors", "adapter_config.json"];
    if !overwrite {
        if let Some(existing) = FILES
            .iter()
            .map(|f| out.join(f))
            .find(|p| p.symlink_metadata().is_ok())
        {
            return Err(CheckpointError::WouldOverwrite(existing));
        }
    }
    let fail = |m: String| CheckpointError::Mismatch(format!("{}: {m}", step_dir.display()));
    let m = load_model(step_dir)?;
    let Some((lora, adapters)) = &m.lora else {
        return Err(fail(
            "not a LoRA run ([lora] rank 0): export it whole with --to-hf alone".into(),
        ));
    };
    let mut tensors = Vec::new();
    let mut modules = Vec::new();
    for t in &lora.targets {
        let module = t.hf_module.as_ref().ok_or_else(|| {
            fail(format!(
                "{} has no one-to-one Hugging Face tensor, so PEFT cannot name its adapter; \
                 export the merged model instead (without --adapter)",
                t.name
            ))
        })?;
        for (part, name) in [
            ("lora_A", crate::lora::a_name(&t.name)),
            ("lora_B", crate::lora::b_name(&t.name)),
        ] {
            let tensor = adapters
                .get(&name)
                .ok_or_else(|| fail(format!("no adapter {name}")))?;
            tensors.push((
                format!("base_model.model.{module}.{part}.weight"),
                tensor.clone(),
            ));
        }
        modules.push(module.clone());
    }
    std::fs::create_dir_all(out).map_err(super::io_err(out))?;
    let st = out.join(FILES[0]);
    let list: Vec<(&str, &anneal_engine::Tensor)> =
        tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    anneal_engine::io::save_safetensors(&st, &list)
        .map_err(|e| fail(format!("{}: {e}", st.display())))?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": m.base_dir,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "modules_to_save": null,
        "inference_mode": true,
    });
    let path = out.join(FILES[1]);
    let text = serde_json::to_string_pretty(&config).unwrap_or_default();
    std::fs::write(&path, text).map_err(super::io_err(&path))
}
