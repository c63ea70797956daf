//! The API's requests and answers, as `openapi.yaml` describes them.
//!
//! Answers are read leniently: an unknown field is ignored and an unknown
//! value of a closed set (a state, a direction) becomes `Unknown`, so a
//! server that grew a field does not break an older client.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The body of `POST /transfers`. Amounts are integers in the currency's
/// minor unit (`10000` is 100.00 USD).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRequest {
    pub from: String,
    pub to: String,
    pub amount_minor: i64,
    pub currency: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `None` (or [`TransferMode::Immediate`]) posts at once;
    /// [`TransferMode::Pending`] only reserves the amount on the source, to
    /// be posted or voided later (a hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<TransferMode>,
    /// For a hold: seconds until it expires (is voided by the server) if
    /// neither posted nor voided. The server's default is 7 days, its
    /// bound 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_seconds: Option<i64>,
}

/// Whether a transfer posts when it is made or is held first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    Immediate,
    Pending,
}

impl TransferRequest {
    pub fn new(
        from: impl Into<String>,
        to: impl Into<String>,
        amount_minor: i64,
        currency: impl Into<String>,
    ) -> Self {
        Self {
            from: from.into(),
            to: to.into(),
            amount_minor,
            currency: currency.into(),
            description: None,
            mode: None,
            expires_in_seconds: None,
        }
    }

    pub fn description(mut self, description: impl Into<String>) -> Self {
        self.description = Some(description.into());
        self
    }

    /// A hold: the amount is reserved on the source and moves only when
    /// posted ([`crate::TransferIntent::post_hold`]); released when voided
    /// or after `expires_in_seconds` (the server's default when `None`).
    pub fn pending(mut self, expires_in_seconds: Option<i64>) -> Self {
        self.mode = Some(TransferMode::Pending);
        self.expires_in_seconds = expires_in_seconds;
        self
    }
}

/// A transfer, as `POST /transfers` (and a hold's post, void or reversal)
/// answers it and `GET /transfers/{id}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub transfer_id: Uuid,
    pub status: TransferStatus,
    pub from: String,
    pub to: String,
    /// What moved; for a hold not yet posted, what it reserves.
    pub amount_minor: i64,
    pub currency: String,
    pub description: Option<String>,
    pub created_at: DateTime<Utc>,
    /// `None` until the transfer is posted (a hold pending, voided or
    /// expired).
    pub receipt: Option<Receipt>,
    /// Present for a transfer made as a hold.
    #[serde(default)]
    pub hold: Option<Hold>,
    /// For a reversal: the transfer it gives back.
    #[serde(default)]
    pub reverses: Option<Uuid>,
    /// For a leg of an atomic batch: the batch.
    #[serde(default)]
    pub batch_id: Option<Uuid>,
    /// On reads: how much of this transfer reversals have given back, when
    /// any has.
    #[serde(default)]
    pub reversed_minor: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferStatus {
    Posted,
    /// A hold: reserved, not moved.
    Pending,
    /// A hold released by a void: nothing moved.
    Voided,
    /// A hold released at its expiry: nothing moved.
    Expired,
    #[serde(other)]
    Unknown,
}

/// What a hold reserved and until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// Reserved when the hold was made; a partial post moves less.
    pub amount_minor: i64,
    pub expires_at: DateTime<Utc>,
    /// When it was posted, voided or expired.
    pub resolved_at: Option<DateTime<Utc>>,
}

/// Proof of the posting; identical on every replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    pub receipt_id: String,
    pub debit_entry_id: i64,
    pub credit_entry_id: i64,
    pub issued_at: DateTime<Utc>,
}

/// A page of `GET /transfers`, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransfersPage {
    pub transfers: Vec<Transfer>,
    /// Pass to [`TransferQuery::cursor`] for the next, older page; `None`
    /// on the last page.
    pub next_cursor: Option<String>,
}

/// The filters and page of `GET /transfers`; every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferQuery {
    /// `limit` and `cursor`, as every listing takes them.
    pub page: PageQuery,
    pub account: Option<String>,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    pub idempotency_key: Option<String>,
}

impl TransferQuery {
    /// Transfers per page, 1 to 200 (the server's default is 50).
    pub fn limit(mut self, limit: u32) -> Self {
        self.page = self.page.limit(limit);
        self
    }

    /// The `next_cursor` of the previous page.
    pub fn cursor(mut self, cursor: impl Into<String>) -> Self {
        self.page = self.page.cursor(cursor);
        self
    }

    /// Only transfers of this account, which must be the caller's.
    pub fn account(mut self, account: impl Into<String>) -> Self {
        self.account = Some(account.into());
        self
    }

    pub fn created_after(mut self, at: DateTime<Utc>) -> Self {
        self.created_after = Some(at);
        self
    }

    pub fn created_before(mut self, at: DateTime<Utc>) -> Self {
        self.created_before = Some(at);
        self
    }

    /// Only the transfer made under this key.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    pub(crate) fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs = self.page.pairs();
        if let Some(account) = &self.account {
            pairs.push(("account", account.clone()));
        }
        if let Some(at) = self.created_after {
            pairs.push(("created_after", rfc3339(at)));
        }
        if let Some(at) = self.created_before {
            pairs.push(("created_before", rfc3339(at)));
        }
        if let Some(key) = &self.idempotency_key {
            pairs.push(("idempotency_key", key.clone()));
        }
        pairs
    }
}

/// The page of a listing that takes only `limit` and `cursor`
/// (`GET /accounts/{id}/entries`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageQuery {
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

impl PageQuery {
    /// Entries per page, 1 to 200 (the server's default is 50).
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = Some(limit);
        self
    }

    /// The `next_cursor` of the previous page.
    pub fn cursor(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }

    pub(crate) fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs = Vec::new();
        if let Some(limit) = self.limit {
            pairs.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = &self.cursor {
            pairs.push(("cursor", cursor.clone()));
        }
        pairs
    }
}

/// Microseconds, `Z`: the form the server writes, so a timestamp read from
/// an answer filters exactly.
fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// One of the caller's accounts (`GET /accounts/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    pub account_id: String,
    pub currency: String,
    /// Posted balance.
    pub balance_minor: i64,
    /// Reserved by pending holds.
    #[serde(default)]
    pub held_minor: i64,
    /// What the account may still spend: `balance_minor - held_minor`.
    #[serde(default)]
    pub available_minor: i64,
}

/// One ledger entry of an account.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub entry_id: i64,
    pub transfer_id: Uuid,
    pub direction: Direction,
    /// Negative for a debit, positive for a credit.
    pub amount_minor: i64,
    pub currency: String,
    pub balance_after_minor: i64,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Debit,
    Credit,
    #[serde(other)]
    Unknown,
}

/// A page of `GET /accounts/{id}/entries`, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntriesPage {
    pub entries: Vec<Entry>,
    /// Pass to [`PageQuery::cursor`] for the next, older page; `None` on
    /// the last page.
    pub next_cursor: Option<String>,
}

/// What became of an idempotency key (`GET /idempotency-keys/{key}`, and
/// the answer of a cancellation). Every field is present in every state;
/// those that do not apply to the state are `None`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyState {
    /// The key's content, without the quotes of the quoted spelling.
    pub idempotency_key: String,
    pub state: KeyStatus,
    /// For `Completed`: whether a retry gets the stored bytes or the answer
    /// rebuilt from the compacted record.
    #[serde(default)]
    pub answer: Option<KeyAnswer>,
    /// For `InFlight`: when to ask (or retry) again.
    #[serde(default)]
    pub retry_after_seconds: Option<u64>,
    /// For `Completed`: the status of the stored answer (201, or 422 for a
    /// refusal such as insufficient funds).
    #[serde(default)]
    pub response_status: Option<u16>,
    /// The transfer the key moved, for `Completed` and `Expired`.
    #[serde(default)]
    pub transfer_id: Option<Uuid>,
    #[serde(default)]
    pub transfer_url: Option<String>,
    #[serde(default)]
    pub completed_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub cancelled_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub expires_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub retained_until: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStatus {
    /// A request holds the key now.
    InFlight,
    /// Its answer is stored; a retry of the same request replays it.
    Completed,
    /// Released after a technical failure: the same request executes again,
    /// once.
    Failed,
    /// Past its retention; the transfer it moved, if any, is linked.
    Expired,
    /// Cancelled: no request with the key executes within its retention.
    Cancelled,
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyAnswer {
    /// The exact response bytes are kept.
    Stored,
    /// Past the TTL: rebuilt from the compact record, the same bytes for a
    /// 201 and for a refusal.
    Rebuilt,
    #[serde(other)]
    Unknown,
}

/// The body of `GET /healthz` and of a ready `GET /readyz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_without_description_leaves_the_field_out() {
        let body = serde_json::to_string(&TransferRequest::new(
            "acc_00001",
            "acc_00002",
            10_000,
            "USD",
        ))
        .unwrap_or_default();
        assert_eq!(
            body,
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":10000,"currency":"USD"}"#
        );
    }

    #[test]
    fn reads_the_server_s_transfer_and_ignores_unknown_fields() {
        let body = r#"{"transfer_id":"01a22a45-1c5e-77cc-b464-f70d8dff5602","status":"posted","from":"acc_00001","to":"acc_00002","amount_minor":10000,"currency":"USD","description":null,"created_at":"2026-11-30T02:25:02.046486Z","receipt":{"receipt_id":"rcpt_d02a75d76350467f8fdaed825def0943","debit_entry_id":5,"credit_entry_id":6,"issued_at":"2026-11-30T02:25:02.046486Z"},"later":1}"#;
        let transfer: Transfer = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(transfer.status, TransferStatus::Posted);
        assert_eq!(transfer.receipt.map(|r| r.credit_entry_id), Some(6));
        assert_eq!(transfer.hold, None);
    }

    #[test]
    fn a_hold_request_names_its_mode_and_expiry() {
        let body = serde_json::to_string(
            &TransferRequest::new("acc_00001", "acc_00002", 500, "USD").pending(Some(60)),
        )
        .unwrap_or_default();
        assert_eq!(
            body,
            r#"{"from":"acc_00001","to":"acc_00002","amount_minor":500,"currency":"USD","mode":"pending","expires_in_seconds":60}"#
        );
    }

    #[test]
    fn reads_a_pending_hold_without_a_receipt() {
        let body = r#"{"transfer_id":"01a22a45-1c5e-77cc-b464-f70d8dff5602","status":"pending","from":"acc_00001","to":"acc_00002","amount_minor":500,"currency":"USD","description":null,"created_at":"2026-11-30T02:25:02.046486Z","hold":{"amount_minor":500,"expires_at":"2026-11-30T03:25:02.046486Z","resolved_at":null},"receipt":null}"#;
        let transfer: Transfer = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(transfer.status, TransferStatus::Pending);
        assert_eq!(transfer.receipt, None);
        assert_eq!(transfer.hold.map(|h| h.amount_minor), Some(500));
    }

    #[test]
    fn an_unknown_key_state_is_not_an_error() {
        let state: KeyState = serde_json::from_str(r#"{"idempotency_key":"k","state":"archived"}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(state.state, KeyStatus::Unknown);
    }

    #[test]
    fn queries_name_only_what_is_set() {
        let at = DateTime::parse_from_rfc3339("2026-11-30T02:25:02.046486Z")
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_else(|e| panic!("{e}"));
        let pairs = TransferQuery::default()
            .limit(2)
            .created_after(at)
            .idempotency_key("k")
            .pairs();
        assert_eq!(
            pairs,
            vec![
                ("limit", "2".to_owned()),
                ("created_after", "2026-11-30T02:25:02.046486Z".to_owned()),
                ("idempotency_key", "k".to_owned()),
            ]
        );
        assert!(PageQuery::default().pairs().is_empty());
    }
}
