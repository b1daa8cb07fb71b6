//! Secure by default (protected mode): an agent with no `cluster_secret` serves only peers on
//! loopback. A peer that reaches it over another address is refused with a message naming
//! both ways out, counted (`kvrail_protected_refusals_total`); the same agent with
//! `insecure: true`, or both agents with a secret, serve it, byte-exact. On TCP on any host
//! with a non-loopback address of its own (checked local by binding to it: a test never
//! sends beyond this machine), and on verbs in the lab over host A's rail address.

use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};

use kvrail::agent::{Agent, AgentConfig, ClusterSecret, RemoteAccess, XferOp};

use super::{cfg, cfg_no_secret, lab, pattern, post_wait_release, Host};

/// A non-loopback address of this machine: the lab's host A rail address, else the one the
/// kernel would send from. Proven local by binding a listener to it (binding fails with
/// EADDRNOTAVAIL for an address that is not on one of this machine's interfaces). None:
/// this machine has none (the test says it is skipped).
fn own_address() -> Option<IpAddr> {
    let ip = match lab::Topology::from_env() {
        Some(t) => IpAddr::V4(*t.a_ips.first()?),
        None => {
            // connect() on UDP sends nothing; it picks the source address a route would use
            let u = UdpSocket::bind("0.0.0.0:0").ok()?;
            u.connect("192.0.2.1:9").ok()?;
            u.local_addr().ok()?.ip()
        }
    };
    if ip.is_loopback() || ip.is_unspecified() {
        return None;
    }
    TcpListener::bind(SocketAddr::new(ip, 0)).ok()?;
    Some(ip)
}

fn on(ip: IpAddr, host: Host, secret: Option<&str>, insecure: bool) -> AgentConfig {
    AgentConfig {
        listen: SocketAddr::new(ip, 0),
        side_channel_host: ip,
        cluster_secret: secret.map(|k| ClusterSecret::new(k).unwrap()),
        insecure,
        ..cfg(host)
    }
}

/// D reads P's region over `ip`; the bytes that land are P's.
fn read_all(p: &Agent, d: &Agent, len: usize, seed: u64) {
    let src = p.register(len, RemoteAccess::READ, vec![]).unwrap();
    let data = pattern(seed, len);
    p.write_region(src, 0, &data).unwrap();
    let peer = d.load_remote(p.side_channel_addr()).unwrap();
    let dst = d.register(len, RemoteAccess::NONE, vec![]).unwrap();
    post_wait_release(d, XferOp::Read, (dst, &peer, src), len as u64, None);
    let mut got = vec![0u8; len];
    d.read_region(dst, 0, &mut got).unwrap();
    assert!(got == data, "the bytes differ");
}

#[test]
fn without_a_secret_only_loopback_peers_are_served() {
    let Some(ip) = own_address() else {
        println!("SKIPPED: this machine has no non-loopback address of its own");
        return;
    };
    // P and D on `ip`, neither with a secret: P refuses D, and says how to open up
    let p = Agent::new("protected-p", on(ip, Host::B, None, false)).unwrap();
    let d = Agent::new("protected-d", on(ip, Host::A, None, false)).unwrap();
    for n in 1..=2u64 {
        let e = d
            .load_remote(p.side_channel_addr())
            .unwrap_err()
            .to_string();
        assert!(e.contains("serves only peers on loopback"), "{e}");
        assert!(
            e.contains("cluster_secret")
                && e.contains("insecure: true")
                && e.contains("KVRAIL_INSECURE=1"),
            "{e}"
        );
        assert_eq!(p.protected_refusals(), n);
    }
    assert!(d.peers().is_empty());
    let m = p.metrics();
    assert_eq!(
        m.value(
            "kvrail_protected_refusals_total",
            &[("agent", "protected-p")]
        ),
        Some(2.0),
        "{}",
        m.render_prometheus()
    );
    // the same from loopback is served (the agent listens on every address)
    let mut c = on(ip, Host::B, None, false);
    c.listen = SocketAddr::new([0, 0, 0, 0].into(), 0);
    c.side_channel_host = [127, 0, 0, 1].into();
    let lp = Agent::new("protected-lo", c).unwrap();
    let ld = Agent::new("protected-lo-d", cfg_no_secret(Host::A)).unwrap();
    read_all(&lp, &ld, 1 << 20, 31);
    assert_eq!(lp.protected_refusals(), 0);
    // insecure: served as before, the operator's choice
    let ip_ = Agent::new("insecure-p", on(ip, Host::B, None, true)).unwrap();
    read_all(&ip_, &d, 1 << 20, 32);
    assert_eq!(ip_.protected_refusals(), 0);
    // a secret on both: served
    const K: &str = "the protected suite's secret";
    let sp = Agent::new("secret-p", on(ip, Host::B, Some(K), false)).unwrap();
    let sd = Agent::new("secret-d", on(ip, Host::A, Some(K), false)).unwrap();
    read_all(&sp, &sd, 1 << 20, 33);
    assert_eq!(sp.protected_refusals() + sp.auth_refusals(), 0);
}
