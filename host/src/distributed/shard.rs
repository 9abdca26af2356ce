//! Which slice of each weight a rank keeps (Megatron-style tensor
//! parallelism, as mlx-lm's `shard_linear` lays it out):
//!
//! - q/k/v (and their biases), gate/up: split by output rows
//!   ("all-to-sharded": each rank computes its heads / MLP columns);
//! - o_proj, down_proj: split by input columns ("sharded-to-all": each
//!   rank's partial product is summed over ranks, see
//!   [`crate::model::Llama`]'s `tp` field);
//! - embedding, output head, norms: replicated (the head is one product
//!   on rank 0 only; splitting it would add a gather per step for a
//!   vocabulary that is a small share of these models' weights).
//!
//! Heads are split by whole key/value groups (a query head stays with the
//! key/value head it reads), as evenly as the counts allow: SmolLM2's 3
//! key/value heads over 2 ranks give 2 and 1. MLP columns are split on
//! quantization-group boundaries. Uneven shares are allowed; fewer units
//! than ranks is an error naming `--tensor-parallel`.

use mlx_rs::{ops, ops::indexing::IndexOp, Array};

use super::DistributedError;
use crate::model::config::ModelConfig;
use crate::model::weights::TensorMap;

/// Architectures this module shards (dense decoders of `model::llama`).
pub const SHARDED_MODEL_TYPES: &[&str] = &["llama", "qwen2", "qwen3"];

/// Rank `rank`'s share `[start, end)` of `units` split over `size` ranks
/// (the first `units % size` ranks take one more).
pub fn share(units: usize, size: usize, rank: usize) -> (usize, usize) {
    let (base, extra) = (units / size, units % size);
    let start = rank * base + rank.min(extra);
    (start, start + base + usize::from(rank < extra))
}

fn refuse(size: usize, reason: String) -> DistributedError {
    DistributedError::Shard(format!("--tensor-parallel {size}: {reason}"))
}

/// Replaces `tensors` by rank `rank`'s shard (of `size`) and returns the
/// config that describes it (its own head counts, `head_dim` explicit,
/// its MLP width).
///
/// Errors: [`DistributedError::Shard`] (naming `--tensor-parallel`) for
/// an architecture not sharded yet, fewer key/value heads or MLP groups
/// than ranks, quantization groups that a head boundary would cut, or a
/// missing tensor; MLX errors from slicing.
pub fn shard_llama(
    config: &ModelConfig,
    tensors: &mut TensorMap,
    rank: usize,
    size: usize,
) -> Result<ModelConfig, DistributedError> {
    let c = config;
    if !SHARDED_MODEL_TYPES.contains(&c.model_type.as_str()) || c.moe.num_experts.is_some() {
        return Err(refuse(
            size,
            format!(
                "architecture `{}` is not sharded yet (sharded: {})",
                c.model_type,
                SHARDED_MODEL_TYPES.join(", ")
            ),
        ));
    }
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim());
    if nkv < size || nh % nkv != 0 {
        return Err(refuse(
            size,
            format!("the model has {nkv} key/value heads: at most {nkv} ranks"),
        ));
    }
    let group = nh / nkv;
    let (k0, k1) = share(nkv, size, rank);
    let q_rows = (k0 * group * hd, k1 * group * hd);
    let kv_rows = (k0 * hd, k1 * hd);
    // MLP columns move in units of down_proj's quantization group (1 when
    // dense), the same on every layer so every rank's config holds.
    let i = c.intermediate_size;
    let unit = (0..c.num_hidden_layers)
        .map(|l| group_size(tensors, &format!("model.layers.{l}.mlp.down_proj"), i))
        .try_fold(1usize, |acc, g| g.map(|g| lcm(acc, g)))?;
    if !i.is_multiple_of(unit) || i / unit < size {
        return Err(refuse(
            size,
            format!(
                "the MLP width {i} holds {} quantization groups of {unit}: at most that many ranks",
                i / unit
            ),
        ));
    }
    let (u0, u1) = share(i / unit, size, rank);
    let mlp_cols = (u0 * unit, u1 * unit);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, rows) in [
            ("self_attn.q_proj", q_rows),
            ("self_attn.k_proj", kv_rows),
            ("self_attn.v_proj", kv_rows),
            ("mlp.gate_proj", mlp_cols),
            ("mlp.up_proj", mlp_cols),
        ] {
            for suffix in ["weight", "scales", "biases", "bias"] {
                let key = format!("{p}.{name}.{suffix}");
                if let Some(a) = tensors.get(&key) {
                    let part = own(&a.index(rows.0 as i32..rows.1 as i32))?;
                    tensors.insert(key, part);
                }
            }
        }
        for (name, cols, width) in [
            ("self_attn.o_proj", q_rows, nh * hd),
            ("mlp.down_proj", mlp_cols, i),
        ] {
            slice_columns(tensors, &format!("{p}.{name}"), cols, width, size)?;
        }
    }
    let mut out = c.clone();
    out.num_attention_heads = (k1 - k0) * group;
    out.num_key_value_heads = k1 - k0;
    out.head_dim = Some(hd);
    out.intermediate_size = mlp_cols.1 - mlp_cols.0;
    Ok(out)
}

/// A copy with its own buffer (a slice would keep the whole tensor
/// alive, which is the memory tensor parallelism exists to split).
fn own(a: &Array) -> Result<Array, DistributedError> {
    let zero = Array::from_int(0).as_dtype(a.dtype()).map_err(mlx)?;
    ops::add(a, &zero).map_err(mlx)
}

fn mlx(e: mlx_rs::error::Exception) -> DistributedError {
    DistributedError::Shard(format!("slicing a weight: {e}"))
}

/// Input columns `[cols.0, cols.1)` of linear `prefix` (input width
/// `width`): dense weights directly; quantized ones at whole groups.
fn slice_columns(
    tensors: &mut TensorMap,
    prefix: &str,
    cols: (usize, usize),
    width: usize,
    size: usize,
) -> Result<(), DistributedError> {
    let wname = format!("{prefix}.weight");
    let weight = tensors
        .get(&wname)
        .ok_or_else(|| DistributedError::Shard(format!("`{wname}` is missing")))?
        .clone();
    let packed = weight.shape().get(1).copied().unwrap_or(0) as usize;
    let Some(scales) = tensors.get(&format!("{prefix}.scales")).cloned() else {
        tensors.insert(
            wname,
            own(&weight.index((.., cols.0 as i32..cols.1 as i32)))?,
        );
        return Ok(());
    };
    let groups = scales.shape().get(1).copied().unwrap_or(0) as usize;
    let gs = width / groups.max(1);
    let bits = packed * 32 / width.max(1);
    let aligned = |c: usize| c.is_multiple_of(gs) && (c * bits).is_multiple_of(32);
    if !(aligned(cols.0) && aligned(cols.1)) {
        return Err(refuse(
            size,
            format!(
                "`{prefix}` is quantized in groups of {gs} and a rank's share [{}, {}) would cut one",
                cols.0, cols.1
            ),
        ));
    }
    let w = weight.index((.., (cols.0 * bits / 32) as i32..(cols.1 * bits / 32) as i32));
    tensors.insert(wname, own(&w)?);
    for suffix in ["scales", "biases"] {
        let key = format!("{prefix}.{suffix}");
        if let Some(a) = tensors.get(&key) {
            let part = own(&a.index((.., (cols.0 / gs) as i32..(cols.1 / gs) as i32)))?;
            tensors.insert(key, part);
        }
    }
    Ok(())
}

/// Quantization group size of linear `prefix` with input width `width`
/// (1 when dense).
fn group_size(tensors: &TensorMap, prefix: &str, width: usize) -> Result<usize, DistributedError> {
    match tensors.get(&format!("{prefix}.scales")) {
        None => Ok(1),
        Some(s) => {
            let groups = s.shape().get(1).copied().unwrap_or(0) as usize;
            if groups == 0 || !width.is_multiple_of(groups) {
                return Err(DistributedError::Shard(format!(
                    "`{prefix}`: {groups} quantization groups do not divide width {width}"
                )));
            }
            Ok(width / groups)
        }
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_unit_once_and_differ_by_at_most_one() {
        for units in 1..20 {
            for size in 1..=units {
                let parts: Vec<_> = (0..size).map(|r| share(units, size, r)).collect();
                assert_eq!(parts[0].0, 0);
                assert_eq!(parts[size - 1].1, units);
                for w in parts.windows(2) {
                    assert_eq!(w[0].1, w[1].0);
                }
                let lens: Vec<_> = parts.iter().map(|(a, b)| b - a).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
        }
        // SmolLM2: 3 key/value heads over 2 ranks.
        assert_eq!(share(3, 2, 0), (0, 2));
        assert_eq!(share(3, 2, 1), (2, 3));
    }
}
