//! Sharded checkpoints on disk: pieces written by several ranks read back whole and by rows,
//! equal to the same tensors saved whole; a missing shard or pieces that do not tile a tensor
//! are errors that name what is wrong.

use super::*;
use anneal_data::LoaderState;
use anneal_engine::{DType, Tensor};
use std::path::{Path, PathBuf};

fn state(step: u64) -> TrainState {
    TrainState {
        step,
        seed: 7,
        loader: LoaderState {
            epoch: 0,
            cursor: 3,
            mixture: None,
            stream: None,
        },
        lr: 1e-3,
        tokens: 128,
        elapsed_s: 1.5,
        model: "llama/debugmodel".into(),
        optimizer: "adamw".into(),
        config: String::new(),
        tokenizer_sha256: None,
        data_sha256: None,
        rl: None,
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("anneal-ckpt-unit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `w` [5, 3] f32, `e` [4, 2] bf16 and a scalar `s`.
fn whole() -> Vec<(String, Tensor)> {
    let w = Tensor::from_vec((0..15).map(|i| i as f32 * 0.5).collect(), &[5, 3]).unwrap();
    let e = Tensor::from_vec((0..8).map(|i| i as f32 - 3.0).collect(), &[4, 2])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    vec![
        ("model/w".into(), w),
        ("optim/w.m".into(), e),
        ("model/s".into(), Tensor::scalar(2.5)),
    ]
}

/// Rows `rows` of `t` as a tensor of their own.
fn rows_of(t: &Tensor, rows: std::ops::Range<usize>) -> Tensor {
    let v = t.narrow(0, rows.start, rows.len()).unwrap();
    Tensor::from_storage(
        anneal_engine::Storage::from_bytes(v.dtype(), &v.to_bytes()),
        v.shape(),
    )
    .unwrap()
}

/// Writes `whole()` as two ranks would under FSDP (rank 0: rows 0..3 of `w`, 0..2 of `e` and
/// the scalar; rank 1: the rest) and publishes step `step` under `root`.
fn write_two_ranks(root: &Path, step: u64) -> PathBuf {
    let t = whole();
    let (w, e, s) = (&t[0].1, &t[1].1, &t[2].1);
    let (w0, w1, e0, e1) = (
        rows_of(w, 0..3),
        rows_of(w, 3..5),
        rows_of(e, 0..2),
        rows_of(e, 2..4),
    );
    let tmp = tmp_dir(root, step, "unit");
    let rank0 = Snapshot::capture_pieces(
        state(step),
        vec![
            ("model/w".to_string(), &w0, Some((vec![5, 3], 0))),
            ("optim/w.m".to_string(), &e0, Some((vec![4, 2], 0))),
            ("model/s".to_string(), s, None),
        ],
        Vec::new(),
    );
    let rank1 = Snapshot::capture_pieces(
        state(step),
        vec![
            ("model/w".to_string(), &w1, Some((vec![5, 3], 3))),
            ("optim/w.m".to_string(), &e1, Some((vec![4, 2], 2))),
        ],
        Vec::new(),
    );
    let p0 = write_piece(&tmp, &rank0, 0, 2, true).unwrap();
    let p1 = write_piece(&tmp, &rank1, 1, 2, false).unwrap();
    publish(root, &tmp, step, 2, vec![p0, p1]).unwrap()
}

fn same(a: &Tensor, b: &Tensor) {
    assert_eq!(a.shape(), b.shape());
    assert_eq!(a.dtype(), b.dtype());
    assert_eq!(a.to_bytes(), b.to_bytes());
}

#[test]
fn pieces_of_two_ranks_read_back_like_the_whole_checkpoint() {
    let root = scratch("two");
    let dir = write_two_ranks(&root, 10);
    let sharded = load_dir(&dir).unwrap();
    assert_eq!(sharded.manifest.world_size, 2);
    let shards: std::collections::BTreeSet<&str> = sharded
        .manifest
        .tensors
        .iter()
        .map(|e| e.shard.as_str())
        .collect();
    assert_eq!(
        shards.into_iter().collect::<Vec<_>>(),
        [
            "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors"
        ]
    );
    let t = whole();
    let full = Snapshot::capture(state(11), t.iter().map(|(n, t)| (n.clone(), t)), Vec::new());
    let whole_dir = write_checkpoint(&root, &full).unwrap();
    let reference = load_dir(&whole_dir).unwrap();
    assert_eq!(reference.manifest.world_size, 1);
    for (name, t) in &t {
        same(&sharded.tensors[name], t);
        same(&reference.tensors[name], t);
    }
    assert_eq!(sharded.state.loader, state(10).loader);

    // On demand: the rows of another layout, across the two shards.
    let lazy = load_dir_with(&dir, Contents::OnDemand).unwrap();
    assert!(lazy.tensors.is_empty());
    same(
        &lazy.rows("model/w", 2..5).unwrap(),
        &rows_of(&t[0].1, 2..5),
    );
    same(
        &lazy.rows("optim/w.m", 1..2).unwrap(),
        &rows_of(&t[1].1, 1..2),
    );
    same(
        &lazy.rows("model/w", 0..0).unwrap(),
        &rows_of(&t[0].1, 0..0),
    );
    same(&lazy.tensor("model/s").unwrap(), &t[2].1);
    // Whole tensors in memory serve rows too.
    same(
        &sharded.rows("model/w", 1..4).unwrap(),
        &rows_of(&t[0].1, 1..4),
    );
    let names: Vec<&str> = lazy.names().collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(lazy.describe("optim/w.m"), Some((&[4usize, 2][..], "bf16")));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_missing_shard_is_an_error_naming_it() {
    let root = scratch("missing");
    let dir = write_two_ranks(&root, 4);
    std::fs::remove_file(dir.join("shard-00001-of-00002.safetensors")).unwrap();
    for contents in [Contents::All, Contents::OnDemand] {
        let err = load_dir_with(&dir, contents)
            .err()
            .expect("a missing shard");
        assert!(
            err.to_string()
                .contains("missing file shard-00001-of-00002.safetensors"),
            "{err}"
        );
    }
    // A rank that trusts rank 0's check finds out when it reads the rows.
    let trusted = load_dir_with(&dir, Contents::Trusted).unwrap();
    assert!(
        trusted.rows("model/w", 0..3).is_ok(),
        "rank 0's rows are there"
    );
    let err = trusted
        .rows("model/w", 2..5)
        .expect_err("rank 1's rows are gone");
    assert!(
        err.to_string().contains("shard-00001-of-00002.safetensors"),
        "{err}"
    );
    // The newest complete checkpoint is used instead, with the reason.
    let older = write_two_ranks(&root, 2);
    let warned = std::cell::RefCell::new(Vec::new());
    let loaded = load_latest(&root, None, &|m| warned.borrow_mut().push(m.to_string()))
        .unwrap()
        .unwrap();
    assert_eq!(loaded.dir, older);
    assert!(
        warned.borrow()[0].contains("shard-00001-of-00002"),
        "{warned:?}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn pieces_that_do_not_tile_a_tensor_are_corrupt() {
    let root = scratch("tile");
    let dir = write_two_ranks(&root, 3);
    let path = dir.join("manifest.json");
    let manifest: Manifest = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let edit = |f: &dyn Fn(&mut Manifest)| {
        let mut m = manifest.clone();
        f(&mut m);
        std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
        load_dir(&dir)
            .err()
            .expect("a damaged manifest")
            .to_string()
    };
    // Rank 1's rows of `w` are not listed.
    let err = edit(&|m| {
        m.tensors
            .retain(|e| !(e.name == "model/w" && e.shard.contains("00001")))
    });
    assert!(err.contains("model/w cover rows 0..3 of 5"), "{err}");
    // Two pieces claim the same rows.
    let err = edit(&|m| {
        for e in m.tensors.iter_mut().filter(|e| e.name == "model/w") {
            e.slice[0] = [0, e.slice[0][1] - e.slice[0][0]];
        }
    });
    assert!(err.contains("model/w"), "{err}");
    // A byte range past the end of its shard.
    let err = edit(&|m| {
        let e = m.tensors.iter_mut().find(|e| e.name == "model/s").unwrap();
        e.byte_range = [1 << 40, (1 << 40) + 4];
    });
    assert!(err.contains("model/s"), "{err}");
    let _ = std::fs::remove_dir_all(&root);
}
