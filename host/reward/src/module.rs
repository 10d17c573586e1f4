//! Loading: compile (or fetch from the disk cache), check imports against the grants, link, and
//! check the exports against the ABI.

use crate::error::{LoadError, ModuleRole};
use crate::sandbox::{write_cache_file, Sandbox};
use crate::state::{ComponentState, CoreState};
use std::sync::Arc;
use wasmtime::component::{Component, ComponentExportIndex};
use wasmtime::{ExternType, FuncType, InstancePre, Module, ValType};

/// The module name under which core modules import WASI preview 1.
const WASI_P1: &str = "wasi_snapshot_preview1";

/// Which ABI a loaded module follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// A core module (ABI v1: `memory`, `alloc` and `score` for rewards, `env_init` and
    /// `env_step` for environments).
    Core,
    /// A component (of the WIT world `anneal:reward/reward` or `anneal:environment/environment`).
    Component,
}

/// A compiled, linked reward module, ready to be instantiated for each call. Cheap to clone.
#[derive(Clone)]
pub struct RewardModule {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) name: String,
    pub(crate) hash: String,
    pub(crate) abi_problem: Option<String>,
    pub(crate) kind: Kind,
}

pub(crate) enum Kind {
    Core {
        pre: InstancePre<CoreState>,
        /// Whether the module imports WASI preview 1 (then each call gets a deny-all context).
        wasi: bool,
    },
    Component {
        pre: wasmtime::component::InstancePre<ComponentState>,
        score: Option<ComponentExportIndex>,
    },
}

impl RewardModule {
    /// The name given at load (the file name for [`Sandbox::load_file`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The SHA-256 of the module's binary, in hex.
    pub fn hash(&self) -> &str {
        &self.inner.hash
    }

    /// Which ABI the module follows.
    pub fn kind(&self) -> ModuleKind {
        match self.inner.kind {
            Kind::Core { .. } => ModuleKind::Core,
            Kind::Component { .. } => ModuleKind::Component,
        }
    }

    /// Why the module's exports do not match the ABI, if they do not; every call of such a
    /// module ends with `abi_mismatch`.
    pub fn abi_problem(&self) -> Option<&str> {
        self.inner.abi_problem.as_deref()
    }

    /// Whether the module imports WASI (and so runs against the deny-all WASI stubs).
    pub fn imports_wasi(&self) -> bool {
        match &self.inner.kind {
            Kind::Core { wasi, .. } => *wasi,
            Kind::Component { .. } => true,
        }
    }
}

impl std::fmt::Debug for RewardModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardModule")
            .field("name", &self.inner.name)
            .field("kind", &self.kind())
            .field("hash", &self.inner.hash)
            .finish()
    }
}

pub(crate) fn hex(hash: &[u8; 32]) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

/// A compiled and linked binary, whatever its ABI: what the sandbox caches by content hash.
/// Reward and environment modules are built on it (their exports checked against their ABI).
#[derive(Clone)]
pub(crate) enum Compiled {
    Core {
        module: Module,
        pre: InstancePre<CoreState>,
        /// Whether the module imports WASI preview 1 (then each store gets a deny-all context).
        wasi: bool,
    },
    Component {
        component: Component,
        pre: wasmtime::component::InstancePre<ComponentState>,
    },
}

impl RewardModule {
    /// A reward module over a compiled binary, its exports checked against the reward ABI.
    pub(crate) fn new(name: &str, hash: &[u8; 32], compiled: Compiled) -> Self {
        let (abi_problem, kind) = match compiled {
            Compiled::Core { module, pre, wasi } => {
                (check_core_abi(&module).err(), Kind::Core { pre, wasi })
            }
            Compiled::Component { component, pre } => {
                let score = component.get_export_index(None, "score");
                let problem = match score {
                    Some(_) => None,
                    None => Some("missing function export `score`".to_string()),
                };
                (problem, Kind::Component { pre, score })
            }
        };
        RewardModule {
            inner: Arc::new(Inner {
                name: name.to_string(),
                hash: hex(hash),
                abi_problem,
                kind,
            }),
        }
    }
}

impl Sandbox {
    /// A compiled module or component: from the on-disk cache when a valid entry exists, else
    /// compiled and written to the cache (best effort).
    fn compile_cached<T>(
        &self,
        role: ModuleRole,
        name: &str,
        hash: &[u8; 32],
        load: impl FnOnce(&std::path::Path) -> Option<T>,
        compile: impl FnOnce() -> wasmtime::Result<T>,
        serialize: impl FnOnce(&T) -> wasmtime::Result<Vec<u8>>,
    ) -> Result<T, LoadError> {
        let path = self.cache_path(hash, "cwasm");
        if let Some(cached) = path.as_deref().filter(|p| p.exists()).and_then(load) {
            return Ok(cached);
        }
        let compiled = compile().map_err(|e| LoadError::Invalid {
            role,
            name: name.to_string(),
            message: format!("{e:#}"),
        })?;
        if let (Some(p), Ok(bytes)) = (&path, serialize(&compiled)) {
            write_cache_file(p, &bytes);
        }
        Ok(compiled)
    }

    pub(crate) fn compile_core(
        &self,
        role: ModuleRole,
        name: &str,
        binary: &[u8],
        hash: &[u8; 32],
    ) -> Result<Compiled, LoadError> {
        let module = self.compile_cached(
            role,
            name,
            hash,
            // SAFETY: the cache holds only files this sandbox wrote with `Module::serialize` for
            // an engine with the same compatibility hash (part of the file name); they are not
            // modified while mapped.
            |p| unsafe { Module::deserialize_file(&self.engine, p) }.ok(),
            || Module::from_binary(&self.engine, binary),
            Module::serialize,
        )?;
        let mut wasi = false;
        for import in module.imports() {
            if import.module() == WASI_P1 && self.config.grants.wasi {
                wasi = true;
                continue;
            }
            return Err(LoadError::DisallowedImport {
                role,
                name: name.to_string(),
                import: format!("{}::{}", import.module(), import.name()),
            });
        }
        let pre = self
            .core_linker
            .instantiate_pre(&module)
            .map_err(|e| LoadError::Link {
                role,
                name: name.to_string(),
                message: format!("{e:#}"),
            })?;
        Ok(Compiled::Core { module, pre, wasi })
    }

    pub(crate) fn compile_component(
        &self,
        role: ModuleRole,
        name: &str,
        binary: &[u8],
        hash: &[u8; 32],
    ) -> Result<Compiled, LoadError> {
        let component = self.compile_cached(
            role,
            name,
            hash,
            // SAFETY: as in `compile_core`: only files this sandbox wrote, for a compatible engine.
            |p| unsafe { Component::deserialize_file(&self.engine, p) }.ok(),
            || Component::from_binary(&self.engine, binary),
            Component::serialize,
        )?;
        let ty = component.component_type();
        for (import, _) in ty.imports(&self.engine) {
            if !(self.config.grants.wasi && import.starts_with("wasi:")) {
                return Err(LoadError::DisallowedImport {
                    role,
                    name: name.to_string(),
                    import: import.to_string(),
                });
            }
        }
        let pre = self
            .component_linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Link {
                role,
                name: name.to_string(),
                message: format!("{e:#}"),
            })?;
        Ok(Compiled::Component { component, pre })
    }
}

/// A short text form of a value type, for messages.
fn val_name(t: &ValType) -> &'static str {
    match t {
        ValType::I32 => "i32",
        ValType::I64 => "i64",
        ValType::F32 => "f32",
        ValType::F64 => "f64",
        ValType::V128 => "v128",
        ValType::Ref(_) => "ref",
    }
}

/// A function type as text, e.g. `(i32) -> i32`.
fn sig(ft: &FuncType) -> String {
    let params: Vec<_> = ft.params().map(|t| val_name(&t)).collect();
    let results: Vec<_> = ft.results().map(|t| val_name(&t)).collect();
    format!("({}) -> {}", params.join(", "), results.join(", "))
}

/// Checks that function export `name` exists (when `required`) with signature `want`.
pub(crate) fn check_func(
    module: &Module,
    name: &str,
    want: &str,
    required: bool,
) -> Result<bool, String> {
    match module.get_export(name) {
        None if required => Err(format!("missing function export `{name}` {want}")),
        None => Ok(false),
        Some(ExternType::Func(ft)) if sig(&ft) == want => Ok(true),
        Some(ExternType::Func(ft)) => Err(format!(
            "export `{name}` has signature {}, expected {want}",
            sig(&ft)
        )),
        Some(_) => Err(format!("export `{name}` is not a function")),
    }
}

/// Checks that `memory` is exported as a 32-bit memory.
pub(crate) fn check_memory(module: &Module) -> Result<(), String> {
    match module.get_export("memory") {
        Some(ExternType::Memory(m)) if !m.is_64() => Ok(()),
        Some(ExternType::Memory(_)) => Err("export `memory` is a 64-bit memory".into()),
        Some(_) => Err("export `memory` is not a memory".into()),
        None => Err("missing memory export `memory`".into()),
    }
}

/// Checks the exports of a core module against ABI v1.
fn check_core_abi(module: &Module) -> Result<(), String> {
    check_memory(module)?;
    check_func(module, "alloc", "(i32) -> i32", true)?;
    check_func(
        module,
        "score",
        "(i32, i32, i32, i32, i32, i32) -> f64",
        true,
    )?;
    let has_ptr = check_func(module, "details_ptr", "() -> i32", false)?;
    let has_len = check_func(module, "details_len", "() -> i32", false)?;
    if has_ptr != has_len {
        return Err("exports only one of `details_ptr` and `details_len`".into());
    }
    check_func(module, "anneal_reward_abi", "() -> i32", false)?;
    Ok(())
}
