//! Shared by the plugin tests: builds the workspace's plugin crates once per test binary.
#![allow(dead_code)]

use anneal_runtime::plugins::{discover, LoadedPlugin};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Builds the plugin crates with the profile this test was built with; returns their folder.
pub fn plugin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test binary path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps layout")
            .to_path_buf();
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev".to_string(),
            Some(p) => p.to_string(),
        };
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--profile", &profile]);
        for p in [
            "anneal-plugin-adamw",
            "anneal-plugin-sgd",
            "anneal-plugin-llama",
            "anneal-testplugin-bad-api",
        ] {
            cmd.args(["-p", p]);
        }
        let status = cmd.current_dir(root).status().expect("run cargo");
        assert!(status.success(), "building the plugins failed");
        profile_dir
    })
}

/// The plugin called `name` from the freshly built ones.
pub fn plugin(name: &str) -> LoadedPlugin {
    discover(&[plugin_dir().to_path_buf()])
        .into_iter()
        .flatten()
        .find(|p| p.name() == name)
        .unwrap_or_else(|| panic!("plugin {name} not discovered"))
}

/// A fixture folder of this crate.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}
