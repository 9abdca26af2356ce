//! Auto-generated host bindings (wasmtime `bindgen!`), one module per WIT
//! package version: `mlxhost:plugin@0.1.0` at the top level (samplers,
//! logits processors, 0.1.0 adapters) and `mlxhost:plugin@0.2.0` in [`v2`]
//! (parsers, 0.2.0 adapters), `mlxhost:plugin@0.3.0` in [`v3`] (constraint
//! plugins, the adapters' `structured-output` service), `mlxhost:plugin@0.4.0`
//! in [`v4`] (drafters, the adapters' `speculation` service). All are linked
//! into one linker side by side.
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

/// `mlxhost:plugin@0.3.0` (`wit/0.3.0/plugin.wit`).
pub mod v3 {
    /// The `constraint-plugin` world.
    pub mod constraint {
        wasmtime::component::bindgen!({
            path: "../wit/0.3.0",
            world: "constraint-plugin",
            imports: { default: trappable },
        });
    }

    /// The `structured-output` import of 0.3.0 adapters. (A 0.3.0 adapter
    /// exports 0.2.0's `api-adapter` interface, so it is instantiated
    /// through [`super::v2::adapter`]; only this import is new.)
    pub mod structured_output {
        wasmtime::component::bindgen!({
            inline: "package mlxhost:host-v3;\nworld adapter-services { import mlxhost:plugin/structured-output@0.3.0; }",
            path: "../wit/0.3.0",
            world: "mlxhost:host-v3/adapter-services",
            with: {
                "mlxhost:plugin/types@0.3.0": crate::plugin::bindings::v3::constraint::mlxhost::plugin0_3_0::types,
            },
        });
    }
}

/// `mlxhost:plugin@0.4.0` (`wit/0.4.0/plugin.wit`).
pub mod v4 {
    /// The `drafter-plugin` world.
    pub mod drafter {
        wasmtime::component::bindgen!({
            path: "../wit/0.4.0",
            world: "drafter-plugin",
            imports: { default: trappable },
        });
    }

    /// The `speculation` import of 0.4.0 adapters (which export 0.2.0's
    /// `api-adapter` interface, as 0.3.0 adapters do).
    pub mod speculation {
        wasmtime::component::bindgen!({
            inline: "package mlxhost:host-v4;\nworld adapter-services { import mlxhost:plugin/speculation@0.4.0; }",
            path: "../wit/0.4.0",
            world: "mlxhost:host-v4/adapter-services",
        });
    }
}
