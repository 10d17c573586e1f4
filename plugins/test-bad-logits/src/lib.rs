//! A deliberately broken model plugin for the host's tests, declared as `badlogits`: a one-table
//! bigram model whose head returns logits of the wrong shape, so tests can check that the host
//! reports it instead of crashing. Flavors: `rank2` returns `[B·T, V]`, `narrow` returns
//! `[B, T, V − 1]`, `ok` returns the right `[B, T, V]` (a control). Flavor `aux` returns the
//! right logits and, from its one block, the auxiliary loss `l2` (mean square of the hidden
//! state) and the statistic `hidden_mean` (`[DIM]`), and keeps the buffer `seen` (`[DIM]`),
//! to which its `before_optimizer_step` adds each step's `hidden_mean`, so the host's handling
//! of named outputs and buffers is tested. Flavor `aux_rl` is `aux` without the buffer, for RL
//! runs that compare gradients. Flavor `moe` puts the host's MoE layer (`moe_ffn`, 4
//! experts, top-2, `[out, in]` weights) in its block and reports the layer's balancing loss as
//! `balance` and its statistics `router_imbalance`, `router_entropy` and `tokens_per_expert`.
//! Flavor `refuse`'s head refuses its input (a plugin's typed user error) and flavor `panic`'s
//! head panics (a plugin's bug), so tests check that the host tells the two apart.
//! Arguments are ignored.

use anneal_plugin_api::sdk::{
    Ctx, Error, Factory, Init, Model, ModelSpec, MoeFfnOpts, ParamSpec, Placement, Result, Router,
    Tensor,
};

/// Vocabulary of the logits (the end-to-end tests' tokenizers have 320 tokens).
const VOCAB: usize = 320;
/// Width of the embedding.
const DIM: usize = 8;
/// Experts of the `moe` flavor.
const EXPERTS: usize = 4;
/// Width of each expert.
const EXPERT_FFN: usize = 16;

/// Which wrong shape the head returns.
pub struct BadLogits {
    flavor: String,
}

impl Factory for BadLogits {
    fn flavors() -> Vec<String> {
        vec![
            "rank2".into(),
            "narrow".into(),
            "ok".into(),
            "aux".into(),
            "aux_rl".into(),
            "moe".into(),
            "refuse".into(),
            "panic".into(),
        ]
    }

    fn create(flavor: Option<&str>, _args: anneal_plugin_api::serde_json::Value) -> Result<Self> {
        let flavor = flavor.unwrap_or("rank2");
        if !Self::flavors().iter().any(|f| f == flavor) {
            return Err(format!(
                "unknown flavor '{flavor}' (known: rank2, narrow, ok, aux, aux_rl, moe, refuse, panic)"
            )
            .into());
        }
        Ok(BadLogits {
            flavor: flavor.into(),
        })
    }
}

fn table(name: &str) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape: vec![VOCAB, DIM],
        dtype: "f32".into(),
        init: Init::Normal { std: 0.02 },
        placement: Placement::default(),
        layer: None,
        hf: None,
        trainable: true,
    }
}

/// The `aux` flavor's buffer: the sum of every step's `hidden_mean`.
fn seen() -> ParamSpec {
    ParamSpec {
        name: "seen".into(),
        shape: vec![DIM],
        init: Init::Zeros,
        trainable: false,
        ..table("seen")
    }
}

/// A parameter of `shape` initialised like the tables.
fn weight(name: &str, shape: &[usize]) -> ParamSpec {
    ParamSpec {
        shape: shape.to_vec(),
        ..table(name)
    }
}

impl Model for BadLogits {
    fn spec(&self) -> ModelSpec {
        ModelSpec {
            active_params: None,
            architecture: "badlogits".into(),
            n_layers: usize::from(self.flavor.starts_with("aux") || self.flavor == "moe"),
            vocab_size: VOCAB,
            max_seq_len: 64,
            flops_per_token: (6 * VOCAB * DIM) as f64,
            context_flops_per_token: 0.0,
            params: if self.flavor == "aux" {
                vec![table("embedding"), table("output"), seen()]
            } else if self.flavor == "moe" {
                vec![
                    table("embedding"),
                    table("output"),
                    weight("router", &[EXPERTS, DIM]),
                    weight("gate", &[EXPERTS, EXPERT_FFN, DIM]),
                    weight("up", &[EXPERTS, EXPERT_FFN, DIM]),
                    weight("down", &[EXPERTS, DIM, EXPERT_FFN]),
                ]
            } else {
                vec![table("embedding"), table("output")]
            },
            kv_cache: vec![],
            hf: None,
            parallel: Default::default(),
        }
    }

    fn embed<'h>(&self, _ctx: &Ctx<'h>, tokens: Tensor<'h>) -> Result<Vec<Tensor<'h>>> {
        let table = tokens.host().param("embedding")?;
        Ok(vec![table.embedding(&tokens)?])
    }

    fn layer<'h>(
        &self,
        ctx: &Ctx<'h>,
        _index: usize,
        hidden: Vec<Tensor<'h>>,
    ) -> Result<Vec<Tensor<'h>>> {
        let h = hidden.first().ok_or("layer: no hidden state")?;
        if self.flavor == "moe" {
            let p = |n: &str| h.host().param(n);
            let opts = MoeFfnOpts {
                aux_loss_coef: 0.01,
                out_in: true,
                ..MoeFfnOpts::new(Router {
                    renormalize: true,
                    ..Router::new(EXPERTS, 2)
                })
            };
            let moe = h.moe_ffn(&p("router")?, &p("gate")?, &p("up")?, &p("down")?, &opts)?;
            if let Some(aux) = &moe.aux_loss {
                ctx.aux_loss("balance", aux)?;
            }
            ctx.stat("router_imbalance", &moe.imbalance)?;
            ctx.stat("router_entropy", &moe.entropy)?;
            ctx.stat("tokens_per_expert", &moe.tokens_per_expert)?;
            return Ok(vec![h.add(&moe.out)?]);
        }
        ctx.aux_loss("l2", &h.mul(h)?.mean(&[0, 1, 2], false)?)?;
        ctx.stat("hidden_mean", &h.mean(&[0, 1], false)?)?;
        Ok(hidden)
    }

    fn head<'h>(&self, _ctx: &Ctx<'h>, hidden: Vec<Tensor<'h>>) -> Result<Tensor<'h>> {
        let h = hidden.into_iter().next().ok_or("head: no hidden state")?;
        let logits = h.linear(&h.host().param("output")?)?;
        match self.flavor.as_str() {
            "rank2" => logits.reshape(&[-1, VOCAB as i64]),
            "narrow" => logits.narrow(2, 0, VOCAB - 1),
            "refuse" => Err(Error::input(
                "sequences longer than 4 tokens are not supported by this flavor",
            )),
            "panic" => panic!("deliberate panic in head"),
            _ => Ok(logits),
        }
    }

    fn before_optimizer_step(
        &self,
        host: anneal_plugin_api::sdk::Host<'_>,
        _step: u64,
    ) -> Result<()> {
        if self.flavor != "aux" {
            return Ok(());
        }
        let seen = host.param("seen")?;
        seen.assign(&seen.add(&host.param("stats.hidden_mean")?)?)
    }
}

anneal_plugin_api::export_plugin!(model BadLogits, name = "badlogits", description = "test plugin: logits of the wrong shape, or auxiliary outputs");
