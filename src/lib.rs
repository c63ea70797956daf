//! nexo-transfers: a REST API that moves money between accounts effectively
//! once. A client may send the same transfer intent any number of times and
//! the money moves once, with the same answer every time.
//!
//! Map of the modules, in the direction dependencies point:
//!
//! - [`http`]: routes, extractors, the problem+json error mapping and the
//!   middleware stack. Builds the router ([`http::app`]) that tests mount.
//!   Each handler extracts, calls a service, and maps the result.
//! - [`transfers`]: the transfers service below HTTP: a request's intent and
//!   fingerprint, the checks before its claim, and the posting layer that
//!   queues, batches and bounds every posting so each claim ends.
//! - [`idempotency`]: the `Idempotency-Key` header, request fingerprints, and
//!   the store that claims keys insert-first and completes them, fenced,
//!   inside the caller's transaction.
//! - [`feed`]: the pull feed of events (`GET /events`): pages after a
//!   cursor and long polls, bounded, ended at shutdown.
//! - [`ledger`]: money types, the pure planning of postings, the
//!   double-entry writes and the events (the outbox) written with them.
//!   Knows nothing of HTTP or idempotency records.
//! - [`problem`]: problem+json documents as exact bytes (stored rejections
//!   are replayed byte for byte).
//! - [`caches`]: bounded in-memory lookups (tokens, accounts, replays).
//! - [`principal`]: the caller's id.
//! - [`admin`]: operator actions (principals, accounts, deposits, demo data).
//! - [`auth`]: bearer tokens, stored only as SHA-256.
//! - [`config`], [`db`], [`cli`]: settings, connection and migrations, and
//!   the command line that `main.rs` hands over to.
//! - [`reconcile`]: whole-ledger checks that money and idempotency records
//!   agree, for `nexo-transfers reconcile` and the server's schedule.
//! - [`telemetry`]: the Prometheus metrics catalogue and recorder.
//! - [`webhooks`]: registered endpoints and the worker that delivers the
//!   events to them, signed, at least once, in the feed's order.

pub mod admin;
pub mod auth;
pub mod caches;
pub mod cli;
pub mod config;
pub mod db;
pub mod feed;
pub mod http;
pub mod idempotency;
pub mod ledger;
pub mod principal;
pub mod problem;
pub mod reconcile;
pub mod telemetry;
pub mod transfers;
pub mod webhooks;
