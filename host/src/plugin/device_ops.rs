//! The device operations behind the `tensors` interface, as plain functions
//! on MLX arrays: each takes the row's logits `[V]` (float32) and returns
//! new lazy logits (or a token `[]` uint32). The plugin host calls them for
//! guests (`plugin::tensors`), and benchmarks call them directly to compute
//! the same chain natively. Definitions follow mlx-lm's
//! `mlx_lm/sample_utils.py` (top-p, min-p, XTC, top-k), Hugging Face's
//! repetition penalty, OpenAI's presence/frequency penalties and llama.cpp's
//! mirostat truncation. Inputs are assumed validated by the caller.

use mlx_rs::error::Result;
use mlx_rs::{
    ops::{self, indexing::IndexOp},
    random, Array, Dtype,
};

/// `-inf` as a scalar.
pub fn neg_inf() -> Array {
    Array::from_f32(f32::NEG_INFINITY)
}

/// A `[V]` float32 vector that is `value` at `ids` (ids >= V ignored) and
/// `fill` elsewhere; duplicates accumulate when `accumulate`.
pub fn dense(vocab: usize, ids: &[u32], values: &[f32], fill: f32, accumulate: bool) -> Array {
    let mut v = vec![fill; vocab];
    for (&id, &x) in ids.iter().zip(values) {
        if let Some(slot) = v.get_mut(id as usize) {
            *slot = if accumulate { *slot + x } else { x };
        }
    }
    Array::from_slice(&v, &[vocab as i32])
}

/// A `[V]` boolean mask, true at `ids` (ids >= V ignored).
pub fn id_mask(vocab: usize, ids: &[u32]) -> Result<Array> {
    ops::gt(
        dense(vocab, ids, &vec![1.0; ids.len()], 0.0, false),
        Array::from_f32(0.5),
    )
}

/// V of a `[V]` array.
pub fn vocab(a: &Array) -> usize {
    a.shape().first().copied().unwrap_or(0) as usize
}

/// Log-softmax over the last axis: `a - logsumexp(a)`, a `[V]` row's
/// logsumexp on the CPU through [`crate::logprobs::logsumexp_rows`] (16-lane
/// exponentials), otherwise MLX's.
pub fn log_softmax(a: &Array) -> Result<Array> {
    if a.ndim() == 1 && !crate::runtime::gpu_available() {
        let lse = crate::logprobs::logsumexp_rows(&a.reshape(&[1, -1])?)?.reshape(&[1])?;
        return ops::subtract(a, &lse);
    }
    mlx_rs::nn::log_softmax(a, -1)
}

/// Deterministic PRNG key for (seed, step): the same pair gives the same draw.
pub fn step_key(seed: u64, step: u32, stream: u64) -> Result<Array> {
    random::key(step_bits(seed, step, stream))
}

/// 64 bits for (seed, step, stream): the SplitMix64 finalizer over the
/// triple, so nearby seeds and steps decorrelate.
fn step_bits(seed: u64, step: u32, stream: u64) -> u64 {
    let mut z = seed
        ^ (u64::from(step) << 32 | u64::from(step))
        ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `logits / temperature` (temperature > 0, finite).
pub fn scale(logits: &Array, temperature: f32) -> Result<Array> {
    ops::multiply(logits, Array::from_f32(1.0 / temperature))
}

/// `logits[ids[i]] += biases[i]`.
pub fn add_bias(logits: &Array, ids: &[u32], biases: &[f32]) -> Result<Array> {
    ops::add(logits, dense(vocab(logits), ids, biases, 0.0, true))
}

/// `logits[ids] = -inf`.
pub fn ban(logits: &Array, ids: &[u32]) -> Result<Array> {
    ops::select(&id_mask(vocab(logits), ids)?, neg_inf(), logits)
}

/// Keep only `ids`.
pub fn allow_only(logits: &Array, ids: &[u32]) -> Result<Array> {
    ops::select(&id_mask(vocab(logits), ids)?, logits, neg_inf())
}

/// Hugging Face repetition penalty over the last `window` ids of `history`
/// (prompt included): positive logits divided by `penalty`, negative
/// multiplied (penalty > 0).
pub fn repetition_penalty(
    logits: &Array,
    history: &[u32],
    penalty: f32,
    window: u32,
) -> Result<Array> {
    let start = history.len().saturating_sub(window as usize);
    let v = vocab(logits);
    let mut ids: Vec<u32> = history[start..]
        .iter()
        .copied()
        .filter(|&i| (i as usize) < v)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Ok(logits.clone());
    }
    let penalized = ops::select(
        &ops::gt(logits, Array::from_f32(0.0))?,
        ops::divide(logits, Array::from_f32(penalty))?,
        ops::multiply(logits, Array::from_f32(penalty))?,
    )?;
    ops::select(&id_mask(v, &ids)?, &penalized, logits)
}

/// OpenAI presence/frequency penalties over `generated` ids:
/// `logit[j] -= count[j] * frequency + (count[j] > 0) * presence`.
pub fn presence_frequency_penalty(
    logits: &Array,
    generated: &[u32],
    presence: f32,
    frequency: f32,
) -> Result<Array> {
    let v = vocab(logits);
    let mut counts = std::collections::BTreeMap::<u32, f32>::new();
    for &id in generated.iter().filter(|&&i| (i as usize) < v) {
        *counts.entry(id).or_default() += 1.0;
    }
    if counts.is_empty() {
        return Ok(logits.clone());
    }
    let ids: Vec<u32> = counts.keys().copied().collect();
    let pen: Vec<f32> = counts.values().map(|&c| c * frequency + presence).collect();
    ops::subtract(logits, dense(v, &ids, &pen, 0.0, false))
}

/// Keep the `k` largest logits (ties at the boundary kept); 0 or >= V: no-op.
pub fn top_k(logits: &Array, k: u32) -> Result<Array> {
    if k == 0 || k as usize >= vocab(logits) {
        return Ok(logits.clone());
    }
    // The k-th largest value is the threshold (mlx-lm's apply_top_k keeps
    // exactly the argpartition's top k; ties at the boundary are kept here).
    let kth =
        ops::argpartition_axis(&ops::negative(logits)?, k as i32 - 1, -1)?.index(k as i32 - 1);
    let threshold = logits.take_axis(&kth, -1)?;
    ops::select(&ops::lt(logits, &threshold)?, neg_inf(), logits)
}

/// mlx-lm's `apply_top_p`; `p` outside (0, 1): no-op.
///
/// On the CPU backend through mlxhost's op (`mlxhost_top_p`,
/// `host/mlx-sys/native/top_p.cpp`: no full sort of the vocabulary, 16-lane
/// exponentials), elsewhere through [`top_p_mlx`]'s MLX ops.
pub fn top_p(logits: &Array, p: f32) -> Result<Array> {
    if !(p > 0.0 && p < 1.0) {
        return Ok(logits.clone());
    }
    if crate::runtime::gpu_available() {
        return top_p_mlx(logits, p);
    }
    // SAFETY: `logits` is borrowed for the whole call; the op keeps its own
    // reference.
    unsafe {
        crate::native_op::build_one(
            |out| mlx_sys::mlxhost_top_p(out, logits.as_ptr(), p),
            || {
                format!(
                    "top-p: logits must be [V] with V > 0, got {:?}",
                    logits.shape()
                )
            },
        )
    }
}

/// [`top_p`] through MLX ops (a sort of the whole vocabulary): the GPU path,
/// and what the CPU op is tested against. `p` must be in (0, 1).
pub fn top_p_mlx(logits: &Array, p: f32) -> Result<Array> {
    // Drop the low tail whose mass lies at or above 1 - p of the total,
    // measured from the top.
    let lp = log_softmax(logits)?;
    let sorted = ops::sort_axis(&lp, -1)?;
    let probs = ops::exp(&sorted)?;
    let mass_above = ops::cumsum(&probs, -1, true, false)?;
    let total = ops::add(mass_above.index(..1), probs.index(..1))?;
    let dropped = ops::sum_axis(
        &ops::ge(&mass_above, &ops::multiply(&total, Array::from_f32(p))?)?
            .as_dtype(Dtype::Int32)?,
        -1,
        true,
    )?;
    let threshold = sorted.take_axis(&dropped, -1)?;
    ops::select(&ops::lt(&lp, &threshold)?, neg_inf(), logits)
}

/// mlx-lm's `apply_min_p` (0 < p <= 1): keep tokens with
/// `logprob >= max + ln(p)` (the top token always survives).
pub fn min_p(logits: &Array, p: f32) -> Result<Array> {
    let lp = log_softmax(logits)?;
    let top = ops::max_axis(&lp, -1, true)?;
    let threshold = ops::add(&top, Array::from_f32(p.ln()))?;
    ops::select(&ops::lt(&lp, &threshold)?, neg_inf(), logits)
}

/// llama.cpp's mirostat truncation (`llama_sampler_mirostat_v2_apply` in
/// src/llama-sampling.cpp): drop tokens with `logprob < threshold`; the top
/// token always stays.
pub fn min_logprob(logits: &Array, threshold: f32) -> Result<Array> {
    let lp = log_softmax(logits)?;
    let top = ops::max_axis(&lp, -1, true)?;
    let below = ops::logical_and(
        &ops::lt(&lp, Array::from_f32(threshold))?,
        &ops::lt(&lp, &top)?,
    )?;
    ops::select(&below, neg_inf(), logits)
}

/// mlx-lm's `apply_xtc`: with probability `probability` (drawn from
/// (seed, step)), remove every token whose probability exceeds the smallest
/// probability above `threshold`; `keep` ids are never removed.
pub fn xtc(
    logits: &Array,
    probability: f32,
    threshold: f32,
    keep: &[u32],
    seed: u64,
    step: u32,
) -> Result<Array> {
    let v = vocab(logits);
    let probs = ops::softmax_axis(logits, -1, None)?;
    let above = ops::gt(&probs, Array::from_f32(threshold))?;
    let inf = Array::from_f32(f32::INFINITY);
    let min_above = ops::min_axis(&ops::select(&above, &probs, &inf)?, -1, true)?;
    let mut remove = ops::gt(&probs, &min_above)?;
    if !keep.is_empty() {
        let protect = id_mask(v, keep)?;
        remove = ops::logical_and(&remove, &ops::logical_not(&protect)?)?;
    }
    let draw = random::uniform::<f32, f32>(0.0, 1.0, &[], Some(&step_key(seed, step, 2)?))?;
    let apply = ops::lt(&draw, Array::from_f32(probability))?;
    ops::select(&ops::logical_and(&remove, &apply)?, neg_inf(), logits)
}

/// The most likely token, `[]` uint32.
pub fn argmax(logits: &Array) -> Result<Array> {
    ops::indexing::argmax_axis(logits, -1, None)?.as_dtype(Dtype::Uint32)
}

/// A draw from softmax(logits) keyed by (seed, step), `[]` uint32.
///
/// On the CPU backend by inverse CDF at one uniform from (seed, step)
/// (`mlxhost_categorical`, `host/mlx-sys/native/categorical.cpp`: MLX's
/// Gumbel-max draw hashes and takes two logarithms per vocabulary entry,
/// one lane at a time on x86); elsewhere MLX's `random::categorical`. Both
/// draw exactly from softmax(logits); a seed maps to different tokens on
/// the two.
pub fn categorical(logits: &Array, seed: u64, step: u32) -> Result<Array> {
    if crate::runtime::gpu_available() {
        let key = step_key(seed, step, 1)?;
        return random::categorical(logits, -1, None, Some(&key))?.as_dtype(Dtype::Uint32);
    }
    // The top 53 bits as a double in [0, 1).
    let u = (step_bits(seed, step, 1) >> 11) as f64 / (1u64 << 53) as f64;
    // SAFETY: `logits` is borrowed for the whole call; the op keeps its own
    // reference.
    unsafe {
        crate::native_op::build_one(
            |out| mlx_sys::mlxhost_categorical(out, logits.as_ptr(), u),
            || {
                format!(
                    "categorical: logits must be [V] with V > 0, got {:?}",
                    logits.shape()
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits from a fixed LCG: `n` values spread over `spread` nats.
    fn logits(n: usize, spread: f32, state: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((*state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * spread
            })
            .collect()
    }

    fn kept(a: &Array) -> Vec<bool> {
        a.as_slice::<f32>().iter().map(|x| x.is_finite()).collect()
    }

    /// mlx-lm's `apply_top_p` computed plainly in float64: sort descending,
    /// keep a token while the mass above it is below `p` of the total, then
    /// keep every token tied with the last one kept.
    fn top_p_float64(v: &[f32], p: f32) -> Vec<bool> {
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
        let q = |i: usize| (f64::from(v[i]) - f64::from(m)).exp();
        let target = f64::from(p) * v.iter().enumerate().map(|(i, _)| q(i)).sum::<f64>();
        let (mut above, mut threshold) = (0.0, m);
        for &i in &order {
            if above >= target {
                break;
            }
            threshold = v[i];
            above += q(i);
        }
        v.iter().map(|&x| x >= threshold).collect()
    }

    #[test]
    fn top_p_op_keeps_what_the_definition_keeps() -> Result<()> {
        let mut state = 7u64;
        // Vocabulary sizes off the 16-lane blocks, peaked (the boundary in
        // the top bucket) to flat (everything in one bucket) distributions,
        // tails past the last bucket, ties (values rounded to a coarse
        // grid), masked entries, and p from tiny to almost 1. Against the
        // float64 definition always; against the MLX ops (float32 cumsum)
        // where neighbouring masses are not within its rounding (all but
        // the near-flat row).
        let shapes = [
            (37, 4.0),
            (1000, 20.0),
            (4099, 2.0),
            (49152, 30.0),
            (5000, 0.01),
            (3000, 400.0),
        ];
        for (case, &(n, spread)) in shapes.iter().enumerate() {
            for &p in &[0.01f32, 0.3, 0.5, 0.9, 0.95, 0.999] {
                let mut v = logits(n, spread, &mut state);
                if case % 2 == 1 {
                    for x in &mut v {
                        *x = (*x * 2.0).round() / 2.0;
                    }
                }
                v[n / 3] = f32::NEG_INFINITY;
                let x = Array::from_slice(&v, &[n as i32]);
                let ours = top_p(&x, p)?;
                let at = format!("n {n}, spread {spread}, p {p}");
                assert!(
                    kept(&ours) == top_p_float64(&v, p),
                    "{at}: not the definition"
                );
                for (a, b) in ours.as_slice::<f32>().iter().zip(&v) {
                    assert!(
                        a == b || *a == f32::NEG_INFINITY,
                        "{at}: a kept value changed"
                    );
                }
                if spread > 0.1 {
                    let mlx = top_p_mlx(&x, p)?;
                    assert!(kept(&ours) == kept(&mlx), "{at}: not the MLX ops");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn categorical_draws_follow_softmax() -> Result<()> {
        // Pearson's chi-square of 4000 draws (one per seed) against
        // softmax([2, 1, 0.5, 0, -1, -inf]) over 5 degrees of freedom: the
        // 0.999 quantile is 20.5; the -inf token is never drawn.
        let v = [2.0f32, 1.0, 0.5, 0.0, -1.0, f32::NEG_INFINITY];
        let logits = Array::from_slice(&v, &[6]);
        let total: f64 = v.iter().map(|&x| f64::from(x).exp()).sum();
        let draws = 4000u64;
        let mut counts = [0u64; 6];
        for seed in 0..draws {
            let t = categorical(&logits, seed, 3)?;
            counts[t.item_exact::<u32>() as usize] += 1;
        }
        assert_eq!(counts[5], 0);
        let chi2: f64 = v[..5]
            .iter()
            .zip(&counts)
            .map(|(&x, &c)| {
                let expected = draws as f64 * f64::from(x).exp() / total;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi2 < 20.5, "chi-square {chi2}, counts {counts:?}");
        // Same (seed, step): same token.
        let again =
            |seed| -> Result<u32> { Ok(categorical(&logits, seed, 3)?.item_exact::<u32>()) };
        assert_eq!(again(11)?, again(11)?);
        Ok(())
    }

    #[test]
    fn categorical_of_rows_it_cannot_weigh_is_the_argmax() -> Result<()> {
        let nan = Array::from_slice(&[1.0f32, f32::NAN, 3.0], &[3]);
        assert_eq!(categorical(&nan, 1, 1)?.item_exact::<u32>(), 2);
        let masked = Array::from_slice(&[f32::NEG_INFINITY; 3], &[3]);
        assert_eq!(categorical(&masked, 1, 1)?.item_exact::<u32>(), 0);
        Ok(())
    }

    #[test]
    fn top_p_op_leaves_rows_it_cannot_rank() -> Result<()> {
        let nan = Array::from_slice(&[1.0f32, f32::NAN, 0.5], &[3]);
        let out = top_p(&nan, 0.5)?;
        let got = out.as_slice::<f32>();
        assert_eq!((got[0], got[2]), (1.0, 0.5));
        assert!(got[1].is_nan());
        let masked = Array::from_slice(&[f32::NEG_INFINITY; 4], &[4]);
        assert!(top_p(&masked, 0.5)?
            .as_slice::<f32>()
            .iter()
            .all(|x| *x == f32::NEG_INFINITY));
        assert!(top_p(&Array::from_slice(&[1.0f32; 4], &[2, 2]), 0.5).is_err());
        Ok(())
    }
}
