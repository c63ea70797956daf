//! `POST /transfers` and `GET /transfers/{transfer_id}`.

use std::sync::Mutex;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use tracing::Instrument;
use uuid::Uuid;

use super::AppState;
use super::batch::Posting as _;
use super::error::{ApiError, ValidationKind};
use super::extract::{PathParam, Principal, StrictJson};
use crate::idempotency::{
    self, ClaimOutcome, Completion, ExecuteError, Fingerprint, IdempotencyKey, Operation,
    OperationError, Scope, StoredResponse,
};
use crate::ledger::{
    self, AccountId, AmountMinor, Currency, Description, LedgerError, PostingOutcome,
    PostingRequest, Transfer,
};
use crate::telemetry;

/// The route template that enters the fingerprint.
pub const ROUTE: &str = "/transfers";

pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

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
}

/// A transfer request that passed every check that does not need a lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferIntent {
    pub from: AccountId,
    pub to: AccountId,
    pub amount: AmountMinor,
    pub currency: Currency,
    pub description: Option<Description>,
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
}

impl TransferIntent {
    /// Parses and validates a body without touching the database.
    pub fn parse(body: &TransferBody) -> Result<Self, ApiError> {
        let account = |field: &str, value: &str| {
            AccountId::parse(value).map_err(|e| {
                ApiError::validation(ValidationKind::InvalidAccountId, format!("{field}: {e}"))
            })
        };
        let from = account("from", &body.from)?;
        let to = account("to", &body.to)?;
        let amount = AmountMinor::parse(body.amount_minor)
            .map_err(|e| ApiError::validation(ValidationKind::InvalidAmount, e.to_string()))?;
        let currency = Currency::parse(&body.currency).map_err(|e| {
            ApiError::validation(ValidationKind::UnsupportedCurrency, e.to_string())
        })?;
        if from == to {
            return Err(ApiError::validation(
                ValidationKind::SameAccount,
                "from and to must be different accounts",
            ));
        }
        let description = body
            .description
            .as_deref()
            .map(Description::parse)
            .transpose()
            .map_err(|e| ApiError::validation(ValidationKind::InvalidDescription, e.to_string()))?;
        Ok(Self {
            from,
            to,
            amount,
            currency,
            description,
        })
    }

    pub fn canonical_bytes(&self) -> Vec<u8> {
        let canonical = CanonicalTransfer {
            from: self.from.as_str(),
            to: self.to.as_str(),
            amount_minor: self.amount.get(),
            currency: self.currency.as_str(),
            description: self.description.as_ref().map(Description::as_str),
        };
        // Serialising strings and an integer into a Vec cannot fail.
        serde_json::to_vec(&canonical).unwrap_or_default()
    }

    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::compute("POST", ROUTE, &self.canonical_bytes())
    }
}

/// Records its fields on the request's span (`principal_id` from the
/// extractor, `idempotency_outcome`, `transfer_id`), so the one line logged
/// per request carries them all.
pub async fn create(
    State(state): State<AppState>,
    principal: Principal,
    key: IdempotencyKey,
    StrictJson(body): StrictJson<TransferBody>,
) -> Result<Response, ApiError> {
    let intent = TransferIntent::parse(&body).inspect_err(count_rejection)?;
    check_against_accounts(&state, principal, &intent)
        .await
        .inspect_err(count_rejection)?;
    let span = tracing::Span::current();
    let operation = TransferOperation::new(principal.id, key, intent);
    // An intent completed lately is replayed from memory: no round trip.
    if let Some(stored) =
        state
            .caches
            .replay(principal.id, operation.key.as_str(), &operation.fingerprint)
    {
        record_outcome(&span, "replayed");
        return Ok(stored_response(stored, true));
    }
    // The claim and the work it starts run in a task of their own. If the
    // client hangs up, hyper drops this handler's future; were the claim
    // awaited here, a claim committed just before that would be left
    // IN_PROGRESS and block its key for a whole lease (the hang-up test in
    // tests/lost_response.rs saw 2 to 4 in 20). The task always finishes:
    // it completes the key, or marks it FAILED.
    let task = tokio::spawn(claim_and_execute(state.clone(), operation).in_current_span());
    let handled = match task.await {
        Ok(handled) => handled?,
        Err(join_error) => {
            record_outcome(&span, "failed");
            tracing::error!(error = %join_error, "transfer task did not finish");
            return Err(ApiError::Internal);
        }
    };
    let (took_over, result) = match handled {
        Handled::Replay(stored) => {
            record_outcome(&span, "replayed");
            return Ok(stored_response(stored, true));
        }
        Handled::Mismatch => {
            record_outcome(&span, "mismatch");
            return Err(ApiError::IdempotencyKeyReused);
        }
        Handled::InFlight => {
            record_outcome(&span, "in_flight");
            return Err(ApiError::RequestInFlight {
                retry_after_secs: IN_FLIGHT_RETRY_AFTER_SECS,
            });
        }
        Handled::Executed { took_over, result } => (took_over, result),
    };
    record_outcome(&span, if took_over { "taken_over" } else { "claimed" });
    match result {
        Ok(completion) => {
            if let Some(id) = completion.transfer_id {
                span.record("transfer_id", tracing::field::display(id));
            }
            #[cfg(feature = "failpoints")]
            fail::fail_point!("transfer::before_response");
            Ok(stored_response(completion.response, false))
        }
        Err(ExecuteError::FenceLost) => {
            record_outcome(&span, "fence_lost");
            Err(ApiError::RequestInFlight {
                retry_after_secs: IN_FLIGHT_RETRY_AFTER_SECS,
            })
        }
        Err(ExecuteError::Database(e)) => {
            record_outcome(&span, "failed");
            Err(ApiError::from(e))
        }
        Err(ExecuteError::Invariant(message)) => {
            record_outcome(&span, "failed");
            tracing::error!(%message, "transfer broke an invariant");
            Err(ApiError::Internal)
        }
    }
}

/// What the claim decided, and the execution's result when it claimed.
enum Handled {
    Replay(StoredResponse),
    Mismatch,
    InFlight,
    Executed {
        took_over: bool,
        result: Result<Completion, ExecuteError>,
    },
}

async fn claim_and_execute(
    state: AppState,
    operation: TransferOperation,
) -> Result<Handled, sqlx::Error> {
    let outcome = idempotency::store::claim(
        &state.claim_pool,
        state.config.idempotency,
        Scope(operation.principal_id),
        &operation.key,
        "POST",
        ROUTE,
        &operation.fingerprint,
    )
    .await?;
    let claim = match outcome {
        ClaimOutcome::Replay(stored) => {
            state.caches.remember_completed(
                operation.principal_id,
                operation.key.as_str(),
                &operation.fingerprint,
                &stored,
            );
            return Ok(Handled::Replay(stored));
        }
        ClaimOutcome::Mismatch => return Ok(Handled::Mismatch),
        ClaimOutcome::InFlight { .. } => return Ok(Handled::InFlight),
        ClaimOutcome::Claimed(claim) => claim,
    };
    #[cfg(feature = "failpoints")]
    fail::fail_point!("transfer::after_claim");
    let (principal_id, key, fingerprint) = (
        operation.principal_id,
        operation.key.clone(),
        operation.fingerprint,
    );
    let from = operation.intent.from.clone();
    // The posting is batched with other waiting transfers (see `batch`) and
    // runs in a task of its own: a panic there drops this job's reply, so it
    // is caught here, its transaction rolls back with the dropped
    // connection, and the key is marked FAILED so the retry need not wait
    // out the lease.
    let result = match state
        .postings
        .submit(&state.pool, from.as_str(), claim.clone(), operation)
        .await
    {
        Ok(result) => result,
        Err(_) => {
            if let Err(e) = idempotency::store::mark_failed(&state.pool, &claim).await {
                // The lease still frees the key.
                tracing::error!(error = %e, "could not mark the claim FAILED");
            }
            Err(ExecuteError::Invariant(
                "the posting did not finish".to_owned(),
            ))
        }
    };
    if let Ok(completion) = &result {
        // Committed as COMPLETED: from now on a retry is a replay.
        state.caches.remember_completed(
            principal_id,
            key.as_str(),
            &fingerprint,
            &completion.response,
        );
    }
    Ok(Handled::Executed {
        took_over: claim.took_over,
        result,
    })
}

/// The idempotency outcome, on the request span and in the metrics.
fn record_outcome(span: &tracing::Span, outcome: &'static str) {
    span.record("idempotency_outcome", outcome);
    telemetry::idempotency_outcome(outcome);
}

/// A request refused before its key was claimed; server errors are not
/// rejections.
fn count_rejection(error: &ApiError) {
    if error.status().is_client_error() {
        telemetry::transfer_rejected(error.slug());
    }
}

/// What a 409 tells the client to wait: a posting takes milliseconds, so one
/// second is enough for the first request to finish in the normal case.
pub const IN_FLIGHT_RETRY_AFTER_SECS: u64 = 1;

/// Checks that need the database but no lock, before the key is claimed, so
/// a rejected request never touches `idempotency_keys` and its key stays free.
/// Owner and currency of an account never change, so they still hold when
/// the posting transaction runs.
async fn check_against_accounts(
    state: &AppState,
    principal: Principal,
    intent: &TransferIntent,
) -> Result<(), ApiError> {
    if !state.currencies.contains(intent.currency.as_str()) {
        return Err(ApiError::validation(
            ValidationKind::UnsupportedCurrency,
            format!("{} is not a supported currency", intent.currency),
        ));
    }
    let (from_id, to_id) = (intent.from.as_str(), intent.to.as_str());
    let (mut from, mut to) = (state.caches.account(from_id), state.caches.account(to_id));
    // Only what memory does not hold is read, in one query.
    let missing: Vec<&str> = [(from_id, &from), (to_id, &to)]
        .into_iter()
        .filter_map(|(id, known)| known.is_none().then_some(id))
        .collect();
    if !missing.is_empty() {
        for account in ledger::repo::get_accounts(&state.pool, &missing).await? {
            state.caches.remember_account(&account);
            if account.id == from_id {
                from = Some((&account).into());
            } else if account.id == to_id {
                to = Some((&account).into());
            }
        }
    }
    let from = from
        .filter(|a| a.principal_id == Some(principal.id))
        // Someone else's account is indistinguishable from no account (BOLA).
        .ok_or(ApiError::NotFound)?;
    let to = to.ok_or_else(|| {
        ApiError::validation(
            ValidationKind::UnknownDestination,
            format!("destination account {} does not exist", intent.to),
        )
    })?;
    for (id, account) in [(from_id, from), (to_id, to)] {
        if account.currency != intent.currency.as_str() {
            return Err(ApiError::validation(
                ValidationKind::CurrencyMismatch,
                format!(
                    "account {id} holds {}, not {}",
                    account.currency, intent.currency
                ),
            ));
        }
    }
    Ok(())
}

/// One transfer intent, executed once under its claimed key.
pub struct TransferOperation {
    principal_id: Uuid,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    intent: TransferIntent,
    /// What the latest attempt decided, counted once its transaction
    /// committed (a rolled-back attempt moved nothing). A std Mutex: it is
    /// never held across an await.
    decision: Mutex<Option<Decision>>,
}

#[derive(Debug, Clone, Copy)]
enum Decision {
    Posted,
    /// A late retry found its transfer: nothing new moved.
    AlreadyPosted,
    Rejected(&'static str),
}

impl TransferOperation {
    fn decide(&self, decision: Decision) {
        match self.decision.lock() {
            Ok(mut guard) => *guard = Some(decision),
            Err(poisoned) => *poisoned.into_inner() = Some(decision),
        }
    }

    pub fn new(principal_id: Uuid, key: IdempotencyKey, intent: TransferIntent) -> Self {
        Self {
            principal_id,
            fingerprint: intent.fingerprint(),
            key,
            intent,
            decision: Mutex::new(None),
        }
    }
}

impl super::batch::Posting for TransferOperation {
    fn request(&self) -> PostingRequest<'_> {
        PostingRequest {
            principal_id: Some(self.principal_id),
            idempotency_key: self.key.as_str(),
            fingerprint: self.fingerprint.as_bytes(),
            from: self.intent.from.as_str(),
            to: self.intent.to.as_str(),
            amount: self.intent.amount,
            currency: &self.intent.currency,
            description: self.intent.description.as_ref(),
        }
    }

    /// The answer to store for a posting's outcome.
    fn completion(
        &self,
        outcome: Result<PostingOutcome, LedgerError>,
    ) -> Result<Completion, OperationError> {
        let outcome = outcome.map_err(|e| match e {
            LedgerError::Database(e) => OperationError::Database(e),
            other => OperationError::Invariant(other.to_string()),
        })?;
        Ok(match outcome {
            PostingOutcome::Posted(transfer) => {
                self.decide(Decision::Posted);
                created(&transfer)
            }
            // The record of this key was purged and the client retried late:
            // the transfer renders to the same bytes it was first answered with.
            PostingOutcome::AlreadyPosted(transfer)
                if transfer.request_fingerprint.as_slice() == self.fingerprint.as_bytes() =>
            {
                self.decide(Decision::AlreadyPosted);
                let mut completion = created(&transfer);
                completion
                    .response
                    .headers
                    .push((IDEMPOTENT_REPLAYED.to_owned(), "true".to_owned()));
                completion
            }
            PostingOutcome::AlreadyPosted(_) => rejected(self, ApiError::IdempotencyKeyReused),
            PostingOutcome::InsufficientFunds => rejected(self, ApiError::InsufficientFunds),
        })
    }
}

impl Operation for TransferOperation {
    async fn execute(&self, conn: &mut PgConnection) -> Result<Completion, OperationError> {
        let outcome = ledger::repo::post_transfer(conn, &self.request()).await;
        self.completion(outcome)
    }

    fn committed(&self) {
        let decision = match self.decision.lock() {
            Ok(guard) => *guard,
            Err(poisoned) => *poisoned.into_inner(),
        };
        match decision {
            Some(Decision::Posted) => telemetry::transfer_posted(),
            Some(Decision::Rejected(reason)) => telemetry::transfer_rejected(reason),
            Some(Decision::AlreadyPosted) | None => {}
        }
    }
}

/// A business rejection, stored and replayed like a success.
fn rejected(operation: &TransferOperation, error: ApiError) -> Completion {
    operation.decide(Decision::Rejected(error.slug()));
    Completion {
        response: error.to_stored(),
        transfer_id: None,
    }
}

fn created(transfer: &Transfer) -> Completion {
    Completion {
        response: StoredResponse {
            status: StatusCode::CREATED.as_u16(),
            headers: vec![
                (
                    header::CONTENT_TYPE.as_str().to_owned(),
                    "application/json".to_owned(),
                ),
                (
                    header::LOCATION.as_str().to_owned(),
                    format!("{ROUTE}/{}", transfer.id),
                ),
            ],
            body: render_transfer(transfer),
        },
        transfer_id: Some(transfer.id),
    }
}

/// The JSON representation of a transfer, deterministic for a given row:
/// the same transfer always renders to the same bytes.
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
}

#[derive(Serialize)]
pub struct ReceiptView<'a> {
    pub receipt_id: &'a str,
    pub debit_entry_id: i64,
    pub credit_entry_id: i64,
    pub issued_at: String,
}

pub fn render_transfer(transfer: &Transfer) -> Bytes {
    let created_at = super::timestamp(transfer.created_at);
    let view = TransferView {
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
    };
    Bytes::from(serde_json::to_vec(&view).unwrap_or_default())
}

/// A stored response as sent: its status, its stored headers and its exact
/// bytes, plus `Idempotent-Replayed: true` on a replay.
pub fn stored_response(stored: StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, stored.body).into_response();
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.insert(name, value);
        }
    }
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

#[tracing::instrument(skip_all, fields(principal_id = %principal.id))]
pub async fn get(
    State(state): State<AppState>,
    principal: Principal,
    PathParam(transfer_id): PathParam,
) -> Result<Response, ApiError> {
    let id = Uuid::parse_str(&transfer_id).map_err(|_| ApiError::NotFound)?;
    let transfer = ledger::repo::get_transfer(&state.pool, id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let accounts = ledger::repo::get_accounts(
        &state.pool,
        &[transfer.from_account.as_str(), transfer.to_account.as_str()],
    )
    .await?;
    if !accounts
        .iter()
        .any(|a| a.principal_id == Some(principal.id))
    {
        return Err(ApiError::NotFound);
    }
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        render_transfer(&transfer),
    )
        .into_response())
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
