//! Cluster administration for the tests that move slots: the masters of the test cluster and
//! `CLUSTER SETSLOT` the way resharding uses it.

/// A master of the test cluster: node id, a plain connection, slot ranges, `host:port`.
pub type Master = (
    String,
    redis::aio::MultiplexedConnection,
    Vec<(u16, u16)>,
    String,
);

/// Every master of the test cluster.
pub async fn masters() -> Vec<Master> {
    let mut first = redis::Client::open(super::cluster_nodes()[0].as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut first)
        .await
        .unwrap();
    let mut masters = Vec::new();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if !fields[2].contains("master") {
            continue;
        }
        let addr = fields[1].split('@').next().unwrap();
        let conn = redis::Client::open(format!("redis://{addr}"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let ranges = slot_ranges(&fields);
        masters.push((fields[0].to_owned(), conn, ranges, addr.to_owned()));
    }
    masters
}

/// The slot ranges a `CLUSTER NODES` line (split on whitespace) says its node serves; slots
/// being migrated (`[...]`) are left out.
pub fn slot_ranges(fields: &[&str]) -> Vec<(u16, u16)> {
    fields[8..]
        .iter()
        .filter(|r| !r.starts_with('['))
        .map(|r| match r.split_once('-') {
            Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
            None => (r.parse().unwrap(), r.parse().unwrap()),
        })
        .collect()
}

pub async fn setslot(conn: &mut redis::aio::MultiplexedConnection, slot: u16, how: &[&str]) {
    let _: () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg(how)
        .query_async(conn)
        .await
        .unwrap();
}

/// Moves every key `from` still holds in `slot` to `to` with `MIGRATE`, as resharding does:
/// other tests' keys share the cluster, and a slot must be empty on its old owner before it
/// can be assigned away. While the slot migrates, a key that is not on `from` is created on
/// `to` (ASK), so once this finds the slot empty it stays empty.
async fn migrate_keys(masters: &mut [Master], slot: u16, from: usize, to: usize) {
    let (host, port) = masters[to].3.rsplit_once(':').unwrap();
    let (host, port): (String, u16) = (host.to_owned(), port.parse().unwrap());
    loop {
        let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1000)
            .query_async(&mut masters[from].1)
            .await
            .unwrap();
        if keys.is_empty() {
            return;
        }
        let _: () = redis::cmd("MIGRATE")
            .arg(&host)
            .arg(port)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("REPLACE")
            .arg("KEYS")
            .arg(&keys)
            .query_async(&mut masters[from].1)
            .await
            .unwrap();
    }
}

/// A slot being moved from the master serving it (`from`) to the next one (`to`), indices in
/// the masters list.
pub struct Migration {
    pub slot: u16,
    pub from: usize,
    pub to: usize,
}

impl Migration {
    /// The slot of `storage_key` and the master serving it; nothing changed yet.
    pub async fn of(masters: &mut [Master], storage_key: &[u8]) -> Self {
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(storage_key)
            .query_async(&mut masters[0].1)
            .await
            .unwrap();
        let from = masters
            .iter()
            .position(|m| m.2.iter().any(|&(a, b)| a <= slot && slot <= b))
            .unwrap();
        let to = (from + 1) % masters.len();
        Self { slot, from, to }
    }

    /// A key of another test in the same slot as `storage_key` (which holds no hash tag), on
    /// `from`, for 60 s: the slot is not empty when it moves, as in a shared cluster.
    pub async fn add_neighbour(&self, masters: &mut [Master], storage_key: &[u8]) -> Vec<u8> {
        let mut neighbour = b"{".to_vec();
        neighbour.extend_from_slice(storage_key);
        neighbour.extend_from_slice(b"}neighbour");
        let _: () = redis::cmd("SET")
            .arg(&neighbour)
            .arg("kept")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut masters[self.from].1)
            .await
            .unwrap();
        neighbour
    }

    /// The slot migrates (IMPORTING on `to`, MIGRATING on `from`): a key not on `from` is
    /// answered ASK.
    pub async fn begin(&self, masters: &mut [Master]) {
        let (from_id, to_id) = (masters[self.from].0.clone(), masters[self.to].0.clone());
        setslot(&mut masters[self.to].1, self.slot, &["IMPORTING", &from_id]).await;
        setslot(&mut masters[self.from].1, self.slot, &["MIGRATING", &to_id]).await;
    }

    /// The migration ends: the keys still on `from` move to `to`, then every master says `to`
    /// serves the slot (MOVED for a stale map).
    pub async fn finish(&self, masters: &mut [Master]) {
        migrate_keys(masters, self.slot, self.from, self.to).await;
        let to_id = masters[self.to].0.clone();
        setslot(&mut masters[self.to].1, self.slot, &["NODE", &to_id]).await;
        setslot(&mut masters[self.from].1, self.slot, &["NODE", &to_id]).await;
        for (i, master) in masters.iter_mut().enumerate() {
            if i != self.from && i != self.to {
                setslot(&mut master.1, self.slot, &["NODE", &to_id]).await;
            }
        }
    }

    /// Puts the slot back on `from` the same way, with every key in it (deletes the test's
    /// own `storage_key` first).
    pub async fn undo(&self, masters: &mut [Master], storage_key: &[u8]) {
        let _: () = redis::cmd("DEL")
            .arg(storage_key)
            .query_async(&mut masters[self.to].1)
            .await
            .unwrap();
        let back = Self {
            slot: self.slot,
            from: self.to,
            to: self.from,
        };
        back.begin(masters).await;
        back.finish(masters).await;
    }
}
