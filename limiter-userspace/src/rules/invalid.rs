//! What a check of the rule file returns when a field is wrong: the
//! field's path (`rules[2].limit.rate`) and what is wrong with it; the
//! caller adds the file and line (`InvalidFile`).

/// A wrong field of the rule file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidField {
    /// Its path from the file's top (`rules[2].limit.rate`).
    pub field: String,
    pub message: String,
}

impl InvalidField {
    /// The same error, its field inside `parent` (`rules[2]`).
    pub fn within(self, parent: impl Fn(&str) -> String) -> Self {
        Self {
            field: parent(&self.field),
            message: self.message,
        }
    }
}

pub fn invalid(field: impl Into<String>, message: impl std::fmt::Display) -> InvalidField {
    InvalidField {
        field: field.into(),
        message: message.to_string(),
    }
}
