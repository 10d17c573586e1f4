//! `anneal train` and `anneal config show`.

use anneal_config::{resolve, JobConfig, Source};

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

pub(crate) fn load(config: &Path, set: &[String]) -> anyhow::Result<JobConfig> {
    Ok(resolve(Source::File(config), set)?)
}

/// Prints the resolved config as TOML (exactly what a run dir keeps as `config.toml`), and the
/// memory estimate of the run on stderr.
pub fn show(config: &Path, set: &[String]) -> anyhow::Result<()> {
    use anneal_train::memory::{describe, Workload};
    let cfg = load(config, set)?;
    print!("{}", cfg.to_toml());
    eprintln!(
        "memory estimate for `anneal train`: {}",
        describe(&cfg, Workload::Train)
    );
    if !cfg.rl.rewards.is_empty() {
        eprintln!(
            "memory estimate for `anneal rl`: {}",
            describe(&cfg, Workload::Rl)
        );
    }
    Ok(())
}

/// Steps that run before a profile starts recording (allocator cache, lazy setup).
const PROFILE_WARMUP_STEPS: u64 = 2;

/// Trains until the configured steps, or until SIGINT/SIGTERM (a second signal exits at once).
/// With `profile = Some(n)`, steps 3..=2+n are timed op by op (see [`write_profile`]).
pub fn train(
    config: &Path,
    set: &[String],
    run_dir: Option<PathBuf>,
    profile: Option<u64>,
) -> anyhow::Result<()> {
    let cfg = load(config, set)?;
    if cfg.training.threads > 0 {
        anneal_engine::init_threads(cfg.training.threads)?;
    }
    let run_dir = run_dir.unwrap_or_else(|| default_run_dir(&cfg.job.name));
    // MPI only when a launcher started this process; a plain run never touches it.
    let world = anneal_dist::init()?;
    if world.rank() == 0 {
        if let Some(note) = crate::restart::unrestartable_note(&cfg.fault_tolerance) {
            eprintln!("{note}");
        }
    }
    if world.size() == 1 {
        return train_on(&cfg, &run_dir, profile, world.as_ref());
    }
    let run_dir = crate::dist_cmd::prepare_rank(world.as_ref(), cfg.training.threads, run_dir)?;
    // A rank that fails ends every rank (with its exit code) rather than leave them waiting.
    match train_on(
        &cfg,
        &run_dir,
        profile.filter(|_| world.rank() == 0),
        world.as_ref(),
    ) {
        Ok(()) => Ok(()),
        Err(e) => crate::dist_cmd::fail_job(world.as_ref(), e),
    }
}

/// [`train`] in `run_dir` as one rank of `world`.
fn train_on(
    cfg: &JobConfig,
    run_dir: &Path,
    profile: Option<u64>,
    world: &dyn anneal_dist::Collective,
) -> anyhow::Result<()> {
    let stop = install_stop_signals()?;
    if let Some(steps) = profile {
        if steps == 0 {
            crate::user_bail!("--profile: the number of steps to record must be at least 1");
        }
        anneal_engine::profile::configure(anneal_engine::profile::Window {
            skip: PROFILE_WARMUP_STEPS,
            steps,
        });
    }
    let result = anneal_train::run_dist(cfg, run_dir, &stop, world);
    if profile.is_some() {
        write_profile(run_dir)?;
    }
    // The exit code follows `TrainError::is_user_error` (see `errors::exit_code`).
    result?;
    Ok(())
}

/// Prints the recorded per-op table and writes `table.txt` and `trace.json` (Chrome trace
/// format, for Perfetto) under `<run_dir>/profile/`.
fn write_profile(run_dir: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let Some(p) = anneal_engine::profile::finish() else {
        return Ok(());
    };
    if p.steps == 0 {
        eprintln!(
            "profile: no step was recorded (the run ended within the {PROFILE_WARMUP_STEPS} warm-up steps)"
        );
        return Ok(());
    }
    let dir = run_dir.join("profile");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let table = p.table();
    for (name, text) in [("table.txt", &table), ("trace.json", &p.chrome_trace())] {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!("{table}");
    eprintln!(
        "profile: {} and {} (open the trace in https://ui.perfetto.dev)",
        dir.join("table.txt").display(),
        dir.join("trace.json").display()
    );
    Ok(())
}

/// A flag set by the first SIGINT/SIGTERM; a second one exits at once.
pub(crate) fn install_stop_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Order matters: the conditional shutdown sees the flag set by an earlier signal.
        signal_hook::flag::register_conditional_shutdown(sig, 130, stop.clone())?;
        signal_hook::flag::register(sig, stop.clone())?;
    }
    Ok(stop)
}

/// `runs/<job name>-<UTC date>-<time>`.
pub(crate) fn default_run_dir(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let t = secs % 86_400;
    PathBuf::from("runs").join(format!(
        "{name}-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        t / 3600,
        t / 60 % 60,
        t % 60
    ))
}

/// Gregorian (year, month, day) of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil_from_days(0), (1970, 1, 1));
        assert_eq!(super::civil_from_days(20_423), (2025, 12, 1));
        assert_eq!(super::civil_from_days(11_016), (2000, 2, 29));
    }
}
