//! Finding corpus files and reading their documents.

use std::fs;
use std::path::{Path, PathBuf};

use anneal_data::{discover_files, read_documents, DataError};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(&p, text).unwrap();
    p
}

#[test]
fn folders_are_walked_recursively_in_path_order_keeping_known_extensions() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "b.txt", "b");
    write(d, "a/z.md", "z");
    write(d, "a/c.jsonl", "{\"text\": \"c\"}");
    write(d, "a/deeper/y.TXT", "y");
    write(d, "notes.bin", "x");
    write(d, "a/readme", "x");
    let files = discover_files(d).unwrap();
    let rel: Vec<_> = files
        .iter()
        .map(|f| f.strip_prefix(d).unwrap().to_str().unwrap().to_owned())
        .collect();
    assert_eq!(rel, ["a/c.jsonl", "a/deeper/y.TXT", "a/z.md", "b.txt"]);
}

#[test]
fn a_single_file_is_its_own_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "one.jsonl", "{\"text\": \"x\"}");
    assert_eq!(discover_files(&f).unwrap(), [f]);
    let bin = write(dir.path(), "data.bin", "x");
    let err = discover_files(&bin).unwrap_err();
    assert!(matches!(err, DataError::UnsupportedFile { .. }), "{err}");
    assert!(err.to_string().contains("data.bin"), "{err}");
}

#[test]
fn empty_or_missing_paths_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "sub/skip.csv", "a,b");
    let err = discover_files(dir.path()).unwrap_err();
    assert!(matches!(err, DataError::Empty { .. }), "{err}");
    let err = discover_files(&dir.path().join("missing")).unwrap_err();
    assert!(matches!(err, DataError::Io { .. }), "{err}");
    assert!(err.to_string().contains("missing"), "{err}");
}

#[test]
fn text_files_are_one_document_and_jsonl_lines_are_one_each() {
    let dir = tempfile::tempdir().unwrap();
    let files = vec![
        write(dir.path(), "a.txt", "line one\nline two\n"),
        write(
            dir.path(),
            "b.jsonl",
            "{\"text\": \"first\", \"id\": 1}\n\n  \n{\"text\": \"sec\\nond\"}\n{\"text\": \"\"}\n",
        ),
        write(dir.path(), "c.md", "# Title\n"),
    ];
    let docs = read_documents(&files, "text").unwrap();
    assert_eq!(
        docs,
        ["line one\nline two\n", "first", "sec\nond", "# Title\n"]
    );
}

#[test]
fn the_text_field_is_configurable() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "d.jsonl", "{\"content\": \"x\", \"text\": 3}\n");
    assert_eq!(read_documents(&[f], "content").unwrap(), ["x"]);
}

#[test]
fn a_bad_jsonl_line_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "bad.jsonl",
        "{\"text\": \"ok\"}\n{\"text\": oops}\n",
    );
    let err = read_documents(&[f], "text").unwrap_err();
    assert!(
        matches!(err, DataError::BadJsonLine { line: 2, .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("bad.jsonl:2:") && msg.contains("not valid JSON"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "one line: {msg}");

    let f = write(dir.path(), "arr.jsonl", "[1, 2]\n");
    let err = read_documents(&[f], "text").unwrap_err();
    assert!(
        err.to_string().contains("arr.jsonl:1: not a JSON object"),
        "{err}"
    );
}

#[test]
fn a_missing_or_non_string_field_names_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "m.jsonl",
        "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"body\": \"c\"}\n",
    );
    let err = read_documents(&[f], "text").unwrap_err();
    assert!(
        err.to_string()
            .contains("m.jsonl:3: missing field \"text\""),
        "{err}"
    );

    let f = write(dir.path(), "n.jsonl", "{\"text\": 12}\n");
    let err = read_documents(&[f], "text").unwrap_err();
    assert!(
        err.to_string()
            .contains("n.jsonl:1: field \"text\" is not a string"),
        "{err}"
    );
}

#[test]
fn a_corpus_without_text_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let files = vec![
        write(dir.path(), "e.txt", ""),
        write(dir.path(), "e.jsonl", "\n"),
    ];
    let err = read_documents(&files, "text").unwrap_err();
    assert!(matches!(err, DataError::Empty { .. }), "{err}");
}
