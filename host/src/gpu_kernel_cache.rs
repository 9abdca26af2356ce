//! Compiled GPU kernels kept under `$MLXHOST_CACHE` between runs.
//!
//! On CUDA, MLX compiles its kernels (and ours, [`crate::model::cuda_kernel`])
//! with NVRTC at first use and keeps the PTX in `MLX_PTX_CACHE_DIR`, by
//! default `/tmp/mlx/<version>/ptx`; the driver then compiles PTX for the
//! card and keeps that in `CUDA_CACHE_PATH`, by default
//! `~/.nv/ComputeCache`, at most 256 MiB. A fresh `/tmp` (a reboot, a
//! container) or an evicted driver cache means minutes of compiling before
//! the server is ready (issue 35: ~155 s against mlx_lm.server's ~15 s).
//! Both are pointed under mlxhost's own cache folder instead, next to the
//! models, unless the user already set them; the PTX folder is keyed by
//! MLX's version, as MLX's own default is, so an upgrade never loads stale
//! kernels.

use std::path::{Path, PathBuf};

/// The driver's cache limit we ask for (`CUDA_CACHE_MAXSIZE`, bytes): a
/// 32B model's kernels for every batch size exceed the 256 MiB default.
pub const DRIVER_CACHE_BYTES: u64 = 1 << 30;

/// MLX's version string (`mlx_version`), e.g. `0.32.2`.
pub fn mlx_version() -> String {
    // SAFETY: mlx_version writes a fresh string into `s`, which is read and
    // freed here; no device is touched.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let rc = mlx_sys::mlx_version(&mut s);
        let data = mlx_sys::mlx_string_data(s);
        let version = if rc == 0 && !data.is_null() {
            std::ffi::CStr::from_ptr(data)
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown".to_string()
        };
        mlx_sys::mlx_string_free(s);
        version
    }
}

/// The environment to set for kernel caches under `cache`, leaving out
/// any variable `is_set` says the user set: (name, value) pairs.
pub fn settings(
    cache: &Path,
    version: &str,
    is_set: impl Fn(&str) -> bool,
) -> Vec<(&'static str, String)> {
    let root = cache.join("gpu-kernels");
    let wanted = [
        (
            "MLX_PTX_CACHE_DIR",
            path_string(root.join(format!("mlx-{version}"))),
        ),
        ("CUDA_CACHE_PATH", path_string(root.join("cuda-driver"))),
        ("CUDA_CACHE_MAXSIZE", DRIVER_CACHE_BYTES.to_string()),
    ];
    wanted
        .into_iter()
        .filter(|(name, _)| !is_set(name))
        .collect()
}

fn path_string(p: PathBuf) -> String {
    p.to_string_lossy().into_owned()
}

/// Points MLX's and the CUDA driver's kernel caches under
/// [`crate::paths::cache_dir`] (creating the folders) where the user has
/// not set them. Must run before MLX compiles a kernel and before other
/// threads start (it sets environment variables): first thing in `main`.
/// A folder that cannot be created leaves that cache where it was.
pub fn persist() {
    let cache = crate::paths::cache_dir();
    let set = |name: &str| std::env::var_os(name).is_some();
    for (name, value) in settings(&cache, &mlx_version(), set) {
        if name != "CUDA_CACHE_MAXSIZE" && std::fs::create_dir_all(&value).is_err() {
            continue;
        }
        std::env::set_var(name, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caches_go_under_mlxhost_cache_keyed_by_mlx_version() {
        let s = settings(Path::new("/c"), "0.32.2", |_| false);
        assert_eq!(
            s,
            vec![
                ("MLX_PTX_CACHE_DIR", "/c/gpu-kernels/mlx-0.32.2".to_string()),
                ("CUDA_CACHE_PATH", "/c/gpu-kernels/cuda-driver".to_string()),
                ("CUDA_CACHE_MAXSIZE", (1u64 << 30).to_string()),
            ]
        );
    }

    #[test]
    fn a_users_own_setting_is_kept() {
        let s = settings(Path::new("/c"), "0.32.2", |n| n == "CUDA_CACHE_PATH");
        assert!(s.iter().all(|(n, _)| *n != "CUDA_CACHE_PATH"));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn mlx_version_is_the_linked_mlx() {
        let v = mlx_version();
        assert!(v.split('.').count() >= 3, "{v}");
    }
}
