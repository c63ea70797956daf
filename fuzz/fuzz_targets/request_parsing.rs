//! Everything a `POST /transfers` request is parsed through before any
//! database work: the `Authorization` header, the `Idempotency-Key` header
//! and the JSON body, down to the fingerprint. Input layout: one length
//! byte and that many bytes of key, one length byte and that many bytes of
//! authorization, then the body. Any panic is a finding, and so is a parse
//! that does not survive a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nexo_transfers::auth;
use nexo_transfers::idempotency::{IDEMPOTENCY_KEY_LEN_MAX, IdempotencyKey};
use nexo_transfers::transfers::intent::{TransferBody, TransferIntent};

/// Splits off a length-prefixed field.
fn field(data: &[u8]) -> (&[u8], &[u8]) {
    match data.split_first() {
        Some((&len, rest)) => rest.split_at(usize::from(len).min(rest.len())),
        None => (&[], &[]),
    }
}

fn check_key(raw: &[u8]) {
    let Ok(key) = IdempotencyKey::parse(raw) else {
        return;
    };
    let inner = key.as_str();
    assert!((1..=IDEMPOTENCY_KEY_LEN_MAX).contains(&inner.len()));
    assert!(inner.bytes().all(|b| (0x20..=0x7e).contains(&b)));
    // The quoted spelling of a parsed key is the same key.
    let quoted = format!("\"{}\"", inner.replace('\\', "\\\\").replace('"', "\\\""));
    assert_eq!(IdempotencyKey::parse(quoted.as_bytes()), Ok(key));
}

fn check_authorization(raw: &[u8]) {
    let Ok(value) = std::str::from_utf8(raw) else {
        return;
    };
    if let Some(token) = auth::bearer_token(value) {
        assert!(!token.is_empty() && token.len() <= auth::TOKEN_LEN_MAX);
        assert!(token.bytes().all(|b| b.is_ascii_graphic()));
    }
}

fn check_body(raw: &[u8]) {
    let Ok(body) = serde_json::from_slice::<TransferBody>(raw) else {
        return;
    };
    let Ok(intent) = TransferIntent::parse(&body) else {
        return;
    };
    // The canonical form parses back to the same intent and fingerprint.
    let canonical = intent.canonical_bytes();
    let again: TransferBody = serde_json::from_slice(&canonical).expect("canonical bytes parse");
    let again = TransferIntent::parse(&again).expect("a canonical intent is valid");
    assert_eq!(again, intent);
    assert_eq!(again.fingerprint(), intent.fingerprint());
}

fuzz_target!(|data: &[u8]| {
    let (key, rest) = field(data);
    let (authorization, body) = field(rest);
    check_key(key);
    check_authorization(authorization);
    check_body(body);
});
