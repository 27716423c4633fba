"""cairn's SigV4 signer (src/s3/sigv4.cc) against botocore's S3SigV4Auth,
the reference: the same requests, keys and time must give the same
headers, Authorization included, byte for byte."""

import datetime
import hashlib
from urllib.parse import quote

import pytest

botocore = pytest.importorskip("botocore", reason="pip install botocore "
                               "(python/requirements.txt)")
from botocore.auth import S3SigV4Auth  # noqa: E402
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402

from cairn import _cairn  # noqa: E402

WHEN = datetime.datetime(2026, 11, 27, 21, 33, 57)
AMZ_DATE = "20261127T213357Z"

CASES = [
    # method, url base (scheme://host), path, params, headers, body, token,
    # region, signed payload
    ("GET", "http://127.0.0.1:5000", "/bucket/ckpt/metadata.json", {},
     {"Range": "bytes=0-1023"}, b"", "", "us-east-1", True),
    ("PUT", "http://127.0.0.1:5000", "/bucket/ckpt/rank 0/__0_0.safetensors",
     {"partNumber": "3", "uploadId": "a/b+c=d"}, {}, b"x" * 1000, "",
     "us-east-1", True),
    ("POST", "https://bucket.s3.eu-west-1.amazonaws.com", "/ckpt/data.bin",
     {"uploads": ""}, {"Content-Type": "application/octet-stream"}, b"",
     "FQoGZXIvYXdzE//session+token=", "eu-west-1", True),
    ("PUT", "https://s3.us-west-2.amazonaws.com", "/b/step-00000100/metadata.json",
     {}, {"If-None-Match": "*", "Content-Type": "application/json",
          "x-amz-meta-note": "  two   spaces  "}, b'{"format": 4}', "",
     "us-west-2", True),
    ("PUT", "https://s3.us-west-2.amazonaws.com", "/b/unsigned/é~x.safetensors",
     {}, {"Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg=="}, b"abc", "", "us-west-2",
     False),
    ("DELETE", "http://localhost:9000", "/bucket/k", {"uploadId": "0~1"}, {},
     b"", "tok", "auto", True),
    ("GET", "http://127.0.0.1:5000", "/bucket", {"list-type": "2",
     "prefix": "ckpt/step-", "continuation-token": "1/2=3"}, {}, b"", "",
     "us-east-1", True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]} {c[2]}" for c in CASES])
def test_signature_matches_botocore(case, monkeypatch):
    method, base, path, params, headers, body, token, region, signed = case
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: WHEN)
    request = AWSRequest(method=method, url=base + quote(path, safe="/~"),
                         params=params, headers=dict(headers), data=body)
    if not signed:
        request.context["client_config"] = Config(
            s3={"payload_signing_enabled": False})
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCY",
                            token or None), "s3", region).add_auth(request)
    want = {k.lower(): v for k, v in request.headers.items()}

    payload = (hashlib.sha256(body).hexdigest() if signed
               else "UNSIGNED-PAYLOAD")
    assert want["x-amz-content-sha256"] == payload
    host = base.split("://", 1)[1]
    got = dict(_cairn._sigv4_sign(
        method, host, path, list(params.items()), list(headers.items()),
        payload, "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCY", token,
        region, "s3", AMZ_DATE))
    assert got["authorization"] == want["authorization"]
    for name in ("x-amz-date", "x-amz-content-sha256"):
        assert got[name] == want[name]
    assert got.get("x-amz-security-token") == want.get("x-amz-security-token")
    assert got["host"] == host


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="YYYYMMDDTHHMMSSZ"):
        _cairn._sigv4_sign("GET", "h", "/", [], [], "UNSIGNED-PAYLOAD", "a",
                           "s", "", "r", "s3", "yesterday")
