//! Store URLs: which store to open, and how, from one string.

use std::fmt;
use std::path::PathBuf;

use url::Url;

/// The schemes `idem` understands, for error messages and `--help`.
pub(crate) const SCHEMES: &str = "memory:, redis://, rediss://, redis+cluster://, \
     rediss+cluster://, postgres://, postgresql://, dynamodb://, sqlite://";

/// Where the records are: a parsed store URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StoreUrl {
    /// `memory:`: an empty in-process store that lives as long as the command (for trying the
    /// tool out; it never holds anything another process wrote).
    Memory,
    /// `redis://` or `rediss://`: one server. `url` is what the driver gets (without `prefix`).
    Redis { url: String, prefix: Option<String> },
    /// `redis+cluster://h1:p1,h2:p2` (or `rediss+cluster://`): a cluster, through these nodes.
    RedisCluster {
        nodes: Vec<String>,
        prefix: Option<String>,
    },
    /// `postgres://` or `postgresql://`; `url` is what the driver gets (without `schema` and
    /// `table`).
    Postgres {
        url: String,
        schema: Option<String>,
        table: Option<String>,
    },
    /// `dynamodb://table?endpoint=&region=`.
    Dynamo {
        table: String,
        endpoint: Option<String>,
        region: Option<String>,
    },
    /// `sqlite://path` (`sqlite:///absolute/path` or `sqlite://relative/path`).
    Sqlite { path: PathBuf },
}

/// Why a store URL was refused: one line, never holding a password.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BadUrl(pub(crate) String);

impl fmt::Display for BadUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad(shown: &str, why: impl fmt::Display) -> BadUrl {
    BadUrl(format!("bad store URL {shown:?}: {why}"))
}

impl StoreUrl {
    /// Parses a store URL.
    pub(crate) fn parse(text: &str) -> Result<Self, BadUrl> {
        let shown = redact(text);
        let shown = shown.as_str();
        let Some((scheme, _)) = text.split_once(':') else {
            return Err(bad(shown, format!("no scheme; expected one of {SCHEMES}")));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "memory" => match text[scheme.len() + 1..].trim_start_matches("//") {
                "" => Ok(Self::Memory),
                _ => Err(bad(shown, "memory: takes nothing after the scheme")),
            },
            "redis" | "rediss" => parse_redis(text, shown),
            "redis+cluster" | "rediss+cluster" => parse_cluster(text, shown, scheme),
            "postgres" | "postgresql" => parse_postgres(text, shown),
            "dynamodb" => parse_dynamo(text, shown),
            "sqlite" => parse_sqlite(text, shown),
            _ => Err(bad(
                shown,
                format!("unknown scheme {scheme:?}; expected one of {SCHEMES}"),
            )),
        }
    }

    /// The store's name in messages before it is opened.
    pub(crate) fn store_name(&self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Redis { .. } => "redis",
            Self::RedisCluster { .. } => "redis-cluster",
            Self::Postgres { .. } => "postgres",
            Self::Dynamo { .. } => "dynamo",
            Self::Sqlite { .. } => "sqlite",
        }
    }
}

/// `text` with any password replaced by `***`, for messages.
pub(crate) fn redact(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else {
        return text.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    if let Some((userinfo, hosts)) = authority.rsplit_once('@') {
        let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
        let hidden = if userinfo.contains(':') {
            format!("{user}:***")
        } else {
            user.to_owned()
        };
        return format!("{scheme}://{hidden}@{hosts}{}", redact_query_password(tail));
    }
    let tail = redact_query_password(tail);
    // A password holding an unencoded `/`, `?` or `#` ends the authority early (such a URL is
    // refused, and its message must not show the password either): when an `@` follows,
    // everything before the last one is hidden. A URL whose path or query holds an `@` then
    // shows less than it could, never a password.
    match tail.rsplit_once('@') {
        Some((_, after)) => format!("{scheme}://***@{after}"),
        None => format!("{scheme}://{authority}{tail}"),
    }
}

/// Hides `password=` in a query string (libpq and redis-rs accept one there).
fn redact_query_password(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

/// Takes the parameters `names` out of `url`'s query: their values, and the URL without them.
fn take_params(
    mut url: Url,
    names: &[&str],
    shown: &str,
) -> Result<(Url, Vec<Option<String>>), BadUrl> {
    let mut found: Vec<Option<String>> = vec![None; names.len()];
    let mut kept: Vec<(String, String)> = Vec::new();
    for (name, value) in url.query_pairs() {
        match names.iter().position(|n| *n == name) {
            Some(i) if found[i].is_some() => {
                return Err(bad(shown, format!("parameter {name:?} given twice")));
            }
            Some(i) => found[i] = Some(value.into_owned()),
            None => kept.push((name.into_owned(), value.into_owned())),
        }
    }
    if kept.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(kept);
    }
    Ok((url, found))
}

fn parse_url(text: &str, shown: &str) -> Result<Url, BadUrl> {
    Url::parse(text).map_err(|e| bad(shown, e))
}

fn non_empty(value: Option<String>, name: &str, shown: &str) -> Result<Option<String>, BadUrl> {
    match value {
        Some(v) if v.is_empty() => Err(bad(shown, format!("parameter {name:?} is empty"))),
        other => Ok(other),
    }
}

fn parse_redis(text: &str, shown: &str) -> Result<StoreUrl, BadUrl> {
    let url = parse_url(text, shown)?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad(shown, "no host"));
    }
    let (url, mut params) = take_params(url, &["prefix"], shown)?;
    let prefix = non_empty(params.remove(0), "prefix", shown)?;
    // The driver reads `protocol` and ignores the rest: a misspelt `prefix` would silently
    // name the default prefix's records.
    if let Some((other, _)) = url.query_pairs().find(|(name, _)| name != "protocol") {
        return Err(bad(
            shown,
            format!("unknown parameter {other:?} (a Redis URL takes prefix= and protocol=)"),
        ));
    }
    Ok(StoreUrl::Redis {
        url: url.to_string(),
        prefix,
    })
}

fn parse_cluster(text: &str, shown: &str, scheme: &str) -> Result<StoreUrl, BadUrl> {
    let node_scheme = if scheme.eq_ignore_ascii_case("rediss+cluster") {
        "rediss"
    } else {
        "redis"
    };
    let rest = &text[scheme.len()..];
    let Some(rest) = rest.strip_prefix("://") else {
        return Err(bad(shown, format!("expected {scheme}://host:port,...")));
    };
    let (rest, query) = match rest.split_once('?') {
        Some((rest, query)) => (rest, Some(query)),
        None => (rest, None),
    };
    let authority = match rest.split_once('/') {
        Some((authority, "")) => authority,
        Some(_) => {
            return Err(bad(
                shown,
                "a cluster has no database number: nothing may follow the node list but ?prefix=",
            ));
        }
        None => rest,
    };
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let mut nodes = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() {
            return Err(bad(shown, "empty node in the node list"));
        }
        let node = match userinfo {
            Some(userinfo) => format!("{node_scheme}://{userinfo}@{host}"),
            None => format!("{node_scheme}://{host}"),
        };
        let parsed = Url::parse(&node).map_err(|e| bad(shown, format!("node {host:?}: {e}")))?;
        if parsed.host_str().is_none_or(str::is_empty) || parsed.path().len() > 1 {
            return Err(bad(shown, format!("node {host:?} is not host:port")));
        }
        nodes.push(node);
    }
    let mut prefix = None;
    if let Some(query) = query {
        for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match name.as_ref() {
                "prefix" if prefix.is_some() => {
                    return Err(bad(shown, "parameter \"prefix\" given twice"));
                }
                "prefix" => prefix = non_empty(Some(value.into_owned()), "prefix", shown)?,
                other => {
                    return Err(bad(
                        shown,
                        format!("unknown parameter {other:?} (a cluster URL takes prefix=)"),
                    ));
                }
            }
        }
    }
    Ok(StoreUrl::RedisCluster { nodes, prefix })
}

fn parse_postgres(text: &str, shown: &str) -> Result<StoreUrl, BadUrl> {
    let url = parse_url(text, shown)?;
    let (url, mut params) = take_params(url, &["schema", "table"], shown)?;
    let table = non_empty(params.remove(1), "table", shown)?;
    let schema = non_empty(params.remove(0), "schema", shown)?;
    Ok(StoreUrl::Postgres {
        url: url.to_string(),
        schema,
        table,
    })
}

fn parse_dynamo(text: &str, shown: &str) -> Result<StoreUrl, BadUrl> {
    let url = parse_url(text, shown)?;
    let table = url.host_str().unwrap_or_default().to_owned();
    if table.is_empty() {
        return Err(bad(
            shown,
            "no table: expected dynamodb://TABLE?endpoint=&region=",
        ));
    }
    if !url.username().is_empty() || url.password().is_some() || url.port().is_some() {
        return Err(bad(
            shown,
            "credentials and ports do not go in a dynamodb URL (credentials come from the AWS \
             environment; the endpoint is ?endpoint=)",
        ));
    }
    if !matches!(url.path(), "" | "/") {
        return Err(bad(
            shown,
            "nothing may follow the table name but ?endpoint=&region=",
        ));
    }
    let mut endpoint = None;
    let mut region = None;
    for (name, value) in url.query_pairs() {
        let slot = match name.as_ref() {
            "endpoint" => &mut endpoint,
            "region" => &mut region,
            other => {
                return Err(bad(
                    shown,
                    format!(
                        "unknown parameter {other:?} (a dynamodb URL takes endpoint= and region=)"
                    ),
                ));
            }
        };
        if slot.is_some() {
            return Err(bad(shown, format!("parameter {name:?} given twice")));
        }
        *slot = non_empty(Some(value.into_owned()), &name, shown)?;
    }
    if let Some(endpoint) = &endpoint {
        let parsed = Url::parse(endpoint).map_err(|e| bad(shown, format!("endpoint: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(bad(shown, "endpoint must be an http:// or https:// URL"));
        }
    }
    Ok(StoreUrl::Dynamo {
        table,
        endpoint,
        region,
    })
}

fn parse_sqlite(text: &str, shown: &str) -> Result<StoreUrl, BadUrl> {
    let Some(path) = text.get("sqlite://".len()..).filter(|_| {
        text.get(..9)
            .is_some_and(|s| s.eq_ignore_ascii_case("sqlite://"))
    }) else {
        return Err(bad(
            shown,
            "expected sqlite://PATH (sqlite:///absolute/path)",
        ));
    };
    if path.is_empty() {
        return Err(bad(shown, "no path: expected sqlite://PATH"));
    }
    if path.contains('?') {
        return Err(bad(shown, "a sqlite URL takes no parameters"));
    }
    // SQLite reads these names as an in-memory database, gone when the command ends.
    if path == ":memory:" || path.starts_with("file:") {
        return Err(bad(
            shown,
            "an in-memory SQLite database lasts one command: name a file (or use memory:)",
        ));
    }
    Ok(StoreUrl::Sqlite {
        path: PathBuf::from(path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> StoreUrl {
        StoreUrl::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn err(text: &str) -> String {
        match StoreUrl::parse(text) {
            Ok(url) => panic!("{text} parsed as {url:?}"),
            Err(e) => e.0,
        }
    }

    #[test]
    fn memory() {
        assert_eq!(ok("memory:"), StoreUrl::Memory);
        assert_eq!(ok("memory://"), StoreUrl::Memory);
        assert!(err("memory:x").contains("nothing after"));
    }

    #[test]
    fn redis_keeps_the_driver_url_and_takes_the_prefix_out() {
        assert_eq!(
            ok("redis://127.0.0.1:6379"),
            StoreUrl::Redis {
                url: "redis://127.0.0.1:6379".into(),
                prefix: None
            }
        );
        assert_eq!(
            ok("rediss://user:pw@cache.example:6380/2?prefix=pay%3Aidem%3A&protocol=resp3"),
            StoreUrl::Redis {
                url: "rediss://user:pw@cache.example:6380/2?protocol=resp3".into(),
                prefix: Some("pay:idem:".into())
            }
        );
        assert!(err("redis://").contains("bad store URL"));
        assert!(err("redis://h?prefix=").contains("empty"));
        assert!(err("sqlite://:memory:").contains("in-memory"));
        // A misspelt prefix is refused, not taken for the default one.
        assert!(err("redis://h?prefx=pay:").contains("unknown parameter \"prefx\""));
        assert!(err("redis://h?prefix=pay:&bogus=1").contains("unknown parameter \"bogus\""));
        assert!(err("redis://h?prefix=a&prefix=b").contains("twice"));
    }

    #[test]
    fn cluster_nodes() {
        assert_eq!(
            ok("redis+cluster://127.0.0.1:7001,127.0.0.1:7002?prefix=x:"),
            StoreUrl::RedisCluster {
                nodes: vec![
                    "redis://127.0.0.1:7001".into(),
                    "redis://127.0.0.1:7002".into()
                ],
                prefix: Some("x:".into())
            }
        );
        assert_eq!(
            ok("rediss+cluster://:secret@a:1,b:2/"),
            StoreUrl::RedisCluster {
                nodes: vec!["rediss://:secret@a:1".into(), "rediss://:secret@b:2".into()],
                prefix: None
            }
        );
        assert!(err("redis+cluster://a:1,,b:2").contains("empty node"));
        assert!(err("redis+cluster://a:1/3").contains("no database"));
        assert!(err("redis+cluster://a:1?db=2").contains("unknown parameter"));
        assert!(err("redis+cluster://a:notaport").contains("node"));
        assert!(err("redis+cluster:a:1").contains("expected"));
    }

    #[test]
    fn postgres_takes_schema_and_table_out() {
        assert_eq!(
            ok("postgres://app@127.0.0.1:5432/test?schema=idem_x&sslmode=disable&table=t"),
            StoreUrl::Postgres {
                url: "postgres://app@127.0.0.1:5432/test?sslmode=disable".into(),
                schema: Some("idem_x".into()),
                table: Some("t".into())
            }
        );
        assert_eq!(
            ok("postgresql://h/db"),
            StoreUrl::Postgres {
                url: "postgresql://h/db".into(),
                schema: None,
                table: None
            }
        );
    }

    #[test]
    fn dynamodb() {
        assert_eq!(
            ok("dynamodb://Idem_Table.v2?endpoint=http://127.0.0.1:8000&region=us-east-1"),
            StoreUrl::Dynamo {
                table: "Idem_Table.v2".into(),
                endpoint: Some("http://127.0.0.1:8000".into()),
                region: Some("us-east-1".into())
            }
        );
        assert_eq!(
            ok("dynamodb://idem"),
            StoreUrl::Dynamo {
                table: "idem".into(),
                endpoint: None,
                region: None
            }
        );
        assert!(err("dynamodb://").contains("no table"));
        assert!(err("dynamodb://t?endpoint=ftp://x").contains("http"));
        assert!(err("dynamodb://t?colour=blue").contains("unknown parameter"));
        assert!(err("dynamodb://t/x").contains("nothing may follow"));
        assert!(err("dynamodb://key:secret@t").contains("credentials"));
    }

    #[test]
    fn sqlite() {
        assert_eq!(
            ok("sqlite:///var/lib/idem.db"),
            StoreUrl::Sqlite {
                path: "/var/lib/idem.db".into()
            }
        );
        assert_eq!(
            ok("sqlite://data/idem.db"),
            StoreUrl::Sqlite {
                path: "data/idem.db".into()
            }
        );
        assert!(err("sqlite://").contains("no path"));
        assert!(err("sqlite:idem.db").contains("expected"));
    }

    #[test]
    fn anything_else_is_refused_in_one_line_without_the_password() {
        for text in ["mysql://u:hunter2@h/db", "nothing", "", "http://x"] {
            let e = err(text);
            assert!(!e.contains('\n'), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
            assert!(e.contains("expected one of"), "{e}");
        }
        assert!(!err("redis://u:hunter2@[::1").contains("hunter2"));
    }

    #[test]
    fn redaction() {
        assert_eq!(
            redact("redis://u:pw@h:1/0?password=x&a=b"),
            "redis://u:***@h:1/0?password=***&a=b"
        );
        assert_eq!(redact("postgres://app@h/db"), "postgres://app@h/db");
        assert_eq!(redact("memory:"), "memory:");
        // Unencoded `/`, `?`, `#` or `@` in a password.
        for (url, shown) in [
            (
                "redis://u:hun/ter2@127.0.0.1:6379",
                "redis://***@127.0.0.1:6379",
            ),
            ("redis://:a?b@h:1/0", "redis://***@h:1/0"),
            ("postgres://u:a#b@h/db", "postgres://***@h/db"),
            ("postgres://u:a@b@h/db", "postgres://u:***@h/db"),
            (
                "redis+cluster://u:x/y@h:1,h:2",
                "redis+cluster://***@h:1,h:2",
            ),
            // An `@` in the query, with a password there too.
            (
                "postgres://h:5432/db?application_name=svc@prod&password=secret&table=",
                "postgres://***@prod&password=***&table=",
            ),
            (
                "postgres://h/db?password=p@ss&table=",
                "postgres://h/db?password=***&table=",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
    }
}
