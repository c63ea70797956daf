-- The SQL of k transfers posted together, as the server's posting batches
-- do (src/ledger/repo.rs, write_planned), and their k claims in one
-- statement, as the server's claim statements carry the claims that arrive
-- together (ADR-006 §7). Variables (-D): principal, accounts, hot, k.
-- Needs bench_pairs (bench/pgbench/pairs.sql).
\set batch random(1, 1000000000000)
-- Phase 1: the k claims, one statement, committed on its own.
INSERT INTO idempotency_keys (principal_id, idempotency_key, request_method, request_path,
                              fingerprint, status, lock_token, locked_until, expires_at,
                              retain_until)
SELECT :principal::uuid, 'pgbb-' || :client_id || '-' || :batch || '-' || p.n, 'POST', '/transfers',
       sha256(convert_to('pgbb-' || :batch || '-' || p.n, 'UTF8')), 'IN_PROGRESS', gen_random_uuid(),
       now() + interval '30 seconds', now() + interval '24 hours', now() + interval '400 days'
FROM bench_pairs(:batch, :k, :accounts, :hot) AS p
ON CONFLICT (principal_id, idempotency_key) DO NOTHING;
-- Phase 2: lock every account of the batch in id order; then one statement
-- writes the transfers, moves the balances and event sequences (running,
-- in batch order), writes the entries and the events; then the k keys are
-- completed; all in one transaction.
BEGIN;
-- `= ANY(ARRAY(…))`: primary-key lookups, as the server's `= ANY($1)`; an
-- `IN (subquery)` is planned as a scan of every account.
SELECT count(*) FROM (
    SELECT id FROM accounts
    WHERE id = ANY(ARRAY(SELECT 'acc_L' || a FROM bench_pairs(:batch, :k, :accounts, :hot)
                         UNION SELECT 'acc_L' || b FROM bench_pairs(:batch, :k, :accounts, :hot)))
    ORDER BY id FOR UPDATE) AS locked;
WITH p AS (
    SELECT n, 'acc_L' || a AS from_account, 'acc_L' || b AS to_account, amount,
           'pgbb-' || :client_id || '-' || :batch || '-' || n AS key
    FROM bench_pairs(:batch, :k, :accounts, :hot)
), t AS (
    INSERT INTO transfers (id, principal_id, idempotency_key, request_fingerprint, from_account,
                           to_account, currency, amount_minor, description, receipt_id)
    SELECT gen_random_uuid(), :principal::uuid, p.key, sha256(convert_to(p.key, 'UTF8')),
           p.from_account, p.to_account, 'USD', p.amount, NULL, 'rcpt_' || md5(p.key)
    FROM p ORDER BY p.n
    RETURNING id, idempotency_key, status, from_account, to_account, currency, amount_minor,
              description, receipt_id, created_at, reverses, batch_id
), legs AS (
    SELECT t.id, p.n, side, CASE side WHEN 0 THEN t.from_account ELSE t.to_account END AS account,
           CASE side WHEN 0 THEN -t.amount_minor ELSE t.amount_minor END AS delta
    FROM t JOIN p ON p.key = t.idempotency_key CROSS JOIN (VALUES (0), (1)) AS s(side)
), running AS (
    -- `accounts` here is the statement's snapshot: the balances before it.
    SELECT l.*, a.balance_minor + sum(l.delta) OVER w AS balance_after,
           a.event_seq + row_number() OVER w AS seq
    FROM legs l JOIN accounts a ON a.id = l.account
    WINDOW w AS (PARTITION BY l.account ORDER BY l.n, l.side)
), moved AS (
    UPDATE accounts a SET balance_minor = c.balance_after, event_seq = c.seq
    FROM (SELECT DISTINCT ON (account) account, balance_after, seq FROM running
          ORDER BY account, n DESC, side DESC) AS c
    WHERE a.id = c.account
    RETURNING a.id
), entries AS (
    INSERT INTO ledger_entries (transfer_id, account_id, currency, amount_minor, balance_after_minor)
    SELECT id, account, 'USD', delta, balance_after FROM running ORDER BY n, side
    RETURNING id, transfer_id, amount_minor
), announced AS (
    INSERT INTO events (type, resource_id, resource, occurred_at, from_account, to_account,
                        from_principal, to_principal, from_seq, to_seq)
    SELECT 'transfer.posted', t.id,
           transfer_resource(t.id, t.status, t.from_account, t.to_account, t.amount_minor, t.currency,
                             t.description, t.created_at,
                             receipt_resource(t.receipt_id, d.id, c.id, t.created_at),
                             t.reverses, t.batch_id),
           t.created_at, t.from_account, t.to_account, :principal::uuid, :principal::uuid,
           rd.seq, rc.seq
    FROM t
    JOIN entries d ON d.transfer_id = t.id AND d.amount_minor < 0
    JOIN entries c ON c.transfer_id = t.id AND c.amount_minor > 0
    JOIN running rd ON rd.id = t.id AND rd.side = 0
    JOIN running rc ON rc.id = t.id AND rc.side = 1
    RETURNING 1
)
SELECT (SELECT count(*) FROM t) AS transfers, (SELECT count(*) FROM moved) AS moved,
       (SELECT count(*) FROM announced) AS announced;
-- By the keys, `= ANY(ARRAY(…))` on both tables, as the server completes
-- by the keys it holds: a join on the principal alone would read every
-- key or transfer of the benchmark's one principal, a cost that grows with
-- the run.
UPDATE idempotency_keys k
SET status = 'COMPLETED', response_status = 201,
    response_headers = '[["content-type","application/json"],["location","/transfers/x"]]',
    response_body = convert_to(repeat('x', 420), 'UTF8'), transfer_id = t.id, updated_at = now()
FROM transfers t
WHERE k.principal_id = :principal::uuid
  AND k.idempotency_key = ANY(ARRAY(SELECT 'pgbb-' || :client_id || '-' || :batch || '-' || n
                                    FROM bench_pairs(:batch, :k, :accounts, :hot)))
  AND t.principal_id = :principal::uuid
  AND t.idempotency_key = ANY(ARRAY(SELECT 'pgbb-' || :client_id || '-' || :batch || '-' || n
                                    FROM bench_pairs(:batch, :k, :accounts, :hot)))
  AND t.idempotency_key = k.idempotency_key
  AND k.status = 'IN_PROGRESS';
COMMIT;
