//! Guest SDK for mlxhost plugins: `mlxhost:plugin@0.1.0` (samplers, logits
//! processors, 0.1.0 adapters) and `mlxhost:plugin@0.2.0` (tool-call and
//! reasoning parsers, 0.2.0 adapters; modules under [`v2`]).
//!
//! A Rust sampler is a type implementing [`sampler::exports::mlxhost::plugin::sampler::GuestSession`]
//! plus one macro call:
//!
//! ```ignore
//! use mlxhost_plugin_sdk::sampler::{self, exports::mlxhost::plugin::sampler as api};
//! struct Plugin;
//! impl api::Guest for Plugin { type Session = Session; }
//! struct Session;
//! impl api::GuestSession for Session { /* create, sample, accept */ }
//! mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);
//! ```
//!
//! Build for `wasm32-unknown-unknown` and encode as a component
//! (`scripts/build-plugins.sh` does both); see `docs/plugins.md`.

/// Bindings for the `sampler-plugin` world.
pub mod sampler {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "sampler-plugin",
        pub_export_macro: true,
        export_macro_name: "export_sampler",
        default_bindings_module: "mlxhost_plugin_sdk::sampler",
    });
}

/// Bindings for the `logits-processor-plugin` world.
pub mod processor {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "logits-processor-plugin",
        pub_export_macro: true,
        export_macro_name: "export_processor",
        default_bindings_module: "mlxhost_plugin_sdk::processor",
    });
}

/// Bindings for the `api-adapter-plugin` world (no imports: an adapter only
/// transforms bytes and canonical records).
pub mod adapter {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "api-adapter-plugin",
        pub_export_macro: true,
        export_macro_name: "export_adapter",
        default_bindings_module: "mlxhost_plugin_sdk::adapter",
    });
}

/// Bindings for `mlxhost:plugin@0.2.0` (`wit/0.2.0/plugin.wit`).
pub mod v2 {
    /// Content blocks / output items from generation events.
    pub mod blocks;

    /// The `tool-call-parser-plugin` world.
    pub mod tool_parser {
        wit_bindgen::generate!({
            path: "../../wit/0.2.0",
            world: "tool-call-parser-plugin",
            pub_export_macro: true,
            export_macro_name: "export_tool_parser",
            default_bindings_module: "mlxhost_plugin_sdk::v2::tool_parser",
        });
    }

    /// The `reasoning-parser-plugin` world.
    pub mod reasoning_parser {
        wit_bindgen::generate!({
            path: "../../wit/0.2.0",
            world: "reasoning-parser-plugin",
            pub_export_macro: true,
            export_macro_name: "export_reasoning_parser",
            default_bindings_module: "mlxhost_plugin_sdk::v2::reasoning_parser",
        });
    }

    /// The `api-adapter-plugin` world on the 0.2.0 request model. (Bound
    /// through a world of another name that includes it: wit-bindgen names
    /// its export helper macro after the world, and 0.1.0's adapter world
    /// above has the same name.)
    pub mod adapter {
        wit_bindgen::generate!({
            inline: "package mlxhost:sdk;\nworld api-adapter-v2 { include mlxhost:plugin/api-adapter-plugin@0.2.0; }",
            path: "../../wit/0.2.0",
            world: "mlxhost:sdk/api-adapter-v2",
            generate_all,
            pub_export_macro: true,
            export_macro_name: "export_adapter",
            default_bindings_module: "mlxhost_plugin_sdk::v2::adapter",
        });
    }
}

/// Bindings for `mlxhost:plugin@0.3.0` (`wit/0.3.0/plugin.wit`): output
/// constraints.
pub mod v3 {
    /// The `constraint-plugin` world (a constraint engine: token masks per
    /// row per step over a per-model engine).
    pub mod constraint {
        wit_bindgen::generate!({
            path: "../../wit/0.3.0",
            world: "constraint-plugin",
            pub_export_macro: true,
            export_macro_name: "export_constraint",
            default_bindings_module: "mlxhost_plugin_sdk::v3::constraint",
        });
    }

    /// The `structured-output` import of the 0.3.0 `api-adapter-plugin`
    /// world (0.2.0's adapter plus this import). A 0.3.0 adapter exports
    /// through [`crate::v2::adapter`] (its `export_adapter!`) and calls
    /// `structured_output::constrain` from here; the component then imports
    /// it beside 0.2.0's interfaces. (Bound as a world of its own: a second
    /// binding of 0.2.0's `api-adapter` export would define its export
    /// macro twice.)
    pub mod structured_output {
        wit_bindgen::generate!({
            inline: "package mlxhost:sdk-v3;\nworld structured-output-import { import mlxhost:plugin/structured-output@0.3.0; }",
            path: "../../wit/0.3.0",
            world: "mlxhost:sdk-v3/structured-output-import",
            generate_all,
            // Adapters compare parsed constraints in their tests.
            additional_derives: [PartialEq],
        });
    }
}

/// Bindings for `mlxhost:plugin@0.4.0` (`wit/0.4.0/plugin.wit`):
/// speculative decoding.
pub mod v4 {
    /// The `drafter-plugin` world (proposes draft tokens for the host to
    /// verify).
    pub mod drafter {
        wit_bindgen::generate!({
            path: "../../wit/0.4.0",
            world: "drafter-plugin",
            pub_export_macro: true,
            export_macro_name: "export_drafter",
            default_bindings_module: "mlxhost_plugin_sdk::v4::drafter",
        });
    }

    /// The `speculation` import of the 0.4.0 `api-adapter-plugin` world
    /// (0.3.0's adapter plus this import), bound on its own as
    /// [`crate::v3::structured_output`] is.
    pub mod speculation {
        wit_bindgen::generate!({
            inline: "package mlxhost:sdk-v4;\nworld speculation-import { import mlxhost:plugin/speculation@0.4.0; }",
            path: "../../wit/0.4.0",
            world: "mlxhost:sdk-v4/speculation-import",
            generate_all,
            additional_derives: [PartialEq],
        });
    }
}

/// JSON request fields for adapters (feature `json`).
#[cfg(feature = "json")]
pub mod fields;

/// Each dialect's structured-output fields as an output constraint
/// (feature `json`).
#[cfg(feature = "json")]
pub mod structured;

/// The `speculative` request field (speculative decoding; feature `json`).
#[cfg(feature = "json")]
pub mod speculative;

/// Parses a plugin's `extra` parameters (a JSON object) into `(key, value)`
/// number pairs, for plugins that take simple numeric options without a JSON
/// dependency. Non-numeric values are returned as errors naming the key.
pub fn numeric_params(extra: &str) -> Result<Vec<(String, f64)>, String> {
    let body = extra.trim();
    let body = body
        .strip_prefix('{')
        .and_then(|b| b.strip_suffix('}'))
        .ok_or_else(|| format!("parameters must be a JSON object, got `{extra}`"))?;
    let mut out = Vec::new();
    for pair in body.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once(':')
            .ok_or_else(|| format!("malformed parameter `{pair}`"))?;
        let key = k.trim().trim_matches('"').to_string();
        let value: f64 = v
            .trim()
            .parse()
            .map_err(|_| format!("parameter `{key}` must be a number, got `{}`", v.trim()))?;
        out.push((key, value));
    }
    Ok(out)
}
