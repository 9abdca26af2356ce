//! Building a [`Gemma4`] from a checkpoint's tensors.
//!
//! Tensor names are read in `gemma4_text` spelling (`model.layers.N...`):
//! a `gemma4` checkpoint's text tensors are renamed first, mlx-lm's
//! `language_model.model.*` and `language_model.lm_head.*` as it saves
//! them, Hugging Face's `model.language_model.*` as it ships them (vision
//! and audio towers are ignored). KV-shared layers read no `k_proj`,
//! `v_proj` or `k_norm` (mlx-lm drops them; Hugging Face checkpoints carry
//! unused ones).

use super::config::LayerAttention;
use super::per_layer::{PerLayerGate, PerLayerInputs};
use super::{Gemma4, Gemma4Attention, Gemma4Layer};
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, Result};
use crate::model::linear::Embedding;
use crate::model::llama::Projections;
use crate::model::weights::{ComputeDtype, Loader, TensorMap};

/// The checkpoint's text-decoder tensors under `gemma4_text` names (see
/// the module doc); other tensors keep their names.
fn text_tensors(tensors: &TensorMap) -> TensorMap {
    tensors
        .iter()
        .map(|(name, a)| {
            let renamed = if let Some(rest) = name.strip_prefix("language_model.") {
                rest.to_string()
            } else if let Some(rest) = name.strip_prefix("model.language_model.") {
                format!("model.{rest}")
            } else {
                name.clone()
            };
            (renamed, a.clone())
        })
        .collect()
}

/// Builds a [`Gemma4`] from a checkpoint's tensors (norm weights the `w`
/// they multiply by).
///
/// Errors: [`ModelError::Tensor`] naming a missing or mis-shaped tensor.
pub fn build_gemma4(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<Gemma4> {
    let c = config;
    let g = &c.gemma4;
    let tensors = text_tensors(tensors);
    let ld = Loader::new(c, &tensors, compute);
    let h = c.hidden_size;
    // `ModelConfig::validate` (run at load) has checked the config already.
    let attention = g
        .layers(c)
        .map_err(|reason| ModelError::invalid("config.json", reason))?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, a) in attention.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let i = g.mlp_width(c, l);
        let gate = ld.linear(&format!("{p}.mlp.gate_proj"), h, i)?;
        let up = ld.linear(&format!("{p}.mlp.up_proj"), h, i)?;
        let per_layer = match g.per_layer_width() {
            0 => None,
            w => Some(PerLayerGate {
                gate: ld.linear(&format!("{p}.per_layer_input_gate"), h, w)?,
                projection: ld.linear(&format!("{p}.per_layer_projection"), w, h)?,
                norm: ld.vector(&format!("{p}.post_per_layer_input_norm.weight"), h)?,
            }),
        };
        layers.push(Gemma4Layer {
            input_norm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_attention_norm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            pre_feedforward_norm: ld.vector(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
            post_feedforward_norm: ld
                .vector(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
            attn: attention_layer(&ld, &p, a, h)?,
            gate_up: Projections::new(vec![gate, up])?,
            down_proj: ld.linear(&format!("{p}.mlp.down_proj"), i, h)?,
            per_layer,
            layer_scalar: ld.vector(&format!("{p}.layer_scalar"), 1)?,
        });
    }
    let per_layer = match g.per_layer_width() {
        0 => None,
        w => {
            let width = c.num_hidden_layers * w;
            let vocab = g.vocab_size_per_layer_input.unwrap_or(c.vocab_size);
            Some(PerLayerInputs {
                embed: Embedding(ld.linear("model.embed_tokens_per_layer", width, vocab)?),
                vocab,
                mask_ids: vocab < c.vocab_size,
                projection: ld.linear("model.per_layer_model_projection", h, width)?,
                norm: ld.vector("model.per_layer_projection_norm.weight", w)?,
                layers: c.num_hidden_layers,
                width: w,
            })
        }
    };
    let lm_head = if c.tie_word_embeddings {
        None
    } else {
        Some(ld.linear("lm_head", h, c.vocab_size)?)
    };
    Ok(Gemma4 {
        config: c.clone(),
        embed: Embedding(ld.linear("model.embed_tokens", h, c.vocab_size)?),
        per_layer,
        layers,
        norm: ld.vector("model.norm.weight", h)?,
        lm_head,
        dtype: ld.act,
        layer_kernel: ld.layer_kernel(),
    })
}

/// Layer `p`'s attention (`p`: `model.layers.N`) with geometry `a`.
fn attention_layer(
    ld: &Loader<'_>,
    p: &str,
    a: &LayerAttention,
    h: usize,
) -> Result<Gemma4Attention> {
    let d = a.kv.head_dim;
    let (q_out, kv_out) = (a.heads * d, a.kv.kv_heads * d);
    let mut parts = vec![ld.linear(&format!("{p}.self_attn.q_proj"), h, q_out)?];
    let k_norm = if a.has_kv {
        parts.push(ld.linear(&format!("{p}.self_attn.k_proj"), h, kv_out)?);
        if !a.k_eq_v {
            parts.push(ld.linear(&format!("{p}.self_attn.v_proj"), h, kv_out)?);
        }
        Some(ld.vector(&format!("{p}.self_attn.k_norm.weight"), d)?)
    } else {
        None
    };
    Ok(Gemma4Attention {
        projections: Projections::new(parts)?,
        q_norm: ld.vector(&format!("{p}.self_attn.q_norm.weight"), d)?,
        k_norm,
        o_proj: ld.linear(&format!("{p}.self_attn.o_proj"), q_out, h)?,
        kind: a.kind,
        cache_layer: a.cache_layer,
        heads: a.heads,
        kv: a.kv,
        rope: a.rope.rope(d)?,
    })
}
