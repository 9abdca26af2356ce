//! Link settings for the `mlxhost` binaries that mlx-sys cannot set itself
//! (`rustc-link-arg` from a library's build script does not reach binaries):
//! an rpath to libmlx so binaries run directly, and OpenBLAS as a direct
//! dependency so its `cblas_*` symbols interpose the wheel's reference BLAS.
//!
//! GPU: when MLX's CUDA build of the same version is installed beside the
//! CPU wheel the build compiles against (`scripts/setup.sh` on an NVIDIA
//! machine: `wheels/mlx-cuda-13-<version>/mlx/lib`), its folder comes first
//! in the rpath, so the binary loads the CUDA libmlx (same C++ API and ABI)
//! and MLX's default device is the GPU. `MLX_BACKEND=cpu` at build time
//! leaves it out.
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    println!("cargo:rerun-if-env-changed=DEP_MLX_OPENBLAS");
    println!("cargo:rerun-if-env-changed=MLX_BACKEND");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        if let Some(cuda) = cuda_lib_dir(Path::new(&dir)) {
            println!(
                "cargo:rerun-if-changed={}",
                cuda.join("libmlx.so").display()
            );
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", cuda.display());
        }
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    if std::env::var("DEP_MLX_OPENBLAS").is_ok() {
        // --no-as-needed: no Rust symbol refers to it; it is here to interpose.
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-lopenblas,--pop-state");
    }
}

/// The CUDA wheel's `mlx/lib` beside the CPU wheel whose `mlx/lib` is
/// `cpu_lib` (`.../wheels/mlx-cpu-<version>/mlx/lib`), when it holds a
/// libmlx and `MLX_BACKEND` is not `cpu`.
fn cuda_lib_dir(cpu_lib: &Path) -> Option<std::path::PathBuf> {
    if std::env::var("MLX_BACKEND").is_ok_and(|b| b == "cpu") {
        return None;
    }
    let version = std::env::var("DEP_MLX_VERSION").ok()?;
    let wheels = cpu_lib.parent()?.parent()?.parent()?;
    let cuda = wheels.join(format!("mlx-cuda-13-{version}/mlx/lib"));
    cuda.join("libmlx.so").is_file().then_some(cuda)
}
