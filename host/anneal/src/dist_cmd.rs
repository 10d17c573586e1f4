//! The process side of multi-process training: `anneal train --nproc N` (runs `mpiexec` for the
//! user), and what a rank started by `mpiexec` does before training: agree on the run
//! directory, take its share of the cores, send its output to `<run_dir>/logs/rank-<r>.log`
//! (rank 0 keeps the terminal), and end the whole job when it fails.

use anneal_dist::Collective;
use anyhow::Context;
use std::path::{Path, PathBuf};

/// `anneal train --nproc N CONFIG ...`: resolves the config here (so a bad one fails before
/// any process starts), then runs `mpiexec -n N <this binary> train CONFIG ...` with the run
/// directory fixed for every rank and, unless `training.threads` is set, an equal share of the
/// cores per rank. With `fault_tolerance.enabled` a failed job is started again on the same run
/// directory ([`crate::restart`]). Returns the launcher's exit code.
pub fn launch(
    config: &Path,
    set: &[String],
    run_dir: Option<PathBuf>,
    profile: Option<u64>,
    nproc: usize,
) -> anyhow::Result<u8> {
    use crate::errors::UserError;
    if anneal_dist::launched_by_mpi() {
        crate::user_bail!(
            "--nproc starts mpiexec itself; under mpiexec, run `anneal train` without --nproc"
        );
    }
    let cfg = crate::train_cmd::load(config, set)?;
    let run_dir = run_dir.unwrap_or_else(|| crate::train_cmd::default_run_dir(&cfg.job.name));
    let exe = std::env::current_exe().context("finding the anneal binary")?;
    let mut env = Vec::new();
    if cfg.training.threads == 0 {
        env.push((
            "ANNEAL_TRAINING__THREADS",
            threads_per_rank(nproc).to_string(),
        ));
    }
    if cfg.fault_tolerance.enabled {
        env.push((crate::restart::LAUNCHER_ENV, "1".to_string()));
    }
    let signals = Signals::register()?;
    let mut restarts = 0;
    loop {
        let mut cmd = anneal_dist::launch::mpiexec_command(nproc, &exe, &env)
            .map_err(|e| UserError(e.to_string()))?;
        cmd.arg("train").arg(config).arg("--run-dir").arg(&run_dir);
        for s in set {
            cmd.arg("--set").arg(s);
        }
        if let Some(steps) = profile {
            cmd.arg(format!("--profile={steps}"));
        }
        let status = wait_forwarding_term(&mut cmd, &signals)?;
        // A rank's failure reaches us as mpiexec's exit code (the rank's own code under MPICH).
        let code = match status.code() {
            Some(0) => 0,
            Some(c) => u8::try_from(c).unwrap_or(1).max(1),
            None => 1,
        };
        let ft = &cfg.fault_tolerance;
        match crate::restart::after_exit(ft, code, signals.stopped(), restarts) {
            crate::restart::After::Exit(code) => return Ok(code),
            crate::restart::After::Restart(n) => {
                eprintln!("{}", crate::restart::restart_note(ft, code, n, &run_dir));
                restarts = n;
            }
        }
    }
}

/// SIGTERM and SIGINT as they reach the launcher: a SIGTERM is passed on to `mpiexec`, and
/// either one means the user stopped the job, so a failure that follows is not restarted.
struct Signals {
    term: std::sync::Arc<std::sync::atomic::AtomicBool>,
    int: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Signals {
    fn register() -> anyhow::Result<Signals> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let signals = Signals {
            term: Default::default(),
            int: Default::default(),
        };
        signal_hook::flag::register(SIGTERM, signals.term.clone())?;
        signal_hook::flag::register(SIGINT, signals.int.clone())?;
        Ok(signals)
    }

    fn term(&self) -> bool {
        self.term.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn stopped(&self) -> bool {
        self.term() || self.int.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Runs `cmd` (mpiexec) to its end. This process outlives the ranks: Ctrl-C reaches mpiexec
/// through the terminal's process group, and a SIGTERM sent to this process alone is passed on
/// to mpiexec, which forwards it to every rank (each stops after its step and rank 0 saves).
fn wait_forwarding_term(
    cmd: &mut std::process::Command,
    signals: &Signals,
) -> anyhow::Result<std::process::ExitStatus> {
    let mut child = cmd.spawn().context("running mpiexec")?;
    let mut forwarded = false;
    loop {
        if let Some(status) = child.try_wait().context("waiting for mpiexec")? {
            return Ok(status);
        }
        if signals.term() && !forwarded {
            forwarded = true;
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) on the pid of a child we have not reaped yet.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Cores per rank when `nproc` ranks share this machine: at least one.
pub(crate) fn threads_per_rank(nproc: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nproc.max(1)).max(1)
}

/// Prepares this process as rank `world.rank()` of a multi-process job: sets the compute
/// threads when the config leaves them to us (the cores shared by the ranks on this machine),
/// makes a panic end the whole job, agrees on rank 0's run directory, and sends the output of
/// every other rank to its log file. Returns the run directory.
pub fn prepare_rank(
    world: &dyn Collective,
    threads: usize,
    run_dir: PathBuf,
) -> anyhow::Result<PathBuf> {
    if threads == 0 {
        let local = anneal_dist::local_ranks().unwrap_or(world.size());
        anneal_engine::init_threads(threads_per_rank(local))?;
    }
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        // Unwinding would finalize MPI and leave the other ranks waiting; abort them all.
        anneal_dist::abort_job(101);
    }));
    let run_dir = shared_path(world, &run_dir)?;
    if world.rank() > 0 {
        redirect_output(&run_dir, world.rank())?;
    }
    Ok(run_dir)
}

/// Rank 0's `path` on every rank (a default run dir is named after the time, which ranks
/// would each read differently).
fn shared_path(world: &dyn Collective, path: &Path) -> anyhow::Result<PathBuf> {
    let mine = path.to_string_lossy().into_owned().into_bytes();
    let mut len = (mine.len() as u64).to_le_bytes();
    world.broadcast(&mut len, 0)?;
    let mut bytes = if world.rank() == 0 {
        mine
    } else {
        vec![0u8; u64::from_le_bytes(len) as usize]
    };
    world.broadcast(&mut bytes, 0)?;
    Ok(PathBuf::from(String::from_utf8_lossy(&bytes).into_owned()))
}

/// Points stdout and stderr at `<run_dir>/logs/rank-<rank>.log` (appending), so everything this
/// rank prints, panics included, lands in its own file.
fn redirect_output(run_dir: &Path, rank: usize) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let dir = run_dir.join("logs");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("rank-{rank}.log"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: dup2 on two open descriptors; `file` stays open for the call, and the
        // duplicated descriptors live independently of it.
        if unsafe { libc::dup2(file.as_raw_fd(), fd) } < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("sending output to {}", path.display()));
        }
    }
    Ok(())
}

/// How long a failed rank waits for the others to fail too before it ends the job alone: a
/// failure every rank meets (a bad layout) reaches them within moments of each other, even on a
/// loaded machine with more ranks than cores.
const FAIL_TOGETHER_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Reports `e` and ends the whole job with its exit code (every rank's error ends every rank).
/// When every rank fails (a bad layout), they agree and exit with one code, so the launcher
/// reports it (not the kill of a slower rank) and one report stands for all when they say the
/// same; a failure of this rank alone ends it after [`FAIL_TOGETHER_WAIT`], which stops the rest.
pub fn fail_job(world: &dyn anneal_dist::Collective, e: anyhow::Error) -> ! {
    use std::io::Write;
    let message = crate::errors::one_line(&e);
    let code = i32::from(crate::errors::exit_code(&e));
    // A rank that only learnt of another's failure has nothing to add to that rank's report,
    // nor a code of its own.
    let follower = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<anneal_dist::DistError>(),
            Some(anneal_dist::DistError::PeerFailed { .. })
        )
    });
    // One write, so the launcher never splits the line around another rank's output.
    let report = || {
        let _ = std::io::stderr().write_all(format!("error: {message}\n").as_bytes());
    };
    // Rank 0 speaks at once; the others once they know whether it spoke for them (asked now:
    // agreeing shuts the transport down).
    let rank = world.rank();
    if rank == 0 {
        report();
    }
    let own_code = if follower { 0 } else { code };
    match world.fail_together(own_code, &message, FAIL_TOGETHER_WAIT) {
        Some(agreed) => {
            if rank != 0 && !agreed.same_message && !follower {
                report();
            }
            anneal_dist::abort_job(agreed.code.max(1))
        }
        None => {
            if rank != 0 {
                report();
            }
            anneal_dist::abort_job(code)
        }
    }
}
