//! A TCP proxy in front of PostgreSQL that counts the frontend protocol messages the client sends
//! (so tests can show how many statements and round trips an operation costs), and that can
//! "freeze" (stop forwarding) to play a server that stopped answering.

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
    let up = async move {
        let mut parser = Parser::default();
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
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            wait_thawed(&f2).await;
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(up, down);
}

/// Incremental parser of the frontend stream: untyped startup-phase messages (SSLRequest,
/// StartupMessage), then typed messages (`type: u8, len: i32 (including itself), body`).
#[derive(Default)]
struct Parser {
    pending: Vec<u8>,
    started: bool,
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
