//! Job configs: the files under `configs/` (and nothing outside it), resolving TOML text with
//! overrides into the full config the trainer would run (or the problems by key path), and the
//! kind of job a config describes (training or RL).

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
/// config (defaults < text < `ANNEAL_*` environment < overrides, as `anneal train` resolves it).
pub fn resolve(
    text: &str,
    name: &str,
    overrides: &[String],
) -> Result<anneal_config::JobConfig, Problem> {
    anneal_config::resolve(anneal_config::Source::Text { text, name }, overrides).map_err(|e| {
        Problem {
            key_path: e.key_path.clone(),
            message: e.to_string(),
        }
    })
}

/// How many processes a run's device mesh asks for: the product of its `[parallelism]`
/// degrees, a `-1` degree (the rest of the world size) counting 1 (`ep` borrows ranks from
/// `dp_shard` and adds none). Above 1 the server starts the run through
/// `anneal train --nproc N` (MPI).
pub fn processes(cfg: &anneal_config::JobConfig) -> usize {
    let p = &cfg.parallelism;
    [p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp]
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(1).max(1))
        .product()
}

/// What a run's process runs: `anneal train`, or `anneal rl` for a post-training job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// `anneal train`.
    Train,
    /// `anneal rl`.
    Rl,
}

impl Kind {
    /// The subcommand (and the registry's `kind` column).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Train => "train",
            Kind::Rl => "rl",
        }
    }

    /// The kind recorded in the registry; anything but `rl` trains.
    pub fn parse(s: &str) -> Kind {
        if s == "rl" {
            Kind::Rl
        } else {
            Kind::Train
        }
    }

    /// The kind a config asks for: `rl` when its text has an `[rl]` table or an override sets an
    /// `rl.` key (`anneal train` ignores that section, so a config that has one is an RL job).
    pub fn of(text: &str, overrides: &[String]) -> Kind {
        let in_text = text
            .parse::<toml::Table>()
            .is_ok_and(|t| t.get("rl").is_some_and(toml::Value::is_table));
        let in_overrides = overrides
            .iter()
            .any(|o| o.trim_start().starts_with("rl.") || o.trim_start().starts_with("rl ="));
        if in_text || in_overrides {
            Kind::Rl
        } else {
            Kind::Train
        }
    }
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
    fn the_kind_follows_the_rl_section_or_rl_overrides() {
        let train = "[training]\nsteps = 3\n";
        assert_eq!(Kind::of(train, &[]), Kind::Train);
        assert_eq!(Kind::of("[rl]\ngroup_size = 4\n", &[]), Kind::Rl);
        assert_eq!(Kind::of("rl.group_size = 4\n", &[]), Kind::Rl);
        assert_eq!(Kind::of(train, &["rl.init_from=\"x\"".into()]), Kind::Rl);
        assert_eq!(Kind::of(train, &["training.rl=1".into()]), Kind::Train);
        // A comment or a string that mentions [rl] is not a section.
        assert_eq!(Kind::of("# [rl]\nname = \"[rl]\"\n", &[]), Kind::Train);
        assert_eq!(Kind::parse("rl"), Kind::Rl);
        assert_eq!(Kind::parse("train"), Kind::Train);
    }

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
