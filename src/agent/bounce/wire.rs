//! The host-bounce protocol's messages. They travel as agent notifications, each starting
//! with [`MAGIC`] followed by a msgpack body; everything else is the engine's own
//! notification and is passed through untouched.

use serde::{Deserialize, Serialize};

/// First bytes of every bounce message.
pub(crate) const MAGIC: &[u8; 6] = b"\xffKVRB1";

/// Which transfer a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct Tag {
    /// The transfer id on the side that created it.
    pub(crate) xid: u64,
    /// True: a READ, so `xid` is the receiver's (the initiator's); false: a WRITE, so `xid`
    /// is the sender's.
    pub(crate) read: bool,
    /// Which post of the transfer: chunks and acknowledgements of an earlier (failed) post
    /// never count toward a repost.
    pub(crate) gen: u32,
}

impl Tag {
    /// The tag of post `gen` of the initiator's READ `xid`.
    pub(crate) fn read(xid: u64, gen: u32) -> Self {
        Self {
            xid,
            read: true,
            gen,
        }
    }
}

/// Where `len` bytes of a chunk go: `offset` of region `region` of the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Part {
    pub(crate) region: u32,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// One contiguous piece to move: sender's bytes → receiver's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Piece {
    pub(crate) src: Part,
    pub(crate) dst: Part,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Wire {
    /// A link's parameters: the sender's side-channel address (load its metadata from
    /// there) and the staging region the receiver may WRITE into (`slots` × `slot_size`
    /// bytes). `reply`: answer with your own Hello.
    Hello {
        addr: String,
        in_stage: u32,
        slots: u32,
        slot_size: u64,
        reply: bool,
    },
    /// The data of `parts`, packed in order, is in staging slot `slot`. `total`: on the
    /// transfer's last chunk, how many chunks it has; `notif` rides on that chunk too.
    Chunk {
        tag: Tag,
        slot: u32,
        parts: Vec<Part>,
        total: Option<u32>,
        #[serde(with = "serde_bytes")]
        notif: Option<Vec<u8>>,
    },
    /// Slot `slot` was copied out (to device memory) and is free; `error` if it could not be.
    Ack {
        tag: Tag,
        slot: u32,
        error: Option<String>,
    },
    /// READ: send me these pieces (`src` in your regions, `dst` in mine) under `xid`.
    ReadReq {
        xid: u64,
        gen: u32,
        pieces: Vec<Piece>,
    },
    /// READ `xid` (post `gen`) failed on the sender's side.
    ReadFail { xid: u64, gen: u32, error: String },
    /// READ `xid` completed at the initiator; the engine's notification for the target.
    ReadDone {
        xid: u64,
        #[serde(with = "serde_bytes")]
        notif: Option<Vec<u8>>,
    },
}

impl Wire {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        // Serializing these plain types into a Vec cannot fail.
        v.extend(rmp_serde::to_vec(self).unwrap_or_default());
        v
    }
}

/// What a notification is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    /// A bounce message.
    Ours(Wire),
    /// A bounce message that does not parse (counted, dropped).
    Malformed(String),
    /// Not ours: the engine's.
    Theirs,
}

pub(crate) fn decode(bytes: &[u8]) -> Decoded {
    let Some(body) = bytes.strip_prefix(MAGIC.as_slice()) else {
        return Decoded::Theirs;
    };
    match rmp_serde::from_slice(body) {
        Ok(w) => Decoded::Ours(w),
        Err(e) => Decoded::Malformed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Wire> {
        let tag = Tag {
            xid: 7,
            read: false,
            gen: 2,
        };
        let p = Part {
            region: 1,
            offset: 4096,
            len: 100,
        };
        vec![
            Wire::Hello {
                addr: "10.0.0.1:5559".into(),
                in_stage: 3,
                slots: 4,
                slot_size: 1 << 20,
                reply: true,
            },
            Wire::Chunk {
                tag,
                slot: 2,
                parts: vec![p, p],
                total: Some(5),
                notif: Some(b"done".to_vec()),
            },
            Wire::Ack {
                tag,
                slot: 2,
                error: None,
            },
            Wire::ReadReq {
                xid: 9,
                gen: 1,
                pieces: vec![Piece { src: p, dst: p }],
            },
            Wire::ReadFail {
                xid: 9,
                gen: 1,
                error: "x".into(),
            },
            Wire::ReadDone {
                xid: 9,
                notif: None,
            },
        ]
    }

    #[test]
    fn round_trip_and_pass_through() {
        for w in samples() {
            assert_eq!(decode(&w.encode()), Decoded::Ours(w));
        }
        assert_eq!(decode(b"engine's own notification"), Decoded::Theirs);
        assert_eq!(decode(b""), Decoded::Theirs);
    }

    #[test]
    fn golden_ack() {
        let w = Wire::Ack {
            tag: Tag {
                xid: 1,
                read: true,
                gen: 4,
            },
            slot: 3,
            error: None,
        };
        // MAGIC, then msgpack: {"Ack": [[1, true, 4], 3, nil]}
        assert_eq!(
            w.encode(),
            b"\xffKVRB1\x81\xa3Ack\x93\x93\x01\xc3\x04\x03\xc0".to_vec()
        );
    }

    proptest! {
        #[test]
        fn garbage_after_the_magic_is_malformed_never_a_panic(body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut m = MAGIC.to_vec();
            m.extend(&body);
            match decode(&m) {
                Decoded::Ours(_) | Decoded::Malformed(_) => {}
                Decoded::Theirs => prop_assert!(false, "prefixed message passed through"),
            }
        }
    }
}
