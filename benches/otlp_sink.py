"""An OTLP/gRPC trace receiver that counts and discards spans, for benches/overhead.sh's
kvmesh-traced setup (built on the official opentelemetry-proto package and grpcio, as the
tracing tests' receiver is).

Usage: otlp_sink.py COUNT_FILE — prints `LISTENING otlp 127.0.0.1:PORT` then `READY`, and
rewrites COUNT_FILE with the number of spans received after every export, until killed.
"""

import sys
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, count_file):
        self.count_file = count_file
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        with open(self.count_file, "w") as out:
            out.write(f"{self.spans}\n")
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(sys.argv[1]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"LISTENING otlp 127.0.0.1:{port}", flush=True)
    print("READY", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
