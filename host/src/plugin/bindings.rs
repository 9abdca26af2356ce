//! Auto-generated host bindings for `mlxhost:plugin@0.1.0` (wasmtime `bindgen!`).
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
