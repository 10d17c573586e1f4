//! Where a job computes (`job.device`, `anneal generate --device`): the name resolved to an
//! engine [`Device`] whose backend can run here, and tensors placed on it. Checkpoints stay
//! device-free: they are written from host copies and loaded on the host, then placed.

use crate::TrainError;
use anneal_config::{parse_device, DeviceName, JobConfig};
use anneal_engine::{Device, Tensor};

/// The device `name` (`cpu`, `cuda`, `cuda:N`) names, once its backend is usable on this
/// machine. `key` is how the user spelled the setting (`job.device`, `--device`), so both
/// errors are one line naming it: an unknown value, or a CUDA device that cannot run, with the
/// probe's reason (which library or device is missing).
pub fn resolve(name: &str, key: &str) -> Result<Device, TrainError> {
    let device = match parse_device(name) {
        Some(DeviceName::Cpu) => return Ok(Device::Cpu),
        Some(DeviceName::Cuda(n)) => Device::Cuda(n),
        None => {
            return Err(TrainError::Config(format!(
                "{}`{key}`: `{name}` is not a device (use cpu, cuda or cuda:N)",
                prefix(key)
            )))
        }
    };
    match anneal_engine::backend::backend_for(device) {
        Ok(_) => Ok(device),
        Err(e) => Err(TrainError::Config(format!(
            "{}`{key}` = {name}: {e}",
            prefix(key)
        ))),
    }
}

/// `config: ` before a config key, nothing before a command-line flag.
fn prefix(key: &str) -> &'static str {
    if key.starts_with('-') {
        ""
    } else {
        "config: "
    }
}

/// The job's device. Applies `training.allow_tf32` (GPU f32 products on TF32) for the
/// process.
pub fn for_job(cfg: &JobConfig, processes: usize) -> Result<Device, TrainError> {
    let device = check(cfg, processes)?;
    anneal_engine::set_allow_tf32(cfg.training.allow_tf32);
    Ok(device)
}

/// [`for_job`] without changing anything in this process: what a validation asks (the
/// server's, before it starts the job). A job of several processes takes one GPU per rank:
/// `cuda` is `cuda:{local rank modulo the machine's GPUs}` ([`rank_device`]); a named
/// `cuda:N` is refused when several ranks share this machine (they would share one GPU).
pub fn check(cfg: &JobConfig, processes: usize) -> Result<Device, TrainError> {
    for_ranks(&cfg.job.device, "job.device", processes)
}

/// [`resolve`] for one rank of a job of `processes` processes: `cuda` is this rank's GPU
/// ([`rank_device`]); a named `cuda:N` is refused when several ranks share this machine.
pub fn for_ranks(name: &str, key: &str, processes: usize) -> Result<Device, TrainError> {
    if processes > 1 && name != "cuda" {
        if let Some(DeviceName::Cuda(_)) = parse_device(name) {
            let local = anneal_dist::local_ranks().unwrap_or(processes);
            if local > 1 {
                return Err(TrainError::Config(format!(
                    "{}`{key}` = {name}: {local} ranks of this job share this machine, and one GPU each is what `cuda` picks (cuda:<local rank>); set {key} to cuda",
                    prefix(key)
                )));
            }
        }
    }
    if processes > 1 && name == "cuda" {
        let device = rank_device(anneal_engine::backend::cuda_device_count());
        return match anneal_engine::backend::backend_for(device) {
            Ok(_) => Ok(device),
            Err(e) => Err(TrainError::Config(format!(
                "{}`{key}` = cuda (this rank's {device}): {e}",
                prefix(key)
            ))),
        };
    }
    resolve(name, key)
}

/// The GPU this rank of a job of several processes takes when `job.device = "cuda"`: its rank
/// among the ranks on this machine (from the launcher, else its world rank) modulo the `gpus`
/// the driver sees (cuda:0 when it sees none, so the error names a device).
pub fn rank_device(gpus: usize) -> Device {
    let local = anneal_dist::local_rank()
        .or_else(|| {
            ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"]
                .iter()
                .find_map(|k| std::env::var(k).ok()?.parse().ok())
        })
        .unwrap_or(0);
    Device::Cuda(local % gpus.max(1))
}

/// Tensors by name.
type Named = Vec<(String, Tensor)>;

/// The weights a run trains, with every bf16 or f16 tensor widened to f32: mixed precision
/// keeps f32 master weights (and f32 optimizer state beside them) even for a model declared,
/// or a checkpoint shipped, in bf16; the forward computes in `training.dtype` either way.
pub fn f32_masters(named: impl IntoIterator<Item = (String, Tensor)>) -> Result<Named, TrainError> {
    named
        .into_iter()
        .map(|(n, t)| match t.dtype() {
            anneal_engine::DType::BF16 | anneal_engine::DType::F16 => {
                Ok((n, t.to_dtype(anneal_engine::DType::F32)?))
            }
            _ => Ok((n, t)),
        })
        .collect()
}

/// A policy read or initialised on the host, moved to `device`: the parameters (leaves that
/// take gradients again), the buffers and `optimizer`'s state. Unchanged on the CPU.
pub fn place_policy(
    device: Device,
    named: Named,
    buffers: Named,
    optimizer: &mut anneal_runtime::plugins::PluginOptimizer,
) -> Result<(Named, Named), TrainError> {
    if device == Device::Cpu {
        return Ok((named, buffers));
    }
    let named = place(named, device)?
        .into_iter()
        .map(|(n, p)| (n, p.requires_grad_()))
        .collect();
    for t in optimizer.state_mut().values_mut() {
        *t = t.to_device(device)?;
    }
    Ok((named, place(buffers, device)?))
}

/// Each tensor copied to `device` (no copy when it is already there), names kept.
pub fn place(
    named: Vec<(String, Tensor)>,
    device: Device,
) -> Result<Vec<(String, Tensor)>, TrainError> {
    named
        .into_iter()
        .map(|(n, t)| {
            if t.device() == device {
                Ok((n, t))
            } else {
                Ok((n, t.to_device(device)?))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_or_fail_with_the_key() {
        assert_eq!(resolve("cpu", "job.device").expect("cpu"), Device::Cpu);
        let e = resolve("tpu", "job.device").expect_err("tpu").to_string();
        assert!(e.starts_with("config: `job.device`: `tpu`"), "{e}");
        let e = resolve("gpu", "--device").expect_err("gpu").to_string();
        assert!(e.starts_with("`--device`: `gpu`"), "{e}");
        // Where CUDA cannot run, the line says why (the probe's reason), naming the key.
        if anneal_engine::backend::backend_for(Device::Cuda(0)).is_err() {
            let e = resolve("cuda", "job.device")
                .expect_err("no GPU")
                .to_string();
            assert!(
                e.contains("`job.device` = cuda: device cuda:0 is unavailable"),
                "{e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn a_named_gpu_is_refused_for_several_local_ranks() {
        // Outside a launcher every rank counts as local.
        if anneal_dist::local_ranks().is_none() {
            let e = for_ranks("cuda:1", "job.device", 2)
                .expect_err("two ranks on one GPU")
                .to_string();
            assert!(
                e.starts_with(
                    "config: `job.device` = cuda:1: 2 ranks of this job share this machine"
                ),
                "{e}"
            );
        }
        // One process keeps the device it names (refused here only when it cannot run).
        assert_eq!(for_ranks("cpu", "--device", 4).expect("cpu"), Device::Cpu);
    }
}
