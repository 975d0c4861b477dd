// RailRouter: the rail choice for one run of slices to one peer, from a
// snapshot of the loads and health taken once per run (no lock, no
// verbs; header-only, it is on the data path).
//
// A rail is a (local NIC i, remote NIC j) pair, index i * n_remote + j.
// Each slice takes the least loaded usable rail: local NIC load plus rail
// load, charging a NIC four slices per topology tier away from the
// slice's buffer (near NICs win at low load, all stripe under load) and
// one slice for leaving the matched pair (NIC i <-> remote NIC i, the
// usual rail wiring). NICs whose port is down and remote NICs without a
// key for the buffer are never used; paused rails and rails the slice
// already failed on only if nothing else is left. The snapshot is updated
// as slices are assigned (Assign), so the slices of one request spread
// over all NICs; `rotation` varies where ties start from run to run.
// SlicePath asks once per stripe (rdma.stripe_bytes of slices that
// continue each other in memory) and assigns the whole stripe.
#ifndef FERRY_TRANSPORT_RDMA_RAIL_ROUTER_H_
#define FERRY_TRANSPORT_RDMA_RAIL_ROUTER_H_

#include <cstdint>

#include "absl/container/inlined_vector.h"

namespace ferry::rdma {

class RailRouter {
 public:
  struct RailState {
    uint64_t load = 0;  // Bytes in flight on the rail's endpoint.
    bool paused = false;
  };

  // `unit`: the slice size the tier and pair charges are counted in.
  RailRouter(int n_local, int n_remote, uint64_t unit, uint64_t rotation)
      : n_local_(n_local),
        n_remote_(n_remote),
        unit_(unit),
        rot_(rotation),
        rails_(static_cast<size_t>(n_local) * n_remote),
        nic_load_(n_local, 0),
        nic_up_(n_local, false),
        keys_(n_remote, -1) {}

  int n_rails() const { return n_local_ * n_remote_; }
  int local_of(int rail) const { return rail / n_remote_; }
  int remote_of(int rail) const { return rail % n_remote_; }

  // Mutable access to a rail's state, for setting up the snapshot.
  RailState& rail(int r) {
    rows_valid_ = false;
    return rails_[r];
  }
  void SetNic(int i, uint64_t load, bool up) {
    nic_load_[i] = load;
    nic_up_[i] = up;
  }
  // The remote key, per remote NIC, of the buffer the next slices target
  // (-1: that NIC has none).
  void SetKey(int j, int64_t key) {
    // The rows depend on which remote NICs have a key, not on the keys: a
    // run's next buffer usually has one on the same NICs, and then the
    // rows stand.
    if ((keys_[j] < 0) != (key < 0)) rows_valid_ = false;
    keys_[j] = key;
  }
  int64_t key(int j) const { return keys_[j]; }

  // The best rail for a slice whose buffer is `tiers[i]` topology tiers
  // from local NIC i, and which failed on the rails of `failed` (bit r:
  // rail r); -1 if none is usable.
  //
  // With more than kScanRails rails, a slice that has not failed (nearly
  // all) costs O(local + remote NICs), not O(rails): each local NIC's best
  // remote NIC is kept (rows below), and Assign refreshes only the row it
  // changed. The answer is the same as ChooseByScan's, ties included
  // (rail_router_test checks it). Up to kScanRails, scoring every rail is
  // cheaper than keeping the rows (hotpath_benchmark: 1x1 and 2x2).
  template <typename Tiers>
  int Choose(const Tiers& tiers, uint64_t failed) {
    if (failed != 0 || n_rails() <= kScanRails) {
      return ChooseByScan(tiers, failed);
    }
    if (!rows_valid_) BuildRows();
    int best = -1;
    uint64_t best_score = ~uint64_t{0};
    for (int li = 0; li < n_local_; ++li) {
      const int i = static_cast<int>((li + rot_) % n_local_);
      if (!nic_up_[i] || row_best_[i] < 0) continue;
      const uint64_t score = nic_load_[i] +
                             static_cast<uint64_t>(tiers[i]) * 4 * unit_ +
                             row_score_[i];
      if (score < best_score) {
        best_score = score;
        best = i * n_remote_ + row_best_[i];
      }
    }
    // None: every usable rail is paused (ChooseByScan's second pass).
    return best >= 0 ? best : ChooseByScan(tiers, failed);
  }

  // Choose by scoring every rail: for slices that failed on some rails,
  // when every usable rail is paused, and as the reference Choose is
  // tested against.
  template <typename Tiers>
  int ChooseByScan(const Tiers& tiers, uint64_t failed) const {
    int best = -1;
    uint64_t best_score = ~uint64_t{0};
    for (int pass = 0; pass < 2 && best < 0; ++pass) {
      for (int li = 0; li < n_local_; ++li) {
        const int i = static_cast<int>((li + rot_) % n_local_);
        if (!nic_up_[i]) continue;
        const uint64_t base =
            nic_load_[i] + static_cast<uint64_t>(tiers[i]) * 4 * unit_;
        for (int rj = 0; rj < n_remote_; ++rj) {
          const int j = static_cast<int>((rj + rot_ + i) % n_remote_);
          if (keys_[j] < 0) continue;
          const int r = i * n_remote_ + j;
          if (pass == 0 &&
              (rails_[r].paused || (r < 64 && ((failed >> r) & 1)))) {
            continue;
          }
          const uint64_t score = base + RailScore(i, j);
          if (score < best_score) {
            best_score = score;
            best = r;
          }
        }
      }
    }
    return best;
  }

  // Counts a slice of `length` bytes routed to rail `r`.
  void Assign(int r, uint64_t length) {
    rails_[r].load += length;
    nic_load_[r / n_remote_] += length;
    if (rows_valid_) BuildRow(r / n_remote_);
  }

 private:
  static constexpr int kScanRails = 4;

  // A rail's own part of a slice's score: its load, and one slice for
  // leaving the matched pair (local NIC i <-> remote NIC i).
  uint64_t RailScore(int i, int j) const {
    return rails_[i * n_remote_ + j].load + (j != i % n_remote_ ? unit_ : 0);
  }

  // Local NIC i's best rail among those not paused with a remote key, in
  // the order ChooseByScan visits them (so ties break the same way).
  void BuildRow(int i) {
    int best = -1;
    uint64_t best_score = ~uint64_t{0};
    for (int rj = 0; rj < n_remote_; ++rj) {
      const int j = static_cast<int>((rj + rot_ + i) % n_remote_);
      if (keys_[j] < 0 || rails_[i * n_remote_ + j].paused) continue;
      const uint64_t score = RailScore(i, j);
      if (score < best_score) {
        best_score = score;
        best = j;
      }
    }
    row_best_[i] = best;
    row_score_[i] = best_score;
  }

  void BuildRows() {
    // Sized here, not in the constructor: runs over few rails never use
    // the rows, and every run constructs a router.
    row_best_.resize(n_local_);
    row_score_.resize(n_local_);
    for (int i = 0; i < n_local_; ++i) BuildRow(i);
    rows_valid_ = true;
  }

  const int n_local_;
  const int n_remote_;
  const uint64_t unit_;
  const uint64_t rot_;
  absl::InlinedVector<RailState, 16> rails_;
  absl::InlinedVector<uint64_t, 8> nic_load_;
  absl::InlinedVector<bool, 8> nic_up_;
  absl::InlinedVector<int64_t, 8> keys_;
  // Per local NIC: its best remote NIC (-1: none usable) and that rail's
  // RailScore; valid while rows_valid_.
  absl::InlinedVector<int, 8> row_best_;
  absl::InlinedVector<uint64_t, 8> row_score_;
  bool rows_valid_ = false;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_RAIL_ROUTER_H_
