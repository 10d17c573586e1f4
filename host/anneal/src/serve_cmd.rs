//! `anneal serve`: the web UI, the run registry and the OpenAI-compatible endpoint; and `anneal supervise`, the small process that
//! stands between the server and each training process.

use anneal_server::{serve, ServerOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Arguments of `anneal serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Where to listen. Anything but a loopback address needs a token.
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// The registry (registry.sqlite), run directories and reward modules live here.
    #[arg(long, value_name = "DIR", default_value = "runs", env = "ANNEAL_HOME")]
    home: PathBuf,
    /// A token every API call must send as `Authorization: Bearer <token>`.
    #[arg(long, env = "ANNEAL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The config files offered to new runs (runs may only name files in it).
    #[arg(long, value_name = "DIR", default_value = "configs")]
    configs: PathBuf,
    /// The browser UI's files (default: web/ here, or in the source tree of this binary).
    #[arg(long, value_name = "DIR")]
    web: Option<PathBuf>,
    /// How many runs may train at once; more wait as `queued`.
    #[arg(long, value_name = "N", default_value_t = 1)]
    max_running: usize,
    /// The largest reward module upload, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    max_upload_mb: usize,
    /// Serve a model on the OpenAI-compatible endpoint (/v1): a checkpoint step directory
    /// (served as <run>-step-<N>) or a Hugging Face directory (served as its folder name).
    /// Repeatable.
    #[arg(long = "model", value_name = "PATH")]
    models: Vec<PathBuf>,
    /// Most requests one model decodes together (continuous batching); more wait for a row.
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_batch: usize,
}

/// Runs the server until SIGINT or SIGTERM.
pub fn serve_cmd(args: ServeArgs) -> Result<()> {
    let addr: SocketAddr = args.addr.parse().with_context(|| {
        format!(
            "--addr {}: expected IP:PORT, e.g. 127.0.0.1:8080",
            args.addr
        )
    })?;
    if args.token.is_none() && !addr.ip().is_loopback() {
        bail!("{addr} is not a loopback address: give a token (--token or ANNEAL_TOKEN) to listen on it");
    }
    if args.max_running == 0 {
        bail!("--max-running must be at least 1");
    }
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if args.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
        bail!("the token is empty");
    }
    let exe = std::env::current_exe().context("cannot find the anneal binary")?;
    let work_dir = std::env::current_dir().context("cannot read the current directory")?;
    let home = absolute(&work_dir, &args.home);
    let web_dir = match args.web {
        Some(dir) if dir.join("index.html").is_file() => Some(absolute(&work_dir, &dir)),
        Some(dir) => bail!("--web {}: no index.html there", dir.display()),
        None => default_web_dir(&work_dir, &exe),
    };
    let models = args.models.iter().map(|m| absolute(&work_dir, m)).collect();
    let options = ServerOptions {
        addr,
        home,
        token: args.token,
        configs_dir: absolute(&work_dir, &args.configs),
        web_dir,
        work_dir,
        exe,
        max_running: args.max_running,
        max_upload_bytes: args.max_upload_mb.saturating_mul(1 << 20),
        models,
        max_batch: args.max_batch,
    };
    if options.web_dir.is_none() {
        eprintln!("warning: web/ not found; serving the API only (pass --web DIR)");
    }
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(serve(options, |bound| {
        // Tests read this line to learn the port when started with port 0.
        println!("anneal serve: listening on http://{bound}");
    }))?;
    Ok(())
}

fn absolute(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// `web/` in the working directory, else in the source tree the binary was built in
/// (`target/<profile>/anneal` → `web/`).
fn default_web_dir(work_dir: &Path, exe: &Path) -> Option<PathBuf> {
    let here = work_dir.join("web");
    let built = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map(|root| root.join("web"));
    std::iter::once(here)
        .chain(built)
        .find(|d| d.join("index.html").is_file())
}

/// Arguments of `anneal supervise` (started by the server, not by hand).
#[derive(Args)]
pub struct SuperviseArgs {
    /// The run directory: the log and the exit record go there.
    #[arg(long, value_name = "DIR")]
    run_dir: PathBuf,
    /// The anneal command to run, e.g. `train CONFIG --run-dir DIR`.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

/// Runs the trainer, waits for it, writes the exit record; exits with the trainer's code.
pub fn supervise_cmd(args: SuperviseArgs) -> Result<u8> {
    let exe = std::env::current_exe().context("cannot find the anneal binary")?;
    let code = anneal_server::process::supervise(&args.run_dir, &exe, &args.command)
        .with_context(|| format!("supervising a run in {}", args.run_dir.display()))?;
    Ok(u8::try_from(code).unwrap_or(1))
}
