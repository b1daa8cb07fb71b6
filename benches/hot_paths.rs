#![allow(missing_docs)] // criterion_group! generates undocumented items
//! The CPU side of kvrail's hot paths, measured with criterion: the stripe planner and
//! progress tracking for a 1,000-descriptor transfer, descriptor validation (create_xfer of
//! 1,000 descriptors against a peer's advertised regions), and the wire codecs (frames,
//! notification frames, agent metadata). Run: `cargo bench --bench hot_paths`.
//! Building the verbs work requests needs an RDMA device; that path is measured in the lab
//! by kvrail-perf instead.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvrail::agent::{Agent, AgentConfig, BackendChoice, Desc, RemoteAccess, XferOp};
use kvrail::proto::frame::{self, FrameDecoder};
use kvrail::transport::notif::{fragments, Assembler, Header};
use kvrail::transport::stripe::{DescPair, Planner, Progress, StripeMode};

const DESCS: u64 = 1000;

fn descs() -> Vec<DescPair> {
    (0..DESCS)
        .map(|i| DescPair {
            local_region: 1,
            local_off: i * 16384,
            remote_region: 1,
            remote_off: i * 16384,
            len: 16384,
        })
        .collect()
}

fn stripe(c: &mut Criterion) {
    let d = descs();
    let mut g = c.benchmark_group("stripe");
    g.throughput(Throughput::Elements(DESCS));
    for (name, mode) in [
        (
            "plan_per_transfer_1000_descs_2_rails",
            StripeMode::PerTransfer,
        ),
        ("plan_striped_1000_descs_2_rails", StripeMode::Striped),
    ] {
        g.bench_function(name, |b| {
            let mut p = Planner::new(2);
            b.iter(|| {
                let plan = p.plan(black_box(&d), mode).expect("rails up");
                for r in 0..2 {
                    p.release(r, plan.per_rail[r].iter().map(|s| s.len).sum());
                }
                plan
            })
        });
    }
    g.bench_function("progress_complete_1000_slices", |b| {
        let plan = Planner::new(2)
            .plan(&d, StripeMode::Striped)
            .expect("rails up");
        b.iter_batched(
            || Progress::new(&plan),
            |mut pr| {
                for r in 0..2 {
                    let n = plan.per_rail[r].len();
                    for _ in (0..n).step_by(64) {
                        pr.complete(r, 64);
                    }
                }
                pr.state()
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn validation(c: &mut Criterion) {
    let cfg = || AgentConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        backend: BackendChoice::Tcp,
        ..AgentConfig::default()
    };
    let p = Agent::new("bench-p", cfg()).expect("agent");
    let d = Agent::new("bench-d", cfg()).expect("agent");
    let src = p
        .register((DESCS * 16384) as usize, RemoteAccess::READ, vec![])
        .expect("register");
    let dst = d
        .register((DESCS * 16384) as usize, RemoteAccess::NONE, vec![])
        .expect("register");
    let peer = d.load_remote(p.side_channel_addr()).expect("load");
    let local: Vec<Desc> = (0..DESCS)
        .map(|i| Desc::new(dst, i * 16384, 16384))
        .collect();
    let remote: Vec<Desc> = (0..DESCS)
        .map(|i| Desc::new(src, i * 16384, 16384))
        .collect();
    let mut g = c.benchmark_group("validation");
    g.throughput(Throughput::Elements(DESCS));
    g.bench_function("create_xfer_1000_descs", |b| {
        b.iter(|| {
            let x = d
                .create_xfer(XferOp::Read, local.clone(), &peer, remote.clone(), None)
                .expect("valid");
            d.release(x).expect("release");
        })
    });
    g.finish();
}

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec");
    let body = vec![7u8; 4096];
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.bench_function("frame_encode_decode_4k", |b| {
        let mut dec = FrameDecoder::new(1 << 20);
        b.iter(|| {
            let f = frame::encode(black_box(&body)).expect("fits");
            dec.push(&f);
            dec.next_frame().expect("valid").expect("whole")
        })
    });
    let msg = vec![3u8; 64 << 10];
    g.throughput(Throughput::Bytes(msg.len() as u64));
    g.bench_function("notif_fragment_reassemble_64k_in_1k_slots", |b| {
        b.iter(|| {
            let mut asm = Assembler::default();
            let mut out = None;
            for (r, first, last) in fragments(msg.len(), 1024) {
                let h = Header {
                    credits: 1,
                    first,
                    last,
                    credit_only: false,
                };
                let wire = h.encode();
                let h = Header::decode(&wire).expect("valid");
                out = asm.push(&h, &msg[r]).expect("in order");
            }
            out.expect("complete")
        })
    });
    g.finish();
    let a = Agent::new(
        "bench-meta",
        AgentConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            backend: BackendChoice::Tcp,
            ..AgentConfig::default()
        },
    )
    .expect("agent");
    for _ in 0..64 {
        a.register(4096, RemoteAccess::READ_WRITE, vec!["layer.0".into()])
            .expect("register");
    }
    let m = a.metadata();
    let bytes = m.encode().expect("encode");
    let mut g = c.benchmark_group("metadata");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("encode_64_regions", |b| {
        b.iter(|| m.encode().expect("encode"))
    });
    g.bench_function("decode_64_regions", |b| {
        b.iter(|| kvrail::agent::metadata::AgentMetadata::decode(black_box(&bytes)).expect("valid"))
    });
    g.finish();
}

criterion_group!(benches, stripe, validation, codec);
criterion_main!(benches);
