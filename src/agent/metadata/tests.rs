use proptest::prelude::*;

use super::*;
use crate::proto::handshake::CompatHash;

fn sample() -> AgentMetadata {
    AgentMetadata {
        version: VERSION,
        handshake: HandshakeInfo {
            agent: "prefill-0".into(),
            compat_hash: CompatHash(0x3fa2_6e55_90ce_afc2),
            kv_layout: "HND".into(),
            block_size: 16,
            layers: vec!["model.layers.0".into()],
            requires_layers: true,
            physical_per_logical: 1,
        },
        backend: BackendKind::Verbs,
        side_channel: "10.0.0.1:18515".into(),
        rails: vec![RailAddr {
            name: "mlx5_0:1".into(),
            gid: std::net::Ipv4Addr::new(10, 0, 0, 1)
                .to_ipv6_mapped()
                .octets(),
            lid: 0,
            mtu: 4096,
            ipv4: Some("10.0.0.1/24".into()),
        }],
        tcp_data: None,
        regions: vec![RegionMeta {
            id: 1,
            kind: MemKind::Host,
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            rkeys: vec![0x1234],
            remote_read: true,
            remote_write: false,
            layers: vec!["model.layers.0".into()],
            device: -1,
            layer_offsets: vec![],
            layer_len: 0,
            fenced: false,
        }],
    }
}

#[test]
fn round_trip() {
    let m = sample();
    assert_eq!(AgentMetadata::decode(&m.encode().unwrap()).unwrap(), m);
}

/// The encoding is the wire format between builds: a change must be deliberate.
#[test]
fn golden_bytes() {
    let hex: String = sample()
        .encode()
        .unwrap()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(hex, include_str!("golden_metadata.hex").trim());
}

/// Metadata from a build before the handshake told the physical blocks per logical one
/// still loads, as a ratio of 1.
#[test]
fn metadata_without_the_block_ratio_reads_as_one() {
    let hex = include_str!("golden_metadata_no_ratio.hex").trim();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let m = AgentMetadata::decode(&bytes).unwrap();
    assert_eq!(m.handshake.physical_per_logical, 1);
    assert_eq!(m, sample());
}

#[test]
fn validation_names_the_problem() {
    let mut m = sample();
    m.version = 3;
    assert_eq!(
        AgentMetadata::decode(&m.encode().unwrap())
            .unwrap_err()
            .to_string(),
        "agent metadata version 3, this build reads version 2"
    );
    let mut m = sample();
    m.regions[0].rkeys.clear();
    assert_eq!(
        AgentMetadata::decode(&m.encode().unwrap())
            .unwrap_err()
            .to_string(),
        "invalid agent metadata from \"prefill-0\": region #0 (id 1): 0 rkeys for 1 rails"
    );
    let mut m = sample();
    m.regions.push(m.regions[0].clone());
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .ends_with("region #1: duplicate id 1"));
    let mut m = sample();
    m.regions[0].addr = u64::MAX;
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .contains("is empty or overflows"));
    let mut m = sample();
    m.handshake.agent.clear();
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .contains("agent name must be 1..=256 bytes, is 0"));
    let mut m = sample();
    m.backend = BackendKind::Tcp;
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .ends_with("tcp backend without a data address"));
    let mut m = sample();
    m.rails.clear();
    assert!(m
        .validate()
        .unwrap_err()
        .to_string()
        .ends_with("verbs backend without rails"));
}

#[test]
fn garbage_and_oversize() {
    assert!(matches!(
        AgentMetadata::decode(b"\xc1garbage"),
        Err(MetadataError::Decode(_))
    ));
    assert!(matches!(
        AgentMetadata::decode(&[]),
        Err(MetadataError::Decode(_))
    ));
    let big = vec![0u8; MAX_BYTES + 1];
    assert_eq!(
        AgentMetadata::decode(&big),
        Err(MetadataError::TooLarge(MAX_BYTES + 1))
    );
    // a map announcing 2^32-1 entries must fail on the missing bytes, not allocate them
    assert!(AgentMetadata::decode(&[0xdf, 0xff, 0xff, 0xff, 0xff]).is_err());
    // a GID of the wrong length
    let mut bytes = sample().encode().unwrap();
    let at = bytes
        .windows(2)
        .position(|w| w == [0xc4, 16])
        .expect("the GID as bin8");
    bytes[at + 1] = 15;
    assert!(AgentMetadata::decode(&bytes).is_err());
}

proptest! {
    #[test]
    fn mutated_metadata_never_panics(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = sample().encode().unwrap();
        for (i, v) in flips {
            let k = i.index(bytes.len());
            bytes[k] = v;
        }
        let _ = AgentMetadata::decode(&bytes);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = AgentMetadata::decode(&bytes);
    }
}
