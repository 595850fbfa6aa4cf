// "testccl": the collective backend of the portspeed test device (see testdev.h).
//
// A c10d::Backend for the device type, so every path into c10d reaches it: the Python API,
// functional collectives and DTensor alike (c10d dispatches PrivateUse1 tensors to the
// group's backend for PrivateUse1). It stages through a Gloo process group made in Python:
// inputs are copied to host buffers when the collective is issued, Gloo runs on the host
// buffers, and results are copied back into the device tensors inside wait(). Until wait()
// returns, a device output holds what it held before: code that forgets to wait, or frees
// a buffer too early, gets a wrong answer here as it would on an accelerator.
//
// torch >= 2.15 (C10D_BACKEND_HAS_HOOKS): completion and abort hooks, as a vendor's C++ CCL offers
// them, so torch's FlightRecorderHook (attached by default to a C++ backend that does not record
// itself) shows an entry "completed" once its staged Gloo call finished (pushed from Gloo's future,
// or at wait() for Gloo's sends and receives, which have none), and dumps its buffer
// when a staged call fails (the abort hooks run before the error reaches the caller). Older torch
// builds the same backend without them.
//
// Declared gaps, like a vendor CCL's (the adapter declares the same ones to the router):
//   * ReduceOp AVG and PREMUL_SUM are refused by every reducing collective;
//   * bfloat16 is refused by reduce-scatter (list, tensor and coalesced forms).
#include "testdev.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace testdev {
namespace {

using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

at::Tensor to_host(const at::Tensor& t) { return t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true); }

at::Tensor host_like(const at::Tensor& t) { return at::empty_like(t, t.options().device(at::kCPU)); }

std::vector<at::Tensor> to_host(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(to_host(t));
  return out;
}

std::vector<at::Tensor> host_like(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(host_like(t));
  return out;
}

// Host copies of lists of device tensors (inputs); every host tensor is also added to ``keep``.
std::vector<std::vector<at::Tensor>> lists_to_host(const std::vector<std::vector<at::Tensor>>& lists,
                                                   std::vector<at::Tensor>& keep) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& list : lists) {
    out.push_back(to_host(list));
    keep.insert(keep.end(), out.back().begin(), out.back().end());
  }
  return out;
}

// Host buffers for lists of device tensors (outputs); each (device, host) pair goes to ``back``.
std::vector<std::vector<at::Tensor>> lists_like(const std::vector<std::vector<at::Tensor>>& lists,
                                                std::vector<std::pair<at::Tensor, at::Tensor>>& back) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& list : lists) {
    out.push_back(host_like(list));
    for (size_t i = 0; i < list.size(); ++i) back.emplace_back(list[i], out.back()[i]);
  }
  return out;
}

#ifdef C10D_BACKEND_HAS_HOOKS
// The backend's completion and abort hooks, shared with its works (a work may outlive the backend).
struct Hooks {
  std::mutex mutex;
  std::map<int64_t, c10d::CompletionHook> completion;
  std::map<int64_t, c10d::AbortHook> abort;

  void completed(uint64_t key) {
    std::vector<c10d::CompletionHook> run;
    {
      std::lock_guard<std::mutex> lock(mutex);  // copied out: a hook must not run under the table's lock
      for (auto& [id, hook] : completion) run.push_back(hook);
    }
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    for (auto& hook : run) hook(args);
  }

  void aborted() {
    std::vector<c10d::AbortHook> run;
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (auto& [id, hook] : abort) run.push_back(hook);
    }
    for (auto& hook : run) hook();
  }
};
#else
struct Hooks {
  void completed(uint64_t) {}
  void aborted() {}
};
#endif

// The work of one staged collective: waits for Gloo, then copies host results back into
// the device tensors (once, whoever asks first: wait() or the future).
class StagedWork final : public Work {
 public:
  StagedWork(WorkPtr inner, std::vector<std::pair<at::Tensor, at::Tensor>> copy_back, c10d::OpType type,
             std::vector<at::Tensor> keep_alive, int rank, std::shared_ptr<Hooks> hooks)
      : Work(rank, type), inner_(std::move(inner)), copy_back_(std::move(copy_back)),
        keep_alive_(std::move(keep_alive)), hooks_(std::move(hooks)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (inner_) {
      try {
        inner_->wait(timeout);
      } catch (...) {
        failed();
        throw;
      }
    }
    finish_copy();
    succeeded();
    return true;
  }

  // Gloo finished the staged call: push completion (once) or, on its error, run the abort hooks. Called from
  // the inner future's callback (Gloo's thread) and from wait(); the key is this work's, which torch saw.
#ifdef C10D_BACKEND_HAS_HOOKS
  void succeeded() {
    if (!hooks_ || told_.exchange(true)) return;
    hooks_->completed(getCompletionKey());
  }

  void failed() {
    if (!hooks_ || told_.exchange(true)) return;
    hooks_->aborted();
  }
#else
  void succeeded() {}
  void failed() {}
#endif

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return copied_;
  }

  bool isSuccess() const override { return inner_ ? inner_->isSuccess() : true; }

  Work* inner() const { return inner_.get(); }

  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (auto& p : copy_back_) out.push_back(p.first);
    return out;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (!inner_) {
      fut->markCompleted(c10::IValue(result()));
      return fut;
    }
    c10::intrusive_ptr<StagedWork> self = c10::intrusive_ptr<StagedWork>::reclaim_copy(this);
    inner_->getFuture()->addCallback([self, fut](c10::ivalue::Future& done) {
      if (done.hasError()) {
        fut->setError(done.exception_ptr());
        return;
      }
      self->finish_copy();
      fut->markCompleted(c10::IValue(self->result()));
    });
    return fut;
  }

 private:
  void finish_copy() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (copied_) return;
    // A collective writes its outputs outside autograd (Megatron receives into leaf tensors
    // that require grad), so the copy back must not be recorded as an in-place op.
    at::NoGradGuard no_grad;
    for (auto& [device_tensor, host_tensor] : copy_back_) device_tensor.copy_(host_tensor);
    copied_ = true;
    keep_alive_.clear();
  }

  WorkPtr inner_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;  // (device destination, host source)
  std::vector<at::Tensor> keep_alive_;                          // host inputs Gloo still reads
  std::shared_ptr<Hooks> hooks_;                                // null: nobody listens
  std::atomic<bool> told_{false};                               // completion or abort pushed
  std::mutex mutex_;
  bool copied_ = false;
};

// Work that completes when every part does (coalesced forms made of single collectives).
class GroupWork final : public Work {
 public:
  GroupWork(std::vector<WorkPtr> parts, int rank) : Work(rank, c10d::OpType::COALESCED), parts_(std::move(parts)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : parts_) w->wait(timeout);
    return true;
  }
  bool isCompleted() override {
    for (auto& w : parts_) {
      if (!w->isCompleted()) return false;
    }
    return true;
  }

 private:
  std::vector<WorkPtr> parts_;
};

class TestCCL final : public c10d::Backend {
 public:
  TestCCL(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size)
      : c10d::Backend(rank, size), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override { return "testccl"; }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    auto host = to_host(tensors);
    return staged(gloo_->broadcast(host, opts), pairs(tensors, host), c10d::OpType::BROADCAST);
  }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    check_reduce_op(opts.reduceOp, "allreduce");
    auto host = to_host(tensors);
    return staged(gloo_->allreduce(host, opts), pairs(tensors, host), c10d::OpType::ALLREDUCE);
  }

  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    check_reduce_op(opts.reduceOp, "allreduce_coalesced");
    auto host = to_host(tensors);
    return staged(gloo_->allreduce_coalesced(host, opts), pairs(tensors, host), c10d::OpType::ALLREDUCE_COALESCED);
  }

  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    check_reduce_op(opts.reduceOp, "reduce");
    auto host = to_host(tensors);
    return staged(gloo_->reduce(host, opts), pairs(tensors, host), c10d::OpType::REDUCE);
  }

  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts) override {
    auto host_in = to_host(inputs);
    std::vector<std::pair<at::Tensor, at::Tensor>> back;
    auto host_out = lists_like(outputs, back);
    return staged(gloo_->allgather(host_out, host_in, opts), std::move(back), c10d::OpType::ALLGATHER, host_in);
  }

  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    at::Tensor host_in = to_host(input);
    at::Tensor host_out = host_like(output);
    return staged(gloo_->_allgather_base(host_out, host_in, opts), {{output, host_out}}, c10d::OpType::_ALLGATHER_BASE,
                  {host_in});
  }

  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    auto host_in = to_host(inputs);
    auto host_out = host_like(outputs);
    return staged(gloo_->allgather_into_tensor_coalesced(host_out, host_in, opts), pairs(outputs, host_out),
                  c10d::OpType::COALESCED, host_in);
  }

  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    auto host_in = to_host(inputs);
    std::vector<std::pair<at::Tensor, at::Tensor>> back;
    auto host_out = lists_like(outputs, back);
    return staged(gloo_->gather(host_out, host_in, opts), std::move(back), c10d::OpType::GATHER, host_in);
  }

  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    std::vector<at::Tensor> keep;
    auto host_in = lists_to_host(inputs, keep);
    auto host_out = host_like(outputs);
    return staged(gloo_->scatter(host_out, host_in, opts), pairs(outputs, host_out), c10d::OpType::SCATTER, keep);
  }

  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    check_reduce_op(opts.reduceOp, "reduce_scatter");
    check_reduce_scatter_dtype(outputs, "reduce_scatter");
    std::vector<at::Tensor> keep;
    auto host_in = lists_to_host(inputs, keep);
    auto host_out = host_like(outputs);
    return staged(gloo_->reduce_scatter(host_out, host_in, opts), pairs(outputs, host_out),
                  c10d::OpType::REDUCE_SCATTER, keep);
  }

  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    check_reduce_op(opts.reduceOp, "reduce_scatter_tensor");
    std::vector<at::Tensor> outs{output};
    check_reduce_scatter_dtype(outs, "reduce_scatter_tensor");
    at::Tensor host_in = to_host(input);
    at::Tensor host_out = host_like(output);
    return staged(gloo_->_reduce_scatter_base(host_out, host_in, opts), {{output, host_out}},
                  c10d::OpType::_REDUCE_SCATTER_BASE, {host_in});
  }

  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    check_reduce_op(opts.reduceOp, "reduce_scatter_tensor_coalesced");
    check_reduce_scatter_dtype(outputs, "reduce_scatter_tensor_coalesced");
    auto host_in = to_host(inputs);
    auto host_out = host_like(outputs);
    return staged(gloo_->reduce_scatter_tensor_coalesced(host_out, host_in, opts), pairs(outputs, host_out),
                  c10d::OpType::COALESCED, host_in);
  }

  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    at::Tensor host_in = to_host(input);
    at::Tensor host_out = host_like(output);
    return staged(gloo_->alltoall_base(host_out, host_in, output_splits, input_splits, opts), {{output, host_out}},
                  c10d::OpType::ALLTOALL_BASE, {host_in});
  }

  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override {
    auto host_in = to_host(inputs);
    auto host_out = host_like(outputs);
    return staged(gloo_->alltoall(host_out, host_in, opts), pairs(outputs, host_out), c10d::OpType::ALLTOALL, host_in);
  }

  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    // The host copy is taken now: like NCCL, the send has captured the data when it returns.
    auto host = to_host(tensors);
    return staged(gloo_->send(host, dst, tag), {}, c10d::OpType::SEND, host);
  }

  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto host = host_like(tensors);
    return staged(gloo_->recv(host, src, tag), pairs(tensors, host), c10d::OpType::RECV);
  }

  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    auto host = host_like(tensors);
    return staged(gloo_->recvAnysource(host, tag), pairs(tensors, host), c10d::OpType::RECVANYSOURCE);
  }

  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    c10d::BarrierOptions host_opts = opts;
    host_opts.device_ids.clear();
    host_opts.device = std::nullopt;
    return staged(gloo_->barrier(host_opts), {}, c10d::OpType::BARRIER);
  }

#ifdef C10D_BACKEND_HAS_HOOKS
  bool supportsCompletionHooks() const override { return true; }
  void registerCompletionHook(int64_t hook_id, c10d::CompletionHook hook) override {
    std::lock_guard<std::mutex> lock(hooks_->mutex);
    hooks_->completion[hook_id] = std::move(hook);
  }
  void unregisterCompletionHook(int64_t hook_id) override {
    std::lock_guard<std::mutex> lock(hooks_->mutex);
    hooks_->completion.erase(hook_id);
  }
  bool supportsAbortHooks() const override { return true; }
  void registerAbortHook(int64_t hook_id, c10d::AbortHook hook) override {
    std::lock_guard<std::mutex> lock(hooks_->mutex);
    hooks_->abort[hook_id] = std::move(hook);
  }
  void unregisterAbortHook(int64_t hook_id) override {
    std::lock_guard<std::mutex> lock(hooks_->mutex);
    hooks_->abort.erase(hook_id);
  }
#endif

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(opts, wait_all_ranks);
  }

  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }

 private:
  static std::vector<std::pair<at::Tensor, at::Tensor>> pairs(const std::vector<at::Tensor>& device,
                                                              const std::vector<at::Tensor>& host) {
    std::vector<std::pair<at::Tensor, at::Tensor>> out;
    for (size_t i = 0; i < device.size(); ++i) out.emplace_back(device[i], host[i]);
    return out;
  }

  WorkPtr staged(WorkPtr inner, std::vector<std::pair<at::Tensor, at::Tensor>> back, c10d::OpType type,
                 std::vector<at::Tensor> keep_alive = {}) {
    auto work = c10::make_intrusive<StagedWork>(std::move(inner), std::move(back), type, std::move(keep_alive), getRank(),
                                                hooks_);
#ifdef C10D_BACKEND_HAS_HOOKS
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {  // Gloo's sends and receives have no future ("Work::getFuture not implemented"): pushed at wait()
      if (work->inner()) future = work->inner()->getFuture();
    } catch (const c10::Error&) {
    }
    if (future) {  // completion pushed as soon as Gloo's call is done, waited or not
      c10::weak_intrusive_ptr<StagedWork> weak(work);
      future->addCallback([weak](c10::ivalue::Future& done) {
        if (auto w = weak.lock()) done.hasError() ? w->failed() : w->succeeded();
      });
    }
#endif
    return work;
  }

  void check_reduce_op(const c10d::ReduceOp& op, const char* collective) const {
    TORCH_CHECK(op.op_ != c10d::ReduceOp::AVG,
                "testccl (portspeed test-device CCL) does not support ReduceOp.AVG in ", collective,
                "; reduce with SUM and divide (portspeed's router does this when the adapter declares the gap)");
    TORCH_CHECK(op.op_ != c10d::ReduceOp::PREMUL_SUM,
                "testccl (portspeed test-device CCL) does not support ReduceOp.PREMUL_SUM in ", collective,
                "; scale, then reduce with SUM");
  }

  void check_reduce_scatter_dtype(const std::vector<at::Tensor>& outputs, const char* collective) const {
    for (const auto& t : outputs) {
      TORCH_CHECK(t.scalar_type() != at::kBFloat16, "testccl (portspeed test-device CCL) does not support bfloat16 in ",
                  collective, "; reduce in float32 (portspeed's router upcasts when the adapter declares the gap)");
    }
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<Hooks> hooks_ = std::make_shared<Hooks>();
};

// The bare variant's CCL (PORTSPEED_TESTDEV_BARE=stub-ccl): what OpenReg's OCCL does on torch 2.13. Every call
// returns at once having moved no data: an all_reduce hands its input back, a broadcast changes nothing, a gather
// or scatter leaves zeros in its outputs, a receive leaves its buffer as it was. It raises nothing, so only a
// value-for-value check finds it.
class StubCCL final : public c10d::Backend {
 public:
  StubCCL(int rank, int size) : c10d::Backend(rank, size) {}

  const std::string getBackendName() const override { return "testccl"; }

  WorkPtr broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override { return done(); }
  WorkPtr allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override { return done(); }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>&, const c10d::AllreduceCoalescedOptions&) override {
    return done();
  }
  WorkPtr reduce(std::vector<at::Tensor>&, const c10d::ReduceOptions&) override { return done(); }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>&,
                    const c10d::AllgatherOptions&) override {
    for (auto& list : outputs) zero(list);
    return done();
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor&, const c10d::AllgatherOptions&) override {
    return zero_one(output);
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>&,
                                          const c10d::AllgatherOptions&) override {
    zero(outputs);
    return done();
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>&,
                 const c10d::GatherOptions&) override {
    for (auto& list : outputs) zero(list);
    return done();
  }
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>&,
                  const c10d::ScatterOptions&) override {
    zero(outputs);
    return done();
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>&,
                         const c10d::ReduceScatterOptions&) override {
    zero(outputs);
    return done();
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor&, const c10d::ReduceScatterOptions&) override {
    return zero_one(output);
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>&,
                                          const c10d::ReduceScatterOptions&) override {
    zero(outputs);
    return done();
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                        const c10d::AllToAllOptions&) override {
    return zero_one(output);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>&, const c10d::AllToAllOptions&) override {
    zero(outputs);
    return done();
  }
  WorkPtr send(std::vector<at::Tensor>&, int, int) override { return done(); }
  WorkPtr recv(std::vector<at::Tensor>&, int, int) override { return done(); }
  WorkPtr recvAnysource(std::vector<at::Tensor>&, int) override { return done(); }
  WorkPtr barrier(const c10d::BarrierOptions&) override { return done(); }

 private:
  WorkPtr done() {
    return c10::make_intrusive<StagedWork>(WorkPtr(), std::vector<std::pair<at::Tensor, at::Tensor>>{},
                                           c10d::OpType::UNKNOWN, std::vector<at::Tensor>{}, getRank(), nullptr);
  }
  static void zero(std::vector<at::Tensor>& ts) {
    at::NoGradGuard no_grad;
    for (auto& t : ts) t.zero_();
  }
  WorkPtr zero_one(at::Tensor& t) {
    at::NoGradGuard no_grad;
    t.zero_();
    return done();
  }
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> create_backend(py::object gloo, int rank, int size) {
  auto* raw = gloo.cast<c10d::Backend*>();
  TORCH_CHECK(raw != nullptr, "testccl needs a Gloo backend object to stage through");
  if (bare("stub-ccl")) return c10::make_intrusive<StubCCL>(rank, size);
  auto held = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(raw);
  return c10::make_intrusive<TestCCL>(std::move(held), rank, size);
}

}  // namespace testdev
