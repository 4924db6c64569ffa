//! A TCP proxy in front of PostgreSQL that counts the frontend protocol messages the client sends
//! (so tests can show how many statements and round trips an operation costs), and that can
//! "freeze" (stop forwarding) to play a server that stopped answering.
//!
//! Two measures of cost: `requests` (one per extended-protocol `Sync` or simple `Query`: what
//! the server answers with a `ReadyForQuery`), and `flights`: network round trips, that is the
//! bursts of requests a client sent while it was waiting for no reply. Requests pipelined
//! together (sent before the first reply) are several requests in one flight.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Frontend messages seen, by type.
#[derive(Debug, Default)]
pub struct Counters {
    /// `Q`: simple-protocol queries (each may hold several statements).
    pub query: AtomicU64,
    /// `P`: parse (prepare) messages.
    pub parse: AtomicU64,
    /// `B`: bind messages.
    pub bind: AtomicU64,
    /// `E`: execute messages: one per extended-protocol statement execution.
    pub execute: AtomicU64,
    /// `S`: sync messages: one per extended-protocol round trip.
    pub sync: AtomicU64,
    /// Network round trips: frontend messages sent while no request of their connection was
    /// waiting for its `ReadyForQuery` start a new flight.
    pub flights: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub query: u64,
    pub parse: u64,
    pub bind: u64,
    pub execute: u64,
    pub sync: u64,
}

impl Counters {
    /// Requests sent: one per extended-protocol round trip (`Sync`) plus one per simple query
    /// (`Query`). A statement re-sent by the client counts again.
    pub fn requests(&self) -> u64 {
        self.sync.load(Ordering::SeqCst) + self.query.load(Ordering::SeqCst)
    }

    /// Network round trips so far (see [`Counters::flights`]).
    pub fn flights(&self) -> u64 {
        self.flights.load(Ordering::SeqCst)
    }

    pub fn snapshot(&self) -> Counts {
        Counts {
            query: self.query.load(Ordering::SeqCst),
            parse: self.parse.load(Ordering::SeqCst),
            bind: self.bind.load(Ordering::SeqCst),
            execute: self.execute.load(Ordering::SeqCst),
            sync: self.sync.load(Ordering::SeqCst),
        }
    }
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            query: self.query - o.query,
            parse: self.parse - o.parse,
            bind: self.bind - o.bind,
            execute: self.execute - o.execute,
            sync: self.sync - o.sync,
        }
    }
}

/// The proxy: listens on an ephemeral loopback port and forwards to `upstream`.
pub struct Proxy {
    pub addr: SocketAddr,
    pub counters: Arc<Counters>,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counters = Arc::new(Counters::default());
        let frozen = Arc::new(AtomicBool::new(false));
        let (c, f) = (counters.clone(), frozen.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (c, f) = (c.clone(), f.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        pipe(client, server, c, f).await;
                    }
                });
            }
        });
        Self {
            addr,
            counters,
            frozen,
        }
    }

    /// Stops (`true`) or resumes forwarding in both directions.
    pub fn freeze(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::SeqCst);
    }

    pub fn counts(&self) -> Counts {
        self.counters.snapshot()
    }

    /// Network round trips so far.
    pub fn flights(&self) -> u64 {
        self.counters.flights()
    }
}

async fn wait_thawed(frozen: &AtomicBool) {
    while frozen.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    counters: Arc<Counters>,
    frozen: Arc<AtomicBool>,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let f2 = frozen.clone();
    let waiting = Arc::new(Waiting::default());
    let w2 = waiting.clone();
    let up = async move {
        let mut parser = Parser {
            waiting: Some(waiting),
            ..Parser::default()
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            wait_thawed(&frozen).await;
            parser.feed(&buf[..n], &counters);
            if sw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = sw.shutdown().await;
    };
    let down = async move {
        let mut replies = Replies::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            wait_thawed(&f2).await;
            // Counted before the client sees it, so a request the client sends in reaction is
            // already known to start a new flight.
            replies.feed(&buf[..n], &w2);
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(up, down);
}

/// Per connection: how many requests (`Sync`, `Query`) await their `ReadyForQuery`.
#[derive(Default)]
struct Waiting {
    /// Requests sent and not answered yet.
    outstanding: std::sync::atomic::AtomicI64,
    /// Set by the first `ReadyForQuery` (the end of the startup phase).
    ready: AtomicBool,
    /// The client asked for TLS: the backend answers with one untyped byte first.
    ssl_request: AtomicBool,
    /// A flight is under way: the client sent messages since the last time nothing was awaited.
    in_flight: AtomicBool,
}

/// Incremental parser of the backend stream: counts `ReadyForQuery` messages.
#[derive(Default)]
struct Replies {
    pending: Vec<u8>,
    ssl_answered: bool,
}

impl Replies {
    fn feed(&mut self, bytes: &[u8], waiting: &Waiting) {
        self.pending.extend_from_slice(bytes);
        if !self.ssl_answered && waiting.ssl_request.load(Ordering::SeqCst) {
            if self.pending.is_empty() {
                return;
            }
            // `S` (TLS follows: nothing more is readable) or `N`.
            self.ssl_answered = true;
            if self.pending.remove(0) == b'S' {
                self.pending.clear();
                return;
            }
        }
        loop {
            if self.pending.len() < 5 {
                return;
            }
            let kind = self.pending[0];
            let len = i32::from_be_bytes(self.pending[1..5].try_into().unwrap()) as usize;
            if self.pending.len() < 1 + len {
                return;
            }
            self.pending.drain(..1 + len);
            if kind == b'Z'
                && waiting.ready.swap(true, Ordering::SeqCst)
                && waiting.outstanding.fetch_sub(1, Ordering::SeqCst) == 1
            {
                waiting.in_flight.store(false, Ordering::SeqCst);
            }
        }
    }
}

/// Incremental parser of the frontend stream: untyped startup-phase messages (SSLRequest,
/// StartupMessage), then typed messages (`type: u8, len: i32 (including itself), body`).
#[derive(Default)]
struct Parser {
    pending: Vec<u8>,
    started: bool,
    waiting: Option<Arc<Waiting>>,
}

impl Parser {
    fn feed(&mut self, bytes: &[u8], counters: &Counters) {
        self.pending.extend_from_slice(bytes);
        loop {
            if !self.started {
                if self.pending.len() < 8 {
                    return;
                }
                let len = i32::from_be_bytes(self.pending[0..4].try_into().unwrap()) as usize;
                let code = i32::from_be_bytes(self.pending[4..8].try_into().unwrap());
                if self.pending.len() < len {
                    return;
                }
                self.pending.drain(..len);
                if code == 196_608 {
                    self.started = true; // protocol 3.0 startup; typed messages follow
                }
                if code == 80_877_103
                    && let Some(waiting) = &self.waiting
                {
                    waiting.ssl_request.store(true, Ordering::SeqCst);
                }
                continue;
            }
            if self.pending.len() < 5 {
                return;
            }
            let kind = self.pending[0];
            let len = i32::from_be_bytes(self.pending[1..5].try_into().unwrap()) as usize;
            if self.pending.len() < 1 + len {
                return;
            }
            self.pending.drain(..1 + len);
            if let Some(waiting) = &self.waiting
                && waiting.ready.load(Ordering::SeqCst)
                && kind != b'X'
            {
                if !waiting.in_flight.swap(true, Ordering::SeqCst) {
                    counters.flights.fetch_add(1, Ordering::SeqCst);
                }
                if kind == b'S' || kind == b'Q' {
                    waiting.outstanding.fetch_add(1, Ordering::SeqCst);
                }
            }
            let counter = match kind {
                b'Q' => &counters.query,
                b'P' => &counters.parse,
                b'B' => &counters.bind,
                b'E' => &counters.execute,
                b'S' => &counters.sync,
                _ => continue,
            };
            counter.fetch_add(1, Ordering::SeqCst);
        }
    }
}
