//! Link settings for the `mlxhost` binaries that mlx-sys cannot set itself
//! (`rustc-link-arg` from a library's build script does not reach binaries):
//! an rpath to libmlx so binaries run directly, and OpenBLAS as a direct
//! dependency so its `cblas_*` symbols interpose the wheel's reference BLAS.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    println!("cargo:rerun-if-env-changed=DEP_MLX_OPENBLAS");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    if std::env::var("DEP_MLX_OPENBLAS").is_ok() {
        // --no-as-needed: no Rust symbol refers to it; it is here to interpose.
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-lopenblas,--pop-state");
    }
}
