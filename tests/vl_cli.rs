//! `anneal logprobs --image` on a tiny Qwen3-VL checkpoint saved by transformers
//! (`host/runtime/tests/reference/make_vl_fixture.py`): the CLI reads the two PNG files through
//! the checkpoint's image processor and scores a prompt holding both images with transformers'
//! logprobs within 1e-4; `anneal generate --image` after the images picks transformers' greedy
//! token and decodes what scoring the whole sequence with the images gives. Bad images, a
//! placeholder count that does not match an image, and an image for a text-only model are one
//! error line each, exit 2. `anneal serve --model` answers a chat request whose `image_url`
//! parts carry the PNG files as `data:` URLs with transformers' greedy token and logprob, and
//! refuses bad images with a 400 naming the part.

use anneal_engine::io::load_safetensors;
use anneal_tests::cli::{anneal, error_line, floats, json_of, root, Job};
use anneal_tests::serve::{temp_home, Server};
use base64::Engine as _;
use serde_json::{json, Value};
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

/// A Hugging Face directory serving the fixture: its files, a word-level tokenizer whose word
/// `w<i>` is token `i` (the vision tokens are special), and a chat template that places each
/// image between its start and end tokens, as Qwen-VL's does, and nothing else.
fn servable_fixture(dir: &Path, with_processor: bool) {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(fixture("tiny_qwen3_vl")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if with_processor || name != "preprocessor_config.json" {
            std::fs::copy(&path, dir.join(name)).unwrap();
        }
    }
    let special = [
        (90, "<|image_pad|>"),
        (91, "<|video_pad|>"),
        (92, "<|vision_start|>"),
        (93, "<|vision_end|>"),
        (95, "<|endoftext|>"),
    ];
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for i in 1..96 {
        let word = special
            .iter()
            .find(|(id, _)| *id == i)
            .map_or(format!("w{i}"), |(_, w)| w.to_string());
        vocab.insert(word, json!(i));
    }
    let added: Vec<Value> = special
        .iter()
        .map(|(id, w)| {
            json!({"id": id, "content": w, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{%- for message in messages %}{%- if message.content is string %}{{ message.content }}{%- else %}{%- for part in message.content %}{%- if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{%- else %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endfor %}";
    let config = json!({"chat_template": template, "eos_token": "<|endoftext|>"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

fn data_url(bytes: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    format!("data:image/png;base64,{b64}")
}

/// The fixture's prompt as chat content: its text words around the two images.
fn chat_with_images(model: &str, first: &str, second: &str) -> Value {
    let image = |url: &str| json!({"type": "image_url", "image_url": {"url": url}});
    json!({
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "w1 w2 w3 "}, image(first),
            {"type": "text", "text": " w4 w5 "}, image(second),
            {"type": "text", "text": " w6 w7 w8"},
        ]}],
        "temperature": 0,
        "max_tokens": 3,
        "logprobs": true,
    })
}

#[test]
fn serve_answers_a_chat_with_images_as_transformers_and_refuses_bad_ones() {
    let home = temp_home("vl-serve");
    let (vl, blind) = (home.join("tiny_vl"), home.join("tiny_vl_blind"));
    servable_fixture(&vl, true);
    servable_fixture(&blind, false);
    let server = Server::start(
        &home,
        &[
            "--model",
            vl.to_str().unwrap(),
            "--model",
            blind.to_str().unwrap(),
        ],
    );
    let png = |i: usize| std::fs::read(&images()[i]).unwrap();
    let (first, second) = (data_url(&png(0)), data_url(&png(1)));
    let (code, reply) = server.post(
        "/v1/chat/completions",
        &chat_with_images("tiny_vl", &first, &second),
    );
    assert_eq!(code, 200, "{reply}");
    // The template's two placeholders grew to the images' 2 and 4 tokens: the fixture's prompt.
    let (tokens, _, greedy) = expected();
    assert_eq!(reply["usage"]["prompt_tokens"], tokens.len(), "{reply}");
    let last = tokens.len() - 1;
    let top = &reply["choices"][0]["logprobs"]["content"][0];
    assert_eq!(top["token"], format!("w{}", greedy[last]), "{reply}");
    // transformers' logprob of its greedy token after the whole prompt.
    let exp = load_safetensors(fixture("tiny_qwen3_vl").join("expected.safetensors")).unwrap();
    let logits = exp["vl_logits"].to_vec_f32();
    let v = logits.len() / tokens.len();
    let row = &logits[last * v..];
    let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    let expected_lp = row[greedy[last] as usize] as f64 - lse;
    let lp = top["logprob"].as_f64().unwrap();
    assert!((lp - expected_lp).abs() <= 1e-4, "{lp} vs {expected_lp}");

    // Bad images: a 400 naming the part, and the server answers the next request.
    let bytes = png(0);
    let cut = data_url(&bytes[..bytes.len() / 2]);
    let huge = data_url(&std::fs::read(fixture("tiny_qwen3_vl").join("huge.png")).unwrap());
    // 3 MiB of zeros: past the 2 MiB body of other requests, read and refused as no image.
    let zeros = data_url(&vec![0u8; 3 << 20]);
    let part = "messages[0].content[3]";
    for (url, says) in [
        (zeros.as_str(), "unsupported image format"),
        (cut.as_str(), "corrupt or truncated"),
        (huge.as_str(), "over the limit"),
        ("https://example.com/a.png", "only data: URLs"),
        ("data:image/png;base64,@@@", "does not decode"),
    ] {
        let (code, err) = server.post(
            "/v1/chat/completions",
            &chat_with_images("tiny_vl", &first, url),
        );
        assert_eq!(code, 400, "{url:.40}: {err}");
        assert_eq!(err["error"]["param"], part, "{err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(says) && !message.contains('\n'), "{err}");
    }
    // A text part spelling the placeholder: the template placed one more than the images.
    let mut extra = chat_with_images("tiny_vl", &first, &second);
    extra["messages"][0]["content"][0]["text"] = json!("w1 <|image_pad|> w3 ");
    let (code, err) = server.post("/v1/chat/completions", &extra);
    assert_eq!(code, 400, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("3 image placeholder(s) for 2 image(s)"),
        "{err}"
    );
    // An image for the same model without its image processor.
    let (code, err) = server.post(
        "/v1/chat/completions",
        &chat_with_images("tiny_vl_blind", &first, &second),
    );
    assert_eq!(code, 400, "{err}");
    assert_eq!(err["error"]["param"], "messages[0].content[1]", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("text-only"),
        "{err}"
    );
    // Still serving, and the same answer again.
    let (code, again) = server.post(
        "/v1/chat/completions",
        &chat_with_images("tiny_vl", &first, &second),
    );
    assert_eq!(code, 200, "{again}");
    assert_eq!(
        again["choices"][0]["message"],
        reply["choices"][0]["message"]
    );
}
