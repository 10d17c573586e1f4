//! NCCL at world size 1 on a GPU (bootstrapped over `Single`); skipped, saying why, on a machine
//! without a GPU or without libnccl. Multi-rank logic is covered by the MPI tests.

#![cfg(feature = "nccl")]

use anneal_dist::nccl::{unavailable, Nccl};
use anneal_dist::{Collective, Single};

fn world_of_one() -> Option<Nccl> {
    if let Some(why) = unavailable() {
        eprintln!("skipped: NCCL is unavailable here: {why}");
        return None;
    }
    Some(Nccl::new(Box::new(Single::new()), None).expect("NCCL world of one"))
}

#[test]
fn unavailable_names_what_is_missing_instead_of_panicking() {
    // Either there is a GPU with NCCL, or the reason names a library or the GPU count.
    if let Some(why) = unavailable() {
        assert!(
            why.contains("libcuda") || why.contains("libnccl") || why.contains("GPU"),
            "{why}"
        );
        let err = Nccl::new(Box::new(Single::new()), None)
            .err()
            .expect("no NCCL without its libraries");
        assert!(err.to_string().starts_with("unavailable: "), "{err}");
    }
}

#[test]
fn collectives_at_world_size_one() {
    let Some(c) = world_of_one() else { return };
    assert_eq!((c.rank(), c.size()), (0, 1));
    let mut v = vec![1.5f32, -2.0, 3.25];
    c.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v, [1.5, -2.0, 3.25]);
    let mut out = vec![0f32; 3];
    c.reduce_scatter_sum(&v, &mut out).unwrap();
    assert_eq!(out, v);
    let mut ids = vec![0i64; 2];
    c.all_gather((&[7i64, -9][..]).into(), (&mut ids[..]).into())
        .unwrap();
    assert_eq!(ids, [7, -9]);
    let mut got = vec![0u8; 4];
    c.all_to_all_v(
        (&[1u8, 2, 3, 4][..]).into(),
        &[4],
        (&mut got[..]).into(),
        &[4],
    )
    .unwrap();
    assert_eq!(got, [1, 2, 3, 4]);
    let mut bytes = *b"nccl";
    c.broadcast(&mut bytes, 0).unwrap();
    assert_eq!(&bytes, b"nccl");
    c.barrier().unwrap();
    let pending = c.iall_gather(vec![0.5, 0.25]).unwrap();
    assert_eq!(pending.wait().unwrap(), [0.5, 0.25]);
    let pending = c.ireduce_scatter_sum(vec![4.0, 5.0]).unwrap();
    assert_eq!(pending.wait().unwrap(), [4.0, 5.0]);
    let sub = c.split(0, 0).unwrap();
    let mut w = vec![2.0f32];
    sub.all_reduce_sum(&mut w).unwrap();
    assert_eq!(w, [2.0]);
    assert!(c.comm_bytes() > 0);
    assert!(
        c.broadcast(&mut bytes, 1).is_err(),
        "root outside the world"
    );
}
