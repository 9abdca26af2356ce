//! mlxhost: a WebAssembly-plugin-extensible LLM inference host on MLX.
