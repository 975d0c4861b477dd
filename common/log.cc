#include "common/log.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "common/mutex.h"
#include "common/status_macros.h"
#include "spdlog/cfg/helpers.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"

namespace ferry::log {
namespace {

spdlog::level::level_enum ToSpd(Level l) {
  switch (l) {
    case Level::kTrace:
      return spdlog::level::trace;
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
    case Level::kOff:
      break;
  }
  return spdlog::level::off;
}

Level FromSpd(spdlog::level::level_enum l) {
  switch (l) {
    case spdlog::level::trace:
      return Level::kTrace;
    case spdlog::level::debug:
      return Level::kDebug;
    case spdlog::level::info:
      return Level::kInfo;
    case spdlog::level::warn:
      return Level::kWarn;
    case spdlog::level::err:
    case spdlog::level::critical:
      return Level::kError;
    default:
      return Level::kOff;
  }
}

// Every component logger writes here: to the host's sink if it set one,
// else to stderr with a timestamp, the component and the level.
class Router : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void Set(Sink sink) {
    MutexLock lock(&mu_);
    host_ = std::move(sink);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    Sink host;
    {
      MutexLock lock(&mu_);
      host = host_;
    }
    if (host) {
      host(FromSpd(msg.level),
           absl::string_view(msg.logger_name.data(), msg.logger_name.size()),
           absl::string_view(msg.payload.data(), msg.payload.size()));
      return;
    }
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
  void flush_() override { std::fflush(stderr); }

 private:
  Mutex mu_;
  Sink host_ ABSL_GUARDED_BY(mu_);
};

std::atomic<Clock*> g_clock{nullptr};

struct State {
  std::shared_ptr<Router> router = std::make_shared<Router>();
  Mutex mu;  // Serializes making components.
};

State& Get() {
  static State* state = [] {
    auto* s = new State();
    s->router->set_pattern("[%Y-%m-%d %H:%M:%S.%f] [%n] [%l] %v");
    // Levels from the environment, for loggers made from now on too.
    if (const char* spec = std::getenv("FERRY_LOG_LEVEL"); spec && *spec) {
      spdlog::cfg::helpers::load_levels(spec);
    }
    return s;
  }();
  return *state;
}

}  // namespace

class Component {
 public:
  explicit Component(std::shared_ptr<spdlog::logger> logger)
      : logger_(std::move(logger)) {}
  spdlog::logger& logger() const { return *logger_; }

 private:
  const std::shared_ptr<spdlog::logger> logger_;
};

Component* GetComponent(absl::string_view name) {
  State& s = Get();
  MutexLock lock(&s.mu);
  static auto* components = new absl::flat_hash_map<std::string, Component*>;
  Component*& c = (*components)[name];
  if (c == nullptr) {
    auto l = std::make_shared<spdlog::logger>(std::string(name), s.router);
    // The registry gives it the level set last for its name, or the global
    // one (FERRY_LOG_LEVEL, SetLevel, SetLevels), and applies later changes.
    spdlog::initialize_logger(l);
    c = new Component(std::move(l));
  }
  return c;
}

absl::StatusOr<Level> ParseLevel(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "trace") return Level::kTrace;
  if (n == "debug") return Level::kDebug;
  if (n == "info") return Level::kInfo;
  if (n == "warn" || n == "warning") return Level::kWarn;
  if (n == "error") return Level::kError;
  if (n == "off") return Level::kOff;
  return absl::InvalidArgumentError(absl::StrCat(
      "log level '", name, "' is not trace, debug, info, warn, error or off"));
}

absl::string_view LevelName(Level level) {
  static constexpr absl::string_view kNames[] = {"trace", "debug", "info",
                                                 "warn",  "error", "off"};
  return kNames[static_cast<int>(level)];
}

void SetLevel(Level level) {
  Get();
  spdlog::set_level(ToSpd(level));
}

absl::Status ValidateLevels(absl::string_view spec) {
  // Checked here: spdlog ignores what it cannot parse.
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(part, absl::MaxSplits('=', 1));
    const absl::string_view level = kv.second.empty() ? kv.first : kv.second;
    if (auto l = ParseLevel(level); !l.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("log levels '", spec, "': ", l.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::Status SetLevels(absl::string_view spec) {
  FERRY_RETURN_IF_ERROR(ValidateLevels(spec));
  Get();
  spdlog::cfg::helpers::load_levels(std::string(spec));
  return absl::OkStatus();
}

void SetSink(Sink sink) { Get().router->Set(std::move(sink)); }

bool Enabled(const Component* component, Level level) {
  return level != Level::kOff && component->logger().should_log(ToSpd(level));
}

void Write(const Component* component, Level level, absl::string_view message) {
  component->logger().log(ToSpd(level), "{}",
                          fmt::string_view(message.data(), message.size()));
}

void SetClock(Clock* clock) { g_clock.store(clock); }

bool RateLimit::Allow(absl::Duration interval, uint64_t* suppressed) {
  const int64_t now = ClockOrReal(g_clock.load())->NowNanos();
  int64_t next = next_ns_.load(std::memory_order_relaxed);
  if (now < next || !next_ns_.compare_exchange_strong(
                        next, now + absl::ToInt64Nanoseconds(interval))) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *suppressed = dropped_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace ferry::log
