//! `anneal logprobs --audio` and `anneal generate --audio` on `tiny_muse_spark`, the tiny Muse
//! Spark Open checkpoint saved by transformers, with the two WAV files
//! `host/runtime/tests/reference/make_audio_fixture.py` wrote (24 kHz 16-bit PCM, one mono, one
//! stereo): the CLI decodes them, pads them as the feature extractor does and scores a prompt
//! holding both clips' placeholders with transformers' logprobs within 1e-4; `generate` expands
//! one placeholder per clip and decodes transformers' greedy token. Bad WAV files (missing,
//! truncated, another rate, not WAV), placeholders that do not match the clips and audio for a
//! model without an audio tower are one error line each, exit 2.

use anneal_engine::io::load_safetensors;
use anneal_tests::cli::{anneal, error_line, floats, json_of, root, Job};
use std::path::{Path, PathBuf};
use std::process::Output;

const AUDIO_TOKEN: i64 = 93;

fn fixture(name: &str) -> PathBuf {
    root().join("host/runtime/tests/fixtures").join(name)
}

fn clips() -> Vec<PathBuf> {
    let dir = fixture("tiny_muse_spark");
    vec![dir.join("audio0.wav"), dir.join("audio1.wav")]
}

fn logprobs(dir: &Path, tokens: &[i64], audio: &[PathBuf]) -> Output {
    let ids: Vec<String> = tokens.iter().map(i64::to_string).collect();
    let mut c = anneal();
    c.args(["logprobs", "--tokens", &ids.join(","), "--model-dir"])
        .arg(dir);
    for clip in audio {
        c.arg("--audio").arg(clip);
    }
    c.output().unwrap()
}

/// The prompt holding both clips' placeholders, transformers' logprob of each next token and
/// its greedy token after each position.
fn expected() -> (Vec<i64>, Vec<f32>, Vec<i64>) {
    let exp =
        load_safetensors(fixture("tiny_muse_spark").join("expected_audio.safetensors")).unwrap();
    let tokens = exp["tokens"].to_vec::<i64>();
    let logits = exp["logits"].to_vec_f32();
    let v = logits.len() / tokens.len();
    let greedy = (0..tokens.len())
        .map(|i| {
            let row = &logits[i * v..(i + 1) * v];
            (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as i64
        })
        .collect();
    (tokens, exp["logprobs"].to_vec_f32(), greedy)
}

#[test]
fn logprobs_of_a_prompt_with_two_clips_match_transformers() {
    let (tokens, want, _) = expected();
    let dir = fixture("tiny_muse_spark");
    let v = json_of(&logprobs(&dir, &tokens, &clips()));
    let got = floats(&v["logprobs"]);
    assert_eq!(got.len(), want.len(), "{v}");
    let d = got
        .iter()
        .zip(&want)
        .map(|(a, &b)| (a - b as f64).abs())
        .fold(0.0, f64::max);
    println!("logprobs with audio: max |difference| {d:e}");
    assert!(d <= 1e-4, "max |logprob difference| {d}");
    // The audio reaches the model: without it the same tokens score otherwise.
    let plain = json_of(&logprobs(&dir, &tokens, &[]));
    assert_ne!(plain["logprobs"], v["logprobs"]);
}

#[test]
fn generation_expands_one_placeholder_per_clip_and_follows_transformers() {
    let (tokens, _, greedy) = expected();
    let dir = fixture("tiny_muse_spark");
    // The prompt up to just past the second clip, each clip's run written as one placeholder.
    let end = tokens.iter().rposition(|&t| t == AUDIO_TOKEN).unwrap() + 1;
    let mut prompt: Vec<i64> = vec![];
    for (i, &t) in tokens[..end].iter().enumerate() {
        if t != AUDIO_TOKEN || i == 0 || tokens[i - 1] != AUDIO_TOKEN {
            prompt.push(t);
        }
    }
    assert_eq!(prompt.iter().filter(|&&t| t == AUDIO_TOKEN).count(), 2);
    let ids: Vec<String> = prompt.iter().map(i64::to_string).collect();
    let mut c = anneal();
    c.args(["generate", "--temperature", "0", "--max-new-tokens", "2"])
        .args(["--prompt-tokens", &ids.join(","), "--model-dir"])
        .arg(&dir);
    for clip in clips() {
        c.arg("--audio").arg(clip);
    }
    let g = json_of(&c.output().unwrap());
    let expanded: Vec<i64> = floats(&g["prompt_tokens"])
        .iter()
        .map(|&t| t as i64)
        .collect();
    assert_eq!(expanded, tokens[..end], "{g}");
    let new: Vec<i64> = floats(&g["tokens"]).iter().map(|&t| t as i64).collect();
    assert_eq!(new[0], greedy[end - 1], "transformers' greedy token: {g}");
    // Several rows with audio are refused in one line.
    let mut c = anneal();
    c.args([
        "generate",
        "--batch",
        "2",
        "--prompt-tokens",
        &ids.join(","),
    ])
    .arg("--model-dir")
    .arg(&dir)
    .arg("--audio")
    .arg(&clips()[0]);
    assert!(error_line(&c.output().unwrap(), 2).contains("--audio"));
}

/// A 16-bit mono PCM WAV file at `rate` holding `samples`.
fn wav(rate: u32, samples: &[i16]) -> Vec<u8> {
    let data: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
    let mut out = b"RIFF".to_vec();
    out.extend((36 + data.len() as u32).to_le_bytes());
    out.extend(b"WAVEfmt ");
    out.extend(16u32.to_le_bytes());
    out.extend(1u16.to_le_bytes());
    out.extend(1u16.to_le_bytes());
    out.extend(rate.to_le_bytes());
    out.extend((rate * 2).to_le_bytes());
    out.extend(2u16.to_le_bytes());
    out.extend(16u16.to_le_bytes());
    out.extend(b"data");
    out.extend((data.len() as u32).to_le_bytes());
    out.extend(data);
    out
}

#[test]
fn bad_wav_files_and_placeholders_are_one_error_line() {
    let job = Job::new("muse-audio-bad");
    let (tokens, _, _) = expected();
    let dir = fixture("tiny_muse_spark");
    let second = clips()[1].clone();
    let bad = |path: PathBuf| error_line(&logprobs(&dir, &tokens, &[path, second.clone()]), 2);
    // A missing file.
    let line = bad(job.dir.join("nowhere.wav"));
    assert!(
        line.contains("nowhere.wav") && line.contains("not found"),
        "{line}"
    );
    // The first clip cut in its data chunk.
    let bytes = std::fs::read(&clips()[0]).unwrap();
    let cut = job.dir.join("cut.wav");
    std::fs::write(&cut, &bytes[..bytes.len() - 11]).unwrap();
    let line = bad(cut);
    assert!(
        line.contains("cut.wav") && line.contains("truncated") && line.contains("'data'"),
        "{line}"
    );
    // Another rate: nothing is resampled.
    let cd = job.dir.join("cd.wav");
    std::fs::write(&cd, wav(44_100, &[0; 100])).unwrap();
    let line = bad(cd);
    assert!(
        line.contains("cd.wav") && line.contains("44100 Hz") && line.contains("24000 Hz"),
        "{line}"
    );
    // Not a WAV file, and an encoding the decoder does not read (8-bit µ-law).
    let text = job.dir.join("notes.wav");
    std::fs::write(&text, "not audio at all").unwrap();
    assert!(bad(text).contains("not a WAV file"));
    let mut mulaw = wav(24_000, &[0; 50]);
    mulaw[20] = 7;
    mulaw[34] = 8;
    mulaw[32] = 1;
    let mulaw_path = job.dir.join("mulaw.wav");
    std::fs::write(&mulaw_path, mulaw).unwrap();
    let line = bad(mulaw_path);
    assert!(line.contains("unsupported WAV encoding"), "{line}");
    // The first clip's run one placeholder short (it takes 13).
    let at = tokens.iter().position(|&t| t == AUDIO_TOKEN).unwrap();
    let mut short = tokens.clone();
    short.remove(at);
    let line = error_line(&logprobs(&dir, &short, &clips()), 2);
    assert!(
        line.contains("audio clip 0 needs 13 placeholder tokens"),
        "{line}"
    );
    // One placeholder for the first clip, as a chat template writes it: scoring does not
    // expand it.
    let mut one = tokens.clone();
    one.drain(at + 1..at + 13);
    let line = error_line(&logprobs(&dir, &one, &clips()), 2);
    assert!(
        line.contains("[13, 7]") && line.contains("runs of [1, 7]"),
        "{line}"
    );
    // Audio for a checkpoint without an audio tower.
    let line = error_line(
        &logprobs(&fixture("tiny_muse_glimmer"), &[1, 2, 3], &clips()),
        2,
    );
    assert!(line.contains("no audio_config"), "{line}");
}
