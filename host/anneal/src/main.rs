//! `anneal`: the command-line edge of the host. Parses arguments, calls into the library crates,
//! and turns their errors into one clear line (exit code 2 for user errors, 1 for failures).

mod dist_cmd;
mod errors;
mod infer_cmd;
mod plan_cmd;
mod plugins_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod env_cmd;
mod restart;
mod reward_cmd;
mod rl_cmd;
mod rl_env;
mod serve_cmd;
mod train_cmd;

/// Train, post-train and serve language models.
#[derive(Parser)]
#[command(name = "anneal", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print what this build of the host can use: backends, threads, SIMD level, memory.
    Info,
    /// Inspect model and optimizer plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// Log-probability of each next token of a sequence, as JSON.
    Logprobs {
        /// A Hugging Face model directory (config.json + *.safetensors), or a model id
        /// (`org/name[@revision]`) of the local Hugging Face cache.
        #[arg(long)]
        model_dir: std::path::PathBuf,
        /// Comma-separated token ids.
        #[arg(long, allow_hyphen_values = true)]
        tokens: Option<String>,
        /// Text to score (needs --tokenizer); may start with `-`.
        #[arg(long, allow_hyphen_values = true)]
        text: Option<String>,
        /// A tokenizer.json for --text.
        #[arg(long)]
        tokenizer: Option<std::path::PathBuf>,
        /// The model plugin to run it with (default: the one serving config.json's model_type).
        #[arg(long)]
        plugin: Option<String>,
        /// An image of the prompt (PNG, JPEG or WebP; repeat for several, in the order of their
        /// placeholder runs): the tokens hold each image's placeholder tokens already expanded.
        #[arg(long = "image")]
        images: Vec<std::path::PathBuf>,
        /// An audio clip of the prompt (a 24 kHz WAV file, PCM or float, channels averaged;
        /// repeat for several, in the order of their placeholder runs): the tokens hold each
        /// clip's run of ⌈samples / samples_per_token⌉ `audio_token_id` tokens (docs/audio.md).
        #[arg(long = "audio")]
        audio: Vec<std::path::PathBuf>,
    },
    /// Generate tokens after a prompt (prefill + decode with a KV cache), as JSON.
    Generate {
        /// A Hugging Face model directory (config.json + *.safetensors), or a model id
        /// (`org/name[@revision]`) of the local Hugging Face cache.
        #[arg(long)]
        model_dir: std::path::PathBuf,
        /// Comma-separated prompt token ids.
        #[arg(long, allow_hyphen_values = true)]
        prompt_tokens: Option<String>,
        /// Prompt text (needs --tokenizer; the output then also has the decoded text); may
        /// start with `-`.
        #[arg(long, allow_hyphen_values = true)]
        prompt: Option<String>,
        /// A tokenizer.json for --prompt and for decoding.
        #[arg(long)]
        tokenizer: Option<std::path::PathBuf>,
        /// How many tokens to generate at most (capped at what the model's positions leave).
        #[arg(long, default_value_t = 16)]
        max_new_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
        temperature: f32,
        /// Nucleus sampling threshold, within (0, 1].
        #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
        top_p: f32,
        /// Keep only the k most likely tokens (0 = all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Seed of the sampling stream.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stop after this token id.
        #[arg(long)]
        eos: Option<i64>,
        /// The model plugin to run it with (default: the one serving config.json's model_type).
        #[arg(long)]
        plugin: Option<String>,
        /// Decode this many rows together (the prompt repeated; row i samples with seed + i;
        /// the output shows row 0).
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Run the fast kernels instead of the batch-invariant ones (row 0's tokens may then
        /// differ from a batch-1 run).
        #[arg(long)]
        fast: bool,
        /// Tensor-parallel degree: run under `mpiexec -n TP`; each rank holds its slices of
        /// the weights and its heads of the KV cache (the Llama 3 family and dense Qwen3); rank 0 prints.
        #[arg(long, default_value_t = 1)]
        tp: usize,
        /// Where the model and its KV cache live: cpu, cuda (GPU 0) or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// An image of the prompt (PNG, JPEG or WebP; repeat for several, in the order of their
        /// placeholder runs): the prompt holds one placeholder per image, as a chat template
        /// writes it (expanded to the image's count), or each image's placeholders already
        /// expanded.
        #[arg(long = "image")]
        images: Vec<std::path::PathBuf>,
        /// An audio clip of the prompt (a 24 kHz WAV file, PCM or float, channels averaged;
        /// repeat for several, in the order of their placeholder runs): the prompt holds one
        /// `audio_token_id` per clip (expanded to the clip's count) or each clip's run already
        /// expanded (docs/audio.md).
        #[arg(long = "audio")]
        audio: Vec<std::path::PathBuf>,
    },
    /// Work with reward modules (WebAssembly): `anneal reward test MODULE`.
    #[command(subcommand)]
    Reward(reward_cmd::RewardCommand),
    /// Work with RL environments (WebAssembly): `anneal env test ENV.wasm`.
    #[command(subcommand)]
    Env(env_cmd::EnvCommand),
    /// Train a model from a job config (TOML); metrics go to `<run dir>/metrics.jsonl`.
    Train {
        /// The job config, e.g. configs/llama3_debug.toml.
        config: std::path::PathBuf,
        /// Override a key: `--set training.steps=100` (repeatable; values are TOML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Where the run writes its files (default: runs/<job name>-<time>).
        #[arg(long)]
        run_dir: Option<std::path::PathBuf>,
        /// Time every op of STEPS steps (`--profile` or `--profile=STEPS`, after 2 warm-up steps;
        /// default 3): prints a per-op
        /// table and writes it with a Chrome trace (Perfetto) to `<run dir>/profile/`.
        #[arg(long, value_name = "STEPS", num_args = 0..=1, require_equals = true, default_missing_value = "3")]
        profile: Option<u64>,
        /// Train as N processes on this machine: runs `mpiexec -n N` on this command for you
        /// (the same as `mpiexec -n N anneal train ...`; needs MPI, see scripts/setup-mpi.sh).
        #[arg(long, value_name = "N")]
        nproc: Option<usize>,
    },
    /// Plan a training run before allocating anything: per-rank memory (parameters,
    /// gradients, optimizer state, activations, buffers), per-step communication bytes by
    /// kind and an estimated step time on a device.
    Plan {
        /// The job config, e.g. configs/llama3_debug.toml.
        config: std::path::PathBuf,
        /// Override a key: `--set parallelism.tp=8` (repeatable; values are TOML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// The device to estimate for: h200, h100 or cpu.
        #[arg(long, default_value = "h200")]
        device: String,
        /// The job's processes (default: the product of the mesh's degrees).
        #[arg(long, value_name = "N")]
        nproc: Option<usize>,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Post-train a policy with RL (GRPO / Dr.GRPO / DAPO) and WebAssembly rewards, from a job
    /// config with an `[rl]` section; metrics go to `<run dir>/metrics.jsonl`.
    Rl {
        /// The job config, e.g. configs/rl_digits.toml.
        config: std::path::PathBuf,
        /// Override a key: `--set rl.max_staleness=1` (repeatable; values are TOML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Where the run writes its files (default: runs/<job name>-<time>).
        #[arg(long)]
        run_dir: Option<std::path::PathBuf>,
    },
    /// Inspect job configs.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Work with checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Serve the web UI and the run registry's JSON API (see web/API.md).
    Serve(serve_cmd::ServeArgs),
    /// Run one job for the server and record how it ended (started by `anneal serve`).
    #[command(hide = true)]
    Supervise(serve_cmd::SuperviseArgs),
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Export a checkpoint as a Hugging Face directory (config.json, model.safetensors,
    /// tokenizer.json): `anneal checkpoint export --to-hf OUT_DIR RUN_DIR/checkpoints/step-N`.
    Export {
        /// The Hugging Face directory to write.
        #[arg(long = "to-hf", value_name = "OUT_DIR")]
        to_hf: std::path::PathBuf,
        /// The checkpoint's step directory.
        step_dir: std::path::PathBuf,
        /// Replace files already in OUT_DIR (without it, an export never overwrites).
        #[arg(long)]
        force: bool,
        /// A LoRA run: write the adapters alone, as PEFT saves them (adapter_model.safetensors,
        /// adapter_config.json), instead of the merged model.
        #[arg(long)]
        adapter: bool,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the resolved config (defaults < file < ANNEAL_* env < --set) as TOML.
    Show {
        /// The job config.
        config: std::path::PathBuf,
        /// Override a key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// List the plugins in the search path: name, kind, API version, flavors, file.
    List,
    /// What a model flavor holds and costs: parameters (total and per token for a mixture of
    /// experts), buffers, FLOPs per token, KV cache per token. Allocates nothing.
    Show {
        /// The model plugin (`anneal plugins list` names them).
        plugin: String,
        /// The flavor (default: the plugin's first).
        #[arg(long)]
        flavor: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `ANNEAL_CHECK_ARGS=1`: the command line parsed, nothing runs (the docs' commands are
    // checked this way, so a renamed flag fails the tests rather than a reader).
    if std::env::var_os("ANNEAL_CHECK_ARGS").is_some_and(|v| v == "1") {
        return ExitCode::SUCCESS;
    }
    let result = match cli.command {
        Command::Info => info(),
        Command::Plugins(PluginsCommand::List) => plugins_cmd::list(),
        Command::Plugins(PluginsCommand::Show { plugin, flavor }) => {
            plugins_cmd::show(&plugin, flavor.as_deref())
        }
        Command::Logprobs {
            model_dir,
            tokens,
            text,
            tokenizer,
            plugin,
            images,
            audio,
        } => {
            let input = infer_cmd::TokenSource {
                ids: tokens.as_deref(),
                text: text.as_deref(),
                tokenizer: tokenizer.as_deref(),
            };
            infer_cmd::logprobs(&model_dir, plugin.as_deref(), input, &images, &audio)
        }
        Command::Generate {
            model_dir,
            prompt_tokens,
            prompt,
            tokenizer,
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            eos,
            plugin,
            batch,
            fast,
            tp,
            device,
            images,
            audio,
        } => {
            let sampling = anneal_runtime::infer::Sampling {
                temperature,
                top_k,
                top_p,
                seed,
                eos,
            };
            infer_cmd::generate(
                &model_dir,
                plugin.as_deref(),
                infer_cmd::TokenSource {
                    ids: prompt_tokens.as_deref(),
                    text: prompt.as_deref(),
                    tokenizer: tokenizer.as_deref(),
                },
                max_new_tokens,
                sampling,
                infer_cmd::GenerateMode {
                    batch,
                    fast,
                    tp,
                    device: &device,
                    images: &images,
                    audio: &audio,
                },
            )
        }
        Command::Reward(command) => reward_cmd::run(command),
        Command::Env(command) => env_cmd::run(command),
        Command::Train {
            config,
            set,
            run_dir,
            profile,
            nproc,
        } => match nproc {
            Some(n) => match dist_cmd::launch(&config, &set, run_dir, profile, n) {
                Ok(code) => return ExitCode::from(code),
                Err(e) => Err(e),
            },
            None => train_cmd::train(&config, &set, run_dir, profile),
        },
        Command::Rl {
            config,
            set,
            run_dir,
        } => rl_cmd::rl(&config, &set, run_dir),
        Command::Plan {
            config,
            set,
            device,
            nproc,
            json,
        } => plan_cmd::run(&config, &set, &device, nproc, json),
        Command::Config(ConfigCommand::Show { config, set }) => train_cmd::show(&config, &set),
        Command::Checkpoint(CheckpointCommand::Export {
            to_hf,
            step_dir,
            force,
            adapter,
        }) => match adapter {
            true => anneal_train::checkpoint::export_peft(&step_dir, &to_hf, force),
            false => anneal_train::checkpoint::export_hf(&step_dir, &to_hf, force),
        }
        .map(|()| println!("wrote {}", to_hf.display()))
        .map_err(Into::into),
        Command::Serve(args) => serve_cmd::serve_cmd(args),
        Command::Supervise(args) => match serve_cmd::supervise_cmd(args) {
            Ok(code) => return ExitCode::from(code),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", errors::one_line(&e));
            // Exit 2 tells the user to fix their input; 1 is a failure of the run itself.
            ExitCode::from(errors::exit_code(&e))
        }
    }
}

fn info() -> anyhow::Result<()> {
    use anneal_engine::{backend::backend_for, Device};
    println!("anneal {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu backend: {} threads, SIMD level {:?}",
        anneal_engine::num_threads(),
        anneal_engine::simd_level()
    );
    println!("cpu matmul: {}", anneal_engine::matmul_kernels());
    match backend_for(Device::Cuda(0)) {
        Ok(b) => match anneal_engine::cuda::probe(0) {
            Ok(info) => println!("cuda backend: {} on {info}", b.name()),
            Err(why) => println!("cuda backend: {} ({why})", b.name()),
        },
        Err(e) => println!("cuda backend: unavailable ({e})"),
    }
    match anneal_dist::nccl::unavailable() {
        None => println!("nccl: available"),
        Some(why) => println!("nccl: unavailable ({why})"),
    }
    let m = anneal_engine::alloc::memory_stats();
    println!(
        "cpu allocator: {} B in use, {} B cached",
        m.current_bytes, m.cached_bytes
    );
    Ok(())
}
