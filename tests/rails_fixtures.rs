//! Rail discovery, verdicts and selection on the fixture trees of tests/fixtures/sysfs/
//! (made by tests/fixtures/make_sysfs.py). Every verdict reason and the error text are
//! asserted exactly.

use std::path::PathBuf;

use kvrail::rails::{
    discover, judge_all, pci_numa_node, select, AddrSource, HostView, RailError, Reason, SysfsRoot,
    Verdict,
};

fn root(name: &str) -> SysfsRoot {
    SysfsRoot::new(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/sysfs")
            .join(name),
    )
}

fn host(name: &str) -> HostView {
    let r = root(name);
    discover(&r, &AddrSource::for_root(&r)).unwrap()
}

/// `dev:port => summary` for every port.
fn summaries(v: &[Verdict]) -> Vec<String> {
    v.iter()
        .map(|v| format!("{} => {}", v.port.name(), v.summary()))
        .collect()
}

fn selected(h: &HostView, numa: i32) -> Vec<String> {
    select(h, numa)
        .unwrap()
        .iter()
        .map(|r| format!("{} GID[{}] {}", r.port.name(), r.gid.index, r.gid.gid))
        .collect()
}

#[test]
fn one_nic_host() {
    let h = host("one-nic");
    assert_eq!(h.default_route_ifaces, ["eno1"]);
    let p = &h.ports[0];
    assert_eq!(
        (p.device.as_str(), p.port, p.state.as_str()),
        ("mlx5_0", 1, "ACTIVE")
    );
    assert_eq!(p.netdev.as_deref(), Some("ens1f0"));
    assert_eq!(p.active_mtu, Some(4096));
    assert_eq!(p.numa_node, Some(0));
    assert_eq!(
        p.ipv4.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        ["10.0.0.1/24"]
    );
    assert_eq!(selected(&h, 0), ["mlx5_0:1 GID[3] ::ffff:10.0.0.1"]);
    let v = judge_all(&h, 0);
    assert_eq!(
        v[0].gid.as_ref().unwrap().reason,
        "GID[3] ::ffff:10.0.0.1 (RoCE v2, IPv4)"
    );
    assert_eq!(pci_numa_node(&root("one-nic"), "0000:17:00.0"), Ok(0));
    let e = pci_numa_node(&root("one-nic"), "0000:99:00.0").unwrap_err();
    assert!(
        matches!(&e, kvrail::rails::NumaNodeError::Unreadable(p)
            if p.ends_with("sys/bus/pci/devices/0000:99:00.0/numa_node")),
        "{e}"
    );
    let e = e.to_string();
    assert!(
        e.starts_with("cannot read ") && e.ends_with("sys/bus/pci/devices/0000:99:00.0/numa_node"),
        "{e}"
    );
    // an accelerator on node 1 has no NIC on its node
    let e = select(&h, 1).unwrap_err().to_string();
    assert_eq!(
        e,
        "no usable data-plane RoCE NIC on numa=1; checked 1 port(s):\n  mlx5_0:1: on NUMA node 0, not the accelerator's node 1"
    );
}

#[test]
fn two_socket_host_with_eight_nics_and_a_management_nic() {
    let h = host("two-socket-8nic");
    assert_eq!(h.ports.len(), 9);
    let accel0 = pci_numa_node(&root("two-socket-8nic"), "0000:17:00.0").unwrap();
    let accel1 = pci_numa_node(&root("two-socket-8nic"), "0000:b1:00.0").unwrap();
    assert_eq!((accel0, accel1), (0, 1));
    assert_eq!(
        selected(&h, accel0),
        [
            "mlx5_0:1 GID[3] ::ffff:10.0.0.1",
            "mlx5_1:1 GID[3] ::ffff:10.1.0.1",
            "mlx5_2:1 GID[3] ::ffff:10.2.0.1",
            "mlx5_3:1 GID[3] ::ffff:10.3.0.1"
        ]
    );
    assert_eq!(
        selected(&h, accel1),
        [
            "mlx5_4:1 GID[3] ::ffff:10.4.0.1",
            "mlx5_5:1 GID[3] ::ffff:10.5.0.1",
            "mlx5_6:1 GID[3] ::ffff:10.6.0.1",
            "mlx5_7:1 GID[3] ::ffff:10.7.0.1"
        ]
    );
    let v = judge_all(&h, 0);
    let mgmt = v.iter().find(|v| v.port.device == "mlx5_8").unwrap();
    assert_eq!(
        mgmt.reasons,
        [Reason::DefaultRoute {
            netdev: "eno1".into()
        }]
    );
    assert_eq!(mgmt.port.active_mtu, Some(1024));
    let far = v.iter().find(|v| v.port.device == "mlx5_5").unwrap();
    assert_eq!(
        far.reasons,
        [Reason::NumaMismatch {
            device_numa: 1,
            wanted: 0
        }]
    );
    // on node 1 the management NIC fails twice
    let v1 = judge_all(&h, 1);
    assert_eq!(
        summaries(&v1).last().unwrap(),
        "mlx5_8:1 => on NUMA node 0, not the accelerator's node 1; netdev eno1 carries the default route (management interface, not data plane)"
    );
    // -1 (no accelerator node known) takes all eight data-plane NICs, never the management one
    assert_eq!(select(&h, -1).unwrap().len(), 8);
}

#[test]
fn a_port_that_is_down() {
    let h = host("port-down");
    assert_eq!(
        summaries(&judge_all(&h, 0)),
        ["mlx5_0:1 => usable", "mlx5_1:1 => port is DOWN, not ACTIVE"]
    );
    assert_eq!(selected(&h, 0), ["mlx5_0:1 GID[3] ::ffff:10.0.0.1"]);
    let down = &judge_all(&h, 0)[1];
    assert_eq!(
        down.reasons[0].check_command(&down.port),
        "rdma link show mlx5_1/1   # or: ibv_devinfo -d mlx5_1"
    );
}

#[test]
fn a_netdev_without_ipv4_and_a_port_without_netdev() {
    let h = host("no-ipv4");
    let v = judge_all(&h, 0);
    assert_eq!(
        v[0].reasons,
        [
            Reason::NoIpv4 { netdev: "ens1f0".into() },
            Reason::NoGid {
                detail: "no RoCEv2 GID with an IPv4 address (table: [0] fe80::ff:fe00:215 RoCE v1, [1] fe80::ff:fe00:215 RoCE v2, \
                         [2] 2001:db8:: RoCE v1, [3] 2001:db8:: RoCE v2); give the netdev an IPv4 address"
                    .into()
            }
        ]
    );
    assert_eq!(
        v[0].reasons[0].check_command(&v[0].port),
        "ip -4 addr show dev ens1f0"
    );
    assert_eq!(v[1].reasons[0], Reason::NoNetdev);
    let e = select(&h, 0).unwrap_err();
    let RailError::NoUsableNic { numa, verdicts, .. } = &e else {
        panic!()
    };
    assert_eq!((*numa, verdicts.len()), (0, 2));
    assert!(e.to_string().starts_with("no usable data-plane RoCE NIC on numa=0; checked 2 port(s):\n  mlx5_0:1: netdev ens1f0 has no IPv4 address; no RoCEv2 GID"), "{e}");
}

#[test]
fn infiniband_only_host() {
    let h = host("ib-only");
    let v = judge_all(&h, 1);
    assert_eq!(
        summaries(&v),
        [
            "mlx5_0:1 => usable",
            "qib0:1 => link layer \"Unknown\" is neither Ethernet nor InfiniBand"
        ]
    );
    assert_eq!(
        v[0].notes,
        ["InfiniBand: addressed by LID/GID, no IPv4 needed"]
    );
    assert_eq!(v[0].port.netdev, None);
    assert_eq!(v[0].gid.as_ref().unwrap().index, 0);
    assert_eq!(selected(&h, 1), ["mlx5_0:1 GID[0] fe80::2:c903:a:1b2c"]);
}

#[test]
fn a_host_with_no_rdma() {
    let h = host("no-rdma");
    assert!(h.ports.is_empty());
    let e = select(&h, 0).unwrap_err().to_string();
    assert!(
        e.starts_with("no usable data-plane RoCE NIC on numa=0; no RDMA devices under "),
        "{e}"
    );
    assert!(e.ends_with("no-rdma/sys/class/infiniband"), "{e}");
}

#[test]
fn soft_roce_without_numa_node_matches_any_node() {
    let h = host("soft-roce");
    assert!(
        h.default_route_ifaces.is_empty(),
        "the lab has no default route"
    );
    for numa in [0, 1, -1] {
        assert_eq!(
            selected(&h, numa),
            [
                "rxeA0:1 GID[1] ::ffff:198.18.0.1",
                "rxeA1:1 GID[1] ::ffff:198.18.1.1",
                "rxeB0:1 GID[1] ::ffff:198.18.0.2",
                "rxeB1:1 GID[1] ::ffff:198.18.1.2"
            ]
        );
    }
    let v = &judge_all(&h, 0)[0];
    assert_eq!(
        v.notes,
        ["no device/numa_node (a software device on vethA0): matches any NUMA node"]
    );
    assert_eq!(v.port.netdev.as_deref(), Some("vethA0"));
}

#[test]
fn a_missing_root_is_a_host_without_rdma() {
    let r = SysfsRoot::new("/nonexistent/kvrail-root");
    let h = discover(&r, &AddrSource::for_root(&r)).unwrap();
    assert!(h.ports.is_empty());
}

/// Discovery that reads only some ports' GID tables (an agent given `devices`): those ports
/// exactly as a full discovery sees them, every other port listed with no GIDs.
#[test]
fn gid_tables_only_of_the_named_ports() {
    let r = root("two-socket-8nic");
    let full = host("two-socket-8nic");
    let some = kvrail::rails::discover_gids_of(&r, &AddrSource::for_root(&r), |dev, port| {
        (dev, port) == ("mlx5_2", 1) || dev == "mlx5_5"
    })
    .unwrap();
    assert_eq!(some.ports.len(), full.ports.len());
    for (s, f) in some.ports.iter().zip(&full.ports) {
        if ["mlx5_2", "mlx5_5"].contains(&s.device.as_str()) {
            assert_eq!(s, f);
            assert!(!s.gids.is_empty(), "{}", s.name());
        } else {
            assert!(s.gids.is_empty(), "{}", s.name());
            assert_eq!((&s.device, s.port, &s.state), (&f.device, f.port, &f.state));
        }
    }
    assert_eq!(
        selected(&some, -1),
        [
            "mlx5_2:1 GID[3] ::ffff:10.2.0.1",
            "mlx5_5:1 GID[3] ::ffff:10.5.0.1"
        ]
    );
    let all = kvrail::rails::discover_gids_of(&r, &AddrSource::for_root(&r), |_, _| true);
    assert_eq!(all.unwrap(), full);
}

/// RoCE v2 off on the NIC: the netdev has its address, the GID table offers only RoCE v1.
/// The verdict says so, not "give the netdev an IPv4 address" (which it has).
#[test]
fn a_port_whose_gid_table_offers_only_roce_v1() {
    let h = host("roce-v1-only");
    let v = judge_all(&h, 0);
    assert!(!v[0].usable());
    assert_eq!(v[0].reasons.len(), 1, "{:?}", v[0].reasons);
    let s = v[0].summary();
    assert!(
        s.starts_with("no RoCE v2 GID (the netdev's address is there; the port's GID table offers only RoCE v1: ")
            && s.contains("[1] ::ffff:10.0.0.1 RoCE v1")
            && s.ends_with("); enable RoCE v2 on the NIC"),
        "{s}"
    );
    assert!(!s.contains("give the netdev an IPv4 address"), "{s}");
    assert!(v[0].reasons[0]
        .check_command(&v[0].port)
        .contains("gid_attrs/types"));
}

/// A port at the netdev's default MTU (1500: active MTU 1024) is usable, and says it is
/// slow; one at 9000 (4096) says nothing of its MTU.
#[test]
fn a_port_below_mtu_4096_is_usable_and_says_so() {
    let h = host("low-mtu");
    assert_eq!(h.ports[0].active_mtu, Some(1024));
    let v = judge_all(&h, 0);
    assert!(v[0].usable(), "{}", v[0].summary());
    assert_eq!(v[0].summary(), "usable, low MTU (expect lower bandwidth)");
    assert!(
        v[0].notes.iter().any(|n| {
            n == "low MTU: active MTU 1024, from netdev ens1f0's MTU; RoCE carries 4096 where the \
                fabric takes jumbo frames (ip link set dev ens1f0 mtu 9000): expect lower bandwidth"
        }),
        "{:?}",
        v[0].notes
    );
    let ok = judge_all(&host("one-nic"), 0);
    assert!(
        !ok[0].notes.iter().any(|n| n.contains("MTU")),
        "{:?}",
        ok[0].notes
    );
}
