// Object storage from Python: the SigV4 signer as
// cairn._cairn._sigv4_sign, so that the tests compare it with botocore's.
#ifndef CAIRN_PYTHON_S3_H_
#define CAIRN_PYTHON_S3_H_

#include <pybind11/pybind11.h>

namespace cairn::python {

namespace py = pybind11;

// _sigv4_sign(method, host, path, query, headers, payload_sha256,
// access_key_id, secret_access_key, session_token, region, service,
// amz_date) -> list of (name, value): the headers to send. query and
// headers are lists of (name, value) pairs. ValueError on bad input.
void RegisterS3(py::module_& m);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_S3_H_
