//! Packing, shuffling, resuming and evaluation batches.

use std::sync::Arc;

use anneal_data::{Batch, DataError, LoaderState, PackedLoader};

const SEQ: usize = 7;

/// A stream whose token at position `i` is `i`, so a window shows where it starts.
fn stream(n: u32) -> Arc<[u32]> {
    (0..n).collect::<Vec<_>>().into()
}

/// The start of each row of `b`, checking that the row is a contiguous stream slice starting at a
/// multiple of the sequence length and that targets are the inputs shifted by one.
fn starts(b: &Batch) -> Vec<usize> {
    assert_eq!(b.inputs.len(), b.batch * b.seq_len);
    assert_eq!(b.targets.len(), b.batch * b.seq_len);
    (0..b.batch)
        .map(|r| {
            let row = &b.inputs[r * b.seq_len..(r + 1) * b.seq_len];
            let tgt = &b.targets[r * b.seq_len..(r + 1) * b.seq_len];
            let s = row[0];
            assert!(
                row.iter().enumerate().all(|(i, &t)| t == s + i as i64),
                "not contiguous: {row:?}"
            );
            assert!(
                tgt.iter().zip(row).all(|(&t, &x)| t == x + 1),
                "targets not shifted: {tgt:?}"
            );
            assert_eq!(s as usize % b.seq_len, 0);
            s as usize
        })
        .collect()
}

fn take(loader: &mut PackedLoader, rows: usize, batch: usize) -> Vec<usize> {
    let mut out = Vec::new();
    while out.len() < rows {
        let b = loader.next_batch(batch.min(rows - out.len())).unwrap();
        assert_eq!(b.seq_len, SEQ);
        out.extend(starts(&b));
    }
    out
}

#[test]
fn every_window_is_visited_once_per_epoch() {
    let mut l = PackedLoader::new(stream(1000), SEQ, 42, true).unwrap();
    let w = l.windows_per_epoch();
    assert_eq!(w, 999 / SEQ);
    let all: Vec<usize> = (0..w).map(|i| i * SEQ).collect();
    let mut e0 = take(&mut l, w, 5);
    assert_eq!(
        l.state(),
        LoaderState {
            epoch: 1,
            cursor: 0,
            mixture: None,
            stream: None,
        }
    );
    let mut e1 = take(&mut l, w, 5);
    assert_ne!(e0, all, "shuffled");
    assert_ne!(e0, e1, "each epoch has its own order");
    e0.sort();
    e1.sort();
    assert_eq!(e0, all);
    assert_eq!(e1, all);
}

#[test]
fn batches_wrap_into_the_next_epoch() {
    let mut l = PackedLoader::new(stream(1000), SEQ, 1, true).unwrap();
    let w = l.windows_per_epoch(); // 142 = 28 * 5 + 2
    take(&mut l, w - 2, 5);
    let b = l.next_batch(5).unwrap();
    assert_eq!(b.batch, 5);
    assert_eq!(starts(&b).len(), 5);
    assert_eq!(
        l.state(),
        LoaderState {
            epoch: 1,
            cursor: 3,
            mixture: None,
            stream: None,
        }
    );
}

#[test]
fn without_shuffle_windows_come_in_stream_order() {
    let mut l = PackedLoader::new(stream(100), SEQ, 9, false).unwrap();
    let w = l.windows_per_epoch();
    let expect: Vec<usize> = (0..w).map(|i| i * SEQ).collect();
    assert_eq!(take(&mut l, w, 4), expect);
    assert_eq!(take(&mut l, w, 4), expect);
}

#[test]
fn the_order_depends_on_the_seed_only() {
    let order = |seed| {
        take(
            &mut PackedLoader::new(stream(1000), SEQ, seed, true).unwrap(),
            300,
            8,
        )
    };
    assert_eq!(order(3), order(3));
    assert_ne!(order(3), order(4));
    // The batch size does not change the sequence of windows.
    let by_one = take(
        &mut PackedLoader::new(stream(1000), SEQ, 3, true).unwrap(),
        300,
        1,
    );
    assert_eq!(by_one, order(3));
}

#[test]
fn restore_continues_exactly_mid_epoch_and_across_epochs() {
    let mut reference = PackedLoader::new(stream(1000), SEQ, 77, true).unwrap();
    let mut states = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..60 {
        states.push(reference.state());
        rows.push(starts(&reference.next_batch(6).unwrap()));
    }
    // 60 batches of 6 cover 360 windows: epochs 0, 1 and part of 2.
    assert_eq!(reference.state().epoch, 2);
    for at in [0, 1, 13, 23, 24, 25, 47, 59] {
        // Through JSON, as a checkpoint stores it.
        let json = serde_json::to_string(&states[at]).unwrap();
        let state: LoaderState = serde_json::from_str(&json).unwrap();
        let mut resumed = PackedLoader::new(stream(1000), SEQ, 77, true).unwrap();
        if at == 47 {
            resumed.next_batch(100).unwrap(); // a used loader restores just as well as a fresh one
        }
        resumed.restore(&state).unwrap();
        assert_eq!(resumed.state(), states[at]);
        for expect in &rows[at..] {
            assert_eq!(
                &starts(&resumed.next_batch(6).unwrap()),
                expect,
                "resumed at batch {at}"
            );
        }
    }
}

#[test]
fn restore_rejects_a_cursor_past_the_epoch() {
    let mut l = PackedLoader::new(stream(1000), SEQ, 0, true).unwrap();
    let w = l.windows_per_epoch() as u64;
    let err = l
        .restore(&LoaderState {
            epoch: 0,
            cursor: w,
            mixture: None,
            stream: None,
        })
        .unwrap_err();
    assert!(matches!(err, DataError::BadLoaderState { .. }), "{err}");
    assert!(err.to_string().contains(&w.to_string()), "{err}");
    assert_eq!(
        l.state(),
        LoaderState {
            epoch: 0,
            cursor: 0,
            mixture: None,
            stream: None,
        },
        "a failed restore changes nothing"
    );
    l.restore(&LoaderState {
        epoch: 5,
        cursor: w - 1,
        mixture: None,
        stream: None,
    })
    .unwrap();
    l.next_batch(1).unwrap();
    assert_eq!(
        l.state(),
        LoaderState {
            epoch: 6,
            cursor: 0,
            mixture: None,
            stream: None,
        }
    );
}

#[test]
fn a_stream_needs_one_full_window() {
    let err = PackedLoader::new(stream(SEQ as u32), SEQ, 0, true).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::StreamTooShort {
                tokens: 7,
                needed: 8
            }
        ),
        "{err}"
    );
    let mut l = PackedLoader::new(stream(SEQ as u32 + 1), SEQ, 0, true).unwrap();
    assert_eq!(l.windows_per_epoch(), 1);
    let b = l.next_batch(3).unwrap();
    assert_eq!(starts(&b), [0, 0, 0]);
    assert!(matches!(
        PackedLoader::new(stream(10), 0, 0, true),
        Err(DataError::InvalidArgument { .. })
    ));
}

#[test]
fn eval_batches_cover_all_windows_in_order() {
    let tokens: Vec<u32> = (0..100).collect();
    let batches = PackedLoader::eval_batches(&tokens, SEQ, 4, usize::MAX);
    // 99 / 7 = 14 windows: 4 + 4 + 4 + 2.
    assert_eq!(
        batches.iter().map(|b| b.batch).collect::<Vec<_>>(),
        [4, 4, 4, 2]
    );
    let all: Vec<usize> = batches.iter().flat_map(starts).collect();
    assert_eq!(all, (0..14).map(|i| i * SEQ).collect::<Vec<_>>());

    assert_eq!(PackedLoader::eval_batches(&tokens, SEQ, 4, 2).len(), 2);
    assert_eq!(PackedLoader::eval_batches(&tokens, SEQ, 4, 2), batches[..2]);
    assert!(PackedLoader::eval_batches(&tokens[..SEQ], SEQ, 4, 10).is_empty());
    assert!(PackedLoader::eval_batches(&tokens, SEQ, 0, 10).is_empty());
}
