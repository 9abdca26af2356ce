//! KV cache kinds (per-row full cache today; sliding-window, SSM state and
//! quantized kinds plug in beside it).

pub mod kv;

pub use kv::KvCache;
