//! `[fault_tolerance]`: off by default and then absent from the serialized config (a run that
//! does not use it records the same `config.toml` as before the section existed), its value
//! checks, and its unknown keys refused like every section's.

use anneal_config::{resolve_with_env, Source};

fn resolve(set: &[&str]) -> Result<anneal_config::JobConfig, String> {
    let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    resolve_with_env(Source::Defaults, &set, &[]).map_err(|e| e.to_string())
}

#[test]
fn off_by_default_and_left_out_of_the_serialized_config() {
    let c = resolve(&[]).unwrap();
    assert!(!c.fault_tolerance.enabled);
    assert_eq!(c.fault_tolerance.max_restarts, 3);
    assert!(!c.to_toml().contains("fault_tolerance"), "{}", c.to_toml());

    let on = resolve(&[
        "fault_tolerance.enabled=true",
        "fault_tolerance.max_restarts=2",
    ])
    .unwrap();
    assert!(on.fault_tolerance.enabled);
    let text = on.to_toml();
    assert!(text.contains("[fault_tolerance]"), "{text}");
    // What a run dir records reads back as the same config.
    let back = resolve_with_env(
        Source::Text {
            text: &text,
            name: "config.toml",
        },
        &[],
        &[],
    )
    .unwrap();
    assert_eq!(back, on);
}

#[test]
fn bad_values_and_unknown_keys_name_the_key() {
    let e = resolve(&[
        "fault_tolerance.enabled=true",
        "fault_tolerance.max_restarts=0",
    ])
    .unwrap_err();
    assert!(e.contains("fault_tolerance.max_restarts"), "{e}");
    let e = resolve(&["fault_tolerance.enabled=true", "checkpoint.interval=0"]).unwrap_err();
    assert!(
        e.contains("fault_tolerance.enabled") && e.contains("checkpoint.interval"),
        "{e}"
    );
    // Off, the checks do not apply: a run that never restarts needs no checkpoints.
    resolve(&["fault_tolerance.max_restarts=0", "checkpoint.interval=0"]).unwrap();
    let e = resolve(&["fault_tolerance.heal_from_peer=true"]).unwrap_err();
    assert!(e.contains("heal_from_peer"), "{e}");
    let env = [(
        "ANNEAL_FAULT_TOLERANCE__ENABLED".to_string(),
        "true".to_string(),
    )];
    let c = resolve_with_env(Source::Defaults, &[], &env).unwrap();
    assert!(c.fault_tolerance.enabled);
}
