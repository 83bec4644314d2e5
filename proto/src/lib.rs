//! kvmesh-proto: the KServe v2 / Open Inference Protocol gRPC API (package
//! `inference`, service `GRPCInferenceService`, with the Triton extensions its
//! clients use), compiled from `proto/inference.proto` by tonic and prost.
//!
//! [`inference`] holds the messages, the server trait
//! ([`inference::grpc_inference_service_server::GrpcInferenceService`]) and a
//! client generic over any tonic transport
//! ([`inference::grpc_inference_service_client::GrpcInferenceServiceClient`]).
//! [`FILE_DESCRIPTOR_SET`] feeds gRPC server reflection.

/// The `inference` protobuf package: messages, server and client.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod inference {
    tonic::include_proto!("inference");
}

/// The encoded `FileDescriptorSet` of `inference.proto`, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/inference_descriptor.bin"));
