//! The in-process store, the model store of the contract: discovery by name, fetch
//! before publish, withdrawal, and liveness (an owner whose manager goes away is
//! invalidated at its watchers at once; a new owner of that name is fetched again).

mod common;

use std::time::Duration;

use common::{blob, FakeAgent};
use ferry_exchange::{ExchangeConfig, InProcessConfig, Route, StoreConfig, Via, FULL_LABEL};

const LONG: Duration = Duration::from_secs(10);

fn config(name: &str) -> ExchangeConfig {
    ExchangeConfig {
        store: StoreConfig::InProcess(InProcessConfig::new(name)),
        fetch_timeout: Duration::from_secs(5),
        ..ExchangeConfig::default()
    }
}

#[test]
fn in_process_store_keeps_the_contract() {
    let cfg = config("contract");
    let mut b = FakeAgent::new("b", cfg.clone());
    assert_eq!(b.manager.store().map(|s| s.0), Some(Route::InProcess));

    // Fetch before publish: answered when the key appears.
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    b.pump();
    assert!(b.fetch_failures.is_empty());
    let a = FakeAgent::new("a", cfg.clone());
    let md = blob("a", 1000);
    a.manager.set_local_md(md.clone());
    a.manager.send_local_md(Via::Store).unwrap();
    b.wait_md("a", FULL_LABEL, &md, LONG);

    // Partial metadata, fetched after publish.
    let part = blob("a/p", 10);
    a.manager
        .send_local_partial_md("p", part.clone(), Via::Store)
        .unwrap();
    b.manager
        .fetch_remote_md("a", Via::Store, Some("p"))
        .unwrap();
    b.wait_md("a", "p", &part, LONG);

    // Withdraw: the watcher is told.
    a.manager.invalidate_local_md(Via::Store).unwrap();
    b.wait_invalidated("a", LONG);

    // Liveness: an owner that goes away without withdrawing is invalidated at once,
    // and a new owner of that name is fetched again.
    a.manager.send_local_md(Via::Store).unwrap();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    b.wait_md("a", FULL_LABEL, &md, LONG);
    b.invalidated.clear();
    drop(a);
    b.wait_invalidated("a", LONG);
    let again = FakeAgent::new("a", cfg);
    let md2 = blob("a", 2000);
    again.manager.set_local_md(md2.clone());
    again.manager.send_local_md(Via::Store).unwrap();
    b.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    b.wait_md("a", FULL_LABEL, &md2, LONG);

    // A fetch of a name nobody publishes times out with an error naming it.
    let short = ExchangeConfig {
        fetch_timeout: Duration::from_millis(100),
        ..config("contract")
    };
    let mut c = FakeAgent::new("c", short);
    c.manager
        .fetch_remote_md("nobody", Via::Store, None)
        .unwrap();
    let e = c.wait_fetch_failure("nobody", LONG);
    assert!(e.to_string().contains("nobody"), "{e}");

    // Stores of other names are apart.
    let mut d = FakeAgent::new("d", {
        let mut cfg = config("other");
        cfg.fetch_timeout = Duration::from_millis(100);
        cfg
    });
    d.manager.fetch_remote_md("a", Via::Store, None).unwrap();
    d.wait_fetch_failure("a", LONG);
}
