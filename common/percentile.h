// Percentile: the quantile every benchmark and report of Ferry's takes, so
// that their p50 and p99 mean the same thing.
#ifndef FERRY_COMMON_PERCENTILE_H_
#define FERRY_COMMON_PERCENTILE_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace ferry {

// The p-th quantile (0..1) of `v`, the nearest rank below (rank
// p x (n - 1), rounded down); 0 if empty. Reorders `v` (nth_element).
inline double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(
      v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1)));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k),
                   v.end());
  return v[k];
}

}  // namespace ferry

#endif  // FERRY_COMMON_PERCENTILE_H_
