//! The sandbox: one engine (with its epoch ticker), the linkers, and the module cache.

use crate::config::SandboxConfig;
use crate::error::{LoadError, ModuleRole};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::module::{Compiled, RewardModule};
use crate::state::{ComponentState, CoreState};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use wasmtime::{Config, Engine, Linker, OptLevel};

/// Advances the engine's epoch on a thread of its own until dropped (shared by the sandbox and
/// its live episodes, so an episode's deadlines keep working if the sandbox goes first).
pub(crate) struct Ticker {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: Engine, tick: std::time::Duration) -> Result<Self, LoadError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("reward-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    engine.increment_epoch();
                }
            })
            .map_err(|e| LoadError::Engine {
                message: format!("cannot start the epoch ticker thread: {e}"),
            })?;
        Ok(Ticker {
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Runs reward modules under fuel, time and memory limits. Create one per process (the engine
/// and its compiled-module cache are shared by all calls); it is `Send + Sync`.
pub struct Sandbox {
    pub(crate) engine: Engine,
    pub(crate) config: SandboxConfig,
    pub(crate) core_linker: Linker<CoreState>,
    pub(crate) component_linker: wasmtime::component::Linker<ComponentState>,
    pub(crate) metrics: Arc<Metrics>,
    cache: Mutex<HashMap<[u8; 32], Compiled>>,
    /// Distinguishes `.cwasm` files of engines with other settings or versions.
    engine_tag: String,
    pub(crate) ticker: Arc<Ticker>,
}

impl Sandbox {
    /// Creates the engine (fuel and epoch interruption on), its linkers and the ticker thread.
    pub fn new(config: SandboxConfig) -> Result<Self, LoadError> {
        let engine_err = |e: wasmtime::Error| LoadError::Engine {
            message: format!("{e:#}"),
        };
        let mut c = Config::new();
        c.consume_fuel(true)
            .epoch_interruption(true)
            .cranelift_opt_level(OptLevel::Speed)
            .wasm_component_model(true)
            .parallel_compilation(true);
        let engine = Engine::new(&c).map_err(engine_err)?;

        let mut core_linker = Linker::new(&engine);
        let mut component_linker = wasmtime::component::Linker::new(&engine);
        if config.grants.wasi {
            wasmtime_wasi::p1::add_to_linker_sync(&mut core_linker, |s: &mut CoreState| {
                s.p1.as_mut()
                    .expect("a WASI context is created for every module that imports WASI")
            })
            .map_err(engine_err)?;
            crate::nowait::install(&mut core_linker).map_err(engine_err)?;
            wasmtime_wasi::p2::add_to_linker_sync(&mut component_linker).map_err(engine_err)?;
            crate::nowait::install_p2(&mut component_linker).map_err(engine_err)?;
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        let engine_tag = format!("{:016x}", h.finish());
        let ticker = Ticker::start(engine.clone(), config.epoch_tick)?;
        Ok(Sandbox {
            engine,
            config,
            core_linker,
            component_linker,
            metrics: Arc::new(Metrics::default()),
            cache: Mutex::new(HashMap::new()),
            engine_tag,
            ticker: Arc::new(ticker),
        })
    }

    /// The configuration this sandbox was created with.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// The live counters of all calls so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A copy of the counters of all calls so far.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Loads a module or component from a file (`.wasm` binary or `.wat` text). A file over
    /// [`SandboxConfig::max_module_bytes`] is refused from its size, before it is read.
    pub fn load_file(&self, path: &Path) -> Result<RewardModule, LoadError> {
        let (name, bytes) = self.read_module_file(ModuleRole::Reward, path)?;
        self.load_bytes(&name, &bytes)
    }

    /// Loads a module or component from bytes (binary or WebAssembly text). Compiled modules are
    /// cached by content hash: loading the same bytes again is a lookup.
    pub fn load_bytes(&self, name: &str, bytes: &[u8]) -> Result<RewardModule, LoadError> {
        let (compiled, hash) = self.compile(ModuleRole::Reward, name, bytes)?;
        Ok(RewardModule::new(name, &hash, compiled))
    }

    /// Reads a module file, refused from its size when over the limit; returns its file name
    /// (the module's name) and its bytes.
    pub(crate) fn read_module_file(
        &self,
        role: ModuleRole,
        path: &Path,
    ) -> Result<(String, Vec<u8>), LoadError> {
        use std::io::Read;
        let io = |error| LoadError::Io {
            role,
            path: path.to_path_buf(),
            error,
        };
        let max = self.config.max_module_bytes as u64;
        let too_large = |bytes| LoadError::TooLarge {
            role,
            name: path.display().to_string(),
            bytes,
            max,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        if size > max {
            return Err(too_large(size));
        }
        // The size may change while reading (or a pipe has none): read at most one byte more.
        let mut bytes = Vec::with_capacity(size as usize);
        file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
        if bytes.len() as u64 > max {
            return Err(too_large(bytes.len() as u64));
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        Ok((name, bytes))
    }

    /// The compiled, linked binary of `bytes` (binary or WebAssembly text) and its content hash,
    /// from the in-memory cache when the same binary was loaded before (as any role).
    pub(crate) fn compile(
        &self,
        role: ModuleRole,
        name: &str,
        bytes: &[u8],
    ) -> Result<(Compiled, [u8; 32]), LoadError> {
        if bytes.len() > self.config.max_module_bytes {
            return Err(LoadError::TooLarge {
                role,
                name: name.to_string(),
                bytes: bytes.len() as u64,
                max: self.config.max_module_bytes as u64,
            });
        }
        let binary = wat::parse_bytes(bytes).map_err(|e| {
            // The text parser's message spans several lines (with a source snippet): keep the
            // first line and the position, so a user sees one line.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            let at = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("--> "))
                .map(|loc| format!(" (at line:column {})", loc.trim_start_matches("<anon>:")))
                .unwrap_or_default();
            LoadError::Invalid {
                role,
                name: name.to_string(),
                message: format!(
                    "not a WebAssembly binary, nor valid WebAssembly text: {first}{at}"
                ),
            }
        })?;
        let hash: [u8; 32] = Sha256::digest(&binary).into();
        if let Some(c) = self.cache_lock().get(&hash) {
            return Ok((c.clone(), hash));
        }
        let compiled = if is_component(&binary) {
            self.compile_component(role, name, &binary, &hash)?
        } else {
            self.compile_core(role, name, &binary, &hash)?
        };
        self.cache_lock().insert(hash, compiled.clone());
        Ok((compiled, hash))
    }

    fn cache_lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Compiled>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts).
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The `.cwasm` path for content `hash` in the disk cache, if one is configured.
    pub(crate) fn cache_path(&self, hash: &[u8; 32], ext: &str) -> Option<PathBuf> {
        let dir = self.config.cache_dir.as_ref()?;
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        Some(dir.join(format!("{hex}-{}.{ext}", self.engine_tag)))
    }
}

/// True when `binary` is a component rather than a core module (by its header's layer field).
fn is_component(binary: &[u8]) -> bool {
    binary.len() >= 8 && binary[0..4] == *b"\0asm" && binary[6..8] == [1, 0]
}

/// Writes `bytes` to `path` atomically (temporary file + rename); errors are ignored because the
/// disk cache is only an optimization.
pub(crate) fn write_cache_file(path: &Path, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
