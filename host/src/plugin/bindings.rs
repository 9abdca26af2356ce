//! Auto-generated host bindings (wasmtime `bindgen!`), one module per WIT
//! package version: `mlxhost:plugin@0.1.0` at the top level (samplers,
//! logits processors, 0.1.0 adapters) and `mlxhost:plugin@0.2.0` in [`v2`]
//! (parsers, 0.2.0 adapters). Both are linked into one linker side by side.
#![allow(missing_docs)]

/// The `sampler-plugin` world.
pub mod sampler {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "sampler-plugin",
        // Host functions return `wasmtime::Result`: an MLX failure traps the
        // guest and fails only the request that made the call.
        imports: { default: trappable },
        with: {
            "mlxhost:plugin/tensors.logits": crate::plugin::tensors::LogitsHandle,
            "mlxhost:plugin/tensors.history": crate::plugin::tensors::HistoryHandle,
            "mlxhost:plugin/tensors.token": crate::plugin::tensors::TokenHandle,
        },
    });
}

/// The `logits-processor-plugin` world.
pub mod processor {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "logits-processor-plugin",
        with: {
            "mlxhost:plugin/tensors": crate::plugin::bindings::sampler::mlxhost::plugin::tensors,
            "mlxhost:plugin/types": crate::plugin::bindings::sampler::mlxhost::plugin::types,
            "mlxhost:plugin/vocab": crate::plugin::bindings::sampler::mlxhost::plugin::vocab,
        },
    });
}

/// The `api-adapter-plugin` world (imports nothing but the shared types).
pub mod adapter {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "api-adapter-plugin",
        with: {
            "mlxhost:plugin/types": crate::plugin::bindings::sampler::mlxhost::plugin::types,
        },
    });
}

/// `mlxhost:plugin@0.2.0` (`wit/0.2.0/plugin.wit`).
pub mod v2 {
    /// The `tool-call-parser-plugin` world.
    pub mod tool_parser {
        wasmtime::component::bindgen!({
            path: "../wit/0.2.0",
            world: "tool-call-parser-plugin",
            imports: { default: trappable },
        });
    }

    /// The `reasoning-parser-plugin` world.
    pub mod reasoning_parser {
        wasmtime::component::bindgen!({
            path: "../wit/0.2.0",
            world: "reasoning-parser-plugin",
            imports: { default: trappable },
            with: {
                "mlxhost:plugin/types": crate::plugin::bindings::v2::tool_parser::mlxhost::plugin::types,
                "mlxhost:plugin/vocab": crate::plugin::bindings::v2::tool_parser::mlxhost::plugin::vocab,
            },
        });
    }

    /// The `api-adapter-plugin` world on the 0.2.0 request model.
    pub mod adapter {
        wasmtime::component::bindgen!({
            path: "../wit/0.2.0",
            world: "api-adapter-plugin",
            with: {
                "mlxhost:plugin/types": crate::plugin::bindings::v2::tool_parser::mlxhost::plugin::types,
            },
        });
    }
}
