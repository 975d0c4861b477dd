#include "metadata/etcd/etcd_rpc.h"

#include "metadata/grpc_deadline.h"

namespace ferry::metadata {

using etcdserverpb::Compare;
using etcdserverpb::RequestOp;

RequestOp RangeOp(const std::string& key, const std::string& end,
                  int64_t limit) {
  RequestOp op;
  auto* r = op.mutable_request_range();
  r->set_key(key);
  r->set_range_end(end);
  r->set_limit(limit);
  return op;
}

RequestOp PutOp(const std::string& key, const std::string& value,
                int64_t lease) {
  RequestOp op;
  auto* p = op.mutable_request_put();
  p->set_key(key);
  p->set_value(value);
  p->set_lease(lease);
  return op;
}

RequestOp DeleteOp(const std::string& key, const std::string& end) {
  RequestOp op;
  op.mutable_request_delete_range()->set_key(key);
  op.mutable_request_delete_range()->set_range_end(end);
  return op;
}

Compare ValueIs(const std::string& key, const std::string& value) {
  Compare c;
  c.set_key(key);
  c.set_target(Compare::VALUE);
  c.set_result(Compare::EQUAL);
  c.set_value(value);
  return c;
}

Compare Absent(const std::string& key) {
  Compare c;
  c.set_key(key);
  c.set_target(Compare::CREATE);
  c.set_result(Compare::EQUAL);
  c.set_create_revision(0);
  return c;
}

Compare ModRevisionIs(const std::string& key, int64_t rev) {
  Compare c;
  c.set_key(key);
  c.set_target(Compare::MOD);
  c.set_result(Compare::EQUAL);
  c.set_mod_revision(rev);
  return c;
}

void SetDeadline(grpc::ClientContext* ctx, Clock* clock, absl::Time deadline) {
  ctx->set_deadline(GrpcDeadline(deadline - clock->Now()));
}

}  // namespace ferry::metadata
