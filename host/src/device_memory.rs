//! MLX's memory on the device the model runs on: the limits the server sets
//! (`--memory-limit`, `--memory-cache`) and what MLX holds now.
//!
//! Why: MLX keeps freed buffers in a cache for reuse, unbounded by default.
//! On an H100 a 17 GB model's server held 79 of the card's 80 GB after
//! warm-up, and a second process on the card slowed 35x; on Apple Silicon
//! GPU memory is the system's RAM. The server therefore sets MLX's memory
//! limit and cache limit at start, and computes its admission budget inside
//! the limit (weights, buffer cache and prompt cache left out).
//!
//! Sources: `mlx_set_memory_limit`, `mlx_set_cache_limit`,
//! `mlx_set_wired_limit` (Metal) and `mlx_get_*_memory` of mlx-c's
//! `memory.h`; the device's size from `mlx_device_info` (`memory_size` on
//! Metal; `total_memory` on MLX 0.32's CUDA build, whose keys are
//! `total_memory`, `free_memory`, `device_name`, `architecture`, ...).

use std::ffi::CString;
use std::sync::OnceLock;

use serde::Serialize;

/// Limits applied to MLX's allocator, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryLimits {
    /// MLX's memory limit: what its allocations (weights, KV, activations
    /// and the buffer cache) may reach before it frees cached buffers and,
    /// past that, fails an allocation.
    pub limit: u64,
    /// The buffer cache's cap: freed buffers kept for reuse beyond it are
    /// returned to the device.
    pub cache_limit: u64,
}

impl MemoryLimits {
    /// The defaults: on a GPU, 90% of the device's memory (vLLM's
    /// `--gpu-memory-utilization`) and a buffer cache of 10% of that; on
    /// the CPU backend none (`None`: MLX's own defaults, an unbounded
    /// cache). `limit_gib` / `cache_gib` override either part.
    ///
    /// Errors: a size that is negative or not finite, or a cache larger
    /// than the limit (the message names the flag).
    pub fn resolve(
        limit_gib: Option<f64>,
        cache_gib: Option<f64>,
        gpu: bool,
        device_bytes: Option<u64>,
    ) -> Result<Option<MemoryLimits>, String> {
        let limit = match limit_gib {
            // At least 1 MiB: smaller sizes round to nothing.
            Some(g) if !(g.is_finite() && g * GIB >= (1u64 << 20) as f64) => {
                return Err(format!(
                    "--memory-limit must be a size in GiB of at least 1 MiB, got {g}"
                ))
            }
            Some(g) => Some((g * GIB) as u64),
            None if gpu => device_bytes.map(|d| (d as f64 * 0.9) as u64),
            None => None,
        };
        let Some(limit) = limit else {
            return match cache_gib {
                Some(_) => Err(
                    "--memory-cache needs --memory-limit here (the device's memory size \
                     is unknown or this is the CPU backend)"
                        .into(),
                ),
                None => Ok(None),
            };
        };
        let cache_limit = match cache_gib {
            Some(g) if !(g.is_finite() && g >= 0.0) => {
                return Err(format!(
                    "--memory-cache must be a size in GiB >= 0, got {g}"
                ))
            }
            // 0: MLX keeps no freed buffers.
            Some(g) => (g * GIB) as u64,
            None => limit / 10,
        };
        if cache_limit > limit {
            return Err(format!(
                "--memory-cache ({:.2} GiB) is larger than --memory-limit ({:.2} GiB)",
                cache_limit as f64 / GIB,
                limit as f64 / GIB
            ));
        }
        Ok(Some(MemoryLimits { limit, cache_limit }))
    }

    /// Sets MLX's memory and cache limits (and, on Metal, the wired limit
    /// to the memory limit capped at the device's recommended working set,
    /// as mlx-lm does for large models). Process-wide.
    pub fn apply(self) {
        let _ = APPLIED.set(self);
        let mut previous = 0usize;
        // SAFETY: each call writes one size_t through a valid pointer.
        unsafe {
            mlx_sys::mlx_set_memory_limit(&mut previous, self.limit as usize);
            mlx_sys::mlx_set_cache_limit(&mut previous, self.cache_limit as usize);
        }
        if crate::runtime::backend_name() == "metal" {
            let wired = device_size("max_recommended_working_set_size")
                .map_or(self.limit, |w| w.min(self.limit));
            // SAFETY: as above.
            unsafe {
                mlx_sys::mlx_set_wired_limit(&mut previous, wired as usize);
            }
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The limits [`MemoryLimits::apply`] set, for reports.
static APPLIED: OnceLock<MemoryLimits> = OnceLock::new();
/// MLX's active memory once the model was loaded (its weights), recorded
/// by the scheduler at start.
static WEIGHTS: OnceLock<u64> = OnceLock::new();

/// Records MLX's active memory now as the model's weights (call once,
/// after loading and before any request).
pub fn record_weights() -> u64 {
    *WEIGHTS.get_or_init(|| current().active_bytes)
}

/// `/stats`' `memory` object: MLX's counters now, the limits set at start
/// and the weights' share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    #[serde(flatten)]
    pub now: MemoryUse,
    /// The buffer cache's cap set at start (`None`: MLX's default).
    pub cache_limit_bytes: Option<u64>,
    /// Active memory once the model was loaded (`None`: not recorded yet).
    pub weights_bytes: Option<u64>,
}

/// MLX's memory now, with the limits and weights recorded at start.
pub fn report() -> MemoryReport {
    MemoryReport {
        now: current(),
        cache_limit_bytes: APPLIED.get().map(|l| l.cache_limit),
        weights_bytes: WEIGHTS.get().copied(),
    }
}

/// What MLX holds now, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryUse {
    /// Buffers in use (weights, KV caches, live activations).
    pub active_bytes: u64,
    /// Freed buffers kept in MLX's cache for reuse.
    pub cache_bytes: u64,
    /// The most `active_bytes` has been since start.
    pub peak_bytes: u64,
    /// MLX's memory limit now.
    pub limit_bytes: u64,
}

/// MLX's allocator's counters now.
pub fn current() -> MemoryUse {
    let read = |f: unsafe extern "C" fn(*mut usize) -> std::os::raw::c_int| -> u64 {
        let mut v = 0usize;
        // SAFETY: `f` writes one size_t through a valid pointer.
        unsafe { f(&mut v) };
        v as u64
    };
    MemoryUse {
        active_bytes: read(mlx_sys::mlx_get_active_memory),
        cache_bytes: read(mlx_sys::mlx_get_cache_memory),
        peak_bytes: read(mlx_sys::mlx_get_peak_memory),
        limit_bytes: read(mlx_sys::mlx_get_memory_limit),
    }
}

/// The GPU's memory size in bytes, where MLX has a GPU backend and reports
/// it (`memory_size` on Metal, `total_memory` on CUDA).
pub fn device_bytes() -> Option<u64> {
    if !crate::runtime::gpu_available() {
        return None;
    }
    device_size("memory_size").or_else(|| device_size("total_memory"))
}

/// A size-valued key of the GPU's `mlx_device_info`.
fn device_size(key: &str) -> Option<u64> {
    let key = CString::new(key).ok()?;
    // SAFETY: the device and info objects are created, used with valid
    // pointers and freed here; `get_size` writes one size_t.
    unsafe {
        let dev = mlx_sys::mlx_device_new_type(mlx_sys::mlx_device_type__MLX_GPU, 0);
        let mut info = mlx_sys::mlx_device_info_new();
        let mut value = 0usize;
        let ok = mlx_sys::mlx_device_info_get(&mut info, dev) == 0
            && mlx_sys::mlx_device_info_get_size(&mut value, info, key.as_ptr()) == 0;
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(dev);
        ok.then_some(value as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn gpu_defaults_to_90_percent_with_a_tenth_as_cache() {
        let l = MemoryLimits::resolve(None, None, true, Some(80 * G)).unwrap();
        assert_eq!(
            l,
            Some(MemoryLimits {
                limit: 72 * G,
                cache_limit: 72 * G / 10
            })
        );
    }

    #[test]
    fn cpu_sets_nothing_unless_asked() {
        assert_eq!(MemoryLimits::resolve(None, None, false, None), Ok(None));
        let l = MemoryLimits::resolve(Some(4.0), Some(0.5), false, None).unwrap();
        assert_eq!(
            l,
            Some(MemoryLimits {
                limit: 4 * G,
                cache_limit: G / 2
            })
        );
    }

    #[test]
    fn bad_sizes_name_their_flag() {
        let e = MemoryLimits::resolve(Some(-1.0), None, true, Some(G)).unwrap_err();
        assert!(e.contains("--memory-limit"), "{e}");
        let e = MemoryLimits::resolve(Some(2.0), Some(3.0), true, Some(G)).unwrap_err();
        assert!(e.contains("--memory-cache"), "{e}");
        let e = MemoryLimits::resolve(None, Some(1.0), false, None).unwrap_err();
        assert!(e.contains("--memory-limit"), "{e}");
        let e = MemoryLimits::resolve(Some(1e-12), None, false, None).unwrap_err();
        assert!(e.contains("--memory-limit"), "{e}");
        let e = MemoryLimits::resolve(Some(1.0), Some(-1.0), false, None).unwrap_err();
        assert!(e.contains("--memory-cache"), "{e}");
        // A zero cache is a setting: MLX keeps no freed buffers.
        let l = MemoryLimits::resolve(Some(1.0), Some(0.0), false, None).unwrap();
        assert_eq!(l.map(|l| l.cache_limit), Some(0));
    }

    #[test]
    fn counters_read_without_a_limit_set() {
        let m = current();
        assert!(m.peak_bytes >= m.active_bytes);
    }
}
