//! Settings of the in-process store (`FERRY_INPROCESS_STORE`; table in `config.rs`).

use ferry_storage::{Error, Subject};

/// The in-process store: managers of one process that name the same store share its
/// keys.
#[derive(Clone, Debug)]
pub struct InProcessConfig {
    /// The store's name; the managers that give the same name share it.
    pub name: String,
}

impl InProcessConfig {
    /// The store named `name`.
    pub fn new(name: impl Into<String>) -> InProcessConfig {
        InProcessConfig { name: name.into() }
    }

    /// The variable that selects this store.
    pub(crate) const SELECT_VAR: &'static str = "FERRY_INPROCESS_STORE";

    /// This store's settings, if its selecting variable is set (with its value).
    pub(crate) fn selected(
        get: &impl Fn(&str) -> Option<String>,
    ) -> Option<(String, InProcessConfig)> {
        let v = get(Self::SELECT_VAR)?;
        let config = InProcessConfig::new(v.trim());
        Some((v, config))
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.name.is_empty() || self.name.len() > 255 {
            return Err(Error::invalid(
                Subject::Named(
                    format!("in-process store name '{}'", self.name.escape_debug()).into(),
                ),
                "must be 1 to 255 bytes",
            ));
        }
        Ok(())
    }
}
