//! `link_down_exit_s` on a producer worker (SPEC §2): in the lab its real rxe links are
//! taken down with `ip link`; while one link is up nothing happens, once every link has
//! been down for the configured time the action runs once (by default it exits the
//! process; here the test's action records the reason). On TCP there are no links: no
//! monitor runs. A consumer cannot set the key at all (config tests).

mod lab;

use std::sync::{mpsc, Arc};
use std::time::Duration;

use kvrail::agent::Agent;
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::{agent_config, Worker};
use kvrail::rails::SysfsRoot;

fn producer(exit_s: u64) -> Worker {
    let json = format!(
        r#"{{"kv_connector":"KvrailPullConnector","kv_role":"kv_producer","kv_buffer_device":"rbln",
            "kv_connector_extra_config":{{"link_down_exit_s":{exit_s}}}}}"#
    );
    let cfg = KvTransferConfig::from_json(&json).unwrap();
    let l = lab::kv_layout(1, 4, 1024, 1);
    let ac = agent_config(&cfg, &l, lab::agent_config(true));
    let agent = Arc::new(Agent::new("prefill-links", ac).unwrap());
    Worker::new(agent, cfg, l, 1).unwrap()
}

#[test]
fn every_link_down_for_the_set_time_runs_the_exit_once() {
    let mut w = producer(2);
    let Some(lab) = lab::Topology::from_env() else {
        assert!(w.link_monitor().is_none(), "TCP: no links to watch");
        return;
    };
    let (tx, rx) = mpsc::channel();
    w.watch_links(
        SysfsRoot::system(),
        Duration::from_millis(100),
        Box::new(move |why| {
            let _ = tx.send(why.to_owned());
        }),
    );
    assert!(w.link_monitor().is_some());
    // every rail but the last down: the instance keeps running
    let (last, rest) = lab.a_netdevs.split_last().unwrap();
    let restore = || {
        for nd in &lab.a_netdevs {
            let _ = lab::ip_link(nd, "up");
        }
        for d in &lab.a_devs {
            let _ = lab::wait_port(d, "ACTIVE");
        }
    };
    for nd in rest {
        lab::ip_link(nd, "down").unwrap();
    }
    let early = rx.recv_timeout(Duration::from_secs(4));
    lab::ip_link(last, "down").unwrap();
    let fired = rx.recv_timeout(Duration::from_secs(60));
    let again = rx.recv_timeout(Duration::from_millis(500));
    restore();
    assert!(early.is_err(), "fired with a link up: {early:?}");
    let why = fired.expect("every link down for 2 s: the exit runs");
    for d in &lab.a_devs {
        assert!(why.contains(&format!("{d}:1")), "{why}");
    }
    assert!(again.is_err(), "once");
    assert!(w.link_monitor().unwrap().fired());
}

#[test]
fn zero_watches_nothing() {
    let w = producer(0);
    assert!(w.link_monitor().is_none());
}
