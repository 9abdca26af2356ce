//! Test-only constraint plugin: every token is allowed, except that a
//! session for the regex `trap` panics (a trap) on its third `mask`, and one
//! for `dead` returns an empty set (a dead end) on its second. The host must
//! fail only those rows, and replay the other sessions after the trap.

use std::cell::Cell;

use mlxhost_plugin_sdk::v3::constraint::exports::mlxhost::plugin0_3_0::constraint::{
    self as api, EngineBorrow,
};
use mlxhost_plugin_sdk::v3::constraint::mlxhost::plugin0_3_0::types::{Grammar, PluginError};
use mlxhost_plugin_sdk::v3::constraint::mlxhost::plugin0_3_0::vocabulary;

struct Plugin;

impl api::Guest for Plugin {
    type Engine = Engine;
    type Session = Session;
}

/// The vocabulary's width.
struct Engine(usize);

impl api::GuestEngine for Engine {
    fn create(_extra: String) -> Result<api::Engine, PluginError> {
        Ok(api::Engine::new(Engine(vocabulary::table().ends.len())))
    }
}

enum Kind {
    Free,
    Trap,
    Dead,
}

struct Session {
    vocab: usize,
    kind: Kind,
    masks: Cell<u32>,
}

impl api::GuestSession for Session {
    fn create(
        engine: EngineBorrow<'_>,
        grammar: Grammar,
        _extra: String,
    ) -> Result<api::Session, PluginError> {
        let kind = match grammar {
            Grammar::Regex(r) if r == "trap" => Kind::Trap,
            Grammar::Regex(r) if r == "dead" => Kind::Dead,
            _ => Kind::Free,
        };
        Ok(api::Session::new(Session {
            vocab: engine.get::<Engine>().0,
            kind,
            masks: Cell::new(0),
        }))
    }

    fn mask(&self) -> Result<Vec<u32>, PluginError> {
        let n = self.masks.get() + 1;
        self.masks.set(n);
        match self.kind {
            Kind::Trap if n == 3 => panic!("test-only trap"),
            Kind::Dead if n == 2 => return Ok(vec![0; self.vocab.div_ceil(32)]),
            _ => {}
        }
        Ok(vec![u32::MAX; self.vocab.div_ceil(32)])
    }

    fn accept(&self, _token: u32) -> Result<(), PluginError> {
        Ok(())
    }
}

mlxhost_plugin_sdk::v3::constraint::export_constraint!(Plugin);
