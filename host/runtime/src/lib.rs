//! The plugin host and model runner of Anneal: finding and loading plugins, serving their
//! host-op calls over engine tensors, running models (stages, recompute, KV cache) and
//! optimizers, Hugging Face directories, logprobs and generation, and the continuous-batching
//! decode loop that serves requests (`serving`). The run harness and trainer
//! live in `anneal-train`, RL in `anneal-rl`.

pub mod hf;
pub mod infer;
pub mod plugins;
pub mod serving;
