//! Model ids (`org/name`, optionally `@revision`) resolved to directories of the local Hugging
//! Face cache, in the layout `huggingface_hub` writes: `$HF_HUB_CACHE` (else `$HF_HOME/hub`,
//! else `~/.cache/huggingface/hub`) holds `models--org--name/`, whose `refs/<branch>` names a
//! commit and `snapshots/<commit>/` holds its files. Nothing is downloaded: a model missing
//! from the cache is an error that says where it looked and how to fetch it.

use std::path::{Path, PathBuf};

/// Why a model id did not resolve.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// Neither a directory nor a model id in the cache.
    #[error("{spec} is not a directory, and not a model of the Hugging Face cache ({looked}); fetch it with `huggingface-cli download {id}` (or `hf download {id}`) where a network exists, or give the model's directory")]
    NotFound {
        /// What was asked for.
        spec: String,
        /// The id without its revision.
        id: String,
        /// Where the cache was looked up.
        looked: String,
    },
}

/// The directory `spec` names: itself when it exists (or does not look like a model id);
/// otherwise, for `org/name[@revision]`, the snapshot of the local Hugging Face cache that
/// `revision` (default `main`: a branch or tag in `refs/`, or a commit) names.
pub fn resolve(spec: &str) -> Result<PathBuf, HubError> {
    let path = Path::new(spec);
    if path.exists() || !is_model_id(spec) {
        return Ok(path.to_path_buf());
    }
    let (id, revision) = spec.split_once('@').unwrap_or((spec, "main"));
    let cache = cache_dir();
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let commit = std::fs::read_to_string(repo.join("refs").join(revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let snapshot = repo.join("snapshots").join(&commit);
    match snapshot.join("config.json").is_file() {
        true => Ok(snapshot),
        false => Err(HubError::NotFound {
            spec: spec.into(),
            id: id.into(),
            looked: format!("no {}", snapshot.join("config.json").display()),
        }),
    }
}

/// Whether `spec` reads as `org/name` or `org/name@revision` (names of letters, digits, `-`,
/// `_` and `.`), not as a path.
fn is_model_id(spec: &str) -> bool {
    let id = spec.split_once('@').map_or(spec, |(id, _)| id);
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!(id.split('/').collect::<Vec<_>>().as_slice(), [org, name] if part(org) && part(name))
}

/// The hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
fn cache_dir() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(hub) = var("HF_HUB_CACHE") {
        return PathBuf::from(hub);
    }
    let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        let user = var("HOME").map(PathBuf::from).unwrap_or_default();
        user.join(".cache/huggingface")
    });
    home.join("hub")
}

#[cfg(test)]
mod tests {
    use super::is_model_id;

    #[test]
    fn model_ids_are_org_slash_name_with_an_optional_revision() {
        for id in ["Qwen/Qwen3-0.6B", "acme/tiny@main", "a_b/c.d@0123abcd"] {
            assert!(is_model_id(id), "{id}");
        }
        for not in [
            "runs/a/hf",
            "./hf",
            "hf",
            "/abs/path",
            "../x/y",
            "a/",
            "a/b/c",
        ] {
            assert!(!is_model_id(not), "{not}");
        }
    }
}
