//! Webhooks: endpoints a principal registers, and the worker that posts
//! them the events they may see, in the feed's order, at least once, signed
//! with `nexo_signature`. `store` owns the tables (migration 0009),
//! `worker` delivers. Guarantees: docs/events.md; design: ADR-012.

pub mod client;
pub mod store;
pub mod worker;

use std::time::Duration;

use rand::RngCore;

use crate::ledger::events::EventType;

/// Endpoints one principal may register: each costs the worker a claim per
/// poll and a delivery per event, so a principal cannot multiply the
/// instance's work without bound.
pub const ENDPOINTS_MAX: i64 = 10;
/// The longest URL accepted: what browsers and most proxies handle.
pub const URL_LEN_MAX: usize = 2_048;
/// Secrets are this prefix and [`SECRET_BYTES`] random bytes in hex, so a
/// leaked one is recognisable in a scan of logs or repositories.
pub const SECRET_PREFIX: &str = "whsec_";
/// 256 bits: the HMAC-SHA256 key size.
pub const SECRET_BYTES: usize = 32;
/// After a rotation the old secret keeps signing (next to the new one) for
/// this long, so receivers can be switched over without refusing a
/// delivery.
pub const PREVIOUS_SECRET_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// Attempts per page of `GET /webhook-endpoints/{id}/attempts` when the
/// client does not ask.
pub const ATTEMPTS_PAGE_DEFAULT: i64 = 50;
/// The most attempts one page holds.
pub const ATTEMPTS_PAGE_MAX: i64 = 200;
/// The most events a range redelivery (`after`) may send again: the range
/// is counted before the cursor moves, so the worker's backlog stays
/// bounded.
pub const REDELIVER_RANGE_EVENTS_MAX: i64 = 1_000;

/// How much of an unknown event type a refusal repeats.
const EVENT_TYPE_SHOWN_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("{0}")]
    InvalidUrl(String),
    #[error("{0}")]
    InvalidEventTypes(String),
    #[error("a principal may register at most {ENDPOINTS_MAX} webhook endpoints")]
    TooManyEndpoints,
    /// The principal already registered this URL.
    #[error("this URL is already registered")]
    DuplicateUrl { existing: uuid::Uuid },
    #[error("{0}")]
    InvalidRedelivery(String),
    #[error("not found")]
    NotFound,
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

/// An endpoint's URL: absolute http or https, with a host, no credentials
/// and no fragment, at most [`URL_LEN_MAX`] characters.
pub fn parse_url(raw: &str) -> Result<String, WebhookError> {
    let bad = |why: &str| WebhookError::InvalidUrl(format!("url {why}"));
    if raw.len() > URL_LEN_MAX {
        return Err(bad(&format!("must be at most {URL_LEN_MAX} characters")));
    }
    let url = url::Url::parse(raw).map_err(|_| bad("must be an absolute http or https URL"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("must use http or https"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("must name a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(
            "must not carry credentials: the signature authenticates deliveries",
        ));
    }
    if url.fragment().is_some() {
        return Err(bad("must not have a fragment"));
    }
    client::request_uri(raw).map_err(|_| bad("must be an absolute http or https URL"))?;
    Ok(raw.to_owned())
}

/// The event types an endpoint receives: each a known type, no repeats;
/// empty means every type.
pub fn parse_event_types(raw: &[String]) -> Result<Vec<String>, WebhookError> {
    let mut types: Vec<String> = Vec::with_capacity(raw.len());
    for name in raw {
        if !EventType::ALL.iter().any(|t| t.as_str() == name) {
            let known: Vec<&str> = EventType::ALL.iter().map(|t| t.as_str()).collect();
            // A client's text in a problem stays short.
            let shown: String = name.chars().take(EVENT_TYPE_SHOWN_MAX).collect();
            return Err(WebhookError::InvalidEventTypes(format!(
                "event_types: unknown type {shown:?}; the types are {}",
                known.join(", ")
            )));
        }
        if !types.contains(name) {
            types.push(name.clone());
        }
    }
    Ok(types)
}

/// A new signing secret.
pub fn new_secret() -> String {
    let mut bytes = [0u8; SECRET_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    format!("{SECRET_PREFIX}{}", hex::encode(bytes))
}

/// How long to wait after the `failures`th failure in a row: capped
/// exponential backoff with full jitter (uniform between zero and the
/// cap), so endpoints that failed together do not retry together.
pub fn backoff(failures: i32, base: Duration, max: Duration) -> Duration {
    let exponent = u32::try_from(failures.saturating_sub(1).clamp(0, 30)).unwrap_or(30);
    let ceiling = base.saturating_mul(2u32.saturating_pow(exponent)).min(max);
    let ceiling_ms = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(rand::random_range(0..=ceiling_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_must_be_absolute_http_without_credentials() {
        assert!(parse_url("https://example.com/hooks").is_ok());
        assert!(parse_url("http://127.0.0.1:9000/").is_ok());
        for bad in [
            "",
            "example.com/hooks",
            "ftp://example.com/",
            "https://user:pw@example.com/",
            "https://example.com/#frag",
            "file:///etc/passwd",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(URL_LEN_MAX));
        assert!(parse_url(&long).is_err());
    }

    #[test]
    fn event_types_are_known_and_deduplicated() {
        let types = |names: &[&str]| {
            parse_event_types(&names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).ok()
        };
        assert_eq!(types(&[]), Some(vec![]));
        assert_eq!(
            types(&["hold.posted", "hold.posted"]),
            Some(vec!["hold.posted".to_owned()])
        );
        assert_eq!(types(&["transfer.created"]), None);
    }

    #[test]
    fn secrets_are_prefixed_random_hex() {
        let (a, b) = (new_secret(), new_secret());
        assert_ne!(a, b);
        assert_eq!(a.len(), SECRET_PREFIX.len() + 2 * SECRET_BYTES);
        assert!(a.starts_with(SECRET_PREFIX));
    }

    #[test]
    fn backoff_grows_to_its_cap_with_jitter_below_it() {
        let (base, max) = (Duration::from_secs(1), Duration::from_secs(300));
        for failures in [0, 1, 5, 20, i32::MAX] {
            let ceiling = base
                .saturating_mul(
                    2u32.saturating_pow(u32::try_from((failures - 1).clamp(0, 30)).unwrap_or(30)),
                )
                .min(max);
            for _ in 0..50 {
                assert!(backoff(failures, base, max) <= ceiling);
            }
        }
    }
}
