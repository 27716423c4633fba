// The whole public API of cairn.
#ifndef CAIRN_CAIRN_H_
#define CAIRN_CAIRN_H_

#include "cairn/async_save.h"   // IWYU pragma: export
#include "cairn/box.h"          // IWYU pragma: export
#include "cairn/checkpoint.h"   // IWYU pragma: export
#include "cairn/communicator.h" // IWYU pragma: export
#include "cairn/dlpack.h"       // IWYU pragma: export
#include "cairn/dtype.h"        // IWYU pragma: export
#include "cairn/huggingface.h"  // IWYU pragma: export
#include "cairn/import_names.h" // IWYU pragma: export
#include "cairn/kv_table.h"     // IWYU pragma: export
#include "cairn/manager.h"      // IWYU pragma: export
#include "cairn/metadata.h"     // IWYU pragma: export
#include "cairn/planner.h"      // IWYU pragma: export
#include "cairn/rocksdb_kv_table.h"  // IWYU pragma: export
#include "cairn/stager.h"       // IWYU pragma: export
#include "cairn/state_dict.h"   // IWYU pragma: export
#include "cairn/state_dict_utils.h"  // IWYU pragma: export
#include "cairn/storage.h"      // IWYU pragma: export
#include "cairn/tensor.h"       // IWYU pragma: export
#include "cairn/verify.h"       // IWYU pragma: export

#include "cairn/version.h"      // IWYU pragma: export

#endif  // CAIRN_CAIRN_H_
