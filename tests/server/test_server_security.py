"""API keys (UNAUTHENTICATED, health exempt), TLS and mTLS with certificates made here."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from mmserve.server.auth import ApiKeyInterceptor
from mmserve.server.config import ModelSpec
from mmserve_client import Client, MMServeError
from tests.server.conftest import ServerThread, serve
from tests.server.raw_rpc import HEALTH_CHECK, INFERENCE, call_raw

KEYS = ("key-one", "key-two")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(
    name: str, key: Any, issuer: tuple[x509.Name, Any] | None, ca: bool = False
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        alt = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate."""
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("mmserve test CA", ca_key, None, ca=True)
    files = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM)}
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"mmserve test {who}", key, (ca.subject, ca_key))
        files[f"{who}.pem"] = cert.public_bytes(serialization.Encoding.PEM)
        files[f"{who}.key"] = _pem_key(key)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return {name: root / name for name in files}


def _credentials(pki: dict[str, Path], client_cert: bool = False) -> grpc.ChannelCredentials:
    chain = pki["client.pem"].read_bytes() if client_cert else None
    key = pki["client.key"].read_bytes() if client_cert else None
    return grpc.ssl_channel_credentials(pki["ca.pem"].read_bytes(), key, chain)


@pytest.fixture(scope="module")
def keyed_tls_server(
    tiny_models: dict[str, Path], pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# test keys\n" + "\n".join(KEYS) + "\n\n")
    server = serve(
        [ModelSpec("tiny-b", str(tiny_models["tiny-b"]))],
        api_key_file=str(key_file),
        tls_cert=str(pki["server.pem"]),
        tls_key=str(pki["server.key"]),
    )
    yield server
    server.stop()


def test_api_keys(keyed_tls_server: ServerThread, pki: dict[str, Path]) -> None:
    target, creds = f"localhost:{keyed_tls_server.port}", _credentials(pki)
    for key in (None, "wrong", "key-one-", "Key-one"):
        with Client(target, api_key=key, credentials=creds, timeout=10) as c:
            with pytest.raises(MMServeError) as e:
                c.list_models()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(MMServeError) as e:
                c.generate("Hello", max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    for key in KEYS:
        with Client(target, api_key=key, credentials=creds, timeout=30) as c:
            assert [m.name for m in c.list_models()] == ["tiny-b"]
            assert c.generate("Hello", max_tokens=2).finish_reason == "length"


def test_health_needs_no_key_and_reflection_does(
    keyed_tls_server: ServerThread, pki: dict[str, Path]
) -> None:
    target = f"localhost:{keyed_tls_server.port}"
    with grpc.secure_channel(target, _credentials(pki)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_garbage_without_a_key_is_unauthenticated_and_never_decoded(
    keyed_tls_server: ServerThread, pki: dict[str, Path]
) -> None:
    """The key check comes before decoding: a caller without a key learns nothing about the
    request format. With a key, or on health (exempt), the same bytes are INVALID_ARGUMENT."""
    target, garbage = f"localhost:{keyed_tls_server.port}", b"\xff\xff\xff"
    with grpc.secure_channel(target, _credentials(pki)) as channel:
        for method in INFERENCE.methods:
            assert call_raw(channel, method, garbage).code == grpc.StatusCode.UNAUTHENTICATED
        assert call_raw(channel, HEALTH_CHECK, garbage).code == grpc.StatusCode.INVALID_ARGUMENT
    keyed = grpc.composite_channel_credentials(
        _credentials(pki), grpc.access_token_call_credentials(KEYS[1])
    )
    with grpc.secure_channel(target, keyed) as channel:
        for method in INFERENCE.methods:
            assert call_raw(channel, method, garbage).code == grpc.StatusCode.INVALID_ARGUMENT


def test_tls_refuses_plaintext_and_untrusted_clients(keyed_tls_server: ServerThread) -> None:
    with Client(keyed_tls_server.target, api_key=KEYS[0], timeout=5, retry_attempts=1) as c:
        with pytest.raises(MMServeError) as e:
            c.list_models()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    untrusted = grpc.ssl_channel_credentials()  # the system roots do not know our CA
    target = f"localhost:{keyed_tls_server.port}"
    with Client(target, api_key=KEYS[0], credentials=untrusted, timeout=5, retry_attempts=1) as c:
        with pytest.raises(MMServeError) as e:
            c.list_models()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate(
    tiny_models: dict[str, Path], pki: dict[str, Path]
) -> None:
    server = serve(
        [ModelSpec("tiny-b", str(tiny_models["tiny-b"]))],
        tls_cert=str(pki["server.pem"]),
        tls_key=str(pki["server.key"]),
        tls_client_ca=str(pki["ca.pem"]),
    )
    target = f"localhost:{server.port}"
    try:
        with Client(target, credentials=_credentials(pki), timeout=5, retry_attempts=1) as c:
            with pytest.raises(MMServeError) as e:
                c.list_models()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
        with Client(target, credentials=_credentials(pki, client_cert=True), timeout=30) as c:
            assert c.generate("Hello", max_tokens=2).finish_reason == "length"
    finally:
        server.stop()


def test_authorization_header_forms() -> None:
    check = ApiKeyInterceptor(list(KEYS)).authorized
    assert check([("authorization", "Bearer key-two")])
    assert check([("authorization", "bearer key-one")])
    assert check([("x-other", "1"), ("authorization", b"Bearer key-one")])
    assert not check([("authorization", "key-one")])
    assert not check([("authorization", "Basic key-one")])
    assert not check([("authorization", "Bearer ")])
    assert not check([])
    assert not check(None)


@pytest.mark.parametrize("share", [False, True])
def test_prefix_cache_is_scoped_by_key(
    tiny_models: dict[str, Path], tmp_path: Path, share: bool
) -> None:
    """With API keys, a key's prefix-cache blocks serve only its tenant: the same prompt under
    another key computes everything again (no cache-timing side channel), keys named for one
    tenant share, and --share-prefix-cache-across-keys lets every key share."""
    key_file = tmp_path / "keys.txt"
    key_file.write_text("alice\nbob\ncarol team\ndave team\n")
    server = serve(
        [ModelSpec("tiny-b", str(tiny_models["tiny-b"]))],
        api_key_file=str(key_file),
        share_prefix_cache_across_keys=share,
    )
    prompt = list(range(10, 60))  # 50 tokens: 12 full blocks of 4

    def cached(key: str) -> int:
        with Client(server.target, api_key=key, timeout=30) as c:
            usage = c.generate(prompt, max_tokens=1, temperature=0).usage
            assert usage is not None
            return usage.cached_tokens

    try:
        assert cached("alice") == 0
        assert cached("alice") >= 48  # a hit within one key
        assert cached("bob") == (48 if share else 0)
        assert cached("carol") == (48 if share else 0)
        assert cached("dave") >= 48  # carol's tenant
    finally:
        server.stop()


def test_tenants_of_keys_are_found_in_constant_time_and_say_nothing() -> None:
    from mmserve.server.auth import key_tenant

    check = ApiKeyInterceptor({"k1": "team", "k2": key_tenant("k2")})
    assert check.tenant([("authorization", "Bearer k1")]) == "team"
    assert check.tenant([("authorization", "Bearer k2")]) == key_tenant("k2")
    assert check.tenant([("authorization", "Bearer k3")]) is None
    assert "k2" not in key_tenant("k2") and key_tenant("k2") != key_tenant("k3")
