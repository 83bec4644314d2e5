//! The endpoint picker in the cluster setup: `etcd` and `nats-server` on loopback, two
//! `kvmesh-engine-sim` engines publishing KV events, an agent beside each, and a
//! `kvmesh-proxy` that is only an endpoint picker (`listeners: []`). Driven as Envoy drives
//! it, with the ext_proc client compiled from Envoy's protos (`envoy-types`).
//!
//! - readiness turns `SERVING` once discovery has listed its instances and the KV index is
//!   fed by events (watched through `grpc.health.v1.Health/Watch`); a picker that cannot
//!   reach NATS is live but not ready;
//! - the endpoints are the `ip:port` the agents registered, and a prompt whose prefix one
//!   engine cached (learned from its events, never routed by this picker) is picked there,
//!   the other engine named as the fallback.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
use kvmesh_e2e::cluster::start_proxy;
use kvmesh_e2e::control_plane::{
    BLOCK_SIZE, Servers, await_metric, control_proxy_config, prompt_tokens, start_agent,
    start_event_engines, token_prompt,
};
use kvmesh_e2e::{HttpClient, ScratchDir, grpc};
use tokio_stream::StreamExt;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Deadline for state the picker reaches through the control plane.
const CONVERGE: Duration = Duration::from_secs(15);

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

/// One full-duplex exchange for a completion of `prompt`; returns the endpoints picked.
async fn pick(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    prompt: &[u32],
) -> anyhow::Result<Vec<String>> {
    let headers = HttpHeaders {
        headers: Some(HeaderMap {
            headers: [(":method", "POST"), (":path", "/v1/completions")]
                .into_iter()
                .map(|(key, value)| HeaderValue {
                    key: key.to_string(),
                    value: String::new(),
                    raw_value: value.as_bytes().to_vec(),
                })
                .collect(),
        }),
        ..HttpHeaders::default()
    };
    let body = HttpBody {
        body: serde_json::to_vec(&token_prompt(prompt, 1))?,
        end_of_stream: true,
        ..HttpBody::default()
    };
    let requests = tokio_stream::iter([
        message(Request::RequestHeaders(headers)),
        message(Request::RequestBody(body)),
    ]);
    let mut answers = client.process(requests).await?.into_inner();
    let Some(Response::RequestHeaders(headers)) = grpc::next_message(&mut answers)
        .await?
        .and_then(|a| a.response)
    else {
        anyhow::bail!("no pick");
    };
    let set = headers
        .response
        .and_then(|common| common.header_mutation)
        .map(|mutation| mutation.set_headers)
        .unwrap_or_default();
    let pick = set
        .into_iter()
        .filter_map(|option| option.header)
        .find(|header| header.key == "x-gateway-destination-endpoint")
        .map(|header| String::from_utf8(header.raw_value))
        .transpose()?
        .unwrap_or_default();
    Ok(pick.split(',').map(str::to_string).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picker_alone_is_ready_once_synced_and_picks_by_the_agents_events() -> anyhow::Result<()>
{
    let scratch = ScratchDir::new("epp-cluster")?;
    let servers = Servers::start(&scratch).await?;
    let (_sim, engines) = start_event_engines(&scratch, 2)?;
    let config = control_proxy_config(&servers, "epp:\n  address: 127.0.0.1:0\n  fallbacks: 1\n")
        .replace(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\n",
            "listeners: []\n",
        );
    let _agents = engines
        .iter()
        .map(|engine| {
            start_agent(
                &scratch,
                &servers,
                engine,
                CONVERGE,
                Duration::from_millis(100),
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // A picker whose bus is unreachable: discovery synced, events never; live, not ready.
    let unreachable = config.replace(&servers.nats.url(), "nats://127.0.0.1:1");
    let cut_off = start_proxy(&scratch, &unreachable)?;
    let channel =
        grpc::connect(tonic::transport::Endpoint::from_shared(cut_off.url("epp"))?).await?;
    let client = HttpClient::default();
    let metrics = format!("{}/metrics", cut_off.url("admin"));
    await_metric(
        &client,
        &metrics,
        "kvmesh_discovery_connected",
        |v| v == 1.0,
        CONVERGE,
    )
    .await?;
    let mut health = HealthClient::new(channel);
    for (service, expected) in [
        ("liveness", ServingStatus::Serving),
        ("readiness", ServingStatus::NotServing),
        (
            "envoy.service.ext_proc.v3.ExternalProcessor",
            ServingStatus::NotServing,
        ),
    ] {
        let request = HealthCheckRequest {
            service: service.to_string(),
        };
        let status = health.check(request).await?.into_inner().status;
        assert_eq!(status, expected as i32, "{service}");
    }

    let proxy = start_proxy(&scratch, &config)?;
    let channel = grpc::connect(tonic::transport::Endpoint::from_shared(proxy.url("epp"))?).await?;
    let mut health = HealthClient::new(channel.clone());
    let readiness = HealthCheckRequest {
        service: "readiness".to_string(),
    };
    let mut watch = health.watch(readiness).await?.into_inner();
    let ready = tokio::time::timeout(CONVERGE, async {
        while let Some(status) = watch.next().await.transpose()? {
            if status.status == ServingStatus::Serving as i32 {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("the watch ended")
    })
    .await;
    ready.map_err(|_| anyhow::anyhow!("readiness never turned SERVING"))??;
    for service in ["liveness", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let request = HealthCheckRequest {
            service: service.to_string(),
        };
        let status = health.check(request).await?.into_inner().status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service}");
    }

    // The second engine caches a prompt the picker never saw; its events reach the index.
    let prompt = prompt_tokens(7, 8);
    let url = format!("{}/v1/completions", engines[1].url);
    let response = client.post_json(&url, &token_prompt(&prompt, 1)).await?;
    assert_eq!(response.status, 200);
    let metrics = format!("{}/metrics", proxy.url("admin"));
    let series = format!(
        "kvmesh_index_blocks{{instance=\"{}\",model=\"{}\"}}",
        engines[1].url,
        kvmesh_e2e::cluster::MODEL
    );
    await_metric(&client, &metrics, &series, |v| v == 8.0, CONVERGE).await?;

    let mut picker = ExternalProcessorClient::new(channel);
    let mut longer = prompt.clone();
    longer.extend(prompt_tokens(99, 1));
    let endpoints = pick(&mut picker, &longer).await?;
    let registered: Vec<String> = engines
        .iter()
        .map(|engine| engine.url.trim_start_matches("http://").to_string())
        .collect();
    if endpoints != [registered[1].clone(), registered[0].clone()] {
        // What the router saw, for the failure message.
        let explained = client
            .post_json(
                &format!("{}/debug/route?route=completions", proxy.url("admin")),
                &token_prompt(&longer, 1),
            )
            .await?;
        panic!(
            "picked {endpoints:?}: the cached engine {} first, the other as fallback ({} tokens \
             per block); the router's explanation now: {}",
            registered[1],
            BLOCK_SIZE,
            String::from_utf8_lossy(&explained.body)
        );
    }
    Ok(())
}
