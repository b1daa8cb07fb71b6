//! Where the accelerator sits, so the connector's agent uses the NICs of its NUMA node: the
//! NPU's node comes from the runtime (`rbln_rdma_device_numa_node`, when it has one), else
//! from `rbln-smi -j` (the NPU's PCI bus id) and sysfs (`sys/bus/pci/devices/<bdf>/
//! numa_node`). With the node known, an explicitly verbs-only agent with no usable NIC
//! there fails at start with `no usable data-plane RoCE NIC on numa=N`; `auto` falls back to
//! TCP and says so at warning level.

use rbln_sys::smi::SmiDevice;
use rbln_sys::RblnLib;

use crate::agent::AgentConfig;
use crate::rails::SysfsRoot;

/// Where a NUMA node was learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaSource {
    /// The runtime's `rbln_rdma_device_numa_node`.
    Runtime,
    /// `rbln-smi -j`'s bus id, then sysfs.
    SmiSysfs,
}

/// The NUMA node of NPU `device`: from `lib` when the runtime reports it, else from the
/// `smi` device list (what `rbln-smi -j` printed) and sysfs under `root`. `None` when
/// neither knows (then every node's NICs may be used).
pub fn accelerator_numa(
    device: i32,
    lib: Option<&RblnLib>,
    smi: Option<&[SmiDevice]>,
    root: &SysfsRoot,
) -> Option<(i32, NumaSource)> {
    if let Some(n) = lib.and_then(|l| l.numa_node(device)) {
        return Some((n, NumaSource::Runtime));
    }
    let dev = smi?
        .iter()
        .find(|d| i64::from(d.npu) == i64::from(device))?;
    if let Some(n) = dev.numa_node {
        return Some((n as i32, NumaSource::SmiSysfs));
    }
    crate::rails::pci_numa_node(root, &dev.bus_id)
        .ok()
        .filter(|n| *n >= 0)
        .map(|n| (n, NumaSource::SmiSysfs))
}

/// `base` with the NUMA node of NPU `device` (unless `base.numa` is already set): asks
/// the runtime `lib`, then `rbln-smi -j` (`smi`: its parsed output; `None` runs the tool)
/// and the sysfs tree the agent reads (`base.sysfs_root`). Logged once, with the source.
pub fn on_accelerator(
    mut base: AgentConfig,
    device: i32,
    lib: Option<&RblnLib>,
    smi: Option<Vec<SmiDevice>>,
) -> AgentConfig {
    if base.numa >= 0 || device < 0 {
        return base;
    }
    let root = base
        .sysfs_root
        .clone()
        .map_or_else(SysfsRoot::system, SysfsRoot::new);
    // the runtime first; rbln-smi (a process) only when the runtime does not know
    let found = accelerator_numa(device, lib, None, &root).or_else(|| {
        let smi = smi.or_else(rbln_sys::smi::query_smi);
        accelerator_numa(device, None, smi.as_deref(), &root)
    });
    match found {
        Some((n, src)) => {
            tracing::info!(npu = device, numa = n, source = ?src, "accelerator placement: rails of numa={n}");
            base.numa = n;
        }
        None => tracing::info!(
            npu = device,
            "accelerator placement: NUMA node unknown (no runtime entry point, no rbln-smi); \
             every node's NICs may be used"
        ),
    }
    base
}

/// `base` placed for a worker over `caches`: on the NUMA node of their NPU (the process's
/// RBLN runtime, then `rbln-smi` and sysfs, as [`on_accelerator`]); unchanged for host
/// caches.
pub fn for_caches(base: AgentConfig, caches: &super::KvCaches) -> AgentConfig {
    match caches.npu_device() {
        Some(dev) => {
            let lib = rbln_sys::RblnLib::shared().ok();
            on_accelerator(base, dev, lib.as_deref(), None)
        }
        None => base,
    }
}

/// The RDMA devices an agent made with `config` would use as rails (the same discovery
/// and selection the verbs backend runs at start), or why none is usable — for checking a
/// placement before starting, and for tests on fixture trees.
///
/// # Errors
/// The selection's explanation (`no usable data-plane RoCE NIC on numa=N` with every
/// device's verdict), or "no RDMA device".
#[cfg(feature = "verbs")]
pub fn rails(config: &AgentConfig) -> Result<Vec<String>, String> {
    crate::agent::config_rails(config)
        .map(|rs| rs.iter().map(|r| r.port.name()).collect())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smi_bus_id_then_sysfs() {
        let dir = std::env::temp_dir().join(format!("placement-{}", std::process::id()));
        let dev = dir.join("sys/bus/pci/devices/0000:b1:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        let root = SysfsRoot::new(dir.clone());
        let smi = rbln_sys::smi::parse_smi_json(
            r#"{"devices":[{"npu":"0","pci":{"bus_id":"0000:17:00.0"}},
                           {"npu":"1","pci":{"bus_id":"0000:b1:00.0"}}]}"#,
        )
        .unwrap();
        assert_eq!(
            accelerator_numa(1, None, Some(&smi), &root),
            Some((1, NumaSource::SmiSysfs))
        );
        // npu 0's device has no numa_node file; npu 7 is not listed
        assert_eq!(accelerator_numa(0, None, Some(&smi), &root), None);
        assert_eq!(accelerator_numa(7, None, Some(&smi), &root), None);
        assert_eq!(accelerator_numa(1, None, None, &root), None);
        let placed = on_accelerator(
            AgentConfig {
                sysfs_root: Some(dir.clone()),
                ..AgentConfig::default()
            },
            1,
            None,
            Some(smi),
        );
        assert_eq!(placed.numa, 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
