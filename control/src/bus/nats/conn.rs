//! The NATS connection task: connects, handshakes, restores subscriptions, writes commands,
//! dispatches messages, answers pings, probes liveness, and reconnects with backoff.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot, watch};

use super::proto::{self, ServerOp};
use crate::backoff::Backoff;
use crate::bus::{ConnectionState, Delivery, Inbox, Message};
use crate::error::ControlError;

/// Deadline of the TCP connect and of the INFO / CONNECT / PONG handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// A client PING this often; two unanswered ones mean the connection is dead.
const PING_INTERVAL: Duration = Duration::from_secs(2);
/// Commands written per flush at most.
const WRITE_BATCH: usize = 512;

/// What the client handles ask the connection task to do.
pub(crate) enum Command {
    /// Publish (dropped while disconnected).
    Publish {
        subject: String,
        reply: Option<String>,
        payload: Bytes,
    },
    /// Add a subscription (kept across reconnects).
    Subscribe {
        sid: u64,
        subject: String,
        inbox: Inbox,
    },
    /// Remove a subscription.
    Unsubscribe { sid: u64 },
    /// Answer once the server has processed everything sent before (a PING round trip).
    Flush(oneshot::Sender<()>),
}

/// State shared between the task and the handles.
#[derive(Debug)]
pub(crate) struct Shared {
    pub state: watch::Sender<ConnectionState>,
    pub max_payload: AtomicUsize,
}

/// Why a session ended.
enum End {
    /// Every handle is gone: stop.
    Closed,
    /// The connection broke: reconnect.
    Broken(String),
}

/// A subscription as the task keeps it.
struct Sub {
    subject: String,
    inbox: Inbox,
}

struct Session {
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// One entry per PING in flight: a flush waiter, or `None` for a liveness probe.
    pings: VecDeque<Option<oneshot::Sender<()>>>,
}

async fn handshake(addr: &str, name: &str) -> Result<(Session, Option<usize>), ControlError> {
    let broken = |e: &dyn std::fmt::Display| ControlError::Transport {
        backend: "nats",
        message: e.to_string(),
    };
    let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| ControlError::Timeout("nats connect"))?
        .map_err(|e| broken(&e))?;
    stream.set_nodelay(true).map_err(|e| broken(&e))?;
    let (mut reader, mut writer) = stream.into_split();
    let mut rbuf = BytesMut::with_capacity(64 * 1024);
    let mut max_payload = None;
    let mut sent_connect = false;
    let fut = async {
        loop {
            while let Some(op) = proto::parse(&mut rbuf).map_err(|e| broken(&e.0))? {
                match op {
                    ServerOp::Info { max_payload: m } => {
                        max_payload = m;
                        if !sent_connect {
                            writer
                                .write_all(&proto::connect_lines(name))
                                .await
                                .map_err(|e| broken(&e))?;
                            sent_connect = true;
                        }
                    }
                    ServerOp::Pong if sent_connect => return Ok(()),
                    ServerOp::Ping => writer
                        .write_all(b"PONG\r\n")
                        .await
                        .map_err(|e| broken(&e))?,
                    ServerOp::Err(e) => {
                        return Err(ControlError::Server {
                            backend: "nats",
                            message: e,
                        });
                    }
                    _ => {}
                }
            }
            if reader.read_buf(&mut rbuf).await.map_err(|e| broken(&e))? == 0 {
                return Err(broken(&"connection closed during handshake"));
            }
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, fut)
        .await
        .map_err(|_| ControlError::Timeout("nats handshake"))??;
    Ok((
        Session {
            reader,
            writer,
            rbuf,
            wbuf: BytesMut::with_capacity(64 * 1024),
            pings: VecDeque::new(),
        },
        max_payload,
    ))
}

/// Applies a command while disconnected: subscriptions are remembered, the rest dropped.
fn offline(cmd: Command, subs: &mut HashMap<u64, Sub>) {
    match cmd {
        Command::Subscribe {
            sid,
            subject,
            inbox,
        } => {
            subs.insert(sid, Sub { subject, inbox });
        }
        Command::Unsubscribe { sid } => {
            subs.remove(&sid);
        }
        // The waiter sees the sender dropped and goes on.
        Command::Publish { .. } | Command::Flush(_) => {}
    }
}

impl Session {
    fn command(&mut self, cmd: Command, subs: &mut HashMap<u64, Sub>) {
        match cmd {
            Command::Publish {
                subject,
                reply,
                payload,
            } => proto::write_pub(&mut self.wbuf, &subject, reply.as_deref(), &payload),
            Command::Subscribe {
                sid,
                subject,
                inbox,
            } => {
                proto::write_sub(&mut self.wbuf, &subject, sid);
                subs.insert(sid, Sub { subject, inbox });
            }
            Command::Unsubscribe { sid } => {
                if subs.remove(&sid).is_some() {
                    proto::write_unsub(&mut self.wbuf, sid);
                }
            }
            Command::Flush(done) => {
                self.wbuf.extend_from_slice(b"PING\r\n");
                self.pings.push_back(Some(done));
            }
        }
    }

    fn dispatch(
        &mut self,
        op: ServerOp,
        subs: &mut HashMap<u64, Sub>,
        shared: &Shared,
    ) -> Result<(), String> {
        match op {
            ServerOp::Msg {
                subject,
                sid,
                reply,
                payload,
            } => {
                let Some(sub) = subs.get(&sid) else {
                    return Ok(());
                };
                let msg = Message {
                    subject,
                    reply,
                    payload,
                };
                if sub.inbox.deliver(msg) == Delivery::Closed {
                    subs.remove(&sid);
                    proto::write_unsub(&mut self.wbuf, sid);
                }
            }
            ServerOp::Ping => self.wbuf.extend_from_slice(b"PONG\r\n"),
            ServerOp::Pong => {
                if let Some(Some(done)) = self.pings.pop_front() {
                    let _ = done.send(());
                }
            }
            ServerOp::Info { max_payload } => {
                if let Some(m) = max_payload {
                    shared.max_payload.store(m, Ordering::Relaxed);
                }
            }
            ServerOp::Ok => {}
            ServerOp::Err(e) => {
                let lower = e.to_ascii_lowercase();
                // Permission and subject errors leave the connection open; the rest close it.
                if lower.contains("permissions violation") || lower.contains("invalid subject") {
                    tracing::warn!(error = %e, "NATS server error");
                } else {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), String> {
        if self.wbuf.is_empty() {
            return Ok(());
        }
        let data = self.wbuf.split();
        self.writer
            .write_all(&data)
            .await
            .map_err(|e| e.to_string())
    }

    async fn run(
        &mut self,
        cmds: &mut mpsc::Receiver<Command>,
        subs: &mut HashMap<u64, Sub>,
        shared: &Shared,
    ) -> End {
        let mut ping = tokio::time::interval(PING_INTERVAL);
        ping.tick().await;
        loop {
            loop {
                match proto::parse(&mut self.rbuf) {
                    Ok(Some(op)) => {
                        if let Err(e) = self.dispatch(op, subs, shared) {
                            return End::Broken(format!("server error: {e}"));
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return End::Broken(e.0),
                }
            }
            if let Err(e) = self.flush().await {
                return End::Broken(e);
            }
            tokio::select! {
                cmd = cmds.recv() => {
                    let Some(cmd) = cmd else { return End::Closed };
                    self.command(cmd, subs);
                    for _ in 1..WRITE_BATCH {
                        match cmds.try_recv() {
                            Ok(cmd) => self.command(cmd, subs),
                            Err(_) => break,
                        }
                    }
                }
                read = self.reader.read_buf(&mut self.rbuf) => match read {
                    Ok(0) => return End::Broken("connection closed by the server".into()),
                    Ok(_) => {}
                    Err(e) => return End::Broken(e.to_string()),
                },
                _ = ping.tick() => {
                    if self.pings.iter().filter(|p| p.is_none()).count() >= 2 {
                        return End::Broken("no PONG to two PINGs".into());
                    }
                    self.wbuf.extend_from_slice(b"PING\r\n");
                    self.pings.push_back(None);
                }
            }
        }
    }
}

/// Runs the connection until every handle is gone.
pub(crate) async fn run(
    addr: String,
    name: String,
    mut cmds: mpsc::Receiver<Command>,
    shared: Arc<Shared>,
) {
    let mut subs: HashMap<u64, Sub> = HashMap::new();
    let mut epoch = 0u64;
    let mut backoff = Backoff::default();
    loop {
        match handshake(&addr, &name).await {
            Ok((mut session, max_payload)) => {
                backoff.reset();
                epoch += 1;
                if let Some(m) = max_payload {
                    shared.max_payload.store(m, Ordering::Relaxed);
                }
                for (sid, sub) in &subs {
                    proto::write_sub(&mut session.wbuf, &sub.subject, *sid);
                }
                tracing::info!(%addr, epoch, "connected to NATS");
                shared
                    .state
                    .send_replace(ConnectionState::Connected { epoch });
                let end = session.run(&mut cmds, &mut subs, &shared).await;
                shared.state.send_replace(ConnectionState::Disconnected);
                match end {
                    End::Closed => return,
                    End::Broken(why) => tracing::warn!(%addr, %why, "NATS connection lost"),
                }
            }
            Err(e) => tracing::debug!(%addr, error = %e, "cannot connect to NATS"),
        }
        let sleep = tokio::time::sleep(backoff.next_delay());
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                cmd = cmds.recv() => match cmd {
                    Some(cmd) => offline(cmd, &mut subs),
                    None => return,
                },
            }
        }
    }
}
