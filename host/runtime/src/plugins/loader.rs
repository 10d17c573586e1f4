//! Finding plugin libraries and loading them with every check done before any plugin code runs.

use abi_stable::library::{lib_header_from_path, LibraryError, RootModule};
use abi_stable::std_types::{ROption, RStr};
use anneal_plugin_api::abi::{PluginInfo, PluginInstance, PluginKind, PluginModRef};
use anneal_plugin_api::API_VERSION;
use std::path::{Path, PathBuf};

/// Why a plugin could not be found, loaded or instantiated.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// No library in the search path provides the plugin.
    #[error("no plugin named '{name}' in {searched} (found: {available})")]
    NotFound {
        /// The plugin asked for.
        name: String,
        /// The folders searched, joined.
        searched: String,
        /// The plugin names the files there are named after, joined.
        available: String,
    },
    /// The library file is named after another plugin than the one it declares.
    #[error("{path}: declares plugin '{name}', which its file name does not match; rename the file to {}", plugin_file_name(name))]
    Named {
        /// The file.
        path: PathBuf,
        /// The name the library declares.
        name: String,
    },
    /// The file could not be opened as a shared library.
    #[error("{path}: cannot open as a shared library: {msg}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's message.
        msg: String,
    },
    /// The library has no Anneal root module.
    #[error("{path}: not an Anneal plugin (it exports no plugin root module)")]
    NotAPlugin {
        /// The file.
        path: PathBuf,
    },
    /// Built against another release of the plugin interface crate.
    #[error(
        "{path}: built against plugin API crate {plugin}, this host has {host}; rebuild the plugin"
    )]
    CrateVersion {
        /// The file.
        path: PathBuf,
        /// The plugin's interface crate version.
        plugin: String,
        /// The host's.
        host: String,
    },
    /// The interface types differ in layout (the full report is kept in `detail`).
    #[error("{path}: its plugin interface does not match this host's ({summary}); rebuild the plugin against this host's plugin-api")]
    Layout {
        /// The file.
        path: PathBuf,
        /// The first line of the layout report.
        summary: String,
        /// The whole layout report (hundreds of lines).
        detail: String,
    },
    /// Built for another API version.
    #[error("{path}: plugin '{name}' was built for plugin API version {plugin}, this host supports version {host}")]
    ApiVersion {
        /// The file.
        path: PathBuf,
        /// The plugin's name.
        name: String,
        /// The plugin's API version.
        plugin: u32,
        /// The host's.
        host: u32,
    },
    /// No model plugin in the search path declares a Hugging Face `model_type`.
    #[error("no model plugin serves Hugging Face model_type '{model_type}' (served: {served})")]
    NoModelType {
        /// The `model_type` of the directory.
        model_type: String,
        /// `plugin (type, type)` for each model plugin found, joined.
        served: String,
    },
    /// The plugin refused its arguments or failed to build.
    #[error("plugin '{name}': {msg}")]
    Create {
        /// The plugin's name.
        name: String,
        /// Its message.
        msg: String,
    },
    /// The plugin failed by itself (a panic, a broken invariant): a bug in the plugin, not the
    /// user's input.
    #[error("plugin '{name}' failed (a bug in the plugin, not in your input): {msg}")]
    Failed {
        /// The plugin's name.
        name: String,
        /// Its message.
        msg: String,
    },
}

impl PluginError {
    /// The error `plugin` returned across the boundary, by its kind: a refusal is
    /// [`PluginError::Create`], anything else [`PluginError::Failed`].
    pub fn of(plugin: &str, e: anneal_plugin_api::abi::PluginError) -> PluginError {
        let (name, msg) = (plugin.to_string(), e.message.into());
        match e.kind {
            anneal_plugin_api::abi::ErrorKind::Input => PluginError::Create { name, msg },
            _ => PluginError::Failed { name, msg },
        }
    }

    /// Whether the user's input must change (everything but a plugin's own failure).
    pub fn is_user_error(&self) -> bool {
        !matches!(self, PluginError::Failed { .. })
    }
}

/// A loaded, checked plugin library.
#[derive(Clone)]
pub struct LoadedPlugin {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// What it says about itself.
    pub info: PluginInfo,
    module: PluginModRef,
}

impl std::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("path", &self.path)
            .field("name", &self.info.name)
            .finish()
    }
}

impl LoadedPlugin {
    /// The plugin's name.
    pub fn name(&self) -> &str {
        self.info.name.as_str()
    }

    /// Model or optimizer.
    pub fn kind(&self) -> PluginKind {
        self.info.kind
    }

    /// The Hugging Face `model_type`s a model plugin serves.
    pub fn model_types(&self) -> impl Iterator<Item = &str> {
        self.info.model_types.iter().map(|t| t.as_str())
    }

    /// Instantiates `flavor` with JSON `args`.
    pub fn create(
        &self,
        flavor: Option<&str>,
        args: &serde_json::Value,
    ) -> Result<PluginInstance, PluginError> {
        let args = args.to_string();
        let flavor = match flavor {
            Some(f) => ROption::RSome(RStr::from(f)),
            None => ROption::RNone,
        };
        self.module.create()(flavor, RStr::from(args.as_str()))
            .into_result()
            .map_err(|e| PluginError::of(self.name(), e))
    }
}

/// The folders searched for plugins, in order: `ANNEAL_PLUGIN_PATH` (colon-separated), `plugins/`
/// next to the running binary, and the binary's own folder (which is `target/<profile>/` for
/// cargo builds, where plugin crates land).
pub fn search_paths() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::env::var_os("ANNEAL_PLUGIN_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        v.push(dir.join("plugins"));
        v.push(dir.clone());
        // Test binaries live in target/<profile>/deps, examples in target/<profile>/examples.
        if dir.ends_with("deps") || dir.ends_with("examples") {
            if let Some(parent) = dir.parent() {
                v.push(parent.to_path_buf());
            }
        }
    }
    v
}

/// File name extensions of shared libraries, on any platform.
const LIB_EXTENSIONS: [&str; 3] = ["so", "dylib", "dll"];

/// The plugin name a library file is named after (`libanneal_plugin_llama.so` → `llama`), if
/// it is named like a plugin.
fn plugin_name_of(p: &Path) -> Option<&str> {
    let name = p.file_name()?.to_str()?;
    let stem = name.strip_prefix("lib").unwrap_or(name);
    let (stem, ext) = stem.rsplit_once('.')?;
    let plugin = stem.strip_prefix("anneal_plugin_")?;
    (LIB_EXTENSIONS.contains(&ext) && !plugin.is_empty()).then_some(plugin)
}

/// Whether `p` is a regular file (or a link to one). Opening anything else as a library can
/// block for ever (a FIFO) or fail in odd ways (a folder, a device).
fn is_regular_file(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file())
}

/// The regular files in `dir` named like plugins, sorted.
fn plugin_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| plugin_name_of(p).is_some() && is_regular_file(p))
        .collect();
    files.sort();
    files
}

/// Every `anneal_plugin_*` library in `dirs`, loaded (or the reason it could not be). A plugin
/// name found in several folders is taken from the first. Only regular files are opened.
pub fn discover(dirs: &[PathBuf]) -> Vec<Result<LoadedPlugin, PluginError>> {
    let mut out = Vec::new();
    let mut names = std::collections::HashSet::new();
    for dir in dirs {
        for f in plugin_files(dir) {
            match load(&f) {
                Ok(p) => {
                    if names.insert(p.name().to_string()) {
                        out.push(Ok(p));
                    }
                }
                Err(e) => out.push(Err(e)),
            }
        }
    }
    out
}

/// The model plugin of the search path that declares Hugging Face `model_type` (the first
/// such plugin in search order).
pub fn find_for_model_type(model_type: &str) -> Result<LoadedPlugin, PluginError> {
    find_for_model_type_in(&search_paths(), model_type)
}

/// [`find_for_model_type`] over `dirs`. Plugin files that fail to load are passed over: they
/// cannot serve anything, and `anneal plugins list` reports them.
pub fn find_for_model_type_in(
    dirs: &[PathBuf],
    model_type: &str,
) -> Result<LoadedPlugin, PluginError> {
    let models: Vec<LoadedPlugin> = discover(dirs)
        .into_iter()
        .filter_map(Result::ok)
        .filter(|p| p.kind() == PluginKind::Model)
        .collect();
    if let Some(p) = models
        .iter()
        .find(|p| p.model_types().any(|t| t == model_type))
    {
        return Ok(p.clone());
    }
    let served: Vec<String> = models
        .iter()
        .map(|p| {
            format!(
                "{} ({})",
                p.name(),
                p.model_types().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    Err(PluginError::NoModelType {
        model_type: model_type.to_string(),
        served: if served.is_empty() {
            "no model plugins found".into()
        } else {
            served.join("; ")
        },
    })
}

/// Finds the plugin called `name` in the search path.
pub fn find(name: &str) -> Result<LoadedPlugin, PluginError> {
    find_in(&search_paths(), name)
}

/// Finds the plugin called `name` in `dirs`: the first library file named after it
/// (`[lib]anneal_plugin_<name>.<so|dylib|dll>`, `-` spelled `_`). Only that file is opened, so
/// a broken or unrelated file next to it cannot fail or slow down the command.
pub fn find_in(dirs: &[PathBuf], name: &str) -> Result<LoadedPlugin, PluginError> {
    let wanted = name.replace('-', "_");
    let file = dirs
        .iter()
        .flat_map(|d| plugin_files(d))
        .find(|f| plugin_name_of(f) == Some(wanted.as_str()));
    let Some(file) = file else {
        let mut available: Vec<String> = dirs
            .iter()
            .flat_map(|d| plugin_files(d))
            .filter_map(|f| plugin_name_of(&f).map(str::to_string))
            .collect();
        available.sort();
        available.dedup();
        return Err(PluginError::NotFound {
            name: name.to_string(),
            searched: dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            available: if available.is_empty() {
                "none".into()
            } else {
                available.join(", ")
            },
        });
    };
    let plugin = load(&file)?;
    if plugin.name().replace('-', "_") != wanted {
        return Err(PluginError::Named {
            path: file,
            name: plugin.name().to_string(),
        });
    }
    Ok(plugin)
}

/// Loads the plugin library at `path`, checking in order: that it opens, that it exports a root
/// module, the interface crate version, the layout of every boundary type, and the API version.
pub fn load(path: &Path) -> Result<LoadedPlugin, PluginError> {
    let path = path.to_path_buf();
    let header = lib_header_from_path(&path).map_err(|e| match e {
        LibraryError::OpenError { err, .. } => PluginError::Open {
            path: path.clone(),
            msg: err.to_string(),
        },
        LibraryError::GetSymbolError { .. } => PluginError::NotAPlugin { path: path.clone() },
        other => PluginError::Open {
            path: path.clone(),
            msg: first_line(&other.to_string()),
        },
    })?;
    let theirs = header.version_strings();
    let ours = <PluginModRef as RootModule>::VERSION_STRINGS;
    if theirs.version != ours.version {
        return Err(PluginError::CrateVersion {
            path,
            plugin: theirs.version.to_string(),
            host: ours.version.to_string(),
        });
    }
    let module = header.init_root_module::<PluginModRef>().map_err(|e| {
        let detail = e.to_string();
        PluginError::Layout {
            path: path.clone(),
            summary: first_line(&detail),
            detail,
        }
    })?;
    let info = module.info()();
    if info.api_version != API_VERSION {
        return Err(PluginError::ApiVersion {
            path,
            name: info.name.to_string(),
            plugin: info.api_version,
            host: API_VERSION,
        });
    }
    Ok(LoadedPlugin { path, info, module })
}

/// The file name a plugin called `name` is looked up by on this platform.
fn plugin_file_name(name: &str) -> String {
    format!(
        "{}anneal_plugin_{}{}",
        std::env::consts::DLL_PREFIX,
        name.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    )
}

fn first_line(s: &str) -> String {
    s.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .chars()
        .take(200)
        .collect()
}
