//! The pull feed (`GET /events`): a page of the events a principal may see
//! after a cursor and, when asked, a wait for the first of them (a long
//! poll). The rows and their order are `ledger::events`'; this module adds
//! the bounds on pages, waits and waiters, and stops every wait at
//! shutdown.
//!
//! A waiting request holds no database connection: it asks again every
//! [`POLL_INTERVAL`], each time taking a pooled connection for one indexed
//! query. Why polling and not LISTEN/NOTIFY: ADR-011.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;
use uuid::Uuid;

use crate::ledger::events::{self, Cursor, Event};
use crate::principal::PrincipalId;
use crate::telemetry;

/// Events per page when the client does not ask.
pub const PAGE_SIZE_DEFAULT: i64 = 100;
/// The most events one page holds: about 1 MiB of JSON, and two index
/// scans of at most this many entries.
pub const PAGE_SIZE_MAX: i64 = 1_000;
/// The longest a client may ask to wait for an event (`wait`, in seconds):
/// under the idle timeouts of common proxies and load balancers (60 s).
pub const WAIT_MAX: Duration = Duration::from_secs(30);
/// How often a waiting request asks again: an event reaches a tailing
/// consumer within about this (once its transaction and every older one
/// ended), for one cheap index probe per waiter per interval.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// Requests that may wait at once on one instance: each costs a query per
/// [`POLL_INTERVAL`] (1,280 a second at this bound). Past it a request
/// that would wait gets 503 with `Retry-After` instead.
pub const WAITERS_MAX: usize = 256;

/// A page of the feed.
#[derive(Debug, Clone)]
pub struct Page {
    /// Oldest first, in feed order.
    pub events: Vec<Event>,
    /// Where the next page starts: the last event's cursor, or the cursor
    /// asked for when the page is empty.
    pub next_after: Cursor,
}

impl Page {
    fn after(after: Cursor, events: Vec<Event>) -> Self {
        let next_after = events.last().map_or(after, Event::cursor);
        Self { events, next_after }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    /// [`WAITERS_MAX`] requests are already waiting.
    #[error("too many requests are waiting for events")]
    TooManyWaiters,
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

/// The feed of one server.
#[derive(Debug)]
pub struct Feed {
    pool: PgPool,
    waiters: Arc<Semaphore>,
    /// True once the server is shutting down: every wait ends at once.
    closing: watch::Receiver<bool>,
}

impl Feed {
    pub fn new(pool: PgPool, closing: watch::Receiver<bool>) -> Self {
        Self {
            pool,
            waiters: Arc::new(Semaphore::new(WAITERS_MAX)),
            closing,
        }
    }

    /// The events `principal` may see after `after`, at most `limit`. When
    /// there are none yet and `wait` is not zero, asks again until one
    /// arrives, `wait` (at most [`WAIT_MAX`]) passes or the server shuts
    /// down, and then answers what it has (possibly nothing).
    #[tracing::instrument(skip(self), fields(principal = %principal))]
    pub async fn read(
        &self,
        principal: PrincipalId,
        after: Cursor,
        limit: i64,
        wait: Duration,
    ) -> Result<Page, FeedError> {
        let deadline = Instant::now() + wait.min(WAIT_MAX);
        let limit = limit.clamp(1, PAGE_SIZE_MAX);
        let found = events::page(&self.pool, principal, after, limit).await?;
        if !found.is_empty() || wait.is_zero() || *self.closing.borrow() {
            return Ok(Page::after(after, found));
        }
        let Ok(_slot) = Arc::clone(&self.waiters).try_acquire_owned() else {
            tracing::warn!(
                waiters_max = WAITERS_MAX,
                "a long poll of the event feed was refused: too many waiting"
            );
            return Err(FeedError::TooManyWaiters);
        };
        let _counted = Waiting::start();
        let mut closing = self.closing.clone();
        loop {
            let next = (Instant::now() + POLL_INTERVAL).min(deadline);
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                // A dropped sender is a server that is gone: stop as well.
                _ = closing.wait_for(|closing| *closing) => {
                    return Ok(Page::after(after, Vec::new()));
                }
            }
            let found = events::page(&self.pool, principal, after, limit).await?;
            if !found.is_empty() || Instant::now() >= deadline {
                return Ok(Page::after(after, found));
            }
        }
    }
}

/// Counts a waiting request in [`telemetry::EVENT_FEED_WAITERS`] for as
/// long as it lives, however the request ends (a client that hangs up
/// drops it mid-wait).
struct Waiting;

impl Waiting {
    fn start() -> Self {
        telemetry::event_feed_waiters(1.0);
        Self
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        telemetry::event_feed_waiters(-1.0);
    }
}

/// An event as a principal sees it: in a page of `GET /events`, and as the
/// body of a webhook delivery (the same renderer, so both say the same).
#[derive(Debug, serde::Serialize)]
pub struct EventView<'a> {
    /// Stable: the same event always has this id. Deduplicate by it.
    pub id: Uuid,
    #[serde(rename = "type")]
    pub event_type: &'a str,
    pub occurred_at: String,
    /// Resume after this event (what `next_after` is for the last one).
    pub cursor: String,
    /// For each of the caller's accounts the event moved: its number in
    /// that account's gap-free sequence of events.
    pub sequences: BTreeMap<&'a str, i64>,
    /// The transfer as `GET /transfers/{id}` showed it right after the
    /// change.
    pub resource: &'a serde_json::Value,
}

/// `event` as `principal` sees it.
pub fn view(event: &Event, principal: PrincipalId) -> EventView<'_> {
    EventView {
        id: event.id,
        event_type: &event.event_type,
        occurred_at: crate::transfers::render::timestamp(event.occurred_at),
        cursor: event.cursor().encode(),
        sequences: event.sequences_of(principal).into_iter().collect(),
        resource: &event.resource,
    }
}
