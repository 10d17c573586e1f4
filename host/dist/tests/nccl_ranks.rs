//! NCCL between real ranks: this test binary starts itself under `mpiexec -n 2` and `-n 4`,
//! where every rank joins an NCCL communicator (bootstrapped over MPI) and checks each
//! collective of `Nccl`, the host-slice and the device-buffer forms, bit for bit against `Mpi`'s
//! results; and where two ranks make different calls, which must fail on both with both calls
//! named, not hang. Without GPUs it runs on the CPU emulation (`tools/cuda-emu`, on
//! `LD_LIBRARY_PATH`, as scripts/test.sh does); without either it is skipped, unless
//! `ANNEAL_REQUIRE_CUDA=1` makes that a failure.

#![cfg(feature = "nccl")]

use anneal_dist::launch::{mpiexec_command, run_self_on_ranks};
use anneal_dist::nccl::{unavailable, Nccl, NcclDtype};
use anneal_dist::{Collective, RecvBuf, SendBuf};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::time::{Duration, Instant};

/// Set in the ranks' environment: the rank-side tests only run under it.
const RANK_ENV: &str = "ANNEAL_NCCL_RANK_CHECKS";

/// Whether NCCL can start here; panics under `ANNEAL_REQUIRE_CUDA=1` when it cannot.
fn nccl_here(test: &str) -> bool {
    match unavailable() {
        None => true,
        Some(why) => {
            assert!(
                std::env::var("ANNEAL_REQUIRE_CUDA").as_deref() != Ok("1"),
                "ANNEAL_REQUIRE_CUDA=1 but NCCL is unavailable: {why}"
            );
            println!("SKIP {test}: NCCL is unavailable here: {why}");
            false
        }
    }
}

#[test]
fn nccl_matches_mpi_on_2_ranks() {
    if nccl_here("nccl_matches_mpi_on_2_ranks") {
        run_self_on_ranks(2, RANK_ENV, "rank_checks", "nccl matches mpi");
    }
}

#[test]
fn nccl_matches_mpi_on_4_ranks() {
    if nccl_here("nccl_matches_mpi_on_4_ranks") {
        run_self_on_ranks(4, RANK_ENV, "rank_checks", "nccl matches mpi");
    }
}

/// Values whose sums round, so a different summation order would change the bits.
fn values(r: usize, n: usize, salt: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((r * 131 + i * 17) as f32 * 0.37 + salt as f32).sin() * 10f32.powi((i % 7) as i32 - 3)
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Runs on each rank under `mpiexec` (a no-op in a plain `cargo test`).
#[test]
fn rank_checks() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    let mpi = anneal_dist::init().unwrap();
    let (r, n) = (mpi.rank(), mpi.size());
    let nccl = Nccl::new(mpi.split(0, r as u32).unwrap(), None).unwrap();
    assert_eq!((nccl.rank(), nccl.size()), (r, n));
    // One process per GPU: with enough (emulated) devices each rank of the machine has its own.
    let gpus = cudarc::driver::CudaContext::device_count().unwrap() as usize;
    let mut devices = vec![0i64; n];
    mpi.all_gather(
        SendBuf::I64(&[nccl.device() as i64]),
        (&mut devices[..]).into(),
    )
    .unwrap();
    if gpus >= n {
        let mut distinct = devices.clone();
        distinct.dedup();
        assert_eq!(distinct.len(), n, "one device per rank: {devices:?}");
    }
    check_host_forms(mpi.as_ref(), &nccl);
    check_split(mpi.as_ref(), &nccl);
    check_device_forms(mpi.as_ref(), &nccl);
    nccl.barrier().unwrap();
    println!("rank {r}/{n}: nccl matches mpi");
}

fn check_host_forms(mpi: &dyn Collective, nccl: &Nccl) {
    let (r, n) = (mpi.rank(), mpi.size());
    let x = values(r, 9, 1);
    let (mut a, mut b) = (x.clone(), x.clone());
    mpi.all_reduce_sum(&mut a).unwrap();
    nccl.all_reduce_sum(&mut b).unwrap();
    assert_eq!(bits(&a), bits(&b), "all_reduce_sum");

    // Over the emulation's first 64 KiB of staging memory, so it grows and peers map it again.
    let x = values(r, 40_000, 11);
    let (mut a, mut b) = (x.clone(), x);
    mpi.all_reduce_sum(&mut a).unwrap();
    nccl.all_reduce_sum(&mut b).unwrap();
    assert_eq!(bits(&a), bits(&b), "a large all_reduce_sum");

    let send = values(r, 3 * n, 2);
    let (mut a, mut b) = (vec![0f32; 3], vec![0f32; 3]);
    mpi.reduce_scatter_sum(&send, &mut a).unwrap();
    nccl.reduce_scatter_sum(&send, &mut b).unwrap();
    assert_eq!(bits(&a), bits(&b), "reduce_scatter_sum");

    let mine = values(r, 2, 3);
    let (mut a, mut b) = (vec![0f32; 2 * n], vec![0f32; 2 * n]);
    mpi.all_gather(SendBuf::F32(&mine), (&mut a[..]).into())
        .unwrap();
    nccl.all_gather(SendBuf::F32(&mine), (&mut b[..]).into())
        .unwrap();
    assert_eq!(bits(&a), bits(&b), "all_gather f32");
    let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
    mpi.all_gather(SendBuf::U8(&[r as u8 + 7]), (&mut a[..]).into())
        .unwrap();
    nccl.all_gather(SendBuf::U8(&[r as u8 + 7]), (&mut b[..]).into())
        .unwrap();
    assert_eq!(a, b, "all_gather u8");
    let big = [(1i64 << 40) + r as i64, -(r as i64)];
    let (mut a, mut b) = (vec![0i64; 2 * n], vec![0i64; 2 * n]);
    mpi.all_gather(SendBuf::I64(&big), (&mut a[..]).into())
        .unwrap();
    nccl.all_gather(SendBuf::I64(&big), (&mut b[..]).into())
        .unwrap();
    assert_eq!(a, b, "all_gather i64");

    // Rank r sends d + 1 values to rank d and none to itself when r is odd.
    let send_counts: Vec<usize> = (0..n)
        .map(|d| if r % 2 == 1 && d == r { 0 } else { d + 1 })
        .collect();
    let recv_counts: Vec<usize> = (0..n)
        .map(|s| if s % 2 == 1 && s == r { 0 } else { r + 1 })
        .collect();
    let total: usize = send_counts.iter().sum();
    let got: usize = recv_counts.iter().sum();
    let send: Vec<i64> = (0..total as i64).map(|i| r as i64 * 1000 + i).collect();
    let (mut a, mut b) = (vec![0i64; got], vec![0i64; got]);
    mpi.all_to_all_v(
        (&send[..]).into(),
        &send_counts,
        (&mut a[..]).into(),
        &recv_counts,
    )
    .unwrap();
    nccl.all_to_all_v(
        (&send[..]).into(),
        &send_counts,
        (&mut b[..]).into(),
        &recv_counts,
    )
    .unwrap();
    assert_eq!(a, b, "all_to_all_v i64");
    let fsend = values(r, total, 4);
    let (mut a, mut b) = (vec![0f32; got], vec![0f32; got]);
    mpi.all_to_all_v(
        (&fsend[..]).into(),
        &send_counts,
        (&mut a[..]).into(),
        &recv_counts,
    )
    .unwrap();
    nccl.all_to_all_v(
        (&fsend[..]).into(),
        &send_counts,
        (&mut b[..]).into(),
        &recv_counts,
    )
    .unwrap();
    assert_eq!(bits(&a), bits(&b), "all_to_all_v f32");

    for root in [0, n - 1] {
        let text = format!("from rank {r} for root {root}");
        let (mut a, mut b) = (text.clone().into_bytes(), text.into_bytes());
        mpi.broadcast(&mut a, root).unwrap();
        nccl.broadcast(&mut b, root).unwrap();
        assert_eq!(a, b, "broadcast from {root}");
    }

    // A ring: even ranks send first, odd ranks receive first.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let msg = values(r, 5, 5);
    let mut got = [0f32; 5];
    if r % 2 == 0 {
        nccl.send(SendBuf::F32(&msg), next, 0).unwrap();
        nccl.recv(RecvBuf::F32(&mut got), prev, 0).unwrap();
    } else {
        nccl.recv(RecvBuf::F32(&mut got), prev, 0).unwrap();
        nccl.send(SendBuf::F32(&msg), next, 0).unwrap();
    }
    assert_eq!(bits(&got), bits(&values(prev, 5, 5)), "send/recv");
    let big = values(r, 30_000, 12);
    let mut got = vec![0f32; 30_000];
    if r % 2 == 0 {
        nccl.send(SendBuf::F32(&big), next, 0).unwrap();
        nccl.recv(RecvBuf::F32(&mut got), prev, 0).unwrap();
    } else {
        nccl.recv(RecvBuf::F32(&mut got), prev, 0).unwrap();
        nccl.send(SendBuf::F32(&big), next, 0).unwrap();
    }
    assert_eq!(
        bits(&got),
        bits(&values(prev, 30_000, 12)),
        "a large send/recv"
    );

    // The non-blocking forms, three in flight, waited for in reverse.
    let p1 = nccl.iall_reduce_sum(values(r, 4, 6)).unwrap();
    let p2 = nccl.ireduce_scatter_sum(values(r, 2 * n, 7)).unwrap();
    let p3 = nccl.iall_gather(values(r, 3, 8)).unwrap();
    let (g3, g2, g1) = (p3.wait().unwrap(), p2.wait().unwrap(), p1.wait().unwrap());
    let w1 = mpi
        .iall_reduce_sum(values(r, 4, 6))
        .unwrap()
        .wait()
        .unwrap();
    let w2 = mpi
        .ireduce_scatter_sum(values(r, 2 * n, 7))
        .unwrap()
        .wait()
        .unwrap();
    let w3 = mpi.iall_gather(values(r, 3, 8)).unwrap().wait().unwrap();
    assert_eq!(bits(&g1), bits(&w1), "iall_reduce_sum");
    assert_eq!(bits(&g2), bits(&w2), "ireduce_scatter_sum");
    assert_eq!(bits(&g3), bits(&w3), "iall_gather");
    assert!(nccl.comm_bytes() > 0);
}

fn check_split(mpi: &dyn Collective, nccl: &Nccl) {
    let r = mpi.rank();
    let (sub_mpi, sub_nccl) = (
        mpi.split((r % 2) as u32, r as u32).unwrap(),
        nccl.split((r % 2) as u32, r as u32).unwrap(),
    );
    assert_eq!(
        (sub_nccl.rank(), sub_nccl.size()),
        (sub_mpi.rank(), sub_mpi.size())
    );
    let (mut a, mut b) = (values(r, 6, 9), values(r, 6, 9));
    sub_mpi.all_reduce_sum(&mut a).unwrap();
    sub_nccl.all_reduce_sum(&mut b).unwrap();
    assert_eq!(bits(&a), bits(&b), "all_reduce_sum in a split");
}

/// The device entry points, on buffers already on the communicator's device.
fn check_device_forms(mpi: &dyn Collective, nccl: &Nccl) {
    let (r, n) = (mpi.rank(), mpi.size());
    let stream = nccl.stream().clone();
    let host = values(r, 8, 10);
    let send: CudaSlice<f32> = stream.clone_htod(&host).unwrap();
    let mut sum: CudaSlice<f32> = stream.alloc_zeros(8).unwrap();
    let mut gathered: CudaSlice<f32> = stream.alloc_zeros(8 * n).unwrap();
    let mut block: CudaSlice<f32> = stream.alloc_zeros(8 / n).unwrap();
    {
        let (s, _s) = send.device_ptr(&stream);
        let (o, _o) = sum.device_ptr_mut(&stream);
        let (g, _g) = gathered.device_ptr_mut(&stream);
        let (b, _b) = block.device_ptr_mut(&stream);
        // SAFETY: each buffer holds the elements the call names, on the communicator's device.
        unsafe {
            nccl.all_reduce_sum_device(s, o, 8, NcclDtype::F32).unwrap();
            nccl.all_gather_device(s, g, 8, NcclDtype::F32).unwrap();
            nccl.reduce_scatter_sum_device(s, b, 8 / n, NcclDtype::F32)
                .unwrap();
        }
    }
    stream.synchronize().unwrap();
    let mut want = host.clone();
    mpi.all_reduce_sum(&mut want).unwrap();
    assert_eq!(
        bits(&stream.clone_dtoh(&sum).unwrap()),
        bits(&want),
        "all_reduce_sum_device"
    );
    let mut want = vec![0f32; 8 * n];
    mpi.all_gather(SendBuf::F32(&host), (&mut want[..]).into())
        .unwrap();
    assert_eq!(
        bits(&stream.clone_dtoh(&gathered).unwrap()),
        bits(&want),
        "all_gather_device"
    );
    let mut want = vec![0f32; 8 / n];
    mpi.reduce_scatter_sum(&host, &mut want).unwrap();
    assert_eq!(
        bits(&stream.clone_dtoh(&block).unwrap()),
        bits(&want),
        "reduce_scatter_sum_device"
    );

    // bf16 sums round after every addition; every rank gets the same bits.
    let halves: Vec<u16> = (0..4).map(|i| 0x3f80 + (r as u16) * 3 + i).collect();
    let mut h: CudaSlice<u16> = stream.clone_htod(&halves).unwrap();
    {
        let (p, _p) = h.device_ptr_mut(&stream);
        // SAFETY: 4 bf16 values on the device, reduced in place.
        unsafe {
            nccl.all_reduce_sum_device(p, p, 4, NcclDtype::Bf16)
                .unwrap()
        };
    }
    let got: Vec<u8> = stream
        .clone_dtoh(&h)
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let mut everyone = vec![0u8; 8 * n];
    mpi.all_gather(SendBuf::U8(&got), (&mut everyone[..]).into())
        .unwrap();
    assert!(
        everyone.chunks(8).all(|c| c == &everyone[..8]),
        "bf16 sums differ between ranks"
    );
    if n == 2 {
        // One addition: the f32 sum of the two values (exact here), rounded to bf16.
        let f = |b: u16| f32::from_bits((b as u32) << 16);
        let want: Vec<u8> = (0..4u16)
            .map(|i| f(0x3f80 + i) + f(0x3f80 + 3 + i))
            .map(|x| {
                let u = x.to_bits();
                ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
            })
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(got, want, "bf16 all-reduce");
    }

    // Broadcast and a grouped all-to-all straight from device memory.
    let mut bytes: CudaSlice<u8> = stream.clone_htod(&[r as u8; 5]).unwrap();
    {
        let (p, _p) = bytes.device_ptr_mut(&stream);
        // SAFETY: 5 bytes on the device, in place.
        unsafe {
            nccl.broadcast_device(p, p, 5, NcclDtype::U8, n - 1)
                .unwrap()
        };
    }
    assert_eq!(stream.clone_dtoh(&bytes).unwrap(), vec![(n - 1) as u8; 5]);
    let counts = vec![2usize; n];
    let out: Vec<i64> = (0..2 * n as i64).map(|i| r as i64 * 100 + i).collect();
    let s: CudaSlice<i64> = stream.clone_htod(&out).unwrap();
    let mut d: CudaSlice<i64> = stream.alloc_zeros(2 * n).unwrap();
    {
        let (sp, _s) = s.device_ptr(&stream);
        let (dp, _d) = d.device_ptr_mut(&stream);
        // SAFETY: 2 * n elements each side.
        unsafe {
            nccl.all_to_all_v_device(sp, &counts, dp, &counts, NcclDtype::I64)
                .unwrap()
        };
    }
    let want: Vec<i64> = (0..n as i64)
        .flat_map(|s| [s * 100 + 2 * r as i64, s * 100 + 2 * r as i64 + 1])
        .collect();
    assert_eq!(stream.clone_dtoh(&d).unwrap(), want, "all_to_all_v_device");

    // On the emulation, a host pointer is refused with an error naming the call, on every
    // rank of the communicator, not a crash (on a GPU it would be a fault). A sub-communicator
    // takes the failure, so this one stays usable.
    if is_emulated() {
        let sub = Nccl::new_on_stream(mpi.split(0, r as u32).unwrap(), stream.clone()).unwrap();
        let (o, _o) = sum.device_ptr_mut(&stream);
        // SAFETY: the emulation checks the pointer before touching it.
        let err = unsafe { sub.all_reduce_sum_device(host.as_ptr() as u64, o, 8, NcclDtype::F32) }
            .expect_err("a host pointer as the send buffer");
        let text = err.to_string();
        assert!(
            text.contains("ncclAllReduce(count 8, float32, sum)"),
            "{text}"
        );
        assert!(
            text.contains("send buffer") && text.contains("host pointer"),
            "{text}"
        );
    }
}

/// Whether the CUDA driver is this repository's CPU emulation (tools/cuda-emu).
fn is_emulated() -> bool {
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ctx.name().map(|s| s.contains("emulation")).unwrap_or(false)
}

/// Runs `test` of this binary on `n` ranks, killed (and failed) if it has not ended in two
/// minutes: a mismatch must end in an error, never a hang.
fn run_bounded(n: usize, test: &str) -> (bool, String, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = mpiexec_command(n, &exe, &[(RANK_ENV, "1".into())]).expect("mpiexec on PATH");
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    let out_path =
        std::env::temp_dir().join(format!("anneal-nccl-{}-{test}.out", std::process::id()));
    let err_path = out_path.with_extension("err");
    cmd.stdout(std::fs::File::create(&out_path).unwrap());
    cmd.stderr(std::fs::File::create(&err_path).unwrap());
    let mut child = cmd.spawn().expect("mpiexec runs");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{test} on {n} ranks hung: {}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    (status.success(), stdout, stderr)
}

#[test]
fn mismatched_calls_fail_on_every_rank_instead_of_hanging() {
    if !nccl_here("mismatched_calls_fail_on_every_rank_instead_of_hanging") {
        return;
    }
    let (ok, stdout, stderr) = run_bounded(3, "mismatch_ranks");
    assert!(ok, "{stdout}\n{stderr}");
    for r in 0..3 {
        for phase in ["mismatch", "crossed calls", "ring of receives"] {
            assert!(
                stdout.contains(&format!("rank {r}/3: {phase} failed")),
                "{stdout}\n{stderr}"
            );
        }
    }
    if stderr.contains("anneal nccl emulation") {
        // Both calls named: the op, the count and the type, for each rank.
        assert!(stderr.contains("does not match across ranks"), "{stderr}");
        assert!(
            stderr.contains("rank 0 called ncclAllReduce(count 4, float32, sum)"),
            "{stderr}"
        );
        assert!(
            stderr.contains("rank 1 called ncclAllGather(count 1, float32)"),
            "{stderr}"
        );
        // A receive against a collective, and three receives in a ring, wait for each other.
        assert!(
            stderr.contains("ncclRecv(count 3, float32, peer 1) waits for rank 1"),
            "{stderr}"
        );
        assert!(
            stderr.contains("ncclRecv(count 2, float32, peer 2) waits for rank 2"),
            "{stderr}"
        );
    }
}

/// Rank 0 all-reduces while the others all-gather; then rank 0 receives while the others
/// all-reduce; then every rank receives from the next one, and nobody sends.
#[test]
fn mismatch_ranks() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    let mpi = anneal_dist::init().unwrap();
    let (r, n) = (mpi.rank(), mpi.size());
    let nccl = Nccl::new(mpi.split(0, 0).unwrap(), None).unwrap();
    let err = if r == 0 {
        nccl.all_reduce_sum(&mut [1.0; 4])
    } else {
        nccl.all_gather(SendBuf::F32(&[1.0]), (&mut vec![0f32; n][..]).into())
    }
    .expect_err("different collectives on the ranks");
    println!("rank {r}/{n}: mismatch failed: {err}");
    // The communicator stays failed.
    assert!(nccl.barrier().is_err());
    drop(nccl);

    let nccl = Nccl::new(mpi.split(0, 0).unwrap(), None).unwrap();
    let err = if r == 0 {
        nccl.recv(RecvBuf::F32(&mut [0f32; 3]), 1, 0)
    } else {
        nccl.all_reduce_sum(&mut [1.0; 3])
    }
    .expect_err("a receive against a collective");
    println!("rank {r}/{n}: crossed calls failed: {err}");
    drop(nccl);

    let nccl = Nccl::new(mpi.split(0, 0).unwrap(), None).unwrap();
    let err = nccl
        .recv(RecvBuf::F32(&mut [0f32; 2]), (r + 1) % n, 0)
        .expect_err("receives in a ring");
    println!("rank {r}/{n}: ring of receives failed: {err}");
    mpi.barrier().unwrap();
}
