//! The agent's side of the narrow interface: snapshots of its serialized metadata that
//! the workers read to answer "send me yours" and to publish. Workers never touch agent
//! state; the agent replaces a snapshot whenever its metadata changes.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use ferry_storage::{Error, Subject};

use crate::events::FULL_LABEL;
use crate::util::{read, write};

/// Longest agent name or label, in bytes (it travels with a one-byte length).
pub const NAME_LEN_MAX_BYTES: usize = 255;

/// Check an agent name: non-empty, at most [`NAME_LEN_MAX_BYTES`], no `/` (it is a
/// path segment of store keys), no control characters.
pub fn check_agent_name(name: &str) -> Result<(), Error> {
    check_segment(name, "agent name")
}

/// Check a partial-metadata label: the rules of [`check_agent_name`], and not the
/// reserved label of full metadata ([`FULL_LABEL`]).
pub fn check_label(label: &str) -> Result<(), Error> {
    check_segment(label, "metadata label")?;
    if label == FULL_LABEL {
        return Err(Error::invalid(
            Subject::Named(format!("metadata label '{label}'").into()),
            "this label is reserved for full metadata",
        ));
    }
    Ok(())
}

fn check_segment(s: &str, what: &'static str) -> Result<(), Error> {
    let reason = if s.is_empty() {
        "is empty"
    } else if s.len() > NAME_LEN_MAX_BYTES {
        "is longer than 255 bytes"
    } else if s.contains('/') {
        "contains '/'"
    } else if s.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(Error::invalid(
        Subject::Named(format!("{what} '{}'", s.escape_debug()).into()),
        reason,
    ))
}

/// The agent's current serialized metadata, full and partial by label.
#[derive(Default)]
pub(crate) struct LocalMd {
    full: RwLock<Option<Arc<[u8]>>>,
    partial: RwLock<HashMap<String, Arc<[u8]>>>,
}

impl LocalMd {
    pub(crate) fn set_full(&self, blob: Arc<[u8]>) {
        *write(&self.full) = Some(blob);
    }

    pub(crate) fn set_partial(&self, label: &str, blob: Arc<[u8]>) {
        write(&self.partial).insert(label.to_owned(), blob);
    }

    /// The snapshot stored under `label` ([`FULL_LABEL`] for the full metadata).
    pub(crate) fn get(&self, label: &str) -> Option<Arc<[u8]>> {
        if label == FULL_LABEL {
            read(&self.full).clone()
        } else {
            read(&self.partial).get(label).cloned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_are_checked() {
        assert!(check_agent_name("prefill-0").is_ok());
        assert!(check_agent_name("").is_err());
        assert!(check_agent_name("a/b").is_err());
        assert!(check_agent_name("a\nb").is_err());
        assert!(check_agent_name(&"x".repeat(256)).is_err());
        assert!(check_label("layer-3").is_ok());
        assert!(check_label(FULL_LABEL).is_err());
    }

    #[test]
    fn snapshots_by_label() {
        let md = LocalMd::default();
        assert!(md.get(FULL_LABEL).is_none());
        md.set_full(Arc::from(&b"full"[..]));
        md.set_partial("p", Arc::from(&b"part"[..]));
        assert_eq!(&*md.get(FULL_LABEL).unwrap(), b"full");
        assert_eq!(&*md.get("p").unwrap(), b"part");
        assert!(md.get("q").is_none());
    }
}
