//! Parquet files and datasets saved by Hugging Face `datasets` read as the same records as the
//! JSON lines they were written from (fixtures: tests/reference/make_columnar_fixtures.py):
//! documents and conversations alike, and a saved dataset lists its files (a DatasetDict its
//! train split).

use anneal_data::chat::read_conversations;
use anneal_data::records::{hf_dataset_files, is_hf_dataset, read_records};
use anneal_data::{discover_files, read_documents};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/columnar")
        .join(name)
}

#[test]
fn every_container_holds_the_same_records() {
    for what in ["docs", "chat"] {
        let want: Vec<_> = read_records(&fixture(&format!("{what}.jsonl")))
            .unwrap()
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        assert!(want.len() >= 48, "{what}");
        let hf = discover_files(&fixture(&format!("{what}_hf"))).unwrap();
        let parquet = vec![fixture(&format!("{what}.parquet"))];
        for files in [parquet, hf] {
            assert_eq!(files.len(), 1);
            let got: Vec<_> = read_records(&files[0])
                .unwrap()
                .into_iter()
                .map(|(_, v)| v)
                .collect();
            assert_eq!(got, want, "{}", files[0].display());
        }
    }
    let docs = read_documents(&[fixture("docs.parquet")], "text").unwrap();
    assert_eq!(
        docs,
        read_documents(&[fixture("docs.jsonl")], "text").unwrap()
    );
    let err = read_documents(&[fixture("docs.parquet")], "body").unwrap_err();
    assert!(
        err.to_string()
            .contains("docs.parquet:1: missing field \"body\""),
        "{err}"
    );
    let a = read_conversations(&[fixture("chat.parquet")]).unwrap();
    let b = read_conversations(&[fixture("chat.jsonl")]).unwrap();
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(a, b)| a.messages == b.messages));
    assert!(anneal_data::chat::looks_like_chat(&[fixture(
        "chat.parquet"
    )]));
    assert!(!anneal_data::chat::looks_like_chat(&[fixture(
        "docs.parquet"
    )]));
}

#[test]
fn a_saved_dataset_dict_trains_on_its_train_split() {
    let dict = fixture("chat_hf");
    assert!(is_hf_dataset(&dict) && is_hf_dataset(&fixture("docs_hf")));
    assert!(!is_hf_dataset(&fixture("")));
    let files = hf_dataset_files(&dict).unwrap();
    assert_eq!(files, [dict.join("train/data-00000-of-00001.arrow")]);
}
