use super::*;
use crate::mem::KvBufferDevice;
use crate::proto::handshake::Direction;

fn parse(s: &str) -> Result<KvTransferConfig, String> {
    KvTransferConfig::from_json(s).map_err(|e| e.to_string())
}

#[test]
fn the_seed_example_and_defaults() {
    let c = parse(
        r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_both","kv_buffer_device":"rbln"}"#,
    )
    .unwrap();
    assert_eq!(c.direction, Direction::Pull);
    assert_eq!(c.role, KvRole::Both);
    assert_eq!(c.buffer_device, KvBufferDevice::Rbln);
    assert_eq!(
        (
            c.lease_duration_s,
            c.decoder_kv_blocks_ttl_s,
            c.push_registration_timeout_s
        ),
        (30, 480, 480)
    );
    assert_eq!((c.heartbeat_interval_s(), c.lease_extension_s()), (5, 20));
    assert!(
        c.enforce_handshake_compat && !c.chunk_mode && !c.push_stream && c.stripe_width.is_none()
    );
    let c = parse(
        r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_producer","engine_id":"p0",
        "kv_connector_extra_config":{"kv_lease_duration":60,"push_stream":true,"stripe_width":0,
        "link_down_exit_s":30,"chunk_mode":true,"chunk_tokens":256,"decoder_kv_blocks_ttl":100}}"#,
    )
    .unwrap();
    assert_eq!(c.direction, Direction::Push);
    assert_eq!(c.engine_id.as_deref(), Some("p0"));
    assert_eq!((c.heartbeat_interval_s(), c.lease_extension_s()), (10, 40));
    assert_eq!(
        c.push_registration_timeout_s, 100,
        "defaults to decoder_kv_blocks_ttl"
    );
    assert_eq!(
        (c.stripe_width, c.link_down_exit_s, c.chunk_tokens),
        (Some(0), 30, Some(256))
    );
    assert_eq!(
        parse(r#"{"kv_connector":"KvrailConnector","kv_role":"kv_consumer"}"#)
            .unwrap()
            .direction,
        Direction::Pull
    );
    assert_eq!(
        c.max_num_batched_tokens, 8192,
        "one prefill step by default"
    );
}

#[test]
fn vllm_keys_are_accepted_and_the_prefill_step_is_configurable() {
    let c = parse(
        r#"{"kv_connector":"KvrailConnector","kv_role":"kv_producer",
        "kv_connector_module_path":"kvrail.vllm","kv_buffer_size":1e9,"kv_rank":0,
        "kv_parallel_size":1,"kv_ip":"127.0.0.1","kv_port":14579,
        "kv_load_failure_policy":"recompute","enable_permute_local_kv":false,
        "kv_connector_extra_config":{"max_num_batched_tokens":2048}}"#,
    )
    .unwrap();
    assert_eq!(c.max_num_batched_tokens, 2048);
    let e = parse(r#"{"kv_connector":"KvrailConnector","kv_role":"kv_producer","kv_module":1}"#)
        .unwrap_err();
    assert!(e.starts_with("kv_module"), "{e}");
    let e = parse(
        r#"{"kv_connector":"KvrailConnector","kv_role":"kv_producer",
        "kv_connector_extra_config":{"max_num_batched_tokens":0}}"#,
    )
    .unwrap_err();
    assert!(e.contains("max_num_batched_tokens"), "{e}");
}

#[test]
fn every_rejection_names_its_key() {
    let base = |extra: &str| {
        format!(
            r#"{{"kv_connector":"KvrailPushConnector","kv_role":"kv_consumer","kv_connector_extra_config":{{{extra}}}}}"#
        )
    };
    let cases: Vec<(String, &str)> = vec![
        ("not json".into(), "kv_transfer_config:"),
        ("[1]".into(), "kv_transfer_config:"),
        (r#"{"kv_role":"kv_both"}"#.into(), "kv_connector: required"),
        (r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#.into(), "kv_connector:"),
        (r#"{"kv_connector":"KvrailPullConnector"}"#.into(), "kv_role: required"),
        (r#"{"kv_connector":"KvrailPullConnector","kv_role":"prefill"}"#.into(), "kv_role:"),
        (r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_both","kv_buffer_device":"cuda"}"#.into(), "kv_buffer_device:"),
        (r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_both","kv_prot":1}"#.into(), "kv_prot: unknown key"),
        (r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_both","engine_id":7}"#.into(), "engine_id:"),
        (r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_both","kv_connector_extra_config":3}"#.into(), "kv_connector_extra_config:"),
        (base(r#""kv_lease":1"#), "kv_connector_extra_config.kv_lease: unknown key"),
        (base(r#""kv_lease_duration":0"#), "kv_connector_extra_config.kv_lease_duration: must be greater than 0"),
        (base(r#""kv_lease_duration":-5"#), "kv_connector_extra_config.kv_lease_duration:"),
        (base(r#""kv_lease_duration":"30""#), "kv_connector_extra_config.kv_lease_duration:"),
        (base(r#""decoder_kv_blocks_ttl":1.5"#), "kv_connector_extra_config.decoder_kv_blocks_ttl:"),
        (base(r#""push_registration_timeout":0"#), "kv_connector_extra_config.push_registration_timeout:"),
        (base(r#""chunk_mode":"yes""#), "kv_connector_extra_config.chunk_mode:"),
        (base(r#""chunk_tokens":64"#), "kv_connector_extra_config.chunk_tokens: needs chunk_mode"),
        (base(r#""stripe_width":2"#), "kv_connector_extra_config.stripe_width:"),
        (base(r#""link_down_exit_s":10"#), "kv_connector_extra_config.link_down_exit_s: only with kv_role kv_producer"),
        (base(r#""enforce_handshake_compat":1"#), "kv_connector_extra_config.enforce_handshake_compat:"),
        (r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_both","kv_connector_extra_config":{"push_stream":true}}"#.into(),
         "kv_connector_extra_config.push_stream: push mode only"),
        (r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"chunk_mode":true}}"#.into(),
         "kv_connector_extra_config.chunk_mode: device to device only"),
        (r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"swa_window_mode":true}}"#.into(),
         "kv_connector_extra_config.swa_window_mode: device to device only"),
    ];
    for (json, want) in cases {
        let e = parse(&json).expect_err(&json);
        assert!(e.starts_with(want), "{json}\n  gave: {e}\n  want: {want}");
    }
    // push_stream moves whole blocks of the engine's own cache: host memory too (vLLM's CPU
    // backend; issue 41)
    let host_stream = r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_producer",
        "kv_buffer_device":"cpu","kv_connector_extra_config":{"push_stream":true}}"#;
    assert!(parse(host_stream).is_ok_and(|c| c.push_stream));
}
