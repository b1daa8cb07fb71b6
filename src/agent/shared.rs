//! The facade's state ([`Shared`]) at work: deregistration (the region fenced, its keys
//! gone), the metadata it serves, and the traits the drivers ask it through —
//! `control::Host` (the side channel and peer connections) and `verbs::Host` (the verbs
//! lanes): queue pairs and notifications over the peers' connections, the orderly stop.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use super::control::FLUSH_ON_DROP;
use super::*;

impl Shared {
    /// Deregister region `id` and hand its memory back. Refused while this agent's own
    /// transfers use it. Otherwise, before this returns: no lookup finds it any more (a
    /// peer's new READ or WRITE of it is refused, naming it), its grants are revoked, the
    /// chunks of peers' transfers inside its gate have moved and no more enter (what is
    /// left of those transfers fails with the reason), and on verbs its keys are
    /// deregistered once no work request holds them — so nothing reads or writes the
    /// memory from then on. What does not let go within `deregister_wait` puts it back.
    pub(super) fn deregister_region(&self, id: RegionId) -> Result<RegionMemory, AgentError> {
        let r = {
            let mut regions = lock(&self.regions);
            let r = regions.get(&id.0).ok_or(AgentError::NoRegion(id.0))?;
            let transfers = r.in_use();
            if transfers > 0 {
                return Err(AgentError::RegionBusy {
                    region: id.0,
                    transfers,
                });
            }
            regions.remove(&id.0).ok_or(AgentError::NoRegion(id.0))?
        };
        self.revoke_region_grants(id.0);
        let (start, wait) = (std::time::Instant::now(), self.config.deregister_wait);
        let put_back = |r: Arc<Region>, holders: String| {
            r.gate.reopen();
            lock(&self.regions).insert(id.0, r);
            tracing::warn!(agent = %self.name, region = id.0, %holders,
                "deregistration timed out; the region stays registered");
            Err(AgentError::DeregisterTimeout {
                region: id.0,
                holders,
                waited_ms: start.elapsed().as_millis() as u64,
            })
        };
        if let Err(n) = r.gate.close(wait) {
            return put_back(r, format!("{n} chunk(s) of transfers in progress"));
        }
        // the last reference: a finished transfer's may still be on its way out
        let mut r = r;
        let region = loop {
            match Arc::try_unwrap(r) {
                Ok(region) => break region,
                Err(again) if start.elapsed() < wait => {
                    r = again;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(held) => {
                    let n = Arc::strong_count(&held) - 1;
                    return put_back(held, format!("{n} reference(s) of ended transfers"));
                }
            }
        };
        // verbs: the keys go now (a work request still holding one defers `ibv_dereg_mr`
        // until its completion, so wait for those)
        #[cfg(feature = "verbs")]
        while crate::transport::verbs::work_in_flight(&region.mrs) > 0 {
            if start.elapsed() >= wait {
                let n = crate::transport::verbs::work_in_flight(&region.mrs);
                return put_back(Arc::new(region), format!("{n} work request(s)"));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mem = region.into_memory();
        self.republish();
        tracing::debug!(agent = %self.name, region = id.0, "memory deregistered");
        Ok(mem)
    }

    pub(super) fn metadata(&self) -> AgentMetadata {
        #[cfg(feature = "verbs")]
        let verbs = self.verbs.as_ref();
        #[cfg(not(feature = "verbs"))]
        let verbs: Option<&()> = None;
        let regions = lock(&self.regions);
        let mut rs: Vec<RegionMeta> = regions
            .values()
            .map(|r| RegionMeta {
                id: r.id.0,
                kind: r.kind,
                addr: r.addr(),
                len: r.len(),
                #[cfg(feature = "verbs")]
                rkeys: r.mrs.iter().map(|m| m.rkey()).collect(),
                #[cfg(not(feature = "verbs"))]
                rkeys: Vec::new(),
                remote_read: r.access.read,
                remote_write: r.access.write,
                layers: r.layers.names.clone(),
                device: r.device,
                layer_offsets: r.layers.offsets.clone(),
                layer_len: r.layers.len,
                fenced: r.fenced,
            })
            .collect();
        rs.sort_by_key(|r| r.id);
        #[cfg(feature = "verbs")]
        let rails: Vec<metadata::RailAddr> = verbs
            .map(|v| v.rails.iter().map(|r| r.addr.clone()).collect())
            .unwrap_or_default();
        #[cfg(not(feature = "verbs"))]
        let rails = Vec::new();
        AgentMetadata {
            version: metadata::VERSION,
            handshake: self.handshake.clone(),
            backend: if verbs.is_some() {
                BackendKind::Verbs
            } else {
                BackendKind::Tcp
            },
            side_channel: self.addr.to_string(),
            rails,
            tcp_data: Some(self.addr.to_string()),
            regions: rs,
        }
    }

    /// Send a notification over the TCP connection to `peer` (numbered when it follows
    /// numbered ones of a failed channel).
    pub(crate) fn send_tcp_notif(&self, peer: &str, seq: Option<u64>, bytes: Vec<u8>) {
        if let Some(p) = lock(&self.peers).get(peer) {
            p.conn.submit(match seq {
                Some(seq) => control::Work::SeqNotif(seq, bytes),
                None => control::Work::Notif(bytes),
            });
        }
    }
}

#[cfg(feature = "verbs")]
impl verbs::Host for Shared {
    fn request_qps(&self, peer: &str, req: verbs::QpRequest) {
        // Lock order: the verbs engine (taken by `rebuilt`) is never taken under `peers`.
        let sent = lock(&self.peers)
            .get(peer)
            .is_some_and(|p| p.conn.try_submit(control::Work::QpOpen(req)));
        if !sent {
            if let Some(v) = &self.verbs {
                v.rebuilt(peer, Err("no open connection to the peer".into()));
            }
        }
    }

    fn request_chan(&self, peer: &str, rail: u32, ep: crate::transport::verbs::Endpoint) {
        // Lock order: the verbs engine (taken by `chan_rebuilt`) is never taken under `peers`.
        let sent = lock(&self.peers)
            .get(peer)
            .is_some_and(|p| p.conn.try_submit(control::Work::ChanOpen(rail, ep)));
        if !sent {
            if let Some(v) = &self.verbs {
                v.chan_rebuilt(peer, Err("no open connection to the peer".into()));
            }
        }
    }

    fn send_tcp_notif(&self, peer: &str, seq: Option<u64>, bytes: Vec<u8>) {
        Self::send_tcp_notif(self, peer, seq, bytes);
    }

    fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}

impl Shared {
    /// Wait until each writer sent what was queued on it before now: done, or
    /// [`FLUSH_ON_DROP`] without one item sent (a peer that stopped taking them), never a
    /// fixed total that a slow peer or a loaded host misses. `why` names the occasion in
    /// the log line of a writer given up on.
    pub(crate) fn flush_writers(
        &self,
        writers: Vec<(
            mpsc::Sender<control::Work>,
            Arc<std::sync::atomic::AtomicU64>,
        )>,
        why: &str,
    ) {
        for (w, sent) in writers {
            let (tx, rx) = mpsc::sync_channel(1);
            if w.send(control::Work::Flush(tx)).is_err() {
                continue;
            }
            let (mut seen, mut stall) = (sent.load(Ordering::Acquire), std::time::Instant::now());
            while let Err(mpsc::RecvTimeoutError::Timeout) =
                rx.recv_timeout(Duration::from_millis(50))
            {
                let now = sent.load(Ordering::Acquire);
                if now != seen {
                    (seen, stall) = (now, std::time::Instant::now());
                } else if stall.elapsed() > FLUSH_ON_DROP {
                    tracing::warn!(
                        agent = %self.name,
                        "{why} with messages a peer did not take for {FLUSH_ON_DROP:?}: closing"
                    );
                    break;
                }
            }
        }
    }
}

impl control::Host for Shared {
    fn config(&self) -> &AgentConfig {
        &self.config
    }

    fn handshake(&self) -> &HandshakeInfo {
        &self.handshake
    }

    fn metadata(&self) -> AgentMetadata {
        Self::metadata(self)
    }

    #[cfg(feature = "verbs")]
    fn verbs(&self) -> Option<&Arc<verbs::Verbs>> {
        self.verbs.as_ref()
    }

    #[cfg(feature = "verbs")]
    fn lanes_host(&self) -> &dyn verbs::Host {
        self
    }

    fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    fn new_conn(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    fn drive(&self, d: &Arc<control::driven::Driven>) {
        self.drive_tcp_conn(d);
    }

    fn undrive(&self, d: &Arc<control::driven::Driven>) {
        self.undrive_tcp_conn(d);
    }

    fn count_auth_refusal(&self) {
        self.auth_refused.fetch_add(1, Ordering::Relaxed);
    }

    fn count_protected_refusal(&self, ip: std::net::IpAddr) -> bool {
        self.open_refused.fetch_add(1, Ordering::Relaxed);
        lock(&self.open_refused_from).insert(ip)
    }

    fn take_sent(&self, s: std::net::TcpStream, m: control::msg::Msg) {
        // the agent is gone (being dropped): the connection closes unanswered
        if let Some(a) = self.me.get().and_then(WeakAgent::upgrade) {
            a.take_sent(s, m);
        }
    }

    fn flush_and_stop(&self) {
        // what was queued for peers (notifications, WRITE data) goes out first, bounded:
        // the notification channels deliver theirs while the peers keep taking them (until
        // FLUSH_ON_DROP passes without progress: then what is left on them goes over TCP),
        // then the TCP writers send theirs
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            let (mut left, mut stall) = (usize::MAX, std::time::Instant::now());
            loop {
                let n = v.notifs_in_flight();
                if n == 0 {
                    break;
                }
                if stall.elapsed() > FLUSH_ON_DROP {
                    tracing::warn!(
                        agent = %self.name, left = n,
                        "dropped with notifications a channel did not deliver for \
                         {FLUSH_ON_DROP:?}: they go over TCP"
                    );
                    let why =
                        format!("no progress for {FLUSH_ON_DROP:?} while the agent was dropped");
                    v.give_up_chans(self, &why);
                    break;
                }
                if n < left {
                    (left, stall) = (n, std::time::Instant::now());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // each TCP writer: flushed, or FLUSH_ON_DROP without one item sent (a peer that
        // stopped taking them), never a fixed total that a slow peer or a loaded host misses
        let writers: Vec<_> = (lock(&self.peers).values())
            .flat_map(|p| p.conn.writers())
            .collect();
        self.flush_writers(writers, "dropped");
        // then peers learn from the store that this agent is gone (after what it queued for
        // them arrived: they close their connections to it when they hear)
        self.withdraw();
        self.shutdown.store(true, Ordering::Release);
    }

    fn close_peers(&self) {
        for (_, p) in std::mem::take(&mut *lock(&self.peers)) {
            p.conn.close();
        }
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            v.wake();
        }
    }
}
