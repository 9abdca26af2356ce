//! A store's resource limiter: wasmtime's [`StoreLimits`] plus a record of
//! whether the instance was refused memory. The host then knows a trap was
//! the memory cap (for an API adapter parsing a client's body: the client's
//! request is too large, a 413) rather than a fault in the plugin.

use wasmtime::{ResourceLimiter, StoreLimits};

/// [`StoreLimits`] that remembers a refused `memory.grow`.
pub struct CappedLimits {
    inner: StoreLimits,
    exhausted: bool,
}

impl CappedLimits {
    /// Wraps `inner`.
    pub fn new(inner: StoreLimits) -> Self {
        CappedLimits {
            inner,
            exhausted: false,
        }
    }

    /// Whether a `memory.grow` past the cap was refused since the store was
    /// made (the store's instance is then unusable: the refusal traps).
    pub fn memory_exhausted(&self) -> bool {
        self.exhausted
    }
}

impl ResourceLimiter for CappedLimits {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.inner.memory_growing(current, desired, maximum);
        if !matches!(allowed, Ok(true)) {
            self.exhausted = true;
        }
        allowed
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        // The pooling allocator's own reservation ran out: the same limit.
        self.exhausted = true;
        self.inner.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmtime::StoreLimitsBuilder;

    #[test]
    fn a_refused_grow_is_remembered_and_an_allowed_one_is_not() {
        let mut l = CappedLimits::new(
            StoreLimitsBuilder::new()
                .memory_size(1 << 20)
                .trap_on_grow_failure(true)
                .build(),
        );
        assert!(matches!(l.memory_growing(0, 1 << 16, None), Ok(true)));
        assert!(!l.memory_exhausted());
        assert!(l.memory_growing(1 << 16, 2 << 20, None).is_err());
        assert!(l.memory_exhausted());
    }
}
