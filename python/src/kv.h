// Key-value tables from Python (include/cairn/kv_table.h): the C++ side of
// python/cairn/_kv.py.
//
// Sources and sinks written in Python reach the library through adapters
// (a KvSource and a KvSink) that call into Python with the GIL held. cairn
// calls them from the thread running the save or load, which has released
// the GIL, between its own collectives (which take the GIL in turn when the
// communicator is a Python one): so a callback never waits for a
// collective, nor a collective for a callback.
//
// The Python layer hands over normalized entries:
//   save: (fqn, spec, buckets, source)
//   load: (fqn, sink, num_buckets, bucketing, bucket_size, buckets, columns)
// where spec is a cairn.KvTableSpec (num_buckets, bucketing, bucket_size,
// columns of name, dtype (cairn's name), width), buckets None or (begin,
// end), bucketing "chunked" or "interleaved", columns a list of names.
// source is None, a KvTableSource (a cairn table's, used as it is, without
// the GIL) or an object with begin(), next() and end(), next() returning
// None or (ids, [columns]) as DLPack exporters of host memory (the Python
// layer checks their dtypes and shapes first). sink is a KvTable (used as
// it is) or an object with apply(ids, columns), which gets `Exported`
// views of cairn's buffers, valid only during the call.
//
// A Python exception in a callback becomes the status the library reports
// on every rank: "<type>: <message>" (a cairn.Error's message as it is),
// with the code of its class (cairn.Error subclasses), kInvalidArgument for
// ValueError and TypeError, kDeadlineExceeded for TimeoutError,
// kResourceExhausted for MemoryError, kUnimplemented for
// NotImplementedError, kCancelled for KeyboardInterrupt, else kUnknown.
#ifndef CAIRN_PYTHON_KV_H_
#define CAIRN_PYTHON_KV_H_

#include <pybind11/pybind11.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cairn/cairn.h"
#include "convert.h"

namespace cairn::python {

// What one save's or load's tables need while it runs: the options'
// entries, and the adapters, table leases and Python objects behind them.
// Destroy it with the GIL held.
struct KvCalls {
  std::vector<KvTableToSave> save;
  std::vector<KvTableToLoad> load;
  std::vector<std::unique_ptr<KvSource>> sources;
  std::vector<std::unique_ptr<KvSink>> sinks;
  std::vector<std::shared_ptr<void>> leases;  // tables kept open
  KeepAlive keep;
};

// The save or load entries in `entries` (a list, or None) into `out`.
// Needs the GIL; raises the Python exception of a bad entry.
void KvTablesToSave(py::handle entries, KvCalls& out);
void KvTablesToLoad(py::handle entries, KvCalls& out);

// metadata's kv_tables, by FQN: spec (a dict), buckets, rows,
// rows_per_bucket, chunks (their count) and bytes.
py::dict KvTablesToDict(const std::map<std::string, KvTableMetadata>& tables);

// KvTable, KvTableSource and the bucketing functions.
void BindKv(py::module_& m);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_KV_H_
