//! gpt-oss's sliding-window layers (alternating with full ones, attention
//! sinks in both) in both cache tiers, on the tiny random-weight fixture
//! (tests/fixtures/models/gpt-oss-tiny: a 16-token window): a 900-token
//! conversation resent in the shapes a client resends it, from the RAM
//! prompt cache and, after the cache is reopened, from the SSD tier, gives
//! a cold run's tokens and logprobs (the harness and its cases:
//! `mlxhost_e2e::sliding_cache`). The mxfp4 fixture's experts change
//! nothing the caches hold, so the float32 one serves.

use mlxhost_e2e::sliding_cache;

#[test]
fn the_ram_prompt_cache_resumes_sliding_layers_as_a_cold_run() {
    sliding_cache::ram_prompt_cache_resumes_as_a_cold_run(&sliding_cache::fixture("gpt-oss-tiny"));
}

#[test]
fn the_ssd_tier_restores_sliding_layers_after_a_restart() {
    sliding_cache::ssd_tier_restores_after_a_restart(&sliding_cache::fixture("gpt-oss-tiny"));
}
