#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The seed's "two instances behind the load balancer": three server
//! processes share one database, and every key reaches all of them at once.
mod common;

use std::time::Duration;

use common::process::*;
use common::*;
use futures::future::join_all;
use sqlx::PgPool;
use tokio::time::Instant;

const INSTANCES: usize = 3;
/// Keys in one round; each is sent by every instance COPIES times at once.
const KEYS: usize = 40;
const COPIES: usize = 3;
const ROUNDS: usize = 3;

#[sqlx::test(migrator = "nexo_transfers::db::MIGRATOR")]
async fn the_same_key_on_three_instances_executes_once(pool: PgPool) {
    nexo_transfers::admin::load_demo(&pool).await.unwrap();
    let url = database_url(&pool);
    let servers = join_all((0..INSTANCES).map(|_| ServerProcess::start(&url, &[]))).await;
    let client = fault_client(Duration::from_secs(30));

    let mut answers: Vec<(String, Vec<Reply>)> = Vec::new();
    let (mut created, mut conflicts) = (0, 0);
    for round in 0..ROUNDS {
        let intents: Vec<(String, serde_json::Value)> = (0..KEYS)
            .map(|i| {
                let amount = (round * KEYS + i + 1) as i64;
                (new_key(), transfer(A_USD, B_USD, amount, "USD"))
            })
            .collect();
        let requests = intents.iter().flat_map(|(key, body)| {
            servers.iter().flat_map(move |server| {
                (0..COPIES).map(move |_| (key.clone(), body.clone(), server.base.clone()))
            })
        });
        let replies = join_all(requests.map(|(key, body, base)| {
            let client = client.clone();
            async move {
                let reply = try_post_transfer(&client, &base, TOKEN_A, &key, &body)
                    .await
                    .expect("every instance answers");
                (key, reply)
            }
        }))
        .await;
        for (key, body) in &intents {
            let mine: Vec<Reply> = replies
                .iter()
                .filter(|(k, _)| k == key)
                .map(|(_, r)| r.clone())
                .collect();
            let successes: Vec<&Reply> = mine.iter().filter(|r| r.status == 201).collect();
            for reply in &mine {
                match reply.status {
                    201 => assert_eq!(reply.body, successes[0].body, "replays differ"),
                    409 => reply.assert_problem(409, "request-in-flight"),
                    other => panic!("{key}: unexpected {other}: {:?}", reply.body),
                }
            }
            assert!(
                successes.iter().filter(|r| !r.replayed()).count() <= 1,
                "{key} executed on more than one instance"
            );
            created += successes.len();
            conflicts += mine.len() - successes.len();
            // Whatever the storm answered, the key now replays its one result.
            let last = send_until_answered(
                &client,
                &servers[0].base,
                TOKEN_A,
                key,
                body,
                Instant::now() + Duration::from_secs(30),
            )
            .await;
            if let Some(first) = successes.first() {
                assert_eq!(last.body, first.body);
            }
            let mut all = mine.clone();
            all.retain(|r| r.status == 201);
            all.push(last);
            answers.push((key.clone(), all));
        }
    }
    assert_each_intent_moved_once(&pool, &answers).await;
    assert_ledger_consistent(&pool).await;
    let total = ROUNDS * KEYS * INSTANCES * COPIES;
    println!(
        "multi-instance: {INSTANCES} processes, {} keys, {total} requests: {created} answered 201 \
         (one execution per key, the rest byte-identical replays), {conflicts} answered 409",
        ROUNDS * KEYS
    );
}
