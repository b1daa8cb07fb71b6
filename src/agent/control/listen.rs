//! The side channel's listener: accepting peers, serving each connection's requests as
//! the target, and the orderly shutdown when the agent is dropped (what was queued goes out
//! first, bounded).

use super::*;

impl Drop for Shutdown {
    fn drop(&mut self) {
        // what was queued for peers goes out first (bounded), then the agent stops
        self.shared.flush_and_stop();
        let _ = TcpStream::connect_timeout(&self.wake, Duration::from_secs(1));
        for (_, c) in lock(&self.conns).drain() {
            let _ = c.shutdown(NetShutdown::Both);
        }
        self.shared.close_peers();
    }
}

pub(crate) fn serve(
    shared: Arc<dyn Host>,
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
                    if matches!(first, Msg::Attach { .. }) {
                        if let Err(e) = target(&*shared, s, first) {
                            tracing::warn!(agent = %shared.name, error = %e, "data connection");
                        }
                    } else {
                        shared.take_sent(s, first);
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
pub(super) fn target(shared: &dyn Host, s: TcpStream, first: Msg) -> Result<(), String> {
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    let mut r = Reader::new(s);
    let Msg::Attach { info } = first else {
        return Err(format!("expected Attach, got {first:?}"));
    };
    let checked = (crate::agent::metadata::check_name(&info.agent))
        .map_err(|e| e.to_string())
        .and_then(|()| {
            handshake::check(
                shared.handshake(),
                &info,
                shared.config().enforce_handshake_compat,
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
    let conn = shared.new_conn();
    let res = target_loop(shared, &mut r, &mut w, &from, conn);
    // the channel first: what it still delivers is numbered on this connection
    #[cfg(feature = "verbs")]
    if let Some(v) = shared.verbs() {
        v.drop_in_chan(shared.lanes_host(), conn);
    }
    shared.forget_conn(conn);
    res
}

/// Serve an attached initiator's requests until its connection ends.
pub(super) fn target_loop(
    shared: &dyn Host,
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
