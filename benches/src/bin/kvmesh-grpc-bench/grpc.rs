//! KServe v2 `ModelInfer` and `ModelStreamInfer` over one tonic channel.

use std::collections::HashMap;

use anyhow::{Context, bail};
use kvmesh_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use kvmesh_proto::inference::infer_parameter::ParameterChoice;
use kvmesh_proto::inference::model_infer_request::InferInputTensor;
use kvmesh_proto::inference::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelStreamInferResponse,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

use crate::Args;
use crate::load::{Sample, Shape, Worker};

/// One worker: a client on the shared channel, and for streaming its open call.
pub(crate) struct GrpcWorker {
    client: GrpcInferenceServiceClient<Channel>,
    request: ModelInferRequest,
    stream: Option<(
        mpsc::Sender<ModelInferRequest>,
        Streaming<ModelStreamInferResponse>,
    )>,
}

/// `args.concurrency` workers on one channel.
pub(crate) async fn workers(
    args: &Args,
    shape: Shape,
    prompt: &str,
) -> anyhow::Result<Vec<Worker>> {
    let channel = Endpoint::from_shared(format!("http://{}", args.grpc))?
        .tcp_nodelay(true)
        .connect()
        .await
        .context("gRPC connect")?;
    let request = request(args, prompt, shape == Shape::Stream);
    let mut workers = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        let mut client = GrpcInferenceServiceClient::new(channel.clone());
        let stream = match shape {
            Shape::Unary => None,
            Shape::Stream => {
                let (tx, rx) = mpsc::channel(1);
                let responses = client
                    .model_stream_infer(ReceiverStream::new(rx))
                    .await
                    .context("ModelStreamInfer")?
                    .into_inner();
                Some((tx, responses))
            }
        };
        workers.push(Worker::Grpc(Box::new(GrpcWorker {
            client,
            request: request.clone(),
            stream,
        })));
    }
    Ok(workers)
}

fn request(args: &Args, prompt: &str, streaming: bool) -> ModelInferRequest {
    let mut inputs = vec![InferInputTensor {
        name: "text_input".to_string(),
        datatype: "BYTES".to_string(),
        shape: vec![1],
        parameters: HashMap::new(),
        contents: Some(InferTensorContents {
            bytes_contents: vec![prompt.as_bytes().to_vec()],
            ..Default::default()
        }),
    }];
    if streaming {
        inputs.push(InferInputTensor {
            name: "streaming".to_string(),
            datatype: "BOOL".to_string(),
            shape: vec![1],
            parameters: HashMap::new(),
            contents: Some(InferTensorContents {
                bool_contents: vec![true],
                ..Default::default()
            }),
        });
    }
    ModelInferRequest {
        model_name: args.model.clone(),
        parameters: HashMap::from([(
            "max_tokens".to_string(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Int64Param(i64::from(args.max_tokens))),
            },
        )]),
        inputs,
        ..Default::default()
    }
}

impl GrpcWorker {
    /// Sends the request and waits for its (last) response.
    pub(crate) async fn send(&mut self) -> anyhow::Result<Sample> {
        let started = Instant::now();
        let Some((tx, responses)) = self.stream.as_mut() else {
            self.client.model_infer(self.request.clone()).await?;
            let total = started.elapsed();
            return Ok(Sample {
                started,
                first: total,
                total,
            });
        };
        tx.send(self.request.clone()).await?;
        let mut first = None;
        loop {
            let Some(message) = responses.message().await? else {
                bail!("the stream ended");
            };
            if !message.error_message.is_empty() {
                bail!("{}", message.error_message);
            }
            first.get_or_insert_with(|| started.elapsed());
            let last = message.infer_response.is_some_and(|response| {
                matches!(
                    response
                        .parameters
                        .get("triton_final_response")
                        .and_then(|p| p.parameter_choice.as_ref()),
                    Some(ParameterChoice::BoolParam(true))
                )
            });
            if last {
                let total = started.elapsed();
                return Ok(Sample {
                    started,
                    first: first.unwrap_or(total),
                    total,
                });
            }
        }
    }
}
