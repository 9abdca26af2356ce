//! What a request may cost before the adapter and the tokenizer see it.
//! Every bound here is checked before the work it bounds, so a hostile body
//! is refused with a 4xx (or waits its turn) instead of growing the process:
//!
//! - **Large bodies** (over [`LARGE_BODY_BYTES`] declared, or chunked with no
//!   length) are read and prepared at most `--large-bodies` at a time; the
//!   rest wait (up to `--body-timeout`, then a 503). Small bodies never wait
//!   behind them.
//! - **JSON size**: a body holding more than `--max-json-values` values is a
//!   413 before the adapter parses it (an adapter's parse costs far more
//!   memory than the body's bytes: 8.4 MB of `[0,0,...]` exhausted a 256 MiB
//!   adapter).
//! - **Preparation** (the adapter's `handle`, the chat template and the
//!   tokenizer, for generations and `count_tokens` alike) runs at most
//!   `--prepare-concurrency` requests at a time, FIFO.
//!
//! With the prompt-character bound (`--max-prompt-chars`, checked before
//! tokenizing in [`super::request`]) this caps what request intake holds at
//! once; docs/configuration.md gives the sum.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bodies larger than this (declared, or chunked) take a large-body permit.
pub const LARGE_BODY_BYTES: usize = 1 << 20;

/// The intake bounds of one server.
pub struct Intake {
    large_bodies: Arc<Semaphore>,
    large_body_limit: usize,
    prepare: Arc<Semaphore>,
    prepare_limit: usize,
    /// Most JSON values a body may hold (`--max-json-values`).
    pub max_json_values: usize,
    /// Longest wait for a permit before a 503.
    pub wait: Duration,
}

/// Why a request was not let in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntakeError {
    /// No large-body permit came within the wait.
    #[error("the server is reading {0} large request bodies (over 1 MiB) already; retry (--large-bodies)")]
    LargeBodiesBusy(usize),
    /// No preparation permit came within the wait.
    #[error("the server is preparing {0} requests already; retry (--prepare-concurrency)")]
    PrepareBusy(usize),
    /// The body holds more JSON values than allowed.
    #[error("the request body holds more than {0} JSON values (--max-json-values)")]
    TooManyJsonValues(usize),
}

impl Intake {
    /// Bounds: `large_bodies` and `prepare` permits (each at least 1),
    /// `max_json_values`, and how long a request waits for a permit.
    pub fn new(
        large_bodies: usize,
        prepare: usize,
        max_json_values: usize,
        wait: Duration,
    ) -> Self {
        let (large_bodies, prepare) = (large_bodies.max(1), prepare.max(1));
        Intake {
            large_bodies: Arc::new(Semaphore::new(large_bodies)),
            large_body_limit: large_bodies,
            prepare: Arc::new(Semaphore::new(prepare)),
            prepare_limit: prepare,
            max_json_values,
            wait,
        }
    }

    /// A large-body permit when the body is large (`declared` over
    /// [`LARGE_BODY_BYTES`], or `chunked` with no length), else `None`.
    pub async fn admit_body(
        &self,
        declared: Option<usize>,
        chunked: bool,
    ) -> Result<Option<OwnedSemaphorePermit>, IntakeError> {
        let large = declared.map_or(chunked, |n| n > LARGE_BODY_BYTES);
        if !large {
            return Ok(None);
        }
        let acquire = self.large_bodies.clone().acquire_owned();
        match tokio::time::timeout(self.wait, acquire).await {
            Ok(Ok(p)) => Ok(Some(p)),
            _ => Err(IntakeError::LargeBodiesBusy(self.large_body_limit)),
        }
    }

    /// A preparation permit (FIFO), held while the adapter and tokenizer
    /// work on the request.
    pub async fn admit_prepare(&self) -> Result<OwnedSemaphorePermit, IntakeError> {
        let acquire = self.prepare.clone().acquire_owned();
        match tokio::time::timeout(self.wait, acquire).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err(IntakeError::PrepareBusy(self.prepare_limit)),
        }
    }

    /// Refuses a body holding more than `max_json_values` JSON values
    /// ([`json_values`]) before any parser sees it.
    pub fn check_json(&self, body: &[u8]) -> Result<(), IntakeError> {
        if json_values(body, self.max_json_values) > self.max_json_values {
            return Err(IntakeError::TooManyJsonValues(self.max_json_values));
        }
        Ok(())
    }
}

/// The number of JSON values in `body` as a parser would meet them, counted
/// without parsing: every `{`, `[` and `,` outside strings (an array of `k`
/// scalars counts `k`, each object member one more than its value's own
/// count). Stops counting past `stop_after`. Not a validator: a malformed
/// body is the parser's to reject.
pub fn json_values(body: &[u8], stop_after: usize) -> usize {
    let (mut in_string, mut escaped, mut n) = (false, false, 0usize);
    for &b in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' | b',' => {
                n += 1;
                if n > stop_after {
                    return n;
                }
            }
            _ => {}
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_containers_and_elements_outside_strings() {
        assert_eq!(json_values(b"[0,0,0]", usize::MAX), 3);
        assert_eq!(json_values(br#"{"a":"x,[{","b":[1,2]}"#, usize::MAX), 4);
        assert_eq!(
            json_values(br#""\",[""#, usize::MAX),
            0,
            "escaped quote stays in the string"
        );
        assert_eq!(json_values(b"", usize::MAX), 0);
        let big = format!("{{\"x\":[{}0]}}", "0,".repeat(2_800_000));
        assert_eq!(
            json_values(big.as_bytes(), 1000),
            1001,
            "stops past the bound"
        );
    }

    #[test]
    fn refuses_bodies_over_the_value_bound() {
        let intake = Intake::new(1, 1, 10, Duration::from_millis(10));
        assert!(intake.check_json(b"[1,2,3]").is_ok());
        assert_eq!(
            intake.check_json(format!("[{}0]", "0,".repeat(20)).as_bytes()),
            Err(IntakeError::TooManyJsonValues(10))
        );
    }

    #[tokio::test]
    async fn small_bodies_never_wait_and_large_ones_wait_their_turn() {
        let intake = Intake::new(1, 1, 10, Duration::from_millis(50));
        assert!(intake
            .admit_body(Some(100), false)
            .await
            .expect("small")
            .is_none());
        assert!(intake
            .admit_body(None, false)
            .await
            .expect("no body")
            .is_none());
        let held = intake
            .admit_body(None, true)
            .await
            .expect("chunked is large");
        assert!(held.is_some());
        assert_eq!(
            intake.admit_body(Some(2 << 20), false).await.err(),
            Some(IntakeError::LargeBodiesBusy(1))
        );
        assert!(intake
            .admit_body(Some(100), false)
            .await
            .expect("small")
            .is_none());
        drop(held);
        assert!(intake
            .admit_body(Some(2 << 20), false)
            .await
            .expect("freed")
            .is_some());
        let p = intake.admit_prepare().await.expect("first");
        assert_eq!(
            intake.admit_prepare().await.err(),
            Some(IntakeError::PrepareBusy(1))
        );
        drop(p);
        assert!(intake.admit_prepare().await.is_ok());
    }
}
