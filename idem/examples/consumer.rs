//! A simulated consumer fleet on `MemoryStore`: two workers share one queue that redelivers,
//! a producer that retries, a crash in the middle of a payment, a transient failure, a poison
//! message, a reused key, a message without a key and a malformed one. Every delivery goes
//! through the executor and `BrokerAction::of` decides what the "broker" does with it.
//!
//! Run: `cargo run -p idem --example consumer`

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::executor::{ExecutorConfig, InProgressWait, RawMessage};
use idem::{BrokerAction, Executor, HandlerContext, HandlerError, MemoryStore, Message};
use serde::{Deserialize, Serialize};
use tokio::time::{Instant, sleep, timeout};

/// The downstream system the handler writes to: one row per payment, fenced by token (a write
/// with a lower token than the row's is refused, so a zombie worker cannot overwrite).
#[derive(Default)]
struct Ledger {
    rows: Mutex<BTreeMap<String, (u64, u64)>>, // payment id -> (amount, token)
}

impl Ledger {
    fn charge(&self, ctx: &HandlerContext, amount: u64) -> Result<(), HandlerError> {
        let id = ctx.key().expect("deduplicated").id().to_owned();
        let token = ctx.token().expect("deduplicated").get();
        let mut rows = self.rows.lock().unwrap();
        match rows.get(&id) {
            Some(&(_, existing)) if existing > token => Err(HandlerError::terminal("fenced")),
            _ => {
                rows.insert(id, (amount, token));
                Ok(())
            }
        }
    }
}

#[derive(Deserialize)]
struct Payment {
    amount: serde_json::Value,
}

#[derive(Serialize, Deserialize, Debug)]
struct Receipt {
    amount: u64,
    token: u64,
}

struct Delivery {
    msg: RawMessage,
    label: &'static str,
    not_before: Instant,
    count: u32,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(MemoryStore::new());
    let ledger = Arc::new(Ledger::default());
    let config = ExecutorConfig::new("payments")
        .with_lease_ttl(Duration::from_millis(300))
        .with_heartbeat_interval(Duration::from_millis(100))
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(50))
        .with_in_progress_wait(InProgressWait::default().with_max_wait(Duration::from_millis(100)));
    let workers: Vec<Executor> = ["worker-a", "worker-b"]
        .into_iter()
        .map(|owner| {
            Executor::builder(store.clone())
                .config(config.clone().with_owner(owner))
                .on_dead_letter(|dl| {
                    println!(
                        "    !! dead-letter hook: {} after {} attempts: {}",
                        dl.key, dl.attempts, dl.last_error
                    )
                })
                .build()
        })
        .collect::<Result<_, _>>()?;

    let now = Instant::now();
    let payment = |label, key: &str, body: &str| Delivery {
        msg: RawMessage::new(body.to_owned()).with_header("idempotency-key", key.to_owned()),
        label,
        not_before: now,
        count: 0,
    };
    let mut queue: VecDeque<Delivery> = VecDeque::from([
        payment("first charge", "pay-1", r#"{"amount": 100}"#),
        payment("second charge", "pay-2", r#"{"amount": 250}"#),
        payment("producer retry of pay-1", "pay-1", r#"{"amount": 100}"#),
        payment("worker crashes mid-charge", "pay-3", r#"{"amount": 75}"#),
        payment("downstream always refuses", "pay-4", r#"{"amount": 13}"#),
        payment("transient timeout once", "pay-5", r#"{"amount": 40}"#),
        payment(
            "key reused for another amount",
            "pay-2",
            r#"{"amount": 999}"#,
        ),
        Delivery {
            msg: RawMessage::new(r#"{"amount": 5}"#),
            label: "no idempotency key",
            not_before: now,
            count: 0,
        },
        payment("malformed amount", "pay-6", r#"{"amount": "abc"}"#),
    ]);
    let crashed_once = AtomicBool::new(false);
    let timed_out_once = AtomicBool::new(false);
    let mut dead_letters = Vec::new();
    let mut turn = 0usize;

    while let Some(mut d) = queue.pop_front() {
        sleep(d.not_before.saturating_duration_since(Instant::now())).await;
        d.count += 1;
        let exec = &workers[turn % workers.len()];
        turn += 1;
        println!(
            "{} receives {:?} ({}, delivery {})",
            exec.owner(),
            d.label,
            key_of(&d.msg),
            d.count
        );

        let crash_now =
            d.label.starts_with("worker crashes") && !crashed_once.swap(true, Ordering::SeqCst);
        let ledger = ledger.clone();
        let timed_out_once = &timed_out_once;
        let body = d.msg.clone();
        let run = exec.run(&d.msg, |ctx| async move {
            let payment: Payment =
                serde_json::from_slice(body.payload()).map_err(HandlerError::terminal)?;
            let amount = payment.amount.as_u64().ok_or_else(|| {
                HandlerError::terminal(format!(
                    "amount {} is not a positive integer",
                    payment.amount
                ))
            })?;
            if ctx.is_takeover() {
                println!(
                    "    took over attempt {} with token {}",
                    ctx.attempt(),
                    ctx.token().unwrap()
                );
            }
            if crash_now {
                sleep(Duration::from_secs(10)).await; // the process dies in here
            }
            if amount == 13 {
                return Err(HandlerError::retryable("bank refused the charge"));
            }
            if amount == 40 && !timed_out_once.swap(true, Ordering::SeqCst) {
                return Err(HandlerError::retryable("bank timed out"));
            }
            ledger.charge(&ctx, amount)?;
            Ok(Receipt {
                amount,
                token: ctx.token().unwrap().get(),
            })
        });

        let result = if crash_now {
            match timeout(Duration::from_millis(30), run).await {
                Ok(result) => result,
                Err(_) => {
                    println!(
                        "    ** {} crashed; the broker redelivers after its visibility timeout",
                        exec.owner()
                    );
                    d.not_before = Instant::now() + Duration::from_millis(150);
                    queue.push_back(d);
                    continue;
                }
            }
        } else {
            run.await
        };

        let shown = match &result {
            Ok(outcome) => format!("{} {:?}", outcome.name(), outcome.value()),
            Err(e) => format!("error: {e}"),
        };
        match BrokerAction::of(&result) {
            BrokerAction::Ack => println!("    {shown} -> ack"),
            BrokerAction::Retry { after } => {
                println!("    {shown} -> retry in {after:?}");
                d.not_before = Instant::now() + after;
                queue.push_back(d);
            }
            BrokerAction::DeadLetter { reason, error } => {
                println!("    {shown} -> dead-letter ({reason}): {error}");
                dead_letters.push((d.label, reason, error));
            }
            other => println!("    {shown} -> {other:?}"),
        }
    }

    println!("\nledger (payment -> amount, token):");
    for (id, (amount, token)) in ledger.rows.lock().unwrap().iter() {
        println!("  {id}: {amount} (token {token})");
    }
    println!("dead-letter queue:");
    for (label, reason, error) in &dead_letters {
        println!("  {label}: {reason} ({error})");
    }
    Ok(())
}

fn key_of(msg: &RawMessage) -> String {
    msg.header("idempotency-key")
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .unwrap_or_else(|| "no key".to_owned())
}
