//! `instant::Instant` for a guest without a clock: every instant is the
//! same, so every elapsed time is zero. llguidance (feature `wasm`) uses
//! it only to time its own steps for statistics, never for a decision.

pub use std::time::Duration;

/// A moment; all moments are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant;

impl Instant {
    /// Now (the only instant there is).
    pub fn now() -> Self {
        Instant
    }

    /// Always zero.
    pub fn elapsed(&self) -> Duration {
        Duration::ZERO
    }

    /// Always zero.
    pub fn duration_since(&self, _earlier: Instant) -> Duration {
        Duration::ZERO
    }
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, _: Duration) -> Instant {
        Instant
    }
}

impl std::ops::Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, _: Instant) -> Duration {
        Duration::ZERO
    }
}
