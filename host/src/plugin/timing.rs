//! Time spent inside each plugin's calls since start, by plugin name (the
//! `/metrics` family `mlxhost_plugin_call_seconds_total`). Written by the
//! engine thread per call (an uncontended lock, ~tens of ns beside calls
//! of microseconds), read when metrics are scraped.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Calls and their total time for one plugin.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PluginTime {
    /// Calls made (`process`, `sample`, `accept`, ...).
    pub calls: u64,
    /// Their wall time, seconds.
    pub seconds: f64,
}

fn times() -> &'static Mutex<BTreeMap<String, PluginTime>> {
    static TIMES: OnceLock<Mutex<BTreeMap<String, PluginTime>>> = OnceLock::new();
    TIMES.get_or_init(Default::default)
}

/// Adds one call of `plugin` that took `took`.
pub fn record(plugin: &str, took: Duration) {
    let Ok(mut t) = times().lock() else {
        return;
    };
    match t.get_mut(plugin) {
        Some(p) => {
            p.calls += 1;
            p.seconds += took.as_secs_f64();
        }
        None => {
            t.insert(
                plugin.to_string(),
                PluginTime {
                    calls: 1,
                    seconds: took.as_secs_f64(),
                },
            );
        }
    }
}

/// Every plugin's totals so far, by name.
pub fn snapshot() -> Vec<(String, PluginTime)> {
    times()
        .lock()
        .map(|t| t.iter().map(|(k, v)| (k.clone(), *v)).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_add_up_per_plugin() {
        record("timing-test-a", Duration::from_millis(2));
        record("timing-test-a", Duration::from_millis(3));
        record("timing-test-b", Duration::from_millis(1));
        let s = snapshot();
        let a = s.iter().find(|(n, _)| n == "timing-test-a").unwrap().1;
        assert_eq!(a.calls, 2);
        assert!((a.seconds - 0.005).abs() < 1e-9);
        assert!(s.iter().any(|(n, _)| n == "timing-test-b"));
    }
}
