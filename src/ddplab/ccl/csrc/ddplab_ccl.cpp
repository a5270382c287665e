// ddplab's c10d backend "ccl" over the oneCCL C++ API (CPU tensors).
//
// Why it exists: Intel's oneccl_bindings_for_pytorch stop at torch 2.7/2.8; this backend is
// built against the installed torch by `make setup-ccl` (python -m ddplab.ccl.build), over the
// oneCCL runtime and headers that PyPI ships. PyTorch tutorial "Customize Process Group
// Backends Using Cpp Extensions" describes the registration this follows.
//
// Shape: the caller's thread starts each oneCCL operation (so every rank issues them in the
// order its program calls them, as oneCCL requires) and returns a Work at once; one completion
// thread per group waits on the oneCCL events in that same order, runs what must follow (AVG's
// division, copies out of flat buffers) and completes the Work and its Future. DDP's reducer
// therefore overlaps the gradient all-reduce with the backward pass, as with gloo.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <pybind11/chrono.h>

#include <oneapi/ccl.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ddplab_ccl {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;

// ---- types ----

ccl::datatype to_ccl(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return ccl::datatype::float32;
    case at::kDouble: return ccl::datatype::float64;
    case at::kHalf: return ccl::datatype::float16;
    case at::kBFloat16: return ccl::datatype::bfloat16;
    case at::kInt: return ccl::datatype::int32;
    case at::kLong: return ccl::datatype::int64;
    case at::kShort: return ccl::datatype::int16;
    case at::kChar: return ccl::datatype::int8;
    case at::kByte: return ccl::datatype::uint8;
    case at::kBool: return ccl::datatype::uint8;  // moved as bytes; reductions refuse it below
    default:
      TORCH_CHECK(false, "ccl (ddplab): ", op, " does not support dtype ", c10::toString(t),
                  "; supported: float32, float64, float16, bfloat16, int64, int32, int16, int8, "
                  "uint8, bool (bool only where nothing is reduced)");
  }
}

// oneCCL 2022 has sum, prod, min, max; AVG is a SUM divided afterwards (floating types).
ccl::reduction to_ccl(const c10d::ReduceOp& op, at::ScalarType t, const char* name) {
  TORCH_CHECK(t != at::kBool, "ccl (ddplab): ", name, " cannot reduce bool tensors");
  switch (op) {
    case c10d::ReduceOp::SUM: return ccl::reduction::sum;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(at::isFloatingType(t), "ccl (ddplab): ", name,
                  " with ReduceOp.AVG needs a floating dtype, got ", c10::toString(t));
      return ccl::reduction::sum;
    case c10d::ReduceOp::PRODUCT: return ccl::reduction::prod;
    case c10d::ReduceOp::MIN: return ccl::reduction::min;
    case c10d::ReduceOp::MAX: return ccl::reduction::max;
    default:
      TORCH_CHECK(false, "ccl (ddplab): ", name,
                  " supports ReduceOp SUM, AVG, PRODUCT, MIN, MAX; got another op");
  }
}

void check_cpu(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "ccl (ddplab): ", op,
              " takes CPU tensors (use nccl for CUDA), got a tensor on ", t.device());
  TORCH_CHECK(!t.is_sparse(), "ccl (ddplab): ", op, " does not support sparse tensors");
}

void check_one(const Tensors& ts, const char* op) {
  TORCH_CHECK(ts.size() == 1, "ccl (ddplab): ", op, " takes exactly one tensor per rank, got ",
              ts.size());
  check_cpu(ts[0], op);
}

at::Tensor flat_cat(const Tensors& ts) {
  std::vector<at::Tensor> flat;
  flat.reserve(ts.size());
  for (const auto& t : ts) flat.push_back(t.reshape(-1));
  return at::cat(flat).contiguous();
}

void copy_out(const at::Tensor& flat, Tensors& outs) {
  int64_t off = 0;
  for (auto& o : outs) {
    o.copy_(flat.narrow(0, off, o.numel()).view(o.sizes()));
    off += o.numel();
  }
}

// ---- Work ----

class CclWork : public c10d::Work {
 public:
  CclWork(int rank, OpType op, const char* title, const Tensors& inputs, Tensors outputs,
          std::chrono::milliseconds timeout)
      : c10d::Work(rank, op, title, std::optional<Tensors>(inputs)),
        outputs_(std::move(outputs)),
        timeout_(timeout),
        future_(c10::make_intrusive<at::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  // Without a timeout of its own, a wait uses the group's (dist.timeout_s): a dead peer then
  // ends the job with an error instead of hanging it.
  bool wait(std::chrono::milliseconds timeout) override {
    auto limit = timeout == kNoTimeout ? timeout_ : timeout;
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, limit, [&] { return completed_; })) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str("ccl (ddplab): ", c10d::opTypeToString(opType_),
                               " did not complete within ", limit.count(),
                               " ms (a rank died or never called it)"));
    }
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  Tensors result() override { return outputs_; }

  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 private:
  Tensors outputs_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// ---- the completion thread ----

struct Pending {
  c10::intrusive_ptr<CclWork> work;
  ccl::event event;
  std::function<void()> after;  // runs once the event is done (copies out, AVG's division)
  Tensors keep;  // every buffer oneCCL reads or writes, alive until it is done with them
};

// Shared with the thread, so a backend destroyed while a collective is stuck (a dead peer)
// can leave the thread behind without it touching freed memory.
struct Queue {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Pending> items;
  bool stop = false;
};

// ccl::event::wait() spins. This thread must not take a core from the compute threads while
// DDP overlaps communication with backward (oneCCL's own worker already spins for the
// operation), so it polls with a backoff that sleeps, at most 1 ms late.
void await_event(ccl::event& ev) {
  auto pause = std::chrono::microseconds(10);
  for (int polls = 0; !ev.test(); ++polls) {
    if (polls < 64) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  ev.wait();  // done already: returns at once and lets oneCCL release the operation
}

void drain(std::shared_ptr<Queue> q) {
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lock(q->mutex);
      q->cv.wait(lock, [&] { return q->stop || !q->items.empty(); });
      if (q->items.empty()) return;
      p = std::move(q->items.front());
      q->items.pop_front();
    }
    std::exception_ptr error;
    try {
      await_event(p.event);
      if (p.after) p.after();
    } catch (...) {
      error = std::current_exception();
    }
    p.work->complete(error);
  }
}

// ---- the backend ----

class CclBackend : public c10d::Backend {
 public:
  CclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), timeout_(timeout), queue_(std::make_shared<Queue>()) {
    ccl::init();
    comm_ = std::make_unique<ccl::communicator>(connect(store, rank, size, timeout));
    thread_ = std::thread(drain, queue_);
  }

  ~CclBackend() override {
    {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      queue_->stop = true;
    }
    queue_->cv.notify_all();
    // A collective stuck on a dead peer never ends: then leave its thread behind rather than
    // hang the process at exit.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(queue_->mutex);
        if (queue_->items.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    bool idle;
    {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      idle = queue_->items.empty();
    }
    if (idle && thread_.joinable()) {
      thread_.join();
    } else if (thread_.joinable()) {
      comm_.release();  // the stuck thread may still use it
      thread_.detach();
    }
  }

  const std::string getBackendName() const override { return "ccl"; }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    check_one(tensors, "broadcast");
    auto buf = tensors[0].contiguous();
    auto out = tensors[0];
    auto ev = ccl::broadcast(buf.data_ptr(), buf.numel(), to_ccl(buf.scalar_type(), "broadcast"),
                             static_cast<int>(opts.rootRank), *comm_);
    return enqueue(OpType::BROADCAST, "ccl:broadcast", tensors, tensors, std::move(ev),
                   copy_back(buf, out), {buf});
  }

  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    check_one(tensors, "all_reduce");
    auto buf = tensors[0].contiguous();
    auto out = tensors[0];
    auto ev = ccl::allreduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                             to_ccl(buf.scalar_type(), "all_reduce"),
                             to_ccl(opts.reduceOp, buf.scalar_type(), "all_reduce"), *comm_);
    return enqueue(OpType::ALLREDUCE, "ccl:all_reduce", tensors, tensors, std::move(ev),
                   then_avg(opts.reduceOp, buf, copy_back(buf, out)), {buf});
  }

  // DDP may coalesce several gradients into one call: one flat buffer, one all-reduce.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    TORCH_CHECK(!tensors.empty(), "ccl (ddplab): allreduce_coalesced got no tensors");
    for (const auto& t : tensors) {
      check_cpu(t, "allreduce_coalesced");
      TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                  "ccl (ddplab): allreduce_coalesced needs one dtype for all tensors");
    }
    auto flat = flat_cat(tensors);
    auto ev = ccl::allreduce(flat.data_ptr(), flat.data_ptr(), flat.numel(),
                             to_ccl(flat.scalar_type(), "allreduce_coalesced"),
                             to_ccl(opts.reduceOp, flat.scalar_type(), "allreduce_coalesced"),
                             *comm_);
    Tensors outs = tensors;
    return enqueue(OpType::ALLREDUCE_COALESCED, "ccl:allreduce_coalesced", tensors, tensors,
                   std::move(ev), then_avg(opts.reduceOp, flat, [flat, outs]() mutable {
                     copy_out(flat, outs);
                   }), {flat});
  }

  c10::intrusive_ptr<c10d::Work> reduce(Tensors& tensors,
                                        const c10d::ReduceOptions& opts) override {
    check_one(tensors, "reduce");
    auto buf = tensors[0].contiguous();
    auto out = tensors[0];
    auto ev = ccl::reduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                          to_ccl(buf.scalar_type(), "reduce"),
                          to_ccl(opts.reduceOp, buf.scalar_type(), "reduce"),
                          static_cast<int>(opts.rootRank), *comm_);
    // Only the root's result is defined (as in torch's docs); AVG divides it there.
    bool root = static_cast<int>(opts.rootRank) == rank_;
    auto after = copy_back(buf, out);
    if (root) after = then_avg(opts.reduceOp, buf, after);
    return enqueue(OpType::REDUCE, "ccl:reduce", tensors, tensors, std::move(ev), after, {buf});
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                           const c10d::AllgatherOptions& /*opts*/) override {
    check_one(inputs, "all_gather");
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                "ccl (ddplab): all_gather needs one output list of world-size tensors");
    auto in = inputs[0].contiguous();
    std::vector<size_t> counts;
    for (const auto& o : outputs[0]) {
      check_cpu(o, "all_gather");
      TORCH_CHECK(o.scalar_type() == in.scalar_type(), "ccl (ddplab): all_gather dtypes differ");
      counts.push_back(static_cast<size_t>(o.numel()));
    }
    TORCH_CHECK(static_cast<int64_t>(counts[rank_]) == in.numel(),
                "ccl (ddplab): all_gather output ", rank_, " holds ", counts[rank_],
                " elements, the input ", in.numel());
    int64_t total = 0;
    for (auto c : counts) total += static_cast<int64_t>(c);
    auto flat = at::empty({total}, in.options());
    auto ev = ccl::allgatherv(in.data_ptr(), in.numel(), flat.data_ptr(), counts,
                              to_ccl(in.scalar_type(), "all_gather"), *comm_);
    Tensors outs = outputs[0];
    return enqueue(OpType::ALLGATHER, "ccl:all_gather", inputs, outs, std::move(ev),
                   [flat, outs]() mutable { copy_out(flat, outs); }, {in, flat});
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    check_cpu(input, "all_gather_into_tensor");
    check_cpu(output, "all_gather_into_tensor");
    TORCH_CHECK(output.numel() == input.numel() * size_,
                "ccl (ddplab): all_gather_into_tensor needs an output of world size x the input");
    auto in = input.contiguous();
    auto buf = output.contiguous();
    std::vector<size_t> counts(size_, static_cast<size_t>(in.numel()));
    auto ev = ccl::allgatherv(in.data_ptr(), in.numel(), buf.data_ptr(), counts,
                              to_ccl(in.scalar_type(), "all_gather_into_tensor"), *comm_);
    Tensors ins{input}, outs{output};
    return enqueue(OpType::_ALLGATHER_BASE, "ccl:all_gather_into_tensor", ins, outs,
                   std::move(ev), copy_back(buf, output), {in, buf});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<Tensors>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    check_one(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                "ccl (ddplab): reduce_scatter needs one input list of world-size tensors");
    for (const auto& t : inputs[0]) {
      TORCH_CHECK(t.numel() == outputs[0].numel() && t.scalar_type() == outputs[0].scalar_type(),
                  "ccl (ddplab): reduce_scatter needs inputs shaped like the output");
    }
    return scatter_reduced(flat_cat(inputs[0]), outputs[0], opts, OpType::REDUCE_SCATTER,
                           "ccl:reduce_scatter");
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    check_cpu(input, "reduce_scatter_tensor");
    TORCH_CHECK(input.numel() == output.numel() * size_,
                "ccl (ddplab): reduce_scatter_tensor needs an input of world size x the output");
    return scatter_reduced(input.contiguous(), output, opts, OpType::_REDUCE_SCATTER_BASE,
                           "ccl:reduce_scatter_tensor");
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& /*opts*/) override {
    check_cpu(input, "all_to_all_single");
    check_cpu(output, "all_to_all_single");
    auto in = input.contiguous();
    auto buf = output.contiguous();
    auto send = counts_of(in, inputSplits, "input");
    auto recv = counts_of(buf, outputSplits, "output");
    auto ev = ccl::alltoallv(in.data_ptr(), send, buf.data_ptr(), recv,
                             to_ccl(in.scalar_type(), "all_to_all_single"), *comm_);
    Tensors ins{input}, outs{output};
    return enqueue(OpType::ALLTOALL_BASE, "ccl:all_to_all_single", ins, outs, std::move(ev),
                   copy_back(buf, output), {in, buf});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllToAllOptions& /*opts*/) override {
    TORCH_CHECK(static_cast<int>(inputs.size()) == size_ &&
                    static_cast<int>(outputs.size()) == size_,
                "ccl (ddplab): all_to_all needs world-size input and output lists");
    std::vector<size_t> send, recv;
    for (const auto& t : inputs) {
      check_cpu(t, "all_to_all");
      send.push_back(static_cast<size_t>(t.numel()));
    }
    for (const auto& t : outputs) {
      check_cpu(t, "all_to_all");
      recv.push_back(static_cast<size_t>(t.numel()));
    }
    auto in = flat_cat(inputs);
    int64_t total = 0;
    for (auto c : recv) total += static_cast<int64_t>(c);
    auto flat = at::empty({total}, in.options());
    auto ev = ccl::alltoallv(in.data_ptr(), send, flat.data_ptr(), recv,
                             to_ccl(in.scalar_type(), "all_to_all"), *comm_);
    Tensors outs = outputs;
    return enqueue(OpType::ALLTOALL, "ccl:all_to_all", inputs, outs, std::move(ev),
                   [flat, outs]() mutable { copy_out(flat, outs); }, {in, flat});
  }

  // ccl::barrier blocks its caller in a spin loop; a one-element all-reduce is the same
  // synchronisation, asynchronous, so a rank waiting here leaves its cores to others (on a
  // small machine: rank 0's tracking delivery at the end of a job).
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    auto token = at::zeros({1}, at::kFloat);
    auto ev = ccl::allreduce(token.data_ptr(), token.data_ptr(), 1, ccl::datatype::float32,
                             ccl::reduction::sum, *comm_);
    Tensors none;
    return enqueue(OpType::BARRIER, "ccl:barrier", none, none, std::move(ev), nullptr, {token});
  }

  c10::intrusive_ptr<c10d::Work> send(Tensors& tensors, int dst, int /*tag*/) override {
    check_one(tensors, "send");
    auto buf = tensors[0].contiguous();
    auto ev = ccl::send(buf.data_ptr(), buf.numel(), to_ccl(buf.scalar_type(), "send"), dst,
                        *comm_);
    return enqueue(OpType::SEND, "ccl:send", tensors, tensors, std::move(ev), nullptr, {buf});
  }

  c10::intrusive_ptr<c10d::Work> recv(Tensors& tensors, int src, int /*tag*/) override {
    check_one(tensors, "recv");
    auto buf = tensors[0].contiguous();
    auto out = tensors[0];
    auto ev = ccl::recv(buf.data_ptr(), buf.numel(), to_ccl(buf.scalar_type(), "recv"), src,
                        *comm_);
    return enqueue(OpType::RECV, "ccl:recv", tensors, tensors, std::move(ev),
                   copy_back(buf, out), {buf});
  }

  static c10::intrusive_ptr<c10d::Backend> create(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size,
                                                  const std::chrono::duration<float>& timeout) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    return c10::make_intrusive<CclBackend>(store, rank, size, ms);
  }

 private:
  // Rank 0 opens oneCCL's key-value store and publishes its address through the c10d Store
  // that the launcher already set up (torchrun's, or ddplab's env:// one); the others read it
  // there, so no MPI/PMI launcher is needed. The Store handed to a backend is already
  // prefixed per process group, so one key serves every group.
  //
  // oneCCL then makes the communicator in a barrier over its key-value store whose socket reads
  // never time out: a rank that died during set-up (a crash, the OOM killer, its node lost) left
  // every other rank blocked there for ever. So the communicator is made on a thread of its own
  // and waited for up to the group's timeout (dist.timeout_s); past it the rank raises, and the
  // thread stays in its read until the process ends (ddplab's ranks end by _exit).
  static ccl::communicator connect(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                   int size, std::chrono::milliseconds timeout) {
    const std::string key = "ddplab_ccl_kvs_address";
    ccl::shared_ptr_class<ccl::kvs> kvs;
    if (rank == 0) {
      kvs = ccl::create_main_kvs();
      auto addr = kvs->get_address();
      store->set(key, std::vector<uint8_t>(addr.begin(), addr.end()));
    } else {
      auto bytes = store->get(key);  // waits up to the Store's timeout
      ccl::kvs::address_type addr{};
      TORCH_CHECK(bytes.size() == addr.size(), "ccl (ddplab): bad oneCCL kvs address in store");
      std::copy(bytes.begin(), bytes.end(), addr.begin());
      kvs = ccl::create_kvs(addr);
    }
    auto made = std::make_shared<std::promise<ccl::communicator>>();
    auto communicator = made->get_future();
    std::thread([made, size, rank, kvs]() {
      try {
        made->set_value(ccl::create_communicator(size, rank, kvs));
      } catch (...) {
        made->set_exception(std::current_exception());
      }
    }).detach();
    // At most a year: a script's timedelta.max would overflow the clock's arithmetic. The GIL
    // is let go meanwhile, so the process's other Python threads run.
    auto limit = std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365));
    std::future_status status;
    {
      std::optional<pybind11::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil.emplace();
      status = communicator.wait_for(limit);
    }
    if (status != std::future_status::ready) {
      C10_THROW_ERROR(DistNetworkError,
                      "ccl (ddplab): oneCCL's communicator of " + std::to_string(size) +
                          " ranks was not made within " + std::to_string(timeout.count() / 1000) +
                          " s: a rank did not join it (it failed or was stopped during set-up)");
    }
    return communicator.get();
  }

  // Per-peer element counts of all_to_all_single: torch's splits count rows (dim 0); none
  // means equal parts.
  std::vector<size_t> counts_of(const at::Tensor& t, const std::vector<int64_t>& splits,
                                const char* which) const {
    if (splits.empty()) {
      TORCH_CHECK(t.numel() % size_ == 0, "ccl (ddplab): all_to_all_single ", which, " of ",
                  t.numel(), " elements does not split evenly over ", size_, " ranks");
      return std::vector<size_t>(size_, static_cast<size_t>(t.numel() / size_));
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == size_, "ccl (ddplab): all_to_all_single ",
                which, " splits need one entry per rank");
    int64_t row = t.dim() > 0 && t.size(0) > 0 ? t.numel() / t.size(0) : 0;
    std::vector<size_t> counts;
    for (auto s : splits) counts.push_back(static_cast<size_t>(s * row));
    return counts;
  }

  c10::intrusive_ptr<c10d::Work> scatter_reduced(const at::Tensor& flat_in, at::Tensor& output,
                                                 const c10d::ReduceScatterOptions& opts,
                                                 OpType op, const char* title) {
    check_cpu(output, title);
    auto buf = output.contiguous();
    auto ev = ccl::reduce_scatter(flat_in.data_ptr(), buf.data_ptr(), buf.numel(),
                                  to_ccl(buf.scalar_type(), title),
                                  to_ccl(opts.reduceOp, buf.scalar_type(), title), *comm_);
    Tensors ins{flat_in}, outs{output};
    return enqueue(op, title, ins, outs, std::move(ev),
                   then_avg(opts.reduceOp, buf, copy_back(buf, output)), {flat_in, buf});
  }

  // contiguous() may have copied: write the result back into the caller's tensor.
  static std::function<void()> copy_back(const at::Tensor& buf, const at::Tensor& out) {
    if (buf.data_ptr() == out.data_ptr()) return nullptr;
    return [buf, out]() mutable { out.copy_(buf); };
  }

  std::function<void()> then_avg(const c10d::ReduceOp& op, const at::Tensor& buf,
                                 std::function<void()> next) const {
    if (op != c10d::ReduceOp::AVG) return next;
    int world = size_;
    return [buf, world, next]() mutable {
      buf.div_(world);
      if (next) next();
    };
  }

  c10::intrusive_ptr<c10d::Work> enqueue(OpType op, const char* title, const Tensors& inputs,
                                         const Tensors& outputs, ccl::event ev,
                                         std::function<void()> after, Tensors keep) {
    auto work = c10::make_intrusive<CclWork>(rank_, op, title, inputs, outputs, timeout_);
    {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      queue_->items.push_back(Pending{work, std::move(ev), std::move(after), std::move(keep)});
    }
    queue_->cv.notify_one();
    return work;
  }

  std::chrono::milliseconds timeout_;
  std::unique_ptr<ccl::communicator> comm_;
  std::shared_ptr<Queue> queue_;
  std::thread thread_;
};

}  // namespace ddplab_ccl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddplab's c10d backend 'ccl' over oneCCL (CPU)";
  m.def("create_backend", &ddplab_ccl::CclBackend::create,
        "c10d creator: (store, rank, size, timeout) -> Backend", py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"));
  m.def("oneccl_version", []() {
    auto v = ccl::get_library_version();
    return c10::str(v.major, ".", v.minor, ".", v.update);
  });
}
