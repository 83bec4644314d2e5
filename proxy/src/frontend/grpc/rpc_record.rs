//! The record of one gRPC inference request: metrics (`protocol="grpc"`, the RPC as
//! `route`) and one log line, written when it ends, or when it is dropped because the
//! client cancelled or its deadline passed.

use tokio::time::Instant;
use tonic::Code;

use crate::engines::pool::ModelPool;
use crate::frontend::grpc::failure::{Failure, code_name};
use crate::metrics::families::{Metrics, RpcTable};
use crate::metrics::rpc::Rpc;
use crate::request::record::Record;

/// One inference request in progress; written once, at the latest when dropped.
pub(crate) struct RpcRecord<'a> {
    /// What the spine records about the request.
    pub(crate) record: Record,
    rpc: Rpc,
    metrics: &'a Metrics,
    unattributed: &'a RpcTable,
    deadline: Option<Instant>,
    written: bool,
}

impl<'a> RpcRecord<'a> {
    /// A record of `record`'s request on `rpc`; requests that name no served model count
    /// under `unattributed`.
    pub(crate) fn new(
        record: Record,
        rpc: Rpc,
        metrics: &'a Metrics,
        unattributed: &'a RpcTable,
        deadline: Option<Instant>,
    ) -> Self {
        Self {
            record,
            rpc,
            metrics,
            unattributed,
            deadline,
            written: false,
        }
    }

    /// Records how the request ended.
    pub(crate) fn finish(&mut self, outcome: Result<(), &Failure>) {
        match outcome {
            Ok(()) => self.write(200, Code::Ok),
            Err(failure) => {
                if let Some(reason) = failure.client_reason() {
                    self.metrics.client_error(reason);
                }
                self.write(failure.http_status(), failure.code());
            }
        }
    }

    fn write(&mut self, status: u16, code: Code) {
        self.written = true;
        self.record.status = status;
        let elapsed = self.record.started.elapsed();
        let rpcs = self
            .record
            .pool
            .as_deref()
            .map_or(self.unattributed, |pool| &pool.metrics().rpcs);
        rpcs.rpc(self.rpc).observe(status, elapsed.as_secs_f64());
        self.record.count_tokens();
        let model = self.record.pool.as_deref().map_or("", ModelPool::name);
        let instance = self
            .record
            .instance
            .as_ref()
            .and_then(|value| value.to_str().ok())
            .unwrap_or("");
        let request_id = self.record.request_id.to_str().unwrap_or("");
        let upstream_error = self.record.upstream_failure.map_or("", |kind| kind.label());
        tracing::info!(
            rpc = self.rpc.label(),
            model,
            status,
            code = code_name(code),
            instance,
            duration_ms = elapsed.as_secs_f64() * 1e3,
            request_id,
            stream = self.record.stream,
            upstream_error,
            "grpc request"
        );
    }
}

impl Drop for RpcRecord<'_> {
    fn drop(&mut self) {
        if self.written {
            return;
        }
        let failure = if self.deadline.is_some_and(|at| Instant::now() >= at) {
            Failure::Deadline
        } else {
            Failure::Cancelled
        };
        self.finish(Err(&failure));
    }
}
