//! Preference pairs: read as TRL writes them, each side a row whose trained tokens are its
//! completion's, text or conversational; bad records named by file, line and key.

use anneal_data::chat::encode::ChatEncoder;
use anneal_data::chat::template::{ChatTemplate, CHATML, CHATML_SPECIALS};
use anneal_data::preference::{encode_pairs, looks_like_pairs, read_pairs};
use anneal_data::TextTokenizer;

fn write(dir: &std::path::Path, lines: &[serde_json::Value]) -> Vec<std::path::PathBuf> {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let path = dir.join("pairs.jsonl");
    std::fs::write(&path, text).unwrap();
    vec![path]
}

/// The text of `row`'s trained tokens.
fn trained_text(tok: &TextTokenizer, row: &anneal_data::chat::encode::EncodedChat) -> String {
    let ids: Vec<u32> = row
        .tokens
        .iter()
        .zip(&row.trained)
        .filter(|(_, &t)| t)
        .map(|(&id, _)| id)
        .collect();
    tok.decode(&ids).unwrap()
}

#[test]
fn text_and_conversational_pairs_train_on_their_completions() {
    let dir = tempfile::tempdir().unwrap();
    let files = write(
        dir.path(),
        &[
            serde_json::json!({"prompt": "Is snow white?", "chosen": " Yes.", "rejected": " No."}),
            serde_json::json!({
                "prompt": [
                    {"role": "user", "content": "Is snow white?"},
                    {"role": "assistant", "content": "Yes."},
                    {"role": "user", "content": "And coal?"},
                ],
                "chosen": [{"role": "assistant", "content": "Coal is black."}],
                "rejected": "Coal is white.",
            }),
        ],
    );
    assert!(looks_like_pairs(&files));
    let pairs = read_pairs(&files).unwrap();
    let texts = anneal_data::preference::texts(&pairs);
    let tok = TextTokenizer::train_bpe_with_specials(&texts, 400, &CHATML_SPECIALS).unwrap();
    let template = ChatTemplate::new(Some(CHATML.into()), None, Some("<|im_end|>".into())).unwrap();
    let encoder = ChatEncoder {
        template: &template,
        tokenizer: &tok,
        vision: None,
    };
    let rows = encode_pairs(&pairs, &tok, &encoder).unwrap();
    assert_eq!(rows.len(), 4);
    // Text: the completion and EOS, after the prompt's untrained tokens.
    assert_eq!(trained_text(&tok, &rows[0]), " Yes.<|endoftext|>");
    assert_eq!(trained_text(&tok, &rows[1]), " No.<|endoftext|>");
    assert!(!rows[0].trained[0]);
    // Conversational: from where the sides part ("black" / "white"), to the end of the turn;
    // the prompt's earlier assistant turn trains on neither side.
    let (c, r) = (trained_text(&tok, &rows[2]), trained_text(&tok, &rows[3]));
    assert!(c.starts_with("black.") || c.starts_with(" black."), "{c:?}");
    assert!(r.starts_with("white.") || r.starts_with(" white."), "{r:?}");
    assert!(c.contains("<|im_end|>") && !c.contains("Yes"), "{c:?}");
}

#[test]
fn a_record_without_a_side_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let files = write(
        dir.path(),
        &[
            serde_json::json!({"prompt": "a", "chosen": "b", "rejected": "c"}),
            serde_json::json!({"prompt": "a", "chosen": "b"}),
        ],
    );
    let e = read_pairs(&files).unwrap_err().to_string();
    assert!(
        e.contains("pairs.jsonl:2") && e.contains("`rejected`"),
        "{e}"
    );
    let plain = write(dir.path(), &[serde_json::json!({"text": "not a pair"})]);
    assert!(!looks_like_pairs(&plain));
}
