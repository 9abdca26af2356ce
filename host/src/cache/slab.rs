//! A batched KV slab for the rows of a step that decode one token (GPU
//! backends): every decoding row's keys and values live side by side in
//! one buffer per layer, `[S, H_kv, capacity, D]` (slot `s` is the step's
//! `s`-th decode row, position `p` at column `p`), so a step writes every
//! row's new key and value with one scatter and attends with one
//! `scaled_dot_product_attention` per layer for all rows, instead of
//! ~9 graph ops per row per layer over each row's own cache. On a GPU the
//! step is host-bound (building and launching the graph), so the op count
//! is the cost; mlx-lm's `BatchKVCache` (`mlx_lm/models/cache.py`) keeps a
//! batched cache for the same reason.
//!
//! Ownership: a [`KvCache`](super::KvCache) whose row joined the slab holds a
//! [`SlabLink`] instead of its own buffers. Anything that needs the row's
//! buffers ([`KvCache::detach`](super::KvCache::detach): truncating, a prompt
//! chunk, the prompt cache, the SSD tier, a clone) reads them back out of
//! the slab. Membership is reconciled at the start of a step: when the
//! step's decode rows are the slots of the last step, in order (the steady
//! state), nothing is copied; otherwise the slab is rebuilt once from the
//! slots, the rows' own buffers and what rows that left were holding.
//!
//! Chosen by [`enabled`]: on GPU backends, or anywhere with
//! `MLXHOST_DECODE_ATTENTION=slab` (tests run it on the CPU that way).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use mlx_rs::{
    error::Exception,
    fast::{self, ScaledDotProductAttentionMask},
    ops::{self, indexing::IndexOp},
    Array, StreamOrDevice,
};

use super::kv::{fresh_copy, grow, KvCache};
use crate::model::error::Result;
use crate::model::{cuda_decode_attention, cuda_split_attention};

/// Whether decode rows attend through the slab: GPU backends unless
/// `MLXHOST_DECODE_ATTENTION=per-row`; the CPU only with
/// `MLXHOST_DECODE_ATTENTION=slab` (the CPU has its own batched op,
/// `model::decode_attention`, that writes each row's buffers in place).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(
        || match std::env::var("MLXHOST_DECODE_ATTENTION").as_deref() {
            Ok("slab") => true,
            Ok("per-row") => false,
            _ => crate::runtime::gpu_available(),
        },
    )
}

/// The model's decode slab (one per loaded model; cheap to clone, clones
/// share it).
#[derive(Clone, Default)]
pub struct DecodeSlab {
    state: Arc<Mutex<SlabState>>,
}

impl std::fmt::Debug for DecodeSlab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("DecodeSlab")
            .field("slots", &s.members.len())
            .field("capacity", &s.capacity)
            .field("parked", &s.parked.len())
            .finish()
    }
}

#[derive(Default)]
struct SlabState {
    /// Per layer, keys and values `[S, H_kv, capacity, D]`.
    layers: Vec<(Array, Array)>,
    /// Columns every slot has room for.
    capacity: usize,
    /// Slot `s`'s row; `None` once that row left (its KV was read out or
    /// its cache dropped).
    members: Vec<Option<Member>>,
    /// Rows that were slots and sat a step out: their keys and values
    /// `[1, H_kv, len, D]` per layer, until their cache takes them back.
    parked: HashMap<u64, Vec<(Array, Array)>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Member {
    id: u64,
    /// Positions held (the row's cache offset).
    len: usize,
}

/// A row's claim on its keys and values inside a [`DecodeSlab`]. Dropping
/// it releases the slot (a retired or cancelled row).
pub struct SlabLink {
    state: Arc<Mutex<SlabState>>,
    id: u64,
}

impl std::fmt::Debug for SlabLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlabLink").field("id", &self.id).finish()
    }
}

impl SlabLink {
    /// The row's keys and values, `[1, H_kv, len, D]` per layer (lazy
    /// slices of the slab, or what the row parked).
    pub(super) fn read(&self) -> Vec<(Array, Array)> {
        let s = lock(&self.state);
        if let Some(parked) = s.parked.get(&self.id) {
            return parked.clone();
        }
        match s.slot_of(self.id) {
            Some((slot, len)) => s.slice_out(slot, len),
            None => Vec::new(),
        }
    }
}

impl Drop for SlabLink {
    fn drop(&mut self) {
        let mut s = lock(&self.state);
        s.parked.remove(&self.id);
        if let Some((slot, _)) = s.slot_of(self.id) {
            s.members[slot] = None;
        }
        // The last row gone: give the buffers back now, not at the next
        // decode step (which may never come).
        if s.parked.is_empty() && s.members.iter().all(Option::is_none) {
            s.layers.clear();
            s.members.clear();
            s.capacity = 0;
        }
    }
}

/// A poisoned lock only means another thread panicked while holding it; the
/// state is plain data, still consistent between whole operations.
fn lock(state: &Mutex<SlabState>) -> MutexGuard<'_, SlabState> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl SlabState {
    fn slot_of(&self, id: u64) -> Option<(usize, usize)> {
        self.members
            .iter()
            .enumerate()
            .find_map(|(s, m)| m.filter(|m| m.id == id).map(|m| (s, m.len)))
    }

    /// Slot `slot`'s first `len` columns, per layer `[1, H_kv, len, D]`.
    fn slice_out(&self, slot: usize, len: usize) -> Vec<(Array, Array)> {
        let (s, len) = (slot as i32, len as i32);
        self.layers
            .iter()
            .map(|(k, v)| {
                (
                    k.index((s..s + 1, .., ..len, ..)),
                    v.index((s..s + 1, .., ..len, ..)),
                )
            })
            .collect()
    }
}

/// Membership changes of every slab in the process (see [`DecodeSlab::rebuilds`]).
static REBUILDS: AtomicU64 = AtomicU64::new(0);

impl DecodeSlab {
    /// How many times a step found the slab's rows changed (joined, left or
    /// reordered) and rebuilt it, copying every row's KV, in this process.
    /// Steady decoding rebuilds nothing; tests check the engine keeps it so.
    pub fn rebuilds() -> u64 {
        REBUILDS.load(Ordering::Relaxed)
    }

    /// Whether `cache` is linked to a slab other than this one (another
    /// model's); such a row must be detached before it joins this one.
    pub fn is_foreign(&self, cache: &KvCache) -> bool {
        cache
            .slab_link()
            .is_some_and(|l| !Arc::ptr_eq(&l.state, &self.state))
    }

    /// Whether rows of these cache offsets are worth one slab: its slots
    /// all take the longest row's length, so a batch whose padding would
    /// more than quadruple the KV its rows hold (one very long row beside
    /// short ones) attends per row instead. Admission budgets each row by
    /// its own length; this keeps the slab within a small factor of that.
    pub fn worth_batching(lens: &[usize]) -> bool {
        let Some(&longest) = lens.iter().max() else {
            return false;
        };
        let step = KvCache::STEP;
        let padded = lens.len() * (longest + 1).div_ceil(step) * step;
        let held: usize = lens.iter().map(|l| l + 1).sum();
        padded <= (4 * held).max(lens.len() * step)
    }

    /// Starts a step whose decode rows are `rows` (in the step's row order;
    /// each row's cache offset is the position of the token it feeds) for a
    /// model of `num_layers` layers whose keys are shaped like `like`
    /// (`[1, H_kv, 1, D]`, the cache dtype). Links every row to the slab.
    /// Holds the slab until the returned step is dropped: no row's cache
    /// may be detached meanwhile.
    ///
    /// Errors: MLX errors building the copies of a membership change.
    pub fn begin<'a>(
        &'a self,
        rows: &mut [&mut KvCache],
        num_layers: usize,
        like: &Array,
    ) -> Result<SlabStep<'a>> {
        let mut s = lock(&self.state);
        let wanted: Vec<Option<u64>> = rows
            .iter()
            .map(|r| r.slab_link().filter(|l| Arc::ptr_eq(&l.state, &self.state)))
            .map(|l| l.map(|l| l.id))
            .collect();
        let lens: Vec<usize> = rows.iter().map(|r| r.offset()).collect();
        let need = lens.iter().max().map_or(1, |&l| l + 1);
        let steady = s.layers.len() == num_layers
            && s.members.len() == rows.len()
            && s.members
                .iter()
                .zip(&wanted)
                .all(|(m, w)| matches!((m, w), (Some(m), Some(w)) if m.id == *w));
        if !steady {
            REBUILDS.fetch_add(1, Ordering::Relaxed);
            self.rebuild(&mut s, rows, &wanted, num_layers, like, need)?;
        } else if need > s.capacity {
            widen(&mut s, need)?;
        }
        for (m, &len) in s.members.iter_mut().zip(&lens) {
            if let Some(m) = m {
                m.len = len;
            }
        }
        let n = rows.len() as i32;
        let slots: Vec<i32> = (0..n).collect();
        let cols: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        // Keys every row may see: columns up to its own new position. On
        // CUDA our kernel reads the lengths instead of a mask.
        let width = need;
        let head_dim = like.shape()[3];
        let kernel =
            rows.len() > 1 && head_dim % 32 == 0 && cuda_decode_attention::available(like.dtype());
        let mask = (rows.len() > 1 && !kernel).then(|| {
            let bits: Vec<bool> = lens
                .iter()
                .flat_map(|&l| (0..width).map(move |c| c <= l))
                .collect();
            Array::from_slice(&bits, &[n, 1, 1, width as i32])
        });
        Ok(SlabStep {
            state: s,
            slots: Array::from_slice(&slots, &[n]),
            cols: Array::from_slice(&cols, &[n]),
            width,
            mask,
            kernel,
        })
    }

    /// Makes the slots exactly `rows`, in order: a row already in the slab
    /// keeps its columns, a row that parked or never joined brings its
    /// buffers, a slot whose row is not in this step parks its keys and
    /// values (still alive) or is freed (its row left).
    fn rebuild(
        &self,
        s: &mut SlabState,
        rows: &mut [&mut KvCache],
        wanted: &[Option<u64>],
        num_layers: usize,
        like: &Array,
        need: usize,
    ) -> Result<()> {
        let capacity = need.div_ceil(KvCache::STEP) * KvCache::STEP;
        // Built first, committed only once every copy was built, so an MLX
        // error leaves the slab (slots, parked rows) as it was.
        let staying: Vec<u64> = wanted.iter().flatten().copied().collect();
        let leaving: Vec<(u64, Vec<(Array, Array)>)> = s
            .members
            .iter()
            .enumerate()
            .filter_map(|(slot, m)| m.filter(|m| !staying.contains(&m.id)).map(|m| (slot, m)))
            .map(|(slot, m)| Ok((m.id, own_copies(s.slice_out(slot, m.len))?)))
            .collect::<Result<_>>()?;
        // Each row's source: its slot, its parked arrays, or its own buffers.
        let mut sources: Vec<Vec<(Array, Array)>> = Vec::with_capacity(rows.len());
        for (row, id) in rows.iter().zip(wanted) {
            let len = row.offset();
            let kv = match id.and_then(|id| s.slot_of(id)) {
                Some((slot, _)) => s.slice_out(slot, len),
                None => match id.and_then(|id| s.parked.get(&id)) {
                    Some(kv) => kv.clone(),
                    None => row.own_prefix(len),
                },
            };
            sources.push(kv);
        }
        let mut layers = Vec::with_capacity(num_layers);
        for l in 0..num_layers {
            let mut ks = Vec::with_capacity(rows.len());
            let mut vs = Vec::with_capacity(rows.len());
            for (src, row) in sources.iter().zip(rows.iter()) {
                let len = row.offset();
                let pair = src.get(l);
                ks.push(grow(pair.map(|p| p.0.clone()), like, len, capacity)?);
                vs.push(grow(pair.map(|p| p.1.clone()), like, len, capacity)?);
            }
            layers.push((concat0(ks)?, concat0(vs)?));
        }
        for id in wanted.iter().flatten() {
            s.parked.remove(id);
        }
        s.parked.extend(leaving);
        s.layers = layers;
        s.capacity = capacity;
        s.members.clear();
        for row in rows.iter_mut() {
            let id = match row.slab_link() {
                Some(l) if Arc::ptr_eq(&l.state, &self.state) => l.id,
                _ => {
                    let id = next_id();
                    row.link_to_slab(SlabLink {
                        state: Arc::clone(&self.state),
                        id,
                    });
                    id
                }
            };
            s.members.push(Some(Member {
                id,
                len: row.offset(),
            }));
        }
        Ok(())
    }
}

/// Copies of a parked row's arrays ([`fresh_copy`]), so it does not keep a
/// whole slab generation alive.
fn own_copies(kv: Vec<(Array, Array)>) -> Result<Vec<(Array, Array)>> {
    kv.iter()
        .map(|(k, v)| Ok((fresh_copy(k)?, fresh_copy(v)?)))
        .collect()
}

fn concat0(parts: Vec<Array>) -> Result<Array> {
    if parts.len() == 1 {
        return Ok(parts.into_iter().next().expect("one part"));
    }
    Ok(ops::concatenate(&parts, 0)?)
}

/// Adds [`KvCache::STEP`] columns (or more) so every slot holds `need`.
fn widen(s: &mut SlabState, need: usize) -> Result<()> {
    let capacity = need.div_ceil(KvCache::STEP) * KvCache::STEP;
    let wider = |a: &Array| grow(Some(a.clone()), a, s.capacity, capacity);
    // Every layer first, then the swap: an error leaves the slab as it was.
    let layers = s
        .layers
        .iter()
        .map(|(k, v)| Ok((wider(k)?, wider(v)?)))
        .collect::<Result<Vec<_>>>()?;
    s.layers = layers;
    s.capacity = capacity;
    Ok(())
}

/// One step's use of the slab: [`SlabStep::attend`] once per layer.
pub struct SlabStep<'a> {
    state: MutexGuard<'a, SlabState>,
    /// `[R]` int32: slot of each row (`0..R`).
    slots: Array,
    /// `[R]` int32: column each row writes (its new token's position).
    cols: Array,
    /// Columns any row attends over (the longest row's, plus its new one).
    width: usize,
    /// `[R, 1, 1, width]` bool: row r sees columns `<= cols[r]`; `None` for
    /// one row, or when the CUDA kernel attends.
    mask: Option<Array>,
    /// Attend through [`cuda_decode_attention`] (CUDA, several rows).
    kernel: bool,
}

impl SlabStep<'_> {
    /// Layer `l`'s attention for the step's rows: writes `k`/`v` (`[R,
    /// H_kv, 1, D]`, RoPE applied) at each row's column and attends `q`
    /// (`[R, H, 1, D]`) over each row's columns, scores scaled by `scale`.
    /// Returns `[R, H, 1, D]`.
    ///
    /// Errors: MLX errors (shapes that do not fit the slab).
    pub fn attend(
        &mut self,
        l: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        let (keys, values) = self
            .state
            .layers
            .get(l)
            .cloned()
            .ok_or_else(|| Exception::custom(format!("decode slab: no layer {l}")))?;
        let keys = self.write(keys, k)?;
        let values = self.write(values, v)?;
        self.state.layers[l] = (keys.clone(), values.clone());
        if self.kernel {
            // Long rows: split-K kernels (every key read once per KV head,
            // thousands of blocks); short ones: one block per head and row.
            let (d, rep) = (q.shape()[3], q.shape()[1] / keys.shape()[1].max(1));
            if self.width > 2 * cuda_split_attention::CHUNK as usize
                && cuda_split_attention::split_available(q.dtype(), d, rep)
            {
                return cuda_split_attention::attend_slab(
                    q, &keys, &values, &self.cols, self.width, scale,
                );
            }
            return cuda_decode_attention::attend(q, &keys, &values, &self.cols, scale);
        }
        let w = self.width as i32;
        let (keys, values) = if self.width < self.state.capacity {
            (
                keys.index((.., .., ..w, ..)),
                values.index((.., .., ..w, ..)),
            )
        } else {
            (keys, values)
        };
        let mask = self.mask.as_ref().map(ScaledDotProductAttentionMask::Array);
        Ok(fast::scaled_dot_product_attention(
            q, &keys, &values, scale, mask, None,
        )?)
    }

    /// `buffer` `[R, H_kv, capacity, D]` with `new` `[R, H_kv, 1, D]`
    /// scattered at (slot r, column cols[r]): one op for every row. The slab
    /// holds the only reference to `buffer`, so MLX updates it in place.
    fn write(&self, buffer: Array, new: &Array) -> Result<Array> {
        let sh = new.shape();
        let updates = new
            .reshape(&[sh[0], 1, sh[1], 1, sh[3]])?
            .as_dtype(buffer.dtype())?;
        scatter(buffer, &[&self.slots, &self.cols], &updates, &[0, 2])
    }
}

/// MLX's `scatter` (`mlx/ops.h`): `a` with `updates` written at the points
/// `indices` name along `axes` (mlx-rs exposes it only through numpy-style
/// index assignment, whose mixed-index rules would reorder these axes).
fn scatter(a: Array, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
    let stream = StreamOrDevice::default();
    let handles: Vec<mlx_sys::mlx_array> = indices.iter().map(|a| a.as_ptr()).collect();
    // SAFETY: every handle is alive for the call (borrowed above); the
    // vector copies the handles it holds and is freed here; the result
    // handle is wrapped in an `Array`, which frees it.
    unsafe {
        let vector = mlx_sys::mlx_vector_array_new_data(handles.as_ptr(), handles.len());
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_scatter(
            &mut res,
            a.as_ptr(),
            vector,
            updates.as_ptr(),
            axes.as_ptr(),
            axes.len(),
            stream.as_ref().as_ptr(),
        );
        mlx_sys::mlx_vector_array_free(vector);
        let out = Array::from_ptr(res);
        if status != 0 {
            return Err(Exception::custom("decode slab: scatter rejected its inputs").into());
        }
        Ok(out)
    }
}

impl Drop for SlabStep<'_> {
    fn drop(&mut self) {
        // Every row wrote one more column.
        for m in self.state.members.iter_mut().flatten() {
            m.len += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{random, transforms::eval};

    const LAYERS: usize = 2;
    const H: i32 = 4;
    const HKV: i32 = 2;
    const D: i32 = 8;

    fn normal(shape: &[i32]) -> Array {
        random::normal::<f32>(shape, None, None, None).expect("random")
    }

    /// A cache holding `len` random positions in every layer.
    fn filled(len: usize) -> KvCache {
        let mut c = KvCache::new(LAYERS);
        if len > 0 {
            for l in 0..LAYERS {
                let t = len as i32;
                c.update(l, &normal(&[1, HKV, t, D]), &normal(&[1, HKV, t, D]))
                    .expect("update");
            }
            c.advance(len);
        }
        c
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        let d = ops::abs(ops::subtract(a, b).expect("sub")).expect("abs");
        ops::max(&d, None).expect("max").as_slice::<f32>()[0]
    }

    /// One step for `names` (indices into `slab_rows`/`solo_rows`): the slab's
    /// outputs against each row attending over its own cache.
    fn step(
        slab: &DecodeSlab,
        slab_rows: &mut [KvCache],
        solo_rows: &mut [KvCache],
        names: &[usize],
    ) {
        let n = names.len() as i32;
        let qs: Vec<Array> = (0..LAYERS).map(|_| normal(&[n, H, 1, D])).collect();
        let ks: Vec<Array> = (0..LAYERS).map(|_| normal(&[n, HKV, 1, D])).collect();
        let vs: Vec<Array> = (0..LAYERS).map(|_| normal(&[n, HKV, 1, D])).collect();
        let like = ops::zeros::<f32>(&[1, HKV, 1, D]).expect("zeros");
        let scale = 0.35;
        let mut outs = Vec::new();
        {
            // Borrow the named rows mutably, in the step's order.
            let mut picked: Vec<&mut KvCache> = Vec::new();
            let mut rest: Vec<Option<&mut KvCache>> = slab_rows.iter_mut().map(Some).collect();
            for &i in names {
                picked.push(rest[i].take().expect("row named twice"));
            }
            let mut s = slab.begin(&mut picked, LAYERS, &like).expect("begin");
            for l in 0..LAYERS {
                outs.push(s.attend(l, &qs[l], &ks[l], &vs[l], scale).expect("attend"));
            }
            drop(s);
            for c in picked {
                c.advance(1);
            }
        }
        for (r, &i) in names.iter().enumerate() {
            let r = r as i32;
            let solo = &mut solo_rows[i];
            for l in 0..LAYERS {
                let pick = |a: &Array| a.index(r..r + 1);
                let (keys, values) = solo
                    .update(l, &pick(&ks[l]), &pick(&vs[l]))
                    .expect("update");
                let want = fast::scaled_dot_product_attention(
                    pick(&qs[l]),
                    &keys,
                    &values,
                    scale,
                    None,
                    None,
                )
                .expect("sdpa");
                let got = outs[l].index(r..r + 1);
                eval([&want, &got]).expect("eval");
                assert!(max_diff(&want, &got) < 1e-5, "row {i} layer {l}");
            }
            solo.advance(1);
        }
    }

    fn assert_same_kv(a: &mut KvCache, b: &mut KvCache) {
        a.detach();
        assert_eq!(a.offset(), b.offset());
        let len = a.offset() as i32;
        for (x, y) in a.layer_buffers().into_iter().zip(b.layer_buffers()) {
            let ((xk, xv), (yk, yv)) = (x.expect("layer"), y.expect("layer"));
            for (p, q) in [(xk, yk), (xv, yv)] {
                let (p, q) = (p.index((.., .., ..len, ..)), q.index((.., .., ..len, ..)));
                assert!(max_diff(&p, &q) < 1e-6);
            }
        }
    }

    /// Rows joining, sitting a step out, coming back in another order,
    /// leaving (read out, dropped) and a fresh row: every step equals each
    /// row alone over its own cache, and what a row reads back is its own.
    #[test]
    fn slab_steps_equal_each_row_alone() {
        random::seed(11).expect("seed");
        let lens = [3usize, 0, 5, 300];
        let mut solo: Vec<KvCache> = lens.iter().map(|&l| filled(l)).collect();
        let mut rows: Vec<KvCache> = solo.iter().map(KvCache::clone).collect();
        let slab = DecodeSlab::default();
        step(&slab, &mut rows, &mut solo, &[0, 1, 2]);
        step(&slab, &mut rows, &mut solo, &[0, 1, 2]);
        // Row 1 sits out (parked), then comes back first.
        step(&slab, &mut rows, &mut solo, &[0, 2]);
        step(&slab, &mut rows, &mut solo, &[1, 0, 2]);
        // A clone reads the row out without taking it from the slab.
        let mut copy = rows[2].clone();
        assert_same_kv(&mut copy, &mut solo[2]);
        // Row 0 leaves (as a retired row does), a longer row joins past the
        // slab's capacity.
        let mut gone = std::mem::replace(&mut rows[0], KvCache::new(LAYERS));
        assert_same_kv(&mut gone, &mut solo[0]);
        step(&slab, &mut rows, &mut solo, &[1, 2, 3]);
        step(&slab, &mut rows, &mut solo, &[1, 2, 3]);
        // One row alone (no mask).
        step(&slab, &mut rows, &mut solo, &[3]);
        // A row leaves and a fresh one takes its place in the order: the
        // freed slot must not be mistaken for the newcomer's.
        drop(std::mem::replace(&mut rows[3], KvCache::new(LAYERS)));
        solo[3] = KvCache::new(LAYERS);
        step(&slab, &mut rows, &mut solo, &[3]);
        for i in 1..4 {
            let (r, s) = (&mut rows[i], &mut solo[i]);
            assert_same_kv(r, s);
        }
        // A row that rejoins after its buffers came back out.
        step(&slab, &mut rows, &mut solo, &[2, 1]);
        drop(rows);
        // The last row gone: the slab gives its buffers back.
        let s = lock(&slab.state);
        assert!(s.parked.is_empty() && s.members.is_empty() && s.layers.is_empty());
    }

    #[test]
    fn a_very_long_row_beside_short_ones_is_not_worth_one_slab() {
        assert!(DecodeSlab::worth_batching(&[10, 20, 30]));
        assert!(DecodeSlab::worth_batching(&[1000, 900, 1100, 700]));
        assert!(!DecodeSlab::worth_batching(&[
            32_000, 10, 10, 10, 10, 10, 10, 10
        ]));
        assert!(!DecodeSlab::worth_batching(&[]));
    }
}
