"""The kubelet's image reference parser against Spillway's, and the API server's
admission of spec.engine.image.

Wherever Spillway re-implements something Kubernetes does, both are driven with the
same inputs. spillway_operator.flow.imageref re-implements reference.ParseNormalizedNamed
(github.com/distribution/reference, what the kubelet parses images with); tools/imageref
is a Go program that calls the real one (built and cached by tools/build.sh, or taken
from $SPILLWAY_IMAGEREF). Over a fixed corpus and generated references, valid and
hostile, the two give the same verdict and, for a valid one, the same normalised name.
The CRD's CEL rules then refuse at admission what the kubelet would refuse.

The differential tests need only the Go program; the admission tests need the cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client

from e2e.cluster.controlplane import default_bin_cache, read_versions
from spillway_operator.flow.imageref import (
    IMAGE_MAX_LENGTH,
    InvalidImageReference,
    image_reference_error,
    parse_image_reference,
)
from spillway_operator.flow.spec import GROUP, PLURAL, VERSION
from tests.integration.test_hostile import kubectl_apply
from tests.integration.test_operator import Env, infdep, model_configmap
from tests.unit.operator.flow.test_imageref import (
    SHA256,
    any_references,
    hostile_references,
    references,
)

IMAGEREF_ENV = "SPILLWAY_IMAGEREF"


def imageref_binary() -> Path:
    """$SPILLWAY_IMAGEREF, or the build tools/build.sh caches; missing fails (never skips)."""
    if os.environ.get(IMAGEREF_ENV):
        return Path(os.environ[IMAGEREF_ENV])
    path = (default_bin_cache() / f"imageref-v{read_versions()['IMAGEREF_BUILD']}"
            / "imageref")
    if not os.access(path, os.X_OK):
        pytest.fail(f"missing {path}: build it with tools/build.sh (or `go build` in "
                    f"tools/imageref and point {IMAGEREF_ENV} at the binary)")
    return path


class KubeletParser:
    """tools/imageref as one long-running process: a JSON string in, a verdict out."""

    def __init__(self, binary: Path):
        self.proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, encoding="utf-8")

    def parse(self, text: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(text) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"tools/imageref exited ({self.proc.poll()}) on {text!r}"
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def kubelet() -> Iterator[KubeletParser]:
    parser = KubeletParser(imageref_binary())
    yield parser
    parser.close()


def assert_same_verdict(kubelet: KubeletParser, text: str) -> bool:
    """Both parsers accept ``text`` (with the same normalised name) or both refuse it."""
    theirs = kubelet.parse(text)
    try:
        ours = str(parse_image_reference(text))
    except InvalidImageReference as exc:
        assert not theirs["ok"], (text, theirs, "we refuse: " + str(exc))
        return False
    assert theirs["ok"], (text, theirs, "we accept: " + ours)
    assert theirs["name"] == ours, text
    return True


# distribution/reference v0.6.0's own test inputs (normalize_test.go, reference_test.go),
# then Spillway's.
CORPUS = [
    "",
    "192.168.1.1",
    "192.168.1.1/repo",
    "192.168.1.1:5000",
    "192.168.1.1:5000/repo",
    "192.168.1.1:5000/repo:5050",
    "192.168.1.1:tag",
    ":justtag",
    "@sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "Uppercase/lowercase:tag",
    "Uppercase:tag",
    "[2001:db8:1:2:3:4:5:6]/repo:tag",
    "[2001:db8::1]",
    "[2001:db8::1]/repo",
    "[2001:db8::1]:5000",
    "[2001:db8::1]:5000/repo",
    "[2001:db8::1]:5000/repo:tag",
    "[2001:db8::1]:5000/repo:tag@sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "[2001:db8::1]:5000/repo@sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "[2001:db8::1]:tag",
    "[2001:db8::]:5000/repo",
    "[::1]:5000/repo",
    "[fe80::1%@invalidzone]:5000/repo",
    "[fe80::1%eth0]:5000/repo",
    "aa/asdf$$^/aa",
    "b.gcr.io/test.example.com/my-app:test.example.com",
    "busybox",
    "busybox:latest",
    "busybox@sha256:e6693c20186f837fc393390135d8a598a96a833917917789d63766cab6c59582",
    "docker.io/busybox",
    "docker.io/busybox:latest",
    "docker.io/foo",
    "docker.io/library/busybox",
    "docker.io/library/busybox:latest",
    "docker.io/library/foo",
    "docker.io/library/foo/bar",
    "docker/migrator",
    "domain/",
    "example.com/",
    "example.com/repo:tag",
    "example.com:8000/named",
    "example.com:8000/named:tagged",
    "foo",
    "foo/foo_bar.com:8080",
    "foo_bar.com:8080",
    "gcr.io/library/busybox",
    "gcr.io/library/busybox:latest@sha256:e6693c20186f837fc393390135d8a598a96a833917917789d63766cab6c59582",
    "library/busybox",
    "library/busybox:latest",
    "library/foo",
    "lowercase:Uppercase",
    "other.com/named@sha256:1234567890098765432112345667890098765432112345667890098765432112",
    "repo@sha256:ffffffffffffffffffffffffffffffffff",
    "sub-dom1.foo.com/bar/baz/quux",
    "sub-dom1.foo.com/bar/baz/quux:some-long-tag",
    "test-com:8080/foo",
    "test.com",
    "test.com/foo",
    "test.com/repo:tag",
    "test.com:5000",
    "test.com:8080/foo",
    "test.com:tag",
    "test:5000/Uppercase/lowercase:tag",
    "test:5000/repo",
    "test:5000/repo:tag",
    "test:5000/repo:tag@sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "test:5000/repo@sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "test:8080/foo",
    "test_com",
    "test_com/foo",
    "validname@invaliddigest:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "xn--7o8h.com/myimage:xn--7o8h.com@sha512:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "xn--n3h.com/foo",
    "xn--n3h.com/myimage:xn--n3h.com",
    "xn--n3h.com:18080/foo",
    "domain/" + "a" * 256 + ":tag",
    "a/" * 127 + "a:tag-puts-this-over-max",
    "example.com/" + "a" * 255 + ":tag",
    "example.com/" + "a" * 256,
    # Spillway's
    "x; rm -rf /",
    "$(curl evil)",
    "`id`",
    "ubuntu\n",
    "ubuntu ",
    "\tubuntu",
    "ubuntu\x00",
    "ubüntu",
    "\u212aelvin/x",  # KELVIN SIGN lower-cases to k
    "İ/x",
    "a" * 64,
    "0123456789abcdef" * 4,
    "0123456789ABCDEF" * 4,
    "0123456789abcdef" * 4 + ":tag",
    "sha256:" + "0" * 64,
    "ubuntu@" + SHA256,
    "ubuntu:24.04@" + SHA256,
    "ubuntu@SHA256:" + "0" * 64,
    "ubuntu@sha256:" + "A" * 64,
    "ubuntu@sha384:" + "a" * 96,
    "ubuntu@sha512:" + "a" * 128,
    "ubuntu@sha512:" + "a" * 64,
    "ubuntu@md5:" + "a" * 32,
    "ubuntu@sha256:" + "a" * 64 + "@sha256:" + "a" * 64,
    "ubuntu:" + "t" * 128,
    "ubuntu:" + "t" * 129,
    "ubuntu:-t",
    "ubuntu:.t",
    "ubuntu:_t",
    "y" * 247,
    "y" * 248,
    "docker.io/" + "y" * 247,
    "docker.io/" + "y" * 248,
    "index.docker.io/" + "y" * 248,
    "localhost/" + "y" * 255,
    "localhost/" + "y" * 256,
    "a_b.c/" + "a" * 249,
    "a_b.c/" + "a" * 250,
    "[ab]/x",
    "[AB]/x",
    "[ab]:1/x",
    "[]/x",
    "[::1]/x",
    "Registry/app",
    "REGISTRY:5000/app",
    "registry.local:5000/team/vllm-openai:v0.33.0@" + SHA256,
    "registry.local:/x",
    "registry.local:5000:6000/x",
    "-registry.local/x",
    "registry-.local/x",
    "registry..local/x",
    "a__b/c", "a___b/c", "a._b", "a-_b", "a---b", "a.-b", "a..b",
    "/x", "x/", "x//y", ":", "@", ":@", "/", "localhost", "localhost:5000",
]


@pytest.mark.parametrize("text", CORPUS)
def test_the_corpus_gets_the_kubelets_verdict(kubelet, text):
    assert_same_verdict(kubelet, text)


@settings(max_examples=4000, deadline=None, suppress_health_check=list(HealthCheck))
@given(references)
def test_generated_references_get_the_kubelets_verdict(kubelet, text):
    assert_same_verdict(kubelet, text)


@settings(max_examples=4000, deadline=None, suppress_health_check=list(HealthCheck))
@given(hostile_references)
def test_hostile_references_get_the_kubelets_verdict(kubelet, text):
    assert_same_verdict(kubelet, text)


# ------------------------------------------------------------------ admission


@pytest.fixture
def env(api, namespace, cluster, crd_installed):
    e = Env(api, namespace, cluster)
    model_configmap(e.core, namespace, "model", "gemma-3-1b-it.json")
    return e


def _with_image(image: str) -> dict:
    body = infdep("image-probe")
    body["spec"]["engine"]["image"] = image
    return body


def _admitted(env, image: str) -> bool:
    try:
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL,
                                                   _with_image(image), dry_run="All")
    except client.ApiException as exc:
        assert exc.status == 422, exc.body
        assert "spec.engine.image" in exc.body, exc.body
        return False
    return True


def test_kubectl_apply_refuses_a_shell_command_as_the_image(env, tmp_path):
    proc = kubectl_apply(env, _with_image("x; rm -rf /"), tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "spec.engine.image" in proc.stderr, proc.stderr
    assert "not an image reference the kubelet accepts" in proc.stderr, proc.stderr


def test_admission_takes_an_unusual_image_the_kubelet_takes(env):
    image = "registry.local:5000/team/vllm-openai:v0.33.0@" + SHA256
    assert image_reference_error(image) is None
    created = env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL,
                                                         _with_image(image), dry_run="All")
    assert created["spec"]["engine"]["image"] == image


def test_admission_refuses_what_the_kubelet_refuses(env, kubelet):
    """The CRD's CEL rules, evaluated by the real API server (server-side dry run), give
    the Go parser's verdict over the corpus and generated references (up to the spec's
    length cap, beyond which everything is refused)."""
    for text in CORPUS:
        expected = kubelet.parse(text)["ok"] and len(text) <= IMAGE_MAX_LENGTH
        assert _admitted(env, text) == expected, text

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(references, any_references))
    def check(text):
        expected = kubelet.parse(text)["ok"] and len(text) <= IMAGE_MAX_LENGTH
        assert _admitted(env, text) == expected, text

    check()
