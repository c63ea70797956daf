-- Reversals: a transfer that gives back (part of) an earlier one, from its
-- destination to its source. It links to the original (`reverses`), and the
-- original keeps the sum of its reversals (`reversed_minor`), which can never
-- exceed what it moved.
--
-- Atomic multi-transfer requests: a batch's transfers (its legs) all post in
-- one transaction or none does, under one idempotency key. Each leg is an
-- ordinary transfer with its two entries; its key in `transfers` is derived
-- from its batch (`batch:<batch id>:<leg>`), so the permanent unique key
-- still holds, and the batch's own key lives in `transfer_batches`.

ALTER TABLE transfers
    ADD COLUMN reverses uuid REFERENCES transfers (id),
    ADD COLUMN reversed_minor bigint NOT NULL DEFAULT 0,
    ADD COLUMN batch_id uuid,
    ADD COLUMN batch_leg smallint;

-- The new columns hold their defaults on every existing row, so these
-- hold at once; adding them reads the table once, without rewriting it.
ALTER TABLE transfers
    ADD CONSTRAINT transfers_reversed_within_amount
        CHECK (reversed_minor BETWEEN 0 AND amount_minor),
    ADD CONSTRAINT transfers_not_its_own_reversal CHECK (reverses <> id),
    ADD CONSTRAINT transfers_batch_leg CHECK (
        (batch_id IS NULL) = (batch_leg IS NULL)
        AND (batch_id IS NULL
             OR (batch_leg >= 0 AND idempotency_key = 'batch:' || batch_id || ':' || batch_leg))
    );

CREATE INDEX transfers_reverses_idx ON transfers (reverses) WHERE reverses IS NOT NULL;

CREATE TABLE transfer_batches (
    id                  uuid        PRIMARY KEY,
    principal_id        uuid        NOT NULL REFERENCES principals (id),
    -- The key it was asked with: unique per principal for ever, so a very
    -- late retry finds its batch.
    idempotency_key     text        NOT NULL,
    request_fingerprint bytea       NOT NULL,
    legs                smallint    NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT transfer_batches_principal_key_unique UNIQUE (principal_id, idempotency_key),
    CONSTRAINT transfer_batches_fingerprint_length CHECK (octet_length(request_fingerprint) = 32),
    CONSTRAINT transfer_batches_key_length CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT transfer_batches_legs_range CHECK (legs BETWEEN 1 AND 100)
);

ALTER TABLE transfers
    ADD CONSTRAINT transfers_batch_fk FOREIGN KEY (batch_id) REFERENCES transfer_batches (id);

CREATE UNIQUE INDEX transfers_batch_leg_unique ON transfers (batch_id, batch_leg) WHERE batch_id IS NOT NULL;

-- A batch commits with all of its legs or not at all.
CREATE FUNCTION transfer_batches_check_legs() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    found bigint;
BEGIN
    SELECT count(*) INTO found FROM transfers WHERE batch_id = NEW.id;
    IF found <> NEW.legs THEN
        RAISE EXCEPTION 'batch % must commit with its % transfers, found %', NEW.id, NEW.legs, found
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER transfer_batches_all_legs
    AFTER INSERT ON transfer_batches
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION transfer_batches_check_legs();
