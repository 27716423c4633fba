// Object storage from Python: the `s3` option of save and load (a dict of
// S3Options' fields), and the SigV4 signer as cairn._cairn._sigv4_sign, so
// that the tests compare it with botocore's.
#ifndef CAIRN_PYTHON_S3_H_
#define CAIRN_PYTHON_S3_H_

#include <pybind11/pybind11.h>

#include "cairn/storage.h"

namespace cairn::python {

namespace py = pybind11;

// _sigv4_sign(method, host, path, query, headers, payload_sha256,
// access_key_id, secret_access_key, session_token, region, service,
// amz_date) -> list of (name, value): the headers to send. query and
// headers are lists of (name, value) pairs. ValueError on bad input.
void RegisterS3(py::module_& m);

// S3Options from a dict such as {"endpoint": "http://127.0.0.1:9000",
// "access_key_id": ..., "addressing": "path", "part_bytes": 16 << 20}:
// every S3Options field by name, "addressing" as "auto", "path" or
// "virtual". TypeError naming an unknown key or a value of the wrong type.
S3Options S3OptionsFrom(py::handle value);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_S3_H_
