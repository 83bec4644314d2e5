//! `NatsBus` against a real nats-server process.

use std::time::Duration;

use bytes::Bytes;
use kvmesh_control::testing::{NatsServer, temp_dir};
use kvmesh_control::{ConnectionState, ControlError, EventBus, NatsBus, SUBSCRIPTION_BUFFER};

const SECOND: Duration = Duration::from_secs(1);

async fn recv(sub: &mut kvmesh_control::Subscription) -> kvmesh_control::Message {
    tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .expect("message in time")
        .expect("subscription open")
}

#[tokio::test]
async fn publish_subscribe_request_and_reconnect() {
    let dir = temp_dir("control-nats");
    let mut server = NatsServer::start(&dir).await.expect("nats starts");
    let a = NatsBus::connect(&server.url(), "test-a")
        .await
        .expect("connect a");
    let b = NatsBus::connect(&server.url(), "test-b")
        .await
        .expect("connect b");
    assert_eq!(
        *a.connection_state().borrow(),
        ConnectionState::Connected { epoch: 1 }
    );

    // Wildcard subscription across connections.
    let mut sub = b.subscribe("ns.kv.*").await.expect("subscribe");
    a.publish("ns.kv.m1", Bytes::from_static(b"one"))
        .await
        .expect("publish");
    a.publish("ns.load.m1", Bytes::from_static(b"not me"))
        .await
        .expect("publish");
    a.publish("ns.kv.m2", Bytes::from_static(b"two"))
        .await
        .expect("publish");
    let first = recv(&mut sub).await;
    assert_eq!(
        (first.subject.as_str(), &first.payload[..]),
        ("ns.kv.m1", &b"one"[..])
    );
    assert_eq!(&recv(&mut sub).await.payload[..], b"two");

    // Request-reply through serve().
    let mut service = b.serve("ns.snapshot.01").await.expect("serve");
    let responder = b.clone();
    tokio::spawn(async move {
        while let Some(req) = service.next().await {
            let mut answer = b"re:".to_vec();
            answer.extend_from_slice(&req.payload);
            let _ = responder.reply(&req, Bytes::from(answer)).await;
        }
    });
    let reply = a
        .request("ns.snapshot.01", Bytes::from_static(b"{}"), 5 * SECOND)
        .await
        .expect("reply");
    assert_eq!(&reply[..], b"re:{}");
    // No one serves this subject: the server says so at once (the deadline is far off).
    assert!(matches!(
        a.request("ns.snapshot.none", Bytes::new(), 30 * SECOND)
            .await,
        Err(ControlError::NoResponders(_))
    ));

    // Limits and names are enforced before anything is sent.
    let big = Bytes::from(vec![b'x'; a.max_payload() + 1]);
    assert!(matches!(
        a.publish("ns.kv.m1", big).await,
        Err(ControlError::PayloadTooLarge { .. })
    ));
    assert!(a.publish("ns.kv.*", Bytes::new()).await.is_err());

    // The server goes away: both clients notice, publishing fails fast, and after the
    // restart they reconnect with a new epoch and their subscriptions work again.
    let mut state = b.connection_state();
    let mut a_state = a.connection_state();
    server.kill().await;
    for s in [&mut state, &mut a_state] {
        tokio::time::timeout(
            10 * SECOND,
            s.wait_for(|s| *s == ConnectionState::Disconnected),
        )
        .await
        .expect("disconnect noticed")
        .expect("state open");
    }
    assert!(matches!(
        a.publish("ns.kv.m1", Bytes::new()).await,
        Err(ControlError::Disconnected(_))
    ));
    server.restart().await.expect("nats restarts");
    tokio::time::timeout(
        15 * SECOND,
        state.wait_for(|s| *s == ConnectionState::Connected { epoch: 2 }),
    )
    .await
    .expect("reconnected")
    .expect("state open");
    tokio::time::timeout(
        15 * SECOND,
        a_state.wait_for(|s| matches!(s, ConnectionState::Connected { .. })),
    )
    .await
    .expect("a reconnected")
    .expect("state open");
    // b's subscription is restored once its SUB reached the server: flush to be sure.
    b.flush(5 * SECOND).await.expect("flush");
    a.publish("ns.kv.m3", Bytes::from_static(b"three"))
        .await
        .expect("publish after restart");
    assert_eq!(&recv(&mut sub).await.payload[..], b"three");
    let reply = a
        .request("ns.snapshot.01", Bytes::from_static(b"again"), 5 * SECOND)
        .await
        .expect("reply after restart");
    assert_eq!(&reply[..], b"re:again");
}

#[tokio::test]
async fn a_subscriber_too_far_behind_loses_messages_and_counts_them() {
    let dir = temp_dir("control-nats-overflow");
    let server = NatsServer::start(&dir).await.expect("nats starts");
    let bus = NatsBus::connect(&server.url(), "test-overflow")
        .await
        .expect("connect");
    let mut slow = bus.subscribe("ns.kv.m").await.expect("subscribe");
    let mut marker = bus.subscribe("ns.marker").await.expect("subscribe");
    let extra = 25;
    for i in 0..SUBSCRIPTION_BUFFER + extra {
        bus.publish("ns.kv.m", Bytes::from(i.to_string()))
            .await
            .expect("publish");
    }
    // One connection delivers in order: once the marker is here, every message before it
    // has reached the slow subscription's forwarder, which hands it over or drops it.
    bus.publish("ns.marker", Bytes::from_static(b"end"))
        .await
        .expect("publish");
    assert_eq!(&recv(&mut marker).await.payload[..], b"end");
    let deadline = tokio::time::Instant::now() + 5 * SECOND;
    while slow.dropped() < extra as u64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "drops not counted in time"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(slow.dropped(), extra as u64);
    for i in 0..SUBSCRIPTION_BUFFER {
        assert_eq!(recv(&mut slow).await.payload, Bytes::from(i.to_string()));
    }
}
