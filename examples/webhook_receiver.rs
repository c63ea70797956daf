//! A webhook receiver for nexo-transfers, as a receiver should be written:
//!
//! - It checks the `Nexo-Signature` header over the exact bytes received
//!   (`nexo-signature`, HMAC-SHA256 over `"{t}.{body}"`) before reading the
//!   body, and refuses a forgery (no signature matches any of its secrets)
//!   and a replay (a signature older than the tolerance, 5 minutes) with a
//!   400 the sender records.
//! - It drops duplicates by the event's id, which is in the signed body: the
//!   server delivers at least once, so the same event may arrive again (a
//!   retry after a lost answer, a redelivery asked by an operator). A
//!   duplicate is answered 200, so the sender stops retrying it.
//! - It answers at once and does its work after: the server waits a bounded
//!   time for an answer and retries what timed out.
//!
//! ```sh
//! NEXO_WEBHOOK_SECRET=whsec_... cargo run --example webhook_receiver -- --bind 127.0.0.1:8090
//! ```
//!
//! Each new event is printed on stdout as one JSON line; refusals and
//! duplicates are reported on stderr. Here the ids seen are kept in memory
//! (the last `SEEN_IDS_MAX`); a real receiver records each id durably, in
//! the same transaction as the effect of the event.

use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use clap::Parser;
use nexo_signature::{DEFAULT_TOLERANCE, HEADER, SignatureError};

/// Event ids remembered to drop duplicates: the oldest is forgotten first.
pub const SEEN_IDS_MAX: usize = 100_000;

/// The largest body read; events are a few hundred bytes.
pub const BODY_BYTES_MAX: usize = 64 * 1024;

#[derive(Debug, Parser)]
#[command(
    about = "Receive nexo-transfers webhooks: check signatures, drop duplicates, print events"
)]
pub struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub bind: SocketAddr,
    /// The endpoint's signing secret; give it twice while a secret is
    /// being rotated (either verifies).
    #[arg(
        long = "secret",
        env = "NEXO_WEBHOOK_SECRET",
        hide_env_values = true,
        value_delimiter = ',',
        required = true
    )]
    pub secrets: Vec<String>,
    /// How old a signature may be, in seconds.
    #[arg(long, default_value_t = DEFAULT_TOLERANCE.as_secs())]
    pub tolerance_seconds: u64,
    /// The path the endpoint was registered with.
    #[arg(long, default_value = "/webhooks/nexo")]
    pub path: String,
}

/// What a receiver knows and remembers.
pub struct Receiver {
    secrets: Vec<Vec<u8>>,
    tolerance: Duration,
    seen: Mutex<Seen>,
    out: Arc<Mutex<dyn Write + Send>>,
    log: Arc<Mutex<dyn Write + Send>>,
}

#[derive(Default)]
struct Seen {
    ids: HashSet<String>,
    order: VecDeque<String>,
}

impl Seen {
    /// Whether `id` is new; remembers it.
    fn first_time(&mut self, id: &str) -> bool {
        if self.ids.contains(id) {
            return false;
        }
        if self.order.len() == SEEN_IDS_MAX
            && let Some(oldest) = self.order.pop_front()
        {
            self.ids.remove(&oldest);
        }
        self.ids.insert(id.to_owned());
        self.order.push_back(id.to_owned());
        true
    }
}

impl Receiver {
    pub fn new(
        args: &Args,
        out: Arc<Mutex<dyn Write + Send>>,
        log: Arc<Mutex<dyn Write + Send>>,
    ) -> Self {
        Self {
            secrets: args.secrets.iter().map(|s| s.as_bytes().to_vec()).collect(),
            tolerance: Duration::from_secs(args.tolerance_seconds),
            seen: Mutex::default(),
            out,
            log,
        }
    }

    fn say(&self, sink: &Mutex<dyn Write + Send>, line: &str) {
        if let Ok(mut sink) = sink.lock() {
            let _ = writeln!(sink, "{line}");
        }
    }
}

pub fn router(receiver: Arc<Receiver>, path: &str) -> Router {
    Router::new()
        .route(path, post(receive))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(receiver)
}

async fn receive(
    State(receiver): State<Arc<Receiver>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let secrets: Vec<&[u8]> = receiver.secrets.iter().map(Vec::as_slice).collect();
    let header = headers.get(HEADER).and_then(|v| v.to_str().ok());
    if let Err(refused) = nexo_signature::verify(header, &body, &secrets, now, receiver.tolerance) {
        let why = match refused {
            SignatureError::TooOld { .. } => "replayed or late",
            SignatureError::Mismatch => "forged",
            _ => "unsigned",
        };
        receiver.say(&receiver.log, &format!("refused ({why}): {refused}"));
        return (StatusCode::BAD_REQUEST, refused.to_string());
    }
    // Only a verified body is read: its id is signed, a header's is not.
    let id = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|event| {
            event
                .get("id")
                .and_then(|id| id.as_str())
                .map(str::to_owned)
        });
    let Some(id) = id else {
        receiver.say(&receiver.log, "refused: a signed body without an event id");
        return (StatusCode::BAD_REQUEST, "no event id".to_owned());
    };
    let first = receiver
        .seen
        .lock()
        .map(|mut seen| seen.first_time(&id))
        .unwrap_or(true);
    if !first {
        receiver.say(&receiver.log, &format!("duplicate {id}: already handled"));
        return (StatusCode::OK, "duplicate".to_owned());
    }
    receiver.say(&receiver.out, &String::from_utf8_lossy(&body));
    (StatusCode::OK, "received".to_owned())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let receiver = Arc::new(Receiver::new(
        &args,
        Arc::new(Mutex::new(std::io::stdout())),
        Arc::new(Mutex::new(std::io::stderr())),
    ));
    let listener = match tokio::net::TcpListener::bind(args.bind).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", args.bind);
            return std::process::ExitCode::from(2);
        }
    };
    eprintln!("receiving webhooks on http://{}{}", args.bind, args.path);
    match axum::serve(listener, router(receiver, &args.path)).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
