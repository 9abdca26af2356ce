//! Building a [`GptOss`] from an MLX-format checkpoint's tensors, named as
//! mlx-lm saves them (`model.layers.N.self_attn.{q,k,v,o}_proj`,
//! `.self_attn.sinks`, `.mlp.router`, `.mlp.experts.{gate,up,down}_proj`,
//! `lm_head`): the experts' gate and up projections already split, as
//! mlx-lm's `sanitize` leaves them. Hugging Face's original layout (fused
//! `gate_up_proj_blocks` / `_scales` interleaving gate and up rows) is
//! refused with a message saying to convert it with mlx-lm.

use mlx_rs::{ops, Array};

use super::config::layer_kinds;
use super::{GptOss, GptOssAttention, GptOssLayer};
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, Result};
use crate::model::linear::Embedding;
use crate::model::llama::Projections;
use crate::model::moe::{GateActivation, Routing, SparseMoe, SwitchLinear};
use crate::model::ragged::Rope;
use crate::model::weights::{ComputeDtype, Loader, TensorMap};
use crate::model::yarn::YarnParams;

/// Builds a [`GptOss`] from MLX-named tensors.
///
/// Errors: [`ModelError::Tensor`] naming a missing or mis-shaped tensor
/// (or the Hugging Face layout's fused expert tensors).
pub fn build_gpt_oss(
    config: &ModelConfig,
    tensors: &TensorMap,
    compute: ComputeDtype,
) -> Result<GptOss> {
    let c = config;
    if let Some(name) = tensors.keys().find(|k| k.contains("gate_up_proj")) {
        return Err(ModelError::Tensor {
            name: name.clone(),
            reason: "Hugging Face's fused expert layout; convert the checkpoint with \
                     `mlx_lm.convert` (it splits gate_up_proj into gate_proj and up_proj)"
                .into(),
        });
    }
    let ld = Loader::new(c, tensors, compute);
    // `ModelConfig::validate` (run at load) has checked the config already.
    let kinds = layer_kinds(c).map_err(|reason| ModelError::invalid("config.json", reason))?;
    let h = c.hidden_size;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, kind) in kinds.into_iter().enumerate() {
        let p = format!("model.layers.{l}");
        layers.push(GptOssLayer {
            input_norm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_attention_norm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            attn: attention(&ld, c, &p, kind)?,
            mlp: experts(&ld, c, tensors, &format!("{p}.mlp"))?,
        });
    }
    let (rope, mscale) = match c.rope_scaling.as_ref().filter(|v| !v.is_null()) {
        Some(scaling) if scaling["rope_type"] == "yarn" || scaling["type"] == "yarn" => {
            let yarn = YarnParams::from_scaling(scaling)
                .map_err(|reason| ModelError::invalid("config.json", reason))?
                .rope(c.head_dim(), c.rope_theta)?;
            let mscale = (yarn.mscale != 1.0)
                .then(|| Array::from_f32(yarn.mscale).as_dtype(ld.act))
                .transpose()?;
            (Rope::Periods(yarn.periods), mscale)
        }
        _ => (Rope::Base(c.rope_theta), None),
    };
    Ok(GptOss {
        config: c.clone(),
        embed: Embedding(ld.linear("model.embed_tokens", h, c.vocab_size)?),
        layers,
        norm: ld.vector("model.norm.weight", h)?,
        lm_head: ld.linear("lm_head", h, c.vocab_size)?,
        rope,
        rope_mscale: mscale,
        dtype: ld.act,
        layer_kernel: ld.layer_kernel(),
    })
}

/// Layer `p`'s attention (`p`: `model.layers.N`).
fn attention(
    ld: &Loader<'_>,
    c: &ModelConfig,
    p: &str,
    kind: crate::cache::LayerKind,
) -> Result<GptOssAttention> {
    let (h, d) = (c.hidden_size, c.head_dim());
    let (q_out, kv_out) = (c.num_attention_heads * d, c.num_key_value_heads * d);
    let a = format!("{p}.self_attn");
    let q = ld.linear(&format!("{a}.q_proj"), h, q_out)?;
    let k = ld.linear(&format!("{a}.k_proj"), h, kv_out)?;
    let v = ld.linear(&format!("{a}.v_proj"), h, kv_out)?;
    let qkv_bias = ops::concatenate(
        &[
            ld.vector(&format!("{a}.q_proj.bias"), q_out)?,
            ld.vector(&format!("{a}.k_proj.bias"), kv_out)?,
            ld.vector(&format!("{a}.v_proj.bias"), kv_out)?,
        ],
        0,
    )?;
    Ok(GptOssAttention {
        qkv: Projections::new(vec![q, k, v])?,
        qkv_bias,
        o_proj: ld.linear(&format!("{a}.o_proj"), q_out, h)?,
        o_bias: ld.vector(&format!("{a}.o_proj.bias"), h)?,
        // In the activation dtype: MLX's SDPA wants sinks that promote to
        // its output's.
        sinks: ld.vector(&format!("{a}.sinks"), c.num_attention_heads)?,
        kind,
    })
}

/// The router and experts of the MLP at `mlp` (`model.layers.N.mlp`).
fn experts(ld: &Loader<'_>, c: &ModelConfig, tensors: &TensorMap, mlp: &str) -> Result<SparseMoe> {
    let h = c.hidden_size;
    // `normalize` and `validate` made these present.
    let n = c.moe.num_experts.unwrap_or(0);
    let i = c.moe.moe_intermediate_size.unwrap_or(c.intermediate_size);
    let switch = |proj: &str, in_dim: usize, out_dim: usize| -> Result<SwitchLinear> {
        let prefix = format!("{mlp}.experts.{proj}");
        let sw = SwitchLinear::load_stacked(tensors, &prefix, n, in_dim, out_dim)?;
        if sw.bias.is_none() {
            return Err(ModelError::Tensor {
                name: format!("{prefix}.bias"),
                reason: "missing from the checkpoint (gpt-oss's experts have biases)".into(),
            });
        }
        ld.experts(sw)
    };
    Ok(SparseMoe {
        // The exact float32 kernel, as Qwen3-MoE's router (the top-k
        // follows the logits to their last bits).
        router: ld.linear(&format!("{mlp}.router"), h, n)?,
        router_bias: Some(ld.vector(&format!("{mlp}.router.bias"), n)?),
        gate_proj: switch("gate_proj", h, i)?,
        up_proj: switch("up_proj", h, i)?,
        down_proj: switch("down_proj", i, h)?,
        top_k: c.moe.num_experts_per_tok.unwrap_or(4) as i32,
        routing: Routing::TopKSoftmax,
        activation: GateActivation::GPT_OSS,
    })
}
