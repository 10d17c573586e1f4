//! Training a vision-language model on chat data with images (`data.format = "chat"`): the
//! synthetic shapes data of `scripts/vlm-data.py`, the debug Qwen3-VL with a smaller decoder.
//! A run logs `eval_accuracy`, resumes on the same losses bit for bit, records its chat
//! template and image processor, and exports a directory that `anneal generate --image` and
//! `anneal serve --model` answer questions about an image with. Bad chat data (a missing,
//! truncated or 20,000 x 20,000 image, images for a text-only model) is one error line, exit 2,
//! before any training.

use anneal_tests::cli::{anneal, error_line, json_of, losses, ok, rows};
use anneal_tests::serve::{temp_home, Server};
use base64::Engine as _;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Output;

/// The data: `n` conversations about 64 x 64 images, in `dir/data`.
fn make_data(dir: &Path, n: usize) -> PathBuf {
    let data = dir.join("data");
    let out = std::process::Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/vlm-data.py"))
        .arg(&data)
        .args(["--train", &n.to_string(), "--seed", "3"])
        .output()
        .expect("python3 runs scripts/vlm-data.py");
    ok(&out);
    data
}

fn config(dir: &Path, data: &Path, model_args: &str) -> PathBuf {
    let toml = format!(
        r#"[model]
plugin = "llama"
flavor = "debugmodel_vl"
args = {model_args}

[optimizer]
plugin = "adamw"
lr = 1e-3

[lr_scheduler]
warmup_steps = 0
decay = "constant"

[training]
steps = 6
batch_size = 4
micro_batch_size = 2
seq_len = 32
seed = 5

[checkpoint]
interval = 3
keep_latest = 4

[data]
path = "{train}"
format = "chat"
tokenizer = "train"
vocab_size = 320
val_fraction = 0.25
image_min_pixels = 4096
image_max_pixels = 16384
cache_dir = "{cache}"

[metrics]
log_freq = 1
eval_freq = 3
eval_batches = 2
"#,
        train = data.join("train.jsonl").display(),
        cache = dir.join("cache").display(),
    );
    let path = dir.join("vlm.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

fn train(config: &Path, run: &Path, set: &[&str]) -> Output {
    let mut c = anneal();
    c.arg("train").arg(config).arg("--run-dir").arg(run);
    for s in set {
        c.args(["--set", s]);
    }
    c.output().unwrap()
}

/// The debug Qwen3-VL made smaller: a 2-block, 128-wide decoder and a 1-block tower.
const SMALL: &str = "{ vocab_size = 320, n_layers = 2, dim = 128, ffn_dim = 256, n_heads = 4, \
    n_kv_heads = 2, head_dim = 32, vision = { mrope_section = [6, 5, 5], \
    vision = { depth = 1, out_hidden_size = 128 } } }";

#[test]
fn chat_data_with_images_trains_resumes_exports_and_answers_about_an_image() {
    let dir = temp_home("vlm-train");
    let data = make_data(&dir, 40);
    let cfg = config(&dir, &data, SMALL);

    // The whole run, and the same run stopped at step 3 and resumed.
    let whole = dir.join("whole");
    let out = train(&cfg, &whole, &[]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("30 train / 10 held-out conversations, 40 images"),
        "{stdout}"
    );
    let evals: Vec<f64> = rows(&whole)
        .iter()
        .filter_map(|r| r["eval_accuracy"].as_f64())
        .collect();
    assert_eq!(evals.len(), 2, "an accuracy at steps 3 and 6");
    assert!(evals.iter().all(|a| (0.0..=1.0).contains(a)), "{evals:?}");
    let halves = dir.join("halves");
    ok(&train(&cfg, &halves, &["training.steps=3"]));
    ok(&train(&cfg, &halves, &[]));
    assert_eq!(
        losses(&whole),
        losses(&halves),
        "resume continues the same curve"
    );

    // The run keeps its chat template and image processor; the export carries them.
    let tc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(whole.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|image_pad|>"));
    let hf = dir.join("hf");
    ok(anneal()
        .args(["checkpoint", "export", "--to-hf"])
        .arg(&hf)
        .arg(whole.join("checkpoints/step-6"))
        .output()
        .as_ref()
        .unwrap());
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ] {
        assert!(hf.join(f).is_file(), "the export has {f}");
    }

    // `generate --image`: the prompt's one placeholder grows to the image's 4 tokens.
    let image = data.join("images/00000.png");
    let prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the shape?<|im_end|>\n<|im_start|>assistant\n";
    let out = anneal()
        .args(["generate", "--model-dir"])
        .arg(&hf)
        .arg("--tokenizer")
        .arg(hf.join("tokenizer.json"))
        .args([
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            "2",
            "--image",
        ])
        .arg(&image)
        .output()
        .unwrap();
    let v = json_of(&out);
    let placeholders = v["prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t.as_i64() == Some(5))
        .count();
    assert_eq!(placeholders, 4, "{v}");
    assert_eq!(v["tokens"].as_array().unwrap().len(), 2, "{v}");

    // The OpenAI endpoint reads the image from a data: URL through the exported processor.
    let server = Server::start(&dir.join("home"), &["--model", hf.to_str().unwrap()]);
    let png = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&image).unwrap());
    let (code, reply) = server.post(
        "/v1/chat/completions",
        &json!({
            "model": "hf",
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
                {"type": "text", "text": "What colour is the shape?"},
            ]}],
            "temperature": 0,
            "max_tokens": 2,
        }),
    );
    assert_eq!(code, 200, "{reply}");
    // The chat template of the run, and the image's 4 tokens: what generate's prompt holds.
    assert_eq!(
        reply["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        v["prompt_tokens"].as_array().unwrap().len(),
        "{reply}"
    );
    server.kill();
}

#[test]
fn bad_chat_data_is_one_error_line_before_training() {
    let dir = temp_home("vlm-bad");
    let data = make_data(&dir, 8);
    let cfg = config(&dir, &data, SMALL);
    // An image that is not there: named with the conversation's line.
    std::fs::remove_file(data.join("images/00002.png")).unwrap();
    let line = error_line(&train(&cfg, &dir.join("missing"), &[]), 2);
    assert!(
        line.contains("train.jsonl:3") && line.contains("00002.png: image file not found"),
        "{line}"
    );
    // A truncated image, and one whose header declares 20,000 x 20,000 pixels: refused from
    // the header, past the documented limit, before any pixel buffer.
    let image = data.join("images/00002.png");
    let bytes = std::fs::read(data.join("images/00003.png")).unwrap();
    std::fs::write(&image, &bytes[..bytes.len() / 2]).unwrap();
    let line = error_line(&train(&cfg, &dir.join("cut"), &[]), 2);
    assert!(
        line.contains("train.jsonl:3") && line.contains("corrupt or truncated"),
        "{line}"
    );
    let huge = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../host/runtime/tests/fixtures/tiny_qwen3_vl/huge.png");
    std::fs::copy(huge, &image).unwrap();
    let line = error_line(&train(&cfg, &dir.join("huge"), &[]), 2);
    assert!(
        line.contains("20000 x 20000") && line.contains("over the limit"),
        "{line}"
    );
    // Images for a text-only model.
    let text_only = config(&dir, &data, "{ vocab_size = 320, n_layers = 1 }");
    let toml = std::fs::read_to_string(&text_only)
        .unwrap()
        .replace("debugmodel_vl", "debugmodel_qwen3");
    std::fs::write(&text_only, toml).unwrap();
    let line = error_line(&train(&text_only, &dir.join("blind"), &[]), 2);
    assert!(
        line.contains("reads no images") && line.contains("train.jsonl:1"),
        "{line}"
    );
}

/// `mpiexec -n 2 anneal train CONFIG --run-dir RUN --set ...`.
fn train_on_2_ranks(config: &Path, run: &Path, set: &[&str]) -> Output {
    let bin = anneal_tests::cli::anneal_bin();
    let mut c = anneal_dist::launch::mpiexec_command(2, &bin, &[]).expect("mpiexec");
    c.env_remove("ANNEAL_PLUGIN_PATH")
        .arg("train")
        .arg(config)
        .arg("--run-dir")
        .arg(run);
    for s in set {
        c.args(["--set", s]);
    }
    c.output().unwrap()
}

#[test]
fn images_train_under_ddp_and_fsdp_as_in_one_process() {
    let dir = temp_home("vlm-dist");
    let data = make_data(&dir, 24);
    let cfg = config(&dir, &data, SMALL);
    let common = ["training.threads=1", "metrics.eval_freq=0"];
    let single = dir.join("single");
    ok(&train(&cfg, &single, &common));
    let want: Vec<f64> = rows(&single)
        .iter()
        .filter_map(|r| r["loss"].as_f64())
        .collect();
    for (name, layout) in [
        ("ddp", "parallelism.dp_replicate=2"),
        ("fsdp", "parallelism.dp_shard=2"),
    ] {
        let run = dir.join(name);
        let set = [common[0], common[1], layout];
        ok(&train_on_2_ranks(&cfg, &run, &set));
        let got: Vec<f64> = rows(&run)
            .iter()
            .filter_map(|r| r["loss"].as_f64())
            .collect();
        assert_eq!(got.len(), want.len(), "{name}");
        // Each rank takes one of a step's two micro-batches, with its rows' images.
        assert_eq!(
            got[0].to_bits(),
            want[0].to_bits(),
            "{name}: step 1 bitwise"
        );
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() / b < 1e-4, "{name}: {a} vs {b}");
        }
    }
}
