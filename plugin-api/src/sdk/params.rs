//! Declaring parameters once: one [`Decl`] gives a parameter's spec (shape, dtype, init,
//! placement), its Hugging Face mapping, and the [`Param`] handle the forward fetches it with.
//!
//! ```ignore
//! let mut t = ParamTable::new("f32");
//! let embed = t.add(Decl::new("tok_embeddings.weight", [vocab, dim]).normal(1.0).vocab()
//!     .hf_name("model.embed_tokens.weight"));
//! let mut l = t.layer(0, "layers.0", "model.layers.0");
//! let wq = l.add(Decl::new("attention.wq.weight", [dim, dim]).trunc_normal(0.02).column()
//!     .hf_name("self_attn.q_proj.weight"));
//! // forward: x.linear(&ctx.w(&wq)?)?
//! ```

use super::{Error, Result};
use crate::spec::{HfMap, Init, ParamSpec, Placement, TensorParallel};
use std::sync::Arc;

/// A declared parameter. Only [`ParamTable`] makes one, so the forward can only fetch what the
/// spec declares; fetch it with [`super::Ctx::w`] or [`super::Host::w`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    name: Arc<str>,
}

impl Param {
    /// The parameter's full name (`layers.0.attention.wq.weight`).
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// One parameter's declaration, built up field by field.
#[derive(Clone, Debug)]
pub struct Decl {
    spec: ParamSpec,
    dtype_set: bool,
}

impl Decl {
    /// A parameter called `name` (relative to the layer scope it is added in) of `shape`,
    /// initialized to zeros, FSDP-shardable when it has more than one dim.
    pub fn new(name: &str, shape: impl Into<Vec<usize>>) -> Self {
        let shape = shape.into();
        Decl {
            spec: ParamSpec {
                name: name.to_string(),
                placement: Placement {
                    fsdp: shape.len() > 1,
                    ..Default::default()
                },
                shape,
                dtype: String::new(),
                init: Init::Zeros,
                layer: None,
                hf: None,
                trainable: true,
            },
            dtype_set: false,
        }
    }

    /// Initialization.
    pub fn init(mut self, init: Init) -> Self {
        self.spec.init = init;
        self
    }
    /// Ones (norm weights).
    pub fn ones(self) -> Self {
        self.init(Init::Ones)
    }
    /// Normal with mean 0.
    pub fn normal(self, std: f64) -> Self {
        self.init(Init::Normal { std })
    }
    /// Normal with mean 0, truncated to ±3 std.
    pub fn trunc_normal(self, std: f64) -> Self {
        self.init(Init::TruncNormal {
            std,
            a: -3.0 * std,
            b: 3.0 * std,
        })
    }
    /// Another dtype than the table's.
    pub fn dtype(mut self, dtype: &str) -> Self {
        self.spec.dtype = dtype.to_string();
        self.dtype_set = true;
        self
    }
    /// Tensor parallelism splits the output features (dim 0 of `[out, in]`, dim 1 of stacked
    /// experts' `[expert, out, in]`).
    pub fn column(self) -> Self {
        self.tp(TensorParallel::Column)
    }
    /// Tensor parallelism splits the input features (the last dim of `[out, in]` or
    /// `[expert, out, in]`).
    pub fn row(self) -> Self {
        self.tp(TensorParallel::Row)
    }
    /// Tensor parallelism splits the vocabulary.
    pub fn vocab(self) -> Self {
        self.tp(TensorParallel::Vocab)
    }
    /// A tensor-parallel split.
    pub fn tp(mut self, tp: TensorParallel) -> Self {
        self.spec.placement.tensor_parallel = Some(tp);
        self
    }
    /// Shared by every attention head and applied to each head apart (per-head norms): see
    /// [`Placement::per_head`].
    pub fn per_head(mut self) -> Self {
        self.spec.placement.per_head = true;
        self
    }
    /// The dim that indexes experts (expert parallelism splits it).
    pub fn expert_dim(mut self, dim: usize) -> Self {
        self.spec.placement.expert_dim = Some(dim);
        self
    }
    /// A buffer rather than a trained parameter: checkpointed and exported, never given a
    /// gradient or optimizer state; the model updates it in `Model::before_optimizer_step`.
    pub fn buffer(mut self) -> Self {
        self.spec.trainable = false;
        self.spec.placement.fsdp = false;
        self
    }
    /// Kept whole on every rank: FSDP does not shard it, and tensor parallelism keeps a matrix
    /// declared so whole (a router's gate, applied by every rank to the whole batch).
    pub fn replicated(mut self) -> Self {
        self.spec.placement.fsdp = false;
        self
    }
    /// Its Hugging Face mapping (sources relative to the layer scope's Hugging Face prefix).
    pub fn hf(mut self, map: HfMap) -> Self {
        self.spec.hf = Some(map);
        self
    }
    /// The Hugging Face tensor of the same layout, by name (relative to the scope's prefix).
    pub fn hf_name(self, name: &str) -> Self {
        self.hf(HfMap::one(name))
    }
}

/// Every parameter of a model, declared in order.
#[derive(Clone, Debug, Default)]
pub struct ParamTable {
    params: Vec<ParamSpec>,
    dtype: String,
}

impl ParamTable {
    /// An empty table whose parameters default to `dtype` (`f32`, `bf16`).
    pub fn new(dtype: &str) -> Self {
        ParamTable {
            params: vec![],
            dtype: dtype.to_string(),
        }
    }

    /// Declares a parameter outside any block (embeddings, final norm, head).
    pub fn add(&mut self, d: Decl) -> Param {
        self.push(d, "", "", None)
    }

    /// A decoder's token embedding `tok_embeddings.weight [vocab, dim]`: N(0, 1), split over
    /// the vocabulary by tensor parallelism, Hugging Face's `model.embed_tokens.weight`.
    pub fn token_embedding(&mut self, vocab: usize, dim: usize) -> Param {
        self.add(
            Decl::new("tok_embeddings.weight", [vocab, dim])
                .normal(1.0)
                .vocab()
                .hf_name("model.embed_tokens.weight"),
        )
    }

    /// A decoder's final RMSNorm `norm.weight [dim]` and output projection `output.weight
    /// [vocab, dim]` (truncated normal of std `dim^-0.5`; `tied` instead when the embedding is
    /// shared, which then takes the output's init: N(0, 1) rows would make the first logits of
    /// std `√dim` and the first loss hundreds), Hugging Face's `model.norm.weight` and
    /// `lm_head.weight`.
    pub fn final_norm_and_output(
        &mut self,
        vocab: usize,
        dim: usize,
        tied: Option<&Param>,
    ) -> (Param, Param) {
        let norm = self.add(
            Decl::new("norm.weight", [dim])
                .ones()
                .hf_name("model.norm.weight"),
        );
        let std = (dim as f64).powf(-0.5);
        let output = match tied {
            Some(embedding) => {
                if let Some(p) = self.params.iter_mut().find(|p| p.name == embedding.name()) {
                    p.init = Init::TruncNormal {
                        std,
                        a: -3.0 * std,
                        b: 3.0 * std,
                    };
                }
                embedding.clone()
            }
            None => self.add(
                Decl::new("output.weight", [vocab, dim])
                    .trunc_normal(std)
                    .column()
                    .hf_name("lm_head.weight"),
            ),
        };
        (norm, output)
    }

    /// A scope for block `index`: names get `prefix.` and Hugging Face names `hf_prefix.`.
    pub fn layer<'a>(&'a mut self, index: usize, prefix: &str, hf_prefix: &str) -> LayerScope<'a> {
        LayerScope {
            table: self,
            index,
            prefix: format!("{prefix}."),
            hf_prefix: format!("{hf_prefix}."),
        }
    }

    fn push(&mut self, d: Decl, prefix: &str, hf_prefix: &str, layer: Option<usize>) -> Param {
        let mut spec = d.spec;
        spec.name = format!("{prefix}{}", spec.name);
        if !d.dtype_set {
            spec.dtype = self.dtype.clone();
        }
        spec.layer = layer;
        if let Some(m) = &mut spec.hf {
            for s in &mut m.sources {
                *s = format!("{hf_prefix}{s}");
            }
        }
        let p = Param {
            name: spec.name.as_str().into(),
        };
        self.params.push(spec);
        p
    }

    /// The declared parameter called `name`; an error names it and the closest declared names,
    /// so a lookup by name fails when the plugin is created, not in the middle of a forward.
    pub fn get(&self, name: &str) -> Result<Param> {
        if self.params.iter().any(|p| p.name == name) {
            return Ok(Param { name: name.into() });
        }
        let mut near: Vec<(usize, &str)> = self
            .params
            .iter()
            .map(|p| (edit_distance(&p.name, name), p.name.as_str()))
            .collect();
        near.sort();
        let near: Vec<&str> = near.iter().take(2).map(|n| n.1).collect();
        Err(Error::internal(format!(
            "no parameter '{name}' is declared (closest: {})",
            near.join(", ")
        )))
    }

    /// The declared specs, checked (see [`crate::spec::ModelSpec::check`]).
    pub fn specs(&self) -> &[ParamSpec] {
        &self.params
    }

    /// Takes the declared specs.
    pub fn into_specs(self) -> Vec<ParamSpec> {
        self.params
    }
}

/// Declares the parameters of one block (see [`ParamTable::layer`]).
pub struct LayerScope<'a> {
    table: &'a mut ParamTable,
    index: usize,
    prefix: String,
    hf_prefix: String,
}

impl LayerScope<'_> {
    /// Declares a parameter of this block.
    pub fn add(&mut self, d: Decl) -> Param {
        self.table
            .push(d, &self.prefix, &self.hf_prefix, Some(self.index))
    }
}

/// Levenshtein distance, for "closest" suggestions.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ModelSpec;

    fn spec(params: Vec<ParamSpec>) -> ModelSpec {
        ModelSpec {
            active_params: None,
            architecture: "t".into(),
            n_layers: 1,
            vocab_size: 4,
            max_seq_len: 4,
            flops_per_token: 0.0,
            context_flops_per_token: 0.0,
            params,
            kv_cache: vec![],
            hf: None,
            parallel: Default::default(),
        }
    }

    #[test]
    fn one_declaration_gives_name_spec_and_mapping() {
        let mut t = ParamTable::new("bf16");
        let e = t.add(
            Decl::new("embed", [4, 2])
                .normal(1.0)
                .vocab()
                .hf_name("model.embed"),
        );
        let mut l = t.layer(3, "layers.3", "model.layers.3");
        let w = l.add(
            Decl::new("moe.w1", [8, 6, 2])
                .expert_dim(0)
                .dtype("f32")
                .hf(HfMap::stack("mlp.experts.{e}.w1.weight", 8)),
        );
        assert_eq!((e.name(), w.name()), ("embed", "layers.3.moe.w1"));
        let s = &t.specs()[1];
        assert_eq!((s.layer, s.dtype.as_str()), (Some(3), "f32"));
        assert_eq!(t.specs()[0].dtype, "bf16");
        let hf = s.hf.as_ref().unwrap();
        assert_eq!(hf.sources[7], "model.layers.3.mlp.experts.7.w1.weight");
        assert_eq!(t.get("layers.3.moe.w1").unwrap(), w);
        spec(t.into_specs()).check().unwrap();
    }

    #[test]
    fn a_typo_fails_at_declaration_time_naming_the_parameter() {
        let mut t = ParamTable::new("f32");
        let mut l = t.layer(0, "layers.0", "model.layers.0");
        l.add(Decl::new("attention.wq.weight", [2, 2]));
        l.add(Decl::new("attention.wk.weight", [2, 2]));
        let e = t.get("layers.0.attention.wqq.weight").unwrap_err();
        assert!(
            e.msg.contains("'layers.0.attention.wqq.weight'")
                && e.msg.contains("closest: layers.0.attention.wq.weight"),
            "{e}"
        );
        // A mapping that does not fit its parameter, a name declared twice, a Hugging Face
        // tensor claimed twice: each refused with the parameter's name.
        let bad = |d: Vec<Decl>| {
            let mut t = ParamTable::new("f32");
            for d in d {
                t.add(d);
            }
            spec(t.into_specs()).check().unwrap_err()
        };
        let e = bad(vec![
            Decl::new("w", [3, 2, 2]).hf(HfMap::stack("experts.{e}.w", 4))
        ]);
        assert!(e.contains("'w'") && e.contains("4 tensors"), "{e}");
        let e = bad(vec![Decl::new("w", [2]), Decl::new("w", [2])]);
        assert!(e.contains("'w' is declared twice"), "{e}");
        let e = bad(vec![
            Decl::new("a", [2]).hf_name("x"),
            Decl::new("b", [2]).hf_name("x"),
        ]);
        assert!(e.contains("'a' and 'b'") && e.contains("'x'"), "{e}");
        let e = bad(vec![
            Decl::new("gate", [2, 2]).hf(HfMap::one("gate_up").part(0, 0, 2, false))
        ]);
        assert!(e.contains("'gate_up'") && e.contains("2 parts"), "{e}");
    }
}
