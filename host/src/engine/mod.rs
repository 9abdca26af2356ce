//! The engine: the decode loop, incremental detokenization and stop strings.
//! (Continuous batching and admission come with the scheduler work; the
//! model step already takes a ragged batch of rows.)

pub mod detokenize;
pub mod generate;

pub use crate::plugin::session::TokenChain;
pub use generate::{
    effective_params, generate, generate_with, FinishReason, GenerateError, GenerateEvent,
    GenerateRequest, GenerateSummary,
};
