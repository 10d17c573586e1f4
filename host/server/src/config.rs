//! Job configs: the files of the configs folder (`anneal serve --configs DIR`, default
//! `configs/`; nothing outside it), resolving TOML text with overrides into the full config the
//! trainer would run (or the problems by key path), and the kind of job a config describes
//! (training or RL).

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
    /// The path runs are created with: the folder as [`ConfigsDir::shown`] names it, then the
    /// name (`configs/llama3_debug.toml`).
    pub path: String,
}

/// The configs folder, and how the API names it.
#[derive(Clone, Debug)]
pub struct ConfigsDir {
    /// The folder.
    pub dir: PathBuf,
    /// The folder in the paths the API lists: its path from the runs' working directory when
    /// it lies inside it (`configs`, `my/configs`), else its own name (`cfgs` for
    /// `--configs /data/cfgs`).
    pub shown: String,
    /// Whether the folder lies inside the working directory.
    inside: bool,
}

impl ConfigsDir {
    /// `dir` as seen from the runs' working directory `work_dir`.
    pub fn new(dir: &Path, work_dir: &Path) -> ConfigsDir {
        let inside = dir
            .strip_prefix(work_dir)
            .ok()
            .filter(|rel| !rel.as_os_str().is_empty());
        let shown = match inside {
            Some(rel) => rel.to_string_lossy().into_owned(),
            None => dir
                .file_name()
                .map_or_else(|| "configs".into(), |n| n.to_string_lossy().into_owned()),
        };
        ConfigsDir {
            dir: dir.to_path_buf(),
            shown: shown.trim_end_matches('/').to_string(),
            inside: inside.is_some(),
        }
    }

    /// The API's path of the file `name` in the folder (`configs/tiny.toml`).
    pub fn path_of(&self, name: &str) -> String {
        format!("{}/{name}", self.shown)
    }

    /// The folder as messages name it: `configs/` inside the working directory, else the
    /// whole path, so the user sees which folder is meant.
    pub fn display(&self) -> String {
        match self.inside {
            true => format!("{}/", self.shown),
            false => format!("{}/", self.dir.display()),
        }
    }

    /// The file name a request means: `<name>`, the listed `<shown>/<name>`, or the file's
    /// whole path `<dir>/<name>`.
    fn name_in<'a>(&self, requested: &'a str) -> &'a str {
        let listed = format!("{}/", self.shown);
        let whole = format!("{}/", self.dir.display());
        requested
            .strip_prefix(&listed)
            .or_else(|| requested.strip_prefix(&whole))
            .unwrap_or(requested)
    }
}

/// The `*.toml` files directly in the folder, by name (symlinks only when [`locate`] finds
/// them).
pub fn list(configs: &ConfigsDir) -> Vec<ConfigFile> {
    let Ok(entries) = std::fs::read_dir(&configs.dir) else {
        return Vec::new();
    };
    let mut out: Vec<ConfigFile> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| locate(configs, n).is_some())
        .map(|name| ConfigFile {
            path: configs.path_of(&name),
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

/// Finds a config by its path as [`list`] gives it (`configs/<name>`, see [`ConfigsDir`]), by
/// its whole path or by its bare `<name>`: only a plain name directly in the folder, so
/// no path can reach outside it, and a symlink only when its target is a file inside the
/// folder too (a link to `~/.ssh/config.toml` must not be readable through the API). Returns
/// the canonical path and the resolved file, which is what must be read.
pub fn locate(configs: &ConfigsDir, requested: &str) -> Option<(String, PathBuf)> {
    let name = configs.name_in(requested);
    if !is_config_name(name) {
        return None;
    }
    let root = configs.dir.canonicalize().ok()?;
    let file = root.join(name).canonicalize().ok()?;
    (file.starts_with(&root) && file.is_file()).then(|| (configs.path_of(name), file))
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

    /// The folder as `anneal serve` run from its parent sees it (`configs`).
    fn configs(dir: &Path) -> ConfigsDir {
        ConfigsDir::new(dir, dir.parent().expect("a parent"))
    }

    #[test]
    fn only_plain_names_inside_the_folder_are_found() {
        let base = std::env::temp_dir().join(format!("anneal-configs-{}", std::process::id()));
        let dir = base.join("configs");
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::write(dir.join("a.toml"), "x = 1").expect("write");
        std::fs::write(dir.join("sub/b.toml"), "x = 1").expect("write");
        let dir = &configs(&dir);
        assert!(locate(dir, "configs/a.toml").is_some());
        assert!(locate(dir, "a.toml").is_some());
        for bad in [
            "../a.toml",
            "sub/b.toml",
            "configs/../a.toml",
            "/etc/passwd",
            "a.txt",
        ] {
            assert!(locate(dir, bad).is_none(), "{bad}");
        }
        let names: Vec<String> = list(dir).into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["a.toml"]);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn another_folder_is_named_as_it_is() {
        let base = std::env::temp_dir().join(format!("anneal-cfgdir-{}", std::process::id()));
        let dir = base.join("my/cfgs");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("a.toml"), "x = 1").expect("write");
        let whole = format!("{}/a.toml", dir.display());
        // Inside the working directory: the path from it.
        let inside = ConfigsDir::new(&dir, &base);
        assert_eq!(list(&inside)[0].path, "my/cfgs/a.toml");
        for asked in ["my/cfgs/a.toml", "a.toml", whole.as_str()] {
            assert_eq!(locate(&inside, asked).expect("found").0, "my/cfgs/a.toml");
        }
        assert!(locate(&inside, "configs/a.toml").is_none());
        assert_eq!(inside.display(), "my/cfgs/");
        // Elsewhere: its own name, and the whole path in messages.
        let outside = ConfigsDir::new(&dir, Path::new("/nonexistent-work-dir"));
        assert_eq!(list(&outside)[0].path, "cfgs/a.toml");
        for asked in ["cfgs/a.toml", "a.toml", whole.as_str()] {
            assert_eq!(locate(&outside, asked).expect("found").0, "cfgs/a.toml");
        }
        assert_eq!(outside.display(), format!("{}/", dir.display()));
        let _ = std::fs::remove_dir_all(&base);
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
        let configs = configs(&dir);
        let (path, file) = locate(&configs, "configs/alias.toml").expect("an inside link");
        assert_eq!(path, "configs/alias.toml");
        assert_eq!(std::fs::read_to_string(file).expect("read"), "x = 1");
        for bad in ["up.toml", "abs.toml", "dangling.toml"] {
            assert!(locate(&configs, bad).is_none(), "{bad}");
        }
        let names: Vec<String> = list(&configs).into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["a.toml", "alias.toml"]);
        let _ = std::fs::remove_dir_all(&base);
    }
}
