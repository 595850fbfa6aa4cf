// The test device's own fused kernels, each counting its calls (see testdev.h).
//
// Attention, through torch's PrivateUse1 hooks for F.scaled_dot_product_attention: torch asks
// the device's `_fused_sdp_choice` dispatch stub which backend serves a call; answering
// "overrideable" sends it to aten::_scaled_dot_product_fused_attention_overrideable, and
// autograd sends its gradient to ..._overrideable_backward. This is how a vendor plugs its
// flash attention into SDPA without forking torch. The test device computes both on the host
// with torch's CPU flash-attention kernels (copy in, compute, copy out): a test device, not
// hardware. It returns the output and the log-sum-exp the schema asks for, handles causal
// (top-left, SDPA's meaning; also with a mask, as torch's CPU kernel does), an additive or
// boolean mask, the scale, and grouped-query attention as the overrideable op receives it
// (K/V with fewer heads: the schema has no enable_gqa). It has no dropout: the choice sends
// dropout_p > 0 to torch's math path (which draws from the device generator), and counts
// that, so the fallback is visible.
//
// rms_norm, for portspeed's vendor-kernel slot (portspeed.testing.testdev.kernels): the
// custom operators testdev::rms_norm_forward / rms_norm_backward, statistics in float32.
//
// attention_lse, for the same slot (ring context parallelism asks for it): the custom operators
// testdev::attention_lse_forward / attention_lse_backward, the device's own tiled kernel with an
// online softmax (not torch's), reading and writing device memory in place.
#include "testdev.h"

#include <ATen/SDPBackend.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <optional>
#include <tuple>

namespace testdev {
namespace {

enum Counter : size_t {
  kSdpaForward,
  kSdpaBackward,
  kChoiceFused,
  kChoiceMath,
  kChoiceMathDropout,
  kRmsNormForward,
  kRmsNormBackward,
  kLseForward,
  kLseBackward,
  kNumCounters
};
constexpr std::array<const char*, kNumCounters> kCounterNames = {
    "sdpa_overrideable_fwd", "sdpa_overrideable_bwd", "sdpa_choice_overrideable", "sdpa_choice_math",
    "sdpa_choice_math_dropout", "rms_norm_fwd", "rms_norm_bwd",
    "attention_lse_fwd", "attention_lse_bwd"};
std::array<std::atomic<int64_t>, kNumCounters> counters{};

void bump(Counter c) { counters[c].fetch_add(1, std::memory_order_relaxed); }

// ---------------------------------------------------------------- attention
bool floating(c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Why the fused kernel cannot serve this call (nullptr: it can). Anything it cannot serve goes
// to torch's math path, which computes (or refuses) it exactly as on any other device.
const char* fused_refusal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout_p, bool enable_gqa) {
  if (dropout_p > 0.0) return "dropout";
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return "not 4-D";
  if (q.is_nested() || k.is_nested() || v.is_nested()) return "nested";
  if (!floating(q.scalar_type()) || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    return "dtype";
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0)) return "batch";
  if (k.size(3) != q.size(3) || v.size(3) != q.size(3)) return "head dim";
  if (v.size(1) != k.size(1) || v.size(2) != k.size(2)) return "key/value shapes";
  if (q.size(2) == 0 || k.size(2) == 0 || q.size(3) == 0) return "empty";
  const int64_t hq = q.size(1), hkv = k.size(1);
  if (hq != hkv && (!enable_gqa || hkv == 0 || hq % hkv != 0)) return "heads";
  if (mask.has_value() && mask->defined()) {
    if (mask->requires_grad()) return "mask gradient";
    if (mask->scalar_type() != at::kBool && mask->scalar_type() != q.scalar_type()) return "mask dtype";
    if (mask->dim() > 4) return "mask rank";
  }
  return nullptr;
}

int64_t choose_sdp(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                   double dropout_p, bool /*is_causal*/, std::optional<double> /*scale*/, bool enable_gqa) {
  const char* why = fused_refusal(q, k, v, mask, dropout_p, enable_gqa);
  if (why == nullptr) {
    bump(kChoiceFused);
    return static_cast<int64_t>(at::SDPBackend::overrideable);
  }
  bump(kChoiceMath);
  if (dropout_p > 0.0) bump(kChoiceMathDropout);
  return static_cast<int64_t>(at::SDPBackend::math);
}

// The mask on the host, additive, in q's dtype, broadcast to [b, hq, sq, sk].
std::optional<at::Tensor> host_mask(const std::optional<at::Tensor>& bias, const at::Tensor& q, int64_t sk) {
  if (!bias.has_value() || !bias->defined()) return std::nullopt;
  at::Tensor m = bias->cpu();
  if (m.scalar_type() == at::kBool) {
    m = at::zeros(m.sizes(), m.options().dtype(q.scalar_type()))
            .masked_fill_(m.logical_not(), -std::numeric_limits<double>::infinity());
  } else if (m.scalar_type() != q.scalar_type()) {
    m = m.to(q.scalar_type());
  }
  return m.expand({q.size(0), q.size(1), q.size(2), sk});
}

using FusedOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
                                at::Tensor, at::Tensor>;

FusedOutputs attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                               bool return_debug_mask, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "testdev: its fused attention has no dropout (dropout_p=", dropout_p,
              "); F.scaled_dot_product_attention sends dropout to torch's math path on this device");
  TORCH_CHECK(!return_debug_mask, "testdev: its fused attention returns no debug mask");
  bump(kSdpaForward);
  const c10::Device device = q.device();
  c10::DeviceGuard guard(device);
  if (bare("wrong-sdpa")) {  // the bare variant: outputs never written (OpenReg's SDPA on torch 2.13)
    const auto ints = q.options().dtype(at::kInt);
    const auto longs = q.options().dtype(at::kLong);
    return {at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options()),
            at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat)),
            at::empty({0}, ints), at::empty({0}, ints), c10::SymInt(q.size(2)), c10::SymInt(k.size(2)),
            at::empty({}, longs), at::empty({}, longs), at::empty({0}, q.options())};
  }
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.cpu(), k.cpu(), v.cpu(), 0.0, is_causal,
                                                                    host_mask(attn_bias, q, k.size(2)), scale);
  const auto ints = q.options().dtype(at::kInt);
  const auto longs = q.options().dtype(at::kLong);
  return {out.to(device),          lse.to(device),          at::empty({0}, ints),   at::empty({0}, ints),
          c10::SymInt(q.size(2)),  c10::SymInt(k.size(2)),  at::empty({}, longs),   at::empty({}, longs),
          at::empty({0}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& /*cum_seq_q*/, const at::Tensor& /*cum_seq_k*/, int64_t /*max_q*/, int64_t /*max_k*/,
    double dropout_p, bool is_causal, const at::Tensor& /*philox_seed*/, const at::Tensor& /*philox_offset*/,
    std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "testdev: its fused attention has no dropout (dropout_p=", dropout_p, ")");
  TORCH_CHECK(!grad_input_mask[3], "testdev: its fused attention gives no gradient for attn_mask "
              "(its _fused_sdp_choice sends a mask that requires grad to torch's math path)");
  bump(kSdpaBackward);
  const c10::Device device = q.device();
  c10::DeviceGuard guard(device);
  if (bare("wrong-sdpa")) {
    return {at::empty_like(q), at::empty_like(k), at::empty_like(v), at::Tensor()};
  }
  std::optional<at::Tensor> bias = attn_bias.defined() ? std::optional<at::Tensor>(attn_bias) : std::nullopt;
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      grad_out.cpu(), q.cpu(), k.cpu(), v.cpu(), out.cpu(), lse.cpu(), 0.0, is_causal, host_mask(bias, q, k.size(2)),
      scale);
  return {dq.to(device), dk.to(device), dv.to(device), at::Tensor()};
}

// ---------------------------------------------------------------- rms_norm (vendor slot)
void check_rms_operands(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().type() == kDeviceType && weight.device() == x.device(),
              "testdev::rms_norm: x and weight must be on one testdev device, got ", x.device(), " and ",
              weight.device());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "testdev::rms_norm: weight must be 1-D of the last dimension of x (", x.sizes(), "), got ",
              weight.sizes());
}

// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension, in float32.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_operands(x, weight);
  bump(kRmsNormForward);
  c10::DeviceGuard guard(x.device());
  const at::Tensor xf = x.cpu().to(at::kFloat);
  const at::Tensor rstd = (xf.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();
  const at::Tensor y = (xf * rstd * weight.cpu().to(at::kFloat)).to(x.scalar_type());
  return {y.to(x.device()), rstd.to(x.device())};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd) {
  check_rms_operands(x, weight);
  bump(kRmsNormBackward);
  c10::DeviceGuard guard(x.device());
  const at::Tensor g = grad.cpu().to(at::kFloat);
  const at::Tensor xhat = x.cpu().to(at::kFloat) * rstd.cpu();
  const at::Tensor gw = g * weight.cpu().to(at::kFloat);
  const at::Tensor dx = rstd.cpu() * (gw - xhat * (gw * xhat).mean(-1, /*keepdim=*/true));
  const at::Tensor dw = (g * xhat).reshape({-1, x.size(-1)}).sum(0);
  return {dx.to(x.scalar_type()).to(x.device()), dw.to(weight.scalar_type()).to(x.device())};
}

// ---------------------------------------------------------------- attention with its log-sum-exp (vendor slot)
// One block of ring context parallelism (portspeed.accelerator.kernel_ops.attention_lse and its backward),
// written for the device rather than borrowed from torch: keys in tiles of kKeyTile with an online softmax
// (running max, running sum, rescaled accumulator), float32 throughout, grouped-query attention without
// repeating K/V (each key/value head serves its g query heads as g * sq rows). Device memory is host RAM,
// so the kernel reads its operands and writes its results in place through host views: no copies.
constexpr int64_t kKeyTile = 32;

// A host tensor over a device tensor's bytes (sizes, strides and offset kept): how the kernel touches device memory.
at::Tensor in_place(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), at::TensorOptions().dtype(t.scalar_type()));
}

void check_lse_operands(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().type() == kDeviceType && t->device() == q.device(), "testdev::", op,
                ": q, k and v must be on one testdev device (it is the device's kernel), got ", q.device(), ", ",
                k.device(), " and ", v.device());
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "testdev::", op,
              ": q, k, v must be [b, heads, seq, d], got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(floating(q.scalar_type()) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "testdev::", op, ": q, k, v must share one floating dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "testdev::", op, ": k and v must be [b, hkv, sk, d] with hq % hkv == 0 for q ", q.sizes(),
              ", got ", k.sizes(), " and ", v.sizes());
}

// A device tensor [b, hq, s, x] (any strides) as float32 [b, hkv, g * s, x] on the host, read in place (a copy
// only to widen bf16/fp16): the rows of the g query heads of each key/value head, as one matrix.
at::Tensor grouped(const at::Tensor& host, int64_t hkv) {
  return host.to(at::kFloat).reshape({host.size(0), hkv, host.size(1) / hkv * host.size(2), host.size(3)});
}

// Where top-left causal forbids keys [j0, j0 + n) to the grouped rows (row r is query r % sq): [g * sq, n].
at::Tensor causal_forbidden(int64_t rows, int64_t sq, int64_t j0, int64_t n) {
  const auto longs = at::TensorOptions().dtype(at::kLong);
  const at::Tensor query = at::arange(rows, longs).remainder(sq).unsqueeze(1);
  const at::Tensor key = at::arange(j0, j0 + n, longs).unsqueeze(0);
  return key.gt(query);
}

at::Tensor tile_scores(const at::Tensor& qg, const at::Tensor& kt, bool causal, int64_t sq, int64_t j0,
                       double scale) {
  at::Tensor s = at::matmul(qg, kt.transpose(-2, -1)).mul_(scale);
  if (causal) s.masked_fill_(causal_forbidden(qg.size(2), sq, j0, kt.size(2)), -std::numeric_limits<float>::infinity());
  return s;
}

// A device tensor of `like`'s options holding `host` (written in place).
at::Tensor to_device(const at::Tensor& host, const at::Tensor& like, c10::ScalarType dtype) {
  at::Tensor out = at::empty(host.sizes(), like.options().dtype(dtype));
  in_place(out).copy_(host);
  return out;
}

std::tuple<at::Tensor, at::Tensor> attention_lse_forward(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, bool causal, double scale) {
  check_lse_operands("attention_lse_forward", q, k, v);
  bump(kLseForward);
  c10::DeviceGuard guard(q.device());
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3), hkv = k.size(1), sk = k.size(2);
  const at::Tensor qg = grouped(in_place(q), hkv), kf = grouped(in_place(k), hkv), vf = grouped(in_place(v), hkv);
  const float inf = std::numeric_limits<float>::infinity();
  at::Tensor row_max = at::full({b, hkv, qg.size(2), 1}, -inf, qg.options());
  at::Tensor row_sum = at::zeros_like(row_max);
  at::Tensor acc = at::zeros({b, hkv, qg.size(2), d}, qg.options());
  for (int64_t j0 = 0; j0 < sk; j0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, sk - j0);
    const at::Tensor s = tile_scores(qg, kf.narrow(2, j0, n), causal, sq, j0, scale);
    const at::Tensor new_max = at::maximum(row_max, std::get<0>(s.max(-1, /*keepdim=*/true)));
    const at::Tensor shift = new_max.masked_fill(new_max.isneginf(), 0.0);  // a row with no key allowed yet
    const at::Tensor p = (s - shift).exp_();
    const at::Tensor rescale = (row_max - shift).exp_();
    row_sum = row_sum.mul_(rescale).add_(p.sum(-1, /*keepdim=*/true));
    acc = acc.mul_(rescale).add_(at::matmul(p, vf.narrow(2, j0, n)));
    row_max = new_max;
  }
  const at::Tensor lse = (row_max + row_sum.log()).reshape({b, hq, sq});
  // no key at all (an empty block): lse -inf and out 0, which a log-sum-exp merge then ignores
  const at::Tensor out = acc.div_(row_sum.masked_fill(row_sum.eq(0), 1.0)).reshape({b, hq, sq, d});
  return {to_device(out, q, q.scalar_type()), to_device(lse, q, at::kFloat)};
}

// The block's share of the gradient of the merged attention, given the merged `out` and `lse`:
// p = exp(s - lse), dV = p^T dO, dS = p * (dO V^T - rowsum(dO * O)), dQ = dS K scale, dK = dS^T Q scale.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_lse_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  check_lse_operands("attention_lse_backward", q, k, v);
  for (const at::Tensor* t : {&grad_out, &out, &lse}) {
    TORCH_CHECK(t->device() == q.device(), "testdev::attention_lse_backward: grad_out, out and lse must be on ",
                q.device(), " with q, got ", grad_out.device(), ", ", out.device(), " and ", lse.device());
  }
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "testdev::attention_lse_backward: grad_out and out must be shaped as q ", q.sizes(), ", got ",
              grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.sizes() == q.sizes().slice(0, 3) && lse.scalar_type() == at::kFloat,
              "testdev::attention_lse_backward: lse must be float32 [b, hq, sq] ", q.sizes().slice(0, 3), ", got ",
              lse.scalar_type(), " ", lse.sizes());
  bump(kLseBackward);
  c10::DeviceGuard guard(q.device());
  const int64_t hkv = k.size(1), sq = q.size(2), sk = k.size(2);
  const at::Tensor qg = grouped(in_place(q), hkv), kf = grouped(in_place(k), hkv), vf = grouped(in_place(v), hkv);
  const at::Tensor dout = grouped(in_place(grad_out), hkv);
  const at::Tensor lse_rows = grouped(in_place(lse).unsqueeze(-1), hkv);
  const at::Tensor delta = (dout * grouped(in_place(out), hkv)).sum(-1, /*keepdim=*/true);
  at::Tensor dq = at::zeros_like(qg);
  at::Tensor dk = at::empty_like(kf), dv = at::empty_like(vf);
  for (int64_t j0 = 0; j0 < sk; j0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, sk - j0);
    const at::Tensor kt = kf.narrow(2, j0, n), vt = vf.narrow(2, j0, n);
    const at::Tensor p = (tile_scores(qg, kt, causal, sq, j0, scale) - lse_rows).exp_();
    dv.narrow(2, j0, n).copy_(at::matmul(p.transpose(-2, -1), dout));
    const at::Tensor ds = p.mul_(at::matmul(dout, vt.transpose(-2, -1)).sub_(delta));
    dq.add_(at::matmul(ds, kt));
    dk.narrow(2, j0, n).copy_(at::matmul(ds.transpose(-2, -1), qg));
  }
  return {to_device(dq.mul_(scale).reshape(q.sizes()), q, q.scalar_type()),
          to_device(dk.mul_(scale), k, k.scalar_type()), to_device(dv, v, v.scalar_type())};
}

}  // namespace

std::map<std::string, int64_t> kernel_counters() {
  std::map<std::string, int64_t> out;
  for (size_t i = 0; i < kNumCounters; ++i) out[kCounterNames[i]] = counters[i].load();
  return out;
}

void reset_kernel_counters() {
  for (auto& c : counters) c.store(0);
}

TORCH_LIBRARY(testdev, m) {
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd) -> (Tensor grad_x, Tensor grad_weight)");
  m.def("attention_lse_forward(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor out, Tensor lse)");
  m.def("attention_lse_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
}

TORCH_LIBRARY_IMPL(testdev, PrivateUse1, m) {
  m.impl("rms_norm_forward", TORCH_FN(rms_norm_forward));
  m.impl("rms_norm_backward", TORCH_FN(rms_norm_backward));
  m.impl("attention_lse_forward", TORCH_FN(attention_lse_forward));
  m.impl("attention_lse_backward", TORCH_FN(attention_lse_backward));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // the operator form of the choice (torch.nn.attention asks it), answering as the stub below does
  m.impl("_fused_sdp_choice", TORCH_FN(choose_sdp));
  m.impl("_scaled_dot_product_fused_attention_overrideable", TORCH_FN(attention_forward));
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward", TORCH_FN(attention_backward));
}

}  // namespace testdev

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &testdev::choose_sdp)
}  // namespace at::native
