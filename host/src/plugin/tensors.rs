//! Host side of the `tensors` interface: device arrays behind resource handles.
use mlx_rs::Array;

/// The row's logits `[V]` (float32), edited in place by plugins.
pub struct LogitsHandle {
    /// Current (lazy) logits.
    pub array: Array,
}

/// The row's token history.
pub struct HistoryHandle {
    /// Prompt then generated ids.
    pub ids: Vec<u32>,
    /// Where generation starts.
    pub prompt_len: usize,
}

/// A chosen token on the device (`[]` uint32).
pub struct TokenHandle {
    /// Scalar id array.
    pub array: Array,
}
