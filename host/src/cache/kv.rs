//! Per-row full-attention KV cache with chunked preallocation.
//!
//! Layout per layer: keys and values `[1, H_kv, capacity, D]` in the compute
//! dtype; positions `[0, offset)` are valid. Capacity grows in steps of
//! [`KvCache::STEP`] tokens so a decode step writes in place (`slice_update`)
//! instead of copying the whole cache, as mlx-lm's `KVCache` does
//! (`mlx_lm/models/cache.py`).

use mlx_rs::{ops, ops::indexing::IndexOp, ops::indexing::TryIndexMutOp, Array, Dtype};

use crate::model::error::Result;

#[derive(Debug, Clone, Default)]
struct LayerKv {
    keys: Option<Array>,
    values: Option<Array>,
}

/// One row's KV cache over all layers.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    offset: usize,
}

impl KvCache {
    /// Growth step in tokens.
    pub const STEP: usize = 256;

    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            layers: vec![LayerKv::default(); num_layers],
            offset: 0,
        }
    }

    /// A cache of `offset` positions from per-layer keys and values
    /// `[1, H_kv, T, D]` with `T >= offset` (a restored SSD entry: `T ==
    /// offset`, and the first update reallocates with room to grow).
    pub fn from_layers(layers: Vec<(Array, Array)>, offset: usize) -> Self {
        KvCache {
            layers: layers
                .into_iter()
                .map(|(k, v)| LayerKv {
                    keys: Some(k),
                    values: Some(v),
                })
                .collect(),
            offset,
        }
    }

    /// Per layer, the key and value buffers `[1, H_kv, capacity, D]`
    /// (`None` for a layer never written).
    pub fn layer_buffers(&self) -> Vec<Option<(&Array, &Array)>> {
        self.layers
            .iter()
            .map(|l| l.keys.as_ref().zip(l.values.as_ref()))
            .collect()
    }

    /// Number of cached positions (tokens already processed).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Writes `keys`/`values` `[1, H_kv, T, D]` for `layer` at positions
    /// `[offset, offset + T)` and returns the valid prefix
    /// `[1, H_kv, offset + T, D]` of both. Call [`KvCache::advance`] once all
    /// layers have been updated.
    pub fn update(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let t = keys.shape()[2] as usize;
        let start = self.offset;
        let end = start + t;
        self.reserve(layer, end, keys)?;
        let slot = &mut self.layers[layer];
        let (k_buf, v_buf) = match (slot.keys.as_mut(), slot.values.as_mut()) {
            (Some(k), Some(v)) => (k, v),
            _ => unreachable!("buffers allocated by reserve"),
        };
        let (s, e) = (start as i32, end as i32);
        k_buf.try_index_mut((.., .., s..e, ..), keys)?;
        v_buf.try_index_mut((.., .., s..e, ..), values)?;
        Ok((
            k_buf.index((.., .., ..e, ..)),
            v_buf.index((.., .., ..e, ..)),
        ))
    }

    /// Makes `layer`'s buffers hold at least `end` positions (allocating
    /// them shaped like `like: [1, H_kv, _, D]` on first use) and takes them
    /// out of the cache, for an op that writes them and hands back new ones
    /// ([`KvCache::put_layer`]).
    pub fn take_layer(&mut self, layer: usize, end: usize, like: &Array) -> Result<(Array, Array)> {
        self.reserve(layer, end, like)?;
        let slot = &mut self.layers[layer];
        match (slot.keys.take(), slot.values.take()) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => unreachable!("buffers allocated by reserve"),
        }
    }

    /// Grows `layer`'s buffers (in [`KvCache::STEP`] steps, keeping the
    /// valid positions) until they hold `end` positions; first use
    /// allocates them shaped like `like: [1, H_kv, _, D]`.
    fn reserve(&mut self, layer: usize, end: usize, like: &Array) -> Result<()> {
        let valid = self.offset;
        let slot = &mut self.layers[layer];
        let capacity = slot
            .keys
            .as_ref()
            .map(|k| k.shape()[2] as usize)
            .unwrap_or(0);
        if end > capacity {
            let new_cap = end.div_ceil(Self::STEP) * Self::STEP;
            slot.keys = Some(grow(slot.keys.take(), like, valid, new_cap)?);
            slot.values = Some(grow(slot.values.take(), like, valid, new_cap)?);
        }
        Ok(())
    }

    /// Gives this cache buffers of its own: a lazy copy of every layer's
    /// keys and values. A cache cloned from a prompt-cache entry shares the
    /// entry's buffers; a decoding row whose cache is written in place
    /// (`model::decode_attention`) must own them alone.
    pub fn make_exclusive(&mut self) -> Result<()> {
        for slot in &mut self.layers {
            for buf in [&mut slot.keys, &mut slot.values].into_iter().flatten() {
                // `x + 0` is exact, and its output is a fresh buffer (MLX
                // reuses an input's buffer only when nothing else holds it).
                *buf = ops::add(&*buf, &Array::from_f32(0.0).as_dtype(buf.dtype())?)?;
            }
        }
        Ok(())
    }

    /// Puts back `layer`'s buffers taken with [`KvCache::take_layer`].
    pub fn put_layer(&mut self, layer: usize, keys: Array, values: Array) {
        let slot = &mut self.layers[layer];
        slot.keys = Some(keys);
        slot.values = Some(values);
    }

    /// Marks `t` more positions valid (after every layer got its update).
    pub fn advance(&mut self, t: usize) {
        self.offset += t;
    }

    /// Drops positions at and after `len` (keeps the allocation).
    pub fn truncate(&mut self, len: usize) {
        self.offset = self.offset.min(len);
    }

    /// Arrays to evaluate so the cache holds concrete data.
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| l.keys.iter().chain(l.values.iter()))
            .collect()
    }

    /// Bytes held by the allocation (capacity, not just valid positions).
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }
}

/// New buffer `[1, H, new_cap, D]` holding the first `valid` positions of `old`.
fn grow(old: Option<Array>, like: &Array, valid: usize, new_cap: usize) -> Result<Array> {
    let shape = like.shape();
    let dtype: Dtype = like.dtype();
    match old {
        Some(old) if valid > 0 => {
            let kept = old.index((.., .., ..valid as i32, ..));
            let tail = ops::zeros_dtype(
                &[shape[0], shape[1], (new_cap - valid) as i32, shape[3]],
                dtype,
            )?;
            Ok(ops::concatenate(&[kept, tail], 2)?)
        }
        _ => Ok(ops::zeros_dtype(
            &[shape[0], shape[1], new_cap as i32, shape[3]],
            dtype,
        )?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_in_place_and_grows_across_the_step() -> Result<()> {
        let mut cache = KvCache::new(1);
        let k = ops::ones::<f32>(&[1, 2, 3, 4])?;
        let (keys, _) = cache.update(0, &k, &k)?;
        cache.advance(3);
        assert_eq!(keys.shape(), &[1, 2, 3, 4]);
        let big = ops::full::<f32>(&[1, 2, KvCache::STEP as i32, 4], Array::from_f32(2.0))?;
        let (keys, values) = cache.update(0, &big, &big)?;
        cache.advance(KvCache::STEP);
        assert_eq!(keys.shape(), &[1, 2, 3 + KvCache::STEP as i32, 4]);
        let total = keys.sum(None)?.item_exact::<f32>();
        assert_eq!(
            total,
            (2 * 3 * 4) as f32 + (2 * KvCache::STEP * 4 * 2) as f32
        );
        assert_eq!(values.shape(), keys.shape());
        assert_eq!(cache.offset(), 3 + KvCache::STEP);
        Ok(())
    }
}
