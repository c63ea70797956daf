//! Deciding postings before anything is written: pure functions over the
//! locked accounts, so what a batch will do is tested without a database.

use uuid::Uuid;

use super::LedgerError;
use super::repo::{Account, PostingRequest};

/// A transfer decided under the accounts' locks, before anything is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Post(Planned),
    InsufficientFunds,
}

/// A transfer to write, with the balances its two entries record and the
/// sequence numbers its event takes on its two accounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub id: Uuid,
    pub receipt_id: String,
    pub debit_balance_after: i64,
    pub credit_balance_after: i64,
    pub from_seq: i64,
    pub to_seq: i64,
}

/// One ledger entry to write: signed amount, and the balance its account
/// is left with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEntry<'a> {
    pub transfer_id: Uuid,
    pub account_id: &'a str,
    pub amount_minor: i64,
    pub balance_after_minor: i64,
}

/// Decides each transfer in order against the locked balances, moving them
/// in `accounts` as it goes: a transfer is checked against what the ones
/// before it left, as if they had been posted one by one. Each posted
/// transfer also takes the next event sequence number of both its accounts.
pub fn plan(
    requests: &[PostingRequest<'_>],
    accounts: &mut [Account],
) -> Result<Vec<Plan>, LedgerError> {
    let position = |accounts: &[Account], id: &str| {
        accounts
            .iter()
            .position(|a| a.id == id)
            .ok_or_else(|| LedgerError::AccountNotFound(id.to_owned()))
    };
    let mut plans = Vec::with_capacity(requests.len());
    for request in requests {
        let (from, to) = (
            position(accounts, request.from)?,
            position(accounts, request.to)?,
        );
        for account in [&accounts[from], &accounts[to]] {
            if account.currency != request.currency.as_str() {
                return Err(LedgerError::CurrencyMismatch {
                    transfer: request.currency.to_string(),
                    account: account.id.clone(),
                    account_currency: account.currency.clone(),
                });
            }
        }
        let amount = request.amount.get();
        let source = &accounts[from];
        if !source.allow_negative && source.available_minor() < amount {
            plans.push(Plan::InsufficientFunds);
            continue;
        }
        let out_of_range = |account: &Account| LedgerError::BalanceOutOfRange(account.id.clone());
        let debited = accounts[from]
            .balance_minor
            .checked_sub(amount)
            .ok_or_else(|| out_of_range(&accounts[from]))?;
        let credited = accounts[to]
            .balance_minor
            .checked_add(amount)
            .ok_or_else(|| out_of_range(&accounts[to]))?;
        accounts[from].balance_minor = debited;
        accounts[to].balance_minor = credited;
        accounts[from].event_seq += 1;
        accounts[to].event_seq += 1;
        plans.push(Plan::Post(Planned {
            id: request.kind.transfer_id().unwrap_or_else(Uuid::now_v7),
            receipt_id: format!("rcpt_{}", Uuid::new_v4().simple()),
            debit_balance_after: debited,
            credit_balance_after: credited,
            from_seq: accounts[from].event_seq,
            to_seq: accounts[to].event_seq,
        }));
    }
    Ok(plans)
}

/// The entries of the planned postings in the order they are written:
/// plan order, each transfer's debit before its credit. Entry ids are
/// assigned in this order, which is what makes an account's entries, read
/// by id, a running balance.
pub fn entries<'a>(posted: &[(&PostingRequest<'a>, &Planned)]) -> Vec<PlannedEntry<'a>> {
    posted
        .iter()
        .flat_map(|(request, planned)| {
            let amount = request.amount.get();
            [
                PlannedEntry {
                    transfer_id: planned.id,
                    account_id: request.from,
                    amount_minor: -amount,
                    balance_after_minor: planned.debit_balance_after,
                },
                PlannedEntry {
                    transfer_id: planned.id,
                    account_id: request.to,
                    amount_minor: amount,
                    balance_after_minor: planned.credit_balance_after,
                },
            ]
        })
        .collect()
}

/// The accounts the plan touches, as (opening, closing): `closing` is
/// `opening` after [`plan`]. An account a posting touched took an event
/// sequence number even when the batch left its balance where it was.
pub fn moved_accounts<'a>(
    opening: &'a [Account],
    closing: &'a [Account],
) -> impl Iterator<Item = (&'a Account, &'a Account)> + 'a {
    opening.iter().zip(closing).filter(|(before, after)| {
        before.balance_minor != after.balance_minor || before.event_seq != after.event_seq
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AmountMinor, Currency, PostingKind};

    fn account(id: &str, balance_minor: i64, allow_negative: bool) -> Account {
        Account {
            id: id.to_owned(),
            principal_id: None,
            currency: "USD".to_owned(),
            balance_minor,
            held_minor: 0,
            allow_negative,
            event_seq: 0,
        }
    }

    fn usd() -> Currency {
        Currency::parse("USD").unwrap_or_else(|e| panic!("{e}"))
    }

    fn request<'a>(
        from: &'a str,
        to: &'a str,
        amount: i64,
        currency: &'a Currency,
    ) -> PostingRequest<'a> {
        PostingRequest {
            principal_id: None,
            idempotency_key: "k",
            fingerprint: &[0; 32],
            from,
            to,
            amount: AmountMinor::parse(amount).unwrap_or_else(|e| panic!("{e}")),
            currency,
            description: None,
            kind: PostingKind::Transfer,
        }
    }

    fn posted(plan: &Plan) -> &Planned {
        match plan {
            Plan::Post(planned) => planned,
            Plan::InsufficientFunds => panic!("expected a posting, got a refusal"),
        }
    }

    #[test]
    fn each_transfer_is_checked_against_the_balance_the_earlier_ones_left() {
        let usd = usd();
        let mut accounts = vec![account("acc_a", 100, false), account("acc_b", 0, false)];
        let requests = [
            request("acc_a", "acc_b", 60, &usd),
            request("acc_a", "acc_b", 60, &usd),
            request("acc_a", "acc_b", 40, &usd),
        ];
        let plans = plan(&requests, &mut accounts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(posted(&plans[0]).debit_balance_after, 40);
        assert_eq!(posted(&plans[0]).credit_balance_after, 60);
        assert_eq!(plans[1], Plan::InsufficientFunds, "40 left cannot cover 60");
        assert_eq!(posted(&plans[2]).debit_balance_after, 0);
        assert_eq!(posted(&plans[2]).credit_balance_after, 100);
        assert_eq!(
            (accounts[0].balance_minor, accounts[1].balance_minor),
            (0, 100)
        );
    }

    #[test]
    fn money_received_earlier_in_the_batch_can_be_spent_later_in_it() {
        let usd = usd();
        let mut accounts = vec![account("acc_a", 50, false), account("acc_b", 0, false)];
        let requests = [
            request("acc_a", "acc_b", 50, &usd),
            request("acc_b", "acc_a", 30, &usd),
        ];
        let plans = plan(&requests, &mut accounts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(posted(&plans[1]).debit_balance_after, 20);
        assert_eq!(posted(&plans[1]).credit_balance_after, 30);
    }

    #[test]
    fn an_account_allowed_negative_is_never_refused_and_overflow_is_an_error() {
        let usd = usd();
        let mut accounts = vec![
            account("acc_f", 0, true),
            account("acc_b", i64::MAX - 1, false),
        ];
        let fine = [request("acc_f", "acc_b", 1, &usd)];
        let plans = plan(&fine, &mut accounts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(posted(&plans[0]).debit_balance_after, -1);
        let overflow = [request("acc_f", "acc_b", 1, &usd)];
        assert!(matches!(
            plan(&overflow, &mut accounts),
            Err(LedgerError::BalanceOutOfRange(id)) if id == "acc_b"
        ));
    }

    #[test]
    fn a_currency_that_does_not_match_an_account_is_an_error() {
        let eur = Currency::parse("EUR").unwrap_or_else(|e| panic!("{e}"));
        let mut accounts = vec![account("acc_a", 100, false), account("acc_b", 0, false)];
        assert!(matches!(
            plan(&[request("acc_a", "acc_b", 1, &eur)], &mut accounts),
            Err(LedgerError::CurrencyMismatch { .. })
        ));
        assert!(matches!(
            plan(&[request("acc_a", "acc_x", 1, &usd())], &mut accounts),
            Err(LedgerError::AccountNotFound(id)) if id == "acc_x"
        ));
    }

    #[test]
    fn entries_follow_plan_order_debit_before_credit_with_running_balances() {
        let usd = usd();
        let mut accounts = vec![account("acc_a", 100, false), account("acc_b", 0, false)];
        let requests = [
            request("acc_a", "acc_b", 10, &usd),
            request("acc_b", "acc_a", 4, &usd),
        ];
        let plans = plan(&requests, &mut accounts).unwrap_or_else(|e| panic!("{e}"));
        let pairs: Vec<_> = requests.iter().zip(plans.iter().map(posted)).collect();
        let written = entries(&pairs);
        let summary: Vec<(&str, i64, i64)> = written
            .iter()
            .map(|e| (e.account_id, e.amount_minor, e.balance_after_minor))
            .collect();
        assert_eq!(
            summary,
            [
                ("acc_a", -10, 90),
                ("acc_b", 10, 10),
                ("acc_b", -4, 6),
                ("acc_a", 4, 94)
            ]
        );
        assert_eq!(written[0].transfer_id, written[1].transfer_id);
        assert_ne!(written[1].transfer_id, written[2].transfer_id);
    }

    #[test]
    fn every_account_a_posting_touched_is_moved_even_back_to_its_balance() {
        let usd = usd();
        let opening = vec![
            account("acc_a", 100, false),
            account("acc_b", 0, false),
            account("acc_c", 7, false),
            account("acc_d", 5, false),
        ];
        let mut closing = opening.clone();
        let requests = [
            request("acc_a", "acc_b", 10, &usd),
            request("acc_b", "acc_a", 10, &usd),
            request("acc_c", "acc_b", 1, &usd),
        ];
        plan(&requests, &mut closing).unwrap_or_else(|e| panic!("{e}"));
        let moved: Vec<(&str, i64, i64, i64)> = moved_accounts(&opening, &closing)
            .map(|(before, after)| {
                (
                    after.id.as_str(),
                    before.balance_minor,
                    after.balance_minor,
                    after.event_seq,
                )
            })
            .collect();
        assert_eq!(
            moved,
            [
                ("acc_a", 100, 100, 2),
                ("acc_b", 0, 1, 3),
                ("acc_c", 7, 6, 1)
            ]
        );
    }

    #[test]
    fn each_posting_takes_the_next_sequence_number_of_both_its_accounts() {
        let usd = usd();
        let mut accounts = vec![account("acc_a", 100, false), account("acc_b", 0, false)];
        accounts[0].event_seq = 41;
        let requests = [
            request("acc_a", "acc_b", 10, &usd),
            request("acc_a", "acc_b", 1_000, &usd),
            request("acc_b", "acc_a", 4, &usd),
        ];
        let plans = plan(&requests, &mut accounts).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (posted(&plans[0]).from_seq, posted(&plans[0]).to_seq),
            (42, 1)
        );
        assert_eq!(
            plans[1],
            Plan::InsufficientFunds,
            "a refusal takes no number"
        );
        assert_eq!(
            (posted(&plans[2]).from_seq, posted(&plans[2]).to_seq),
            (2, 43)
        );
        assert_eq!((accounts[0].event_seq, accounts[1].event_seq), (43, 2));
    }
}
