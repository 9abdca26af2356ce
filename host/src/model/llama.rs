//! Llama-family decoder (RoPE, GQA, RMSNorm, SwiGLU, optionally tied
//! embeddings, optional q/k/v biases, optional per-head q/k RMSNorm, dense
//! or mixture-of-experts MLPs) over a ragged batch of rows: the `llama`,
//! `qwen2`, `qwen3` and `qwen3_moe` architectures.
//!
//! Follows mlx-lm's `mlx_lm/models/llama.py`, `qwen2.py`, `qwen3.py` and
//! `qwen3_moe.py` (Hugging Face half-split RoPE layout; llama GGUF weights
//! are un-permuted at load, qwen2 GGUFs already use that layout; the sparse
//! MLP is [`super::moe`]). A forward pass takes any
//! number of rows, each with its own new tokens and its own [`KvCache`]: the
//! rows' tokens are packed into one `[N, H]` activation so every linear layer
//! runs once for the batch, and attention runs per row against that row's
//! cache. Rows may differ in length and cache offset, which is what
//! continuous batching needs (prefill of one row beside decode of others).

use mlx_rs::{
    fast,
    ops::{self, indexing::IndexOp},
    Array, Dtype,
};

use super::config::ModelConfig;
use super::cpu_quant::Kernel;
use super::cpu_swiglu;
use super::cuda_fused;
use super::decode_layer::{decode_layer, FusedLayer, LayerShape};
use super::error::{ModelError, Result};
use super::linear::{Embedding, Linear};
use super::lora::{LoraAdapter, LoraTargets, Module, Slot, StepLora};
use super::moe::SparseMoe;
use super::ragged;
use crate::cache::slab::{self, DecodeSlab, SlabStep};
use crate::cache::{KvCache, LayerKind};

/// Several projections of the same input, fused into one matrix product
/// when their storage allows (see [`Linear::fuse`]).
#[derive(Debug, Clone)]
pub enum Projections {
    /// One product; outputs split at these widths.
    Fused(Linear, Vec<i32>),
    /// Separate products (mixed quantization).
    Separate(Vec<Linear>),
}

impl Projections {
    /// Fuses `parts` when possible. Output widths are read from the parts.
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let widths = parts.iter().map(Linear::out_features).collect::<Vec<_>>();
        Ok(match Linear::fuse(&parts)? {
            Some(fused) => Projections::Fused(fused, widths),
            None => Projections::Separate(parts),
        })
    }

    /// `x: [N, in]` -> one `[N, out_i]` per part (`kernel`: see
    /// [`Linear::forward_with`]).
    pub fn forward(&self, x: &Array, kernel: Kernel) -> Result<Vec<Array>> {
        self.forward_biased(x, kernel, None)
    }

    /// As [`Projections::forward`], adding `bias` (`[sum of out_i]`, the
    /// parts' biases concatenated) to the products.
    pub fn forward_biased(
        &self,
        x: &Array,
        kernel: Kernel,
        bias: Option<&Array>,
    ) -> Result<Vec<Array>> {
        match self {
            Projections::Separate(parts) => {
                let mut start = 0;
                let mut out = Vec::with_capacity(parts.len());
                for p in parts {
                    let y = p.forward_with(x, kernel)?;
                    let w = p.out_features();
                    out.push(match bias {
                        Some(b) => ops::add(&y, b.index(start..start + w))?,
                        None => y,
                    });
                    start += w;
                }
                Ok(out)
            }
            Projections::Fused(lin, widths) => {
                let y = Self::biased(lin.forward_with(x, kernel)?, bias)?;
                let mut out = Vec::with_capacity(widths.len());
                let mut start = 0;
                for w in widths {
                    out.push(y.index((.., start..start + w)));
                    start += w;
                }
                Ok(out)
            }
        }
    }

    /// The fused product itself, `[N, sum of out_i]` (parts side by side in
    /// order, `bias` added), with the parts' widths; `None` for separate
    /// products.
    pub fn forward_joined(
        &self,
        x: &Array,
        kernel: Kernel,
        bias: Option<&Array>,
    ) -> Result<Option<(Array, &[i32])>> {
        match self {
            Projections::Separate(_) => Ok(None),
            Projections::Fused(lin, widths) => Ok(Some((
                Self::biased(lin.forward_with(x, kernel)?, bias)?,
                widths,
            ))),
        }
    }

    fn biased(y: Array, bias: Option<&Array>) -> Result<Array> {
        Ok(match bias {
            Some(b) => ops::add(&y, b)?,
            None => y,
        })
    }

    /// The underlying layers.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Projections::Fused(l, _) => vec![l],
            Projections::Separate(p) => p.iter().collect(),
        }
    }
}

/// One decoder layer's parameters.
#[derive(Debug, Clone)]
pub struct Layer {
    /// RMSNorm weight before attention, `[H]`.
    pub input_norm: Array,
    /// RMSNorm weight before the MLP, `[H]`.
    pub post_attention_norm: Array,
    /// `q_proj` `[n_heads*D, H]`, `k_proj`/`v_proj` `[n_kv*D, H]`.
    pub qkv: Projections,
    /// q/k/v biases concatenated, `[(n_heads + 2 n_kv) * D]` in the
    /// activation dtype (Qwen2); `None` for Llama.
    pub qkv_bias: Option<Array>,
    /// Qwen3's RMSNorm weights over each query / key head, `[D]`.
    pub q_norm: Option<Array>,
    /// See `q_norm`.
    pub k_norm: Option<Array>,
    /// `o_proj`: `[H, n_heads * D]`.
    pub o_proj: Linear,
    /// The MLP after attention.
    pub mlp: Mlp,
}

/// A decoder layer's MLP.
#[derive(Debug, Clone)]
pub enum Mlp {
    /// One SwiGLU MLP for every token.
    Dense(DenseMlp),
    /// Each token through its top-k experts (Qwen3-MoE's sparse layers).
    Sparse(SparseMoe),
}

/// The SwiGLU MLP `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct DenseMlp {
    /// `gate_proj`, `up_proj`: `[I, H]` each.
    pub gate_up: Projections,
    /// `down_proj`: `[H, I]`.
    pub down_proj: Linear,
}

impl DenseMlp {
    /// The MLP width (`down_proj`'s inputs).
    pub fn down_proj_inputs(&self) -> i32 {
        match &self.gate_up {
            Projections::Fused(_, widths) => widths.first().copied().unwrap_or(0),
            Projections::Separate(parts) => parts.first().map_or(0, Linear::out_features),
        }
    }
}

impl Mlp {
    /// Every linear layer's parameters.
    fn tensors(&self) -> Vec<&Array> {
        match self {
            Mlp::Dense(d) => {
                let mut linears = d.gate_up.linears();
                linears.push(&d.down_proj);
                linears
                    .into_iter()
                    .flat_map(|lin| lin.tensors().into_iter().map(|(_, a)| a))
                    .collect()
            }
            Mlp::Sparse(moe) => moe.tensors(),
        }
    }
}

/// The whole model's parameters plus its compute dtype.
#[derive(Debug, Clone)]
pub struct Llama {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Token embedding `[V, H]`.
    pub embed: Embedding,
    /// Decoder layers.
    pub layers: Vec<Layer>,
    /// Final RMSNorm weight `[H]`.
    pub norm: Array,
    /// Untied output head `[V, H]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    /// Activation dtype (float16 on the native 4-bit path, float32 on the
    /// dequantized path).
    pub dtype: Dtype,
    /// Every layer's tensors for the fused decode op
    /// ([`super::decode_layer`]), when every layer qualifies (see
    /// [`Llama::with_fused_decode`]); `None`: decode runs through MLX ops.
    pub fused_decode: Option<Vec<FusedLayer>>,
    /// CPU kernel for the decoder layers' decode-sized quantized products
    /// ([`Kernel::for_layers`] on the quantized path, else
    /// [`Kernel::Float`]). The output head always takes the exact float32
    /// kernel: int8 activations there alone moved logprobs by ~0.09 nats.
    pub layer_kernel: Kernel,
    /// Where decode rows keep their KV on GPU backends
    /// ([`crate::cache::slab`]): one attention op per layer for all rows.
    pub decode_slab: DecodeSlab,
    /// Tensor parallelism: this rank's group when the weights are one
    /// rank's shard ([`crate::distributed::shard`]). The o_proj and
    /// down_proj partial products are summed over ranks, every rank
    /// evaluates the residual stream before the head (so all run the same
    /// collectives in the same order), and only rank 0 computes logits.
    pub tp: Option<std::sync::Arc<crate::distributed::Group>>,
}

/// One row of a ragged forward pass.
pub struct RowInput<'a> {
    /// New tokens for this row (prompt chunk or one decode token).
    pub tokens: &'a [u32],
    /// The row's cache; its offset is the position of `tokens[0]`.
    pub cache: &'a mut KvCache,
    /// Index into `tokens` from which logits are returned
    /// (`tokens.len() - 1` for the last position only; `tokens.len()` for none).
    pub logits_from: usize,
    /// The LoRA adapter the row runs with (`None`: the base model). Only
    /// architectures with [`super::CausalLm::lora_targets`] honour it.
    pub lora: Option<&'a LoraAdapter>,
}

impl Llama {
    /// Runs the rows' new tokens through the model, extending each row's
    /// cache, and returns per row the logits `[n, V]` (float32, lazy) for
    /// positions `logits_from..tokens.len()`. With `device_ids` (`[N]`
    /// uint32, lazy) the packed token ids come from it instead of the rows'
    /// `tokens` (see [`super::CausalLm::forward_device_ids`]).
    ///
    /// Errors: [`ModelError::TokenOutOfRange`] for an id `>= vocab_size`;
    /// MLX errors from graph construction.
    pub fn forward_ids(
        &self,
        rows: &mut [RowInput<'_>],
        device_ids: Option<&Array>,
    ) -> Result<Vec<Array>> {
        let vocab = self.config.vocab_size;
        // Rows with an adapter too: the op adds their deltas after each
        // product.
        if let Some(fused) = &self.fused_decode {
            // The fused op reads float and quantized caches (`--kv-bits`),
            // one scheme per step: every row of a model shares it.
            let scheme = rows.first().map(|r| r.cache.quant());
            let one_scheme = rows.iter().all(|r| Some(r.cache.quant()) == scheme);
            if !rows.is_empty() && one_scheme && rows.iter().all(|r| r.tokens.len() == 1) {
                return self.forward_fused_decode(fused, rows, device_ids);
            }
        }
        let Some(ragged::Packed {
            ids,
            lens,
            positions,
        }) = ragged::pack(rows, vocab)?
        else {
            return Ok(ragged::no_logits(rows.len(), vocab));
        };
        let ids = device_ids.cloned().unwrap_or(ids);
        let adapters: Vec<Option<&LoraAdapter>> = rows.iter().map(|r| r.lora).collect();
        let lora = StepLora::new(&adapters, &lens);
        let lora = lora.as_ref();
        let mut slab = self.begin_slab_step(rows)?;
        let mut h = self.embed.lookup(&ids, self.dtype)?;
        let eps = self.config.rms_norm_eps;
        let fused = cuda_fused::available(self.dtype);
        let mut x = match self.layers.first() {
            Some(first) => fast::rms_norm(&h, Some(&first.input_norm), eps)?,
            None => h.clone(),
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let attn =
                self.attention(l, layer, &x, rows, &lens, &positions, slab.as_mut(), lora)?;
            let mut o = self.tp_sum(layer.o_proj.forward_with(&attn, self.layer_kernel)?)?;
            if let Some(lora) = lora {
                o = lora.add(l, Slot::O, &attn, o)?;
            }
            (h, x) = add_rms_norm(&h, &o, &layer.post_attention_norm, eps, fused)?;
            let down = match &layer.mlp {
                Mlp::Dense(mlp) => {
                    let act = match lora {
                        Some(lora) => self.swiglu_lora(mlp, &x, l, lora)?,
                        None => self.swiglu(mlp, &x, fused)?,
                    };
                    let down = mlp.down_proj.forward_with(&act, self.layer_kernel)?;
                    match lora {
                        Some(lora) => lora.add(l, Slot::Down, &act, down)?,
                        None => down,
                    }
                }
                Mlp::Sparse(moe) => moe.forward(&x)?,
            };
            let down = self.tp_sum(down)?;
            // The residual add and the next layer's input norm, as one kernel
            // where fused; the last layer's norm is the head's.
            match self.layers.get(l + 1) {
                Some(next) => (h, x) = add_rms_norm(&h, &down, &next.input_norm, eps, fused)?,
                None => h = ops::add(&h, &down)?,
            }
        }
        drop(slab);
        for (row, &t) in rows.iter_mut().zip(&lens) {
            row.cache.advance(t);
        }
        if let Some(group) = &self.tp {
            // Every rank evaluates the same graph (the stream and every
            // row's cache) here, so the collectives in it pair up; what
            // the caller evaluates later (the head) has none.
            let mut arrays: Vec<&Array> = vec![&h];
            for row in rows.iter() {
                arrays.extend(row.cache.arrays());
            }
            mlx_rs::transforms::eval(arrays)?;
            if group.rank() != 0 {
                return Ok(ragged::no_logits(rows.len(), vocab));
            }
        }
        self.head(&h, rows, &lens)
    }

    /// `x` summed over the tensor-parallel ranks (a row-parallel product's
    /// partial sums); `x` itself on one rank.
    fn tp_sum(&self, x: Array) -> Result<Array> {
        match &self.tp {
            Some(group) => Ok(group.all_sum(&x)?),
            None => Ok(x),
        }
    }

    /// The MLP's activation `silu(gate) * up` of `x: [N, E]` -> `[N, I]`:
    /// one fused CUDA kernel over the fused gate/up product where `fused`
    /// ([`cuda_fused::available`]), one CPU op over it on the CPU backend
    /// ([`cpu_swiglu`]), else MLX's ops.
    fn swiglu(&self, mlp: &DenseMlp, x: &Array, fused: bool) -> Result<Array> {
        if fused {
            if let Projections::Fused(lin, widths) = &mlp.gate_up {
                if widths.len() == 2 && widths[0] == widths[1] {
                    return cuda_fused::swiglu(&lin.forward_with(x, self.layer_kernel)?);
                }
            }
        }
        if let Projections::Fused(lin, widths) = &mlp.gate_up {
            if widths.len() == 2 && widths[0] == widths[1] {
                let gu = lin.forward_with(x, self.layer_kernel)?;
                if cpu_swiglu::applies(&gu) {
                    return cpu_swiglu::swiglu_rows(&gu);
                }
            }
        }
        let gu = mlp.gate_up.forward(x, self.layer_kernel)?;
        let (gate, up) = (&gu[0], &gu[1]);
        Ok(ops::multiply(
            ops::multiply(gate, ops::sigmoid(gate)?)?,
            up,
        )?)
    }

    /// [`Llama::swiglu`] with the step's LoRA delta added to the gate/up
    /// product before the activation.
    fn swiglu_lora(&self, mlp: &DenseMlp, x: &Array, l: usize, lora: &StepLora) -> Result<Array> {
        let Some(delta) = lora.delta(l, Slot::GateUp, x)? else {
            return self.swiglu(mlp, x, false);
        };
        let gu = match &mlp.gate_up {
            Projections::Fused(lin, _) => lin.forward_with(x, self.layer_kernel)?,
            Projections::Separate(_) => {
                ops::concatenate(&mlp.gate_up.forward(x, self.layer_kernel)?, 1)?
            }
        };
        let gu = ops::add(&gu, &delta)?;
        if cpu_swiglu::applies(&gu) {
            return cpu_swiglu::swiglu_rows(&gu);
        }
        let i = gu.shape()[1] / 2;
        let (gate, up) = (gu.index((.., 0..i)), gu.index((.., i..)));
        Ok(ops::multiply(
            ops::multiply(&gate, ops::sigmoid(&gate)?)?,
            &up,
        )?)
    }

    /// The products adapters may adapt: every layer's q/k/v and o, and a
    /// dense MLP's gate/up and down (not a mixture of experts').
    pub fn lora_targets(&self) -> LoraTargets {
        let c = &self.config;
        let (e, d) = (c.hidden_size as i32, c.head_dim() as i32);
        let (q, kv) = (
            c.num_attention_heads as i32 * d,
            c.num_key_value_heads as i32 * d,
        );
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let mut m = std::collections::HashMap::from([
                    (Module::Q, (e, q)),
                    (Module::K, (e, kv)),
                    (Module::V, (e, kv)),
                    (Module::O, (q, e)),
                ]);
                if let Mlp::Dense(mlp) = &layer.mlp {
                    let i = mlp.down_proj_inputs();
                    m.insert(Module::Gate, (e, i));
                    m.insert(Module::Up, (e, i));
                    m.insert(Module::Down, (i, e));
                }
                m
            })
            .collect();
        LoraTargets {
            layers,
            dtype: self.dtype,
        }
    }

    /// Starts the step's use of the decode slab ([`crate::cache::slab`])
    /// when it is enabled and some row decodes one token; a row feeding
    /// more takes its KV back out of the slab first.
    fn begin_slab_step(&self, rows: &mut [RowInput<'_>]) -> Result<Option<SlabStep<'_>>> {
        if !slab::enabled() {
            return Ok(None);
        }
        // The slab holds float rows: quantized rows (`--kv-bits`) keep their
        // own buffers and attend per row over their packed rows.
        if rows.iter().any(|r| r.cache.quant().is_some()) {
            for row in rows.iter_mut() {
                row.cache.detach();
            }
            return Ok(None);
        }
        let lens: Vec<usize> = rows
            .iter()
            .filter(|r| r.tokens.len() == 1)
            .map(|r| r.cache.offset())
            .collect();
        // Rows outside the slab this step (prompt chunks, or every row when
        // the slab would be mostly padding) take their KV back first; so do
        // rows of another model's slab.
        let batch = DecodeSlab::worth_batching(&lens);
        let mut decoding: Vec<&mut KvCache> = Vec::new();
        for row in rows.iter_mut() {
            if batch && row.tokens.len() == 1 {
                if self.decode_slab.is_foreign(row.cache) {
                    row.cache.detach();
                }
                decoding.push(&mut *row.cache);
            } else {
                row.cache.detach();
            }
        }
        if decoding.is_empty() {
            return Ok(None);
        }
        let c = &self.config;
        let like = ops::zeros_dtype(
            &[1, c.num_key_value_heads as i32, 1, c.head_dim() as i32],
            self.dtype,
        )?;
        Ok(Some(self.decode_slab.begin(
            &mut decoding,
            self.layers.len(),
            &like,
        )?))
    }

    /// Decode step through the fused layer op: every row feeds one token.
    fn forward_fused_decode(
        &self,
        fused: &[FusedLayer],
        rows: &mut [RowInput<'_>],
        device_ids: Option<&Array>,
    ) -> Result<Vec<Array>> {
        let vocab = self.config.vocab_size;
        let mut ids = Vec::with_capacity(rows.len());
        for row in rows.iter() {
            let id = row.tokens[0];
            if id as usize >= vocab {
                return Err(ModelError::TokenOutOfRange { id, vocab });
            }
            ids.push(id);
        }
        let c = &self.config;
        let shape = LayerShape {
            heads: c.num_attention_heads as i32,
            kv_heads: c.num_key_value_heads as i32,
            head_dim: c.head_dim() as i32,
            eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            kv: None,
        };
        let positions: Vec<i32> = rows.iter().map(|r| r.cache.offset() as i32).collect();
        // What a row's cache buffers look like (dtype, heads, width).
        let like = Array::zeros::<f32>(&[1, shape.kv_heads, 1, shape.head_dim])?;
        let ids = match device_ids {
            Some(d) => d.clone(),
            None => Array::from_slice(&ids, &[ids.len() as i32]),
        };
        let adapters: Vec<Option<&LoraAdapter>> = rows.iter().map(|r| r.lora).collect();
        let lora = StepLora::new(&adapters, &vec![1; rows.len()]);
        let mut h = self.embed.lookup(&ids, self.dtype)?;
        for (l, layer) in fused.iter().enumerate() {
            let lora = lora.as_ref().map(|s| s.fused(l, rows.len()));
            let mut caches = Vec::with_capacity(rows.len());
            let kv = rows.first().and_then(|r| r.cache.layer_quant(l));
            for row in rows.iter_mut() {
                let pos = row.cache.offset();
                caches.push(row.cache.take_layer(l, pos + 1, &like)?);
            }
            let (out, updated) = decode_layer(
                &h,
                layer,
                LayerShape { kv, ..shape },
                caches,
                &positions,
                self.layer_kernel,
                lora.as_ref(),
            )?;
            for (row, (kb, vb)) in rows.iter_mut().zip(updated) {
                row.cache.put_layer(l, kb, vb);
            }
            h = out;
        }
        let lens = vec![1usize; rows.len()];
        for row in rows.iter_mut() {
            row.cache.advance(1);
        }
        self.head(&h, rows, &lens)
    }

    /// The final norm and output head over each row's requested positions
    /// (`h: [N, E]`, rows' tokens in order).
    fn head(&self, h: &Array, rows: &[RowInput<'_>], lens: &[usize]) -> Result<Vec<Array>> {
        let eps = self.config.rms_norm_eps;
        ragged::head(h, rows, lens, self.config.vocab_size, |hs| {
            // Logits in float32: the output head's product is computed in
            // float32 where the quantized path allows (CPU), and log-softmax
            // over a float16 vocabulary loses ~0.01 nats.
            let hs = fast::rms_norm(hs, Some(&self.norm), eps)?.as_dtype(Dtype::Float32)?;
            Ok(match &self.lm_head {
                Some(head) => head.forward(&hs)?,
                None => self.embed.as_linear(&hs)?,
            }
            .as_dtype(Dtype::Float32)?)
        })
    }

    /// Self-attention for all rows: `x: [N, H]` -> `[N, n_heads * D]`.
    ///
    /// Head split and RoPE run once for all N tokens of all rows: each token
    /// is its own batch element `[N, heads, 1, D]` with its own position
    /// (`rope` with an offsets array), so a decode row costs only its cache
    /// update and its attention; MLX's CPU backend pays tens of microseconds
    /// per op, which per-row head reshapes and RoPE multiplied by rows x
    /// layers.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        layer: &Layer,
        x: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
        positions: &Array,
        slab: Option<&mut SlabStep<'_>>,
        lora: Option<&StepLora>,
    ) -> Result<Array> {
        let c = &self.config;
        let d = c.head_dim() as i32;
        let (nh, nkv) = (c.num_attention_heads as i32, c.num_key_value_heads as i32);
        let n = x.shape()[0];
        // Qwen3's per-head RMSNorm of q and k, then RoPE.
        let rope = |a: &Array, heads: i32, norm: Option<&Array>| {
            let norm = norm.map(|w| (w, c.rms_norm_eps));
            ragged::rope_heads(a, heads, d, norm, c.rope_theta, positions)
        };
        let bias = layer.qkv_bias.as_ref();
        // One token and no per-head q/k norm: q's and k's heads are one
        // contiguous run of the fused product, so one RoPE kernel serves both
        // (the same values; on a GPU a 1-row decode step is bound by its
        // kernel launches, 30 fewer here on SmolLM2).
        let delta = match lora {
            Some(lora) => lora.delta(l, Slot::Qkv, x)?,
            None => None,
        };
        let joined = if n == 1 && layer.q_norm.is_none() && layer.k_norm.is_none() {
            layer
                .qkv
                .forward_joined(x, self.layer_kernel, bias)?
                .map(|(y, w)| -> Result<(Array, &[i32])> {
                    Ok(match &delta {
                        Some(d) => (ops::add(&y, d)?, w),
                        None => (y, w),
                    })
                })
                .transpose()?
        } else {
            None
        };
        let (q, k, v) = match joined {
            Some((y, &[wq, wk, _])) => {
                let qk = rope(&y.index((.., 0..wq + wk)), nh + nkv, None)?;
                let v = y.index((.., wq + wk..));
                (qk.index((.., 0..nh)), qk.index((.., nh..)), v)
            }
            _ => {
                let mut qkv = layer.qkv.forward_biased(x, self.layer_kernel, bias)?;
                if let Some(d) = &delta {
                    let mut start = 0;
                    for part in qkv.iter_mut() {
                        let w = part.shape()[1];
                        *part = ops::add(&*part, d.index((.., start..start + w)))?;
                        start += w;
                    }
                }
                (
                    rope(&qkv[0], nh, layer.q_norm.as_ref())?,
                    rope(&qkv[1], nkv, layer.k_norm.as_ref())?,
                    qkv[2].clone(),
                )
            }
        };
        let v = v.reshape(&[n, nkv, 1, d])?;
        // Rows decoding one token go through one batched op: the decode slab
        // (GPU backends) or the in-place CPU op.
        let batched = slab.is_some() || super::decode_attention::enabled();
        let decode: Vec<bool> = lens.iter().map(|&t| t == 1 && batched).collect();
        let decoded = match slab {
            Some(step) => Some(self.attend_slab_rows(l, &q, &k, &v, lens, step)?),
            None if batched => self.attend_decode_rows(l, &q, &k, &v, rows, lens)?,
            None => None,
        };
        let mut decoded_rows = 0i32;
        let mut outs = Vec::with_capacity(rows.len());
        let mut start = 0i32;
        for ((row, &t), &batched) in rows.iter_mut().zip(lens).zip(&decode) {
            let end = start + t as i32;
            if batched {
                if let Some(all) = &decoded {
                    outs.push(all.index(decoded_rows..decoded_rows + 1));
                }
                decoded_rows += 1;
            } else if t > 0 {
                let part = |a: &Array, heads: i32| ragged::row_heads(a, start, t as i32, heads, d);
                outs.push(ragged::attend_row(
                    l,
                    LayerKind::Full,
                    &part(&q, nh)?,
                    &part(&k, nkv)?,
                    &part(&v, nkv)?,
                    row.cache,
                    1.0 / (d as f32).sqrt(),
                )?);
            }
            start = end;
        }
        // Every row decoded: the batched output is already in row order.
        if let (Some(all), true) = (&decoded, decoded_rows as usize == rows.len()) {
            return Ok(all.clone());
        }
        if outs.len() == 1 {
            return Ok(outs.remove(0));
        }
        Ok(ops::concatenate(&outs, 0)?)
    }

    /// Layer `l`'s attention for the rows that feed one token, through the
    /// decode slab: `[R, n_heads * D]` in row order.
    fn attend_slab_rows(
        &self,
        l: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        lens: &[usize],
        step: &mut SlabStep<'_>,
    ) -> Result<Array> {
        let c = &self.config;
        let d = c.head_dim() as i32;
        let pick = ragged::decode_rows_picker(lens);
        let out = step.attend(l, &pick(q)?, &pick(k)?, &pick(v)?, 1.0 / (d as f32).sqrt())?;
        let rows = out.shape()[0];
        Ok(out.reshape(&[rows, c.num_attention_heads as i32 * d])?)
    }

    /// The batched decode op over the rows that feed one token (see
    /// `model::decode_attention`): `[R, n_heads * D]` in row order, `None`
    /// when no row does. Updates those rows' caches.
    fn attend_decode_rows(
        &self,
        l: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
    ) -> Result<Option<Array>> {
        let c = &self.config;
        let d = c.head_dim() as i32;
        let scale = 1.0 / (d as f32).sqrt();
        let Some(out) = ragged::decode_rows_op(l, q, k, v, rows, lens, scale, false)? else {
            return Ok(None);
        };
        let count = out.shape()[0];
        Ok(Some(
            out.reshape(&[count, c.num_attention_heads as i32 * d])?,
        ))
    }

    /// Prepares the fused decode op ([`super::decode_layer`]) when it is
    /// enabled, the activations are float32 and every layer qualifies
    /// ([`FusedLayer::of`]); otherwise leaves decode on MLX ops.
    pub fn with_fused_decode(mut self) -> Self {
        self.fused_decode = None;
        // The fused op runs a whole layer, with no place for the all-sums.
        if self.dtype == Dtype::Float32 && super::decode_layer::enabled() && self.tp.is_none() {
            self.fused_decode = self.layers.iter().map(FusedLayer::of).collect();
        }
        self
    }

    /// A fresh cache for one row.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// Every parameter array (for evaluation after load and byte counts).
    pub fn parameters(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.embed.0.tensors().into_iter().map(|(_, a)| a).collect();
        for layer in &self.layers {
            out.push(&layer.input_norm);
            out.push(&layer.post_attention_norm);
            out.extend(&layer.qkv_bias);
            out.extend(&layer.q_norm);
            out.extend(&layer.k_norm);
            let mut linears = layer.qkv.linears();
            linears.push(&layer.o_proj);
            for lin in linears {
                out.extend(lin.tensors().into_iter().map(|(_, a)| a));
            }
            out.extend(layer.mlp.tensors());
        }
        out.push(&self.norm);
        if let Some(head) = &self.lm_head {
            out.extend(head.tensors().into_iter().map(|(_, a)| a));
        }
        out
    }

    /// Bytes of parameter storage.
    pub fn nbytes(&self) -> usize {
        self.parameters().iter().map(|a| a.nbytes()).sum()
    }
}

/// The residual add `h + y` and RMSNorm of the sum with weight `w`
/// (`[N, E]` each; returns `(sum, normed)`): one fused CUDA kernel where
/// `fused` ([`cuda_fused::available`]) and the three share a dtype, else
/// MLX's two ops.
fn add_rms_norm(h: &Array, y: &Array, w: &Array, eps: f32, fused: bool) -> Result<(Array, Array)> {
    // One thread block per row along the grid's y axis, which CUDA caps at
    // 65535 blocks.
    let rows_fit = h.shape().first().is_some_and(|&n| n <= 65_535);
    if fused && y.dtype() == h.dtype() && w.dtype() == h.dtype() && h.ndim() == 2 && rows_fit {
        return cuda_fused::add_rms_norm(h, y, w, eps);
    }
    let sum = ops::add(h, y)?;
    let normed = fast::rms_norm(&sum, Some(w), eps)?;
    Ok((sum, normed))
}
