//! Starting the project's binaries and waiting for their readiness lines.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};

/// How long a binary may take to print `READY`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Directory holding the workspace's built binaries: `$KVMESH_BIN_DIR`, or the
/// profile directory this test executable was built into.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVMESH_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    // target/<profile>/deps/<test-binary>
    exe.parent()
        .and_then(|deps| deps.parent())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/debug"))
}

/// A running child process whose listeners are known. Killed on drop.
pub struct Spawned {
    name: String,
    child: Child,
    listeners: Vec<(String, SocketAddr)>,
    log: PathBuf,
}

impl Spawned {
    /// Starts `bin` (a binary of the workspace) with `args`, logs its stderr to
    /// `log_dir`, and waits until it prints `READY`.
    pub fn start(bin: &str, args: &[String], log_dir: &std::path::Path) -> anyhow::Result<Self> {
        Self::launch(bin, &[], args, log_dir, None)
    }

    /// [`Spawned::start`] with `RUST_LOG` set to `rust_log` (what its log then holds is read
    /// back from [`Spawned::log_path`]).
    pub fn start_logging(
        bin: &str,
        args: &[String],
        log_dir: &std::path::Path,
        rust_log: &str,
    ) -> anyhow::Result<Self> {
        Self::launch(bin, &[], args, log_dir, Some(rust_log))
    }

    /// [`Spawned::start`] under `taskset -c 0`: the process sees a machine of one CPU.
    pub fn start_on_one_cpu(
        bin: &str,
        args: &[String],
        log_dir: &std::path::Path,
    ) -> anyhow::Result<Self> {
        Self::launch(bin, &["taskset", "-c", "0"], args, log_dir, None)
    }

    /// [`Spawned::start`] through `wrapper`, a command that execs the binary it is given
    /// (e.g. `faketime -f +30s`).
    pub fn start_wrapped(
        wrapper: &[&str],
        bin: &str,
        args: &[String],
        log_dir: &std::path::Path,
    ) -> anyhow::Result<Self> {
        Self::launch(bin, wrapper, args, log_dir, None)
    }

    /// Starts `bin` through `wrapper` (a command that execs it, or nothing), with `RUST_LOG`
    /// at `rust_log` (else the test's own, else `info`).
    fn launch(
        bin: &str,
        wrapper: &[&str],
        args: &[String],
        log_dir: &std::path::Path,
        rust_log: Option<&str>,
    ) -> anyhow::Result<Self> {
        let path = bin_dir().join(bin);
        if !path.exists() {
            bail!(
                "{} not found: build the workspace binaries first (cargo build --workspace --bins)",
                path.display()
            );
        }
        let log = log_dir.join(format!("{bin}.{}.log", std::process::id()));
        let log = unique_path(log);
        let stderr = std::fs::File::create(&log).context("creating log file")?;
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(&path);
                command
            }
            None => Command::new(&path),
        };
        let mut child = command
            .args(args)
            .env(
                "RUST_LOG",
                rust_log.map_or_else(
                    || std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
                    str::to_string,
                ),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| format!("spawning {}", path.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            // Forward lines until READY, then keep draining so the child never
            // blocks on a full pipe.
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut listeners = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match rx.recv_timeout(left) {
                Ok(line) => line,
                Err(_) => {
                    let _ = child.kill();
                    let logs = std::fs::read_to_string(&log).unwrap_or_default();
                    bail!("{bin} did not print READY within {READY_TIMEOUT:?}; its log:\n{logs}");
                }
            };
            if line.trim() == "READY" {
                break;
            }
            let mut parts = line.split_whitespace();
            if parts.next() == Some("LISTENING")
                && let (Some(name), Some(addr)) = (parts.next(), parts.next())
            {
                let addr: SocketAddr = addr
                    .parse()
                    .with_context(|| format!("bad address in {line:?}"))?;
                listeners.push((name.to_string(), addr));
            }
        }
        Ok(Self {
            name: bin.to_string(),
            child,
            listeners,
            log,
        })
    }

    /// The process's resident memory in bytes (`VmRSS` of `/proc/<pid>/status`; 0 when
    /// unreadable).
    pub fn rss_bytes(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    /// The address of the listener announced as `name`.
    pub fn addr(&self, name: &str) -> SocketAddr {
        self.listeners
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| *a)
            .unwrap_or_else(|| {
                panic!(
                    "{} announced no listener {name:?}: {:?}",
                    self.name, self.listeners
                )
            })
    }

    /// Every announced listener, in announcement order.
    pub fn listeners(&self) -> &[(String, SocketAddr)] {
        &self.listeners
    }

    /// `http://ADDR` of the listener `name`.
    pub fn url(&self, name: &str) -> String {
        format!("http://{}", self.addr(name))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The file that holds the child's stderr.
    pub fn log_path(&self) -> &std::path::Path {
        &self.log
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> anyhow::Result<()> {
        signal(self.child.id(), "TERM")
    }

    /// Sends SIGSTOP: the process hangs (its sockets stay open) until [`Spawned::resume`].
    pub fn pause(&self) -> anyhow::Result<()> {
        signal(self.child.id(), "STOP")
    }

    /// Sends SIGCONT.
    pub fn resume(&self) -> anyhow::Result<()> {
        signal(self.child.id(), "CONT")
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit, up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
    }
}

fn signal(pid: u32, name: &str) -> anyhow::Result<()> {
    Ok(kvmesh_control::testing::signal(pid, name)?)
}

fn unique_path(path: PathBuf) -> PathBuf {
    let mut candidate = path.clone();
    let mut n = 0;
    while candidate.exists() {
        n += 1;
        candidate = path.with_extension(format!("{n}.log"));
    }
    candidate
}
