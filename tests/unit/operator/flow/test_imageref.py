"""spec.engine.image accepts exactly what the kubelet accepts as an image reference.

The parser (spillway_operator.flow.imageref) is compared with the kubelet's own Go parser in
tests/integration/test_image_reference.py, over the strategies defined here. This file
checks the parser on known cases, that the CRD's CEL rules (built from the same
grammar) give the same verdict as the parser, and that the typed spec refuses what
the parser refuses.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from spillway_operator.flow import imageref
from spillway_operator.flow.cel import CEL_RULES
from spillway_operator.flow.imageref import (
    CEL_CHECKS,
    IDENTIFIER_PATTERN,
    IMAGE_MAX_LENGTH,
    NAME_PREFIX_PATTERN,
    OFFICIAL_PATTERN,
    REFERENCE_PATTERN,
    REGISTRY_PREFIX_PATTERN,
    image_reference_error,
    parse_image_reference,
)
from spillway_operator.flow.reconciler import plan_failure
from spillway_operator.flow.spec import (
    DEFAULT_ENGINE_IMAGE,
    EngineSpec,
    InferenceDeploymentSpec,
)

HEX = "0123456789abcdef"
SHA256 = "sha256:" + "0123456789abcdef" * 4

# ------------------------------------------------------------------ strategies
# Shared with tests/integration/test_image_reference.py (the Go differential test).

_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
_WORD = _ALNUM + "ABCDEFGHIJKLMNOPQRSTUVWXYZ_"

_alnum = st.text(_ALNUM, min_size=1, max_size=6)
_separator = st.sampled_from([".", "_", "__", "-", "--", "---"])
path_components = st.builds(
    lambda head, rest: head + "".join(s + a for s, a in rest),
    _alnum, st.lists(st.tuples(_separator, _alnum), max_size=3))
_label = st.one_of(
    st.text(_ALNUM + "ABCXYZ", min_size=1, max_size=1),
    st.builds(lambda a, m, b: a + m + b, st.text(_ALNUM + "QZ", min_size=1, max_size=1),
              st.text(_ALNUM + "-QZ", max_size=8), st.text(_ALNUM + "Q", min_size=1, max_size=1)),
)
_host = st.one_of(
    st.builds(lambda labels: ".".join(labels), st.lists(_label, min_size=1, max_size=4)),
    st.builds(lambda h: f"[{h}]", st.text("0123456789abcdefABCDEF:", min_size=1, max_size=12)),
    st.sampled_from(["localhost", "docker.io", "index.docker.io", "registry.local",
                     "Registry", "ghcr.io", "127.0.0.1", "[::1]", "[fe80::1]"]),
)
domains = st.builds(lambda h, p: h + p, _host,
                    st.one_of(st.just(""), st.builds(lambda d: ":" + d,
                                                     st.text("0123456789", min_size=1,
                                                             max_size=6))))
paths = st.builds("/".join, st.lists(path_components, min_size=1, max_size=4))
tags = st.one_of(
    st.builds(lambda a, b: a + b, st.text(_WORD, min_size=1, max_size=1),
              st.text(_WORD + ".-", max_size=12)),
    st.builds(lambda a, n: a + "v" * n, st.text(_WORD, min_size=1, max_size=1),
              st.integers(120, 130)),  # around the 128-character limit
)
digests = st.builds(
    lambda alg, hexes: f"{alg}:{hexes}",
    st.sampled_from(["sha256", "sha384", "sha512"]),
    st.sampled_from([64, 96, 128]).flatmap(lambda n: st.text(HEX, min_size=n, max_size=n)),
)
_odd_digests = st.builds(
    lambda alg, hexes: f"{alg}:{hexes}",
    st.sampled_from(["sha256", "sha384", "sha512", "SHA256", "md5", "sha256+b64", "a.b",
                     "sha", "1sha", "sha-256"]),
    st.one_of(st.integers(0, 130).flatmap(lambda n: st.text(HEX + "ABCDEF", min_size=n,
                                                             max_size=n)),
              st.sampled_from(["", "xyz", "0" * 63, "0" * 65, "A" * 64, "g" * 64])),
)


def _reference(domain, path, tag, digest):
    return ((domain + "/" if domain else "") + path + (":" + tag if tag else "")
            + ("@" + digest if digest else ""))


def _long_path(size):
    return "/".join(["abcdefghi"] * (size // 10 + 1))[:size].strip("/").rstrip(".")


# References the grammar builds (some with a tag too long or a digest of the wrong
# kind, some near the path limit).
references = st.one_of(
    st.builds(_reference, st.one_of(st.just(""), domains), paths,
              st.one_of(st.just(""), tags), st.one_of(st.just(""), digests)),
    st.builds(_reference, st.one_of(st.just(""), domains), paths, st.just(""), _odd_digests),
    st.builds(_reference, st.sampled_from(["", "docker.io", "index.docker.io", "localhost",
                                           "a.b:5000", "Foo", "a_b.c"]),
              st.integers(240, 262).map(_long_path), st.just(""), st.just("")),
)

_HOSTILE = [*" \t\n\r\x00;|&$`'\"\\<>(){}*?!#%^~=,+", "é", "İ", "\u212a", "ß", "\u200b",
            "..", "//", "::", "@@", "A"]


@st.composite
def mutated(draw, base=references):
    """A reference with edits: an inserted hostile or reference character, a deleted or
    replaced one, an upper-cased stretch, a doubled separator, an empty part."""
    text = draw(base)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["insert", "delete", "upper", "double", "swap"]))
        if kind == "insert":
            text = text[:i] + draw(st.sampled_from(_HOSTILE + list(":/@._-[]"))) + text[i:]
        elif kind == "delete":
            text = text[:i] + text[i + 1:]
        elif kind == "upper":
            text = text[:i] + text[i:i + draw(st.integers(1, 8))].upper() + text[i + 8:]
        elif kind == "double" and i < len(text):
            text = text[:i] + text[i] + text[i:]
        elif i < len(text):
            text = text[:i] + draw(st.sampled_from(":/@._-0aZ")) + text[i + 1:]
    return text


hostile_references = st.one_of(
    mutated(),
    st.text(_ALNUM + "ABZ:/@._-[]", max_size=24),
    st.text(max_size=12),
    st.text(HEX, min_size=62, max_size=66),  # around the 64-hex image ID rule
    st.builds(lambda a, b: a + " " + b, references, st.sampled_from(["", "x", "; rm -rf /"])),
)
any_references = st.one_of(references, hostile_references)


# ------------------------------------------------------------------ the parser


@pytest.mark.parametrize(("text", "normalised"), [
    ("ubuntu", "docker.io/library/ubuntu"),
    ("ubuntu:24.04", "docker.io/library/ubuntu:24.04"),
    ("docker.io/ubuntu", "docker.io/library/ubuntu"),
    ("index.docker.io/team/app", "docker.io/team/app"),
    ("team/app", "docker.io/team/app"),
    ("localhost/app", "localhost/app"),
    ("localhost:5000/app", "localhost:5000/app"),
    ("Registry/app", "Registry/app"),  # an upper-case first component is a host
    ("a_b.c/app", "a_b.c/app"),  # '_' makes it a path component: no registry
    ("[::1]:5000/app:t", "[::1]:5000/app:t"),
    ("registry.local:5000/team/vllm-openai:v0.33.0@" + SHA256,
     "registry.local:5000/team/vllm-openai:v0.33.0@" + SHA256),
    ("vllm/vllm-openai@" + SHA256, "docker.io/vllm/vllm-openai@" + SHA256),
    ("a__b--c.d_e:Tag_1.0-x", "docker.io/library/a__b--c.d_e:Tag_1.0-x"),
    ("x:" + "t" * 128, "docker.io/library/x:" + "t" * 128),
    ("ABCDEF" + "0" * 58 + "/x", "ABCDEF" + "0" * 58 + "/x"),
    (DEFAULT_ENGINE_IMAGE, DEFAULT_ENGINE_IMAGE),
])
def test_accepted_references_normalise_as_the_kubelet_does(text, normalised):
    assert image_reference_error(text) is None
    assert str(parse_image_reference(text)) == normalised


@pytest.mark.parametrize(("text", "needle"), [
    ("x; rm -rf /", "';' cannot appear"),
    ("", "empty"),
    (" ubuntu", "' ' cannot appear"),
    ("ubuntu\n", "'\\n' cannot appear"),
    ("Ubuntu", "lower case"),
    ("team/App:1", "lower case"),
    ("a//b", "path component ''"),
    ("a___b", "path component 'a___b'"),
    ("a/", "path component ''"),
    ("-a", "path component '-a'"),
    ("x:" + "t" * 129, "tag"),
    ("x:.t", "tag"),
    ("x:", "tag"),
    ("x@sha256:" + "A" * 64, "digest"),
    ("x@sha256:" + "a" * 63, "digest"),
    ("x@md5:" + "a" * 32, "digest"),
    ("x@", "digest"),
    ("Foo.com:x/app", "registry"),
    ("a:b:c", "path component 'a:b'"),
    ("0123456789abcdef" * 4, "image ID"),
    ("x/" + "a" * 254, "255"),
    ("y" * 248, "255"),  # library/ makes it 256
    ("docker.io/" + "y" * 248, "255"),
])
def test_refused_references_say_what_is_wrong(text, needle):
    problem = image_reference_error(text)
    assert problem is not None and needle in problem, problem


def test_the_path_limit_counts_the_path_alone():
    assert image_reference_error("y" * 247) is None  # library/ + 247 = 255
    assert image_reference_error("x/" + "a" * 253) is None  # docker.io/ + 255
    assert image_reference_error("registry.example.com:5000/" + "a" * 255) is None
    assert image_reference_error("a_b.c/" + "a" * 249) is None  # no registry: 255 in all
    assert image_reference_error("a_b.c/" + "a" * 250) is not None


def test_a_hostile_string_is_refused_quickly():
    # Polynomial at worst: the patterns leave the regex engine few ways to backtrack.
    for text in ("a" * 20_000 + "!", "a." * 10_000 + "/", "a-" * 10_000, "[" + ":" * 20_000):
        assert image_reference_error(text) is not None


# ------------------------------------------------------------------ the CEL rules


def _re2(pattern: str) -> str:
    """An anchored RE2 pattern in Python: RE2's '$' is the end of the text."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern


def cel_admits(text: str) -> bool:
    """The CRD's three rules on spec.engine.image, evaluated with Python's re (the
    integration test evaluates the same rules in the real API server)."""
    if not re.search(_re2(REFERENCE_PATTERN), text) or re.search(_re2(IDENTIFIER_PATTERN), text):
        return False
    name = re.search(NAME_PREFIX_PATTERN, text)
    registry = re.search(REGISTRY_PREFIX_PATTERN, text)
    library = 8 if re.search(_re2(OFFICIAL_PATTERN), text) else 0
    path = len(name.group(0) if name else "") - len(registry.group(0) if registry else "")
    return path + library <= imageref.PATH_MAX


def test_the_cel_rules_are_the_patterns_emulated_here():
    rules = " ".join(rule for rule, _ in CEL_CHECKS)
    for pattern in (REFERENCE_PATTERN, IDENTIFIER_PATTERN, NAME_PREFIX_PATTERN,
                    REGISTRY_PREFIX_PATTERN, OFFICIAL_PATTERN):
        assert imageref._cel_string(pattern) in rules
    assert [e["message"].split(":")[0] for e in CEL_RULES["spec.engine.image"]] == [
        "engine.image"] * len(CEL_CHECKS)


@settings(max_examples=3000, deadline=None)
@given(any_references)
def test_the_cel_rules_agree_with_the_parser(text):
    assert cel_admits(text) == (image_reference_error(text) is None), text


# ------------------------------------------------------------------ the typed spec


def test_the_spec_refuses_an_image_the_kubelet_refuses():
    with pytest.raises(ValidationError) as info:
        InferenceDeploymentSpec(model={"name": "x/y"}, engine={"image": "x; rm -rf /"})
    err = info.value.errors()[0]
    assert err["loc"] == ("engine", "image")
    assert "';' cannot appear" in err["msg"]
    reason, message, outcome = plan_failure(info.value)
    assert (reason, outcome) == ("SpecInvalid", "refused")
    assert message.startswith("spec.engine.image: ") and "image reference" in message


def test_the_spec_caps_the_image_length():
    image = "h" * (IMAGE_MAX_LENGTH - 4) + ".io/x"  # the kubelet takes any host length
    assert image_reference_error(image) is None
    with pytest.raises(ValidationError, match=r"engine\.image\n.*at most 1024 characters"):
        InferenceDeploymentSpec(model={"name": "x/y"}, engine={"image": image})


@pytest.mark.parametrize("image", [
    DEFAULT_ENGINE_IMAGE, "vllm/vllm-openai:v0.33.0",
    "registry.local:5000/team/vllm-openai:v0.33.0@" + SHA256,
])
def test_the_spec_takes_an_image_the_kubelet_takes(image):
    assert EngineSpec(image=image).image == image  # kept as written, not normalised
