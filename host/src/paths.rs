//! Where mlxhost keeps installed and cached data.

use std::path::PathBuf;

/// `$MLXHOST_CACHE`, else `$XDG_CACHE_HOME/mlxhost`, else `~/.cache/mlxhost`
/// (the same rule as `host/mlx-sys/build.rs` and `scripts/setup.sh`).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MLXHOST_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("mlxhost");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/mlxhost")
}
