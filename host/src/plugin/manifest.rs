//! `plugin.toml`: what a plugin folder declares.
//!
//! ```toml
//! name = "standard"            # unique; what requests and flags name
//! version = "0.1.0"
//! kinds = ["sampler"]          # sampler | logits-processor | tool-call-parser | api-adapter
//! component = "standard.wasm"  # relative to the folder
//! wit = "mlxhost:plugin@0.1.0" # the WIT package version the component targets
//! description = "..."
//! capabilities = []            # none granted by default (no WASI)
//! [defaults]                   # default plugin parameters (JSON-compatible)
//! ```

use std::path::Path;

use serde::Deserialize;

/// The WIT package version this host implements.
pub const WIT_VERSION: &str = "mlxhost:plugin@0.1.0";

/// A plugin kind (a WIT world).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// `sampler-plugin` world.
    Sampler,
    /// `logits-processor-plugin` world.
    LogitsProcessor,
    /// `tool-call-parser-plugin` world.
    ToolCallParser,
    /// `api-adapter-plugin` world.
    ApiAdapter,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Sampler => "sampler",
            Kind::LogitsProcessor => "logits-processor",
            Kind::ToolCallParser => "tool-call-parser",
            Kind::ApiAdapter => "api-adapter",
        })
    }
}

/// A parsed `plugin.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Unique plugin name (`[a-z0-9_-]+`).
    pub name: String,
    /// The plugin's own version.
    pub version: String,
    /// Worlds the component implements.
    pub kinds: Vec<Kind>,
    /// Component file, relative to the plugin folder.
    pub component: String,
    /// WIT package version, e.g. `mlxhost:plugin@0.1.0`.
    pub wit: String,
    /// One line for `plugins list`.
    #[serde(default)]
    pub description: String,
    /// Capabilities requested (none are grantable in 0.1.0).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Default plugin parameters, merged under the request's.
    #[serde(default)]
    pub defaults: toml::Table,
}

impl Manifest {
    /// Reads and validates `dir/plugin.toml`. Errors say what is wrong.
    pub fn load(dir: &Path) -> Result<Self, String> {
        let path = dir.join("plugin.toml");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let m: Manifest = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        if m.name.is_empty()
            || !m
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        {
            return Err(format!("name `{}` must be non-empty [a-z0-9_-]", m.name));
        }
        if m.wit != WIT_VERSION {
            return Err(format!(
                "targets `{}`, this host implements `{WIT_VERSION}`",
                m.wit
            ));
        }
        if m.kinds.is_empty() {
            return Err("`kinds` is empty".into());
        }
        if let Some(c) = m.capabilities.first() {
            return Err(format!(
                "capability `{c}` is not grantable (WIT 0.1.0 grants none)"
            ));
        }
        Ok(m)
    }

    /// `defaults` as a JSON object.
    pub fn defaults_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.defaults).unwrap_or_else(|_| serde_json::json!({}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) {
        std::fs::write(dir.join("plugin.toml"), text).expect("write manifest");
    }

    #[test]
    fn reads_a_valid_manifest() {
        let d = tempfile::tempdir().expect("tempdir");
        write(d.path(), "name = \"standard\"\nversion = \"0.1.0\"\nkinds = [\"sampler\"]\ncomponent = \"s.wasm\"\nwit = \"mlxhost:plugin@0.1.0\"\n[defaults]\nx = 1\n");
        let m = Manifest::load(d.path()).expect("valid");
        assert_eq!(m.kinds, vec![Kind::Sampler]);
        assert_eq!(m.defaults_json()["x"], 1);
    }

    #[test]
    fn rejects_other_wit_versions_unknown_kinds_and_capabilities() {
        let d = tempfile::tempdir().expect("tempdir");
        write(d.path(), "name = \"a\"\nversion = \"1\"\nkinds = [\"sampler\"]\ncomponent = \"a.wasm\"\nwit = \"mlxhost:plugin@9.0.0\"\n");
        assert!(Manifest::load(d.path()).unwrap_err().contains("9.0.0"));
        write(d.path(), "name = \"a\"\nversion = \"1\"\nkinds = [\"oracle\"]\ncomponent = \"a.wasm\"\nwit = \"mlxhost:plugin@0.1.0\"\n");
        assert!(Manifest::load(d.path()).unwrap_err().contains("oracle"));
        write(d.path(), "name = \"a\"\nversion = \"1\"\nkinds = [\"sampler\"]\ncomponent = \"a.wasm\"\nwit = \"mlxhost:plugin@0.1.0\"\ncapabilities = [\"wasi:filesystem\"]\n");
        assert!(Manifest::load(d.path())
            .unwrap_err()
            .contains("wasi:filesystem"));
    }
}
