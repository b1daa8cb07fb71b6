//! A queue pair made and brought up: created on a protection domain with its completion queues, moved through INIT, RTR and RTS to a peer's endpoint, queried.

use super::*;

impl Qp {
    /// Create an RC queue pair and move it to INIT on `opts.port`.
    ///
    /// # Errors
    /// [`Error::QueryPort`], [`Error::QueryGid`], [`Error::CreateQp`], [`Error::ModifyQp`].
    pub fn new(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, opts: &QpOptions) -> Result<Self, Error> {
        let ctx = super::super::device::Context {
            inner: pd.inner.ctx.clone(),
        };
        let port = ctx.query_port(opts.port)?;
        let dev = ctx.query_device()?;
        let gid = ctx
            .gid_table(opts.port)?
            .into_iter()
            .find(|e| e.index == opts.gid_index)
            .map(|e| e.gid)
            .ok_or_else(|| Error::NoUsableGid {
                device: ctx.name().to_owned(),
                port: opts.port,
                reason: format!("GID index {} is empty", opts.gid_index),
            })?;
        // SAFETY: plain old data; zeroed is valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.inner.raw();
        init.recv_cq = recv_cq.inner.raw();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = opts.max_send_wr;
        init.cap.max_recv_wr = opts.max_recv_wr;
        init.cap.max_send_sge = opts.max_send_sge;
        init.cap.max_recv_sge = opts.max_recv_sge;
        init.cap.max_inline_data = opts.max_inline_data;
        // SAFETY: live PD and CQs of the same context; `init` is fully initialized.
        let qp = unsafe { ffi::ibv_create_qp(pd.raw(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| Error::CreateQp {
            send_wr: opts.max_send_wr,
            recv_wr: opts.max_recv_wr,
            source: last_os_error(),
        })?;
        // SAFETY: just created.
        let qpn = unsafe { qp.as_ref().qp_num };
        // what the provider granted (it writes the capabilities back)
        let max_inline = init.cap.max_inline_data;
        let shared = Arc::new(QpShared::new(
            opts.max_send_wr as usize,
            opts.max_recv_wr as usize,
        ));
        send_cq.inner.attach(qpn, shared.clone());
        recv_cq.inner.attach(qpn, shared.clone());
        // As many outstanding READs as the device takes (perftest's default too): on rxe
        // (128) a cap of 16 left 64 KiB READs at 32 in flight waiting on READ credits.
        let max_dest_rd_atomic = dev.max_qp_rd_atom.clamp(1, 255) as u8;
        let this = Self {
            inner: Arc::new(QpInner {
                qp,
                qpn,
                opts: opts.clone(),
                local: Endpoint {
                    qpn,
                    psn: random_psn(),
                    gid,
                    lid: port.lid,
                    mtu: {
                        let active = port.active_mtu.unwrap_or(Mtu::Mtu1024);
                        opts.max_mtu.map_or(active, |m| m.min(active))
                    },
                    rd_atomic: max_dest_rd_atomic,
                },
                link_layer: port.link_layer,
                max_rd_atomic: dev.max_qp_init_rd_atom.clamp(1, 255) as u8,
                max_dest_rd_atomic,
                max_inline,
                state: AtomicU8::new(QpState::Reset as u8),
                posting: Mutex::new(()),
                shared,
                send_cq: send_cq.inner.clone(),
                recv_cq: recv_cq.inner.clone(),
                pd: pd.inner.clone(),
            }),
        };
        if port.state != PortState::Active {
            tracing::warn!(
                device = ctx.name(),
                port = opts.port,
                "creating a QP on a port that is {}",
                port.state
            );
        }
        // SAFETY: zeroed is valid; only the masked fields are read.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = opts.port;
        a.qp_access_flags = opts.remote_access.bits();
        use ffi::ibv_qp_attr_mask as M;
        this.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            QpState::Init,
        )?;
        Ok(this)
    }

    pub(super) fn modify(
        &self,
        a: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        to: QpState,
    ) -> Result<(), Error> {
        // SAFETY: live QP; `a` holds every attribute the mask names.
        let ret = unsafe { ffi::ibv_modify_qp(self.inner.qp.as_ptr(), a, mask.0 as i32) };
        if ret != 0 {
            return Err(Error::ModifyQp {
                qpn: self.inner.qpn,
                to: to.name(),
                source: from_ret(ret),
            });
        }
        self.set_state(to);
        Ok(())
    }

    pub(super) fn set_state(&self, s: QpState) {
        self.inner.state.store(s as u8, Ordering::Release);
    }

    /// Connect to the peer's endpoint: INIT → RTR (path MTU = the smaller of both ports'
    /// active MTUs) → RTS.
    ///
    /// # Errors
    /// [`Error::BadEndpoint`] for an endpoint that cannot be valid; [`Error::QpState`] when
    /// the QP is not in INIT; [`Error::ModifyQp`] naming the state that failed.
    pub fn connect(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<(), Error> {
        let qpn = self.inner.qpn;
        let bad = |reason: String| Err(Error::BadEndpoint { qpn, reason });
        if remote.qpn == 0 || remote.qpn > 0x00ff_ffff {
            return bad(format!(
                "peer qpn {} is not a 24-bit non-zero QP number",
                remote.qpn
            ));
        }
        if remote.psn > 0x00ff_ffff {
            return bad(format!("peer psn {} exceeds 24 bits", remote.psn));
        }
        let roce = self.inner.link_layer == LinkLayer::Ethernet;
        if roce && remote.gid.is_zero() {
            return bad("peer GID is zero on a RoCE port".into());
        }
        let state = self.cached_state();
        if state != QpState::Init {
            return Err(Error::QpState {
                qpn,
                state: state.name(),
                expected: "INIT",
            });
        }
        let path_mtu = remote.mtu.min(self.inner.local.mtu);
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: zeroed is valid; only the masked fields are read.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = path_mtu as u32;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = self.inner.max_dest_rd_atomic;
        a.min_rnr_timer = opts.min_rnr_timer;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.inner.opts.port;
        a.ah_attr.is_global = u8::from(roce || !remote.gid.is_zero());
        a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid.0 };
        a.ah_attr.grh.sgid_index = self.inner.opts.gid_index as u8;
        a.ah_attr.grh.hop_limit = opts.hop_limit;
        a.ah_attr.grh.traffic_class = opts.traffic_class;
        a.ah_attr.grh.flow_label = 0;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            QpState::Rtr,
        )?;
        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = opts.timeout;
        a.retry_cnt = opts.retry_cnt;
        a.rnr_retry = opts.rnr_retry;
        a.sq_psn = self.inner.local.psn;
        // never more outstanding than the peer's responder serves
        let theirs = match remote.rd_atomic {
            0 => UNSAID_RD_ATOMIC,
            n => n,
        };
        a.max_rd_atomic = self.inner.max_rd_atomic.min(theirs);
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            QpState::Rts,
        )?;
        tracing::debug!(
            qpn,
            peer_qpn = remote.qpn,
            mtu = path_mtu.bytes(),
            "queue pair connected"
        );
        Ok(())
    }

    pub(super) fn query(&self, mask: ffi::ibv_qp_attr_mask) -> Result<ffi::ibv_qp_attr, Error> {
        // SAFETY: zeroed PODs are valid out-parameters.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, valid out-pointers.
        let ret =
            unsafe { ffi::ibv_query_qp(self.inner.qp.as_ptr(), &mut a, mask.0 as i32, &mut init) };
        if ret != 0 {
            return Err(Error::QueryQp {
                qpn: self.inner.qpn,
                source: from_ret(ret),
            });
        }
        Ok(a)
    }
}
