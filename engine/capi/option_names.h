// Every EngineOptions field by name, as the C API (ferry_options_set) and
// through it Python and the Mooncake shim set them: one table, so that an
// option the C++ API has is never missing from the others.
//
// Names are the field's, nested ones with their struct's prefix
// ("tcp.max_slice_bytes", "rdma.slice_bytes"). Durations are numbers with
// the unit in the name: "_ms" (milliseconds; "transfer_timeout_ms") or
// "_us" ("wait_spin_us"). Lists are comma-separated ("rdma.devices",
// "transports", "rdma.worker_cpus"); booleans 0/1 or false/true. The
// options that are not strings (EngineOptions::clock) have no name.
#ifndef FERRY_ENGINE_CAPI_OPTION_NAMES_H_
#define FERRY_ENGINE_CAPI_OPTION_NAMES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ferry/transfer_engine.h"

namespace ferry::capi {

// Sets option `name` of `options` from `value`. InvalidArgument naming
// the option for an unknown name or a value that does not parse or does
// not fit the field (the engine's Init checks ranges beyond that).
absl::Status SetOption(EngineOptions& options, absl::string_view name,
                       absl::string_view value);

// The current value of option `name`, as SetOption takes it; NotFound for
// an unknown name.
absl::StatusOr<std::string> GetOption(const EngineOptions& options,
                                      absl::string_view name);

// Every name SetOption knows, sorted (aliases excluded).
std::vector<std::string> OptionNames();

}  // namespace ferry::capi

#endif  // FERRY_ENGINE_CAPI_OPTION_NAMES_H_
