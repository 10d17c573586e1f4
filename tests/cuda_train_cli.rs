//! `job.device` and `anneal generate --device` end to end. Everywhere: a bad value names the key
//! (exit 2), `cpu` is the default bit for bit, and where no GPU can run, `cuda` is one line
//! saying why (exit 2). With a GPU: the tiny Llama trains on CUDA like on the CPU (f32 within
//! 1e-4 relative, bf16 within 2%), its checkpoint resumes on the CPU, and generation from it
//! agrees on both devices; every model family trains on it like on the CPU; `anneal rl` rolls
//! out and trains on it with a logprob mismatch of exactly 0 and resumes bit for bit. Without one those print SKIP with the reason and pass.

use anneal_tests::cli as common;

mod rl_support;

use common::{anneal, losses, no_gpu, ok, rows, Job};
use std::path::Path;
use std::process::Output;

fn user_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// The logged losses as numbers.
fn loss_values(run_dir: &Path) -> Vec<f64> {
    losses(run_dir).into_iter().map(f64::from_bits).collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs(),
            "{what}: step {}: cuda {g} vs cpu {w} (more than {rel} relative)",
            i + 1
        );
    }
}

#[test]
fn a_bad_device_names_the_key() {
    let job = Job::new("device-bad");
    let (out, _) = job.train("run", &["job.device=\"tpu\""]);
    let err = user_error(&out);
    assert!(err.contains("`job.device`") && err.contains("tpu"), "{err}");
    let out = anneal()
        .args([
            "generate",
            "--model-dir",
            "/nonexistent",
            "--prompt-tokens",
            "1",
        ])
        .args(["--device", "gpu0"])
        .output()
        .expect("anneal generate");
    let err = user_error(&out);
    assert!(err.contains("`--device`") && err.contains("gpu0"), "{err}");
}

#[test]
fn cpu_is_the_default_bit_for_bit() {
    let job = Job::new("device-cpu");
    let (a, dir_a) = job.train("default", &["training.steps=3"]);
    let (b, dir_b) = job.train("cpu", &["training.steps=3", "job.device=\"cpu\""]);
    ok(&a);
    ok(&b);
    assert_eq!(losses(&dir_a).len(), 3);
    assert_eq!(losses(&dir_a), losses(&dir_b));
}

#[test]
fn cuda_without_a_gpu_is_one_line_saying_why() {
    let Some(why) = no_gpu() else {
        println!("SKIP cuda_without_a_gpu_is_one_line_saying_why: a GPU is present");
        return;
    };
    println!("no GPU here: {why}");
    let job = Job::new("device-nogpu");
    let (out, run_dir) = job.train("run", &["job.device=\"cuda\""]);
    let err = user_error(&out);
    assert!(
        err.contains("`job.device` = cuda") && err.contains("device cuda:0 is unavailable"),
        "{err}"
    );
    assert!(
        !run_dir.join("metrics.jsonl").exists(),
        "nothing ran before the device check"
    );
    let out = anneal()
        .args([
            "generate",
            "--model-dir",
            "/nonexistent",
            "--prompt-tokens",
            "1",
        ])
        .args(["--device", "cuda:1"])
        .output()
        .expect("anneal generate");
    let err = user_error(&out);
    assert!(err.contains("`--device` = cuda:1"), "{err}");
}

#[test]
fn trains_and_generates_on_cuda_like_the_cpu() {
    if let Some(why) = no_gpu() {
        println!("SKIP trains_and_generates_on_cuda_like_the_cpu: {why}");
        return;
    }
    let job = Job::new("device-gpu");
    let steps = "training.steps=8";
    for (dtype, rel) in [("float32", 1e-4), ("bfloat16", 0.02)] {
        let d = format!("training.dtype=\"{dtype}\"");
        let (cpu, cpu_dir) = job.train(&format!("cpu-{dtype}"), &[steps, &d]);
        let (gpu, gpu_dir) =
            job.train(&format!("gpu-{dtype}"), &[steps, &d, "job.device=\"cuda\""]);
        ok(&cpu);
        ok(&gpu);
        assert_close(dtype, &loss_values(&gpu_dir), &loss_values(&cpu_dir), rel);
        let peak = rows(&gpu_dir)[0]["mem_peak_bytes"].as_u64().unwrap_or(0);
        assert!(peak > 0, "a GPU run reports the device pool's peak");
    }
    // The GPU run's checkpoint resumes on the CPU (the same files on either device) ...
    let gpu_dir = job.dir.join("gpu-float32");
    let (more, _) = job.train("gpu-float32", &["training.steps=10", "job.device=\"cpu\""]);
    ok(&more);
    assert!(
        String::from_utf8_lossy(&more.stdout).contains("resuming")
            || String::from_utf8_lossy(&more.stderr).contains("resuming"),
        "the CPU run resumed from the GPU checkpoint"
    );
    assert_eq!(loss_values(&gpu_dir).len(), 10);
    // ... and generation from it agrees on both devices (greedy).
    let hf = job.dir.join("hf");
    let out = anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(gpu_dir.join("checkpoints").join("step-10"))
        .output()
        .expect("export");
    ok(&out);
    let generate = |device: &str| -> serde_json::Value {
        let out = anneal()
            .args(["generate", "--model-dir"])
            .arg(&hf)
            .args(["--prompt-tokens", "5,17,42,9", "--max-new-tokens", "8"])
            .args(["--temperature", "0", "--device", device])
            .output()
            .expect("generate");
        ok(&out);
        serde_json::from_slice(&out.stdout).expect("JSON")
    };
    let (c, g) = (generate("cpu"), generate("cuda"));
    assert_eq!(g["device"], "cuda:0");
    assert_eq!(c["tokens"], g["tokens"], "greedy tokens, cpu vs cuda");
    let lp = |v: &serde_json::Value| -> Vec<f64> {
        v["logprobs"]
            .as_array()
            .expect("logprobs")
            .iter()
            .map(|x| x.as_f64().unwrap_or(f64::NAN))
            .collect()
    };
    for (a, b) in lp(&c).iter().zip(&lp(&g)) {
        assert!((a - b).abs() < 1e-3, "logprob cpu {a} vs cuda {b}");
    }
}

#[test]
fn rl_on_cuda_keeps_rollouts_and_trainer_bitwise_equal() {
    if let Some(why) = no_gpu() {
        println!("SKIP rl_on_cuda_keeps_rollouts_and_trainer_bitwise_equal: {why}");
        return;
    }
    let dir = rl_support::rl_job("cuda");
    let cuda = "job.device=\"cuda\"";
    let (out, done) = rl_support::rl(1, &dir, "gpu", &[cuda]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("cuda:0"),
        "the policy is on the GPU: {stdout}"
    );
    let steps = rl_support::steps(&done);
    assert_eq!(steps.len(), 4);
    for s in &steps {
        // Rollouts (decode with a KV cache) and the trainer's forward (the whole batch) give
        // the same logprobs bit for bit: batch-invariant products and attention on the GPU.
        assert_eq!(s["logprob_mismatch_max"].as_f64(), Some(0.0), "{s}");
        assert!(s["loss"].as_f64().is_some_and(f64::is_finite), "{s}");
    }
    // Same seed and config on the GPU: a run continued from its step-2 checkpoint logs the same
    // losses bit for bit.
    rl_support::resumes_bitwise(1, &dir, &done, "gpu-resumed", &[cuda]);
    // The run's checkpoint continues on the CPU.
    let (out, cpu) = rl_support::rl(1, &dir, "gpu", &["job.device=\"cpu\"", "training.steps=5"]);
    ok(&out);
    assert_eq!(rl_support::steps(&cpu).len(), 5);
}

#[test]
fn the_model_families_train_on_cuda_like_the_cpu() {
    if let Some(why) = no_gpu() {
        println!("SKIP the_model_families_train_on_cuda_like_the_cpu: {why}");
        return;
    }
    let job = Job::new("device-families");
    // Tiny configs of each family: MoE routing and grouped products, sinks and sliding windows,
    // latent attention with multi-token prediction, DeepSeek-V4's compressed sparse attention,
    // the gated delta rule of Qwen3.5, Kimi Linear and Kimi K3 (its recurrence kernels),
    // and Kimi K3's latent experts and residual mixes.
    use anneal_tests::tiny;
    let families = [
        ("gpt_oss", "gpt_oss", tiny::GPT_OSS, None),
        ("deepseek_v3", "deepseek_v3", tiny::DEEPSEEK_V3, None),
        ("deepseek_v4", "deepseek_v4", tiny::DEEPSEEK_V4, None),
        ("qwen3_5", "qwen3_5", tiny::QWEN3_5, None),
        (
            "kimi_linear",
            "deepseek_v3",
            tiny::KIMI_LINEAR,
            Some("model.flavor=\"kimi_linear_debug\""),
        ),
        ("kimi_k3", "kimi_k3", tiny::KIMI_K3, None),
    ];
    // Two steps: the first update's effect shows in the second loss.
    let steps = ["training.steps=2", "checkpoint.interval=0"];
    for (name, plugin, args, flavor) in families {
        let config = job.config_with_model(name, plugin, args);
        let run = |run: &str, device: &str| {
            let dir = job.dir.join(format!("{name}-{run}"));
            let mut c = anneal();
            c.arg("train").arg(&config).arg("--run-dir").arg(&dir);
            for s in steps.iter().copied().chain(flavor).chain([device]) {
                c.args(["--set", s]);
            }
            ok(&c.output().expect("anneal train"));
            loss_values(&dir)
        };
        let (cpu, gpu) = (
            run("cpu", "job.device=\"cpu\""),
            run("gpu", "job.device=\"cuda\""),
        );
        assert_close(name, &gpu, &cpu, 1e-4);
    }
    // The llama plugin's Qwen3-MoE flavor.
    let moe = [
        "model.flavor=\"debugmodel_qwen3_moe\"",
        "model.args.moe.n_experts=4",
        "model.args.moe.expert_ffn_dim=16",
        steps[0],
        steps[1],
    ];
    let (cpu, cpu_dir) = job.train("qwen3-moe-cpu", &moe);
    let gpu_set: Vec<&str> = moe.iter().copied().chain(["job.device=\"cuda\""]).collect();
    let (gpu, gpu_dir) = job.train("qwen3-moe-gpu", &gpu_set);
    ok(&cpu);
    ok(&gpu);
    assert_close(
        "qwen3 moe",
        &loss_values(&gpu_dir),
        &loss_values(&cpu_dir),
        1e-4,
    );
}

#[test]
fn tf32_products_only_where_asked() {
    let job = Job::new("device-tf32");
    let steps = "training.steps=3";
    let tf32 = "training.allow_tf32=true";
    // The CPU has no TF32: the key changes nothing there.
    let (a, cpu) = job.train("cpu", &[steps]);
    let (b, cpu_tf32) = job.train("cpu-tf32", &[steps, tf32]);
    ok(&a);
    ok(&b);
    assert_eq!(losses(&cpu), losses(&cpu_tf32));
    if let Some(why) = no_gpu() {
        println!("SKIP tf32_products_only_where_asked on the GPU: {why}");
        return;
    }
    let cuda = "job.device=\"cuda\"";
    let (a, gpu) = job.train("gpu", &[steps, cuda]);
    let (b, gpu_tf32) = job.train("gpu-tf32", &[steps, cuda, tf32]);
    ok(&a);
    ok(&b);
    // TF32 rounds the products' inputs to 10 mantissa bits: other bits, the same curve.
    assert_ne!(losses(&gpu), losses(&gpu_tf32), "TF32 was used");
    assert_close("tf32", &loss_values(&gpu_tf32), &loss_values(&cpu), 1e-2);
}

/// A job on a GPU is sized against the GPU's memory, not the host's: a model whose weights,
/// gradients and AdamW state alone pass the (emulated) GPU's 16 GiB is refused before anything
/// is allocated, naming the device.
#[test]
fn the_memory_check_counts_the_gpus_memory() {
    if let Some(why) = no_gpu() {
        println!("SKIP the_memory_check_counts_the_gpus_memory: {why}");
        return;
    }
    let job = Job::new("device-memory");
    let (out, _) = job.train(
        "big",
        &[
            "model.args.dim=8192",
            "model.args.ffn_dim=32768",
            "job.device=\"cuda\"",
            "training.steps=1",
        ],
    );
    let err = user_error(&out);
    assert!(
        err.contains("the run needs about") && err.contains("the memory of cuda:0"),
        "{err}"
    );
}

/// What the emulated GPU logged to `ANNEAL_CUDA_EMU_TRANSFER_LOG` during a run: the sizes of its
/// device→host copies and how often the host waited for the device.
struct Transfers {
    copies: Vec<usize>,
    waits: usize,
}

/// `anneal train config` of `steps` steps on the emulated GPU, with its transfers logged.
fn transfers_of(job: &Job, config: &Path, run: &str, steps: u64, set: &[&str]) -> Transfers {
    let log = job.dir.join(format!("{run}.transfers"));
    let run_dir = job.dir.join(run);
    let steps = format!("training.steps={steps}");
    let mut sets = vec![
        steps.as_str(),
        "job.device=\"cuda\"",
        "metrics.eval_freq=0",
        "metrics.log_freq=1",
        "checkpoint.interval=0",
    ];
    sets.extend_from_slice(set);
    let mut c = anneal();
    c.arg("train").arg(config).arg("--run-dir").arg(&run_dir);
    for s in sets {
        c.args(["--set", s]);
    }
    ok(&c
        .env("ANNEAL_CUDA_EMU_TRANSFER_LOG", &log)
        .output()
        .expect("anneal train"));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    Transfers {
        copies: text
            .lines()
            .filter_map(|l| l.strip_prefix("dtoh "))
            .map(|n| n.parse().expect("a byte count"))
            .collect(),
        waits: text.lines().filter(|l| l.starts_with("wait ")).count(),
    }
}

/// A training step on the GPU never waits for the device mid-step: two more steps of the same
/// run (on the emulator, which logs every device→host copy and host wait) add exactly one
/// copy each, of the logged scalars (the micro-batch losses and the gradient norm's
/// per-parameter parts, read together), and one wait each: the token ids and targets are
/// checked on their host copies, the loss's mean and the gradient norm's parts are computed on
/// the device, and uploads do not wait. In f32 and in bf16 with full recompute, two
/// micro-batches per step; for Qwen3.5, whose gated delta rule runs as CUDA kernels; and for
/// the MoE models (Qwen3-MoE, DeepSeek-V3 with group-limited routing and the aux-loss-free
/// bias, GPT-OSS with expert biases, DeepSeek-V4 with its gathered sparse attention on the
/// device), whose routing is sorted, counted and multiplied on the device and whose router
/// statistics come back in the step's one copy.
#[test]
fn a_gpu_step_copies_back_only_its_logged_scalars() {
    if let Some(why) = no_gpu() {
        println!("SKIP a_gpu_step_copies_back_only_its_logged_scalars: {why}");
        return;
    }
    if !common::cuda_backend_line().contains("emulation") {
        println!(
            "SKIP a_gpu_step_copies_back_only_its_logged_scalars: counts copies on the emulator"
        );
        return;
    }
    let job = Job::new("gpu-transfers");
    let qwen3_5 = job.config_with_model("qwen3_5", "qwen3_5", anneal_tests::tiny::QWEN3_5);
    let deepseek_v3 = job.config_with_model(
        "deepseek_v3",
        "deepseek_v3",
        anneal_tests::tiny::DEEPSEEK_V3,
    );
    let gpt_oss = job.config_with_model("gpt_oss", "gpt_oss", anneal_tests::tiny::GPT_OSS);
    let deepseek_v4 = job.config_with_model(
        "deepseek_v4",
        "deepseek_v4",
        anneal_tests::tiny::DEEPSEEK_V4,
    );
    for (name, config, set) in [
        ("f32", job.config(), &["training.micro_batch_size=2"][..]),
        (
            "bf16",
            job.config(),
            &[
                "training.micro_batch_size=2",
                "training.dtype=\"bfloat16\"",
                "activation_checkpoint.mode=\"full\"",
            ][..],
        ),
        ("qwen3_5", qwen3_5, &["training.micro_batch_size=2"][..]),
        (
            "qwen3_moe",
            job.config(),
            &[
                "training.micro_batch_size=2",
                "model.flavor=\"debugmodel_qwen3_moe\"",
            ][..],
        ),
        (
            "deepseek_v3",
            deepseek_v3,
            &["training.micro_batch_size=2"][..],
        ),
        ("gpt_oss", gpt_oss, &["training.micro_batch_size=2"][..]),
        (
            "deepseek_v4",
            deepseek_v4,
            &["training.micro_batch_size=2"][..],
        ),
    ] {
        let short = transfers_of(&job, &config, &format!("{name}-2"), 2, set);
        let long = transfers_of(&job, &config, &format!("{name}-4"), 4, set);
        // The runs differ by two steps alone (same setup, same final checkpoint).
        let mut extra = long.copies.clone();
        for c in &short.copies {
            let at = extra.iter().position(|e| e == c);
            extra.remove(at.unwrap_or_else(|| panic!("{name}: a copy of {c} bytes went missing")));
        }
        assert_eq!(
            extra.len(),
            2,
            "{name}: one device→host copy per step, got {extra:?} for two steps"
        );
        assert_eq!(extra[0], extra[1], "{name}: the same scalars every step");
        let scalars = extra[0] / 4;
        assert!(
            extra[0].is_multiple_of(4) && (3..=256).contains(&scalars),
            "{name}: the copy holds a few f32 scalars (2 losses, the norm's parts, the model's statistics), got {} bytes",
            extra[0]
        );
        assert_eq!(
            long.waits - short.waits,
            2,
            "{name}: the host waits for the device once per step"
        );
    }
}

/// `anneal train --profile` on the GPU times each op with the device's events and prints, beside
/// each, what the roofline allows it (FLOPs and bytes against the device's peaks); profiling
/// changes no number of the run.
#[test]
fn a_gpu_profile_has_device_times_and_the_roofline() {
    if let Some(why) = no_gpu() {
        println!("SKIP a_gpu_profile_has_device_times_and_the_roofline: {why}");
        return;
    }
    let job = Job::new("gpu-profile");
    let set = [
        "training.steps=3",
        "job.device=\"cuda\"",
        "training.dtype=\"bfloat16\"",
    ];
    let (plain, plain_dir) = job.train("plain", &set);
    ok(&plain);
    let run_dir = job.dir.join("profiled");
    let mut c = anneal();
    c.arg("train")
        .arg(job.config())
        .arg("--run-dir")
        .arg(&run_dir)
        .arg("--profile=1");
    for s in set {
        c.args(["--set", s]);
    }
    ok(&c.output().expect("anneal train --profile"));
    assert_eq!(
        losses(&run_dir),
        losses(&plain_dir),
        "profiling changes no number"
    );
    let table = std::fs::read_to_string(run_dir.join("profile/table.txt")).expect("the table");
    let device = table
        .split_once("device time per op on ")
        .unwrap_or_else(|| panic!("no device section in\n{table}"))
        .1;
    for needle in [
        "roofline at",
        "TFLOP/s bf16 tensor",
        "GB/s",
        "roofline ms",
        "% peak",
    ] {
        assert!(device.contains(needle), "no `{needle}` in\n{table}");
    }
    // Each row: op, phase, calls, ms, GFLOP, MB, roofline ms, % of it, bound.
    let row = |op: &str, phase: &str| -> Vec<String> {
        device
            .lines()
            .map(|l| {
                l.split('|')
                    .map(|c| c.trim().to_string())
                    .collect::<Vec<_>>()
            })
            .find(|c| c.len() > 9 && c[1] == op && c[2] == phase)
            .unwrap_or_else(|| panic!("no `{op}` row in phase {phase} in\n{table}"))
    };
    let num = |c: &str| -> f64 { c.parse().unwrap_or_else(|_| panic!("`{c}` is a number")) };
    for (op, phase, bound) in [
        ("matmul", "forward", None),
        ("matmul", "backward", None),
        ("attention", "forward", None),
        ("attention_backward", "backward", None),
        ("adamw", "optimizer", Some("memory")),
        ("rms_norm", "forward", Some("memory")),
    ] {
        let c = row(op, phase);
        assert!(num(&c[3]) >= 1.0, "{op}: calls per step in {c:?}");
        assert!(num(&c[4]) > 0.0, "{op}: device time in {c:?}");
        assert!(num(&c[5]) > 0.0 || op == "adamw", "{op}: FLOPs in {c:?}");
        assert!(num(&c[6]) > 0.0, "{op}: bytes in {c:?}");
        assert!(num(&c[7]) > 0.0, "{op}: the roofline's time in {c:?}");
        if let Some(b) = bound {
            assert_eq!(c[9], b, "{op}: bound in {c:?}");
        }
    }
    // The gradient norm's one read of the device is in its own phase.
    assert!(table.contains("grad_norm"), "{table}");
    // Qwen3.5's gated delta rule has its rows too.
    let qwen3_5 = job.config_with_model("qwen3_5", "qwen3_5", anneal_tests::tiny::QWEN3_5);
    let run_dir = job.dir.join("qwen3_5-profiled");
    let out = anneal()
        .arg("train")
        .arg(&qwen3_5)
        .arg("--run-dir")
        .arg(&run_dir)
        .args([
            "--profile=1",
            "--set",
            "training.steps=3",
            "--set",
            "job.device=\"cuda\"",
        ])
        .output()
        .expect("anneal train --profile");
    ok(&out);
    let table = std::fs::read_to_string(run_dir.join("profile/table.txt")).expect("the table");
    for needle in [
        "| delta_rule                   | forward",
        "| delta_rule_backward",
    ] {
        assert!(table.contains(needle), "no `{needle}` in\n{table}");
    }
}
