//! Layering, key paths in errors, and the printed TOML round trip.

use anneal_config::{resolve_with_env, Decay, JobConfig, Source};
use std::path::PathBuf;

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("anneal-config-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn set(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn layers_override_in_order() {
    let p = write(
        "layers",
        "[training]\nsteps = 10\nseq_len = 64\n[optimizer]\nlr = 1e-3\n",
    );
    let env = vec![
        ("ANNEAL_TRAINING__STEPS".to_string(), "20".to_string()),
        ("ANNEAL_PLUGIN_PATH".to_string(), "/x".to_string()),
    ];
    let c = resolve_with_env(Source::File(&p), &set(&["training.steps=30"]), &env).unwrap();
    assert_eq!(c.training.steps, 30, "--set beats env");
    assert_eq!(c.training.seq_len, 64, "file beats defaults");
    assert_eq!(c.optimizer.lr, 1e-3);
    assert_eq!(c.training.batch_size, 8, "defaults fill the rest");
    let c = resolve_with_env(Source::File(&p), &[], &env).unwrap();
    assert_eq!(c.training.steps, 20, "env beats the file");
}

#[test]
fn override_values_are_typed() {
    let c = resolve_with_env(
        Source::Defaults,
        &set(&[
            "optimizer.args.betas=[0.9, 0.99]",
            "data.path=some/dir with space",
            "lr_scheduler.decay=wsd",
            "model.args={dim = 64, n_layers = 2}",
            "checkpoint.async=false",
        ]),
        &[],
    )
    .unwrap();
    assert_eq!(c.optimizer.args["betas"], serde_json::json!([0.9, 0.99]));
    assert_eq!(c.data.path, "some/dir with space");
    assert_eq!(c.lr_scheduler.decay, Decay::Wsd);
    assert_eq!(c.model.args["dim"], serde_json::json!(64));
    assert!(!c.checkpoint.async_save);
}

#[test]
fn unknown_key_names_path_and_file() {
    let p = write("unknown", "[training]\nstepz = 10\n");
    let e = resolve_with_env(Source::File(&p), &[], &[]).unwrap_err();
    assert_eq!(e.key_path.as_deref(), Some("training.stepz"));
    let line = e.to_string();
    assert!(
        line.contains("training.stepz") && line.contains(&p.display().to_string()),
        "{line}"
    );
    assert!(!line.contains('\n'));

    let e = resolve_with_env(Source::Defaults, &set(&["nosuch.section=1"]), &[]).unwrap_err();
    assert_eq!(e.key_path.as_deref(), Some("nosuch"));
    assert!(e.to_string().contains("--set nosuch.section=1"), "{e}");
}

#[test]
fn wrong_type_names_path() {
    let p = write("wrongtype", "[training]\nsteps = \"many\"\n");
    let e = resolve_with_env(Source::File(&p), &[], &[]).unwrap_err();
    assert_eq!(e.key_path.as_deref(), Some("training.steps"));
    let e = resolve_with_env(
        Source::Defaults,
        &[],
        &[("ANNEAL_TRAINING__SEQ_LEN".into(), "long".into())],
    )
    .unwrap_err();
    assert_eq!(e.key_path.as_deref(), Some("training.seq_len"));
    assert!(e.to_string().contains("environment"), "{e}");
}

#[test]
fn bad_values_and_relations() {
    for (set_, key) in [
        ("training.micro_batch_size=3", "training.batch_size"),
        ("training.steps=0", "training.steps"),
        ("optimizer.lr=-1.0", "optimizer.lr"),
        ("parallelism.tp_sequence=true", "parallelism.tp_sequence"),
        ("parallelism.dp_shard=-1", "parallelism.dp_shard"),
        ("parallelism.cp=-1", "parallelism.cp"),
        ("parallelism.dp_replicate=0", "parallelism.dp_replicate"),
        ("data.val_fraction=0.9", "data.val_fraction"),
    ] {
        let e = resolve_with_env(Source::Defaults, &set(&[set_]), &[]).unwrap_err();
        assert_eq!(e.key_path.as_deref(), Some(key), "{set_}: {e}");
    }
    let e = resolve_with_env(
        Source::Defaults,
        &[],
        &[("ANNEAL_TRAINING_STEPS".into(), "5".into())],
    )
    .unwrap_err();
    assert!(e.to_string().contains("ANNEAL_TRAINING__STEPS"), "{e}");
    let e = resolve_with_env(Source::Defaults, &set(&["no_equals"]), &[]).unwrap_err();
    assert!(e.to_string().contains("section.key=value"), "{e}");
    let e = resolve_with_env(Source::File("/nonexistent/x.toml".as_ref()), &[], &[]).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/x.toml"), "{e}");
}

#[test]
fn printed_toml_resolves_to_the_same_config() {
    let c = resolve_with_env(
        Source::Defaults,
        &set(&["model.args.dim=64", "checkpoint.load_step=7", "job.name=x"]),
        &[],
    )
    .unwrap();
    let text = c.to_toml();
    let back = resolve_with_env(
        Source::Text {
            text: &text,
            name: "printed",
        },
        &[],
        &[],
    )
    .unwrap();
    assert_eq!(back, c);
    assert_eq!(
        resolve_with_env(Source::Defaults, &[], &[]).unwrap(),
        JobConfig::default()
    );
    let e = resolve_with_env(
        Source::Text {
            text: "[job]\nnam = 1",
            name: "form",
        },
        &[],
        &[],
    )
    .unwrap_err();
    assert_eq!(e.origin.as_deref(), Some("form"));
}

#[test]
fn toml_syntax_errors_are_one_line() {
    let e = resolve_with_env(
        Source::Text {
            text: "[training]\nsteps = = 3\n",
            name: "form",
        },
        &[],
        &[],
    )
    .unwrap_err();
    let line = e.to_string();
    assert!(!line.contains('\n'), "{line}");
    assert!(line.contains("form"), "{line}");
}

#[test]
fn non_finite_plugin_arguments_name_the_key() {
    for (set_, key) in [
        ("model.args.dim=nan", "model.args.dim"),
        ("model.args={rope = {theta = inf}}", "model.args.rope.theta"),
        (
            "optimizer.args.betas=[0.9, -inf]",
            "optimizer.args.betas[1]",
        ),
    ] {
        let e = resolve_with_env(Source::Defaults, &set(&[set_]), &[]).unwrap_err();
        assert_eq!(e.key_path.as_deref(), Some(key), "{set_}: {e}");
        assert!(e.to_string().contains("finite"), "{e}");
    }
    let text = "[optimizer]\nargs = { eps = nan }\n";
    let e = resolve_with_env(Source::Text { text, name: "form" }, &[], &[]).unwrap_err();
    assert_eq!(e.key_path.as_deref(), Some("optimizer.args.eps"), "{e}");
}

#[test]
fn job_name_stays_inside_runs() {
    for bad in [
        "../../x", "a/b", "/tmp/x", "..", ".hidden", "a\\\\b", "\"\"",
    ] {
        let e = resolve_with_env(Source::Defaults, &set(&[&format!("job.name={bad}")]), &[])
            .unwrap_err();
        assert_eq!(e.key_path.as_deref(), Some("job.name"), "{bad}: {e}");
    }
    let c = resolve_with_env(Source::Defaults, &set(&["job.name=my run-2.b"]), &[]).unwrap();
    assert_eq!(c.job.name, "my run-2.b");
}

#[test]
fn wrong_types_say_wrong_type_and_parse_errors_drop_the_quoted_line() {
    let e = resolve_with_env(Source::Defaults, &set(&["training.steps=\"abc\""]), &[]).unwrap_err();
    let line = e.to_string();
    assert!(
        line.contains("wrong type") && !line.contains("missing"),
        "{line}"
    );
    let e = resolve_with_env(
        Source::Text {
            text: "[training\nsteps = 1\n",
            name: "form",
        },
        &[],
        &[],
    )
    .unwrap_err();
    let line = e.to_string();
    assert!(line.contains("line 1, column 10"), "{line}");
    assert!(!line.contains("| [training"), "{line}");
}

#[test]
fn context_parallelism_needs_whole_chunks_and_runs_inside_pipeline_stages() {
    assert!(resolve_with_env(Source::Defaults, &set(&["parallelism.cp=2"]), &[]).is_ok());
    let e = resolve_with_env(
        Source::Defaults,
        &set(&["parallelism.cp=2", "training.seq_len=30"]),
        &[],
    )
    .unwrap_err();
    assert_eq!(e.key_path.as_deref(), Some("training.seq_len"), "{e}");
    assert!(e.to_string().contains("parallelism.cp"), "{e}");
    // Pipeline stages run their blocks on each rank's chunks (the trainer checks the rest).
    assert!(resolve_with_env(
        Source::Defaults,
        &set(&["parallelism.cp=2", "parallelism.pp=2"]),
        &[],
    )
    .is_ok());
}

#[test]
fn job_device_is_cpu_cuda_or_cuda_n() {
    let ok = |v: &str| resolve_with_env(Source::Defaults, &set(&[v]), &[]);
    assert_eq!(ok("job.device=cpu").expect("cpu").job.device, "cpu");
    assert_eq!(JobConfig::default().job.device, "cpu");
    for v in ["cuda", "cuda:0", "cuda:7"] {
        let c = ok(&format!("job.device={v}")).expect(v);
        assert_eq!(c.job.device, v);
    }
    assert_eq!(
        anneal_config::parse_device("cuda:3"),
        Some(anneal_config::DeviceName::Cuda(3))
    );
    for bad in ["gpu", "cuda:", "cuda:x", "cuda:+1", "CPU", "cuda0"] {
        let e = ok(&format!("job.device={bad}")).expect_err(bad).to_string();
        assert!(e.contains("`job.device`") && e.contains(bad), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
}

#[test]
fn a_group_of_one_is_refused_for_every_loss_that_compares_a_group() {
    for loss in ["grpo", "dr_grpo", "dapo"] {
        let over = set(&["rl.group_size=1", &format!("rl.loss=\"{loss}\"")]);
        let e = resolve_with_env(Source::Defaults, &over, &[]).unwrap_err();
        assert_eq!(e.key_path.as_deref(), Some("rl.group_size"), "{loss}: {e}");
        assert!(e.to_string().contains(loss), "{e}");
        assert!(e.to_string().contains("advantage is 0"), "{e}");
    }
    let ok = resolve_with_env(Source::Defaults, &set(&["rl.group_size=2"]), &[]).unwrap();
    assert_eq!(ok.rl.group_size, 2);
    assert!(!ok.rl.skip_long_prompts);
}
