#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Properties of the two parsers every request goes through: the
//! `Idempotency-Key` header and the transfer body's fingerprint. proptest
//! generates the inputs (256 cases per property by default; set
//! PROPTEST_CASES for more).
mod common;

use nexo_transfers::idempotency::{Fingerprint, IDEMPOTENCY_KEY_LEN_MAX, IdempotencyKey, KeyError};
use nexo_transfers::ledger::money::AMOUNT_MINOR_MAX;
use nexo_transfers::transfers::intent::{TransferBody, TransferIntent};
use proptest::prelude::*;

/// The Structured Field string spelling of a key: quoted, `\` and `"` escaped.
fn sf_string(inner: &str) -> String {
    format!("\"{}\"", inner.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A bare key: printable ASCII without spaces, not starting with a quote
/// (which would make it the quoted spelling).
const BARE_KEY: &str = "[!#-~][!-~]{0,254}";

proptest! {
    #[test]
    fn any_bytes_either_parse_to_a_valid_key_or_are_refused(
        raw in proptest::collection::vec(any::<u8>(), 0..600)
    ) {
        if let Ok(key) = IdempotencyKey::parse(&raw) {
            let inner = key.as_str();
            prop_assert!((1..=IDEMPOTENCY_KEY_LEN_MAX).contains(&inner.len()));
            prop_assert!(inner.bytes().all(|b| (0x20..=0x7e).contains(&b)));
        }
    }

    #[test]
    fn a_bare_key_is_itself(key in BARE_KEY) {
        let parsed = IdempotencyKey::parse(key.as_bytes()).unwrap();
        prop_assert_eq!(parsed.as_str(), key.as_str());
    }

    #[test]
    fn the_quoted_spelling_is_the_same_key(inner in "[ -~]{1,255}") {
        let quoted = IdempotencyKey::parse(sf_string(&inner).as_bytes()).unwrap();
        prop_assert_eq!(quoted.as_str(), inner.as_str());
        if !inner.contains(' ') && !inner.starts_with('"') {
            prop_assert_eq!(IdempotencyKey::parse(inner.as_bytes()).unwrap(), quoted);
        }
    }

    #[test]
    fn surrounding_whitespace_is_not_part_of_the_key(
        key in BARE_KEY, before in "[ \t]{0,3}", after in "[ \t]{0,3}"
    ) {
        let padded = format!("{before}{key}{after}");
        let parsed = IdempotencyKey::parse(padded.as_bytes()).unwrap();
        prop_assert_eq!(parsed.as_str(), key.as_str());
    }

    #[test]
    fn keys_over_the_limit_are_too_long_in_both_spellings(inner in "[!#-~]{256,600}") {
        prop_assert_eq!(IdempotencyKey::parse(inner.as_bytes()), Err(KeyError::TooLong));
        prop_assert_eq!(
            IdempotencyKey::parse(sf_string(&inner).as_bytes()),
            Err(KeyError::TooLong)
        );
    }

    #[test]
    fn a_byte_outside_printable_ascii_inside_a_key_is_refused(
        head in "[!#-~]{1,50}",
        bad in prop_oneof![0x00u8..0x20, 0x7fu8..=0xff],
        tail in "[!-~]{1,50}",
        quoted in any::<bool>(),
    ) {
        let mut raw = Vec::new();
        if quoted {
            raw.push(b'"');
        }
        raw.extend_from_slice(head.replace(['"', '\\'], "x").as_bytes());
        raw.push(bad);
        raw.extend_from_slice(tail.replace(['"', '\\'], "x").as_bytes());
        if quoted {
            raw.push(b'"');
        }
        prop_assert!(IdempotencyKey::parse(&raw).is_err());
    }
}

/// A valid transfer intent, as field values.
#[derive(Debug, Clone)]
struct Fields {
    from: String,
    to: String,
    amount: i64,
    currency: String,
    description: Option<String>,
}

fn fields() -> impl Strategy<Value = Fields> {
    (
        "acc_[A-Za-z0-9]{1,40}",
        "acc_[A-Za-z0-9]{1,40}",
        1..=AMOUNT_MINOR_MAX,
        "[A-Z]{3}",
        proptest::option::of("\\PC{0,140}"),
    )
        .prop_filter("distinct accounts", |(from, to, ..)| from != to)
        .prop_map(|(from, to, amount, currency, description)| Fields {
            from,
            to,
            amount,
            currency,
            description,
        })
}

/// How one client happens to write the JSON: field order, whitespace,
/// `\u` escapes, an explicit null description.
#[derive(Debug, Clone)]
struct Spelling {
    order: Vec<usize>,
    gaps: Vec<String>,
    escape_everything: bool,
    null_description: bool,
}

fn spelling() -> impl Strategy<Value = Spelling> {
    (
        Just((0..5).collect::<Vec<usize>>()).prop_shuffle(),
        proptest::collection::vec("[ \t\r\n]{0,3}", 24),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(order, gaps, escape_everything, null_description)| Spelling {
                order,
                gaps,
                escape_everything,
                null_description,
            },
        )
}

fn json_string(value: &str, escape_everything: bool) -> String {
    if !escape_everything {
        return serde_json::to_string(value).unwrap();
    }
    let mut out = String::from("\"");
    for unit in value.encode_utf16() {
        out.push_str(&format!("\\u{unit:04x}"));
    }
    out.push('"');
    out
}

fn render(fields: &Fields, spelling: &Spelling) -> String {
    let esc = spelling.escape_everything;
    let mut members: Vec<Option<(&str, String)>> = vec![
        Some(("from", json_string(&fields.from, esc))),
        Some(("to", json_string(&fields.to, esc))),
        Some(("amount_minor", fields.amount.to_string())),
        Some(("currency", json_string(&fields.currency, esc))),
        match &fields.description {
            Some(d) => Some(("description", json_string(d, esc))),
            None => spelling
                .null_description
                .then(|| ("description", "null".to_owned())),
        },
    ];
    let mut gaps = spelling.gaps.iter();
    let mut gap = || gaps.next().cloned().unwrap_or_default();
    let mut out = format!("{}{{", gap());
    let mut first = true;
    for i in &spelling.order {
        if let Some((name, value)) = members[*i].take() {
            if !first {
                out.push_str(&format!("{},", gap()));
            }
            first = false;
            let name = json_string(name, esc);
            out.push_str(&format!("{}{name}{}:{}{value}", gap(), gap(), gap()));
        }
    }
    out.push_str(&format!("{}}}{}", gap(), gap()));
    out
}

fn fingerprint_of(json: &str) -> Fingerprint {
    let body: TransferBody = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"));
    TransferIntent::parse(&body)
        .unwrap_or_else(|e| panic!("{json}: {e}"))
        .fingerprint()
}

proptest! {
    #[test]
    fn equal_intents_hash_equal_however_they_are_written(
        fields in fields(), one in spelling(), other in spelling()
    ) {
        let canonical = fingerprint_of(&render(&fields, &Spelling {
            order: (0..5).collect(),
            gaps: Vec::new(),
            escape_everything: false,
            null_description: false,
        }));
        prop_assert_eq!(fingerprint_of(&render(&fields, &one)), canonical);
        prop_assert_eq!(fingerprint_of(&render(&fields, &other)), canonical);
    }

    #[test]
    fn any_changed_value_hashes_differently(
        fields in fields(),
        changed in fields(),
        which in 0..5usize,
        how in spelling(),
    ) {
        let mut other = fields.clone();
        match which {
            0 => other.from = changed.from,
            1 => other.to = changed.to,
            2 => other.amount = changed.amount,
            3 => other.currency = changed.currency,
            _ => other.description = changed.description,
        }
        prop_assume!(other.from != other.to);
        let same = (&other.from, &other.to, other.amount, &other.currency, &other.description)
            == (&fields.from, &fields.to, fields.amount, &fields.currency, &fields.description);
        prop_assume!(!same);
        prop_assert_ne!(
            fingerprint_of(&render(&fields, &how)),
            fingerprint_of(&render(&other, &how))
        );
    }
}
