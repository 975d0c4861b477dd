// Ferry's operational logs: what an operator needs to see (connects and
// disconnects with reasons, failover, rails paused and resumed,
// evictions, metadata errors, the configuration at Init), never the
// per-slice data path.
//
//   FERRY_LOG(kInfo, "rdma", "endpoint ", peer, " connected on ", rail);
//   FERRY_LOG_EVERY(kWarn, "tcp", absl::Seconds(1), "peer ", a, " refused");
//
// Each line has a timestamp, the component ("engine", "rdma", "tcp",
// "metadata", ...) and the level. Levels come from FERRY_LOG_LEVEL at the
// first use ("info", or per component: "warn,rdma=debug"; spdlog's
// syntax), from SetLevel, or from EngineOptions::log_level. A host
// application routes every line into its own logging with SetSink.
// Backed by spdlog (Debian's libspdlog-dev): named loggers, levels per
// component and sinks, without a process-wide initialisation that could
// clash with a host that uses glog itself (docs/architecture.md, Logs).
//
// Thread-safe. Arguments are evaluated only when the level is enabled.
#ifndef FERRY_COMMON_LOG_H_
#define FERRY_COMMON_LOG_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace ferry::log {

enum class Level { kTrace, kDebug, kInfo, kWarn, kError, kOff };

// "trace", "debug", "info", "warn" (or "warning"), "error", "off".
absl::StatusOr<Level> ParseLevel(absl::string_view name);
absl::string_view LevelName(Level level);

// Sets the level of every component.
void SetLevel(Level level);
// Checks a FERRY_LOG_LEVEL-style spec ("warn,rdma=debug") without applying
// it: InvalidArgument naming what is not a level.
absl::Status ValidateLevels(absl::string_view spec);
// Applies such a spec. InvalidArgument for a malformed one (nothing is
// changed then).
absl::Status SetLevels(absl::string_view spec);

// Receives every line that passes the level; replaces the default sink
// (stderr). An empty function restores the default. The sink may be
// called from any thread, concurrently.
using Sink = std::function<void(Level level, absl::string_view component,
                                absl::string_view message)>;
void SetSink(Sink sink);

// One component's logger, made on first use and never destroyed: the
// macros look it up once per call site, so a line below the level costs an
// atomic load, not a lookup in the registry.
class Component;
Component* GetComponent(absl::string_view name);
bool Enabled(const Component* component, Level level);
void Write(const Component* component, Level level, absl::string_view message);

// The clock FERRY_LOG_EVERY's intervals are measured on (null: the system
// clock, the default), so that a test of rate limiting runs on a
// SimulatedClock. Process-wide: set it back to null before `clock` goes,
// and only once no other thread may log (a logging thread may be reading
// the old clock). A call site's next allowed moment keeps the old clock's
// time, so a test that changes clocks uses call sites of its own.
void SetClock(Clock* clock);

// Per call site: at most one line per `interval` (on the clock above);
// the next one that passes says how many were suppressed in between.
class RateLimit {
 public:
  // Returns true if a line may be written now; *suppressed is the count
  // dropped since the last one.
  bool Allow(absl::Duration interval, uint64_t* suppressed);

 private:
  std::atomic<int64_t> next_ns_{0};
  std::atomic<uint64_t> dropped_{0};
};

}  // namespace ferry::log

#define FERRY_LOG(level, component, ...)                                    \
  do {                                                                      \
    static ::ferry::log::Component* const ferry_log_component_ =            \
        ::ferry::log::GetComponent(component);                              \
    if (::ferry::log::Enabled(ferry_log_component_,                         \
                              ::ferry::log::Level::level)) {                \
      ::ferry::log::Write(ferry_log_component_, ::ferry::log::Level::level, \
                          ::absl::StrCat(__VA_ARGS__));                     \
    }                                                                       \
  } while (0)

#define FERRY_LOG_EVERY(level, component, interval, ...)              \
  do {                                                                \
    static ::ferry::log::Component* const ferry_log_component_ =      \
        ::ferry::log::GetComponent(component);                        \
    static ::ferry::log::RateLimit ferry_log_limit_;                  \
    uint64_t ferry_log_dropped_ = 0;                                  \
    if (::ferry::log::Enabled(ferry_log_component_,                   \
                              ::ferry::log::Level::level) &&          \
        ferry_log_limit_.Allow(interval, &ferry_log_dropped_)) {      \
      ::ferry::log::Write(                                            \
          ferry_log_component_, ::ferry::log::Level::level,           \
          ferry_log_dropped_ == 0                                     \
              ? ::absl::StrCat(__VA_ARGS__)                           \
              : ::absl::StrCat(__VA_ARGS__, " (", ferry_log_dropped_, \
                               " similar suppressed)"));              \
    }                                                                 \
  } while (0)

#endif  // FERRY_COMMON_LOG_H_
