//! Building a [`Qwen35`] from an MLX-format checkpoint's tensors, named as
//! mlx-lm saves a `qwen3_5` model (`language_model.model.layers.N.*`,
//! `language_model.lm_head`; a checkpoint without the `language_model.`
//! wrapper is read too). Multi-token-prediction (`mtp.*`) and vision
//! tensors are left out, as mlx-lm's `sanitize` drops them. Hugging Face's
//! original layout (conv weights `[C, 1, K]`, norm weights stored as
//! `w - 1`) is refused with a message saying to convert it with mlx-lm.

use mlx_rs::{ops, Dtype};

use super::{GatedAttention, GatedDeltaNet, Mixer, Qwen35, Qwen35Layer};
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, Result};
use crate::model::linear::Embedding;
use crate::model::llama::{DenseMlp, Projections};
use crate::model::weights::{ComputeDtype, Loader, TensorMap};

/// Builds a [`Qwen35`] from MLX-named tensors.
///
/// Errors: [`ModelError::Tensor`] naming a missing or mis-shaped tensor
/// (as the checkpoint spells it), or Hugging Face's unconverted layout.
pub fn build_qwen3_5(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<Qwen35> {
    let wrapped = tensors.keys().any(|k| k.starts_with("language_model."));
    let text: TensorMap = tensors
        .iter()
        .filter_map(|(name, a)| {
            let name = match wrapped {
                true => name.strip_prefix("language_model.")?,
                false => name.as_str(),
            };
            (!name.starts_with("mtp.")).then(|| (name.to_string(), a.clone()))
        })
        .collect();
    build_text(config, &text, compute).map_err(|e| match e {
        ModelError::Tensor { name, reason } if wrapped => ModelError::Tensor {
            name: format!("language_model.{name}"),
            reason,
        },
        other => other,
    })
}

fn build_text(c: &ModelConfig, tensors: &TensorMap, compute: ComputeDtype) -> Result<Qwen35> {
    let ld = Loader::new(c, tensors, compute);
    let h = c.hidden_size;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mixer = if c.linear_attn.is_linear_layer(l) {
            Mixer::Delta(delta(&ld, c, tensors, &format!("{p}.linear_attn"))?)
        } else {
            Mixer::Attention(attention(&ld, c, &format!("{p}.self_attn"))?)
        };
        let i = c.intermediate_size;
        let gate = ld.linear(&format!("{p}.mlp.gate_proj"), h, i)?;
        let up = ld.linear(&format!("{p}.mlp.up_proj"), h, i)?;
        layers.push(Qwen35Layer {
            input_norm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_attention_norm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mixer,
            mlp: DenseMlp {
                gate_up: ld.pack_projections(Projections::new(vec![gate, up])?)?,
                down_proj: ld.pack(ld.linear(&format!("{p}.mlp.down_proj"), i, h)?)?,
            },
        });
    }
    let lm_head = match c.tie_word_embeddings {
        true => None,
        false => Some(ld.linear("lm_head", h, c.vocab_size)?),
    };
    Ok(Qwen35 {
        config: c.clone(),
        embed: Embedding(ld.linear("model.embed_tokens", h, c.vocab_size)?),
        layers,
        norm: ld.vector("model.norm.weight", h)?,
        lm_head,
        dtype: ld.act,
        layer_kernel: ld.layer_kernel(),
        stacks: Default::default(),
    })
}

/// The DeltaNet layer at `p` (`model.layers.N.linear_attn`).
fn delta(ld: &Loader<'_>, c: &ModelConfig, tensors: &TensorMap, p: &str) -> Result<GatedDeltaNet> {
    let dims = c.linear_attn.dims();
    let h = c.hidden_size;
    let hv = dims.value_heads;
    let conv_name = format!("{p}.conv1d.weight");
    let conv = tensors.get(&conv_name).ok_or_else(|| ModelError::Tensor {
        name: conv_name.clone(),
        reason: "missing from the checkpoint".into(),
    })?;
    let want = [dims.conv_width() as i32, dims.conv_kernel as i32, 1];
    if conv.shape() != want {
        let hint = if conv.shape().len() == 3 && conv.shape()[1] == 1 {
            " (Hugging Face's layout: convert the checkpoint with `mlx_lm.convert`)"
        } else {
            ""
        };
        return Err(ModelError::Tensor {
            name: conv_name,
            reason: format!("expected shape {want:?}, found {:?}{hint}", conv.shape()),
        });
    }
    let a_log_name = format!("{p}.A_log");
    let a_log = tensors.get(&a_log_name).ok_or_else(|| ModelError::Tensor {
        name: a_log_name.clone(),
        reason: "missing from the checkpoint".into(),
    })?;
    if a_log.shape() != [hv as i32] {
        return Err(ModelError::Tensor {
            name: a_log_name,
            reason: format!("expected shape [{hv}], found {:?}", a_log.shape()),
        });
    }
    let neg_a = ops::negative(ops::exp(a_log.as_dtype(Dtype::Float32)?)?)?;
    let in_proj = ld.pack_projections(Projections::new(vec![
        ld.linear(&format!("{p}.in_proj_qkv"), h, dims.conv_width())?,
        ld.linear(&format!("{p}.in_proj_z"), h, dims.v_width())?,
        ld.linear(&format!("{p}.in_proj_b"), h, hv)?,
        ld.linear(&format!("{p}.in_proj_a"), h, hv)?,
    ])?)?;
    Ok(GatedDeltaNet {
        in_proj,
        conv_weight: conv.as_dtype(ld.act)?,
        neg_a,
        dt_bias: ld.vector(&format!("{p}.dt_bias"), hv)?,
        norm: ld.vector(&format!("{p}.norm.weight"), dims.value_dim)?,
        out_proj: ld.pack(ld.linear(&format!("{p}.out_proj"), dims.v_width(), h)?)?,
    })
}

/// The gated attention layer at `p` (`model.layers.N.self_attn`).
fn attention(ld: &Loader<'_>, c: &ModelConfig, p: &str) -> Result<GatedAttention> {
    let (h, d) = (c.hidden_size, c.head_dim());
    let (q_out, kv_out) = (c.num_attention_heads * d, c.num_key_value_heads * d);
    let q = ld.linear(&format!("{p}.q_proj"), h, 2 * q_out)?;
    let k = ld.linear(&format!("{p}.k_proj"), h, kv_out)?;
    let v = ld.linear(&format!("{p}.v_proj"), h, kv_out)?;
    Ok(GatedAttention {
        qkv: ld.pack_projections(Projections::new(vec![q, k, v])?)?,
        q_norm: ld.vector(&format!("{p}.q_norm.weight"), d)?,
        k_norm: ld.vector(&format!("{p}.k_norm.weight"), d)?,
        o_proj: ld.pack(ld.linear(&format!("{p}.o_proj"), q_out, h)?)?,
    })
}
