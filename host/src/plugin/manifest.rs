//! `plugin.toml`: what a plugin folder declares.
//!
//! ```toml
//! name = "standard"            # unique; what requests and flags name
//! version = "0.1.0"
//! kinds = ["sampler"]          # sampler | logits-processor | tool-call-parser | reasoning-parser | api-adapter | constraint | drafter
//! component = "standard.wasm"  # relative to the folder
//! wit = "mlxhost:plugin@0.1.0" # the WIT package version the component targets
//! description = "..."
//! capabilities = []            # none granted by default (no WASI)
//! template_markers = []        # parsers: chosen by default when all occur in the chat template
//! [defaults]                   # default plugin parameters (JSON-compatible)
//! ```
//!
//! Which kinds each WIT version serves: samplers and logits processors are
//! `0.1.0` (0.2.0 did not change them); API adapters `0.1.0`, `0.2.0` or
//! `0.3.0` (0.2.0's adapter plus `structured-output`), linked side by side;
//! tool-call and reasoning parsers `0.2.0`; constraint plugins `0.3.0`;
//! drafters `0.4.0` (adapters `0.4.0` add the `speculation` import).

use std::path::Path;

use serde::Deserialize;

/// The WIT package versions this host implements, oldest first.
pub const WIT_VERSIONS: [&str; 4] = [
    "mlxhost:plugin@0.1.0",
    "mlxhost:plugin@0.2.0",
    "mlxhost:plugin@0.3.0",
    "mlxhost:plugin@0.4.0",
];

/// A WIT package version the host links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WitVersion {
    /// `mlxhost:plugin@0.1.0` (`wit/plugin.wit`).
    V0_1,
    /// `mlxhost:plugin@0.2.0` (`wit/0.2.0/plugin.wit`).
    V0_2,
    /// `mlxhost:plugin@0.3.0` (`wit/0.3.0/plugin.wit`).
    V0_3,
    /// `mlxhost:plugin@0.4.0` (`wit/0.4.0/plugin.wit`).
    V0_4,
}

impl WitVersion {
    /// Parses `mlxhost:plugin@X.Y.Z`; `None` for a version this host lacks.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "mlxhost:plugin@0.1.0" => Some(WitVersion::V0_1),
            "mlxhost:plugin@0.2.0" => Some(WitVersion::V0_2),
            "mlxhost:plugin@0.3.0" => Some(WitVersion::V0_3),
            "mlxhost:plugin@0.4.0" => Some(WitVersion::V0_4),
            _ => None,
        }
    }

    /// Whether this version defines the world of `kind`.
    pub fn serves(self, kind: Kind) -> bool {
        match kind {
            Kind::Sampler | Kind::LogitsProcessor => self == WitVersion::V0_1,
            Kind::ApiAdapter => true,
            Kind::ToolCallParser | Kind::ReasoningParser => self == WitVersion::V0_2,
            Kind::Constraint => self == WitVersion::V0_3,
            Kind::Drafter => self == WitVersion::V0_4,
        }
    }
}

/// A plugin kind (a WIT world).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// `sampler-plugin` world.
    Sampler,
    /// `logits-processor-plugin` world.
    LogitsProcessor,
    /// `tool-call-parser-plugin` world (0.2.0).
    ToolCallParser,
    /// `reasoning-parser-plugin` world (0.2.0).
    ReasoningParser,
    /// `api-adapter-plugin` world.
    ApiAdapter,
    /// `constraint-plugin` world (0.3.0): structured output.
    Constraint,
    /// `drafter-plugin` world (0.4.0): speculative decoding's drafts.
    Drafter,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Sampler => "sampler",
            Kind::LogitsProcessor => "logits-processor",
            Kind::ToolCallParser => "tool-call-parser",
            Kind::ReasoningParser => "reasoning-parser",
            Kind::ApiAdapter => "api-adapter",
            Kind::Constraint => "constraint",
            Kind::Drafter => "drafter",
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
    /// Parsers: chat-template substrings that select this plugin by
    /// default (all must occur; the plugin matching most markers wins).
    #[serde(default)]
    pub template_markers: Vec<String>,
    /// Default plugin parameters, merged under the request's.
    #[serde(default)]
    pub defaults: toml::Table,
    /// API adapters: the SSE event the host sends while a stream is silent
    /// (a long prefill), every 15 s; the dialect's own keep-alive, such as
    /// Anthropic's `ping`, which clients' idle watchdogs count. Without it
    /// the host sends an SSE comment (`:`), which parsers ignore.
    #[serde(default)]
    pub stream_keep_alive: Option<KeepAliveEvent>,
    /// Samplers and logits processors: the plugin's `sample` / `process`
    /// never read the history's last token and its `accept` keeps no state,
    /// so the host may run a row's next step before it has read the token
    /// this step chose (decode lookahead, `--decode-lookahead`). Default
    /// `false`: the host always reads a token before the row's next call.
    #[serde(default)]
    pub history_free: bool,
}

/// An SSE event (`event:` name and one `data:` line) from a manifest.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KeepAliveEvent {
    /// The `event:` field (empty: none).
    #[serde(default)]
    pub event: String,
    /// The `data:` field, one line.
    pub data: String,
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
        let Some(version) = WitVersion::parse(&m.wit) else {
            return Err(format!(
                "targets `{}`, this host implements {}",
                m.wit,
                WIT_VERSIONS.join(" and ")
            ));
        };
        if m.kinds.is_empty() {
            return Err("`kinds` is empty".into());
        }
        if let Some(k) = &m.stream_keep_alive {
            if !m.kinds.contains(&Kind::ApiAdapter) {
                return Err("`stream_keep_alive` is for api-adapter plugins".into());
            }
            if [&k.event, &k.data].iter().any(|v| v.contains(['\n', '\r'])) {
                return Err("`stream_keep_alive` event and data must be one line each".into());
            }
        }
        if let Some(kind) = m.kinds.iter().find(|k| !version.serves(**k)) {
            return Err(format!(
                "kind `{kind}` is not defined by `{}` (samplers and logits processors are 0.1.0, parsers 0.2.0, constraints 0.3.0, drafters 0.4.0, adapters any)",
                m.wit
            ));
        }
        if let Some(c) = m.capabilities.first() {
            return Err(format!(
                "capability `{c}` is not grantable (WIT 0.1.0 grants none)"
            ));
        }
        if !is_plain_relative(&m.component) {
            return Err(format!(
                "`component = {:?}` must be a file name or relative path inside the plugin folder (no `..`, no absolute path)",
                m.component
            ));
        }
        Ok(m)
    }

    /// The component file, resolved inside `dir`: symlinks are followed and
    /// the result must still lie inside `dir` (canonicalised), so a
    /// manifest cannot make the host open a file elsewhere. Errors name the
    /// manifest's value, never the file's contents.
    pub fn component_path(&self, dir: &Path) -> Result<std::path::PathBuf, String> {
        let root = dir
            .canonicalize()
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let given = dir.join(&self.component);
        let resolved = match given.canonicalize() {
            Ok(p) => p,
            Err(_) => {
                return Err(format!(
                    "component {} not found (build it with scripts/build-plugins.sh)",
                    given.display()
                ))
            }
        };
        if !resolved.starts_with(&root) {
            return Err(format!(
                "component `{}` resolves outside the plugin folder {} (a symlink out is refused)",
                self.component,
                root.display()
            ));
        }
        if !resolved.is_file() {
            return Err(format!(
                "component {} is not a regular file",
                given.display()
            ));
        }
        Ok(resolved)
    }

    /// The WIT version, validated by [`Manifest::load`].
    pub fn wit_version(&self) -> WitVersion {
        WitVersion::parse(&self.wit).unwrap_or(WitVersion::V0_1)
    }

    /// `defaults` as a JSON object.
    pub fn defaults_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.defaults).unwrap_or_else(|_| serde_json::json!({}))
    }
}

/// Whether `p` is a non-empty relative path of plain names (no `..`, `.`
/// only, root or drive prefix).
fn is_plain_relative(p: &str) -> bool {
    use std::path::Component;
    let path = Path::new(p);
    !p.is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && path.components().any(|c| matches!(c, Component::Normal(_)))
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

    #[test]
    fn each_version_serves_its_kinds() {
        let d = tempfile::tempdir().expect("tempdir");
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"tool-call-parser\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.2.0\"\ntemplate_markers = [\"<tool_call>\"]\n");
        let m = Manifest::load(d.path()).expect("0.2.0 parser");
        assert_eq!(m.wit_version(), WitVersion::V0_2);
        assert_eq!(m.template_markers, vec!["<tool_call>".to_string()]);
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"tool-call-parser\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.1.0\"\n");
        assert!(Manifest::load(d.path())
            .unwrap_err()
            .contains("tool-call-parser"));
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"sampler\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.2.0\"\n");
        assert!(Manifest::load(d.path()).unwrap_err().contains("sampler"));
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"api-adapter\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.2.0\"\n");
        assert!(Manifest::load(d.path()).is_ok());
        // 0.3.0: constraint plugins, and adapters (0.2.0's world plus an import).
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"constraint\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.3.0\"\n");
        assert_eq!(
            Manifest::load(d.path())
                .expect("0.3.0 constraint")
                .wit_version(),
            WitVersion::V0_3
        );
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"constraint\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.2.0\"\n");
        assert!(Manifest::load(d.path()).unwrap_err().contains("constraint"));
        write(d.path(), "name = \"p\"\nversion = \"1\"\nkinds = [\"api-adapter\"]\ncomponent = \"p.wasm\"\nwit = \"mlxhost:plugin@0.3.0\"\n");
        assert!(Manifest::load(d.path()).is_ok());
    }

    #[test]
    fn a_component_path_cannot_leave_the_plugin_folder() {
        let d = tempfile::tempdir().expect("tempdir");
        let head = "name = \"a\"\nversion = \"1\"\nkinds = [\"sampler\"]\nwit = \"mlxhost:plugin@0.1.0\"\n";
        for bad in [
            "../../../../etc/passwd",
            "/etc/passwd",
            "",
            "..",
            "x/../../y.wasm",
        ] {
            write(d.path(), &format!("{head}component = {bad:?}\n"));
            let err = Manifest::load(d.path()).expect_err(bad);
            assert!(err.contains("inside the plugin folder"), "{bad}: {err}");
        }
        // A symlink that points out of the folder is refused at resolution,
        // and the message never carries the target's contents.
        let outside = tempfile::tempdir().expect("tempdir");
        let secret = outside.path().join("secret.wasm");
        std::fs::write(&secret, "root:x:0:0:secret").expect("write");
        std::os::unix::fs::symlink(&secret, d.path().join("link.wasm")).expect("symlink");
        write(d.path(), &format!("{head}component = \"link.wasm\"\n"));
        let m = Manifest::load(d.path()).expect("the name itself is plain");
        let err = m.component_path(d.path()).expect_err("escapes");
        assert!(err.contains("outside the plugin folder"), "{err}");
        assert!(!err.contains("root:x"), "{err}");
        // Inside the folder (also through a subfolder) resolves.
        std::fs::create_dir(d.path().join("sub")).expect("mkdir");
        std::fs::write(d.path().join("sub/ok.wasm"), b"\0asm").expect("write");
        write(d.path(), &format!("{head}component = \"./sub/ok.wasm\"\n"));
        let m = Manifest::load(d.path()).expect("plain");
        assert!(m
            .component_path(d.path())
            .expect("inside")
            .ends_with("sub/ok.wasm"));
    }
}
