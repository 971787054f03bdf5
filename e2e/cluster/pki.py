"""A throw-away PKI for the local control plane: one CA, the apiserver's serving
certificate, client certificates for each component, serving certificates for the
webhook servers the API server calls on loopback (LeaderWorkerSet's), and the
service-account key."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Client identities: (file stem, common name, organisation). The CNs match the
# built-in RBAC bindings of the control-plane components.
CLIENTS = [
    ("admin", "spillway-admin", "system:masters"),
    ("controller-manager", "system:kube-controller-manager", None),
    ("scheduler", "system:kube-scheduler", None),
    ("kwok", "kwok-controller", "system:masters"),
]

SERVER_SANS = [
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
]


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _validity() -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    return now, now + dt.timedelta(days=3650)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    return ca, key


def _issue(directory: Path, ca: x509.Certificate, ca_key, stem: str, subject: x509.Name,
           usage, sans=None) -> None:
    now, later = _validity()
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    _write_key(directory / f"{stem}.key", key)
    _write_cert(directory / f"{stem}.crt", builder.sign(ca_key, hashes.SHA256()))


def _server_sans(ips: list[str]) -> list:
    return [x509.DNSName(n) for n in SERVER_SANS] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips
    ]


def _cert_ips(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}


def make_pki(directory: Path, service_ip: str = "10.0.0.1",
             server_ips: tuple[str, ...] = ()) -> None:
    """Write ca.{crt,key}, apiserver.{crt,key}, <client>.{crt,key} and sa.{key,pub}.

    ``server_ips``: more addresses the API server is reached at (the real nodes' API
    address), put in its serving certificate's SANs beside 127.0.0.1 and ``service_ip``.

    Idempotent: an existing CA is kept so kubeconfigs handed out stay valid; only an
    apiserver certificate that lacks one of the addresses asked for is issued again.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ips = ["127.0.0.1", service_ip, *server_ips]
    if (directory / "ca.crt").exists() and (directory / "sa.pub").exists():
        if not set(ips) <= _cert_ips(directory / "apiserver.crt"):
            ca, ca_key = _load_ca(directory)
            _issue(directory, ca, ca_key, "apiserver", _name("kube-apiserver"),
                   ExtendedKeyUsageOID.SERVER_AUTH, _server_sans(ips))
        return
    now, later = _validity()

    # EC keys: generating them is instant, unlike RSA on a 2-core machine.
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("spillway-local-ca"))
        .issuer_name(_name("spillway-local-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(directory / "ca.key", ca_key)
    _write_cert(directory / "ca.crt", ca)

    _issue(directory, ca, ca_key, "apiserver", _name("kube-apiserver"),
           ExtendedKeyUsageOID.SERVER_AUTH, _server_sans(ips))
    for stem, cn, org in CLIENTS:
        _issue(directory, ca, ca_key, stem, _name(cn, org), ExtendedKeyUsageOID.CLIENT_AUTH)

    # Service-account token signing key (RSA: what the token controller expects).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(directory / "sa.key", sa_key)
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def ensure_client_cert(directory: Path, stem: str, cn: str, org: str | None = None) -> None:
    """Issue ``<stem>.{crt,key}`` for the identity ``cn`` (in group ``org``) from the CA
    ``make_pki`` wrote, unless that certificate is there already: the real nodes'
    kubelets (``system:node:<name>`` in ``system:nodes``), kube-proxy, and the API
    server's client certificate for the kubelets."""
    crt = directory / f"{stem}.crt"
    if crt.exists() and (directory / f"{stem}.key").exists():
        subject = x509.load_pem_x509_certificate(crt.read_bytes()).subject
        if subject == _name(cn, org):
            return
    ca, ca_key = _load_ca(directory)
    _issue(directory, ca, ca_key, stem, _name(cn, org), ExtendedKeyUsageOID.CLIENT_AUTH)


def ensure_serving_cert(directory: Path, stem: str, cn: str,
                        dns_names: tuple[str, ...] = ("localhost",),
                        ips: tuple[str, ...] = ("127.0.0.1",)) -> None:
    """Issue ``<stem>.{crt,key}``, a serving certificate from the CA ``make_pki`` wrote
    for ``dns_names`` and ``ips``, unless one with those names is there already: the
    certificate of a webhook server the API server reaches at ``https://127.0.0.1:PORT``
    (LeaderWorkerSet's, whose own certificate rotation needs an in-cluster Service)."""
    crt = directory / f"{stem}.crt"
    if crt.exists() and (directory / f"{stem}.key").exists():
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            sans = None
        if sans is not None and set(dns_names) <= set(sans.get_values_for_type(x509.DNSName)) \
                and set(ips) <= _cert_ips(crt) and cert.subject == _name(cn):
            return
    ca, ca_key = _load_ca(directory)
    sans = [x509.DNSName(n) for n in dns_names] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips
    ]
    _issue(directory, ca, ca_key, stem, _name(cn), ExtendedKeyUsageOID.SERVER_AUTH, sans)
