// Python bindings of the portspeed test device (see testdev.h): what its Python device
// module (portspeed.testing.testdev.device_module) calls.
#include "testdev.h"

#include <ATen/core/Generator.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/extension.h>

namespace testdev {
c10::intrusive_ptr<c10d::Backend> create_backend(py::object gloo, int rank, int size);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "portspeed test device (PrivateUse1): a test device, not hardware";
  m.def("register_hooks", &testdev::register_hooks, "register the PrivateUse1 hooks (generators, pinned memory)");
  m.def("device_count", []() { return static_cast<int>(testdev::device_count()); });
  m.def("current_device", []() { return static_cast<int>(testdev::current_device()); });
  m.def("set_device", [](int index) { testdev::set_device(static_cast<c10::DeviceIndex>(index)); });
  m.def("current_stream_id", [](int index) { return testdev::current_stream_id(static_cast<c10::DeviceIndex>(index)); });
  m.def("default_generator",
        [](int index) { return testdev::default_generator(static_cast<c10::DeviceIndex>(index)); });
  m.def("memory_stats", [](int index) { return testdev::memory_stats(static_cast<c10::DeviceIndex>(index)); });
  m.def("reset_peak_memory_stats",
        [](int index) { testdev::reset_peak_memory_stats(static_cast<c10::DeviceIndex>(index)); });
  m.def("is_pinned_ptr", [](uintptr_t ptr) { return testdev::is_pinned(reinterpret_cast<const void*>(ptr)); });
  m.def("kernel_counters", &testdev::kernel_counters, "calls of the device's own fused kernels (fused.cpp)");
  m.def("reset_kernel_counters", &testdev::reset_kernel_counters);
  m.def("bare_faults", &testdev::bare_faults, "the faults of the bare variant this library read (PORTSPEED_TESTDEV_BARE)");
  m.def("create_backend", &testdev::create_backend, py::arg("gloo"), py::arg("rank"), py::arg("size"),
        "the testccl c10d backend, staging through the given Gloo backend");
}
