//! `anneal plugins ...`: what plugins the host can see, and which Hugging Face model types each
//! model plugin serves.

use anneal_plugin_api::abi::PluginKind;
use anneal_runtime::plugins::{discover, search_paths};

/// Prints every plugin found in the search path (and every plugin file that failed to load,
/// with the reason). Fails when a plugin file is broken, so scripts notice.
pub fn list() -> anyhow::Result<()> {
    let dirs = search_paths();
    let found = discover(&dirs);
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(["NAME", "KIND", "API", "FLAVORS", "MODEL TYPES", "FILE"]);
    let mut broken = 0;
    for entry in &found {
        match entry {
            Ok(p) => {
                let kind = match p.kind() {
                    PluginKind::Model => "model",
                    PluginKind::Optimizer => "optimizer",
                };
                let flavors: Vec<String> = p.info.flavors.iter().map(|f| f.to_string()).collect();
                let types: Vec<&str> = p.model_types().collect();
                table.add_row([
                    p.name().to_string(),
                    kind.to_string(),
                    p.info.api_version.to_string(),
                    flavors.join(","),
                    if types.is_empty() {
                        "-".into()
                    } else {
                        types.join(",")
                    },
                    p.path.display().to_string(),
                ]);
            }
            Err(e) => {
                broken += 1;
                eprintln!("error: {e}");
            }
        }
    }
    // Columns two spaces apart, the first at the margin (as `ps` or `cargo tree` print).
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    println!("{}", table.trim_fmt());
    if found.is_empty() {
        println!(
            "(no plugins found; searched {}; build them with `cargo build --release --workspace` or set ANNEAL_PLUGIN_PATH)",
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    if broken > 0 {
        anyhow::bail!("{broken} plugin file(s) could not be loaded");
    }
    Ok(())
}

/// `anneal plugins show NAME [--flavor F]`: what a model flavor costs before anything is
/// allocated: parameters (all, and those one token goes through for a mixture of experts),
/// buffers, FLOPs per token and the KV cache per token.
pub fn show(name: &str, flavor: Option<&str>) -> anyhow::Result<()> {
    use anneal_runtime::plugins::{find, PluginModel};
    let loaded = find(name).map_err(|e| crate::errors::UserError(e.to_string()))?;
    if loaded.kind() != PluginKind::Model {
        crate::user_bail!("{name} is an optimizer plugin; `plugins show` describes models");
    }
    let inst = loaded
        .create(flavor, &serde_json::json!({}))
        .map_err(|e| crate::errors::UserError(e.to_string()))?;
    let model = PluginModel::new(loaded.name(), inst)?;
    let spec = model.spec();
    let count = |trainable: bool| -> usize {
        spec.params
            .iter()
            .filter(|p| p.trainable == trainable)
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    };
    let (trained, buffers) = (count(true), count(false));
    let billions = |n: usize| format!("{:.2}B ({n})", n as f64 / 1e9);
    println!("{} / {}", loaded.name(), flavor.unwrap_or("default flavor"));
    println!("parameters        {}", billions(trained));
    if let Some(active) = spec.active_params {
        println!("active per token  {}", billions(active));
    }
    if buffers > 0 {
        println!("buffers           {buffers} (not trained)");
    }
    println!(
        "layers {}, vocab {}, context {}",
        spec.n_layers, spec.vocab_size, spec.max_seq_len
    );
    println!(
        "training FLOPs    {:.3e} per token at the full context",
        spec.flops_per_token
    );
    let cache: usize = spec
        .kv_cache
        .iter()
        .flatten()
        .map(|(heads, dim)| 2 * heads * dim)
        .sum();
    println!(
        "KV cache          {cache} values per token ({} bytes in bf16)",
        2 * cache
    );
    Ok(())
}
