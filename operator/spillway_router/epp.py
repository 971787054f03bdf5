"""The endpoint picker (EPP) of the Gateway API Inference Extension, over Envoy's ext_proc.

A gateway (Envoy, Envoy Gateway, kgateway, Istio...) streams each request's headers
and body here; the picker makes the router's own decision (:meth:`RouterState.decide`:
the same index, hashing and scoring) and answers with the pods to use, best first, as
GIE's protocol asks: the ``x-gateway-destination-endpoint`` header and the same value
under ``envoy.lb`` in the dynamic metadata (``ip:port[,ip:port...]``, so the gateway
can retry down the list). The gateway then streams the pod's answer to the client
itself: the picker never sees a response byte.

Both of Envoy's body modes are served: FULL_DUPLEX_STREAMED (GIE's mode: the body
arrives in chunks and goes back as the streamed body once the pick is made) and
BUFFERED. A request the router would refuse gets the router's own OpenAI-style error
as an immediate response. Requests without a body (``GET /health``) get no
destination, so the gateway's fallback policy (round robin over the pool) takes them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .app import MAX_BODY, Refused, RouterState, error_body

log = logging.getLogger("spillway.epp")

#: GIE's names (the endpoint picker protocol, v1.0.0)
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
#: the health services gateways probe (GIE: liveness, readiness, the ext_proc service)
HEALTH_SERVICES = ("", "liveness", "readiness", pb.DESCRIPTOR.services_by_name[
    "ExternalProcessor"].full_name)

_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _header(headers: base_pb2.HeaderMap, name: str) -> str | None:
    for h in headers.headers:
        if h.key.lower() == name:
            return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return None


def _subset(metadata: base_pb2.Metadata) -> set[str] | None:
    """The endpoints the gateway allows, when it says (GIE's subset hint)."""
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.HasField("list_value"):
        return {v.string_value for v in value.list_value.values}
    return {e.strip() for e in value.string_value.split(",") if e.strip()}


def _immediate(status: int, message: str) -> pb.ProcessingResponse:
    body = json.dumps(error_body(status, message)).encode()
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))]),
        body=body,
        details=f"spillway_epp_{status}",
    ))


def _destination(endpoints: str) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoints.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]),
        clear_route_cache=True,  # the route may depend on the header just set
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: endpoints}})
    return common, metadata


def _streamed_body(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """Full duplex: the body goes on to the pod as the picker sends it back."""
    return pb.ProcessingResponse(request_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(
                body=body, end_of_stream=end_of_stream)))))


@dataclass
class PickerStream:
    """One request's ext_proc stream: the messages Envoy sends in, the answers out.
    Pure apart from the router state it reads (and the in-flight count it keeps)."""

    state: RouterState
    max_attempts: int = 3
    path: str = ""
    streamed: bool = False
    body: bytearray = field(default_factory=bytearray)
    subset: set[str] | None = None
    picked: str | None = None  # the pod, in flight until it answers or the stream ends
    done: bool = False

    def on(self, req: pb.ProcessingRequest) -> Iterator[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            self.streamed = req.protocol_config.request_body_mode == _STREAMED
        if req.HasField("metadata_context") and self.subset is None:
            self.subset = _subset(req.metadata_context)
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            yield from self._headers(req.request_headers)
        elif kind == "request_body":
            yield from self._body(req.request_body)
        elif kind == "request_trailers":
            if not self.done:  # a body that ended in trailers
                yield from self._pick(end_of_stream=False)
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif kind == "response_headers":
            served = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
            if served is not None and SERVED in served.fields:
                log.debug("served by %s", served.fields[SERVED].string_value)
            self.close()  # the pod answered: its queue and prefill are behind it
            yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        elif kind == "response_body":
            yield pb.ProcessingResponse(response_body=pb.BodyResponse())
        elif kind == "response_trailers":
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    def _headers(self, headers: pb.HttpHeaders) -> Iterator[pb.ProcessingResponse]:
        self.path = (_header(headers.headers, ":path") or "").split("?", 1)[0]
        if headers.end_of_stream:
            # no body: not a generation request; the gateway's fallback takes it
            self.done = True
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        elif not self.streamed:
            # BUFFERED: the body follows once the headers are answered; the
            # destination goes on the body's answer (Envoy still holds the headers)
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())

    def _body(self, chunk: pb.HttpBody) -> Iterator[pb.ProcessingResponse]:
        if self.done:
            if self.streamed:  # past the pick: pass any further chunk through
                yield _streamed_body(chunk.body, chunk.end_of_stream)
            else:
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            return
        self.body += chunk.body
        if len(self.body) > MAX_BODY:
            self.done = True
            self.state.metrics.errors.labels("413").inc()
            yield _immediate(413, f"the request body is larger than {MAX_BODY} bytes")
            return
        if chunk.end_of_stream:
            yield from self._pick(end_of_stream=True)

    def _pick(self, *, end_of_stream: bool) -> Iterator[pb.ProcessingResponse]:
        self.done = True
        s = self.state
        try:
            decision = s.decide(self.path, bytes(self.body), only=self.subset)
        except Refused as e:
            s.metrics.errors.labels(str(e.status)).inc()
            yield _immediate(e.status, e.message)
            return
        chosen = decision.candidates[: self.max_attempts]
        endpoints = ",".join(b.address for b in chosen)
        s.served(chosen[0].name, decision.prompt, decision.keys)
        # in flight until the pod's first byte (the response headers, which the gateway
        # sends here; its body never comes) or the stream's end: the queue and prefill
        # the scorer weighs; the pod's own /metrics report its decoding requests
        self.picked = chosen[0].name
        s.inflight[self.picked] += 1
        common, metadata = _destination(endpoints)
        if self.streamed:
            yield pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
            yield _streamed_body(bytes(self.body), end_of_stream)
        else:
            yield pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)

    def close(self) -> None:
        if self.picked is not None:
            self.state.inflight[self.picked] -= 1
            self.picked = None


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = PickerStream(self.state, self.state.config.max_attempts)
        try:
            async for req in requests:
                for resp in stream.on(req):
                    yield resp
        finally:
            stream.close()


class EndpointPickerServer:
    """The gRPC server beside the router's HTTP one, on the same event loop and state."""

    def __init__(self, state: RouterState, host: str, port: int) -> None:
        self.state, self.host, self.port = state, host, port
        self.health: health.aio.HealthServicer | None = None
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(self.state), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        await self.server.start()
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("endpoint picker (Envoy ext_proc, GIE protocol) on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self.server is not None:
            if self.health is not None:
                await self.health.enter_graceful_shutdown()
            await self.server.stop(grace=2)
