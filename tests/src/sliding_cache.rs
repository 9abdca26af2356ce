//! The prompt cache over a model with sliding-window layers, in both
//! tiers: a 900-token conversation is long enough that a small window's
//! layers drop old positions while it is prefilled, and it is resent in the
//! shapes a client resends it (one more turn, a reply re-tokenized a few
//! tokens back, a branch far back, one before the oldest kept position),
//! from the RAM prompt cache and, after the cache is reopened, from the SSD
//! tier. Every warm run gives the tokens and logprobs of a cold run, and
//! reuses what the rollback margin allows. Drives the engine's scheduler
//! directly with the real plugins. Shared by the architectures with
//! sliding layers (`gemma4_cache.rs`, `gpt_oss_cache.rs`); the model must
//! have a 16-token window and a byte-level vocabulary of 256.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use mlxhost::cache::ssd::{KvGeometry, ModelIdentity};
use mlxhost::cache::{PrefixCache, PromptCache, SsdCache, SsdConfig};
use mlxhost::engine::scheduler::{ChainSource, Pending, Scheduler, SchedulerConfig};
use mlxhost::engine::{GenerateError, GenerateEvent, GenerateSummary, SequenceSink};
use mlxhost::model::LoadedModel;
use mlxhost::plugin::{PluginHost, PluginLimits, VocabView};

use crate::plugin_folder_with;
use crate::requests::greedy_request;

/// Logprobs of a warm and a cold run agree within this (both float32; the
/// graphs differ only in how the prompt was split into forwards).
const TOL: f32 = 1e-4;

/// Tokens are compared up to the first step whose cold top-2 margin is
/// below this (random weights make near-ties common).
const NEAR_TIE: f32 = 1e-3;

/// What a sequence emitted, recorded by [`Sink`].
#[derive(Debug, Default)]
pub struct Record {
    /// (id, logprob, top-2 margin).
    pub tokens: Vec<(u32, f32, f32)>,
    /// The summary, or the error as text.
    pub result: Option<Result<GenerateSummary, String>>,
}

/// A [`SequenceSink`] that records into a shared [`Record`]; never
/// cancels.
pub struct Sink(pub Rc<RefCell<Record>>);

impl SequenceSink for Sink {
    fn event(&mut self, event: GenerateEvent) {
        if let GenerateEvent::Token(t) = event {
            let margin = match t.top.as_slice() {
                [a, b, ..] => a.1 - b.1,
                _ => f32::INFINITY,
            };
            self.0.borrow_mut().tokens.push((t.id, t.logprob, margin));
        }
    }
    fn cancelled(&self) -> bool {
        false
    }
    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>) {
        self.0.borrow_mut().result = Some(result.map_err(|e| e.to_string()));
    }
}

/// A loaded model with the `standard` sampler.
pub struct Fixture {
    /// The model.
    pub model: LoadedModel,
    /// The plugins (`standard`).
    pub plugins: Arc<PluginHost>,
    _dir: tempfile::TempDir,
}

/// Loads `tests/fixtures/models/<name>` (default options) with the
/// `standard` sampler plugin.
pub fn fixture(name: &str) -> Fixture {
    let path = format!("{}/fixtures/models/{name}", env!("CARGO_MANIFEST_DIR"));
    let model = mlxhost::model::load(Path::new(&path), &Default::default()).expect("model loads");
    Fixture::with_standard_sampler(model)
}

impl Fixture {
    /// `model` with the `standard` sampler plugin, loaded from a folder of
    /// its own and told the model's vocabulary.
    pub fn with_standard_sampler(model: LoadedModel) -> Fixture {
        let dir = plugin_folder_with(&["standard"]);
        let plugins =
            PluginHost::load_dir(dir.path(), PluginLimits::default()).expect("plugins load");
        plugins.set_vocab(Arc::new(VocabView::new(model.tokenizer.clone())));
        Fixture {
            model,
            plugins: Arc::new(plugins),
            _dir: dir,
        }
    }
}

/// Greedy generation of `max_tokens` after `prompt`, through the scheduler
/// with `caches` (`None`: a cold run); returns the tokens (id, logprob,
/// top-2 margin) and how many prompt tokens came from a cache.
pub fn generate(
    f: &Fixture,
    prompt: &[u32],
    max_tokens: usize,
    mut caches: Option<&mut PrefixCache>,
) -> (Vec<(u32, f32, f32)>, usize) {
    let record = Rc::new(RefCell::new(Record::default()));
    let mut scheduler = Scheduler::new(SchedulerConfig::default());
    scheduler.submit(Pending {
        request: greedy_request(prompt, max_tokens, 2),
        chain: ChainSource::Plugins(f.plugins.clone()),
        sink: Box::new(Sink(Rc::clone(&record))),
    });
    let mut steps = 0;
    while !scheduler.is_idle() {
        scheduler.step(&f.model, caches.as_deref_mut());
        steps += 1;
        assert!(steps < 10_000, "the scheduler never drained");
    }
    let record = record.take();
    let summary = match record.result {
        Some(Ok(s)) => s,
        other => panic!("generation failed: {other:?}"),
    };
    (record.tokens, summary.cached_tokens)
}

/// `semantics.md`'s "same": tokens equal until the cold run's first
/// near-tie, logprobs within [`TOL`] up to there.
pub fn assert_same(label: &str, warm: &[(u32, f32, f32)], cold: &[(u32, f32, f32)]) {
    assert_same_within(label, warm, cold, TOL, NEAR_TIE);
}

/// Tokens `(id, logprob, top-2 margin)` of `got` equal `want`'s until
/// `want`'s first step with a margin under `near_tie`, logprobs within
/// `tol` up to there (`f32::INFINITY`: tokens only). Returns the steps
/// compared. Panics naming `label` and the step that differs.
pub fn assert_same_within(
    label: &str,
    got: &[(u32, f32, f32)],
    want: &[(u32, f32, f32)],
    tol: f32,
    near_tie: f32,
) -> usize {
    assert!(!want.is_empty(), "{label}: no tokens");
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.1 - w.1).abs() <= tol,
            "{label}: step {s}: logprob {} vs {}",
            g.1,
            w.1
        );
        if w.2 < near_tie {
            eprintln!("{label}: {s} tokens equal up to a near-tie");
            return s;
        }
        assert_eq!(g.0, w.0, "{label}: token {s} differs");
    }
    eprintln!("{label}: all {} tokens equal", want.len());
    want.len()
}

/// A 900-token prompt: prefilled in 512-token chunks, the sliding layers
/// drop positions (their buffers hold `window - 1 + 256` behind the next
/// query once full), so the cache can be resumed only from position 256 on.
fn long_prompt() -> Vec<u32> {
    (0..900u32).map(|i| (i * 37 + 11) % 256).collect()
}

/// The resent shapes: (label, prompt, fewest and most tokens to reuse).
fn resent(prompt: &[u32], reply: &[u32]) -> Vec<(&'static str, Vec<u32>, usize, usize)> {
    let turn = [7u32, 8, 9];
    let with = |head: &[u32]| [head, &turn[..]].concat();
    let conversation = [prompt, reply].concat();
    let n = prompt.len();
    vec![
        (
            "resent with one more turn",
            with(&conversation),
            n + reply.len() - 1,
            n + reply.len(),
        ),
        (
            "reply re-tokenized 4 tokens back",
            with(&conversation[..n + 4]),
            n + 4,
            n + 4,
        ),
        ("a branch 300 tokens back", with(&prompt[..600]), 600, 600),
        (
            "a branch before the oldest kept sliding position",
            with(&prompt[..200]),
            0,
            0,
        ),
    ]
}

/// Each resent shape against the RAM cache the first conversation left.
/// (A warm row's own entry holds less behind it: its buffers were copied
/// at admission to their valid positions, so its first write compacts the
/// sliding layers to `window - 1 + 256` behind; the branch 300 tokens back
/// is only reusable from the first conversation's entry, as designed.)
pub fn ram_prompt_cache_resumes_as_a_cold_run(f: &Fixture) {
    let prompt = long_prompt();
    let first_conversation = || {
        let mut ram = PrefixCache::new(PromptCache::new(1 << 30), None);
        let (first, cached) = generate(f, &prompt, 12, Some(&mut ram));
        assert_eq!(cached, 0);
        (ram, first)
    };
    let (_, first) = first_conversation();
    assert_same("first run", &first, &generate(f, &prompt, 12, None).0);
    let reply: Vec<u32> = first.iter().map(|t| t.0).collect();
    assert!(reply.len() > 4, "the reply ended early: {reply:?}");
    for (label, p, least, most) in resent(&prompt, &reply) {
        let (mut ram, _) = first_conversation();
        let (warm, cached) = generate(f, &p, 8, Some(&mut ram));
        assert!(
            (least..=most).contains(&cached),
            "{label}: reused {cached}, expected {least}..={most}"
        );
        assert_same(label, &warm, &generate(f, &p, 8, None).0);
    }
}

pub fn open_ssd(model: &LoadedModel, dir: &Path) -> SsdCache {
    let identity = ModelIdentity {
        model: mlxhost::model::fingerprint::fingerprint(&model.path, &model.format)
            .expect("fingerprint"),
        tokenizer: model
            .tokenizer
            .fingerprint()
            .expect("tokenizer fingerprint"),
        geometry: KvGeometry {
            shapes: model.model.kv_shapes(),
            dtype: model.model.dtype(),
            kinds: model.model.new_cache().kinds(),
            quant: model.model.new_cache().quant(),
        },
    };
    let config = SsdConfig {
        dir: dir.to_path_buf(),
        max_bytes: 1 << 30,
        verify: true,
    };
    SsdCache::open(&config, identity).expect("the SSD tier opens")
}

/// Each resent shape from the SSD tier alone (RAM keeps nothing), after the
/// tier is reopened as after a restart.
pub fn ssd_tier_restores_after_a_restart(f: &Fixture) {
    let prompt = long_prompt();
    let dir = tempfile::tempdir().expect("tempdir");
    let ssd_dir = dir.path().join("ssd");
    // RAM keeps nothing: every hit below comes from the disk.
    let reply: Vec<u32> = {
        let mut tiers = PrefixCache::new(PromptCache::new(0), Some(open_ssd(&f.model, &ssd_dir)));
        let (first, _) = generate(f, &prompt, 12, Some(&mut tiers));
        assert!(tiers.flush(Duration::from_secs(60)), "written to disk");
        first.iter().map(|t| t.0).collect()
    };
    let mut tiers = PrefixCache::new(PromptCache::new(0), Some(open_ssd(&f.model, &ssd_dir)));
    for (label, p, least, most) in resent(&prompt, &reply) {
        let (warm, cached) = generate(f, &p, 8, Some(&mut tiers));
        assert!(
            (least..=most).contains(&cached),
            "{label}: reused {cached} from the SSD tier, expected {least}..={most}"
        );
        assert_same(label, &warm, &generate(f, &p, 8, None).0);
    }
    let stats = tiers.ssd().expect("ssd").stats_handle("Float32").stats();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
}
