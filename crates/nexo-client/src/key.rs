//! The `Idempotency-Key` a transfer intent is sent under.

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// Longest key content the server accepts, in characters.
pub const KEY_LEN_MAX: usize = 255;

/// A value the server accepts in `Idempotency-Key`: either a bare key of 1
/// to 255 printable ASCII characters without spaces (not starting with a
/// quote), or the draft's quoted Structured Field string (`"abc"`, with `\"`
/// and `\\` escapes) whose content is 1 to 255 characters from 0x20 to 0x7E.
/// The server treats both spellings of one content as the same key.
///
/// Checked here so that a key that could never be accepted fails before
/// anything is sent, instead of as a `400` on every attempt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a string is not an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an idempotency key: {reason}")]
pub struct InvalidKey {
    reason: &'static str,
}

impl IdempotencyKey {
    /// A fresh random key (a UUID v4): what a new intent gets.
    pub fn generate() -> Self {
        Self(Uuid::new_v4().to_string())
    }

    pub fn parse(value: impl Into<String>) -> Result<Self, InvalidKey> {
        let value = value.into();
        let invalid = |reason| Err(InvalidKey { reason });
        if value.is_empty() {
            return invalid("empty");
        }
        if let Some(inner) = value.strip_prefix('"') {
            let Some(inner) = inner.strip_suffix('"') else {
                return invalid("a quoted key must end with a quote");
            };
            let mut characters = 0usize;
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some('"' | '\\') => {}
                        _ => return invalid("in a quoted key, `\\` escapes only `\"` and `\\`"),
                    },
                    '"' => return invalid("a quote inside a quoted key must be escaped"),
                    ' '..='~' => {}
                    _ => return invalid("only printable ASCII characters"),
                }
                characters += 1;
            }
            if characters == 0 {
                return invalid("empty");
            }
            if characters > KEY_LEN_MAX {
                return invalid("longer than 255 characters");
            }
        } else {
            if value.len() > KEY_LEN_MAX {
                return invalid("longer than 255 characters");
            }
            if !value.bytes().all(|b| (b'!'..=b'~').contains(&b)) {
                return invalid("a bare key holds only printable ASCII characters, no spaces");
            }
        }
        Ok(Self(value))
    }

    /// The key as it is sent in the header.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for IdempotencyKey {
    type Err = InvalidKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_distinct_and_valid() {
        let (a, b) = (IdempotencyKey::generate(), IdempotencyKey::generate());
        assert_ne!(a, b);
        assert!(IdempotencyKey::parse(a.as_str()).is_ok());
    }

    #[test]
    fn accepts_what_the_server_accepts() {
        for key in [
            "a",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "a/b?c#d%e",
            "\"with spaces\"",
            r#""esc\"aped\\""#,
            &"x".repeat(KEY_LEN_MAX),
            &format!("\"{}\"", "y".repeat(KEY_LEN_MAX)),
        ] {
            assert!(IdempotencyKey::parse(key).is_ok(), "{key:?}");
        }
    }

    #[test]
    fn refuses_what_the_server_refuses() {
        for key in [
            "",
            "two words",
            "tab\there",
            "ñ",
            "\"\"",
            "\"unterminated",
            r#""bad\escape""#,
            r#""inner"quote""#,
            &"x".repeat(KEY_LEN_MAX + 1),
            &format!("\"{}\"", "y".repeat(KEY_LEN_MAX + 1)),
        ] {
            assert!(IdempotencyKey::parse(key).is_err(), "{key:?}");
        }
    }
}
