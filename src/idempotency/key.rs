//! The `Idempotency-Key` request header, parsed once at the boundary.

use std::fmt;

/// Stripe's limit, and the IETF draft leaves it to the server: long enough
/// for any UUID or ULID with a prefix, short enough to keep the primary-key
/// index of `idempotency_keys` small.
pub const IDEMPOTENCY_KEY_LEN_MAX: usize = 255;

/// A client-chosen key naming one intent. Holds 1 to
/// [`IDEMPOTENCY_KEY_LEN_MAX`] printable ASCII characters (0x20 to 0x7E).
///
/// The draft (`draft-ietf-httpapi-idempotency-key-header`) defines the field
/// as a Structured Field string (`"8e03978e-..."`); most clients in the wild
/// send the bare value. Both spellings are accepted and normalised to the
/// inner string, so `"abc"` and `abc` are the same key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the Idempotency-Key header is required on this request")]
    Missing,
    #[error("send exactly one Idempotency-Key header")]
    Repeated,
    #[error("the Idempotency-Key must not be empty")]
    Empty,
    #[error("the Idempotency-Key must be at most {IDEMPOTENCY_KEY_LEN_MAX} characters")]
    TooLong,
    #[error("the Idempotency-Key must be printable ASCII (0x20 to 0x7E)")]
    NotPrintableAscii,
    #[error("the Idempotency-Key is not a valid Structured Field string")]
    MalformedString,
}

impl IdempotencyKey {
    /// Parses one header value, given as raw bytes (header values need not be
    /// UTF-8, and a non-ASCII key must be a 400, not a panic).
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let trimmed = raw.trim_ascii();
        let inner = if trimmed.first() == Some(&b'"') {
            parse_sf_string(trimmed)?
        } else {
            if trimmed.iter().any(|b| !(0x21..=0x7e).contains(b)) {
                return Err(KeyError::NotPrintableAscii);
            }
            // Checked to be ASCII just above, so this cannot fail.
            String::from_utf8(trimmed.to_vec()).map_err(|_| KeyError::NotPrintableAscii)?
        };
        Self::from_inner(inner)
    }

    /// Parses every `Idempotency-Key` header of a request: exactly one is
    /// allowed, because two keys for one request have no meaning.
    pub fn from_headers(headers: &http::HeaderMap) -> Result<Self, KeyError> {
        let mut values = headers.get_all(HEADER_NAME).iter();
        let first = values.next().ok_or(KeyError::Missing)?;
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes())
    }

    /// Rebuilds a key read back from the database or a test.
    pub fn from_inner(inner: String) -> Result<Self, KeyError> {
        if inner.is_empty() {
            Err(KeyError::Empty)
        } else if inner.len() > IDEMPOTENCY_KEY_LEN_MAX {
            Err(KeyError::TooLong)
        } else if inner.bytes().any(|b| !(0x20..=0x7e).contains(&b)) {
            Err(KeyError::NotPrintableAscii)
        } else {
            Ok(Self(inner))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

pub const HEADER_NAME: &str = "idempotency-key";

fn parse_sf_string(raw: &[u8]) -> Result<String, KeyError> {
    let item: sfv::Item = sfv::Parser::new(raw)
        .parse()
        .map_err(|_| KeyError::MalformedString)?;
    // Parameters have no meaning for this field; accepting them would make
    // `"k";a=1` and `"k"` silently the same key.
    if !item.params.is_empty() {
        return Err(KeyError::MalformedString);
    }
    match item.bare_item.as_string() {
        Some(s) => Ok(s.as_str().to_owned()),
        None => Err(KeyError::MalformedString),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(raw: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(raw.as_bytes()).map(|k| k.0)
    }

    #[test]
    fn a_bare_uuid_is_a_key() {
        assert_eq!(
            key("8e03978e-40d5-43e8-bc93-6894a57f9324").as_deref(),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
    }

    #[test]
    fn quoted_and_bare_spellings_are_the_same_key() {
        assert_eq!(key("\"abc-123\""), key("abc-123"));
    }

    #[test]
    fn quoted_strings_may_hold_spaces_and_escapes() {
        assert_eq!(key(r#""a b \"c\" \\""#).as_deref(), Ok(r#"a b "c" \"#));
    }

    #[test]
    fn empty_keys_are_rejected_in_both_spellings() {
        assert_eq!(key(""), Err(KeyError::Empty));
        assert_eq!(key("\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn keys_longer_than_the_limit_are_rejected() {
        let at_limit = "k".repeat(IDEMPOTENCY_KEY_LEN_MAX);
        assert!(key(&at_limit).is_ok());
        assert_eq!(key(&format!("{at_limit}k")), Err(KeyError::TooLong));
        assert_eq!(key(&format!("\"{at_limit}k\"")), Err(KeyError::TooLong));
    }

    #[test]
    fn non_ascii_and_control_characters_are_rejected() {
        assert_eq!(
            IdempotencyKey::parse("clé".as_bytes()),
            Err(KeyError::NotPrintableAscii)
        );
        assert_eq!(
            IdempotencyKey::parse(b"a\x01b"),
            Err(KeyError::NotPrintableAscii)
        );
        assert_eq!(
            IdempotencyKey::parse(b"a\xffb"),
            Err(KeyError::NotPrintableAscii)
        );
        assert!(IdempotencyKey::parse(b"\"a\x01b\"").is_err());
    }

    #[test]
    fn malformed_structured_strings_are_rejected() {
        for bad in [
            "\"unterminated",
            "\"a\";p=1",
            "\"a\" trailing",
            "\"bad \\q escape\"",
        ] {
            assert!(key(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn a_bare_key_with_inner_spaces_must_be_quoted() {
        assert_eq!(key("a b"), Err(KeyError::NotPrintableAscii));
    }
}
