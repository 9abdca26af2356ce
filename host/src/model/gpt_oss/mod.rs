//! gpt-oss's decoder (`gpt_oss`: gpt-oss-20b, gpt-oss-120b) over a ragged
//! batch of rows.
//!
//! Follows mlx-lm 0.32.2's `mlx_lm/models/gpt_oss.py`, op for op. A
//! pre-norm decoder (RMSNorm before attention and before the MLP, the
//! branch added to the residual, a final norm and an untied head) whose
//! parts are shared with the other architectures, and what is its own:
//! - attention with q/k/v/o biases, half-split RoPE (YaRN-scaled when
//!   `rope_scaling` says so: [`super::yarn`]; queries and keys times its
//!   mscale first) and **attention sinks**: one learned logit per query
//!   head that joins every softmax and attends to nothing, so a head can
//!   give a position little weight everywhere (MLX's SDPA `sinks`, through
//!   [`ragged::attend_rows`]);
//! - layers alternating between a `sliding_window` (128) and full
//!   attention, the sliding ones with Gemma's bounded, trimmable cache
//!   layer ([`LayerKind::SlidingWindow`]) in the RAM and SSD tiers alike;
//! - every layer a mixture of experts ([`SparseMoe`]): a router with a
//!   bias, the top-k logits softmaxed, experts with biases through
//!   `swiglu_oai` ([`GateActivation::GPT_OSS`]), in MLX's `mxfp4` mode as
//!   gpt-oss ships them ([`super::mxfp4`]).
//!
//! Decode runs through MLX ops, as Gemma's does (the fused CPU decode op is
//! Llama-shaped, without sinks or experts).

pub mod config;
mod load;

use mlx_rs::{fast, ops, Array, Dtype};

pub use load::build_gpt_oss;

use super::config::ModelConfig;
use super::cpu_quant::Kernel;
use super::error::Result;
use super::linear::{Embedding, Linear};
use super::llama::{Projections, RowInput};
use super::moe::SparseMoe;
use super::ragged::{self, Rope};
use crate::cache::{KvCache, LayerKind};

/// One layer's attention parameters.
#[derive(Debug, Clone)]
pub struct GptOssAttention {
    /// `q_proj` `[n_heads*D, H]`, `k_proj`/`v_proj` `[n_kv*D, H]`.
    pub qkv: Projections,
    /// Their biases concatenated, `[(n_heads + 2 n_kv) * D]`.
    pub qkv_bias: Array,
    /// `o_proj`: `[H, n_heads * D]`.
    pub o_proj: Linear,
    /// `o_proj`'s bias, `[H]`.
    pub o_bias: Array,
    /// Each query head's sink logit, `[n_heads]`.
    pub sinks: Array,
    /// Full or sliding-window attention.
    pub kind: LayerKind,
}

/// One gpt-oss decoder layer.
#[derive(Debug, Clone)]
pub struct GptOssLayer {
    /// RMSNorm weight before attention, `[H]`.
    pub input_norm: Array,
    /// RMSNorm weight before the MLP, `[H]`.
    pub post_attention_norm: Array,
    /// Attention.
    pub attn: GptOssAttention,
    /// The router and experts.
    pub mlp: SparseMoe,
}

/// gpt-oss's parameters plus its compute dtype.
#[derive(Debug, Clone)]
pub struct GptOss {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding `[V, H]`.
    pub embed: Embedding,
    /// Decoder layers.
    pub layers: Vec<GptOssLayer>,
    /// Final RMSNorm weight, `[H]`.
    pub norm: Array,
    /// Output head `[V, H]`.
    pub lm_head: Linear,
    /// RoPE of every layer.
    pub rope: Rope,
    /// YaRN's multiplier of queries and keys before RoPE, in the
    /// activation dtype; `None` without YaRN (or a multiplier of 1).
    pub rope_mscale: Option<Array>,
    /// Activation dtype.
    pub dtype: Dtype,
    /// CPU kernel for the layers' decode-sized quantized products.
    pub layer_kernel: Kernel,
}

impl GptOss {
    /// Runs the rows' new tokens through the model, extending each row's
    /// cache, and returns per row the logits `[n, V]` (float32, lazy) for
    /// positions `logits_from..tokens.len()`. With `device_ids` (`[N]`
    /// uint32, lazy) the packed token ids come from it instead of the rows'
    /// `tokens` (see [`super::CausalLm::forward_device_ids`]).
    ///
    /// Errors: a token id `>= vocab_size`; MLX errors.
    pub fn forward_ids(
        &self,
        rows: &mut [RowInput<'_>],
        device_ids: Option<&Array>,
    ) -> Result<Vec<Array>> {
        let c = &self.config;
        let Some(ragged::Packed {
            ids,
            lens,
            positions,
        }) = ragged::pack(rows, c.vocab_size)?
        else {
            return Ok(ragged::no_logits(rows.len(), c.vocab_size));
        };
        let ids = device_ids.cloned().unwrap_or(ids);
        let eps = c.rms_norm_eps;
        let mut h = self.embed.lookup(&ids, self.dtype)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = fast::rms_norm(&h, Some(&layer.input_norm), eps)?;
            let attn = self.attention(l, &layer.attn, &x, rows, &lens, &positions)?;
            let o = layer.attn.o_proj.forward_with(&attn, self.layer_kernel)?;
            h = ops::add(&h, ops::add(&o, &layer.attn.o_bias)?)?;
            let x = fast::rms_norm(&h, Some(&layer.post_attention_norm), eps)?;
            h = ops::add(&h, layer.mlp.forward(&x)?)?;
        }
        for (row, &t) in rows.iter_mut().zip(&lens) {
            row.cache.advance(t);
        }
        ragged::head(&h, rows, &lens, c.vocab_size, |hs| {
            // Logits in float32, as Llama's head computes them.
            let hs = fast::rms_norm(hs, Some(&self.norm), eps)?.as_dtype(Dtype::Float32)?;
            Ok(self.lm_head.forward(&hs)?.as_dtype(Dtype::Float32)?)
        })
    }

    /// Self-attention for all rows: `x: [N, H]` -> `[N, n_heads * D]`.
    /// Projections and RoPE run once for all tokens; attention per row
    /// against its own cache, with the layer's sinks.
    fn attention(
        &self,
        l: usize,
        attn: &GptOssAttention,
        x: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
        positions: &Array,
    ) -> Result<Array> {
        let c = &self.config;
        let d = c.head_dim() as i32;
        let (nh, nkv) = (c.num_attention_heads as i32, c.num_key_value_heads as i32);
        let qkv = attn
            .qkv
            .forward_biased(x, self.layer_kernel, Some(&attn.qkv_bias))?;
        let n = qkv[0].shape()[0];
        let rope = |a: &Array, heads: i32| -> Result<Array> {
            // YaRN scales the whole head before rotating it (mlx-lm's
            // `YarnRoPE`: `x.at[..., :dims].multiply(mscale)`).
            let a = match &self.rope_mscale {
                Some(m) => ops::multiply(a, m)?,
                None => a.clone(),
            };
            ragged::rope_heads_with(&a, heads, d, None, &self.rope, positions)
        };
        let q = rope(&qkv[0], nh)?;
        let k = rope(&qkv[1], nkv)?;
        let v = qkv[2].reshape(&[n, nkv, 1, d])?;
        ragged::attend_rows(
            l,
            attn.kind,
            &q,
            Some((&k, &v)),
            rows,
            lens,
            (nh, nkv, d),
            1.0 / (d as f32).sqrt(),
            Some(&attn.sinks),
        )
    }

    /// A fresh cache for one row: sliding-window layers bounded.
    pub fn new_cache(&self) -> KvCache {
        KvCache::with_kinds(&self.layers.iter().map(|l| l.attn.kind).collect::<Vec<_>>())
    }

    /// Every parameter array.
    pub fn parameters(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.embed.0.tensors().into_iter().map(|(_, a)| a).collect();
        for layer in &self.layers {
            out.extend([
                &layer.input_norm,
                &layer.post_attention_norm,
                &layer.attn.qkv_bias,
                &layer.attn.o_bias,
                &layer.attn.sinks,
            ]);
            let mut linears = layer.attn.qkv.linears();
            linears.push(&layer.attn.o_proj);
            for lin in linears {
                out.extend(lin.tensors().into_iter().map(|(_, a)| a));
            }
            out.extend(layer.mlp.tensors());
        }
        out.push(&self.norm);
        out.extend(self.lm_head.tensors().into_iter().map(|(_, a)| a));
        if let Rope::Periods(p) = &self.rope {
            out.push(p);
        }
        out.extend(&self.rope_mscale);
        out
    }
}
