//! Gemma 4's sliding-window caches in both cache tiers, on the tiny
//! random-weight fixture (tests/fixtures/models/gemma4-tiny: a 16-token
//! window, KV-shared layers reading their source layers' cache, full layers
//! with their own KV head count and width): a 900-token conversation resent
//! in the shapes a client resends it, from the RAM prompt cache and, after
//! the cache is reopened, from the SSD tier, gives a cold run's tokens and
//! logprobs (the harness and its cases: `mlxhost_e2e::sliding_cache`).

use mlxhost_e2e::sliding_cache;

#[test]
fn the_ram_prompt_cache_resumes_sliding_and_shared_layers_as_a_cold_run() {
    sliding_cache::ram_prompt_cache_resumes_as_a_cold_run(&sliding_cache::fixture("gemma4-tiny"));
}

#[test]
fn the_ssd_tier_restores_sliding_and_shared_layers_after_a_restart() {
    sliding_cache::ssd_tier_restores_after_a_restart(&sliding_cache::fixture("gemma4-tiny"));
}
