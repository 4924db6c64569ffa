//! The command line: global options and one subcommand per operator task.

use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use idem_core::Status;

/// The bound on every store call when `--timeout` is not given.
pub(crate) const DEFAULT_TIMEOUT: &str = "10s";

const STORES: &str = "\
Store URLs (--store or IDEM_STORE):
  memory:                              an empty store inside this process, for trying idem out
  redis://[user:pass@]host:port[/db]   one Redis server (rediss:// for TLS)
  redis+cluster://host:port,host:port  a Redis Cluster (rediss+cluster:// for TLS)
                                       Redis URLs take ?prefix= (default idem:)
  postgres://user@host:port/db         PostgreSQL: ?schema= (default idem), ?table= (default
                                       records), ?sslmode=require for TLS
  dynamodb://TABLE                     DynamoDB: ?endpoint=, ?region=; credentials from the AWS
                                       environment (AWS_ACCESS_KEY_ID..., profile, role)
  sqlite:///path/to/idem.db            a SQLite file (sqlite://relative/path too)";

const EXIT_CODES: &str = "\
Exit codes:
  0  done
  1  not found: a record named on the command line does not exist (or is past retention)
  2  bad usage: a bad argument or store URL, a command the store does not offer (listing on a
     store without one), a destructive command refused without --yes and without a terminal,
     or a delete that left records with a live lease alone (without --include-live)
  3  store unavailable: unreachable, or no answer within --timeout
  4  store error: the store answered with an error (not set up, a record it cannot decode, a
     server error), or the output could not be written";

/// The idem operator tool: inspect, list, delete, release and purge idempotency records.
///
/// Every store call is bounded by --timeout; errors are one line on standard error. Tables go
/// to standard output; --json prints one JSON object per line instead. Progress bars appear on
/// standard error only when it is a terminal.
#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    after_help = format!("{STORES}\n\n{EXIT_CODES}"),
    after_long_help = format!("{STORES}\n\n{EXIT_CODES}"),
)]
pub(crate) struct Cli {
    /// The store: a URL (see "Store URLs" below).
    #[arg(
        long,
        short = 's',
        env = "IDEM_STORE",
        global = true,
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) store: Option<String>,

    /// The bound on every store call (connecting included): 500ms, 10s, 1m ...
    #[arg(
        long,
        env = "IDEM_TIMEOUT",
        global = true,
        default_value = DEFAULT_TIMEOUT,
        value_name = "DURATION",
        value_parser = timeout,
        hide_env_values = true
    )]
    pub(crate) timeout: Duration,

    /// Print one JSON object per line instead of tables.
    #[arg(long, global = true)]
    pub(crate) json: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Show one record: every field, the result as UTF-8 text or hex, the error text.
    ///
    /// Exit code 1 when the record does not exist or is past retention.
    Get {
        /// The key's namespace.
        namespace: String,
        /// The key's id.
        id: String,
        /// The consumers' maximum attempts, which decides whether the record shows as exhausted.
        #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        max_attempts: u32,
    },

    /// List the records of a namespace, filtered by status, age and owner.
    ///
    /// Shows at most --limit records and, when more follow, the --cursor to go on with (pass
    /// the same filters with it); --all follows every page. On stores that filter while they
    /// scan (Redis SCAN, DynamoDB Scan) a listing costs one pass over the keys.
    List {
        /// The namespace to list.
        namespace: String,
        #[command(flatten)]
        filters: Filters,
        /// Show at most this many records.
        #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "all")]
        limit: u64,
        /// Follow every page: show every matching record.
        #[arg(long)]
        all: bool,
        /// Go on where an earlier listing with the same filters stopped.
        #[arg(long, value_name = "CURSOR")]
        cursor: Option<String>,
    },

    /// Delete records: the ids given, or every record matching the filters.
    ///
    /// Shows what it is about to delete, with each record's status, and asks for
    /// confirmation, unless --yes; without a terminal on standard input it refuses unless
    /// --yes. Each record is read again just before it is deleted and skipped when it carries
    /// another token (`taken_over`), another state or no longer matches the filters
    /// (`changed`); a change in the one round trip between that read and the delete is not
    /// caught (the store has no delete conditional on the token). Records whose lease is live
    /// (status in_progress) are not deleted (`refused_live`, exit code 2) unless
    /// --include-live. Tokens keep rising after a delete: the next acquire of the key gets a
    /// higher token. Deleting a record in progress fences its holder (its later transitions
    /// fail with a lost lease), but only after its effect: a redelivery may run the handler
    /// again meanwhile. Deleting also resets the attempt count. Exit code 1 when an id given
    /// does not exist.
    Delete {
        /// The namespace.
        namespace: String,
        /// The ids to delete; none: every record matching the filters (at least one filter).
        #[arg(value_name = "ID", conflicts_with_all = ["status", "older_than", "owner"])]
        ids: Vec<String>,
        #[command(flatten)]
        filters: Filters,
        /// Delete records whose lease is live (status in_progress) too: their holder may be
        /// running the handler right now, and a redelivery can then run it again (the holder is
        /// fenced only when it finishes). Without it they are left alone (`refused_live`).
        #[arg(long)]
        include_live: bool,
        #[command(flatten)]
        safety: Safety,
    },

    /// Give back leases that expired more than --older-than ago (holders that crashed or stalled).
    ///
    /// Lists the namespace's `lease_expired` records, keeps those whose lease ended at least
    /// --older-than ago (on this machine's clock), and releases each one with the lease it
    /// holds (its owner and fencing token), after reading it again: a lease renewed or taken
    /// over since the listing is skipped, and the token fences the release itself, so a key
    /// another worker acquired meanwhile is never touched. A release does not count the
    /// attempt (the next acquire runs the work again as the same attempt number), so a message
    /// that kills its worker every time is better left alone: each take-over of its expired
    /// lease counts an attempt until it is exhausted. Deleting it would reset its attempts.
    ReleaseStuck {
        /// The namespace.
        namespace: String,
        /// Only leases that ended at least this long ago: 30s, 10m, 2h ...
        #[arg(long, value_name = "DURATION", value_parser = duration)]
        older_than: Duration,
        /// Only leases of this owner.
        #[arg(long, value_name = "OWNER")]
        owner: Option<String>,
        /// The consumers' maximum attempts: records out of attempts are exhausted, not stuck,
        /// and are left alone.
        #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        max_attempts: u32,
        #[command(flatten)]
        safety: Safety,
    },

    /// Remove records past their retention (PostgreSQL, SQLite, memory; Redis and DynamoDB expire
    /// records themselves).
    ///
    /// Expired records already count as absent for every operation; this only frees the space.
    Purge {
        /// Records removed per store call.
        #[arg(long, default_value_t = 1000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000))]
        batch: u64,
        /// Stop after removing this many.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        max: Option<u64>,
    },

    /// Set the store up: PostgreSQL migrations, the DynamoDB table, the SQLite table.
    ///
    /// Safe to run again. Redis and memory need nothing.
    #[command(visible_alias = "create-table")]
    Migrate {
        /// Only print the DDL (SQL, or the AWS CLI commands for DynamoDB); connect to nothing.
        #[arg(long)]
        print: bool,
    },

    /// Count the records of each namespace per status.
    ///
    /// Lists every record of each namespace (one pass over the keys on Redis and DynamoDB).
    Stats {
        /// The namespaces to count.
        #[arg(required = true, value_name = "NAMESPACE")]
        namespaces: Vec<String>,
        /// The consumers' maximum attempts, which decides which records are exhausted.
        #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        max_attempts: u32,
    },
}

/// Which records of a namespace.
#[derive(Debug, Args)]
pub(crate) struct Filters {
    /// Only these statuses (repeat, or separate with commas).
    #[arg(long, value_name = "STATUS", value_delimiter = ',', value_parser = status())]
    pub(crate) status: Vec<Status>,
    /// Only records unchanged for at least this long: 30s, 10m, 2h, 7days ...
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) older_than: Option<Duration>,
    /// Only records whose last owner is this one.
    #[arg(long, value_name = "OWNER")]
    pub(crate) owner: Option<String>,
    /// The consumers' maximum attempts, which decides which records are exhausted.
    #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_attempts: u32,
}

impl Filters {
    pub(crate) fn any(&self) -> bool {
        !self.status.is_empty() || self.older_than.is_some() || self.owner.is_some()
    }
}

/// The flags of every destructive command.
#[derive(Debug, Args)]
pub(crate) struct Safety {
    /// Only show what would be done.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Do it without asking.
    #[arg(long, short = 'y', conflicts_with = "dry_run")]
    pub(crate) yes: bool,
}

fn status() -> impl TypedValueParser<Value = Status> {
    PossibleValuesParser::new(Status::ALL.map(Status::name))
        .try_map(|name| Status::from_name(&name).ok_or_else(|| format!("unknown status {name:?}")))
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{e} (examples: 500ms, 30s, 10m, 2h, 7days)"))
}

fn timeout(text: &str) -> Result<Duration, String> {
    let d = duration(text)?;
    if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
        return Err("must be between 100ms and 1h".to_owned());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn statuses_parse_by_name_repeated_or_comma_separated() {
        let cli = Cli::try_parse_from([
            "idem",
            "list",
            "ns",
            "--status",
            "exhausted,lease_expired",
            "--status",
            "completed",
        ])
        .unwrap();
        let Command::List { filters, .. } = cli.command else {
            panic!("{cli:?}")
        };
        assert_eq!(
            filters.status,
            [Status::Exhausted, Status::LeaseExpired, Status::Completed]
        );
        assert!(Cli::try_parse_from(["idem", "list", "ns", "--status", "stuck"]).is_err());
    }

    #[test]
    fn timeouts_are_bounded() {
        assert_eq!(timeout("1s"), Ok(Duration::from_secs(1)));
        assert!(timeout("10ms").is_err());
        assert!(timeout("2h").is_err());
        assert!(timeout("soon").is_err());
    }

    #[test]
    fn ids_and_filters_do_not_mix() {
        assert!(
            Cli::try_parse_from(["idem", "delete", "ns", "a", "--status", "completed"]).is_err()
        );
        assert!(Cli::try_parse_from(["idem", "delete", "ns", "--yes", "--dry-run", "a"]).is_err());
        assert!(Cli::try_parse_from(["idem", "list", "ns", "--all", "--limit", "3"]).is_err());
    }
}
