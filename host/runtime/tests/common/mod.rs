//! Shared by the plugin tests: builds the workspace's plugin crates once per test binary.
#![allow(dead_code)]

use anneal_runtime::plugins::{discover, LoadedPlugin};
use std::path::{Path, PathBuf};

/// The folder of the freshly built plugin crates (the test's `target/<profile>/`).
pub fn plugin_dir() -> &'static Path {
    anneal_tests::cli::built_dir()
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
