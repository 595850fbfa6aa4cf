// Memory of the portspeed test device (see testdev.h).
//
// Device memory is host RAM handed out under the device's type, so PyTorch treats it as
// device memory. Fresh allocations are filled with 0xFF bytes (NaN in every float type)
// unless PORTSPEED_TESTDEV_POISON=0: a real device's fresh memory holds garbage, and code
// that reads a buffer it never wrote must fail here too, not read zeros by luck.
// The allocator is a c10::DeviceAllocator so torch.accelerator's memory statistics work.
//
// Pinned host memory is plain host memory whose ranges are remembered, so is_pinned()
// answers truthfully for tensors made by pin_memory().
#include "testdev.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace testdev {
namespace {

using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kAggregate = static_cast<size_t>(StatType::AGGREGATE);

bool poison_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("PORTSPEED_TESTDEV_POISON");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return on;
}

struct Block {
  void* ptr;
  size_t bytes;
  c10::DeviceIndex device;
};

std::mutex stats_mutex;
std::vector<DeviceStats>& all_stats() {
  static std::vector<DeviceStats> stats(static_cast<size_t>(device_count()));
  return stats;
}

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  {
    std::lock_guard<std::mutex> lock(stats_mutex);
    auto& s = all_stats()[block->device];
    s.allocated_bytes[kAggregate].decrease(block->bytes);
    s.reserved_bytes[kAggregate].decrease(block->bytes);
    s.active_bytes[kAggregate].decrease(block->bytes);
    s.allocation[kAggregate].decrease(1);
    s.segment[kAggregate].decrease(1);
    s.active[kAggregate].decrease(1);
  }
  std::free(block->ptr);
  delete block;
}

// The statistics this allocator keeps (aggregate pool only: there is one pool).
template <typename Fn>
void for_each_stat(DeviceStats& s, Fn fn) {
  for (auto* arr : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.requested_bytes}) {
    fn((*arr)[kAggregate]);
  }
}

struct DeviceMemory final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex device = current_device();
    if (n == 0) {
      return c10::DataPtr(nullptr, c10::Device(kDeviceType, device));
    }
    void* ptr = std::aligned_alloc(64, (n + 63) / 64 * 64);
    TORCH_CHECK(ptr != nullptr, "testdev: out of memory allocating ", n, " bytes");
    if (poison_enabled()) {
      std::memset(ptr, 0xFF, n);
    }
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      auto& s = all_stats()[device];
      s.allocated_bytes[kAggregate].increase(n);
      s.reserved_bytes[kAggregate].increase(n);
      s.active_bytes[kAggregate].increase(n);
      s.requested_bytes[kAggregate].increase(n);
      s.allocation[kAggregate].increase(1);
      s.segment[kAggregate].increase(1);
      s.active[kAggregate].increase(1);
      s.num_device_alloc += 1;
    }
    return c10::DataPtr(ptr, new Block{ptr, n, device}, &free_block, c10::Device(kDeviceType, device));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // no cache: freed memory goes back at once
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // streams run in order
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(stats_mutex);
    return all_stats()[check_index(device)];
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(stats_mutex);
    auto& s = all_stats()[check_index(device)];
    for_each_stat(s, [](c10::CachingAllocator::Stat& st) { st.reset_accumulated(); });
    s.num_device_alloc = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(stats_mutex);
    for_each_stat(all_stats()[check_index(device)], [](c10::CachingAllocator::Stat& st) { st.reset_peak(); });
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    // The bare variant answers as a new vendor's allocator often does (OpenReg's on torch 2.13): not at all.
    TORCH_CHECK_NOT_IMPLEMENTED(!bare("no-memory-info"),
                                "getMemoryInfo is not implemented for this allocator yet (the bare test device: "
                                "PORTSPEED_TESTDEV_BARE=no-memory-info)");
    constexpr size_t kTotal = size_t(16) << 30;  // a nominal 16 GiB per test device
    std::lock_guard<std::mutex> lock(stats_mutex);
    size_t used = static_cast<size_t>(all_stats()[check_index(device)].reserved_bytes[kAggregate].current);
    return {used < kTotal ? kTotal - used : 0, kTotal};
  }
};

DeviceMemory device_memory;

// ---- pinned host memory
std::mutex pinned_mutex;
std::map<const char*, size_t>& pinned_ranges() {
  static std::map<const char*, size_t> ranges;
  return ranges;
}

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_ranges().erase(static_cast<const char*>(ptr));
  }
  std::free(ptr);
}

struct PinnedMemory final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* ptr = n ? std::aligned_alloc(64, (n + 63) / 64 * 64) : nullptr;
    TORCH_CHECK(n == 0 || ptr != nullptr, "testdev: out of pinned memory allocating ", n, " bytes");
    if (ptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_ranges()[static_cast<const char*>(ptr)] = n;
    }
    return c10::DataPtr(ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedMemory pinned_memory;

}  // namespace

c10::Allocator* device_allocator() { return &device_memory; }
c10::Allocator* pinned_allocator() { return &pinned_memory; }

bool is_pinned(const void* ptr) {
  const char* p = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto& ranges = pinned_ranges();
  auto it = ranges.upper_bound(p);
  if (it == ranges.begin()) return false;
  --it;
  return p < it->first + it->second;
}

std::map<std::string, int64_t> memory_stats(c10::DeviceIndex index) {
  DeviceStats s = device_memory.getDeviceStats(index);
  const auto& a = s.allocated_bytes[kAggregate];
  const auto& r = s.reserved_bytes[kAggregate];
  const auto& n = s.allocation[kAggregate];
  return {
      {"allocated_bytes.all.current", a.current}, {"allocated_bytes.all.peak", a.peak},
      {"allocated_bytes.all.allocated", a.allocated}, {"allocated_bytes.all.freed", a.freed},
      {"reserved_bytes.all.current", r.current}, {"reserved_bytes.all.peak", r.peak},
      {"allocation.all.current", n.current}, {"allocation.all.peak", n.peak},
      {"num_device_alloc", s.num_device_alloc},
  };
}

void reset_peak_memory_stats(c10::DeviceIndex index) { device_memory.resetPeakStats(index); }

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &device_memory);

}  // namespace testdev
