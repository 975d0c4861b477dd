// gtest assertions for absl::Status and absl::StatusOr that print the
// status when they fail (a bare ASSERT_TRUE(s.ok()) prints only "false"):
//
//   ASSERT_OK(engine.Init(options));
//   EXPECT_OK(engine.FreeBatch(batch)) << "after the wait";
//   ASSERT_OK_AND_ASSIGN(BatchId batch, engine.AllocateBatch(8));
//   EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
#ifndef FERRY_COMMON_STATUS_TESTING_H_
#define FERRY_COMMON_STATUS_TESTING_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace ferry::testing_internal {

inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

template <typename T>
::testing::AssertionResult IsOk(const char* text, const T& value) {
  const absl::Status& s = StatusOf(value);
  if (s.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << text << " is not OK: " << s;
}

template <typename T>
::testing::AssertionResult HasCode(const char* text, const char* code_text,
                                   const T& value, absl::StatusCode code) {
  const absl::Status& s = StatusOf(value);
  if (s.code() == code) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << text << " is " << s << ", expected code " << code_text;
}

}  // namespace ferry::testing_internal

#define EXPECT_OK(expr) \
  EXPECT_PRED_FORMAT1(::ferry::testing_internal::IsOk, expr)
#define ASSERT_OK(expr) \
  ASSERT_PRED_FORMAT1(::ferry::testing_internal::IsOk, expr)
#define EXPECT_STATUS(expr, code) \
  EXPECT_PRED_FORMAT2(::ferry::testing_internal::HasCode, expr, code)
#define ASSERT_STATUS(expr, code) \
  ASSERT_PRED_FORMAT2(::ferry::testing_internal::HasCode, expr, code)

#define FERRY_TESTING_CONCAT_INNER_(a, b) a##b
#define FERRY_TESTING_CONCAT_(a, b) FERRY_TESTING_CONCAT_INNER_(a, b)
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                           \
  auto FERRY_TESTING_CONCAT_(ferry_statusor_, __LINE__) = (expr); \
  ASSERT_OK(FERRY_TESTING_CONCAT_(ferry_statusor_, __LINE__));    \
  lhs = std::move(FERRY_TESTING_CONCAT_(ferry_statusor_, __LINE__)).value()

#endif  // FERRY_COMMON_STATUS_TESTING_H_
