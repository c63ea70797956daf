//! Operator actions without SQL: principals, accounts, deposits, and the
//! demo fixtures. Deposits are ledger transfers from the currency's funding
//! account, never balance edits, so the ledger always sums to zero.

use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::auth;
use crate::idempotency::Fingerprint;
use crate::ledger::repo::Settled;
use crate::ledger::{
    self, AccountId, AmountMinor, Currency, LedgerError, PostingKind, PostingRequest, Transfer,
};
use crate::principal::PrincipalId;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("no principal named {0:?}")]
    UnknownPrincipal(String),
    #[error("a principal named {0:?} already exists")]
    PrincipalExists(String),
    #[error("principal names are 1 to 64 characters")]
    InvalidPrincipalName,
    #[error("{0} is not a supported currency")]
    UnsupportedCurrency(String),
    #[error("{0}")]
    InvalidAccountId(String),
    #[error("account {id} already exists with another owner or currency")]
    AccountConflict { id: String },
    #[error("no customer account {0}")]
    UnknownAccount(String),
    #[error("amount_minor: {0}")]
    InvalidAmount(String),
    #[error("reference {0:?} was already used for a different deposit")]
    ReferenceReused(String),
    #[error("principal {name:?} exists, and this token is not one of its live tokens")]
    TokenMismatch { name: String },
    #[error("token labels are 1 to 64 visible ASCII characters")]
    InvalidTokenLabel,
    #[error("the principal already has a live token labelled {0:?}; choose another label")]
    TokenLabelTaken(String),
    #[error(
        "principal {0:?} already holds {LIVE_TOKENS_PER_PRINCIPAL_MAX} live tokens: revoke one first"
    )]
    TooManyTokens(String),
    #[error("principal {principal:?} has no live token labelled {label:?}")]
    UnknownToken { principal: String, label: String },
    #[error("{0}")]
    Ledger(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl From<LedgerError> for AdminError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Database(e) => Self::Database(e),
            other => Self::Ledger(other.to_string()),
        }
    }
}

/// A new principal and its token, shown once: only its hash is stored.
#[derive(Debug, Serialize)]
pub struct NewPrincipal {
    pub principal_id: PrincipalId,
    pub name: String,
    pub token_id: Uuid,
    pub token_label: String,
    pub token: String,
}

/// The label of the token a principal is created with.
pub const INITIAL_TOKEN_LABEL: &str = "initial";

/// Creates a principal with one token labelled [`INITIAL_TOKEN_LABEL`], in
/// one transaction: a principal never exists without a way in.
pub async fn create_principal(pool: &PgPool, name: &str) -> Result<NewPrincipal, AdminError> {
    check_principal_name(name)?;
    let mut tx = pool.begin().await?;
    let id: Option<PrincipalId> = sqlx::query_scalar(
        "INSERT INTO principals (id, name) VALUES ($1, $2)
         ON CONFLICT (name) DO NOTHING RETURNING id",
    )
    .bind(Uuid::now_v7())
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let principal_id = id.ok_or_else(|| AdminError::PrincipalExists(name.to_owned()))?;
    let token = auth::generate_token();
    let token_id = insert_token(&mut tx, principal_id, INITIAL_TOKEN_LABEL, &token).await?;
    tx.commit().await?;
    Ok(NewPrincipal {
        principal_id,
        name: name.to_owned(),
        token_id,
        token_label: INITIAL_TOKEN_LABEL.to_owned(),
        token,
    })
}

async fn insert_token(
    conn: &mut sqlx::PgConnection,
    principal_id: PrincipalId,
    label: &str,
    token: &str,
) -> Result<Uuid, AdminError> {
    let id: Option<Uuid> = sqlx::query_scalar(
        "INSERT INTO principal_tokens (id, principal_id, label, token_sha256)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (principal_id, label) WHERE revoked_at IS NULL DO NOTHING
         RETURNING id",
    )
    .bind(Uuid::now_v7())
    .bind(principal_id)
    .bind(label)
    .bind(auth::token_sha256(token).as_slice())
    .fetch_optional(conn)
    .await?;
    id.ok_or_else(|| AdminError::TokenLabelTaken(label.to_owned()))
}

/// Token labels: 1 to 64 visible ASCII characters (`ci-2026-11`, `laptop`).
fn check_token_label(label: &str) -> Result<(), AdminError> {
    if (1..=64).contains(&label.len()) && label.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        Err(AdminError::InvalidTokenLabel)
    }
}

/// A token added to a principal, shown once.
#[derive(Debug, Serialize)]
pub struct NewToken {
    pub principal: String,
    pub token_id: Uuid,
    pub label: String,
    pub token: String,
}

/// The most live tokens a principal may hold: enough for a rotation per
/// deployment, few enough that a leaked credential store is a short list.
pub const LIVE_TOKENS_PER_PRINCIPAL_MAX: i64 = 20;

/// The most tokens `list-tokens` prints (revoked ones accumulate).
pub const TOKENS_LISTED_MAX: i64 = 1_000;

/// Adds a token to a principal, its other tokens untouched: the first step
/// of a rotation (create, deploy, then revoke the old one).
pub async fn create_token(
    pool: &PgPool,
    principal: &str,
    label: &str,
) -> Result<NewToken, AdminError> {
    check_token_label(label)?;
    let principal_id = principal_id_by_name(pool, principal).await?;
    let token = auth::generate_token();
    let mut tx = pool.begin().await?;
    // The principal's row lock orders concurrent creations, so the count
    // below cannot be passed by two at once.
    let live: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM principal_tokens t
                 WHERE t.principal_id = p.id AND t.revoked_at IS NULL)
         FROM principals p WHERE p.id = $1 FOR UPDATE",
    )
    .bind(principal_id)
    .fetch_one(&mut *tx)
    .await?;
    if live >= LIVE_TOKENS_PER_PRINCIPAL_MAX {
        return Err(AdminError::TooManyTokens(principal.to_owned()));
    }
    let token_id = insert_token(&mut tx, principal_id, label, &token).await?;
    tx.commit().await?;
    Ok(NewToken {
        principal: principal.to_owned(),
        token_id,
        label: label.to_owned(),
        token,
    })
}

/// A token as operators see it: never the token itself.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct TokenInfo {
    pub token_id: Uuid,
    pub label: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub last_used_at: Option<chrono::DateTime<chrono::Utc>>,
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Revokes a principal's live token by its label. It stops authenticating
/// at once on new lookups, and within `caches::PRINCIPAL_CACHE_TTL` on an
/// instance that remembers it. Revoking twice is an error naming the label:
/// the operator learns the token was not live.
pub async fn revoke_token(
    pool: &PgPool,
    principal: &str,
    label: &str,
) -> Result<TokenInfo, AdminError> {
    let principal_id = principal_id_by_name(pool, principal).await?;
    let mut tx = pool.begin().await?;
    let revoked: TokenInfo = sqlx::query_as(
        "UPDATE principal_tokens SET revoked_at = now()
         WHERE principal_id = $1 AND label = $2 AND revoked_at IS NULL
         RETURNING id AS token_id, label, created_at, last_used_at, revoked_at",
    )
    .bind(principal_id)
    .bind(label)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| AdminError::UnknownToken {
        principal: principal.to_owned(),
        label: label.to_owned(),
    })?;
    // An instance of the version before migration 0005 authenticates with
    // the principal's old column: a token revoked here must stop there too.
    sqlx::query(
        "UPDATE principals p SET token_sha256 = NULL
         FROM principal_tokens t
         WHERE t.id = $1 AND p.id = t.principal_id AND p.token_sha256 = t.token_sha256",
    )
    .bind(revoked.token_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(revoked)
}

/// A principal's tokens, live and revoked, oldest first.
pub async fn list_tokens(pool: &PgPool, principal: &str) -> Result<Vec<TokenInfo>, AdminError> {
    let principal_id = principal_id_by_name(pool, principal).await?;
    Ok(sqlx::query_as(
        "SELECT id AS token_id, label, created_at, last_used_at, revoked_at
         FROM principal_tokens WHERE principal_id = $1 ORDER BY created_at, id LIMIT $2",
    )
    .bind(principal_id)
    .bind(TOKENS_LISTED_MAX)
    .fetch_all(pool)
    .await?)
}

/// A principal as operators see it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct PrincipalInfo {
    pub principal_id: PrincipalId,
    pub name: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub live_tokens: i64,
    pub accounts: i64,
}

/// The most principals `list-principals` prints: bounds its output and its
/// query.
pub const PRINCIPALS_LISTED_MAX: i64 = 1_000;

pub async fn list_principals(pool: &PgPool) -> Result<Vec<PrincipalInfo>, AdminError> {
    Ok(sqlx::query_as(
        "SELECT p.id AS principal_id, p.name, p.created_at,
                (SELECT count(*) FROM principal_tokens t
                 WHERE t.principal_id = p.id AND t.revoked_at IS NULL) AS live_tokens,
                (SELECT count(*) FROM accounts a WHERE a.principal_id = p.id) AS accounts
         FROM principals p ORDER BY p.name LIMIT $1",
    )
    .bind(PRINCIPALS_LISTED_MAX)
    .fetch_all(pool)
    .await?)
}

/// An account as operators see it: owner, balance and its ledger activity.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct AccountInfo {
    pub account_id: String,
    pub owner: Option<String>,
    pub currency: String,
    pub balance_minor: i64,
    pub held_minor: i64,
    pub entries: i64,
    pub last_entry_at: Option<chrono::DateTime<chrono::Utc>>,
}

pub async fn show_account(pool: &PgPool, account: &str) -> Result<AccountInfo, AdminError> {
    sqlx::query_as(
        "SELECT a.id AS account_id, p.name AS owner, a.currency, a.balance_minor, a.held_minor,
                (SELECT count(*) FROM ledger_entries e WHERE e.account_id = a.id) AS entries,
                -- The newest entry through the (account_id, id) index, not
                -- a scan of the account's history.
                (SELECT e.created_at FROM ledger_entries e WHERE e.account_id = a.id
                 ORDER BY e.id DESC LIMIT 1) AS last_entry_at
         FROM accounts a LEFT JOIN principals p ON p.id = a.principal_id
         WHERE a.id = $1",
    )
    .bind(account)
    .fetch_optional(pool)
    .await?
    .ok_or_else(|| AdminError::UnknownAccount(account.to_owned()))
}

fn check_principal_name(name: &str) -> Result<(), AdminError> {
    if (1..=64).contains(&name.chars().count()) && !name.chars().any(char::is_control) {
        Ok(())
    } else {
        Err(AdminError::InvalidPrincipalName)
    }
}

/// Makes sure a principal with this name and token exists; running it again
/// changes nothing. For fixtures, whose tokens are fixed.
pub async fn ensure_principal(
    pool: &PgPool,
    name: &str,
    token: &str,
) -> Result<PrincipalId, AdminError> {
    check_principal_name(name)?;
    let hash = auth::token_sha256(token);
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO principals (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
        .bind(Uuid::now_v7())
        .bind(name)
        .execute(&mut *tx)
        .await?;
    let id: PrincipalId = sqlx::query_scalar("SELECT id FROM principals WHERE name = $1")
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    // The fixture token, unless it is already this principal's; a token
    // that is another principal's (or revoked) is refused below.
    sqlx::query(
        "INSERT INTO principal_tokens (id, principal_id, label, token_sha256)
         VALUES ($1, $2, 'fixture', $3)
         ON CONFLICT DO NOTHING",
    )
    .bind(Uuid::now_v7())
    .bind(id)
    .bind(hash.as_slice())
    .execute(&mut *tx)
    .await?;
    let live: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM principal_tokens
                        WHERE principal_id = $1 AND token_sha256 = $2 AND revoked_at IS NULL)",
    )
    .bind(id)
    .bind(hash.as_slice())
    .fetch_one(&mut *tx)
    .await?;
    if !live {
        return Err(AdminError::TokenMismatch {
            name: name.to_owned(),
        });
    }
    tx.commit().await?;
    Ok(id)
}

async fn principal_id_by_name(pool: &PgPool, name: &str) -> Result<PrincipalId, AdminError> {
    sqlx::query_scalar("SELECT id FROM principals WHERE name = $1")
        .bind(name)
        .fetch_optional(pool)
        .await?
        .ok_or_else(|| AdminError::UnknownPrincipal(name.to_owned()))
}

/// The most accounts one principal may hold; bounds what one misbehaving
/// onboarding script can create.
pub const ACCOUNTS_PER_PRINCIPAL_MAX: i64 = 1_000;

/// Opens an account for a principal in a currency. With an explicit id,
/// opening it again for the same owner and currency changes nothing.
pub async fn open_account(
    pool: &PgPool,
    owner: &str,
    currency: &str,
    id: Option<&str>,
) -> Result<AccountId, AdminError> {
    let principal_id = principal_id_by_name(pool, owner).await?;
    let currency = Currency::parse(currency)
        .map_err(|_| AdminError::UnsupportedCurrency(currency.to_owned()))?;
    let id = match id {
        Some(id) => {
            AccountId::parse(id).map_err(|e| AdminError::InvalidAccountId(e.to_string()))?
        }
        None => AccountId::parse(&format!(
            "acc_{}",
            &Uuid::new_v4().simple().to_string()[..16]
        ))
        .map_err(|e| AdminError::InvalidAccountId(e.to_string()))?,
    };
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts WHERE principal_id = $1")
        .bind(principal_id)
        .fetch_one(pool)
        .await?;
    if held >= ACCOUNTS_PER_PRINCIPAL_MAX {
        return Err(AdminError::Ledger(format!(
            "{owner} already holds {ACCOUNTS_PER_PRINCIPAL_MAX} accounts"
        )));
    }
    let inserted = sqlx::query(
        "INSERT INTO accounts (id, principal_id, currency)
         SELECT $1, $2, code FROM currencies WHERE code = $3
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(id.as_str())
    .bind(principal_id)
    .bind(currency.as_str())
    .execute(pool)
    .await?
    .rows_affected();
    if inserted == 0 {
        match ledger::repo::get_account(pool, id.as_str()).await? {
            Some(a) if a.principal_id == Some(principal_id) && a.currency == currency.as_str() => {}
            Some(_) => {
                return Err(AdminError::AccountConflict { id: id.to_string() });
            }
            None => return Err(AdminError::UnsupportedCurrency(currency.to_string())),
        }
    }
    Ok(id)
}

#[derive(Debug, Serialize)]
pub struct Deposit {
    pub transfer_id: Uuid,
    pub account_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub reference: String,
    /// True when this reference had already been deposited: nothing moved now.
    pub already_posted: bool,
}

/// Deposits money into a customer account, from the funding account of its
/// currency. The reference is the deposit's idempotency key: running the
/// same deposit again (same reference) moves nothing.
pub async fn deposit(
    pool: &PgPool,
    account: &str,
    amount_minor: i64,
    reference: &str,
) -> Result<Deposit, AdminError> {
    let account_id =
        AccountId::parse(account).map_err(|e| AdminError::InvalidAccountId(e.to_string()))?;
    let amount =
        AmountMinor::parse(amount_minor).map_err(|e| AdminError::InvalidAmount(e.to_string()))?;
    let target = ledger::repo::get_account(pool, account_id.as_str())
        .await?
        .ok_or_else(|| AdminError::UnknownAccount(account.to_owned()))?;
    let currency = Currency::parse(&target.currency)
        .map_err(|_| AdminError::UnsupportedCurrency(target.currency.clone()))?;
    let funding = AccountId::funding(&currency);
    let canonical = serde_json::json!({
        "to": account_id.as_str(),
        "amount_minor": amount.get(),
        "currency": currency.as_str(),
    });
    let fingerprint = Fingerprint::compute("CLI", "deposit", canonical.to_string().as_bytes());
    let request = PostingRequest {
        principal_id: None,
        idempotency_key: reference,
        fingerprint: fingerprint.as_bytes(),
        from: funding.as_str(),
        to: account_id.as_str(),
        amount,
        currency: &currency,
        description: None,
        kind: PostingKind::Transfer,
    };
    let mut tx = pool.begin().await?;
    let outcome = ledger::repo::post_transfer(&mut tx, &request).await?;
    tx.commit().await?;
    let (transfer, already_posted): (Transfer, bool) = match outcome.settle(fingerprint.as_bytes())
    {
        Settled::Posted(t) => (t, false),
        Settled::Replayed(t) => (t, true),
        Settled::KeyUsedByOther(_) => {
            return Err(AdminError::ReferenceReused(reference.to_owned()));
        }
        Settled::InsufficientFunds => {
            return Err(AdminError::Ledger(
                "the funding account refused the deposit".to_owned(),
            ));
        }
    };
    Ok(Deposit {
        transfer_id: transfer.id,
        account_id: transfer.to_account,
        amount_minor: transfer.amount_minor,
        currency: transfer.currency,
        reference: reference.to_owned(),
        already_posted,
    })
}

/// The synthetic fixtures of the seed articles. Loading them twice changes
/// nothing: principals and accounts are upserted and the opening deposits
/// carry fixed references.
pub struct DemoFixture {
    pub principal: &'static str,
    pub token: &'static str,
    pub accounts: &'static [(&'static str, &'static str, i64)],
}

pub const DEMO_FIXTURES: &[DemoFixture] = &[
    DemoFixture {
        principal: "demo-a",
        token: "tok_test_A",
        accounts: &[
            ("acc_00001", "USD", 100_000_000),
            ("acc_00003", "EUR", 100_000_000),
        ],
    },
    DemoFixture {
        principal: "demo-b",
        token: "tok_test_B",
        accounts: &[("acc_00002", "USD", 0), ("acc_00004", "EUR", 0)],
    },
];

pub async fn load_demo(pool: &PgPool) -> Result<(), AdminError> {
    for fixture in DEMO_FIXTURES {
        ensure_principal(pool, fixture.principal, fixture.token).await?;
        for &(id, currency, opening_balance) in fixture.accounts {
            open_account(pool, fixture.principal, currency, Some(id)).await?;
            if opening_balance > 0 {
                deposit(pool, id, opening_balance, &format!("demo-opening-{id}")).await?;
            }
        }
    }
    Ok(())
}
