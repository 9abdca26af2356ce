//! Per-row KV cache with chunked preallocation, one [`LayerKind`] per layer.
//!
//! Layout per layer: keys and values `[1, H_kv, capacity, D]` in the compute
//! dtype; slot `i` holds position `start + i`, and positions
//! `[start, offset)` are valid. Capacity grows in steps of
//! [`KvCache::STEP`] tokens so a decode step writes in place (`slice_update`)
//! instead of copying the whole cache, as mlx-lm's `KVCache` does
//! (`mlx_lm/models/cache.py`).
//!
//! A full-attention layer keeps every position (`start == 0`). A
//! sliding-window layer (Gemma 3's local layers) is bounded: when its
//! buffer is full it drops the positions no later query can attend to,
//! keeping the last `window - 1 + ROLLBACK` (a rotating buffer, compacted
//! once per [`KvCache::STEP`] tokens rather than rotated every step, so
//! slots stay in position order and attention needs no gather). The
//! [`KvCache::ROLLBACK`] positions beyond the window are what make a cached
//! sliding-window conversation reusable: a prompt-cache hit must trim the
//! cache back to the shared prefix, and a window that kept only the last
//! `window` positions could not be trimmed at all (llama.cpp re-processes
//! the whole prompt in that case, its issue 13194).

use mlx_rs::{ops, ops::indexing::IndexOp, ops::indexing::TryIndexMutOp, Array, Dtype};

use super::quant::KvQuant;
use super::slab::SlabLink;
use super::state::{LayerState, RowStates};
use crate::distributed::mirror::{CacheOp, MirrorId};
use crate::model::error::{ModelError, Result};

/// What one layer of a [`KvCache`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LayerKind {
    /// Every position (full causal attention).
    #[default]
    Full,
    /// Sliding-window attention: a query at position `q` attends to keys
    /// at positions `(q - window, q]` (Gemma 3's local layers, mlx-lm's
    /// `RotatingKVCache`, llama.cpp's standard SWA mask).
    SlidingWindow {
        /// Keys a query sees, itself included (Gemma 3: 512).
        window: usize,
    },
    /// A gated-DeltaNet layer's fixed-size recurrent state (conv and
    /// recurrent state, [`super::state`]) instead of keys and values: it
    /// cannot be trimmed back, only restored from a checkpoint.
    Recurrent,
}

impl LayerKind {
    /// The name used in KV-scheme strings and SSD headers: `full` or
    /// `sliding<W>`.
    pub fn name(&self) -> String {
        match self {
            LayerKind::Full => "full".into(),
            LayerKind::SlidingWindow { window } => format!("sliding{window}"),
            LayerKind::Recurrent => "recurrent".into(),
        }
    }
}

/// The head geometry of one cache layer: keys and values are
/// `[1, kv_heads, T, head_dim]`. Uniform for most models; Gemma 4's full
/// layers have their own (`global_head_dim`, `num_global_key_value_heads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Key/value heads (`H_kv`).
    pub kv_heads: usize,
    /// Head dimension (`D`).
    pub head_dim: usize,
}

#[derive(Debug, Clone, Default)]
struct LayerKv {
    keys: Option<Array>,
    values: Option<Array>,
    kind: LayerKind,
    /// Position held by slot 0 (0 for full layers).
    start: usize,
}

impl LayerKv {
    /// Positions the buffers hold room for (0 before the first write).
    fn capacity(&self) -> usize {
        self.keys
            .as_ref()
            .map(|k| k.shape()[2] as usize)
            .unwrap_or(0)
    }
}

/// One row's KV cache over all layers.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    offset: usize,
    /// Set while the row decodes in the model's batched decode slab
    /// ([`super::slab`]): the slab holds this row's keys and values, and
    /// `layers` holds no buffers until [`KvCache::detach`].
    slab: Option<SlabLink>,
    /// The recurrent layers' states and checkpoints, when some layer is
    /// [`LayerKind::Recurrent`].
    states: Option<RowStates>,
    /// This cache's identity across tensor-parallel ranks: clones, drops
    /// and trims are logged under it for the workers' shards
    /// ([`crate::distributed::mirror`]).
    mirror: MirrorId,
    /// Quantized keys and values in full-attention layers (`--kv-bits`):
    /// their buffers hold packed rows `[1, H_kv, capacity, P]` `uint32`
    /// ([`super::quant`]). Sliding-window layers stay in the compute dtype:
    /// they hold at most `window + ROLLBACK + STEP` positions whatever the
    /// context, and mlx-lm's `RotatingKVCache` has no quantized form either.
    quant: Option<KvQuant>,
}

/// What a layer's cache holds after a write, for attention to read: the
/// valid prefix of its buffers.
#[derive(Debug, Clone)]
pub enum KvView {
    /// Keys and values `[1, H_kv, S, D]` in the compute dtype.
    Float(Array, Array),
    /// Packed rows `[1, H_kv, S, P]` `uint32` of `quant`.
    Quantized {
        /// Packed keys.
        keys: Array,
        /// Packed values.
        values: Array,
        /// Their scheme.
        quant: KvQuant,
    },
}

impl KvView {
    /// Keys and values `[1, H_kv, S, D]` in `dtype`, dequantized when
    /// they are quantized (lazy: a full copy of the prefix, for the paths
    /// that amortize it over many queries, e.g. a prefill chunk).
    ///
    /// Errors: MLX errors.
    pub fn float(self, head_dim: usize, dtype: Dtype) -> Result<(Array, Array)> {
        match self {
            KvView::Float(k, v) => Ok((k, v)),
            KvView::Quantized {
                keys,
                values,
                quant,
            } => Ok((
                quant.unpack(&keys, head_dim, dtype)?,
                quant.unpack(&values, head_dim, dtype)?,
            )),
        }
    }
}

impl Clone for KvCache {
    /// A copy that is never in the decode slab. A row in the slab is read
    /// out of it as lazy slices, which keep that slab generation alive
    /// until the copy is evaluated or dropped ([`KvCache::make_exclusive`]
    /// on the copy gives it buffers of its own).
    fn clone(&self) -> Self {
        let mut layers = self.layers.clone();
        if let Some(link) = &self.slab {
            for (layer, (k, v)) in layers.iter_mut().zip(link.read()) {
                layer.keys = Some(k);
                layer.values = Some(v);
            }
        }
        KvCache {
            layers,
            offset: self.offset,
            slab: None,
            states: self.states.clone(),
            mirror: self.mirror.clone(),
            quant: self.quant,
        }
    }
}

impl KvCache {
    /// Growth step in tokens.
    pub const STEP: usize = 256;

    /// Positions a sliding-window layer keeps beyond its window, so the
    /// cache can be trimmed back by up to this many tokens (a prompt-cache
    /// hit whose shared prefix ends inside the last turn's reply).
    pub const ROLLBACK: usize = 256;

    /// An empty cache for `num_layers` full-attention layers.
    pub fn new(num_layers: usize) -> Self {
        Self::with_kinds(&vec![LayerKind::Full; num_layers])
    }

    /// An empty cache with one layer per entry of `kinds`.
    pub fn with_kinds(kinds: &[LayerKind]) -> Self {
        KvCache {
            layers: kinds
                .iter()
                .map(|&kind| LayerKv {
                    kind,
                    ..Default::default()
                })
                .collect(),
            offset: 0,
            slab: None,
            states: kinds
                .contains(&LayerKind::Recurrent)
                .then(|| RowStates::new(kinds.len())),
            mirror: MirrorId::fresh(),
            quant: None,
        }
    }

    /// This cache with its full-attention layers quantized by `quant`
    /// (`None`: float). Set before the first write (or on a cache whose
    /// buffers were restored in that scheme).
    pub fn with_quant(mut self, quant: Option<KvQuant>) -> Self {
        self.quant = quant;
        self
    }

    /// The scheme the full-attention layers are quantized with (`None`:
    /// float).
    pub fn quant(&self) -> Option<KvQuant> {
        self.quant
    }

    /// The scheme `layer` is stored in: the cache's for a full-attention
    /// layer, `None` (float) for the other kinds.
    pub fn layer_quant(&self, layer: usize) -> Option<KvQuant> {
        match self.layers.get(layer).map(|l| l.kind) {
            Some(LayerKind::Full) => self.quant,
            _ => None,
        }
    }

    /// A cache of `offset` positions from per-layer keys and values
    /// `[1, H_kv, offset - starts[l], D]`, each layer of kind `kinds[l]`
    /// holding positions `[starts[l], offset)` (a restored SSD entry; the
    /// first update reallocates with room to grow).
    pub fn from_parts(
        layers: Vec<(Array, Array)>,
        kinds: &[LayerKind],
        starts: &[usize],
        offset: usize,
    ) -> Self {
        let layers = layers.into_iter().map(Some).collect();
        Self::from_layer_parts(layers, kinds, starts, offset, None)
    }

    /// [`KvCache::from_parts`] for a cache with recurrent layers too: a
    /// recurrent layer's entry in `layers` is `None`, and `states` holds
    /// its states (see [`RowStates::restored`]).
    pub fn from_layer_parts(
        layers: Vec<Option<(Array, Array)>>,
        kinds: &[LayerKind],
        starts: &[usize],
        offset: usize,
        states: Option<RowStates>,
    ) -> Self {
        let recurrent = kinds.contains(&LayerKind::Recurrent);
        KvCache {
            layers: layers
                .into_iter()
                .zip(kinds.iter().zip(starts))
                .map(|(kv, (&kind, &start))| {
                    let (keys, values) = kv.map_or((None, None), |(k, v)| (Some(k), Some(v)));
                    LayerKv {
                        keys,
                        values,
                        kind,
                        start,
                    }
                })
                .collect(),
            offset,
            slab: None,
            states: match (recurrent, states) {
                (true, Some(s)) => Some(s),
                (true, None) => Some(RowStates::new(kinds.len())),
                (false, _) => None,
            },
            mirror: MirrorId::fresh(),
            quant: None,
        }
    }

    /// Gives recurrent states that are views into a decode step's stacked
    /// states (`cache::state::StackSlot`) arrays of their own, evaluated
    /// now, as [`KvCache::detach`] does for the decode slab: a cache
    /// leaving its batch (for the prompt cache) must not keep every row's
    /// state alive.
    pub fn detach_states(&mut self) {
        if let Some(states) = &mut self.states {
            let copies = states.detach();
            if !copies.is_empty() {
                let _ = mlx_rs::transforms::eval(copies.iter());
            }
        }
    }

    /// The recurrent layers' states and checkpoints; `None` without
    /// recurrent layers.
    pub fn states(&self) -> Option<&RowStates> {
        self.states.as_ref()
    }

    /// Takes this row's keys and values back from the decode slab
    /// ([`super::slab`]) into buffers of its own (`[1, H_kv, offset, D]`
    /// copies, evaluated here: one device sync per retired row); nothing
    /// when the row is not in the slab.
    /// Every method that reads or writes the buffers calls it first; call
    /// it before [`KvCache::layer_buffers`], [`KvCache::arrays`] and
    /// [`KvCache::nbytes`], which take `&self`.
    pub fn detach(&mut self) {
        let Some(link) = self.slab.take() else {
            return;
        };
        // Copies, evaluated now: a lazy slice would keep the whole slab
        // (every row's columns) alive for as long as this cache lives, in
        // the prompt cache say. If the copy cannot be built or evaluated,
        // the slices stay (correct, only holding more memory).
        let copy = |a: Array| fresh_copy(&a).unwrap_or(a);
        let kv: Vec<(Array, Array)> = link
            .read()
            .into_iter()
            .map(|(k, v)| (copy(k), copy(v)))
            .collect();
        drop(link);
        let _ = mlx_rs::transforms::eval(kv.iter().flat_map(|(k, v)| [k, v]));
        for (layer, (k, v)) in self.layers.iter_mut().zip(kv) {
            layer.keys = Some(k);
            layer.values = Some(v);
            layer.start = 0;
        }
    }

    /// The slab link, while the row is in the decode slab.
    pub(super) fn slab_link(&self) -> Option<&SlabLink> {
        self.slab.as_ref()
    }

    /// Hands this row's keys and values to the decode slab (which copied
    /// them already): the own buffers go.
    pub(super) fn link_to_slab(&mut self, link: SlabLink) {
        for layer in &mut self.layers {
            layer.keys = None;
            layer.values = None;
        }
        self.slab = Some(link);
    }

    /// Per layer, the first `len` positions of the own buffers (`[1, H_kv,
    /// len, D]`); empty when a layer was never written. Full-attention
    /// layers only (slot i is position i).
    pub(super) fn own_prefix(&self, len: usize) -> Vec<(Array, Array)> {
        let len = len as i32;
        self.layers
            .iter()
            .map_while(|l| {
                let (k, v) = l.keys.as_ref().zip(l.values.as_ref())?;
                Some((k.index((.., .., ..len, ..)), v.index((.., .., ..len, ..))))
            })
            .collect()
    }

    /// Per layer, the key and value buffers `[1, H_kv, capacity, D]`
    /// (`None` for a layer never written). Slot `i` holds position
    /// [`KvCache::layer_start`]` + i`.
    pub fn layer_buffers(&self) -> Vec<Option<(&Array, &Array)>> {
        self.layers
            .iter()
            .map(|l| l.keys.as_ref().zip(l.values.as_ref()))
            .collect()
    }

    /// Each layer's kind.
    pub fn kinds(&self) -> Vec<LayerKind> {
        self.layers.iter().map(|l| l.kind).collect()
    }

    /// The first position `layer` still holds (0 unless a sliding-window
    /// layer dropped older ones).
    pub fn layer_start(&self, layer: usize) -> usize {
        self.layers[layer].start
    }

    /// The shortest length this cache can be trimmed to with
    /// [`KvCache::truncate`] and still be resumed: a sliding-window layer
    /// that dropped positions must keep the `window - 1` before the next
    /// query. 0 when nothing was dropped.
    pub fn min_resume(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l.kind {
                LayerKind::SlidingWindow { window } if l.start > 0 => l.start + window - 1,
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }

    /// How many of the first `shared` positions a reuse can keep: `shared`
    /// when the cache can be trimmed to it ([`KvCache::min_resume`]), else
    /// 0 (nothing shorter can be resumed either). With recurrent layers,
    /// the longest checkpoint at most `shared` ([`RowStates::resumable`]):
    /// a state is never resumed past the point a new prompt diverges.
    pub fn reusable(&self, shared: usize) -> usize {
        let mut shared = shared.min(self.offset);
        if let Some(states) = &self.states {
            shared = states.resumable(shared, self.offset);
        }
        if shared >= self.min_resume() {
            shared
        } else {
            0
        }
    }

    /// Whether some layer keeps a recurrent state.
    pub fn has_recurrent(&self) -> bool {
        self.states.is_some()
    }

    /// Recurrent layer `layer`'s state; `None` before its first token (or
    /// for another kind of layer).
    pub fn state(&self, layer: usize) -> Option<&LayerState> {
        self.states.as_ref().and_then(|s| s.get(layer))
    }

    /// Sets recurrent layer `layer`'s state after this step's tokens (call
    /// [`KvCache::advance`] once every layer is updated).
    ///
    /// Errors: [`ModelError::Tensor`] when the cache has no recurrent
    /// layers (a cache made for another model).
    pub fn set_state(&mut self, layer: usize, state: LayerState) -> Result<()> {
        let offset = self.offset;
        match (&mut self.states, self.layers.get(layer).map(|l| l.kind)) {
            (Some(states), Some(LayerKind::Recurrent)) => {
                states.set(layer, state, offset);
                Ok(())
            }
            _ => Err(ModelError::Tensor {
                name: format!("cache layer {layer}"),
                reason: "not a recurrent-state layer".into(),
            }),
        }
    }

    /// Hands over recurrent layer `layer`'s state one token before the end
    /// of this forward (a prefill chunk), before [`KvCache::advance`]
    /// ([`RowStates::set_before_end`]); nothing without recurrent layers.
    pub fn set_state_before_end(&mut self, layer: usize, state: LayerState) {
        if let Some(states) = &mut self.states {
            states.set_before_end(layer, state);
        }
    }

    /// Positions this cache holds recurrent checkpoints at (empty without
    /// recurrent layers).
    pub fn checkpoint_positions(&self) -> Vec<usize> {
        self.states
            .as_ref()
            .map(RowStates::checkpoint_positions)
            .unwrap_or_default()
    }

    /// Whether positions at the end can be dropped ([`KvCache::truncate`])
    /// while keeping those before them (speculative decoding trims rejected
    /// drafts this way, at most [`KvCache::ROLLBACK`] positions back). A
    /// kind that folds positions into a running state cannot.
    pub fn trimmable(&self) -> bool {
        self.layers.iter().all(|l| match l.kind {
            LayerKind::Full | LayerKind::SlidingWindow { .. } => true,
            LayerKind::Recurrent => false,
        })
    }

    /// The id tensor-parallel plans name this cache by
    /// ([`crate::distributed::mirror`]).
    pub fn mirror_id(&self) -> u64 {
        self.mirror.get()
    }

    /// Number of cached positions (tokens already processed).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Writes `keys`/`values` `[1, H_kv, T, D]` for `layer` at positions
    /// `[offset, offset + T)` and returns the valid prefix
    /// `[1, H_kv, offset + T, D]` of both. Call [`KvCache::advance`] once all
    /// layers have been updated.
    ///
    /// For a sliding-window layer the returned arrays hold positions
    /// `[layer_start, offset + T)` (read [`KvCache::layer_start`] after the
    /// call); the caller masks what lies outside each query's window.
    ///
    /// A quantized layer returns its prefix dequantized (a copy: attention
    /// reads [`KvCache::update_view`] instead).
    pub fn update(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (d, dtype) = (keys.shape()[3] as usize, keys.dtype());
        self.update_view(layer, keys, values)?.float(d, dtype)
    }

    /// [`KvCache::update`], returning what the layer holds as it is stored:
    /// packed rows for a quantized layer (the new keys and values are
    /// quantized as they are written).
    pub fn update_view(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<KvView> {
        match self.layer_quant(layer) {
            Some(quant) => {
                let (k, v) = self.write(layer, &quant.pack(keys)?, &quant.pack(values)?)?;
                Ok(KvView::Quantized {
                    keys: k,
                    values: v,
                    quant,
                })
            }
            None => {
                let (k, v) = self.write(layer, keys, values)?;
                Ok(KvView::Float(k, v))
            }
        }
    }

    /// Writes rows `[1, H_kv, T, W]` as stored (floats, or packed rows) at
    /// positions `[offset, offset + T)` and returns the buffers' valid
    /// prefix.
    fn write(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        self.detach();
        let t = keys.shape()[2] as usize;
        let end = self.offset + t;
        if let LayerKind::SlidingWindow { window } = self.layers[layer].kind {
            self.reserve_window(layer, end, window, keys)?;
        } else {
            self.reserve(layer, end, keys)?;
        }
        let slot = &mut self.layers[layer];
        let (k_buf, v_buf) = match (slot.keys.as_mut(), slot.values.as_mut()) {
            (Some(k), Some(v)) => (k, v),
            _ => unreachable!("buffers allocated by reserve"),
        };
        let (s, e) = ((self.offset - slot.start) as i32, (end - slot.start) as i32);
        k_buf.try_index_mut((.., .., s..e, ..), keys)?;
        v_buf.try_index_mut((.., .., s..e, ..), values)?;
        Ok((
            k_buf.index((.., .., ..e, ..)),
            v_buf.index((.., .., ..e, ..)),
        ))
    }

    /// What [`KvCache::update`] of `layer` returned in this step, read
    /// again: the valid prefix through the step's `t` new positions, which
    /// that call must already have written (`[1, H_kv, offset + t -
    /// layer_start, D]` each). Gemma 4's KV-shared layers attend over an
    /// earlier layer's keys and values this way instead of writing their own.
    ///
    /// Errors: [`ModelError::Tensor`] when the layer was not written up to
    /// `offset + t` (a shared layer ahead of its source layer).
    pub fn written(&mut self, layer: usize, t: usize) -> Result<(Array, Array)> {
        let view = self.written_view(layer, t)?;
        let d = match &view {
            KvView::Quantized { keys, quant, .. } => quant.head_dim_of(keys.shape()[3] as usize),
            KvView::Float(k, _) => k.shape()[3] as usize,
        };
        view.float(d, Dtype::Float32)
    }

    /// [`KvCache::written`] as stored (packed rows for a quantized layer).
    pub fn written_view(&mut self, layer: usize, t: usize) -> Result<KvView> {
        self.detach();
        let end = self.offset + t;
        let quant = self.layer_quant(layer);
        let slot = &self.layers[layer];
        match (slot.keys.as_ref(), slot.values.as_ref()) {
            (Some(k), Some(v)) if end - slot.start <= slot.capacity() => {
                let e = (end - slot.start) as i32;
                let (keys, values) = (k.index((.., .., ..e, ..)), v.index((.., .., ..e, ..)));
                Ok(match quant {
                    Some(quant) => KvView::Quantized {
                        keys,
                        values,
                        quant,
                    },
                    None => KvView::Float(keys, values),
                })
            }
            _ => Err(ModelError::Tensor {
                name: format!("KV cache layer {layer}"),
                reason: format!("read before positions up to {end} were written"),
            }),
        }
    }

    /// Makes sliding-window `layer`'s buffer hold positions up to `end`:
    /// when it is full, positions no query from `offset` on can see (and
    /// that lie beyond the [`KvCache::ROLLBACK`] margin) are dropped, and
    /// the rest moves to the front of a buffer with a [`KvCache::STEP`] of
    /// room, so the copy happens once per `STEP` decode steps.
    fn reserve_window(
        &mut self,
        layer: usize,
        end: usize,
        window: usize,
        like: &Array,
    ) -> Result<()> {
        let offset = self.offset;
        let slot = &mut self.layers[layer];
        if end - slot.start <= slot.capacity() {
            return Ok(());
        }
        let keep_from = offset
            .saturating_sub(window - 1 + Self::ROLLBACK)
            .max(slot.start);
        let (drop, valid) = (keep_from - slot.start, offset - keep_from);
        let new_cap = (end - keep_from + Self::STEP).div_ceil(Self::STEP) * Self::STEP;
        for buf in [&mut slot.keys, &mut slot.values] {
            let old = buf.take().map(|b| b.index((.., .., drop as i32.., ..)));
            *buf = Some(grow(old, like, valid, new_cap)?);
        }
        slot.start = keep_from;
        Ok(())
    }

    /// Makes `layer`'s buffers hold at least `end` positions (allocating
    /// them shaped like `like: [1, H_kv, _, D]` on first use, or like its
    /// packed rows `[1, H_kv, _, P]` `uint32` for a quantized layer) and
    /// takes them out of the cache, for an op that writes them and hands
    /// back new ones ([`KvCache::put_layer`]).
    pub fn take_layer(&mut self, layer: usize, end: usize, like: &Array) -> Result<(Array, Array)> {
        self.detach();
        match self.layer_quant(layer) {
            Some(q) => {
                let s = like.shape();
                let words = q.row_words(s[3] as usize) as i32;
                let packed = ops::zeros_dtype(&[s[0], s[1], 1, words], Dtype::Uint32)?;
                self.reserve(layer, end, &packed)?;
            }
            None => self.reserve(layer, end, like)?,
        }
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
        if end > slot.capacity() {
            let new_cap = end.div_ceil(Self::STEP) * Self::STEP;
            slot.keys = Some(grow(slot.keys.take(), like, valid, new_cap)?);
            slot.values = Some(grow(slot.values.take(), like, valid, new_cap)?);
        }
        Ok(())
    }

    /// Gives this cache buffers of its own: a lazy copy of every layer's
    /// valid keys and values (not the source's spare capacity: a cache
    /// trimmed from a longer one would otherwise keep that one's whole
    /// allocation; the next write grows it). A cache cloned from a
    /// prompt-cache entry or a running row shares their buffers; a decoding
    /// row whose cache is written in place (`model::decode_attention`) must
    /// own them alone.
    pub fn make_exclusive(&mut self) -> Result<()> {
        self.detach();
        self.mirror.record(CacheOp::MakeExclusive);
        let offset = self.offset;
        for slot in &mut self.layers {
            let valid = offset.saturating_sub(slot.start) as i32;
            for buf in [&mut slot.keys, &mut slot.values].into_iter().flatten() {
                let keep = valid.min(buf.shape()[2]);
                *buf = fresh_copy(&buf.index((.., .., ..keep, ..)))?;
            }
        }
        Ok(())
    }

    /// Copies the valid positions into buffers of exactly that many
    /// positions, evaluated now: a cache truncated from a longer one (a
    /// shared prefix kept by the prompt cache) then holds only its own
    /// positions instead of pinning the longer allocation.
    pub fn compact(&mut self) -> Result<()> {
        self.detach();
        self.mirror.record(CacheOp::Compact);
        let offset = self.offset;
        for slot in &mut self.layers {
            let valid = offset.saturating_sub(slot.start) as i32;
            for buf in [&mut slot.keys, &mut slot.values].into_iter().flatten() {
                *buf = fresh_copy(&buf.index((.., .., ..valid, ..)))?;
            }
        }
        mlx_rs::transforms::eval(self.arrays())?;
        Ok(())
    }

    /// Puts back `layer`'s buffers taken with [`KvCache::take_layer`].
    pub fn put_layer(&mut self, layer: usize, keys: Array, values: Array) {
        self.detach();
        let slot = &mut self.layers[layer];
        slot.keys = Some(keys);
        slot.values = Some(values);
    }

    /// Marks `t` more positions valid (after every layer got its update).
    pub fn advance(&mut self, t: usize) {
        if let Some(states) = &mut self.states {
            states.advance(self.offset, t);
        }
        self.offset += t;
    }

    /// Drops positions at and after `len` (keeps the allocation). With
    /// sliding-window layers, `len` must be at least
    /// [`KvCache::min_resume`] (see [`KvCache::reusable`]); with
    /// recurrent layers, a position holding a checkpoint (or the end); any
    /// other one empties the cache instead, which is always valid.
    pub fn truncate(&mut self, len: usize) {
        self.detach();
        self.mirror.record(|id| CacheOp::Truncate(id, len));
        let offset = self.offset;
        let restored = self.states.as_mut().is_none_or(|s| s.truncate(len, offset));
        if len < self.min_resume() || !restored {
            if let Some(states) = &mut self.states {
                states.reset();
            }
            for slot in &mut self.layers {
                slot.start = 0;
            }
            self.offset = 0;
            return;
        }
        self.offset = self.offset.min(len);
    }

    /// Arrays to evaluate so the cache holds concrete data (none while the
    /// row is in the decode slab: the step's outputs depend on the slab).
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| l.keys.iter().chain(l.values.iter()))
            .chain(self.states.iter().flat_map(RowStates::arrays))
            .collect()
    }

    /// Bytes held by the allocation (capacity, not just valid positions;
    /// recurrent states and their checkpoints).
    pub fn nbytes(&self) -> usize {
        let kv: usize = self
            .layers
            .iter()
            .flat_map(|l| l.keys.iter().chain(l.values.iter()))
            .map(|a| a.nbytes())
            .sum();
        kv + self.states.as_ref().map_or(0, |s| s.nbytes(self.offset))
    }
}

/// `a + 0`: exact, and a lazy copy with a buffer of its own once evaluated
/// (MLX reuses an input's buffer only when nothing else holds it), so it
/// no longer keeps `a`'s storage alive.
pub(super) fn fresh_copy(a: &Array) -> Result<Array> {
    Ok(ops::add(a, &Array::from_f32(0.0).as_dtype(a.dtype())?)?)
}

/// New buffer `[B, H, new_cap, D]` (B, H, D and the dtype of `like`)
/// holding the first `valid` positions of `old`, cast to that dtype (zeros
/// after them, or everywhere without `old`).
pub(super) fn grow(
    old: Option<Array>,
    like: &Array,
    valid: usize,
    new_cap: usize,
) -> Result<Array> {
    let shape = like.shape();
    let dtype: Dtype = like.dtype();
    match old {
        Some(old) if valid > 0 => {
            let kept = old.index((.., .., ..valid as i32, ..)).as_dtype(dtype)?;
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

    /// Feeds positions `from..to` of a one-layer cache one chunk at a time;
    /// each position's key is its position number.
    fn feed(cache: &mut KvCache, from: usize, to: usize, chunk: usize) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        let mut p = from;
        while p < to {
            let t = chunk.min(to - p);
            let vals: Vec<f32> = (p..p + t).map(|x| x as f32).collect();
            let k = Array::from_slice(&vals, &[1, 1, t as i32, 1]);
            let (keys, _) = cache.update(0, &k, &k)?;
            cache.advance(t);
            last = keys.as_slice::<f32>().to_vec();
            p += t;
        }
        Ok(last)
    }

    #[test]
    fn written_reads_back_what_update_returned_this_step() -> Result<()> {
        let window = 4;
        let mut cache =
            KvCache::with_kinds(&[LayerKind::Full, LayerKind::SlidingWindow { window }]);
        // Nothing written yet: an error, not a panic.
        assert!(cache.written(1, 1).is_err());
        for (from, t) in [(0, 3), (3, 1), (4, 300), (304, 2)] {
            let vals: Vec<f32> = (from..from + t).map(|x| x as f32).collect();
            let k = Array::from_slice(&vals, &[1, 1, t as i32, 1]);
            for layer in 0..2 {
                let (keys, values) = cache.update(layer, &k, &k)?;
                let (again_k, again_v) = cache.written(layer, t)?;
                assert_eq!(keys.as_slice::<f32>(), again_k.as_slice::<f32>());
                assert_eq!(values.as_slice::<f32>(), again_v.as_slice::<f32>());
            }
            cache.advance(t);
        }
        // Past what the buffer holds: an error.
        assert!(cache.written(0, 10_000).is_err());
        Ok(())
    }

    #[test]
    fn sliding_window_layer_stays_bounded_and_in_position_order() -> Result<()> {
        let window = 8;
        let mut cache = KvCache::with_kinds(&[LayerKind::SlidingWindow { window }]);
        let total = 3 * KvCache::STEP + 2 * KvCache::ROLLBACK + 17;
        for chunk in [1, 5] {
            cache.truncate(0);
            let keys = feed(&mut cache, 0, total, chunk)?;
            let start = cache.layer_start(0);
            // Slots hold consecutive positions from `start` to the end.
            let want: Vec<f32> = (start..total).map(|x| x as f32).collect();
            assert_eq!(keys, want, "chunk {chunk}");
            // Everything a rollback of ROLLBACK tokens needs is there, and
            // the buffer never holds much more.
            assert!(start <= total - (window - 1 + KvCache::ROLLBACK));
            let cap = cache.layer_buffers()[0]
                .map(|(k, _)| k.shape()[2])
                .unwrap_or(0) as usize;
            assert!(
                cap <= window + KvCache::ROLLBACK + 2 * KvCache::STEP,
                "capacity {cap}"
            );
        }
        Ok(())
    }

    #[test]
    fn sliding_window_cache_trims_back_within_its_margin_only() -> Result<()> {
        let window = 8;
        let mut cache =
            KvCache::with_kinds(&[LayerKind::Full, LayerKind::SlidingWindow { window }]);
        let total = 2 * KvCache::STEP + KvCache::ROLLBACK + 40;
        for p in 0..total {
            let k = Array::from_slice(&[p as f32], &[1, 1, 1, 1]);
            cache.update(0, &k, &k)?;
            cache.update(1, &k, &k)?;
            cache.advance(1);
        }
        let min = cache.min_resume();
        assert!(
            min > 0 && min <= total - KvCache::ROLLBACK,
            "min_resume {min}"
        );
        assert_eq!(cache.reusable(total - 3), total - 3);
        assert_eq!(cache.reusable(min - 1), 0);
        // Trimmed to `min`, the next token's window is all there.
        let mut trimmed = cache.clone();
        trimmed.truncate(min);
        let k = Array::from_slice(&[-1.0f32], &[1, 1, 1, 1]);
        let (keys, _) = trimmed.update(1, &k, &k)?;
        let held = keys.as_slice::<f32>().to_vec();
        let start = trimmed.layer_start(1);
        let window_keys = &held[min + 1 - window - start..];
        let want: Vec<f32> = (min + 1 - window..min)
            .map(|x| x as f32)
            .chain([-1.0])
            .collect();
        assert_eq!(window_keys, &want[..]);
        // Below the margin the cache empties rather than resume wrongly.
        let mut emptied = cache.clone();
        emptied.truncate(min - 1);
        assert_eq!(emptied.offset(), 0);
        assert_eq!(emptied.min_resume(), 0);
        Ok(())
    }

    /// A quantized cache stores MLX's packed rows in its full layers (the
    /// sliding-window layer stays float), reads them back as written, and
    /// keeps its scheme through clones, trims and compaction.
    #[test]
    fn quantized_full_layers_store_packed_rows() -> Result<()> {
        let quant = KvQuant::new(4, 32).expect("a scheme");
        let mut cache =
            KvCache::with_kinds(&[LayerKind::Full, LayerKind::SlidingWindow { window: 8 }])
                .with_quant(Some(quant));
        mlx_rs::random::seed(2)?;
        let x = mlx_rs::random::normal::<f32>(&[1, 2, 5, 64], None, None, None)?;
        let view = cache.update_view(0, &x, &x)?;
        let KvView::Quantized { keys, .. } = &view else {
            panic!("a full layer of a quantized cache is quantized");
        };
        assert_eq!(keys.shape(), &[1, 2, 5, quant.row_words(64) as i32]);
        assert!(matches!(cache.update_view(1, &x, &x)?, KvView::Float(..)));
        cache.advance(5);
        let want = quant.unpack(&quant.pack(&x)?, 64, Dtype::Float32)?;
        let (k, _) = cache.written(0, 0)?;
        let err = ops::abs(&ops::subtract(&k, &want)?)?
            .max(None)?
            .item_exact::<f32>();
        assert_eq!(err, 0.0);
        let mut copy = cache.clone();
        copy.truncate(3);
        copy.compact()?;
        assert_eq!(copy.quant(), Some(quant));
        assert_eq!(copy.layer_buffers()[0].map(|(k, _)| k.shape()[2]), Some(3));
        // The decode op's buffers are packed too.
        let like = ops::zeros::<f32>(&[1, 2, 1, 64])?;
        let (kb, _) = cache.take_layer(0, 6, &like)?;
        assert_eq!(kb.dtype(), Dtype::Uint32);
        assert_eq!(kb.shape()[3], quant.row_words(64) as i32);
        Ok(())
    }
}
