//! `anneal plugins ...`: what plugins the host can see, and which Hugging Face model types each
//! model plugin serves.

use anneal_plugin_api::abi::PluginKind;
use anneal_runtime::plugins::{discover, search_paths};

/// Prints every plugin found in the search path (and every plugin file that failed to load,
/// with the reason). Fails when a plugin file is broken, so scripts notice.
pub fn list() -> anyhow::Result<()> {
    let dirs = search_paths();
    let found = discover(&dirs);
    println!(
        "{:<12} {:<10} {:<4} {:<28} {:<20} FILE",
        "NAME", "KIND", "API", "FLAVORS", "MODEL TYPES"
    );
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
                println!(
                    "{:<12} {:<10} {:<4} {:<28} {:<20} {}",
                    p.name(),
                    kind,
                    p.info.api_version,
                    flavors.join(","),
                    if types.is_empty() {
                        "-".into()
                    } else {
                        types.join(",")
                    },
                    p.path.display()
                );
            }
            Err(e) => {
                broken += 1;
                eprintln!("error: {e}");
            }
        }
    }
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
