//! The processes behind runs. Each run is a small supervisor process (`anneal supervise`) that
//! leads its own process group, starts `anneal train` (or `anneal rl`), forwards a stop request to it once, and
//! writes `<run_dir>/exit.json` when the trainer exits. The exit record outlives the server: a
//! server restarted while runs were active reads it to tell `stopped` from `failed`.

use crate::config::Kind;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The log file of a run: the trainer's stdout and stderr, and the supervisor's notes.
pub const LOG_FILE: &str = "stdout.log";
/// The exit record the supervisor writes.
pub const EXIT_FILE: &str = "exit.json";

/// How the trainer process ended, as the supervisor saw it.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct ExitRecord {
    /// The exit code, when it exited (rather than being killed by a signal).
    pub code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// Whether the supervisor was asked to stop (SIGTERM/SIGINT) before the trainer exited.
    pub stop_requested: bool,
    /// Unix milliseconds.
    pub finished_at: i64,
}

impl ExitRecord {
    /// Reads `<run_dir>/exit.json`, if it is there and readable.
    pub fn read(run_dir: &Path) -> Option<ExitRecord> {
        let text = std::fs::read_to_string(run_dir.join(EXIT_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

static STOP: AtomicBool = AtomicBool::new(false);
static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(_: libc::c_int) {
    // Only async-signal-safe work here: atomics and kill(2). The stop is forwarded once, so a
    // second request cannot turn the trainer's graceful stop into an abrupt one.
    if !STOP.swap(true, Ordering::SeqCst) {
        let pid = CHILD.load(Ordering::SeqCst);
        if pid > 0 {
            // SAFETY: kill(2) with a pid we spawned; no memory is touched.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}

fn install_stop_handlers() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: installs a handler that only touches atomics and calls kill(2).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_stop_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

fn note(log: &mut std::fs::File, line: &str) {
    // The log is best effort: a full disk must not keep the exit record from being written.
    let _ = writeln!(log, "[anneal serve] {line}");
}

/// Runs `exe args` with its output appended to `<run_dir>/stdout.log`, waits for it and writes
/// the exit record. Returns the exit code to exit with (the trainer's, or 1).
pub fn supervise(run_dir: &Path, exe: &Path, args: &[OsString]) -> std::io::Result<i32> {
    install_stop_handlers();
    std::fs::create_dir_all(run_dir)?;
    let _ = std::fs::remove_file(run_dir.join(EXIT_FILE));
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run_dir.join(LOG_FILE))?;
    let shown: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    note(&mut log, &format!("start: anneal {}", shown.join(" ")));
    let spawned = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log.try_clone()?)
        .spawn();
    let record = match spawned {
        Err(e) => {
            note(&mut log, &format!("cannot start {}: {e}", exe.display()));
            ExitRecord {
                code: Some(127),
                signal: None,
                stop_requested: STOP.load(Ordering::SeqCst),
                finished_at: crate::registry::now_ms(),
            }
        }
        Ok(mut child) => {
            CHILD.store(child.id() as i32, Ordering::SeqCst);
            // A stop that arrived while spawning found no child to forward to.
            if STOP.load(Ordering::SeqCst) {
                // SAFETY: kill(2) on our own child.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            }
            let status = child.wait()?;
            use std::os::unix::process::ExitStatusExt;
            ExitRecord {
                code: status.code(),
                signal: status.signal(),
                stop_requested: STOP.load(Ordering::SeqCst),
                finished_at: crate::registry::now_ms(),
            }
        }
    };
    match (record.code, record.signal) {
        (Some(c), _) => note(&mut log, &format!("exit code {c}")),
        (None, Some(s)) => note(&mut log, &format!("killed by signal {s}")),
        _ => {}
    }
    let tmp = run_dir.join(format!("{EXIT_FILE}.tmp-{}", std::process::id()));
    std::fs::write(
        &tmp,
        serde_json::to_vec(&record).expect("the record serializes"),
    )?;
    std::fs::rename(&tmp, run_dir.join(EXIT_FILE))?;
    Ok(record.code.unwrap_or(1))
}

/// `--name=value` as one argument, so that a value starting with `-` is never parsed as a flag.
pub fn flag(name: &str, value: &std::ffi::OsStr) -> OsString {
    let mut arg = OsString::from(name);
    arg.push("=");
    arg.push(value);
    arg
}

/// The command line that starts a run: `exe supervise --run-dir=DIR -- train|rl [--nproc=N]
/// CONFIG --set=.. --run-dir=DIR`, in its own process group so that a terminal's Ctrl-C to the server does not
/// reach it and a forced stop can kill the whole group. Values are joined to their flags (see
/// [`flag`]); the config is the run dir's absolute `source.toml`.
pub fn run_command(
    exe: &Path,
    work_dir: &Path,
    run_dir: &Path,
    kind: Kind,
    config_file: &Path,
    overrides: &[String],
    processes: usize,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("supervise")
        .arg(flag("--run-dir", run_dir.as_os_str()))
        .arg("--")
        .arg(kind.as_str());
    // A mesh of several processes runs through `--nproc` (mpiexec), which passes a stop on.
    if processes > 1 {
        cmd.arg(flag("--nproc", processes.to_string().as_ref()));
    }
    cmd.arg(config_file);
    for o in overrides {
        cmd.arg(flag("--set", o.as_ref()));
    }
    cmd.arg(flag("--run-dir", run_dir.as_os_str()))
        .current_dir(work_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(false);
    cmd
}

/// Whether the supervisor `pid` of the run in `run_dir` is still alive. Checks the command line
/// too, so a reused pid is not mistaken for the run.
pub fn supervisor_alive(pid: i64, run_dir: &Path) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // A zombie (state Z, after the comm field in parentheses) has exited.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.trim_start()) {
            if rest.starts_with('Z') {
                return false;
            }
        }
    }
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let dir = run_dir.as_os_str().as_encoded_bytes();
    let joined = flag("--run-dir", run_dir.as_os_str());
    // `--run-dir=DIR` since runs are started that way; `--run-dir DIR` from older servers.
    args.contains(&b"supervise".as_slice())
        && (args.contains(&joined.as_encoded_bytes()) || args.contains(&dir))
}

/// Asks the run to stop gracefully: SIGTERM to its supervisor, which forwards it to the trainer
/// once. With `force`, kills the whole process group at once.
pub fn signal_stop(pid: i64, force: bool) -> std::io::Result<()> {
    let pid = i32::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: kill(2) on a process (group) this server started; checked for liveness first.
    let rc = unsafe {
        if force {
            libc::kill(-pid, libc::SIGKILL)
        } else {
            libc::kill(pid, libc::SIGTERM)
        }
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The last meaningful line of a run's log (skipping the supervisor's notes): usually the
/// trainer's one-line error.
pub fn last_log_line(run_dir: &Path) -> Option<String> {
    let text = crate::files::tail_text(&run_dir.join(LOG_FILE), 64 * 1024)?;
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("[anneal serve]"))
        .map(|l| l.chars().take(500).collect())
}

/// The file the trainer is started with: the config text the run was created with, saved in
/// the run dir (so a config edited later does not change a resumed run).
pub fn source_file(run_dir: &Path) -> PathBuf {
    run_dir.join("source.toml")
}
