//! Prints calls per second of fresh-store scoring (figures, not assertions), one thread and
//! the batch pool, for the example reward modules that exist (WAT always; the others once
//! `reward-wasm/build-examples.sh` has run). Run with `bash bench/reward_bench.sh`.

use anneal_reward::{Sandbox, SandboxConfig, ScoreInput};
use std::path::Path;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../reward-wasm");
    let sandbox = Sandbox::new(SandboxConfig {
        cache_dir: Some(root.join("out/.cache")),
        ..SandboxConfig::default()
    })?;
    let input = ScoreInput {
        prompt: "What is 6*7? Think step by step.".into(),
        completion: "6*7 is 6 sevens: 7, 14, 21, 28, 35, 42. Answer: 42".into(),
        metadata: serde_json::json!({"answer": "42"}),
    };
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    println!(
        "{:<16} {:>12} {:>14} {:>16} {:>10}",
        "module",
        "load ms",
        "calls/s (1 thr)",
        &format!("calls/s ({} thr)", sandbox.threads()),
        "fuel/call"
    );
    for (lang, file) in [
        ("wat", "examples/wat/reward.wat"),
        ("rust", "out/rust.wasm"),
        ("c", "out/c.wasm"),
        ("zig", "out/zig.wasm"),
        ("assemblyscript", "out/assemblyscript.wasm"),
        ("go", "out/go.wasm"),
        ("js", "out/js.wasm"),
        ("python", "out/python.wasm"),
    ] {
        let path = root.join(file);
        if !path.exists() {
            println!("{lang:<16} (not built)");
            continue;
        }
        let start = Instant::now();
        let module = sandbox.load_file(&path)?;
        let load_ms = start.elapsed().as_secs_f64() * 1e3;
        // Big modules are slow per call: scale the count down so the bench stays short.
        let calls = if std::fs::metadata(&path)?.len() > 1 << 20 {
            n / 20
        } else {
            n
        }
        .max(1);
        let first = sandbox.score(&module, &input);
        let start = Instant::now();
        for _ in 0..calls {
            sandbox.score(&module, &input);
        }
        let single = calls as f64 / start.elapsed().as_secs_f64();
        let batch: Vec<ScoreInput> = (0..calls).map(|_| input.clone()).collect();
        let start = Instant::now();
        let outs = sandbox.score_batch(&module, &batch);
        let pooled = calls as f64 / start.elapsed().as_secs_f64();
        let ok = outs.iter().all(|o| o.result == first.result);
        println!(
            "{lang:<16} {load_ms:>12.1} {single:>14.0} {pooled:>16.0} {:>10}{}",
            first.fuel_used,
            if ok { "" } else { "  (outcomes differ!)" }
        );
    }
    Ok(())
}
