//! Launchers of real `etcd` and `nats-server` processes on free loopback ports, for tests
//! (cargo feature `testing`). Readiness is polled (etcd's `/health`, NATS's `INFO` greeting),
//! never slept for. The binaries are looked up as `$KVMESH_ETCD_BIN` / `$KVMESH_NATS_BIN`, else
//! `etcd` / `nats-server` on `PATH` (Debian: `etcd-server`, `nats-server`; nats-server is in
//! `/usr/sbin`, which is searched too). [`temp_dir()`] gives each test a directory for their
//! data.

mod temp_dir;

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

pub use temp_dir::{TempDir, temp_dir};

/// How long a server may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between readiness probes.
const PROBE_EVERY: Duration = Duration::from_millis(50);

/// A record of instance `id` of `model` at `http://127.0.0.1:{8000 + id}`, ready, 16-token
/// blocks, 1,024 blocks of capacity.
pub fn instance_record(ns: &crate::Namespace, model: &str, id: u64) -> crate::InstanceRecord {
    let instance_id = crate::InstanceId(id);
    crate::InstanceRecord {
        instance_id,
        model: model.to_owned(),
        url: format!("http://127.0.0.1:{}", 8000 + id),
        protocol: "http1".into(),
        block_size: 16,
        total_blocks: 1024,
        dp_ranks: 1,
        labels: Default::default(),
        adapters: Vec::new(),
        event_subject: ns.event_subject(model),
        snapshot_subject: ns.snapshot_subject(instance_id),
        state: crate::InstanceState::Ready,
        role: crate::InstanceRole::Both,
    }
}

/// The ports [`free_port`] hands out: below Linux's default ephemeral range (32768–60999), so
/// an outgoing connection's local port cannot take one between the draw and the server's bind.
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_768;

/// The next port [`free_port`] tries, as an offset into [`TEST_PORTS`]; starts where the
/// process id points, so test processes running at once draw from different places.
static NEXT_PORT: std::sync::OnceLock<std::sync::atomic::AtomicU32> = std::sync::OnceLock::new();

/// A free TCP port on 127.0.0.1 (free when asked; the server binds it right after). No port
/// is handed out twice in a process until all of [`TEST_PORTS`] has been.
pub fn free_port() -> io::Result<u16> {
    use std::sync::atomic::Ordering;
    let span = u32::from(TEST_PORTS.end - TEST_PORTS.start);
    let next = NEXT_PORT
        .get_or_init(|| std::sync::atomic::AtomicU32::new(std::process::id().wrapping_mul(97)));
    for _ in 0..span {
        let offset = next.fetch_add(1, Ordering::Relaxed) % span;
        let port = TEST_PORTS.start + u16::try_from(offset).expect("offset < span");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("no free port in {TEST_PORTS:?}"),
    ))
}

/// How many times a server is started on fresh free ports: a port free when asked can still
/// be taken before the server binds it (by another test process's server), and the server
/// then exits at once.
const START_ATTEMPTS: usize = 3;

/// Runs `start` (a server started on newly drawn free ports) again, up to [`START_ATTEMPTS`]
/// times in all, while it fails because a port was taken; `start` gets the attempt's number
/// (from 1), to clear what the failed one before it left.
async fn on_fresh_ports<T, F, Fut>(mut start: F) -> io::Result<T>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = io::Result<T>>,
{
    let mut attempt = 1;
    loop {
        match start(attempt).await {
            Err(error)
                if attempt < START_ATTEMPTS
                    && error.to_string().contains("address already in use") =>
            {
                attempt += 1;
            }
            result => return result,
        }
    }
}

fn find_binary(env: &str, name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env) {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn spawn(bin: &Path, args: &[String], log: &Path) -> io::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("starting {}: {e}", bin.display())))
}

async fn wait_ready<F, Fut>(
    child: &mut Child,
    what: &str,
    log: &Path,
    mut probe: F,
) -> io::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if probe().await {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let logs = std::fs::read_to_string(log).unwrap_or_default();
            return Err(io::Error::other(format!(
                "{what} exited with {status}:\n{logs}"
            )));
        }
        if Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "{what} not ready in {READY_TIMEOUT:?}"
            )));
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// Reads from `addr` after sending `request`, up to 4 KiB or 1 s.
async fn exchange(addr: &str, request: &[u8]) -> Option<String> {
    let fut = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        if !request.is_empty() {
            stream.write_all(request).await.ok()?;
        }
        let mut buf = vec![0u8; 4096];
        let mut len = 0;
        while len < buf.len() {
            match stream.read(&mut buf[len..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => len += n,
            }
            if request.is_empty() && buf[..len].ends_with(b"\r\n") {
                break;
            }
        }
        Some(String::from_utf8_lossy(&buf[..len]).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(1), fut)
        .await
        .ok()
        .flatten()
}

/// Sends signal `name` (`STOP`, `CONT`, `TERM`, …) to process `pid`.
pub fn signal(pid: u32, name: &str) -> io::Result<()> {
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!("kill -{name} {pid}: {status}")))
    }
}

/// Sends signal `name` to `child`, if it runs.
fn signal_child(child: Option<&Child>, name: &str) -> io::Result<()> {
    match child.and_then(Child::id) {
        Some(pid) => signal(pid, name),
        None => Err(io::Error::other("the process is not running")),
    }
}

/// Stops a child with SIGKILL and reaps it.
async fn kill_child(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill().await;
    }
}

/// TLS of an [`EtcdServer`]'s client port (PEM files).
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The server certificate (for `127.0.0.1`).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA that signs client certificates.
    pub ca: PathBuf,
    /// Whether clients must present a certificate signed by `ca` (`--client-cert-auth`).
    pub client_cert_auth: bool,
}

/// A running `etcd` with its data in a directory; killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    dir: PathBuf,
    /// The member's name in its cluster.
    name: String,
    /// `--initial-cluster`: every member's `name=peer URL`.
    initial_cluster: String,
    client_port: u16,
    peer_port: u16,
    /// Plaintext `/health` (`--listen-metrics-urls`), probed for readiness.
    metrics_port: u16,
    tls: Option<EtcdTls>,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd with its data under `dir` on free loopback ports and waits until healthy.
    pub async fn start(dir: &Path) -> io::Result<Self> {
        Self::start_with(dir, None).await
    }

    /// Starts etcd with TLS on its client port (`https://`), as [`EtcdServer::start`] does.
    pub async fn start_tls(dir: &Path, tls: EtcdTls) -> io::Result<Self> {
        Self::start_with(dir, Some(tls)).await
    }

    async fn start_with(dir: &Path, tls: Option<EtcdTls>) -> io::Result<Self> {
        on_fresh_ports(|attempt| {
            let tls = tls.clone();
            async move {
                if attempt > 1 {
                    // The failed member exited; a new one on new ports keeps nothing of it.
                    let _ = std::fs::remove_dir_all(dir.join("data"));
                    let _ = std::fs::remove_file(dir.join("etcd.log"));
                }
                let mut server = Self::member(dir, "kvmesh-test", tls)?;
                server.initial_cluster = format!("kvmesh-test={}", server.peer_url());
                server.launch().await?;
                Ok(server)
            }
        })
        .await
    }

    /// A member named `name` on free ports, not started, alone in its cluster.
    fn member(dir: &Path, name: &str, tls: Option<EtcdTls>) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_owned(),
            name: name.to_owned(),
            initial_cluster: String::new(),
            client_port: free_port()?,
            peer_port: free_port()?,
            metrics_port: free_port()?,
            tls,
            child: None,
        })
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    async fn launch(&mut self) -> io::Result<()> {
        self.spawn()?;
        self.wait_healthy().await
    }

    /// Starts the process without waiting (members of a cluster wait for each other).
    fn spawn(&mut self) -> io::Result<()> {
        let client = self.url();
        let peer = self.peer_url();
        let mut args = vec![
            "--name".into(),
            self.name.clone(),
            "--data-dir".into(),
            self.dir.join("data").display().to_string(),
            "--listen-client-urls".into(),
            client.clone(),
            "--advertise-client-urls".into(),
            client,
            "--listen-peer-urls".into(),
            peer.clone(),
            "--initial-advertise-peer-urls".into(),
            peer.clone(),
            "--initial-cluster".into(),
            self.initial_cluster.clone(),
            "--log-level".into(),
            "warn".into(),
            "--listen-metrics-urls".into(),
            format!("http://127.0.0.1:{}", self.metrics_port),
        ];
        if let Some(tls) = &self.tls {
            for (flag, path) in [
                ("--cert-file", &tls.cert),
                ("--key-file", &tls.key),
                ("--trusted-ca-file", &tls.ca),
            ] {
                args.push(flag.into());
                args.push(path.display().to_string());
            }
            if tls.client_cert_auth {
                args.push("--client-cert-auth".into());
            }
        }
        let log = self.dir.join("etcd.log");
        self.child = Some(spawn(&find_binary("KVMESH_ETCD_BIN", "etcd"), &args, &log)?);
        Ok(())
    }

    /// Waits until the member reports healthy (its cluster has a leader).
    async fn wait_healthy(&mut self) -> io::Result<()> {
        let log = self.dir.join("etcd.log");
        let Some(child) = self.child.as_mut() else {
            return Err(io::Error::other("etcd is not running"));
        };
        let addr = format!("127.0.0.1:{}", self.metrics_port);
        let request = b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        wait_ready(child, "etcd", &log, || async {
            exchange(&addr, request)
                .await
                .is_some_and(|r| r.contains("\"health\":\"true\""))
        })
        .await
    }

    /// The client URL, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Kills etcd with SIGKILL (its data stays).
    pub async fn kill(&mut self) {
        kill_child(&mut self.child).await;
    }

    /// Stops etcd with SIGSTOP: it hangs with its connections open (no reset, no answer)
    /// until [`EtcdServer::resume`].
    pub fn pause(&self) -> io::Result<()> {
        signal_child(self.child.as_ref(), "STOP")
    }

    /// Lets a paused etcd go on (SIGCONT).
    pub fn resume(&self) -> io::Result<()> {
        signal_child(self.child.as_ref(), "CONT")
    }

    /// Starts etcd again on the same ports with the same data (killing it first if running).
    pub async fn restart(&mut self) -> io::Result<()> {
        self.kill().await;
        self.launch().await
    }

    /// Starts etcd again on the same ports with its data wiped: every key and lease is gone,
    /// as after losing the cluster.
    pub async fn restart_empty(&mut self) -> io::Result<()> {
        self.kill().await;
        match std::fs::remove_dir_all(self.dir.join("data")) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        self.launch().await
    }
}

/// A cluster of several etcd members on loopback (plaintext), each with its data under
/// `dir/{name}`; killed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts `size` members and waits until every one is healthy (a leader is elected).
    pub async fn start(dir: &Path, size: usize) -> io::Result<Self> {
        on_fresh_ports(|attempt| async move {
            let member_dir = |i: usize| dir.join(format!("member-{i}"));
            if attempt > 1 {
                // The failed attempt's members are killed with it; new ones on new ports
                // form a new cluster and keep nothing of theirs.
                for i in 0..size {
                    let _ = std::fs::remove_dir_all(member_dir(i));
                }
            }
            let mut members = (0..size)
                .map(|i| EtcdServer::member(&member_dir(i), &format!("m{i}"), None))
                .collect::<io::Result<Vec<_>>>()?;
            let initial_cluster = members
                .iter()
                .map(|m| format!("{}={}", m.name, m.peer_url()))
                .collect::<Vec<_>>()
                .join(",");
            for member in &mut members {
                member.initial_cluster.clone_from(&initial_cluster);
                member.spawn()?;
            }
            for member in &mut members {
                member.wait_healthy().await?;
            }
            Ok(Self { members })
        })
        .await
    }

    /// Every member's client URL, comma-separated (what `--etcd` and `discovery.endpoint`
    /// take).
    pub fn urls(&self) -> String {
        self.members
            .iter()
            .map(EtcdServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The position of the member that leads now, asked of the members that answer.
    pub async fn leader(&self) -> io::Result<usize> {
        // Each answering member's own id and the leader it names.
        let mut seen = Vec::new();
        for (i, member) in self.members.iter().enumerate() {
            let Ok(mut client) = etcd_client::Client::connect([member.url()], None).await else {
                continue;
            };
            if let Ok(status) = client.status().await
                && let Some(id) = status.header().map(|h| h.member_id())
            {
                seen.push((i, id, status.leader()));
            }
        }
        seen.iter()
            .find(|(_, id, _)| seen.iter().any(|(_, _, leader)| leader == id))
            .map(|(i, _, _)| *i)
            .ok_or_else(|| io::Error::other("no etcd member names a leader"))
    }

    /// Kills member `i` with SIGKILL (its data stays).
    pub async fn kill(&mut self, i: usize) {
        self.members[i].kill().await;
    }

    /// Starts member `i` again with its data and waits until it is healthy.
    pub async fn restart(&mut self, i: usize) -> io::Result<()> {
        self.members[i].restart().await
    }

    /// Stops member `i` with SIGSTOP: it hangs with its connections open.
    pub fn pause(&self, i: usize) -> io::Result<()> {
        self.members[i].pause()
    }

    /// Lets member `i` go on after [`EtcdCluster::pause`].
    pub fn resume(&self, i: usize) -> io::Result<()> {
        self.members[i].resume()
    }
}

/// A running `nats-server`; killed on drop.
#[derive(Debug)]
pub struct NatsServer {
    dir: PathBuf,
    port: u16,
    /// A config file (`-c`), for TLS and auth blocks.
    config: Option<PathBuf>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts nats-server (logs under `dir`) on a free loopback port and waits for its greeting.
    pub async fn start(dir: &Path) -> io::Result<Self> {
        Self::start_with(dir, None).await
    }

    /// Starts nats-server with `config` (nats-server's config syntax: `tls { … }`,
    /// `authorization { … }`, `max_payload`, …) written to `dir/nats.conf`; the address and
    /// port still come from the command line.
    pub async fn start_with_config(dir: &Path, config: &str) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("nats.conf");
        std::fs::write(&path, config)?;
        Self::start_with(dir, Some(path)).await
    }

    async fn start_with(dir: &Path, config: Option<PathBuf>) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        on_fresh_ports(|attempt| {
            let config = config.clone();
            async move {
                if attempt > 1 {
                    let _ = std::fs::remove_file(dir.join("nats.log"));
                }
                let mut server = Self {
                    dir: dir.to_owned(),
                    port: free_port()?,
                    config,
                    child: None,
                };
                server.launch().await?;
                Ok(server)
            }
        })
        .await
    }

    async fn launch(&mut self) -> io::Result<()> {
        let mut args = vec![
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            self.port.to_string(),
        ];
        if let Some(config) = &self.config {
            args.push("-c".into());
            args.push(config.display().to_string());
        }
        let log = self.dir.join("nats.log");
        let mut child = spawn(&find_binary("KVMESH_NATS_BIN", "nats-server"), &args, &log)?;
        let addr = format!("127.0.0.1:{}", self.port);
        wait_ready(&mut child, "nats-server", &log, || async {
            exchange(&addr, b"")
                .await
                .is_some_and(|r| r.starts_with("INFO "))
        })
        .await?;
        self.child = Some(child);
        Ok(())
    }

    /// The client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops nats-server with SIGSTOP: it hangs with its connections open (no reset, no
    /// answer) until [`NatsServer::resume`].
    pub fn pause(&self) -> io::Result<()> {
        self.signal("STOP")
    }

    /// Lets a paused nats-server go on (SIGCONT).
    pub fn resume(&self) -> io::Result<()> {
        self.signal("CONT")
    }

    fn signal(&self, name: &str) -> io::Result<()> {
        signal_child(self.child.as_ref(), name)
    }

    /// Kills nats-server with SIGKILL.
    pub async fn kill(&mut self) {
        kill_child(&mut self.child).await;
    }

    /// Starts nats-server again on the same port (killing it first if running).
    pub async fn restart(&mut self) -> io::Result<()> {
        self.kill().await;
        self.launch().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports = (0..200).map(|_| free_port().unwrap()).collect::<Vec<_>>();
        let distinct = ports.iter().collect::<std::collections::BTreeSet<_>>();
        assert_eq!(distinct.len(), ports.len());
        for port in ports {
            assert!(TEST_PORTS.contains(&port), "{port}");
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
