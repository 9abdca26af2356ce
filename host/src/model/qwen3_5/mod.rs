//! Qwen3.5's dense decoder (`qwen3_5`: every Qwen3.5 size) over a ragged
//! batch of rows: a hybrid of gated-DeltaNet linear attention and gated
//! full attention.
//!
//! Follows mlx-lm 0.32.2's `mlx_lm/models/qwen3_5.py` (and the parts it
//! takes from `qwen3_next.py` and `gated_delta.py`), op for op where the
//! numbers depend on it. A pre-norm decoder (RMSNorm before the mixer and
//! before the SwiGLU MLP, a final norm, a tied or untied head) whose
//! mixer is, per layer ([`config::LinearAttnConfig::is_linear_layer`]):
//! - **gated DeltaNet** (three of every four layers): projections to
//!   queries/keys/values, a gate `z` and the per-head `b` and `a`; a
//!   depthwise causal conv1d over queries/keys/values with SiLU; queries
//!   and keys L2-normalised (the `D_k^-½` scale folded into queries); the
//!   gated delta rule ([`super::gated_delta`]: chunked over a prompt
//!   chunk, one recurrent step per decode token, every decoding row of a
//!   step in one `[B, ...]` step); an RMSNorm of each value head gated by
//!   `silu(z)`; `out_proj`. Its cache layer is a fixed-size recurrent
//!   state ([`LayerKind::Recurrent`], [`crate::cache::state`]);
//! - **gated full attention** (the rest): `q_proj` gives each head's
//!   query and an output gate side by side, per-head q/k RMSNorm, RoPE on
//!   the first `partial_rotary_factor` of each head's dimensions, and the
//!   attention output times `sigmoid(gate)` before `o_proj`.
//!
//! Decode runs through MLX ops, as Gemma's and gpt-oss's do.

pub mod config;
mod load;

use mlx_rs::{
    fast,
    ops::{self, indexing::IndexOp},
    Array, Dtype,
};

pub use load::build_qwen3_5;

use self::config::DeltaDims;
use super::config::ModelConfig;
use super::cpu_quant::Kernel;
use super::error::Result;
use super::gated_delta;
use super::linear::{Embedding, Linear};
use super::llama::{DenseMlp, Projections, RowInput};
use super::moe::SparseMoe;
use super::ragged;
use crate::cache::state::{LayerState, StackSlot};
use crate::cache::{KvCache, LayerKind};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A gated-DeltaNet layer's parameters.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// `in_proj_qkv` `[2 H_k D_k + H_v D_v, H]`, `in_proj_z` `[H_v D_v,
    /// H]`, `in_proj_b` and `in_proj_a` `[H_v, H]`.
    pub in_proj: Projections,
    /// The depthwise conv's weight, `[C, K, 1]` (MLX's `Conv1d` layout).
    pub conv_weight: Array,
    /// `-exp(A_log)`, `[H_v]` float32 (mlx-lm keeps `A_log` in float32).
    pub neg_a: Array,
    /// `dt_bias`, `[H_v]`.
    pub dt_bias: Array,
    /// The gated RMSNorm's weight over each value head, `[D_v]`.
    pub norm: Array,
    /// `out_proj`: `[H, H_v D_v]`.
    pub out_proj: Linear,
}

/// A gated full-attention layer's parameters.
#[derive(Debug, Clone)]
pub struct GatedAttention {
    /// `q_proj` `[2 n_heads D, H]` (each head's query then its gate),
    /// `k_proj`/`v_proj` `[n_kv D, H]`.
    pub qkv: Projections,
    /// RMSNorm weights over each query / key head, `[D]`.
    pub q_norm: Array,
    /// See `q_norm`.
    pub k_norm: Array,
    /// `o_proj`: `[H, n_heads D]`.
    pub o_proj: Linear,
}

/// A layer's token mixer.
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Gated DeltaNet (recurrent state).
    Delta(GatedDeltaNet),
    /// Gated full attention (KV cache).
    Attention(GatedAttention),
}

/// A layer's MLP.
#[derive(Debug, Clone)]
pub enum FeedForward {
    /// The SwiGLU MLP (Qwen3.5; Qwen3-Next's `mlp_only_layers`).
    Dense(DenseMlp),
    /// Qwen3-Next's sparse layers.
    Sparse(Box<SharedExpertMoe>),
}

/// Qwen3-Next's sparse MLP: the routed experts (softmax, top-k,
/// renormalised when `norm_topk_prob`) plus a shared expert scaled by
/// `sigmoid(x @ shared_expert_gate^T)`.
#[derive(Debug, Clone)]
pub struct SharedExpertMoe {
    /// Router and routed experts.
    pub moe: SparseMoe,
    /// The shared expert's SwiGLU MLP.
    pub shared: DenseMlp,
    /// `shared_expert_gate`: `[1, H]`.
    pub shared_gate: Linear,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct Qwen35Layer {
    /// RMSNorm weight before the mixer, `[H]`.
    pub input_norm: Array,
    /// RMSNorm weight before the MLP, `[H]`.
    pub post_attention_norm: Array,
    /// The token mixer.
    pub mixer: Mixer,
    /// The MLP.
    pub mlp: FeedForward,
}

/// Qwen3.5's parameters plus its compute dtype.
#[derive(Debug, Clone)]
pub struct Qwen35 {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding `[V, H]`.
    pub embed: Embedding,
    /// Decoder layers.
    pub layers: Vec<Qwen35Layer>,
    /// Final RMSNorm weight, `[H]`.
    pub norm: Array,
    /// Untied output head `[V, H]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    /// Activation dtype.
    pub dtype: Dtype,
    /// CPU kernel for the layers' decode-sized quantized products.
    pub layer_kernel: Kernel,
    /// Each DeltaNet layer's stacked states from the last decode step.
    pub stacks: DecodeStacks,
}

/// One DeltaNet layer's states after a decode step, stacked `[B, ...]` in
/// the step's row order: the decoding rows' states are row views of these
/// arrays ([`StackSlot`]). The next step takes them as they are when it
/// decodes the same rows in the same order, gathers the rows still there
/// when some left, and appends the states of rows that joined, so the
/// batch's states stay one array per layer while rows come and go (as the
/// decode slab keeps KV on GPU backends) instead of being stacked from
/// per-row arrays every step.
#[derive(Debug)]
struct Stacked {
    id: u64,
    conv: Array,
    ssm: Array,
}

/// Per layer, the last decode step's [`Stacked`] states (interior
/// mutability: the forward takes `&self`). Cloning a model starts it
/// empty.
#[derive(Debug, Default)]
pub struct DecodeStacks(Mutex<HashMap<usize, Stacked>>);

impl Clone for DecodeStacks {
    fn clone(&self) -> Self {
        DecodeStacks::default()
    }
}

impl DecodeStacks {
    fn take(&self, layer: usize) -> Option<Stacked> {
        self.0.lock().ok()?.remove(&layer)
    }

    fn put(&self, layer: usize, stacked: Stacked) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(layer, stacked);
        }
    }
}

/// Ids of [`Stacked`] states, unique in the process.
static NEXT_STACK: AtomicU64 = AtomicU64::new(1);

impl Qwen35 {
    /// Runs the rows' new tokens through the model, extending each row's
    /// cache (KV of the full layers, recurrent state of the DeltaNet
    /// layers), and returns per row the logits `[n, V]` (float32, lazy)
    /// for positions `logits_from..tokens.len()`. With `device_ids` (`[N]`
    /// uint32, lazy) the packed token ids come from it instead of the
    /// rows' `tokens` (see [`super::CausalLm::forward_device_ids`]).
    ///
    /// Errors: a token id `>= vocab_size`; a row cache of another model;
    /// MLX errors.
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
            let r = match &layer.mixer {
                Mixer::Delta(d) => self.delta(l, d, &x, rows, &lens)?,
                Mixer::Attention(a) => self.attention(l, a, &x, rows, &lens, &positions)?,
            };
            h = ops::add(&h, &r)?;
            let x = fast::rms_norm(&h, Some(&layer.post_attention_norm), eps)?;
            let y = match &layer.mlp {
                FeedForward::Dense(mlp) => self.mlp(mlp, &x)?,
                FeedForward::Sparse(m) => {
                    let SharedExpertMoe {
                        moe,
                        shared,
                        shared_gate,
                    } = m.as_ref();
                    let routed = moe.forward(&x)?;
                    let gate = ops::sigmoid(shared_gate.forward_with(&x, self.layer_kernel)?)?;
                    ops::add(&routed, ops::multiply(&gate, self.mlp(shared, &x)?)?)?
                }
            };
            h = ops::add(&h, &y)?;
        }
        for (row, &t) in rows.iter_mut().zip(&lens) {
            row.cache.advance(t);
        }
        ragged::head(&h, rows, &lens, c.vocab_size, |hs| {
            // Logits in float32, as Llama's head computes them.
            let hs = fast::rms_norm(hs, Some(&self.norm), eps)?.as_dtype(Dtype::Float32)?;
            Ok(match &self.lm_head {
                Some(head) => head.forward(&hs)?,
                None => self.embed.as_linear(&hs)?,
            }
            .as_dtype(Dtype::Float32)?)
        })
    }

    /// `down(silu(gate(x)) * up(x))`.
    fn mlp(&self, mlp: &DenseMlp, x: &Array) -> Result<Array> {
        let gu = mlp.gate_up.forward(x, self.layer_kernel)?;
        let act = ops::multiply(gated_delta::silu(&gu[0])?, &gu[1])?;
        mlp.down_proj.forward_with(&act, self.layer_kernel)
    }

    /// A scalar in the activation dtype (mlx-lm's Python floats are weak:
    /// they take the array's dtype).
    fn scalar(&self, v: f32) -> Result<Array> {
        Ok(Array::from_f32(v).as_dtype(self.dtype)?)
    }

    /// Gated DeltaNet for all rows: `x: [N, H]` -> `[N, H]`. The rows that
    /// feed one token share one recurrent step (their states stacked
    /// `[B, ...]`); a prompt chunk runs the chunked form over its own
    /// state. Each row's cache gets its new conv and recurrent state.
    fn delta(
        &self,
        l: usize,
        d: &GatedDeltaNet,
        x: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
    ) -> Result<Array> {
        let dims = self.config.linear_attn.dims();
        let (hv, dv) = (dims.value_heads as i32, dims.value_dim as i32);
        let n = x.shape()[0];
        let parts = d.in_proj.forward(x, self.layer_kernel)?;
        let (qkv, z, b, a) = (&parts[0], &parts[1], &parts[2], &parts[3]);
        let log_g = gated_delta::log_decay(a, &d.dt_bias, &d.neg_a)?;
        let beta = ops::sigmoid(b)?.as_dtype(Dtype::Float32)?;
        // Row starts in the packed tokens, and which rows decode.
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0i32;
        for &t in lens {
            starts.push(at);
            at += t as i32;
        }
        let decoding: Vec<usize> = (0..lens.len()).filter(|&r| lens[r] == 1).collect();
        let decoded = if decoding.is_empty() {
            // No row decodes: the last stack would only hold memory (rows
            // that decode again later are stacked afresh).
            drop(self.stacks.take(l));
            None
        } else {
            Some(self.delta_decode(l, d, &dims, rows, &decoding, &starts, qkv, &log_g, &beta)?)
        };
        let mut outs = Vec::with_capacity(rows.len());
        let mut next_decoded = 0i32;
        for (r, row) in rows.iter_mut().enumerate() {
            let t = lens[r] as i32;
            if t == 1 {
                if let Some(all) = &decoded {
                    outs.push(all.index(next_decoded..next_decoded + 1));
                }
                next_decoded += 1;
            } else if t > 1 {
                let s = starts[r];
                let pick = |a: &Array| a.index(s..s + t);
                outs.push(self.delta_prefill(
                    l,
                    d,
                    &dims,
                    row.cache,
                    &pick(qkv),
                    &pick(&log_g),
                    &pick(&beta),
                )?);
            }
        }
        let y = match (&decoded, decoding.len() == rows.len()) {
            (Some(all), true) => all.clone(),
            _ if outs.len() == 1 => outs.remove(0),
            _ => ops::concatenate(&outs, 0)?,
        }; // [N, H_v, D_v], float32
        let y = y.as_dtype(self.dtype)?;
        // The gated RMSNorm (mlx-lm's `precise_swiglu`: the product in
        // float32).
        let normed = fast::rms_norm(&y, Some(&d.norm), self.config.rms_norm_eps)?;
        let z = z.reshape(&[n, hv, dv])?.as_dtype(Dtype::Float32)?;
        let gated = ops::multiply(gated_delta::silu(&z)?, normed.as_dtype(Dtype::Float32)?)?;
        let gated = gated.as_dtype(self.dtype)?.reshape(&[n, hv * dv])?;
        d.out_proj.forward_with(&gated, self.layer_kernel)
    }

    /// Splits a conv output `[T, C]` into queries and keys (`[T, H_v,
    /// D_k]`, L2-normalised as mlx-lm's `normalize_qk`, repeated to the
    /// value heads) and values (`[T, H_v, D_v]`).
    fn split_qkv(&self, dims: &DeltaDims, conv: &Array) -> Result<(Array, Array, Array)> {
        let t = conv.shape()[0];
        let (hk, dk) = (dims.key_heads as i32, dims.key_dim as i32);
        let (hv, dv) = (dims.value_heads as i32, dims.value_dim as i32);
        let kw = hk * dk;
        let q = conv.index((.., ..kw)).reshape(&[t, hk, dk])?;
        let k = conv.index((.., kw..2 * kw)).reshape(&[t, hk, dk])?;
        let v = conv.index((.., 2 * kw..)).reshape(&[t, hv, dv])?;
        let inv = (dk as f32).powf(-0.5);
        let eps = 1e-6 * inv * inv;
        let q = ops::multiply(self.scalar(inv * inv)?, fast::rms_norm(&q, None, eps)?)?;
        let k = ops::multiply(self.scalar(inv)?, fast::rms_norm(&k, None, eps)?)?;
        let factor = hv / hk;
        Ok((
            gated_delta::repeat_heads(&q, factor, 1)?,
            gated_delta::repeat_heads(&k, factor, 1)?,
            v,
        ))
    }

    /// One row's prompt chunk through the conv and the chunked rule:
    /// `qkv: [T, C]`, `log_g`, `beta: [T, H_v]` -> `[T, H_v, D_v]`
    /// (float32); sets the row's state.
    #[allow(clippy::too_many_arguments)]
    fn delta_prefill(
        &self,
        l: usize,
        d: &GatedDeltaNet,
        dims: &DeltaDims,
        cache: &mut KvCache,
        qkv: &Array,
        log_g: &Array,
        beta: &Array,
    ) -> Result<Array> {
        let t = qkv.shape()[0];
        let (conv_state, ssm) = match cache.state(l) {
            Some(s) => (s.conv.clone(), s.ssm.index(0)),
            None => (self.zero_conv(dims, 1)?, self.zero_ssm(dims, 1)?.index(0)),
        };
        let x = qkv.reshape(&[1, t, dims.conv_width() as i32])?;
        // The conv's inputs one token before the end: a checkpoint there
        // lets the same prompt resent resume one token before its end.
        let k = dims.conv_kernel as i32 - 1;
        let conv_before =
            ops::concatenate(&[&conv_state, &x], 1)?.index((.., t - 1..t - 1 + k, ..));
        let (conv, conv_state) = gated_delta::causal_conv(&x, &conv_state, &d.conv_weight)?;
        let (q, kk, v) = self.split_qkv(dims, &conv.index(0))?;
        // The chunked rule up to the last token, then one recurrent step:
        // the state before the last token comes out on the way.
        let head = |a: &Array| a.index(..t - 1);
        let last = |a: &Array| a.index(t - 1..t);
        let (y_head, before) = gated_delta::chunked(
            &head(&q),
            &head(&kk),
            &head(&v),
            &head(log_g),
            &head(beta),
            &ssm,
        )?;
        let f32 = Dtype::Float32;
        let (y_last, ssm) = gated_delta::recurrent(
            &last(&q).as_dtype(f32)?,
            &last(&kk).as_dtype(f32)?,
            &last(&v).as_dtype(f32)?,
            &ops::exp(last(log_g))?,
            &last(beta),
            &before.expand_dims(0)?,
        )?;
        cache.set_state_before_end(l, LayerState::new(conv_before, before.expand_dims(0)?));
        cache.set_state(l, LayerState::new(conv_state, ssm))?;
        Ok(ops::concatenate(&[y_head, y_last], 0)?)
    }

    /// The rows in `decoding` (one token each) through the conv and one
    /// recurrent step together, their states one `[B, ...]` batch
    /// ([`Stacked`]: the last step's stack as it is, its rows still here
    /// gathered, rows that joined appended); each row's new state is its
    /// row of the new stack. Returns `[B, H_v, D_v]` (float32) in
    /// `decoding`'s order.
    #[allow(clippy::too_many_arguments)]
    fn delta_decode(
        &self,
        l: usize,
        d: &GatedDeltaNet,
        dims: &DeltaDims,
        rows: &mut [RowInput<'_>],
        decoding: &[usize],
        starts: &[i32],
        qkv: &Array,
        log_g: &Array,
        beta: &Array,
    ) -> Result<Array> {
        let prior = self.stacks.take(l);
        // Each decoding row's row in the last step's stack, if it is one.
        let slots: Vec<Option<usize>> = decoding
            .iter()
            .map(|&r| {
                let slot = rows[r].cache.state(l).and_then(|s| s.slot)?;
                let prior = prior.as_ref()?;
                (slot.stack == prior.id).then_some(slot.row)
            })
            .collect();
        // The step's row order: the stacked rows first, then the others
        // (each group in `decoding`'s order).
        let order: Vec<usize> = (0..decoding.len())
            .filter(|&j| slots[j].is_some())
            .chain((0..decoding.len()).filter(|&j| slots[j].is_none()))
            .collect();
        let in_order = order.iter().enumerate().all(|(i, &j)| i == j);
        let b = decoding.len() as i32;
        let all = decoding.len() == rows.len() && in_order;
        let pick = |a: &Array| -> Result<Array> {
            if all {
                return Ok(a.clone());
            }
            let idx: Vec<i32> = order.iter().map(|&j| starts[decoding[j]]).collect();
            Ok(a.take_axis(Array::from_slice(&idx, &[b]), 0)?)
        };
        // States of the stacked rows, taken from the stack.
        let kept: Vec<usize> = order.iter().filter_map(|&j| slots[j]).collect();
        let mut convs = Vec::new();
        let mut ssms = Vec::new();
        if let Some(prior) = prior.as_ref().filter(|_| !kept.is_empty()) {
            let whole = kept.len() == prior.ssm.shape()[0] as usize
                && kept.iter().enumerate().all(|(i, &r)| i == r);
            if whole {
                convs.push(prior.conv.clone());
                ssms.push(prior.ssm.clone());
            } else {
                let idx: Vec<i32> = kept.iter().map(|&r| r as i32).collect();
                let idx = Array::from_slice(&idx, &[idx.len() as i32]);
                convs.push(prior.conv.take_axis(&idx, 0)?);
                ssms.push(prior.ssm.take_axis(&idx, 0)?);
            }
        }
        // Rows that joined: their own states (zeros before their first
        // token).
        for &j in order.iter().filter(|&&j| slots[j].is_none()) {
            match rows[decoding[j]].cache.state(l) {
                Some(s) => {
                    convs.push(s.conv.clone());
                    ssms.push(s.ssm.clone());
                }
                None => {
                    convs.push(self.zero_conv(dims, 1)?);
                    ssms.push(self.zero_ssm(dims, 1)?);
                }
            }
        }
        let stack = |mut parts: Vec<Array>| -> Result<Array> {
            Ok(match parts.len() {
                1 => parts.remove(0),
                _ => ops::concatenate(&parts, 0)?,
            })
        };
        let conv_state = stack(convs)?;
        let ssm = stack(ssms)?;
        let x = pick(qkv)?.expand_dims(1)?; // [B, 1, C]
        let (conv, conv_state) = gated_delta::causal_conv(&x, &conv_state, &d.conv_weight)?;
        let (q, k, v) = self.split_qkv(dims, &conv.index((.., 0, ..)))?;
        let f32 = Dtype::Float32;
        let g = ops::exp(pick(log_g)?)?;
        let (y, ssm) = gated_delta::recurrent(
            &q.as_dtype(f32)?,
            &k.as_dtype(f32)?,
            &v.as_dtype(f32)?,
            &g,
            &pick(beta)?,
            &ssm,
        )?;
        let id = NEXT_STACK.fetch_add(1, Ordering::Relaxed);
        for (i, &j) in order.iter().enumerate() {
            let at = i as i32;
            let (conv, ssm) = match b {
                1 => (conv_state.clone(), ssm.clone()),
                _ => (conv_state.index(at..at + 1), ssm.index(at..at + 1)),
            };
            let state = LayerState {
                conv,
                ssm,
                slot: Some(StackSlot { stack: id, row: i }),
            };
            rows[decoding[j]].cache.set_state(l, state)?;
        }
        self.stacks.put(
            l,
            Stacked {
                id,
                conv: conv_state,
                ssm,
            },
        );
        if in_order {
            return Ok(y);
        }
        // Back to `decoding`'s order.
        let mut inverse = vec![0i32; order.len()];
        for (i, &j) in order.iter().enumerate() {
            inverse[j] = i as i32;
        }
        Ok(y.take_axis(Array::from_slice(&inverse, &[b]), 0)?)
    }

    /// A fresh conv state for `b` rows, `[b, K - 1, C]` (zeros, as mlx-lm
    /// starts one).
    fn zero_conv(&self, dims: &DeltaDims, b: i32) -> Result<Array> {
        let shape = [b, dims.conv_kernel as i32 - 1, dims.conv_width() as i32];
        Ok(ops::zeros_dtype(&shape, self.dtype)?)
    }

    /// A fresh recurrent state for `b` rows, `[b, H_v, D_v, D_k]` float32.
    fn zero_ssm(&self, dims: &DeltaDims, b: i32) -> Result<Array> {
        let shape = [
            b,
            dims.value_heads as i32,
            dims.value_dim as i32,
            dims.key_dim as i32,
        ];
        Ok(ops::zeros::<f32>(&shape)?)
    }

    /// Gated full attention for all rows: `x: [N, H]` -> `[N, H]`.
    fn attention(
        &self,
        l: usize,
        a: &GatedAttention,
        x: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
        positions: &Array,
    ) -> Result<Array> {
        let c = &self.config;
        let d = c.head_dim() as i32;
        let (nh, nkv) = (c.num_attention_heads as i32, c.num_key_value_heads as i32);
        let n = x.shape()[0];
        let qkv = a.qkv.forward(x, self.layer_kernel)?;
        // Each head's query, then its gate (mlx-lm splits `[N, heads, 2D]`).
        let qg = qkv[0].reshape(&[n, nh, 2 * d])?;
        let q = qg.index((.., .., ..d));
        let gate = qg.index((.., .., d..)).reshape(&[n, nh * d])?;
        let eps = c.rms_norm_eps;
        let rotary = c.linear_attn.rotary_dims(c.head_dim()) as i32;
        let rope = |t: &Array, heads: i32, norm: &Array| -> Result<Array> {
            let t = fast::rms_norm(t.reshape(&[n, heads, 1, d])?, Some(norm), eps)?;
            Ok(fast::rope_dynamic(
                t,
                rotary,
                false,
                c.rope_theta,
                1.0,
                positions,
                None,
            )?)
        };
        let q = rope(&q, nh, &a.q_norm)?;
        let k = rope(&qkv[1], nkv, &a.k_norm)?;
        let v = qkv[2].reshape(&[n, nkv, 1, d])?;
        let out = ragged::attend_rows(
            l,
            LayerKind::Full,
            &q,
            Some((&k, &v)),
            rows,
            lens,
            (nh, nkv, d),
            1.0 / (d as f32).sqrt(),
            None,
        )?;
        let gated = ops::multiply(&out, ops::sigmoid(&gate)?)?;
        a.o_proj.forward_with(&gated, self.layer_kernel)
    }

    /// A fresh cache for one row: recurrent state for the DeltaNet layers,
    /// full KV for the others.
    pub fn new_cache(&self) -> KvCache {
        KvCache::with_kinds(&config::layer_kinds(&self.config))
    }

    /// Every parameter array.
    pub fn parameters(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.embed.0.tensors().into_iter().map(|(_, a)| a).collect();
        for layer in &self.layers {
            out.extend([&layer.input_norm, &layer.post_attention_norm]);
            let mut linears: Vec<&Linear> = Vec::new();
            match &layer.mixer {
                Mixer::Delta(d) => {
                    out.extend([&d.conv_weight, &d.neg_a, &d.dt_bias, &d.norm]);
                    linears.extend(d.in_proj.linears());
                    linears.push(&d.out_proj);
                }
                Mixer::Attention(a) => {
                    out.extend([&a.q_norm, &a.k_norm]);
                    linears.extend(a.qkv.linears());
                    linears.push(&a.o_proj);
                }
            }
            match &layer.mlp {
                FeedForward::Dense(mlp) => {
                    linears.extend(mlp.gate_up.linears());
                    linears.push(&mlp.down_proj);
                }
                FeedForward::Sparse(m) => {
                    let SharedExpertMoe {
                        moe,
                        shared,
                        shared_gate,
                    } = m.as_ref();
                    out.extend(moe.tensors());
                    linears.extend(shared.gate_up.linears());
                    linears.extend([&shared.down_proj, shared_gate]);
                }
            }
            for lin in linears {
                out.extend(lin.tensors().into_iter().map(|(_, a)| a));
            }
        }
        out.push(&self.norm);
        if let Some(head) = &self.lm_head {
            out.extend(head.tensors().into_iter().map(|(_, a)| a));
        }
        out
    }
}
