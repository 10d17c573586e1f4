//! Reading and writing tensors as safetensors files.

use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::{DType, Tensor};
use safetensors::tensor::{Dtype as StDtype, Metadata, TensorView};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

fn io_err(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Io {
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}

fn to_st(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::BF16 => StDtype::BF16,
        DType::F16 => StDtype::F16,
        DType::I32 => StDtype::I32,
        DType::I64 => StDtype::I64,
    }
}

fn from_st(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::I32 => DType::I32,
        StDtype::I64 => DType::I64,
        _ => return None,
    })
}

/// Checks a safetensors header (the JSON after the 8-byte length) against the `data_len`
/// bytes of tensor data after it, tensor by tensor, so that an error names the tensor as well
/// as `path`: a dtype, shape or `data_offsets` that is malformed, offsets outside the data,
/// a size that is not the shape's, tensors that overlap or leave gaps, data left over.
fn check_header(path: &Path, header: &[u8], data_len: u64) -> Result<Metadata> {
    use serde_json::Value;
    let map: serde_json::Map<String, Value> = serde_json::from_slice(header)
        .map_err(|e| io_err(path, format!("bad safetensors header: {e}")))?;
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    for (name, info) in &map {
        if name == "__metadata__" {
            continue;
        }
        let bad = |msg: String| io_err(path, format!("tensor `{name}`: {msg}"));
        let dtype_name = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no dtype (a string such as \"F32\")".into()))?;
        let dtype: StDtype = serde_json::from_value(Value::String(dtype_name.into()))
            .map_err(|_| bad(format!("unknown dtype \"{dtype_name}\"")))?;
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|dims| dims.iter().map(Value::as_u64).collect())
            .ok_or_else(|| bad("the shape is not a list of non-negative integers".into()))?;
        let offsets: Vec<u64> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|o| o.iter().map(Value::as_u64).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| bad("data_offsets is not a pair [start, end] of byte offsets".into()))?;
        let (start, end) = (offsets[0], offsets[1]);
        if start > end || end > data_len {
            return Err(bad(format!(
                "data_offsets [{start}, {end}] are outside the {data_len} bytes of tensor data"
            )));
        }
        let bytes = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.bitsize() as u64))
            .filter(|bits| bits % 8 == 0)
            .map(|bits| bits / 8)
            .ok_or_else(|| {
                bad(format!(
                    "shape {shape:?} of {dtype_name} is not a whole number of bytes"
                ))
            })?;
        if end - start != bytes {
            return Err(bad(format!(
                "shape {shape:?} of {dtype_name} needs {bytes} bytes, its data_offsets [{start}, {end}] hold {}",
                end - start
            )));
        }
        spans.push((start, end, name));
    }
    spans.sort_unstable();
    let mut at = 0;
    for (start, end, name) in spans {
        if start != at {
            let how = if start < at {
                "overlap"
            } else {
                "leave a gap after"
            };
            return Err(io_err(
                path,
                format!(
                    "tensor `{name}`: data_offsets [{start}, {end}] {how} the tensor bytes before \
                     them (which end at {at})"
                ),
            ));
        }
        at = end;
    }
    if at != data_len {
        return Err(io_err(
            path,
            format!(
                "the safetensors header describes {at} bytes of tensors, the file holds {data_len}"
            ),
        ));
    }
    // Checked above: the library's own parse agrees.
    serde_json::from_slice(header).map_err(|e| io_err(path, format!("bad safetensors header: {e}")))
}

/// Checks the header of safetensors `bytes` with [`check_header`].
fn check_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    let short = || io_err(path, "not a safetensors file (shorter than its header)");
    let len: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(short)?;
    let n = u64::from_le_bytes(len);
    let file_len = bytes.len() as u64;
    if n > MAX_HEADER || 8 + n > file_len {
        return Err(io_err(
            path,
            format!("safetensors header of {n} bytes does not fit the {file_len}-byte file"),
        ));
    }
    let header = &bytes[8..8 + n as usize];
    check_header(path, header, file_len - 8 - n).map(drop)
}

/// Parses safetensors bytes into named tensors (bad headers and unsupported dtypes are errors
/// naming `path`, and the tensor when one is at fault).
pub fn load_safetensors_bytes(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    check_bytes(path, bytes)?;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| io_err(path, e))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = from_st(view.dtype()).ok_or_else(|| {
            io_err(
                path,
                format!("tensor {name}: unsupported dtype {:?}", view.dtype()),
            )
        })?;
        let storage = Storage::from_bytes(dtype, view.data());
        out.insert(name, Tensor::from_storage(storage, view.shape())?);
    }
    Ok(out)
}

/// Reads every tensor of a safetensors file.
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<BTreeMap<String, Tensor>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    load_safetensors_bytes(path, &bytes)
}

/// Serializes named tensors to safetensors bytes.
pub fn safetensors_bytes(tensors: &[(&str, &Tensor)]) -> Result<Vec<u8>> {
    let owned: Vec<(String, DType, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| {
            let c = t.materialize(t.dtype());
            let bytes = c.storage().as_bytes().to_vec();
            (n.to_string(), t.dtype(), t.shape().to_vec(), bytes)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(to_st(*d), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| crate::error::invalid("save_safetensors", e.to_string()))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize(views, None)
        .map_err(|e| crate::error::invalid("save_safetensors", e.to_string()))
}

/// Writes named tensors to a safetensors file.
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let bytes = safetensors_bytes(tensors)?;
    std::fs::write(path, bytes).map_err(|e| io_err(path, e))
}

/// The largest safetensors header read (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// A safetensors file read one tensor at a time: the header when opened, each tensor's bytes
/// when asked for, so a reader that keeps a slice of every tensor (a tensor-parallel rank)
/// never holds the whole file.
pub struct SafetensorsFile {
    path: PathBuf,
    file: Mutex<File>,
    /// Where the tensors' bytes start (after the 8-byte length and the JSON header).
    data_start: u64,
    meta: Metadata,
}

impl SafetensorsFile {
    /// Opens `path` and reads its header; a header that does not describe the file (bad JSON,
    /// overlapping or short tensors, a length other than the file's) is an error naming it, and
    /// the tensor at fault.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref().to_path_buf();
        let mut file = File::open(&path).map_err(|e| io_err(&path, e))?;
        let file_len = file.metadata().map_err(|e| io_err(&path, e))?.len();
        let mut len = [0u8; 8];
        file.read_exact(&mut len)
            .map_err(|_| io_err(&path, "not a safetensors file (shorter than its header)"))?;
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER || 8 + n > file_len {
            return Err(io_err(
                &path,
                format!("safetensors header of {n} bytes does not fit the {file_len}-byte file"),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(|e| io_err(&path, e))?;
        let data_start = 8 + n;
        let meta = check_header(&path, &header, file_len - data_start)?;
        Ok(SafetensorsFile {
            path,
            file: Mutex::new(file),
            data_start,
            meta,
        })
    }

    /// The tensors' names, in the order of their bytes.
    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    /// The tensor called `name` (a fresh copy from the file), or `None` when it holds none.
    pub fn read(&self, name: &str) -> Result<Option<Tensor>> {
        let Some(info) = self.meta.info(name) else {
            return Ok(None);
        };
        let dtype = from_st(info.dtype).ok_or_else(|| {
            io_err(
                &self.path,
                format!("tensor {name}: unsupported dtype {:?}", info.dtype),
            )
        })?;
        let (start, end) = info.data_offsets;
        let mut bytes = vec![0u8; end - start];
        {
            let mut f = self
                .file
                .lock()
                .map_err(|_| io_err(&self.path, "a reader of this file panicked"))?;
            f.seek(SeekFrom::Start(self.data_start + start as u64))
                .and_then(|_| f.read_exact(&mut bytes))
                .map_err(|e| io_err(&self.path, format!("tensor {name}: {e}")))?;
        }
        let storage = Storage::from_bytes(dtype, &bytes);
        Tensor::from_storage(storage, &info.shape).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_all_dtypes_and_reject_garbage() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let t = a.transpose(0, 1).unwrap();
        let h = a.to_dtype(DType::BF16).unwrap();
        let i = Tensor::from_slice(&[7i64, -1], &[2]).unwrap();
        let bytes = safetensors_bytes(&[("t", &t), ("h", &h), ("i", &i)]).unwrap();
        let back = load_safetensors_bytes(Path::new("mem"), &bytes).unwrap();
        assert_eq!(back["t"].to_vec_f32(), t.to_vec_f32());
        assert_eq!(back["t"].shape(), &[3, 2]);
        assert_eq!(back["h"].dtype(), DType::BF16);
        assert_eq!(back["i"].to_vec::<i64>(), vec![7, -1]);
        let err = load_safetensors_bytes(Path::new("bad.safetensors"), b"garbage").unwrap_err();
        assert!(err.to_string().contains("bad.safetensors"));
    }

    #[test]
    fn a_file_reads_one_tensor_at_a_time_and_refuses_what_its_header_does_not_describe() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let h = a.to_dtype(DType::BF16).unwrap();
        let i = Tensor::from_slice(&[7i64, -1], &[2]).unwrap();
        let bytes = safetensors_bytes(&[("a", &a), ("h", &h), ("i", &i)]).unwrap();
        let dir = std::env::temp_dir().join(format!("anneal-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let f = SafetensorsFile::open(&path).unwrap();
        let mut names = f.names();
        names.sort();
        assert_eq!(names, ["a", "h", "i"]);
        let whole = load_safetensors_bytes(&path, &bytes).unwrap();
        for n in ["a", "h", "i"] {
            let t = f.read(n).unwrap().unwrap();
            assert_eq!(t.shape(), whole[n].shape());
            assert_eq!(t.dtype(), whole[n].dtype());
            assert_eq!(t.storage().as_bytes(), whole[n].storage().as_bytes(), "{n}");
        }
        assert!(f.read("missing").unwrap().is_none());
        // Cut short, padded, or a header length beyond the file: errors naming the file.
        for (what, b) in [
            ("cut", bytes[..bytes.len() - 4].to_vec()),
            ("padded", [&bytes[..], &[0u8; 4]].concat()),
            (
                "huge header",
                [&u64::MAX.to_le_bytes()[..], &bytes[8..]].concat(),
            ),
            ("tiny", vec![1, 2, 3]),
        ] {
            std::fs::write(&path, &b).unwrap();
            let err = SafetensorsFile::open(&path).err().expect(what).to_string();
            assert!(err.contains("t.safetensors"), "{what}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A safetensors file of `header` (JSON) and `data` bytes.
    fn with_header(header: &serde_json::Value, data: usize) -> Vec<u8> {
        let h = header.to_string().into_bytes();
        [&(h.len() as u64).to_le_bytes()[..], &h, &vec![0u8; data]].concat()
    }

    #[test]
    fn a_bad_header_names_the_tensor_and_the_file() {
        use serde_json::json;
        let ok = json!({
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
        });
        let path = Path::new("model.safetensors");
        assert_eq!(
            load_safetensors_bytes(path, &with_header(&ok, 32))
                .unwrap()
                .len(),
            2
        );
        let bad = |name: &str, field: &str, value: serde_json::Value| {
            let mut h = ok.clone();
            h[name][field] = value;
            h
        };
        for (header, data, tensor, words) in [
            (
                bad("b", "data_offsets", json!([24, 4000])),
                32,
                "b",
                "outside the 32 bytes",
            ),
            (
                bad("w", "dtype", json!("F99")),
                32,
                "w",
                "unknown dtype \"F99\"",
            ),
            (bad("w", "dtype", json!(3)), 32, "w", "no dtype"),
            (
                bad("w", "shape", json!([2, -3])),
                32,
                "w",
                "shape is not a list",
            ),
            (bad("w", "shape", json!([2, 4])), 32, "w", "needs 32 bytes"),
            (
                bad("b", "data_offsets", json!([20, 28])),
                32,
                "b",
                "overlap",
            ),
            (
                bad("b", "data_offsets", json!([28, 36])),
                36,
                "b",
                "leave a gap",
            ),
            (bad("w", "data_offsets", json!([0])), 32, "w", "not a pair"),
        ] {
            let bytes = with_header(&header, data);
            let err = load_safetensors_bytes(path, &bytes)
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("model.safetensors: ")
                    && err.contains(&format!("tensor `{tensor}`"))
                    && err.contains(words),
                "{header}: {err}"
            );
        }
        let err = load_safetensors_bytes(path, &with_header(&ok, 40))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("describes 32 bytes of tensors, the file holds 40"),
            "{err}"
        );
    }
}
