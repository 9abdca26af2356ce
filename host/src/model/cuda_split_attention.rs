//! Decode attention over long contexts as two CUDA kernels of ours
//! (split-K, "flash-decoding"), JIT-compiled by MLX through NVRTC
//! ([`super::cuda_kernel`]): for the decode slab's float rows
//! ([`crate::cache::slab`]) and for one row's quantized cache (`--kv-bits`,
//! packed rows as [`crate::cache::quant`] stores them).
//!
//! Why: [`super::cuda_decode_attention`]'s kernel gives each (query head,
//! row) one thread block that walks every key. At 16k positions that is
//! 32 blocks per row each walking 16k keys one after another, so the card
//! waits on memory latency instead of streaming (an H100 took 144 ms per
//! batch-8 step of the Qwen3-8B shape at 16k, 6.5 ms at batch 1 through
//! MLX's SDPA), and each KV head's keys are read once per query head of
//! its group. And MLX 0.32.2's CUDA `quantized_matmul` (mlx-lm's quantized
//! SDPA) takes no strided packed rows, so a quantized cache needed a copy
//! of every layer's keys and values per step.
//!
//! Algorithm: the partial kernel gives each (KV head, row, split of
//! [`CHUNK`] keys) a block of 4 warps; each warp walks every 4th key of
//! the split holding `D / 32` of the head dimension per lane, reads each
//! key and value once for all `REP` query heads of the group, and keeps an
//! online softmax per head (running max and sum, Dao et al. 2022,
//! "FlashAttention"; the split-K form is Dao et al. 2023,
//! "Flash-Decoding"). The warps merge through shared memory and write the
//! split's unnormalized output, max and sum (float32). The combine kernel
//! merges the splits of each (query head, row) into the output. Quantized
//! rows are dequantized in registers (`scale * q + bias`, MLX's affine
//! scheme), never copied.
//!
//! Used only where a self-test on the instance in use ([`split_available`],
//! [`quantized_available`]: same dtype, head dimension, group size and
//! scheme) compiled and matched MLX's SDPA (float) or mlx-lm's quantized
//! SDPA (quantized) on random inputs; otherwise the callers keep those.
//! `MLXHOST_SPLIT_ATTENTION=off` switches both off.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use mlx_rs::{Array, Dtype};

use super::cuda_kernel::{float_bits, relative_diff, CudaKernel, TemplateArg};
use super::error::Result;
use crate::cache::KvQuant;

/// Keys per split: a block's share of one (KV head, row).
pub const CHUNK: i32 = 256;

/// Warps per partial block.
const WARPS: i32 = 4;

/// The partial kernel's body; `LOAD(ptr, j, dst)` (defined in the header
/// of each variant) fills `dst[PER]` with this lane's elements of key or
/// value `j`. MLX writes the signature: `q`, `keys`, `values`, `lens` in,
/// `part` out (`[R, H, splits, D + 2]` float32: output sums, max, sum; the
/// splits are the grid's z, since MLX passes shapes of inputs only).
const PARTIAL: &str = r#"
  constexpr int WARPS = 4;
  constexpr int PER = D / 32;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int hk = blockIdx.x;
  const int r = blockIdx.y;
  const int z = blockIdx.z;
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  const int H = q_shape[1];
  const int Hkv = keys_shape[1];
  const int cap = keys_shape[2];
  const int splits = gridDim.z;
  const int n = min(lens[r] + 1, cap);
  const int j0 = z * CHUNK;
  const int j1 = min(j0 + CHUNK, n);
  const float sc = __int_as_float(SCALE_BITS);
  const long long base = ((long long)r * Hkv + hk) * (long long)cap * ROW;
  const auto* kp = keys + base;
  const auto* vp = values + base;
  float qv[REP][PER];
  float o[REP][PER];
  float m[REP];
  float s[REP];
  for (int g = 0; g < REP; ++g) {
    const auto* qp = q + ((long long)r * H + hk * REP + g) * D;
    for (int i = 0; i < PER; ++i) {
      qv[g][i] = static_cast<float>(qp[lane * PER + i]) * sc;
      o[g][i] = 0.0f;
    }
    m[g] = NEG_INF;
    s[g] = 0.0f;
  }
  float x[PER];
  for (int j = j0 + w; j < j1; j += WARPS) {
    LOAD(kp, j, x);
    float dot[REP];
    for (int g = 0; g < REP; ++g) {
      dot[g] = 0.0f;
      for (int i = 0; i < PER; ++i) {
        dot[g] += qv[g][i] * x[i];
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      for (int g = 0; g < REP; ++g) {
        dot[g] += __shfl_xor_sync(0xffffffff, dot[g], off);
      }
    }
    LOAD(vp, j, x);
    for (int g = 0; g < REP; ++g) {
      const float m_new = fmaxf(m[g], dot[g]);
      const float corr = expf(m[g] - m_new);
      const float p = expf(dot[g] - m_new);
      s[g] = s[g] * corr + p;
      for (int i = 0; i < PER; ++i) {
        o[g][i] = o[g][i] * corr + p * x[i];
      }
      m[g] = m_new;
    }
  }
  __shared__ float sm_m[WARPS][REP];
  __shared__ float sm_s[WARPS][REP];
  __shared__ float sm_o[WARPS][REP][D];
  for (int g = 0; g < REP; ++g) {
    if (lane == 0) {
      sm_m[w][g] = m[g];
      sm_s[w][g] = s[g];
    }
    for (int i = 0; i < PER; ++i) {
      sm_o[w][g][lane * PER + i] = o[g][i];
    }
  }
  __syncthreads();
  // Warp g merges query head g of the group (and every further WARPS-th).
  for (int g = w; g < REP; g += WARPS) {
    float M = NEG_INF;
    for (int k = 0; k < WARPS; ++k) {
      M = fmaxf(M, sm_m[k][g]);
    }
    float S = 0.0f;
    float acc[PER];
    for (int i = 0; i < PER; ++i) {
      acc[i] = 0.0f;
    }
    for (int k = 0; k < WARPS; ++k) {
      const float c = (sm_m[k][g] == NEG_INF) ? 0.0f : expf(sm_m[k][g] - M);
      S += sm_s[k][g] * c;
      for (int i = 0; i < PER; ++i) {
        acc[i] += sm_o[k][g][lane * PER + i] * c;
      }
    }
    float* pp = part + (((long long)r * H + hk * REP + g) * splits + z) * (D + 2);
    for (int i = 0; i < PER; ++i) {
      pp[lane * PER + i] = acc[i];
    }
    if (lane == 0) {
      pp[D] = M;
      pp[D + 1] = S;
    }
  }
"#;

/// Float rows `[R, H_kv, capacity, D]` of type `T`.
const FLOAT_LOAD: &str = "#define ROW D\n\
     #define LOAD(ptr, j, dst) { const auto* row_ = (ptr) + (long long)(j) * D; \
     for (int i_ = 0; i_ < PER; ++i_) (dst)[i_] = static_cast<float>(row_[lane * PER + i_]); }\n";

/// Packed rows `[1, H_kv, capacity, P]` uint32 (`crate::cache::quant`):
/// `D * BITS / 32` words of codes, then `D / GROUP` scales and as many
/// biases (float32 bit patterns). A lane's `PER` elements share a group.
const QUANT_LOAD: &str = "#define QW (D * BITS / 32)\n\
     #define QG (D / GROUP)\n\
     #define ROW (QW + 2 * QG)\n\
     #define LOAD(ptr, j, dst) { const unsigned int* row_ = (const unsigned int*)((ptr) + (long long)(j) * ROW); \
     const int e0_ = lane * PER; const int g_ = e0_ / GROUP; \
     const float s_ = __uint_as_float(row_[QW + g_]); const float b_ = __uint_as_float(row_[QW + QG + g_]); \
     for (int i_ = 0; i_ < PER; ++i_) { const int e_ = e0_ + i_; \
     const unsigned int c_ = (row_[e_ * BITS / 32] >> ((e_ % (32 / BITS)) * BITS)) & ((1u << BITS) - 1u); \
     (dst)[i_] = s_ * static_cast<float>(c_) + b_; } }\n";

/// The combine kernel's body: `part` in, `out` (`[R, H, 1, D]`, `T`) out.
const COMBINE: &str = r#"
  constexpr int PER = D / 32;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int h = blockIdx.x;
  const int r = blockIdx.y;
  const int lane = threadIdx.x;
  const int H = part_shape[1];
  const int splits = part_shape[2];
  const float* pp = part + ((long long)r * H + h) * splits * (D + 2);
  float M = NEG_INF;
  for (int z = 0; z < splits; ++z) {
    M = fmaxf(M, pp[z * (D + 2) + D]);
  }
  float S = 0.0f;
  float acc[PER];
  for (int i = 0; i < PER; ++i) {
    acc[i] = 0.0f;
  }
  for (int z = 0; z < splits; ++z) {
    const float mz = pp[z * (D + 2) + D];
    const float c = (mz == NEG_INF) ? 0.0f : expf(mz - M);
    S += pp[z * (D + 2) + D + 1] * c;
    for (int i = 0; i < PER; ++i) {
      acc[i] += pp[z * (D + 2) + lane * PER + i] * c;
    }
  }
  T* op = out + ((long long)r * H + h) * D;
  for (int i = 0; i < PER; ++i) {
    op[lane * PER + i] = static_cast<T>(acc[i] / S);
  }
"#;

fn float_partial() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_split_attention_float",
            &["q", "keys", "values", "lens"],
            &["part"],
            PARTIAL,
            FLOAT_LOAD,
        )
    })
}

fn quantized_partial() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_split_attention_quantized",
            &["q", "keys", "values", "lens"],
            &["part"],
            PARTIAL,
            QUANT_LOAD,
        )
    })
}

fn combine() -> &'static CudaKernel {
    static K: OnceLock<CudaKernel> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "mlxhost_split_attention_combine",
            &["part"],
            &["out"],
            COMBINE,
            "",
        )
    })
}

/// Splits for rows that see at most `width` positions.
pub fn splits_for(width: usize) -> i32 {
    (width.max(1) as i32 + CHUNK - 1) / CHUNK
}

/// Runs the partial kernel `kernel` over `keys`/`values` (`[R, H_kv, cap,
/// ROW]`), then the combine kernel: `[R, H, 1, D]` in `q`'s dtype.
#[allow(clippy::too_many_arguments)]
fn run(
    kernel: &CudaKernel,
    what: &str,
    q: &Array,
    keys: &Array,
    values: &Array,
    lens: &Array,
    scale: f32,
    splits: i32,
    quant: Option<KvQuant>,
) -> Result<Array> {
    let (r, h, d) = (q.shape()[0], q.shape()[1], q.shape()[3]);
    let hkv = keys.shape()[1];
    if hkv == 0 || h % hkv != 0 || d % 32 != 0 {
        return Err(mlx_rs::error::Exception::custom(format!(
            "{what}: {h} query heads over {hkv} KV heads, head dimension {d}"
        ))
        .into());
    }
    let q = q.reshape(&[r, h, 1, d])?;
    let part_shape = [r, h, splits, d + 2];
    let mut templates = vec![
        TemplateArg::Int("D", d),
        TemplateArg::Int("REP", h / hkv),
        TemplateArg::Int("CHUNK", CHUNK),
        TemplateArg::Int("SCALE_BITS", float_bits(scale)),
    ];
    if let Some(quant) = quant {
        templates.push(TemplateArg::Int("BITS", quant.bits as i32));
        templates.push(TemplateArg::Int("GROUP", quant.group_size as i32));
    }
    let part = kernel
        .apply(
            what,
            &[&q, keys, values, lens],
            &[(&part_shape, Dtype::Float32)],
            (hkv * 32 * WARPS, r, splits),
            (32 * WARPS, 1, 1),
            &templates,
        )?
        .remove(0);
    let shape = [r, h, 1, d];
    let mut out = combine().apply(
        "split attention: combine",
        &[&part],
        &[(&shape, q.dtype())],
        (h * 32, r, 1),
        (32, 1, 1),
        &[TemplateArg::Dtype("T", q.dtype()), TemplateArg::Int("D", d)],
    )?;
    Ok(out.remove(0))
}

/// Attention for `R` decode rows over the decode slab: `q: [R, H, 1, D]`,
/// `keys`/`values: [R, H_kv, capacity, D]` (row-contiguous, the new token
/// written), `lens: [R]` int32 (row r sees columns `0..=lens[r]`), `width`
/// the most columns any row sees, scores scaled by `scale`. Returns `[R, H,
/// 1, D]` in `q`'s dtype.
///
/// Errors: MLX errors (a backend without CUDA, shapes that do not fit).
pub fn attend_slab(
    q: &Array,
    keys: &Array,
    values: &Array,
    lens: &Array,
    width: usize,
    scale: f32,
) -> Result<Array> {
    run(
        float_partial(),
        "split attention (float)",
        q,
        keys,
        values,
        lens,
        scale,
        splits_for(width),
        None,
    )
}

/// One row's attention over its quantized cache layer: `q: [1, H, 1, D]`,
/// `keys`/`values`: the layer's whole packed buffers `[1, H_kv, capacity,
/// P]` uint32 (row-contiguous; positions `0..=pos` written, the new token
/// at `pos`). Returns `[1, H, 1, D]` in `q`'s dtype.
///
/// Errors: MLX errors (a backend without CUDA, shapes that do not fit).
pub fn attend_quantized(
    quant: KvQuant,
    q: &Array,
    keys: &Array,
    values: &Array,
    pos: usize,
    scale: f32,
) -> Result<Array> {
    let lens = Array::from_slice(&[pos as i32], &[1]);
    run(
        quantized_partial(),
        "split attention (quantized)",
        q,
        keys,
        values,
        &lens,
        scale,
        splits_for(pos + 1),
        Some(quant),
    )
}

/// A self-test verdict per kernel instance, decided at its first use.
type Verdicts = Mutex<HashMap<(Dtype, i32, i32, Option<KvQuant>), bool>>;

/// A CUDA backend and not `MLXHOST_SPLIT_ATTENTION=off`; read once (the
/// gates are asked per layer and step).
fn switched_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("MLXHOST_SPLIT_ATTENTION").as_deref() != Ok("off")
            && crate::runtime::backend_name() == "cuda"
    })
}

/// Logs and keeps the verdict for `key`, running `test` at its first use.
fn decide(
    verdicts: &'static Verdicts,
    key: (Dtype, i32, i32, Option<KvQuant>),
    name: &str,
    fallback: &str,
    test: impl FnOnce() -> Result<f32>,
) -> bool {
    let Ok(mut map) = verdicts.lock() else {
        return false;
    };
    if let Some(&v) = map.get(&key) {
        return v;
    }
    let started = std::time::Instant::now();
    let verdict = test();
    let self_test_ms = started.elapsed().as_millis() as u64;
    let (dtype, d, rep, quant) = key;
    let scheme = quant.map(|q| q.name()).unwrap_or_else(|| "float".into());
    let ok = match verdict {
        // Relative to 1 + |want|: bfloat16 outputs round at ~4e-3.
        Ok(diff) if diff <= 2e-2 => {
            tracing::info!(
                ?dtype,
                d,
                rep,
                scheme,
                max_diff = diff,
                self_test_ms,
                "{name} in use"
            );
            true
        }
        Ok(diff) => {
            tracing::warn!(
                ?dtype,
                d,
                rep,
                scheme,
                max_diff = diff,
                self_test_ms,
                "{name} disagrees with {fallback}; using {fallback}"
            );
            false
        }
        Err(e) => {
            tracing::warn!(?dtype, d, rep, scheme, error = %e, self_test_ms,
                "{name} failed; using {fallback}");
            false
        }
    };
    map.insert(key, ok);
    ok
}

/// Whether [`attend_slab`] runs for activations of `dtype`, head dimension
/// `d` and `rep` query heads per KV head: a CUDA backend, not switched off,
/// and its self-test on that instance passed.
pub fn split_available(dtype: Dtype, d: i32, rep: i32) -> bool {
    static V: OnceLock<Verdicts> = OnceLock::new();
    if !switched_on() {
        return false;
    }
    let v = V.get_or_init(Default::default);
    decide(
        v,
        (dtype, d, rep, None),
        "split decode attention (slab): CUDA kernels",
        "the slab's kernel",
        || self_test_float(dtype, d, rep),
    )
}

/// Whether [`attend_quantized`] runs for `quant` with activations of
/// `dtype`, head dimension `d` and `rep` query heads per KV head (as
/// [`split_available`]).
pub fn quantized_available(quant: KvQuant, dtype: Dtype, d: i32, rep: i32) -> bool {
    static V: OnceLock<Verdicts> = OnceLock::new();
    if !switched_on() {
        return false;
    }
    let v = V.get_or_init(Default::default);
    decide(
        v,
        (dtype, d, rep, Some(quant)),
        "quantized decode attention: CUDA kernels",
        "mlx-lm's quantized SDPA",
        || self_test_quantized(quant, dtype, d, rep),
    )
}

fn random(shape: &[i32], salt: u64, dtype: Dtype) -> Result<Array> {
    let k = mlx_rs::random::key(0x5911 + salt)?;
    Ok(mlx_rs::random::normal::<f32>(shape, None, None, &k)?.as_dtype(dtype)?)
}

/// [`attend_slab`] on random inputs (3 rows of 1, 300 and 700 positions in
/// a capacity of 700: one, two and three splits) against MLX's SDPA under
/// the equivalent mask; the largest relative difference.
fn self_test_float(dtype: Dtype, d: i32, rep: i32) -> Result<f32> {
    use mlx_rs::fast;
    let (r, hkv, cap) = (3, 2, 700);
    let h = hkv * rep;
    let lens_host = [0i32, 299, 699];
    let q = random(&[r, h, 1, d], 1, dtype)?;
    let k = random(&[r, hkv, cap, d], 2, dtype)?;
    let v = random(&[r, hkv, cap, d], 3, dtype)?;
    let lens = Array::from_slice(&lens_host, &[r]);
    let scale = 1.0 / (d as f32).sqrt();
    let got = attend_slab(&q, &k, &v, &lens, cap as usize, scale)?;
    let bits: Vec<bool> = lens_host
        .iter()
        .flat_map(|&l| (0..cap).map(move |c| c <= l))
        .collect();
    let mask = Array::from_slice(&bits, &[r, 1, 1, cap]);
    let want = fast::scaled_dot_product_attention(
        &q,
        &k,
        &v,
        scale,
        fast::ScaledDotProductAttentionMask::Array(&mask),
        None,
    )?;
    relative_diff(&got, &want)
}

/// [`attend_quantized`] on random keys and values quantized as the cache
/// writes them, 600 positions written in a buffer of 640 (three splits),
/// against MLX's SDPA in float32 over the same rows dequantized (not
/// mlx-lm's quantized SDPA: MLX's CUDA `quantized_matmul` is the op this
/// replaces, and the reference must not depend on it).
fn self_test_quantized(quant: KvQuant, dtype: Dtype, d: i32, rep: i32) -> Result<f32> {
    use mlx_rs::{fast, ops::indexing::IndexOp};
    let (hkv, cap, n) = (2, 640, 600);
    let h = hkv * rep;
    let q = random(&[1, h, 1, d], 4, dtype)?;
    let k = quant.pack(&random(&[1, hkv, cap, d], 5, dtype)?)?;
    let v = quant.pack(&random(&[1, hkv, cap, d], 6, dtype)?)?;
    let scale = 1.0 / (d as f32).sqrt();
    let got = attend_quantized(quant, &q, &k, &v, (n - 1) as usize, scale)?;
    let float = |packed: &Array| -> Result<Array> {
        quant.unpack(&packed.index((.., .., ..n, ..)), d as usize, Dtype::Float32)
    };
    let want = fast::scaled_dot_product_attention(
        &q.as_dtype(Dtype::Float32)?,
        &float(&k)?,
        &float(&v)?,
        scale,
        None,
        None,
    )?;
    relative_diff(&got, &want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_every_position() {
        assert_eq!(splits_for(0), 1);
        assert_eq!(splits_for(1), 1);
        assert_eq!(splits_for(CHUNK as usize), 1);
        assert_eq!(splits_for(CHUNK as usize + 1), 2);
        assert_eq!(splits_for(16384), 64);
    }

    #[test]
    fn off_the_gpu_neither_kernel_is_used_and_no_test_runs() {
        if crate::runtime::backend_name() == "cuda" {
            return;
        }
        assert!(!split_available(Dtype::Bfloat16, 128, 4));
        let quant = KvQuant::new(8, 64).expect("scheme");
        assert!(!quantized_available(quant, Dtype::Bfloat16, 128, 4));
    }
}
