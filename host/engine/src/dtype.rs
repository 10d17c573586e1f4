//! Element types. Floating tensors compute in f32 on the CPU; bf16 and f16 are storage formats.

use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16: f32's exponent range with an 8-bit mantissa.
    BF16,
    /// IEEE half precision.
    F16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }

    /// True for f32, bf16 and f16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// The lower-case name used in configs and files (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// Parses a name as written by [`DType::name`].
    pub fn parse(name: &str) -> Option<DType> {
        Some(match name {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can be stored in a tensor.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// Converts to f32 (integers convert by value).
    fn to_f32(self) -> f32;
    /// Converts from f32 (round-to-nearest-even for half types, truncation toward zero for ints).
    fn from_f32(v: f32) -> Self;
    /// Converts to i64 (floats truncate toward zero).
    fn to_i64(self) -> i64;
    /// Converts from i64.
    fn from_i64(v: i64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_i64(self) -> i64 {
        self as i64
    }
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_i64(self) -> i64 {
        self.to_f32() as i64
    }
    fn from_i64(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_i64(self) -> i64 {
        self.to_f32() as i64
    }
    fn from_i64(v: i64) -> Self {
        f16::from_f32(v as f32)
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as i32
    }
    fn to_i64(self) -> i64 {
        self as i64
    }
    fn from_i64(v: i64) -> Self {
        v as i32
    }
}

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as i64
    }
    fn to_i64(self) -> i64 {
        self
    }
    fn from_i64(v: i64) -> Self {
        v
    }
}
