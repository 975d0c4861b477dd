// Small helpers for absl::Status plumbing. Debian's abseil (20220623) has no
// public RETURN_IF_ERROR / ASSIGN_OR_RETURN, so Ferry defines its own once.
#ifndef FERRY_COMMON_STATUS_MACROS_H_
#define FERRY_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns from the enclosing function if `expr` yields a non-OK status.
#define FERRY_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status ferry_status_ = (expr);         \
    if (!ferry_status_.ok()) return ferry_status_; \
  } while (0)

#define FERRY_STATUS_CONCAT_INNER_(a, b) a##b
#define FERRY_STATUS_CONCAT_(a, b) FERRY_STATUS_CONCAT_INNER_(a, b)

// `FERRY_ASSIGN_OR_RETURN(auto x, Foo());` assigns the value of a StatusOr or
// returns its status from the enclosing function.
#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_ASSIGN_OR_RETURN_IMPL_(           \
      FERRY_STATUS_CONCAT_(ferry_statusor_, __LINE__), lhs, expr)

#define FERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

#endif  // FERRY_COMMON_STATUS_MACROS_H_
