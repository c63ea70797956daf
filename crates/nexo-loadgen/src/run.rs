//! Running a scenario: workers over one HTTP client, latency histograms,
//! answer counts, the checks and the JSON results.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use nexo_client::{
    Client, Error as ClientError, IdempotencyKey, Operation, TransferIntent, TransferRequest,
};
use serde::Serialize;

use crate::check::{self, CheckReport};
use crate::fixture::{self, Fixture};
use crate::observation::{Answer, Observation};
use crate::scenario::{Action, Intent, Plan, Step, Worker};
use crate::{DEFAULT_DURATION, Error, RunArgs, Scenario};

/// A request that takes longer than this is counted as a transport error;
/// far above the server's own request timeout, so it only catches a hang.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Latencies are recorded from 1 µs to this, at 3 significant digits.
const LATENCY_US_MAX: u64 = 120_000_000;

/// Connections the checks use.
const CHECK_CONNECTIONS: u32 = 2;

/// The HTTP side of a run: one client per principal, over one pool of
/// connections, and the currency every request names.
struct Sender {
    clients: Vec<Client>,
    currency: String,
}

impl Sender {
    /// One attempt, never retried by the client: each request is measured
    /// and checked on its own, and the scenarios make their own retries.
    async fn send(&self, intent: &Intent) -> (Answer, Option<Bytes>, Duration) {
        let key = match IdempotencyKey::parse(&*intent.key) {
            Ok(key) => key,
            Err(e) => return (Answer::Transport(e.to_string()), None, Duration::ZERO),
        };
        let request = TransferRequest::new(
            Fixture::account_id(intent.from),
            Fixture::account_id(intent.to),
            intent.amount,
            self.currency.as_str(),
        );
        let transfer = match intent.action {
            Action::Transfer => TransferIntent::resume(key, request),
            Action::Hold => TransferIntent::resume(key, request.pending(None)),
            Action::PostHold(transfer_id) => TransferIntent::resume_operation(
                key,
                Operation::PostHold {
                    transfer_id,
                    amount_minor: None,
                },
            ),
        };
        let started = Instant::now();
        let sent = self.clients[intent.principal]
            .send_transfer_once(&transfer)
            .await;
        let elapsed = started.elapsed();
        let (answer, body) = match sent {
            Ok(created) => (
                Answer::Created {
                    status: created.status,
                    transfer_id: created.transfer.transfer_id,
                    replayed: created.replayed,
                },
                Some(created.body),
            ),
            Err(ClientError::Problem(p)) => (
                Answer::Problem {
                    status: p.status,
                    slug: p.problem.slug().to_owned(),
                },
                Some(p.body),
            ),
            Err(ClientError::Transport(e)) => (Answer::Transport(e.to_string()), None),
            Err(other) => match (other.status(), other.body()) {
                (Some(status), body) => (Answer::Other { status }, body.cloned()),
                (None, _) => (Answer::Transport(other.to_string()), None),
            },
        };
        (answer, body, elapsed)
    }
}

/// One worker's tally.
struct Tally {
    latency_us: Histogram<u64>,
    statuses: BTreeMap<String, u64>,
    measured: u64,
    errors: u64,
    /// Replays whose bytes differ from the first answer.
    replay_mismatches: u64,
    last_measured: Option<Instant>,
    /// The first transport error, to say what went wrong.
    first_transport_error: Option<String>,
    observations: Vec<Observation>,
}

impl Tally {
    fn new() -> Result<Self, Error> {
        Ok(Self {
            latency_us: Histogram::new_with_bounds(1, LATENCY_US_MAX, 3)?,
            statuses: BTreeMap::new(),
            measured: 0,
            errors: 0,
            replay_mismatches: 0,
            last_measured: None,
            first_transport_error: None,
            observations: Vec::new(),
        })
    }

    fn record(&mut self, measured: bool, observation: Observation, latency: Duration) {
        if measured {
            self.measured += 1;
            self.last_measured = Some(Instant::now());
            let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
            self.latency_us
                .saturating_record(us.clamp(1, LATENCY_US_MAX));
            *self.statuses.entry(observation.answer.label()).or_default() += 1;
            if observation.answer.is_error() {
                self.errors += 1;
            }
        }
        if let Answer::Transport(e) = &observation.answer {
            self.first_transport_error.get_or_insert_with(|| e.clone());
        }
        self.observations.push(observation);
    }
}

/// When to measure and when to stop.
struct Clock {
    measure_from: Instant,
    deadline: Option<Instant>,
    budget: Option<u64>,
    taken: AtomicU64,
}

impl Clock {
    /// Whether to send another request, and whether it is measured.
    fn next(&self) -> Option<bool> {
        let now = Instant::now();
        if self.deadline.is_some_and(|d| now >= d) {
            return None;
        }
        let measured = now >= self.measure_from;
        if measured
            && let Some(budget) = self.budget
            && self.taken.fetch_add(1, Ordering::Relaxed) >= budget
        {
            return None;
        }
        Some(measured)
    }
}

async fn work(
    mut worker: Worker,
    plan: Arc<Plan>,
    sender: Arc<Sender>,
    clock: Arc<Clock>,
    replay_bodies: Arc<HashMap<Arc<str>, Bytes>>,
) -> Result<Tally, Error> {
    let mut tally = Tally::new()?;
    while let Some(measured) = clock.next() {
        match worker.next(&plan) {
            Step::Send(intent) => {
                let (answer, body, latency) = sender.send(&intent).await;
                if let (Some(expected), Some(body)) = (replay_bodies.get(&intent.key), &body)
                    && expected != body
                {
                    tally.replay_mismatches += 1;
                }
                tally.record(measured, Observation::of(intent, answer), latency);
            }
            Step::Twice(intent) => {
                let ((a, _, la), (b, _, lb)) =
                    tokio::join!(sender.send(&intent), sender.send(&intent));
                for (answer, latency) in [(a, la), (b, lb)] {
                    tally.record(measured, Observation::of(intent.clone(), answer), latency);
                }
            }
            Step::HoldThenPost(hold) => {
                let (answer, _, latency) = sender.send(&hold).await;
                let post = match &answer {
                    Answer::Created { transfer_id, .. } => Some(hold.post_of(*transfer_id)),
                    _ => None,
                };
                tally.record(measured, Observation::of(hold, answer), latency);
                if let Some(post) = post {
                    let (answer, _, latency) = sender.send(&post).await;
                    tally.record(measured, Observation::of(post, answer), latency);
                }
            }
            Step::Conflict(intent) => {
                let (answer, _, latency) = sender.send(&intent).await;
                let observation = Observation {
                    intent,
                    conflict: true,
                    answer,
                };
                tally.record(measured, observation, latency);
            }
        }
    }
    Ok(tally)
}

#[derive(Debug, Serialize)]
pub struct Results {
    pub scenario: Scenario,
    pub concurrency: u32,
    pub url: String,
    pub accounts: u32,
    pub measured_s: f64,
    pub requests: u64,
    pub throughput_rps: f64,
    pub latency_ms: Latency,
    pub statuses: BTreeMap<String, u64>,
    /// Transport errors and 5xx answers among the measured requests.
    pub errors: u64,
    pub first_transport_error: Option<String>,
    pub replay_mismatches: u64,
    pub server: Option<ServerMemory>,
    pub checks: Option<CheckReport>,
    pub ok: bool,
}

#[derive(Debug, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

/// The server's resident memory, from /proc/<pid>/status.
#[derive(Debug, Serialize)]
pub struct ServerMemory {
    pub pid: u32,
    /// Peak resident set since the process started.
    pub vm_hwm_kib: u64,
    pub vm_rss_kib: u64,
}

fn server_memory(pid: u32) -> Result<ServerMemory, Error> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .ok_or_else(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(ServerMemory {
        pid,
        vm_hwm_kib: field("VmHWM:")?,
        vm_rss_kib: field("VmRSS:")?,
    })
}

pub async fn run(database_url: &str, args: &RunArgs) -> Result<bool, Error> {
    let fixture = Fixture::load(&args.fixture)?;
    let accounts = args.accounts.unwrap_or(fixture.accounts);
    if !(2..=fixture.accounts).contains(&accounts) {
        return Err(format!("--accounts must be 2 to {}", fixture.accounts).into());
    }
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(2 * args.concurrency as usize)
        .tcp_nodelay(true)
        .build()?;
    let client = Client::builder(args.url.as_str())
        .http_client(http)
        .attempt_timeout(CLIENT_TIMEOUT)
        .build()?;
    let sender = Arc::new(Sender {
        clients: fixture
            .principals
            .iter()
            .map(|p| client.with_token(p.token.as_str()))
            .collect(),
        currency: fixture.currency.clone(),
    });
    let mut plan = Plan::new(args.scenario, fixture, accounts, args.storm_fanout);
    let pool = if args.no_check {
        None
    } else {
        Some(fixture::connect(database_url, CHECK_CONNECTIONS).await?)
    };

    let mut replay_bodies = HashMap::new();
    let mut prepared = Vec::new();
    if args.scenario == Scenario::Replay {
        let (set, bodies, observations) = prepare_replays(&plan, &sender, args).await?;
        plan.replay_set = set;
        replay_bodies = bodies;
        prepared = observations;
    }
    let before = match (&pool, args.scenario) {
        (Some(pool), Scenario::Replay) => Some(check::write_marks(pool).await?),
        _ => None,
    };

    let plan = Arc::new(plan);
    let replay_bodies = Arc::new(replay_bodies);
    let started = Instant::now();
    let measure_from = started + args.warmup;
    let duration = match (args.duration, args.requests) {
        (Some(d), _) => Some(d),
        (None, Some(_)) => None,
        (None, None) => Some(DEFAULT_DURATION),
    };
    let clock = Arc::new(Clock {
        measure_from,
        deadline: duration.map(|d| measure_from + d),
        budget: args.requests,
        taken: AtomicU64::new(0),
    });
    let mut workers = tokio::task::JoinSet::new();
    for id in 0..args.concurrency {
        workers.spawn(work(
            Worker::new(id),
            plan.clone(),
            sender.clone(),
            clock.clone(),
            replay_bodies.clone(),
        ));
    }
    let mut merged = Tally::new()?;
    merged.observations = prepared;
    while let Some(done) = workers.join_next().await {
        let tally = done??;
        merged.latency_us.add(&tally.latency_us)?;
        for (label, n) in tally.statuses {
            *merged.statuses.entry(label).or_default() += n;
        }
        merged.measured += tally.measured;
        merged.errors += tally.errors;
        merged.replay_mismatches += tally.replay_mismatches;
        merged.last_measured = merged.last_measured.max(tally.last_measured);
        merged.first_transport_error = merged.first_transport_error.or(tally.first_transport_error);
        merged.observations.extend(tally.observations);
    }
    let measured_s = merged
        .last_measured
        .map_or(0.0, |last| (last - measure_from).as_secs_f64());
    let server = args.server_pid.map(server_memory).transpose()?;

    let checks = match &pool {
        Some(pool) => Some(check::check(pool, &plan, &merged.observations, before).await?),
        None => None,
    };
    let ok = checks.as_ref().is_none_or(CheckReport::passed)
        && merged.replay_mismatches == 0
        && (!args.fail_on_errors || merged.errors == 0);
    let h = &merged.latency_us;
    let ms = |us: u64| us as f64 / 1000.0;
    let results = Results {
        scenario: args.scenario,
        concurrency: args.concurrency,
        url: args.url.clone(),
        accounts,
        measured_s,
        requests: merged.measured,
        throughput_rps: if measured_s > 0.0 {
            merged.measured as f64 / measured_s
        } else {
            0.0
        },
        latency_ms: Latency {
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
            mean: h.mean() / 1000.0,
        },
        statuses: merged.statuses,
        errors: merged.errors,
        first_transport_error: merged.first_transport_error,
        replay_mismatches: merged.replay_mismatches,
        server,
        checks,
        ok,
    };
    print_summary(&results);
    if let Some(path) = &args.out {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_vec_pretty(&results)?)?;
    }
    Ok(ok)
}

/// Sends each intent of the `replay` set once, before anything is measured,
/// and keeps the bytes of its first answer.
async fn prepare_replays(
    plan: &Plan,
    sender: &Arc<Sender>,
    args: &RunArgs,
) -> Result<(Vec<Intent>, HashMap<Arc<str>, Bytes>, Vec<Observation>), Error> {
    let mut rng = rand::rng();
    let intents: Vec<Intent> = (0..args.replay_intents)
        .map(|i| plan.fresh(&mut rng, None, format!("replay-{}-{i}", plan.run_id)))
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    for chunk in intents.chunks(intents.len().div_ceil(args.concurrency as usize)) {
        let (chunk, sender) = (chunk.to_vec(), sender.clone());
        tasks.spawn(async move {
            let mut done = Vec::with_capacity(chunk.len());
            for intent in chunk {
                let (answer, body, _) = sender.send(&intent).await;
                done.push((intent, answer, body));
            }
            done
        });
    }
    let mut bodies = HashMap::new();
    let mut observations = Vec::new();
    while let Some(done) = tasks.join_next().await {
        for (intent, answer, body) in done? {
            match (&answer, body) {
                (Answer::Created { .. }, Some(body)) => {
                    bodies.insert(intent.key.clone(), body);
                }
                _ => {
                    return Err(format!(
                        "preparing replays: {} got {}",
                        intent.key,
                        answer.label()
                    )
                    .into());
                }
            }
            observations.push(Observation::of(intent, answer));
        }
    }
    Ok((intents, bodies, observations))
}

fn print_summary(r: &Results) {
    println!(
        "{:<7} c={:<3} {:>9.1} req/s  p50 {:>7.2} ms  p90 {:>7.2} ms  p99 {:>7.2} ms  max {:>8.2} ms  ({} requests in {:.1}s)",
        format!("{:?}", r.scenario).to_lowercase(),
        r.concurrency,
        r.throughput_rps,
        r.latency_ms.p50,
        r.latency_ms.p90,
        r.latency_ms.p99,
        r.latency_ms.max,
        r.requests,
        r.measured_s
    );
    let statuses: Vec<String> = r
        .statuses
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    println!("  answers: {}", statuses.join(", "));
    if let Some(m) = &r.server {
        println!(
            "  server memory: peak {:.1} MiB, now {:.1} MiB",
            m.vm_hwm_kib as f64 / 1024.0,
            m.vm_rss_kib as f64 / 1024.0
        );
    }
    if let Some(e) = &r.first_transport_error {
        println!("  first transport error: {e}");
    }
    if r.replay_mismatches > 0 {
        println!("  REPLAYS WITH OTHER BYTES: {}", r.replay_mismatches);
    }
    if let Some(c) = &r.checks {
        c.print();
    }
    println!("  {}", if r.ok { "OK" } else { "FAILED" });
}
