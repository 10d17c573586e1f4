//! Job configs: the files under `configs/` (and nothing outside it), and resolving TOML text with
//! overrides into the full config the trainer would run, or the problems by key path.

use serde::Serialize;
use std::path::{Path, PathBuf};

/// One problem with a config: the key path it is about (when known) and one line.
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    /// `training.steps`, or `null` for problems of the whole file (TOML syntax).
    pub key_path: Option<String>,
    /// One line.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Resolves `text` (named `name` in messages) with `key.path=value` overrides into the full
/// config as TOML (defaults < text < `ANNEAL_*` environment < overrides, as `anneal train`
/// resolves it).
pub fn resolve(text: &str, name: &str, overrides: &[String]) -> Result<String, Problem> {
    anneal_config::resolve(anneal_config::Source::Text { text, name }, overrides)
        .map(|config| config.to_toml())
        .map_err(|e| Problem {
            key_path: e.key_path.clone(),
            message: e.to_string(),
        })
}

/// A config file offered by the server.
#[derive(Debug, Serialize)]
pub struct ConfigFile {
    /// The file name (`llama3_debug.toml`).
    pub name: String,
    /// The path runs are created with (`configs/llama3_debug.toml`).
    pub path: String,
}

/// The `*.toml` files directly in `dir`, by name (symlinks only when [`locate`] finds them).
pub fn list(dir: &Path) -> Vec<ConfigFile> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<ConfigFile> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| locate(dir, n).is_some())
        .map(|name| ConfigFile {
            path: format!("configs/{name}"),
            name,
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn is_config_name(name: &str) -> bool {
    name.ends_with(".toml")
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// Finds a config by `configs/<name>` or `<name>`: only a plain name directly in `dir`, so no
/// path can reach outside it, and a symlink only when its target is a file inside `dir` too (a
/// link to `~/.ssh/config.toml` must not be readable through the API). Returns the canonical
/// `configs/<name>` and the resolved file, which is what must be read.
pub fn locate(dir: &Path, requested: &str) -> Option<(String, PathBuf)> {
    let name = requested.strip_prefix("configs/").unwrap_or(requested);
    if !is_config_name(name) {
        return None;
    }
    let root = dir.canonicalize().ok()?;
    let file = root.join(name).canonicalize().ok()?;
    (file.starts_with(&root) && file.is_file()).then(|| (format!("configs/{name}"), file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_inside_the_folder_are_found() {
        let dir = std::env::temp_dir().join(format!("anneal-configs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::write(dir.join("a.toml"), "x = 1").expect("write");
        std::fs::write(dir.join("sub/b.toml"), "x = 1").expect("write");
        assert!(locate(&dir, "configs/a.toml").is_some());
        assert!(locate(&dir, "a.toml").is_some());
        for bad in [
            "../a.toml",
            "sub/b.toml",
            "configs/../a.toml",
            "/etc/passwd",
            "a.txt",
        ] {
            assert!(locate(&dir, bad).is_none(), "{bad}");
        }
        let names: Vec<String> = list(&dir).into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["a.toml"]);
    }

    #[test]
    fn symlinks_are_followed_only_inside_the_folder() {
        let base = std::env::temp_dir().join(format!("anneal-links-{}", std::process::id()));
        let dir = base.join("configs");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("a.toml"), "x = 1").expect("write");
        std::fs::write(base.join("secret.toml"), "x = 2").expect("write");
        let link = |target: &Path, name: &str| {
            let _ = std::fs::remove_file(dir.join(name));
            std::os::unix::fs::symlink(target, dir.join(name)).expect("symlink");
        };
        link(Path::new("a.toml"), "alias.toml");
        link(Path::new("../secret.toml"), "up.toml");
        link(&base.join("secret.toml"), "abs.toml");
        link(Path::new("missing.toml"), "dangling.toml");
        let (path, file) = locate(&dir, "configs/alias.toml").expect("an inside link");
        assert_eq!(path, "configs/alias.toml");
        assert_eq!(std::fs::read_to_string(file).expect("read"), "x = 1");
        for bad in ["up.toml", "abs.toml", "dangling.toml"] {
            assert!(locate(&dir, bad).is_none(), "{bad}");
        }
        let names: Vec<String> = list(&dir).into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["a.toml", "alias.toml"]);
        let _ = std::fs::remove_dir_all(&base);
    }
}
