//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`; not an API): each takes
//! arbitrary bytes and runs one family of decoders of bytes from the network, the way the
//! agent and the connector run them. A panic, an abort or unbounded memory is a finding;
//! errors are the expected answer to garbage.

use crate::agent::control::auth::Listen;
use crate::agent::control::msg::{Msg, Reader};
use crate::agent::metadata::AgentMetadata;
use crate::agent::notifs::Ordered;
use crate::agent::ClusterSecret;
use crate::connector::{ConnectorMetadata, Finished, KvLayout, KvTransferParams};
use crate::proto::frame::FrameDecoder;
use crate::proto::kvmsg::{self, Completion, KvMsg, PushCancel, PushCancelled, PushReg};
use crate::transport::notif::{Assembler, Header};

/// The side channel and the TCP data path: framed msgpack messages read the way the agent
/// reads them (data messages' raw bytes included), also cut into the chunks the first byte
/// says, and each message through the authentication state machine.
pub fn side_channel(data: &[u8]) {
    let mut r = Reader::new(std::io::Cursor::new(data));
    let secret = ClusterSecret::new(b"sixteen byte key".to_vec()).expect("long enough");
    let mut auth = Listen::start(Some(&secret));
    for _ in 0..4096 {
        let Ok(Some(m)) = r.next() else {
            break;
        };
        match &m {
            Msg::WriteData { len, .. } | Msg::ReadData { len, .. } if r.payload(*len).is_err() => {
                break
            }
            _ => {}
        }
        let _ = auth.take(Some(&secret), m);
    }
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let mut d = FrameDecoder::new(64 << 10);
    for chunk in rest.chunks(usize::from(cut).max(1)) {
        d.push(chunk);
        while let Ok(Some(f)) = d.next_frame() {
            let _ = rmp_serde::from_slice::<Msg>(&f);
        }
    }
}

/// Agent metadata: decoded and validated; what decodes re-encodes to the same value.
pub fn metadata(data: &[u8]) {
    if let Ok(m) = AgentMetadata::decode(data) {
        let again = m.encode().expect("valid metadata encodes");
        assert_eq!(AgentMetadata::decode(&again).as_ref(), Ok(&m));
    }
    // grant tokens travel in connector messages
    if let Ok(g) = crate::agent::Grant::decode(data) {
        assert_eq!(crate::agent::Grant::decode(&g.encode()).as_ref(), Ok(&g));
        let _ = g.covering(g.ranges[0].region, g.ranges[0].offset, u64::MAX);
    }
}

/// The verbs notification channel's frames (a length byte, then the frame) reassembled into
/// messages, and numbered notifications (the first 8 bytes of each message, its number)
/// put back in order, bounded.
pub fn notif(data: &[u8]) {
    let mut a = Assembler::default();
    let mut ordered = Ordered::default();
    let mut at = 0;
    while at < data.len() {
        let n = usize::from(data[at]);
        let f = &data[at + 1..(at + 1 + n).min(data.len())];
        at += 1 + n;
        let Ok(h) = Header::decode(f) else {
            continue;
        };
        if h.credit_only {
            continue;
        }
        match a.push(&h, &f[f.len().min(8)..]) {
            Ok(Some(msg)) => {
                let seq = msg
                    .get(..8)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                let _ = ordered.take(seq % 1024, msg);
            }
            Ok(None) => {}
            Err(_) => a = Assembler::default(),
        }
    }
}

/// The connector's messages: completions, heartbeats, push registrations and withdrawals,
/// and the scheduler's metadata for the workers.
pub fn kvmsg(data: &[u8]) {
    let _ = KvMsg::decode(data);
    let _ = kvmsg::decode_heartbeat(data);
    let _ = Completion::decode(data);
    let _ = PushReg::decode(data);
    let _ = PushCancel::decode(data);
    let _ = PushCancelled::decode(data);
    let _ = ConnectorMetadata::decode(data);
}

/// The host bounce's messages (notifications that start with its magic).
pub fn bounce(data: &[u8]) {
    let _ = crate::agent::bounce::wire::decode(data);
    let mut m = crate::agent::bounce::wire::MAGIC.to_vec();
    m.extend_from_slice(data);
    let _ = crate::agent::bounce::wire::decode(&m);
}

/// JSON from engines and operators: the first byte picks `kv_transfer_config`, the agent's
/// configuration, the KV layout (and its validation), transfer parameters, or a finished
/// list (the C ABI's and the Python package's JSON inputs).
pub fn json(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    match kind % 5 {
        0 => {
            let _ = crate::connector::config::KvTransferConfig::from_json(text);
        }
        1 => {
            let _ = crate::agent::AgentConfig::from_json(text);
        }
        2 => {
            if let Ok(l) = serde_json::from_str::<KvLayout>(text) {
                let _ = l.validate();
            }
        }
        3 => {
            let _ = KvTransferParams::from_json(text);
        }
        _ => {
            let _ = serde_json::from_str::<Finished>(text);
        }
    }
}

/// Seed inputs for each target (`fuzz/src/bin/seeds.rs` writes them to `fuzz/corpus/`):
/// real encodings of what each decoder reads, so the fuzzer starts inside the formats.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use crate::agent::control::msg::send;
    use crate::agent::{Agent, AgentConfig, BackendChoice, RemoteAccess};
    let mut out = Vec::new();
    let a = Agent::new(
        "seed-agent",
        AgentConfig {
            listen: "127.0.0.1:0".parse().expect("address"),
            backend: BackendChoice::Tcp,
            layers: vec!["model.layers.0".into()],
            ..AgentConfig::default()
        },
    )
    .expect("an agent for the seeds");
    a.register(
        4096,
        RemoteAccess::READ_WRITE,
        vec!["model.layers.0".into()],
    )
    .expect("a region");
    let mut meta = a.metadata();
    // fixed addresses: the seeds are the same on every run (they are committed)
    meta.side_channel = "10.0.0.1:5600".into();
    meta.tcp_data = Some("10.0.0.1:5600".into());
    for r in &mut meta.regions {
        r.addr = 0x7f00_0000_0000;
    }
    out.push(("metadata", meta.encode().expect("encodes")));
    let mut frames = Vec::new();
    for m in [
        Msg::GetMetadata,
        Msg::Attach {
            info: meta.handshake.clone(),
        },
        Msg::AuthHello { nonce: vec![1; 32] },
        Msg::AuthProof { proof: vec![2; 32] },
        Msg::WriteEnd {
            xfer: 7,
            notif: Some(b"done".to_vec()),
        },
        Msg::ReadReq {
            xfer: 7,
            idx: 0,
            region: 1,
            offset: 0,
            len: 64,
            grant: 0,
        },
        Msg::SeqNotif {
            seq: 3,
            bytes: b"n".to_vec(),
        },
        Msg::Ack { xfer: 7 },
        Msg::Fail {
            xfer: 8,
            message: "no".into(),
        },
    ] {
        let mut one = Vec::new();
        send(&mut one, &m).expect("encodes");
        out.push(("side_channel", one.clone()));
        frames.extend(one);
    }
    let mut data = Vec::new();
    send(
        &mut data,
        &Msg::WriteData {
            xfer: 9,
            region: 1,
            offset: 0,
            len: 8,
            grant: 0x5eed,
        },
    )
    .expect("encodes");
    data.extend_from_slice(b"12345678");
    frames.extend(&data);
    out.push(("side_channel", data));
    out.push(("side_channel", frames));
    let reg = PushReg {
        request_id: "cmpl-d-0".into(),
        engine_id: "decode-0".into(),
        host: "10.0.0.2".into(),
        port: 5600,
        tp_rank: 0,
        tp_size: 1,
        block_ids: vec![3, 4, 5],
        remote_engine_id: "prefill-0".into(),
        remote_request_id: "cmpl-p-0".into(),
        grant: None,
    };
    out.push(("kvmsg", reg.encode()));
    // fencing: a grant token, in a registration and in the pull messages
    let grant = crate::agent::Grant {
        id: 0x5eed,
        owner: "decode-0".into(),
        read: false,
        write: true,
        ranges: vec![crate::agent::GrantRange {
            region: 1,
            offset: 4096,
            len: 8192,
            rkeys: vec![0x11, 0x22],
        }],
    }
    .encode();
    out.push(("metadata", grant.clone()));
    let with_grant = PushReg {
        grant: Some(grant.clone()),
        ..reg
    };
    out.push(("kvmsg", with_grant.encode()));
    let ask = kvmsg::GrantReq {
        request_id: "cmpl-p-0".into(),
        host: "10.0.0.2".into(),
        port: 5600,
    };
    out.push(("kvmsg", ask.encode()));
    let given = kvmsg::GrantMsg {
        request_id: "cmpl-p-0".into(),
        token: grant,
        clock_us: None,
    };
    out.push(("kvmsg", given.encode()));
    let none = kvmsg::GrantNone {
        request_id: "cmpl-p-0".into(),
        reason: "lease over".into(),
        clock_us: None,
    };
    out.push(("kvmsg", none.encode()));
    out.push((
        "kvmsg",
        Completion {
            request_id: "cmpl-0".into(),
            tp_size: 2,
        }
        .encode(),
    ));
    out.push((
        "kvmsg",
        kvmsg::encode_heartbeat(&["cmpl-0".into(), "cmpl-1".into()]),
    ));
    out.push((
        "kvmsg",
        PushCancel {
            request_id: "cmpl-d-0".into(),
            engine_id: "decode-0".into(),
            host: "10.0.0.2".into(),
            port: 5600,
        }
        .encode(),
    ));
    out.push((
        "kvmsg",
        PushCancelled {
            request_id: "cmpl-d-0".into(),
            tp_size: 1,
        }
        .encode(),
    ));
    out.push(("kvmsg", ConnectorMetadata::default().encode()));
    {
        use crate::agent::bounce::wire::{Part, Tag, Wire};
        let tag = Tag::read(5, 1);
        for w in [
            Wire::Hello {
                addr: "10.0.0.1:5600".into(),
                in_stage: 2,
                slots: 4,
                slot_size: 1 << 20,
                reply: true,
            },
            Wire::Chunk {
                tag,
                slot: 1,
                parts: vec![Part {
                    region: 1,
                    offset: 0,
                    len: 4096,
                }],
                total: Some(1),
                notif: Some(b"done".to_vec()),
            },
            Wire::Ack {
                tag,
                slot: 1,
                error: None,
            },
        ] {
            out.push(("bounce", w.encode()));
        }
    }
    // notification frames: a length byte, then the frame (header + payload)
    let mut nf = Vec::new();
    for (first, last, payload) in [(true, false, &b"01234567ab"[..]), (false, true, b"cd")] {
        let h = Header {
            first,
            last,
            credits: 1,
            credit_only: false,
        };
        let f = [&h.encode()[..], payload].concat();
        nf.push(f.len() as u8);
        nf.extend(f);
    }
    out.push(("notif", nf));
    for (kind, text) in [
        (
            0u8,
            r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_producer","kv_buffer_device":"rbln","engine_id":"p","kv_connector_extra_config":{"kv_lease_duration":30,"chunk_mode":true,"chunk_tokens":256,"cluster_secret":"0123456789abcdef"}}"#,
        ),
        (
            1,
            r#"{"listen":"0.0.0.0:5600","backend":"auto","devices":["mlx5_0"],"numa":1,"model":"m","block_size":16}"#,
        ),
        (
            2,
            r#"{"layers":["l0","l1"],"num_blocks":64,"block_bytes":4096,"planes":2,"block_size":16,"kv_heads":8,"sliding_windows":{"l1":128}}"#,
        ),
        (
            3,
            r#"{"do_remote_prefill":true,"remote_engine_id":"p","remote_host":"10.0.0.1","remote_port":5600,"remote_block_ids":[1,2],"remote_request_id":"r","tp_size":1}"#,
        ),
        (
            4,
            r#"{"sending":["a"],"recving":["b"],"failed_recving":[]}"#,
        ),
    ] {
        out.push(("json", [&[kind][..], text.as_bytes()].concat()));
    }
    // metadata sent to a listener (NIXL's sendLocalMD / invalidateLocalMD), last: the seeds
    // before keep their numbers
    for m in [
        Msg::PutMetadata {
            metadata: meta.encode().expect("encodes"),
            partial: true,
        },
        Msg::Forget {
            name: "initiator".into(),
        },
        Msg::Taken {
            name: "initiator".into(),
        },
    ] {
        let mut one = Vec::new();
        send(&mut one, &m).expect("encodes");
        out.push(("side_channel", one));
    }
    // multi-turn reuse (bidirectional_kv_xfer), appended: grant answers with the keeper's
    // clock, and a next turn's parameters naming D's kept blocks
    let given = kvmsg::GrantMsg {
        request_id: "turn1-d".into(),
        token: b"token".to_vec(),
        clock_us: Some(1_234_567_890),
    };
    out.push(("kvmsg", given.encode()));
    let none = kvmsg::GrantNone {
        request_id: "turn1-d".into(),
        reason: "its blocks were given back (lease over)".into(),
        clock_us: Some(-5),
    };
    out.push(("kvmsg", none.encode()));
    let turn = r#"{"do_remote_decode":true,"remote_engine_id":"d","remote_host":"10.0.0.2","remote_port":5601,"remote_block_ids":[3,4,5],"remote_request_id":"turn1-d","tp_size":1,"remote_num_tokens":40,"remote_blocks_expiry_time":1234.5,"_remote_blocks_processed":false}"#;
    out.push(("json", [&[3u8][..], turn.as_bytes()].concat()));
    out
}
