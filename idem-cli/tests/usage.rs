//! Usage, URLs and errors, on `memory:` (a store that lives as long as one command) and with
//! nothing listening: no server needed.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::{idem, json_lines, one_line_error};
use predicates::prelude::*;
use predicates::str::contains;

#[test]
fn help_documents_the_exit_codes_and_the_store_urls() {
    let help = idem().arg("--help").assert().success();
    let out = String::from_utf8(help.get_output().stdout.clone()).unwrap();
    for needle in [
        "Exit codes:",
        "0  done",
        "1  not found",
        "2  bad usage",
        "3  store unavailable",
        "4  store error",
        "memory:",
        "redis+cluster://",
        "postgres://",
        "dynamodb://TABLE",
        "sqlite://",
        "--timeout",
        "[default: 10s]",
    ] {
        assert!(out.contains(needle), "{needle} not in --help:\n{out}");
    }
    idem()
        .args(["help", "release-stuck"])
        .assert()
        .success()
        .stdout(contains("fences the release"));
}

/// A message that kills its worker every time must be left to run out of attempts: deleting
/// its record resets the attempts (the tombstone keeps only the token), so each delete buys it
/// `max_attempts` more runs, each of which may charge.
#[test]
fn crash_looping_messages_are_left_to_exhaust_not_deleted() {
    // Text with its line breaks and indents as single spaces.
    let flat = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let help = |command: &str| {
        let out = idem().args(["help", command]).output().unwrap();
        flat(&String::from_utf8(out.stdout).unwrap())
    };
    let readme = flat(include_str!("../README.md"));
    assert!(
        !readme.contains("delete it instead"),
        "the README advises it"
    );
    assert!(
        readme.contains("a delete resets its attempt count"),
        "the README says why not"
    );
    let release = help("release-stuck");
    assert!(!release.contains("better deleted"), "{release}");
    assert!(release.contains("is better left alone"), "{release}");
    let delete = help("delete");
    assert!(
        delete.contains("Deleting also resets the attempt count"),
        "{delete}"
    );
    assert!(delete.contains("--include-live"), "{delete}");
}

#[test]
fn a_store_is_required() {
    let out = idem().args(["get", "ns", "id"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(one_line_error(&out.stderr).contains("IDEM_STORE"));
    // ... and may come from the environment.
    idem()
        .env("IDEM_STORE", "memory:")
        .args(["get", "ns", "id"])
        .assert()
        .code(1);
}

#[test]
fn bad_store_urls_are_one_line_and_exit_code_2() {
    for url in [
        "mysql://root:hunter2@127.0.0.1/db",
        "redis:/",
        "redis+cluster://a:1,,b:2",
        "dynamodb://",
        "dynamodb://t?endpoint=ftp://x",
        "sqlite://",
        "postgres://postgres@127.0.0.1:5432/test?schema=Bad-Name",
        "postgres://postgres@127.0.0.1:5432/test?nonsense=1",
        "nothing at all",
    ] {
        let out = idem()
            .args(["--store", url, "get", "ns", "id"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{url}: {out:?}");
        let line = one_line_error(&out.stderr);
        assert!(!line.contains("hunter2"), "a password in {line}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn bad_arguments_are_exit_code_2() {
    for args in [
        &["get", "bad namespace!", "id"][..],
        &["list", "ns", "--status", "stuck"],
        &["list", "ns", "--limit", "0"],
        &["list", "ns", "--older-than", "soon"],
        &["--timeout", "1ms", "list", "ns"],
        &["delete", "ns"],
        &["delete", "ns", "a", "--status", "completed"],
        &["release-stuck", "ns"],
        &["stats"],
        &["frobnicate"],
    ] {
        let out = idem()
            .args(["--store", "memory:"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
}

#[test]
fn memory_answers_every_command() {
    let m = ["--store", "memory:"];
    idem()
        .args(m)
        .args(["get", "orders", "42"])
        .assert()
        .code(1)
        .stderr(contains("no record orders/42"));
    let out = idem()
        .args(m)
        .args(["list", "orders", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");
    idem()
        .args(m)
        .args(["list", "orders", "--all"])
        .assert()
        .success()
        .stderr(contains("no matching records"));
    let out = idem()
        .args(m)
        .args(["stats", "orders", "refunds", "--json"])
        .output()
        .unwrap();
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["namespace"], "refunds");
    assert_eq!(lines[1]["total"], 0);
    assert_eq!(lines[1]["exhausted"], 0);
    idem()
        .args(m)
        .args(["stats", "orders"])
        .assert()
        .success()
        .stdout(contains("NAMESPACE").and(contains("lease_expired")));
    idem()
        .args(m)
        .args(["delete", "orders", "42", "43", "--yes"])
        .assert()
        .code(1)
        .stderr(contains("not found: orders/42"));
    idem()
        .args(m)
        .args(["delete", "orders", "--status", "exhausted"])
        .assert()
        .success()
        .stderr(contains("nothing matched"));
    idem()
        .args(m)
        .args(["release-stuck", "orders", "--older-than", "5m", "--dry-run"])
        .assert()
        .success();
    let out = idem().args(m).args(["purge", "--json"]).output().unwrap();
    assert_eq!(json_lines(&out.stdout)[0]["purged"], 0);
    idem()
        .args(m)
        .args(["migrate"])
        .assert()
        .success()
        .stdout("memory: nothing to set up\n");
}

#[test]
fn migrate_print_shows_the_ddl_without_connecting() {
    // Nothing listens on port 1: --print must not try.
    idem()
        .args([
            "--store",
            "postgres://app@127.0.0.1:1/db?schema=billing",
            "migrate",
            "--print",
        ])
        .assert()
        .success()
        .stdout(
            contains("CREATE SCHEMA IF NOT EXISTS \"billing\";").and(contains(
                "CREATE TABLE IF NOT EXISTS \"billing\".\"records\"",
            )),
        );
    // The URL's region and endpoint go with both commands, quoted for the shell.
    idem()
        .args([
            "--store",
            "dynamodb://payments-idem?endpoint=http://127.0.0.1:1/x?a%3D1%26b%3D2&region=eu-west-1",
            "create-table",
            "--print",
        ])
        .assert()
        .success()
        .stdout(
            contains(
                "aws dynamodb create-table --region eu-west-1 \
                 --endpoint-url 'http://127.0.0.1:1/x?a=1&b=2' --table-name payments-idem",
            )
            .and(contains(
                "aws dynamodb update-time-to-live --region eu-west-1 \
                 --endpoint-url 'http://127.0.0.1:1/x?a=1&b=2' --table-name payments-idem",
            ))
            .and(contains("AttributeName=ttl")),
        );
    idem()
        .args([
            "--store",
            "dynamodb://payments-idem",
            "create-table",
            "--print",
        ])
        .assert()
        .success()
        .stdout(contains(
            "aws dynamodb create-table --table-name payments-idem",
        ));
    idem()
        .args([
            "--store",
            "sqlite:///nonexistent/dir/idem.db",
            "migrate",
            "--print",
        ])
        .assert()
        .success()
        .stdout(contains("CREATE TABLE IF NOT EXISTS idem_records"));
    idem()
        .args(["--store", "redis://127.0.0.1:1", "migrate", "--print"])
        .assert()
        .success()
        .stdout(contains("nothing to create"));
    let out = idem()
        .args([
            "--store",
            "dynamodb://a?endpoint=http://127.0.0.1:1",
            "migrate",
            "--print",
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a table name DynamoDB refuses: {out:?}"
    );
}

#[test]
fn a_missing_sqlite_file_is_not_created_by_reading_commands() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let url = format!("sqlite://{}", path.display());
    let out = idem()
        .args(["--store", &url, "get", "ns", "id"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(one_line_error(&out.stderr).contains("idem migrate"));
    assert!(!path.exists());
    idem()
        .args(["--store", &url, "migrate"])
        .assert()
        .success()
        .stdout(contains("created table idem_records"));
    // Again: nothing to do, and the JSON says so.
    let out = idem()
        .args(["--store", &url, "migrate", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(json_lines(&out.stdout)[0]["changed"], false);
    idem()
        .args(["--store", &url, "get", "ns", "id"])
        .assert()
        .code(1);
}

/// Runs `idem` and checks it ends with exit code 3, one error line, well within `bound`.
fn unavailable(url: &str, timeout: &str, bound: Duration) -> String {
    let started = Instant::now();
    let out = idem()
        .args(["--timeout", timeout, "--store", url, "get", "ns", "id"])
        .output()
        .unwrap();
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(3), "{url}: {out:?}");
    assert!(took < bound, "{url}: took {took:?}");
    one_line_error(&out.stderr)
}

#[test]
fn unreachable_stores_are_exit_code_3_and_one_line() {
    for url in [
        "redis://127.0.0.1:1",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        "postgres://postgres@127.0.0.1:1/test",
        "dynamodb://idem?endpoint=http://127.0.0.1:1&region=us-east-1",
    ] {
        let line = unavailable(url, "3s", Duration::from_secs(20));
        assert!(line.contains("unavailable"), "{url}: {line}");
    }
}

/// A SQLite path that can never be a database file is a usage error (exit 2), as a missing
/// file is, not an outage: a directory, or a file to create in a directory that is not there.
#[test]
fn a_sqlite_path_that_cannot_be_a_database_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().display());
    for command in ["get", "migrate"] {
        let mut args = vec!["--store", url.as_str(), command];
        if command == "get" {
            args.extend(["ns", "id"]);
        }
        let out = idem().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{command}: {out:?}");
        assert!(one_line_error(&out.stderr).contains("is a directory"));
    }
    let out = idem()
        .args(["--store", "sqlite:///nonexistent/dir/idem.db", "migrate"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(one_line_error(&out.stderr).contains("no directory /nonexistent/dir"));
    assert!(!std::path::Path::new("/nonexistent").exists());
}

/// A purge that fails reports no result on standard output (no `purged 0` before the error),
/// DynamoDB's included, whose purge otherwise has nothing to remove.
#[test]
fn a_failed_purge_prints_no_result() {
    for url in [
        "postgres://postgres@127.0.0.1:1/test",
        "dynamodb://idem?endpoint=http://127.0.0.1:1&region=us-east-1",
    ] {
        for json in [false, true] {
            let mut cmd = idem();
            cmd.args(["--timeout", "3s", "--store", url, "purge"]);
            if json {
                cmd.arg("--json");
            }
            let out = cmd.output().unwrap();
            assert_eq!(out.status.code(), Some(3), "{url}: {out:?}");
            assert!(out.stdout.is_empty(), "{url}: {out:?}");
            one_line_error(&out.stderr);
        }
    }
}

/// A server that accepts connections and never says anything.
fn black_hole() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    addr
}

#[test]
fn a_store_that_never_answers_is_exit_code_3_within_the_timeout() {
    let addr = black_hole();
    for url in [
        format!("redis://{addr}"),
        format!("postgres://postgres@{addr}/test"),
        format!("dynamodb://idem?endpoint=http://{addr}&region=us-east-1"),
    ] {
        let line = unavailable(&url, "1s", Duration::from_secs(10));
        assert!(line.contains("unavailable"), "{url}: {line}");
    }
}

#[test]
fn dynamodb_without_a_region_says_so() {
    let out = idem()
        .env_remove("AWS_REGION")
        .env_remove("AWS_DEFAULT_REGION")
        .args([
            "--store",
            "dynamodb://idem?endpoint=http://127.0.0.1:1",
            "get",
            "ns",
            "id",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(one_line_error(&out.stderr).contains("?region="));
}
