use super::*;
use crate::connector::meta::Finished;

fn sched(dir: &str, role: &str) -> Scheduler {
    let cfg = KvTransferConfig::from_json(&format!(
        r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}"}}"#
    ))
    .unwrap();
    Scheduler::new(cfg, "engine", "127.0.0.1:7000".parse().unwrap(), 1)
}

fn remote_prefill(id: &str) -> EngineRequest {
    EngineRequest {
        request_id: id.into(),
        prompt_tokens: 100,
        params: Some(KvTransferParams {
            do_remote_decode: false,
            do_remote_prefill: true,
            remote_engine_id: "prefill".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 7001,
            remote_block_ids: vec![1, 2, 3, 4, 5, 6, 7],
            remote_request_id: format!("p-{id}"),
            tp_size: 1,
            remote_ports: vec![],
            ..KvTransferParams::default()
        }),
    }
}

#[test]
fn heartbeats_start_when_the_request_arrives() {
    let mut d = sched("Pull", "kv_consumer");
    let t0 = Instant::now();
    assert!(d.on_new_request(&remote_prefill("r1"), t0));
    assert_eq!(
        d.heartbeating(),
        1,
        "tracked from arrival, before any scheduling"
    );
    // the first heartbeat for P goes with the next metadata, though r1 was never scheduled
    let m = d.build_connector_meta(t0);
    assert_eq!(m.heartbeats.len(), 1);
    assert_eq!(m.heartbeats[0].engine, "prefill");
    // a request without remote prefill is not tracked; neither is anything on a producer
    let mut plain = remote_prefill("r2");
    plain.params = None;
    assert!(!d.on_new_request(&plain, t0));
    assert!(!sched("Pull", "kv_producer").on_new_request(&remote_prefill("r3"), t0));
    // the request finishing stops them
    d.request_finished(&remote_prefill("r1"), &[]);
    assert_eq!(d.heartbeating(), 0);
}

#[test]
fn pending_push_work_keeps_the_engine_stepping() {
    let t0 = Instant::now();
    // P: a finished request waits for D until the workers report it sent
    let mut p = sched("Push", "kv_producer");
    assert!(!p.has_pending_push_work());
    let mut req = remote_prefill("r1");
    if let Some(x) = req.params.as_mut() {
        x.do_remote_prefill = false;
        x.do_remote_decode = true;
    }
    let (delay, params) = p.request_finished(&req, &[1, 2]);
    assert!(delay && params.is_some());
    assert!(p.has_pending_push_work());
    let _ = p.build_connector_meta(t0);
    assert!(p.has_pending_push_work(), "still held for D");
    p.update_connector_output(&Finished {
        sending: vec!["r1".into()],
        ..Finished::default()
    });
    assert!(!p.has_pending_push_work());
    // D: a registration waits for its completion
    let mut d = sched("Push", "kv_consumer");
    let r = remote_prefill("r2");
    d.update_state_after_alloc(&r, vec![4, 5], 100, t0);
    assert!(d.has_pending_push_work());
    let _ = d.build_connector_meta(t0);
    assert!(d.has_pending_push_work(), "the watchdog runs");
    d.update_connector_output(&Finished {
        recving: vec!["r2".into()],
        ..Finished::default()
    });
    assert!(!d.has_pending_push_work());
    // pull: one more step ships the lease to the workers (an engine that idles after its
    // last request would otherwise never tell them which blocks D reads), then none
    let mut pull = sched("Pull", "kv_producer");
    pull.request_finished(&req, &[1]);
    assert!(
        pull.has_pending_push_work(),
        "the lease waits to be shipped"
    );
    let _ = pull.build_connector_meta(t0);
    assert!(
        !pull.has_pending_push_work(),
        "held for D by the workers, not the loop"
    );
}

/// Parameters that do not name P whole load nothing: each missing key is named with its
/// value, the request is not tracked (no heartbeats to nowhere) and its prompt is computed
/// by D itself; push needs no block ids of P, pull does.
#[test]
fn a_decode_leg_missing_a_key_loads_nothing_and_says_which() {
    let t0 = Instant::now();
    type Cut = fn(&mut KvTransferParams);
    let cases: [(&str, Cut); 5] = [
        ("remote_engine_id", |p| p.remote_engine_id.clear()),
        ("remote_host", |p| p.remote_host.clear()),
        ("remote_port", |p| p.remote_port = 0),
        ("remote_request_id", |p| p.remote_request_id.clear()),
        ("remote_block_ids", |p| p.remote_block_ids.clear()),
    ];
    for (key, cut) in cases {
        let mut req = remote_prefill("r1");
        cut(req.params.as_mut().unwrap());
        let why = req
            .params
            .as_ref()
            .unwrap()
            .load_problem(true, false)
            .unwrap();
        assert!(
            why.starts_with(&format!("kv_transfer_params.{key} is ")),
            "{why}"
        );
        let mut d = sched("Pull", "kv_consumer");
        assert_eq!(
            d.get_num_new_matched_tokens(&req, 0, t0),
            (0, false),
            "{key}"
        );
        assert_eq!(d.heartbeating(), 0, "{key}");
        d.update_state_after_alloc(&req, vec![4, 5], 0, t0);
        assert!(d.build_connector_meta(t0).reqs_to_recv.is_empty(), "{key}");
    }
    // push: D's blocks are written by P, which knows its own
    let mut req = remote_prefill("r1");
    req.params.as_mut().unwrap().remote_block_ids.clear();
    let mut d = sched("Push", "kv_consumer");
    assert_eq!(d.get_num_new_matched_tokens(&req, 0, t0), (100, true));
    // the whole parameters load
    assert_eq!(
        remote_prefill("r2")
            .params
            .unwrap()
            .load_problem(true, false),
        None
    );
    // with a metadata store D finds P's ranks by engine id: no host or port needed
    let mut by_name = remote_prefill("r3").params.unwrap();
    by_name.remote_host.clear();
    by_name.remote_port = 0;
    assert_eq!(by_name.load_problem(true, true), None);
    by_name.remote_engine_id.clear();
    let why = by_name.load_problem(true, true).unwrap();
    assert!(
        why.starts_with("kv_transfer_params.remote_engine_id is "),
        "{why}"
    );
}

/// A key of the wrong type is refused naming the key and its value; null is absent; keys
/// kvrail does not know are the engine's.
#[test]
fn transfer_params_from_json_name_the_bad_key() {
    let p = KvTransferParams::from_json(
        r#"{"do_remote_prefill": true, "remote_host": "10.0.0.1", "remote_port": 7001,
            "remote_block_ids": [1, 2], "remote_ports": null, "vllm_own": {"x": 1}}"#,
    )
    .unwrap();
    assert!(p.do_remote_prefill && p.remote_port == 7001 && p.remote_ports.is_empty());
    assert_eq!(p.remote_block_ids, [1, 2]);
    for (json, want) in [
        (
            r#"{"remote_port": "7001"}"#,
            r#"remote_port: "7001" is not a port"#,
        ),
        (
            r#"{"remote_port": 70000}"#,
            "remote_port: 70000 is not a port",
        ),
        (
            r#"{"remote_block_ids": [1, -2]}"#,
            "remote_block_ids: [1,-2] is not a list of block ids",
        ),
        (
            r#"{"do_remote_prefill": "yes"}"#,
            r#"do_remote_prefill: "yes" is not true or false"#,
        ),
        (r#"{"remote_host": 5}"#, "remote_host: 5 is not a string"),
        ("[1]", "[1] is not a JSON object"),
        ("{", "not JSON"),
    ] {
        let e = KvTransferParams::from_json(json).unwrap_err().to_string();
        assert!(e.starts_with(want), "{json}: {e}");
    }
}

#[test]
fn a_push_receive_that_ended_as_the_engine_finished_it_is_not_withdrawn() {
    // vLLM (policy fail) finishes a request whose KV did not load, then reads the report
    // that named it failed: no withdrawal may follow, its `sending` would name a request
    // vLLM already freed (vLLM asserts on it)
    let t0 = Instant::now();
    let mut d = sched("Push", "kv_consumer");
    let r = remote_prefill("r1");
    d.update_state_after_alloc(&r, vec![4, 5], 100, t0);
    let _ = d.build_connector_meta(t0);
    let (delay, _) = d.request_finished(&r, &[4, 5]);
    assert!(delay, "looked aborted with its registration out");
    d.update_connector_output(&Finished {
        recving: vec!["r1".into()],
        ..Finished::default()
    });
    let m = d.build_connector_meta(t0);
    assert!(
        m.cancel_registrations.is_empty(),
        "withdrew a receive the engine freed"
    );
    assert!(!d.has_pending_push_work());
    // an abort whose receive goes on is withdrawn as before
    let r2 = remote_prefill("r2");
    d.update_state_after_alloc(&r2, vec![6], 100, t0);
    let _ = d.build_connector_meta(t0);
    assert!(d.request_finished(&r2, &[6]).0);
    assert_eq!(
        d.build_connector_meta(t0).cancel_registrations,
        vec!["r2".to_string()]
    );
}

fn bidirectional(role: &str, extra: &str) -> Scheduler {
    let cfg = KvTransferConfig::from_json(&format!(
        r#"{{"kv_connector":"KvrailPullConnector","kv_role":"{role}",
            "kv_connector_extra_config":{{"bidirectional_kv_xfer":true,
            "decoder_kv_blocks_ttl":60{extra}}}}}"#
    ))
    .unwrap();
    Scheduler::new(cfg, "decode", "127.0.0.1:7100".parse().unwrap(), 1)
}

fn ran_to_end(computed: u64) -> RequestEnd {
    RequestEnd {
        completed: true,
        computed_tokens: computed,
    }
}

/// Seed 003, D: a decode leg that ran to its end keeps its blocks for the TTL and returns
/// the next turn's parameters, the expiry in D's clock; an aborted one, or one without the
/// setting, gives its blocks back at once.
#[test]
fn d_keeps_a_finished_turn_for_its_ttl_and_names_it_in_the_parameters() {
    for skew in [-3_600_000_000_i64, 0, 3_600_000_000] {
        let mut d = bidirectional("kv_consumer", "");
        d.skew_clock(skew);
        let turn1 = remote_prefill("t1");
        let before = (super::super::clock::now_us() + skew) as f64 / 1e6;
        let (keep, p) = d.request_finished_as(&turn1, &[9, 10, 11], ran_to_end(40));
        let after = (super::super::clock::now_us() + skew) as f64 / 1e6;
        assert!(keep);
        let p = p.expect("the next turn's parameters");
        assert!(p.do_remote_decode && !p.do_remote_prefill);
        assert_eq!(p.remote_engine_id, "decode");
        assert_eq!((p.remote_host.as_str(), p.remote_port), ("127.0.0.1", 7100));
        assert_eq!(p.remote_block_ids, vec![9, 10, 11]);
        assert_eq!(p.remote_request_id, "t1");
        assert_eq!(p.remote_num_tokens, 40);
        let expiry = p.remote_blocks_expiry_time.unwrap();
        assert!(
            expiry >= before + 60.0 && expiry <= after + 60.0,
            "skew {skew}: {expiry}"
        );
        assert!(p.reads_back(false));
        assert_eq!(d.kept(), 1);
        let m = d.build_connector_meta(Instant::now());
        assert_eq!(m.reqs_to_send.len(), 1);
        assert_eq!(m.reqs_to_send[0].keep_s, Some(60));
        // in the JSON as NixlConnector's keys
        let j: serde_json::Value = serde_json::to_value(&p).unwrap();
        assert_eq!(j["remote_num_tokens"], 40);
        assert!(j["remote_blocks_expiry_time"].as_f64().is_some());
        assert!(j.get("_remote_blocks_processed").is_none());
        // the workers' report gives them back
        d.update_connector_output(&Finished {
            sending: vec!["t1".into()],
            ..Finished::default()
        });
        assert_eq!(d.kept(), 0);
    }
    let mut d = bidirectional("kv_consumer", "");
    let aborted = RequestEnd {
        completed: false,
        computed_tokens: 40,
    };
    assert_eq!(
        d.request_finished_as(&remote_prefill("t2"), &[1], aborted),
        (false, None)
    );
    let mut plain = sched("Pull", "kv_consumer");
    assert_eq!(
        plain.request_finished_as(&remote_prefill("t3"), &[1], ran_to_end(40)),
        (false, None)
    );
}

fn next_turn(prompt: u64, extra: serde_json::Value) -> EngineRequest {
    let mut j = serde_json::json!({
        "do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": "decode", "remote_host": "127.0.0.1", "remote_port": 7100,
        "remote_block_ids": [9, 10, 11], "remote_request_id": "t1", "tp_size": 1,
        "remote_num_tokens": 40, "remote_blocks_expiry_time": 1234.5,
    });
    for (k, v) in extra.as_object().unwrap() {
        j[k] = v.clone();
    }
    EngineRequest {
        request_id: "turn2".into(),
        prompt_tokens: prompt,
        params: Some(KvTransferParams::from_json(&j.to_string()).unwrap()),
    }
}

/// Seed 003, P: the next turn reads D's tokens back (up to the prompt, beyond what P has
/// cached), with heartbeats to D meanwhile; under `kv_recompute_threshold`, already
/// processed, or without the setting, P computes everything.
#[test]
fn p_reads_the_previous_turn_back_beyond_what_it_has_cached() {
    let t0 = Instant::now();
    let mut p = bidirectional("kv_producer", r#","kv_recompute_threshold":8"#);
    let r = next_turn(70, serde_json::json!({}));
    assert_eq!(p.get_num_new_matched_tokens(&r, 16, t0), (24, true));
    assert_eq!(p.heartbeating(), 1, "D's kept blocks are heartbeated");
    p.update_state_after_alloc(&r, vec![30, 31, 32, 33], 24, t0);
    let m = p.build_connector_meta(t0);
    let recv = &m.reqs_to_recv[0];
    assert!(recv.read_back);
    assert_eq!((recv.tokens, recv.computed), (40, 16));
    assert_eq!(recv.local_block_ids, vec![30, 31, 32, 33]);
    assert_eq!(recv.params.remote_blocks_expiry_time, Some(1234.5));
    // a prompt shorter than D's tokens reads up to the prompt
    let short = next_turn(30, serde_json::json!({}));
    assert_eq!(p.get_num_new_matched_tokens(&short, 0, t0), (30, true));
    // fewer than the threshold: computed here
    assert_eq!(p.get_num_new_matched_tokens(&r, 35, t0), (0, false));
    // processed already (a recompute after a failed read): computed here
    let done = next_turn(70, serde_json::json!({"_remote_blocks_processed": true}));
    assert_eq!(p.get_num_new_matched_tokens(&done, 0, t0), (0, false));
    // without the setting the parameters are a plain prefill leg
    let mut plain = sched("Pull", "kv_producer");
    assert_eq!(plain.get_num_new_matched_tokens(&r, 0, t0), (0, false));
    // bad values are named
    let e = KvTransferParams::from_json(r#"{"remote_blocks_expiry_time": "soon"}"#).unwrap_err();
    assert!(
        matches!(&e, crate::connector::ParamsError::WrongType { key, .. } if key == "remote_blocks_expiry_time"),
        "{e}"
    );
}
