//! `Agent::new`: an agent from its configuration — the backend chosen, the side channel
//! listening, its threads started.

use super::*;

impl Agent {
    /// Create an agent called `name`, listening for its side channel on `config.listen`.
    ///
    /// # Errors
    /// [`AgentError::Unsupported`] for an invalid `stripe_width` or agent name, for
    /// `BackendChoice::Verbs` where no usable rail exists (the error says why), or for
    /// `devices` none of which is a usable rail (auto too: named devices are meant); a build
    /// without the `verbs` feature treats `Auto` as TCP. [`AgentError::Connection`] when it
    /// cannot listen.
    pub fn new(name: &str, mut config: AgentConfig) -> Result<Self, AgentError> {
        if config.cluster_secret.is_none() {
            if let Some(k) = std::env::var_os(SECRET_ENV) {
                let k = ClusterSecret::new(k.into_encoded_bytes())
                    .map_err(|e| AgentError::Unsupported(format!("{SECRET_ENV}: {e}")))?;
                config.cluster_secret = Some(k);
            }
        }
        if let Some(v) = std::env::var_os(INSECURE_ENV) {
            match v.to_str().map(str::to_ascii_lowercase).as_deref() {
                Some("1" | "true" | "yes" | "on") => config.insecure = true,
                Some("0" | "false" | "no" | "off" | "") => {}
                _ => {
                    return Err(AgentError::Unsupported(format!(
                        "{INSECURE_ENV}: {v:?} (1 or 0)"
                    )))
                }
            }
        }
        crate::transport::stripe::StripeMode::from_stripe_width(config.stripe_width)
            .map_err(|e| AgentError::Unsupported(format!("stripe_width: {e}")))?;
        metadata::check_name(name).map_err(|e| AgentError::Unsupported(e.to_string()))?;
        if !(1..=config::MAX_TCP_CONNS).contains(&config.tcp_conns) {
            return Err(AgentError::Unsupported(format!(
                "tcp_conns {}: use 1 to {}",
                config.tcp_conns,
                config::MAX_TCP_CONNS
            )));
        }
        #[cfg(feature = "verbs")]
        let verbs = match config.backend {
            BackendChoice::Tcp => {
                tracing::info!(agent = name, "kvrail backend: tcp (configured)");
                None
            }
            choice => match verbs::Verbs::open(&config) {
                Ok(v) => {
                    let names: Vec<&str> = v.rails.iter().map(|r| r.name.as_str()).collect();
                    tracing::info!(agent = name, rails = ?names, "kvrail backend: verbs");
                    Some(Arc::new(v))
                }
                // devices named by the operator are meant: none of them usable is an
                // error even in auto (it fell back to TCP without a word)
                Err(why) if !config.devices.is_empty() => {
                    let why = why.to_string().lines().next().unwrap_or("").to_owned();
                    return Err(AgentError::Unsupported(format!(
                        "devices {:?}: {why} (remove `devices` to let auto use TCP)",
                        config.devices
                    )));
                }
                Err(verbs::OpenError::NoRdma(why)) if choice == BackendChoice::Auto => {
                    tracing::info!(agent = name, "kvrail backend: tcp (no RDMA here: {why})");
                    None
                }
                Err(why) if choice == BackendChoice::Auto => {
                    let why = why.to_string().lines().next().unwrap_or("").to_owned();
                    tracing::warn!(
                        agent = name,
                        "kvrail backend: tcp, falling back from verbs: {why}"
                    );
                    None
                }
                Err(why) => return Err(AgentError::Unsupported(format!("backend verbs: {why}"))),
            },
        };
        #[cfg(not(feature = "verbs"))]
        match config.backend {
            BackendChoice::Verbs => {
                return Err(AgentError::Unsupported(
                    "backend verbs: this build has no verbs support (feature `verbs`)".into(),
                ))
            }
            _ => tracing::info!(agent = name, "kvrail backend: tcp (built without verbs)"),
        }
        // an unreachable store is an error at start, before anything listens
        #[cfg(feature = "etcd")]
        let store = store::open(&config)?;
        #[cfg(not(feature = "etcd"))]
        store::refuse_without_etcd(&config)?;
        let listener = TcpListener::bind(config.listen).map_err(|e| AgentError::Connection {
            what: "cannot listen on",
            addr: config.listen.to_string(),
            message: e.to_string(),
        })?;
        let local = listener.local_addr().map_err(|e| AgentError::Connection {
            what: "cannot listen on",
            addr: config.listen.to_string(),
            message: e.to_string(),
        })?;
        let addr = SocketAddr::new(config.side_channel_host, local.port());
        let handshake = HandshakeInfo {
            agent: name.to_owned(),
            compat_hash: config.compat.hash(),
            kv_layout: config.kv_layout.clone(),
            block_size: config.block_size,
            layers: config.layers.clone(),
            requires_layers: config.require_layers && !config.layers.is_empty(),
            physical_per_logical: config.physical_per_logical.max(1),
        };
        let shared = Arc::new(Shared {
            core: Core::new(name),
            config,
            addr,
            handshake,
            peers: Mutex::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
            next_conn: std::sync::atomic::AtomicU64::new(1),
            shutdown: std::sync::atomic::AtomicBool::new(false),
            auth_refused: std::sync::atomic::AtomicU64::new(0),
            open_refused: std::sync::atomic::AtomicU64::new(0),
            open_refused_from: Mutex::default(),
            driven: std::sync::RwLock::default(),
            #[cfg(feature = "verbs")]
            verbs,
            bounce: std::sync::OnceLock::new(),
            me: std::sync::OnceLock::new(),
            #[cfg(feature = "etcd")]
            store,
        });
        shared.watch_gauges();
        #[cfg(feature = "verbs")]
        if let Some(v) = &shared.verbs {
            v.count_into(&shared.stats.registry, name);
        }
        #[cfg(feature = "verbs")]
        if let Some(v) = &shared.verbs {
            v.run(shared.clone())?;
        }
        let guard = Arc::new(control::listen::serve(shared.clone(), listener, local)?);
        if let Some(at) = shared.config.metrics_listen {
            let ep =
                metrics_http::serve(at, Arc::downgrade(&shared.stats.registry)).map_err(|e| {
                    AgentError::Connection {
                        what: "cannot serve metrics on",
                        addr: at.to_string(),
                        message: e.to_string(),
                    }
                })?;
            tracing::info!(agent = name, metrics = %ep.addr(), "Prometheus metrics served");
            let _ = guard.metrics.set(ep);
        }
        tracing::info!(agent = name, side_channel = %addr, "kvrail agent up");
        if shared.config.cluster_secret.is_none() && !local.ip().is_loopback() {
            if shared.config.insecure {
                tracing::warn!(agent = name, side_channel = %local,
                    "no cluster_secret and insecure: anyone who reaches the side channel can \
                     load this agent's metadata and READ or WRITE its registered memory");
            } else {
                tracing::info!(agent = name, side_channel = %local,
                    "no cluster_secret: only peers on loopback are served ({})",
                    control::auth::PROTECTED_ADVICE);
            }
        }
        let agent = Self {
            shared,
            _guard: guard,
        };
        let _ = agent.shared.me.set(agent.downgrade());
        #[cfg(feature = "verbs")]
        if agent.shared.verbs.is_some() {
            let engine =
                bounce::Engine::start(agent.downgrade(), agent.shared.config.bounce.clone())?;
            agent.shared.core.set_tap(engine.tap());
            let _ = agent.shared.bounce.set(Box::new(engine));
        }
        #[cfg(feature = "etcd")]
        agent.start_store()?;
        Ok(agent)
    }
}
