// _ferry: the Python extension under the `ferry` package, a thin layer over
// the C API (include/ferry/ferry_c.h), so that options, errors and handles
// behave as they do for C. The pythonic layer (ferry/__init__.py) and the
// Mooncake drop-in (ferry/mooncake.py) are Python on top of it.
//
// Every call that may wait (on the network, the metadata service or a
// batch) releases the GIL. Errors raise ferry.errors.FerryError(code,
// message).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/ferry_c.h"

namespace py = pybind11;

namespace {

[[noreturn]] void Raise(int code, const std::string& message) {
  py::object error = py::module_::import("ferry.errors").attr("FerryError");
  PyErr_SetObject(error.ptr(), py::make_tuple(code, message).ptr());
  throw py::error_already_set();
}

// Raises FerryError for a failed status (taking it); returns for OK.
void Check(ferry_status* s) {
  if (s == nullptr) return;
  const int code = ferry_status_code(s);
  const std::string message = ferry_status_message(s);
  ferry_status_free(s);
  Raise(code, message);
}

// Runs `call` (returning a ferry_status*) without the GIL, then checks it.
template <typename Call>
void Unlocked(Call call) {
  ferry_status* s;
  {
    py::gil_scoped_release unlocked;
    s = call();
  }
  Check(s);
}

using Request = std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t>;
using BatchState = std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t>;

// The ints of a sequence, as uint64 (a negative or non-int item raises
// FerryError(INVALID_ARGUMENT) naming `what` and its index). Through the
// sequence protocol's fast path: per item this is the cost of a C call,
// where a list of tuples converted by pybind11 cost several.
std::vector<uint64_t> ToU64(const py::handle& seq, const char* what) {
  PyObject* fast = PySequence_Fast(seq.ptr(), what);
  if (fast == nullptr) {
    PyErr_Clear();
    Raise(FERRY_INVALID_ARGUMENT,
          std::string(what) + " must be a sequence of ints");
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  std::vector<uint64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    // ints, and anything with __index__ (numpy's integers), as pybind11's
    // own conversion takes them; not floats or strings.
    PyObject* as_int =
        PyIndex_Check(items[i]) ? PyNumber_Index(items[i]) : nullptr;
    const unsigned long long v = as_int != nullptr
                                     ? PyLong_AsUnsignedLongLong(as_int)
                                     : static_cast<unsigned long long>(-1);
    const bool bad =
        as_int == nullptr || (v == static_cast<unsigned long long>(-1) &&
                              PyErr_Occurred() != nullptr);
    Py_XDECREF(as_int);
    if (bad) {
      PyErr_Clear();
      Py_DECREF(fast);
      Raise(FERRY_INVALID_ARGUMENT, std::string(what) + "[" +
                                        std::to_string(i) +
                                        "] is not an int in 0..2^64-1");
    }
    out[static_cast<size_t>(i)] = v;
  }
  Py_DECREF(fast);
  return out;
}

// Requests of one opcode to one segment from three parallel sequences,
// the shape of every Mooncake batch call.
std::vector<ferry_request> SameRequests(int op, uint64_t segment,
                                        const py::handle& buffers,
                                        const py::handle& peers,
                                        const py::handle& lengths) {
  const std::vector<uint64_t> b = ToU64(buffers, "buffers");
  const std::vector<uint64_t> p = ToU64(peers, "peer addresses");
  const std::vector<uint64_t> l = ToU64(lengths, "lengths");
  if (b.size() != p.size() || b.size() != l.size()) {
    Raise(FERRY_INVALID_ARGUMENT,
          "buffers, peer addresses and lengths differ in count (" +
              std::to_string(b.size()) + ", " + std::to_string(p.size()) +
              ", " + std::to_string(l.size()) + ")");
  }
  if (b.empty()) Raise(FERRY_INVALID_ARGUMENT, "no requests");
  std::vector<ferry_request> reqs(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    reqs[i] = {op, reinterpret_cast<void*>(b[i]), segment, p[i], l[i]};
  }
  return reqs;
}

// A new batch holding `reqs`, in *b; on error no batch is left behind.
ferry_status* NewBatchOf(ferry_engine* e,
                         const std::vector<ferry_request>& reqs,
                         ferry_batch* b) {
  if (ferry_status* s = ferry_batch_new(e, reqs.size(), b)) return s;
  ferry_status* s = ferry_submit(e, *b, reqs.data(), reqs.size());
  if (s != nullptr) ferry_status_free(ferry_batch_free(e, *b));
  return s;
}

class Engine {
 public:
  explicit Engine(
      const std::vector<std::pair<std::string, std::string>>& options) {
    ferry_options* o = ferry_options_new();
    for (const auto& [key, value] : options) {
      ferry_status* s = ferry_options_set(o, key.c_str(), value.c_str());
      if (s != nullptr) {
        ferry_options_free(o);
        Check(s);
      }
    }
    ferry_status* s;
    ferry_engine* e = nullptr;
    {
      py::gil_scoped_release unlocked;
      s = ferry_engine_new(o, &e);
    }
    ferry_options_free(o);
    Check(s);
    // Pinned objects go only once the engine itself is freed: a call in
    // progress on another thread keeps the engine, and with it every
    // registration peers may still WRITE into, alive after Close().
    engine_ = std::shared_ptr<ferry_engine>(e, [pins = pins_](ferry_engine* p) {
      ferry_engine_free(p);
      py::gil_scoped_acquire gil;
      pins->clear();
    });
  }
  ~Engine() { Close(); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Calls in progress on other threads hold the engine (Get's copy), so
  // it is shut down when the last of them returns.
  void Close() {
    std::shared_ptr<ferry_engine> e = std::move(engine_);
    py::gil_scoped_release unlocked;
    e.reset();
  }

  // Keeps `obj` (what is registered at `addr`) alive until Unpin(addr),
  // or until the engine is freed.
  void Pin(uint64_t addr, const py::object& obj) {
    Get();
    (*pins_)[addr] = obj;
  }
  // What Pin kept at `addr` (None if nothing), no longer kept.
  py::object Unpin(uint64_t addr) {
    auto it = pins_->find(addr);
    if (it == pins_->end()) return py::none();
    py::object obj = std::move(it->second);
    pins_->erase(it);
    return obj;
  }

  std::string SegmentName() { return Copy(ferry_engine_segment_name); }
  std::string RpcAddress() { return Copy(ferry_engine_rpc_address); }
  std::string MetadataAddress() { return Copy(ferry_engine_metadata_address); }

  void Register(uint64_t addr, uint64_t length, const std::string& location,
                bool remote) {
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] {
      return ferry_register_memory(e, reinterpret_cast<void*>(addr), length,
                                   location.c_str(), remote ? 1 : 0);
    });
  }
  void Unregister(uint64_t addr) {
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] {
      return ferry_unregister_memory(e, reinterpret_cast<void*>(addr));
    });
  }
  void RegisterBatch(const std::vector<uint64_t>& addrs,
                     const std::vector<uint64_t>& lengths,
                     const std::string& location, bool remote) {
    if (addrs.size() != lengths.size()) {
      Raise(FERRY_INVALID_ARGUMENT, "addresses and lengths differ in count");
    }
    std::vector<void*> a(addrs.size());
    std::vector<size_t> l(lengths.size());
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = reinterpret_cast<void*>(addrs[i]);
      l[i] = lengths[i];
    }
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] {
      return ferry_register_memory_batch(e, a.data(), l.data(), a.size(),
                                         location.c_str(), remote ? 1 : 0);
    });
  }
  void UnregisterBatch(const std::vector<uint64_t>& addrs) {
    std::vector<void*> a(addrs.size());
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = reinterpret_cast<void*>(addrs[i]);
    }
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked(
        [&] { return ferry_unregister_memory_batch(e, a.data(), a.size()); });
  }
  // (address, length) of each remote-accessible buffer, by address.
  std::vector<std::pair<uint64_t, uint64_t>> SegmentBuffers(uint64_t h) {
    ferry_remote_buffer* bufs = nullptr;
    size_t n = 0;
    Check(ferry_segment_buffers(Get().get(), h, &bufs, &n));
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (size_t i = 0; i < n; ++i)
      out.emplace_back(bufs[i].addr, bufs[i].length);
    std::free(bufs);
    return out;
  }
  uint64_t OpenSegment(const std::string& name) {
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    ferry_segment h = 0;
    Unlocked([&] { return ferry_open_segment(e, name.c_str(), &h); });
    return h;
  }
  void RefreshSegment(uint64_t h) {
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] { return ferry_refresh_segment(e, h); });
  }
  void CloseSegment(uint64_t h) {
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] { return ferry_close_segment(e, h); });
  }
  uint64_t NewBatch(uint64_t capacity) {
    ferry_batch b = 0;
    Check(ferry_batch_new(Get().get(), capacity, &b));
    return b;
  }
  // (opcode, local address, segment, remote address, length) each.
  void Submit(uint64_t batch, const std::vector<Request>& requests) {
    std::vector<ferry_request> reqs(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      const auto& [op, local, seg, remote, length] = requests[i];
      reqs[i] = {op, reinterpret_cast<void*>(local), seg, remote, length};
    }
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] { return ferry_submit(e, batch, reqs.data(), reqs.size()); });
  }
  // A new batch holding requests of one opcode to one segment (three
  // parallel sequences); its id. On error no batch is left behind.
  uint64_t SubmitSame(int op, uint64_t segment, const py::object& buffers,
                      const py::object& peers, const py::object& lengths) {
    const std::vector<ferry_request> reqs =
        SameRequests(op, segment, buffers, peers, lengths);
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    ferry_batch b = 0;
    Unlocked([&] { return NewBatchOf(e, reqs, &b); });
    return b;
  }
  // SubmitSame, then waits (without limit: the engine's transfer_timeout
  // ends every request) and frees the batch, all in one release of the
  // GIL: a synchronous batch costs one crossing from Python, not four.
  // The batch's final (state, total, completed, failed, transferred bytes).
  BatchState TransferSame(int op, uint64_t segment, const py::object& buffers,
                          const py::object& peers, const py::object& lengths) {
    const std::vector<ferry_request> reqs =
        SameRequests(op, segment, buffers, peers, lengths);
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    ferry_batch_status st{};
    Unlocked([&]() -> ferry_status* {
      ferry_batch b = 0;
      if (ferry_status* s = NewBatchOf(e, reqs, &b)) return s;
      ferry_status* s = ferry_batch_wait(e, b, -1, &st);
      // An unlimited wait returns once every request has ended, so the
      // batch can go either way.
      ferry_status* freed = ferry_batch_free(e, b);
      if (s == nullptr) return freed;
      ferry_status_free(freed);
      return s;
    });
    return {st.state, st.total, st.completed, st.failed, st.transferred_bytes};
  }
  // (state, total, completed, failed, transferred bytes); raises
  // FerryError(DEADLINE_EXCEEDED) if the timeout passed first.
  BatchState Wait(uint64_t batch, int64_t timeout_ms) {
    ferry_batch_status st{};
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] { return ferry_batch_wait(e, batch, timeout_ms, &st); });
    return {st.state, st.total, st.completed, st.failed, st.transferred_bytes};
  }
  // (state, transferred bytes, error code, error message).
  std::tuple<int, uint64_t, int, std::string> RequestStatus(uint64_t batch,
                                                            uint64_t index) {
    int state = 0;
    uint64_t bytes = 0;
    ferry_status* error = nullptr;
    Check(ferry_request_status(Get().get(), batch, index, &state, &bytes,
                               &error));
    const int code = ferry_status_code(error);
    std::string message = ferry_status_message(error);
    ferry_status_free(error);
    return {state, bytes, code, std::move(message)};
  }
  void FreeBatch(uint64_t batch) {
    Check(ferry_batch_free(Get().get(), batch));
  }

  // Queues the requests on CUDA stream `stream` (ferry_submit_on_stream);
  // raises if nothing was queued.
  void SubmitOnStream(int op, uint64_t segment, const py::object& buffers,
                      const py::object& peers, const py::object& lengths,
                      uint64_t stream) {
    const std::vector<ferry_request> reqs =
        SameRequests(op, segment, buffers, peers, lengths);
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] {
      return ferry_submit_on_stream(e, reqs.data(), reqs.size(),
                                    static_cast<uintptr_t>(stream));
    });
  }
  // Raises the first failure of a stream transfer since the last call.
  void StreamError() {
    const std::shared_ptr<ferry_engine> held = Get();
    Check(ferry_take_stream_error(held.get()));
  }

  // The C API's handle, for C code sharing the engine (alive while this
  // object is not closed).
  uint64_t Handle() { return reinterpret_cast<uintptr_t>(Get().get()); }

  // The counters, as ferry_engine_stats's JSON.
  std::string Stats() {
    const std::shared_ptr<ferry_engine> held = Get();
    char* json = nullptr;
    Check(ferry_engine_stats(held.get(), &json));
    std::string out = json;
    std::free(json);
    return out;
  }

  void Notify(uint64_t segment, const std::string& name,
              const py::bytes& message) {
    std::string m = message;
    const std::shared_ptr<ferry_engine> held = Get();
    ferry_engine* e = held.get();
    Unlocked([&] {
      return ferry_send_notification(e, segment, name.c_str(), m.data(),
                                     m.size());
    });
  }
  // (from_segment, name, message bytes, sender address, verified) each.
  std::vector<
      std::tuple<std::string, std::string, py::bytes, std::string, bool>>
  Notifications() {
    ferry_notification* got = nullptr;
    size_t n = 0;
    Check(ferry_get_notifications(Get().get(), &got, &n));
    std::vector<
        std::tuple<std::string, std::string, py::bytes, std::string, bool>>
        out;
    for (size_t i = 0; i < n; ++i) {
      out.emplace_back(got[i].from_segment, got[i].name,
                       py::bytes(got[i].message, got[i].message_length),
                       got[i].sender_address, got[i].sender_verified != 0);
    }
    ferry_notifications_free(got, n);
    return out;
  }

 private:
  // A string the C API copies out, whatever its length.
  std::string Copy(size_t (*get)(const ferry_engine*, char*, size_t)) {
    const std::shared_ptr<ferry_engine> held = Get();
    std::string out(get(held.get(), nullptr, 0) + 1, '\0');
    out.resize(get(held.get(), out.data(), out.size()));
    return out;
  }

  // The engine, held for the caller's call: Close only drops this
  // reference, so an engine is shut down once the last call using it
  // (another thread's, the GIL released) has returned. engine_ is only
  // touched by threads holding the GIL.
  std::shared_ptr<ferry_engine> Get() {
    if (engine_ == nullptr) {
      Raise(FERRY_FAILED_PRECONDITION, "engine is closed");
    }
    return engine_;
  }

  // Touched only with the GIL held.
  std::shared_ptr<std::unordered_map<uint64_t, py::object>> pins_ =
      std::make_shared<std::unordered_map<uint64_t, py::object>>();
  std::shared_ptr<ferry_engine> engine_;
};

// The address and size of an object's buffer (buffer protocol), and
// whether it is read-only. The caller keeps a memoryview of the object
// while it uses the address, which pins it (a bytearray cannot be resized
// while one exists).
std::tuple<uint64_t, uint64_t, bool> BufferAddress(const py::object& obj) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) {
    throw py::error_already_set();
  }
  const auto out =
      std::make_tuple(reinterpret_cast<uint64_t>(view.buf),
                      static_cast<uint64_t>(view.len), view.readonly != 0);
  PyBuffer_Release(&view);
  return out;
}

}  // namespace

// This host's NICs as Mooncake's priority matrix (JSON).
std::string LocalTopology(const std::string& devices) {
  char* json = nullptr;
  ferry_status* s;
  {
    py::gil_scoped_release unlocked;
    s = ferry_local_topology(devices.c_str(), &json);
  }
  Check(s);
  std::string out = json;
  std::free(json);
  return out;
}

PYBIND11_MODULE(_ferry, m) {
  m.doc() = "Ferry's C API for Python (use the `ferry` package).";
  m.def("local_topology", &LocalTopology, py::arg("devices") = "");
  m.def("buffer_address", &BufferAddress, py::arg("obj"));
  m.attr("READ") = static_cast<int>(FERRY_READ);
  m.attr("WRITE") = static_cast<int>(FERRY_WRITE);
  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::vector<std::pair<std::string, std::string>>&>())
      .def("close", &Engine::Close)
      .def("pin", &Engine::Pin)
      .def("unpin", &Engine::Unpin)
      .def("segment_name", &Engine::SegmentName)
      .def("metadata_address", &Engine::MetadataAddress)
      .def("rpc_address", &Engine::RpcAddress)
      .def("register", &Engine::Register)
      .def("unregister", &Engine::Unregister)
      .def("register_batch", &Engine::RegisterBatch)
      .def("unregister_batch", &Engine::UnregisterBatch)
      .def("segment_buffers", &Engine::SegmentBuffers)
      .def("open_segment", &Engine::OpenSegment)
      .def("refresh_segment", &Engine::RefreshSegment)
      .def("close_segment", &Engine::CloseSegment)
      .def("new_batch", &Engine::NewBatch)
      .def("submit", &Engine::Submit)
      .def("submit_same", &Engine::SubmitSame)
      .def("transfer_same", &Engine::TransferSame)
      .def("submit_on_stream", &Engine::SubmitOnStream)
      .def("stream_error", &Engine::StreamError)
      .def("stats", &Engine::Stats)
      .def("handle", &Engine::Handle)
      .def("wait", &Engine::Wait)
      .def("request_status", &Engine::RequestStatus)
      .def("free_batch", &Engine::FreeBatch)
      .def("notify", &Engine::Notify)
      .def("notifications", &Engine::Notifications);
}
