//! A client that moves money effectively once over a network that loses
//! answers: what an SDK for nexo-transfers should do.
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
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use rand::Rng;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(about = "Send one transfer effectively once, retrying safely")]
struct Args {
    /// The server's base URL.
    #[arg(long, env = "NEXO_BASE_URL", default_value = "http://127.0.0.1:8080")]
    base_url: String,
    /// Bearer token (the demo principal A by default).
    #[arg(
        long,
        env = "NEXO_TOKEN",
        default_value = "tok_test_A",
        hide_env_values = true
    )]
    token: String,
    #[arg(long)]
    from: String,
    #[arg(long)]
    to: String,
    #[arg(long)]
    amount_minor: i64,
    #[arg(long)]
    currency: String,
    #[arg(long)]
    description: Option<String>,
    /// Resume an intent sent earlier with this key (same body!) instead of
    /// starting a new one.
    #[arg(long)]
    key: Option<String>,
    /// Attempts in all, the first included.
    #[arg(long, default_value_t = RetryPolicy::default().attempts_max)]
    attempts_max: u32,
    /// How long one attempt may take before it counts as timed out.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// The body of `POST /transfers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransferRequest {
    pub from: String,
    pub to: String,
    pub amount_minor: i64,
    pub currency: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// One transfer intent and the key that names it. The key is made with the
/// intent and cannot be changed or moved to another request, so no retry
/// can ever send it with a different body.
#[derive(Debug)]
pub struct Intent {
    key: String,
    body: Vec<u8>,
}

impl Intent {
    /// A new intent with a fresh key (a random UUID).
    pub fn new(request: &TransferRequest) -> Self {
        Self::resume(uuid::Uuid::new_v4().to_string(), request)
    }

    /// An intent sent before under `key`, to learn its outcome. The request
    /// must be the original one: another body is a 422 from the server.
    pub fn resume(key: String, request: &TransferRequest) -> Self {
        // Serialising a struct of strings and an integer cannot fail.
        let body = serde_json::to_vec(request).unwrap_or_default();
        Self { key, body }
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

/// When and how often to try again.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts_max: u32,
    /// The backoff ceiling before the first retry; it doubles per retry.
    pub backoff_base: Duration,
    /// The backoff ceiling never grows past this.
    pub backoff_cap: Duration,
    /// A `Retry-After` longer than this is cut to it, so a confused server
    /// cannot park the client for hours.
    pub retry_after_max: Duration,
}

impl Default for RetryPolicy {
    /// Six attempts over about ten seconds in the worst case: long enough to
    /// ride out a restart of the server, short enough for an interactive
    /// caller. 409s carry `Retry-After: 1`, so they wait a second each.
    fn default() -> Self {
        Self {
            attempts_max: 6,
            backoff_base: Duration::from_millis(100),
            backoff_cap: Duration::from_secs(5),
            retry_after_max: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `retry` (1 for the first retry): full
    /// jitter, uniform between zero and the capped exponential ceiling, so
    /// clients that failed together do not retry together; but never less
    /// than the server's `Retry-After`.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let ceiling = self
            .backoff_base
            .saturating_mul(2u32.saturating_pow(retry.saturating_sub(1)))
            .min(self.backoff_cap);
        let ceiling_ms = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
        let jittered = Duration::from_millis(rand::rng().random_range(0..=ceiling_ms));
        match retry_after {
            Some(wait) => jittered.max(wait.min(self.retry_after_max)),
            None => jittered,
        }
    }
}

/// What one attempt ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptResult {
    /// An HTTP answer, with `Idempotent-Replayed: true` or not.
    Answer { status: u16, replayed: bool },
    /// No answer: a timeout or a broken connection.
    NoAnswer { error: String },
}

#[derive(Debug, Clone)]
pub struct Attempt {
    pub number: u32,
    pub started: Instant,
    pub result: AttemptResult,
}

/// The answer the client settled on.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub key: String,
    pub status: u16,
    pub replayed: bool,
    pub body: bytes::Bytes,
    pub attempts: Vec<Attempt>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("gave up after {attempts} attempts; the last one: {last}")]
    GaveUp { attempts: u32, last: String },
    #[error("cannot send the request: {0}")]
    Request(String),
}

/// Whether an answer may change if the same request is sent again.
pub fn is_retryable_status(status: StatusCode) -> bool {
    status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// `Retry-After` as delta-seconds or an HTTP date.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// Sends `intent` until an answer is final or the attempts run out,
/// printing one line per attempt on `log`.
pub async fn send(
    client: &reqwest::Client,
    base_url: &str,
    token: &str,
    intent: &Intent,
    policy: &RetryPolicy,
    log: &mut impl Write,
) -> Result<Outcome, ClientError> {
    let url = format!("{}/transfers", base_url.trim_end_matches('/'));
    let mut attempts = Vec::new();
    for number in 1..=policy.attempts_max.max(1) {
        let started = Instant::now();
        let sent = client
            .post(&url)
            .bearer_auth(token)
            .header("Idempotency-Key", &intent.key)
            .header("Content-Type", "application/json")
            .body(intent.body.clone())
            .send()
            .await;
        let (result, wait_at_least, answer) = match read_answer(sent).await {
            Ok((status, headers, body)) => {
                let replayed = headers
                    .get("idempotent-replayed")
                    .is_some_and(|v| v.as_bytes() == b"true");
                let result = AttemptResult::Answer {
                    status: status.as_u16(),
                    replayed,
                };
                let final_answer = !is_retryable_status(status);
                (
                    result,
                    retry_after(&headers),
                    final_answer.then_some((status, replayed, body)),
                )
            }
            Err(e) if e.is_builder() => return Err(ClientError::Request(e.to_string())),
            Err(e) => (
                AttemptResult::NoAnswer {
                    error: describe(&e),
                },
                None,
                None,
            ),
        };
        let description = match &result {
            AttemptResult::Answer { status, replayed } => format!(
                "HTTP {status}{}",
                if *replayed { " (replayed)" } else { "" }
            ),
            AttemptResult::NoAnswer { error } => error.clone(),
        };
        attempts.push(Attempt {
            number,
            started,
            result,
        });
        let prefix = format!(
            "attempt {number}/{} key={}: {description}",
            policy.attempts_max, intent.key
        );
        if let Some((status, replayed, body)) = answer {
            let _ = writeln!(log, "{prefix}: final");
            return Ok(Outcome {
                key: intent.key.clone(),
                status: status.as_u16(),
                replayed,
                body,
                attempts,
            });
        }
        if number == policy.attempts_max {
            let _ = writeln!(log, "{prefix}: no attempts left");
            return Err(ClientError::GaveUp {
                attempts: number,
                last: description,
            });
        }
        let delay = policy.delay(number, wait_at_least);
        let _ = writeln!(
            log,
            "{prefix}: retrying with the same key in {} ms",
            delay.as_millis()
        );
        tokio::time::sleep(delay).await;
    }
    Err(ClientError::GaveUp {
        attempts: 0,
        last: "no attempt was made".to_owned(),
    })
}

/// The whole answer, or the error that stopped it: a body that breaks off
/// half-way is as lost as no answer at all.
async fn read_answer(
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<(StatusCode, HeaderMap, bytes::Bytes), reqwest::Error> {
    let response = sent?;
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.bytes().await?;
    Ok((status, headers, body))
}

fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "connection lost before the answer"
    };
    let mut cause = String::new();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        cause = s.to_string();
        source = s.source();
    }
    if cause.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind} ({cause})")
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let client = match reqwest::Client::builder().timeout(args.timeout).build() {
        Ok(client) => client,
        Err(e) => {
            eprintln!("error: cannot build the HTTP client: {e}");
            return ExitCode::from(2);
        }
    };
    let request = TransferRequest {
        from: args.from,
        to: args.to,
        amount_minor: args.amount_minor,
        currency: args.currency,
        description: args.description,
    };
    let intent = match args.key {
        Some(key) => Intent::resume(key, &request),
        None => Intent::new(&request),
    };
    let policy = RetryPolicy {
        attempts_max: args.attempts_max,
        ..RetryPolicy::default()
    };
    match send(
        &client,
        &args.base_url,
        &args.token,
        &intent,
        &policy,
        &mut std::io::stderr(),
    )
    .await
    {
        Ok(outcome) => {
            println!("{}", String::from_utf8_lossy(&outcome.body));
            if (200..300).contains(&outcome.status) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("error: {e}; resume with --key {}", intent.key());
            ExitCode::from(2)
        }
    }
}
