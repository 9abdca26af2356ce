//! Errors from loading, converting and running models.

use std::path::PathBuf;

/// Everything that can go wrong between a path on disk and a forward pass.
/// Messages name the file, tensor or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model path does not exist or lacks a required file.
    #[error("model file not found: {0}")]
    MissingFile(PathBuf),
    /// The file exists but cannot be parsed (truncated, wrong format, bad JSON).
    #[error("invalid model file {path}: {reason}")]
    InvalidFile {
        /// The offending file.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// The checkpoint's architecture is not implemented.
    #[error(
        "unsupported architecture `{arch}` in {path} (supported: {})",
        super::config::SUPPORTED_MODEL_TYPES.join(", ")
    )]
    UnsupportedArchitecture {
        /// The file declaring it.
        path: PathBuf,
        /// The architecture it declares.
        arch: String,
    },
    /// A tensor the architecture needs is absent or has the wrong shape.
    #[error("tensor `{name}`: {reason}")]
    Tensor {
        /// Tensor name (Hugging Face / MLX naming).
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    Template(String),
    /// An input token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    /// A LoRA adapter failed to load or apply.
    #[error(transparent)]
    Lora(#[from] super::lora::LoraError),
    /// Tensor parallelism failed: a shard that cannot be cut, or a rank
    /// that is gone.
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistributedError),
    /// Filesystem error on a named path.
    #[error("{path}: {source}")]
    Io {
        /// The path being read or written.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl ModelError {
    /// Shorthand for [`ModelError::InvalidFile`].
    pub fn invalid(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        ModelError::InvalidFile {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}

/// Result alias for this module.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
