//! `anneal logprobs` and `anneal generate`: inference from a Hugging Face model directory with a
//! model plugin.

use crate::errors::UserError;
use crate::user_bail;
use anneal_runtime::hf;
use anneal_runtime::infer::{self, Sampling};
use anneal_runtime::plugins::{AudioInputs, ImageInputs, Params, PluginModel};
use anneal_train::TpInference;
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

/// Parses `1,2,3` into token ids.
pub fn parse_tokens(s: &str) -> anyhow::Result<Vec<i64>> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<i64>()
                .map_err(|_| UserError(format!("'{t}' is not a token id")).into())
        })
        .collect()
}

/// Loads the plugin (`plugin`, or the one serving the directory's `model_type`), builds the
/// model `config.json` describes and fills in its weights.
pub fn load_hf_model(dir: &Path, plugin: Option<&str>) -> anyhow::Result<(PluginModel, Params)> {
    let (model, params) = hf::load_model(dir, plugin)?;
    Ok((model, Arc::new(params)))
}

fn check_vocab(model: &PluginModel, tokens: &[i64]) -> anyhow::Result<()> {
    let v = model.spec().vocab_size as i64;
    if let Some(t) = tokens.iter().find(|&&t| t < 0 || t >= v) {
        user_bail!("token id {t} is outside the vocabulary (0..{v})");
    }
    Ok(())
}

/// Loads a `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> anyhow::Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_file(path).map_err(|e| {
        UserError(format!(
            "{}: not a usable tokenizer.json: {e}",
            path.display()
        ))
        .into()
    })
}

/// Token ids of `text`.
pub fn encode(tok: &tokenizers::Tokenizer, text: &str) -> anyhow::Result<Vec<i64>> {
    let enc = tok
        .encode(text, false)
        .map_err(|e| UserError(format!("cannot tokenize the prompt: {e}")))?;
    Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
}

/// Where a command's input tokens come from: ids, or text with a tokenizer.
pub struct TokenSource<'a> {
    /// Comma-separated ids.
    pub ids: Option<&'a str>,
    /// Text to tokenize.
    pub text: Option<&'a str>,
    /// The tokenizer for `text` (and for decoding output).
    pub tokenizer: Option<&'a Path>,
}

impl TokenSource<'_> {
    fn resolve(&self) -> anyhow::Result<(Vec<i64>, Option<tokenizers::Tokenizer>)> {
        let tok = self.tokenizer.map(load_tokenizer).transpose()?;
        let ids = match (self.ids, self.text, &tok) {
            (Some(ids), None, _) => parse_tokens(ids)?,
            (None, Some(text), Some(t)) => encode(t, text)?,
            (None, Some(_), None) => user_bail!("text input needs --tokenizer tokenizer.json"),
            (Some(_), Some(_), _) => user_bail!("give token ids or text, not both"),
            (None, None, _) => user_bail!("give token ids or text"),
        };
        Ok((ids, tok))
    }
}

/// Reads `paths` through the image processor of the checkpoint in `dir`
/// (`preprocessor_config.json`): every image's patches in one tensor, in the order given, on
/// `device`, and each image's count of placeholder tokens. A directory without that file holds
/// a text-only model and is refused.
pub fn read_images(
    dir: &Path,
    paths: &[PathBuf],
    device: anneal_engine::Device,
) -> anyhow::Result<Option<(Arc<ImageInputs>, Vec<usize>)>> {
    use anneal_data::image::{load_image, ImageError, ImageProcessor, ProcessorConfig};
    if paths.is_empty() {
        return Ok(None);
    }
    let user = |e: ImageError| UserError(e.to_string());
    let config = ProcessorConfig::from_dir(dir).map_err(|e| match e {
        ImageError::Missing { .. } => UserError(format!(
            "--image: {} has no preprocessor_config.json: it holds a text-only model, which cannot read images",
            dir.display()
        )),
        other => user(other),
    })?;
    let processor = ImageProcessor::new(config);
    let processed = paths
        .iter()
        .map(|path| {
            processor
                .process(&load_image(path).map_err(user)?)
                .map_err(user)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let counts = processed.iter().map(|p| p.placeholder_tokens()).collect();
    let mut images = ImageInputs::from_processed(processed)?;
    images.pixel_values = images.pixel_values.to_device(device)?;
    Ok(Some((Arc::new(images), counts)))
}

/// `prompt` with each image's placeholders expanded as the model reads them (a run of one
/// `image_token_id` of the checkpoint's `config.json`, as a chat template writes it, becomes
/// the image's count; a run already of that count stays), and the images read.
fn prompt_with_images(
    dir: &Path,
    prompt: Vec<i64>,
    paths: &[PathBuf],
    device: anneal_engine::Device,
) -> anyhow::Result<(Vec<i64>, Option<Arc<ImageInputs>>)> {
    let Some((images, counts)) = read_images(dir, paths, device)? else {
        return Ok((prompt, None));
    };
    let image_token = hf::read_config(dir)
        .ok()
        .and_then(|c| c.get("image_token_id")?.as_i64())
        .ok_or_else(|| {
            UserError(format!(
                "--image: {}/config.json gives no image_token_id",
                dir.display()
            ))
        })?;
    let prompt = anneal_data::image::expand_placeholders(&prompt, image_token, &counts)
        .map_err(|e| UserError(format!("--image: {e}")))?;
    Ok((prompt, Some(images)))
}

/// The audio clips of one prompt, read for a model.
pub struct PromptAudio {
    /// The padded waveforms and their lengths, on the model's device.
    pub inputs: Arc<AudioInputs>,
    /// The checkpoint's audio settings (its placeholder token among them).
    pub config: anneal_data::audio::AudioConfig,
    /// Each clip's count of placeholder tokens.
    pub counts: Vec<usize>,
}

/// Reads the WAV files `paths` as the audio clips of one prompt for the checkpoint in `dir`
/// (`config.json`'s `audio_config` gives the samples one audio token takes, `audio_token_id`
/// the placeholder): every clip mono at the model's rate, padded into one tensor on `device`.
/// A checkpoint without an `audio_config` has no audio tower and is refused.
pub fn read_audio(
    dir: &Path,
    paths: &[PathBuf],
    device: anneal_engine::Device,
) -> anyhow::Result<Option<PromptAudio>> {
    use anneal_data::audio::{load_wav, AudioConfig};
    if paths.is_empty() {
        return Ok(None);
    }
    let user = |e: anneal_data::audio::AudioError| UserError(format!("--audio: {e}"));
    let config = hf::read_config(dir)?;
    let Some(audio) = AudioConfig::from_config(&config).map_err(user)? else {
        user_bail!(
            "--audio: {}/config.json has no audio_config: it holds a model without an audio \
             tower, which cannot read audio",
            dir.display()
        );
    };
    let clips = paths
        .iter()
        .map(|path| load_wav(path, audio.sampling_rate).map_err(user))
        .collect::<Result<Vec<_>, _>>()?;
    let counts = clips
        .iter()
        .map(|c| audio.placeholder_tokens(c.len()))
        .collect();
    let mut inputs = AudioInputs::from_processed(audio.process(&clips))?;
    inputs.input_values = inputs.input_values.to_device(device)?;
    Ok(Some(PromptAudio {
        inputs: Arc::new(inputs),
        config: audio,
        counts,
    }))
}

/// `prompt` with each audio clip's placeholders expanded as the model reads them (a run of one
/// `audio_token_id`, as a chat template writes it, becomes the clip's count; a run already of
/// that count stays), and the clips read.
fn prompt_with_audio(
    dir: &Path,
    prompt: Vec<i64>,
    paths: &[PathBuf],
    device: anneal_engine::Device,
) -> anyhow::Result<(Vec<i64>, Option<Arc<AudioInputs>>)> {
    let Some(audio) = read_audio(dir, paths, device)? else {
        return Ok((prompt, None));
    };
    let token = audio.config.audio_token_id;
    let prompt = anneal_data::audio::expand_placeholders(&prompt, token, &audio.counts)
        .map_err(|e| UserError(format!("--audio: {e}")))?;
    Ok((prompt, Some(audio.inputs)))
}

/// `--model-dir` as a directory: a model id (`org/name[@revision]`) that is not a path names
/// its snapshot in the local Hugging Face cache.
fn model_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    match anneal_runtime::hf::hub::resolve(&dir.to_string_lossy()) {
        Ok(path) => Ok(path),
        Err(e) => user_bail!("--model-dir: {e}"),
    }
}

/// Prints `{"logprobs":[...],"loss":...}`; `images` and `audio` (WAV files) are the prompt's
/// images and audio clips in the order of their placeholder runs in the tokens, each run
/// already expanded (an audio clip of `n` samples: `⌈n / samples_per_token⌉` tokens).
pub fn logprobs(
    dir: &Path,
    plugin: Option<&str>,
    input: TokenSource<'_>,
    images: &[PathBuf],
    audio: &[PathBuf],
) -> anyhow::Result<()> {
    let dir = &model_dir(dir)?;
    let (tokens, _) = input.resolve()?;
    let (model, params) = load_hf_model(dir, plugin)?;
    check_vocab(&model, &tokens)?;
    infer::check_scoring(tokens.len(), model.spec().max_seq_len)?;
    let device = infer::device_of(&params);
    let images = read_images(dir, images, device)?.map(|(images, _)| images);
    let audio = match read_audio(dir, audio, device)? {
        Some(a) => {
            anneal_data::audio::check_placeholders(&tokens, a.config.audio_token_id, &a.counts)
                .map_err(|e| UserError(format!("--audio: {e}")))?;
            Some(a.inputs)
        }
        None => None,
    };
    let (lp, loss) = infer::logprobs_with_media(&model, &params, &tokens, images, audio)?;
    println!(
        "{}",
        serde_json::json!({ "tokens": tokens, "logprobs": lp, "loss": loss })
    );
    Ok(())
}

/// How `anneal generate` batches, which kernels it runs and where.
#[derive(Clone, Copy, Debug)]
pub struct GenerateMode<'a> {
    /// Rows decoded together (the prompt repeated; row `i` samples with seed `seed + i`).
    pub batch: usize,
    /// Fast kernels instead of batch-invariant ones (a row's tokens may then depend on the
    /// batch it is in).
    pub fast: bool,
    /// Tensor-parallel degree: under `mpiexec -n tp`, each rank holds its slices of the weights
    /// and its heads of the KV cache; the ranks decode in lockstep and rank 0 prints.
    pub tp: usize,
    /// `--device`: `cpu`, `cuda` or `cuda:N`, where the weights and the KV cache live.
    pub device: &'a str,
    /// `--image`: the prompt's images, in the order of their placeholder runs.
    pub images: &'a [PathBuf],
    /// `--audio`: the prompt's audio clips (WAV), in the order of their placeholder runs.
    pub audio: &'a [PathBuf],
}

/// Prints `{"tokens":[...],"logprobs":[...]}` for the generated tokens of the first row (and
/// `"text"` with a tokenizer), with the batch size and the prefill/decode timing.
pub fn generate(
    dir: &Path,
    plugin: Option<&str>,
    input: TokenSource<'_>,
    max_new: usize,
    sampling: Sampling,
    mode: GenerateMode<'_>,
) -> anyhow::Result<()> {
    let dir = &model_dir(dir)?;
    sampling.validate()?;
    if mode.batch == 0 {
        user_bail!("--batch must be at least 1");
    }
    if !mode.images.is_empty() && (mode.batch > 1 || mode.tp > 1) {
        user_bail!("--image decodes one prompt in one process: leave out --batch and --tp");
    }
    if !mode.audio.is_empty() && (mode.batch > 1 || mode.tp > 1) {
        user_bail!("--audio decodes one prompt in one process: leave out --batch and --tp");
    }
    // Before anything loads: a device that cannot run fails at once, in one line. Under
    // `--tp`, `cuda` is each rank's own GPU.
    anneal_train::device::for_ranks(mode.device, "--device", mode.tp.max(1))?;
    match mode.tp {
        0 => user_bail!("--tp must be at least 1"),
        1 => generate_on(dir, plugin, input, max_new, sampling, mode, None),
        n => {
            // MPI only when a launcher started this process; a plain run never touches it.
            let world = anneal_dist::init()?;
            if world.size() != n {
                user_bail!(
                    "--tp {n} runs one process per slice of the model: start it as `mpiexec -n {n} anneal generate ...` (this job has {} process(es))",
                    world.size()
                );
            }
            anneal_engine::init_threads(crate::dist_cmd::threads_per_rank(
                anneal_dist::local_ranks().unwrap_or(n),
            ))?;
            let result = (|| {
                let comm: Rc<dyn anneal_dist::Collective> = Rc::from(world.split(0, 0)?);
                generate_on(dir, plugin, input, max_new, sampling, mode, Some(comm))
            })();
            // A rank that fails ends every rank (with its exit code) rather than leave them
            // waiting in a collective.
            match result {
                Ok(()) => Ok(()),
                Err(e) => crate::dist_cmd::fail_job(world.as_ref(), e),
            }
        }
    }
}

/// [`generate`] in this process, or as one rank of the tensor-parallel group `tp`.
fn generate_on(
    dir: &Path,
    plugin: Option<&str>,
    input: TokenSource<'_>,
    max_new: usize,
    sampling: Sampling,
    mode: GenerateMode<'_>,
    tp: Option<Rc<dyn anneal_dist::Collective>>,
) -> anyhow::Result<()> {
    // Only the group's first rank speaks; the others compute the same tokens.
    let speaks = tp.as_ref().is_none_or(|c| c.rank() == 0);
    let (prompt, tok) = input.resolve()?;
    let (model, params, tp) = match tp {
        None => {
            let (model, params) = load_hf_model(dir, plugin)?;
            (model, params, None)
        }
        Some(comm) => {
            let n = comm.size();
            let model = hf::model_for(dir, plugin)?;
            let tp = TpInference::new(&dir.display().to_string(), model.spec(), comm)
                .with_context(|| format!("--tp {n}"))?;
            // Each rank keeps its slice of every weight as it reads them one by one: it never
            // holds the whole model.
            let params = hf::load_params_with(dir, model.spec(), &mut |name, whole| {
                tp.slice_one(name, &whole).map_err(|e| e.to_string())
            })?;
            (model, Arc::new(params), Some(tp))
        }
    };
    check_vocab(&model, &prompt)?;
    // The weights go to the device (checked in `generate`); the KV cache follows them.
    let ranks = mode.tp.max(1);
    let device = anneal_train::device::for_ranks(mode.device, "--device", ranks)?;
    // One placeholder per image (as a chat template writes it) is expanded to the image's.
    let (prompt, images) = prompt_with_images(dir, prompt, mode.images, device)?;
    let (prompt, audio) = prompt_with_audio(dir, prompt, mode.audio, device)?;
    let params = if device == anneal_engine::Device::Cpu {
        params
    } else {
        let placed = anneal_train::device::place(
            params.iter().map(|(n, t)| (n.clone(), t.clone())).collect(),
            device,
        )?;
        Arc::new(placed.into_iter().collect())
    };
    let _active = tp.as_ref().map(TpInference::activate);
    let context = tp.as_ref().map(TpInference::context);
    let max_seq_len = model.spec().max_seq_len;
    let budget = infer::new_token_budget(prompt.len(), max_new, max_seq_len)?;
    if budget < max_new && speaks {
        eprintln!(
            "note: --max-new-tokens {max_new} capped at {budget}: the prompt's {} tokens and the completion must fit the model's {max_seq_len} positions",
            prompt.len()
        );
    }
    let prompts = vec![&prompt[..]; mode.batch];
    let samplings: Vec<Sampling> = (0..mode.batch as u64)
        .map(|i| Sampling {
            seed: sampling.seed.wrapping_add(i),
            ..sampling.clone()
        })
        .collect();
    let setup = infer::DecodeSetup {
        tp: context.as_ref(),
        images,
        audio,
    };
    let (mut rows, stats) = infer::generate_batch_with(
        &model, &params, &prompts, budget, &samplings, !mode.fast, setup,
    )?;
    if !speaks {
        return Ok(());
    }
    let g = rows.swap_remove(0);
    let mut out = serde_json::json!({
        "prompt_tokens": prompt,
        "tokens": g.tokens,
        "logprobs": g.logprobs,
        "batch": mode.batch,
        "batch_invariant": !mode.fast,
        "tp": mode.tp,
        "device": device.to_string(),
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_tokens_per_s": stats.decode_tokens as f64 / stats.decode_s.max(1e-12),
        "cache_bytes_per_token": stats.cache_bytes_per_token,
        "state_bytes_per_sequence": stats.state_bytes_per_sequence,
        "cache_bytes": stats.cache_bytes,
        "cache_tokens": stats.cache_tokens,
        "plain_kv_bytes": stats.plain_kv_bytes_per_token * stats.cache_tokens,
        "plain_kv_bytes_per_token": stats.plain_kv_bytes_per_token,
    });
    if let Some(t) = tok {
        let ids: Vec<u32> = g.tokens.iter().map(|&i| i as u32).collect();
        out["text"] = t
            .decode(&ids, true)
            .map_err(|e| anyhow::anyhow!("cannot decode the output: {e}"))?
            .into();
    }
    if stats.cache_tokens > 0 {
        let per = |bytes: usize| bytes as f64 / stats.cache_tokens as f64;
        let plain = stats.plain_kv_bytes_per_token * stats.cache_tokens;
        eprintln!(
            "cache: {} bytes for {} tokens ({:.1} per token) against {plain} for a plain KV cache of this model ({:.1} per token)",
            stats.cache_bytes,
            stats.cache_tokens,
            per(stats.cache_bytes),
            per(plain),
        );
    }
    println!("{out}");
    Ok(())
}
