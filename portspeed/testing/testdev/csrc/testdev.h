// portspeed test device: an out-of-tree accelerator on the PrivateUse1 dispatch key.
//
// It is a TEST DEVICE, not hardware. Its bytes live in host RAM, but PyTorch sees them as
// device memory: tensors carry the device type, ops that mix host and device tensors fail,
// and every move between host and device is a real copy. Its purpose is to make the bugs a
// real port meets (a tensor left on the host, a wrong generator, an aliasing copy, a missing
// wait on a collective) visible on a machine without an accelerator.
//
// Shared declarations of the four translation units:
//   device.cpp  device index, streams, events, the device guard, generators, the hooks
//   memory.cpp  the device allocator (with statistics) and the pinned host allocator
//   kernels.cpp factories, views, copies, the checked CPU fallback, random ops, autocast
//   ccl.cpp     the collective backend "testccl" (staged through a Gloo process group)
//   fused.cpp   its own fused kernels: attention through torch's SDPA hooks, rms_norm; call counters
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace testdev {

constexpr c10::DeviceType kDeviceType = c10::DeviceType::PrivateUse1;

// ---- devices (device.cpp)
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex index);
c10::DeviceIndex check_index(c10::DeviceIndex index);  // -1 -> current; range-checked
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
int64_t current_stream_id(c10::DeviceIndex index);
void register_hooks();

// ---- the bare variant (device.cpp): PORTSPEED_TESTDEV_BARE, read once at load time. Each named fault
// turns off one thing this device does that a new vendor's device often does not (portspeed/testing/testdev/
// bare.py lists them): "no-memory-info", "no-shallow-copy", "wrong-sdpa", "host-rng", "stub-ccl"; "all".
bool bare(const char* fault);
std::vector<std::string> bare_faults();

// ---- memory (memory.cpp)
c10::Allocator* device_allocator();
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);
std::map<std::string, int64_t> memory_stats(c10::DeviceIndex index);
void reset_peak_memory_stats(c10::DeviceIndex index);

// ---- fused kernels (fused.cpp): how many times each ran in this process
std::map<std::string, int64_t> kernel_counters();
void reset_kernel_counters();

}  // namespace testdev
