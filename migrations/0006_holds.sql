-- Holds: a pending transfer reserves its amount on the source account
-- until it is posted (in full or in part), voided, or expires. The money
-- stays in the ledger the whole time: the source's `held_minor` is the sum
-- of its pending holds, and its available balance (balance_minor -
-- held_minor) can never go below zero, so a hold's amount is there to post
-- whatever else the account does meanwhile.
--
-- A hold and the transfer that posts it share one id: clients see one
-- transfer whose status goes pending -> posted | voided | expired. The
-- `transfers` row (and its two entries) exists only once it is posted.

ALTER TABLE accounts
    ADD COLUMN held_minor bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT accounts_held_non_negative CHECK (held_minor >= 0),
    ADD CONSTRAINT accounts_available_non_negative
        CHECK (allow_negative OR balance_minor >= held_minor);

CREATE TABLE holds (
    id                   uuid        PRIMARY KEY,
    principal_id         uuid        NOT NULL REFERENCES principals (id),
    -- The key that created it: unique per principal for ever, like a
    -- transfer's, so a very late retry finds its hold.
    idempotency_key      text        NOT NULL,
    request_fingerprint  bytea       NOT NULL,
    from_account         text        NOT NULL,
    to_account           text        NOT NULL,
    currency             text        NOT NULL REFERENCES currencies (code),
    amount_minor         bigint      NOT NULL,
    description          text,
    status               text        NOT NULL DEFAULT 'pending',
    created_at           timestamptz NOT NULL DEFAULT now(),
    expires_at           timestamptz NOT NULL,
    resolved_at          timestamptz,
    -- The key and fingerprint of the request that posted or voided it, so a
    -- late retry of that request is answered as it was and any other
    -- request is refused. NULL while pending and when it expired.
    resolved_key         text,
    resolved_fingerprint bytea,
    posted_amount_minor  bigint,
    CONSTRAINT holds_principal_key_unique UNIQUE (principal_id, idempotency_key),
    CONSTRAINT holds_amount_positive CHECK (amount_minor > 0),
    CONSTRAINT holds_distinct_accounts CHECK (from_account <> to_account),
    CONSTRAINT holds_status_known CHECK (status IN ('pending', 'posted', 'voided', 'expired')),
    CONSTRAINT holds_fingerprint_length CHECK (octet_length(request_fingerprint) = 32),
    CONSTRAINT holds_key_length CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT holds_description_length CHECK (char_length(description) <= 140),
    CONSTRAINT holds_expiry_after_creation CHECK (expires_at > created_at),
    CONSTRAINT holds_resolved_when_not_pending CHECK ((status = 'pending') = (resolved_at IS NULL)),
    CONSTRAINT holds_resolved_by_a_request CHECK (
        (status IN ('posted', 'voided'))
        = (resolved_key IS NOT NULL AND octet_length(resolved_fingerprint) = 32)
    ),
    CONSTRAINT holds_posted_amount CHECK (
        (status = 'posted') = (posted_amount_minor IS NOT NULL)
        AND (posted_amount_minor IS NULL OR posted_amount_minor BETWEEN 1 AND amount_minor)
    ),
    CONSTRAINT holds_from_currency_fk FOREIGN KEY (from_account, currency) REFERENCES accounts (id, currency),
    CONSTRAINT holds_to_currency_fk FOREIGN KEY (to_account, currency) REFERENCES accounts (id, currency)
);

-- The expiry task finds due holds by this; it holds only pending ones.
CREATE INDEX holds_pending_expiry_idx ON holds (expires_at) WHERE status = 'pending';
CREATE INDEX holds_from_account_idx ON holds (from_account);
CREATE INDEX holds_to_account_idx ON holds (to_account);

-- A hold ends once: posted, voided or expired, never changed after that,
-- whatever code path (or hand-written SQL) tries.
CREATE FUNCTION holds_resolve_once() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status <> 'pending' THEN
        RAISE EXCEPTION 'hold % is already %', OLD.id, OLD.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF NEW.id <> OLD.id OR NEW.from_account <> OLD.from_account OR NEW.to_account <> OLD.to_account
       OR NEW.amount_minor <> OLD.amount_minor OR NEW.currency <> OLD.currency
       OR NEW.expires_at <> OLD.expires_at THEN
        RAISE EXCEPTION 'hold % may only change its status', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER holds_resolve_once
    BEFORE UPDATE ON holds
    FOR EACH ROW EXECUTE FUNCTION holds_resolve_once();

-- A posted hold commits with its transfer: the same id, the posted amount,
-- between the same accounts.
CREATE FUNCTION holds_check_posted_transfer() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'posted' AND NOT EXISTS (
        SELECT 1 FROM transfers t
        WHERE t.id = NEW.id AND t.amount_minor = NEW.posted_amount_minor
          AND t.from_account = NEW.from_account AND t.to_account = NEW.to_account
    ) THEN
        RAISE EXCEPTION 'hold % must commit posted with its transfer of %', NEW.id, NEW.posted_amount_minor
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER holds_posted_transfer
    AFTER UPDATE ON holds
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.status = 'posted')
    EXECUTE FUNCTION holds_check_posted_transfer();
