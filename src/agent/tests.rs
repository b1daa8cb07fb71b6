use super::*;

#[test]
fn zero_length_and_bad_names_are_refused() {
    let a = Agent::new("t0", AgentConfig::default()).unwrap();
    assert!(a.register(0, RemoteAccess::NONE, vec![]).is_err());
    assert!(Agent::new("", AgentConfig::default()).is_err());
    let e = Agent::new(
        "t1",
        AgentConfig {
            stripe_width: Some(3),
            ..AgentConfig::default()
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with("stripe_width: 3 is not allowed"),
        "{e}"
    );
}

mod fencing;
mod strangers;

/// Defect: devices named in the configuration that do not exist fell back to TCP silently.
#[cfg(feature = "verbs")]
#[test]
fn named_devices_that_are_not_there_fail_the_start() {
    for backend in [BackendChoice::Auto, BackendChoice::Verbs] {
        let e = Agent::new(
            "t2",
            AgentConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                backend,
                devices: vec!["nosuchdev".into()],
                ..AgentConfig::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("nosuchdev"), "{backend:?}: {e}");
    }
}
