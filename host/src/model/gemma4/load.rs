//! Building a [`Gemma4`] from a checkpoint's tensors.
//!
//! Tensor names are read in `gemma4_text` spelling (`model.layers.N...`):
//! a `gemma4` checkpoint's text tensors are renamed first, mlx-lm's
//! `language_model.model.*` and `language_model.lm_head.*` as it saves
//! them, Hugging Face's `model.language_model.*` as it ships them (vision
//! and audio towers are left out). KV-shared layers read no `k_proj`,
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

/// Where a checkpoint keeps the text decoder's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `model.*`, `lm_head.*` (`gemma4_text`).
    Text,
    /// `language_model.model.*`, `language_model.lm_head.*` (mlx-lm's
    /// `gemma4`).
    MlxWrapped,
    /// `model.language_model.*` (Hugging Face's `gemma4`).
    HfWrapped,
}

impl Layout {
    fn of(tensors: &TensorMap) -> Layout {
        if tensors.keys().any(|k| k.starts_with("language_model.")) {
            Layout::MlxWrapped
        } else if tensors
            .keys()
            .any(|k| k.starts_with("model.language_model."))
        {
            Layout::HfWrapped
        } else {
            Layout::Text
        }
    }

    /// A checkpoint name in `gemma4_text` spelling; `None` for tensors
    /// outside the text decoder (vision and audio towers).
    fn to_text(self, name: &str) -> Option<String> {
        match self {
            Layout::Text => Some(name.to_string()),
            Layout::MlxWrapped => name.strip_prefix("language_model.").map(String::from),
            Layout::HfWrapped => name
                .strip_prefix("model.language_model.")
                .map(|rest| format!("model.{rest}")),
        }
    }

    /// A `gemma4_text` name as this checkpoint spells it (for errors).
    fn checkpoint_name(self, name: &str) -> String {
        match self {
            Layout::Text => name.to_string(),
            Layout::MlxWrapped => format!("language_model.{name}"),
            Layout::HfWrapped => match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name.to_string(),
            },
        }
    }
}

/// Builds a [`Gemma4`] from a checkpoint's tensors in any of the layouts
/// above (see the module doc); a missing or mis-shaped tensor's error
/// names it as the checkpoint spells it.
pub fn build_gemma4(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<Gemma4> {
    let layout = Layout::of(tensors);
    let text: TensorMap = tensors
        .iter()
        .filter_map(|(name, a)| Some((layout.to_text(name)?, a.clone())))
        .collect();
    build_text(config, &text, compute).map_err(|e| match e {
        ModelError::Tensor { name, reason } => ModelError::Tensor {
            name: layout.checkpoint_name(&name),
            reason,
        },
        other => other,
    })
}

/// Builds a [`Gemma4`] from `gemma4_text`-named tensors (norm weights the
/// `w` they multiply by).
///
/// Errors: [`ModelError::Tensor`] naming a missing or mis-shaped tensor.
fn build_text(config: &ModelConfig, tensors: &TensorMap, compute: ComputeDtype) -> Result<Gemma4> {
    let c = config;
    let g = &c.gemma4;
    let ld = Loader::new(c, tensors, compute);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_renames_to_text_names_and_back() {
        let text = "model.layers.3.self_attn.q_proj.weight";
        for (layout, name) in [
            (Layout::Text, text.to_string()),
            (Layout::MlxWrapped, format!("language_model.{text}")),
            (
                Layout::HfWrapped,
                "model.language_model.layers.3.self_attn.q_proj.weight".into(),
            ),
        ] {
            let mut map = TensorMap::new();
            map.insert(name.clone(), mlx_rs::Array::from_f32(0.0));
            assert_eq!(Layout::of(&map), layout);
            assert_eq!(layout.to_text(&name).as_deref(), Some(text));
            assert_eq!(layout.checkpoint_name(text), name);
        }
        let head = Layout::MlxWrapped.to_text("language_model.lm_head.weight");
        assert_eq!(head.as_deref(), Some("lm_head.weight"));
        // Towers beside the decoder are left out.
        assert_eq!(
            Layout::HfWrapped.to_text("model.vision_tower.patch.weight"),
            None
        );
        assert_eq!(
            Layout::MlxWrapped.to_text("vision_tower.patch.weight"),
            None
        );
    }
}
