//! Value types of the ledger. Each can only be built by parsing, so a value
//! that exists is valid: code past the boundary never re-checks it.

use std::fmt;

/// The largest amount one transfer may move: 10^14 minor units (a trillion
/// dollars in cents). Far above any real payment, and far enough below
/// `i64::MAX` that no sum of a few transfers can overflow a balance.
pub const AMOUNT_MINOR_MAX: i64 = 100_000_000_000_000;

/// The longest description a transfer may carry, in characters. Bounded so a
/// stored response (which embeds it) stays small.
pub const DESCRIPTION_CHARS_MAX: usize = 140;

/// The longest customer account id suffix after `acc_`.
pub const ACCOUNT_ID_SUFFIX_LEN_MAX: usize = 40;

/// A positive amount of money in the currency's minor unit (cents for USD).
/// Never a float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AmountMinor(i64);

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    #[error("amount_minor must be greater than zero")]
    NotPositive,
    #[error("amount_minor must not exceed {AMOUNT_MINOR_MAX}")]
    TooLarge,
}

impl AmountMinor {
    pub fn parse(value: i64) -> Result<Self, AmountError> {
        if value <= 0 {
            Err(AmountError::NotPositive)
        } else if value > AMOUNT_MINOR_MAX {
            Err(AmountError::TooLarge)
        } else {
            Ok(Self(value))
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

/// An ISO 4217 alphabetic code, syntactically valid, in its canonical upper
/// case: clients may send `usd` (Stripe's spelling), and it is the same
/// currency, so the same intent and fingerprint. Whether the ledger supports
/// it is a question for the `currencies` table.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Currency(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("currency must be an ISO 4217 code of three letters")]
pub struct CurrencyError;

impl Currency {
    pub fn parse(value: &str) -> Result<Self, CurrencyError> {
        if value.len() == 3 && value.bytes().all(|b| b.is_ascii_alphabetic()) {
            Ok(Self(value.to_ascii_uppercase()))
        } else {
            Err(CurrencyError)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A customer account id as clients name it: `acc_` and 1 to 40 ASCII
/// letters or digits. System accounts (`sys_...`) cannot be parsed from
/// client input, so no request can name a funding account.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AccountId(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("account ids look like acc_ followed by 1 to 40 letters or digits")]
pub struct AccountIdError;

impl AccountId {
    pub fn parse(value: &str) -> Result<Self, AccountIdError> {
        let suffix = value.strip_prefix("acc_").ok_or(AccountIdError)?;
        if (1..=ACCOUNT_ID_SUFFIX_LEN_MAX).contains(&suffix.len())
            && suffix.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            Ok(Self(value.to_owned()))
        } else {
            Err(AccountIdError)
        }
    }

    /// The funding account of a currency, as the first migration names it.
    pub fn funding(currency: &Currency) -> Self {
        Self(format!(
            "sys_funding_{}",
            currency.as_str().to_ascii_lowercase()
        ))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An optional free-text note, at most [`DESCRIPTION_CHARS_MAX`] characters,
/// with no control characters (they would end up in statements and logs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Description(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptionError {
    #[error("description must be at most {DESCRIPTION_CHARS_MAX} characters")]
    TooLong,
    #[error("description must not contain control characters")]
    ControlCharacter,
}

impl Description {
    pub fn parse(value: &str) -> Result<Self, DescriptionError> {
        if value.chars().count() > DESCRIPTION_CHARS_MAX {
            Err(DescriptionError::TooLong)
        } else if value.chars().any(char::is_control) {
            Err(DescriptionError::ControlCharacter)
        } else {
            Ok(Self(value.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_must_be_positive_and_bounded() {
        assert_eq!(AmountMinor::parse(0), Err(AmountError::NotPositive));
        assert_eq!(AmountMinor::parse(-1), Err(AmountError::NotPositive));
        assert_eq!(
            AmountMinor::parse(AMOUNT_MINOR_MAX + 1),
            Err(AmountError::TooLarge)
        );
        assert_eq!(AmountMinor::parse(1).map(AmountMinor::get), Ok(1));
        assert_eq!(
            AmountMinor::parse(AMOUNT_MINOR_MAX).map(AmountMinor::get),
            Ok(AMOUNT_MINOR_MAX)
        );
    }

    #[test]
    fn currencies_are_three_letters_in_upper_case() {
        for spelling in ["USD", "usd", "uSd"] {
            assert_eq!(
                Currency::parse(spelling).map(|c| c.to_string()),
                Ok("USD".to_owned())
            );
        }
        for bad in ["US", "USDD", "U5D", "", "ÜSD", "US "] {
            assert!(Currency::parse(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn clients_cannot_name_system_accounts() {
        assert!(AccountId::parse("acc_00001").is_ok());
        for bad in [
            "sys_funding_usd",
            "acc_",
            "acc_a-b",
            "ACC_1",
            "acc_é",
            "acc_1 OR 1=1",
        ] {
            assert!(AccountId::parse(bad).is_err(), "{bad} should be rejected");
        }
        let long = format!("acc_{}", "a".repeat(ACCOUNT_ID_SUFFIX_LEN_MAX + 1));
        assert!(AccountId::parse(&long).is_err());
    }

    #[test]
    fn descriptions_are_bounded_and_printable() {
        assert!(Description::parse("rent ñandú 🏠").is_ok());
        assert_eq!(
            Description::parse(&"x".repeat(DESCRIPTION_CHARS_MAX + 1)),
            Err(DescriptionError::TooLong)
        );
        assert_eq!(
            Description::parse("a\u{0}b"),
            Err(DescriptionError::ControlCharacter)
        );
    }
}
