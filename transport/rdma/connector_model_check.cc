// What the model checker reads of a World: whether it is quiescent, the
// checks of a step, of a settled rail and of liveness, and the canonical
// key of its state for the visited set.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "transport/rdma/connector_model.h"

namespace ferry::rdma::model {
namespace {

using Phase = RailConnector::Phase;

void Put(std::string* k, uint64_t v) {
  k->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// A std::map iterates in key order: its entries as they come are canonical.
void PutMap(std::string* k, const std::map<uint64_t, int>& m) {
  Put(k, m.size());
  for (const auto& [key, value] : m) {
    Put(k, key);
    Put(k, static_cast<uint64_t>(value));
  }
}

// Messages and operations in flight are sets: any may go next, so their
// order is not state. Each item is encoded on its own, then sorted.
template <typename T, typename Encode>
void PutSet(std::string* k, const std::vector<T>& items, Encode encode) {
  std::vector<std::string> parts;
  parts.reserve(items.size());
  for (const T& item : items) {
    std::string p;
    encode(item, &p);
    parts.push_back(std::move(p));
  }
  std::sort(parts.begin(), parts.end());
  Put(k, parts.size());
  for (const std::string& p : parts) *k += p;
}

}  // namespace

bool World::Quiescent() const {
  if (!msgs_.empty() || !ops_.empty()) return false;
  for (int side = 0; side < 2; ++side) {
    if (sides_[side].m.deadline_ns() != 0 || UseFails(side)) return false;
  }
  return true;
}

absl::Status World::CheckStep() const {
  if (!error_.empty()) return absl::InternalError(error_);
  for (const Side& s : sides_) {
    FERRY_RETURN_IF_ERROR(s.m.CheckInvariants());
  }
  return absl::OkStatus();
}

absl::Status World::CheckQuiescent() const {
  for (int side = 0; side < 2; ++side) {
    const Side& s = sides_[side];
    const Phase p = s.m.phase();
    if (p != Phase::kIdle && p != Phase::kConnected) {
      return absl::InternalError(
          absl::StrCat("side ", side, " wedged in ", s.m.DebugString()));
    }
    for (const auto& [ep, q] : s.ep_qp) {
      if (ep != s.m.ep()) {
        return absl::InternalError(
            absl::StrCat("side ", side, " keeps endpoint ", ep,
                         " that is not the rail's: ", s.m.DebugString()));
      }
    }
  }
  auto qp_of = [&](int side) {
    const Side& s = sides_[side];
    auto it = s.ep_qp.find(s.m.ep());
    return it == s.ep_qp.end() ? -1 : it->second;
  };
  const bool c0 = sides_[0].m.phase() == Phase::kConnected;
  const bool c1 = sides_[1].m.phase() == Phase::kConnected;
  if (c0 && c1) {
    const int q0 = qp_of(0), q1 = qp_of(1);
    if (q0 < 0 || q1 < 0 || qps_[q0].remote != q1 || qps_[q1].remote != q0 ||
        !qps_[q0].alive || !qps_[q1].alive) {
      return absl::InternalError(absl::StrCat(
          "sides disagree on the endpoint: ", sides_[0].m.DebugString(), " q",
          q0, " | ", sides_[1].m.DebugString(), " q", q1));
    }
    if (sides_[0].m.conn_epoch() != sides_[1].m.conn_epoch()) {
      return absl::InternalError("sides disagree on the connection's epoch");
    }
  } else if (c0 || c1) {
    return absl::InternalError(
        absl::StrCat("half-open: ", sides_[0].m.DebugString(), " | ",
                     sides_[1].m.DebugString()));
  }
  // No QP outlives its endpoint.
  int alive = 0;
  for (const Qp& q : qps_) alive += q.alive;
  const int expected = (c0 ? 1 : 0) + (c1 ? 1 : 0);
  if (alive != expected) {
    return absl::InternalError(
        absl::StrCat(alive, " QPs alive for ", expected, " connected sides"));
  }
  return absl::OkStatus();
}

absl::Status World::CheckLive() const {
  for (int side = 0; side < 2; ++side) {
    const Side& s = sides_[side];
    const bool wanted = sides_[0].wanted || sides_[1].wanted;
    if (wanted && s.m.phase() != Phase::kConnected) {
      return absl::InternalError(
          absl::StrCat("without faults, side ", side,
                       " did not connect: ", s.m.DebugString()));
    }
  }
  if (fails_ != 0) {
    return absl::InternalError(
        absl::StrCat(fails_, " endpoints failed without a fault"));
  }
  return absl::OkStatus();
}

std::string World::Key() const {
  std::string k;
  k.reserve(512);
  for (const Side& s : sides_) {
    s.m.AppendKey(&k);
    Put(&k, s.inc);
    Put(&k, s.peer_inc);
    Put(&k, static_cast<uint64_t>(s.needs_left) * 2 + (s.wanted ? 1 : 0));
    PutMap(&k, s.ep_qp);
    PutMap(&k, s.attempt_qp);
  }
  Put(&k, qps_.size());
  for (const Qp& q : qps_) {
    Put(&k, (static_cast<uint64_t>(q.remote + 1) << 2) | (q.alive ? 2u : 0u) |
                static_cast<uint64_t>(q.side));
  }
  PutSet(&k, msgs_, [](const Msg& m, std::string* p) {
    Put(p, static_cast<uint64_t>(m.type) | static_cast<uint64_t>(m.to) << 8 |
               static_cast<uint64_t>(m.result) << 16);
    Put(p, m.from_inc);
    Put(p, m.to_inc);
    Put(p, m.attempt);
    Put(p, static_cast<uint64_t>(m.qp));
    Put(p, m.epoch);
  });
  PutSet(&k, ops_, [](const Op& o, std::string* p) {
    Put(p, static_cast<uint64_t>(o.type) | static_cast<uint64_t>(o.side) << 8);
    Put(p, o.side_inc);
    Put(p, o.ep);
    Put(p, o.attempt);
    Put(p, o.epoch);
    Put(p, static_cast<uint64_t>(o.qp));
    Put(p, static_cast<uint64_t>(o.remote_qp));
    Put(p, o.req_from_inc);
  });
  Put(&k, static_cast<uint64_t>(budget_.drops) |
              static_cast<uint64_t>(budget_.op_failures) << 8 |
              static_cast<uint64_t>(budget_.local_failures) << 16 |
              static_cast<uint64_t>(budget_.evictions) << 24 |
              static_cast<uint64_t>(budget_.restarts) << 32);
  Put(&k, static_cast<uint64_t>(fails_));
  Put(&k, next_ep_);
  return k;
}

}  // namespace ferry::rdma::model
