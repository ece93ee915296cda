#include "dew/training/distributed.h"

#include <chrono>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <exception>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
// ProcessGroupGloo.hpp includes Gloo's own headers, which the torch wheel does not ship (its libtorch_cpu has
// Gloo compiled in): CMake defines DEW_WITH_GLOO when it finds them (Debian's libgloo-dev; docs/distributed.md).
#if defined(USE_C10D_GLOO) && defined(DEW_WITH_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "dew/core/log.h"

namespace dew::training {

namespace {

// An integer environment variable in [lo, hi], or `fallback` when unset; dew::Error naming it otherwise.
int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  DEW_CHECK(end && *end == '\0', "environment: ", name, "=\"", v, "\" is not an integer; accepted: ", lo, "..", hi);
  DEW_CHECK(x >= lo && x <= hi, "environment: ", name, "=", x, " is out of range; accepted: ", lo, "..", hi);
  return x;
}

std::string env_str(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// The cause of a c10d / Gloo exception in one line: its first line, without Gloo's advice that follows.
std::string first_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  if (auto advice = line.find(". This is typically"); advice != std::string::npos) line = line.substr(0, advice);
  return line;
}

bool is_loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0; }

std::chrono::milliseconds millis(double seconds) { return std::chrono::milliseconds(int64_t(seconds * 1000.0)); }

}  // namespace

DistEnv read_dist_env() {
  DistEnv e;
  e.present = std::getenv("WORLD_SIZE") && *std::getenv("WORLD_SIZE");
  if (!e.present) return e;
  e.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  DEW_CHECK(std::getenv("RANK") && *std::getenv("RANK"), "environment: WORLD_SIZE=", e.world_size,
            " is set but RANK is not; accepted: RANK in 0..", e.world_size - 1, " (torchrun and dew launch set both)");
  e.rank = env_int("RANK", 0, 0, e.world_size - 1);
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", e.world_size, 1, e.world_size);
  e.local_rank = env_int("LOCAL_RANK", e.rank % e.local_world_size, 0, e.local_world_size - 1);
  e.master_addr = env_str("MASTER_ADDR", "127.0.0.1");
  e.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  e.agent_store = env_str("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
  e.restart = env_int("TORCHELASTIC_RESTART_COUNT", 0, 0, INT64_MAX);
  return e;
}

void validate(const DistOptions& o) {
  DEW_CHECK(o.backend == "auto" || o.backend == "gloo" || o.backend == "nccl", "dist.backend: got \"", o.backend,
            "\"; accepted: auto, gloo, nccl");
  DEW_CHECK(o.timeout > 0, "dist.timeout: must be > 0 seconds, got ", o.timeout);
  DEW_CHECK(o.bucket_mb > 0, "dist.bucket_mb: must be > 0, got ", o.bucket_mb);
  DEW_CHECK(o.overlap == "auto" || o.overlap == "on" || o.overlap == "off", "dist.overlap: got \"", o.overlap,
            "\"; accepted: auto, on, off");
}

void check_global_batch(int64_t batch_size, int64_t world_size) {
  DEW_CHECK(batch_size % world_size == 0, "data-parallel: the global batch size ", batch_size,
            " is not divisible by the world size ", world_size, "; pick a batch size that is a multiple of ",
            world_size, " (each rank computes an equal share)");
}

struct Distributed::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> pg;
  c10::Device device{c10::kCPU};
  double timeout = 300;
  int64_t bucket_bytes = 25 << 20;
  bool overlap = true;
  std::shared_ptr<Overlap> ov;  // built at the first arm_overlap (its hooks see it through weak pointers)
};

// The reducer of dist.overlap. The parameters' hooks run on the backward's thread; they hold this by a weak
// pointer (it holds the parameters, and they their hooks), so a hook of a parameter that outlives the group
// does nothing.
struct Distributed::Overlap {
  struct Bucket {
    std::vector<size_t> members;  // indices into params
    at::Tensor flat;
    int64_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };
  c10::intrusive_ptr<c10d::Backend> pg;
  std::vector<at::Tensor> params;
  std::vector<size_t> bucket_of;
  std::vector<int64_t> offset_of;  // where each parameter's gradient sits in its bucket
  std::vector<bool> filled;
  std::vector<Bucket> buckets;
  size_t next = 0;  // the next bucket to start: they start in order, the same on every rank
  std::chrono::steady_clock::time_point first_start;
  bool armed = false;
  bool late = false;  // a gradient arrived for a bucket already started (a parameter fed twice)

  at::Tensor slot(size_t i) {
    return buckets[bucket_of[i]].flat.narrow(0, offset_of[i], params[i].numel()).view(params[i].sizes());
  }
  void start_ready() {
    for (; next < buckets.size() && buckets[next].pending == 0; ++next) {
      if (next == 0) first_start = std::chrono::steady_clock::now();
      std::vector<at::Tensor> v{buckets[next].flat};
      c10d::AllreduceOptions ao;
      ao.reduceOp = c10d::ReduceOp::SUM;
      buckets[next].work = pg->allreduce(v, ao);
    }
  }
  void on_grad(size_t i, const at::Tensor& g) {
    if (!armed) return;
    at::NoGradGuard ng;
    Bucket& b = buckets[bucket_of[i]];
    if (filled[i]) {
      if (b.work) late = true;
      else slot(i).add_(g);
      return;
    }
    filled[i] = true;
    const at::Tensor& before = params[i].grad();  // earlier micro-batches' sum; the engine adds g after us
    at::Tensor here = slot(i);
    if (before.defined()) at::add_out(here, before, g);
    else here.copy_(g);
    if (--b.pending == 0) start_ready();
  }
};

Distributed::Distributed(const DistEnv& env, const DistOptions& o, const c10::Device& device)
    : impl_(std::make_unique<Impl>()), rank_(env.rank), world_(env.world_size) {
  validate(o);
  // A peer that dies closes its sockets: writing to them must raise (Gloo turns it into an exception, one line
  // below) rather than end this process silently by SIGPIPE, as Python's default SIG_IGN also ensures.
  std::signal(SIGPIPE, SIG_IGN);
  impl_->device = device;
  impl_->timeout = o.timeout;
  impl_->bucket_bytes = std::max<int64_t>(1, int64_t(o.bucket_mb * 1024 * 1024));
  backend_ = o.backend == "auto" ? (device.is_cuda() ? "nccl" : "gloo") : o.backend;
  impl_->overlap = o.overlap == "on" || (o.overlap == "auto" && backend_ == "nccl");
  DEW_CHECK(backend_ != "nccl" || device.is_cuda(), "dist.backend: nccl runs on CUDA devices, this run's device is ",
            device.str(), "; accepted on the CPU: gloo, auto");
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const std::string me = "rank " + std::to_string(rank_) + " of " + std::to_string(world_);

  c10d::TCPStoreOptions so;
  so.port = uint16_t(env.master_port);
  so.isServer = rank_ == 0 && !env.agent_store;
  so.numWorkers = size_t(world_);
  so.waitWorkers = false;  // the checks below and the process group's own rendezvous wait, with messages
  so.timeout = millis(o.timeout);
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    if (so.isServer)
      fail("distributed: rank 0 cannot serve the rendezvous at ", where,
           " (the port is in use, or the address is not this host's): pick another MASTER_PORT / --master-port");
    fail("distributed: ", me, " found no rendezvous at ", where, " within dist.timeout ", o.timeout,
         " s (is rank 0 running, with the same MASTER_ADDR and MASTER_PORT?)");
  }
  auto& store = *impl_->store;
  const std::string round = "dew/" + std::to_string(env.restart) + "/";
  try {
    // A rank started twice: the second process to claim it stops here (the first waits for a missing rank).
    const int64_t claims = store.add(round + "rank/" + std::to_string(rank_), 1);
    DEW_CHECK(claims == 1, "distributed: RANK ", rank_, " was started twice (WORLD_SIZE ", world_,
              "); each process needs its own RANK");
    if (rank_ == 0) store.set(round + "world_size", std::to_string(world_));
    const auto bytes = store.get(round + "world_size");  // waits up to the timeout for rank 0
    const int64_t w0 = std::stoll(std::string(bytes.begin(), bytes.end()));
    DEW_CHECK(w0 == world_, "distributed: ", me, " has WORLD_SIZE ", world_, ", rank 0 has ", w0,
              "; every rank needs the same WORLD_SIZE");
  } catch (const dew::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("distributed: ", me, ": rendezvous at ", where, " failed within dist.timeout ", o.timeout,
         " s (rank 0 gone or never started)");
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(round + "pg", impl_->store);
  try {
    if (backend_ == "gloo") {
#if defined(USE_C10D_GLOO) && defined(DEW_WITH_GLOO)
      auto go = c10d::ProcessGroupGloo::Options::create(millis(o.timeout));
      // Tests and single-node runs stay on loopback; across nodes Gloo binds the address of this host's name
      // (or the interface GLOO_SOCKET_IFNAME names).
      if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
        go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      else if (is_loopback(env.master_addr))
        go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      else go->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      go->threads = 2;
      impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, int(rank_), int(world_), go);
#else
      fail("dist.backend: gloo: this dew was built without Gloo's headers (the torch wheel ships none); rebuild ",
           "with Gloo's headers (apt install libgloo-dev, or -DDEW_GLOO_INCLUDE_DIR=DIR; docs/distributed.md), or "
           "train on CUDA with nccl");
#endif
    } else {
#ifdef USE_C10D_NCCL
      auto no = c10d::ProcessGroupNCCL::Options::create();
      no->timeout = millis(o.timeout);
      impl_->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, int(rank_), int(world_), no);
#else
      fail("dist.backend: nccl: this dew's LibTorch has no NCCL (built without USE_C10D_NCCL); accepted: gloo");
#endif
    }
  } catch (const dew::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("distributed: ", me, ": the ", backend_, " process group did not form within dist.timeout ", o.timeout,
         " s: ", first_line(e.what()));
  }
  if (rank_ == 0) log::info("distributed: ", world_, " ranks formed (", backend_, ", rendezvous ", where, ")");
}

Distributed::~Distributed() {
  // NCCL wants its communicators shut down before the group goes (Gloo's shutdown does nothing). Not while an
  // error unwinds: a collective with a dead peer may be what failed, and the process ends anyway.
  if (!impl_ || !impl_->pg || std::uncaught_exceptions() > 0) return;
  try {
    impl_->pg->shutdown();
  } catch (const std::exception&) {
    // ending anyway: a peer may already be gone
  }
}

namespace {

// Waits for a collective; any failure (a rank exited, hung past the timeout, or raised) becomes one line.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t rank, int64_t world,
              double timeout) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    const std::string cause = first_line(e.what());
    fail("distributed: rank ", rank, " of ", world, ": ", what, " failed (another rank exited, raised, or hung past ",
         "dist.timeout ", timeout, " s): ", cause);
  }
}

}  // namespace

void Distributed::broadcast_module(torch::nn::Module& m) {
  const auto t0 = std::chrono::steady_clock::now();
  at::NoGradGuard ng;
  std::vector<at::Tensor> all;
  for (const auto& kv : m.named_parameters()) all.push_back(kv.value());
  for (const auto& kv : m.named_buffers()) all.push_back(kv.value());
  for (auto& t : all) {
    at::Tensor wire = t.detach().is_contiguous() ? t.detach() : t.detach().contiguous();
    std::vector<at::Tensor> v{wire};
    c10d::BroadcastOptions bo;
    bo.rootRank = 0;
    try {
      wait_for(impl_->pg->broadcast(v, bo), "broadcast of the model", rank_, world_, impl_->timeout);
    } catch (const dew::Error&) {
      throw;
    } catch (const std::exception& e) {
      fail("distributed: rank ", rank_, " of ", world_, ": broadcast of the model failed: ", e.what());
    }
    if (!wire.is_same(t)) t.detach().copy_(wire);
  }
  collective_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Distributed::arm_overlap(const NamedTensors& params) {
  if (!impl_->overlap) return;
  auto& ov = impl_->ov;
  if (!ov) {
    ov = std::make_shared<Overlap>();
    ov->pg = impl_->pg;
    for (const auto& kv : params) ov->params.push_back(kv.second);
    ov->bucket_of.resize(params.size());
    ov->offset_of.resize(params.size());
    // The parameters in reverse (backward reaches the last layers first); the first bucket at most 1 MB, so
    // its all-reduce starts early, the others up to dist.bucket_mb; one dtype and device per bucket.
    int64_t bytes = 0, cap = std::min<int64_t>(impl_->bucket_bytes, 1 << 20);
    for (size_t i = params.size(); i-- > 0;) {
      const at::Tensor& p = ov->params[i];
      const int64_t b = p.numel() * int64_t(p.element_size());
      const bool fits = !ov->buckets.empty() && bytes + b <= cap &&
                        ov->buckets.back().flat.scalar_type() == p.scalar_type() &&
                        ov->buckets.back().flat.device() == p.device();
      if (!fits) {
        if (!ov->buckets.empty()) cap = impl_->bucket_bytes;
        ov->buckets.emplace_back();
        ov->buckets.back().flat = at::empty({0}, p.options());
        bytes = 0;
      }
      auto& bucket = ov->buckets.back();
      ov->offset_of[i] = bytes / int64_t(p.element_size());
      bucket.members.push_back(i);
      ov->bucket_of[i] = ov->buckets.size() - 1;
      bytes += b;
    }
    for (auto& bucket : ov->buckets) {
      int64_t n = 0;
      for (size_t i : bucket.members) n += ov->params[i].numel();
      bucket.flat = at::empty({n}, bucket.flat.options());
    }
    for (size_t i = 0; i < params.size(); ++i) {
      std::weak_ptr<Overlap> held = ov;  // not shared: the reducer holds the parameters, which hold their hooks
      ov->params[i].register_hook([held, i](const at::Tensor& g) {
        if (auto reducer = held.lock()) reducer->on_grad(i, g);
      });
    }
  }
  DEW_CHECK(ov->params.size() == params.size(), "distributed: arm_overlap: ", params.size(),
            " parameters, the reducer was built for ", ov->params.size());
  ov->filled.assign(params.size(), false);
  for (auto& bucket : ov->buckets) {
    bucket.pending = int64_t(bucket.members.size());
    bucket.work.reset();
  }
  ov->next = 0;
  ov->late = false;
  ov->armed = true;
}

void Distributed::finish_overlap(const NamedTensors& params) {
  const auto t0 = std::chrono::steady_clock::now();
  Overlap& ov = *impl_->ov;
  ov.armed = false;
  overlapped_ = double(ov.next) / double(std::max<size_t>(1, ov.buckets.size()));
  at::NoGradGuard ng;
  // Parameters backward did not reach (unused this step) contribute what they hold; then every bucket starts.
  for (size_t i = 0; i < ov.params.size(); ++i) {
    if (ov.filled[i]) continue;
    const at::Tensor& g = ov.params[i].grad();
    if (g.defined()) ov.slot(i).copy_(g);
    else ov.slot(i).zero_();
    --ov.buckets[ov.bucket_of[i]].pending;
  }
  ov.start_ready();
  for (auto& bucket : ov.buckets) wait_for(bucket.work, "gradient all-reduce", rank_, world_, impl_->timeout);
  const auto t1 = std::chrono::steady_clock::now();
  collective_s_ += std::chrono::duration<double>(t1 - t0).count();
  inflight_s_ = std::chrono::duration<double>(t1 - ov.first_start).count();
  if (ov.late) {
    // Every rank sees the same graph, so every rank lands here: reduce the finished gradients again, whole.
    static bool warned = false;
    if (!warned && rank_ == 0)
      log::warn("distributed: a parameter received two gradients in one backward after its bucket's all-reduce ",
                "started; those steps all-reduce after backward (set dist.overlap false to always do so)");
    warned = true;
    return average_gradients(params);  // disarmed: the whole-backward path
  }
  for (auto& bucket : ov.buckets) bucket.flat.div_(double(world_));
  for (size_t i = 0; i < ov.params.size(); ++i) {
    at::Tensor& g = ov.params[i].mutable_grad();
    if (!g.defined()) g = at::zeros_like(ov.params[i]);
    g.copy_(ov.slot(i));
  }
}

void Distributed::average_gradients(const NamedTensors& params) {
  if (impl_->ov && impl_->ov->armed) return finish_overlap(params);
  const auto t0 = std::chrono::steady_clock::now();
  at::NoGradGuard ng;
  // Buckets of consecutive parameters sharing dtype and device, up to bucket_bytes each (one at least).
  std::vector<std::vector<at::Tensor>> buckets;
  int64_t bytes = 0;
  for (const auto& [name, p] : params) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) g = at::zeros_like(p);
    const int64_t b = g.numel() * int64_t(g.element_size());
    const bool fits = !buckets.empty() && bytes + b <= impl_->bucket_bytes &&
                      buckets.back().front().scalar_type() == g.scalar_type() &&
                      buckets.back().front().device() == g.device();
    if (!fits) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(g);
    bytes += b;
  }
  for (auto& bucket : buckets) {
    std::vector<at::Tensor> flat_parts;
    flat_parts.reserve(bucket.size());
    for (auto& g : bucket) flat_parts.push_back(g.reshape({-1}));
    std::vector<at::Tensor> v{at::cat(flat_parts)};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::SUM;
    wait_for(impl_->pg->allreduce(v, ao), "gradient all-reduce", rank_, world_, impl_->timeout);
    v[0].div_(double(world_));
    int64_t at = 0;
    for (auto& g : bucket) {
      g.copy_(v[0].narrow(0, at, g.numel()).view(g.sizes()));
      at += g.numel();
    }
  }
  collective_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<double> Distributed::sum(const std::vector<double>& values) {
  if (values.empty()) return values;
  const auto t0 = std::chrono::steady_clock::now();
  auto cpu = at::tensor(values, at::TensorOptions().dtype(at::kDouble));
  std::vector<at::Tensor> v{cpu.to(impl_->device)};
  c10d::AllreduceOptions ao;
  ao.reduceOp = c10d::ReduceOp::SUM;
  wait_for(impl_->pg->allreduce(v, ao), "all-reduce of the step's loss and flags", rank_, world_, impl_->timeout);
  auto back = v[0].to(at::kCPU).contiguous();
  std::vector<double> out(back.data_ptr<double>(), back.data_ptr<double>() + back.numel());
  collective_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

bool Distributed::any(bool flag) { return sum({flag ? 1.0 : 0.0})[0] > 0; }

void Distributed::barrier() {
  const auto t0 = std::chrono::steady_clock::now();
  wait_for(impl_->pg->barrier(), "barrier", rank_, world_, impl_->timeout);
  collective_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dew::training
