-- The whole model of nexo-transfers: who may call (principals), where money
-- lives (accounts), what moved (transfers and their ledger entries), and the
-- idempotency records that make a retried POST move money at most once.
-- Every invariant the code relies on is also a named constraint, so a bug in
-- the code becomes a failed statement instead of a wrong balance.

-- ISO 4217 currencies the ledger accepts. A currency is supported when its row
-- exists; adding one is a migration, never a runtime edit.
CREATE TABLE currencies (
    code        text     PRIMARY KEY,
    minor_units smallint NOT NULL,
    name        text     NOT NULL,
    CONSTRAINT currencies_code_iso4217 CHECK (code ~ '^[A-Z]{3}$'),
    CONSTRAINT currencies_minor_units_range CHECK (minor_units BETWEEN 0 AND 4)
);

INSERT INTO currencies (code, minor_units, name) VALUES
    ('USD', 2, 'US Dollar'),
    ('EUR', 2, 'Euro'),
    ('GBP', 2, 'Pound Sterling'),
    ('MXN', 2, 'Mexican Peso'),
    ('ARS', 2, 'Argentine Peso'),
    ('JPY', 0, 'Yen');

-- An authenticated caller. Only the SHA-256 of its bearer token is stored: a
-- leaked table does not leak credentials. The principal is the idempotency
-- scope: two principals never see each other's keys.
CREATE TABLE principals (
    id           uuid        PRIMARY KEY,
    name         text        NOT NULL,
    token_sha256 bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT principals_name_unique UNIQUE (name),
    CONSTRAINT principals_name_length CHECK (char_length(name) BETWEEN 1 AND 64),
    CONSTRAINT principals_token_sha256_unique UNIQUE (token_sha256),
    CONSTRAINT principals_token_sha256_length CHECK (octet_length(token_sha256) = 32)
);

-- Customer accounts belong to a principal and may never go negative. One
-- system funding account per currency (no owner, allow_negative) is the
-- source of deposits, so the balances of a currency always sum to zero.
CREATE TABLE accounts (
    id             text        PRIMARY KEY,
    principal_id   uuid        REFERENCES principals (id),
    currency       text        NOT NULL REFERENCES currencies (code),
    balance_minor  bigint      NOT NULL DEFAULT 0,
    allow_negative boolean     NOT NULL DEFAULT false,
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- Target of the composite foreign keys that make a transfer's currency
    -- match both of its accounts.
    CONSTRAINT accounts_id_currency_unique UNIQUE (id, currency),
    CONSTRAINT accounts_balance_non_negative CHECK (balance_minor >= 0 OR allow_negative),
    -- Customer ids are what the API accepts; system ids can never be named by a client.
    CONSTRAINT accounts_id_format CHECK (
        (principal_id IS NOT NULL AND id ~ '^acc_[A-Za-z0-9]{1,40}$')
        OR (principal_id IS NULL AND id ~ '^sys_[a-z0-9_]{1,40}$')
    ),
    CONSTRAINT accounts_only_system_may_go_negative CHECK (NOT allow_negative OR principal_id IS NULL)
);

CREATE INDEX accounts_principal_id_idx ON accounts (principal_id);

-- One funding account per currency.
CREATE UNIQUE INDEX accounts_one_funding_per_currency ON accounts (currency) WHERE allow_negative;

INSERT INTO accounts (id, principal_id, currency, allow_negative)
SELECT 'sys_funding_' || lower(code), NULL, code, true FROM currencies;

-- A posted movement of money. principal_id is who asked (NULL for an
-- operator's deposit) and idempotency_key the key it was asked with: the
-- permanent UNIQUE on the pair outlives the idempotency record's TTL, so a
-- retry that arrives after its record was purged still cannot post twice.
CREATE TABLE transfers (
    id                  uuid        PRIMARY KEY,
    principal_id        uuid        REFERENCES principals (id),
    idempotency_key     text        NOT NULL,
    request_fingerprint bytea       NOT NULL,
    from_account        text        NOT NULL,
    to_account          text        NOT NULL,
    currency            text        NOT NULL REFERENCES currencies (code),
    amount_minor        bigint      NOT NULL,
    description         text,
    status              text        NOT NULL DEFAULT 'posted',
    receipt_id          text        NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT transfers_principal_key_unique UNIQUE NULLS NOT DISTINCT (principal_id, idempotency_key),
    CONSTRAINT transfers_receipt_id_unique UNIQUE (receipt_id),
    CONSTRAINT transfers_amount_positive CHECK (amount_minor > 0),
    CONSTRAINT transfers_distinct_accounts CHECK (from_account <> to_account),
    CONSTRAINT transfers_status_known CHECK (status IN ('posted')),
    CONSTRAINT transfers_fingerprint_length CHECK (octet_length(request_fingerprint) = 32),
    CONSTRAINT transfers_key_length CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT transfers_description_length CHECK (char_length(description) <= 140),
    CONSTRAINT transfers_from_currency_fk FOREIGN KEY (from_account, currency) REFERENCES accounts (id, currency),
    CONSTRAINT transfers_to_currency_fk FOREIGN KEY (to_account, currency) REFERENCES accounts (id, currency)
);

CREATE INDEX transfers_from_account_idx ON transfers (from_account);
CREATE INDEX transfers_to_account_idx ON transfers (to_account);

-- Double entry: every transfer writes exactly one debit (negative) on its
-- source and one credit (positive) on its destination, in the same
-- transaction that moves the balances. balance_after_minor is the account's
-- balance right after this entry, so a statement needs no running sum.
CREATE TABLE ledger_entries (
    id                  bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    transfer_id         uuid        NOT NULL REFERENCES transfers (id),
    account_id          text        NOT NULL,
    currency            text        NOT NULL,
    amount_minor        bigint      NOT NULL,
    balance_after_minor bigint      NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ledger_entries_amount_non_zero CHECK (amount_minor <> 0),
    CONSTRAINT ledger_entries_one_per_account_per_transfer UNIQUE (transfer_id, account_id),
    CONSTRAINT ledger_entries_account_currency_fk FOREIGN KEY (account_id, currency) REFERENCES accounts (id, currency)
);

-- Newest-first statement pages by keyset on (account_id, id).
CREATE INDEX ledger_entries_account_id_id_idx ON ledger_entries (account_id, id DESC);

-- One row per (principal, key): the claim of an intent and, once it is
-- done, the exact response to replay. Inserted first with ON CONFLICT DO
-- NOTHING, so two racing requests can never both own it.
CREATE TABLE idempotency_keys (
    principal_id     uuid        NOT NULL REFERENCES principals (id),
    idempotency_key  text        NOT NULL,
    request_method   text        NOT NULL,
    request_path     text        NOT NULL,
    -- SHA-256 of method, route and the canonical request: same key with
    -- another request is a client error (422), never a replay.
    fingerprint      bytea       NOT NULL,
    status           text        NOT NULL,
    -- Fencing token: fresh on every claim or takeover; completion must
    -- present it, so a late original cannot complete after a takeover.
    lock_token       uuid        NOT NULL,
    locked_until     timestamptz NOT NULL,
    response_status  smallint,
    -- The few headers that must replay (Content-Type, Location), in order.
    response_headers jsonb,
    -- bytea, not jsonb: jsonb would reorder keys and the replay must be byte-exact.
    response_body    bytea,
    transfer_id      uuid,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (principal_id, idempotency_key),
    CONSTRAINT idempotency_keys_key_format CHECK (
        char_length(idempotency_key) BETWEEN 1 AND 255 AND idempotency_key ~ '^[\x20-\x7E]+$'
    ),
    CONSTRAINT idempotency_keys_status_known CHECK (status IN ('IN_PROGRESS', 'COMPLETED', 'FAILED')),
    CONSTRAINT idempotency_keys_fingerprint_length CHECK (octet_length(fingerprint) = 32),
    CONSTRAINT idempotency_keys_completed_has_response CHECK (
        (status = 'COMPLETED') = (response_status IS NOT NULL AND response_body IS NOT NULL AND response_headers IS NOT NULL)
    ),
    CONSTRAINT idempotency_keys_expiry_after_creation CHECK (expires_at > created_at)
);

-- The purge deletes by expiry in bounded batches.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
