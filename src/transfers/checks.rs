//! Checks that need the database but no lock, made before the key is
//! claimed, so a rejected request never touches `idempotency_keys` and its
//! key stays free. Owner and currency of an account never change, so they
//! still hold when the posting transaction runs.

use super::intent::{Invalid, TransferIntent, ValidationKind};
use super::{TransferError, Transfers};
use crate::caches::AccountFacts;
use crate::ledger;
use crate::principal::PrincipalId;

pub async fn check_against_accounts(
    transfers: &Transfers,
    principal: PrincipalId,
    intent: &TransferIntent,
) -> Result<(), TransferError> {
    if !transfers.currencies.contains(intent.currency.as_str()) {
        return Err(Invalid::new(
            ValidationKind::UnsupportedCurrency,
            "currency",
            format!("{} is not a supported currency", intent.currency),
        )
        .into());
    }
    let (from, to) = account_facts(transfers, intent).await?;
    let from = from
        .filter(|a| a.principal_id == Some(principal))
        // Someone else's account is indistinguishable from no account (BOLA).
        .ok_or(TransferError::SourceNotFound)?;
    let to = to.ok_or_else(|| {
        Invalid::new(
            ValidationKind::UnknownDestination,
            "to",
            format!("destination account {} does not exist", intent.to),
        )
    })?;
    if from.currency != intent.currency.as_str() {
        return Err(Invalid::new(
            ValidationKind::CurrencyMismatch,
            "currency",
            format!(
                "account {} holds {}, not {}",
                intent.from, from.currency, intent.currency
            ),
        )
        .into());
    }
    // The destination may be someone else's: its currency is not told.
    if to.currency != intent.currency.as_str() {
        return Err(Invalid::new(
            ValidationKind::CurrencyMismatch,
            "currency",
            format!(
                "destination account {} does not hold {}",
                intent.to, intent.currency
            ),
        )
        .into());
    }
    Ok(())
}

/// Owner and currency of both accounts, from memory where it holds them;
/// only what it does not hold is read, in one query.
async fn account_facts(
    transfers: &Transfers,
    intent: &TransferIntent,
) -> Result<(Option<AccountFacts>, Option<AccountFacts>), sqlx::Error> {
    let caches = &transfers.caches;
    let (from_id, to_id) = (intent.from.as_str(), intent.to.as_str());
    let (mut from, mut to) = (caches.account(from_id), caches.account(to_id));
    let missing: Vec<&str> = [(from_id, &from), (to_id, &to)]
        .into_iter()
        .filter_map(|(id, known)| known.is_none().then_some(id))
        .collect();
    if !missing.is_empty() {
        for account in ledger::repo::get_accounts(&transfers.pool, &missing).await? {
            caches.remember_account(&account);
            if account.id == from_id {
                from = Some((&account).into());
            } else if account.id == to_id {
                to = Some((&account).into());
            }
        }
    }
    Ok((from, to))
}
