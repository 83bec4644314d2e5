//! The in-process registry and bus behave like the real ones.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{next_event, record};
use kvmesh_control::{
    ControlError, EventBus, InProcessBus, InProcessRegistry, Namespace, Registry,
    SUBSCRIPTION_BUFFER, WatchEvent,
};

#[tokio::test]
async fn registry_leases_expire_and_watches_follow() {
    let reg = InProcessRegistry::new();
    let ns = Namespace::default();
    let a = record(&ns, "m", 1);
    let key_a = ns.instance_key("m", a.instance_id);
    let other = ns.instance_key("other-model", a.instance_id);
    reg.put(&key_a, &a, None).await.expect("put");
    let mut watch = reg.watch(&ns.model_prefix("m"));
    assert!(matches!(next_event(&mut watch, 2).await, WatchEvent::Put { key, .. } if key == key_a));
    assert_eq!(next_event(&mut watch, 2).await, WatchEvent::Synced);

    reg.put(&other, &a, None).await.expect("put other model");
    let lease = reg
        .grant_lease(Duration::from_secs(1))
        .await
        .expect("lease");
    let b = record(&ns, "m", 2);
    let key_b = ns.instance_key("m", b.instance_id);
    reg.put(&key_b, &b, Some(lease)).await.expect("put b");
    // The other model's key is outside the watched prefix.
    assert!(matches!(next_event(&mut watch, 2).await, WatchEvent::Put { key, .. } if key == key_b));
    assert_eq!(
        next_event(&mut watch, 3).await,
        WatchEvent::Delete { key: key_b.clone() }
    );
    assert!(matches!(
        reg.keep_alive(lease).await,
        Err(ControlError::LeaseNotFound(_))
    ));

    let kept = reg
        .grant_lease(Duration::from_secs(1))
        .await
        .expect("lease");
    reg.put(&key_b, &b, Some(kept)).await.expect("put b again");
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        reg.keep_alive(kept).await.expect("kept alive");
    }
    assert_eq!(
        reg.list(&ns.model_prefix("m"))
            .await
            .expect("list")
            .records
            .len(),
        2
    );
    reg.revoke(kept).await.expect("revoke");
    reg.delete(&key_a).await.expect("delete");
    let mut deleted = vec![];
    while deleted.len() < 2 {
        if let WatchEvent::Delete { key } = next_event(&mut watch, 2).await {
            deleted.push(key);
        }
    }
    deleted.sort();
    let mut expected = vec![key_a, key_b];
    expected.sort();
    assert_eq!(deleted, expected);
}

#[tokio::test]
async fn bus_routes_wildcards_and_requests() {
    let bus = InProcessBus::new();
    let mut all = bus.subscribe("ns.>").await.expect("subscribe");
    let mut kv = bus.subscribe("ns.kv.*").await.expect("subscribe");
    bus.publish("ns.kv.m", Bytes::from_static(b"1"))
        .await
        .expect("publish");
    bus.publish("ns.load.m", Bytes::from_static(b"2"))
        .await
        .expect("publish");
    assert_eq!(&kv.next().await.expect("kv").payload[..], b"1");
    assert_eq!(&all.next().await.expect("all").payload[..], b"1");
    assert_eq!(&all.next().await.expect("all").payload[..], b"2");
    assert!(
        tokio::time::timeout(Duration::from_millis(50), kv.next())
            .await
            .is_err()
    );

    let mut service = bus.serve("ns.snapshot.1").await.expect("serve");
    let responder = bus.clone();
    tokio::spawn(async move {
        while let Some(req) = service.next().await {
            let _ = responder.reply(&req, req.payload.clone()).await;
        }
    });
    let reply = bus
        .request(
            "ns.snapshot.1",
            Bytes::from_static(b"ping"),
            Duration::from_secs(1),
        )
        .await
        .expect("reply");
    assert_eq!(&reply[..], b"ping");
    assert!(matches!(
        bus.request("ns.snapshot.2", Bytes::new(), Duration::from_millis(50))
            .await,
        Err(ControlError::Timeout(_))
    ));
    drop(kv);
    bus.publish("ns.kv.m", Bytes::from_static(b"3"))
        .await
        .expect("publish");
    // The wildcard subscriber saw the requests too, with their reply subjects.
    let request = all.next().await.expect("all");
    assert_eq!(request.subject, "ns.snapshot.1");
    assert!(request.reply.is_some());
    assert_eq!(all.next().await.expect("all").subject, "ns.snapshot.2");
    assert_eq!(&all.next().await.expect("all").payload[..], b"3");
}

#[tokio::test]
async fn a_full_subscriber_loses_only_its_own_messages_and_counts_them() {
    let bus = InProcessBus::new();
    let mut slow = bus.subscribe("ns.kv.m").await.expect("subscribe");
    let mut other = bus.subscribe("ns.kv.*").await.expect("subscribe");
    for i in 0..SUBSCRIPTION_BUFFER + 3 {
        bus.publish("ns.kv.m", Bytes::from(i.to_string()))
            .await
            .expect("publish");
        // The other subscriber keeps up and loses nothing.
        assert_eq!(
            other.next().await.unwrap().payload,
            Bytes::from(i.to_string())
        );
    }
    assert_eq!((slow.dropped(), other.dropped()), (3, 0));
    let first = slow.next().await.unwrap();
    assert_eq!(&first.payload[..], b"0");
}
