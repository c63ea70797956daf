//! Webhook signatures, as the server makes them and a receiver checks them.
//!
//! Every delivery carries the header [`HEADER`]:
//!
//! ```text
//! Nexo-Signature: t=1764547200,v1=630eda942fc34e56ca5112c7d016b4654bf3c31c6bf60ca3d80d63f9c550b29f
//! ```
//!
//! `t` is when the delivery attempt was signed (Unix seconds) and each `v1` is
//! the hex HMAC-SHA256, under one of the endpoint's secrets, of the bytes
//! `"{t}.{body}"`. Signing the timestamp with the body lets a receiver refuse
//! a delivery recorded and sent again later (a replay) without remembering
//! every signature it saw: past [`DEFAULT_TOLERANCE`] it is too old. While a
//! secret is being rotated the server signs with both, so the header holds
//! two `v1` entries and either secret verifies it.
//!
//! A retry of the same event is signed afresh (a new `t`) but carries the
//! same event id: receivers drop duplicates by that id, not by signature.

use std::fmt::Write as _;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The header that carries the signature.
pub const HEADER: &str = "nexo-signature";

/// How far a signature's timestamp may be from the receiver's clock before
/// the delivery is refused, either way: long enough for a slow network and
/// some clock drift, short enough that a captured delivery cannot be
/// replayed later.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// Signatures one header may carry: one per live secret (two while
/// rotating), with room for a receiver that is told about more.
pub const SIGNATURES_MAX: usize = 8;

/// The longest header accepted: bounds the work spent on a hostile one.
pub const HEADER_LEN_MAX: usize = 1_024;

type HmacSha256 = Hmac<Sha256>;

/// Why a delivery's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the signature header is missing")]
    Missing,
    #[error("the signature header is not `t=<unix seconds>,v1=<hex>[,v1=<hex>]`")]
    Malformed,
    #[error("no v1 signature in the header matches the body under any secret")]
    Mismatch,
    #[error("the signature is {age_secs} s old, past the tolerance: a replay, or a clock far off")]
    TooOld { age_secs: i64 },
    #[error("the signature is {ahead_secs} s in the future, past the tolerance")]
    FromTheFuture { ahead_secs: i64 },
}

/// The header value for `body` signed at `timestamp` (Unix seconds) with
/// every secret in `secrets`, in order.
pub fn sign(secrets: &[&[u8]], timestamp: i64, body: &[u8]) -> String {
    let mut header = format!("t={timestamp}");
    for secret in secrets {
        if let Some(mac) = signed(secret, timestamp, body) {
            let _ = write!(header, ",v1={}", hex::encode(mac.finalize().into_bytes()));
        }
    }
    header
}

/// Checks a delivery: `header` is the [`HEADER`] value, `body` the exact
/// bytes received, `secrets` the endpoint's secrets the receiver knows and
/// `now` its clock (Unix seconds). Returns the signed timestamp.
///
/// Each candidate is compared in constant time, so the comparison leaks
/// nothing about how much of a forged signature was right.
pub fn verify(
    header: Option<&str>,
    body: &[u8],
    secrets: &[&[u8]],
    now: i64,
    tolerance: Duration,
) -> Result<i64, SignatureError> {
    let header = header.ok_or(SignatureError::Missing)?;
    let (timestamp, signatures) = parse(header)?;
    let tolerance = i64::try_from(tolerance.as_secs()).unwrap_or(i64::MAX);
    let age = now.saturating_sub(timestamp);
    if age > tolerance {
        return Err(SignatureError::TooOld { age_secs: age });
    }
    if -age > tolerance {
        return Err(SignatureError::FromTheFuture { ahead_secs: -age });
    }
    let matches = secrets.iter().any(|secret| {
        signatures.iter().any(|signature| {
            signed(secret, timestamp, body).is_some_and(|mac| mac.verify_slice(signature).is_ok())
        })
    });
    if matches {
        Ok(timestamp)
    } else {
        Err(SignatureError::Mismatch)
    }
}

/// The timestamp and the `v1` signatures of a header. Entries of other
/// schemes are skipped, so a later scheme can be added beside `v1`.
fn parse(header: &str) -> Result<(i64, Vec<Vec<u8>>), SignatureError> {
    if header.len() > HEADER_LEN_MAX {
        return Err(SignatureError::Malformed);
    }
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for entry in header.split(',') {
        let (name, value) = entry
            .trim()
            .split_once('=')
            .ok_or(SignatureError::Malformed)?;
        match name {
            "t" if timestamp.is_none() => {
                let digits = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
                timestamp = digits.then(|| value.parse::<i64>().ok()).flatten();
                if timestamp.is_none() {
                    return Err(SignatureError::Malformed);
                }
            }
            "t" => return Err(SignatureError::Malformed),
            "v1" => {
                let signature = hex::decode(value).map_err(|_| SignatureError::Malformed)?;
                if signature.len() != 32 || signatures.len() == SIGNATURES_MAX {
                    return Err(SignatureError::Malformed);
                }
                signatures.push(signature);
            }
            _ => {}
        }
    }
    match (timestamp, signatures.is_empty()) {
        (Some(t), false) => Ok((t, signatures)),
        _ => Err(SignatureError::Malformed),
    }
}

/// The MAC of `"{timestamp}.{body}"` under `secret`, not yet finalised.
fn signed(secret: &[u8], timestamp: i64, body: &[u8]) -> Option<HmacSha256> {
    // HMAC takes a key of any length: `None` cannot happen.
    let mut mac = HmacSha256::new_from_slice(secret).ok()?;
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Some(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"whsec_test_secret";
    const NOW: i64 = 1_764_547_200;
    const BODY: &[u8] = br#"{"id":"evt_1","type":"transfer.posted"}"#;

    fn check(header: &str, body: &[u8], now: i64) -> Result<i64, SignatureError> {
        verify(Some(header), body, &[SECRET], now, DEFAULT_TOLERANCE)
    }

    #[test]
    fn a_signed_body_verifies_and_its_timestamp_is_returned() {
        let header = sign(&[SECRET], NOW, BODY);
        assert!(header.starts_with(&format!("t={NOW},v1=")));
        assert_eq!(check(&header, BODY, NOW + 10), Ok(NOW));
    }

    #[test]
    fn matches_an_independent_hmac_sha256() {
        // printf '%s' '1764547200.{"id":"evt_1","type":"transfer.posted"}' |
        //   openssl dgst -sha256 -hmac whsec_test_secret
        assert_eq!(
            sign(&[SECRET], NOW, BODY),
            "t=1764547200,v1=630eda942fc34e56ca5112c7d016b4654bf3c31c6bf60ca3d80d63f9c550b29f"
        );
    }

    #[test]
    fn a_changed_body_timestamp_or_secret_is_refused() {
        let header = sign(&[SECRET], NOW, BODY);
        assert_eq!(check(&header, b"{}", NOW), Err(SignatureError::Mismatch));
        let moved = header.replace(&NOW.to_string(), &(NOW + 1).to_string());
        assert_eq!(check(&moved, BODY, NOW), Err(SignatureError::Mismatch));
        let forged = sign(&[b"whsec_guess"], NOW, BODY);
        assert_eq!(check(&forged, BODY, NOW), Err(SignatureError::Mismatch));
    }

    #[test]
    fn an_old_or_future_signature_is_refused_even_when_it_matches() {
        let header = sign(&[SECRET], NOW, BODY);
        assert_eq!(
            check(&header, BODY, NOW + 301),
            Err(SignatureError::TooOld { age_secs: 301 })
        );
        assert_eq!(check(&header, BODY, NOW + 300), Ok(NOW));
        assert_eq!(
            check(&header, BODY, NOW - 301),
            Err(SignatureError::FromTheFuture { ahead_secs: 301 })
        );
    }

    #[test]
    fn either_secret_verifies_during_a_rotation() {
        let (old, new): (&[u8], &[u8]) = (b"whsec_old", b"whsec_new");
        let header = sign(&[old, new], NOW, BODY);
        assert_eq!(header.matches("v1=").count(), 2);
        for secret in [old, new] {
            assert_eq!(
                verify(Some(&header), BODY, &[secret], NOW, DEFAULT_TOLERANCE),
                Ok(NOW)
            );
        }
    }

    #[test]
    fn malformed_headers_are_refused_before_any_hmac() {
        let good = hex::encode([7u8; 32]);
        for header in [
            "",
            "t=1",
            &format!("v1={good}"),
            &format!("t=abc,v1={good}"),
            &format!("t=-5,v1={good}"),
            &format!("t=1,t=2,v1={good}"),
            "t=1,v1=zz",
            "t=1,v1=abcd",
            "garbage",
            &format!(
                "t=1,{}",
                vec![format!("v1={good}"); SIGNATURES_MAX + 1].join(",")
            ),
            &"x".repeat(HEADER_LEN_MAX + 1),
        ] {
            assert_eq!(
                check(header, BODY, NOW),
                Err(SignatureError::Malformed),
                "{header}"
            );
        }
        assert_eq!(
            verify(None, BODY, &[SECRET], NOW, DEFAULT_TOLERANCE),
            Err(SignatureError::Missing)
        );
    }

    #[test]
    fn other_schemes_beside_v1_are_ignored() {
        let header = format!("{},v0=deadbeef", sign(&[SECRET], NOW, BODY));
        assert_eq!(check(&header, BODY, NOW), Ok(NOW));
    }
}
