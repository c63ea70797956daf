//! A transfer intent: the request body as a client sends it, parsed into
//! typed values, and its canonical form and fingerprint.

use serde::{Deserialize, Serialize};

use crate::idempotency::Fingerprint;
use crate::ledger::{AccountId, AmountMinor, Currency, Description};

/// The route template that enters the fingerprint.
pub const ROUTE: &str = "/transfers";

/// The body of `POST /transfers`, exactly as a client may send it. Unknown
/// and duplicated fields are errors; `amount_minor` must be a JSON integer.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferBody {
    pub from: String,
    pub to: String,
    pub amount_minor: i64,
    pub currency: String,
    #[serde(default)]
    pub description: Option<String>,
    /// `immediate` (the default) or `pending`: a hold, posted or voided later.
    #[serde(default)]
    pub mode: Option<String>,
    /// A pending transfer's life, in seconds (default
    /// [`HOLD_EXPIRES_IN_DEFAULT_SECS`]); only with `mode: pending`.
    #[serde(default)]
    pub expires_in_seconds: Option<i64>,
}

/// How long a hold lasts when the request does not say: a week, about what
/// a card authorisation lives.
pub const HOLD_EXPIRES_IN_DEFAULT_SECS: i64 = 7 * 24 * 3600;

/// The longest a hold may last: thirty days. Money reserved longer than
/// that is better moved to an escrow account.
pub const HOLD_EXPIRES_IN_MAX_SECS: i64 = 30 * 24 * 3600;

/// Why a request was refused before its key was claimed: such a refusal
/// never touches `idempotency_keys`, so a corrected request may reuse the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidationKind {
    InvalidAmount,
    UnsupportedCurrency,
    CurrencyMismatch,
    SameAccount,
    InvalidAccountId,
    UnknownDestination,
    InvalidDescription,
    InvalidMode,
    InvalidExpiry,
    InvalidBatch,
}

impl ValidationKind {
    /// The stable last segment of the problem `type` URI.
    pub fn slug(self) -> &'static str {
        match self {
            Self::InvalidAmount => "invalid-amount",
            Self::UnsupportedCurrency => "unsupported-currency",
            Self::CurrencyMismatch => "currency-mismatch",
            Self::SameAccount => "same-account",
            Self::InvalidAccountId => "invalid-account-id",
            Self::UnknownDestination => "unknown-destination",
            Self::InvalidDescription => "invalid-description",
            Self::InvalidMode => "invalid-mode",
            Self::InvalidExpiry => "invalid-expiry",
            Self::InvalidBatch => "invalid-batch",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::InvalidAmount => "Invalid amount",
            Self::UnsupportedCurrency => "Unsupported currency",
            Self::CurrencyMismatch => "Currency does not match the accounts",
            Self::SameAccount => "Source and destination are the same account",
            Self::InvalidAccountId => "Invalid account id",
            Self::UnknownDestination => "Unknown destination account",
            Self::InvalidDescription => "Invalid description",
            Self::InvalidMode => "Invalid mode",
            Self::InvalidExpiry => "Invalid expiry",
            Self::InvalidBatch => "Invalid batch",
        }
    }
}

/// A refused request: what is wrong, the body field at fault, and the
/// text that says so.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct Invalid {
    pub kind: ValidationKind,
    pub param: &'static str,
    pub detail: String,
}

impl Invalid {
    pub fn new(kind: ValidationKind, param: &'static str, detail: impl Into<String>) -> Self {
        Self {
            kind,
            param,
            detail: detail.into(),
        }
    }
}

/// A request's optional `description`, checked as every request checks it.
pub fn parse_description(raw: Option<&str>) -> Result<Option<Description>, Invalid> {
    raw.map(Description::parse).transpose().map_err(|e| {
        Invalid::new(
            ValidationKind::InvalidDescription,
            "description",
            e.to_string(),
        )
    })
}

/// A transfer request that passed every check that does not need the
/// database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferIntent {
    pub from: AccountId,
    pub to: AccountId,
    pub amount: AmountMinor,
    pub currency: Currency,
    pub description: Option<Description>,
    /// Set for a pending transfer (a hold): how long it lasts.
    pub hold: Option<HoldTerms>,
}

/// What makes a transfer pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldTerms {
    /// 1 to [`HOLD_EXPIRES_IN_MAX_SECS`].
    pub expires_in_seconds: i64,
}

/// The canonical form that is hashed: fixed field order, typed values, no
/// whitespace. Two bodies that differ only in field order or formatting
/// produce the same bytes.
#[derive(Serialize)]
struct CanonicalTransfer<'a> {
    from: &'a str,
    to: &'a str,
    amount_minor: i64,
    currency: &'a str,
    description: Option<&'a str>,
    // Absent for an immediate transfer, so its fingerprint is what it was
    // before holds existed (stored keys keep matching their retries).
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_in_seconds: Option<i64>,
}

impl TransferIntent {
    /// Parses and validates a body without touching the database.
    pub fn parse(body: &TransferBody) -> Result<Self, Invalid> {
        let account = |field: &'static str, value: &str| {
            AccountId::parse(value).map_err(|e| {
                Invalid::new(
                    ValidationKind::InvalidAccountId,
                    field,
                    format!("{field}: {e}"),
                )
            })
        };
        let from = account("from", &body.from)?;
        let to = account("to", &body.to)?;
        let amount = AmountMinor::parse(body.amount_minor).map_err(|e| {
            Invalid::new(ValidationKind::InvalidAmount, "amount_minor", e.to_string())
        })?;
        let currency = Currency::parse(&body.currency).map_err(|e| {
            Invalid::new(
                ValidationKind::UnsupportedCurrency,
                "currency",
                e.to_string(),
            )
        })?;
        if from == to {
            return Err(Invalid::new(
                ValidationKind::SameAccount,
                "to",
                "from and to must be different accounts",
            ));
        }
        let description = parse_description(body.description.as_deref())?;
        let hold = hold_terms(body)?;
        Ok(Self {
            from,
            to,
            amount,
            currency,
            description,
            hold,
        })
    }

    pub fn canonical_bytes(&self) -> Vec<u8> {
        let canonical = CanonicalTransfer {
            from: self.from.as_str(),
            to: self.to.as_str(),
            amount_minor: self.amount.get(),
            currency: self.currency.as_str(),
            description: self.description.as_ref().map(Description::as_str),
            mode: self.hold.map(|_| "pending"),
            expires_in_seconds: self.hold.map(|h| h.expires_in_seconds),
        };
        // Serialising strings and an integer into a Vec cannot fail.
        serde_json::to_vec(&canonical).unwrap_or_default()
    }

    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::compute("POST", ROUTE, &self.canonical_bytes())
    }
}

/// `mode` and `expires_in_seconds`: a default expiry is the same intent as
/// one spelled out.
fn hold_terms(body: &TransferBody) -> Result<Option<HoldTerms>, Invalid> {
    let pending = match body.mode.as_deref() {
        None | Some("immediate") => false,
        Some("pending") => true,
        Some(_) => {
            return Err(Invalid::new(
                ValidationKind::InvalidMode,
                "mode",
                "mode must be immediate or pending",
            ));
        }
    };
    match (pending, body.expires_in_seconds) {
        (false, None) => Ok(None),
        (false, Some(_)) => Err(Invalid::new(
            ValidationKind::InvalidExpiry,
            "expires_in_seconds",
            "only a pending transfer expires: send mode pending with expires_in_seconds",
        )),
        (true, secs) => {
            let secs = secs.unwrap_or(HOLD_EXPIRES_IN_DEFAULT_SECS);
            if !(1..=HOLD_EXPIRES_IN_MAX_SECS).contains(&secs) {
                return Err(Invalid::new(
                    ValidationKind::InvalidExpiry,
                    "expires_in_seconds",
                    format!("expires_in_seconds must be between 1 and {HOLD_EXPIRES_IN_MAX_SECS}"),
                ));
            }
            Ok(Some(HoldTerms {
                expires_in_seconds: secs,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> TransferBody {
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    fn fingerprint(json: &str) -> Fingerprint {
        TransferIntent::parse(&body(json))
            .map(|i| i.fingerprint())
            .unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    #[test]
    fn field_order_and_whitespace_do_not_change_the_fingerprint() {
        assert_eq!(
            fingerprint(r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD"}"#),
            fingerprint(
                r#"{ "currency" : "USD",
                    "amount_minor": 5, "to":"acc_2", "from":"acc_1" }"#
            )
        );
    }

    #[test]
    fn an_absent_description_equals_a_null_one() {
        assert_eq!(
            fingerprint(r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD"}"#),
            fingerprint(
                r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","description":null}"#
            )
        );
    }

    #[test]
    fn any_changed_value_changes_the_fingerprint() {
        let base =
            fingerprint(r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD"}"#);
        for other in [
            r#"{"from":"acc_1","to":"acc_2","amount_minor":6,"currency":"USD"}"#,
            r#"{"from":"acc_1","to":"acc_3","amount_minor":5,"currency":"USD"}"#,
            r#"{"from":"acc_3","to":"acc_2","amount_minor":5,"currency":"USD"}"#,
            r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"EUR"}"#,
            r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","description":""}"#,
        ] {
            assert_ne!(base, fingerprint(other), "{other}");
        }
    }

    #[test]
    fn an_immediate_transfer_keeps_the_fingerprint_it_had_before_holds() {
        let base = r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD"}"#;
        assert_eq!(
            fingerprint(base),
            fingerprint(
                r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"immediate"}"#
            )
        );
        // The canonical bytes of the previous version, spelled out.
        assert_eq!(
            fingerprint(base),
            Fingerprint::compute(
                "POST",
                ROUTE,
                br#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","description":null}"#
            )
        );
    }

    #[test]
    fn a_pending_transfer_is_another_intent_and_its_default_expiry_is_spelled_out() {
        let immediate = r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD"}"#;
        let pending =
            r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"pending"}"#;
        assert_ne!(fingerprint(immediate), fingerprint(pending));
        let week = format!(
            r#"{{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"pending","expires_in_seconds":{HOLD_EXPIRES_IN_DEFAULT_SECS}}}"#
        );
        assert_eq!(fingerprint(pending), fingerprint(&week));
        let hour = r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"pending","expires_in_seconds":3600}"#;
        assert_ne!(fingerprint(pending), fingerprint(hour));
    }

    #[test]
    fn modes_and_expiries_out_of_their_bounds_are_refused() {
        for (json, kind) in [
            (
                r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"later"}"#,
                ValidationKind::InvalidMode,
            ),
            (
                r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","expires_in_seconds":60}"#,
                ValidationKind::InvalidExpiry,
            ),
            (
                r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"pending","expires_in_seconds":0}"#,
                ValidationKind::InvalidExpiry,
            ),
            (
                r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","mode":"pending","expires_in_seconds":2592001}"#,
                ValidationKind::InvalidExpiry,
            ),
        ] {
            assert_eq!(
                TransferIntent::parse(&body(json)).map_err(|e| e.kind),
                Err(kind),
                "{json}"
            );
        }
    }

    #[test]
    fn non_integer_and_out_of_range_amounts_are_not_parsed() {
        for amount in [
            "1.0",
            "1e3",
            "\"5\"",
            "9223372036854775808",
            "-9223372036854775809",
            "true",
        ] {
            let json = format!(
                r#"{{"from":"acc_1","to":"acc_2","amount_minor":{amount},"currency":"USD"}}"#
            );
            assert!(
                serde_json::from_str::<TransferBody>(&json).is_err(),
                "{amount}"
            );
        }
    }

    #[test]
    fn duplicated_and_unknown_fields_are_not_parsed() {
        for json in [
            r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"amount_minor":6,"currency":"USD"}"#,
            r#"{"from":"acc_1","to":"acc_2","amount_minor":5,"currency":"USD","memo":"x"}"#,
        ] {
            assert!(
                serde_json::from_str::<TransferBody>(json).is_err(),
                "{json}"
            );
        }
    }

    #[test]
    fn negative_zero_is_not_an_integer_amount() {
        // serde_json reads `-0` as the float -0.0, so it is refused like any
        // other non-integer rather than silently becoming a zero amount.
        let json = r#"{"from":"acc_1","to":"acc_2","amount_minor":-0,"currency":"USD"}"#;
        assert!(serde_json::from_str::<TransferBody>(json).is_err());
    }
}
