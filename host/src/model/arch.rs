//! The interface the engine, both cache tiers, scoring and the benchmarks
//! run a model through, so none of them names an architecture.

use mlx_rs::{Array, Dtype};

use super::config::ModelConfig;
use super::error::Result;
use super::llama::RowInput;
use crate::cache::{KvCache, KvShape};

/// A decoder-only language model over a ragged batch of rows.
pub trait CausalLm {
    /// Hyper-parameters (vocabulary size, context length, KV geometry).
    fn config(&self) -> &ModelConfig;

    /// Runs each row's new tokens (a prompt chunk or one decode token)
    /// through the model, extending the row's cache, and returns per row
    /// the logits `[n, V]` (float32, lazy) for positions
    /// `logits_from..tokens.len()`.
    ///
    /// Errors: a token id `>= vocab_size`; MLX errors.
    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>>;

    /// As [`CausalLm::forward`] for rows that each feed one token whose ids
    /// are on the device: `ids: [R]` uint32 (lazy, in row order, each below
    /// `vocab_size`: the caller clamps), used instead of the rows' `tokens`
    /// (which must each have length 1; their values are ignored). This lets
    /// a decode step be built before the previous step's tokens are read.
    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>>;

    /// A fresh KV cache for one row.
    fn new_cache(&self) -> KvCache;

    /// Each cache layer's key/value geometry (one entry per layer of
    /// [`CausalLm::new_cache`]): the config's `num_key_value_heads` and
    /// head dimension everywhere, unless the architecture says otherwise
    /// (Gemma 4's full layers).
    fn kv_shapes(&self) -> Vec<KvShape> {
        let c = self.config();
        let shape = KvShape {
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
        };
        vec![shape; self.new_cache().kinds().len()]
    }

    /// Dtype of activations and of the KV cache.
    fn dtype(&self) -> Dtype;

    /// Whether a forward whose rows each feed one token runs a faster path
    /// than a mixed one (Llama's fused CPU decode op). The engine then
    /// runs a step's speculative verifications (rows feeding a token and
    /// its drafts) as a forward of their own beside the one-token rows',
    /// instead of taking every row off the fast path.
    fn fast_one_token_path(&self) -> bool {
        false
    }

    /// Every parameter array (evaluated after load; byte counts).
    fn parameters(&self) -> Vec<&Array>;

    /// Bytes of parameter storage.
    fn nbytes(&self) -> usize {
        self.parameters().iter().map(|a| a.nbytes()).sum()
    }

    /// The products LoRA adapters may adapt, with their shapes; `None`
    /// when the architecture runs no adapters (rows never carry one then:
    /// adapters are refused when they load).
    fn lora_targets(&self) -> Option<super::lora::LoraTargets> {
        None
    }

    /// Merges `adapter` into the weights (`--lora-merge`).
    ///
    /// Errors: the architecture runs no adapters; MLX errors.
    fn merge_lora(&mut self, adapter: &super::lora::LoraAdapter) -> Result<()> {
        Err(super::lora::LoraError::Unsupported(format!(
            "adapter `{}` cannot be merged into this architecture",
            adapter.name
        ))
        .into())
    }

    /// Makes this model one rank of a tensor-parallel group: its weights
    /// are already that rank's shard ([`crate::distributed::shard`]).
    ///
    /// Errors: the architecture has no tensor-parallel forward.
    fn set_tensor_parallel(
        &mut self,
        group: std::sync::Arc<crate::distributed::Group>,
    ) -> Result<()> {
        let _ = group;
        Err(crate::distributed::DistributedError::Shard(format!(
            "--tensor-parallel: architecture `{}` has no tensor-parallel forward",
            self.config().model_type
        ))
        .into())
    }
}

impl CausalLm for super::Llama {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        super::Llama::forward_ids(self, rows, None)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        super::Llama::forward_ids(self, rows, Some(ids))
    }

    fn new_cache(&self) -> KvCache {
        super::Llama::new_cache(self)
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn fast_one_token_path(&self) -> bool {
        self.fused_decode.is_some()
    }

    fn parameters(&self) -> Vec<&Array> {
        super::Llama::parameters(self)
    }

    fn lora_targets(&self) -> Option<super::lora::LoraTargets> {
        // A shard's products are partial: adapters are not split with them.
        self.tp.is_none().then(|| super::Llama::lora_targets(self))
    }

    fn set_tensor_parallel(
        &mut self,
        group: std::sync::Arc<crate::distributed::Group>,
    ) -> Result<()> {
        self.tp = Some(group);
        self.fused_decode = None;
        Ok(())
    }

    fn merge_lora(&mut self, adapter: &super::lora::LoraAdapter) -> Result<()> {
        super::lora::merge::merge(self, adapter)
    }
}

impl CausalLm for super::gemma3::Gemma3 {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        super::gemma3::Gemma3::forward_ids(self, rows, None)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        super::gemma3::Gemma3::forward_ids(self, rows, Some(ids))
    }

    fn new_cache(&self) -> KvCache {
        super::gemma3::Gemma3::new_cache(self)
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn parameters(&self) -> Vec<&Array> {
        super::gemma3::Gemma3::parameters(self)
    }
}

impl CausalLm for super::gemma4::Gemma4 {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        super::gemma4::Gemma4::forward_ids(self, rows, None)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        super::gemma4::Gemma4::forward_ids(self, rows, Some(ids))
    }

    fn new_cache(&self) -> KvCache {
        super::gemma4::Gemma4::new_cache(self)
    }

    fn kv_shapes(&self) -> Vec<KvShape> {
        super::gemma4::Gemma4::kv_shapes(self)
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn parameters(&self) -> Vec<&Array> {
        super::gemma4::Gemma4::parameters(self)
    }
}

impl CausalLm for super::gpt_oss::GptOss {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        super::gpt_oss::GptOss::forward_ids(self, rows, None)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        super::gpt_oss::GptOss::forward_ids(self, rows, Some(ids))
    }

    fn new_cache(&self) -> KvCache {
        super::gpt_oss::GptOss::new_cache(self)
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn parameters(&self) -> Vec<&Array> {
        super::gpt_oss::GptOss::parameters(self)
    }
}

impl CausalLm for super::qwen3_5::Qwen35 {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        super::qwen3_5::Qwen35::forward_ids(self, rows, None)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        super::qwen3_5::Qwen35::forward_ids(self, rows, Some(ids))
    }

    fn new_cache(&self) -> KvCache {
        super::qwen3_5::Qwen35::new_cache(self)
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn parameters(&self) -> Vec<&Array> {
        super::qwen3_5::Qwen35::parameters(self)
    }
}
