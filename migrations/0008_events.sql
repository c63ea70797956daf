-- Events: a transactional outbox. Every change to the ledger (a transfer
-- posted, a hold created, posted, voided or expired, a reversal) writes its
-- event in the transaction, and usually the statement, that makes the
-- change, so an event exists exactly when its change committed: no dual
-- write, nothing to lose between a commit and a publish. Consumers read
-- them through `GET /events` (docs/events.md); webhooks will deliver the
-- same rows. Why an outbox and not logical decoding: ADR-011.

-- Each account counts the events that changed it. The statement that
-- already moves a balance or a held amount bumps it, under the row lock the
-- posting holds anyway, so an account's events are numbered 1, 2, 3, …
-- with no gap and no lock of their own.
ALTER TABLE accounts
    ADD COLUMN event_seq bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT accounts_event_seq_non_negative CHECK (event_seq >= 0);

CREATE TABLE events (
    -- Insertion order. Not the feed's order on its own: a transaction that
    -- took a smaller position may commit after one that took a larger one.
    position       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- What a consumer deduplicates by (and, later, a webhook delivery's id).
    id             uuid        NOT NULL DEFAULT gen_random_uuid(),
    -- The writing transaction. The feed orders by (txid, position) and shows
    -- only transactions older than every one still running, so nothing can
    -- later appear before a cursor it handed out.
    txid           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    type           text        NOT NULL,
    -- The transfer or hold the event is about (a hold and the transfer that
    -- posts it share one id).
    resource_id    uuid        NOT NULL,
    -- The resource as the API showed it at that moment: what
    -- `GET /transfers/{id}` answered right after the commit (without
    -- `reversed_minor`, which only reads carry).
    resource       jsonb       NOT NULL,
    -- The change's own timestamp: the transfer's created_at, the hold's
    -- created_at or resolved_at (all now() of one transaction).
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    from_account   text        NOT NULL,
    to_account     text        NOT NULL,
    -- Who may read it: the owners of its two accounts (NULL for a system
    -- account, which no principal owns).
    from_principal uuid,
    to_principal   uuid,
    -- The account's event_seq for this event, on each account the change
    -- moved (balance or held amount). Every change moves its source; a
    -- hold's creation, void and expiry leave the destination alone (NULL).
    from_seq       bigint      NOT NULL,
    to_seq         bigint,
    CONSTRAINT events_id_unique UNIQUE (id),
    CONSTRAINT events_type_known CHECK (type IN ('transfer.posted', 'transfer.reversed', 'hold.created',
                                                 'hold.posted', 'hold.voided', 'hold.expired')),
    CONSTRAINT events_sequences_of_the_accounts_moved CHECK (
        from_seq >= 1
        AND CASE WHEN type IN ('transfer.posted', 'transfer.reversed', 'hold.posted')
                 THEN to_seq IS NOT NULL AND to_seq >= 1 ELSE to_seq IS NULL END
    ),
    CONSTRAINT events_distinct_accounts CHECK (from_account <> to_account)
);

-- The feed of one principal: every event whose source, or whose
-- destination, it owns, after a cursor, in (txid, position) order. Two
-- ordered index scans, each stopped by the page's LIMIT.
CREATE INDEX events_from_principal_idx ON events (from_principal, txid, position);
CREATE INDEX events_to_principal_idx ON events (to_principal, txid, position);

-- The purge deletes the oldest events (by position, the primary key) past
-- NEXO_EVENT_RETENTION, and records here the newest occurred_at it deleted:
-- every change after it still has its event, which is what the
-- reconciliation checks. One row.
CREATE TABLE events_purged (
    singleton boolean     PRIMARY KEY DEFAULT true,
    through   timestamptz NOT NULL,
    CONSTRAINT events_purged_one_row CHECK (singleton)
);
INSERT INTO events_purged (through) VALUES ('-infinity');

-- The times of a resource, as the API writes them: RFC 3339, UTC,
-- microseconds (src/transfers/render.rs, `timestamp`).
CREATE FUNCTION api_time(at timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');

-- A posting's receipt (render.rs, `ReceiptView`).
CREATE FUNCTION receipt_resource(receipt_id text, debit_entry_id bigint, credit_entry_id bigint,
                                 issued_at timestamptz) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
RETURN jsonb_build_object('receipt_id', receipt_id, 'debit_entry_id', debit_entry_id,
                          'credit_entry_id', credit_entry_id, 'issued_at', api_time(issued_at));

-- A transfer as the API shows it (render.rs, `TransferView` without
-- `reversed_minor`); `reverses` and `batch_id` only when set. The event
-- statements render with these, in the statement that writes the change,
-- because the entry ids and the time are only known there;
-- tests/events.rs compares what they render with what the API answers.
CREATE FUNCTION transfer_resource(id uuid, status text, from_account text, to_account text,
                                  amount_minor bigint, currency text, description text,
                                  created_at timestamptz, receipt jsonb, reverses uuid,
                                  batch_id uuid) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
RETURN jsonb_build_object('transfer_id', id, 'status', status, 'from', from_account, 'to', to_account,
                          'amount_minor', amount_minor, 'currency', currency,
                          'description', description, 'created_at', api_time(created_at),
                          'receipt', receipt)
       || CASE WHEN reverses IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('reverses', reverses) END
       || CASE WHEN batch_id IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('batch_id', batch_id) END;

-- A transfer that began as a hold (render.rs, `HoldTransferView` without
-- `reversed_minor`): `receipt` is NULL until it is posted.
CREATE FUNCTION hold_resource(id uuid, status text, from_account text, to_account text,
                              amount_minor bigint, posted_amount_minor bigint, currency text,
                              description text, created_at timestamptz, expires_at timestamptz,
                              resolved_at timestamptz, receipt jsonb) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE
RETURN jsonb_build_object('transfer_id', id, 'status', status, 'from', from_account, 'to', to_account,
                          'amount_minor', COALESCE(posted_amount_minor, amount_minor),
                          'currency', currency, 'description', description,
                          'created_at', api_time(created_at),
                          'hold', jsonb_build_object('amount_minor', amount_minor,
                                                     'expires_at', api_time(expires_at),
                                                     'resolved_at', api_time(resolved_at)),
                          'receipt', receipt);
