// FakeSysfs: a sysfs tree in a temporary directory, for tests of the
// topology code (Topology::FromSysfs, rdma.sysfs_root, the doctor's
// --sysfs_root): PCI devices with class, vendor and NUMA node under
// devices/, their bus/pci/devices links, and RDMA NICs under
// class/infiniband/<name>/device. Removed when destroyed.
#ifndef FERRY_TRANSPORT_RDMA_FAKE_SYSFS_TESTING_H_
#define FERRY_TRANSPORT_RDMA_FAKE_SYSFS_TESTING_H_

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace ferry::rdma::testing {

class FakeSysfs {
 public:
  FakeSysfs() {
    // mkdtemp, not the pid: Bazel's sandbox gives every test the same pid
    // in its own namespace while they share /tmp (concurrent runs
    // collided in a stress run).
    std::string dir =
        (std::filesystem::temp_directory_path() / "ferry_sysfs_XXXXXX")
            .string();
    if (::mkdtemp(dir.data()) == nullptr) std::abort();
    root_ = dir;
  }
  ~FakeSysfs() { std::filesystem::remove_all(root_); }
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  std::string root() const { return root_.string(); }

  // A PCI device at `path` ("pci0000:00/0000:00:01.0/0000:01:00.0").
  void Device(const std::string& path, const char* cls, const char* vendor,
              int numa) {
    const auto dir = root_ / "devices" / path;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "class") << cls << "\n";
    std::ofstream(dir / "vendor") << vendor << "\n";
    std::ofstream(dir / "numa_node") << numa << "\n";
    const auto bus = root_ / "bus/pci/devices";
    std::filesystem::create_directories(bus);
    std::filesystem::create_directory_symlink(
        dir, bus / std::filesystem::path(path).filename());
  }
  // An RDMA NIC `name` whose device is the PCI device at `path`.
  void Nic(const std::string& name, const std::string& path) {
    const auto dir = root_ / "class/infiniband" / name;
    std::filesystem::create_directories(dir);
    std::filesystem::create_directory_symlink(root_ / "devices" / path,
                                              dir / "device");
  }

 private:
  std::filesystem::path root_;
};

}  // namespace ferry::rdma::testing

#endif  // FERRY_TRANSPORT_RDMA_FAKE_SYSFS_TESTING_H_
