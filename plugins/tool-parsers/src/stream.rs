//! A parser session: accumulates the output, re-parses from the last safe
//! point after every delta (see [`crate::segment`]), and turns decided
//! segments into events.
//!
//! Arguments are sent as one fragment per call, once the call is complete:
//! the fragment is the compact JSON that the final parse gives, so streamed
//! and whole results are equal by construction.

use crate::segment::{Parser, Seg};

/// A generation event, as the WIT `generation-event` has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Text(String),
    Reasoning(String),
    CallStart {
        index: u32,
        id: String,
        name: String,
    },
    CallArguments {
        index: u32,
        arguments: String,
    },
    CallEnd(u32),
    Invalid(String),
}

/// One request's parser state.
pub struct Stream<P: Parser> {
    parser: P,
    text: String,
    safe: usize,
    state: P::State,
    next_index: u32,
    /// FNV-1a over everything decided so far (and the session's salt):
    /// call ids derive from it, so they depend on the output, not on how
    /// it was split.
    hash: u64,
    finished: bool,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl<P: Parser> Stream<P> {
    /// A session; `id_salt` is mixed into call ids.
    pub fn new(parser: P, id_salt: &str) -> Self {
        let state = parser.initial();
        let mut s = Stream {
            parser,
            text: String::new(),
            safe: 0,
            state,
            next_index: 0,
            hash: FNV_OFFSET,
            finished: false,
        };
        s.absorb(id_salt.as_bytes());
        s.absorb(&[0xff]);
        s
    }

    /// The next piece of output; returns what is now certain.
    pub fn feed(&mut self, delta: &str) -> Vec<Event> {
        if self.finished {
            return Vec::new();
        }
        self.text.push_str(delta);
        self.run(true)
    }

    /// End of output: everything left. Later calls return nothing.
    pub fn finish(&mut self) -> Vec<Event> {
        if self.finished {
            return Vec::new();
        }
        let events = self.run(false);
        self.finished = true;
        events
    }

    fn run(&mut self, partial: bool) -> Vec<Event> {
        let parsed = self
            .parser
            .parse(&self.text, self.safe, self.state, partial);
        self.safe = parsed.safe;
        self.state = parsed.state;
        let mut events = Vec::new();
        for seg in parsed.segs {
            match seg {
                Seg::Text(t) => {
                    self.absorb(t.as_bytes());
                    events.push(Event::Text(t));
                }
                // A reasoning session makes no calls: nothing to hash.
                Seg::Reasoning(t) => events.push(Event::Reasoning(t)),
                Seg::Invalid(t) => {
                    self.absorb(&[0xfe]);
                    self.absorb(t.as_bytes());
                    self.absorb(&[0xfe]);
                    events.push(Event::Invalid(t));
                }
                Seg::Call { name, arguments } => {
                    let index = self.next_index;
                    self.next_index += 1;
                    self.absorb(&[0xfd]);
                    self.absorb(name.as_bytes());
                    self.absorb(&[0xfc]);
                    self.absorb(arguments.as_bytes());
                    self.absorb(&[0xfd]);
                    events.push(Event::CallStart {
                        index,
                        id: self.call_id(index),
                        name,
                    });
                    events.push(Event::CallArguments { index, arguments });
                    events.push(Event::CallEnd(index));
                }
            }
        }
        events
    }

    fn absorb(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.hash ^= u64::from(b);
            self.hash = self.hash.wrapping_mul(FNV_PRIME);
        }
    }

    /// `call_` and 24 alphanumerics, from the hash and the index.
    fn call_id(&self, index: u32) -> String {
        const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let mut x = self.hash ^ (u64::from(index) << 32);
        let mut id = String::from("call_");
        for _ in 0..24 {
            // splitmix64: spreads the hash over the characters.
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            id.push(ALPHABET[(z % ALPHABET.len() as u64) as usize] as char);
        }
        id
    }
}
