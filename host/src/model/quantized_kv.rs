//! A model whose rows keep quantized KV (`--kv-bits`, [`crate::cache::quant`]):
//! the model itself, with [`CausalLm::new_cache`] handing out caches whose
//! full-attention layers store packed rows. Every other call goes to the
//! model unchanged; the attention paths choose their quantized form from
//! the cache they are given (`model::ragged`, `model::decode_attention`).
//!
//! Applied last, after everything that configures the model itself
//! (`--lora-merge` and tensor parallelism pass through to the model).

use mlx_rs::{Array, Dtype};

use super::arch::CausalLm;
use super::config::ModelConfig;
use super::error::Result;
use super::llama::RowInput;
use super::LoadedModel;
use crate::cache::{KvCache, KvQuant, KvQuantError, KvShape, LayerKind};

/// `inner` with quantized KV caches.
pub struct QuantizedKv {
    inner: Box<dyn CausalLm>,
    quant: KvQuant,
}

impl CausalLm for QuantizedKv {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn forward(&self, rows: &mut [RowInput<'_>]) -> Result<Vec<Array>> {
        self.inner.forward(rows)
    }

    fn forward_device_ids(&self, rows: &mut [RowInput<'_>], ids: &Array) -> Result<Vec<Array>> {
        self.inner.forward_device_ids(rows, ids)
    }

    fn new_cache(&self) -> KvCache {
        self.inner.new_cache().with_quant(Some(self.quant))
    }

    fn kv_shapes(&self) -> Vec<KvShape> {
        self.inner.kv_shapes()
    }

    fn dtype(&self) -> Dtype {
        self.inner.dtype()
    }

    fn fast_one_token_path(&self) -> bool {
        // The fused decode op reads quantized caches too.
        self.inner.fast_one_token_path()
    }

    fn parameters(&self) -> Vec<&Array> {
        self.inner.parameters()
    }

    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    fn lora_targets(&self) -> Option<super::lora::LoraTargets> {
        self.inner.lora_targets()
    }

    fn merge_lora(&mut self, adapter: &super::lora::LoraAdapter) -> Result<()> {
        self.inner.merge_lora(adapter)
    }

    fn set_tensor_parallel(
        &mut self,
        group: std::sync::Arc<crate::distributed::Group>,
    ) -> Result<()> {
        self.inner.set_tensor_parallel(group)
    }
}

/// `model` with its rows' full-attention layers quantized by `quant`
/// (`None`: unchanged).
///
/// Errors: [`KvQuantError::HeadDim`] when a full layer's head dimension is
/// not a multiple of the group size.
pub fn with_kv_quant(
    mut model: LoadedModel,
    quant: Option<KvQuant>,
) -> std::result::Result<LoadedModel, KvQuantError> {
    let Some(quant) = quant else {
        return Ok(model);
    };
    let kinds = model.model.new_cache().kinds();
    for (shape, kind) in model.model.kv_shapes().iter().zip(&kinds) {
        if *kind == LayerKind::Full {
            quant.check_head_dim(shape.head_dim)?;
        }
    }
    model.model = Box::new(QuantizedKv {
        inner: model.model,
        quant,
    });
    Ok(model)
}

/// The KV scheme's part of a cache namespace: `""` for float caches,
/// `+kv:q8g64` for quantized ones, so entries of one scheme never seed a
/// request of another in either tier.
pub fn scheme_suffix(model: &dyn CausalLm) -> String {
    match model.new_cache().quant() {
        Some(q) => format!("+kv:{}", q.name()),
        None => String::new(),
    }
}
