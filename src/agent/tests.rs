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
