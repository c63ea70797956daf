//! A transfer as clients see it: its JSON, deterministic for a given row,
//! so the same transfer always renders to the same bytes (a late retry
//! whose record was purged is answered with exactly what the first request
//! got).

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;
use uuid::Uuid;

use super::intent::ROUTE;
use crate::idempotency::StoredResponse;
use crate::ledger::Transfer;
use crate::ledger::holds::{Hold, HoldStatus};
use crate::ledger::reversals::Batch;

#[derive(Serialize)]
pub struct TransferView<'a> {
    pub transfer_id: Uuid,
    pub status: &'a str,
    pub from: &'a str,
    pub to: &'a str,
    pub amount_minor: i64,
    pub currency: &'a str,
    pub description: Option<&'a str>,
    pub created_at: String,
    pub receipt: ReceiptView<'a>,
    /// The transfer this one gives (part of) back. Absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reverses: Option<Uuid>,
    /// The atomic batch it was posted in. Absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<Uuid>,
    /// How much its reversals gave back so far: only in what is read now
    /// (`GET`), never in a stored answer, which must not change. Absent
    /// while nothing was reversed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reversed_minor: Option<i64>,
}

#[derive(Serialize)]
pub struct ReceiptView<'a> {
    pub receipt_id: &'a str,
    pub debit_entry_id: i64,
    pub credit_entry_id: i64,
    pub issued_at: String,
}

/// Timestamps in responses: RFC 3339, UTC, microseconds (PostgreSQL's
/// precision), so a row always renders to the same text.
pub fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

pub fn render_transfer(transfer: &Transfer) -> Bytes {
    Bytes::from(serde_json::to_vec(&view(transfer)).unwrap_or_default())
}

/// The transfer's representation, for a response that holds several.
pub fn view(transfer: &Transfer) -> TransferView<'_> {
    let created_at = timestamp(transfer.created_at);
    TransferView {
        transfer_id: transfer.id,
        status: &transfer.status,
        from: &transfer.from_account,
        to: &transfer.to_account,
        amount_minor: transfer.amount_minor,
        currency: &transfer.currency,
        description: transfer.description.as_deref(),
        created_at: created_at.clone(),
        receipt: ReceiptView {
            receipt_id: &transfer.receipt_id,
            debit_entry_id: transfer.debit_entry_id,
            credit_entry_id: transfer.credit_entry_id,
            issued_at: created_at,
        },
        reverses: transfer.reverses,
        batch_id: transfer.batch_id,
        reversed_minor: None,
    }
}

/// The transfer as it stands now, for a read: with what its reversals gave
/// back.
pub fn current_view(transfer: &Transfer) -> TransferView<'_> {
    TransferView {
        reversed_minor: (transfer.reversed_minor > 0).then_some(transfer.reversed_minor),
        ..view(transfer)
    }
}

pub fn render_current(transfer: &Transfer) -> Bytes {
    Bytes::from(serde_json::to_vec(&current_view(transfer)).unwrap_or_default())
}

/// The 201 a posted transfer is answered with, and stored under its key.
pub fn created(transfer: &Transfer) -> StoredResponse {
    created_under(ROUTE, transfer.id, render_transfer(transfer))
}

/// A 201 whose `Location` is `{collection}/{id}`.
fn created_under(collection: &'static str, id: Uuid, body: Bytes) -> StoredResponse {
    let location = HeaderValue::from_str(&format!("{collection}/{id}"))
        .unwrap_or_else(|_| HeaderValue::from_static(collection));
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (header::LOCATION, location),
        ],
        body,
    }
}

/// A transfer that began as a hold: pending, then posted, voided or
/// expired. Rendered from the hold's row (and the transfer that posted it),
/// whose fields never change once its status is set, so an answer about a
/// hold in a given status is always the same bytes.
#[derive(Serialize)]
pub struct HoldTransferView<'a> {
    pub transfer_id: Uuid,
    pub status: &'static str,
    pub from: &'a str,
    pub to: &'a str,
    /// What moved (or will move): the posted amount once posted, the held
    /// amount before.
    pub amount_minor: i64,
    pub currency: &'a str,
    pub description: Option<&'a str>,
    pub created_at: String,
    pub hold: HoldView,
    /// The posting's receipt; null until posted.
    pub receipt: Option<ReceiptView<'a>>,
    /// As for [`TransferView::reversed_minor`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reversed_minor: Option<i64>,
}

#[derive(Serialize)]
pub struct HoldView {
    /// Reserved when the hold was made.
    pub amount_minor: i64,
    pub expires_at: String,
    /// When it was posted, voided or expired; null while pending.
    pub resolved_at: Option<String>,
}

pub fn hold_view<'a>(hold: &'a Hold, posted: Option<&'a Transfer>) -> HoldTransferView<'a> {
    HoldTransferView {
        transfer_id: hold.id,
        status: hold.status.as_str(),
        from: &hold.from_account,
        to: &hold.to_account,
        amount_minor: hold.posted_amount_minor.unwrap_or(hold.amount_minor),
        currency: &hold.currency,
        description: hold.description.as_deref(),
        created_at: timestamp(hold.created_at),
        hold: HoldView {
            amount_minor: hold.amount_minor,
            expires_at: timestamp(hold.expires_at),
            resolved_at: hold.resolved_at.map(timestamp),
        },
        receipt: posted.map(|t| ReceiptView {
            receipt_id: &t.receipt_id,
            debit_entry_id: t.debit_entry_id,
            credit_entry_id: t.credit_entry_id,
            issued_at: timestamp(t.created_at),
        }),
        reversed_minor: None,
    }
}

/// A hold-based transfer as it stands now, for a read.
pub fn hold_current_view<'a>(hold: &'a Hold, posted: Option<&'a Transfer>) -> HoldTransferView<'a> {
    HoldTransferView {
        reversed_minor: posted
            .map(|t| t.reversed_minor)
            .filter(|reversed| *reversed > 0),
        ..hold_view(hold, posted)
    }
}

pub fn render_hold_current(hold: &Hold, posted: Option<&Transfer>) -> Bytes {
    Bytes::from(serde_json::to_vec(&hold_current_view(hold, posted)).unwrap_or_default())
}

/// The route of atomic batches, for their `Location`.
pub const BATCH_ROUTE: &str = "/transfer-batches";

#[derive(Serialize)]
pub struct BatchView<'a> {
    pub batch_id: Uuid,
    pub created_at: String,
    /// Every leg, in the order asked; all posted in one commit.
    pub transfers: Vec<TransferView<'a>>,
}

pub fn render_batch(batch: &Batch, legs: &[Transfer]) -> Bytes {
    let view = BatchView {
        batch_id: batch.id,
        created_at: timestamp(batch.created_at),
        transfers: legs.iter().map(view).collect(),
    };
    Bytes::from(serde_json::to_vec(&view).unwrap_or_default())
}

/// The 201 a batch is answered with; its legs never change, so the same
/// bytes on every retry.
pub fn batch_created(batch: &Batch, legs: &[Transfer]) -> StoredResponse {
    created_under(BATCH_ROUTE, batch.id, render_batch(batch, legs))
}

pub fn render_hold(hold: &Hold, posted: Option<&Transfer>) -> Bytes {
    Bytes::from(serde_json::to_vec(&hold_view(hold, posted)).unwrap_or_default())
}

/// The 201 a hold is created with: as it was created (pending), whatever
/// became of it since, so a late retry gets the same bytes.
pub fn hold_created(hold: &Hold) -> StoredResponse {
    let as_created = Hold {
        status: HoldStatus::Pending,
        resolved_at: None,
        posted_amount_minor: None,
        ..hold.clone()
    };
    created_under(ROUTE, hold.id, render_hold(&as_created, None))
}

/// The 200 a hold's post or void is answered with: the transfer as it
/// now stands.
pub fn hold_resolved(hold: &Hold, posted: Option<&Transfer>) -> StoredResponse {
    StoredResponse {
        status: StatusCode::OK,
        headers: vec![(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body: render_hold(hold, posted),
    }
}
