//! Reconciliation: checks, on the rows themselves, that the ledger is whole
//! and that the idempotency records agree with it, and reports every
//! discrepancy with the ids to look at, what was expected and what was found.
//!
//! Every check is one set-based statement (joins and aggregates the planner
//! runs as a few sequential or index scans), never a row-by-row loop, so its
//! cost grows linearly with the ledger (measured in `docs/operations.md`).
//! All checks read one snapshot (`REPEATABLE READ READ ONLY`): a transfer
//! committed while the check runs is seen whole or not at all, so a busy
//! ledger never shows a balance that is "off" by an in-flight posting.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// Discrepancies listed per check; all of them are still counted. Enough to
/// start an investigation, small enough that a ledger broken in a million
/// places still prints a readable report and a bounded JSON document.
pub const DISCREPANCIES_LISTED_MAX: i64 = 20;

/// Longest a single check may run before the reconciliation gives up (and
/// reports that it could not run). Measured at about a second per check on a
/// million transfers; the bound stops a pathological plan from holding a
/// snapshot, and so vacuum, back for hours.
pub const CHECK_STATEMENT_TIMEOUT: Duration = Duration::from_secs(600);

/// What to reconcile against.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// The idempotency record TTL the server runs with
    /// (`NEXO_IDEMPOTENCY_TTL`): a transfer younger than this must still
    /// have the record of the key it was created through.
    pub key_ttl: Duration,
}

/// The invariants checked, in the order they run and are reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Each transfer has exactly two entries: one debit of its amount on its
    /// source and one credit of its amount on its destination.
    TransferEntries,
    /// Each account's balance equals the sum of its entries.
    AccountBalances,
    /// The balances of each currency, funding accounts included, sum to zero.
    CurrencyTotals,
    /// Each entry's `balance_after_minor` is the sum of its account's entries
    /// up to and including it, in id order: the statement a customer reads
    /// tells the same story as the balance.
    EntryBalances,
    /// No idempotency key maps to more than one transfer: no two transfers
    /// share a (principal, key), and no key record points at a transfer
    /// created under another key.
    KeyTransfers,
    /// A COMPLETED key whose stored response is a success names a transfer
    /// that exists.
    CompletedKeyTransfer,
    /// A transfer created through a key younger than the TTL still has that
    /// key's record.
    TransferKeyRecord,
    /// No key is still IN_PROGRESS after its lease ended.
    KeysStuckInProgress,
    /// Every account's held amount is the sum of its pending holds.
    HoldReservations,
    /// A hold was posted exactly when a transfer with its id exists, of its
    /// posted amount between its accounts.
    HoldTransfers,
    /// A transfer's reversed amount is the sum of its reversals, each going
    /// back from its destination to its source.
    Reversals,
    /// Every change to the ledger has exactly its event, and every event
    /// its change: a transfer its `transfer.posted` (or `transfer.reversed`),
    /// a hold its `hold.created` and, once it ended, the one event of its
    /// end (`hold.posted`, `hold.voided`, `hold.expired`). Changes older
    /// than what the purge deleted are not required to keep theirs.
    LedgerEvents,
    /// Each account's events are numbered without a gap or a repeat, the
    /// last with the account's `event_seq` (from 1, until the purge deletes
    /// the oldest).
    EventSequences,
}

impl Check {
    pub const ALL: [Check; 13] = [
        Check::TransferEntries,
        Check::AccountBalances,
        Check::CurrencyTotals,
        Check::EntryBalances,
        Check::HoldReservations,
        Check::HoldTransfers,
        Check::Reversals,
        Check::LedgerEvents,
        Check::EventSequences,
        Check::KeyTransfers,
        Check::CompletedKeyTransfer,
        Check::TransferKeyRecord,
        Check::KeysStuckInProgress,
    ];

    /// The checks on the ledger alone: they hold whatever state the
    /// idempotency records are in, so tests that leave records half-done on
    /// purpose, and the load generator, check the money with them.
    pub const LEDGER: [Check; 9] = [
        Check::TransferEntries,
        Check::AccountBalances,
        Check::CurrencyTotals,
        Check::EntryBalances,
        Check::HoldReservations,
        Check::HoldTransfers,
        Check::Reversals,
        Check::LedgerEvents,
        Check::EventSequences,
    ];

    /// The stable name used in reports and as the `check` metric label.
    pub fn name(self) -> &'static str {
        match self {
            Check::TransferEntries => "transfer_entries",
            Check::AccountBalances => "account_balances",
            Check::CurrencyTotals => "currency_totals",
            Check::EntryBalances => "entry_balances",
            Check::KeyTransfers => "key_transfers",
            Check::CompletedKeyTransfer => "completed_key_transfer",
            Check::TransferKeyRecord => "transfer_key_record",
            Check::KeysStuckInProgress => "keys_stuck_in_progress",
            Check::HoldReservations => "hold_reservations",
            Check::HoldTransfers => "hold_transfers",
            Check::Reversals => "reversals",
            Check::LedgerEvents => "ledger_events",
            Check::EventSequences => "event_sequences",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Check::TransferEntries => {
                "every transfer has exactly one debit and one credit of its amount"
            }
            Check::AccountBalances => "every account balance equals the sum of its entries",
            Check::CurrencyTotals => {
                "the balances of each currency sum to zero (funding accounts included)"
            }
            Check::EntryBalances => {
                "every entry's balance after equals the sum of its account's entries up to it"
            }
            Check::KeyTransfers => "no idempotency key maps to more than one transfer",
            Check::CompletedKeyTransfer => {
                "every COMPLETED key that stored a success names an existing transfer"
            }
            Check::TransferKeyRecord => {
                "every transfer created through a key within the TTL still has its key record"
            }
            Check::KeysStuckInProgress => "no key is IN_PROGRESS past its lease",
            Check::HoldReservations => {
                "every account's held amount is the sum of its pending holds (available = balance - held)"
            }
            Check::HoldTransfers => {
                "every posted hold has its transfer (same id, posted amount, same accounts) and no other hold has one"
            }
            Check::Reversals => {
                "every transfer's reversed amount is the sum of its reversals, each from its destination back to its source"
            }
            Check::LedgerEvents => {
                "every transfer and every step of a hold has exactly its event (within the event retention), and every event its change"
            }
            Check::EventSequences => {
                "every account's events are numbered without gaps or repeats, up to its event_seq"
            }
        }
    }

    /// The names of the ids each of this check's discrepancies carries, in
    /// the order its query returns them.
    fn id_names(self) -> &'static [&'static str] {
        match self {
            Check::TransferEntries => &["transfer_id"],
            Check::AccountBalances => &["account_id"],
            Check::CurrencyTotals => &["currency"],
            Check::EntryBalances => &["entry_id", "account_id"],
            Check::KeyTransfers | Check::CompletedKeyTransfer | Check::KeysStuckInProgress => {
                &["principal_id", "idempotency_key"]
            }
            Check::TransferKeyRecord => &["transfer_id", "principal_id", "idempotency_key"],
            Check::HoldReservations | Check::EventSequences => &["account_id"],
            Check::HoldTransfers | Check::Reversals => &["transfer_id"],
            Check::LedgerEvents => &["transfer_id", "type"],
        }
    }

    /// One statement per check. `$1` is the number of discrepancies to list;
    /// [`Check::TransferKeyRecord`] also takes `$2`, the key TTL in seconds. Each returns, per listed discrepancy, the
    /// total number found (a window count taken before the LIMIT), its ids,
    /// what was expected and what was found.
    fn sql(self) -> &'static str {
        match self {
            // Cheap counts over the join find the bad transfers; only the
            // listed ones are then described entry by entry.
            Check::TransferEntries => {
                "WITH bad AS (
                     SELECT t.id, t.from_account, t.to_account, t.amount_minor
                     FROM transfers t
                     LEFT JOIN ledger_entries e ON e.transfer_id = t.id
                     GROUP BY t.id
                     HAVING count(e.id) <> 2
                         OR count(e.id) FILTER (WHERE e.account_id = t.from_account
                                                  AND e.amount_minor = -t.amount_minor) <> 1
                         OR count(e.id) FILTER (WHERE e.account_id = t.to_account
                                                  AND e.amount_minor = t.amount_minor) <> 1
                 ), listed AS (
                     SELECT bad.*, count(*) OVER () AS total FROM bad ORDER BY id LIMIT $1
                 )
                 SELECT l.total,
                        ARRAY[l.id::text] AS ids,
                        format('a debit of %s on %s and a credit of %s on %s',
                               -l.amount_minor, l.from_account, l.amount_minor, l.to_account) AS expected,
                        (SELECT format('%s entries: %s', count(*),
                                       COALESCE(string_agg(format('%s on %s (entry %s)',
                                                                  e.amount_minor, e.account_id, e.id),
                                                           ', ' ORDER BY e.id), 'none'))
                         FROM ledger_entries e WHERE e.transfer_id = l.id) AS found
                 FROM listed l
                 ORDER BY l.id"
            }
            // MATERIALIZED: inlined, the sums would be read through the
            // (account_id, id) index to serve the ORDER BY, a random heap
            // read per entry (5 s instead of 0.7 s on a million transfers).
            Check::AccountBalances => {
                "WITH sums AS MATERIALIZED (
                     SELECT account_id, sum(amount_minor) AS total
                     FROM ledger_entries GROUP BY account_id
                 )
                 SELECT count(*) OVER () AS total,
                        ARRAY[a.id] AS ids,
                        format('balance %s (the sum of its entries)', COALESCE(s.total, 0)) AS expected,
                        format('balance %s', a.balance_minor) AS found
                 FROM accounts a
                 LEFT JOIN sums s ON s.account_id = a.id
                 WHERE a.balance_minor <> COALESCE(s.total, 0)
                 ORDER BY a.id
                 LIMIT $1"
            }
            Check::CurrencyTotals => {
                "SELECT count(*) OVER () AS total,
                        ARRAY[currency] AS ids,
                        'balances summing to 0' AS expected,
                        format('balances summing to %s over %s accounts',
                               sum(balance_minor), count(*)) AS found
                 FROM accounts
                 GROUP BY currency
                 HAVING sum(balance_minor) <> 0
                 ORDER BY currency
                 LIMIT $1"
            }
            // MATERIALIZED for the same reason as the account balances: one
            // sorted pass over the entries instead of an index walk.
            Check::EntryBalances => {
                "WITH running AS MATERIALIZED (
                     SELECT id, account_id, balance_after_minor,
                            sum(amount_minor) OVER (PARTITION BY account_id ORDER BY id) AS running_total
                     FROM ledger_entries
                 )
                 SELECT count(*) OVER () AS total,
                        ARRAY[id::text, account_id] AS ids,
                        format('balance after %s (the sum of the account''s entries up to this one)',
                               running_total) AS expected,
                        format('balance after %s', balance_after_minor) AS found
                 FROM running
                 WHERE balance_after_minor <> running_total
                 ORDER BY id
                 LIMIT $1"
            }
            // As for transfer entries: counting finds the bad keys, and only
            // the listed ones are described.
            Check::KeyTransfers => {
                "WITH bad AS (
                     SELECT principal_id, idempotency_key, NULL::uuid AS record_transfer_id
                     FROM transfers
                     GROUP BY principal_id, idempotency_key
                     HAVING count(*) > 1
                     UNION ALL
                     SELECT k.principal_id, k.idempotency_key, k.transfer_id
                     FROM idempotency_keys k
                     JOIN transfers t ON t.id = k.transfer_id
                     WHERE (t.principal_id IS DISTINCT FROM k.principal_id
                            OR t.idempotency_key <> k.idempotency_key)
                       -- The key that created a hold names the transfer that
                       -- posted it later, under the posting's key.
                       AND NOT EXISTS (SELECT 1 FROM holds h
                                       WHERE h.id = k.transfer_id AND h.principal_id = k.principal_id
                                         AND h.idempotency_key = k.idempotency_key)
                 ), listed AS (
                     SELECT bad.*, count(*) OVER () AS total
                     FROM bad ORDER BY principal_id, idempotency_key LIMIT $1
                 )
                 SELECT l.total,
                        ARRAY[COALESCE(l.principal_id::text, 'none (deposits)'), l.idempotency_key] AS ids,
                        CASE WHEN l.record_transfer_id IS NULL THEN 'one transfer'
                             ELSE 'its record to name the transfer created under this key' END AS expected,
                        CASE WHEN l.record_transfer_id IS NULL THEN
                                 (SELECT format('%s transfers: %s', count(*),
                                                string_agg(t.id::text, ', ' ORDER BY t.id))
                                  FROM transfers t
                                  WHERE t.principal_id IS NOT DISTINCT FROM l.principal_id
                                    AND t.idempotency_key = l.idempotency_key)
                             ELSE
                                 (SELECT format('its record names transfer %s, created under principal %s and key %s',
                                                t.id, COALESCE(t.principal_id::text, 'none (a deposit)'),
                                                t.idempotency_key)
                                  FROM transfers t WHERE t.id = l.record_transfer_id) END AS found
                 FROM listed l
                 ORDER BY l.principal_id, l.idempotency_key"
            }
            Check::CompletedKeyTransfer => {
                "SELECT count(*) OVER () AS total,
                        ARRAY[k.principal_id::text, k.idempotency_key] AS ids,
                        CASE WHEN k.transfer_id IS NULL
                             THEN 'the id of the transfer its success created'
                             ELSE format('transfer %s', k.transfer_id) END AS expected,
                        CASE WHEN k.transfer_id IS NULL
                             THEN format('status %s stored without a transfer id', k.response_status)
                             ELSE format('no such transfer (status %s stored)', k.response_status) END AS found
                 FROM idempotency_keys k
                 LEFT JOIN transfers t ON t.id = k.transfer_id
                 WHERE k.status = 'COMPLETED'
                   AND k.response_status BETWEEN 200 AND 299
                   AND t.id IS NULL
                   -- A hold created or voided: a transfer with no posting yet.
                   AND NOT EXISTS (SELECT 1 FROM holds h WHERE h.id = k.transfer_id)
                   -- A batch's record names its batch, not one transfer.
                   AND NOT (k.transfer_id IS NULL AND EXISTS (
                       SELECT 1 FROM transfer_batches b
                       WHERE b.principal_id = k.principal_id AND b.idempotency_key = k.idempotency_key))
                 ORDER BY k.principal_id, k.idempotency_key
                 LIMIT $1"
            }
            Check::TransferKeyRecord => {
                "SELECT count(*) OVER () AS total,
                        ARRAY[t.id::text, t.principal_id::text, t.idempotency_key] AS ids,
                        'the idempotency record of its key' AS expected,
                        format('no record; the transfer was created at %s, within the key TTL',
                               t.created_at) AS found
                 FROM transfers t
                 WHERE t.principal_id IS NOT NULL
                   AND t.created_at > now() - make_interval(secs => $2)
                   AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                                   WHERE k.principal_id = t.principal_id
                                     AND k.idempotency_key = t.idempotency_key)
                   -- A batch's legs were asked for under their batch's key.
                   AND NOT EXISTS (SELECT 1 FROM transfer_batches b
                                   JOIN idempotency_keys k ON k.principal_id = b.principal_id
                                                          AND k.idempotency_key = b.idempotency_key
                                   WHERE b.id = t.batch_id)
                 ORDER BY t.created_at, t.id
                 LIMIT $1"
            }
            Check::HoldReservations => {
                "WITH pending AS MATERIALIZED (
                     SELECT from_account, sum(amount_minor) AS total
                     FROM holds WHERE status = 'pending' GROUP BY from_account
                 )
                 SELECT count(*) OVER () AS total,
                        ARRAY[a.id] AS ids,
                        format('held %s (the sum of its pending holds)', COALESCE(p.total, 0)) AS expected,
                        format('held %s', a.held_minor) AS found
                 FROM accounts a
                 LEFT JOIN pending p ON p.from_account = a.id
                 WHERE a.held_minor <> COALESCE(p.total, 0)
                 ORDER BY a.id
                 LIMIT $1"
            }
            Check::HoldTransfers => {
                "SELECT count(*) OVER () AS total,
                        ARRAY[h.id::text] AS ids,
                        CASE WHEN h.status = 'posted'
                             THEN format('a transfer of %s from %s to %s', h.posted_amount_minor,
                                         h.from_account, h.to_account)
                             ELSE format('no transfer: the hold is %s', h.status) END AS expected,
                        CASE WHEN t.id IS NULL THEN 'no transfer'
                             ELSE format('a transfer of %s from %s to %s', t.amount_minor,
                                         t.from_account, t.to_account) END AS found
                 FROM holds h
                 LEFT JOIN transfers t ON t.id = h.id
                 WHERE CASE WHEN h.status = 'posted'
                            THEN t.id IS NULL OR t.amount_minor <> h.posted_amount_minor
                                 OR t.from_account <> h.from_account OR t.to_account <> h.to_account
                            ELSE t.id IS NOT NULL END
                 ORDER BY h.id
                 LIMIT $1"
            }
            Check::Reversals => {
                "WITH given AS MATERIALIZED (
                     SELECT reverses AS id, sum(amount_minor) AS total,
                            count(*) FILTER (WHERE NOT ok) AS misdirected
                     FROM (SELECT r.reverses, r.amount_minor,
                                  (r.from_account = o.to_account AND r.to_account = o.from_account
                                   AND r.currency = o.currency) AS ok
                           FROM transfers r JOIN transfers o ON o.id = r.reverses) x
                     GROUP BY reverses
                 )
                 SELECT count(*) OVER () AS total,
                        ARRAY[t.id::text] AS ids,
                        format('reversed %s (the sum of its reversals), each from %s back to %s',
                               COALESCE(g.total, 0), t.to_account, t.from_account) AS expected,
                        format('reversed %s; %s reversals between other accounts',
                               t.reversed_minor, COALESCE(g.misdirected, 0)) AS found
                 FROM transfers t
                 LEFT JOIN given g ON g.id = t.id
                 WHERE t.reversed_minor <> COALESCE(g.total, 0) OR COALESCE(g.misdirected, 0) > 0
                 ORDER BY t.id
                 LIMIT $1"
            }
            // What the ledger says must have been announced, against what
            // was: a full join of two grouped sets, each read once.
            Check::LedgerEvents => {
                "WITH expected AS MATERIALIZED (
                     SELECT t.id, CASE WHEN t.reverses IS NULL THEN 'transfer.posted'
                                       ELSE 'transfer.reversed' END AS type,
                            t.created_at AS at
                     FROM transfers t
                     -- A hold's transfer is announced as the hold's post.
                     WHERE NOT EXISTS (SELECT 1 FROM holds h WHERE h.id = t.id)
                     UNION ALL
                     SELECT id, 'hold.created', created_at FROM holds
                     UNION ALL
                     SELECT id, 'hold.' || status, resolved_at FROM holds WHERE status <> 'pending'
                 ), written AS MATERIALIZED (
                     SELECT resource_id AS id, type, count(*) AS n FROM events
                     -- A notice about a webhook endpoint announces no ledger change.
                     WHERE type <> 'webhook_endpoint.disabled'
                     GROUP BY resource_id, type
                 ), bad AS (
                     SELECT COALESCE(x.id, w.id) AS id, COALESCE(x.type, w.type) AS type,
                            x.id IS NOT NULL AS made, COALESCE(w.n, 0) AS n
                     FROM expected x
                     FULL JOIN written w ON w.id = x.id AND w.type = x.type
                     WHERE CASE WHEN x.id IS NULL THEN true
                                WHEN w.id IS NULL THEN x.at > (SELECT through FROM events_purged)
                                ELSE w.n <> 1 END
                 )
                 SELECT count(*) OVER () AS total,
                        ARRAY[id::text, type] AS ids,
                        CASE WHEN made THEN 'exactly one event'
                             ELSE 'no event: the ledger holds no such change' END AS expected,
                        format('%s events', n) AS found
                 FROM bad
                 ORDER BY id, type
                 LIMIT $1"
            }
            Check::EventSequences => {
                "WITH numbered AS MATERIALIZED (
                     SELECT from_account AS account_id, from_seq AS seq FROM events
                     WHERE from_seq IS NOT NULL
                     UNION ALL
                     SELECT to_account, to_seq FROM events WHERE to_seq IS NOT NULL
                 ), per_account AS (
                     SELECT account_id, count(*) AS n, count(DISTINCT seq) AS distinct_n,
                            min(seq) AS lo, max(seq) AS hi
                     FROM numbered GROUP BY account_id
                 ), purged AS (
                     SELECT through > '-infinity' AS happened FROM events_purged
                 )
                 SELECT count(*) OVER () AS total,
                        ARRAY[a.id] AS ids,
                        format('events numbered %s to %s, each once', CASE WHEN (SELECT happened FROM purged)
                               THEN 'from the oldest kept' ELSE '1' END, a.event_seq) AS expected,
                        CASE WHEN p.account_id IS NULL THEN 'no events'
                             ELSE format('%s events numbered %s to %s, %s distinct', p.n, p.lo, p.hi,
                                         p.distinct_n) END AS found
                 FROM accounts a
                 LEFT JOIN per_account p ON p.account_id = a.id
                 WHERE CASE WHEN p.account_id IS NULL THEN a.event_seq > 0 AND NOT (SELECT happened FROM purged)
                            ELSE p.n <> p.distinct_n OR p.hi - p.lo + 1 <> p.n OR p.hi <> a.event_seq
                                 OR (p.lo <> 1 AND NOT (SELECT happened FROM purged)) END
                 ORDER BY a.id
                 LIMIT $1"
            }
            Check::KeysStuckInProgress => {
                "SELECT count(*) OVER () AS total,
                        ARRAY[principal_id::text, idempotency_key] AS ids,
                        'COMPLETED or FAILED by the end of its lease' AS expected,
                        format('IN_PROGRESS, lease ended at %s (%s ago)', locked_until,
                               date_trunc('second', now() - locked_until)) AS found
                 FROM idempotency_keys
                 WHERE status = 'IN_PROGRESS' AND locked_until < now()
                 ORDER BY locked_until, principal_id, idempotency_key
                 LIMIT $1"
            }
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One thing that does not hold: which rows, what should be there, what is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Discrepancy {
    pub ids: BTreeMap<&'static str, String>,
    pub expected: String,
    pub found: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    pub check: Check,
    pub description: &'static str,
    /// Every discrepancy found, listed or not.
    pub discrepancies_total: u64,
    /// At most [`DISCREPANCIES_LISTED_MAX`], in a stable order.
    pub discrepancies: Vec<Discrepancy>,
}

impl CheckReport {
    pub fn holds(&self) -> bool {
        self.discrepancies_total == 0
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// True when every check holds.
    pub ok: bool,
    /// The database's clock when the snapshot was taken.
    pub started_at: DateTime<Utc>,
    pub duration_ms: u64,
    pub key_ttl_secs: u64,
    pub discrepancies_listed_max: i64,
    pub checks: Vec<CheckReport>,
}

impl Report {
    pub fn discrepancies_total(&self) -> u64 {
        self.checks.iter().map(|c| c.discrepancies_total).sum()
    }

    pub fn check(&self, check: Check) -> Option<&CheckReport> {
        self.checks.iter().find(|c| c.check == check)
    }
}

/// The reconciliation's own single connection, apart from the API's pool: a
/// run holds it for seconds, which would otherwise be a request's
/// connection. Its statements are slow by design, so sqlx's slow-statement
/// warnings are off for it; each check's time is logged at debug instead.
/// `eager` connects now (the command line reports a failure at once); the
/// server connects at its first run.
pub async fn connect(
    database_url: &str,
    acquire_timeout: Duration,
    eager: bool,
) -> Result<PgPool, sqlx::Error> {
    // On the primary when DATABASE_URL lists several hosts: a standby's
    // snapshot may lag behind what the service answered.
    let endpoints = crate::db::Endpoints::parse(database_url)
        .map_err(|e| sqlx::Error::Configuration(e.into()))?;
    let url = endpoints.find_primary().await?;
    let options = PgConnectOptions::from_str(url)?.disable_statement_logging();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(acquire_timeout);
    if eager {
        pool.connect_with(options).await
    } else {
        Ok(pool.connect_lazy_with(options))
    }
}

/// Runs every check on one read-only snapshot.
pub async fn run(pool: &PgPool, options: Options) -> Result<Report, sqlx::Error> {
    run_checks(pool, options, &Check::ALL).await
}

/// Runs the ledger's checks ([`Check::LEDGER`]) on one read-only snapshot.
pub async fn run_ledger_checks(pool: &PgPool) -> Result<Report, sqlx::Error> {
    // No ledger check reads the key TTL.
    let options = Options {
        key_ttl: Duration::ZERO,
    };
    run_checks(pool, options, &Check::LEDGER).await
}

/// Runs the given checks, in the given order, on one read-only snapshot.
#[tracing::instrument(skip_all, fields(key_ttl_secs = options.key_ttl.as_secs()))]
pub async fn run_checks(
    pool: &PgPool,
    options: Options,
    selected: &[Check],
) -> Result<Report, sqlx::Error> {
    let clock = Instant::now();
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await?;
    // set_config(.., true) is SET LOCAL: it ends with the transaction. UTC,
    // so the times quoted in discrepancies read the same on every server.
    sqlx::query(
        "SELECT set_config('statement_timeout', $1, true), set_config('TimeZone', 'UTC', true)",
    )
    .bind(CHECK_STATEMENT_TIMEOUT.as_millis().to_string())
    .execute(&mut *tx)
    .await?;
    let started_at: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await?;
    let mut checks = Vec::with_capacity(selected.len());
    for &check in selected {
        let check_clock = Instant::now();
        let mut query = sqlx::query_as(check.sql()).bind(DISCREPANCIES_LISTED_MAX);
        if check == Check::TransferKeyRecord {
            query = query.bind(options.key_ttl.as_secs_f64());
        }
        let rows: Vec<(i64, Vec<String>, String, String)> = query.fetch_all(&mut *tx).await?;
        let total = rows.first().map_or(0, |row| row.0);
        tracing::debug!(%check, found = total, elapsed_ms = check_clock.elapsed().as_millis() as u64, "check ran");
        checks.push(CheckReport {
            check,
            description: check.description(),
            discrepancies_total: u64::try_from(total).unwrap_or(0),
            discrepancies: rows
                .into_iter()
                .map(|(_, ids, expected, found)| Discrepancy {
                    ids: check.id_names().iter().copied().zip(ids).collect(),
                    expected,
                    found,
                })
                .collect(),
        });
    }
    tx.rollback().await?;
    Ok(Report {
        ok: checks.iter().all(CheckReport::holds),
        started_at,
        duration_ms: u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX),
        key_ttl_secs: options.key_ttl.as_secs(),
        discrepancies_listed_max: DISCREPANCIES_LISTED_MAX,
        checks,
    })
}

impl fmt::Display for Report {
    /// The human report: one line per check, then each listed discrepancy.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "reconciliation at {} ({} ms",
            self.started_at.to_rfc3339_opts(SecondsFormat::Micros, true),
            self.duration_ms,
        )?;
        if self.check(Check::TransferKeyRecord).is_some() {
            write!(f, ", key TTL {}s", self.key_ttl_secs)?;
        }
        writeln!(f, ")")?;
        for check in &self.checks {
            let verdict = if check.holds() { "ok  " } else { "FAIL" };
            write!(
                f,
                "{verdict} {:<24} {}",
                check.check.name(),
                check.description
            )?;
            if check.holds() {
                writeln!(f)?;
                continue;
            }
            writeln!(f, ": {} found", check.discrepancies_total)?;
            for d in &check.discrepancies {
                let ids: Vec<String> = check
                    .check
                    .id_names()
                    .iter()
                    .filter_map(|name| d.ids.get(name).map(|v| format!("{name}={v}")))
                    .collect();
                writeln!(f, "     {}", ids.join(" "))?;
                writeln!(f, "       expected: {}", d.expected)?;
                writeln!(f, "       found:    {}", d.found)?;
            }
            let unlisted = check.discrepancies_total - check.discrepancies.len() as u64;
            if unlisted > 0 {
                writeln!(f, "     … and {unlisted} more not listed")?;
            }
        }
        if self.ok {
            write!(f, "all checks hold")
        } else {
            write!(f, "{} discrepancies found", self.discrepancies_total())
        }
    }
}

/// The outcome of the server's last scheduled reconciliation.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum LastRun {
    /// Not run yet since start-up, or scheduling is off.
    NeverRun { scheduled_every_secs: Option<u64> },
    Completed {
        scheduled_every_secs: Option<u64>,
        report: Arc<Report>,
    },
    /// The checks could not run (database away, timeout); the previous
    /// completed report, if any, is kept alongside.
    Failed {
        scheduled_every_secs: Option<u64>,
        at: DateTime<Utc>,
        error: String,
        previous: Option<Arc<Report>>,
    },
}

/// Where the scheduled run leaves its result for the admin endpoint. A std
/// RwLock: it is held only to clone or swap an `Arc`, never across an await.
#[derive(Debug)]
pub struct LastRunCell {
    every: Option<Duration>,
    last: RwLock<LastRun>,
}

impl Default for LastRunCell {
    fn default() -> Self {
        Self::new(None)
    }
}

impl LastRunCell {
    pub fn new(every: Option<Duration>) -> Self {
        let scheduled_every_secs = every.map(|d| d.as_secs());
        Self {
            every,
            last: RwLock::new(LastRun::NeverRun {
                scheduled_every_secs,
            }),
        }
    }

    pub fn get(&self) -> LastRun {
        match self.last.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn record(&self, result: Result<Report, sqlx::Error>) {
        let scheduled_every_secs = self.every.map(|d| d.as_secs());
        let mut guard = match self.last.write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        let previous = match &*guard {
            LastRun::Completed { report, .. } => Some(report.clone()),
            LastRun::Failed { previous, .. } => previous.clone(),
            LastRun::NeverRun { .. } => None,
        };
        *guard = match result {
            Ok(report) => LastRun::Completed {
                scheduled_every_secs,
                report: Arc::new(report),
            },
            Err(e) => LastRun::Failed {
                scheduled_every_secs,
                at: Utc::now(),
                error: e.to_string(),
                previous,
            },
        };
    }
}
