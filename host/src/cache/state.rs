//! The recurrent-state cache kind ([`LayerKind::Recurrent`](super::LayerKind)):
//! what a gated-DeltaNet layer (Qwen3.5, Qwen3-Next) keeps per row instead
//! of keys and values. A fixed-size state, whatever the length: the last
//! `K - 1` inputs of the causal conv1d (`[1, K - 1, C]`, the activation
//! dtype) and the recurrent state (`[1, H_v, D_v, D_k]`, float32), as
//! mlx-lm's `ArraysCache(size=2)` holds them.
//!
//! A recurrent state cannot be trimmed back: the state at position `p`
//! is gone once position `p + 1` was fed. So a row keeps **checkpoints**,
//! the states of every recurrent layer at a few positions, and a cache can
//! be truncated (a prompt-cache hit, a running row's prefix, a lookahead
//! dropped at retirement) only to a position it holds a checkpoint of, or
//! to its end; anything else empties it, which is always valid
//! ([`RowStates::truncate`]). Checkpoints are taken
//! - at the end of every prefill chunk (a forward feeding more than one
//!   token), thinned to one per [`CHECKPOINT_SPACING`] tokens plus the
//!   newest (the end of the prompt so far, where a conversation's next
//!   turn resumes), at most [`MAX_CHECKPOINTS`];
//! - one step back: the states before the last forward, so a decode
//!   lookahead (one token fed ahead of the sampler) can be taken back.
//!
//! Arrays are immutable values in MLX: a checkpoint shares the arrays the
//! row held at that point, no copy is made.

use mlx_rs::Array;

/// Minimum distance, in tokens, between two kept prefill checkpoints
/// (the newest is always kept). llama.cpp and oMLX keep one per 2048-ish.
pub const CHECKPOINT_SPACING: usize = 2048;

/// At most this many prefill checkpoints per row (the oldest beyond go
/// first, the newest always stays).
pub const MAX_CHECKPOINTS: usize = 8;

/// One recurrent layer's state for one row.
#[derive(Debug, Clone)]
pub struct LayerState {
    /// The conv1d's last `K - 1` inputs, `[1, K - 1, C]`.
    pub conv: Array,
    /// The recurrent state, `[1, H_v, D_v, D_k]` float32.
    pub ssm: Array,
    /// When the arrays are row `row` of a decode step's stacked `[B,
    /// ...]` states (views into them): which stack. The next step takes
    /// the stack itself when its rows are the same, so states stay one
    /// batched array while rows decode together.
    pub slot: Option<StackSlot>,
}

/// A row's place in a decode step's stacked states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackSlot {
    /// The stack's id (unique per step and layer).
    pub stack: u64,
    /// The row's index in it.
    pub row: usize,
}

impl LayerState {
    /// A row's own state (not a view into a stack).
    pub fn new(conv: Array, ssm: Array) -> Self {
        LayerState {
            conv,
            ssm,
            slot: None,
        }
    }

    /// The state in arrays of its own: a view into a stack is copied
    /// (else it would keep every row's state alive); unchanged otherwise.
    fn detached(&self) -> Self {
        if self.slot.is_none() {
            return self.clone();
        }
        let copy = |a: &Array| super::kv::fresh_copy(a).unwrap_or_else(|_| a.clone());
        LayerState::new(copy(&self.conv), copy(&self.ssm))
    }
}

/// Every recurrent layer's state at one position.
#[derive(Debug, Clone)]
struct Checkpoint {
    pos: usize,
    /// Taken a token before a prefill chunk's end (kept only beside the
    /// newest chunk end, or where the row resumed).
    before_end: bool,
    /// Per cache layer (`None` for a non-recurrent layer, or one never fed).
    states: Vec<Option<LayerState>>,
}

/// A row's recurrent states, per cache layer, with checkpoints.
#[derive(Debug, Clone, Default)]
pub struct RowStates {
    /// Per cache layer; `None` before the first token (zeros).
    current: Vec<Option<LayerState>>,
    /// Prefill checkpoints, oldest first.
    checkpoints: Vec<Checkpoint>,
    /// The states before the last forward.
    prev: Option<Checkpoint>,
    /// Where these states were last resumed at (a prompt-cache hit, a
    /// row continuing its own cache): a conversation's turn boundary,
    /// kept as a checkpoint through thinning, so this row's entry covers
    /// the one it resumed from.
    resumed_at: Option<usize>,
    /// Per cache layer, the state one token before the end of the forward
    /// in progress (a prefill chunk), when the model hands it over
    /// ([`RowStates::set_before_end`]).
    before_end: Vec<Option<LayerState>>,
}

impl RowStates {
    /// Empty states for `layers` cache layers.
    pub fn new(layers: usize) -> Self {
        RowStates {
            current: vec![None; layers],
            ..Default::default()
        }
    }

    /// Layer `layer`'s state; `None` before it was first fed.
    pub fn get(&self, layer: usize) -> Option<&LayerState> {
        self.current.get(layer).and_then(Option::as_ref)
    }

    /// Hands over layer `layer`'s state one token before the end of the
    /// forward in progress (a prefill chunk of `t >= 2` tokens): with every
    /// fed layer's, [`RowStates::advance`] makes it a checkpoint, so the
    /// same prompt resent (whose last token is always fed again, for its
    /// logits) resumes one token before its end.
    pub fn set_before_end(&mut self, layer: usize, state: LayerState) {
        if self.before_end.len() != self.current.len() {
            self.before_end = vec![None; self.current.len()];
        }
        if let Some(slot) = self.before_end.get_mut(layer) {
            *slot = Some(state);
        }
    }

    /// Sets layer `layer`'s state after a forward at `offset` (the row's
    /// position before it). The first set of a forward keeps the states
    /// before it as the one-step-back checkpoint.
    pub fn set(&mut self, layer: usize, state: LayerState, offset: usize) {
        if self.prev.as_ref().is_none_or(|p| p.pos != offset) {
            self.prev = Some(Checkpoint {
                pos: offset,
                before_end: false,
                states: self.current.clone(),
            });
        }
        if let Some(slot) = self.current.get_mut(layer) {
            *slot = Some(state);
        }
    }

    /// Marks a forward of `t` tokens from `offset` done: a prefill chunk's
    /// end and its start become checkpoints (thinned, see [`thin`]).
    pub fn advance(&mut self, offset: usize, t: usize) {
        let before_end = std::mem::take(&mut self.before_end);
        if t < 2 || self.current.iter().all(Option::is_none) {
            return;
        }
        let pos = offset + t;
        self.checkpoints.retain(|c| c.pos < pos);
        // Where this chunk started (a conversation's previous turn ended
        // there, or a cache hit resumed) is a checkpoint too.
        if let Some(p) = &self.prev {
            let held = p.states.iter().any(Option::is_some);
            if p.pos == offset && held && self.checkpoints.last().is_none_or(|c| c.pos < offset) {
                self.checkpoints.push(p.clone());
            }
        }
        // The states one token before the end, when every fed layer gave
        // them.
        let complete = before_end.len() == self.current.len()
            && before_end
                .iter()
                .zip(&self.current)
                .all(|(b, c)| b.is_some() == c.is_some());
        if complete {
            self.checkpoints.push(Checkpoint {
                pos: pos - 1,
                before_end: true,
                states: before_end,
            });
        }
        self.checkpoints.push(Checkpoint {
            pos,
            before_end: false,
            states: self.current.clone(),
        });
        thin(&mut self.checkpoints, self.resumed_at);
    }

    /// The longest position at most `shared` the states can be resumed
    /// at, for a cache of `offset` positions: `offset` itself, the
    /// one-step-back checkpoint or a prefill checkpoint; 0 when none.
    pub fn resumable(&self, shared: usize, offset: usize) -> usize {
        let ends = self
            .checkpoints
            .iter()
            .map(|c| c.pos)
            .chain(self.prev.as_ref().map(|p| p.pos))
            .chain([offset]);
        ends.filter(|&p| p <= shared && p <= offset)
            .max()
            .unwrap_or(0)
    }

    /// Goes back to position `len` (from `offset`): the states of a
    /// checkpoint there (or nothing to do at `offset`, or fresh states at
    /// 0). Returns `false` when no checkpoint holds `len`: the caller
    /// empties the whole cache.
    pub fn truncate(&mut self, len: usize, offset: usize) -> bool {
        if len >= offset {
            if offset > 0 && self.current.iter().any(Option::is_some) {
                self.resumed_at = Some(offset);
            }
            return true;
        }
        self.checkpoints.retain(|c| c.pos <= len);
        if len == 0 {
            self.reset();
            return true;
        }
        let restored = match self.prev.take() {
            Some(p) if p.pos == len => Some(p.states),
            _ => self
                .checkpoints
                .iter()
                .find(|c| c.pos == len)
                .map(|c| c.states.clone()),
        };
        match restored {
            Some(states) => {
                self.current = states;
                self.resumed_at = Some(len);
                true
            }
            None => {
                self.reset();
                false
            }
        }
    }

    /// Copies every state that is a view into a decode step's stack into
    /// arrays of its own (a row leaving the batch, for the prompt cache).
    /// Returns the arrays to evaluate.
    pub fn detach(&mut self) -> Vec<Array> {
        let mut out = Vec::new();
        let states = self
            .current
            .iter_mut()
            .chain(
                self.checkpoints
                    .iter_mut()
                    .flat_map(|c| c.states.iter_mut()),
            )
            .chain(self.prev.iter_mut().flat_map(|c| c.states.iter_mut()));
        for s in states.flatten() {
            if s.slot.is_some() {
                *s = s.detached();
                out.extend([s.conv.clone(), s.ssm.clone()]);
            }
        }
        out
    }

    /// Fresh states, no checkpoints.
    pub fn reset(&mut self) {
        for s in &mut self.current {
            *s = None;
        }
        self.checkpoints.clear();
        self.prev = None;
        self.resumed_at = None;
    }

    /// Positions of the prefill checkpoints, oldest first (tests, stats).
    pub fn checkpoint_positions(&self) -> Vec<usize> {
        self.checkpoints.iter().map(|c| c.pos).collect()
    }

    /// Every position the states can be resumed at, for a cache of
    /// `offset` positions, ascending: the prefill checkpoints, the
    /// one-step-back states and `offset` itself (0 excluded: resuming there
    /// needs nothing). What the SSD tier stores of a row.
    pub fn resume_points(&self, offset: usize) -> Vec<usize> {
        let mut points: Vec<usize> = self
            .checkpoints
            .iter()
            .map(|c| c.pos)
            .chain(self.prev.as_ref().map(|p| p.pos))
            .filter(|&p| p > 0 && p < offset)
            .collect();
        if offset > 0 && self.current.iter().any(Option::is_some) {
            points.push(offset);
        }
        points.sort_unstable();
        points.dedup();
        points
    }

    /// The states at `pos` (one of [`RowStates::resume_points`]), per cache
    /// layer, for a cache of `offset` positions.
    pub fn states_at(&self, pos: usize, offset: usize) -> Option<&[Option<LayerState>]> {
        if pos == offset {
            return Some(&self.current);
        }
        self.checkpoints
            .iter()
            .chain(self.prev.as_ref())
            .find(|c| c.pos == pos)
            .map(|c| c.states.as_slice())
    }

    /// States restored from stored ones (the SSD tier): `points` holds, per
    /// position, every cache layer's state; the one at `offset` becomes
    /// the current states, the others checkpoints. `None` when `offset`
    /// is not among them.
    pub fn restored(points: Vec<(usize, Vec<Option<LayerState>>)>, offset: usize) -> Option<Self> {
        let mut current = None;
        let mut checkpoints = Vec::new();
        for (pos, states) in points {
            if pos == offset {
                current = Some(states);
            } else if pos < offset {
                checkpoints.push(Checkpoint {
                    pos,
                    before_end: false,
                    states,
                });
            }
        }
        checkpoints.sort_by_key(|c| c.pos);
        Some(RowStates {
            current: current?,
            checkpoints,
            prev: None,
            resumed_at: None,
            before_end: Vec::new(),
        })
    }

    /// Every array held: current states and checkpoints (a checkpoint
    /// usually shares arrays with the current states or another
    /// checkpoint; counted once each here regardless).
    pub fn arrays(&self) -> Vec<&Array> {
        let states = self
            .current
            .iter()
            .chain(self.checkpoints.iter().flat_map(|c| c.states.iter()))
            .chain(self.prev.iter().flat_map(|p| p.states.iter()));
        states.flatten().flat_map(|s| [&s.conv, &s.ssm]).collect()
    }

    /// Bytes held by a cache of `offset` positions: the current states
    /// and each checkpoint before `offset` (one at `offset` shares the
    /// current arrays; the one-step-back states are transient).
    pub fn nbytes(&self, offset: usize) -> usize {
        let layer_bytes = |states: &[Option<LayerState>]| -> usize {
            states
                .iter()
                .flatten()
                .map(|s| s.conv.nbytes() + s.ssm.nbytes())
                .sum()
        };
        let checkpoints: usize = self
            .checkpoints
            .iter()
            .filter(|c| c.pos != offset)
            .map(|c| layer_bytes(&c.states))
            .sum();
        layer_bytes(&self.current) + checkpoints
    }
}

/// Thins prefill checkpoints (ascending, the newest last): the newest
/// always stays; an older one stays when it is at least
/// [`CHECKPOINT_SPACING`] after the last older one kept (oldest first), so
/// a prompt fed in chunks keeps one about every [`CHECKPOINT_SPACING`]
/// tokens; beyond [`MAX_CHECKPOINTS`], the one whose neighbours are
/// closest goes (never the first or the newest), so the rest stay spread
/// over the whole prompt. The one at `pinned` (where the row resumed) and
/// the one a token before the newest always stay too.
fn thin(checkpoints: &mut Vec<Checkpoint>, pinned: Option<usize>) {
    let Some(newest) = checkpoints.pop() else {
        return;
    };
    let before_newest = newest.pos.checked_sub(1);
    let is_pinned = |c: &Checkpoint| Some(c.pos) == pinned || Some(c.pos) == before_newest;
    let mut kept: Vec<Checkpoint> = Vec::with_capacity(checkpoints.len() + 1);
    for c in checkpoints.drain(..) {
        // A chunk end is kept rather than the state a token before it.
        let far = kept
            .last()
            .is_none_or(|k| c.pos >= k.pos + CHECKPOINT_SPACING);
        if (far && !c.before_end) || is_pinned(&c) {
            kept.push(c);
        }
    }
    kept.push(newest);
    while kept.len() > MAX_CHECKPOINTS {
        // `kept[i]`'s neighbours' distance, for every inner one.
        let Some(i) = (1..kept.len() - 1)
            .filter(|&i| !is_pinned(&kept[i]))
            .min_by_key(|&i| kept[i + 1].pos - kept[i - 1].pos)
        else {
            break;
        };
        kept.remove(i);
    }
    *checkpoints = kept;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(v: f32) -> LayerState {
        LayerState::new(
            Array::from_slice(&[v], &[1, 1, 1]),
            Array::from_slice(&[v], &[1, 1, 1, 1]),
        )
    }

    fn value(s: &RowStates) -> f32 {
        s.get(0).map_or(-1.0, |s| s.ssm.as_slice::<f32>()[0])
    }

    /// Feeds `t` tokens from `offset`; the state's value is the position
    /// after them.
    fn feed(s: &mut RowStates, offset: usize, t: usize) -> usize {
        s.set(0, state((offset + t) as f32), offset);
        s.advance(offset, t);
        offset + t
    }

    #[test]
    fn truncates_only_to_checkpoints_and_the_step_before() {
        let mut s = RowStates::new(2);
        let mut at = feed(&mut s, 0, 100); // prefill chunk: checkpoint at 100
        at = feed(&mut s, at, 50); // checkpoint at 150 (the newest; 100 the first)
        assert_eq!(s.checkpoint_positions(), vec![100, 150]);
        for _ in 0..3 {
            at = feed(&mut s, at, 1); // decode
        }
        assert_eq!(at, 153);
        assert_eq!(s.resumable(153, at), 153);
        assert_eq!(s.resumable(152, at), 152, "the step before");
        assert_eq!(s.resumable(151, at), 150, "the prompt end");
        assert_eq!(s.resumable(149, at), 100, "the first chunk's end");
        assert_eq!(s.resumable(99, at), 0);
        // One step back (a lookahead dropped).
        let mut back = s.clone();
        assert!(back.truncate(152, at));
        assert_eq!(value(&back), 152.0);
        // To the prompt end.
        let mut end = s.clone();
        assert!(end.truncate(150, at));
        assert_eq!(value(&end), 150.0);
        // Anywhere else: nothing held.
        let mut other = s.clone();
        assert!(!other.truncate(140, at));
        assert_eq!(value(&other), -1.0);
        assert_eq!(other.resumable(1000, 0), 0);
    }

    #[test]
    fn prefill_checkpoints_are_spaced_and_capped() {
        let mut s = RowStates::new(1);
        let mut at = 0;
        for _ in 0..40 {
            at = feed(&mut s, at, 512);
        }
        let kept = s.checkpoint_positions();
        assert_eq!(*kept.last().unwrap_or(&0), at, "the newest is kept");
        assert_eq!(kept.len(), MAX_CHECKPOINTS);
        assert_eq!(kept[0], 512, "the first stays");
        // Spread over the whole prompt (20480 tokens): no gap wider than
        // twice the even spacing.
        let even = at / (MAX_CHECKPOINTS - 1);
        assert!(kept.windows(2).all(|w| w[1] - w[0] <= 2 * even), "{kept:?}");
        // A shorter prompt: one about every CHECKPOINT_SPACING tokens.
        let mut short = RowStates::new(1);
        let mut end = 0;
        for _ in 0..10 {
            end = feed(&mut short, end, 512);
        }
        assert_eq!(short.checkpoint_positions(), vec![512, 2560, 4608, 5120]);
        for &p in &kept {
            let mut c = s.clone();
            assert!(c.truncate(p, at));
            assert_eq!(value(&c), p as f32);
        }
    }

    /// A prefill chunk handing over its states a token before its end
    /// leaves a checkpoint there, kept beside the newest through thinning.
    #[test]
    fn the_state_a_token_before_a_chunk_end_is_a_checkpoint() {
        let mut s = RowStates::new(1);
        let mut at = 0;
        for t in [512, 512, 300] {
            s.set_before_end(0, state((at + t - 1) as f32));
            at = feed(&mut s, at, t);
        }
        assert_eq!(s.checkpoint_positions(), vec![512, at - 1, at]);
        let mut c = s.clone();
        assert!(c.truncate(at - 1, at));
        assert_eq!(value(&c), (at - 1) as f32);
        // A layer that gave none: no such checkpoint.
        let mut two = RowStates::new(2);
        two.set(1, state(9.0), 0);
        two.set_before_end(0, state(8.0));
        two.advance(0, 10);
        assert_eq!(two.checkpoint_positions(), vec![10]);
    }

    /// Where a row resumed (a conversation's previous turn) stays a
    /// checkpoint however close the next chunk ends.
    #[test]
    fn the_resume_point_survives_thinning() {
        let mut s = RowStates::new(1);
        let mut at = feed(&mut s, 0, 3000);
        at = feed(&mut s, at, 1);
        // Resumed at the end (a prompt-cache hit on this row's entry).
        assert!(s.truncate(at, at));
        let resumed = at;
        at = feed(&mut s, at, 300);
        at = feed(&mut s, at, 400);
        assert_eq!(s.checkpoint_positions(), vec![3000, resumed, at]);
        assert_eq!(s.resumable(resumed, at), resumed);
    }

    /// What the SSD tier stores of a row comes back as the same states.
    #[test]
    fn resume_points_round_trip() {
        let mut s = RowStates::new(2);
        let mut at = 0;
        for t in [600, 2000, 300, 1, 1] {
            at = feed(&mut s, at, t);
        }
        let points = s.resume_points(at);
        assert_eq!(points, vec![600, 2900, 2901, 2902]);
        let stored: Vec<(usize, Vec<Option<LayerState>>)> = points
            .iter()
            .map(|&p| (p, s.states_at(p, at).map(<[_]>::to_vec).unwrap_or_default()))
            .collect();
        let back = RowStates::restored(stored, at).expect("the end is stored");
        assert_eq!(back.resume_points(at), points);
        for &p in &points {
            let mut c = back.clone();
            assert!(c.truncate(p, at));
            assert_eq!(value(&c), p as f32);
        }
        assert!(RowStates::restored(Vec::new(), at).is_none());
    }
}
