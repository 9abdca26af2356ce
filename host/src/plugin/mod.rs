//! WASM plugins: manifests, the wasmtime runtime, host resources.
pub mod bindings;
pub mod tensors;
