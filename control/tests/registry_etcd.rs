//! `EtcdRegistry` against a real etcd process.

mod common;

use std::time::Duration;

use common::{next_event, record};
use kvmesh_control::testing::{EtcdServer, temp_dir};
use kvmesh_control::{ControlError, EtcdRegistry, InstanceState, Namespace, Registry, WatchEvent};

#[tokio::test]
async fn records_leases_and_watch_against_real_etcd() {
    let dir = temp_dir("control-etcd");
    let mut etcd = EtcdServer::start(&dir).await.expect("etcd starts");
    let reg = EtcdRegistry::new(&etcd.url()).expect("client");
    let ns = Namespace::default();
    let model = "org/model.v1";
    let a = record(&ns, model, 1);
    let key_a = ns.instance_key(model, a.instance_id);

    // A record under a lease, listed back.
    let lease = reg
        .grant_lease(Duration::from_secs(10))
        .await
        .expect("lease");
    reg.put(&key_a, &a, Some(lease)).await.expect("put");
    let listing = reg.list(&ns.instances_prefix()).await.expect("list");
    assert_eq!(listing.records, vec![(key_a.clone(), a.clone())]);
    assert!(listing.revision > 0);
    assert_eq!(
        reg.keep_alive(lease).await.expect("alive"),
        Duration::from_secs(10)
    );

    // The watch starts with the listing, then follows changes.
    let mut watch = reg.watch(&ns.instances_prefix());
    assert_eq!(
        next_event(&mut watch, 5).await,
        WatchEvent::Put {
            key: key_a.clone(),
            record: a.clone()
        }
    );
    assert_eq!(next_event(&mut watch, 5).await, WatchEvent::Synced);
    let mut draining = a.clone();
    draining.state = InstanceState::Draining;
    reg.put(&key_a, &draining, Some(lease))
        .await
        .expect("update");
    assert_eq!(
        next_event(&mut watch, 5).await,
        WatchEvent::Put {
            key: key_a.clone(),
            record: draining
        }
    );

    // Revoking the lease deletes the record; the lease is gone afterwards.
    reg.revoke(lease).await.expect("revoke");
    assert_eq!(
        next_event(&mut watch, 5).await,
        WatchEvent::Delete { key: key_a.clone() }
    );
    assert!(matches!(
        reg.keep_alive(lease).await,
        Err(ControlError::LeaseNotFound(_))
    ));
    assert!(matches!(
        reg.put(&key_a, &a, Some(lease)).await,
        Err(ControlError::LeaseNotFound(_))
    ));

    // A lease that is not kept alive expires and takes its record with it.
    let short = reg
        .grant_lease(Duration::from_secs(1))
        .await
        .expect("lease");
    let b = record(&ns, model, 2);
    let key_b = ns.instance_key(model, b.instance_id);
    reg.put(&key_b, &b, Some(short)).await.expect("put b");
    assert!(matches!(next_event(&mut watch, 5).await, WatchEvent::Put { key, .. } if key == key_b));
    assert_eq!(
        next_event(&mut watch, 10).await,
        WatchEvent::Delete { key: key_b }
    );

    // etcd down: the watch says so and keeps what it knows; back up: it re-lists and emits
    // only what changed meanwhile.
    let c = record(&ns, model, 3);
    let key_c = ns.instance_key(model, c.instance_id);
    reg.put(&key_c, &c, None).await.expect("put c");
    assert!(matches!(next_event(&mut watch, 5).await, WatchEvent::Put { key, .. } if key == key_c));
    etcd.kill().await;
    assert_eq!(next_event(&mut watch, 10).await, WatchEvent::Disconnected);
    assert!(reg.list(&ns.instances_prefix()).await.is_err());
    etcd.restart().await.expect("etcd restarts");
    let d = record(&ns, model, 4);
    let key_d = ns.instance_key(model, d.instance_id);
    reg.put(&key_d, &d, None)
        .await
        .expect("put d after restart");
    let mut seen = Vec::new();
    loop {
        match next_event(&mut watch, 15).await {
            WatchEvent::Put { key, .. } => seen.push(key),
            WatchEvent::Synced | WatchEvent::Disconnected => {}
            WatchEvent::Delete { key } => panic!("{key} deleted after restart"),
        }
        if seen.contains(&key_d) {
            break;
        }
    }
    assert!(
        !seen.contains(&key_c),
        "unchanged record re-emitted: {seen:?}"
    );
    // The re-list after the restart may end with `Synced` after the put of d was seen live.
    reg.delete(&key_c).await.expect("delete c");
    let deleted = loop {
        match next_event(&mut watch, 5).await {
            WatchEvent::Synced => {}
            other => break other,
        }
    };
    assert_eq!(deleted, WatchEvent::Delete { key: key_c });
}

#[tokio::test]
async fn a_member_that_does_not_answer_hands_over_to_the_next() {
    let dir = temp_dir("control-etcd-members");
    let etcd = EtcdServer::start(&dir).await.expect("etcd starts");
    // A port nothing listens on: connections to it are refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let reg = EtcdRegistry::new(&format!("http://{dead},{}", etcd.url())).expect("client");
    let ns = Namespace::default();
    let model = "org/model.v1";
    let a = record(&ns, model, 1);
    let key_a = ns.instance_key(model, a.instance_id);

    // The first call finds the dead member, moves on and succeeds; later calls and the
    // watch stay on the live one.
    reg.put(&key_a, &a, None)
        .await
        .expect("put through the live member");
    let listing = reg.list(&ns.instances_prefix()).await.expect("list");
    assert_eq!(listing.records, vec![(key_a.clone(), a.clone())]);
    let mut watch = reg.watch(&ns.instances_prefix());
    assert!(matches!(next_event(&mut watch, 5).await, WatchEvent::Put { key, .. } if key == key_a));
    assert_eq!(next_event(&mut watch, 5).await, WatchEvent::Synced);
    reg.delete(&key_a).await.expect("delete");
    assert_eq!(
        next_event(&mut watch, 5).await,
        WatchEvent::Delete { key: key_a }
    );
}

#[tokio::test]
async fn a_call_a_hung_member_holds_is_answered_by_the_next_within_the_hedge() {
    let dir = temp_dir("control-etcd-hung");
    let etcd = EtcdServer::start(&dir).await.expect("etcd starts");
    // A member that hangs (a stopped process): the kernel completes its connections, and
    // nothing ever answers on them. Held open for the whole test.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let hung_addr = hung.local_addr().expect("addr");
    let reg = EtcdRegistry::new(&format!("http://{hung_addr},{}", etcd.url())).expect("client");
    let ns = Namespace::default();
    let a = record(&ns, "org/model.v1", 1);
    let key_a = ns.instance_key("org/model.v1", a.instance_id);

    // The call goes to the next member a second after the hung one got it, and is answered
    // there: well before the hung member's 5 s call timeout.
    let started = std::time::Instant::now();
    reg.put(&key_a, &a, None)
        .await
        .expect("put through the live member");
    let first = started.elapsed();
    assert!(
        first >= Duration::from_millis(900) && first < Duration::from_secs(3),
        "the first call took {first:?}"
    );
    // The member that answered is the one in use: the next call does not wait on the hung one.
    let started = std::time::Instant::now();
    let listing = reg.list(&ns.instances_prefix()).await.expect("list");
    assert_eq!(listing.records, vec![(key_a, a)]);
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "the second call took {:?}",
        started.elapsed()
    );
    drop(hung);
}
