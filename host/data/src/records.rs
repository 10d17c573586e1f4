//! Records of data files as JSON objects, whatever holds them: JSON lines (`.jsonl`), Parquet
//! (`.parquet`) and Arrow IPC files (`.arrow`, as a dataset saved by Hugging Face `datasets`
//! holds them), so a text field or a chat `messages` list reads the same from each. Columnar
//! rows become JSON objects through `arrow-json` (nested lists and structs included; null
//! fields left out).

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{DataError, Result};

/// A file that holds records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecordFile {
    /// JSON lines: a record per non-blank line.
    JsonLines,
    /// Parquet: a record per row.
    Parquet,
    /// Arrow IPC, stream or file format: a record per row.
    Arrow,
}

/// What kind of record file `path` is, by extension.
pub(crate) fn record_file(path: &Path) -> Option<RecordFile> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "jsonl" => Some(RecordFile::JsonLines),
        "parquet" => Some(RecordFile::Parquet),
        "arrow" => Some(RecordFile::Arrow),
        _ => None,
    }
}

/// Every record of `path` with its 1-based number (its line in a JSON lines file, blank lines
/// skipped; its row in a columnar file), in order. A line that is not JSON is an error naming
/// it; the records need not be objects (the caller says what it wants of them).
pub fn read_records(path: &Path) -> Result<Vec<(usize, Value)>> {
    match record_file(path) {
        Some(RecordFile::JsonLines) => {
            let text = fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
            let mut out = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v = serde_json::from_str(line).map_err(|e| DataError::BadJsonLine {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message: format!("not valid JSON ({e})"),
                })?;
                out.push((i + 1, v));
            }
            Ok(out)
        }
        Some(kind) => columnar_rows(path, kind, usize::MAX),
        None => Err(DataError::UnsupportedFile {
            path: path.to_path_buf(),
        }),
    }
}

/// The first row of a columnar file (for checks that must not read it whole).
pub(crate) fn first_row(path: &Path) -> Result<Option<(usize, Value)>> {
    let kind = record_file(path).ok_or_else(|| DataError::UnsupportedFile {
        path: path.to_path_buf(),
    })?;
    Ok(columnar_rows(path, kind, 1)?.into_iter().next())
}

/// Up to `limit` rows of a Parquet or Arrow file as JSON objects.
fn columnar_rows(path: &Path, kind: RecordFile, limit: usize) -> Result<Vec<(usize, Value)>> {
    use arrow_array::RecordBatch;
    let bad = |e: &dyn std::fmt::Display| DataError::BadRecordFile {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let batches: Box<dyn Iterator<Item = std::result::Result<RecordBatch, _>>> = match kind {
        RecordFile::Parquet => {
            use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
            let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                .map_err(|e| bad(&e))?
                .with_batch_size(limit.clamp(1, 1024))
                .build()
                .map_err(|e| bad(&e))?;
            Box::new(reader)
        }
        _ => {
            // The stream format (what `datasets` writes) starts with a continuation marker;
            // the file format with `ARROW1`.
            let mut magic = [0u8; 6];
            use std::io::{Read, Seek};
            let mut f = file;
            let n = f.read(&mut magic).map_err(|e| DataError::io(path, e))?;
            f.rewind().map_err(|e| DataError::io(path, e))?;
            if n == 6 && &magic == b"ARROW1" {
                let r = arrow_ipc::reader::FileReader::try_new(f, None).map_err(|e| bad(&e))?;
                Box::new(r)
            } else {
                let r = arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::new(f), None)
                    .map_err(|e| bad(&e))?;
                Box::new(r)
            }
        }
    };
    let mut out = Vec::new();
    for batch in batches {
        let batch = batch.map_err(|e| bad(&e))?;
        let mut w = arrow_json::LineDelimitedWriter::new(Vec::new());
        w.write(&batch).map_err(|e| bad(&e))?;
        w.finish().map_err(|e| bad(&e))?;
        let bytes = w.into_inner();
        for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            if out.len() == limit {
                return Ok(out);
            }
            let v: Value = serde_json::from_slice(line).map_err(|e| bad(&e))?;
            out.push((out.len() + 1, v));
        }
    }
    Ok(out)
}

/// Whether `dir` is a dataset saved by Hugging Face `datasets` (`save_to_disk`): a
/// `dataset_info.json` and `state.json`, or a `DatasetDict`'s `dataset_dict.json`.
pub fn is_hf_dataset(dir: &Path) -> bool {
    dir.join("dataset_dict.json").is_file()
        || (dir.join("state.json").is_file() && dir.join("dataset_info.json").is_file())
}

/// The Arrow files of the dataset saved at `dir`, in order (`state.json`'s `_data_files`); of
/// a `DatasetDict`, those of its `train` split.
pub fn hf_dataset_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let read = |p: &Path| -> Result<Value> {
        let text = fs::read_to_string(p).map_err(|e| DataError::io(p, e))?;
        serde_json::from_str(&text).map_err(|e| DataError::BadRecordFile {
            path: p.to_path_buf(),
            message: format!("not valid JSON ({e})"),
        })
    };
    let dict = dir.join("dataset_dict.json");
    if dict.is_file() {
        let splits = read(&dict)?;
        let names: Vec<&str> = splits["splits"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !names.contains(&"train") {
            return Err(DataError::BadRecordFile {
                path: dict,
                message: format!(
                    "no `train` split to train on (splits: {})",
                    names.join(", ")
                ),
            });
        }
        return hf_dataset_files(&dir.join("train"));
    }
    let state = dir.join("state.json");
    let files: Vec<PathBuf> = read(&state)?["_data_files"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f["filename"].as_str())
                .map(|f| dir.join(f))
                .collect()
        })
        .unwrap_or_default();
    if files.is_empty() {
        return Err(DataError::BadRecordFile {
            path: state,
            message: "lists no data files (`_data_files`)".into(),
        });
    }
    Ok(files)
}
