//! The connector's rail choice follows the accelerator (tier 1, on the fixture trees of
//! tests/fixtures/sysfs/): an NPU on NUMA node 1 (its node from `rbln-smi -j`'s bus id and
//! sysfs) makes the agent use only node-1 NICs; with no usable NIC on that node a
//! verbs-only agent fails at start with `no usable data-plane RoCE NIC on numa=1`, and
//! `auto` falls back to TCP.

use std::path::PathBuf;

use kvrail::agent::metadata::BackendKind;
use kvrail::agent::{Agent, AgentConfig, BackendChoice};
use kvrail::connector::placement::{on_accelerator, rails};
use rbln_sys::smi::parse_smi_json;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sysfs")
        .join(name)
}

/// What `rbln-smi -j` prints for two NPUs at the fixtures' accelerator bus ids.
const SMI: &str = r#"{"devices":[
    {"npu":"0","name":"RBLN-CA22","pci":{"bus_id":"0000:17:00.0","numa_node":"-1"}},
    {"npu":"1","name":"RBLN-CA22","pci":{"bus_id":"0000:b1:00.0","numa_node":"-1"}}]}"#;

fn placed(tree: &str, npu: i32, backend: BackendChoice) -> AgentConfig {
    let base = AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend,
        sysfs_root: Some(fixture(tree)),
        ..AgentConfig::default()
    };
    on_accelerator(base, npu, None, Some(parse_smi_json(SMI).unwrap()))
}

#[test]
fn an_npu_on_node_1_gets_only_node_1_nics() {
    let c = placed("two-socket-8nic", 1, BackendChoice::Verbs);
    assert_eq!(c.numa, 1, "from rbln-smi's bus id and sysfs numa_node");
    assert_eq!(
        rails(&c).unwrap(),
        ["mlx5_4:1", "mlx5_5:1", "mlx5_6:1", "mlx5_7:1"]
    );
    let c = placed("two-socket-8nic", 0, BackendChoice::Verbs);
    assert_eq!(c.numa, 0);
    assert_eq!(
        rails(&c).unwrap(),
        ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"]
    );
    // unplaced, the agent would use both sockets' NICs
    let mut c = placed("two-socket-8nic", 1, BackendChoice::Verbs);
    c.numa = -1;
    assert_eq!(rails(&c).unwrap().len(), 8);
}

#[test]
fn verbs_only_with_no_nic_on_the_npus_node_fails_at_start() {
    let c = placed("npu-far", 1, BackendChoice::Verbs);
    assert_eq!(c.numa, 1);
    let e = Agent::new("prefill-0", c).unwrap_err().to_string();
    assert!(
        e.starts_with("backend verbs: no usable data-plane RoCE NIC on numa=1"),
        "{e}"
    );
    assert!(
        e.contains("mlx5_0"),
        "the verdict names the NIC it saw: {e}"
    );
    // auto takes TCP (and warns)
    let a = Agent::new("prefill-0", placed("npu-far", 1, BackendChoice::Auto)).unwrap();
    assert_eq!(a.metadata().backend, BackendKind::Tcp);
}

#[test]
fn a_host_without_rdma_is_not_a_verbs_failure_for_auto() {
    let c = placed("no-rdma", 0, BackendChoice::Verbs);
    let e = Agent::new("x", c).unwrap_err().to_string();
    assert!(e.contains("no RDMA device"), "{e}");
    let a = Agent::new("x", placed("no-rdma", 0, BackendChoice::Auto)).unwrap();
    assert_eq!(a.metadata().backend, BackendKind::Tcp);
}

/// An agent given `devices` reads only their GID tables; the rails and every refusal are
/// what the full discovery gives: named usable ports; a named port that is not usable (the
/// management NIC, a NIC on the wrong node) or not there is refused naming the devices.
#[test]
fn configured_devices_get_the_rails_and_refusals_of_a_full_discovery() {
    let with = |devices: &[&str], numa: i32| {
        let mut c = placed("two-socket-8nic", 0, BackendChoice::Verbs);
        c.numa = numa;
        c.devices = devices.iter().map(|d| d.to_string()).collect();
        rails(&c)
    };
    assert_eq!(
        with(&["mlx5_5", "mlx5_2:1"], -1).unwrap(),
        ["mlx5_2:1", "mlx5_5:1"]
    );
    assert_eq!(with(&["mlx5_1"], 0).unwrap(), ["mlx5_1:1"]);
    for (devices, numa) in [(&["mlx5_8"][..], -1), (&["mlx5_5"], 0), (&["mlx5_99"], -1)] {
        let e = with(devices, numa).unwrap_err();
        assert!(
            e.contains(&format!("none of the configured devices {devices:?}")),
            "{devices:?} on node {numa}: {e}"
        );
    }
}
