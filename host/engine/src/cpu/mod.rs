//! The CPU backend: rayon's persistent thread pool, runtime SIMD dispatch, `gemm` for matrix
//! products. Floating kernels compute in f32 whatever the storage dtype.
//!
//! Determinism: work is split into chunks whose boundaries depend on sizes only, never on the
//! number of threads, and every reduction sums in a fixed order, so results are bitwise
//! identical with any thread count.

mod attention;
pub(crate) mod convert;
pub(crate) mod delta_rule;
mod elementwise;
pub(crate) mod logsumexp;
mod matmul;
mod reduce;
mod sgemm;
pub(crate) mod simd;

pub(crate) use matmul::matmul_row_tiles;

/// Whether f32 products run on the packed AVX-512 kernel.
pub(crate) fn sgemm_available() -> bool {
    sgemm::available()
}

/// Whether bf16 products run on AVX512-BF16 dot products.
pub(crate) fn bf16_gemm_available() -> bool {
    sgemm::bf16::available()
}

// Indexing and mixture-of-experts kernels.
pub(crate) mod index;
mod moe;
pub(crate) mod moe_route;
mod random;
mod shape;

use crate::backend::Backend;
use crate::error::Result;
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::storage::Storage;
use crate::{DType, Tensor};

/// Elements per parallel task in elementwise kernels (fixed, for determinism).
pub(crate) const CHUNK: usize = 1 << 14;

/// The CPU backend.
pub struct CpuBackend;

/// `QKᵀ` and `PV` of an attention forward (halved when causal).
fn attention_flops(q: &Tensor, k: &Tensor, v: &Tensor, spec: &crate::ops::AttentionSpec) -> u64 {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return 0;
    }
    let (b, h, tq, d) = (qs[0], qs[1], qs[2], qs[3]);
    let full = 2 * b * h * tq * ks[2] * (d + vs[3]);
    (if spec.causal { full / 2 } else { full }) as u64
}

/// A contiguous tensor of `dtype` from f32 results (converted when `dtype` is not f32).
pub(crate) fn finish(out: Storage, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_storage(out, shape)?;
    Ok(if dtype == DType::F32 {
        t
    } else {
        t.materialize(dtype)
    })
}

/// The dtype a floating op returns for an input dtype (integers compute and return as f32).
pub(crate) fn float_out(dtype: DType) -> DType {
    if dtype.is_float() {
        dtype
    } else {
        DType::F32
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope_sub("unary", op.name());
        elementwise::unary(op, x)
    }
    fn unary_grad(&self, op: UnaryOp, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope_sub("unary_grad", op.name());
        elementwise::unary_grad(op, x, grad)
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope_sub("binary", op.name());
        elementwise::binary(op, a, b)
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        let _p = crate::profile::scope("affine");
        elementwise::map(x, move |v| v * mul + add)
    }
    fn powf(&self, x: &Tensor, e: f32) -> Result<Tensor> {
        let _p = crate::profile::scope("powf");
        if e == 2.0 {
            return elementwise::map(x, |v| v * v);
        }
        elementwise::map(x, move |v| v.powf(e))
    }
    fn clamp(&self, x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
        let _p = crate::profile::scope("clamp");
        elementwise::map(x, move |v| v.max(lo).min(hi))
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, dim: usize) -> Result<Tensor> {
        let _p = crate::profile::scope_sub("reduce", op.name());
        reduce::reduce(op, x, dim)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        // batch · m · k multiply-adds per output column.
        let n = b.shape()[b.rank() - 1];
        crate::flops::add(2 * (a.numel() * n) as u64);
        matmul::matmul(a, b)
    }
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let _p = crate::profile::scope("cast");
        Ok(x.materialize(dtype))
    }
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let _p = crate::profile::scope("add_assign");
        elementwise::add_assign(dst, src)
    }
    fn topk(
        &self,
        x: &Tensor,
        k: usize,
        dim: usize,
        largest: bool,
        sorted: bool,
    ) -> Result<(Tensor, Tensor)> {
        let _p = crate::profile::scope("topk");
        index::topk(x, k, dim, largest, sorted)
    }
    fn index_select(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope("index_select");
        index::index_select(x, dim, idx)
    }
    fn index_add(&self, base: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope("index_add");
        index::index_add(base, dim, idx, src)
    }
    fn gather(&self, x: &Tensor, dim: usize, idx: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope("gather");
        index::gather(x, dim, idx)
    }
    fn scatter_add(&self, x: &Tensor, dim: usize, idx: &Tensor, src: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope("scatter_add");
        index::scatter_add(x, dim, idx, src)
    }
    fn where_(&self, cond: &Tensor, a: &Tensor, b: &Tensor, dtype: DType) -> Result<Tensor> {
        let _p = crate::profile::scope("where_");
        index::where_(cond, a, b, dtype)
    }
    fn sort_by_expert(&self, ids: &Tensor, num_experts: usize) -> Result<[Tensor; 4]> {
        let _p = crate::profile::scope("sort_by_expert");
        moe_route::sort_by_expert(ids, num_experts)
    }
    fn grouped_matmul(
        &self,
        x: &Tensor,
        w: &Tensor,
        counts: &Tensor,
        transpose_w: bool,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("grouped_matmul");
        moe::grouped_matmul(x, w, &moe_route::host_counts(counts), transpose_w)
    }
    fn grouped_matmul_weight_grad(
        &self,
        x: &Tensor,
        g: &Tensor,
        counts: &Tensor,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("grouped_matmul_weight_grad");
        moe::grouped_matmul_weight_grad(x, g, &moe_route::host_counts(counts))
    }
    fn moe_dispatch(&self, x: &Tensor, token: &Tensor, dtype: DType) -> Result<Tensor> {
        moe_route::dispatch(
            x,
            &index::read_indices("moe_dispatch", token, x.shape()[0])?,
            dtype,
        )
    }
    fn moe_dispatch_backward(
        &self,
        g: &Tensor,
        inverse: &Tensor,
        k: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let inverse = index::read_indices("moe_dispatch_backward", inverse, g.shape()[0])?;
        moe_route::dispatch_backward(g, &inverse, k, dtype)
    }
    fn moe_combine(
        &self,
        y: &Tensor,
        w: &Tensor,
        inverse: &Tensor,
        dtype: DType,
    ) -> Result<Tensor> {
        let inverse = index::read_indices("moe_combine", inverse, y.shape()[0])?;
        moe_route::combine(y, w, &inverse, dtype)
    }
    fn moe_combine_backward(
        &self,
        y: &Tensor,
        w: &Tensor,
        g: &Tensor,
        order: &Tensor,
        inverse: &Tensor,
        need: (bool, bool),
        dtypes: (DType, DType),
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        const OP: &str = "moe_combine_backward";
        let order = index::read_indices(OP, order, w.numel())?;
        let inverse = index::read_indices(OP, inverse, y.shape()[0])?;
        moe_route::combine_backward(y, w, g, &order, &inverse, need, dtypes)
    }
    fn cat(&self, tensors: &[Tensor], dim: usize) -> Result<Tensor> {
        let _p = crate::profile::scope("cat");
        shape::cat(tensors, dim)
    }
    fn dropout(
        &self,
        x: &Tensor,
        p: f32,
        scale: f32,
        key: &crate::rng::RngKey,
        offset: u64,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("dropout");
        random::dropout(x, p, scale, key, offset)
    }
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        let _p = crate::profile::scope("attention");
        crate::flops::add(attention_flops(q, k, v, spec));
        attention::forward(q, k, v, sinks, spec)
    }
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
        out: &Tensor,
        lse: &Tensor,
        grad: &Tensor,
        spec: &crate::ops::AttentionSpec,
    ) -> Result<crate::ops::AttentionGrads> {
        let _p = crate::profile::scope("attention_backward");
        attention::backward(q, k, v, sinks, out, lse, grad, spec)
    }
}

mod embedding;
mod loss;
mod norm;
mod rope;
mod rowwise;
mod softmax;

impl crate::backend::FusedBackend for CpuBackend {
    fn softmax(&self, x: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
        let _p = crate::profile::scope("softmax");
        softmax::softmax(x, dim, log)
    }
    fn softmax_backward(&self, y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
        let _p = crate::profile::scope("softmax_backward");
        softmax::softmax_backward(y, g, dim, log)
    }
    fn rms_norm(&self, x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<(Tensor, Tensor)> {
        let _p = crate::profile::scope("rms_norm");
        norm::rms_norm(x, w, eps)
    }
    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        rstd: &Tensor,
        g: &Tensor,
        need_w: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let _p = crate::profile::scope("rms_norm_backward");
        norm::rms_norm_backward(x, w, rstd, g, need_w)
    }
    fn layer_norm(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let _p = crate::profile::scope("layer_norm");
        norm::layer_norm(x, w, b, eps)
    }
    fn layer_norm_backward(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        g: &Tensor,
        need: (bool, bool),
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let _p = crate::profile::scope("layer_norm_backward");
        norm::layer_norm_backward(x, w, mean, rstd, g, need)
    }
    fn rope(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        spec: crate::ops::RopeSpec,
        inverse: bool,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("rope");
        rope::rope(x, cos, sin, spec, inverse)
    }
    fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope("embedding");
        embedding::embedding(weight, ids)
    }
    fn embedding_backward(
        &self,
        ids: &Tensor,
        g: &Tensor,
        vocab: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("embedding_backward");
        embedding::embedding_backward(ids, g, vocab, dtype)
    }
    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<(Tensor, Tensor)> {
        let _p = crate::profile::scope("cross_entropy");
        loss::cross_entropy(logits, targets, ignore_index, label_smoothing)
    }
    fn cross_entropy_backward(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
        row_scale: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f32,
    ) -> Result<Tensor> {
        let _p = crate::profile::scope("cross_entropy_backward");
        loss::cross_entropy_backward(
            logits,
            targets,
            lse,
            row_scale,
            ignore_index,
            label_smoothing,
        )
    }
}

mod optim;

impl crate::backend::OptimBackend for CpuBackend {
    fn adamw(&self, groups: &[crate::ops::AdamWTensors<'_>], hp: &crate::ops::AdamW) -> Result<()> {
        let _p = crate::profile::scope("adamw");
        optim::adamw(groups, &hp.consts())
    }

    fn sum_of_squares(&self, tensors: &[&Tensor]) -> Result<Tensor> {
        let sums: Vec<f32> = tensors.iter().map(|t| t.sum_of_squares() as f32).collect();
        Tensor::from_vec(sums, &[tensors.len()])
    }
}

mod swiglu;

impl crate::backend::FusionBackend for CpuBackend {
    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let _p = crate::profile::scope("swiglu");
        swiglu::swiglu(gate, up)
    }
    fn swiglu_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let _p = crate::profile::scope("swiglu_backward");
        swiglu::swiglu_backward(gate, up, grad)
    }
}
