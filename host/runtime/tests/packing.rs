//! Packed documents: a row holding several documents, each at positions from 0, computes for
//! each document what it computes alone (attention keeps to each run of consecutive
//! positions), in logits, losses and gradients; and models whose layers carry state along the
//! sequence without positions refuse packed rows instead of mixing the documents. The model is
//! `tiny_qwen3_chat`, a Qwen3 checkpoint as transformers saves it (written with its tokenizer
//! and chat data by tests/reference/make_chat_fixture.py), checked against transformers first.

mod common;

use anneal_engine::io::load_safetensors;
use anneal_engine::ops::{cross_entropy, CrossEntropy};
use anneal_engine::Tensor;
use anneal_runtime::plugins::ForwardOpts;
use common::{fixture, leaves, max_abs_diff, model_for, positions};

/// Three documents of different lengths (token ids of the fixture's vocabulary) and a padded
/// tail, packed into one row of 40 tokens.
fn documents() -> Vec<Vec<i64>> {
    let lens = [11, 17, 7];
    let mut next = 5i64;
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    next = (next * 37 + 11) % 380;
                    next
                })
                .collect()
        })
        .collect()
}

const ROW: usize = 40;

fn packed_row(docs: &[Vec<i64>]) -> (Tensor, Tensor) {
    let mut ids: Vec<i64> = docs.concat();
    let mut pos: Vec<i64> = docs.iter().flat_map(|d| 0..d.len() as i64).collect();
    let pad = ROW - ids.len();
    ids.extend(std::iter::repeat_n(0, pad));
    pos.extend(0..pad as i64);
    (
        Tensor::from_vec(ids, &[1, ROW]).unwrap(),
        Tensor::from_vec(pos, &[1, ROW]).unwrap(),
    )
}

/// The mean next-token loss of `logits [n, V]` over `ids` (`n` tokens).
fn doc_loss(logits: &Tensor, ids: &[i64]) -> Tensor {
    let n = ids.len();
    let v = logits.shape()[1];
    let inputs = logits
        .narrow(0, 0, n - 1)
        .unwrap()
        .reshape(&[n - 1, v])
        .unwrap();
    let targets = Tensor::from_vec(ids[1..].to_vec(), &[n - 1]).unwrap();
    cross_entropy(&inputs, &targets, &CrossEntropy::default()).unwrap()
}

#[test]
fn the_chat_fixture_matches_transformers() {
    let dir = fixture("tiny_qwen3_chat");
    let (model, params) = model_for(&dir);
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let t = exp["tokens"].shape()[0];
    let tokens = exp["tokens"].reshape(&[1, t]).unwrap();
    let logits = model
        .forward(&params, &tokens, &positions(0, t), &ForwardOpts::default())
        .unwrap();
    let d = max_abs_diff(&logits.to_vec_f32(), &exp["logits"].to_vec_f32());
    assert!(d <= 1e-4, "max |logit difference| {d}");
}

#[test]
fn the_chat_fixture_renders_as_transformers_renders_it() {
    use anneal_data::chat::encode::ChatEncoder;
    use anneal_data::chat::template::ChatTemplate;
    let dir = fixture("tiny_qwen3_chat");
    let conversations = anneal_data::chat::read_conversations(&[dir.join("chat.jsonl")]).unwrap();
    let template = ChatTemplate::load(&dir).unwrap();
    let tokenizer = anneal_data::TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let encoder = ChatEncoder {
        template: &template,
        tokenizer: &tokenizer,
        vision: None,
    };
    let first = encoder.encode(&conversations[0]).unwrap();
    let exp = load_safetensors(dir.join("expected.safetensors")).unwrap();
    let want: Vec<u32> = exp["tokens"]
        .to_vec::<i64>()
        .iter()
        .map(|&t| t as u32)
        .collect();
    assert_eq!(first.tokens, want);
    // The loss is on the reply and its end-of-turn token, nothing before.
    let reply = first.trained.iter().position(|&t| t).unwrap();
    let text = tokenizer.decode(&first.tokens[reply..]).unwrap();
    assert!(text.starts_with("34 plus 58 is 92.<|im_end|>"), "{text:?}");
}

#[test]
fn packed_documents_compute_what_they_compute_alone() {
    let dir = fixture("tiny_qwen3_chat");
    let (model, params) = model_for(&dir);
    let docs = documents();
    let (ids, pos) = packed_row(&docs);
    let opts = ForwardOpts {
        training: true,
        packed: true,
        ..Default::default()
    };
    let packed_params = leaves(&params);
    let logits = model.forward(&packed_params, &ids, &pos, &opts).unwrap();
    let v = logits.shape()[2];
    let logits = logits.reshape(&[ROW, v]).unwrap();
    let mut start = 0;
    let mut packed_total: Option<Tensor> = None;
    let mut alone_grads: Vec<(String, Vec<f32>)> = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let n = doc.len();
        let mine = logits.narrow(0, start, n).unwrap();
        let packed_loss = doc_loss(&mine, doc);
        // The document alone, at positions 0..n, with its own gradients.
        let alone_params = leaves(&params);
        let alone_ids = Tensor::from_vec(doc.clone(), &[1, n]).unwrap();
        let alone = model
            .forward(&alone_params, &alone_ids, &positions(0, n), &opts)
            .unwrap()
            .reshape(&[n, v])
            .unwrap();
        let d = max_abs_diff(&mine.to_vec_f32(), &alone.to_vec_f32());
        assert!(d <= 1e-5, "document {i}: max |logit difference| {d}");
        let alone_loss = doc_loss(&alone, doc);
        let (p, a) = (packed_loss.item().unwrap(), alone_loss.item().unwrap());
        assert!(
            (p - a).abs() <= 1e-6,
            "document {i}: loss {p} packed, {a} alone"
        );
        alone_loss.backward().unwrap();
        for (name, t) in alone_params.iter() {
            let g = t.grad().map(|g| g.to_vec_f32()).unwrap_or_default();
            match alone_grads.iter_mut().find(|(n, _)| n == name) {
                Some((_, sum)) => sum.iter_mut().zip(&g).for_each(|(s, x)| *s += x),
                None => alone_grads.push((name.clone(), g)),
            }
        }
        packed_total = Some(match packed_total {
            Some(t) => t.add(&packed_loss).unwrap(),
            None => packed_loss,
        });
        start += n;
    }
    // The sum of the documents' losses: the same gradients packed as alone.
    packed_total.unwrap().backward().unwrap();
    for (name, want) in &alone_grads {
        let got = packed_params[name].grad().expect(name).to_vec_f32();
        let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let d = max_abs_diff(&got, want) / scale;
        assert!(d <= 1e-4, "{name}: relative gradient difference {d}");
    }
}

#[test]
fn a_document_does_not_see_its_neighbours() {
    let dir = fixture("tiny_qwen3_chat");
    let (model, params) = model_for(&dir);
    let mut docs = documents();
    let opts = ForwardOpts {
        packed: true,
        ..Default::default()
    };
    let run = |docs: &[Vec<i64>], pos_of: &dyn Fn(&Tensor) -> Tensor| {
        let (ids, pos) = packed_row(docs);
        model
            .forward(&params, &ids, &pos_of(&pos), &opts)
            .unwrap()
            .to_vec_f32()
    };
    let packed = |p: &Tensor| p.clone();
    let before = run(&docs, &packed);
    docs[0][3] = (docs[0][3] + 1) % 380;
    let after = run(&docs, &packed);
    let v = before.len() / ROW;
    let first = docs[0].len();
    // Document 0 changes from its token 3 on; documents 1, 2 and the padding do not.
    assert!(max_abs_diff(&before[3 * v..first * v], &after[3 * v..first * v]) > 1e-3);
    assert_eq!(before[first * v..], after[first * v..]);
    // Positions running through the row (no documents) let the change through: the test
    // above can fail.
    let through = |_: &Tensor| Tensor::from_vec((0..ROW as i64).collect(), &[1, ROW]).unwrap();
    let (a, b) = (run(&docs, &through), {
        docs[0][3] = (docs[0][3] + 379) % 380;
        run(&docs, &through)
    });
    assert!(max_abs_diff(&a[first * v..], &b[first * v..]) > 1e-4);
}

#[test]
fn layers_with_state_along_the_sequence_refuse_packed_rows() {
    let dir = fixture("tiny_qwen3_5");
    let (model, params) = model_for(&dir);
    let (ids, pos) = packed_row(&[vec![1, 2, 3, 4], vec![5, 6, 7]]);
    let opts = ForwardOpts {
        packed: true,
        ..Default::default()
    };
    let err = model
        .forward(&params, &ids, &pos, &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("data.pack = false"), "{err}");
}
