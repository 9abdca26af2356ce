//! Build script: mlx-c compiled against the official MLX wheel.
//!
//! Steps (each cached under `$MLXHOST_CACHE`, default `~/.cache/mlxhost`):
//! 1. MLX itself: the `mlx-cpu` (Linux) or `mlx-metal` (macOS) wheel at the
//!    version mlx-c pins, installed with `pip install --target`, unless
//!    `MLX_DIR` points at an installed MLX (the folder holding `lib/` and
//!    `include/`, e.g. a pip-installed `site-packages/mlx`).
//! 2. mlx-c sources: the upstream `mlx-sys` crate (which vendors mlx-c) is
//!    fetched into the cargo registry by a nested `cargo metadata`.
//! 3. mlx-c is built with CMake (`MLX_C_USE_SYSTEM_MLX=ON`) and linked
//!    statically; libmlx is linked dynamically with an rpath published to
//!    dependents as `DEP_MLX_LIB_DIR`.
//! 4. bindgen over the mlx-c headers, with the settings mlx-rs 0.33 expects.
//!
//! The macOS branch (mlx-metal wheel) is kept small and is untested in CI.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

/// MLX version mlx-c 0.7.0 pins (`GIT_TAG v0.32.2`); the wheel must match or
/// mlx-c fails to compile (e.g. `gather_qmm` gained a parameter in 0.32.4).
const MLX_VERSION: &str = "0.32.2";
const UPSTREAM_MLX_SYS: &str = "0.7.0";

fn main() {
    for var in [
        "MLX_DIR",
        "MLXHOST_CACHE",
        "XDG_CACHE_HOME",
        "MLXHOST_PYTHON",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=native");
    println!("cargo:rerun-if-changed=build.rs");

    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let cache = cache_dir();
    let mlx_dir = match env::var_os("MLX_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => install_wheel(&cache, &target_os),
    };
    let mlx_lib = mlx_dir.join("lib");
    let mlx_cmake = mlx_dir.join("share/cmake/MLX");
    if !mlx_cmake.join("MLXConfig.cmake").is_file() {
        panic!(
            "no MLXConfig.cmake under {}; set MLX_DIR to an installed MLX {MLX_VERSION} \
             (the folder holding lib/ and include/)",
            mlx_cmake.display()
        );
    }

    let mlx_c_root = locate_mlx_c();
    let native =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("native");

    // mlx-c, built once per (mlx-c, MLX, profile) into the shared cache so a
    // clean `cargo build` does not pay ~90 s of CMake again.
    // Always Release: a debug mlx-c only slows the C shim and shares nothing with MLX.
    let profile = "Release";
    let build_dir = cache.join(format!(
        "mlx-c-{UPSTREAM_MLX_SYS}-mlx-{MLX_VERSION}-{target_os}"
    ));
    fs::create_dir_all(&build_dir).expect("create the mlx-c build cache");
    let mut config = cmake::Config::new(&mlx_c_root);
    config
        .out_dir(&build_dir)
        .profile(profile)
        .define("MLX_C_USE_SYSTEM_MLX", "ON")
        .define("MLX_DIR", &mlx_cmake)
        .define("MLX_C_BUILD_EXAMPLES", "OFF")
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("CMAKE_INSTALL_PREFIX", &build_dir);
    if target_os == "linux" {
        // GCC 12 has no <format>; mlx-c's private/io.h uses std::format.
        config.cxxflag(format!(
            "-include {}",
            native.join("format_compat.h").display()
        ));
    }
    let dst = config.build();
    println!("cargo:rustc-link-search=native={}/lib", dst.display());
    println!("cargo:rustc-link-search=native={}/build", dst.display());
    println!("cargo:rustc-link-lib=static=mlxc");

    // float16/bfloat16 accessors that mlx-c only defines on aarch64.
    if target_os != "macos" {
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file(native.join("half_accessors.cpp"))
            .include(&mlx_c_root)
            .include(mlx_dir.join("include"))
            .warnings(false)
            .compile("mlxsys_half");
    }
    // mlxhost's own MLX primitives (CPU kernels), always optimized: a debug
    // build of the host must not make the decode step's attention slow.
    let mut kernels = cc::Build::new();
    kernels
        .cpp(true)
        .std("c++20")
        .file(native.join("decode_attention.cpp"))
        .file(native.join("prefill_attention.cpp"))
        .file(native.join("prefill_attention_amx.cpp"))
        .file(native.join("quantized_matmul.cpp"))
        .file(native.join("packed_matmul.cpp"))
        .file(native.join("amx_matmul.cpp"))
        .file(native.join("swiglu.cpp"))
        .file(native.join("decode_layer.cpp"))
        .file(native.join("chunked_attention.cpp"))
        .file(native.join("logsumexp.cpp"))
        .file(native.join("top_p.cpp"))
        .file(native.join("categorical.cpp"))
        .file(native.join("graph_census.cpp"))
        .include(&mlx_c_root)
        .include(mlx_dir.join("include"))
        .opt_level(3)
        .flag_if_supported("-fno-math-errno")
        .warnings(false);
    if target_os == "linux" {
        kernels.flag(format!(
            "-include{}",
            native.join("format_compat.h").display()
        ));
        // No CPU BLAS linked (the NVIDIA build): the kernels' prefill
        // products use their own plain loop (quantized_matmul.cpp).
        if env::var_os("CARGO_FEATURE_OPENBLAS").is_none() {
            kernels.define("MLXHOST_NO_CBLAS", None);
        }
    }
    kernels.compile("mlxhost_kernels");

    println!("cargo:rustc-link-search=native={}", mlx_lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    if target_os == "macos" {
        println!("cargo:rustc-link-lib=c++");
        println!("cargo:rustc-link-lib=framework=Foundation");
        println!("cargo:rustc-link-lib=framework=Metal");
        println!("cargo:rustc-link-lib=framework=Accelerate");
    } else {
        println!("cargo:rustc-link-lib=stdc++");
        if env::var_os("CARGO_FEATURE_OPENBLAS").is_some() {
            link_openblas();
        }
    }
    // Dependents' build scripts read these as DEP_MLX_LIB_DIR / DEP_MLX_VERSION
    // and add the rpath to their binaries (rustc-link-arg does not propagate).
    println!("cargo::metadata=lib_dir={}", mlx_lib.display());
    println!("cargo::metadata=version={MLX_VERSION}");
    println!(
        "cargo::metadata=include={}",
        mlx_dir.join("include").display()
    );

    generate_bindings(&mlx_c_root, &native, &target_os);
}

/// `$MLXHOST_CACHE`, else `$XDG_CACHE_HOME/mlxhost`, else `~/.cache/mlxhost`.
fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("MLXHOST_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("mlxhost");
    }
    let home = env::var_os("HOME").expect("HOME or MLXHOST_CACHE must be set");
    PathBuf::from(home).join(".cache/mlxhost")
}

/// Installs the official MLX wheel into the cache (once) and returns the `mlx`
/// package folder (holding `lib/`, `include/`, `share/cmake/MLX`).
fn install_wheel(cache: &Path, target_os: &str) -> PathBuf {
    let wheel = if target_os == "macos" {
        "mlx-metal"
    } else {
        "mlx-cpu"
    };
    let target = cache.join(format!("wheels/{wheel}-{MLX_VERSION}"));
    let mlx = target.join("mlx");
    if mlx.join("share/cmake/MLX/MLXConfig.cmake").is_file() {
        return mlx;
    }
    let python = env::var("MLXHOST_PYTHON").unwrap_or_else(|_| "python3".into());
    let staging = cache.join(format!("wheels/.{wheel}-{MLX_VERSION}.partial"));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).expect("create the wheel staging folder");
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(&staging)
        .arg(format!("{wheel}=={MLX_VERSION}"))
        .status()
        .unwrap_or_else(|e| panic!("could not run `{python} -m pip`: {e}"));
    if !status.success() {
        panic!("`pip install {wheel}=={MLX_VERSION}` failed; install it yourself and set MLX_DIR");
    }
    let _ = fs::remove_dir_all(&target);
    fs::rename(&staging, &target).expect("move the wheel into the cache");
    mlx
}

/// Finds mlx-c inside upstream's `mlx-sys` crate, downloading it into the
/// cargo registry with a nested `cargo metadata` when needed.
fn locate_mlx_c() -> PathBuf {
    if let Some(dir) = env::var_os("MLX_C_DIR") {
        return PathBuf::from(dir);
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let probe = out.join("mlx-c-locator");
    fs::create_dir_all(probe.join("src")).expect("create the locator crate");
    fs::write(
        probe.join("Cargo.toml"),
        format!(
            "[package]\nname = \"mlx-c-locator\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             [dependencies]\nmlx-sys = {{ version = \"={UPSTREAM_MLX_SYS}\", default-features = false }}\n\
             [workspace]\n"
        ),
    )
    .expect("write the locator manifest");
    fs::write(probe.join("src/lib.rs"), "").expect("write the locator lib");
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let run = |offline: bool| {
        let mut cmd = Command::new(&cargo);
        cmd.args(["metadata", "--format-version", "1", "--manifest-path"])
            .arg(probe.join("Cargo.toml"));
        if offline {
            cmd.arg("--offline");
        }
        // The outer build's target dir lock must not be shared.
        cmd.env_remove("CARGO_TARGET_DIR");
        cmd.output().ok().filter(|o| o.status.success())
    };
    let offline_only = env::var("CARGO_NET_OFFLINE").as_deref() == Ok("true");
    let output = run(true)
        .or_else(|| if offline_only { None } else { run(false) })
        .expect("`cargo metadata` could not fetch upstream mlx-sys (for mlx-c); set MLX_C_DIR");
    let meta: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    let manifest = meta["packages"]
        .as_array()
        .and_then(|pkgs| {
            pkgs.iter()
                .find(|p| p["name"] == "mlx-sys" && p["version"] == UPSTREAM_MLX_SYS)
        })
        .and_then(|p| p["manifest_path"].as_str())
        .expect("upstream mlx-sys in cargo metadata");
    let root = Path::new(manifest)
        .parent()
        .expect("manifest has a parent")
        .join("src/mlx-c");
    assert!(
        root.join("CMakeLists.txt").is_file(),
        "no mlx-c at {}",
        root.display()
    );
    root
}

/// Asks dependents to link Debian's OpenBLAS ahead of libmlx so libmlx's
/// `cblas_sgemm` resolves to it. Link args do not propagate from a library's
/// build script, so the binary's build script adds them (`DEP_MLX_OPENBLAS`).
fn link_openblas() {
    let found = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .any(|dir| Path::new(dir).join("libopenblas.so").exists());
    if found {
        println!("cargo::metadata=openblas=1");
    } else {
        println!(
            "cargo:warning=libopenblas.so not found (apt install libopenblas-dev); \
             float32 GEMM falls back to the wheel's reference BLAS (~20x slower)"
        );
    }
}

fn generate_bindings(mlx_c_root: &Path, native: &Path, target_os: &str) {
    let header_dir = mlx_c_root.join("mlx/c");
    let mut headers: Vec<PathBuf> = fs::read_dir(&header_dir)
        .expect("read mlx-c headers")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    headers.sort();
    let mut builder = bindgen::Builder::default()
        .rust_target("1.73.0".parse().expect("rust-version"))
        .clang_arg(format!("-I{}", mlx_c_root.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        .layout_tests(false);
    if target_os != "macos" {
        // mlx-rs expects `float16_t` as a u16 newtype (defined in lib.rs, as
        // bindgen renders aarch64's `__fp16`) and `bfloat16_t` as a plain u16.
        builder = builder
            .clang_arg("-include")
            .clang_arg(native.join("half_compat.h").display().to_string())
            .blocklist_type("float16_t");
    }
    for header in &headers {
        builder = builder.header(header.to_string_lossy());
    }
    let bindings = builder.generate().expect("bindgen over mlx-c headers");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");
}
