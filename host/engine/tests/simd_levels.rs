//! Every SIMD level gives the same results: this test runs itself again with `ANNEAL_SIMD`
//! forcing each level the CPU has (the level is chosen once per process), and compares what
//! each run computes: elementwise kernels bit for bit, matrix products (the packed AVX-512
//! kernel against `gemm`'s AVX2 and scalar paths, bf16 dot products against conversion + f32)
//! to rounding.

mod common;

use anneal_engine::ops::{adamw_step, AdamW, AdamWTensors};
use anneal_engine::{DType, Tensor};
use common::randn;
use std::process::Command;

const OUT_VAR: &str = "ANNEAL_SIMD_LEVEL_OUT";

/// What each level computes: (name, values, exact?).
fn suite() -> Vec<(String, Vec<f32>, bool)> {
    let mut out = Vec::new();
    for (m, k, n, at, bt) in [
        (64, 300, 96, false, true),
        (130, 70, 45, true, false),
        (2, 40, 33, false, false),
    ] {
        let a = if at {
            randn(&[k, m], "sa").transpose(0, 1).unwrap()
        } else {
            randn(&[m, k], "sa")
        };
        let b = if bt {
            randn(&[n, k], "sb").transpose(0, 1).unwrap()
        } else {
            randn(&[k, n], "sb")
        };
        out.push((
            format!("matmul {m}x{k}x{n}"),
            a.matmul(&b).unwrap().to_vec_f32(),
            false,
        ));
    }
    // bf16 products: AVX512-BF16 dot products natively, conversion + f32 at the other levels.
    let a = randn(&[40, 301], "ba").to_dtype(DType::BF16).unwrap();
    let b = randn(&[301, 50], "bb").to_dtype(DType::BF16).unwrap();
    out.push((
        "bf16 matmul".into(),
        a.matmul(&b).unwrap().to_vec_f32(),
        false,
    ));
    let x = randn(&[1000], "sx");
    out.push(("silu".into(), x.silu().unwrap().to_vec_f32(), true));
    out.push(("exp".into(), x.exp().unwrap().to_vec_f32(), true));
    let p = randn(&[999], "sp");
    let (m, v) = (
        Tensor::zeros(&[999], DType::F32),
        Tensor::zeros(&[999], DType::F32),
    );
    let g = randn(&[999], "sg");
    let hp = AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    adamw_step(
        &[AdamWTensors {
            param: &p,
            grad: &g,
            exp_avg: &m,
            exp_avg_sq: &v,
        }],
        &hp,
    )
    .unwrap();
    out.push(("adamw".into(), p.to_vec_f32(), true));
    out
}

fn encode(rows: &[(String, Vec<f32>, bool)]) -> String {
    rows.iter()
        .map(|(n, v, _)| {
            let bits: Vec<String> = v.iter().map(|x| x.to_bits().to_string()).collect();
            format!("{n}:{}", bits.join(","))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_simd_level_computes_the_same() {
    if let Ok(path) = std::env::var(OUT_VAR) {
        // The child run: report the level in force and the suite's results.
        let text = format!("{:?}\n{}", anneal_engine::simd_level(), encode(&suite()));
        std::fs::write(path, text).unwrap();
        return;
    }
    let native = suite();
    let mut levels = vec!["baseline"];
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        levels.push("avx2");
    }
    for level in levels {
        let path = std::env::temp_dir().join(format!("anneal-simd-{}-{level}", std::process::id()));
        let status = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "every_simd_level_computes_the_same",
                "--test-threads",
                "1",
            ])
            .env("ANNEAL_SIMD", level)
            .env(OUT_VAR, &path)
            .status()
            .unwrap();
        assert!(status.success(), "the {level} run failed");
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let (got_level, body) = text.split_once('\n').unwrap();
        let want_level = if level == "avx2" { "Avx2" } else { "Baseline" };
        assert_eq!(
            got_level, want_level,
            "ANNEAL_SIMD={level} was not in force"
        );
        for (line, (name, want, exact)) in body.lines().zip(&native) {
            let (n, vals) = line.split_once(':').unwrap();
            assert_eq!(n, name);
            let got: Vec<f32> = vals
                .split(',')
                .map(|b| f32::from_bits(b.parse().unwrap()))
                .collect();
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                if *exact {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{name}[{i}] at {level}: {g} vs {w}"
                    );
                } else {
                    // f32 sums in another order; bf16 results may round one ulp (2^-8) apart.
                    let tol = if name.starts_with("bf16") { 8e-3 } else { 1e-4 };
                    assert!(
                        (g - w).abs() <= tol * (1.0 + w.abs()),
                        "{name}[{i}] at {level}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
