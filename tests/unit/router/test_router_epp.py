"""The endpoint picker (spillway_router.epp): Envoy's ext_proc messages in, GIE's
answers out -- in process (PickerStream) and over a real gRPC channel (the server,
its health service). Envoy itself in front of it: tests/integration/test_gateway.py."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spillway_engine.planner.plan import read_plan
from spillway_router.app import MAX_BODY, RouterConfig, RouterState
from spillway_router.backends import Backend, profile_from_plan
from spillway_router.epp import (
    DESTINATION,
    HEALTH_SERVICES,
    LB_NAMESPACE,
    SUBSET,
    SUBSET_NAMESPACE,
    EndpointPickerServer,
    PickerStream,
)
from tests.unit.simulator_support import LLAMA, PLANS

MODEL = "m"
PROFILE = profile_from_plan(read_plan((PLANS / LLAMA).read_bytes(), LLAMA))
PODS = {"pod0": "10.0.0.1:8000", "pod1": "10.0.0.2:8000", "pod2": "10.0.0.3:8000"}
STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def state() -> RouterState:
    s = RouterState(RouterConfig(mode="approx"))
    for name, address in PODS.items():
        s.upsert(Backend(name, MODEL, f"http://{address}", None, PROFILE))
        s.set_healthy(name, True)
    return s


def prompt(seed: int, n: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def headers(path: str = "/v1/completions", *, eos: bool = False) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST" if not eos else b"GET"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
    ])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))


def body(data: bytes, *, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def with_mode(req: pb.ProcessingRequest, mode: int) -> pb.ProcessingRequest:
    req.protocol_config.request_body_mode = mode
    return req


def completion(tokens: list[int] | str, model: str = MODEL) -> bytes:
    return json.dumps({"model": model, "prompt": tokens, "max_tokens": 2}).encode()


def run(stream: PickerStream, *reqs: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    return [resp for req in reqs for resp in stream.on(req)]


def destination(resp: pb.ProcessingResponse) -> tuple[str, str, bool]:
    """(header value, metadata value, clear_route_cache) of an answer naming pods."""
    common = (resp.request_headers.response if resp.HasField("request_headers")
              else resp.request_body.response)
    (option,) = common.header_mutation.set_headers
    assert option.header.key == DESTINATION
    meta = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION]
    return option.header.raw_value.decode(), meta.string_value, common.clear_route_cache


def test_streamed_mode_answers_headers_then_the_body_once_the_whole_body_is_in():
    s = state()
    stream = PickerStream(s)
    raw = completion(prompt(1))
    # the same decision the proxy makes, on the same state: RouterState.decide
    proxy_pick = state().decide("/v1/completions", raw).candidates[0].address
    half = len(raw) // 2
    out = run(stream, with_mode(headers(), STREAMED), body(raw[:half], eos=False))
    assert out == []  # nothing until the prompt is whole: the pick needs it
    out = run(stream, body(raw[half:], eos=True))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    header, meta, clear = destination(out[0])
    # best first, then the rest to retry on; header and metadata agree (GIE: MUST)
    assert header == meta and clear
    assert sorted(header.split(",")) == sorted(PODS.values())
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and streamed.end_of_stream
    assert header.split(",")[0] == proxy_pick
    # in flight until the pod answers: the gateway sends the response headers here
    pod = next(n for n, a in PODS.items() if a == proxy_pick)
    assert s.inflight[pod] == 1
    (out,) = run(stream, pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    assert out.HasField("response_headers") and s.inflight[pod] == 0
    stream.close()  # the stream's end counts nothing twice
    assert s.inflight[pod] == 0


def test_buffered_mode_answers_the_headers_at_once_and_names_the_pods_on_the_body():
    s = state()
    stream = PickerStream(s)
    raw = completion(prompt(2))
    out = run(stream, with_mode(headers(), BUFFERED))
    assert len(out) == 1 and out[0].HasField("request_headers")
    assert not out[0].request_headers.response.header_mutation.set_headers
    (out,) = run(stream, body(raw, eos=True))
    header, meta, clear = destination(out)
    assert header == meta and clear and len(header.split(",")) == 3
    # buffered, the stream lasts as long as the request: in flight until it ends
    assert sum(s.inflight.values()) == 1
    stream.close()
    assert sum(s.inflight.values()) == 0


def test_a_shared_prefix_goes_back_to_the_pod_it_went_to():
    s = state()
    shared = prompt(3, 512)
    first = None
    for i in range(5):
        stream = PickerStream(s)
        raw = completion(shared + prompt(100 + i, 16))
        out = run(stream, with_mode(headers(), STREAMED), body(raw, eos=True))
        pod = destination(out[0])[0].split(",")[0]
        first = first or pod
        assert pod == first
        stream.close()


def test_max_attempts_bounds_the_list():
    stream = PickerStream(state(), max_attempts=1)
    out = run(stream, with_mode(headers(), STREAMED), body(completion(prompt(4)), eos=True))
    assert len(destination(out[0])[0].split(",")) == 1


def subset_hint(endpoints: list[str]) -> base_pb2.Metadata:
    hint = struct_pb2.Struct()
    hint.update({SUBSET: endpoints})
    return base_pb2.Metadata(filter_metadata={SUBSET_NAMESPACE: hint})


def test_the_gateways_subset_is_honoured_and_an_empty_one_is_a_503():
    req = with_mode(headers(), STREAMED)
    req.metadata_context.CopyFrom(subset_hint([PODS["pod2"], "10.9.9.9:8000"]))
    out = run(PickerStream(state()), req, body(completion(prompt(5)), eos=True))
    assert destination(out[0])[0] == PODS["pod2"]
    req = with_mode(headers(), STREAMED)
    req.metadata_context.CopyFrom(subset_hint(["10.9.9.9:8000"]))
    (out,) = run(PickerStream(state()), req, body(completion(prompt(5)), eos=True))
    assert out.immediate_response.status.code == 503
    assert "among the endpoints the gateway allows" in json.loads(
        out.immediate_response.body)["message"]


@pytest.mark.parametrize(("raw", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (completion([1, 2, 3], model="nope"), 404, "`nope` does not exist"),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
])
def test_refused_requests_get_the_routers_own_errors(raw, status, needle):
    s = state()
    (out,) = run(PickerStream(s), with_mode(headers(), STREAMED), body(raw, eos=True))
    imm = out.immediate_response
    assert imm.status.code == status
    reply = json.loads(imm.body)
    assert reply["object"] == "error" and reply["code"] == status and needle in reply["message"]
    assert sum(s.inflight.values()) == 0


def test_no_ready_pod_is_a_503_and_an_oversized_body_a_413():
    s = state()
    for name in PODS:
        s.set_healthy(name, False)
    (out,) = run(PickerStream(s), with_mode(headers(), STREAMED),
                 body(completion(prompt(6)), eos=True))
    assert out.immediate_response.status.code == 503
    stream = PickerStream(state())
    chunk = b" " * (1 << 20)
    outs = run(stream, with_mode(headers(), STREAMED),
               *[body(chunk, eos=False) for _ in range(MAX_BODY // len(chunk) + 1)])
    assert [o.immediate_response.status.code for o in outs] == [413]


def test_a_request_without_a_body_gets_no_destination():
    """GET /health or /v1/models: the gateway's fallback (round robin) takes it."""
    (out,) = run(PickerStream(state()), with_mode(headers("/v1/models", eos=True), STREAMED))
    assert out.HasField("request_headers")
    assert not out.request_headers.response.header_mutation.set_headers


def test_trailers_after_the_body_still_get_a_pick():
    stream = PickerStream(state())
    raw = completion(prompt(7))
    out = run(stream, with_mode(headers(), STREAMED), body(raw, eos=False),
              pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    kinds = [o.WhichOneof("response") for o in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert out[1].request_body.response.body_mutation.streamed_response.body == raw


def test_the_grpc_server_picks_and_reports_health():
    """A real gRPC channel to EndpointPickerServer: one ext_proc stream per request,
    and SERVING on every health service GIE names."""

    async def scenario() -> None:
        s = state()
        server = EndpointPickerServer(s, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                checker = health_pb2_grpc.HealthStub(channel)
                for service in HEALTH_SERVICES:
                    reply = await checker.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
                stub = pb_grpc.ExternalProcessorStub(channel)
                queue: asyncio.Queue = asyncio.Queue()

                async def requests():
                    while (item := await queue.get()) is not None:
                        yield item

                call = stub.Process(requests())
                await queue.put(with_mode(headers(), STREAMED))
                await queue.put(body(completion(prompt(8)), eos=True))
                first = await call.read()
                second = await call.read()
                assert destination(first)[0].split(",")[0] in PODS.values()
                assert second.request_body.response.body_mutation.streamed_response.end_of_stream
                assert sum(s.inflight.values()) == 1  # until the pod answers
                await queue.put(None)
                assert await call.read() == grpc.aio.EOF
                for _ in range(100):
                    if sum(s.inflight.values()) == 0:
                        break
                    await asyncio.sleep(0.01)
                assert sum(s.inflight.values()) == 0  # the stream's end
        finally:
            await server.stop()

    asyncio.run(scenario())
