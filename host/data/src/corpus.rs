//! Documents from local files: plain text (`.txt`, `.md`, one document per file), and records
//! (JSON lines, Parquet, Arrow; [`crate::records`]) with the text in a named string field: a
//! document per line or row. A folder saved by Hugging Face `datasets` is its Arrow files.

use std::fs;
use std::path::{Path, PathBuf};

use crate::records::{first_row, read_records, record_file, RecordFile};
use crate::{DataError, Result};

/// File extensions read as documents.
const EXTENSIONS: [&str; 5] = ["txt", "md", "jsonl", "parquet", "arrow"];

/// What a file holds, by extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Text,
    Records(RecordFile),
}

pub(crate) fn kind(path: &Path) -> Option<Kind> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "txt" | "md" => Some(Kind::Text),
        _ => record_file(path).map(Kind::Records),
    }
}

/// The corpus files under `path`: the file itself when it is a `.txt`, `.md` or `.jsonl` file, or
/// every such file below the folder `path` (recursively, other files ignored), sorted by path so
/// the order does not depend on the file system. An empty result is an error.
pub fn discover_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = fs::metadata(path).map_err(|e| DataError::io(path, e))?;
    if meta.is_dir() && crate::records::is_hf_dataset(path) {
        return crate::records::hf_dataset_files(path);
    }
    if !meta.is_dir() {
        return match kind(path) {
            Some(_) => Ok(vec![path.to_path_buf()]),
            None => Err(DataError::UnsupportedFile {
                path: path.to_path_buf(),
            }),
        };
    }
    let mut files = Vec::new();
    let mut dirs = vec![path.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).map_err(|e| DataError::io(&dir, e))? {
            let entry = entry.map_err(|e| DataError::io(&dir, e))?;
            let p = entry.path();
            // Follows symlinks, as a user pointing at a folder of linked files expects.
            let meta = fs::metadata(&p).map_err(|e| DataError::io(&p, e))?;
            if meta.is_dir() {
                dirs.push(p);
            } else if kind(&p).is_some() {
                files.push(p);
            }
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
            what: format!("no .{} files in this folder", EXTENSIONS.join(", .")),
        });
    }
    Ok(files)
}

/// Reads the documents of `files` in order: a text file is one document; each record (a
/// non-blank line of a JSONL file, a row of a Parquet or Arrow file) is one document, the string
/// in its field `text_field`. A record that is not a JSON object, or lacks the field, or whose
/// field is not a string, is an error naming `file:line` (or row).
/// Empty documents are skipped; no documents at all is an error.
pub fn read_documents(files: &[PathBuf], text_field: &str) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for f in files {
        match kind(f) {
            Some(Kind::Text) => docs.push(fs::read_to_string(f).map_err(|e| DataError::io(f, e))?),
            Some(Kind::Records(_)) => {
                for (number, record) in read_records(f)? {
                    docs.push(record_text(f, number, &record, text_field)?);
                }
            }
            None => return Err(DataError::UnsupportedFile { path: f.clone() }),
        }
    }
    docs.retain(|d| !d.is_empty());
    if docs.is_empty() {
        let path = files.first().cloned().unwrap_or_default();
        return Err(DataError::Empty {
            path,
            what: "no non-empty documents in the corpus".into(),
        });
    }
    Ok(docs)
}

/// The document of line `number` of a JSONL file: the string in its field `field`.
pub(crate) fn jsonl_text(path: &Path, number: usize, line: &str, field: &str) -> Result<String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| DataError::BadJsonLine {
            path: path.to_path_buf(),
            line: number,
            message: format!("not valid JSON ({e})"),
        })?;
    record_text(path, number, &value, field)
}

/// The document of record `number` of a file: the string in its field `field`.
pub(crate) fn record_text(
    path: &Path,
    number: usize,
    value: &serde_json::Value,
    field: &str,
) -> Result<String> {
    let bad = |message: String| DataError::BadJsonLine {
        path: path.to_path_buf(),
        line: number,
        message,
    };
    let obj = value
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    let text = obj
        .get(field)
        .ok_or_else(|| bad(format!("missing field \"{field}\"")))?;
    let text = text
        .as_str()
        .ok_or_else(|| bad(format!("field \"{field}\" is not a string")))?;
    Ok(text.to_owned())
}

/// The cheap part of [`read_documents`]' checks, for a validation before a run: every file
/// opens for reading, and a JSONL file's first document is a JSON object with the string field
/// `text_field` (a mistyped field shows there). Reads at most a line per file, so a later bad
/// line or a file that is not UTF-8 further on still fails when the corpus is read.
pub fn check_files(files: &[PathBuf], text_field: &str) -> Result<()> {
    use std::io::{BufRead, Read};
    for f in files {
        let file = fs::File::open(f).map_err(|e| DataError::io(f, e))?;
        match kind(f) {
            Some(Kind::Records(RecordFile::JsonLines)) => {}
            Some(Kind::Records(_)) => {
                if let Some((number, row)) = first_row(f)? {
                    record_text(f, number, &row, text_field)?;
                }
                continue;
            }
            _ => continue,
        }
        // The first non-blank line, read up to a bound (a JSONL file may be one huge line).
        let mut reader = std::io::BufReader::new(file).take(MAX_FIRST_LINE);
        let mut line = String::new();
        for number in 1.. {
            line.clear();
            let read = reader
                .read_line(&mut line)
                .map_err(|e| DataError::io(f, e))?;
            if read == 0 {
                break;
            }
            if !line.trim().is_empty() {
                // A line cut at the bound is not judged; one that ends the file is whole.
                if line.ends_with('\n') || reader.limit() > 0 {
                    jsonl_text(f, number, line.trim_end(), text_field)?;
                }
                break;
            }
        }
    }
    Ok(())
}

/// How much of a JSONL file [`check_files`] reads looking for its first document.
const MAX_FIRST_LINE: u64 = 1 << 20;
