//! Every collective on real MPI ranks: this test binary starts itself under `mpiexec -n 2` and
//! `-n 4` (oversubscribed on small machines, one thread each), where `rank_checks` runs on
//! every rank and checks each collective's result against the values the ranks must hold.

use anneal_dist::launch::run_self_on_ranks;
use anneal_dist::{Collective, Dim0Shard, DistError, Mesh, MeshDim, RecvBuf, SendBuf};

/// Set in the ranks' environment: `rank_checks` only runs under it.
const RANK_ENV: &str = "ANNEAL_DIST_RANK_CHECKS";

fn run_ranks(n: usize) {
    run_self_on_ranks(n, RANK_ENV, "rank_checks", "every collective checked");
}

#[test]
fn collectives_on_2_ranks() {
    run_ranks(2);
}

#[test]
fn collectives_on_4_ranks() {
    run_ranks(4);
}

/// Runs on each rank under `mpiexec` (a no-op in a plain `cargo test`).
#[test]
fn rank_checks() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    assert!(anneal_dist::launched_by_mpi());
    let world = anneal_dist::init().unwrap();
    let (r, n) = (world.rank(), world.size());
    check_blocking(world.as_ref());
    check_point_to_point(world.as_ref());
    check_non_blocking(world.as_ref());
    check_mesh(world.as_ref());
    check_dim0_shards(world.as_ref());
    check_errors(world.as_ref());
    assert!(world.comm_bytes() > 0);
    world.barrier().unwrap();
    println!("rank {r}/{n}: every collective checked");
}

fn check_blocking(c: &dyn Collective) {
    let (r, n) = (c.rank(), c.size());
    let tri = (n * (n - 1) / 2) as f32;

    let mut x: Vec<f32> = (0..5).map(|i| (r * 10 + i) as f32).collect();
    c.all_reduce_sum(&mut x).unwrap();
    let want: Vec<f32> = (0..5).map(|i| 10.0 * tri + (n * i) as f32).collect();
    assert_eq!(x, want, "all_reduce_sum");

    let send: Vec<f32> = (0..3 * n).map(|j| (r + j) as f32).collect();
    let mut recv = vec![0f32; 3];
    c.reduce_scatter_sum(&send, &mut recv).unwrap();
    let want: Vec<f32> = (0..3).map(|k| (n * (r * 3 + k)) as f32 + tri).collect();
    assert_eq!(recv, want, "reduce_scatter_sum");

    let mut f = vec![0f32; 2 * n];
    c.all_gather(SendBuf::F32(&[r as f32, -(r as f32)]), (&mut f[..]).into())
        .unwrap();
    let want: Vec<f32> = (0..n).flat_map(|s| [s as f32, -(s as f32)]).collect();
    assert_eq!(f, want, "all_gather f32");
    let mut b = vec![0u8; n];
    c.all_gather(SendBuf::U8(&[r as u8 + 7]), (&mut b[..]).into())
        .unwrap();
    assert_eq!(b, (0..n).map(|s| s as u8 + 7).collect::<Vec<_>>());
    let mut l = vec![0i64; n];
    let big = 1i64 << 40;
    c.all_gather(SendBuf::I64(&[big + r as i64]), (&mut l[..]).into())
        .unwrap();
    assert_eq!(l, (0..n).map(|s| big + s as i64).collect::<Vec<_>>());

    // Rank r sends d + 1 copies of r·100 + d to rank d, so it receives r + 1 copies of
    // s·100 + r from each rank s.
    let send_counts: Vec<usize> = (0..n).map(|d| d + 1).collect();
    let send: Vec<i64> = (0..n)
        .flat_map(|d| std::iter::repeat_n((r * 100 + d) as i64, d + 1))
        .collect();
    let recv_counts = vec![r + 1; n];
    let mut recv = vec![0i64; n * (r + 1)];
    c.all_to_all_v(
        SendBuf::I64(&send),
        &send_counts,
        (&mut recv[..]).into(),
        &recv_counts,
    )
    .unwrap();
    let want: Vec<i64> = (0..n)
        .flat_map(|s| std::iter::repeat_n((s * 100 + r) as i64, r + 1))
        .collect();
    assert_eq!(recv, want, "all_to_all_v");
    let sendf: Vec<f32> = send.iter().map(|&v| v as f32).collect();
    let mut recvf = vec![0f32; recv.len()];
    c.all_to_all_v(
        SendBuf::F32(&sendf),
        &send_counts,
        (&mut recvf[..]).into(),
        &recv_counts,
    )
    .unwrap();
    assert_eq!(recvf, want.iter().map(|&v| v as f32).collect::<Vec<_>>());

    let root = n - 1;
    let mut bytes = if r == root {
        b"from the last rank".to_vec()
    } else {
        vec![0u8; 18]
    };
    c.broadcast(&mut bytes, root).unwrap();
    assert_eq!(&bytes, b"from the last rank", "broadcast");
    c.barrier().unwrap();
}

fn check_point_to_point(c: &dyn Collective) {
    let (r, n) = (c.rank(), c.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut got = [0f32; 3];
    let msg = [r as f32, 1.5, 2.5];
    // Even ranks send first and odd ranks receive first, so the ring never waits on itself.
    if r % 2 == 0 {
        c.send(SendBuf::F32(&msg), next, 3).unwrap();
        c.recv(RecvBuf::F32(&mut got), prev, 3).unwrap();
    } else {
        c.recv(RecvBuf::F32(&mut got), prev, 3).unwrap();
        c.send(SendBuf::F32(&msg), next, 3).unwrap();
    }
    assert_eq!(got, [prev as f32, 1.5, 2.5], "send/recv");
}

fn check_non_blocking(c: &dyn Collective) {
    let (r, n) = (c.rank(), c.size());
    let tri = (n * (n - 1) / 2) as f32;
    // Three in flight at once, completed in the reverse order.
    let a = c.iall_reduce_sum(vec![r as f32; 4]).unwrap();
    let s = c
        .ireduce_scatter_sum((0..2 * n).map(|j| (r + j) as f32).collect())
        .unwrap();
    let g = c.iall_gather(vec![r as f32 * 2.0]).unwrap();
    assert_eq!(
        g.wait().unwrap(),
        (0..n).map(|s| s as f32 * 2.0).collect::<Vec<_>>()
    );
    let want: Vec<f32> = (0..2).map(|k| (n * (r * 2 + k)) as f32 + tri).collect();
    assert_eq!(s.wait().unwrap(), want, "ireduce_scatter_sum");
    assert_eq!(a.wait().unwrap(), vec![tri; 4], "iall_reduce_sum");
    // Dropping a handle unwaited completes it (no buffer is freed under MPI).
    drop(c.iall_reduce_sum(vec![1.0; 8]).unwrap());
    // Two variable all-to-alls in flight at once (the expert exchange's halves): rank r sends
    // d + 1 copies of r·100 + d (+ 0.5 in the second) to rank d.
    let send_counts: Vec<usize> = (0..n).map(|d| d + 1).collect();
    let recv_counts = vec![r + 1; n];
    let send = |off: f32| -> Vec<f32> {
        (0..n)
            .flat_map(|d| std::iter::repeat_n((r * 100 + d) as f32 + off, d + 1))
            .collect()
    };
    let first = c
        .iall_to_all_v(send(0.0), &send_counts, &recv_counts)
        .unwrap();
    let second = c
        .iall_to_all_v(send(0.5), &send_counts, &recv_counts)
        .unwrap();
    let want = |off: f32| -> Vec<f32> {
        (0..n)
            .flat_map(|s| std::iter::repeat_n((s * 100 + r) as f32 + off, r + 1))
            .collect()
    };
    assert_eq!(first.wait().unwrap(), want(0.0), "iall_to_all_v");
    assert_eq!(second.wait().unwrap(), want(0.5), "iall_to_all_v (second)");
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_mesh(world: &dyn Collective) {
    let (r, n) = (world.rank(), world.size());
    // pp, dp_replicate, dp_shard, cp, ep, tp: 2 replicas × the rest sharded.
    let mesh = Mesh::new([1, 2, -1, 1, 1, 1], n, r).unwrap();
    let shard = n / 2;
    assert_eq!(mesh.degree(MeshDim::DpShard), shard);
    let rep = mesh.comm(world, MeshDim::DpReplicate).unwrap();
    let sh = mesh.comm(world, MeshDim::DpShard).unwrap();
    assert_eq!((rep.size(), sh.size()), (2, shard));
    assert_eq!(rep.rank(), r / shard);
    assert_eq!(sh.rank(), r % shard);
    // Ranks of one shard group are consecutive; replicas are `shard` apart.
    let mut x = [r as f32];
    sh.all_reduce_sum(&mut x).unwrap();
    let base = (r / shard) * shard;
    assert_eq!(
        x[0],
        (base..base + shard).sum::<usize>() as f32,
        "shard group"
    );
    let mut y = [r as f32];
    rep.all_reduce_sum(&mut y).unwrap();
    assert_eq!(y[0], (2 * (r % shard) + shard) as f32, "replicate group");
    // Both data-parallel dimensions together: every rank, in world order.
    let dp = mesh
        .comm_of(world, &[MeshDim::DpReplicate, MeshDim::DpShard])
        .unwrap();
    assert_eq!((dp.rank(), dp.size()), (r, n));
    // Gradients summed over the shard group and then over the replicas have the same bits
    // as summed over every rank at once (HSDP = DDP), for values whose order matters.
    let value = |rank: usize, i: usize| -> f32 {
        let x = ((rank * 7 + i) as f32 * 0.618_034).fract() - 0.5;
        x * 10f32.powi(((rank * 4 + i) % 9) as i32)
    };
    let mine: Vec<f32> = (0..6).map(|i| value(r, i)).collect();
    let mut flat = mine.clone();
    dp.all_reduce_sum(&mut flat).unwrap();
    let mut nested = mine;
    sh.all_reduce_sum(&mut nested).unwrap();
    rep.all_reduce_sum(&mut nested).unwrap();
    assert_eq!(bits(&flat), bits(&nested), "sum of sums");
    let mut every: Vec<f32> = (0..n)
        .flat_map(|s| (0..6).map(move |i| value(s, i)))
        .collect();
    anneal_dist::rank_order_sum(&mut every, n);
    assert_eq!(bits(&flat), bits(&every[..6]), "rank order");
    // The reduce-scatter sums each block in the same order: 12 values split over 2 or 4 ranks.
    let k = 12 / n;
    let mut block = vec![0f32; k];
    let send: Vec<f32> = (0..12).map(|i| value(r, i)).collect();
    dp.reduce_scatter_sum(&send, &mut block).unwrap();
    let mut every: Vec<f32> = (0..n)
        .flat_map(|s| (0..12).map(move |i| value(s, i)))
        .collect();
    anneal_dist::rank_order_sum(&mut every, n);
    assert_eq!(
        bits(&block),
        bits(&every[r * k..(r + 1) * k]),
        "reduce-scatter"
    );
    // Expert parallelism borrows dp_shard's ranks: all of them sharded, ep 2.
    let mesh = Mesh::new([1, 1, -1, 1, 2, 1], n, r).unwrap();
    assert_eq!((mesh.world_size(), mesh.degree(MeshDim::Ep)), (n, 2));
    let (ep, efsdp) = mesh.expert_comms(world).unwrap();
    assert_eq!((ep.rank(), ep.size()), (r % 2, 2), "expert group");
    assert_eq!(
        (efsdp.rank(), efsdp.size()),
        (r / 2, n / 2),
        "expert-FSDP group"
    );
    let mut z = [r as f32];
    ep.all_reduce_sum(&mut z).unwrap();
    assert_eq!(
        z[0],
        (2 * (r / 2) * 2 + 1) as f32,
        "an expert group is consecutive ranks"
    );
    // Under context parallelism (dp_shard 2, ep 2, cp the rest): an expert group stays within
    // one cp coordinate; the expert-FSDP group spans the cp ranks holding the same experts.
    let cp = n / 2;
    let mesh = Mesh::new([1, 1, 2, -1, 2, 1], n, r).unwrap();
    assert_eq!(mesh.degree(MeshDim::Cp), cp);
    let (s, c) = (r / cp, r % cp);
    let (ep, efsdp) = mesh.expert_comms(world).unwrap();
    assert_eq!((ep.rank(), ep.size()), (s, 2), "expert group under cp");
    assert_eq!(
        (efsdp.rank(), efsdp.size()),
        (c, cp),
        "expert-FSDP under cp"
    );
    let mut z = [r as f32];
    ep.all_reduce_sum(&mut z).unwrap();
    assert_eq!(z[0], (2 * c + cp) as f32, "one cp coordinate's shard ranks");
    let mut w = [r as f32];
    efsdp.all_reduce_sum(&mut w).unwrap();
    let held = (s * cp..(s + 1) * cp).sum::<usize>();
    assert_eq!(w[0], held as f32, "the cp ranks of one expert slice");
}

fn check_dim0_shards(c: &dyn Collective) {
    let (r, n) = (c.rank(), c.size());
    // 5 rows of 3 over n ranks: with 4 ranks the last holds none.
    let shape = [5, 3];
    let s = Dim0Shard::new(&shape, r, n);
    let full: Vec<f32> = (0..15).map(|v| v as f32).collect();
    let gathered = s.all_gather(c, s.slice(&full)).unwrap();
    assert_eq!(gathered, full, "all_gather_dim0");
    // Each rank's gradient is (r + 1) × full, so the sum is n(n+1)/2 × full.
    let grad: Vec<f32> = full.iter().map(|v| v * (r + 1) as f32).collect();
    let tri = (n * (n + 1) / 2) as f32;
    let mine = s.reduce_scatter(c, &grad).unwrap();
    let want: Vec<f32> = s.slice(&full).iter().map(|v| v * tri).collect();
    assert_eq!(mine, want, "reduce_scatter_dim0");
    // The same, non-blocking and overlapped.
    let g = s.start_all_gather(c, s.slice(&full)).unwrap();
    let p = s.start_reduce_scatter(c, &grad).unwrap();
    assert_eq!(s.finish_scatter(p).unwrap(), want);
    assert_eq!(s.finish_gather(g).unwrap(), full);
}

fn check_errors(c: &dyn Collective) {
    let n = c.size();
    // Checked before MPI is called, so every rank gets an error and nothing hangs.
    let mut short = vec![0f32; 1];
    assert!(matches!(
        c.reduce_scatter_sum(&vec![0.0; 2 * n + 1], &mut short),
        Err(DistError::Size { .. })
    ));
    assert!(matches!(
        c.all_gather(SendBuf::U8(&[1]), (&mut short[..]).into()),
        Err(DistError::TypeMismatch { .. })
    ));
    assert!(matches!(
        c.broadcast(&mut [0u8; 1], n),
        Err(DistError::Rank { .. })
    ));
}
