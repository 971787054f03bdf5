"""A throw-away PKI for the local control plane: one CA, the apiserver's serving
certificate, client certificates for each component, and the service-account key."""

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


def make_pki(directory: Path, service_ip: str = "10.0.0.1") -> None:
    """Write ca.{crt,key}, apiserver.{crt,key}, <client>.{crt,key} and sa.{key,pub}.

    Idempotent: an existing CA is kept so kubeconfigs handed out stay valid.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "ca.crt").exists() and (directory / "sa.pub").exists():
        return
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=3650)

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

    def issue(stem: str, subject: x509.Name, usage, sans=None) -> None:
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

    sans = [x509.DNSName(n) for n in SERVER_SANS] + [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
    ]
    issue("apiserver", _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    for stem, cn, org in CLIENTS:
        issue(stem, _name(cn, org), ExtendedKeyUsageOID.CLIENT_AUTH)

    # Service-account token signing key (RSA: what the token controller expects).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(directory / "sa.key", sa_key)
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
