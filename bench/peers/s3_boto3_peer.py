#!/usr/bin/env python3
"""What an S3-compatible server serves to boto3, the reference client:
SIZE bytes uploaded in 16 MiB parts on 8 threads, then downloaded the
same way, --repeat times; medians as JSON on stdout. The ceiling beside
`cairn bench --dir s3://...` (bench/RESULTS.md).

    AWS_ENDPOINT_URL=http://127.0.0.1:5000 python3 s3_boto3_peer.py --bucket b
"""
import argparse
import io
import json
import os
import statistics
import time

import boto3
from boto3.s3.transfer import TransferConfig


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bucket", required=True)
    p.add_argument("--key", default="cairn-boto3-peer/object")
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    s3 = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
    cfg = TransferConfig(multipart_threshold=16 << 20,
                         multipart_chunksize=16 << 20, max_concurrency=8)
    data = os.urandom(a.mib << 20)
    up, down = [], []
    for _ in range(a.repeat):
        t = time.perf_counter()
        s3.upload_fileobj(io.BytesIO(data), a.bucket, a.key, Config=cfg)
        up.append(time.perf_counter() - t)
        buf = io.BytesIO()
        t = time.perf_counter()
        s3.download_fileobj(a.bucket, a.key, buf, Config=cfg)
        down.append(time.perf_counter() - t)
        assert buf.getvalue() == data
    s3.delete_object(Bucket=a.bucket, Key=a.key)
    print(json.dumps({
        "bytes": len(data), "upload_seconds": up, "download_seconds": down,
        "upload_gb_per_s": len(data) / statistics.median(up) / 1e9,
        "download_gb_per_s": len(data) / statistics.median(down) / 1e9}))


if __name__ == "__main__":
    main()
