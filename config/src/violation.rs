//! The outcome of one validation rule, and the checks several sections share.

use std::time::Duration;

use crate::FieldPath;

/// The first rule a config breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    pub(crate) path: FieldPath,
    pub(crate) message: String,
}

/// The outcome of one rule.
pub(crate) type Checked = Result<(), Violation>;

/// A violation of the rule at `path`.
pub(crate) fn fail(path: FieldPath, message: impl Into<String>) -> Checked {
    Err(Violation {
        path,
        message: message.into(),
    })
}

/// `duration` is not zero.
pub(crate) fn positive(duration: Duration, path: FieldPath) -> Checked {
    if duration.is_zero() {
        return fail(path, "must be greater than 0");
    }
    Ok(())
}

/// `value` is a finite number, not negative.
pub(crate) fn non_negative(value: f64, path: FieldPath) -> Checked {
    if !(value.is_finite() && value >= 0.0) {
        return fail(path, format!("{value} must be a finite number >= 0"));
    }
    Ok(())
}
