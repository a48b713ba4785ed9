//! A setting that must never reach a log: keys.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A secret string. `Debug` and `Display` print `[redacted]`; read the value
/// with [`Secret::expose`] where it is used, never where it is logged.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_do_not_print() {
        let secret = Secret::new("hunter2");
        assert_eq!(secret.expose(), "hunter2");
        assert!(!format!("{secret:?} {secret} {:?}", Some(&secret)).contains("hunter2"));
        assert_eq!(serde_json::to_string(&secret).unwrap(), "\"hunter2\"");
    }
}
