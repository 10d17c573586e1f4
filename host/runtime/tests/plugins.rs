//! Loading real plugin libraries: discovery, version and file checks, optimizer steps against
//! reference formulas.

use anneal_engine::Tensor;
use anneal_plugin_api::abi::PluginKind;
mod common;

use anneal_runtime::plugins::{discover, load, PluginError, PluginOptimizer};
use common::{plugin, plugin_dir};
use std::path::Path;

#[test]
fn discovers_optimizer_plugins_with_their_info() {
    let found: Vec<_> = discover(&[plugin_dir().to_path_buf()])
        .into_iter()
        .collect();
    let names: Vec<String> = found
        .iter()
        .flatten()
        .map(|p| p.name().to_string())
        .collect();
    assert!(
        names.contains(&"adamw".to_string()) && names.contains(&"sgd".to_string()),
        "{names:?}"
    );
    assert!(
        found.iter().all(|r| r.is_ok()),
        "only anneal_plugin_* files are discovered, and they all load"
    );
    let a = plugin("adamw");
    assert_eq!(a.kind(), PluginKind::Optimizer);
    assert_eq!(a.info.api_version, anneal_plugin_api::API_VERSION);
    assert_eq!(
        a.info
            .flavors
            .iter()
            .map(|f| f.to_string())
            .collect::<Vec<_>>(),
        vec!["default"]
    );
}

fn reference_adamw(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], t: i32, lr: f64) {
    let (b1, b2, eps, wd) = (0.9, 0.999, 1e-8, 0.01);
    for i in 0..p.len() {
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        let mh = m[i] / (1.0 - b1.powi(t));
        let vh = v[i] / (1.0 - b2.powi(t));
        p[i] = p[i] * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + eps);
    }
}

#[test]
fn adamw_steps_match_the_reference_formula() {
    let inst = plugin("adamw")
        .create(
            None,
            &serde_json::json!({"betas": [0.9, 0.999], "weight_decay": 0.01}),
        )
        .unwrap();
    let mut opt = PluginOptimizer::new("adamw", inst).unwrap();
    assert_eq!(opt.spec().state.len(), 2);
    let init = [0.5f32, -1.0, 2.0, 0.0];
    let p = Tensor::from_slice(&init, &[2, 2]).unwrap().requires_grad_();
    let (mut rp, mut rm, mut rv) = (init.map(|x| x as f64).to_vec(), vec![0.0; 4], vec![0.0; 4]);
    for t in 1..=3 {
        let grads = [0.1f32 * t as f32, -0.2, 0.3, 1.0];
        p.set_grad(Some(Tensor::from_slice(&grads, &[2, 2]).unwrap()))
            .unwrap();
        opt.step(&[("w".to_string(), p.clone())], t as u64, 1e-2)
            .unwrap();
        reference_adamw(&mut rp, &grads.map(|x| x as f64), &mut rm, &mut rv, t, 1e-2);
    }
    for (a, b) in p.to_vec_f32().iter().zip(&rp) {
        assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
    }
    assert_eq!(opt.state().len(), 2);
}

#[test]
fn sgd_nesterov_matches_the_reference_formula() {
    let inst = plugin("sgd")
        .create(
            Some("default"),
            &serde_json::json!({"momentum": 0.5, "nesterov": true, "weight_decay": 0.1}),
        )
        .unwrap();
    let mut opt = PluginOptimizer::new("sgd", inst).unwrap();
    let p = Tensor::from_slice(&[1.0f32, -2.0], &[2])
        .unwrap()
        .requires_grad_();
    let (mut rp, mut buf) = (vec![1.0f64, -2.0], vec![0.0f64; 2]);
    for t in 1..=3u64 {
        let g = [0.5f32, 0.25 * t as f32];
        p.set_grad(Some(Tensor::from_slice(&g, &[2]).unwrap()))
            .unwrap();
        opt.step(&[("w".to_string(), p.clone())], t, 0.1).unwrap();
        for i in 0..2 {
            let gi = g[i] as f64 + 0.1 * rp[i];
            buf[i] = if t == 1 { gi } else { 0.5 * buf[i] + gi };
            rp[i] -= 0.1 * (gi + 0.5 * buf[i]);
        }
    }
    for (a, b) in p.to_vec_f32().iter().zip(&rp) {
        assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
fn bad_arguments_are_refused_with_the_plugin_name() {
    let err = plugin("adamw")
        .create(None, &serde_json::json!({"betaz": [0.9, 0.9]}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("adamw") && err.contains("betaz"), "{err}");
    let err = plugin("sgd")
        .create(Some("huge"), &serde_json::json!({}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown flavor 'huge'"), "{err}");
}

#[test]
fn a_plugin_for_another_api_version_is_refused_naming_both_versions() {
    let path = plugin_dir().join("libanneal_testplugin_bad_api.so");
    let err = load(&path).unwrap_err();
    assert!(matches!(err, PluginError::ApiVersion { .. }), "{err}");
    let msg = err.to_string();
    let (v, v1) = (
        anneal_plugin_api::API_VERSION,
        anneal_plugin_api::API_VERSION + 1,
    );
    assert!(
        msg.contains("libanneal_testplugin_bad_api.so")
            && msg.contains(&format!("version {v1}"))
            && msg.contains(&format!("version {v}")),
        "{msg}"
    );
}

#[test]
fn garbage_and_foreign_libraries_give_clear_errors() {
    let dir = std::env::temp_dir().join(format!("anneal-plugin-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("libanneal_plugin_junk.so");
    std::fs::write(&junk, b"not a shared library").unwrap();
    let msg = load(&junk).unwrap_err().to_string();
    assert!(
        msg.contains("libanneal_plugin_junk.so") && msg.contains("cannot open"),
        "{msg}"
    );
    // Discovery reports the broken file instead of failing or skipping silently.
    let found = discover(std::slice::from_ref(&dir));
    assert_eq!(found.len(), 1);
    assert!(found[0].is_err());
    // A real shared library that is not a plugin.
    let foreign = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
    ]
    .iter()
    .map(Path::new)
    .find(|p| p.exists());
    if let Some(lib) = foreign {
        let err = load(lib).unwrap_err();
        assert!(matches!(err, PluginError::NotAPlugin { .. }), "{err}");
        assert!(err.to_string().contains("not an Anneal plugin"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plugin_of_the_wrong_kind_is_refused_by_name() {
    use anneal_runtime::plugins::PluginModel;
    let inst = plugin("adamw")
        .create(None, &serde_json::json!({}))
        .unwrap();
    let err = PluginModel::new("adamw", inst)
        .err()
        .expect("an optimizer is not a model")
        .to_string();
    assert!(
        err.contains("adamw") && err.contains("not a model"),
        "{err}"
    );
    let inst = plugin("llama")
        .create(Some("debugmodel"), &serde_json::json!({}))
        .unwrap();
    let err = PluginOptimizer::new("llama", inst)
        .err()
        .expect("a model is not an optimizer")
        .to_string();
    assert!(
        err.contains("llama") && err.contains("not an optimizer"),
        "{err}"
    );
}

/// Runs `f` on a thread and fails the test if it has not returned within 20 s (a FIFO opened as
/// a library blocks for ever).
fn within_20s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} did not return within 20 s"))
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo")
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn discovery_opens_only_regular_files() {
    let dir = std::env::temp_dir().join(format!("anneal-plugin-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("libanneal_plugin_folder.so")).unwrap();
    mkfifo(&dir.join("libanneal_plugin_x.so"));
    std::os::unix::fs::symlink(
        plugin_dir().join("libanneal_plugin_adamw.so"),
        dir.join("libanneal_plugin_adamw.so"),
    )
    .unwrap();
    let dirs = vec![dir.clone()];
    let found = within_20s("discover", move || {
        discover(&dirs)
            .into_iter()
            .map(|r| r.map(|p| p.name().to_string()).map_err(|e| e.to_string()))
            .collect::<Vec<_>>()
    });
    assert_eq!(
        found,
        vec![Ok("adamw".to_string())],
        "a link to a library is followed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finding_a_plugin_opens_only_its_own_file() {
    use anneal_runtime::plugins::find_in;
    let dir = std::env::temp_dir().join(format!("anneal-plugin-find-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Neither a broken library nor a FIFO next to the plugin asked for is opened.
    std::fs::write(dir.join("libanneal_plugin_junk.so"), b"not a library").unwrap();
    mkfifo(&dir.join("libanneal_plugin_x.so"));
    let real = plugin_dir().join("libanneal_plugin_adamw.so");
    std::os::unix::fs::symlink(&real, dir.join("libanneal_plugin_adamw.so")).unwrap();
    std::os::unix::fs::symlink(&real, dir.join("libanneal_plugin_other.so")).unwrap();
    let dirs = vec![dir.clone()];
    let (found, missing, misnamed) = within_20s("find", move || {
        (
            find_in(&dirs, "adamw").map(|p| p.name().to_string()),
            find_in(&dirs, "nope").map(|p| p.name().to_string()),
            find_in(&dirs, "other").map(|p| p.name().to_string()),
        )
    });
    assert_eq!(found.unwrap(), "adamw");
    let e = missing.unwrap_err();
    assert!(matches!(e, PluginError::NotFound { .. }), "{e}");
    assert!(e.to_string().contains("found: adamw, junk, other"), "{e}");
    let e = misnamed.unwrap_err();
    assert!(matches!(e, PluginError::Named { .. }), "{e}");
    assert!(e.to_string().contains("declares plugin 'adamw'"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn model_plugins_are_found_by_the_hugging_face_model_types_they_declare() {
    use anneal_runtime::plugins::find_for_model_type_in;
    let dirs = [plugin_dir().to_path_buf()];
    for (t, want) in [
        ("llama", "llama"),
        ("qwen3", "llama"),
        ("qwen3_moe", "llama"),
        ("mixtral", "llama"),
        ("qwen3_vl", "llama"),
        ("qwen3_vl_moe", "llama"),
        ("gpt_oss", "gpt_oss"),
        ("deepseek_v3", "deepseek_v3"),
        ("kimi_k2", "deepseek_v3"),
        ("kimi_linear", "deepseek_v3"),
    ] {
        let p = find_for_model_type_in(&dirs, t).unwrap();
        assert_eq!(p.name(), want, "{t}");
    }
    assert_eq!(plugin("adamw").model_types().count(), 0);
    let err = find_for_model_type_in(&dirs, "falcon_h1").unwrap_err();
    assert!(matches!(err, PluginError::NoModelType { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("'falcon_h1'")
            && msg.contains("llama (llama, qwen3, qwen3_moe, mixtral, qwen3_vl, qwen3_vl_moe)"),
        "{msg}"
    );
}

#[test]
fn auxiliary_losses_and_statistics_come_back_beside_the_logits() {
    use anneal_runtime::plugins::{ForwardOpts, PluginModel};
    let path = plugin_dir().join(format!(
        "{}anneal_testplugin_bad_logits{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let p = load(&path).unwrap();
    let model = PluginModel::new(
        "badlogits",
        p.create(Some("aux"), &serde_json::json!({})).unwrap(),
    )
    .unwrap();
    let params: std::collections::HashMap<String, Tensor> = model
        .init_params(1)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.requires_grad_()))
        .collect();
    let params = std::sync::Arc::new(params);
    let tokens = Tensor::from_vec(vec![1i64, 2, 3, 4], &[1, 4]).unwrap();
    let positions = Tensor::from_vec(vec![0i64, 1, 2, 3], &[4]).unwrap();
    let opts = ForwardOpts {
        training: true,
        ..Default::default()
    };
    let out = model
        .forward_full(&params, &tokens, &positions, &opts)
        .unwrap();
    assert_eq!(out.logits.shape(), &[1, 4, 320]);
    let names = |v: &[(String, Tensor)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&out.aux_losses), ["l2"]);
    assert_eq!(names(&out.stats), ["hidden_mean"]);
    assert_eq!(out.stats[0].1.shape(), &[8]);
    // The auxiliary loss trains the embedding it was computed from.
    out.aux_losses[0].1.backward().unwrap();
    let g = params["embedding"].grad().expect("a gradient").to_vec_f32();
    assert!(g.iter().any(|x| *x != 0.0));
    // Recomputing the block keeps the loss's gradient: the same loss and embedding gradient.
    let recompute = ForwardOpts {
        recompute_every: 1,
        ..opts.clone()
    };
    let g_plain = g;
    params["embedding"].zero_grad();
    let again = model
        .forward_full(&params, &tokens, &positions, &recompute)
        .unwrap();
    assert_eq!(
        again.aux_losses[0].1.to_vec_f32(),
        out.aux_losses[0].1.to_vec_f32()
    );
    again.aux_losses[0].1.backward().unwrap();
    let g = params["embedding"].grad().expect("a gradient").to_vec_f32();
    assert_eq!(g, g_plain);
}
