#include "tools/transfer_bench_report.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"

namespace ferry::transfer_bench {

void ErrorLog::Add(const absl::Status& status, uint64_t count) {
  std::string text = status.ToString();
  std::string key = WithoutNumbers(text);
  MutexLock lock(&mu_);
  for (Entry& e : entries_) {
    if (e.key == key) {
      e.count += count;
      return;
    }
  }
  if (entries_.size() >= kMaxDistinctErrors) {
    other_ += count;
    return;
  }
  std::fprintf(out_, "transfer failed: %s\n", text.c_str());
  entries_.push_back({std::move(key), std::move(text), count});
}

void ErrorLog::PrintSummary() {
  MutexLock lock(&mu_);
  for (const Entry& e : entries_) {
    std::fprintf(out_, "%llu requests failed: %s\n",
                 static_cast<unsigned long long>(e.count), e.text.c_str());
  }
  if (other_ > 0) {
    std::fprintf(out_, "%llu requests failed with other statuses\n",
                 static_cast<unsigned long long>(other_));
  }
}

std::string ErrorLog::WithoutNumbers(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool digit = text[i] >= '0' && text[i] <= '9';
    const bool in_number =
        digit || (text[i] == '.' && !out.empty() && out.back() == '#');
    if (!in_number) {
      out.push_back(text[i]);
    } else if (out.empty() || out.back() != '#') {
      out.push_back('#');
    }
  }
  return out;
}

double ReportUnitBytes(const std::string& unit) {
  static constexpr struct {
    const char* name;
    double bytes;
  } kUnits[] = {{"GB", 1e9},      {"MB", 1e6},      {"KB", 1e3},
                {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
                {"Gb", 1e9 / 8},  {"Mb", 1e6 / 8},  {"Kb", 1e3 / 8}};
  for (const auto& u : kUnits) {
    if (unit == u.name) return u.bytes;
  }
  return 0;
}

std::string Rate(double bytes_per_second, const std::string& unit,
                 int precision) {
  return absl::StrFormat("%.*f %s/s", precision,
                         bytes_per_second / ReportUnitBytes(unit), unit);
}

}  // namespace ferry::transfer_bench
