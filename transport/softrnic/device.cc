// Devices, contexts, queries, async events and the fault-injection API.
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "transport/softrnic/connection.h"
#include "transport/softrnic/hello_auth.h"
#include "transport/softrnic/softrnic.h"

namespace softrnic {

void Device::GidFor(ibv_gid* gid) const {
  std::memset(gid->raw, 0, sizeof(gid->raw));
  if (!gid_valid.load(std::memory_order_acquire)) return;  // An empty entry.
  // RoCE v2 style IPv4-mapped GID; the listener port rides in bytes 8..9 so
  // a peer knows where to connect from the GID alone.
  const uint16_t p = port.load(std::memory_order_relaxed);
  gid->raw[8] = static_cast<uint8_t>(p >> 8);
  gid->raw[9] = static_cast<uint8_t>(p & 0xff);
  gid->raw[10] = 0xff;
  gid->raw[11] = 0xff;
  std::memcpy(&gid->raw[12], &ip, 4);
}

void Device::GidAt(int index, ibv_gid* gid, bool* roce_v1) const {
  *roce_v1 = false;
  if (InfiniBand()) {
    // The default subnet prefix and the port GUID: the port's identity
    // whatever its IP (IPoIB) address is doing.
    std::memset(gid->raw, 0, sizeof(gid->raw));
    gid->raw[0] = 0xfe;
    gid->raw[1] = 0x80;
    std::memcpy(&gid->raw[8], &guid, 8);
    return;
  }
  if (GetProfile().gid_table_len == 1) {
    GidFor(gid);
    return;
  }
  // 4 entries: [0] fe80 v1, [1] fe80 v2, [2] IPv4-mapped v1, [3]
  // IPv4-mapped v2. 2 entries (a port left in RoCE v1 mode): [0] fe80 v1,
  // [1] IPv4-mapped v1.
  const bool v1_only = GetProfile().gid_table_len == 2;
  *roce_v1 = v1_only || index % 2 == 0;
  if (index >= (v1_only ? 1 : 2)) {
    GidFor(gid);
    return;
  }
  std::memset(gid->raw, 0, sizeof(gid->raw));
  if (!gid_valid.load(std::memory_order_acquire)) return;
  gid->raw[0] = 0xfe;
  gid->raw[1] = 0x80;
  // An interface identifier of the device's own (EUI-64 style): unique,
  // not routable.
  gid->raw[8] = 0x02;
  gid->raw[11] = 0xff;
  gid->raw[12] = 0xfe;
  std::memcpy(&gid->raw[13], reinterpret_cast<const uint8_t*>(&ip) + 1, 3);
}

std::vector<Device*>& Devices() {
  static std::vector<Device*>* devices = [] {
    auto* list = new std::vector<Device*>();
    int index = 0;
    for (const DeviceConfig& c : LoadDeviceConfig()) {
      auto* d = new Device();
      d->name = c.name;
      inet_pton(AF_INET, c.ip.c_str(), &d->ip);
      d->ibdev.node_type = IBV_NODE_CA;
      d->ibdev.transport_type = IBV_TRANSPORT_IB;
      std::snprintf(d->ibdev.name, sizeof(d->ibdev.name), "%s", c.name.c_str());
      std::snprintf(d->ibdev.dev_name, sizeof(d->ibdev.dev_name), "uverbs%d",
                    index);
      std::snprintf(d->ibdev.dev_path, sizeof(d->ibdev.dev_path),
                    "/sys/class/infiniband_verbs/uverbs%d", index);
      std::snprintf(d->ibdev.ibdev_path, sizeof(d->ibdev.ibdev_path),
                    "/sys/class/infiniband/%s", c.name.c_str());
      uint8_t g[8] = {0x02, 0x53, 0x52, static_cast<uint8_t>(index),
                      0,    0,    0,    0};
      std::memcpy(&g[4], &d->ip, 4);
      std::memcpy(&d->guid, g, 8);
      list->push_back(d);
      ++index;
    }
    return list;
  }();
  return *devices;
}

Device* FindDeviceByAddress(in_addr ip, uint16_t port) {
  for (Device* d : Devices()) {
    ferry::MutexLock lock(&d->mu);
    if (d->started && d->ip.s_addr == ip.s_addr && d->port.load() == port) {
      return d;
    }
  }
  return nullptr;
}

Device* FindDeviceByName(const char* name) {
  if (name == nullptr) return nullptr;
  for (Device* d : Devices()) {
    if (d->name == name) return d;
  }
  return nullptr;
}

int StartDevice(Device* dev) {
  // Before dev->mu: a port that is down raises its event under that lock.
  StartCarrierMonitor();
  ferry::MutexLock lock(&dev->mu);
  if (dev->started) return 0;
  // The timer first: it has no resources to give back if the acceptor
  // then cannot start (a later open tries again).
  if (!dev->timer_running) {
    if (!StartThread("srnic-timer", [dev] { TimerLoop(dev); })) return EAGAIN;
    dev->timer_running = true;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return errno;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr = dev->ip;
  sa.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      ::listen(fd, 256) != 0) {
    int err = errno;
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &dev->ip, ip, sizeof(ip));
    std::fprintf(stderr, "softrnic: %s: cannot listen on %s: %s\n",
                 dev->name.c_str(), ip, std::strerror(err));
    ::close(fd);
    return err;
  }
  const int epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) {
    const int err = errno;
    ::close(fd);
    return err;
  }
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  // Process-lifetime threads: detached, they block in epoll/wait when idle.
  if (!StartThread("srnic-accept",
                   [dev, fd, epoll_fd] { AcceptLoop(dev, fd, epoll_fd); })) {
    ::close(epoll_fd);
    ::close(fd);
    return EAGAIN;
  }
  dev->port.store(ntohs(sa.sin_port));
  if (InfiniBand()) dev->lid.store(AssignLid(dev->ip, ntohs(sa.sin_port)));
  dev->started = true;
  return 0;
}

namespace {

// Applies one change of a port condition and reports a change of state.
void ChangePort(Device* dev, std::atomic<bool>* condition, bool value) {
  bool was, now;
  {
    ferry::MutexLock lock(&dev->link_mu);
    was = dev->LinkUp();
    condition->store(value);
    now = dev->LinkUp();
  }
  if (was == now) return;
  if (!now) CutDeviceConnections(dev);
  ibv_async_event e{};
  e.event_type = now ? IBV_EVENT_PORT_ACTIVE : IBV_EVENT_PORT_ERR;
  PostAsyncEvent(dev, e);
}

}  // namespace

void SetLink(Device* dev, bool up) { ChangePort(dev, &dev->link_up, up); }
void SetCarrier(Device* dev, bool up) { ChangePort(dev, &dev->carrier, up); }

void PostAsyncEvent(Context* ctx, const ibv_async_event& event) {
  {
    ferry::MutexLock lock(&ctx->mu);
    if (ctx->async_events.size() >= kMaxAsyncEvents) {
      // The oldest event's byte is still in the pipe: it now stands for
      // this one, so bytes and events stay equal in number.
      ctx->async_events.pop_front();
      ctx->async_events.push_back(event);
      return;
    }
    ctx->async_events.push_back(event);
  }
  // One byte per event; the pipe holds far more than kMaxAsyncEvents, and
  // its write end does not block in any case.
  char b = 1;
  ssize_t n = ::write(ctx->async_write_fd, &b, 1);
  (void)n;
}

void KillDevice(Device* dev) {
  {
    ferry::MutexLock lock(&dev->mu);
    for (Context* c : dev->contexts) c->dead.store(true);
    // With no context open there is nothing to kill (nothing would ever
    // be closed to bring the device back).
    if (dev->contexts.empty()) return;
    dev->fatal.store(true);
  }
  CutDeviceConnections(dev);
  for (const std::shared_ptr<Qp>& qp : QpsOf(dev)) EnterError(qp, -1);
  ibv_async_event e{};
  e.event_type = IBV_EVENT_DEVICE_FATAL;
  PostAsyncEvent(dev, e);
}

void PostAsyncEvent(Device* dev, const ibv_async_event& event) {
  // Under the device's lock, so that ibv_close_device (which leaves the
  // list under it) cannot close or free a context being written to.
  ferry::MutexLock lock(&dev->mu);
  for (Context* c : dev->contexts) {
    ibv_async_event e = event;
    if (e.event_type == IBV_EVENT_PORT_ERR ||
        e.event_type == IBV_EVENT_PORT_ACTIVE ||
        e.event_type == IBV_EVENT_GID_CHANGE) {
      e.element.port_num = 1;
    }
    PostAsyncEvent(c, e);
  }
}

}  // namespace softrnic

using namespace softrnic;

SOFTRNIC_EXPORT ibv_device** ibv_get_device_list(int* num_devices) {
  auto& devs = Devices();
  auto** list =
      static_cast<ibv_device**>(calloc(devs.size() + 1, sizeof(ibv_device*)));
  if (list == nullptr) {
    errno = ENOMEM;
    return nullptr;
  }
  for (size_t i = 0; i < devs.size(); ++i) list[i] = &devs[i]->ibdev;
  if (num_devices != nullptr) *num_devices = static_cast<int>(devs.size());
  return list;
}

SOFTRNIC_EXPORT void ibv_free_device_list(ibv_device** list) { free(list); }

SOFTRNIC_EXPORT const char* ibv_get_device_name(ibv_device* device) {
  return device->name;
}

SOFTRNIC_EXPORT __be64 ibv_get_device_guid(ibv_device* device) {
  return reinterpret_cast<Device*>(device)->guid;
}

SOFTRNIC_EXPORT int ibv_get_device_index(ibv_device* device) {
  auto& devs = Devices();
  for (size_t i = 0; i < devs.size(); ++i) {
    if (&devs[i]->ibdev == device) return static_cast<int>(i);
  }
  return -1;
}

SOFTRNIC_EXPORT ibv_context* ibv_open_device(ibv_device* device) {
  Device* dev = reinterpret_cast<Device*>(device);
  if (dev->fatal.load()) {
    errno = EIO;  // Dead until every context open at the fatal is closed.
    return nullptr;
  }
  if (int err = StartDevice(dev); err != 0) {
    errno = err;
    return nullptr;
  }
  auto* c = new Context();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    delete c;
    return nullptr;
  }
  ::fcntl(fds[1], F_SETFL, O_NONBLOCK);
  c->dev = dev;
  c->async_write_fd = fds[1];
  c->ctx.device = device;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = fds[0];
  c->ctx.num_comp_vectors = 1;
  c->ctx.abi_compat = nullptr;  // Not extended: verbs_get_ctx() is NULL.
  pthread_mutex_init(&c->ctx.mutex, nullptr);
  c->ctx.ops.poll_cq = PollCq;
  c->ctx.ops.req_notify_cq = ReqNotifyCq;
  c->ctx.ops.post_send = PostSend;
  c->ctx.ops.post_recv = PostRecv;
  ferry::MutexLock lock(&dev->mu);
  dev->contexts.push_back(c);
  return &c->ctx;
}

SOFTRNIC_EXPORT int ibv_close_device(ibv_context* context) {
  auto* c = reinterpret_cast<Context*>(context);
  {
    ferry::MutexLock lock(&c->dev->mu);
    auto& v = c->dev->contexts;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (*it == c) {
        v.erase(it);
        break;
      }
    }
    // The last context that saw the device die is gone: the device is
    // reset and works again.
    if (c->dev->fatal.load() &&
        std::none_of(v.begin(), v.end(),
                     [](const Context* o) { return o->dead.load(); })) {
      c->dev->fatal.store(false);
    }
  }
  ::close(c->ctx.async_fd);
  ::close(c->async_write_fd);
  pthread_mutex_destroy(&c->ctx.mutex);
  delete c;
  return 0;
}

SOFTRNIC_EXPORT int ibv_query_device(ibv_context* context,
                                     ibv_device_attr* attr) {
  if (Dead(context)) return EIO;
  Device* dev = reinterpret_cast<Context*>(context)->dev;
  std::memset(attr, 0, sizeof(*attr));
  std::snprintf(attr->fw_ver, sizeof(attr->fw_ver), "softrnic 1.0");
  attr->node_guid = dev->guid;
  attr->sys_image_guid = dev->guid;
  attr->max_mr_size = ~uint64_t{0};
  attr->page_size_cap = 0xfffff000;
  attr->vendor_id = 0x5352;  // "SR"
  attr->vendor_part_id = 1;
  attr->hw_ver = 1;
  attr->max_qp = kMaxQp;
  const Profile& hw = GetProfile();
  attr->max_qp_wr = hw.max_qp_wr;
  attr->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN |
                           IBV_DEVICE_PORT_ACTIVE_EVENT |
                           IBV_DEVICE_CHANGE_PHY_PORT;
  attr->max_sge = hw.max_sge;
  attr->max_sge_rd = hw.max_sge;
  attr->max_cq = 1 << 16;
  attr->max_cqe = hw.max_cqe;
  attr->max_mr = 1 << 20;
  attr->max_pd = 1 << 16;
  attr->max_qp_rd_atom = hw.max_qp_rd_atom;
  attr->max_qp_init_rd_atom = hw.max_qp_init_rd_atom;
  attr->max_res_rd_atom = hw.max_qp_rd_atom * kMaxQp;
  attr->atomic_cap = IBV_ATOMIC_NONE;
  attr->max_srq = 0;
  attr->max_pkeys = 1;
  attr->local_ca_ack_delay = 15;
  attr->phys_port_cnt = 1;
  return 0;
}

SOFTRNIC_EXPORT int ibv_query_port(ibv_context* context, uint8_t port_num,
                                   struct _compat_ibv_port_attr* out) {
  if (Dead(context)) return EIO;
  Device* dev = reinterpret_cast<Context*>(context)->dev;
  if (port_num != 1) return EINVAL;
  ibv_port_attr a{};
  bool up = dev->LinkUp();
  a.state = up ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  const bool ib = InfiniBand();
  const uint16_t lid = dev->lid.load();
  // An InfiniBand port the subnet manager has not configured (no LID)
  // stays in INIT with its link up: it cannot carry traffic.
  if (ib && up && lid == 0) a.state = IBV_PORT_INIT;
  a.max_mtu = GetProfile().max_mtu;
  a.active_mtu = GetProfile().active_mtu;
  a.gid_tbl_len = GetProfile().gid_table_len;
  a.port_cap_flags = 0;
  a.max_msg_sz = kMaxMsgSize;
  a.pkey_tbl_len = 1;
  a.lid = ib ? lid : 0;  // RoCE: no LIDs.
  a.sm_lid = ib ? kSubnetManagerLid : 0;
  a.max_vl_num = 1;
  a.active_width = 2;         // 4x
  a.active_speed = 32;        // EDR (25 Gbps per lane)
  a.phys_state = up ? 5 : 3;  // LinkUp : Disabled
  a.link_layer = GetProfile().link_layer;
  // The caller's struct may be the short compat layout (verbs.h passes an
  // ibv_port_attr cast to _compat_ibv_port_attr): write only through flags.
  std::memcpy(out, &a, offsetof(ibv_port_attr, flags) + sizeof(a.flags));
  return 0;
}

SOFTRNIC_EXPORT int ibv_query_gid(ibv_context* context, uint8_t port_num,
                                  int index, ibv_gid* gid) {
  if (Dead(context)) {
    errno = EIO;
    return -1;
  }
  Device* dev = reinterpret_cast<Context*>(context)->dev;
  if (port_num != 1 || index < 0 || index >= GetProfile().gid_table_len) {
    errno = EINVAL;
    return -1;
  }
  bool v1 = false;
  dev->GidAt(index, gid, &v1);
  return 0;
}

SOFTRNIC_EXPORT int ibv_query_pkey(ibv_context* context, uint8_t port_num,
                                   int index, __be16* pkey) {
  if (Dead(context)) {
    errno = EIO;
    return -1;
  }
  if (port_num != 1 || index != 0) {
    errno = EINVAL;
    return -1;
  }
  *pkey = htobe16(0xffff);
  return 0;
}

SOFTRNIC_EXPORT int ibv_get_pkey_index(ibv_context*, uint8_t port_num,
                                       __be16 pkey) {
  if (port_num == 1 && be16toh(pkey) == 0xffff) return 0;
  errno = ENOENT;
  return -1;
}

// Declared in rdma-core's private driver.h; ibv_devinfo -v uses it.
SOFTRNIC_EXPORT int ibv_query_gid_type(ibv_context* context, uint8_t port_num,
                                       unsigned int index, int* type) {
  if (Dead(context)) {
    errno = EIO;
    return -1;
  }
  if (port_num != 1 ||
      index >= static_cast<unsigned>(GetProfile().gid_table_len)) {
    errno = EINVAL;
    return -1;
  }
  ibv_gid gid;
  bool v1 = false;
  reinterpret_cast<Context*>(context)->dev->GidAt(static_cast<int>(index), &gid,
                                                  &v1);
  // IBV_GID_TYPE_SYSFS_IB_ROCE_V1 (0: also InfiniBand's) or
  // IBV_GID_TYPE_SYSFS_ROCE_V2 (1).
  *type = v1 || InfiniBand() ? 0 : 1;
  return 0;
}

SOFTRNIC_EXPORT int _ibv_query_gid_ex(ibv_context* context, uint32_t port_num,
                                      uint32_t gid_index, ibv_gid_entry* entry,
                                      uint32_t flags, size_t entry_size) {
  if (Dead(context)) return EIO;
  Device* dev = reinterpret_cast<Context*>(context)->dev;
  if (flags != 0 || entry_size < sizeof(ibv_gid_entry)) return EINVAL;
  if (port_num != 1 ||
      gid_index >= static_cast<uint32_t>(GetProfile().gid_table_len)) {
    return ENODATA;
  }
  // A RoCE entry is empty while its address is gone; InfiniBand's is the
  // port's GUID, always there.
  if (!InfiniBand() && !dev->gid_valid.load()) return ENODATA;
  std::memset(entry, 0, entry_size);
  bool v1 = false;
  dev->GidAt(static_cast<int>(gid_index), &entry->gid, &v1);
  entry->gid_index = gid_index;
  entry->port_num = 1;
  entry->gid_type = InfiniBand() ? IBV_GID_TYPE_IB
                    : v1         ? IBV_GID_TYPE_ROCE_V1
                                 : IBV_GID_TYPE_ROCE_V2;
  entry->ndev_ifindex = InfiniBand() ? 0 : 1;
  return 0;
}

SOFTRNIC_EXPORT ssize_t _ibv_query_gid_table(ibv_context* context,
                                             ibv_gid_entry* entries,
                                             size_t max_entries, uint32_t flags,
                                             size_t entry_size) {
  if (flags != 0 || entry_size < sizeof(ibv_gid_entry)) return -EINVAL;
  const int len = GetProfile().gid_table_len;
  if (max_entries < static_cast<size_t>(len)) return -EINVAL;
  ssize_t n = 0;
  for (int i = 0; i < len; ++i) {
    auto* e = reinterpret_cast<ibv_gid_entry*>(
        reinterpret_cast<uint8_t*>(entries) + n * entry_size);
    const int rc = _ibv_query_gid_ex(context, 1, i, e, 0, entry_size);
    if (rc == ENODATA) continue;  // An empty entry.
    if (rc != 0) return -rc;
    ++n;
  }
  return n;
}

SOFTRNIC_EXPORT int ibv_get_async_event(ibv_context* context,
                                        ibv_async_event* event) {
  auto* c = reinterpret_cast<Context*>(context);
  char b;
  ssize_t n;
  do {
    n = ::read(c->ctx.async_fd, &b, 1);
  } while (n < 0 && errno == EINTR);
  if (n != 1) return -1;  // errno from read (EAGAIN if non-blocking).
  ferry::MutexLock lock(&c->mu);
  if (c->async_events.empty()) {
    errno = EAGAIN;
    return -1;
  }
  *event = c->async_events.front();
  c->async_events.pop_front();
  return 0;
}

SOFTRNIC_EXPORT void ibv_ack_async_event(ibv_async_event*) {}

SOFTRNIC_EXPORT int ibv_fork_init(void) { return 0; }

SOFTRNIC_EXPORT enum ibv_fork_status ibv_is_fork_initialized(void) {
  return IBV_FORK_UNNEEDED;
}

SOFTRNIC_EXPORT int ibv_read_sysfs_file(const char*, const char*, char*,
                                        size_t) {
  return -1;  // There is no sysfs for soft devices.
}

// ---- Fault injection (softrnic_control.h) --------------------------------

SOFTRNIC_EXPORT const char* softrnic_version(void) { return "softrnic 1.0"; }

SOFTRNIC_EXPORT int softrnic_set_cluster_token(const char* token) {
  const int rc = SetClusterToken(token);
  if (rc == 0) return 0;
  errno = rc;
  return -1;
}

SOFTRNIC_EXPORT int softrnic_set_link(const char* name, int up) {
  Device* dev = FindDeviceByName(name);
  if (dev == nullptr) {
    errno = ENODEV;
    return -1;
  }
  SetLink(dev, up != 0);
  return 0;
}

SOFTRNIC_EXPORT int softrnic_cut_connections(const char* name) {
  Device* dev = FindDeviceByName(name);
  if (dev == nullptr) {
    errno = ENODEV;
    return -1;
  }
  CutDeviceConnections(dev);
  return 0;
}

SOFTRNIC_EXPORT int softrnic_set_delay_us(const char* name, uint32_t us) {
  Device* dev = FindDeviceByName(name);
  if (dev == nullptr) {
    errno = ENODEV;
    return -1;
  }
  dev->delay_us.store(us);
  return 0;
}

SOFTRNIC_EXPORT int softrnic_ack_timeouts(const char* name, uint64_t* out) {
  Device* dev = FindDeviceByName(name);
  if (dev == nullptr || out == nullptr) {
    errno = dev == nullptr ? ENODEV : EINVAL;
    return -1;
  }
  *out = dev->ack_timeouts.load(std::memory_order_relaxed);
  return 0;
}

SOFTRNIC_EXPORT int softrnic_inject_async_event(const char* name, int event) {
  Device* dev = FindDeviceByName(name);
  if (dev == nullptr) {
    errno = ENODEV;
    return -1;
  }
  switch (event) {
    case IBV_EVENT_DEVICE_FATAL:
      KillDevice(dev);
      return 0;
    case IBV_EVENT_GID_CHANGE: {
      RereadGidTable(dev);
      ibv_async_event e{};
      e.event_type = IBV_EVENT_GID_CHANGE;
      PostAsyncEvent(dev, e);
      return 0;
    }
    default:
      errno = EINVAL;
      return -1;
  }
}
