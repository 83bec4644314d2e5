//! Where the engine's KV events come from: the ZMQ endpoints of each data-parallel rank, from
//! the flags (rank r at the port plus r) or, when no endpoint was given, from the engine itself;
//! none for TensorRT-LLM, whose events are polled over HTTP.
//!
//! vLLM (0.32 and later) answers `GET /kv_event_sources` with its KV event publisher
//! configuration per data-parallel rank, the ranks' ports already offset:
//! `{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
//! "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,
//! "max_queue_size": 100000, "topic": ""}, "1": {...}}` (`{}` when it publishes none). A bind
//! address (`*`, `0.0.0.0`, `::`) means the engine's own host: the host of its URL.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use crate::config::{AgentConfig, EngineKind};
use crate::endpoint::rank_endpoint;
use crate::error::AgentError;
use crate::http_client::EngineClient;

/// vLLM's route.
const PATH: &str = "/kv_event_sources";
/// Pause between attempts while the engine is not up yet.
const RETRY: Duration = Duration::from_millis(200);

/// Where one rank publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankSource {
    /// Its PUB endpoint, `tcp://HOST:PORT`.
    pub endpoint: String,
    /// Its replay ROUTER endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Its topic (the subscription prefix).
    pub topic: String,
}

/// The ranks the agent follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EventSources {
    /// Rank r's ZMQ sockets at index r (empty for TensorRT-LLM: polled over HTTP).
    pub ranks: Vec<RankSource>,
    /// The engine's data-parallel ranks.
    pub dp_ranks: u32,
}

/// The host of `engine_url` (`http://HOST:PORT/...`), brackets kept for IPv6.
fn url_host(engine_url: &str) -> Option<&str> {
    let authority = engine_url
        .split_once("://")
        .map_or(engine_url, |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if authority.starts_with('[') {
        &authority[..=authority.find(']')?]
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then_some(host)
}

/// `endpoint` as the agent connects to it: a bind host replaced by `host`.
fn connectable(endpoint: &str, host: &str) -> Result<String, String> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        format!("the engine publishes at {endpoint:?}: the agent connects to tcp:// endpoints only")
    })?;
    let (bind, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("endpoint {endpoint:?} has no port"))?;
    let bind = match bind {
        "*" | "0.0.0.0" | "::" | "[::]" | "" => host,
        other => other,
    };
    Ok(format!("tcp://{bind}:{port}"))
}

/// Reads vLLM's `/kv_event_sources` answer: each rank's sockets, bind hosts replaced by
/// `host`.
pub(crate) fn parse_sources(body: &[u8], host: &str) -> Result<BTreeMap<u32, RankSource>, String> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the engine's {PATH} is not JSON: {e}"))?;
    let Value::Object(ranks) = value else {
        return Err(format!("the engine's {PATH} is not a JSON object"));
    };
    let mut sources = BTreeMap::new();
    for (rank, config) in &ranks {
        let rank: u32 = rank
            .parse()
            .map_err(|_| format!("{PATH} names rank {rank:?}, not a number"))?;
        if config.get("publisher").and_then(Value::as_str) == Some("null")
            || config.get("enable_kv_cache_events") == Some(&Value::Bool(false))
        {
            continue;
        }
        let endpoint = config
            .get("endpoint")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{PATH}: rank {rank} without an endpoint"))?;
        let replay_endpoint = match config.get("replay_endpoint") {
            Some(Value::String(replay)) => Some(connectable(replay, host)?),
            _ => None,
        };
        sources.insert(
            rank,
            RankSource {
                endpoint: connectable(endpoint, host)?,
                replay_endpoint,
                topic: config
                    .get("topic")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            },
        );
    }
    Ok(sources)
}

/// The sockets of ranks `0..dp_ranks` from the flags: rank r at the ports plus r.
fn from_flags(config: &AgentConfig) -> Result<Vec<RankSource>, AgentError> {
    (0..config.dp_ranks)
        .map(|rank| {
            Ok(RankSource {
                endpoint: rank_endpoint(&config.kv_events_endpoint, rank)?,
                replay_endpoint: config
                    .kv_events_replay_endpoint
                    .as_deref()
                    .map(|e| rank_endpoint(e, rank))
                    .transpose()?,
                topic: config.kv_events_topic.clone(),
            })
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(AgentError::Config)
}

/// What the engine answered at `/kv_event_sources`: its sources, or `None` when it does not
/// serve the route (a vLLM before 0.32). Retried until `deadline` while the engine is not up.
async fn ask(
    engine: &EngineClient,
    host: &str,
    deadline: tokio::time::Instant,
) -> Result<Option<BTreeMap<u32, RankSource>>, AgentError> {
    loop {
        let why = match engine.get(PATH, Duration::from_secs(1)).await {
            Ok((status, body)) if status.is_success() => {
                return parse_sources(&body, host)
                    .map(Some)
                    .map_err(AgentError::Config);
            }
            Ok((status, _))
                if status == http::StatusCode::NOT_FOUND
                    || status == http::StatusCode::METHOD_NOT_ALLOWED =>
            {
                return Ok(None);
            }
            Ok((status, _)) => format!("answered {status}"),
            Err(why) => why,
        };
        if tokio::time::Instant::now() + RETRY >= deadline {
            return Err(AgentError::Startup(format!(
                "the engine's {PATH} did not answer within the startup timeout ({why})"
            )));
        }
        tracing::debug!(%why, "asking the engine where it publishes KV events");
        tokio::time::sleep(RETRY).await;
    }
}

/// Where the agent reads the engine's KV events (asking the engine with
/// `config.discover_kv_events`, until `deadline`).
pub(crate) async fn resolve(
    config: &AgentConfig,
    engine: &EngineClient,
    deadline: tokio::time::Instant,
) -> Result<EventSources, AgentError> {
    if config.engine_kind == EngineKind::Trtllm {
        return Ok(EventSources {
            ranks: Vec::new(),
            dp_ranks: config.dp_ranks,
        });
    }
    if !config.discover_kv_events {
        return Ok(EventSources {
            ranks: from_flags(config)?,
            dp_ranks: config.dp_ranks,
        });
    }
    let host = url_host(&config.engine_url).unwrap_or("127.0.0.1");
    let Some(mut listed) = ask(engine, host, deadline).await? else {
        tracing::info!(
            endpoint = %config.kv_events_endpoint,
            "the engine has no {PATH}: reading its KV events at the default endpoint"
        );
        return Ok(EventSources {
            ranks: from_flags(config)?,
            dp_ranks: config.dp_ranks,
        });
    };
    if listed.is_empty() {
        return Err(AgentError::Config(format!(
            "the engine's {PATH} lists no KV event publisher: start vLLM with \
             --kv-events-config '{{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\
             \"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}}' (and \
             --enable-prefix-caching), or give --kv-events-endpoint"
        )));
    }
    let dp_ranks = if config.dp_ranks_from_engine {
        u32::try_from(listed.len()).unwrap_or(u32::MAX)
    } else {
        config.dp_ranks
    };
    let mut ranks = Vec::with_capacity(dp_ranks as usize);
    for rank in 0..dp_ranks {
        let mut source = listed.remove(&rank).ok_or_else(|| {
            AgentError::Config(format!(
                "the engine's {PATH} names no KV event publisher for data-parallel rank {rank}"
            ))
        })?;
        if !config.kv_events_topic.is_empty() {
            source.topic = config.kv_events_topic.clone();
        }
        tracing::info!(rank, endpoint = %source.endpoint, replay = ?source.replay_endpoint, "the engine publishes KV events here");
        ranks.push(source);
    }
    Ok(EventSources { ranks, dp_ranks })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What vLLM 0.32.0's own `/kv_event_sources` route rendered for two data-parallel
    /// ranks publishing at `tcp://*:5557` and replaying at `tcp://*:5567`
    /// (`engine-events/tests/fixtures/render_vllm_kv_event_sources.py`).
    const VLLM: &[u8] =
        include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-kv-event-sources.json");

    #[test]
    fn vllm_answer_gives_each_ranks_sockets_on_the_engine_host() {
        let sources = parse_sources(VLLM, "10.1.2.3").expect("vLLM's answer");
        let endpoints: Vec<(u32, &str, Option<&str>, &str)> = sources
            .iter()
            .map(|(rank, s)| {
                (
                    *rank,
                    s.endpoint.as_str(),
                    s.replay_endpoint.as_deref(),
                    s.topic.as_str(),
                )
            })
            .collect();
        assert_eq!(
            endpoints,
            [
                (
                    0,
                    "tcp://10.1.2.3:5557",
                    Some("tcp://10.1.2.3:5567"),
                    "kv-events"
                ),
                (
                    1,
                    "tcp://10.1.2.3:5558",
                    Some("tcp://10.1.2.3:5568"),
                    "kv-events"
                )
            ]
        );
        assert!(parse_sources(b"{}", "h").expect("no publisher").is_empty());
        for bad in [&b"[]"[..], b"{\"x\": {}}", b"{\"0\": {}}"] {
            assert!(parse_sources(bad, "h").is_err(), "{bad:?}");
        }
        let ipc = br#"{"0": {"endpoint": "ipc:///tmp/kv", "replay_endpoint": null}}"#;
        assert!(parse_sources(ipc, "h").is_err());
    }

    /// An engine on a free port answering every request with `status` and `body`.
    async fn engine(status: &'static str, body: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request).await;
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            }
        });
        url
    }

    async fn resolve_at(url: &str, discover: bool) -> Result<EventSources, AgentError> {
        let mut config = AgentConfig::new(url, "m", "tcp://127.0.0.1:5557");
        config.kv_events_replay_endpoint = Some("tcp://127.0.0.1:6557".to_owned());
        config.discover_kv_events = discover;
        config.dp_ranks_from_engine = true;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        resolve(&config, &EngineClient::new(url), deadline).await
    }

    #[tokio::test]
    async fn the_engine_is_asked_and_an_older_one_read_at_the_flags() {
        let vllm = engine("200 OK", std::str::from_utf8(VLLM).expect("UTF-8")).await;
        let asked = resolve_at(&vllm, true).await.expect("asked");
        assert_eq!(asked.dp_ranks, 2, "the ranks it lists");
        assert_eq!(asked.ranks[1].endpoint, "tcp://127.0.0.1:5558");
        assert_eq!(
            asked.ranks[1].replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:5568")
        );
        let flags = EventSources {
            ranks: vec![RankSource {
                endpoint: "tcp://127.0.0.1:5557".to_owned(),
                replay_endpoint: Some("tcp://127.0.0.1:6557".to_owned()),
                topic: String::new(),
            }],
            dp_ranks: 1,
        };
        assert_eq!(resolve_at(&vllm, false).await.expect("flags"), flags);
        let older = engine("404 Not Found", "{\"detail\":\"Not Found\"}").await;
        assert_eq!(resolve_at(&older, true).await.expect("fallback"), flags);
        let silent = engine("200 OK", "{}").await;
        assert!(
            matches!(resolve_at(&silent, true).await, Err(AgentError::Config(why)) if why.contains("--kv-events-config")),
            "an engine publishing nothing stops the agent"
        );
    }

    #[test]
    fn bind_hosts_become_the_engine_host() {
        for (bind, host, want) in [
            ("tcp://*:5557", "127.0.0.1", "tcp://127.0.0.1:5557"),
            ("tcp://0.0.0.0:1", "engine", "tcp://engine:1"),
            ("tcp://[::]:2", "[::1]", "tcp://[::1]:2"),
            ("tcp://10.0.0.9:3", "engine", "tcp://10.0.0.9:3"),
        ] {
            assert_eq!(connectable(bind, host).as_deref(), Ok(want));
        }
        assert_eq!(url_host("http://127.0.0.1:8000"), Some("127.0.0.1"));
        assert_eq!(url_host("http://[::1]:8000/v1"), Some("[::1]"));
        assert_eq!(url_host("http://vllm.ns.svc"), Some("vllm.ns.svc"));
        assert_eq!(url_host("http://"), None);
    }
}
