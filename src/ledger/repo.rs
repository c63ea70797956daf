//! All SQL on accounts, transfers and ledger entries.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::events::EventType;
use super::plan::{self, Plan, Planned};
use super::{AmountMinor, Currency, Description, LedgerError, PlanMismatch};
use crate::principal::PrincipalId;

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Account {
    pub id: String,
    pub principal_id: Option<PrincipalId>,
    pub currency: String,
    pub balance_minor: i64,
    /// The sum of the account's pending holds: reserved, not yet moved.
    pub held_minor: i64,
    pub allow_negative: bool,
    /// How many events changed this account: the sequence number of its
    /// latest (`events.from_seq` / `to_seq`).
    pub event_seq: i64,
}

impl Account {
    /// What the account may still spend: its balance less what its
    /// pending holds reserve.
    pub fn available_minor(&self) -> i64 {
        self.balance_minor.saturating_sub(self.held_minor)
    }
}

/// A posted transfer with the two entries that moved its money.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Transfer {
    pub id: Uuid,
    pub principal_id: Option<PrincipalId>,
    pub idempotency_key: String,
    pub request_fingerprint: Vec<u8>,
    pub from_account: String,
    pub to_account: String,
    pub currency: String,
    pub amount_minor: i64,
    pub description: Option<String>,
    pub status: String,
    pub receipt_id: String,
    pub created_at: DateTime<Utc>,
    pub debit_entry_id: i64,
    pub credit_entry_id: i64,
    /// The transfer this one reverses.
    pub reverses: Option<Uuid>,
    /// How much of this transfer its reversals gave back.
    pub reversed_minor: i64,
    /// The atomic batch it was posted in.
    pub batch_id: Option<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Entry {
    pub id: i64,
    pub transfer_id: Uuid,
    pub account_id: String,
    pub currency: String,
    pub amount_minor: i64,
    pub balance_after_minor: i64,
    pub created_at: DateTime<Utc>,
}

/// One movement of money, as the caller asks for it.
#[derive(Debug, Clone)]
pub struct PostingRequest<'a> {
    /// Who asked; `None` for an operator's deposit.
    pub principal_id: Option<PrincipalId>,
    /// The intent's key: unique per principal for ever, so a very late
    /// retry finds the transfer instead of posting a second one.
    pub idempotency_key: &'a str,
    pub fingerprint: &'a [u8; 32],
    pub from: &'a str,
    pub to: &'a str,
    pub amount: AmountMinor,
    pub currency: &'a Currency,
    pub description: Option<&'a Description>,
    /// What the posting is beyond the money it moves.
    pub kind: PostingKind,
}

/// What a posting is beyond the money it moves: the event it announces and
/// the links its row carries, both written by the statement that posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostingKind {
    /// An ordinary transfer, or an operator's deposit: `transfer.posted`.
    Transfer,
    /// Leg `leg` (from 0) of an atomic batch: `transfer.posted`, with its
    /// batch.
    BatchLeg { batch_id: Uuid, leg: i16 },
    /// Gives (part of) `original` back: `transfer.reversed`.
    Reversal { original: Uuid },
    /// Posts a hold, under the hold's id. The event (`hold.posted`) shows
    /// the hold, so the hold's resolution writes it, with the account
    /// sequences this posting took.
    HoldPost { hold_id: Uuid },
}

impl PostingKind {
    /// The id the transfer is posted under, when it is not a fresh one.
    pub fn transfer_id(self) -> Option<Uuid> {
        match self {
            Self::HoldPost { hold_id } => Some(hold_id),
            _ => None,
        }
    }

    /// The event the posting statement writes for it.
    fn event(self) -> Option<EventType> {
        match self {
            Self::Transfer | Self::BatchLeg { .. } => Some(EventType::TransferPosted),
            Self::Reversal { .. } => Some(EventType::TransferReversed),
            Self::HoldPost { .. } => None,
        }
    }

    fn reverses(self) -> Option<Uuid> {
        match self {
            Self::Reversal { original } => Some(original),
            _ => None,
        }
    }

    fn batch(self) -> (Option<Uuid>, Option<i16>) {
        match self {
            Self::BatchLeg { batch_id, leg } => (Some(batch_id), Some(leg)),
            _ => (None, None),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostingOutcome {
    Posted(Transfer),
    /// A transfer with this principal and key already exists (its
    /// idempotency record was purged, or it is an operator's repeated
    /// deposit): nothing was posted.
    AlreadyPosted(Transfer),
    /// The source balance cannot cover the amount: nothing was posted.
    InsufficientFunds,
}

/// What a posting means for the intent that asked for it. The one place
/// that decides what a late retry gets: a key that already has its
/// transfer answers with that transfer when the request is the same
/// intent (the same fingerprint), and is refused for any other request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Posted now.
    Posted(Transfer),
    /// Posted earlier under this key by this same intent: nothing moved now.
    Replayed(Transfer),
    /// Posted earlier under this key by another intent: nothing moved, the
    /// request is refused, and the key stays the other intent's.
    KeyUsedByOther(Transfer),
    InsufficientFunds,
}

impl PostingOutcome {
    pub fn settle(self, fingerprint: &[u8; 32]) -> Settled {
        match self {
            Self::Posted(t) => Settled::Posted(t),
            Self::AlreadyPosted(t) if t.request_fingerprint.as_slice() == fingerprint => {
                Settled::Replayed(t)
            }
            Self::AlreadyPosted(t) => Settled::KeyUsedByOther(t),
            Self::InsufficientFunds => Settled::InsufficientFunds,
        }
    }
}

/// How a posting transaction takes its accounts' row locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// Never wait: rows locked by someone else are left out of the answer
    /// (`SKIP LOCKED`), and the caller posts what it could lock.
    SkipLocked,
    /// Wait for the locks, as long as the session's `lock_timeout` allows.
    Wait,
}

/// Whether to look the requests' keys up before planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyLookup {
    /// Plan straight away; a key that turns out to have its transfer makes
    /// the batch fail with [`LedgerError::KeyAlreadyUsed`]. One round trip
    /// fewer, for the common case where no key was used before.
    Optimistic,
    /// Find the transfers the keys already have first (one statement), and
    /// answer those requests with them instead of planning them.
    First,
}

/// A transfer with its debit and credit entry ids; a literal so that the
/// queries built on it stay static SQL.
macro_rules! select_transfer {
    () => {
        "SELECT t.id, t.principal_id, t.idempotency_key, t.request_fingerprint, t.from_account, t.to_account,
                t.currency, t.amount_minor, t.description, t.status, t.receipt_id, t.created_at,
                d.id AS debit_entry_id, c.id AS credit_entry_id, t.reverses, t.reversed_minor,
                t.batch_id
         FROM transfers t
         JOIN ledger_entries d ON d.transfer_id = t.id AND d.account_id = t.from_account
         JOIN ledger_entries c ON c.transfer_id = t.id AND c.account_id = t.to_account"
    };
}

/// Posts one transfer inside the caller's transaction: locks both accounts
/// in id order (so opposite transfers cannot deadlock, and so the foreign-key
/// checks of the inserts find the rows already locked instead of queueing
/// shared locks behind the balance update), checks the funds under the lock,
/// then writes the transfer, its two entries and both balances.
#[tracing::instrument(skip_all, fields(from = request.from, to = request.to, amount = request.amount.get()))]
pub async fn post_transfer(
    conn: &mut PgConnection,
    request: &PostingRequest<'_>,
) -> Result<PostingOutcome, LedgerError> {
    let mut accounts =
        lock_accounts(&mut *conn, &[request.from, request.to], LockMode::Wait).await?;
    let mut outcomes = post_locked(
        conn,
        std::slice::from_ref(request),
        &mut accounts,
        KeyLookup::First,
    )
    .await?;
    outcomes
        .pop()
        .ok_or(LedgerError::PlanMismatch(PlanMismatch::TransfersWritten {
            written: 0,
            planned: 1,
        }))
}

/// What one statement wrote for a transfer.
#[derive(sqlx::FromRow)]
struct Written {
    id: Uuid,
    created_at: DateTime<Utc>,
    status: String,
    debit_entry_id: Option<i64>,
    credit_entry_id: Option<i64>,
    accounts_moved: i64,
    events_written: i64,
}

/// Posts transfers whose accounts the caller's transaction has already
/// locked (a batch locks all of its accounts at once), in order, as if one
/// by one: each checks its funds against the balances the earlier ones
/// left. `accounts` holds the locked accounts with their current balances
/// and is kept current.
///
/// Everything is decided here, under the locks, and then written by one
/// statement whatever the number of transfers: one round trip for a batch
/// instead of one per transfer, which is what bounds throughput on a small,
/// CPU-bound database machine and how fast a hot account's queue drains.
/// The statement writes the transfers, their entries (each with the balance
/// its account was left with) and the balances, and checks that every
/// balance it moved ends where the plan said.
///
/// A request whose principal and key already have a transfer (its record
/// was purged and the client retried late, or an operator repeated a
/// deposit) is answered `AlreadyPosted` with that transfer: found first
/// with [`KeyLookup::First`], or else reported as
/// [`LedgerError::KeyAlreadyUsed`] so the caller rolls back and asks again.
pub async fn post_locked(
    conn: &mut PgConnection,
    requests: &[PostingRequest<'_>],
    accounts: &mut [Account],
    lookup: KeyLookup,
) -> Result<Vec<PostingOutcome>, LedgerError> {
    let mut existing = match lookup {
        KeyLookup::First => find_by_keys(&mut *conn, requests).await?,
        KeyLookup::Optimistic => HashMap::new(),
    };
    let fresh: Vec<PostingRequest<'_>> = requests
        .iter()
        .filter(|r| !existing.contains_key(&(r.principal_id, r.idempotency_key.to_owned())))
        .cloned()
        .collect();
    // Planned on a copy: `accounts` changes only once the plan is written.
    let mut closing = accounts.to_vec();
    let plans = plan::plan(&fresh, &mut closing)?;
    let posted: Vec<(&PostingRequest<'_>, &Planned)> = fresh
        .iter()
        .zip(&plans)
        .filter_map(|(request, plan)| match plan {
            Plan::Post(planned) => Some((request, planned)),
            Plan::InsufficientFunds => None,
        })
        .collect();
    let mut written = if posted.is_empty() {
        HashMap::new()
    } else {
        let written = write_planned(&mut *conn, &posted, accounts, &closing).await?;
        check_written(
            &written,
            posted.len(),
            plan::moved_accounts(accounts, &closing).count(),
            posted
                .iter()
                .filter(|(r, _)| r.kind.event().is_some())
                .count(),
        )?;
        written.into_iter().map(|w| (w.id, w)).collect()
    };

    let mut fresh_outcomes = Vec::with_capacity(fresh.len());
    let mut last_entry_id = 0;
    for (request, plan) in fresh.iter().zip(plans) {
        let outcome = match plan {
            Plan::Post(planned) => {
                let row = written.remove(&planned.id);
                let transfer = written_transfer(request, planned, row, last_entry_id)?;
                last_entry_id = transfer.credit_entry_id;
                PostingOutcome::Posted(transfer)
            }
            // A late retry of an intent that already moved the money must
            // find its transfer, not a rejection caused by that same debit.
            Plan::InsufficientFunds => match lookup {
                KeyLookup::First => PostingOutcome::InsufficientFunds,
                KeyLookup::Optimistic => {
                    match find_by_key(&mut *conn, request.principal_id, request.idempotency_key)
                        .await?
                    {
                        Some(found) => PostingOutcome::AlreadyPosted(found),
                        None => PostingOutcome::InsufficientFunds,
                    }
                }
            },
        };
        fresh_outcomes.push(outcome);
    }
    accounts.clone_from_slice(&closing);
    let mut fresh_outcomes = fresh_outcomes.into_iter();
    Ok(requests
        .iter()
        .filter_map(
            |r| match existing.remove(&(r.principal_id, r.idempotency_key.to_owned())) {
                Some(found) => Some(PostingOutcome::AlreadyPosted(found)),
                None => fresh_outcomes.next(),
            },
        )
        .collect())
}

/// The statement inserts every transfer or writes nothing else: fewer rows
/// back means some key already had its transfer.
fn check_written(
    written: &[Written],
    planned: usize,
    accounts_planned: usize,
    events_planned: usize,
) -> Result<(), LedgerError> {
    if written.len() < planned {
        return Err(LedgerError::KeyAlreadyUsed);
    }
    if written.len() != planned {
        return Err(PlanMismatch::TransfersWritten {
            written: written.len(),
            planned,
        }
        .into());
    }
    if let Some(w) = written
        .iter()
        .find(|w| usize::try_from(w.accounts_moved).ok() != Some(accounts_planned))
    {
        return Err(PlanMismatch::AccountsMoved {
            moved: usize::try_from(w.accounts_moved).unwrap_or(usize::MAX),
            planned: accounts_planned,
        }
        .into());
    }
    if let Some(w) = written
        .iter()
        .find(|w| usize::try_from(w.events_written).ok() != Some(events_planned))
    {
        return Err(PlanMismatch::EventsWritten {
            written: usize::try_from(w.events_written).unwrap_or(usize::MAX),
            planned: events_planned,
        }
        .into());
    }
    Ok(())
}

/// The row as written, built from what was sent and what came back instead
/// of read again. Entry ids rise in plan order, debit before credit: what
/// the statement asks for, checked rather than assumed.
fn written_transfer(
    request: &PostingRequest<'_>,
    planned: Planned,
    written: Option<Written>,
    last_entry_id: i64,
) -> Result<Transfer, LedgerError> {
    let Some(Written {
        created_at,
        status,
        debit_entry_id: Some(debit_entry_id),
        credit_entry_id: Some(credit_entry_id),
        ..
    }) = written
    else {
        return Err(PlanMismatch::MissingEntries(planned.id).into());
    };
    if !(last_entry_id < debit_entry_id && debit_entry_id < credit_entry_id) {
        return Err(PlanMismatch::EntryOrder(planned.id).into());
    }
    Ok(Transfer {
        id: planned.id,
        principal_id: request.principal_id,
        idempotency_key: request.idempotency_key.to_owned(),
        request_fingerprint: request.fingerprint.to_vec(),
        from_account: request.from.to_owned(),
        to_account: request.to.to_owned(),
        currency: request.currency.as_str().to_owned(),
        amount_minor: request.amount.get(),
        description: request.description.map(|d| d.as_str().to_owned()),
        status,
        receipt_id: planned.receipt_id,
        created_at,
        debit_entry_id,
        credit_entry_id,
        reverses: request.kind.reverses(),
        reversed_minor: 0,
        batch_id: request.kind.batch().0,
    })
}

/// The one statement that writes planned transfers: the transfer rows, then
/// (only if every one of them was inserted) their entries, debit before
/// credit in plan order, each account they touched set to its planned
/// closing balance and event sequence (only where it still holds the
/// opening ones read under the lock), and each transfer's event, in plan
/// order, rendered from the rows just written (the entry ids and the time
/// exist only here). The accounts are locked, so the foreign-key checks at
/// the end of the statement find rows this transaction holds. Returns one
/// row per inserted transfer.
async fn write_planned(
    conn: &mut PgConnection,
    posted: &[(&PostingRequest<'_>, &Planned)],
    opening: &[Account],
    closing: &[Account],
) -> Result<Vec<Written>, sqlx::Error> {
    let owner = |id: &str| {
        opening
            .iter()
            .find(|a| a.id == id)
            .and_then(|a| a.principal_id)
    };
    let mut t = TransferColumns::default();
    for (request, planned) in posted {
        t.ids.push(planned.id);
        t.principals.push(request.principal_id);
        t.keys.push(request.idempotency_key);
        t.fingerprints.push(request.fingerprint.as_slice());
        t.froms.push(request.from);
        t.tos.push(request.to);
        t.currencies.push(request.currency.as_str());
        t.amounts.push(request.amount.get());
        t.descriptions
            .push(request.description.map(Description::as_str));
        t.receipts.push(planned.receipt_id.as_str());
        t.reverses.push(request.kind.reverses());
        let (batch_id, batch_leg) = request.kind.batch();
        t.batch_ids.push(batch_id);
        t.batch_legs.push(batch_leg);
        t.event_types
            .push(request.kind.event().map(EventType::as_str));
        t.from_owners.push(owner(request.from));
        t.to_owners.push(owner(request.to));
        t.from_seqs.push(planned.from_seq);
        t.to_seqs.push(planned.to_seq);
    }
    let mut e = EntryColumns::default();
    for (entry, currency) in plan::entries(posted)
        .into_iter()
        .zip(posted.iter().flat_map(|(r, _)| [r.currency.as_str(); 2]))
    {
        e.transfers.push(entry.transfer_id);
        e.accounts.push(entry.account_id);
        e.currencies.push(currency);
        e.amounts.push(entry.amount_minor);
        e.balances_after.push(entry.balance_after_minor);
    }
    let mut m = MovedColumns::default();
    for (before, after) in plan::moved_accounts(opening, closing) {
        m.ids.push(after.id.as_str());
        m.openings.push(before.balance_minor);
        m.closings.push(after.balance_minor);
        m.opening_seqs.push(before.event_seq);
        m.closing_seqs.push(after.event_seq);
    }
    let planned = i64::try_from(t.ids.len()).unwrap_or(i64::MAX);
    sqlx::query_as(
        "WITH transfer AS (
             INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint,
                                    from_account, to_account, currency, amount_minor, description, receipt_id,
                                    reverses, batch_id, batch_leg)
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::bytea[], $5::text[],
                                  $6::text[], $7::text[], $8::int8[], $9::text[], $10::text[],
                                  $20::uuid[], $21::uuid[], $22::int2[])
             ON CONFLICT (principal_id, idempotency_key) DO NOTHING
             RETURNING id, created_at, status, from_account, to_account, currency, amount_minor,
                       description, receipt_id, reverses, batch_id
         ), complete AS (
             SELECT count(*) = $11 AS all_inserted FROM transfer
         ), moved AS (
             UPDATE accounts a SET balance_minor = m.closing, event_seq = m.closing_seq
             FROM unnest($12::text[], $13::int8[], $14::int8[], $23::int8[], $24::int8[])
                  AS m(id, opening, closing, opening_seq, closing_seq),
                  complete
             WHERE complete.all_inserted AND a.id = m.id
               AND a.balance_minor = m.opening AND a.event_seq = m.opening_seq
             RETURNING a.id
         ), entries AS (
             INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor)
             SELECT e.transfer_id, e.account_id, e.currency, e.amount_minor, e.balance_after
             FROM unnest($15::uuid[], $16::text[], $17::text[], $18::int8[], $19::int8[])
                  WITH ORDINALITY AS e(transfer_id, account_id, currency, amount_minor, balance_after, n),
                  complete
             WHERE complete.all_inserted
             ORDER BY e.n
             RETURNING id, transfer_id, amount_minor
         ), announced AS (
             INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                                 from_principal, to_principal, from_seq, to_seq)
             SELECT v.type, t.id,
                    transfer_resource(t.id, t.status, t.from_account, t.to_account, t.amount_minor,
                                      t.currency, t.description, t.created_at,
                                      receipt_resource(t.receipt_id, d.id, c.id, t.created_at),
                                      t.reverses, t.batch_id),
                    t.created_at, t.from_account, t.to_account,
                    v.from_principal, v.to_principal, v.from_seq, v.to_seq
             FROM unnest($1::uuid[], $25::text[], $26::uuid[], $27::uuid[], $28::int8[], $29::int8[])
                  WITH ORDINALITY AS v(id, type, from_principal, to_principal, from_seq, to_seq, n)
             JOIN transfer t ON t.id = v.id
             JOIN entries d ON d.transfer_id = v.id AND d.amount_minor < 0
             JOIN entries c ON c.transfer_id = v.id AND c.amount_minor > 0
             WHERE v.type IS NOT NULL
             ORDER BY v.n
             RETURNING 1
         )
         SELECT t.id, t.created_at, t.status,
                (SELECT e.id FROM entries e WHERE e.transfer_id = t.id AND e.amount_minor < 0) AS debit_entry_id,
                (SELECT e.id FROM entries e WHERE e.transfer_id = t.id AND e.amount_minor > 0) AS credit_entry_id,
                (SELECT count(*) FROM moved) AS accounts_moved,
                (SELECT count(*) FROM announced) AS events_written
         FROM transfer t",
    )
    .bind(&t.ids)
    .bind(&t.principals)
    .bind(&t.keys)
    .bind(&t.fingerprints)
    .bind(&t.froms)
    .bind(&t.tos)
    .bind(&t.currencies)
    .bind(&t.amounts)
    .bind(&t.descriptions)
    .bind(&t.receipts)
    .bind(planned)
    .bind(&m.ids)
    .bind(&m.openings)
    .bind(&m.closings)
    .bind(&e.transfers)
    .bind(&e.accounts)
    .bind(&e.currencies)
    .bind(&e.amounts)
    .bind(&e.balances_after)
    .bind(&t.reverses)
    .bind(&t.batch_ids)
    .bind(&t.batch_legs)
    .bind(&m.opening_seqs)
    .bind(&m.closing_seqs)
    .bind(&t.event_types)
    .bind(&t.from_owners)
    .bind(&t.to_owners)
    .bind(&t.from_seqs)
    .bind(&t.to_seqs)
    .fetch_all(conn)
    .await
}

#[derive(Default)]
struct TransferColumns<'a> {
    ids: Vec<Uuid>,
    principals: Vec<Option<PrincipalId>>,
    keys: Vec<&'a str>,
    fingerprints: Vec<&'a [u8]>,
    froms: Vec<&'a str>,
    tos: Vec<&'a str>,
    currencies: Vec<&'a str>,
    amounts: Vec<i64>,
    descriptions: Vec<Option<&'a str>>,
    receipts: Vec<&'a str>,
    reverses: Vec<Option<Uuid>>,
    batch_ids: Vec<Option<Uuid>>,
    batch_legs: Vec<Option<i16>>,
    /// NULL where the caller writes the event itself (a hold's post).
    event_types: Vec<Option<&'static str>>,
    from_owners: Vec<Option<PrincipalId>>,
    to_owners: Vec<Option<PrincipalId>>,
    from_seqs: Vec<i64>,
    to_seqs: Vec<i64>,
}

#[derive(Default)]
struct EntryColumns<'a> {
    transfers: Vec<Uuid>,
    accounts: Vec<&'a str>,
    currencies: Vec<&'a str>,
    amounts: Vec<i64>,
    balances_after: Vec<i64>,
}

#[derive(Default)]
struct MovedColumns<'a> {
    ids: Vec<&'a str>,
    openings: Vec<i64>,
    closings: Vec<i64>,
    opening_seqs: Vec<i64>,
    closing_seqs: Vec<i64>,
}

/// Locks accounts for the rest of the caller's transaction, in id order:
/// every transaction that locks accounts does it through here, so no two
/// can wait on each other in a cycle. Locking an account this transaction
/// already holds is free.
///
/// With [`LockMode::SkipLocked`] the statement never waits: the accounts
/// it returns are locked, and the missing ones are held by another
/// transaction (PostgreSQL's `SKIP LOCKED`).
pub async fn lock_accounts(
    conn: &mut PgConnection,
    ids: &[&str],
    mode: LockMode,
) -> Result<Vec<Account>, sqlx::Error> {
    let query = match mode {
        LockMode::Wait => {
            "SELECT id, principal_id, currency, balance_minor, held_minor, allow_negative, event_seq
             FROM accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE"
        }
        LockMode::SkipLocked => {
            "SELECT id, principal_id, currency, balance_minor, held_minor, allow_negative, event_seq
             FROM accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE SKIP LOCKED"
        }
    };
    sqlx::query_as(query).bind(ids).fetch_all(conn).await
}

/// The transfers some of the requests' keys already have, by (principal,
/// key), in one statement through the (principal_id, idempotency_key)
/// index. Deposits (no principal) are looked up one by one: they come from
/// the operator's command, never in batches.
async fn find_by_keys(
    conn: &mut PgConnection,
    requests: &[PostingRequest<'_>],
) -> Result<HashMap<(Option<PrincipalId>, String), Transfer>, LedgerError> {
    let mut found = HashMap::new();
    let (mut principals, mut keys) = (Vec::new(), Vec::new());
    for request in requests {
        match request.principal_id {
            Some(principal) => {
                principals.push(principal);
                keys.push(request.idempotency_key);
            }
            None => {
                if let Some(t) = find_by_key(&mut *conn, None, request.idempotency_key).await? {
                    found.insert((None, request.idempotency_key.to_owned()), t);
                }
            }
        }
    }
    if !principals.is_empty() {
        let transfers: Vec<Transfer> = sqlx::query_as(concat!(
            select_transfer!(),
            " JOIN unnest($1::uuid[], $2::text[]) AS k(principal_id, idempotency_key)
              ON t.principal_id = k.principal_id AND t.idempotency_key = k.idempotency_key"
        ))
        .bind(&principals)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for t in transfers {
            found.insert((t.principal_id, t.idempotency_key.clone()), t);
        }
    }
    Ok(found)
}

pub(crate) async fn find_by_key(
    conn: &mut PgConnection,
    principal_id: Option<PrincipalId>,
    idempotency_key: &str,
) -> Result<Option<Transfer>, sqlx::Error> {
    // Two statements, not `principal_id IS NOT DISTINCT FROM $1`: the planner
    // cannot use the (principal_id, idempotency_key) index for that operator,
    // and every refused overdraft would scan all transfers under its locks.
    let query = match principal_id {
        Some(principal_id) => sqlx::query_as(concat!(
            select_transfer!(),
            " WHERE t.principal_id = $1 AND t.idempotency_key = $2"
        ))
        .bind(principal_id),
        None => sqlx::query_as(concat!(
            select_transfer!(),
            " WHERE t.principal_id IS NULL AND t.idempotency_key = $1"
        )),
    };
    query.bind(idempotency_key).fetch_optional(conn).await
}

/// The transfer a principal's key moved, if any: the permanent trace of a
/// key whose idempotency record is gone.
pub async fn get_transfer_by_key(
    pool: &sqlx::PgPool,
    principal_id: PrincipalId,
    idempotency_key: &str,
) -> Result<Option<Transfer>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    find_by_key(&mut conn, Some(principal_id), idempotency_key).await
}

/// Which transfers a listing returns.
#[derive(Debug, Clone, Default)]
pub struct TransferFilter<'a> {
    /// Transfers that debited or credited one of these accounts.
    pub accounts: Vec<&'a str>,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    /// Only the transfer this principal's key moved.
    pub key: Option<(PrincipalId, &'a str)>,
    /// Strictly older than this transfer (ids are time-ordered UUIDv7).
    pub before_id: Option<Uuid>,
}

impl TransferFilter<'_> {
    /// Binds a listing's parameters, the same for transfers and holds:
    /// `$1` accounts, `$2` created after, `$3` created before, `$4` and `$5`
    /// the key's principal and key, `$6` the id to page from, `$7` `limit`.
    pub(crate) fn bind<'q, O>(
        &'q self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
        limit: i64,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        let (key_principal, key) = match self.key {
            Some((principal, key)) => (Some(principal), Some(key)),
            None => (None, None),
        };
        query
            .bind(&self.accounts)
            .bind(self.created_after)
            .bind(self.created_before)
            .bind(key_principal)
            .bind(key)
            .bind(self.before_id)
            .bind(limit)
    }
}

/// A page of transfers, newest first; holds in any status, posted or not,
/// are listed by [`super::holds::list`].
pub async fn list_transfers<'e>(
    executor: impl PgExecutor<'e>,
    filter: &TransferFilter<'_>,
    limit: i64,
) -> Result<Vec<Transfer>, sqlx::Error> {
    filter
        .bind(
            sqlx::query_as(concat!(
                select_transfer!(),
                " WHERE (t.from_account = ANY($1) OR t.to_account = ANY($1))
                    AND ($2::timestamptz IS NULL OR t.created_at > $2)
                    AND ($3::timestamptz IS NULL OR t.created_at < $3)
                    AND ($5::text IS NULL OR (t.principal_id = $4 AND t.idempotency_key = $5))
                    AND ($6::uuid IS NULL OR t.id < $6)
                    -- A posted hold is listed from its hold (holds::list), as
                    -- GET /transfers/{id} shows it.
                    AND NOT EXISTS (SELECT 1 FROM holds h WHERE h.id = t.id)
                  ORDER BY t.id DESC
                  LIMIT $7"
            )),
            limit,
        )
        .fetch_all(executor)
        .await
}

/// The ids of a principal's accounts.
pub async fn account_ids_of<'e>(
    executor: impl PgExecutor<'e>,
    principal_id: PrincipalId,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM accounts WHERE principal_id = $1 ORDER BY id")
        .bind(principal_id)
        .fetch_all(executor)
        .await
}

/// A batch's legs, in their order.
pub async fn transfers_of_batch<'e>(
    executor: impl PgExecutor<'e>,
    batch_id: Uuid,
) -> Result<Vec<Transfer>, sqlx::Error> {
    sqlx::query_as(concat!(
        select_transfer!(),
        " WHERE t.batch_id = $1 ORDER BY t.batch_leg"
    ))
    .bind(batch_id)
    .fetch_all(executor)
    .await
}

pub async fn get_transfer<'e>(
    executor: impl PgExecutor<'e>,
    id: Uuid,
) -> Result<Option<Transfer>, sqlx::Error> {
    sqlx::query_as(concat!(select_transfer!(), " WHERE t.id = $1"))
        .bind(id)
        .fetch_optional(executor)
        .await
}

/// The transfers with these ids (those that exist), in no order.
pub async fn get_transfers<'e>(
    executor: impl PgExecutor<'e>,
    ids: &[Uuid],
) -> Result<Vec<Transfer>, sqlx::Error> {
    sqlx::query_as(concat!(select_transfer!(), " WHERE t.id = ANY($1)"))
        .bind(ids)
        .fetch_all(executor)
        .await
}

pub async fn get_account<'e>(
    executor: impl PgExecutor<'e>,
    id: &str,
) -> Result<Option<Account>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, principal_id, currency, balance_minor, held_minor, allow_negative, event_seq
         FROM accounts WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(executor)
    .await
}

/// Both accounts of a prospective transfer, read without locks: owner and
/// currency never change, so checks on them made before the claim still hold
/// inside the posting transaction.
pub async fn get_accounts<'e>(
    executor: impl PgExecutor<'e>,
    ids: &[&str],
) -> Result<Vec<Account>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, principal_id, currency, balance_minor, held_minor, allow_negative, event_seq
         FROM accounts WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(executor)
    .await
}

/// A page of an account's entries, newest first, strictly older than
/// `before_entry_id` when given.
pub async fn list_entries<'e>(
    executor: impl PgExecutor<'e>,
    account_id: &str,
    before_entry_id: Option<i64>,
    limit: i64,
) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, transfer_id, account_id, currency, amount_minor, balance_after_minor, created_at
         FROM ledger_entries
         WHERE account_id = $1 AND ($2::bigint IS NULL OR id < $2)
         ORDER BY id DESC
         LIMIT $3",
    )
    .bind(account_id)
    .bind(before_entry_id)
    .bind(limit)
    .fetch_all(executor)
    .await
}

/// The currencies the ledger supports, from the `currencies` table.
pub async fn supported_currencies<'e>(
    executor: impl PgExecutor<'e>,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT code FROM currencies ORDER BY code")
        .fetch_all(executor)
        .await
}
