//! Shared by the CLI tests: the repository root and the `anneal` binary with its plugins.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The anneal binary, with the model and optimizer plugins built next to it (same profile).
pub fn anneal() -> Command {
    static BUILT: OnceLock<()> = OnceLock::new();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_anneal"));
    BUILT.get_or_init(|| {
        let profile = match bin
            .parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
        {
            Some("debug") | None => "dev".to_string(),
            Some(p) => p.to_string(),
        };
        let ok = Command::new(env!("CARGO"))
            .args(["build", "--profile", &profile])
            .args([
                "-p",
                "anneal-plugin-llama",
                "-p",
                "anneal-plugin-adamw",
                "-p",
                "anneal-plugin-sgd",
            ])
            .current_dir(root())
            .status()
            .expect("run cargo")
            .success();
        assert!(ok, "building the plugins failed");
    });
    let mut c = Command::new(bin);
    c.env_remove("ANNEAL_PLUGIN_PATH");
    c
}
