//! Audio for audio-language models (Muse Spark Open's raw-waveform tower): WAV files decoded to
//! mono, and transformers' `MuseSparkFeatureExtractor`, which only checks the rate and pads.
//!
//! The path of one clip:
//! [`load_wav`] (RIFF/WAVE PCM 8/16/24/32-bit or float 32/64-bit, channels averaged to mono,
//! the rate checked: the model's is [`SAMPLING_RATE`], nothing is resampled) →
//! [`AudioConfig::process`] (the clips of one prompt right-padded with zeros to the longest,
//! rounded up to a multiple of the samples one audio token takes) → [`ProcessedAudio`]
//! (`input_values [clips, samples]` and each clip's length). A clip of `n` samples takes
//! `⌈n / samples_per_token⌉` placeholder tokens in the prompt ([`AudioConfig::placeholder_tokens`]),
//! as transformers' `MuseSparkProcessor` lays them out (between its audio start and end tokens).

mod wav;

use std::path::{Path, PathBuf};

pub use wav::{decode_wav, Wav, WavError};

/// The rate Muse Spark's feature extractor takes (24 kHz); it refuses any other.
pub const SAMPLING_RATE: u32 = 24_000;

/// Why an audio file could not be read as the model's input. Each message names the file.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    /// The file does not exist.
    #[error("{}: audio file not found", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// The file exists but could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a WAV file this decoder reads.
    #[error("{}: {source}", path.display())]
    Wav {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: WavError,
    },
    /// The file is sampled at another rate than the model's.
    #[error(
        "{}: sampled at {rate} Hz, but the model takes {want} Hz audio (resample it first, e.g. \
         `sox IN.wav -r {want} OUT.wav`)",
        path.display()
    )]
    Rate {
        /// The file.
        path: PathBuf,
        /// Its rate.
        rate: u32,
        /// The model's.
        want: u32,
    },
    /// The checkpoint's `config.json` describes no audio input this reads.
    #[error("{0}")]
    Config(String),
}

/// Reads the WAV file at `path` as mono samples, refusing any rate but `sample_rate`.
pub fn load_wav(path: &Path, sample_rate: u32) -> Result<Vec<f32>, AudioError> {
    let bytes = std::fs::read(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => AudioError::Missing {
            path: path.to_path_buf(),
        },
        _ => AudioError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    let wav = decode_wav(&bytes).map_err(|source| AudioError::Wav {
        path: path.to_path_buf(),
        source,
    })?;
    if wav.sample_rate != sample_rate {
        return Err(AudioError::Rate {
            path: path.to_path_buf(),
            rate: wav.sample_rate,
            want: sample_rate,
        });
    }
    Ok(wav.samples)
}

/// What a checkpoint says about its audio input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AudioConfig {
    /// The rate its clips must have.
    pub sampling_rate: u32,
    /// Samples one audio token takes (the product of `audio_config.patch_sizes`).
    pub samples_per_token: usize,
    /// The placeholder token of one audio token (`audio_token_id`).
    pub audio_token_id: i64,
}

/// One prompt's clips as the model reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedAudio {
    /// `[clips, width]`, row-major: each clip then zeros.
    pub input_values: Vec<f32>,
    /// Samples per row: the longest clip rounded up to a multiple of the samples per token.
    pub width: usize,
    /// Each clip's length in samples.
    pub lengths: Vec<usize>,
}

impl AudioConfig {
    /// The audio input of a checkpoint's `config.json` (`audio_config.patch_sizes`, default
    /// transformers' `[16, 6, 5, 4]`; `audio_token_id`, default 200038); `None` when it has no
    /// `audio_config` (a model without an audio tower).
    pub fn from_config(config: &serde_json::Value) -> Result<Option<AudioConfig>, AudioError> {
        let Some(audio) = config.get("audio_config") else {
            return Ok(None);
        };
        let bad = |what: &str| AudioError::Config(format!("config.json: {what}"));
        let samples_per_token = match audio.get("patch_sizes") {
            None => 16 * 6 * 5 * 4,
            Some(v) => v
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| bad("audio_config.patch_sizes must be a list of sizes"))?
                .iter()
                .map(|p| p.as_u64().filter(|&p| p > 0).map(|p| p as usize))
                .try_fold(1usize, |acc, p| acc.checked_mul(p?))
                .ok_or_else(|| bad("audio_config.patch_sizes must be positive integers"))?,
        };
        let audio_token_id = match config.get("audio_token_id") {
            None => 200_038,
            Some(v) => v
                .as_i64()
                .filter(|&t| t >= 0)
                .ok_or_else(|| bad("audio_token_id must be a token id"))?,
        };
        Ok(Some(AudioConfig {
            sampling_rate: SAMPLING_RATE,
            samples_per_token,
            audio_token_id,
        }))
    }

    /// Placeholder tokens a clip of `samples` takes: one per started `samples_per_token`.
    pub fn placeholder_tokens(&self, samples: usize) -> usize {
        samples.div_ceil(self.samples_per_token)
    }

    /// One prompt's clips, each right-padded with zeros to the longest rounded up to a
    /// multiple of the samples per token (transformers' `padding="longest"` with
    /// `pad_to_multiple_of`).
    pub fn process(&self, clips: &[Vec<f32>]) -> ProcessedAudio {
        let longest = clips.iter().map(Vec::len).max().unwrap_or(0);
        let width = longest.div_ceil(self.samples_per_token) * self.samples_per_token;
        let mut input_values = Vec::with_capacity(clips.len() * width);
        for clip in clips {
            input_values.extend_from_slice(clip);
            input_values.resize(input_values.len() + width - clip.len(), 0.0);
        }
        ProcessedAudio {
            input_values,
            width,
            lengths: clips.iter().map(Vec::len).collect(),
        }
    }
}

/// `tokens` with each clip's placeholders as the model reads them: run `k` of `audio_token`
/// belongs to clip `k`, which needs `counts[k]`; a run of one (as a chat template writes it) is
/// expanded, a run of that count kept (see [`crate::image::expand_placeholder_runs`]).
pub fn expand_placeholders(
    tokens: &[i64],
    audio_token: i64,
    counts: &[usize],
) -> Result<Vec<i64>, String> {
    crate::image::expand_placeholder_runs(tokens, audio_token, counts, "audio clip")
}

/// Checks that `tokens` hold each clip's placeholders already expanded (run `k` of
/// `audio_token` exactly `counts[k]` long), as a scored sequence must: nothing is changed.
pub fn check_placeholders(
    tokens: &[i64],
    audio_token: i64,
    counts: &[usize],
) -> Result<(), String> {
    let expanded = expand_placeholders(tokens, audio_token, counts)?;
    if expanded.len() != tokens.len() {
        let mut runs = vec![];
        for (i, &t) in tokens.iter().enumerate() {
            if t == audio_token {
                if i > 0 && tokens[i - 1] == audio_token {
                    *runs.last_mut().expect("a run has begun") += 1;
                } else {
                    runs.push(1);
                }
            }
        }
        return Err(format!(
            "the audio clips take {counts:?} placeholder tokens (token {audio_token}) in a row, \
             the tokens hold runs of {runs:?}: scored tokens are read as given, so each clip's \
             run must be expanded"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::wav::write::{i16s, wav};
    use super::*;
    use serde_json::json;

    fn tiny() -> AudioConfig {
        AudioConfig::from_config(&json!({
            "audio_config": {"patch_sizes": [4, 2]},
            "audio_token_id": 93
        }))
        .unwrap()
        .unwrap()
    }

    #[test]
    fn the_config_gives_the_samples_per_token_and_the_placeholder() {
        let c = tiny();
        assert_eq!((c.samples_per_token, c.audio_token_id), (8, 93));
        assert_eq!(c.sampling_rate, 24_000);
        let released = AudioConfig::from_config(&json!({"audio_config": {}})).unwrap();
        assert_eq!(released.map(|c| c.samples_per_token), Some(1920));
        assert_eq!(AudioConfig::from_config(&json!({})).unwrap(), None);
        for bad in [json!([]), json!([4, 0]), json!("4"), json!([4, -2])] {
            let e = AudioConfig::from_config(&json!({"audio_config": {"patch_sizes": bad}}));
            assert!(e.unwrap_err().to_string().contains("patch_sizes"));
        }
    }

    #[test]
    fn clips_pad_to_the_longest_on_a_token_boundary() {
        let c = tiny();
        let p = c.process(&[vec![1.0; 5], vec![2.0; 13]]);
        assert_eq!((p.width, p.lengths.clone()), (16, vec![5, 13]));
        assert_eq!(&p.input_values[..6], &[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]);
        assert!(p.input_values[5..16].iter().all(|&v| v == 0.0));
        assert_eq!(&p.input_values[16..29], &[2.0; 13]);
        assert_eq!(&p.input_values[29..], &[0.0; 3]);
        // A clip already on the boundary is not padded further.
        assert_eq!(c.process(&[vec![0.5; 16]]).width, 16);
        assert_eq!(
            [0, 1, 8, 9, 16].map(|n| c.placeholder_tokens(n)),
            [0, 1, 1, 2, 2]
        );
    }

    #[test]
    fn placeholder_runs_expand_per_clip() {
        let x = 93;
        assert_eq!(
            expand_placeholders(&[1, x, 2, x, x], x, &[3, 2]).unwrap(),
            [1, x, x, x, 2, x, x]
        );
        let e = expand_placeholders(&[1, x, x], x, &[3]).unwrap_err();
        assert!(e.contains("audio clip 0 needs 3"), "{e}");
        let e = expand_placeholders(&[1, 2], x, &[3]).unwrap_err();
        assert!(e.contains("1 audio clip(s) but 0 run(s)"), "{e}");
        assert!(check_placeholders(&[1, x, x, x, 2, x], x, &[3, 1]).is_ok());
        let e = check_placeholders(&[1, x, 2, x, x], x, &[3, 2]).unwrap_err();
        assert!(e.contains("[3, 2]") && e.contains("runs of [1, 2]"), "{e}");
    }

    #[test]
    fn files_are_read_at_the_model_rate_only() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("ok.wav");
        std::fs::write(&ok, wav(1, 2, 24_000, 16, &i16s(&[16_384, 0]))).unwrap();
        assert_eq!(load_wav(&ok, SAMPLING_RATE).unwrap(), [0.25]);
        let cd = dir.path().join("cd.wav");
        std::fs::write(&cd, wav(1, 1, 44_100, 16, &i16s(&[0]))).unwrap();
        let e = load_wav(&cd, SAMPLING_RATE).unwrap_err().to_string();
        assert!(
            e.contains("cd.wav") && e.contains("44100 Hz") && e.contains("24000 Hz"),
            "{e}"
        );
        let e = load_wav(&dir.path().join("none.wav"), SAMPLING_RATE).unwrap_err();
        assert!(
            e.to_string().contains("none.wav: audio file not found"),
            "{e}"
        );
        let text = dir.path().join("notes.wav");
        std::fs::write(&text, "hello").unwrap();
        let e = load_wav(&text, SAMPLING_RATE).unwrap_err().to_string();
        assert!(e.contains("notes.wav: not a WAV file"), "{e}");
    }
}
