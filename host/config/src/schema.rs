//! The sections of a job config and their defaults. Every struct rejects unknown keys, so a typo
//! fails with its key path instead of being ignored.

use crate::tuning::{Lora, Preference};
use serde::{Deserialize, Serialize};

/// Free-form arguments handed to a plugin as JSON (the plugin validates them).
pub type PluginArgs = serde_json::Map<String, serde_json::Value>;

/// A whole job: what `anneal train` (and later `anneal rl`) runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    /// Name and description of the job.
    pub job: Job,
    /// The model plugin.
    pub model: Model,
    /// The optimizer plugin and its learning rate.
    pub optimizer: Optimizer,
    /// Learning-rate schedule.
    pub lr_scheduler: LrScheduler,
    /// Steps, batch shape, clipping, dtype, seed.
    pub training: Training,
    /// Parallelism degrees (reserved: single process for now).
    pub parallelism: Parallelism,
    /// Checkpoint cadence and retention.
    pub checkpoint: Checkpoint,
    /// Recompute of activations in backward.
    pub activation_checkpoint: ActivationCheckpoint,
    /// Corpus and tokenizer.
    pub data: Data,
    /// Logging and evaluation cadence.
    pub metrics: Metrics,
    /// RL post-training (`anneal rl`).
    pub rl: Rl,
    /// What `anneal train --nproc N` does when a rank of the job dies. Left out of the
    /// serialized config while off, so a run that does not use it records what it did before.
    #[serde(skip_serializing_if = "FaultTolerance::is_off")]
    pub fault_tolerance: FaultTolerance,
    /// Low-rank adapters (LoRA): the base model frozen, only the adapters trained. Left out
    /// of the serialized config while off.
    #[serde(skip_serializing_if = "Lora::is_off")]
    pub lora: Lora,
    /// Preference tuning (DPO, SimPO) on pairs of completions. Left out of the serialized
    /// config while off.
    #[serde(skip_serializing_if = "Preference::is_off")]
    pub preference: Preference,
}

/// `[job]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Job {
    /// Short name; the default run directory is `runs/<name>-<time>`.
    pub name: String,
    /// Free text shown next to the run.
    pub description: String,
    /// Where the trainer keeps parameters, optimizer state and activations: `cpu` (the
    /// default), `cuda` (GPU 0) or `cuda:N`. Checkpoints are the same files on either, so a
    /// run may resume on another device.
    pub device: String,
}

impl Default for Job {
    fn default() -> Self {
        Job {
            name: "job".into(),
            description: String::new(),
            device: "cpu".into(),
        }
    }
}

/// `[model]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Model {
    /// Plugin name, as `anneal plugins list` shows it. Empty (the default): the plugin serving
    /// the `model_type` of the Hugging Face directory the job starts from
    /// (`checkpoint.init_from_hf`, or `rl.init_from` when it is one), otherwise `llama`.
    pub plugin: String,
    /// Named flavor of the plugin (its preset sizes).
    pub flavor: String,
    /// Overrides of the flavor's arguments, passed to the plugin as JSON.
    pub args: PluginArgs,
}

impl Default for Model {
    fn default() -> Self {
        Model {
            plugin: String::new(),
            flavor: "debugmodel".into(),
            args: PluginArgs::new(),
        }
    }
}

/// `[optimizer]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Optimizer {
    /// Plugin name.
    pub plugin: String,
    /// Peak learning rate (the schedule scales it).
    pub lr: f64,
    /// Plugin arguments (for AdamW: `betas`, `eps`, `weight_decay`).
    pub args: PluginArgs,
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer {
            plugin: "adamw".into(),
            lr: 8e-4,
            args: PluginArgs::new(),
        }
    }
}

/// Shape of the learning-rate decay after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    /// Stay at the peak.
    Constant,
    /// Half-cosine from the peak to `min_lr_ratio × lr`.
    Cosine,
    /// Straight line from the peak to `min_lr_ratio × lr`.
    Linear,
    /// Warmup-stable-decay: hold the peak, then decay linearly over the last `decay_fraction`.
    Wsd,
}

/// `[lr_scheduler]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LrScheduler {
    /// Steps of linear warmup from 0 to the peak.
    pub warmup_steps: u64,
    /// Decay shape after warmup.
    pub decay: Decay,
    /// Final learning rate as a fraction of the peak.
    pub min_lr_ratio: f64,
    /// For `wsd`: the fraction of all steps spent decaying at the end.
    pub decay_fraction: f64,
}

impl Default for LrScheduler {
    fn default() -> Self {
        LrScheduler {
            warmup_steps: 20,
            decay: Decay::Cosine,
            min_lr_ratio: 0.1,
            decay_fraction: 0.2,
        }
    }
}

/// `[training]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Training {
    /// Optimizer steps to run.
    pub steps: u64,
    /// Global batch in sequences per optimizer step.
    pub batch_size: usize,
    /// Sequences per forward/backward; `batch_size / micro_batch_size` micro-batches accumulate.
    pub micro_batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Seed of parameter init, data order and dropout.
    pub seed: u64,
    /// Clip the global gradient norm to this (0 disables clipping).
    pub max_grad_norm: f64,
    /// Compute dtype: `float32`, or `bfloat16` for mixed precision (matrix products on bf16
    /// inputs with f32 accumulation and bf16 activations between them; parameters, gradients
    /// and optimizer state stay f32).
    pub dtype: String,
    /// On a GPU, let float32 matrix products round their inputs to TF32 (10-bit mantissa, f32
    /// accumulation) on the tensor cores, as PyTorch's `allow_tf32`: faster, less exact. No
    /// effect on the CPU, on bf16 products or in batch-invariant mode.
    pub allow_tf32: bool,
    /// CPU threads (0 = all cores).
    pub threads: usize,
    /// Memory the run may use, in MiB, checked against an estimate before any parameter is
    /// allocated (0 = what the machine has available: `MemAvailable`, or the cgroup's limit
    /// when lower).
    pub memory_limit_mb: u64,
    /// Start even when the memory estimate exceeds the limit.
    pub skip_memory_check: bool,
    /// Weight of each auxiliary loss the model returns, by name (a MoE router's load-balancing
    /// loss); a loss not listed here is added with weight 1.
    pub aux_loss_weights: std::collections::BTreeMap<String, f64>,
}

impl Default for Training {
    fn default() -> Self {
        Training {
            steps: 300,
            batch_size: 8,
            micro_batch_size: 8,
            seq_len: 256,
            seed: 42,
            max_grad_norm: 1.0,
            dtype: "float32".into(),
            allow_tf32: false,
            threads: 0,
            memory_limit_mb: 0,
            skip_memory_check: false,
            aux_loss_weights: Default::default(),
        }
    }
}

/// `[parallelism]`: the device mesh, a degree per dimension. The degrees multiply to the
/// number of processes (`mpiexec -n N`, `anneal train --nproc N`); one of them may be -1 to take
/// the rest (`ep` borrows from `dp_shard` and is not counted). Data parallelism (DDP:
/// `dp_replicate`; FSDP: `dp_shard`; HSDP: both), expert parallelism within `dp_shard` and
/// pipeline parallelism (`pp`, the `pp_*` keys), tensor parallelism (`tp`, `tp_sequence`) and
/// context parallelism (`cp`) run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Parallelism {
    /// Data-parallel replicas: each holds the whole model and trains on its slice of the
    /// global batch; gradients are averaged across them. Default -1: every process.
    pub dp_replicate: i64,
    /// Data-parallel shards (FSDP: parameters, gradients and optimizer state split on dim 0).
    pub dp_shard: i64,
    /// Tensor-parallel degree: the projections are split over `tp` ranks by the placement each
    /// parameter declares (column: q, k, v, gate, up, the output head; row: o, down; vocab: the
    /// embedding), each rank holding `1 / tp` of the heads and of the feed-forward, the logits
    /// split by vocabulary. Dense Llama models.
    pub tp: i64,
    /// Sequence parallelism with `tp > 1`: the hidden states between the projections (the
    /// residual stream, the norms) hold `1 / tp` of the sequence on each rank (all-gathered
    /// before the column-split projections, reduce-scattered after the row-split ones), which
    /// divides their memory by `tp` for the same traffic. `training.seq_len` must divide by `tp`.
    pub tp_sequence: bool,
    /// Pipeline stages.
    pub pp: i64,
    /// Context-parallel degree: every sequence is cut into `2·cp` chunks and each of `cp` ranks
    /// holds one from the head and its mirror from the tail (`training.seq_len` must be a
    /// multiple of `2·cp`); attention passes keys and values around the ranks' ring.
    pub cp: i64,
    /// Expert-parallel degree: the experts are split over `ep` ranks borrowed from `dp_shard`
    /// (it must divide it; it adds no processes), the MoE layers sending each token to its
    /// experts' rank and back; expert parameters are then sharded over `dp_shard / ep`.
    pub ep: i64,
    /// How FSDP's parameter all-gathers travel: `float32` (exact), `bfloat16`, or quantized
    /// blockwise (`int8`, `fp8_e4m3`: one f32 scale per `fsdp_all_gather_block` values,
    /// dequantized on receipt). Gradients and optimizer state stay full precision.
    pub fsdp_all_gather_dtype: String,
    /// Values per scale of a quantized all-gather (128 or 256 are usual).
    pub fsdp_all_gather_block: i64,
    /// The pipeline schedule when `pp > 1`: `1f1b` (one forward, one backward),
    /// `interleaved_1f1b` (each rank holds `pp_virtual_stages` non-adjacent stages),
    /// `zero_bubble` (backwards split into input and weight passes, the weight passes filling
    /// the idle time: ZB-H1 with one stage per rank, interleaved with several) or `zbv` (zero
    /// bubble with two stages per rank in V order, `pp_virtual_stages = 2`).
    pub pp_schedule: String,
    /// Stages per rank under `interleaved_1f1b` and `zero_bubble` (the pipeline has
    /// `pp × pp_virtual_stages` stages, stage `s` on rank `s mod pp`); 1 under `1f1b`, 2 under
    /// `zbv` (rank `r` holds stages `r` and `2·pp − 1 − r`).
    pub pp_virtual_stages: i64,
    /// Blocks per pipeline stage, first stage first (`[3, 5]`: blocks 0–2, then 3–7); empty:
    /// balanced by the model's per-block cost. Must sum to the model's layer count.
    pub pp_split: Vec<i64>,
}

impl Parallelism {
    /// The degrees in the device mesh's order: `pp, dp_replicate, dp_shard, cp, ep, tp`.
    pub fn degrees(&self) -> [i64; 6] {
        [
            self.pp,
            self.dp_replicate,
            self.dp_shard,
            self.cp,
            self.ep,
            self.tp,
        ]
    }
}

impl Default for Parallelism {
    fn default() -> Self {
        Parallelism {
            dp_replicate: -1,
            dp_shard: 1,
            tp: 1,
            tp_sequence: false,
            pp: 1,
            cp: 1,
            ep: 1,
            fsdp_all_gather_dtype: "float32".into(),
            fsdp_all_gather_block: 128,
            pp_schedule: "1f1b".into(),
            pp_virtual_stages: 1,
            pp_split: Vec::new(),
        }
    }
}

/// `[checkpoint]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Checkpoint {
    /// Save every this many steps (0 = only at the end and on a graceful stop).
    pub interval: u64,
    /// Complete checkpoints to keep (older ones are removed after a newer one is published).
    pub keep_latest: usize,
    /// Write in the background while training continues.
    #[serde(rename = "async")]
    pub async_save: bool,
    /// Resume from this step instead of the newest complete checkpoint.
    pub load_step: Option<u64>,
    /// Start fresh when a run dir has checkpoints but none is usable.
    pub allow_fresh_start: bool,
    /// Resume even when the tokenizer differs from the one the checkpoint was trained with
    /// (compared by the SHA-256 recorded in `train_state.json`).
    pub allow_tokenizer_change: bool,
    /// Resume even when the training data (the tokenized stream, or an RL run's prompts)
    /// differs from the checkpoint's.
    pub allow_data_change: bool,
    /// Start from the weights of a Hugging Face directory.
    pub init_from_hf: Option<String>,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            interval: 100,
            keep_latest: 3,
            async_save: true,
            load_step: None,
            allow_fresh_start: false,
            allow_tokenizer_change: false,
            allow_data_change: false,
            init_from_hf: None,
        }
    }
}

/// `[fault_tolerance]`: restarting a multi-process job after one of its ranks dies. MPI (MPICH
/// over UCX, without ULFM or dynamic processes) cannot keep the surviving replicas of a job
/// running nor let a restarted one join them, so the launcher restarts the whole job and it
/// resumes from the newest complete checkpoint (docs/distributed.md, "Replica failure").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultTolerance {
    /// Restart the job (every rank) after a rank fails, resuming from the newest complete
    /// checkpoint. Read by the `anneal train --nproc N` launcher only.
    pub enabled: bool,
    /// Restarts one launch may make before it reports the failure.
    pub max_restarts: u32,
}

impl FaultTolerance {
    /// Whether the section is at its defaults.
    pub fn is_off(&self) -> bool {
        *self == FaultTolerance::default()
    }
}

impl Default for FaultTolerance {
    fn default() -> Self {
        FaultTolerance {
            enabled: false,
            max_restarts: 3,
        }
    }
}

/// Which activations are recomputed in backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputeMode {
    /// Keep every activation.
    None,
    /// Recompute every block.
    Full,
    /// Recompute every `every`-th block.
    Selective,
    /// Recompute the blocks that are cheapest to recompute until the kept activations fit
    /// `memory_budget` × what no recompute keeps (measured at startup).
    Budget,
}

/// `[activation_checkpoint]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpoint {
    /// `none`, `full`, `selective` or `budget`.
    pub mode: RecomputeMode,
    /// For `selective`: recompute blocks whose index is a multiple of this.
    pub every: usize,
    /// For `budget`: the fraction (0..=1) of the blocks' activation bytes to keep; 0 recomputes
    /// every block, 1 none.
    pub memory_budget: f64,
}

impl Default for ActivationCheckpoint {
    fn default() -> Self {
        ActivationCheckpoint {
            mode: RecomputeMode::None,
            every: 2,
            memory_budget: 0.5,
        }
    }
}

/// `[data]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Data {
    /// A text or JSONL file, or a folder of them (relative paths are from the working directory).
    pub path: String,
    /// A `tokenizer.json`, or `train` to fit a byte-level BPE on the corpus (cached).
    pub tokenizer: String,
    /// Vocabulary size when training a tokenizer.
    pub vocab_size: usize,
    /// Field holding the text in JSONL records.
    pub text_field: String,
    /// A chat template (a Jinja file, as transformers' `chat_template.jinja`) for chat data,
    /// instead of the tokenizer's own (or, for a tokenizer trained here, the built-in ChatML).
    /// The run records it in `tokenizer_config.json`, so RL, export and serving render as
    /// training did.
    pub chat_template: String,
    /// Fraction of the corpus held out for validation.
    pub val_fraction: f64,
    /// Visit training windows in a seeded random order (else in corpus order).
    pub shuffle: bool,
    /// Where trained tokenizers and tokenized corpora are cached.
    pub cache_dir: String,
    /// What the files hold: `text` (documents packed into windows), `chat` (JSON lines of
    /// conversations, the loss on the assistant's replies, images for vision models), `tokens`
    /// (pre-tokenized ids: a nanoGPT or llm.c `.bin`, a Megatron `.bin` + `.idx` or its prefix,
    /// or a folder of `.bin` shards whose `val` ones are held out), or `auto` (tokens for `.bin`
    /// / `.idx` paths and folders of `.bin` files, chat when a `.jsonl` file's first line has a
    /// `messages` list, else text).
    pub format: DataFormat,
    /// Token files without a header (nanoGPT's raw `.bin`): how each id is stored. llm.c and
    /// Megatron files say it themselves.
    pub token_dtype: TokenDtype,
    /// A mixture of sources in place of `data.path` (`[[data.sources]]`): each row is a window
    /// of one source, the sources' shares of the rows kept at their weights; each source keeps
    /// its own order and cursor, saved in checkpoints. Text and token sources mix (sharing
    /// `data.tokenizer`, trained on the text sources when `train`); chat data does not.
    pub sources: Vec<DataSource>,
    /// Chat data: pack several whole conversations into each row (in the loader's order, as
    /// many as fit) instead of one per row with padding. Positions restart at each
    /// conversation and attention stays within it, so each conversation trains as it would
    /// alone, with fewer padded tokens.
    pub pack: bool,
    /// Text data: read and tokenize the corpus in background threads as training goes,
    /// instead of all of it at start, so a corpus larger than memory trains with constant
    /// memory. Windows are shuffled within blocks of 1,024 (files per epoch), the held-out
    /// tokens come from the first documents, and a trained tokenizer learns from the first
    /// 64 MiB of text.
    pub streaming: bool,
    /// Threads that tokenize a streamed corpus (0: half the cores, at least 1).
    pub stream_threads: usize,
    /// Chat data for a vision model trained without a `preprocessor_config.json`
    /// (`checkpoint.init_from_hf` brings one): the fewest pixels an image is resized to.
    pub image_min_pixels: u64,
    /// As `image_min_pixels`: the most pixels.
    pub image_max_pixels: u64,
}

/// `data.format`
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// Chat when the data looks like it, else text.
    Auto,
    /// Documents packed into fixed windows.
    Text,
    /// Conversations, one per row.
    Chat,
    /// Pre-tokenized ids (nanoGPT / llm.c `.bin`, Megatron `.bin` + `.idx`), read in place.
    Tokens,
    /// Parquet files: text (`data.text_field`) or chat (`messages`) rows.
    Parquet,
    /// A dataset saved by Hugging Face `datasets` (`save_to_disk`; a `DatasetDict`'s `train`
    /// split): text or chat rows.
    HfDataset,
    /// Preference pairs (`prompt`, `chosen`, `rejected`), for `[preference]` tuning.
    Preference,
}

/// One source of a data mixture (`[[data.sources]]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSource {
    /// Its files, as `data.path`: a text corpus (file or folder, JSON lines, Parquet or a saved
    /// dataset) or token files.
    pub path: String,
    /// Its share of the rows, relative to the other sources' weights (any positive scale).
    pub weight: f64,
    /// What it holds, as `data.format` (`auto` guesses from the path).
    #[serde(default = "auto_format")]
    pub format: DataFormat,
}

fn auto_format() -> DataFormat {
    DataFormat::Auto
}

/// `data.token_dtype`
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenDtype {
    /// Little-endian u16 (nanoGPT's `np.uint16`).
    Uint16,
    /// Little-endian u32.
    Uint32,
}

impl Default for Data {
    fn default() -> Self {
        Data {
            path: "data/shakespeare".into(),
            tokenizer: "train".into(),
            vocab_size: 8192,
            text_field: "text".into(),
            chat_template: String::new(),
            val_fraction: 0.01,
            shuffle: true,
            cache_dir: "data/cache".into(),
            format: DataFormat::Auto,
            sources: Vec::new(),
            token_dtype: TokenDtype::Uint16,
            pack: false,
            streaming: false,
            stream_threads: 0,
            // Qwen3-VL's processor: 256 x 256 to 4,096 x 4,096 pixels.
            image_min_pixels: 65_536,
            image_max_pixels: 16_777_216,
        }
    }
}

/// `[metrics]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Metrics {
    /// Print and record a metrics row every this many steps.
    pub log_freq: u64,
    /// Evaluate the held-out loss every this many steps (0 = never).
    pub eval_freq: u64,
    /// Batches of the held-out split per evaluation.
    pub eval_batches: usize,
    /// Peak TFLOP/s of the machine for MFU (0 = the CPU's theoretical f32 peak: threads × SIMD
    /// FLOPs per cycle × clock).
    pub peak_tflops: f64,
    /// Show a progress bar on a terminal.
    pub progress_bar: bool,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            log_freq: 10,
            eval_freq: 100,
            eval_batches: 4,
            peak_tflops: 0.0,
            progress_bar: true,
        }
    }
}

/// One reward module of `[rl]` and its weight in the combined score.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    /// A reward module (`.wasm` or `.wat`).
    pub path: String,
    /// Weight of this module's reward in the sum.
    #[serde(default = "one")]
    pub weight: f64,
    /// What metrics and `samples.jsonl` call it; empty: the file name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
}

fn one() -> f64 {
    1.0
}

/// The policy-gradient loss of `[rl]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RlLoss {
    /// Group-normalized advantages, clipped ratio, mean over each sequence then over sequences.
    Grpo,
    /// Mean-centred advantages (no std division), no length normalization.
    DrGrpo,
    /// Asymmetric clip, token-level mean over the batch, groups with equal rewards dropped.
    Dapo,
}

/// `[rl]`: post-training a policy with rewards from WebAssembly modules.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Rl {
    /// The starting policy: a checkpoint step dir (`.../checkpoints/step-N`) or a Hugging Face
    /// dir (`config.json` + `*.safetensors`). Empty: fresh weights from `training.seed`.
    pub init_from: String,
    /// The tokenizer (`tokenizer.json`); empty: the one next to a run dir's checkpoint.
    pub tokenizer: String,
    /// JSON lines `{"prompt":..,"metadata":{..}}`; empty: the built-in `task` generator.
    pub prompts_path: String,
    /// Built-in prompt generator when `prompts_path` is empty: `digits_sort` (`4213=` →
    /// `1234`) or `arithmetic` (`347*86=` → `29842`).
    pub task: String,
    /// Seed of the built-in generator (held-out prompts use a different stream).
    pub task_seed: u64,
    /// Put the end-of-text token before every prompt: in a packed corpus each document follows
    /// one, so a policy pretrained or fine-tuned by `anneal train` expects it (without it the
    /// model cannot tell a prompt from the truncated tail of a longer document).
    pub prepend_eos: bool,
    /// Completions sampled per prompt (a group): at least 2, since every loss compares the
    /// completions of a group (with one, every advantage is 0 and the policy never moves).
    pub group_size: usize,
    /// Prompts (groups) per trainer step.
    pub prompts_per_step: usize,
    /// Longest completion.
    pub max_new_tokens: usize,
    /// Skip (and count) the prompts of `prompts_path` that do not fit the model's context
    /// with `max_new_tokens` after them; `false` refuses the run, naming the first such line.
    pub skip_long_prompts: bool,
    /// Sampling temperature (> 0).
    pub temperature: f32,
    /// Nucleus sampling threshold (1 = off).
    pub top_p: f32,
    /// Top-k sampling (0 = off).
    pub top_k: usize,
    /// Reward modules; their rewards are summed with their weights. With an `environment`
    /// they score the policy's last turn and add to the environment's reward (optional then).
    pub rewards: Vec<RewardSpec>,
    /// A multi-turn environment (`.wasm` or `.wat`, `reward-wasm/ENVIRONMENTS.md`): each
    /// prompt becomes an episode of turns between the policy and the environment (tools, code
    /// execution) instead of one completion. Empty: single-turn.
    pub environment: String,
    /// Policy turns per episode at most (with an `environment`).
    pub max_turns: usize,
    /// Tokens per episode at most: prompt, policy turns and observations (0: the model's
    /// `max_seq_len`). `max_new_tokens` bounds each policy turn.
    pub max_episode_tokens: usize,
    /// Wall-clock deadline of one environment call (`init` or `step`), in milliseconds.
    pub env_step_timeout_ms: u64,
    /// Wall-clock budget of all the environment calls of one episode, in milliseconds.
    pub env_episode_timeout_ms: u64,
    /// The reward of a call that traps, times out or returns garbage.
    pub error_reward: f64,
    /// Per-call reward deadline in milliseconds.
    pub reward_timeout_ms: u64,
    /// `grpo`, `dr_grpo` or `dapo`.
    pub loss: RlLoss,
    /// Lower clip of the ratio: `1 - clip_low`.
    pub clip_low: f64,
    /// Upper clip of the ratio: `1 + clip_high`.
    pub clip_high: f64,
    /// Weight of the k3 KL penalty to the frozen initial policy (0 = off, no reference kept).
    pub kl_coef: f64,
    /// Weight of an entropy bonus on the completion tokens (0 = off); keeps the policy exploring.
    pub entropy_coef: f64,
    /// How many policy versions a rollout may lag the trainer (0 = synchronous).
    pub max_staleness: u64,
    /// Rollout worker threads.
    pub rollout_threads: usize,
    /// Compute threads of each rollout worker's private pool; 0 = share the trainer's pool.
    /// With `max_staleness > 0` a private pool lets rollouts and training run side by side.
    pub rollout_compute_threads: usize,
    /// Optimizer steps taken on each batch of rollouts (GRPO's μ; the clip bounds how far the
    /// later ones move the policy from the one that sampled).
    pub updates_per_batch: usize,
    /// Cap of the truncated importance ratio `π_trainer / π_rollout` (0 = no correction).
    pub is_correction_cap: f64,
    /// Evaluate held-out accuracy (greedy) every this many steps (0 = never).
    pub eval_freq: u64,
    /// Held-out prompts per evaluation.
    pub eval_prompts: usize,
    /// The held-out prompts (JSON lines as `prompts_path`; the first `eval_prompts` are
    /// played). Empty: the built-in task's held-out stream, or the last `eval_prompts` lines
    /// of `prompts_path` (which training cycles through too).
    pub eval_prompts_path: String,
    /// Write the step's samples (prompt, completion, each reward module's score and error) to
    /// `<run dir>/samples.jsonl` at step 1 and every this many steps (0 = never).
    pub samples_every: u64,
    /// At most this many samples per written step: the first ones, in group order, so a multiple
    /// of `group_size` keeps whole groups.
    pub samples_per_step: usize,
}

impl RlLoss {
    /// Whether the loss compares the completions of a group (its advantages are rewards
    /// relative to the group's), so a group of one learns nothing. Every loss so far does.
    pub fn needs_groups(self) -> bool {
        match self {
            RlLoss::Grpo | RlLoss::DrGrpo | RlLoss::Dapo => true,
        }
    }

    /// The name `rl.loss` takes.
    pub fn name(self) -> &'static str {
        match self {
            RlLoss::Grpo => "grpo",
            RlLoss::DrGrpo => "dr_grpo",
            RlLoss::Dapo => "dapo",
        }
    }
}

impl Default for Rl {
    fn default() -> Self {
        Rl {
            init_from: String::new(),
            tokenizer: String::new(),
            prompts_path: String::new(),
            task: "digits_sort".into(),
            task_seed: 0,
            prepend_eos: false,
            group_size: 8,
            prompts_per_step: 8,
            max_new_tokens: 16,
            skip_long_prompts: false,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            rewards: Vec::new(),
            environment: String::new(),
            max_turns: 4,
            max_episode_tokens: 0,
            env_step_timeout_ms: 1000,
            env_episode_timeout_ms: 10_000,
            error_reward: 0.0,
            reward_timeout_ms: 1000,
            loss: RlLoss::Grpo,
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.0,
            entropy_coef: 0.0,
            max_staleness: 0,
            rollout_threads: 1,
            rollout_compute_threads: 0,
            updates_per_batch: 1,
            is_correction_cap: 0.0,
            eval_freq: 10,
            eval_prompts: 64,
            eval_prompts_path: String::new(),
            samples_every: 10,
            samples_per_step: 64,
        }
    }
}
