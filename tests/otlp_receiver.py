"""A test OTLP receiver on the `opentelemetry-proto` definitions, over gRPC (the TraceService) and
over HTTP (protobuf bodies POSTed to /v1/traces): it keeps every span any process (our services,
Envoy) exports to it, in the JSON-lines shape of `services.common.span_file.span_json`."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, count_only: bool = False) -> None:
        """`count_only`: keep no span, count them (`received`): a collector's cheapest work,
        for benchmarks that share the cores with it."""
        self.count_only = count_only
        self.received = 0  # spans received
        self.spans: list[dict] = []
        self.exports = {"grpc": 0, "http": 0}  # export requests received, by transport
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True

    @property
    def endpoint(self) -> str:
        """host:port of the OTLP/gRPC service."""
        return f"127.0.0.1:{self.port}"

    @property
    def http_endpoint(self) -> str:
        """The OTLP/HTTP base URL (an exporter appends /v1/traces)."""
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)
        self._http.shutdown()
        self._http.server_close()

    def Export(self, request, context):
        self.keep(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()

    def keep(self, request: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        if self.count_only:
            with self._lock:
                self.received += n
                self.exports[transport] += 1
            return
        out = []
        for rs in request.resource_spans:
            service = _attributes(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    status = {0: "UNSET", 1: "OK", 2: "ERROR"}[s.status.code]
                    out.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex() or None,
                            "name": s.name,
                            "service": service,
                            "start_unix_nano": s.start_time_unix_nano,
                            "end_unix_nano": s.end_time_unix_nano,
                            "attributes": _attributes(s.attributes),
                            "status": status,
                            "status_message": s.status.message,
                        }
                    )
        with self._lock:
            self.spans += out
            self.received += n
            self.exports[transport] += 1

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 20.0) -> list[dict]:
        """The trace's spans once all `names` arrived (AssertionError naming the missing ones
        after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            missing = names - {s["name"] for s in spans}
            if not missing:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans {sorted(missing)} never arrived; got {spans}")
            time.sleep(0.05)


def _handler(receiver: OtlpReceiver) -> type[http.server.BaseHTTPRequestHandler]:
    class OtlpHttpHandler(http.server.BaseHTTPRequestHandler):
        """OTLP/HTTP with binary protobuf: POST /v1/traces, an ExportTraceServiceRequest in,
        an ExportTraceServiceResponse out."""

        def do_POST(self) -> None:
            if self.path != "/v1/traces":
                return self._reply(404, b"")
            if self.headers.get("Content-Type") != "application/x-protobuf":
                return self._reply(415, b"")
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            receiver.keep(request, "http")
            self._reply(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def _reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # quiet: no line per export on stderr
            pass

    return OtlpHttpHandler


def main() -> None:
    """Run a counting receiver (`count_only`) as a process of its own, for benchmarks: prints
    `{"endpoint": ..., "http_endpoint": ...}` once serving, and `{"spans": N}` when its
    standard input closes, then exits."""
    import json
    import sys

    with OtlpReceiver(count_only=True) as receiver:
        print(json.dumps({"endpoint": receiver.endpoint, "http_endpoint": receiver.http_endpoint}))
        sys.stdout.flush()
        sys.stdin.read()
        print(json.dumps({"spans": receiver.received}), flush=True)


if __name__ == "__main__":
    main()
