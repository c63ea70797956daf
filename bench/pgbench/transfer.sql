-- The SQL of one transfer, as the server issues it, for pgbench: the
-- database's own ceiling. Variables from the command line (-D): principal
-- (a principal's uuid), accounts (how many acc_L<n> there are) and hot (0,
-- or the number of the account every transfer debits).
-- Phase 1: claim the key, committed on its own.
\set k random(1, 1000000000000000)
\set a random(1, :accounts)
\set a case when :hot > 0 then :hot else :a end
\set b random(1, :accounts - 1)
\set b case when :b >= :a then :b + 1 else :b end
\set amount random(1, 1000)
INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path,
                              fingerprint, status, lock_token, locked_until, expires_at,
                              retain_until)
VALUES (:principal::uuid, 'pgb-' || :client_id || '-' || :k, 'POST', '/transfers',
        sha256(convert_to('pgb-' || :k, 'UTF8')), 'IN_PROGRESS', gen_random_uuid(),
        now() + interval '30 seconds', now() + interval '24 hours', now() + interval '400 days')
ON CONFLICT (principal_id, idempotency_key) DO NOTHING
RETURNING lock_token \gset
-- Phase 2: lock both accounts in id order, write the transfer, move both
-- balances and event sequences, write both entries and the transfer's
-- event, complete the key fenced by its token.
BEGIN;
SELECT max(balance_minor) FILTER (WHERE id = 'acc_L' || :a) AS balance_a,
       max(balance_minor) FILTER (WHERE id = 'acc_L' || :b) AS balance_b,
       max(event_seq) FILTER (WHERE id = 'acc_L' || :a) + 1 AS seq_a,
       max(event_seq) FILTER (WHERE id = 'acc_L' || :b) + 1 AS seq_b
FROM (SELECT id, principal_id, currency, balance_minor, held_minor, allow_negative, event_seq FROM accounts
      WHERE id IN ('acc_L' || :a, 'acc_L' || :b) ORDER BY id FOR UPDATE) locked \gset
INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint, from_account,
                       to_account, currency, amount_minor, description, receipt_id)
VALUES (gen_random_uuid(), :principal::uuid, 'pgb-' || :client_id || '-' || :k,
        sha256(convert_to('pgb-' || :k, 'UTF8')), 'acc_L' || :a, 'acc_L' || :b, 'USD', :amount::bigint,
        NULL, 'rcpt_' || md5(random()::text))
RETURNING id AS transfer_id, created_at \gset
UPDATE accounts
SET balance_minor = balance_minor + CASE WHEN id = 'acc_L' || :a THEN -(:amount::bigint) ELSE :amount::bigint END,
    event_seq = event_seq + 1
WHERE id IN ('acc_L' || :a, 'acc_L' || :b);
\set after_a :balance_a - :amount
\set after_b :balance_b + :amount
WITH entries AS (
    INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor)
    VALUES (:transfer_id::uuid, 'acc_L' || :a, 'USD', -(:amount::bigint), :after_a::bigint),
           (:transfer_id::uuid, 'acc_L' || :b, 'USD', :amount, :after_b::bigint)
    RETURNING id, amount_minor
)
INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                    from_principal, to_principal, from_seq, to_seq)
SELECT 'transfer.posted', t.id,
       transfer_resource(t.id, t.status, t.from_account, t.to_account, t.amount_minor, t.currency,
                         t.description, t.created_at,
                         receipt_resource(t.receipt_id, (SELECT id FROM entries WHERE amount_minor < 0),
                                          (SELECT id FROM entries WHERE amount_minor > 0), t.created_at),
                         t.reverses, t.batch_id),
       t.created_at, t.from_account, t.to_account, :principal::uuid, :principal::uuid,
       :seq_a, :seq_b
FROM transfers t WHERE t.id = :transfer_id::uuid;
UPDATE idempotency_keys
SET status = 'COMPLETED', response_status = 201,
    response_headers = '[["content-type","application/json"],["location","/transfers/x"]]',
    response_body = convert_to(repeat('x', 420), 'UTF8'), transfer_id = :transfer_id::uuid,
    updated_at = now()
WHERE principal_id = :principal::uuid AND idempotency_key = 'pgb-' || :client_id || '-' || :k
  AND lock_token = :lock_token::uuid AND status = 'IN_PROGRESS';
COMMIT;
