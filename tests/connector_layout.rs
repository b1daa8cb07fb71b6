//! The KV layout a connector worker found in its engine's cache travels in the handshake:
//! a peer whose block bytes are in another order (or another number of planes) is refused,
//! both layouts named, before any byte moves; the same layout with another TP's heads per
//! block pairs.

use std::sync::Arc;

use kvrail::agent::{Agent, AgentConfig, BackendChoice};
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::{agent_config, BlockOrder, KvCaches, KvLayout, Worker};

fn layout(inner: BlockOrder, planes: u64, kv_heads: u64) -> KvLayout {
    KvLayout {
        layers: vec!["model.layers.0.attn".into()],
        num_blocks: 4,
        block_bytes: 2048 * kv_heads,
        planes,
        block_size: 16,
        kv_heads,
        sliding_windows: Default::default(),
        physical_per_logical: 1,
        block_stride: 0,
        inner,
    }
}

fn worker(name: &str, role: &str, l: KvLayout) -> Worker {
    let cfg = KvTransferConfig::from_json(&format!(
        r#"{{"kv_connector":"KvrailPullConnector","kv_role":"{role}","kv_buffer_device":"cpu"}}"#
    ))
    .unwrap();
    let base = AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend: BackendChoice::Tcp,
        ..AgentConfig::default()
    };
    let a = Agent::new(name, agent_config(&cfg, &l, base)).unwrap();
    Worker::with_caches(Arc::new(a), cfg, l, (0, 1), KvCaches::Allocate).unwrap()
}

#[test]
fn a_peer_with_another_block_order_or_planes_is_refused_naming_both() {
    let p = worker("p", "kv_producer", layout(BlockOrder::Hnd, 2, 2));
    let addr = p.agent().side_channel_addr().to_string();
    for (l, theirs) in [
        (layout(BlockOrder::Nhd, 2, 2), "NHD/2-plane"),
        (layout(BlockOrder::Hnd, 1, 2), "HND/1-plane"),
    ] {
        let d = worker(&format!("d-{theirs}"), "kv_consumer", l);
        let e = d
            .agent()
            .load_remote(addr.parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KV layout mismatch") && e.contains(theirs) && e.contains("HND/2-plane"),
            "{e}"
        );
    }
    // another TP size (one head per block here, two at P): the same layout
    let d = worker("d-tp", "kv_consumer", layout(BlockOrder::Hnd, 2, 1));
    assert_eq!(d.agent().load_remote(addr.parse().unwrap()).unwrap(), "p");
}
