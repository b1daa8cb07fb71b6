//! The connector through the C ABI: `kvrail_scheduler` (scheduler side) and
//! `kvrail_worker` (worker side), passing the metadata as opaque msgpack bytes and requests'
//! transfer parameters, finished lists and layouts as JSON text.

use std::ffi::c_char;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvrail::agent::Agent;
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::placement;
use kvrail::connector::tp::rank_agent_name;
use kvrail::connector::{
    agent_config, ConnectorMetadata, EngineRequest, Finished, KvCaches, KvLayout, KvTransferParams,
    RequestEnd, Scheduler, Worker,
};

use crate::agent::{kvrail_agent, parse_config, AgentHandle};
use crate::memory::{kv_caches, kvrail_kv_cache};
use crate::result::{kvrail_result, Failure};
use crate::util::{boundary, bytes_arg, null, put, slice_arg, str_arg, write_bytes};

/// A connector's scheduler side (opaque).
pub struct kvrail_scheduler {
    _private: [u8; 0],
}

/// A connector's worker side (opaque).
pub struct kvrail_worker {
    _private: [u8; 0],
}

struct SchedHandle {
    s: Mutex<Scheduler>,
    /// Built metadata that did not fit the caller's buffer (handed out next time).
    pending: Mutex<Option<Vec<u8>>>,
}

struct WorkerHandle {
    w: Mutex<Worker>,
    /// A finished report that did not fit the caller's buffer.
    pending: Mutex<Option<Vec<u8>>>,
}

/// Write the output kept from a call whose buffer was too small, or else a fresh one from
/// `make`, into `buf`; an output that does not fit is kept for the next call.
///
/// # Safety
/// As for [`write_bytes`].
unsafe fn hand_out(
    pending: &Mutex<Option<Vec<u8>>>,
    make: impl FnOnce() -> Vec<u8>,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> Result<(), Failure> {
    let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
    let bytes = pending.take().unwrap_or_else(make);
    // SAFETY: the caller's promises.
    let r = unsafe { write_bytes(&bytes, buf, len, out_len) };
    if r.is_err() {
        *pending = Some(bytes);
    }
    r
}

fn config(json: &str) -> Result<KvTransferConfig, Failure> {
    KvTransferConfig::from_json(json)
        .map_err(|e| Failure::new(kvrail_result::InvalidConfig, e.to_string()))
}

fn invalid(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new(kvrail_result::InvalidArgument, format!("{what}: {e}"))
}

/// # Safety
/// `p` is NULL or from [`kvrail_scheduler_new`], not freed.
unsafe fn sched<'a>(p: *const kvrail_scheduler) -> Result<&'a SchedHandle, Failure> {
    if p.is_null() {
        return Err(null("scheduler"));
    }
    // SAFETY: a non-NULL pointer from `kvrail_scheduler_new` (a leaked Box) by the caller's
    // promise, valid until `kvrail_scheduler_free`.
    Ok(unsafe { &*p.cast::<SchedHandle>() })
}

/// # Safety
/// `p` is NULL or from [`kvrail_worker_new`], not freed.
unsafe fn worker<'a>(p: *const kvrail_worker) -> Result<&'a WorkerHandle, Failure> {
    if p.is_null() {
        return Err(null("worker"));
    }
    // SAFETY: as for `sched`.
    Ok(unsafe { &*p.cast::<WorkerHandle>() })
}

/// A request from its id, prompt length and `kv_transfer_params` JSON (NULL: none).
///
/// # Safety
/// The strings are NULL (params only) or NUL-terminated.
unsafe fn request(
    id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
) -> Result<EngineRequest, Failure> {
    // SAFETY: the caller's promise.
    let id = unsafe { str_arg(id, "request_id") }?;
    let params = if params_json.is_null() {
        None
    } else {
        // SAFETY: the caller's promise.
        let j = unsafe { str_arg(params_json, "params_json") }?;
        Some(KvTransferParams::from_json(j).map_err(|e| invalid("params_json", e))?)
    };
    Ok(EngineRequest {
        request_id: id.to_owned(),
        prompt_tokens,
        params,
    })
}

/// A scheduler call's scheduler, request and blocks.
///
/// # Safety
/// As [`sched`], [`request`] and [`slice_arg`] each require.
unsafe fn sched_request_blocks<'a>(
    s: *const kvrail_scheduler,
    (id, prompt_tokens, params_json): (*const c_char, u64, *const c_char),
    blocks: *const u64,
    n_blocks: usize,
) -> Result<
    (
        std::sync::MutexGuard<'a, Scheduler>,
        EngineRequest,
        &'a [u64],
    ),
    Failure,
> {
    // SAFETY: the caller's promises.
    let (h, req, blocks) = unsafe {
        (
            sched(s)?,
            request(id, prompt_tokens, params_json)?,
            slice_arg(blocks, n_blocks, "blocks")?,
        )
    };
    Ok((h.s.lock().unwrap_or_else(|p| p.into_inner()), req, blocks))
}

/// Create the scheduler side for engine `engine_id` whose workers' side channel is
/// `side_channel_addr` ("ip:port"), from the `kv_transfer_config` JSON.
///
/// # Safety
/// Strings NUL-terminated; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_new(
    kv_transfer_config: *const c_char,
    engine_id: *const c_char,
    side_channel_addr: *const c_char,
    tp_size: u32,
    out: *mut *mut kvrail_scheduler,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (cfg, engine, addr) = unsafe {
            (
                str_arg(kv_transfer_config, "kv_transfer_config")?,
                str_arg(engine_id, "engine_id")?,
                str_arg(side_channel_addr, "side_channel_addr")?,
            )
        };
        if out.is_null() {
            return Err(null("out"));
        }
        let cfg = config(cfg)?;
        let addr = addr.parse().map_err(|e| invalid("side_channel_addr", e))?;
        let h = Box::new(SchedHandle {
            s: Mutex::new(Scheduler::new(cfg, engine, addr, tp_size.max(1))),
            pending: Mutex::new(None),
        });
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out, Box::into_raw(h).cast::<kvrail_scheduler>(), "out") }
    })
}

/// Free a scheduler (NULL is ignored).
///
/// # Safety
/// NULL or from [`kvrail_scheduler_new`]; not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_free(s: *mut kvrail_scheduler) {
    let _ = boundary(|| {
        if !s.is_null() {
            // SAFETY: from `kvrail_scheduler_new`, freed once.
            drop(unsafe { Box::from_raw(s.cast::<SchedHandle>()) });
        }
        Ok(())
    });
}

/// Tokens the connector will load for a request beyond `num_computed` (`*out_tokens`), and
/// whether they load asynchronously (`*out_async`).
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; strings NUL-terminated (`params_json` may be NULL);
/// out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_get_num_new_matched_tokens(
    s: *const kvrail_scheduler,
    request_id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
    num_computed: u64,
    out_tokens: *mut u64,
    out_async: *mut bool,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, req) = unsafe { (sched(s)?, request(request_id, prompt_tokens, params_json)?) };
        if out_tokens.is_null() || out_async.is_null() {
            return Err(null("out_tokens or out_async"));
        }
        let (n, a) =
            h.s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_num_new_matched_tokens(&req, num_computed, Instant::now());
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe {
            put(out_tokens, n, "out_tokens")?;
            put(out_async, a, "out_async")
        }
    })
}

/// Blocks were allocated for a request; with external tokens to load the workers receive
/// into `blocks`.
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; strings NUL-terminated (`params_json` may be NULL);
/// `blocks` valid for `n_blocks`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvrail_scheduler_update_state_after_alloc(
    s: *const kvrail_scheduler,
    request_id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
    blocks: *const u64,
    n_blocks: usize,
    num_external_tokens: u64,
) -> kvrail_result {
    boundary(|| {
        let args = (request_id, prompt_tokens, params_json);
        // SAFETY: the caller's promises.
        let (mut s, req, blocks) = unsafe { sched_request_blocks(s, args, blocks, n_blocks) }?;
        s.update_state_after_alloc(&req, blocks.to_vec(), num_external_tokens, Instant::now());
        Ok(())
    })
}

/// This step's metadata for the workers (msgpack bytes, for [`kvrail_worker_start_load_kv`])
/// into `buf`. [`kvrail_result::BufferTooSmall`] keeps it for the next call
/// (`kvrail_last_error` says the size).
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; `buf` valid for `len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_build_connector_meta(
    s: *const kvrail_scheduler,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { sched(s) }?;
        let make = || {
            h.s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .build_connector_meta(Instant::now())
                .encode()
        };
        // SAFETY: the caller's promises.
        unsafe { hand_out(&h.pending, make, buf, len, out_len) }
    })
}

/// A request finished on this engine: `*out_delay_free` says whether its blocks stay
/// allocated (P keeps them for D), and the transfer parameters for D (JSON; empty when
/// none) go to `params_buf`. An engine with `bidirectional_kv_xfer` calls
/// [`kvrail_scheduler_request_finished_as`] instead, which is told how the request ended.
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; strings NUL-terminated (`params_json` may be NULL);
/// `blocks` valid for `n_blocks`; `params_buf` valid for `params_len`; out-pointers writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvrail_scheduler_request_finished(
    s: *const kvrail_scheduler,
    request_id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
    blocks: *const u64,
    n_blocks: usize,
    out_delay_free: *mut bool,
    params_buf: *mut u8,
    params_len: usize,
    out_params_len: *mut usize,
) -> kvrail_result {
    let args = (request_id, prompt_tokens, params_json);
    let outs = (out_delay_free, params_buf, params_len, out_params_len);
    // SAFETY: the caller's promises, passed on.
    unsafe { finished(s, args, (blocks, n_blocks), RequestEnd::default(), outs) }
}

/// [`kvrail_scheduler_request_finished`], told how the request ended: `completed` (it ran
/// to its end: a stop condition or its length; not aborted or failed) and
/// `computed_tokens` (tokens whose KV is in its blocks: vLLM's `num_computed_tokens`).
/// With `bidirectional_kv_xfer`, a decode leg (D) that completed keeps its blocks for
/// `decoder_kv_blocks_ttl` (`*out_delay_free` true) and its parameters name them for the
/// next turn (`do_remote_decode`, `remote_num_tokens`, `remote_blocks_expiry_time` in D's
/// clock): the engine passes them to P with that turn, and P reads them back.
///
/// # Safety
/// As [`kvrail_scheduler_request_finished`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvrail_scheduler_request_finished_as(
    s: *const kvrail_scheduler,
    request_id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
    blocks: *const u64,
    n_blocks: usize,
    completed: bool,
    computed_tokens: u64,
    out_delay_free: *mut bool,
    params_buf: *mut u8,
    params_len: usize,
    out_params_len: *mut usize,
) -> kvrail_result {
    let args = (request_id, prompt_tokens, params_json);
    let end = RequestEnd {
        completed,
        computed_tokens,
    };
    let outs = (out_delay_free, params_buf, params_len, out_params_len);
    // SAFETY: the caller's promises, passed on.
    unsafe { finished(s, args, (blocks, n_blocks), end, outs) }
}

/// The request-finished calls' one body.
///
/// # Safety
/// As [`kvrail_scheduler_request_finished`].
unsafe fn finished(
    s: *const kvrail_scheduler,
    args: (*const c_char, u64, *const c_char),
    (blocks, n_blocks): (*const u64, usize),
    end: RequestEnd,
    (out_delay_free, params_buf, params_len, out_params_len): (
        *mut bool,
        *mut u8,
        usize,
        *mut usize,
    ),
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (mut s, req, blocks) = unsafe { sched_request_blocks(s, args, blocks, n_blocks) }?;
        if out_delay_free.is_null() || out_params_len.is_null() {
            return Err(null("out_delay_free or out_params_len"));
        }
        let (delay, params) = s.request_finished_as(&req, blocks, end);
        drop(s);
        let json = params
            .map(|p| serde_json::to_string(&p).unwrap_or_default())
            .unwrap_or_default();
        // SAFETY: the caller's promises.
        unsafe {
            write_bytes(json.as_bytes(), params_buf, params_len, out_params_len)?;
            put(out_delay_free, delay, "out_delay_free")
        }
    })
}

/// The workers' report (the JSON [`kvrail_worker_get_finished`] wrote).
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; `finished_json` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_update_connector_output(
    s: *const kvrail_scheduler,
    finished_json: *const c_char,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, j) = unsafe { (sched(s)?, str_arg(finished_json, "finished_json")?) };
        let f: Finished = serde_json::from_str(j).map_err(|e| invalid("finished_json", e))?;
        h.s.lock()
            .unwrap_or_else(|p| p.into_inner())
            .update_connector_output(&f);
        Ok(())
    })
}

/// P with TP above 1: the side-channel port of each rank's worker (`ports[k]` for rank
/// `k`), when they are not the scheduler's port + rank. They travel to D in the transfer
/// parameters.
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; `ports` valid for `n_ports`.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_set_rank_ports(
    s: *const kvrail_scheduler,
    ports: *const u16,
    n_ports: usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, ports) = unsafe { (sched(s)?, slice_arg(ports, n_ports, "ports")?) };
        h.s.lock()
            .unwrap_or_else(|p| p.into_inner())
            .set_rank_ports(ports.to_vec());
        Ok(())
    })
}

/// P in push mode with `push_stream`: after a prefill step the request has the KV of
/// `computed` prompt tokens in its cache, in `blocks` (its blocks so far); the blocks that
/// closed go to D with the next metadata. A no-op without `push_stream`.
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; strings NUL-terminated (`params_json` may be NULL);
/// `blocks` valid for `n_blocks`.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_prefill_progress(
    s: *const kvrail_scheduler,
    request_id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
    blocks: *const u64,
    n_blocks: usize,
    computed: u64,
) -> kvrail_result {
    boundary(|| {
        let args = (request_id, prompt_tokens, params_json);
        // SAFETY: the caller's promises.
        let (mut s, req, blocks) = unsafe { sched_request_blocks(s, args, blocks, n_blocks) }?;
        s.prefill_progress(&req, blocks, computed);
        Ok(())
    })
}

/// A request entered the engine's scheduler (its waiting queue): a remote-prefill request
/// starts its heartbeats now, so P keeps its blocks however long it waits.
/// `*out_tracked` says whether it is tracked.
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; strings NUL-terminated (`params_json` may be NULL);
/// `out_tracked` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_on_new_request(
    s: *const kvrail_scheduler,
    request_id: *const c_char,
    prompt_tokens: u64,
    params_json: *const c_char,
    out_tracked: *mut bool,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, req) = unsafe { (sched(s)?, request(request_id, prompt_tokens, params_json)?) };
        if out_tracked.is_null() {
            return Err(null("out_tracked"));
        }
        let t =
            h.s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .on_new_request(&req, Instant::now());
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out_tracked, t, "out_tracked") }
    })
}

/// Whether push work is under way (`*out_pending`): while it is, the engine keeps stepping
/// so the workers and P's writer get their turn. In pull too while finished requests or
/// receives wait to be shipped to the workers: P, just after its last request finished,
/// takes one more step so its workers learn which blocks D will read.
///
/// # Safety
/// `s` from [`kvrail_scheduler_new`]; `out_pending` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_scheduler_has_pending_push_work(
    s: *const kvrail_scheduler,
    out_pending: *mut bool,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { sched(s) }?;
        if out_pending.is_null() {
            return Err(null("out_pending"));
        }
        let p =
            h.s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .has_pending_push_work();
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out_pending, p, "out_pending") }
    })
}

/// Create a worker named `engine_id` (its agent's name): `agent_config_json` as for
/// `kvrail_agent_new` (NULL: defaults), the `kv_transfer_config` JSON, and the KV layout as
/// JSON `{"layers": [...], "num_blocks": N, "block_bytes": B, "planes": 2, "block_size":
/// T}`. One region per layer is registered (see [`kvrail_worker_region`]).
///
/// # Safety
/// Strings NUL-terminated (`agent_config_json` may be NULL); `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_new(
    engine_id: *const c_char,
    agent_config_json: *const c_char,
    kv_transfer_config: *const c_char,
    layout_json: *const c_char,
    tp_size: u32,
    out: *mut *mut kvrail_worker,
) -> kvrail_result {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        kvrail_worker_new_rank(
            engine_id,
            agent_config_json,
            kv_transfer_config,
            layout_json,
            0,
            tp_size,
            out,
        )
    }
}

/// Like [`kvrail_worker_new`] for TP rank `tp_rank` of `tp_size`: the agent is named
/// `engine_id` for rank 0 and `<engine_id>#tp<rank>` otherwise (peers find each rank under
/// that name); `layout_json` is this rank's share of the cache (`"kv_heads"` per rank).
///
/// # Safety
/// As [`kvrail_worker_new`].
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_new_rank(
    engine_id: *const c_char,
    agent_config_json: *const c_char,
    kv_transfer_config: *const c_char,
    layout_json: *const c_char,
    tp_rank: u32,
    tp_size: u32,
    out: *mut *mut kvrail_worker,
) -> kvrail_result {
    // SAFETY: the caller's promises, passed on (no caches: kvrail allocates them).
    unsafe {
        kvrail_worker_new_caches(
            engine_id,
            agent_config_json,
            kv_transfer_config,
            layout_json,
            tp_rank,
            tp_size,
            std::ptr::null(),
            0,
            out,
        )
    }
}

/// `register_kv_caches`: like [`kvrail_worker_new_rank`] (rank `tp_rank` of `tp_size`), over the
/// engine's own KV cache — `caches[0..n_caches]`, each one allocation holding one layer or
/// several at offsets (pooled), of the memory `kv_buffer_device` names (`"cpu"`: host,
/// `"rbln"`: NPU) — registered in place; the engine keeps writing and reading it directly.
/// `n_caches` 0 lets kvrail allocate the cache (as [`kvrail_worker_new_rank`]). Errors name
/// the cache and field (`caches[1].mem.addr: …`), a layer the layout lacks or misses, or
/// `kv_buffer_device`.
///
/// # Safety
/// As [`kvrail_worker_new`]; `caches` readable for `n_caches` entries, their strings
/// NUL-terminated and their memory valid until the worker is freed.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvrail_worker_new_caches(
    engine_id: *const c_char,
    agent_config_json: *const c_char,
    kv_transfer_config: *const c_char,
    layout_json: *const c_char,
    tp_rank: u32,
    tp_size: u32,
    caches: *const kvrail_kv_cache,
    n_caches: usize,
    out: *mut *mut kvrail_worker,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (engine, cfg, layout) = unsafe {
            (
                str_arg(engine_id, "engine_id")?,
                str_arg(kv_transfer_config, "kv_transfer_config")?,
                str_arg(layout_json, "layout_json")?,
            )
        };
        let agent_json = if agent_config_json.is_null() {
            ""
        } else {
            // SAFETY: the caller's promise.
            unsafe { str_arg(agent_config_json, "agent_config_json") }?
        };
        if out.is_null() {
            return Err(null("out"));
        }
        let cfg = config(cfg)?;
        let layout: KvLayout = serde_json::from_str(layout)
            .map_err(|e| e.to_string())
            .and_then(|l: KvLayout| l.validate().map(|()| l).map_err(|e| e.to_string()))
            .map_err(|e| Failure::new(kvrail_result::InvalidConfig, format!("layout_json: {e}")))?;
        let ac = agent_config(&cfg, &layout, parse_config(agent_json)?);
        let caches = match n_caches {
            0 => KvCaches::Allocate,
            // SAFETY: the caller's promise (n_caches entries; memory alive while registered).
            n => KvCaches::Engine(unsafe { kv_caches(caches, n) }?),
        };
        // the rails of the NPU's NUMA node (runtime, else rbln-smi and sysfs)
        let ac = placement::for_caches(ac, &caches);
        let agent = Arc::new(Agent::new(&rank_agent_name(engine, tp_rank), ac)?);
        let w = Worker::with_caches(agent, cfg, layout, (tp_rank, tp_size.max(1)), caches)?;
        let h = Box::new(WorkerHandle {
            w: Mutex::new(w),
            pending: Mutex::new(None),
        });
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out, Box::into_raw(h).cast::<kvrail_worker>(), "out") }
    })
}

/// Free a worker (NULL is ignored).
///
/// # Safety
/// NULL or from [`kvrail_worker_new`]; not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_free(w: *mut kvrail_worker) {
    let _ = boundary(|| {
        if !w.is_null() {
            // SAFETY: from `kvrail_worker_new`, freed once.
            drop(unsafe { Box::from_raw(w.cast::<WorkerHandle>()) });
        }
        Ok(())
    });
}

/// A new agent handle for the worker's agent (free it with `kvrail_agent_free`; the worker
/// keeps its own): the engine writes and reads its KV cache through it.
///
/// # Safety
/// `w` from [`kvrail_worker_new`]; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_agent(
    w: *const kvrail_worker,
    out: *mut *mut kvrail_agent,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { worker(w) }?;
        let agent =
            h.w.lock()
                .unwrap_or_else(|p| p.into_inner())
                .agent()
                .clone();
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out, AgentHandle::boxed(agent), "out") }
    })
}

/// The region holding layer `layer_index` of the KV cache.
///
/// # Safety
/// `w` from [`kvrail_worker_new`]; `out_region` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_region(
    w: *const kvrail_worker,
    layer_index: usize,
    out_region: *mut u32,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { worker(w) }?;
        let r =
            h.w.lock()
                .unwrap_or_else(|p| p.into_inner())
                .regions()
                .get(layer_index)
                .copied()
                .ok_or_else(|| invalid("layer_index", format!("{layer_index} is not a layer")))?;
        // SAFETY: the caller's promise.
        unsafe { put(out_region, r.0, "out_region") }
    })
}

/// Start this step's work from the scheduler's metadata bytes.
///
/// # Safety
/// `w` from [`kvrail_worker_new`]; `meta` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_start_load_kv(
    w: *const kvrail_worker,
    meta: *const u8,
    len: usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, meta) = unsafe { (worker(w)?, bytes_arg(meta, len, "meta")?) };
        let m = ConnectorMetadata::decode(meta)
            .map_err(|e| invalid("meta (not connector metadata)", e))?;
        h.w.lock()
            .unwrap_or_else(|p| p.into_inner())
            .start_load_kv(&m, Instant::now());
        Ok(())
    })
}

/// Layers are loaded as a whole before a request runs: returns at once.
///
/// # Safety
/// `w` from [`kvrail_worker_new`]; `layer` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_wait_for_layer_load(
    w: *const kvrail_worker,
    layer: *const c_char,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, layer) = unsafe { (worker(w)?, str_arg(layer, "layer")?) };
        h.w.lock()
            .unwrap_or_else(|p| p.into_inner())
            .wait_for_layer_load(layer);
        Ok(())
    })
}

/// KV is computed in place in registered memory: returns at once.
///
/// # Safety
/// `w` from [`kvrail_worker_new`]; `layer` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_save_kv_layer(
    w: *const kvrail_worker,
    layer: *const c_char,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, layer) = unsafe { (worker(w)?, str_arg(layer, "layer")?) };
        h.w.lock()
            .unwrap_or_else(|p| p.into_inner())
            .save_kv_layer(layer);
        Ok(())
    })
}

/// Nothing is in flight on the save path: returns at once.
///
/// # Safety
/// `w` from [`kvrail_worker_new`].
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_wait_for_save(w: *const kvrail_worker) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { worker(w) }?;
        h.w.lock()
            .unwrap_or_else(|p| p.into_inner())
            .wait_for_save();
        Ok(())
    })
}

/// What finished since the last call, as JSON `{"sending": [...], "recving": [...],
/// "failed_recving": [...]}` (pass it to [`kvrail_scheduler_update_connector_output`]).
/// [`kvrail_result::BufferTooSmall`] keeps it for the next call.
///
/// # Safety
/// `w` from [`kvrail_worker_new`]; `buf` valid for `len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_worker_get_finished(
    w: *const kvrail_worker,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { worker(w) }?;
        let make = || {
            let f =
                h.w.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_finished(Instant::now());
            serde_json::to_vec(&f).unwrap_or_default()
        };
        // SAFETY: the caller's promises.
        unsafe { hand_out(&h.pending, make, buf, len, out_len) }
    })
}
