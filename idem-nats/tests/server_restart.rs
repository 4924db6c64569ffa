//! The server killed (SIGKILL) and restarted mid-run: the client reconnects, the runner goes on
//! pulling, and every key still gets exactly one effect. Runs a PRIVATE `nats-server -js` on its
//! own port and store directory (`nats-server` must be installed: `scripts/services.sh nats`),
//! never the shared one.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError, Message};
use idem_nats::{NatsMessage, NatsRunner, RunnerOptions};
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

const KEYS: usize = 400;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_recovers_from_a_server_restart() {
    if !nats_and_redis() || !nats_program() {
        return;
    }
    init_tracing();
    let mut server = PrivateServer::start().await;
    let url = server.url();
    let client = idem_nats::async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(&url)
        .await
        .expect("connect to the private server");
    let js = idem_nats::async_nats::jetstream::new(client.clone());
    let name = unique("restart");
    create_streams(&js, &name).await;
    let msgs: Vec<Msg> = (0..KEYS)
        .map(|i| Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&js, &name, &msgs).await;

    let prefix = format!("{}:", unique("idem-nats-restart"));
    let store = shared(redis_store(&format!("{prefix}idem:")).await);
    let ledger = format!("{prefix}ledger");
    let conn = redis_conn().await;
    let effects = ledger.clone();
    // The second half of the keys waits for the kill: it comes mid-run however slowly the test
    // gets to it.
    let (killed_tx, killed) = tokio::sync::watch::channel(false);
    let handler = move |msg: NatsMessage, ctx: HandlerContext| {
        let mut conn = conn.clone();
        let ledger = effects.clone();
        let mut killed = killed.clone();
        async move {
            let key = ctx.key().unwrap().id().to_owned();
            if key[1..].parse::<usize>().expect("k<n>") >= KEYS / 2 {
                let _ = killed.wait_for(|k| *k).await;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            let _: i64 = conn.hincr(&ledger, &key, 1).await?;
            Ok::<_, HandlerError>(Message::payload(&msg).len())
        }
    };
    let config = ExecutorConfig::new("restart")
        .with_lease_ttl(Duration::from_secs(3))
        .with_heartbeat_interval(Duration::from_secs(1))
        .with_retry_delay(Duration::from_millis(100));
    let runner = NatsRunner::builder(client, &name, "workers", executor(store, config), handler)
        .options(
            RunnerOptions::default()
                .with_max_in_flight(8)
                .with_ack_wait(Duration::from_secs(3))
                .with_retry_delays(Duration::from_millis(50), Duration::from_secs(1))
                .with_reconnect_delays(Duration::from_millis(100), Duration::from_millis(500)),
        )
        .build()
        .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));

    let mut redis = redis_conn().await;
    let count = |mut redis: redis::aio::ConnectionManager, ledger: String| async move {
        redis.hlen::<_, usize>(ledger).await.unwrap()
    };
    let progressed = wait_for(Duration::from_secs(30), || {
        let (r, l) = (redis.clone(), ledger.clone());
        async move { count(r, l).await >= KEYS / 4 }
    })
    .await;
    assert!(progressed, "no progress before the restart: {stats:?}");
    let restart = Instant::now();
    server.kill();
    let at_kill = count(redis.clone(), ledger.clone()).await;
    killed_tx.send(true).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart().await;
    let restarted_in = restart.elapsed();
    assert!(
        at_kill < KEYS,
        "the server died mid-run ({at_kill} of {KEYS})"
    );

    let all = wait_for(Duration::from_secs(60), || {
        let (r, l) = (redis.clone(), ledger.clone());
        async move { count(r, l).await >= KEYS }
    })
    .await;
    let settled = wait_for(Duration::from_secs(30), || {
        let (js, name) = (js.clone(), name.clone());
        async move { consumer_state(&js, &name, "workers").await == (0, 0) }
    })
    .await;
    let recovered_in = restart.elapsed();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(all && settled, "{stats:?}");
    let ledger: HashMap<String, u64> = redis.hgetall(&ledger).await.unwrap();
    assert_eq!(ledger.len(), KEYS);
    let twice: Vec<_> = ledger.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "exactly one effect per key; more for {twice:?}"
    );
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    eprintln!(
        "server restart: killed with {at_kill}/{KEYS} effects, back in {restarted_in:?}, all \
         effects and nothing pending {recovered_in:?} after the kill; {stats:?}"
    );
}
