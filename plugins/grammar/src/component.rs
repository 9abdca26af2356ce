//! The component's exports: WIT types to and from the engine's.

use std::cell::RefCell;

use mlxhost_plugin_sdk::v3::constraint::exports::mlxhost::plugin0_3_0::constraint::{
    self as api, EngineBorrow,
};
use mlxhost_plugin_sdk::v3::constraint::mlxhost::plugin0_3_0::types::{
    Grammar as WitGrammar, PluginError,
};
use mlxhost_plugin_sdk::v3::constraint::mlxhost::plugin0_3_0::vocabulary;

use crate::engine::{Engine, Session};
use crate::spec::Grammar;
use crate::tokens::TokenTable;

fn error(message: impl Into<String>) -> PluginError {
    PluginError {
        message: message.into(),
    }
}

fn grammar(g: WitGrammar) -> Grammar {
    match g {
        WitGrammar::JsonSchema(s) => Grammar::JsonSchema(s),
        WitGrammar::JsonObject => Grammar::JsonObject,
        WitGrammar::Regex(r) => Grammar::Regex(r),
        WitGrammar::Lark(l) => Grammar::Lark(l),
        WitGrammar::Choice(c) => Grammar::Choice(c),
    }
}

struct Plugin;

impl api::Guest for Plugin {
    type Engine = EngineResource;
    type Session = SessionResource;
}

struct EngineResource(Engine);

impl api::GuestEngine for EngineResource {
    fn create(extra: String) -> Result<api::Engine, PluginError> {
        let t = vocabulary::table();
        let table = TokenTable {
            bytes: t.bytes,
            ends: t.ends,
            eos: t.eos,
            special: t.special,
        };
        let engine = Engine::new(&table, &extra).map_err(error)?;
        Ok(api::Engine::new(EngineResource(engine)))
    }
}

struct SessionResource(RefCell<Session>);

impl api::GuestSession for SessionResource {
    fn create(
        engine: EngineBorrow<'_>,
        grammar_: WitGrammar,
        extra: String,
    ) -> Result<api::Session, PluginError> {
        let engine = &engine.get::<EngineResource>().0;
        let session = engine.session(&grammar(grammar_), &extra).map_err(error)?;
        Ok(api::Session::new(SessionResource(RefCell::new(session))))
    }

    fn mask(&self) -> Result<Vec<u32>, PluginError> {
        self.0.borrow_mut().mask().map_err(error)
    }

    fn accept(&self, token: u32) -> Result<(), PluginError> {
        self.0.borrow_mut().accept(token).map_err(error)
    }
}

mlxhost_plugin_sdk::v3::constraint::export_constraint!(Plugin);
