//! `idem` against real stores: records written through the library are shown, listed,
//! counted, released and deleted by the CLI, and tokens keep rising after a CLI delete.
//!
//! Redis (`IDEM_REDIS_URL`), Redis Cluster (`IDEM_REDIS_CLUSTER_NODES`), PostgreSQL
//! (`IDEM_POSTGRES_URL`) and DynamoDB Local (`IDEM_DYNAMO_ENDPOINT`) are skipped with one line
//! each when nothing answers there (and fail in CI); SQLite needs no server.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{Backend, Fixture, fixture, fresh_namespace, json_lines, one_line_error};
use idem_core::{FailureKind, RecordState};
use predicates::str::contains;
use serde_json::Value;

const TEXT: &str = "héllo wörld\n\tsecond line";
const BINARY: [u8; 5] = [0x00, 0x9f, 0x92, 0x96, 0xff];

/// Runs `idem` in a blocking thread (the test's runtime keeps driving the library's
/// connections meanwhile).
async fn run(fx: &Fixture, args: &[&str]) -> std::process::Output {
    let mut cmd = fx.idem(args);
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

fn by_id(lines: &[Value]) -> BTreeMap<String, Value> {
    lines
        .iter()
        .filter_map(|l| Some((l.get("id")?.as_str()?.to_owned(), l.clone())))
        .collect()
}

async fn operator_flow(backend: Backend) {
    let Some(fx) = fixture(backend).await else {
        return;
    };
    let ns = fresh_namespace();
    let n = ns.as_str();
    let text = ns.key("text").unwrap();
    let binary = ns.key("binary").unwrap();
    let failed = ns.key("failed").unwrap();
    let text_token = fx.completed(&text, TEXT.as_bytes()).await;
    let binary_token = fx.completed(&binary, &BINARY).await;
    fx.failed(
        &failed,
        "card declined: insufficient funds",
        FailureKind::Terminal,
    )
    .await;

    // get: UTF-8 results as text, in a table and in JSON.
    let out = run(&fx, &["get", n, "text"]).await;
    assert!(out.status.success(), "{out:?}");
    let shown = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "héllo wörld",
        "utf8",
        "completed",
        "worker-1",
        &text_token.to_string(),
    ] {
        assert!(
            shown.contains(needle),
            "{backend:?}: {needle} not in\n{shown}"
        );
    }
    let out = run(&fx, &["get", n, "text", "--json"]).await;
    let record = &json_lines(&out.stdout)[0];
    assert_eq!(record["result"], TEXT);
    assert_eq!(record["result_encoding"], "utf8");
    assert_eq!(record["result_len"], TEXT.len());
    assert_eq!(record["token"], text_token.get());
    assert_eq!(record["status"], "completed");
    assert_eq!(record["namespace"], n);

    // get: binary results as hex.
    let out = run(&fx, &["get", n, "binary"]).await;
    let shown = String::from_utf8(out.stdout).unwrap();
    assert!(
        shown.contains("009f9296ff") && shown.contains("hex"),
        "{shown}"
    );
    let out = run(&fx, &["get", n, "binary", "--json"]).await;
    let record = &json_lines(&out.stdout)[0];
    assert_eq!(record["result"], "009f9296ff");
    assert_eq!(record["result_encoding"], "hex");
    assert_eq!(record["token"], binary_token.get());

    // get: the error text and kind of a failure.
    let out = run(&fx, &["get", n, "failed", "--json"]).await;
    let record = &json_lines(&out.stdout)[0];
    assert_eq!(record["error"], "card declined: insufficient funds");
    assert_eq!(record["failure_kind"], "terminal");
    assert_eq!(record["status"], "failed_terminal");
    assert_eq!(record["result"], Value::Null);

    // get: not found is exit code 1 and one line.
    let out = run(&fx, &["get", n, "missing"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(one_line_error(&out.stderr).contains("no record"));

    // delete: a dry run and a refusal without a terminal change nothing.
    let out = run(&fx, &["delete", n, "text", "--dry-run"]).await;
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("would_delete"));
    let out = run(&fx, &["delete", n, "text"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(one_line_error(&out.stderr).contains("--yes"));
    assert!(fx.store.get(&text).await.unwrap().is_some());

    // delete --yes: gone, and the next acquire gets a higher token.
    let out = run(&fx, &["delete", n, "text", "--yes", "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    let lines = json_lines(&out.stdout);
    assert_eq!(lines[0]["outcome"], "deleted");
    assert_eq!(lines[0]["id"], "text");
    assert!(fx.store.get(&text).await.unwrap().is_none(), "{backend:?}");
    let again = fx
        .acquire(&text, "worker-3", Duration::from_secs(600))
        .await;
    assert!(
        again.token > text_token,
        "{backend:?}: token {} after the delete of token {text_token}",
        again.token
    );
    assert_eq!(again.attempt, 1, "a deleted key starts over");

    // delete of an id that is not there: exit code 1.
    let out = run(&fx, &["delete", n, "never-written", "--yes"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");

    listing_flow(&fx, n).await;
}

/// On a store that lists: list, pages, stats, release-stuck and filtered delete.
async fn listing_flow(fx: &Fixture, n: &str) {
    let ns = idem_core::Namespace::new(n).unwrap();
    let live = ns.key("live").unwrap();
    fx.acquire(&live, "worker-4", Duration::from_secs(600))
        .await;
    let stuck = ns.key("stuck").unwrap();
    let stuck_lease = fx.stuck(&stuck).await;

    let out = run(fx, &["list", n, "--all", "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    let listed = by_id(&json_lines(&out.stdout));
    let statuses: BTreeMap<&str, &str> = listed
        .iter()
        .map(|(id, r)| (id.as_str(), r["status"].as_str().unwrap()))
        .collect();
    assert_eq!(
        statuses,
        BTreeMap::from([
            ("binary", "completed"),
            ("failed", "failed_terminal"),
            ("live", "in_progress"),
            ("stuck", "lease_expired"),
            ("text", "in_progress"),
        ]),
        "{:?}",
        fx.backend
    );

    // Filters.
    let out = run(fx, &["list", n, "--status", "lease_expired", "--json"]).await;
    let ids: Vec<String> = by_id(&json_lines(&out.stdout)).into_keys().collect();
    assert_eq!(ids, ["stuck"]);
    let out = run(fx, &["list", n, "--owner", "worker-4", "--json"]).await;
    let ids: Vec<String> = by_id(&json_lines(&out.stdout)).into_keys().collect();
    assert_eq!(ids, ["live"]);
    let out = run(fx, &["list", n, "--older-than", "1h", "--json"]).await;
    assert!(json_lines(&out.stdout).is_empty());
    let out = run(fx, &["list", n]).await;
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.starts_with("ID  "), "{table}");
    assert_eq!(table.lines().count(), 6, "{table}");

    // Pages of two, followed by their cursor, cover every record.
    let mut seen = BTreeSet::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10 {
        let mut args = vec!["list", n, "--limit", "2", "--json"];
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let out = run(fx, &args).await;
        assert!(out.status.success(), "{out:?}");
        let lines = json_lines(&out.stdout);
        cursor = lines
            .iter()
            .find_map(|l| Some(l.get("next_cursor")?.as_str()?.to_owned()));
        let page = by_id(&lines);
        assert!(page.len() <= 2, "{lines:?}");
        seen.extend(page.into_keys());
        if cursor.is_none() {
            break;
        }
    }
    assert!(cursor.is_none(), "the listing did not end");
    assert_eq!(seen.len(), 5, "{seen:?}");

    // Stats.
    let out = run(fx, &["stats", n, "--json"]).await;
    let counts = &json_lines(&out.stdout)[0];
    assert_eq!(counts["namespace"], n);
    assert_eq!(counts["completed"], 1);
    assert_eq!(counts["failed_terminal"], 1);
    assert_eq!(counts["in_progress"], 2);
    assert_eq!(counts["lease_expired"], 1);
    assert_eq!(counts["total"], 5);

    // release-stuck: refused without --yes, nothing older than an hour, then the stuck lease
    // and only it.
    let out = run(fx, &["release-stuck", n, "--older-than", "0s"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = run(
        fx,
        &["release-stuck", n, "--older-than", "1h", "--yes", "--json"],
    )
    .await;
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");
    let out = run(
        fx,
        &["release-stuck", n, "--older-than", "0s", "--yes", "--json"],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["id"], "stuck");
    assert_eq!(lines[0]["outcome"], "released");
    assert_eq!(lines[0]["token"], stuck_lease.token.get());
    let after = fx.store.get(&stuck).await.unwrap().unwrap();
    assert_eq!(after.state, RecordState::Released);
    let live_after = fx.store.get(&live).await.unwrap().unwrap();
    assert_eq!(
        live_after.state,
        RecordState::InProgress,
        "a live lease is never released"
    );

    // Filtered delete.
    let out = run(
        fx,
        &[
            "delete",
            n,
            "--status",
            "failed_terminal",
            "--yes",
            "--json",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["id"], "failed");
    assert_eq!(lines[0]["outcome"], "deleted");
    let failed = ns.key("failed").unwrap();
    assert!(fx.store.get(&failed).await.unwrap().is_none());

    // A live lease is not deleted without --include-live (exit code 2), and is with it.
    let out = run(fx, &["delete", n, "live", "--yes", "--json"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let lines = json_lines(&out.stdout);
    assert_eq!(lines[0]["outcome"], "refused_live", "{lines:?}");
    assert_eq!(lines[0]["status"], "in_progress", "{lines:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("1 refused_live") && said.contains("idem: error: refused to delete 1 record"),
        "{said}"
    );
    assert!(fx.store.get(&live).await.unwrap().is_some());
    let out = run(
        fx,
        &[
            "delete",
            n,
            "--owner",
            "worker-4",
            "--include-live",
            "--yes",
            "--json",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["outcome"], "deleted");
    assert!(fx.store.get(&live).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    operator_flow(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster() {
    operator_flow(Backend::Cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    operator_flow(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb() {
    operator_flow(Backend::Dynamo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    operator_flow(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_sets_up_and_is_safe_to_repeat() {
    for backend in [
        Backend::Postgres,
        Backend::Dynamo,
        Backend::Sqlite,
        Backend::Redis,
    ] {
        let Some(fx) = fixture(backend).await else {
            continue;
        };
        for _ in 0..2 {
            let out = run(&fx, &["migrate", "--json"]).await;
            assert!(out.status.success(), "{backend:?}: {out:?}");
            let report = &json_lines(&out.stdout)[0];
            // Already set up by the fixture (SQLite does not tell).
            assert_ne!(report["changed"], true, "{backend:?}: {report}");
        }
        let out = run(&fx, &["create-table"]).await;
        assert!(out.status.success(), "{backend:?}: {out:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_schema_or_table_is_a_store_error_that_says_how_to_fix_it() {
    let cases = [
        (
            Backend::Postgres,
            "schema=idem_cli_test",
            "schema=idem_cli_absent",
        ),
        (
            Backend::Dynamo,
            "dynamodb://idem-cli-test",
            "dynamodb://idem-cli-absent",
        ),
    ];
    for (backend, from, to) in cases {
        let Some(fx) = fixture(backend).await else {
            continue;
        };
        let url = fx.url.replace(from, to);
        let out = common::idem()
            .args(["--store", &url, "get", "ns", "id"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(4), "{backend:?}: {out:?}");
        let line = one_line_error(&out.stderr);
        assert!(
            line.contains("not set up") && line.contains("idem migrate"),
            "{line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_on_stores_that_expire_by_themselves_says_so() {
    for backend in [
        Backend::Redis,
        Backend::Cluster,
        Backend::Postgres,
        Backend::Sqlite,
    ] {
        let Some(fx) = fixture(backend).await else {
            continue;
        };
        let out = run(&fx, &["purge", "--json"]).await;
        assert!(out.status.success(), "{backend:?}: {out:?}");
        let report = &json_lines(&out.stdout)[0];
        assert!(report["purged"].is_u64(), "{report}");
        if matches!(backend, Backend::Redis | Backend::Cluster) {
            fx.idem(&["purge"])
                .assert()
                .success()
                .stderr(contains("removes expired records by itself"));
        }
    }
}
