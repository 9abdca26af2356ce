//! Restoring an entry: `mmap` the file, page it in with several threads,
//! and hand each tensor's bytes to MLX with a release callback that owns
//! the mapping (mlx-c's `mlx_array_new_data_managed_payload`). A backend
//! whose allocator can adopt host memory uses the pages in place; MLX's
//! CPU allocator cannot (it keeps a size header before each buffer), so it
//! copies once and calls the release callback right away. The mapping is
//! private copy-on-write, so a backend that adopts it may write into a
//! restored buffer in place without touching the file.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use mlx_rs::{Array, Dtype};

use super::format::{self, EntryKey, EntryLayout, FormatError, Header};
use crate::cache::state::{LayerState, RowStates};
use crate::cache::{KvCache, KvQuant, KvShape, LayerKind};

/// The KV layout the running model expects (every restored tensor is
/// checked against it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGeometry {
    /// Each cache layer's KV heads and head dimension (the model's
    /// `CausalLm::kv_shapes`: one per layer of its cache, which with
    /// Gemma 4's KV sharing is fewer than its transformer layers).
    pub shapes: Vec<KvShape>,
    /// KV dtype (the activation dtype).
    pub dtype: Dtype,
    /// Each cache layer's kind (as many as `shapes`).
    pub kinds: Vec<LayerKind>,
    /// The full-attention layers' KV quantization (`--kv-bits`; `None`:
    /// float): their tensors are `uint32` packed rows `[1, H_kv, T, P]`.
    pub quant: Option<KvQuant>,
}

impl KvGeometry {
    /// Cache layers.
    pub fn layers(&self) -> usize {
        self.shapes.len()
    }

    /// The cache kind's name in the file: `full` when every layer is,
    /// `hybrid` when some layer keeps a recurrent state, else `sliding`.
    pub fn kind_name(&self) -> &'static str {
        if self.kinds.iter().all(|k| *k == LayerKind::Full) {
            "full"
        } else if self.kinds.contains(&LayerKind::Recurrent) {
            "hybrid"
        } else {
            "sliding"
        }
    }

    /// The layers' kinds for the KV-scheme part of the cache key: `full`,
    /// or each run of equal kinds as `<kind>*<count>` joined by `,`.
    pub fn kinds_scheme(&self) -> String {
        let kinds = self.kind_runs();
        match self.quant {
            Some(q) => format!("{kinds}/{}", q.name()),
            None => kinds,
        }
    }

    /// [`KvGeometry::kinds_scheme`] without the quantization.
    fn kind_runs(&self) -> String {
        if self.kind_name() == "full" {
            return "full".into();
        }
        let mut runs: Vec<(LayerKind, usize)> = Vec::new();
        for &k in &self.kinds {
            match runs.last_mut() {
                Some((last, n)) if *last == k => *n += 1,
                _ => runs.push((k, 1)),
            }
        }
        runs.iter()
            .map(|(k, n)| format!("{}*{n}", k.name()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// What the file records of `kv`'s layers beyond its tensors.
    pub fn layout_of(&self, kv: &KvCache) -> EntryLayout {
        let sliding = self.kind_name() == "sliding";
        EntryLayout {
            kind: self.kind_name().into(),
            layer_starts: if sliding {
                (0..self.layers())
                    .map(|l| kv.layer_start(l) as u64)
                    .collect()
            } else {
                Vec::new()
            },
            resume_from: kv.min_resume() as u64,
            state_positions: kv
                .states()
                .map(|s| s.resume_points(kv.offset()))
                .unwrap_or_default()
                .into_iter()
                .map(|p| p as u64)
                .collect(),
        }
    }

    /// The tensor names of an entry, in file order: each KV layer's keys
    /// and values, each recurrent layer's conv and recurrent state at each
    /// of `state_positions`.
    pub fn tensor_names(&self, state_positions: &[u64]) -> Vec<String> {
        let mut names = Vec::new();
        for (l, kind) in self.kinds.iter().enumerate() {
            match kind {
                LayerKind::Recurrent => {
                    for p in state_positions {
                        names.push(format!("layers.{l}.conv@{p}"));
                        names.push(format!("layers.{l}.ssm@{p}"));
                    }
                }
                _ => {
                    names.push(format!("layers.{l}.keys"));
                    names.push(format!("layers.{l}.values"));
                }
            }
        }
        names
    }
}

/// The dtype's name in the file format.
pub fn dtype_name(dtype: Dtype) -> Option<&'static str> {
    match dtype {
        Dtype::Float32 => Some("float32"),
        Dtype::Float16 => Some("float16"),
        Dtype::Bfloat16 => Some("bfloat16"),
        Dtype::Uint32 => Some("uint32"),
        _ => None,
    }
}

/// The dtype a file's dtype name stands for.
fn dtype_of(name: &str) -> Option<Dtype> {
    match name {
        "float32" => Some(Dtype::Float32),
        "float16" => Some(Dtype::Float16),
        "bfloat16" => Some(Dtype::Bfloat16),
        "uint32" => Some(Dtype::Uint32),
        _ => None,
    }
}

unsafe extern "C" fn release_mapping(payload: *mut std::ffi::c_void) {
    // SAFETY: `payload` is the `Box<Arc<MmapMut>>` leaked in `borrowed_array`,
    // and MLX calls this exactly once, when the array's buffer is freed.
    unsafe { drop(Box::from_raw(payload as *mut Arc<MmapMut>)) };
}

/// An MLX array over `len` bytes of `map` at `offset` (which the caller has
/// checked are in bounds and sized for `shape` and `dtype`).
fn borrowed_array(
    map: &Arc<MmapMut>,
    base: *mut u8,
    offset: usize,
    shape: &[i32],
    dtype: Dtype,
) -> Result<Array, FormatError> {
    let payload = Box::into_raw(Box::new(map.clone())) as *mut std::ffi::c_void;
    // SAFETY: `base + offset` lies inside the mapping (bounds checked by
    // `format::read_header`), which the payload keeps alive until MLX calls
    // `release_mapping`; the mapping is private and writable, so in-place
    // writes by MLX are allowed and never reach the file.
    let c = unsafe {
        mlx_sys::mlx_array_new_data_managed_payload(
            base.add(offset) as *mut std::ffi::c_void,
            shape.as_ptr(),
            shape.len() as i32,
            dtype.into(),
            payload,
            Some(release_mapping),
        )
    };
    if c.ctx.is_null() {
        // SAFETY: MLX did not take ownership of the payload.
        unsafe { release_mapping(payload) };
        return Err(FormatError::Corrupt("MLX refused the buffer".into()));
    }
    // SAFETY: `c` is a fresh, owned array handle.
    Ok(unsafe { Array::from_ptr(c) })
}

/// Threads reading a restore: one reader leaves most of an SSD's
/// bandwidth unused (measured 0.4 GB/s with one thread, 1.6 GB/s with
/// eight on the dev machine).
const READERS: usize = 8;

/// Builds one MLX array per tensor on [`READERS`] threads, each over a
/// contiguous run of the file, so the page faults (disk reads), the
/// optional hash checks and MLX's copy all run in parallel.
fn build_arrays(
    map: &Arc<MmapMut>,
    base: *mut u8,
    tensors: &[format::TensorRecord],
    verify: bool,
) -> Result<Vec<Array>, FormatError> {
    let base = base as usize;
    let per = tensors.len().div_ceil(READERS).max(1);
    let parts: Vec<Result<Vec<Array>, FormatError>> = std::thread::scope(|s| {
        let handles: Vec<_> = tensors
            .chunks(per)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|t| {
                            let range = t.offset as usize..(t.offset + t.nbytes) as usize;
                            if verify {
                                format::verify_tensor(t, &map[range])?;
                            }
                            let shape: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
                            let dtype = dtype_of(&t.dtype).ok_or_else(|| {
                                FormatError::Corrupt(format!("dtype {:?}", t.dtype))
                            })?;
                            borrowed_array(map, base as *mut u8, t.offset as usize, &shape, dtype)
                        })
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(FormatError::Corrupt("a restore thread panicked".into()))
                })
            })
            .collect()
    });
    let mut out = Vec::with_capacity(tensors.len());
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

/// Loads the entry at `path` as a KV cache of `header.tokens.len()`
/// positions, after checking its key and geometry (and, with `verify`,
/// every tensor's hash).
///
/// Errors: [`FormatError`] for any mismatch; the caller quarantines.
pub fn load(
    path: &Path,
    expected: &EntryKey,
    geometry: &KvGeometry,
    verify: bool,
) -> Result<(KvCache, Vec<u32>), FormatError> {
    let file = File::open(path)?;
    let header = format::read_header(&file)?;
    check_layout(&header, expected, geometry)?;
    // SAFETY: entry files are never modified in place (writers rename new
    // files over them; eviction unlinks), so the mapping's contents are
    // stable while it lives.
    let mut map = unsafe { MmapOptions::new().map_copy(&file)? };
    // The header's bounds were checked against the length when it was
    // read; the mapping must still have it.
    if map.len() as u64 != header.file_len {
        return Err(FormatError::Corrupt(format!(
            "changed while being read: {} bytes mapped, the header says {}",
            map.len(),
            header.file_len
        )));
    }
    let base = map.as_mut_ptr();
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::WillNeed);
    let map = Arc::new(map);
    let n = header.tokens.len();
    let arrays = build_arrays(&map, base, &header.tensors, verify)?;
    let mut arrays = arrays.into_iter();
    let positions = &header.state_positions;
    let mut layers = Vec::with_capacity(geometry.layers());
    // Per stored position, every cache layer's state.
    let mut points: Vec<(usize, Vec<Option<LayerState>>)> = positions
        .iter()
        .map(|&p| (p as usize, vec![None; geometry.layers()]))
        .collect();
    let short = || FormatError::Corrupt("fewer tensors than its layout".into());
    for (l, kind) in geometry.kinds.iter().enumerate() {
        if *kind == LayerKind::Recurrent {
            for point in &mut points {
                let conv = arrays.next().ok_or_else(short)?;
                let ssm = arrays.next().ok_or_else(short)?;
                point.1[l] = Some(LayerState::new(conv, ssm));
            }
            layers.push(None);
        } else {
            let k = arrays.next().ok_or_else(short)?;
            let v = arrays.next().ok_or_else(short)?;
            layers.push(Some((k, v)));
        }
    }
    let states = match positions.is_empty() {
        true => None,
        false => Some(RowStates::restored(points, n).ok_or_else(|| {
            FormatError::Corrupt("no recurrent states at the entry's end".into())
        })?),
    };
    let starts = layer_starts(&header, geometry.layers());
    Ok((
        KvCache::from_layer_parts(layers, &geometry.kinds, &starts, n, states)
            .with_quant(geometry.quant),
        header.tokens,
    ))
}

/// Per layer, the first position the entry holds (0 without
/// `layer_starts`: version 1 and full caches).
fn layer_starts(header: &Header, layers: usize) -> Vec<usize> {
    if header.layer_starts.is_empty() {
        vec![0; layers]
    } else {
        header.layer_starts.iter().map(|&s| s as usize).collect()
    }
}

/// The header must describe exactly the cache the model would build.
fn check_layout(
    header: &Header,
    expected: &EntryKey,
    geometry: &KvGeometry,
) -> Result<(), FormatError> {
    if &header.key != expected {
        return Err(FormatError::Corrupt(
            "its key does not match the running model".into(),
        ));
    }
    if header.kind != geometry.kind_name() {
        return Err(FormatError::Corrupt(format!(
            "cache kind {:?} is not the model's ({})",
            header.kind,
            geometry.kind_name()
        )));
    }
    let dtype = dtype_name(geometry.dtype).unwrap_or("?");
    let n = header.tokens.len() as u64;
    let starts_ok = header.layer_starts.is_empty()
        || (header.layer_starts.len() == geometry.layers()
            && header.layer_starts.iter().all(|&s| s < n));
    let starts = if starts_ok {
        layer_starts(header, geometry.layers())
    } else {
        vec![0; geometry.layers()]
    };
    // A layer that dropped positions must be a sliding-window layer, and
    // the resume point must cover what it dropped.
    let kinds_ok = starts.iter().zip(&geometry.kinds).all(|(&s, k)| {
        s == 0 || matches!(k, LayerKind::SlidingWindow { window } if header.resume_from as usize >= s + window - 1)
    });
    // Recurrent states: at ascending positions ending at the entry's end
    // (and only on a hybrid model).
    let positions = &header.state_positions;
    let hybrid = geometry.kind_name() == "hybrid";
    let positions_ok = match hybrid {
        true => {
            positions.last() == Some(&n)
                && positions.first().is_some_and(|&p| p > 0)
                && positions.windows(2).all(|w| w[0] < w[1])
        }
        false => positions.is_empty(),
    };
    let names = geometry.tensor_names(positions);
    // Layer of each tensor, in file order.
    let layer_of: Vec<usize> = geometry
        .kinds
        .iter()
        .enumerate()
        .flat_map(|(l, k)| {
            let count = match k {
                LayerKind::Recurrent => 2 * positions.len(),
                _ => 2,
            };
            std::iter::repeat_n(l, count)
        })
        .collect();
    // Every conv state one shape in the activation dtype, every recurrent
    // state one float32 shape.
    let first = |suffix: &str| {
        header
            .tensors
            .iter()
            .find(|t| t.name.contains(suffix))
            .map(|t| t.shape.clone())
    };
    let (conv_shape, ssm_shape) = (first(".conv@"), first(".ssm@"));
    let tensor_ok = |t: &format::TensorRecord, name: &String, l: usize| -> bool {
        if &t.name != name {
            return false;
        }
        match geometry.kinds[l] {
            LayerKind::Recurrent if name.contains(".conv@") => {
                t.dtype == dtype && t.shape.len() == 3 && Some(&t.shape) == conv_shape.as_ref()
            }
            LayerKind::Recurrent => {
                t.dtype == "float32" && t.shape.len() == 4 && Some(&t.shape) == ssm_shape.as_ref()
            }
            _ => {
                let held = n - starts[l] as u64;
                let Some(kv) = geometry.shapes.get(l) else {
                    return false;
                };
                match (geometry.kinds[l], geometry.quant) {
                    (LayerKind::Full, Some(q)) => {
                        let words = q.row_words(kv.head_dim) as u64;
                        t.dtype == "uint32" && t.shape == [1, kv.kv_heads as u64, held, words]
                    }
                    _ => {
                        t.dtype == dtype
                            && t.shape == [1, kv.kv_heads as u64, held, kv.head_dim as u64]
                    }
                }
            }
        }
    };
    let ok = n > 0
        && starts_ok
        && kinds_ok
        && positions_ok
        && header.resume_from <= n
        && header.tensors.len() == names.len()
        && header
            .tensors
            .iter()
            .zip(&names)
            .zip(&layer_of)
            .all(|((t, name), &l)| tensor_ok(t, name, l));
    if ok {
        Ok(())
    } else {
        Err(FormatError::Corrupt(
            "its tensors do not match the model's KV layout".into(),
        ))
    }
}
