use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

#[test]
fn header_round_trip_and_garbage() {
    let h = Header {
        credits: 77,
        first: true,
        last: false,
        credit_only: false,
    };
    assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    let c = Header {
        credits: 5,
        first: false,
        last: false,
        credit_only: true,
    };
    assert_eq!(Header::decode(&c.encode()).unwrap(), c);
    assert_eq!(
        Header::decode(&[0x4b, 1, 0]),
        Err(NotifFrameError::Short(3))
    );
    assert_eq!(Header::decode(&[0; 8]), Err(NotifFrameError::Magic(0)));
    assert_eq!(
        Header::decode(&[0x4b, 0x80, 0, 0, 0, 0, 0, 0]),
        Err(NotifFrameError::Flags(0x80))
    );
    // the wire form: magic, flags, credits (little endian), nothing else
    let h = Header {
        credits: 0x0102,
        first: true,
        last: true,
        credit_only: false,
    };
    assert_eq!(h.encode(), [0x4b, 3, 2, 1]);
    // an 8-byte header of an older build is refused by its first byte
    assert_eq!(
        Header::decode(&[0x6b, 3, 0, 0, 2, 0, 0, 0]),
        Err(NotifFrameError::Magic(0x6b))
    );
    // a credit-only frame carries nothing else
    let mut f = c.encode().to_vec();
    f.push(1);
    assert_eq!(Header::decode(&f), Err(NotifFrameError::Flags(4)));
}

#[test]
fn fragmenting_and_reassembly() {
    let frames: Vec<_> = fragments(10, HEADER + 4).collect();
    assert_eq!(
        frames,
        [
            (0..4, true, false),
            (4..8, false, false),
            (8..10, false, true)
        ]
    );
    assert_eq!(fragments(0, 64).collect::<Vec<_>>(), [(0..0, true, true)]);
    let msg: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
    let mut a = Assembler::default();
    let mut out = None;
    for (r, first, last) in fragments(msg.len(), 72) {
        let h = Header {
            credits: 0,
            first,
            last,
            credit_only: false,
        };
        out = a.push(&h, &msg[r]).unwrap();
    }
    assert_eq!(out.unwrap(), msg);
    let cont = Header {
        credits: 0,
        first: false,
        last: true,
        credit_only: false,
    };
    assert!(matches!(
        a.push(&cont, b"x"),
        Err(NotifFrameError::Sequence(_))
    ));
    let first = Header {
        credits: 0,
        first: true,
        last: false,
        credit_only: false,
    };
    a.push(&first, b"x").unwrap();
    assert!(matches!(
        a.push(&first, b"x"),
        Err(NotifFrameError::Sequence(_))
    ));
}

/// More owed than the header's 16 bits carry: the rest rides on the next frame, none lost.
#[test]
fn owed_credits_beyond_the_header_field_wait_for_the_next_frame() {
    let mut c = Credits::new(4);
    c.reposted(70_000);
    assert_eq!(c.spend(), u16::MAX);
    assert_eq!(c.owed(), 70_000 - u32::from(u16::MAX));
    assert_eq!(u32::from(c.spend()), 70_000 - u32::from(u16::MAX));
    assert_eq!(c.owed(), 0);
}

#[test]
fn over_returned_credits_are_refused() {
    let mut c = Credits::new(4);
    c.spend();
    assert_eq!(
        c.received(2),
        Err(NotifFrameError::Credits {
            returned: 2,
            outstanding: 1
        })
    );
    assert_eq!(c.received(1), Ok(()));
    assert_eq!(c.available(), 4);
}

/// Two peers exchanging frames over queues with `slots` posted receives each. Panics on a
/// frame arriving with no receive posted (what RNR would be on RDMA). Receives are posted
/// again `batch` at a time, their credits owed only then (as `MsgChannel` does).
struct Sim {
    credits: [Credits; 2],
    posted: [u32; 2],
    unposted: [u32; 2],
    batch: u32,
    wire: [VecDeque<Header>; 2], // wire[i]: frames in flight to peer i
    backlog: [u32; 2],           // data frames peer i still wants to send
    delivered: [u32; 2],         // data frames peer i received
    credit_frames: u32,
}

impl Sim {
    fn new(slots: u32, a: u32, b: u32) -> Self {
        Self::batched(slots, a, b, 1)
    }

    fn batched(slots: u32, a: u32, b: u32, batch: u32) -> Self {
        let c = Credits::new(slots);
        let slots = c.slots(); // what both sides really post
        Self {
            credits: [c.clone(), c],
            posted: [slots, slots],
            unposted: [0, 0],
            batch,
            wire: [VecDeque::new(), VecDeque::new()],
            backlog: [a, b],
            delivered: [0, 0],
            credit_frames: 0,
        }
    }

    /// Peer `i` sends what it may.
    fn send(&mut self, i: usize, burst: u32) {
        let to = 1 - i;
        for _ in 0..burst {
            if self.backlog[i] > 0 && self.credits[i].can_send_data() {
                let credits = self.credits[i].spend();
                self.wire[to].push_back(Header {
                    credits,
                    first: true,
                    last: true,
                    credit_only: false,
                });
                self.backlog[i] -= 1;
            }
        }
        if self.credits[i].should_return() {
            let credits = self.credits[i].spend();
            self.wire[to].push_back(Header {
                credits,
                first: false,
                last: false,
                credit_only: true,
            });
            self.credit_frames += 1;
        }
    }

    /// Up to `n` frames arrive at peer `i`, each consuming a posted receive (posted again
    /// with the batch).
    fn arrive(&mut self, i: usize, n: usize) {
        for _ in 0..n {
            let Some(h) = self.wire[i].pop_front() else {
                return;
            };
            assert!(
                self.posted[i] > 0,
                "frame arrived with no receive posted (RNR)"
            );
            self.posted[i] -= 1;
            self.unposted[i] += 1;
            self.credits[i].arrived(h.credits.into()).unwrap();
            if self.unposted[i] >= self.batch {
                self.posted[i] += self.unposted[i];
                self.credits[i].reposted(std::mem::take(&mut self.unposted[i]));
            }
            if !h.credit_only {
                self.delivered[i] += 1;
            }
        }
    }

    fn idle(&self) -> bool {
        self.wire.iter().all(VecDeque::is_empty)
    }
}

#[test]
fn one_way_burst_of_100k_never_overruns_and_finishes() {
    let mut s = Sim::new(16, 100_000, 0);
    let mut steps = 0;
    while (s.delivered[1] < 100_000 || !s.idle()) && steps < 1_000_000 {
        s.send(0, 64);
        s.arrive(1, 7);
        s.send(1, 0);
        s.arrive(0, 3);
        steps += 1;
    }
    assert_eq!(
        s.delivered[1], 100_000,
        "stalled after {steps} steps: {} / {}",
        s.credits[0], s.credits[1]
    );
    assert!(s.credit_frames > 0);
}

proptest! {
    #[test]
    fn two_way_traffic_is_deadlock_free(
        slots in 2u32..40,
        a in 0u32..3000,
        b in 0u32..3000,
        pattern in prop::collection::vec((0u32..20, 0usize..20, 0u32..20, 0usize..20), 1..50),
        batch in 0u32..64,
    ) {
        // any batch of at most half the slots (MsgChannel's is slots / 8): with more, a
        // sender can sit on its last credit while the receiver owes too little to return
        // (tried: batches up to all the slots deadlock at once)
        let half = (slots.max(Credits::MIN_SLOTS) / 2).max(1);
        let mut s = Sim::batched(slots, a, b, 1 + batch % half);
        let mut k = 0usize;
        let mut quiet = 0;
        while quiet < 10 {
            let (sa, ra, sb, rb) = pattern[k % pattern.len()];
            k += 1;
            s.send(0, sa.max(1));
            s.arrive(1, ra.max(1));
            s.send(1, sb.max(1));
            s.arrive(0, rb.max(1));
            quiet = if s.idle() && (s.backlog == [0, 0] || (!s.credits[0].can_send_data() && !s.credits[1].can_send_data())) { quiet + 1 } else { 0 };
            prop_assert!(k < 2_000_000, "no progress");
        }
        prop_assert_eq!(s.delivered, [b, a], "credits: {} / {}", s.credits[0], s.credits[1]);
    }
}
