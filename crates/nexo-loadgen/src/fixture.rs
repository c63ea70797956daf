//! The principals and funded accounts a load run uses, created through the
//! server library's operator actions (so every opening balance is a ledger
//! deposit), and the fixture file that carries their tokens to `run`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use nexo_transfers::admin::{self, ACCOUNTS_PER_PRINCIPAL_MAX};

use crate::Error;

#[derive(Debug, Clone, clap::Args)]
pub struct SetupArgs {
    /// Accounts to open, named acc_L1 to acc_L<N>; each principal holds a
    /// block of `accounts_per_principal` of them.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(2..=ACCOUNTS_MAX))]
    pub accounts: u32,
    /// Opening deposit of every account, in minor units: large enough that
    /// no run drains an account, even the hot one.
    #[arg(long, default_value_t = 1_000_000_000_000)]
    pub balance_minor: i64,
    #[arg(long, default_value = "USD")]
    pub currency: String,
    /// Where to write the fixture (tokens included: keep it out of commits).
    #[arg(long, default_value = "target/loadgen-fixture.json")]
    pub fixture: PathBuf,
}

/// Bounds a setup: 100,000 accounts take a few minutes to open and fund.
pub const ACCOUNTS_MAX: i64 = 100_000;

/// Accounts opened and funded at once during setup; deposits serialise on
/// the funding account's row anyway, so more would only queue.
const SETUP_TASKS: u32 = 8;

/// Each principal's block of accounts: the most one principal may hold.
const ACCOUNTS_PER_PRINCIPAL: u32 = ACCOUNTS_PER_PRINCIPAL_MAX as u32;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fixture {
    pub currency: String,
    pub accounts: u32,
    pub accounts_per_principal: u32,
    pub principals: Vec<FixturePrincipal>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FixturePrincipal {
    pub name: String,
    pub id: Uuid,
    pub token: String,
}

impl Fixture {
    /// The id of account number `n` (1-based).
    pub fn account_id(n: u32) -> String {
        format!("acc_L{n}")
    }

    /// The index of the principal that owns account number `n`.
    pub fn owner_of(&self, n: u32) -> usize {
        ((n - 1) / self.accounts_per_principal) as usize
    }

    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "cannot read the fixture {} (run `loadgen setup` first): {e}",
                path.display()
            )
        })?;
        Ok(serde_json::from_str(&text)?)
    }
}

pub async fn connect(database_url: &str, connections: u32) -> Result<PgPool, Error> {
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .connect(database_url)
        .await
        .map_err(|e| format!("cannot connect to the database (DATABASE_URL): {e}"))?)
}

pub async fn setup(database_url: &str, args: &SetupArgs) -> Result<bool, Error> {
    let started = Instant::now();
    let pool = connect(database_url, SETUP_TASKS).await?;
    nexo_transfers::db::migrate(&pool).await?;

    let principal_count = args.accounts.div_ceil(ACCOUNTS_PER_PRINCIPAL);
    let mut principals = Vec::new();
    for p in 0..principal_count {
        let created = admin::create_principal(&pool, &format!("loadgen-{p:03}"))
            .await
            .map_err(|e| format!("{e} (setup needs a fresh database)"))?;
        principals.push(FixturePrincipal {
            name: created.name,
            id: created.principal_id.as_uuid(),
            token: created.token,
        });
    }
    let fixture = Fixture {
        currency: args.currency.clone(),
        accounts: args.accounts,
        accounts_per_principal: ACCOUNTS_PER_PRINCIPAL,
        principals,
    };

    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..SETUP_TASKS {
        let (pool, fixture, args) = (pool.clone(), fixture.clone(), args.clone());
        tasks.spawn(async move {
            for n in (1 + task..=fixture.accounts).step_by(SETUP_TASKS as usize) {
                let id = Fixture::account_id(n);
                let owner = &fixture.principals[fixture.owner_of(n)].name;
                admin::open_account(&pool, owner, &fixture.currency, Some(&id)).await?;
                admin::deposit(
                    &pool,
                    &id,
                    args.balance_minor,
                    &format!("loadgen-open-{id}"),
                )
                .await?;
            }
            Ok::<(), admin::AdminError>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    // Fresh statistics, so that the first connections of a run plan the
    // foreign-key checks against a table of the right size.
    sqlx::query("ANALYZE").execute(&pool).await?;

    if let Some(dir) = args.fixture.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.fixture, serde_json::to_vec_pretty(&fixture)?)?;
    eprintln!(
        "opened and funded {} accounts for {} principals in {:.1}s; fixture in {}",
        fixture.accounts,
        fixture.principals.len(),
        started.elapsed().as_secs_f64(),
        args.fixture.display()
    );
    Ok(true)
}
