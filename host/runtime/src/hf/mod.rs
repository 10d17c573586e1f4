//! Hugging Face model directories: `config.json` plus `model.safetensors` or a sharded
//! `model.safetensors.index.json`, mapped onto a plugin's parameters through the Hugging Face
//! mapping each parameter declares (renames, per-expert stacks, fused parts, transposes:
//! `transform.rs`).

pub mod hub;
mod transform;

use crate::plugins::{find, find_for_model_type, LoadedPlugin, PluginModel};
use anneal_engine::io::{save_safetensors, SafetensorsFile};
use anneal_engine::{DType, Tensor};
use anneal_plugin_api::spec::ModelSpec;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a Hugging Face directory could not be read, matched or written.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// A file could not be read or written.
    #[error("{path}: {msg}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A safetensors file could not be read (the message names it).
    #[error("{0}")]
    Tensors(String),
    /// The model has no Hugging Face adapter.
    #[error("model '{0}' declares no Hugging Face adapter")]
    NoAdapter(String),
    /// A weight the model needs is not in the directory.
    #[error("{dir}: missing tensor '{hf}' (for parameter '{ours}')")]
    Missing {
        /// The directory.
        dir: PathBuf,
        /// The Hugging Face name.
        hf: String,
        /// Our parameter name.
        ours: String,
    },
    /// The model plugin could not be found or refused the directory's config.
    #[error("{dir}: {msg}")]
    Plugin {
        /// The directory.
        dir: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A weight has another shape than the model expects.
    #[error("{dir}: tensor '{hf}' has shape {got:?}, parameter '{ours}' needs {want:?}")]
    Shape {
        /// The directory.
        dir: PathBuf,
        /// The Hugging Face name.
        hf: String,
        /// Our parameter name.
        ours: String,
        /// Shape in the file.
        got: Vec<usize>,
        /// Shape the spec declares.
        want: Vec<usize>,
    },
}

fn io(path: &Path, e: impl std::fmt::Display) -> HfError {
    HfError::Io {
        path: path.to_path_buf(),
        msg: e.to_string(),
    }
}

/// The parsed `config.json` of a directory.
pub fn read_config(dir: &Path) -> Result<serde_json::Value, HfError> {
    let p = dir.join("config.json");
    if !dir.is_dir() || !p.is_file() {
        let what = if dir.is_dir() {
            "no config.json there"
        } else {
            "no such directory"
        };
        return Err(io(
            dir,
            format!("{what} (a Hugging Face model directory holds config.json and *.safetensors)"),
        ));
    }
    let text = std::fs::read_to_string(&p).map_err(|e| io(&p, e))?;
    serde_json::from_str(&text).map_err(|e| io(&p, format!("not valid JSON: {e}")))
}

/// The `model_type` of a directory's parsed `config.json`.
pub fn model_type<'a>(dir: &Path, cfg: &'a serde_json::Value) -> Result<&'a str, HfError> {
    cfg.get("model_type")
        .and_then(|t| t.as_str())
        .ok_or_else(|| HfError::Plugin {
            dir: dir.to_path_buf(),
            msg: "config.json has no string 'model_type' to choose a model plugin by; name one"
                .into(),
        })
}

/// The model plugin for a directory: the one called `plugin` when given (an override), else
/// the one that declares the `model_type` of its `config.json`.
pub fn plugin_for(
    dir: &Path,
    cfg: &serde_json::Value,
    plugin: Option<&str>,
) -> Result<LoadedPlugin, HfError> {
    let fail = |e: &dyn std::fmt::Display| HfError::Plugin {
        dir: dir.to_path_buf(),
        msg: e.to_string(),
    };
    let loaded = match plugin {
        Some(name) => find(name).map_err(|e| fail(&e))?,
        None => find_for_model_type(model_type(dir, cfg)?).map_err(|e| fail(&e))?,
    };
    if loaded.kind() != anneal_plugin_api::abi::PluginKind::Model {
        return Err(fail(&format!(
            "{} is an optimizer plugin, not a model",
            loaded.name()
        )));
    }
    Ok(loaded)
}

/// Builds the model `config.json` in `dir` describes, with the model plugin called `plugin` or
/// (when `None`) the one serving its `model_type`, and fills in its weights.
pub fn load_model(
    dir: &Path,
    plugin: Option<&str>,
) -> Result<(PluginModel, HashMap<String, Tensor>), HfError> {
    let model = model_for(dir, plugin)?;
    let params = load_params(dir, model.spec())?;
    Ok((model, params))
}

/// The model `config.json` in `dir` describes, without its weights (see [`load_model`]).
pub fn model_for(dir: &Path, plugin: Option<&str>) -> Result<PluginModel, HfError> {
    let cfg = read_config(dir)?;
    let loaded = plugin_for(dir, &cfg, plugin)?;
    let fail = |e: &dyn std::fmt::Display| HfError::Plugin {
        dir: dir.to_path_buf(),
        msg: e.to_string(),
    };
    let inst = loaded
        .create(None, &serde_json::json!({ "hf_config": cfg }))
        .map_err(|e| fail(&e))?;
    PluginModel::new(loaded.name(), inst).map_err(|e| fail(&e))
}

/// The safetensors files of a Hugging Face directory (`model.safetensors`, or the shards a
/// `model.safetensors.index.json` names), read one tensor at a time.
pub struct HfTensors {
    files: Vec<SafetensorsFile>,
    /// Which file holds each tensor.
    by_name: HashMap<String, usize>,
}

impl HfTensors {
    /// Reads the headers of the directory's safetensors files.
    pub fn open(dir: &Path) -> Result<HfTensors, HfError> {
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| io(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| io(&index, "no weight_map"))?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|f| dir.join(f)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut by_name = HashMap::new();
        for f in paths {
            if !f.is_file() {
                return Err(io(&f, "no such file"));
            }
            // The engine's message already names the file.
            let file = SafetensorsFile::open(&f).map_err(|e| HfError::Tensors(e.to_string()))?;
            for name in file.names() {
                by_name.insert(name, files.len());
            }
            files.push(file);
        }
        Ok(HfTensors { files, by_name })
    }

    /// Every tensor's name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// The tensor called `name`, read from its file, or `None` when no file holds it.
    pub fn read(&self, name: &str) -> Result<Option<Tensor>, HfError> {
        match self.by_name.get(name) {
            None => Ok(None),
            Some(&i) => self.files[i]
                .read(name)
                .map_err(|e| HfError::Tensors(e.to_string())),
        }
    }
}

/// Every tensor in the directory's safetensors files, by Hugging Face name.
pub fn read_tensors(dir: &Path) -> Result<HashMap<String, Tensor>, HfError> {
    let files = HfTensors::open(dir)?;
    let mut out = HashMap::new();
    for name in files.names() {
        if let Some(t) = files.read(name)? {
            out.insert(name.to_string(), t);
        }
    }
    Ok(out)
}

/// Loads `dir`'s weights for `spec` (see [`params_from_tensors`] for the mapping).
pub fn load_params(dir: &Path, spec: &ModelSpec) -> Result<HashMap<String, Tensor>, HfError> {
    load_params_with(dir, spec, &mut |_, t| Ok(t))
}

/// Loads `dir`'s weights for `spec`, each parameter passed through `keep` (given its name and
/// its whole tensor) as soon as it is read: a rank that keeps a slice of each (tensor
/// parallelism) holds at most one whole parameter at a time, never the whole model.
pub fn load_params_with(
    dir: &Path,
    spec: &ModelSpec,
    keep: &mut dyn FnMut(&str, Tensor) -> Result<Tensor, String>,
) -> Result<HashMap<String, Tensor>, HfError> {
    if spec.hf.is_none() {
        return Err(HfError::NoAdapter(spec.architecture.clone()));
    }
    let files = HfTensors::open(dir)?;
    params_from(dir, spec, &|hf| files.read(hf), keep)
}

/// The model's parameters from Hugging Face tensors by name (read from `dir`, which errors
/// name), each through its declared mapping (experts stacked, fused tensors split, transposes),
/// in the dtypes the spec declares.
pub fn params_from_tensors(
    dir: &Path,
    tensors: &HashMap<String, Tensor>,
    spec: &ModelSpec,
) -> Result<HashMap<String, Tensor>, HfError> {
    params_from(
        dir,
        spec,
        &|hf| Ok(tensors.get(hf).cloned()),
        &mut |_, t| Ok(t),
    )
}

/// [`params_from_tensors`] over any source of Hugging Face tensors (`get`), each parameter
/// handed to `keep` once built.
fn params_from(
    dir: &Path,
    spec: &ModelSpec,
    get: &dyn Fn(&str) -> Result<Option<Tensor>, HfError>,
    keep: &mut dyn FnMut(&str, Tensor) -> Result<Tensor, String>,
) -> Result<HashMap<String, Tensor>, HfError> {
    let mut params = HashMap::new();
    for p in &spec.params {
        let map = transform::map_of(p);
        let want = map.source_shape(&p.shape).map_err(|msg| HfError::Plugin {
            dir: dir.to_path_buf(),
            msg: format!("parameter '{}': Hugging Face mapping: {msg}", p.name),
        })?;
        let sources = map
            .sources
            .iter()
            .map(|hf| {
                let t = get(hf)?.ok_or_else(|| HfError::Missing {
                    dir: dir.to_path_buf(),
                    hf: hf.clone(),
                    ours: p.name.clone(),
                })?;
                if t.shape() != want.as_slice() {
                    return Err(HfError::Shape {
                        dir: dir.to_path_buf(),
                        hf: hf.clone(),
                        ours: p.name.clone(),
                        got: t.shape().to_vec(),
                        want: want.clone(),
                    });
                }
                Ok(t)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let t = transform::import(&map, &sources).map_err(|msg| HfError::Plugin {
            dir: dir.to_path_buf(),
            msg: format!("parameter '{}': {msg}", p.name),
        })?;
        let dtype = DType::parse(&p.dtype).unwrap_or(DType::F32);
        let t = t.to_dtype(dtype).map_err(|e| io(dir, e))?;
        let t = keep(&p.name, t).map_err(|msg| HfError::Plugin {
            dir: dir.to_path_buf(),
            msg: format!("parameter '{}': {msg}", p.name),
        })?;
        params.insert(p.name.clone(), t);
    }
    Ok(params)
}

/// The files [`export`] writes into its directory (`tokenizer.json` only when given one).
pub const EXPORT_FILES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

/// Writes `config.json` and `model.safetensors` in the Hugging Face layout (and copies
/// `tokenizer` in as `tokenizer.json` when given).
pub fn export(
    dir: &Path,
    spec: &ModelSpec,
    params: &HashMap<String, Tensor>,
    tokenizer: Option<&Path>,
) -> Result<(), HfError> {
    let adapter = spec
        .hf
        .as_ref()
        .ok_or_else(|| HfError::NoAdapter(spec.architecture.clone()))?;
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let cfg = dir.join("config.json");
    let text = serde_json::to_string_pretty(&adapter.config).map_err(|e| io(&cfg, e))?;
    std::fs::write(&cfg, text).map_err(|e| io(&cfg, e))?;
    let st = dir.join("model.safetensors");
    let by_hf = transform::export(&spec.params, params).map_err(|e| io(&st, e))?;
    let list: Vec<(&str, &Tensor)> = by_hf.iter().map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(&st, &list).map_err(|e| io(&st, e))?;
    if let Some(tok) = tokenizer {
        let dst = dir.join("tokenizer.json");
        std::fs::copy(tok, &dst).map_err(|e| io(&dst, e))?;
    }
    Ok(())
}
