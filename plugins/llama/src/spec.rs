//! The parameter list, placements, initialization and costs of a Llama model.

use crate::config::LlamaArgs;
use crate::hf;
use anneal_plugin_api::sdk::{Init, ModelSpec, ParamSpec, Placement, TensorParallel};

fn param(
    name: String,
    shape: Vec<usize>,
    dtype: &str,
    init: Init,
    tp: Option<TensorParallel>,
    layer: Option<usize>,
) -> ParamSpec {
    let fsdp = shape.len() > 1;
    ParamSpec {
        name,
        shape,
        dtype: dtype.to_string(),
        init,
        placement: Placement {
            tensor_parallel: tp,
            expert_dim: None,
            fsdp,
        },
        layer,
    }
}

fn trunc(std: f64) -> Init {
    Init::TruncNormal {
        std,
        a: -3.0 * std,
        b: 3.0 * std,
    }
}

/// Every parameter, TorchTitan-style: N(0,1) embeddings, truncated normal projections (depth-
/// scaled for the ones writing into the residual stream), ones for norms.
pub fn params(a: &LlamaArgs) -> Vec<ParamSpec> {
    use TensorParallel::{Column, Row, Vocab};
    let (d, hd, dt) = (a.dim, a.head_dim(), a.dtype.as_str());
    let mut v = vec![param(
        "tok_embeddings.weight".into(),
        vec![a.vocab_size, d],
        dt,
        Init::Normal { std: 1.0 },
        Some(Vocab),
        None,
    )];
    for i in 0..a.n_layers {
        let p = |n: &str| format!("layers.{i}.{n}");
        let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
        let l = Some(i);
        v.push(param(
            p("attention_norm.weight"),
            vec![d],
            dt,
            Init::Ones,
            None,
            l,
        ));
        v.push(param(
            p("attention.wq.weight"),
            vec![a.n_heads * hd, d],
            dt,
            trunc(0.02),
            Some(Column),
            l,
        ));
        v.push(param(
            p("attention.wk.weight"),
            vec![a.n_kv_heads * hd, d],
            dt,
            trunc(0.02),
            Some(Column),
            l,
        ));
        v.push(param(
            p("attention.wv.weight"),
            vec![a.n_kv_heads * hd, d],
            dt,
            trunc(0.02),
            Some(Column),
            l,
        ));
        if a.qk_norm {
            v.push(param(
                p("attention.q_norm.weight"),
                vec![hd],
                dt,
                Init::Ones,
                None,
                l,
            ));
            v.push(param(
                p("attention.k_norm.weight"),
                vec![hd],
                dt,
                Init::Ones,
                None,
                l,
            ));
        }
        v.push(param(
            p("attention.wo.weight"),
            vec![d, a.n_heads * hd],
            dt,
            trunc(depth_std),
            Some(Row),
            l,
        ));
        v.push(param(
            p("ffn_norm.weight"),
            vec![d],
            dt,
            Init::Ones,
            None,
            l,
        ));
        v.push(param(
            p("feed_forward.w1.weight"),
            vec![a.ffn_dim, d],
            dt,
            trunc(0.02),
            Some(Column),
            l,
        ));
        v.push(param(
            p("feed_forward.w3.weight"),
            vec![a.ffn_dim, d],
            dt,
            trunc(depth_std),
            Some(Column),
            l,
        ));
        v.push(param(
            p("feed_forward.w2.weight"),
            vec![d, a.ffn_dim],
            dt,
            trunc(depth_std),
            Some(Row),
            l,
        ));
    }
    v.push(param(
        "norm.weight".into(),
        vec![d],
        dt,
        Init::Ones,
        None,
        None,
    ));
    if !a.tie_embeddings {
        let std = (d as f64).powf(-0.5);
        v.push(param(
            "output.weight".into(),
            vec![a.vocab_size, d],
            dt,
            trunc(std),
            Some(Column),
            None,
        ));
    }
    v
}

/// The full spec: parameters, layers, KV-cache needs, FLOPs and the Hugging Face adapter.
pub fn model_spec(a: &LlamaArgs) -> ModelSpec {
    let params = params(a);
    let n: usize = params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let embedding = a.vocab_size * a.dim;
    // 6 FLOPs per parameter per token (forward + backward) for the matmuls, plus attention
    // scores and values: 12 · layers · heads · head_dim · seq_len.
    let dense = (n - embedding) as f64;
    let attn = 12.0 * (a.n_layers * a.n_heads * a.head_dim() * a.max_seq_len) as f64;
    ModelSpec {
        architecture: "llama".into(),
        n_layers: a.n_layers,
        vocab_size: a.vocab_size,
        max_seq_len: a.max_seq_len,
        flops_per_token: 6.0 * dense + attn,
        kv_cache: vec![Some((a.n_kv_heads, a.head_dim())); a.n_layers],
        hf: Some(hf::adapter(a, &params)),
        params,
    }
}
