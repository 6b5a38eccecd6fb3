//! What a check returns when a field is wrong: the field's path
//! (`rules[2].limit.rate`) and what is wrong with it; the caller adds the
//! file and line.

pub(super) type Invalid = (String, String);

pub(super) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Invalid {
    (field.into(), message.into())
}
