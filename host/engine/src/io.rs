//! Reading and writing tensors as safetensors files.

use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::{DType, Tensor};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;

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

/// Parses safetensors bytes into named tensors (bad headers and unsupported dtypes are errors
/// naming `path`).
pub fn load_safetensors_bytes(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
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
}
