//! `anneal logprobs --image` on a tiny Qwen3-VL checkpoint saved by transformers
//! (`host/runtime/tests/reference/make_vl_fixture.py`): the CLI reads the two PNG files through
//! the checkpoint's image processor and scores a prompt holding both images with transformers'
//! logprobs within 1e-4; `anneal generate --image` after the images picks transformers' greedy
//! token and decodes what scoring the whole sequence with the images gives. Bad images, a
//! placeholder count that does not match an image, and an image for a text-only model are one
//! error line each, exit 2.

use anneal_engine::io::load_safetensors;
use anneal_tests::cli::{anneal, error_line, floats, json_of, root, Job};
use std::path::{Path, PathBuf};
use std::process::Output;

fn fixture(name: &str) -> PathBuf {
    root().join("host/runtime/tests/fixtures").join(name)
}

fn logprobs(dir: &Path, tokens: &[i64], images: &[PathBuf]) -> Output {
    let ids: Vec<String> = tokens.iter().map(i64::to_string).collect();
    let mut c = anneal();
    c.args(["logprobs", "--tokens", &ids.join(","), "--model-dir"])
        .arg(dir);
    for image in images {
        c.arg("--image").arg(image);
    }
    c.output().unwrap()
}

/// The prompt with both images, transformers' logprob of each next token, and its greedy
/// token after each position.
fn expected() -> (Vec<i64>, Vec<f64>, Vec<i64>) {
    let exp = load_safetensors(fixture("tiny_qwen3_vl").join("expected.safetensors")).unwrap();
    let tokens = exp["vl_tokens"].to_vec::<i64>();
    let logits = exp["vl_logits"].to_vec_f32();
    let v = logits.len() / tokens.len();
    let row = |i: usize| &logits[i * v..(i + 1) * v];
    let want = (0..tokens.len() - 1)
        .map(|i| {
            let max = row(i)
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let sum: f64 = row(i).iter().map(|&x| (x as f64 - max).exp()).sum();
            row(i)[tokens[i + 1] as usize] as f64 - (max + sum.ln())
        })
        .collect();
    let greedy = (0..tokens.len())
        .map(|i| {
            (0..v)
                .max_by(|&a, &b| row(i)[a].total_cmp(&row(i)[b]))
                .unwrap() as i64
        })
        .collect();
    (tokens, want, greedy)
}

fn images() -> Vec<PathBuf> {
    let dir = fixture("tiny_qwen3_vl");
    vec![dir.join("image0.png"), dir.join("image1.png")]
}

#[test]
fn logprobs_of_a_prompt_with_two_images_match_transformers() {
    let (tokens, want, _) = expected();
    let dir = fixture("tiny_qwen3_vl");
    let v = json_of(&logprobs(&dir, &tokens, &images()));
    let got = floats(&v["logprobs"]);
    assert_eq!(got.len(), want.len(), "{v}");
    let d = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("logprobs with images: max |difference| {d:e}");
    assert!(d <= 1e-4, "max |logprob difference| {d}");
    // The images reach the model: without them the same tokens score otherwise.
    let plain = json_of(&logprobs(&dir, &tokens, &[]));
    assert_ne!(plain["logprobs"], v["logprobs"]);
}

#[test]
fn bad_images_and_placeholders_are_one_error_line() {
    let job = Job::new("vl-bad");
    let (tokens, _, _) = expected();
    let dir = fixture("tiny_qwen3_vl");
    // A missing file, and a truncated PNG.
    let missing = job.dir.join("nowhere.png");
    let line = error_line(&logprobs(&dir, &tokens, &[missing, images()[1].clone()]), 2);
    assert!(
        line.contains("nowhere.png") && line.contains("not found"),
        "{line}"
    );
    let bytes = std::fs::read(&images()[0]).unwrap();
    let cut = job.dir.join("cut.png");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let line = error_line(&logprobs(&dir, &tokens, &[cut, images()[1].clone()]), 2);
    assert!(line.contains("cut.png"), "{line}");
    // The first image's run one placeholder short (image 0 makes 2 tokens).
    let image_token = 90;
    let at = tokens.iter().position(|&t| t == image_token).unwrap();
    let mut short = tokens.clone();
    short.remove(at);
    let line = error_line(&logprobs(&dir, &short, &images()), 2);
    assert!(line.contains("placeholder"), "{line}");
    // An image for a text-only checkpoint.
    let line = error_line(&logprobs(&fixture("tiny_qwen3"), &[1, 2, 3], &images()), 2);
    assert!(line.contains("text-only"), "{line}");
}

#[test]
fn generation_after_two_images_follows_the_model_with_the_images() {
    let (tokens, _, greedy) = expected();
    let dir = fixture("tiny_qwen3_vl");
    // The prompt up to just past the second image's end token.
    let prompt = &tokens[..15];
    let ids: Vec<String> = prompt.iter().map(i64::to_string).collect();
    let mut c = anneal();
    c.args(["generate", "--temperature", "0", "--max-new-tokens", "4"])
        .args(["--prompt-tokens", &ids.join(","), "--model-dir"])
        .arg(&dir);
    for image in images() {
        c.arg("--image").arg(image);
    }
    let g = json_of(&c.output().unwrap());
    let new: Vec<i64> = floats(&g["tokens"]).iter().map(|&t| t as i64).collect();
    assert_eq!(new.len(), 4, "{g}");
    // transformers' greedy token after the prompt.
    assert_eq!(new[0], greedy[14], "{g}");
    // Each decoded token's logprob is what scoring the whole sequence with the images gives.
    let whole: Vec<i64> = prompt.iter().chain(&new).copied().collect();
    let scored = json_of(&logprobs(&dir, &whole, &images()));
    let scored = floats(&scored["logprobs"]);
    let decoded = floats(&g["logprobs"]);
    for (i, (a, b)) in decoded.iter().zip(&scored[prompt.len() - 1..]).enumerate() {
        assert!((a - b).abs() <= 1e-4, "token {i}: decoded {a}, scored {b}");
    }
    // Several rows or ranks with images are refused in one line.
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
    .arg("--image")
    .arg(&images()[0]);
    assert!(error_line(&c.output().unwrap(), 2).contains("--image"));
}
