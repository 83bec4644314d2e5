//! A TCP relay on loopback that can go silent: a network partition between two processes,
//! where bytes stop flowing but no connection is reset or refused, and that can heal.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Relays every connection made to [`TcpRelay::addr`] to `upstream`; stopped on drop.
#[derive(Debug)]
pub struct TcpRelay {
    addr: SocketAddr,
    silent: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl TcpRelay {
    /// Listens on a free loopback port and relays to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (silent, gate) = watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let gate = gate.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, gate).await;
                    }
                });
            }
        });
        Ok(Self { addr, silent, task })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops every byte in both directions, on open connections and on new ones (which are
    /// still accepted): nothing is reset, nothing answers.
    pub fn silence(&self) {
        self.silent.send_replace(true);
    }

    /// Lets bytes flow again, what was held back first.
    pub fn heal(&self) {
        self.silent.send_replace(false);
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies both ways between `client` and `server` while the gate is open, until either side
/// closes; then closes both.
async fn relay(client: TcpStream, server: TcpStream, gate: watch::Receiver<bool>) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        () = pump(client_read, server_write, gate.clone()) => {}
        () = pump(server_read, client_write, gate) => {}
    }
}

/// Copies `from` into `to`; bytes read while the relay is silent are held until it heals.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut gate: watch::Receiver<bool>) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if gate.wait_for(|silent| !silent).await.is_err() {
            return;
        }
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if gate.wait_for(|silent| !silent).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
