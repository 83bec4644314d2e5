//! Following the engine's response through the gateway (phase 7 of
//! [`crate::frontend::epp::exchange`]): the endpoint that really served it (the gateway's
//! `…-served` metadata) gets the booking, the prefill part of the load ends at the first
//! byte (a stream's: its first body chunk), and all of it when the response ends or the
//! stream closes. Each message is answered in order; full duplex bodies are carried back.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use kvmesh_wire::ext_proc::messages::{
    BodyMode, Half, body_answer, header, headers_answer, metadata_string, set_header,
    trailers_answer,
};
use tonic::Status;

use crate::engines::instance::Instance;
use crate::frontend::epp::decide::{endpoint, rebook};
use crate::frontend::epp::settings::Settings;
use crate::frontend::epp::wire::Wire;
use crate::metrics::epp::{EppMetrics, Served};
use crate::openai::headers::{X_KVMESH_INSTANCE, X_KVMESH_ROUTE};
use crate::request::pick::Pick;
use crate::request::prepare::Picker;

/// What the response half needs of the decision.
pub(crate) struct Decided<'a> {
    /// The model's name.
    pub(crate) model: &'a str,
    /// The instances picked from.
    pub(crate) instances: &'a [Arc<Instance>],
    /// How the request picked.
    pub(crate) picker: &'a Picker<'a>,
    /// The endpoints named to the gateway, the pick first.
    pub(crate) order: Vec<usize>,
}

/// Answers the response's messages until the stream ends; `pick` holds the request's load.
pub(crate) async fn follow<'a>(
    wire: &mut Wire,
    settings: &Settings,
    metrics: &EppMetrics,
    decided: &Decided<'a>,
    pick: Pick<'a>,
    mode: BodyMode,
) {
    let mut current = Some(pick);
    let mut streaming = false;
    let mut first_chunk = true;
    while let Some(message) = wire.next().await {
        let answer = match message.request {
            Some(Request::ResponseHeaders(headers)) => {
                let served = metadata_string(
                    message.metadata_context.as_ref(),
                    &settings.namespace,
                    &settings.served_key,
                );
                let outcome = served_by(decided, served, &mut current);
                metrics.served(decided.model, outcome);
                streaming = header(headers.headers.as_ref(), "content-type")
                    .is_some_and(|kind| kind.contains("text/event-stream"));
                let booking = current.as_ref().and_then(|pick| pick.booking.as_ref());
                if let Some(booking) = booking {
                    if headers.end_of_stream {
                        booking.release();
                    } else if !streaming {
                        booking.prefill_done(false);
                    }
                }
                headers_answer(Half::Response, route_headers(current.as_ref()), None)
            }
            Some(Request::ResponseBody(body)) => {
                let booking = current.as_ref().and_then(|pick| pick.booking.as_ref());
                if let Some(booking) = booking {
                    if streaming && first_chunk && !body.body.is_empty() {
                        first_chunk = false;
                        booking.prefill_done(true);
                    }
                    if body.end_of_stream {
                        booking.release();
                    }
                }
                let echo =
                    (mode == BodyMode::FullDuplex).then_some((body.body, body.end_of_stream));
                body_answer(Half::Response, echo, Vec::new(), None)
            }
            Some(Request::ResponseTrailers(_)) => {
                current = None;
                trailers_answer(Half::Response)
            }
            Some(Request::RequestTrailers(_)) => trailers_answer(Half::Request),
            Some(Request::RequestHeaders(_) | Request::RequestBody(_)) | None => {
                metrics.protocol_error("unexpected");
                let status = Status::invalid_argument("expected the response's messages");
                wire.fail(status).await;
                return;
            }
        };
        if !wire.send(answer).await {
            return;
        }
    }
}

/// How the endpoint the gateway says `served` the request relates to the pick; when it is
/// another instance of the model, the request's load moves there.
fn served_by<'a>(
    decided: &Decided<'a>,
    served: Option<&str>,
    current: &mut Option<Pick<'a>>,
) -> Served {
    let Some(served) = served else {
        return Served::Unreported;
    };
    let instances = decided.instances;
    let Some(index) = instances
        .iter()
        .position(|instance| endpoint(instance) == served)
    else {
        return Served::Unknown;
    };
    if decided.order.first() == Some(&index) {
        return Served::Picked;
    }
    *current = None;
    *current = rebook(instances, decided.picker, index);
    if decided.order.contains(&index) {
        Served::Fallback
    } else {
        Served::Other
    }
}

/// `x-kvmesh-instance` (the instance the load is booked on) and, under `policy: kv`,
/// `x-kvmesh-route` (why it was chosen), for the client's response.
fn route_headers(current: Option<&Pick<'_>>) -> Vec<HeaderValueOption> {
    let Some(pick) = current else {
        return Vec::new();
    };
    let mut set = vec![set_header(
        X_KVMESH_INSTANCE.as_str(),
        pick.instance.url().as_str().as_bytes(),
    )];
    if let Some(route) = &pick.route {
        set.push(set_header(X_KVMESH_ROUTE.as_str(), route.as_bytes()));
    }
    set
}
