-- The transfers of one batched pgbench transaction, a function of the
-- batch's number: every statement of the transaction draws the same k
-- transfers, and no client-side state is needed. Created in the bench's
-- own database (dropped afterwards). Accounts 1..accounts; `hot` > 0 makes
-- every transfer debit that account.
CREATE FUNCTION bench_pairs(batch bigint, k int, accounts int, hot int)
RETURNS TABLE (n int, a int, b int, amount bigint)
LANGUAGE sql IMMUTABLE AS $$
    SELECT g, x.a, CASE WHEN x.b >= x.a THEN x.b + 1 ELSE x.b END,
           1 + abs(hashint8(batch * 1000 + g * 3 + 2)) % 1000
    FROM generate_series(1, k) AS g,
         LATERAL (SELECT CASE WHEN hot > 0 THEN hot
                              ELSE 1 + (abs(hashint8(batch * 1000 + g * 3)) % accounts)::int END AS a,
                         1 + (abs(hashint8(batch * 1000 + g * 3 + 1)) % (accounts - 1))::int AS b) AS x
$$;
