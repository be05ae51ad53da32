//! Agent names: unique in a process by default, shared on request (NIXL allows two live
//! agents with one name, and its Python tests make them); and `check_remote_md` on an
//! agent without a metadata exchange (metadata loaded from a side channel).

use ferry::{Agent, AgentConfig, Error, NamePolicy, Params};
use ferry_tests::unique;

#[test]
fn a_second_live_agent_with_a_name_is_refused_unless_shared() {
    let name = unique("names");
    let first = Agent::new(AgentConfig::named(&name)).expect("first");
    let e = Agent::new(AgentConfig::named(&name)).expect_err("a unique name taken");
    assert!(matches!(e, Error::NotAllowed { .. }), "{e}");
    let shared = AgentConfig::named(&name).with_name_policy(NamePolicy::Shared);
    let second = Agent::new(shared.clone()).expect("shared");
    let third = Agent::new(shared).expect("shared again");
    assert_eq!(
        (first.name(), second.name(), third.name()),
        (&*name, &*name, &*name)
    );
    drop(first);
    // Two still live: a unique one is still refused.
    assert!(Agent::new(AgentConfig::named(&name)).is_err());
    drop(second);
    drop(third);
    // All gone: the name is free again.
    Agent::new(AgentConfig::named(&name)).expect("free again");
}

#[test]
fn check_remote_md_answers_without_an_exchange() {
    let a = Agent::new(AgentConfig::named(unique("names-a"))).expect("a");
    let b = Agent::new(AgentConfig::named(unique("names-b"))).expect("b");
    a.create_backend("LOOPBACK", &Params::new())
        .expect("loopback");
    b.create_backend("LOOPBACK", &Params::new())
        .expect("loopback");
    assert!(!a.check_remote_md(b.name(), None).expect("not loaded yet"));
    a.load_remote_md(&b.local_md().expect("md")).expect("load");
    assert!(a.check_remote_md(b.name(), None).expect("loaded"));
}
