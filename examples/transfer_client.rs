//! A command line that moves money effectively once over a network that
//! loses answers, on top of the client library (`crates/nexo-client`),
//! which does what an SDK for nexo-transfers should do:
//!
//! - One idempotency key per transfer intent, made when the intent is made
//!   and never used for anything else: a new intent always gets a new key.
//! - The same key and the same body on every retry of that intent.
//! - Retries on timeouts, connection errors, 409 (the first attempt is still
//!   running), 429 and 5xx, after a capped exponential backoff with full
//!   jitter, and never sooner than the server's `Retry-After`.
//! - Any other answer is final: 2xx, or a 4xx that retrying cannot change.
//!
//! ```sh
//! cargo run --example transfer_client -- \
//!     --from acc_00001 --to acc_00002 --amount-minor 10000 --currency USD
//! ```
//!
//! Each attempt is printed on stderr; the final answer's body on stdout.
//! Exit status: 0 for a 2xx, 1 for another final answer, 2 when it gave up.
//! Plain HTTP only (reqwest is built without TLS here); put a TLS feature on
//! reqwest to talk HTTPS.

use std::io::Write;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use nexo_client::{
    Client, Error, IdempotencyKey, RetryPolicy, TransferIntent, TransferOutcome, TransferRequest,
};

#[derive(Debug, Parser)]
#[command(about = "Send one transfer effectively once, retrying safely")]
pub struct Args {
    /// The server's base URL.
    #[arg(long, env = "NEXO_BASE_URL", default_value = "http://127.0.0.1:8080")]
    pub base_url: String,
    /// Bearer token (the demo principal A by default).
    #[arg(
        long,
        env = "NEXO_TOKEN",
        default_value = "tok_test_A",
        hide_env_values = true
    )]
    pub token: String,
    #[arg(long)]
    pub from: String,
    #[arg(long)]
    pub to: String,
    #[arg(long)]
    pub amount_minor: i64,
    #[arg(long)]
    pub currency: String,
    #[arg(long)]
    pub description: Option<String>,
    /// Make a hold: reserve the amount, to be posted or voided later.
    #[arg(long)]
    pub pending: bool,
    /// With `--pending`: seconds until the hold expires (the server's
    /// default when absent).
    #[arg(long, requires = "pending")]
    pub expires_in_seconds: Option<i64>,
    /// Resume an intent sent earlier with this key (same body!) instead of
    /// starting a new one.
    #[arg(long)]
    pub key: Option<IdempotencyKey>,
    /// Attempts in all, the first included.
    #[arg(long, default_value_t = RetryPolicy::DEFAULT_MAX_ATTEMPTS)]
    pub attempts_max: u32,
    /// How long one attempt may take before it counts as timed out.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

/// What the command ended with: its exit status and the final answer's
/// body, if there was a final answer.
pub struct Finished {
    pub status: u8,
    pub body: Option<bytes::Bytes>,
    pub key: IdempotencyKey,
    pub outcome: Option<TransferOutcome>,
}

/// Sends the intent the arguments describe; writes a line per attempt and
/// any error to `log`.
pub async fn run(args: Args, log: Arc<Mutex<dyn Write + Send>>) -> Finished {
    let mut request = TransferRequest::new(args.from, args.to, args.amount_minor, args.currency);
    request.description = args.description;
    if args.pending {
        request = request.pending(args.expires_in_seconds);
    }
    let intent = match args.key {
        Some(key) => TransferIntent::resume(key, request),
        None => TransferIntent::new(request),
    };
    let key = intent.key().clone();
    let say = {
        let log = log.clone();
        move |line: &dyn std::fmt::Display| {
            if let Ok(mut log) = log.lock() {
                let _ = writeln!(log, "{line}");
            }
        }
    };
    let observer = say.clone();
    let client = Client::builder(args.base_url)
        .token(args.token)
        .attempt_timeout(args.timeout)
        .retry_policy(RetryPolicy {
            max_attempts: args.attempts_max,
            ..RetryPolicy::default()
        })
        .on_attempt(move |attempt| observer(attempt))
        .build();
    let client = match client {
        Ok(client) => client,
        Err(e) => {
            say(&format_args!("error: {e}"));
            return Finished {
                status: 2,
                body: None,
                key,
                outcome: None,
            };
        }
    };
    match client.send_transfer(&intent).await {
        Ok(outcome) => Finished {
            status: 0,
            body: Some(outcome.body.clone()),
            key,
            outcome: Some(outcome),
        },
        // A final answer that is not a success (a refusal such as
        // insufficient funds): shown as it came. An answer that may still
        // change (a 503 on the last attempt) means the client gave up.
        Err(e) if !e.is_retryable() && !matches!(e, Error::GaveUp { .. }) && e.body().is_some() => {
            Finished {
                status: if e.status().is_some_and(|s| (200..300).contains(&s)) {
                    0
                } else {
                    1
                },
                body: e.body().cloned(),
                key,
                outcome: None,
            }
        }
        Err(e) => {
            say(&format_args!("error: {e}; resume with --key {key}"));
            Finished {
                status: 2,
                body: None,
                key,
                outcome: None,
            }
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let finished = run(args, Arc::new(Mutex::new(std::io::stderr()))).await;
    if let Some(body) = &finished.body {
        println!("{}", String::from_utf8_lossy(body));
    }
    ExitCode::from(finished.status)
}
