//! Test-only drafter: misbehaves on purpose (`mode` in `plugin_params`):
//! 0 drafts wrong tokens (last id + 1, repeated), 1 traps in `draft`, 2
//! traps in `create`, 3 drafts ids outside the vocabulary.

use std::cell::RefCell;

use mlxhost_plugin_sdk::v4::drafter::exports::mlxhost::plugin0_4_0::drafter::{
    self as api, DraftOptions,
};
use mlxhost_plugin_sdk::v4::drafter::mlxhost::plugin0_4_0::types::PluginError;

struct Plugin;

impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    mode: u32,
    vocab: u32,
    last: RefCell<u32>,
}

impl api::GuestSession for Session {
    fn create(options: DraftOptions) -> Result<api::Session, PluginError> {
        let mut mode = 0;
        for (key, value) in mlxhost_plugin_sdk::numeric_params(&options.extra)
            .map_err(|message| PluginError { message })?
        {
            if key == "mode" {
                mode = value as u32;
            }
        }
        if mode == 2 {
            panic!("bad-drafter: trapping in create, as asked");
        }
        Ok(api::Session::new(Session {
            mode,
            vocab: options.vocab_size,
            last: RefCell::new(0),
        }))
    }

    fn draft(&self, appended: Vec<u32>, k: u32) -> Result<Vec<u32>, PluginError> {
        if let Some(&id) = appended.last() {
            *self.last.borrow_mut() = id;
        }
        let last = *self.last.borrow();
        match self.mode {
            1 => panic!("bad-drafter: trapping in draft, as asked"),
            3 => Ok((0..k).map(|i| self.vocab + i).collect()),
            _ => Ok(vec![(last + 1) % self.vocab.max(1); k as usize]),
        }
    }
}

mlxhost_plugin_sdk::v4::drafter::export_drafter!(Plugin);
