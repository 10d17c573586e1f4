//! Batched matrix products on `gemm`, reading strided operands in place (no transposed copies).

use super::finish;
use crate::error::Result;
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{DType, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;
use std::sync::{Arc, RwLock};

/// Below this many multiply-adds per matrix, batches run one matrix per task instead of
/// splitting each matrix across threads.
const SMALL: usize = 1 << 21;

/// Products with at most this many rows keep their packed right operand for the next call
/// when it does not change (decode steps reuse the weights; see `sgemm::pack_cache`).
const PACK_CACHE_ROWS: usize = 64;

/// Where a right operand lives, for the packed-operand cache: its storage and write count.
type BCell<'a> = Option<(&'a Arc<RwLock<Storage>>, u64)>;

struct Operand<'a> {
    data: &'a [f32],
    layout: Layout,
}

pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let rank = a.rank();
    let (m, k, n) = (
        a.shape()[rank - 2],
        a.shape()[rank - 1],
        b.shape()[rank - 1],
    );
    let batch_shape = &a.shape()[..rank - 2];
    let batch: usize = batch_shape.iter().product();
    let _p = crate::profile::scope_with("matmul", || shape_detail(a, b, batch, m, k, n));
    let mut out_shape = batch_shape.to_vec();
    out_shape.extend([m, n]);
    let out_dtype = if a.dtype() == b.dtype() && a.dtype().is_float() {
        a.dtype()
    } else {
        DType::F32
    };
    if a.dtype() == DType::BF16
        && b.dtype() == DType::BF16
        && m >= 4
        && super::sgemm::bf16::available()
    {
        return matmul_bf16(a, b, batch_shape, m, k, n, &out_shape);
    }

    // f32 operands are read in place; others are converted once.
    let (ta, tb) = (a.f32_or_converted(), b.f32_or_converted());
    let (ga, gb) = (ta.storage(), tb.storage());
    let oa = Operand {
        data: ga.as_slice(),
        layout: ta.layout().clone(),
    };
    let ob = Operand {
        data: gb.as_slice(),
        layout: tb.layout().clone(),
    };

    let mut out = Storage::any(DType::F32, batch * m * n);
    if m * n > 0 {
        let o = out.as_mut_slice::<f32>();
        let threads = rayon::current_num_threads();
        let batch_offsets = |l: &Layout| -> Vec<usize> {
            let bl = Layout::from_parts(
                batch_shape.to_vec(),
                l.strides()[..rank - 2].to_vec(),
                l.offset(),
            );
            let mut v = Vec::with_capacity(batch);
            bl.for_each_index(|i| v.push(i));
            v
        };
        let (offs_a, offs_b) = (batch_offsets(&oa.layout), batch_offsets(&ob.layout));
        let b_cell: BCell<'_> = (batch == 1).then(|| (tb.storage_cell(), gb.writes()));
        let run = |i: usize, dst: &mut [f32], par: Parallelism| {
            gemm_one(&oa, offs_a[i], &ob, offs_b[i], b_cell, m, k, n, dst, par);
        };
        if batch > 1 && m * n * k < SMALL {
            o.par_chunks_mut(m * n)
                .enumerate()
                .for_each(|(i, dst)| run(i, dst, Parallelism::None));
        } else {
            let par = if threads > 1 {
                Parallelism::Rayon(threads)
            } else {
                Parallelism::None
            };
            for (i, dst) in o.chunks_mut(m * n).enumerate() {
                run(i, dst, par);
            }
        }
    }
    drop((ga, gb));
    finish(out, &out_shape, out_dtype)
}

/// bf16 × bf16 on AVX512-BF16 dot products with f32 accumulation, operands read in place;
/// the f32 result is rounded to bf16 once at the end.
fn matmul_bf16(
    a: &Tensor,
    b: &Tensor,
    batch_shape: &[usize],
    m: usize,
    k: usize,
    n: usize,
    out_shape: &[usize],
) -> Result<Tensor> {
    use super::sgemm::MatRef;
    let rank = a.rank();
    let batch: usize = batch_shape.iter().product();
    let (ga, gb) = (a.storage(), b.storage());
    let (da, db) = (ga.as_slice::<half::bf16>(), gb.as_slice::<half::bf16>());
    let offsets = |l: &Layout| -> Vec<usize> {
        let bl = Layout::from_parts(
            batch_shape.to_vec(),
            l.strides()[..rank - 2].to_vec(),
            l.offset(),
        );
        let mut v = Vec::with_capacity(batch);
        bl.for_each_index(|i| v.push(i));
        v
    };
    let (la, lb) = (a.layout(), b.layout());
    let (oa, ob) = (offsets(la), offsets(lb));
    let mat = |data, l: &Layout, off| MatRef {
        data,
        off,
        rs: l.strides()[rank - 2],
        cs: l.strides()[rank - 1],
    };
    let mut out = Storage::any(DType::F32, batch * m * n);
    if m * n > 0 {
        let o = out.as_mut_slice::<f32>();
        let run = |i: usize, dst: &mut [f32], parallel: bool| {
            super::sgemm::bf16::gemm(
                m,
                n,
                k,
                mat(da, la, oa[i]),
                mat(db, lb, ob[i]),
                dst,
                parallel,
            );
        };
        if batch > 1 && m * n * k < SMALL {
            o.par_chunks_mut(m * n)
                .enumerate()
                .for_each(|(i, d)| run(i, d, false));
        } else {
            let parallel = rayon::current_num_threads() > 1;
            for (i, d) in o.chunks_mut(m * n).enumerate() {
                run(i, d, parallel);
            }
        }
    }
    drop((ga, gb));
    finish(out, out_shape, DType::BF16)
}

/// `a [M, K] @ b [K, N]` on the packed kernel at any `M` (batch-invariant by construction).
fn invariant_sgemm(a: &Tensor, b: &Tensor, m: usize, k: usize, n: usize) -> Result<Tensor> {
    use super::sgemm::{sgemm, MatRef};
    let (ga, gb) = (a.storage(), b.storage());
    let mat = |data, t: &Tensor| MatRef {
        data,
        off: t.layout().offset(),
        rs: t.layout().strides()[0],
        cs: t.layout().strides()[1],
    };
    let mut out = Storage::any(DType::F32, m * n);
    let parallel = rayon::current_num_threads() > 1;
    let rb = mat(gb.as_slice(), b);
    let source = (m <= PACK_CACHE_ROWS)
        .then(|| super::sgemm::pack_cache::Source::new(b.storage_cell(), gb.writes(), &rb, k, n));
    sgemm(
        m,
        n,
        k,
        mat(ga.as_slice(), a),
        rb,
        source.as_ref(),
        out.as_mut_slice(),
        parallel,
    );
    drop((ga, gb));
    finish(out, &[m, n], DType::F32)
}

/// `batch=.. m=.. k=.. n=.. a=n|t b=n|t` for the profile (`t`: the operand's rows are strided,
/// i.e. it is read transposed).
pub(crate) fn shape_detail(
    a: &Tensor,
    b: &Tensor,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
) -> String {
    let t = |x: &Tensor| {
        let r = x.rank();
        if x.layout().strides()[r - 1] == 1 || x.shape()[r - 1] == 1 {
            "n"
        } else {
            "t"
        }
    };
    let b_part = if batch > 1 {
        format!("batch={batch} ")
    } else {
        String::new()
    };
    let dt = if a.dtype() == DType::F32 && b.dtype() == DType::F32 {
        String::new()
    } else {
        format!(" {}x{}", a.dtype(), b.dtype())
    };
    format!("{b_part}m={m} k={k} n={n} a={} b={}{dt}", t(a), t(b))
}

/// `dst[m, n] = a[m, k] @ b[k, n]` for one batch entry.
#[allow(clippy::too_many_arguments)]
fn gemm_one(
    a: &Operand,
    a_off: usize,
    b: &Operand,
    b_off: usize,
    b_cell: BCell<'_>,
    m: usize,
    k: usize,
    n: usize,
    dst: &mut [f32],
    par: Parallelism,
) {
    let r = a.layout.rank();
    let (a_rs, a_cs) = (
        a.layout.strides()[r - 2] as isize,
        a.layout.strides()[r - 1] as isize,
    );
    let (b_rs, b_cs) = (
        b.layout.strides()[r - 2] as isize,
        b.layout.strides()[r - 1] as isize,
    );
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    // The packed kernel wherever the CPU has it, at any number of rows: a decode step's few
    // rows reuse the packed weights of the step before (see `sgemm::pack_cache`).
    if super::sgemm::available() {
        let ra = super::sgemm::MatRef {
            data: a.data,
            off: a_off,
            rs: a_rs as usize,
            cs: a_cs as usize,
        };
        let rb = super::sgemm::MatRef {
            data: b.data,
            off: b_off,
            rs: b_rs as usize,
            cs: b_cs as usize,
        };
        let source = b_cell
            .filter(|_| m <= PACK_CACHE_ROWS)
            .map(|(cell, writes)| super::sgemm::pack_cache::Source::new(cell, writes, &rb, k, n));
        let parallel = !matches!(par, Parallelism::None);
        super::sgemm::sgemm(m, n, k, ra, rb, source.as_ref(), dst, parallel);
        return;
    }
    // Bounds: the last element each operand reaches lies inside its slice.
    let a_last = a_off + (m - 1) * a_rs as usize + (k - 1) * a_cs as usize;
    let b_last = b_off + (k - 1) * b_rs as usize + (n - 1) * b_cs as usize;
    assert!(a_last < a.data.len() && b_last < b.data.len() && dst.len() == m * n);
    // SAFETY: the asserts above bound every element gemm reads; dst is exclusively borrowed and
    // sized m*n with row-major strides (n, 1).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr().add(a_off),
            a_cs,
            a_rs,
            b.data.as_ptr().add(b_off),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// `a [M, K] @ b [K, N]` on zero-padded tiles of exactly [`crate::invariant::TILE`] rows, each a
/// single-threaded product of the same shape, so a row's result does not depend on `M` or on
/// where the row sits (batch-invariant mode).
pub(crate) fn matmul_row_tiles(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    use crate::invariant::TILE;
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let _p = crate::profile::scope_with("matmul_tiles", || shape_detail(a, b, 1, m, k, n));
    if super::sgemm::available() && a.dtype() == DType::F32 && b.dtype() == DType::F32 {
        // On the packed kernel a row's result never depends on how many rows there are, so
        // no padding is needed (a decode step computes 1 row, not 64).
        return invariant_sgemm(a, b, m, k, n);
    }
    let out_dtype = if a.dtype() == b.dtype() && a.dtype().is_float() {
        a.dtype()
    } else {
        DType::F32
    };
    let a = a.contig::<f32>();
    let tb = b.f32_or_converted();
    let gb = tb.storage();
    let ob = Operand {
        data: gb.as_slice(),
        layout: tb.layout().clone(),
    };
    let tile_layout = Layout::contiguous(&[TILE, k]);
    let mut out = Storage::any(DType::F32, m * n);
    out.as_mut_slice::<f32>()
        .par_chunks_mut(TILE * n)
        .enumerate()
        .for_each(|(t, dst)| {
            let rows = dst.len() / n.max(1);
            let mut tile = vec![0f32; TILE * k];
            tile[..rows * k].copy_from_slice(&a[t * TILE * k..(t * TILE + rows) * k]);
            let mut res = vec![0f32; TILE * n];
            let oa = Operand {
                data: &tile,
                layout: tile_layout.clone(),
            };
            gemm_one(
                &oa,
                0,
                &ob,
                ob.layout.offset(),
                None,
                TILE,
                k,
                n,
                &mut res,
                Parallelism::None,
            );
            dst.copy_from_slice(&res[..rows * n]);
        });
    drop((a, gb));
    finish(out, &[m, n], out_dtype)
}
