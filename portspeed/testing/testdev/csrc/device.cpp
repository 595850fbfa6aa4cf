// Devices, streams, events, the device guard, per-device generators and the PrivateUse1
// hooks of the portspeed test device (see testdev.h).
//
// Streams: every stream of a device runs its work in program order on the calling thread,
// so a stream or event wait is always already satisfied. Stream identity (default stream,
// new streams, the thread's current stream per device) is tracked as CUDA does.
#include "testdev.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <string>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

namespace testdev {
namespace {

c10::DeviceIndex read_device_count() {
  const char* env = std::getenv("PORTSPEED_TESTDEV_DEVICES");
  if (env == nullptr || *env == '\0') {
    return 8;  // like one node of eight accelerators
  }
  char* end = nullptr;
  long n = std::strtol(env, &end, 10);
  TORCH_CHECK(end != env && *end == '\0' && n >= 1 && n <= 64,
              "PORTSPEED_TESTDEV_DEVICES=", env,
              " is not a device count; give an integer from 1 to 64 (default 8)");
  return static_cast<c10::DeviceIndex>(n);
}

thread_local c10::DeviceIndex tls_current_device = 0;

// Per thread, per device: the current stream id (0 = the default stream).
thread_local std::vector<int64_t> tls_current_stream;

std::atomic<int64_t> next_stream_id{1};

struct Event {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
  c10::DeviceIndex device = 0;
};

}  // namespace

// The faults PORTSPEED_TESTDEV_BARE names (a comma list, or "all"); portspeed/testing/testdev/bare.py checks
// the value before the library loads, so an unknown name never reaches here.
namespace {

const std::vector<std::string>& read_bare_faults() {
  static const std::vector<std::string> faults = [] {
    static const char* const kAll[] = {"no-memory-info", "no-shallow-copy", "wrong-sdpa", "host-rng", "stub-ccl",
                                       "wrong-gelu", "wrong-layer-norm"};
    std::vector<std::string> out;
    const char* env = std::getenv("PORTSPEED_TESTDEV_BARE");
    std::string value = env == nullptr ? "" : env;
    size_t start = 0;
    while (start <= value.size()) {
      size_t end = value.find(',', start);
      if (end == std::string::npos) end = value.size();
      std::string item = value.substr(start, end - start);
      item.erase(0, item.find_first_not_of(" \t"));
      item.erase(item.find_last_not_of(" \t") + 1);
      if (item == "all") {
        out.assign(std::begin(kAll), std::end(kAll));
      } else if (!item.empty() && std::find(out.begin(), out.end(), item) == out.end()) {
        out.push_back(item);
      }
      start = end + 1;
    }
    return out;
  }();
  return faults;
}

}  // namespace

bool bare(const char* fault) {
  const auto& faults = read_bare_faults();
  return std::find(faults.begin(), faults.end(), fault) != faults.end();
}

std::vector<std::string> bare_faults() { return read_bare_faults(); }

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex count = read_device_count();
  return count;
}

c10::DeviceIndex check_index(c10::DeviceIndex index) {
  if (index < 0) {
    return tls_current_device;
  }
  TORCH_CHECK(index < device_count(), "testdev: invalid device index ", static_cast<int>(index),
              "; the test device has ", static_cast<int>(device_count()),
              " devices (PORTSPEED_TESTDEV_DEVICES)");
  return index;
}

c10::DeviceIndex current_device() { return tls_current_device; }

void set_device(c10::DeviceIndex index) { tls_current_device = check_index(index); }

int64_t current_stream_id(c10::DeviceIndex index) {
  index = check_index(index);
  if (tls_current_stream.size() <= static_cast<size_t>(index)) {
    return 0;
  }
  return tls_current_stream[index];
}

namespace {

void set_current_stream_id(c10::DeviceIndex index, int64_t id) {
  if (tls_current_stream.size() < static_cast<size_t>(device_count())) {
    tls_current_stream.resize(device_count(), 0);
  }
  tls_current_stream[check_index(index)] = id;
}

c10::Stream make_stream(c10::DeviceIndex index, int64_t id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDeviceType, index), id);
}

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDeviceType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDeviceType, "testdev guard given a ", d.type(), " device");
    c10::Device old = getDevice();
    if (d.index() >= 0 && d.index() != old.index()) {
      set_device(d.index());
    }
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDeviceType, tls_current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDeviceType, "testdev guard given a ", d.type(), " device");
    if (d.index() >= 0) set_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) tls_current_device = d.index();
  }

  c10::Stream getStream(c10::Device d) const override {
    auto index = check_index(d.index());
    return make_stream(index, current_stream_id(index));
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return make_stream(check_index(d.index()), 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return make_stream(check_index(d.index()), next_stream_id++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto index = check_index(s.device_index());
    c10::Stream old = make_stream(index, current_stream_id(index));
    set_current_stream_id(index, s.id());
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return device_count();
    } catch (...) {
      return 0;
    }
  }

  // Work on every stream has already run when the call returns: queries are true and waits
  // return at once. Events still keep their time stamps, so elapsed_time() measures.
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "testdev: event device ", static_cast<int>(device_index),
                " does not match the stream's device ", static_cast<int>(stream.device_index()));
    auto* e = static_cast<Event*>(*event);
    if (e == nullptr) {
      e = new Event();
      *event = e;
    }
    e->when = std::chrono::steady_clock::now();
    e->recorded = true;
    e->device = stream.device_index();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void synchronizeEvent(void*) const override {}
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a && b && a->recorded && b->recorded,
                "testdev: elapsed_time() needs both events recorded first");
    return std::chrono::duration<double, std::milli>(b->when - a->when).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// A generator per device: the CPU's Mersenne Twister, owned by the device. Ops on device
// tensors draw from it (kernels.cpp), never from the host's default generator.
struct DeviceGenerator final : at::CPUGeneratorImpl {
  explicit DeviceGenerator(c10::DeviceIndex index) : at::CPUGeneratorImpl(c10::default_rng_seed_val) {
    device_ = c10::Device(kDeviceType, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }

 private:
  at::CPUGeneratorImpl* clone_impl() const override {
    auto* copy = new DeviceGenerator(device_.index());
    copy->set_state(*get_state());
    return copy;
  }
};

std::once_flag generators_once;
std::deque<at::Generator> generators;  // deque: stable addresses

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device();
    if (d >= 0) set_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return new_generator(index); }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kDeviceType, current_device()); }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "testdev: trying to resize a storage that is not resizable");
    c10::DataPtr fresh = impl->allocator()->allocate(newsize);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  std::call_once(generators_once, [] {
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      generators.emplace_back(at::make_generator<DeviceGenerator>(i));
    }
  });
  return generators[check_index(index)];
}

at::Generator new_generator(c10::DeviceIndex index) {
  return at::make_generator<DeviceGenerator>(check_index(index));
}

void register_hooks() {
  static std::once_flag once;
  std::call_once(once, [] { at::RegisterPrivateUse1HooksInterface(new Hooks()); });
}

}  // namespace testdev
