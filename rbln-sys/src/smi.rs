//! Where an NPU sits: its NUMA node from sysfs or from `rbln-smi -j`.
//!
//! `rbln-smi -j` prints `{"KMD_version": …, "devices": [{"npu": "0", "name": …,
//! "pci": {"bus_id": "0000:3b:00.0", "numa_node": "0", …}, …}]}` with every value a
//! string. The sysfs source needs no vendor tool: `/sys/bus/pci/devices/<bus_id>/numa_node`,
//! where -1 means unknown.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One NPU as `rbln-smi -j` lists it (the fields kvrail uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmiDevice {
    /// NPU index (`npu`).
    pub npu: u32,
    /// Product name.
    pub name: String,
    /// PCI bus id (`pci.bus_id`).
    pub bus_id: String,
    /// NUMA node (`pci.numa_node`; `None` for -1 or absent).
    pub numa_node: Option<u32>,
}

#[derive(Deserialize)]
struct Doc {
    devices: Vec<RawDevice>,
}

#[derive(Deserialize)]
struct RawDevice {
    npu: String,
    #[serde(default)]
    name: String,
    pci: RawPci,
}

#[derive(Deserialize)]
struct RawPci {
    bus_id: String,
    #[serde(default)]
    numa_node: Option<String>,
}

/// A malformed `rbln-smi -j` document.
#[derive(Debug, thiserror::Error)]
#[error("rbln-smi -j output: {0}")]
pub struct SmiError(String);

/// Parse `rbln-smi -j` output.
///
/// # Errors
/// [`SmiError`] naming what is malformed (bad JSON, a missing field, a non-numeric `npu`).
pub fn parse_smi_json(text: &str) -> Result<Vec<SmiDevice>, SmiError> {
    let doc: Doc = serde_json::from_str(text).map_err(|e| SmiError(e.to_string()))?;
    doc.devices
        .into_iter()
        .map(|d| {
            let npu = d
                .npu
                .trim()
                .parse()
                .map_err(|_| SmiError(format!("devices[].npu {:?} is not a number", d.npu)))?;
            let numa_node = d
                .pci
                .numa_node
                .as_deref()
                .and_then(|n| n.trim().parse().ok());
            Ok(SmiDevice {
                npu,
                name: d.name,
                bus_id: d.pci.bus_id,
                numa_node,
            })
        })
        .collect()
}

/// Where `rbln-smi` is looked for before `PATH` (as the vendor's Go library does).
pub const SMI_PATHS: &[&str] = &[
    "/usr/bin/rbln-smi",
    "/run/rbln/driver/usr/bin/rbln-smi",
    "/host/usr/bin/rbln-smi",
    "/host/driver/usr/bin/rbln-smi",
];

/// Run `rbln-smi -j` and parse it; `None` when the tool is not installed or fails.
pub fn query_smi() -> Option<Vec<SmiDevice>> {
    let bin = SMI_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("rbln-smi"));
    let out = std::process::Command::new(bin).arg("-j").output().ok()?;
    if !out.status.success() {
        return None;
    }
    parse_smi_json(&String::from_utf8_lossy(&out.stdout)).ok()
}

/// The NUMA node of PCI device `bus_id` under the sysfs tree at `root` (`/` normally):
/// `None` when the file is absent or says -1.
pub fn pci_numa_node(root: &Path, bus_id: &str) -> Option<u32> {
    let p = root
        .join("sys/bus/pci/devices")
        .join(bus_id)
        .join("numa_node");
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"KMD_version":"1.3.73","devices":[
      {"group_id":"0","npu":"0","name":"RBLN-CA22","sid":"x","uuid":"u0","device":"rbln0",
       "status":"normal","fw_ver":"1.0","pci":{"dev":"x","bus_id":"0000:3b:00.0",
       "numa_node":"0","link_speed":"16GT/s","link_width":"16"},"memory":{"used":"0","total":"16G"}},
      {"group_id":"0","npu":"1","name":"RBLN-CA22","pci":{"bus_id":"0000:af:00.0","numa_node":"-1"}}]}"#;

    #[test]
    fn parses_devices_and_numa() {
        let d = parse_smi_json(SAMPLE).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].npu, 0);
        assert_eq!(d[0].bus_id, "0000:3b:00.0");
        assert_eq!(d[0].numa_node, Some(0));
        assert_eq!(d[1].numa_node, None, "-1 means unknown");
    }

    #[test]
    fn malformed_documents_are_errors_naming_the_problem() {
        assert!(parse_smi_json("not json").is_err());
        let e = parse_smi_json(r#"{"devices":[{"npu":"x","pci":{"bus_id":"b"}}]}"#).unwrap_err();
        assert!(e.to_string().contains("devices[].npu"), "{e}");
        let e = parse_smi_json(r#"{"devices":[{"npu":"0"}]}"#).unwrap_err();
        assert!(e.to_string().contains("pci"), "{e}");
    }

    #[test]
    fn sysfs_numa_node() {
        let dir = std::env::temp_dir().join(format!("rbln-sysfs-{}", std::process::id()));
        let dev = dir.join("sys/bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(pci_numa_node(&dir, "0000:3b:00.0"), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(pci_numa_node(&dir, "0000:3b:00.0"), None);
        assert_eq!(pci_numa_node(&dir, "0000:00:00.0"), None);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
