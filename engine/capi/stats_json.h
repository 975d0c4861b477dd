// An engine's counters as one JSON object, for the C API and Python (which
// cannot take C++ structs): EngineStats's fields at the top level, and
// "transports", one object per transport with TransportStats's fields
// and its "nics". Field names are the structs'; every counter is there,
// so a reader gets from C or Python what C++ gets.
#ifndef FERRY_ENGINE_CAPI_STATS_JSON_H_
#define FERRY_ENGINE_CAPI_STATS_JSON_H_

#include <string>
#include <vector>

#include "ferry/stats.h"
#include "ferry/transfer_engine.h"

namespace ferry::capi {

std::string StatsJson(const EngineStats& engine,
                      const std::vector<TransportStats>& transports);

}  // namespace ferry::capi

#endif  // FERRY_ENGINE_CAPI_STATS_JSON_H_
