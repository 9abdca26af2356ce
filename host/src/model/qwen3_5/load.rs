//! Building a [`Qwen35`] from an MLX-format checkpoint's tensors, named as
//! mlx-lm saves a `qwen3_5` model (`language_model.model.layers.N.*`,
//! `language_model.lm_head`; a checkpoint without the `language_model.`
//! wrapper is read too). Multi-token-prediction (`mtp.*`) and vision
//! tensors are left out, as mlx-lm's `sanitize` drops them. Hugging Face's
//! original layout (conv weights `[C, 1, K]`, norm weights stored as
//! `w - 1`) is refused with a message saying to convert it with mlx-lm.
//!
//! A `qwen3_next` checkpoint (mlx-lm's `qwen3_next.py` layout: flat names,
//! `in_proj_qkvz` and `in_proj_ba` fused per key head, stacked experts in
//! `switch_mlp` beside a `shared_expert` and its `shared_expert_gate`) has
//! its fused DeltaNet projections split into Qwen3.5's four at load (a row
//! permutation: the same products), so both run one graph.

use mlx_rs::{ops, Array, Dtype};

use super::config::{is_qwen3_next, DeltaDims};
use super::{
    FeedForward, GatedAttention, GatedDeltaNet, Mixer, Qwen35, Qwen35Layer, SharedExpertMoe,
};
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, Result};
use crate::model::linear::Embedding;
use crate::model::llama::{DenseMlp, Mlp, Projections};
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
    let text = match is_qwen3_next(&config.model_type) {
        true => split_fused(config, text)?,
        false => text,
    };
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
        let mlp = match ld.mlp(c, l, &format!("{p}.mlp"))? {
            Mlp::Dense(dense) => FeedForward::Dense(dense),
            Mlp::Sparse(moe) => {
                // Qwen3-Next's shared expert, behind a sigmoid gate.
                let i = c.linear_attn.shared_expert_intermediate_size.unwrap_or(0);
                let sp = format!("{p}.mlp.shared_expert");
                let gate = ld.linear(&format!("{sp}.gate_proj"), h, i)?;
                let up = ld.linear(&format!("{sp}.up_proj"), h, i)?;
                FeedForward::Sparse(Box::new(SharedExpertMoe {
                    moe,
                    shared: DenseMlp {
                        gate_up: ld.pack_projections(Projections::new(vec![gate, up])?)?,
                        down_proj: ld.pack(ld.linear(&format!("{sp}.down_proj"), i, h)?)?,
                    },
                    shared_gate: ld.linear(&format!("{p}.mlp.shared_expert_gate"), h, 1)?,
                }))
            }
        };
        layers.push(Qwen35Layer {
            input_norm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_attention_norm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mixer,
            mlp,
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

/// Qwen3-Next's fused DeltaNet projections as Qwen3.5's: `in_proj_qkvz`
/// holds per key head `[q (D_k), k (D_k), v (r D_v), z (r D_v)]` rows
/// (`r = H_v / H_k`), `in_proj_ba` per key head `[b (r), a (r)]`
/// (mlx-lm's `fix_query_key_value_ordering`); they become `in_proj_qkv`
/// (all queries, all keys, all values), `in_proj_z`, `in_proj_b` and
/// `in_proj_a`, each with its scales and biases when quantized (rows are
/// output features in every layout).
fn split_fused(c: &ModelConfig, mut tensors: TensorMap) -> Result<TensorMap> {
    let d = c.linear_attn.dims();
    let (qkvz, ba) = fused_rows(&d);
    for l in (0..c.num_hidden_layers).filter(|&l| c.linear_attn.is_linear_layer(l)) {
        let p = format!("model.layers.{l}.linear_attn");
        for (fused, parts) in [
            (
                "in_proj_qkvz",
                [("in_proj_qkv", &qkvz.0), ("in_proj_z", &qkvz.1)],
            ),
            ("in_proj_ba", [("in_proj_b", &ba.0), ("in_proj_a", &ba.1)]),
        ] {
            let want: usize = parts.iter().map(|(_, rows)| rows.len()).sum();
            for suffix in ["weight", "scales", "biases"] {
                let name = format!("{p}.{fused}.{suffix}");
                let Some(a) = tensors.remove(&name) else {
                    if suffix == "weight" {
                        return Err(ModelError::Tensor {
                            name,
                            reason: "missing from the checkpoint".into(),
                        });
                    }
                    continue;
                };
                if a.ndim() != 2 || a.shape()[0] as usize != want {
                    return Err(ModelError::Tensor {
                        name,
                        reason: format!("expected {want} rows, found shape {:?}", a.shape()),
                    });
                }
                for (part, rows) in parts {
                    let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
                    let idx = Array::from_slice(&idx, &[idx.len() as i32]);
                    tensors.insert(format!("{p}.{part}.{suffix}"), a.take_axis(&idx, 0)?);
                }
            }
        }
    }
    Ok(tensors)
}

/// Row indices into the fused projections: (`qkv`, `z`) of
/// `in_proj_qkvz` and (`b`, `a`) of `in_proj_ba`.
#[allow(clippy::type_complexity)]
fn fused_rows(d: &DeltaDims) -> ((Vec<usize>, Vec<usize>), (Vec<usize>, Vec<usize>)) {
    let (nk, dk, dv) = (d.key_heads, d.key_dim, d.value_dim);
    let r = d.value_heads / nk;
    let width = 2 * dk + 2 * r * dv;
    let block = |h: usize, from: usize, len: usize| (h * width + from)..(h * width + from + len);
    let mut qkv: Vec<usize> = (0..nk).flat_map(|h| block(h, 0, dk)).collect();
    qkv.extend((0..nk).flat_map(|h| block(h, dk, dk)));
    qkv.extend((0..nk).flat_map(|h| block(h, 2 * dk, r * dv)));
    let z = (0..nk)
        .flat_map(|h| block(h, 2 * dk + r * dv, r * dv))
        .collect();
    let b = (0..nk).flat_map(|h| (2 * r * h)..(2 * r * h + r)).collect();
    let a = (0..nk)
        .flat_map(|h| (2 * r * h + r)..(2 * r * (h + 1)))
        .collect();
    ((qkv, z), (b, a))
}
