#![doc = include_str!("../README.md")]

mod cli;
mod commands;
mod failure;
mod open;
mod render;
mod store_url;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idem_core::SystemClock;

use crate::cli::{Cli, Command};
use crate::commands::{Confirm, Ctx};
use crate::failure::{Code, Failure};
use crate::store_url::StoreUrl;

/// How long the end of the process waits for store work still running in the background (a
/// connection being closed, a SQLite statement on the blocking pool) before it exits anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(200);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "idem: error: cannot start: {e}");
            return Code::Store.into();
        }
    };
    let result = runtime.block_on(run(cli));
    // Never wait long for whatever a store left running (bounded, unlike dropping the runtime).
    runtime.shutdown_timeout(SHUTDOWN_GRACE);
    match result {
        Ok(()) => Code::Ok.into(),
        Err(failure) => {
            if !failure.message().is_empty() {
                let _ = writeln!(std::io::stderr(), "idem: error: {}", failure.message());
            }
            failure.code.into()
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let Some(url) = cli.store.as_deref() else {
        return Err(Failure::usage(
            "no store: pass --store URL or set IDEM_STORE (see idem --help)",
        ));
    };
    let url = StoreUrl::parse(url)?;
    let mut stdout = std::io::stdout().lock();
    if let Command::Migrate { print: true } = cli.command {
        stdout.write_all(open::ddl(&url)?.as_bytes())?;
        return Ok(());
    }
    let create = matches!(cli.command, Command::Migrate { .. });
    let opened = Box::pin(open::open(&url, cli.timeout, create)).await?;
    let mut stderr = std::io::stderr();
    let confirm = match &cli.command {
        Command::Delete { safety, .. } | Command::ReleaseStuck { safety, .. } if safety.yes => {
            Confirm::Yes
        }
        _ if std::io::stdin().is_terminal() => Confirm::Ask,
        _ => Confirm::Refuse,
    };
    let mut ctx = Ctx {
        store: opened.store(),
        timeout: cli.timeout,
        clock: &SystemClock,
        out: &mut stdout,
        err: &mut stderr,
        json: cli.json,
        progress: std::io::stderr().is_terminal(),
        confirm,
    };
    let result = match &cli.command {
        Command::Get {
            namespace,
            id,
            max_attempts,
        } => commands::get(&mut ctx, namespace, id, *max_attempts).await,
        Command::List {
            namespace,
            filters,
            limit,
            all,
            cursor,
        } => {
            let limit = (!all).then_some(*limit);
            commands::list(&mut ctx, namespace, filters, limit, cursor.clone()).await
        }
        Command::Delete {
            namespace,
            ids,
            filters,
            include_live,
            safety,
        } if ids.is_empty() => {
            commands::delete_matching(&mut ctx, namespace, filters, *include_live, safety.dry_run)
                .await
        }
        Command::Delete {
            namespace,
            ids,
            filters,
            include_live,
            safety,
        } => {
            commands::delete_ids(
                &mut ctx,
                namespace,
                ids,
                filters.max_attempts,
                *include_live,
                safety.dry_run,
            )
            .await
        }
        Command::ReleaseStuck {
            namespace,
            older_than,
            owner,
            max_attempts,
            safety,
        } => {
            commands::release_stuck(
                &mut ctx,
                namespace,
                *older_than,
                owner.as_deref(),
                *max_attempts,
                safety.dry_run,
            )
            .await
        }
        Command::Purge { batch, max } => commands::purge(&mut ctx, *batch, *max).await,
        Command::Stats {
            namespaces,
            max_attempts,
        } => commands::stats(&mut ctx, namespaces, *max_attempts).await,
        Command::Migrate { .. } => match open::set_up(&opened, cli.timeout).await {
            Ok((_, json)) if cli.json => writeln!(ctx.out, "{json}").map_err(Failure::from),
            Ok((said, _)) => writeln!(ctx.out, "{said}").map_err(Failure::from),
            Err(e) => Err(e),
        },
    };
    // The command's failure (a store error) wins over a failure to flush (a closed pipe).
    commands::finish(ctx.out, result)
}
