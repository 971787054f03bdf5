"""Container image references, accepted exactly as the kubelet accepts them.

The kubelet parses a container's image with ``ParseNormalizedNamed`` of
github.com/distribution/reference v0.6.0 (k8s.io/kubernetes/pkg/util/parsers,
Kubernetes 1.35.4) and reports ``InvalidImageName`` for what it refuses. This module
is that parser in Python, built from the same grammar (reference's regexp.go):

    reference := name [ ":" tag ] [ "@" digest ]
    name      := [ domain "/" ] path-component ( "/" path-component )*
    domain    := host [ ":" port ]        host: DNS-style labels joined by '.', or [IPv6]
    path-component := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
    tag       := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest    := sha256:<64 hex> | sha384:<96 hex> | sha512:<128 hex>   (lowercase hex)

and its normalisation: a first component that is ``localhost`` or holds a '.', a ':'
or an upper-case letter is the registry; otherwise the registry is ``docker.io``, and a
one-component name there gains ``library/``. The repository path (the name after the
registry) is at most 255 characters, the part before the tag must be lower case, and a
64-character lower-case hex string (an image ID) is refused.

``tests/integration/test_image_reference.py`` drives this module and the Go parser
itself (tools/imageref) with the same generated inputs and asserts they agree. The
CRD's CEL rules on spec.engine.image (``CEL_CHECKS``) are built here from the same
pieces; ``tests/unit/operator/flow/test_imageref.py`` checks they agree with this parser too.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# ------------------------------------------------------------ the grammar (regexp.go)
# Written in the syntax Python's re and RE2 (the API server's CEL) read alike: no
# \w (Unicode in Python), no POSIX classes, every class spelled in ASCII.

_ALPHANUMERIC = "[a-z0-9]+"
_SEPARATOR = "(?:[._]|__|[-]+)"
_DOMAIN_COMPONENT = "(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_NAME = f"{_DOMAIN_COMPONENT}(?:[.]{_DOMAIN_COMPONENT})*"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_HOST = f"(?:{_DOMAIN_NAME}|{_IPV6})"
_DOMAIN = f"{_HOST}(?::[0-9]+)?"
_PATH_COMPONENT = f"{_ALPHANUMERIC}(?:{_SEPARATOR}{_ALPHANUMERIC})*"
_REMOTE_NAME = f"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_NAME = f"(?:{_DOMAIN}/)?{_REMOTE_NAME}"
_TAG = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
# What the reference grammar reads as a digest; go-digest then accepts only these
# algorithms (the kubelet links sha256 and sha512), each with its exact hex length.
_DIGEST_SYNTAX = "[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha384": 96, "sha512": 128}
_DIGEST = "(?:" + "|".join(f"{a}:[a-f0-9]{{{n}}}" for a, n in DIGEST_HEX_LENGTHS.items()) + ")"

PATH_MAX = 255  # reference.RepositoryNameTotalLengthMax
# The spec's cap on an image string, which bounds the CEL rules' cost. The grammar
# bounds everything but the host: a 253-character DNS name, a port, a 255-character
# path, a 128-character tag and a sha512 digest come to 780; longer strings (only a
# host longer than DNS allows) are the one thing refused that the kubelet would take.
IMAGE_MAX_LENGTH = 1024
DEFAULT_DOMAIN = "docker.io"
LEGACY_DEFAULT_DOMAIN = "index.docker.io"
OFFICIAL_PREFIX = "library/"

_REFERENCE = re.compile(f"({_NAME})(?::({_TAG}))?(?:@({_DIGEST_SYNTAX}))?")
_ANCHORED_NAME = re.compile(f"(?:({_DOMAIN})/)?({_REMOTE_NAME})")
_IDENTIFIER = re.compile("[a-f0-9]{64}")
_TAG_RE = re.compile(_TAG)
_DIGEST_RE = re.compile(_DIGEST)
_DOMAIN_RE = re.compile(_DOMAIN)
_PATH_COMPONENT_RE = re.compile(_PATH_COMPONENT)
_ALPHABET = re.compile(r"[A-Za-z0-9._:/@\[\]-]")

# ------------------------------------------------------------ the CRD's CEL rules
# Anchored patterns for CEL's matches()/find() (RE2: '$' is the end of the text).

# The whole grammar, with the digest algorithms go-digest accepts. Given the
# normalisation above, a string is accepted exactly when it matches this, is not an
# image ID, and its repository path is at most PATH_MAX characters.
# One case of the normaliser shows in it: a bracketed host with neither ':' nor an
# upper-case letter ("[ab]/x") is not taken for a registry, so it needs a port here.
_PORT = "(?::[0-9]+)?"
_CEL_DOMAIN = (f"(?:{_DOMAIN_NAME}{_PORT}|\\[[a-fA-F0-9:]*[A-F:][a-fA-F0-9:]*\\]{_PORT}"
               f"|{_IPV6}:[0-9]+)")
REFERENCE_PATTERN = f"^(?:{_CEL_DOMAIN}/)?{_REMOTE_NAME}(?::{_TAG})?(?:@{_DIGEST})?$"
IDENTIFIER_PATTERN = "^[a-f0-9]{64}$"
# For a string REFERENCE_PATTERN accepts: the name (before the tag and digest); the
# registry prefix the normaliser strips ("localhost/", or a first component with '.',
# ':' or an upper-case letter and no '_': a '_' makes it a path component); and the
# strings that gain "library/" (one component, on Docker Hub).
NAME_PREFIX_PATTERN = "^(?:[^/]*/)*[^/:@]*"
REGISTRY_PREFIX_PATTERN = "^(?:localhost|[^/_]*[.:A-Z][^/_]*)/"
OFFICIAL_PATTERN = "^(?:(?:docker[.]io|index[.]docker[.]io)/)?[^/]*$"


def _cel_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# (rule, why): each an x-kubernetes-validations rule on the image string.
CEL_CHECKS: list[tuple[str, str]] = [
    (
        f"self.matches({_cel_string(REFERENCE_PATTERN)})",
        "not an image reference the kubelet accepts ([host[:port]/]path[:tag][@digest]: "
        "path components of lower-case letters and digits joined by '.', '_', '__' or '-'; "
        "a tag of at most 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'; "
        "a sha256, sha384 or sha512 digest in lower-case hex); the kubelet would report "
        "InvalidImageName",
    ),
    (
        f"!self.matches({_cel_string(IDENTIFIER_PATTERN)})",
        "a 64-character hexadecimal string is an image ID, not an image reference "
        "(the kubelet refuses it)",
    ),
    (
        f"size(self.find({_cel_string(NAME_PREFIX_PATTERN)})) - "
        f"size(self.find({_cel_string(REGISTRY_PREFIX_PATTERN)})) + "
        f"(self.matches({_cel_string(OFFICIAL_PATTERN)}) ? {len(OFFICIAL_PREFIX)} : 0) "
        f"<= {PATH_MAX}",
        f"the repository path (the name after the registry, with library/ on Docker Hub) "
        f"is at most {PATH_MAX} characters",
    ),
]


# ------------------------------------------------------------ the parser


class ImageReference(NamedTuple):
    domain: str  # "" when the kubelet's parser finds no registry in the name
    path: str
    tag: str
    digest: str

    def __str__(self) -> str:
        """The normalised reference, as reference.Named's String() writes it."""
        name = f"{self.domain}/{self.path}" if self.domain else self.path
        return name + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")


class InvalidImageReference(ValueError):
    pass


def _split_docker_domain(name: str) -> tuple[str, str]:
    """reference.splitDockerDomain: the registry and the rest of a familiar name."""
    first, slash, rest = name.partition("/")
    if not slash:
        return DEFAULT_DOMAIN, OFFICIAL_PREFIX + name
    if first == "localhost":
        domain, remote = first, rest
    elif first == LEGACY_DEFAULT_DOMAIN:
        domain, remote = DEFAULT_DOMAIN, rest
    elif "." in first or ":" in first or first.lower() != first:
        domain, remote = first, rest
    else:
        domain, remote = DEFAULT_DOMAIN, name
    if domain == DEFAULT_DOMAIN and "/" not in remote:
        remote = OFFICIAL_PREFIX + remote
    return domain, remote


def parse_image_reference(text: str) -> ImageReference:
    """The reference the kubelet pulls for ``text``, or InvalidImageReference saying
    what is wrong (reference.ParseNormalizedNamed, step by step)."""
    if _IDENTIFIER.fullmatch(text):
        raise InvalidImageReference(
            "a 64-character hexadecimal string is an image ID, not an image reference")
    domain, remainder = _split_docker_domain(text)
    remote = remainder.split(":", 1)[0]
    m = None
    if remote.lower() == remote:
        m = _REFERENCE.fullmatch(f"{domain}/{remainder}")
    if m is None:
        raise InvalidImageReference(_diagnose(text))
    name, tag, digest = m.group(1), m.group(2) or "", m.group(3) or ""
    named = _ANCHORED_NAME.fullmatch(name)
    assert named is not None  # the reference pattern holds the name pattern
    registry, path = named.group(1) or "", named.group(2)
    if len(path) > PATH_MAX:
        raise InvalidImageReference(
            f"the repository path is {len(path)} characters; at most {PATH_MAX}")
    if digest:
        algorithm, _, hex_part = digest.partition(":")
        length = DIGEST_HEX_LENGTHS.get(algorithm)
        if length is None:
            raise InvalidImageReference(
                f"digest algorithm {algorithm!r} is not one of sha256, sha384, sha512")
        if len(hex_part) != length or not re.fullmatch("[a-f0-9]+", hex_part):
            raise InvalidImageReference(
                f"a {algorithm} digest is {length} lower-case hexadecimal digits")
    return ImageReference(registry, path, tag, digest)


def image_reference_error(text: str) -> str | None:
    """Why the kubelet would refuse ``text`` as a container image (InvalidImageName),
    or None when it accepts it."""
    try:
        parse_image_reference(text)
    except InvalidImageReference as exc:
        return str(exc)
    return None


def _shown(part: str, limit: int = 40) -> str:
    return repr(part if len(part) <= limit else part[:limit] + "...")


def _diagnose(text: str) -> str:
    """A short reason for a string the grammar refuses (the verdict is made above)."""
    if not text:
        return "an image reference cannot be empty"
    bad = next((c for c in text if not _ALPHABET.fullmatch(c)), None)
    if bad is not None:
        return f"{bad!r} cannot appear in an image reference"
    name, at, digest = text.partition("@")
    if at and not _DIGEST_RE.fullmatch(digest):
        return ("the digest (after '@') must be sha256:, sha384: or sha512: with 64, 96 or "
                "128 lower-case hexadecimal digits")
    tag = ""
    if name.rfind(":") > name.rfind("/"):
        name, tag = name[: name.rfind(":")], name[name.rfind(":") + 1:]
        if not _TAG_RE.fullmatch(tag):
            return ("the tag (after ':') must be 1 to 128 letters, digits, '_', '.' or '-', "
                    "and not start with '.' or '-'")
    first, slash, rest = name.partition("/")
    path = name
    if slash and (first == "localhost" or "." in first or ":" in first
                  or first.lower() != first):  # the normaliser takes it for a registry
        if _DOMAIN_RE.fullmatch(first):
            path = rest
        elif not _PATH_COMPONENT_RE.fullmatch(first):
            return f"{_shown(first)} is not a registry host[:port]"
    if path.lower() != path:
        return "the repository path must be lower case"
    for component in path.split("/"):
        if not _PATH_COMPONENT_RE.fullmatch(component):
            return (f"path component {_shown(component)} must be lower-case letters and digits "
                    "joined by '.', '_', '__' or '-'")
    return "not of the form [host[:port]/]path[:tag][@digest]"
