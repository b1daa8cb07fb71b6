//! The side channel's listener: accepting peers, serving each connection's requests as
//! the target, and the orderly shutdown when the agent is dropped (what was queued goes out
//! first, bounded).

use super::*;

impl Drop for Shutdown {
    fn drop(&mut self) {
        // what was queued for peers (notifications, WRITE data) goes out first, bounded:
        // the notification channels deliver theirs while the peers keep taking them (until
        // FLUSH_ON_DROP passes without progress: then what is left on them goes over TCP),
        // then the TCP writers send theirs
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            let (mut left, mut stall) = (usize::MAX, std::time::Instant::now());
            loop {
                let n = v.notifs_in_flight();
                if n == 0 {
                    break;
                }
                if stall.elapsed() > FLUSH_ON_DROP {
                    tracing::warn!(
                        agent = %self.shared.name, left = n,
                        "dropped with notifications a channel did not deliver for \
                         {FLUSH_ON_DROP:?}: they go over TCP"
                    );
                    let why =
                        format!("no progress for {FLUSH_ON_DROP:?} while the agent was dropped");
                    v.give_up_chans(&*self.shared, &why);
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
        let writers: Vec<_> = (lock(&self.shared.peers).values())
            .flat_map(|p| p.conn.writers())
            .collect();
        for (w, sent) in writers {
            let (tx, rx) = mpsc::sync_channel(1);
            if w.send(Work::Flush(tx)).is_err() {
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
                        agent = %self.shared.name,
                        "dropped with messages a peer did not take for {FLUSH_ON_DROP:?}: closing"
                    );
                    break;
                }
            }
        }
        // then peers learn from the store that this agent is gone (after what it queued for
        // them arrived: they close their connections to it when they hear)
        self.shared.withdraw();
        self.shared.shutdown.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.wake, Duration::from_secs(1));
        for (_, c) in lock(&self.conns).drain() {
            let _ = c.shutdown(NetShutdown::Both);
        }
        for (_, p) in std::mem::take(&mut *lock(&self.shared.peers)) {
            p.conn.close();
        }
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.wake();
        }
    }
}

pub(crate) fn serve(
    shared: Arc<Shared>,
    listener: TcpListener,
    local: SocketAddr,
) -> Result<Shutdown, AgentError> {
    let wake = if local.ip().is_unspecified() {
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), local.port())
    } else {
        local
    };
    let conns = Conns::default();
    {
        let shared = shared.clone();
        let conns = conns.clone();
        crate::threads::spawn(format!("kvrail-listen-{}", shared.name), move || {
            let _span = tracing::info_span!("agent", name = %shared.name).entered();
            let mut serial = 0u64;
            let res = accept::run(&shared, listener, |shared, s, first| {
                serial += 1;
                let key = serial;
                if let Ok(k) = s.try_clone() {
                    lock(&conns).insert(key, k);
                }
                let mine = conns.clone();
                let spawned = crate::threads::spawn("kvrail-serve", move || {
                    let _span = tracing::info_span!("agent", name = %shared.name).entered();
                    if let Err(e) = target(&shared, s, first) {
                        tracing::warn!(agent = %shared.name, error = %e, "data connection");
                    }
                    lock(&mine).remove(&key);
                });
                if spawned.is_err() {
                    lock(&conns).remove(&key);
                }
            });
            if let Err(e) = res {
                tracing::error!(agent = %shared.name, error = %e, "side channel listener stopped");
            }
        })
        .map_err(|e| conn_err("cannot start the listener thread for", local, e))?;
    }
    Ok(Shutdown {
        shared,
        wake,
        conns,
        metrics: std::sync::OnceLock::new(),
    })
}

/// Serve an attached peer's data connection (`first` is its Attach, read by the listener).
pub(super) fn target(shared: &Shared, s: TcpStream, first: Msg) -> Result<(), String> {
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    let mut r = Reader::new(s);
    let Msg::Attach { info } = first else {
        return Err(format!("expected Attach, got {first:?}"));
    };
    let checked = crate::agent::metadata::check_name(&info.agent).and_then(|()| {
        handshake::check(
            &shared.handshake,
            &info,
            shared.config.enforce_handshake_compat,
        )
        .map_err(|e| e.to_string())
    });
    if let Err(e) = checked {
        let _ = send(
            &mut w,
            &Msg::Refused {
                message: e.to_string(),
            },
        );
        return Err(format!("refused {:?}: {e}", info.agent));
    }
    send(&mut w, &Msg::Attached).map_err(|e| e.to_string())?;
    let from = info.agent;
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let res = target_loop(shared, &mut r, &mut w, &from, conn);
    // the channel first: what it still delivers is numbered on this connection
    #[cfg(feature = "verbs")]
    if let Some(v) = &shared.verbs {
        v.drop_in_chan(shared, conn);
    }
    shared.forget_conn(conn);
    res
}

/// Serve an attached initiator's requests until its connection ends.
pub(super) fn target_loop(
    shared: &Shared,
    r: &mut Reader<TcpStream>,
    w: &mut TcpStream,
    from: &str,
    conn: u64,
) -> Result<(), String> {
    let mut writes = super::super::tcp::Writes::default();
    #[cfg(feature = "verbs")]
    let mut qps = super::qp_exchange::TargetQps::default();
    // WRITE answers wait here while more requests are already read: one send for a burst
    // of small transfers instead of one each (sent before the reader would wait for more,
    // and before any other answer, so nothing is held back or reordered behind one)
    let mut acks = Vec::new();
    let flush = |w: &mut TcpStream, acks: &mut Vec<u8>| -> Result<(), String> {
        if acks.is_empty() {
            return Ok(());
        }
        let r = std::io::Write::write_all(w, acks).map_err(|e| format!("to {from}: {e}"));
        acks.clear();
        r
    };
    loop {
        if !r.has_frame() {
            flush(w, &mut acks)?;
        }
        let m = match r.next() {
            Ok(Some(m)) => m,
            Ok(None) => return flush(w, &mut acks),
            Err(e) => return Err(format!("from {from}: {e}")),
        };
        if !matches!(
            m,
            Msg::WriteData { .. } | Msg::WriteEnd { .. } | Msg::Notif(_)
        ) {
            flush(w, &mut acks)?;
        }
        #[cfg(feature = "verbs")]
        if let Some(reply) = qps.answer(shared, conn, from, &m) {
            send(w, &reply).map_err(|e| format!("to {from}: {e}"))?;
            continue;
        }
        let res = match m {
            Msg::WriteData {
                xfer,
                region,
                offset,
                len,
                grant,
            } => {
                (writes.data(shared, r, xfer, (region, offset, len, grant)))
                    .map_err(|e| format!("from {from}: {e}"))?;
                Ok(())
            }
            Msg::WriteEnd { xfer, notif } => {
                msg::encode_into(&mut acks, &writes.end(shared, from, xfer, notif))
            }
            Msg::ReadReq {
                xfer,
                idx,
                region,
                offset,
                len,
                grant,
            } => {
                super::super::tcp::serve_read(shared, w, (xfer, idx), (region, offset, len), grant)
            }
            Msg::Notif(b) => {
                shared.deliver_notif(from, b);
                Ok(())
            }
            Msg::SeqNotif { seq, bytes } => {
                shared.deliver_seq_notif(conn, from, seq, bytes);
                Ok(())
            }
            other => return Err(format!("from {from}: unexpected {other:?}")),
        };
        res.map_err(|e| format!("to {from}: {e}"))?;
    }
}
