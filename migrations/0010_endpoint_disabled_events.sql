-- The feed says when a webhook endpoint is disabled (docs/events.md): an
-- event about the endpoint, not about money. It names no account, so it
-- has no account sequence; its only reader is the endpoint's owner
-- (from_principal). Ledger events keep every rule they had.
ALTER TABLE events
    ALTER COLUMN from_account DROP NOT NULL,
    ALTER COLUMN to_account DROP NOT NULL,
    ALTER COLUMN from_seq DROP NOT NULL,
    DROP CONSTRAINT events_type_known,
    DROP CONSTRAINT events_sequences_of_the_accounts_moved,
    ADD CONSTRAINT events_type_known CHECK (type IN ('transfer.posted', 'transfer.reversed', 'hold.created',
                                                     'hold.posted', 'hold.voided', 'hold.expired',
                                                     'webhook_endpoint.disabled')),
    ADD CONSTRAINT events_sequences_of_the_accounts_moved CHECK (
        CASE WHEN type = 'webhook_endpoint.disabled'
             THEN from_account IS NULL AND to_account IS NULL AND from_seq IS NULL AND to_seq IS NULL
                  AND from_principal IS NOT NULL AND to_principal IS NULL
             ELSE from_account IS NOT NULL AND to_account IS NOT NULL AND from_seq >= 1
                  AND CASE WHEN type IN ('transfer.posted', 'transfer.reversed', 'hold.posted')
                           THEN to_seq IS NOT NULL AND to_seq >= 1 ELSE to_seq IS NULL END
        END
    );

-- An endpoint may ask for the notice (an operator's endpoint watching the
-- others, say).
ALTER TABLE webhook_endpoints
    DROP CONSTRAINT webhook_endpoints_event_types_known,
    ADD CONSTRAINT webhook_endpoints_event_types_known CHECK (
        event_types <@ ARRAY['transfer.posted', 'transfer.reversed', 'hold.created', 'hold.posted',
                             'hold.voided', 'hold.expired', 'webhook_endpoint.disabled']::text[]
    );
