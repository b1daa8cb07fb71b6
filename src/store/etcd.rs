//! The etcd v3 client of the metadata store: `etcd-client` on a one-worker Tokio runtime
//! owned by the store, behind blocking calls (the agent is thread-based). Two tasks run on
//! it: the lease keeper (renews the agent's lease every third of its TTL; re-grants and
//! republishes when etcd forgot it) and the watcher (one prefix watch for the namespace,
//! resumed from the next revision after any break, so no event is missed while etcd or the
//! connection to it was down).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};

use super::{StoreConfig, StoreError};

/// How long one blocking call may take.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before retrying a lost lease keeper or watch.
const RETRY: Duration = Duration::from_millis(500);

/// A published agent's metadata as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMetadata {
    /// The metadata bytes (msgpack, as the side channel serves them).
    pub bytes: Vec<u8>,
    /// The etcd lease it is attached to: one per agent incarnation.
    pub lease: i64,
    /// The store revision of its last change.
    pub revision: i64,
}

/// What this agent keeps in the store.
#[derive(Debug, Clone, Default)]
pub(crate) struct Published {
    key: String,
    value: Vec<u8>,
    /// 0: no lease yet (or etcd forgot it): grant one and put the value again.
    lease: i64,
}

/// A change under the namespace, in revision order.
#[derive(Debug)]
pub(crate) enum Event {
    /// An agent's key was written (a start, an update, a restart).
    Put(String, StoredMetadata),
    /// An agent's key is gone (lease expired: a crash; revoked: a clean stop) at a revision.
    Delete(String, i64),
    /// Events may have been missed (the watch fell behind a compaction): load again.
    Resync,
}

/// State the runtime's tasks share with the blocking side.
struct State {
    client: Client,
    cfg: StoreConfig,
    up: AtomicBool,
    published: Mutex<Option<Published>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl State {
    fn set_up(&self, up: bool, why: &str) {
        if self.up.swap(up, Ordering::AcqRel) != up {
            if up {
                tracing::info!(endpoints = ?self.cfg.endpoints, "metadata store reachable again");
            } else {
                tracing::warn!(endpoints = ?self.cfg.endpoints, error = %why, "metadata store down: existing connections keep working; loads by name fail until it returns");
            }
        }
    }

    fn published(&self) -> std::sync::MutexGuard<'_, Option<Published>> {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A connection to etcd for agent metadata (see [`super`]).
pub struct EtcdStore {
    state: Arc<State>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.state.cfg.endpoints)
            .field("namespace", &self.state.cfg.namespace)
            .finish()
    }
}

fn failed(op: &'static str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Failed {
        op,
        message: e.to_string(),
    }
}

impl EtcdStore {
    /// Connect and check that etcd answers (a read of the namespace).
    ///
    /// # Errors
    /// [`StoreError::Unreachable`] naming the endpoints; [`StoreError::Unavailable`] for a
    /// bad configuration or no runtime thread.
    pub fn connect(cfg: &StoreConfig) -> Result<Self, StoreError> {
        cfg.check()
            .map_err(|(k, why)| StoreError::Unavailable(format!("{k}: {why}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvrail-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Unavailable(format!("no runtime for the etcd client: {e}")))?;
        let unreachable = |e: &dyn std::fmt::Display| StoreError::Unreachable {
            endpoints: cfg.endpoints.join(","),
            message: e.to_string(),
        };
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(OP_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = rt
            .block_on(async {
                tokio::time::timeout(OP_TIMEOUT, Client::connect(&cfg.endpoints, Some(opts))).await
            })
            .map_err(|e| unreachable(&e))?
            .map_err(|e| unreachable(&e))?;
        let (stop, _) = tokio::sync::watch::channel(false);
        let store = Self {
            state: Arc::new(State {
                client,
                cfg: cfg.clone(),
                up: AtomicBool::new(true),
                published: Mutex::new(None),
                stop,
            }),
            rt: Some(rt),
        };
        // the client connects lazily: a first read says whether anyone answers
        store.revision().map_err(|e| match e {
            StoreError::Failed { message, .. } => unreachable(&message),
            other => other,
        })?;
        Ok(store)
    }

    /// Run `f` on the store's runtime, bounded by [`OP_TIMEOUT`].
    fn block<T>(
        &self,
        op: &'static str,
        f: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        let rt = self.rt.as_ref().expect("runtime lives until drop");
        let r = rt
            .block_on(async { tokio::time::timeout(OP_TIMEOUT, f).await })
            .map_err(|_| failed(op, format!("no answer within {OP_TIMEOUT:?}")))
            .and_then(|r| r.map_err(|e| failed(op, e)));
        match &r {
            Ok(_) => {}
            Err(e) => self.state.set_up(false, &e.to_string()),
        }
        r
    }

    /// The store's current revision.
    fn revision(&self) -> Result<i64, StoreError> {
        let mut c = self.state.client.clone();
        let key = self.state.cfg.prefix();
        let r = self.block("read", async move {
            c.get(
                key,
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_keys_only()
                        .with_limit(1),
                ),
            )
            .await
        })?;
        Ok(r.header().map_or(0, |h| h.revision()))
    }

    /// The metadata agent `name` published, if its key exists.
    ///
    /// # Errors
    /// [`StoreError::Failed`] when etcd does not answer.
    pub fn fetch(&self, name: &str) -> Result<Option<StoredMetadata>, StoreError> {
        let mut c = self.state.client.clone();
        let key = self.state.cfg.key(name);
        let r = self.block("fetch", async move { c.get(key, None).await })?;
        Ok(r.kvs().first().map(|kv| StoredMetadata {
            bytes: kv.value().to_vec(),
            lease: kv.lease(),
            revision: kv.mod_revision(),
        }))
    }

    /// Names of the agents published in the namespace, sorted.
    ///
    /// # Errors
    /// [`StoreError::Failed`] when etcd does not answer.
    pub fn agents(&self) -> Result<Vec<String>, StoreError> {
        let mut c = self.state.client.clone();
        let prefix = self.state.cfg.prefix();
        let p = prefix.clone();
        let r = self.block("list", async move {
            c.get(p, Some(GetOptions::new().with_prefix().with_keys_only()))
                .await
        })?;
        let mut v: Vec<String> = (r.kvs().iter())
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(&prefix).map(str::to_owned))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Whether etcd answered the last operation, lease renewal and watch.
    pub fn is_up(&self) -> bool {
        self.state.up.load(Ordering::Acquire)
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.state.cfg
    }

    /// Publish `value` as agent `name`'s metadata. The first call grants the lease and
    /// starts renewing it; later calls replace the value under the same lease. When etcd is
    /// down the value is kept and written once it returns.
    ///
    /// # Errors
    /// [`StoreError::Failed`] when etcd does not take it now.
    pub(crate) fn publish(&self, name: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let first = {
            let mut p = self.state.published();
            let first = p.is_none();
            let p = p.get_or_insert_with(Published::default);
            p.key = self.state.cfg.key(name);
            p.value = value;
            first
        };
        let state = self.state.clone();
        let r = self.block("publish", async move { put_published(&state).await });
        if first {
            let (state, stop) = (self.state.clone(), self.state.stop.subscribe());
            self.rt
                .as_ref()
                .expect("runtime lives until drop")
                .spawn(keep_lease(state, stop));
        }
        r.map(|_| ())
    }

    /// Publish `value` (partial metadata) under agent `name`'s `label`, under the agent's
    /// lease: it goes when the agent's key does.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] before this agent published its own metadata;
    /// [`StoreError::Failed`] when etcd does not take it now.
    pub(crate) fn publish_label(
        &self,
        name: &str,
        label: &str,
        value: Vec<u8>,
    ) -> Result<(), StoreError> {
        let lease = self.state.published().as_ref().map_or(0, |p| p.lease);
        if lease == 0 {
            return Err(StoreError::Unavailable(
                "this agent's own metadata is not in the store yet (its lease holds the labels)"
                    .into(),
            ));
        }
        let mut c = self.state.client.clone();
        let key = self.state.cfg.label_key(name, label);
        self.block("publish", async move {
            c.put(key, value, Some(PutOptions::new().with_lease(lease)))
                .await
        })
        .map(|_| ())
    }

    /// The partial metadata agent `name` published under `label`, if it did.
    ///
    /// # Errors
    /// [`StoreError::Failed`] when etcd does not answer.
    pub fn fetch_label(&self, name: &str, label: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.state.client.clone();
        let key = self.state.cfg.label_key(name, label);
        let r = self.block("fetch", async move { c.get(key, None).await })?;
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Delete agent `name`'s key and its labels, keeping the lease (peers following it
    /// forget it; a later publish puts it back).
    ///
    /// # Errors
    /// [`StoreError::Failed`] when etcd does not answer.
    pub(crate) fn unpublish(&self, name: &str) -> Result<(), StoreError> {
        let (mut c, mut d) = (self.state.client.clone(), self.state.client.clone());
        let key = self.state.cfg.key(name);
        let labels = self.state.cfg.label_key(name, "");
        self.block("delete", async move {
            c.delete(key, None).await?;
            d.delete(
                labels,
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
        })
        .map(|_| ())
    }

    /// Start the namespace watch: every change after now goes to `tx` until the store drops
    /// or `tx`'s receiver does.
    ///
    /// # Errors
    /// [`StoreError::Failed`] when etcd does not answer.
    pub(crate) fn watch(&self, tx: mpsc::Sender<Event>) -> Result<(), StoreError> {
        let next = self.revision()? + 1;
        let (state, stop) = (self.state.clone(), self.state.stop.subscribe());
        self.rt
            .as_ref()
            .expect("runtime lives until drop")
            .spawn(watch_prefix(state, next, tx, stop));
        Ok(())
    }

    /// Take this agent's key away now (revoke its lease): a clean stop, peers see it at once.
    pub(crate) fn withdraw(&self) {
        let lease = self.state.published().take().map_or(0, |p| p.lease);
        let _ = self.state.stop.send(true);
        if lease != 0 && !self.is_up() {
            // no wait on a store that is down: the key goes when its lease runs out
            tracing::warn!(
                lease,
                "metadata store down: the key stays until its lease expires"
            );
        } else if lease != 0 {
            let mut c = self.state.client.clone();
            let r = self.block("revoke", async move { c.lease_revoke(lease).await });
            if let Err(e) = r {
                tracing::warn!(error = %e, "metadata store: the key stays until its lease expires");
            }
        }
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        let _ = self.state.stop.send(true);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_millis(500));
        }
    }
}

/// Put the published value under its lease, granting one first when there is none.
/// Returns the lease.
async fn put_published(state: &State) -> Result<i64, etcd_client::Error> {
    let Some(p) = state.published().clone() else {
        return Ok(0);
    };
    let mut c = state.client.clone();
    let lease = if p.lease == 0 {
        let ttl = i64::try_from(state.cfg.lease_ttl.as_secs()).unwrap_or(i64::MAX);
        c.lease_grant(ttl, None).await?.id()
    } else {
        p.lease
    };
    c.put(p.key, p.value, Some(PutOptions::new().with_lease(lease)))
        .await?;
    if let Some(now) = state.published().as_mut() {
        now.lease = lease;
    }
    state.set_up(true, "");
    Ok(lease)
}

/// A task's pause after a failure: the store is marked down, then `RETRY` passes. True when
/// the store stopped meanwhile (the task ends).
async fn pause(state: &State, why: &str, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
    state.set_up(false, why);
    tokio::time::timeout(RETRY, stop.changed()).await.is_ok()
}

/// Renews the lease every third of its TTL; when etcd says it expired (down longer than
/// the TTL), grants a new one and puts the value again (peers see a new incarnation).
async fn keep_lease(state: Arc<State>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let period = (state.cfg.lease_ttl / 3).max(Duration::from_millis(500));
    loop {
        if *stop.borrow() {
            return;
        }
        let lease = match state.published().as_ref() {
            None => return,
            Some(p) => p.lease,
        };
        let lease = if lease == 0 {
            match put_published(&state).await {
                Ok(l) if l != 0 => l,
                Ok(_) => return,
                Err(e) => {
                    if pause(&state, &e.to_string(), &mut stop).await {
                        return;
                    }
                    continue;
                }
            }
        } else {
            lease
        };
        let mut c = state.client.clone();
        let (mut keeper, mut answers) = match c.lease_keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => {
                if pause(&state, &e.to_string(), &mut stop).await {
                    return;
                }
                continue;
            }
        };
        loop {
            if keeper.keep_alive().await.is_err() {
                state.set_up(false, "lease renewal not sent");
                break;
            }
            match tokio::time::timeout(OP_TIMEOUT, answers.message()).await {
                Ok(Ok(Some(a))) if a.ttl() > 0 => state.set_up(true, ""),
                Ok(Ok(Some(_))) => {
                    tracing::warn!(lease, "metadata store: the lease expired (etcd unreachable for longer than its TTL); publishing again under a new one");
                    if let Some(p) = state.published().as_mut() {
                        p.lease = 0;
                    }
                    break;
                }
                Ok(Err(e)) => {
                    state.set_up(false, &e.to_string());
                    break;
                }
                _ => {
                    state.set_up(false, "no answer to the lease renewal");
                    break;
                }
            }
            if tokio::time::timeout(period, stop.changed()).await.is_ok() {
                return;
            }
        }
        if tokio::time::timeout(RETRY, stop.changed()).await.is_ok() {
            return;
        }
    }
}

/// Watches the namespace from revision `next`, resuming after every break.
async fn watch_prefix(
    state: Arc<State>,
    mut next: i64,
    tx: mpsc::Sender<Event>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let prefix = state.cfg.prefix();
    loop {
        if *stop.borrow() {
            return;
        }
        let mut c = state.client.clone();
        let opts = WatchOptions::new().with_prefix().with_start_revision(next);
        let mut stream = match c.watch(prefix.clone(), Some(opts)).await {
            Ok(s) => s,
            Err(e) => {
                if pause(&state, &e.to_string(), &mut stop).await {
                    return;
                }
                continue;
            }
        };
        loop {
            let m = tokio::select! {
                _ = stop.changed() => return,
                m = stream.message() => m,
            };
            let Ok(Some(resp)) = m else { break };
            if resp.canceled() {
                if resp.compact_revision() > next {
                    next = resp.compact_revision();
                    if tx.send(Event::Resync).is_err() {
                        return;
                    }
                }
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                next = next.max(kv.mod_revision() + 1);
                let Some(name) = kv.key_str().ok().and_then(|k| k.strip_prefix(&prefix)) else {
                    continue;
                };
                let e = match ev.event_type() {
                    EventType::Put => Event::Put(
                        name.to_owned(),
                        StoredMetadata {
                            bytes: kv.value().to_vec(),
                            lease: kv.lease(),
                            revision: kv.mod_revision(),
                        },
                    ),
                    EventType::Delete => Event::Delete(name.to_owned(), kv.mod_revision()),
                };
                if tx.send(e).is_err() {
                    return;
                }
            }
        }
        if tokio::time::timeout(RETRY, stop.changed()).await.is_ok() {
            return;
        }
    }
}
