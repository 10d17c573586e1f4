//! The Muse plugin: Muse Glimmer's and Muse Spark Open's decoders on the SDK's model kit
//! (`config.rs` declares the arguments with their `config.json` keys, `spec.rs` the parameters,
//! `model.rs` only what differs from the kit's baseline decoder), the vision tower
//! (`vision.rs`) and Spark's raw-waveform audio tower (`audio.rs`).

pub mod audio;
pub mod config;
pub mod hf;
pub mod model;
pub mod spec;
pub mod vision;

pub use config::MuseArgs;
pub use model::Muse;

anneal_plugin_api::model_factory!(Muse, crate::config);

anneal_plugin_api::export_plugin!(model Muse, name = "muse", model_types = ["muse_glimmer", "muse_glimmer_text", "muse_spark", "muse_spark_text"], description = "Muse Glimmer and Muse Spark Open decoders (scaleless QK-norm with a query multiplier, sigmoid output gate, sandwich norms, NoPE full attention every 4th block and RoPE sliding-window attention elsewhere, soft-capped logits; Spark: gated residuals, latent mixtures of experts; the vision tower: windowed attention, learned 2-D positions resampled, 2-D RoPE, merge, adapter, projection; Spark's audio tower: strided patch embeddings and causal depthwise convolutions over the waveform)");

#[cfg(test)]
mod tests {
    use super::*;
    use anneal_plugin_api::sdk::Factory;
    use serde_json::json;

    fn count(flavor: &str, vision: bool) -> usize {
        let m = Muse::create(Some(flavor), json!({})).unwrap();
        spec::params(&m.args)
            .iter()
            // transformers counts parameters, not buffers (Spark's routing biases).
            .filter(|p| p.trainable && (vision || !p.name.starts_with("vision.")))
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    #[test]
    fn released_size_counts_as_transformers_does() {
        // transformers' `MuseGlimmerForConditionalGeneration(MuseGlimmerConfig())`, counted on
        // the meta device.
        assert_eq!(count("muse_glimmer_30b", true), MUSE_GLIMMER_30B);
        // `MuseSparkForConditionalGeneration(MuseSparkConfig())`: towers included.
        assert_eq!(count("muse_spark_open", true), 822_036_513_792);
        assert!(count("debugmodel_spark", false) > 0);
        assert!(count("debugmodel", false) > 0);
    }

    /// Parameters of the released Muse Glimmer (tower included).
    const MUSE_GLIMMER_30B: usize = 29_776_626_688;

    #[test]
    fn layers_follow_transformers_pattern() {
        let m = Muse::create(Some("muse_glimmer_30b"), json!({})).unwrap();
        let a = &m.args;
        // Every 4th block counted back from the last (51, 47, ..., 3) is NoPE with full attention.
        for i in 0..a.n_layers {
            let nope = (a.n_layers - 1 - i) % 4 == 0;
            assert_eq!(a.has_rope(i), !nope, "{i}");
            assert_eq!(a.window_of(i).is_none(), nope, "{i}");
        }
    }

    #[test]
    fn bad_args_are_refused_by_name() {
        for (args, key) in [
            (json!({"n_kv_heads": 3}), "n_kv_heads"),
            (
                json!({"layer_types": ["full_attention"]}),
                "layer_types lists 1",
            ),
            (json!({"logit_softcap": 0.0}), "logit_softcap"),
            (json!({"dimm": 3}), "dimm"),
        ] {
            let e = Muse::create(None, args.clone()).err().expect("refused");
            assert!(e.msg.contains(key), "{args}: {e}");
        }
    }
}
