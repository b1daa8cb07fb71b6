//! `kv_buffer_device` and the choice between device-to-device (dma-buf registration) and
//! host bounce, with the reason logged once.

use std::collections::HashSet;
use std::sync::Mutex;

/// `kv_buffer_device`: where the KV cache that crosses the fabric lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBufferDevice {
    /// `"rbln"`: device to device (NPU memory registered through dma-buf), falling back to
    /// host bounce where no dma-buf path exists.
    Rbln,
    /// `"cpu"`: host bounce (device → host copy, RDMA between host buffers, host → device).
    Cpu,
}

/// A configuration value that is not accepted; names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {reason}")]
pub struct ConfigError {
    /// The configuration key.
    pub key: String,
    /// What is wrong, and what is accepted.
    pub reason: String,
}

impl KvBufferDevice {
    /// The configuration key.
    pub const KEY: &'static str = "kv_buffer_device";

    /// Parse the key's value.
    ///
    /// # Errors
    /// [`ConfigError`] naming `kv_buffer_device` for anything but `"rbln"` and `"cpu"`.
    pub fn parse(value: &str) -> Result<Self, ConfigError> {
        match value {
            "rbln" => Ok(Self::Rbln),
            "cpu" => Ok(Self::Cpu),
            other => Err(ConfigError {
                key: Self::KEY.into(),
                reason: format!(
                    "{other:?} is not accepted; use \"rbln\" (device to device) or \"cpu\" \
                     (host bounce)"
                ),
            }),
        }
    }
}

/// One NIC's dma-buf probe result (from `Agent::dmabuf_support`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicDmabuf {
    /// Rail name (`device:port`).
    pub device: String,
    /// Whether `ibv_reg_dmabuf_mr` works there.
    pub supported: bool,
    /// The probe's explanation.
    pub reason: String,
}

/// How KV bytes reach the fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryPath {
    /// NPU memory registered with every rail through dma-buf.
    DeviceToDevice,
    /// Staged through registered host buffers; `reason` says why (for `cpu`: configured).
    HostBounce {
        /// Why.
        reason: String,
    },
}

impl MemoryPath {
    /// Choose the path for `device`, given whether the NPU runtime can export dma-bufs
    /// (`Err` says why not) and each rail's probe (empty: no RDMA rail, so TCP). Device to
    /// device needs all three: `rbln` configured, an exporter, and every rail supporting
    /// dma-buf. A fallback from `rbln` is logged as a warning, once per distinct reason.
    pub fn choose(
        device: KvBufferDevice,
        exporter: Result<(), String>,
        rails: &[NicDmabuf],
    ) -> Self {
        if device == KvBufferDevice::Cpu {
            return Self::HostBounce {
                reason: "kv_buffer_device is \"cpu\"".into(),
            };
        }
        let why = if let Err(e) = exporter {
            Some(e)
        } else if rails.is_empty() {
            Some("no RDMA rail (the TCP backend cannot reach device memory)".into())
        } else {
            rails
                .iter()
                .find(|r| !r.supported)
                .map(|r| r.reason.clone())
        };
        match why {
            None => Self::DeviceToDevice,
            Some(why) => {
                let reason = format!("kv_buffer_device \"rbln\" falls back to host bounce: {why}");
                warn_once(&reason);
                Self::HostBounce { reason }
            }
        }
    }
}

fn warn_once(msg: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(msg.to_owned()) {
        tracing::warn!("{msg}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(supported: bool) -> NicDmabuf {
        NicDmabuf {
            device: "rxe0:1".into(),
            supported,
            reason: if supported {
                "ok".into()
            } else {
                "rxe0 cannot register dma-buf memory (EOPNOTSUPP)".into()
            },
        }
    }

    #[test]
    fn kv_buffer_device_values() {
        assert_eq!(KvBufferDevice::parse("rbln"), Ok(KvBufferDevice::Rbln));
        assert_eq!(KvBufferDevice::parse("cpu"), Ok(KvBufferDevice::Cpu));
        for bad in ["cuda", "", "CPU", "rbln "] {
            let e = KvBufferDevice::parse(bad).unwrap_err();
            assert_eq!(e.key, "kv_buffer_device");
            assert!(e.to_string().starts_with("kv_buffer_device: "), "{e}");
        }
    }

    #[test]
    fn the_path_needs_rbln_an_exporter_and_dmabuf_on_every_rail() {
        let ok = Ok(());
        assert_eq!(
            MemoryPath::choose(KvBufferDevice::Rbln, ok.clone(), &[nic(true), nic(true)]),
            MemoryPath::DeviceToDevice
        );
        let p = MemoryPath::choose(KvBufferDevice::Cpu, ok.clone(), &[nic(true)]);
        assert!(matches!(p, MemoryPath::HostBounce { reason } if reason.contains("\"cpu\"")));
        let p = MemoryPath::choose(KvBufferDevice::Rbln, ok.clone(), &[nic(true), nic(false)]);
        assert!(
            matches!(&p, MemoryPath::HostBounce { reason } if reason.contains("EOPNOTSUPP")),
            "{p:?}"
        );
        let p = MemoryPath::choose(KvBufferDevice::Rbln, ok, &[]);
        assert!(
            matches!(&p, MemoryPath::HostBounce { reason } if reason.contains("TCP")),
            "{p:?}"
        );
        let p = MemoryPath::choose(
            KvBufferDevice::Rbln,
            Err("no rbln_rdma_export_dmabuf".into()),
            &[nic(true)],
        );
        assert!(
            matches!(&p, MemoryPath::HostBounce { reason } if reason.contains("rbln_rdma_export_dmabuf")),
            "{p:?}"
        );
    }
}
