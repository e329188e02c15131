"""A test OTLP/gRPC receiver on the `opentelemetry-proto` service definition: it keeps every span
any process (our services, Envoy) exports to it, in the JSON-lines shape of
`services.common.telemetry.span_json`."""

from __future__ import annotations

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
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    def Export(self, request, context):
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
        return trace_service_pb2.ExportTraceServiceResponse()

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
