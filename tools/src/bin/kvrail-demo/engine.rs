//! One instance (P or D): an agent, the connector's scheduler and worker, a block allocator
//! and the fake model, stepped every millisecond; commands come from the proxy as JSON
//! lines on a control connection, answers go back the same way.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, AgentConfig, BackendChoice};
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::{agent_config, EngineRequest, KvTransferParams, Scheduler, Worker};
use serde_json::{json, Value};

use crate::model::{block, tokens, Shape};

/// How an instance runs.
pub(crate) struct Instance {
    pub(crate) name: String,
    pub(crate) kv_config: String,
    pub(crate) backend: BackendChoice,
    pub(crate) devices: Vec<String>,
    pub(crate) shape: Shape,
    /// Prefill this many tokens per engine step (None: the whole prompt in one step).
    pub(crate) step_tokens: Option<u64>,
}

/// A prefill running over several steps.
struct Prefilling {
    id: String,
    toks: Vec<u32>,
    blocks: Vec<u64>,
    done: u64,
}

/// Microseconds since the epoch (P and D on one host compare them).
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn prefill_req(id: &str, n: u64) -> EngineRequest {
    EngineRequest {
        request_id: id.to_owned(),
        prompt_tokens: n,
        params: Some(KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        }),
    }
}

struct Decoding {
    blocks: Vec<u64>,
    toks: Vec<u32>,
    started: Instant,
}

/// Serve the proxy until it says quit (or disconnects).
pub(crate) fn serve(inst: Instance) -> Result<(), String> {
    let cfg = KvTransferConfig::from_json(&inst.kv_config).map_err(|e| e.to_string())?;
    let layout = inst.shape.layout();
    let mut base = AgentConfig {
        listen: "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
        backend: inst.backend,
        devices: inst.devices.clone(),
        ..AgentConfig::default()
    };
    base.compat.model = "demo-28l-8h-128d".into();
    base.compat.dtype = "float16".into();
    let ac = agent_config(&cfg, &layout, base);
    let agent = Arc::new(Agent::new(&inst.name, ac).map_err(|e| e.to_string())?);
    let mut sched = Scheduler::new(cfg.clone(), &inst.name, agent.side_channel_addr(), 1);
    let mut worker =
        Worker::new(agent.clone(), cfg, layout.clone(), 1).map_err(|e| e.to_string())?;
    let mut free: VecDeque<u64> = (0..layout.num_blocks).collect();

    let ctl = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    outln!(
        "ready {} backend {:?} side {}",
        ctl.local_addr().map_err(|e| e.to_string())?.port(),
        agent.metadata().backend,
        agent.side_channel_addr().port()
    );
    std::io::stdout().flush().ok();
    let (stream, _) = ctl.accept().map_err(|e| e.to_string())?;
    let mut out = stream.try_clone().map_err(|e| e.to_string())?;
    let (tx, rx) = mpsc::channel::<Value>();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            match serde_json::from_str(&line) {
                Ok(v) => {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
                Err(e) => eprintln!("bad command {line:?}: {e}"),
            }
        }
    });
    let reply = |out: &mut TcpStream, v: Value| -> Result<(), String> {
        writeln!(out, "{v}").map_err(|e| e.to_string())
    };

    // the "forward pass": the KV of tokens [from, to) of a prompt into its blocks (the
    // blocks those tokens touch, holding every token up to `to`)
    let regions = worker.regions().to_vec();
    let compute = |toks: &[u32], blocks: &[u64], from: u64, to: u64| -> Result<(), String> {
        let bs = layout.block_size as u64;
        let (first, last) = (from / bs, to.div_ceil(bs));
        for (li, r) in regions.iter().enumerate() {
            for p in 0..layout.planes {
                for bi in first..last {
                    let data = block(&inst.shape, &toks[..to as usize], li, p, bi as usize);
                    agent
                        .write_region(*r, layout.offset(p, blocks[bi as usize]), &data)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(())
    };
    let mut prefilling: Vec<Prefilling> = Vec::new();
    let mut held: HashMap<String, Vec<u64>> = HashMap::new(); // P: blocks under a lease
    let mut decoding: HashMap<String, Decoding> = HashMap::new(); // D
    let mut freed = 0u64;
    loop {
        let now = Instant::now();
        loop {
            let cmd = match rx.try_recv() {
                Ok(c) => c,
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
            };
            match cmd["cmd"].as_str().unwrap_or("") {
                "prefill" => {
                    let id = cmd["id"].as_str().unwrap_or("").to_owned();
                    let n = cmd["tokens"].as_u64().unwrap_or(0);
                    let toks = tokens(cmd["seed"].as_u64().unwrap_or(0), n);
                    let need = n.div_ceil(layout.block_size as u64) as usize;
                    if free.len() < need {
                        reply(&mut out, json!({"id": id, "error": "out of KV blocks"}))?;
                        continue;
                    }
                    let blocks: Vec<u64> = free.drain(..need).collect();
                    prefilling.push(Prefilling {
                        id,
                        toks,
                        blocks,
                        done: 0,
                    });
                }
                "decode" => {
                    let id = cmd["id"].as_str().unwrap_or("").to_owned();
                    let n = cmd["tokens"].as_u64().unwrap_or(0);
                    let params: KvTransferParams =
                        serde_json::from_value(cmd["params"].clone()).map_err(|e| e.to_string())?;
                    let req = EngineRequest {
                        request_id: id.clone(),
                        prompt_tokens: n,
                        params: Some(params),
                    };
                    let (ext, _) = sched.get_num_new_matched_tokens(&req, 0, now);
                    let need = n.div_ceil(layout.block_size as u64) as usize;
                    if free.len() < need {
                        reply(
                            &mut out,
                            json!({"id": id, "ok": false, "error": "out of KV blocks"}),
                        )?;
                        continue;
                    }
                    let blocks: Vec<u64> = free.drain(..need).collect();
                    sched.update_state_after_alloc(&req, blocks.clone(), ext, now);
                    decoding.insert(
                        id,
                        Decoding {
                            blocks,
                            toks: tokens(cmd["seed"].as_u64().unwrap_or(0), n),
                            started: now,
                        },
                    );
                }
                "stats" => reply(
                    &mut out,
                    json!({"stats": {"held": held.len(), "leased": worker.leased(),
                        "free_blocks": free.len(), "freed": freed,
                        "bytes_posted": worker.bytes_posted(),
                        "push_dropped": worker.push_dropped(),
                        "grants": worker.grants_live()}}),
                )?,
                "quit" => return Ok(()),
                other => eprintln!("unknown command {other:?}"),
            }
        }
        // one engine step of every running prefill; a finished one goes to D
        let mut i = 0;
        while i < prefilling.len() {
            let p = &mut prefilling[i];
            let n = p.toks.len() as u64;
            let to = inst.step_tokens.map_or(n, |s| (p.done + s).min(n));
            compute(&p.toks, &p.blocks, p.done, to)?;
            p.done = to;
            let req = prefill_req(&p.id, n);
            if to < n {
                sched.prefill_progress(&req, &p.blocks, to);
                i += 1;
                continue;
            }
            let p = prefilling.swap_remove(i);
            let (_, params) = sched.request_finished(&req, &p.blocks);
            reply(
                &mut out,
                json!({"id": p.id, "params": params, "finished_at_us": now_us()}),
            )?;
            held.insert(p.id, p.blocks);
        }
        let meta = sched.build_connector_meta(now);
        worker.start_load_kv(&meta, now);
        let f = worker.get_finished(now);
        sched.update_connector_output(&f);
        for id in &f.sending {
            if let Some(b) = held.remove(id) {
                free.extend(b);
                freed += 1;
            }
        }
        for id in &f.recving {
            let Some(d) = decoding.remove(id) else {
                continue;
            };
            let ms = d.started.elapsed().as_secs_f64() * 1e3;
            // check every KV byte that arrived, then "decode" and free
            let mut bad = None;
            let mut got = vec![0u8; layout.block_bytes as usize];
            'check: for (li, r) in worker.regions().iter().enumerate() {
                for p in 0..layout.planes {
                    for (bi, b) in d.blocks.iter().enumerate() {
                        agent
                            .read_region(*r, layout.offset(p, *b), &mut got)
                            .map_err(|e| e.to_string())?;
                        // every token of the prompt in this block, per head (what the
                        // model reads; with chunk_mode the rest of a last block is not sent)
                        let want = block(&inst.shape, &d.toks, li, p, bi);
                        let bs = layout.block_size as u64;
                        let n = d.toks.len() as u64;
                        let in_block = n.saturating_sub(bi as u64 * bs);
                        let from = inst
                            .shape
                            .first_attended(li, n)
                            .saturating_sub(bi as u64 * bs)
                            .min(in_block);
                        let spans = layout.geom().token_spans(from, in_block);
                        if spans.iter().any(|s| {
                            let r = s.offset as usize..(s.offset + s.len) as usize;
                            got[r.clone()] != want[r]
                        }) {
                            bad = Some(format!("layer {li} plane {p} block {bi}"));
                            break 'check;
                        }
                    }
                }
            }
            let bytes = d.blocks.len() as u64
                * layout.block_bytes
                * layout.planes
                * layout.layers.len() as u64;
            free.extend(d.blocks);
            match bad {
                None => reply(
                    &mut out,
                    json!({"id": id, "ok": true, "ms": ms, "bytes": bytes, "done_at_us": now_us()}),
                )?,
                Some(w) => reply(
                    &mut out,
                    json!({"id": id, "ok": false, "error": format!("KV differs at {w}")}),
                )?,
            }
        }
        for id in &f.failed_recving {
            if let Some(d) = decoding.remove(id) {
                free.extend(d.blocks);
            }
            reply(
                &mut out,
                json!({"id": id, "ok": false, "error": "KV receive failed"}),
            )?;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
