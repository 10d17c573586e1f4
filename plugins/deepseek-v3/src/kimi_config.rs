//! Kimi Linear (transformers' `kimi_linear`): its flavors and the reader of its `config.json`.
//! The model is DeepSeek-V3's (MLA without RoPE, the same router and experts) with Kimi Delta
//! Attention in three of every four blocks.

use crate::config::{DeepseekArgs, KdaArgs};
use anneal_plugin_api::sdk::kit::ModelArgs;
use anneal_plugin_api::sdk::HfConfig;

/// Kimi-Linear-48B-A3B: transformers' `KimiLinearConfig` defaults (hidden 2304, 27 blocks, 32
/// MLA heads over a 512-rank latent, 256 experts of 1024, top 8, one shared, 32 KDA heads of
/// 128) with the layer pattern of the released `config.json` (`full_attn_layers` 4, 8, .., 24,
/// 27, 1-based: MLA there, KDA in the other 20 blocks).
pub fn kimi_linear_48b_a3b() -> DeepseekArgs {
    let n_layers = 27;
    let full = [3, 7, 11, 15, 19, 23, 26];
    DeepseekArgs {
        dim: 2304,
        n_layers,
        n_heads: 32,
        vocab_size: 163_840,
        norm_eps: 1e-5,
        rope_theta: 10_000.0,
        yarn: None,
        max_seq_len: 1_048_576,
        q_lora_rank: None,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        rope_interleave: true,
        ffn_dim: 9216,
        first_k_dense: 1,
        n_experts: 256,
        top_k: 8,
        expert_ffn_dim: 1024,
        n_shared_experts: 1,
        n_group: 1,
        topk_group: 1,
        scoring: "sigmoid".into(),
        norm_topk_prob: true,
        routed_scaling_factor: 2.446,
        aux_loss_coef: 0.0,
        balance_rate: 0.0,
        mtp_layers: 0,
        tie_embeddings: false,
        dtype: "bf16".into(),
        hf_model_type: "kimi_linear".into(),
        mla_rope: false,
        dense_layers: None,
        kda: Some(KdaArgs {
            n_heads: 32,
            head_dim: 128,
            conv_kernel: 4,
            layers: (0..n_layers).filter(|i| !full.contains(i)).collect(),
        }),
        vision: None,
        hf_released_layout: true,
    }
}

/// The debug Kimi Linear: the debug DeepSeek-V3's size (hidden 256, 4 blocks) with Kimi
/// Linear's blocks: KDA (4 heads of 64) in blocks 0–2, MLA without RoPE (4 heads, a 32-rank
/// latent) in block 3, a dense first block, then 8 sigmoid-routed experts of 128 (top 2) plus
/// a shared one.
pub fn kimi_linear_debug() -> DeepseekArgs {
    DeepseekArgs {
        dim: 256,
        n_layers: 4,
        n_heads: 4,
        vocab_size: 8192,
        max_seq_len: 2048,
        kv_lora_rank: 32,
        qk_nope_head_dim: 32,
        qk_rope_head_dim: 16,
        v_head_dim: 32,
        ffn_dim: 512,
        n_experts: 8,
        top_k: 2,
        expert_ffn_dim: 128,
        balance_rate: 0.001,
        dtype: "f32".into(),
        kda: Some(KdaArgs {
            n_heads: 4,
            head_dim: 64,
            conv_kernel: 4,
            layers: vec![0, 1, 2],
        }),
        hf_released_layout: false,
        ..kimi_linear_48b_a3b()
    }
}

/// DeepSeek-V3's keys that transformers' Kimi Linear does not read (no RoPE, sigmoid scoring,
/// its own names for the expert count and the dense blocks): a config that holds them anyway
/// keeps the flavor's values, and export leaves them out.
pub(crate) const NOT_KIMI_KEYS: [&str; 7] = [
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rope_interleave",
    "scoring_func",
    "n_routed_experts",
    "first_k_dense_replace",
];

/// Arguments from a Hugging Face `kimi_linear` `config.json` (as `save_pretrained` writes it,
/// or as the released checkpoints do with `linear_attn_config`). A key that is absent takes
/// transformers' default, which is the released model's.
pub fn from_hf_config(c: &serde_json::Value) -> Result<DeepseekArgs, String> {
    let f = HfConfig::new(c);
    if f.bool("attention_bias")?.unwrap_or(false) {
        return Err("config.json: attention_bias = true is not supported".into());
    }
    if let Some(act) = f.str("hidden_act")? {
        if act != "silu" {
            return Err(format!(
                "config.json: hidden_act '{act}' is not supported (silu)"
            ));
        }
    }
    // DeepSeek-V3's keys, the flavor's values where the config has none.
    let mut keys = kimi_linear_48b_a3b().to_hf();
    for (k, v) in c.as_object().into_iter().flatten() {
        if !NOT_KIMI_KEYS.contains(&k.as_str()) {
            keys.insert(k.clone(), v.clone());
        }
    }
    let keys = serde_json::Value::Object(keys);
    let a = DeepseekArgs::from_hf(&HfConfig::new(&keys))?;
    // transformers expands the latent into `num_attention_heads` key/value heads; other
    // key/value head counts do not run there either.
    if let Some(kv) = f.uint("num_key_value_heads")? {
        if kv != a.n_heads {
            return Err(format!(
                "config.json: num_key_value_heads = {kv} must equal num_attention_heads = {} (MLA expands the latent into one key/value head per query head)",
                a.n_heads
            ));
        }
    }
    // `linear_attn_config` (the released checkpoints) wins over the flat keys, as in
    // transformers.
    let lin = match f.get("linear_attn_config") {
        Some(_) => Some(f.object("linear_attn_config")?),
        None => None,
    };
    let mut kda = KdaArgs::from_hf(&HfConfig::new(&keys))?;
    if let Some(lin) = &lin {
        for (k, v) in [
            ("num_heads", &mut kda.n_heads),
            ("head_dim", &mut kda.head_dim),
            ("short_conv_kernel_size", &mut kda.conv_kernel),
        ] {
            *v = lin.uint(k)?.unwrap_or(*v);
        }
    }
    kda.layers = kda_layers(&f, lin.as_ref(), a.n_layers)?;
    let args = DeepseekArgs {
        // transformers' names for these (its `attribute_map`) win over DeepSeek-V3's.
        max_seq_len: f.uint("model_max_length")?.unwrap_or(a.max_seq_len),
        n_experts: match f.uint("num_experts")? {
            Some(n) => n,
            None => f.uint("num_local_experts")?.unwrap_or(a.n_experts),
        },
        top_k: f.uint("num_experts_per_token")?.unwrap_or(a.top_k),
        n_shared_experts: f.uint("num_shared_experts")?.unwrap_or(a.n_shared_experts),
        n_group: f.uint("num_expert_group")?.unwrap_or(a.n_group),
        norm_topk_prob: f.bool("moe_renormalize")?.unwrap_or(a.norm_topk_prob),
        dense_layers: Some(dense_layers(&f, a.n_layers)?),
        kda: Some(kda),
        // transformers always writes both lists; the released configs have neither.
        hf_released_layout: f.get("layer_types").is_none() && f.get("mlp_layer_types").is_none(),
        mla_rope: false,
        ..a
    };
    args.validate().map_err(|e| format!("config.json: {e}"))?;
    Ok(args)
}

/// The KDA blocks: `layer_types`, else `linear_attn_config.kda_layers` / `full_attn_layers`
/// (1-based), else transformers' default (MLA where `i > 0 && i % 4 == 0`).
fn kda_layers(f: &HfConfig, lin: Option<&HfConfig>, n_layers: usize) -> Result<Vec<usize>, String> {
    if let Some(types) = f.str_list("layer_types")? {
        if types.len() != n_layers {
            return Err(format!(
                "config.json: layer_types has {} entries for {n_layers} layers (num_hidden_layers)",
                types.len()
            ));
        }
        let mut kda = vec![];
        for (i, t) in types.iter().enumerate() {
            match *t {
                "linear_attention" => kda.push(i),
                "full_attention" => {}
                other => {
                    return Err(format!(
                        "config.json: layer_types[{i}] = '{other}' (expected linear_attention or full_attention)"
                    ))
                }
            }
        }
        return Ok(kda);
    }
    if let Some(lin) = lin {
        if let (Some(kda), Some(full)) = (
            lin.uint_list("kda_layers")?,
            lin.uint_list("full_attn_layers")?,
        ) {
            let mut seen = vec![false; n_layers];
            for &l in kda.iter().chain(&full) {
                match l.checked_sub(1).and_then(|i| seen.get_mut(i)) {
                    Some(s) => *s = true,
                    None => {
                        return Err(format!(
                            "config.json: linear_attn_config names layer {l}, outside 1..={n_layers} (the lists are 1-based)"
                        ))
                    }
                }
            }
            if let Some(i) = seen.iter().position(|s| !s) {
                return Err(format!(
                    "config.json: linear_attn_config gives layer {} neither kda_layers nor full_attn_layers",
                    i + 1
                ));
            }
            // As transformers: a layer in both lists is KDA (it writes the KDA list last).
            let mut layers: Vec<usize> = kda.iter().map(|l| l - 1).collect();
            layers.sort_unstable();
            layers.dedup();
            return Ok(layers);
        }
    }
    Ok((0..n_layers).filter(|&i| !(i > 0 && i % 4 == 0)).collect())
}

/// The dense blocks: `mlp_layer_types`, else the first `first_k_dense_replace` (default 1).
fn dense_layers(f: &HfConfig, n_layers: usize) -> Result<Vec<usize>, String> {
    match f.str_list("mlp_layer_types")? {
        Some(types) => {
            if types.len() != n_layers {
                return Err(format!(
                    "config.json: mlp_layer_types has {} entries for {n_layers} layers (num_hidden_layers)",
                    types.len()
                ));
            }
            let mut dense = vec![];
            for (i, t) in types.iter().enumerate() {
                match *t {
                    "dense" => dense.push(i),
                    "sparse" => {}
                    other => {
                        return Err(format!(
                        "config.json: mlp_layer_types[{i}] = '{other}' (expected dense or sparse)"
                    ))
                    }
                }
            }
            Ok(dense)
        }
        None => {
            let k = f.uint("first_k_dense_replace")?.unwrap_or(1);
            Ok((0..k.min(n_layers)).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_released_config_reads_like_the_flavor() {
        // The keys of moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json that matter.
        let c = json!({
            "model_type": "kimi_linear", "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
            "head_dim": 72, "model_max_length": 1048576, "rms_norm_eps": 1e-5,
            "linear_attn_config": {
                "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4
            },
            "num_experts": 256, "moe_intermediate_size": 1024, "kv_lora_rank": 512,
            "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "mla_use_nope": true, "first_k_dense_replace": 1,
            "num_experts_per_token": 8, "num_shared_experts": 1, "moe_renormalize": true,
            "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
            "vocab_size": 163840, "tie_word_embeddings": false
        });
        let a = from_hf_config(&c).unwrap();
        let want = kimi_linear_48b_a3b();
        assert_eq!(a.kda, want.kda);
        assert_eq!((a.is_sparse(0), a.is_sparse(1)), (false, true));
        assert_eq!(
            DeepseekArgs {
                dtype: "bf16".into(),
                first_k_dense: 1,
                dense_layers: None,
                ..a
            },
            want
        );
    }

    #[test]
    fn layer_patterns_and_bad_values_are_read_by_name() {
        // transformers' default pattern: MLA at 4, 8, .. (0-based).
        let a = from_hf_config(&json!({"num_hidden_layers": 9})).unwrap();
        assert_eq!(a.kda.unwrap().layers, [0, 1, 2, 3, 5, 6, 7]);
        let a = from_hf_config(&json!({
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
            "mlp_layer_types": ["sparse", "dense", "sparse"]
        }))
        .unwrap();
        assert_eq!(a.kda.as_ref().unwrap().layers, [1]);
        assert_eq!((a.is_sparse(0), a.is_sparse(1)), (true, false));
        for (c, want) in [
            (
                json!({"num_hidden_layers": 2, "layer_types": ["full_attention"]}),
                "layer_types has 1 entries",
            ),
            (
                json!({"num_hidden_layers": 1, "layer_types": ["sliding"]}),
                "layer_types[0] = 'sliding'",
            ),
            (
                json!({"num_hidden_layers": 2, "mlp_layer_types": ["dense", "moe"]}),
                "mlp_layer_types[1] = 'moe'",
            ),
            (
                json!({"num_hidden_layers": 2, "linear_attn_config": {"kda_layers": [0], "full_attn_layers": [2]}}),
                "layer 0, outside 1..=2",
            ),
            (json!({"num_key_value_heads": 8}), "num_key_value_heads = 8"),
            (
                json!({"linear_num_heads": 0}),
                "kda.n_heads must be at least 1",
            ),
            (
                json!({"num_experts": "many"}),
                "'num_experts' has the wrong type",
            ),
        ] {
            let e = from_hf_config(&c).unwrap_err();
            assert!(e.contains(want), "{c}: {e}");
        }
    }
}
