//! The Anneal server behind `anneal serve`: a run registry in SQLite, supervised training and RL
//! processes, a JSON API (`web/API.md`) and the browser UI (`web/`).
//!
//! ```text
//! registry.rs   runs and reward modules in <home>/registry.sqlite
//! runs.rs       the manager: queue, start, watch, stop, resume, reconcile at startup
//! process.rs    the per-run supervisor process and its exit record
//! files.rs      metrics.jsonl, logs and checkpoint folders of a run directory
//! samples/      an RL run's samples.jsonl: an index kept per run, filters and pages
//! config.rs     configs/, config resolution, the kind of a job (train or rl)
//! guard.rs      Host, Origin and content-type checks against web pages driving the server
//! api/          the HTTP handlers
//! openai/       the OpenAI-compatible endpoint (/v1) for the --model models
//! ```

#![warn(missing_docs)]

mod api;
pub mod config;
pub mod files;
pub mod guard;
pub mod openai;
pub mod process;
pub mod registry;
pub mod runs;
pub mod samples;

use anneal_reward::{Sandbox, SandboxConfig};
use registry::Registry;
use runs::{Launch, Manager, RunError};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// How the server is set up.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Where to listen.
    pub addr: SocketAddr,
    /// The registry, run directories and reward modules live here.
    pub home: PathBuf,
    /// Required as `Authorization: Bearer <token>` on every API call when set; must be set to
    /// listen on anything but loopback.
    pub token: Option<String>,
    /// The folder offered by `GET /api/configs` (runs may only name files in it).
    pub configs_dir: PathBuf,
    /// The browser UI's files (`web/`); `None` serves a page saying they were not found.
    pub web_dir: Option<PathBuf>,
    /// The working directory of training processes.
    pub work_dir: PathBuf,
    /// The `anneal` binary runs are started with.
    pub exe: PathBuf,
    /// How many runs may have a process at once.
    pub max_running: usize,
    /// The largest reward module upload, in bytes.
    pub max_upload_bytes: usize,
    /// What one reward test request may spend across all its inputs.
    pub reward_test: RewardTestBudget,
    /// Models served on the OpenAI-compatible endpoint (`/v1`): checkpoint step directories or
    /// Hugging Face directories.
    pub models: Vec<PathBuf>,
    /// Most requests each model decodes together (its decode loop's batch).
    pub max_batch: usize,
}

/// The total a `POST /api/rewards/{id}/test` request may spend across its inputs (each call is
/// also held to the sandbox's own per-call limits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RewardTestBudget {
    /// Wall time.
    pub time: Duration,
    /// Fuel (roughly WebAssembly instructions).
    pub fuel: u64,
}

impl Default for RewardTestBudget {
    fn default() -> Self {
        RewardTestBudget {
            time: Duration::from_secs(30),
            fuel: 10_000_000_000,
        }
    }
}

impl ServerOptions {
    /// `<home>/runs`.
    pub fn runs_dir(&self) -> PathBuf {
        self.home.join("runs")
    }

    /// `<home>/rewards`.
    pub fn rewards_dir(&self) -> PathBuf {
        self.home.join("rewards")
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A non-loopback address without a token.
    #[error(
        "{0} is not a loopback address: give a token (--token or ANNEAL_TOKEN) to listen on it"
    )]
    NeedsToken(SocketAddr),
    /// The home folder could not be created.
    #[error("cannot create {path}: {source}")]
    Home {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The registry could not be opened.
    #[error(transparent)]
    Registry(#[from] registry::RegistryError),
    /// Reconciling runs failed.
    #[error(transparent)]
    Runs(#[from] RunError),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Another server manages this home (two would both start and reconcile its runs).
    #[error("another anneal serve is using {0}; stop it or pick another --home")]
    HomeInUse(PathBuf),
    /// A `--model` could not be served.
    #[error(transparent)]
    Model(#[from] openai::ModelError),
    /// The server stopped with an error.
    #[error("server error: {0}")]
    Serve(std::io::Error),
}

/// What every handler shares.
pub struct AppState {
    options: ServerOptions,
    registry: Arc<Registry>,
    manager: Arc<Manager>,
    sandbox: OnceLock<Result<Arc<Sandbox>, String>>,
    /// The index of each RL run's samples file, and the bound on concurrent reads of them.
    samples: samples::Samples,
    /// Set when SIGINT or SIGTERM arrives: long work on blocking threads stops.
    shutting_down: AtomicBool,
}

impl AppState {
    /// Whether the server is stopping.
    fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// The reward sandbox, created at first use (it starts a ticker thread and a compiler).
    fn sandbox(&self) -> Result<&Arc<Sandbox>, api::ApiError> {
        self.sandbox
            .get_or_init(|| {
                Sandbox::new(SandboxConfig {
                    cache_dir: Some(self.options.rewards_dir().join("cache")),
                    // Whatever the server accepts as an upload it can load.
                    max_module_bytes: self.options.max_upload_bytes,
                    ..SandboxConfig::default()
                })
                .map(Arc::new)
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| api::ApiError::internal(format!("the reward sandbox failed: {e}")))
    }
}

impl AppState {
    /// Where an uploaded reward module's bytes are stored: `<home>/rewards/<sha256>.wasm` (what
    /// an RL run's `rl.rewards` names).
    fn stored_reward_path(&self, reward: &registry::Reward) -> PathBuf {
        self.options
            .rewards_dir()
            .join(format!("{}.wasm", reward.sha256))
    }
}

/// Opens the registry, reconciles runs left by an earlier server, binds `options.addr`, calls
/// `ready` with the bound address (useful with port 0), and serves until SIGINT or SIGTERM.
/// Runs keep going when the server stops; the next server adopts them.
pub async fn serve(
    options: ServerOptions,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    if options.token.is_none() && !options.addr.ip().is_loopback() {
        return Err(ServeError::NeedsToken(options.addr));
    }
    for dir in [&options.home, &options.runs_dir(), &options.rewards_dir()] {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::Home {
            path: dir.clone(),
            source,
        })?;
    }
    let _lock = lock_home(&options.home)?;
    let registry = Arc::new(Registry::open(&options.home.join("registry.sqlite"))?);
    // Loaded before listening: a model that cannot be served stops the startup.
    let models = openai::load_models(
        &options.models,
        &anneal_runtime::serving::SchedulerOptions {
            max_batch: options.max_batch,
        },
    )?;
    let openai_token = options.token.clone();
    let manager = Manager::new(
        Arc::clone(&registry),
        Launch {
            exe: options.exe.clone(),
            work_dir: options.work_dir.clone(),
            runs_dir: options.runs_dir(),
            max_running: options.max_running,
        },
    );
    manager.start()?;
    let listener = tokio::net::TcpListener::bind(options.addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: options.addr,
            source,
        })?;
    let addr = listener.local_addr().map_err(ServeError::Serve)?;
    let web_dir = options.web_dir.clone();
    let state = Arc::new(AppState {
        options,
        registry,
        manager,
        sandbox: OnceLock::new(),
        samples: samples::Samples::default(),
        shutting_down: AtomicBool::new(false),
    });
    let app = static_routes(web_dir)
        .nest("/api", api::routes(Arc::clone(&state)))
        .nest("/v1", openai::routes(models, openai_token))
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(guard::Guard::new(addr)),
            guard::check,
        ));
    ready(addr);
    // Not a graceful shutdown: event streams never end by themselves, and runs do not depend on
    // the server, so open connections are simply dropped. Work on blocking threads (reward
    // tests) sees the flag and stops; the caller should not wait for it either (drop the
    // runtime with a timeout).
    let result = tokio::select! {
        served = axum::serve(listener, app) => served.map_err(ServeError::Serve),
        () = shutdown_signal() => Ok(()),
    };
    state.shutting_down.store(true, Ordering::Relaxed);
    result
}

/// Holds an exclusive lock on `<home>/server.lock` for as long as the file stays open (the
/// kernel releases it when the process dies, however it dies).
fn lock_home(home: &std::path::Path) -> Result<std::fs::File, ServeError> {
    let path = home.join("server.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| ServeError::Home {
            path: path.clone(),
            source,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(ServeError::HomeInUse(home.to_path_buf())),
        Err(std::fs::TryLockError::Error(source)) => Err(ServeError::Home { path, source }),
    }
}

fn static_routes(web_dir: Option<PathBuf>) -> axum::Router {
    match web_dir {
        Some(dir) => axum::Router::new().fallback_service(tower_http::services::ServeDir::new(dir)),
        None => axum::Router::new().fallback(|| async {
            axum::response::Html(
                "<h1>Anneal</h1><p>The browser UI's files (<code>web/</code>) were not found. \
                 Run <code>anneal serve</code> from the repository root, or pass \
                 <code>--web DIR</code>. The API is under <code>/api</code>.</p>",
            )
        }),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        // Without a SIGTERM handler, Ctrl-C still stops the server.
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
