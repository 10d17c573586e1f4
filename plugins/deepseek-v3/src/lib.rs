//! The DeepSeek-V3 plugin: DeepSeek-V3 and Kimi K2 (multi-head latent attention, sigmoid
//! group-limited routing with shared experts and an aux-loss-free bias) in one model file, and
//! Kimi Linear (the same with Kimi Delta Attention in three blocks of four, `kda.rs`), with
//! debug flavors that train on the built-in corpus in minutes.

pub mod config;
pub mod hf;
pub mod kda;
pub mod kimi_config;
pub mod model;
pub mod moonvit;
pub mod spec;

pub use config::DeepseekArgs;
pub use model::DeepseekV3;

anneal_plugin_api::model_factory!(DeepseekV3, crate::config);

anneal_plugin_api::export_plugin!(model DeepseekV3, name = "deepseek_v3", model_types = ["deepseek_v3", "kimi_k2", "kimi_linear", "kimi_k25"], description = "DeepSeek-V3 / Kimi K2 / Kimi Linear / Kimi K2.7 decoder (multi-head latent attention, YaRN RoPE, sigmoid group-limited routing with shared experts and an aux-loss-free bias; Kimi Delta Attention; MoonViT3d for Kimi K2.7's images)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;

    /// Trained parameters (the routing biases are buffers, as in transformers, which has no
    /// MTP module) and those a token goes through.
    fn count(flavor: &str) -> (usize, usize) {
        let m = DeepseekV3::create(Some(flavor), serde_json::json!({})).unwrap();
        let total: usize = m
            .spec
            .params
            .iter()
            .filter(|p| p.trainable && !p.name.starts_with("mtp."))
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        (total, total - spec::idle_params(&m.args))
    }

    #[test]
    fn released_sizes_count_like_transformers() {
        // transformers 5.24 `DeepseekV3ForCausalLM` on the meta device (no MTP module).
        assert_eq!(count("deepseek_v3_671b").0, 671_026_404_352);
        assert_eq!(count("kimi_k2_1t").0, 1_026_408_209_408);
        // `Kimi_K25ForConditionalGeneration` with Kimi K2's decoder and the default tower.
        assert_eq!(count("kimi_k25_1t").0, 1_026_879_353_328);
        assert_eq!(count("moonlight_16b_a3b").0, 15_960_108_544);
        // transformers' `DeepseekV2ForCausalLM` for V2-Lite.
        assert_eq!(count("deepseek_v2_lite_16b").0, 15_706_484_224);
        // DeepSeek-V3's 37B active parameters per token.
        let active = count("deepseek_v3_671b").1 as f64 / 1e9;
        assert!((36.5..38.0).contains(&active), "{active}");
    }

    #[test]
    fn kimi_linear_48b_counts_like_transformers_and_its_flops_count_each_block_kind() {
        // transformers 5.24 `KimiLinearForCausalLM` on the meta device, with the released
        // layer pattern (MLA in blocks 4, 8, .., 24, 27, 1-based).
        let (total, active) = count("kimi_linear_48b_a3b");
        assert_eq!(total, 49_122_675_072);
        let m = DeepseekV3::create(Some("kimi_linear_48b_a3b"), serde_json::json!({})).unwrap();
        // By hand: hidden 2304, KDA 32 heads of 128 (H·D = 4096), conv kernel 4; MLA 32 heads
        // of 128 + 64 query/key and 128 value dims over a 512-rank latent; 26 sparse blocks
        // (256 experts of 1024, 8 routed + 1 shared per token), one dense block of 9216.
        let (d, hd, hdim) = (2304usize, 4096usize, 128usize);
        let kda =
            3 * hd * d + 3 * hd * 4 + 32 + hd + 2 * (hdim * d + hd * hdim) + 32 * d + hdim + d * hd;
        let mla = d * 32 * 192 + d * (512 + 64) + 512 + 512 * 32 * 256 + 32 * 128 * d;
        let expert = 3 * d * 1024;
        let sparse_active = 256 * d + 256 + 9 * expert;
        let active_by_hand =
            20 * kda + 7 * mla + 27 * 2 * d + 3 * d * 9216 + 26 * sparse_active + d + 163_840 * d;
        // (The routing biases are buffers, counted among the active parameters here.)
        assert_eq!(active + 26 * 256, active_by_hand + 163_840 * d);
        // 6 per active parameter (the embedding apart), MLA's scores and values over the
        // 1M-token context in the 7 MLA blocks only, and the chunked delta rule in the 20 KDA
        // blocks: per head and token, (10·64²·128 + ⅔·64³ + 6·64·128²) / 64, times 3.
        let delta_per_block = 3.0
            * 32.0
            * (10.0 * 64.0 * 64.0 * 128.0 + 2.0 / 3.0 * 64f64.powi(3) + 6.0 * 64.0 * 128.0 * 128.0)
            / 64.0;
        assert_eq!(delta_per_block, 17_563_648.0);
        let want = 6.0 * active_by_hand as f64
            + 6.0 * 7.0 * 32.0 * (192.0 + 128.0) * 1_048_576.0
            + 20.0 * delta_per_block;
        let got = m.spec.flops_per_token;
        assert!((got - want).abs() / want < 1e-12, "{got} vs {want}");
        // KDA blocks keep no KV cache.
        let cached: Vec<usize> = (0..27).filter(|&i| m.spec.kv_cache[i].is_some()).collect();
        assert_eq!(cached, [3, 7, 11, 15, 19, 23, 26]);
    }

    #[test]
    fn kda_blocks_declare_transformers_layout() {
        let m = DeepseekV3::create(Some("kimi_linear_debug"), serde_json::json!({})).unwrap();
        let find = |n: &str| m.spec.params.iter().find(|p| p.name == n);
        let conv = find("layers.0.attention.conv1d.weight").unwrap();
        assert_eq!(conv.shape, [768, 1, 4]);
        assert_eq!(
            conv.hf.as_ref().unwrap().sources,
            [
                "model.layers.0.self_attn.q_conv1d.weight",
                "model.layers.0.self_attn.k_conv1d.weight",
                "model.layers.0.self_attn.v_conv1d.weight"
            ]
        );
        assert!(find("layers.0.attention.wkv_a.weight").is_none());
        assert!(find("layers.3.attention.wkv_a.weight").is_some());
        let w1 = find("layers.1.feed_forward.experts.w1").unwrap();
        assert_eq!(
            w1.hf.as_ref().unwrap().sources[7],
            "model.layers.1.block_sparse_moe.experts.7.w1.weight"
        );
        assert_eq!(
            find("layers.0.feed_forward.w1.weight")
                .unwrap()
                .hf
                .as_ref()
                .unwrap()
                .sources,
            ["model.layers.0.block_sparse_moe.gate_proj.weight"]
        );
    }

    #[test]
    fn the_debug_model_has_a_dense_first_block_and_grouped_experts() {
        let m = DeepseekV3::create(None, serde_json::json!({})).unwrap();
        let find = |n: &str| m.spec.params.iter().find(|p| p.name == n);
        assert!(find("layers.0.feed_forward.w1.weight").is_some());
        let w1 = find("layers.1.feed_forward.experts.w1").unwrap();
        assert_eq!(w1.shape, [8, 128, 256]);
        let bias = find("layers.1.feed_forward.router.balance_bias").unwrap();
        assert!(!bias.trainable);
        assert_eq!(
            bias.hf.as_ref().unwrap().sources,
            ["model.layers.1.mlp.gate.e_score_correction_bias"]
        );
        assert!(m.spec.params.iter().all(|p| p.hf.is_some()));
        // The MTP module: one more (sparse) block where DeepSeek's checkpoints keep it.
        let eh = find("mtp.eh_proj.weight").unwrap();
        assert_eq!(eh.shape, [256, 512]);
        assert_eq!(
            eh.hf.as_ref().unwrap().sources,
            ["model.layers.4.eh_proj.weight"]
        );
        assert!(find("mtp.block.feed_forward.experts.w1").is_some());
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (
                serde_json::json!({"topk_group": 5}),
                "topk_group (5) must not exceed n_group (4)",
            ),
            (serde_json::json!({"top_k": 9}), "more experts per token"),
            (
                serde_json::json!({"qk_rope_head_dim": 15}),
                "qk_rope_head_dim",
            ),
        ] {
            let e = DeepseekV3::create(None, args.clone())
                .err()
                .expect("refused");
            assert!(e.msg.contains(key), "{args}: {e}");
        }
    }
}
