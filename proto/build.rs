//! Compiles `proto/inference.proto` with protox (no `protoc` needed) into prost
//! messages and tonic client and server code, and writes the encoded file
//! descriptor set that server reflection serves.

use std::path::PathBuf;

use prost::Message;

const PROTO: &str = "proto/inference.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("inference_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
