// Operators of the portspeed test device (see testdev.h).
//
// Real kernels where a CPU fallback would be wrong: factories (device memory), views (a
// fallback "view" would be a copy and break aliasing such as Megatron's gradient buffers),
// copies between host and device (real copies), resize/set_, and reading one scalar.
// Everything else runs through at::native::cpu_fallback, behind a wrapper that first does
// what a real device does and the fallback does not:
//  * rejects operands on the host or on another device index (0-dim host scalars pass, and
//    host index tensors for indexing, as on CUDA);
//  * makes random operators draw from the device's own generator, never the host's;
//  * refuses a random operator it cannot route to the device generator, naming it.
// The few operators whose composite decomposition would otherwise bypass the fallback are
// sent to it explicitly, so the device computes what torch's CPU kernels compute.
// Autocast for the device registers torch's own operator lists on AutocastPrivateUse1.
#include "testdev.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/native_dropout_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace testdev {
namespace {

c10::Device device_or_current(std::optional<c10::Device> device) {
  if (!device.has_value() || !device->has_index()) {
    return c10::Device(kDeviceType, current_device());
  }
  TORCH_CHECK(device->type() == kDeviceType, "testdev: kernel asked for a ", device->type(), " device");
  return c10::Device(kDeviceType, check_index(device->index()));
}

// ---------------------------------------------------------------- factories
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "testdev: only host tensors can be pinned");
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided, "testdev: only strided tensors are supported");
  c10::DeviceGuard guard(device_or_current(device));
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "testdev: only host tensors can be pinned");
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided, "testdev: only strided tensors are supported");
  c10::DeviceGuard guard(device_or_current(device));
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// ---------------------------------------------------------------- storage changes
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  auto* impl = self.unsafeGetTensorImpl();
  at::native::resize_impl_cpu_(impl, size, /*stride=*/std::nullopt);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "testdev: unsupported memory format ", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor& set_empty_(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return at::native::set_storage_cpu_(self, storage, 0, {0}, {});
}

bool is_set_to(const at::Tensor& self, const at::Tensor& other) {
  return self.storage().is_alias_of(other.storage()) && self.storage_offset() == other.storage_offset() &&
         self.sizes().equals(other.sizes()) && self.strides().equals(other.strides());
}

// ---------------------------------------------------------------- copies
// A host tensor over a device tensor's bytes: only ever used inside these kernels, to copy.
at::Tensor host_alias(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), at::TensorOptions().dtype(t.scalar_type()));
}

at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool /*non_blocking*/) {
  for (const auto* t : {&src, &dst}) {
    TORCH_CHECK(t->is_cpu() || t->device().type() == kDeviceType, "testdev: cannot copy between testdev and ",
                t->device().type());
  }
  if (dst.numel() == 0) {
    return dst;
  }
  at::Tensor from = src.is_cpu() ? src : host_alias(src);
  at::Tensor to = dst.is_cpu() ? dst : host_alias(dst);
  to.copy_(from);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  if (!dst.sizes().equals(src.sizes())) {
    dst.resize_(src.sizes());
  }
  return copy_from(src, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::native::_local_scalar_dense_cpu(host_alias(self));
}

void record_stream(at::Tensor&, c10::Stream) {}  // every stream runs in program order

// `param.data = other` between host and device tensors: torch allows it between dense CPU and
// CUDA/XPU/... tensors, but its list of dense backends does not name PrivateUse1 (Megatron
// does `weight.data = weight.data.cuda()`). Answer for the test device as for CUDA.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  if (self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set())) return true;
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() && (t.is_cpu() || t.device().type() == kDeviceType);
  };
  return dense(self) && dense(from);
}

// ---------------------------------------------------------------- the checked fallback
bool allows_host_operands(const c10::OperatorName& name) {
  // CUDA accepts host index tensors for advanced indexing; so does the test device.
  return name.name == "aten::index" || name.name == "aten::index_put_" || name.name == "aten::index_put" ||
         name.name == "aten::_index_put_impl_";
}

struct Operands {
  std::optional<c10::Device> device;
  std::optional<c10::Device> host_operand;
};

void visit_tensor(const at::Tensor& t, const c10::OperatorHandle& op, Operands& seen) {
  if (!t.defined()) return;
  const c10::Device d = t.device();
  if (d.type() == kDeviceType) {
    if (!seen.device.has_value()) {
      seen.device = d;
    } else if (seen.device->index() != d.index()) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                  *seen.device, " and ", d, "! (testdev operator ", op.schema().operator_name(), ")");
    }
  } else if (d.is_cpu()) {
    if (t.dim() > 0 && !seen.host_operand.has_value()) seen.host_operand = d;
  } else {
    TORCH_CHECK(false, "testdev operator ", op.schema().operator_name(), " was given a tensor on ", d);
  }
}

void visit_value(const c10::IValue& v, const c10::OperatorHandle& op, Operands& seen) {
  if (v.isTensor()) {
    visit_tensor(v.toTensor(), op, seen);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) visit_tensor(t, op, seen);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) visit_tensor(e.toTensor(), op, seen);
    }
  }
}

bool is_generator_argument(const c10::Argument& arg) {
  const auto& type = arg.type();
  if (type->kind() == c10::TypeKind::GeneratorType) return true;
  if (type->kind() == c10::TypeKind::OptionalType) {
    return type->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::GeneratorType;
  }
  return false;
}

// The bare variant's wrong-gelu and wrong-layer-norm: gelu and gelu_backward, native_layer_norm and
// native_layer_norm_backward answer 1.25x the right value (a kernel of the vendor's off by a factor), in every
// dtype; the results are scaled on the device after the host computed them.
bool skewed_by_bare(const c10::OperatorName& name) {
  if (name.name == "aten::gelu" || name.name == "aten::gelu_" || name.name == "aten::gelu_backward") {
    return bare("wrong-gelu");
  }
  if (name.name == "aten::native_layer_norm" || name.name == "aten::native_layer_norm_backward") {
    return bare("wrong-layer-norm");
  }
  return false;
}

// Every result, but of native_layer_norm only the output: its mean and rstd, saved for the backward, stay right, so
// the backward too is off by exactly the factor.
void skew_results(torch::jit::Stack* stack, size_t returns, const c10::OperatorName& name) {
  const size_t first = stack->size() - returns;
  const size_t skewed = name.name == "aten::native_layer_norm" ? 1 : returns;
  for (size_t i = first; i < first + skewed; ++i) {
    if ((*stack)[i].isTensor() && (*stack)[i].toTensor().defined()) (*stack)[i].toTensor().mul_(1.25);
  }
}

void checked_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;

  Operands seen;
  std::vector<size_t> generator_slots;
  for (size_t i = 0; i < nargs; ++i) {
    visit_value((*stack)[first + i], op, seen);
    if (is_generator_argument(schema.arguments()[i])) generator_slots.push_back(first + i);
  }
  if (seen.device.has_value() && seen.host_operand.has_value() && !allows_host_operands(schema.operator_name())) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                *seen.device, " and cpu! (testdev operator ", schema.operator_name(), ")");
  }
  const c10::Device device = seen.device.value_or(c10::Device(kDeviceType, current_device()));
  c10::DeviceGuard guard(device);

  if (generator_slots.empty()) {
    TORCH_CHECK(!op.hasTag(at::Tag::nondeterministic_seeded),
                "testdev: random operator ", schema.operator_name(),
                " has no device kernel; running it on the host would draw from the host generator");
    at::native::cpu_fallback(op, stack);
    if (skewed_by_bare(schema.operator_name())) skew_results(stack, schema.returns().size(), schema.operator_name());
    return;
  }

  if (bare("host-rng")) {
    // The bare variant: random operators draw from the host's default generator through the CPU fallback (the
    // device generators exist, and seed, but nothing draws from them), and a device generator is refused.
    for (size_t slot : generator_slots) {
      const c10::IValue& v = (*stack)[slot];
      TORCH_CHECK(v.isNone() || v.toGenerator().device().is_cpu(), "Expected a 'cpu' device type for generator "
                  "but found '", v.isNone() ? c10::DeviceType::CPU : v.toGenerator().device().type(),
                  "' (testdev operator ", schema.operator_name(), ")");
    }
    at::native::cpu_fallback(op, stack);
    return;
  }

  // Random operator: run it on the host with a generator that holds the device generator's
  // state, then hand the advanced state back, so draws come from (and advance) the device one.
  struct Borrowed {
    at::Generator device_gen;
    at::Generator host_gen;
  };
  std::vector<Borrowed> borrowed;
  std::vector<std::unique_lock<std::mutex>> locks;
  for (size_t slot : generator_slots) {
    c10::IValue& v = (*stack)[slot];
    at::Generator gen = v.isNone() ? default_generator(device.index()) : v.toGenerator();
    TORCH_CHECK(gen.device().type() == kDeviceType, "Expected a 'testdev' device type for generator but found '",
                gen.device().type(), "' (testdev operator ", schema.operator_name(), ")");
    locks.emplace_back(gen.mutex());
    at::Generator host = at::make_generator<at::CPUGeneratorImpl>();
    host.set_state(gen.get_state());
    v = c10::IValue(host);
    borrowed.push_back({gen, host});
  }
  at::native::cpu_fallback(op, stack);
  for (auto& b : borrowed) b.device_gen.set_state(b.host_gen.get_state());
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&checked_fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(at::native::set_storage_cpu_));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", TORCH_FN(set_empty_));
  m.impl("is_set_to", TORCH_FN(is_set_to));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("record_stream", TORCH_FN(record_stream));
  // The bare variant leaves torch's default (PrivateUse1 is not in its list of dense backends), as OpenReg does:
  // `module.to(device)` then makes new Parameter objects and `param.data = t` across host and device raises.
  if (!bare("no-shallow-copy")) {
    m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  }
  // Composed of operators that reach this device (empty_like, bernoulli_, mul): the mask is
  // drawn by bernoulli_ from the device generator through the checked fallback.
  m.impl("native_dropout", TORCH_FN(at::native::native_dropout_cpu));
  // Operators whose CompositeExplicitAutograd decomposition would otherwise win over the
  // fallback on this device, and compute differently from the CPU kernel (bf16 layer_norm
  // without float accumulation, for one): run torch's CPU kernel, like every other operator.
  for (const char* name : {"native_layer_norm", "native_group_norm", "addr", "addr.out", "_stack", "_stack.out",
                           "linalg__powsum", "all.dims_out", "any.dims_out"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&checked_fallback>());
  }
}

// bf16/fp16 autocast on the device, with torch's own operator lists.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TESTDEV_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TESTDEV_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TESTDEV_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TESTDEV_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TESTDEV_LOWER)
  AT_FORALL_FP32(TESTDEV_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TESTDEV_FP32_OPT)
  AT_FORALL_PROMOTE(TESTDEV_PROMOTE)
#undef TESTDEV_LOWER
#undef TESTDEV_FP32
#undef TESTDEV_FP32_OPT
#undef TESTDEV_PROMOTE
}

}  // namespace testdev
