//! The engine's error type: every user mistake becomes one of these, naming the op and the shapes.

/// Errors returned by tensor operations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two operands whose shapes do not fit together.
    #[error("{op}: shape mismatch between {lhs:?} and {rhs:?}")]
    ShapeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// Shape of the first operand.
        lhs: Vec<usize>,
        /// Shape of the second operand.
        rhs: Vec<usize>,
    },
    /// A dimension index outside the tensor's rank.
    #[error("{op}: dim {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The dimension asked for (possibly negative).
        dim: isize,
        /// The rank of the tensor.
        rank: usize,
    },
    /// An index (into a dimension, a vocabulary, a table) out of range.
    #[error("{op}: index {index} out of range for size {size}")]
    IndexOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The offending index.
        index: i64,
        /// The size it must be below.
        size: usize,
    },
    /// A dtype the operation does not accept.
    #[error("{op}: unsupported dtype {got} (expected {expected})")]
    DType {
        /// The operation that failed.
        op: &'static str,
        /// The dtype received.
        got: crate::DType,
        /// What the op accepts.
        expected: &'static str,
    },
    /// The requested device cannot be used on this machine.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: crate::Device,
        /// Why it cannot be used.
        reason: String,
    },
    /// Any other invalid argument, with the op's explanation.
    #[error("{op}: {msg}")]
    Invalid {
        /// The operation that failed.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// A model or optimizer plugin refused what it was given (an argument, a shape or a setting
    /// it does not support): the user's input must change.
    #[error("{plugin}: {msg}")]
    PluginRefused {
        /// The plugin.
        plugin: String,
        /// Where and what it refused.
        msg: String,
    },
    /// A plugin failed by itself (a panic, a broken invariant of its own): a bug in the plugin,
    /// not the user's input.
    #[error("{plugin}: failed inside the plugin (a bug in it, not in your input): {msg}")]
    PluginBug {
        /// The plugin.
        plugin: String,
        /// Where and what failed.
        msg: String,
    },
    /// Reading or writing a tensor file failed.
    #[error("{path}: {msg}")]
    Io {
        /// The file involved.
        path: String,
        /// What went wrong.
        msg: String,
    },
}

/// Result alias used throughout the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand for an [`Error::Invalid`].
pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        op,
        msg: msg.into(),
    }
}
