// The eager CUDA training step of the FTRL TBE launched from C++ (see kernels/cuda/host.py).
//
// The kernels are Triton's, compiled and loaded by Triton (the Python path compiles them on its
// first step of a configuration and registers each compiled variant here: its CUfunction, threads,
// shared memory and how each positional argument is passed). A step then makes its buffers with
// ATen and launches the kernels with cuLaunchKernel on the current stream, without Python.
//
// A variant is keyed by (plan, role, specialisation string): the plan is the Python side's static
// configuration (every constexpr of every kernel), the string the facts Triton specialises each
// positional argument on (a tensor's dtype and 16-byte alignment, an integer's value class), so a
// registered variant is exactly the kernel JITFunction.run would launch with these arguments. A
// step whose variants are not all registered launches nothing and returns "absent"; the Python path
// then runs that step and registers what it launched.
//
// Only c10/ATen headers: the CUDA driver is reached through dlopen, the stream through c10's
// device guard interface, so this file builds on any machine with torch.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using CUresult = int;
using CUfunction = void*;
using CUcontext = void*;
using CUdevice = int;
using LaunchFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, void*, void**, void**);
using CtxGetFn = CUresult (*)(CUcontext*);
using CtxSetFn = CUresult (*)(CUcontext);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using RetainFn = CUresult (*)(CUcontext*, CUdevice);

struct Driver {
  LaunchFn launch = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxSetFn ctx_set = nullptr;
  DeviceGetFn device_get = nullptr;
  RetainFn retain = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib != nullptr, "torchrec_ftrl host path: cannot load libcuda.so.1");
    r.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    r.ctx_get = reinterpret_cast<CtxGetFn>(dlsym(lib, "cuCtxGetCurrent"));
    r.ctx_set = reinterpret_cast<CtxSetFn>(dlsym(lib, "cuCtxSetCurrent"));
    r.device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
    r.retain = reinterpret_cast<RetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    TORCH_CHECK(r.launch && r.ctx_get && r.ctx_set && r.device_get && r.retain,
                "torchrec_ftrl host path: libcuda.so.1 lacks a driver entry point");
    return r;
  }();
  return d;
}

// A thread that has not touched the driver (e.g. a fresh autograd worker) has no current context:
// make the device's primary context current, as Triton's launcher does.
void ensure_context(int device) {
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  TORCH_CHECK(d.ctx_get(&ctx) == 0, "torchrec_ftrl host path: cuCtxGetCurrent failed");
  if (ctx != nullptr) return;
  CUdevice dev = 0;
  TORCH_CHECK(d.device_get(&dev, device) == 0, "torchrec_ftrl host path: cuDeviceGet failed");
  TORCH_CHECK(d.retain(&ctx, dev) == 0, "torchrec_ftrl host path: cuDevicePrimaryCtxRetain failed");
  TORCH_CHECK(d.ctx_set(ctx) == 0, "torchrec_ftrl host path: cuCtxSetCurrent failed");
}

// One positional argument of a kernel launch. kFresh stands for a buffer not yet allocated, by
// its dtype and alignment: enough for the registry lookup, which then runs before any allocation.
struct Arg {
  enum Kind { kTensor, kInt, kFresh } kind;
  at::Tensor tensor;
  int64_t value = 0;
  at::ScalarType dtype = at::kFloat;
  bool aligned = true;
};

Arg T(const at::Tensor& t) { return Arg{Arg::kTensor, t}; }
Arg I(int64_t v) { return Arg{Arg::kInt, at::Tensor(), v}; }
// A buffer the step will allocate: ATen's CUDA allocator returns 512-byte aligned blocks, so a
// fresh tensor (or a view at a multiple of 16 bytes into one) is aligned.
Arg F(at::ScalarType dtype, bool aligned = true) { return Arg{Arg::kFresh, at::Tensor(), 0, dtype, aligned}; }

char dtype_code(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return 'f';
    case at::kHalf: return 'h';
    case at::kBFloat16: return 'b';
    case at::kInt: return 'i';
    case at::kLong: return 'l';
    case at::kByte: return 'u';
    case at::kBool: return 'o';
    default: return '?';
  }
}

// Triton's specialisation facts of the arguments (host.py's signature_of states the same rule).
std::string signature_of(const std::vector<Arg>& args) {
  std::string s;
  s.reserve(args.size() * 2);
  for (const Arg& a : args) {
    if (a.kind == Arg::kTensor) {
      s.push_back(dtype_code(a.tensor.scalar_type()));
      s.push_back(reinterpret_cast<uintptr_t>(a.tensor.data_ptr()) % 16 == 0 ? 'A' : 'U');
    } else if (a.kind == Arg::kFresh) {
      s.push_back(dtype_code(a.dtype));
      s.push_back(a.aligned ? 'A' : 'U');
    } else {
      const int64_t v = a.value;
      const bool i32 = v >= INT32_MIN && v <= INT32_MAX;
      s.push_back(i32 ? 'I' : 'J');
      s.push_back(v == 1 ? '1' : (v % 16 == 0 ? 'D' : 'N'));
    }
  }
  return s;
}

struct Variant {
  uintptr_t function = 0;   // 0: a variant only the Python path launches
  unsigned threads = 0;
  unsigned shared = 0;
  std::string kinds;        // per argument: 'P' pointer, 'i' int32, 'l' int64, 'x' not passed
};

std::mutex registry_mutex;
std::unordered_map<std::string, Variant> registry;

std::string variant_key(int64_t plan, int64_t role, int64_t device, const std::string& sig) {
  return std::to_string(plan) + ":" + std::to_string(role) + ":" + std::to_string(device) + ":" + sig;
}

// 0: found and launchable, 1: absent, 2: registered as Python-only.
int find(int64_t plan, int64_t role, int64_t device, const std::vector<Arg>& args, Variant* out) {
  const std::string key = variant_key(plan, role, device, signature_of(args));
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(key);
  if (it == registry.end()) return 1;
  if (it->second.function == 0) return 2;
  *out = it->second;
  return 0;
}

void launch(const Variant& v, const std::vector<Arg>& args, int64_t grid, void* stream) {
  if (grid <= 0) return;
  TORCH_CHECK(v.kinds.size() == args.size(), "torchrec_ftrl host path: a variant of ", v.kinds.size(),
              " arguments launched with ", args.size());
  std::vector<uint64_t> storage(args.size() + 2, 0);   // + Triton's global and profile scratch
  std::vector<void*> params;
  params.reserve(args.size() + 2);
  for (size_t i = 0; i < args.size(); ++i) {
    const char k = v.kinds[i];
    if (k == 'x') continue;
    TORCH_CHECK(args[i].kind != Arg::kFresh, "torchrec_ftrl host path: argument ", i, " not allocated");
    if (k == 'P') {
      storage[i] = reinterpret_cast<uint64_t>(args[i].tensor.data_ptr());
    } else if (k == 'i') {
      int32_t v32 = static_cast<int32_t>(args[i].value);
      std::memcpy(&storage[i], &v32, sizeof(v32));
    } else {
      std::memcpy(&storage[i], &args[i].value, sizeof(int64_t));
    }
    params.push_back(&storage[i]);
  }
  params.push_back(&storage[args.size()]);
  params.push_back(&storage[args.size() + 1]);
  const CUresult rc = driver().launch(reinterpret_cast<CUfunction>(v.function),
                                      static_cast<unsigned>(grid), 1, 1, v.threads, 1, 1, v.shared,
                                      stream, params.data(), nullptr);
  TORCH_CHECK(rc == 0, "torchrec_ftrl host path: cuLaunchKernel failed with CUresult ", rc);
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t kI32Max = 2147483647;

void* current_stream(const at::Device& dev) {
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(dev.type());
  return impl->getStream(dev).native_handle();
}

// Roles: the kernels of a training step (host.py's ROLES, in this order).
enum Role : int64_t { kLinearize = 0, kForward = 1, kMark = 2, kUpdate = 3, kCombine = 4 };

void register_variant(int64_t plan, int64_t role, int64_t device, std::string sig, int64_t function,
                      int64_t threads, int64_t shared, std::string kinds) {
  TORCH_CHECK(function == 0 || kinds.size() * 2 == sig.size(),
              "torchrec_ftrl host path: kinds and signature disagree");
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry[variant_key(plan, role, device, sig)] =
      Variant{static_cast<uintptr_t>(function), static_cast<unsigned>(threads),
              static_cast<unsigned>(shared), std::move(kinds)};
}

void clear_variants() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.clear();
}

std::string signature_op(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, std::string order) {
  // The signature of arguments given as tensors and ints in the order of `order` ('T' / 'I'),
  // for host.py's tests of its twin rule.
  std::vector<Arg> args;
  size_t t = 0, i = 0;
  for (char c : order) args.push_back(c == 'T' ? T(tensors.at(t++)) : I(ints.at(i++)));
  return signature_of(args);
}

// The training forward: tbe_linearize then tbe_forward with the row keys (host.py's Python twin:
// cuda/backend.py's _linearize and tbe_forward). Returns (0, [out, key, gofs, scale, tid, fixed]),
// or (1 absent / 2 Python-only, []) having launched nothing.
std::tuple<int64_t, std::vector<at::Tensor>> train_forward(
    int64_t plan, const std::optional<at::Tensor>& weights, const at::Tensor& accum,
    const at::Tensor& linear, const at::Tensor& table_w_offset, const at::Tensor& table_dim,
    const at::Tensor& table_rows, const at::Tensor& row_base, const at::Tensor& feature_table,
    const at::Tensor& bag_feature, const at::Tensor& bag_out_offset, const at::Tensor& indices,
    const at::Tensor& offsets, const std::optional<at::Tensor>& psw, const at::Tensor& knobs,
    const std::optional<at::Tensor>& warn, int64_t max_D, int64_t total_rows, int64_t out_numel,
    at::ScalarType out_dtype, bool padded, bool has_scale, int64_t lin_bags, int64_t fwd_bags) {
  const at::Device dev = linear.device();
  c10::DeviceGuard guard(dev);
  const int64_t N = indices.numel(), num_bags = offsets.numel() - 1;
  TORCH_CHECK(N > 0 && num_bags > 0 && out_numel > 0, "torchrec_ftrl host path: an empty batch");
  const bool repair = warn.has_value(), has_psw = psw.has_value();
  const auto on = [&](at::ScalarType s) { return at::TensorOptions().dtype(s).device(dev); };
  const at::ScalarType key_t = 0 <= total_rows && total_rows < kI32Max ? at::kInt : at::kLong;
  const at::ScalarType gofs_t = out_numel < kI32Max ? at::kInt : at::kLong;
  const int64_t tiles = cdiv(num_bags, lin_bags);
  // The step's buffers: fresh (F) for the registry lookups, then allocated (T) for the launches.
  struct Buffers { Arg key, gofs, scale, tid, fixed, ws, out; };
  const auto args_of = [&](const Buffers& b) {
    const Arg offs = repair ? b.fixed : T(offsets);
    const Arg w = T(weights.has_value() ? *weights : linear);
    std::vector<Arg> lin = {T(indices), T(offsets), T(bag_feature), T(bag_out_offset), T(feature_table),
                            T(row_base), T(table_rows), has_psw ? T(*psw) : b.scale, b.key, b.gofs,
                            b.scale, b.tid, T(repair ? *warn : offsets), offs, repair ? b.ws : T(offsets),
                            I(num_bags), I(N), I(max_D)};
    std::vector<Arg> fwd = {w, b.out, b.key, offs, T(bag_feature), T(bag_out_offset), T(feature_table),
                            T(table_w_offset), T(table_dim), T(table_rows), T(row_base),
                            has_psw ? T(*psw) : b.out, T(repair ? *warn : row_base), offs, w, w, T(linear),
                            T(accum), T(knobs), I(num_bags), I(max_D), I(0)};
    return std::make_pair(std::move(lin), std::move(fwd));
  };
  Variant vl, vf;
  {
    const auto fresh = args_of(Buffers{F(key_t), F(gofs_t), F(at::kFloat), F(at::kInt),
                                       F(offsets.scalar_type()), F(at::kLong), F(out_dtype)});
    int rc = find(plan, kLinearize, dev.index(), fresh.first, &vl);
    if (rc == 0) rc = find(plan, kForward, dev.index(), fresh.second, &vf);
    if (rc != 0) return {rc, {}};
  }
  at::Tensor key = at::empty({N}, on(key_t));
  at::Tensor gofs = at::empty({N}, on(gofs_t));
  at::Tensor scale = at::empty({has_scale ? N : 1}, on(at::kFloat));
  at::Tensor tid = at::empty({N}, on(at::kInt));
  at::Tensor fixed = at::empty({repair ? offsets.numel() : 0}, on(offsets.scalar_type()));
  at::Tensor ws = repair ? at::zeros({tiles + 1}, on(at::kLong)) : offsets;
  at::Tensor out = padded ? at::zeros({out_numel}, on(out_dtype)) : at::empty({out_numel}, on(out_dtype));
  const auto args = args_of(Buffers{T(key), T(gofs), T(scale), T(tid), T(fixed), T(ws), T(out)});
  ensure_context(dev.index());
  void* stream = current_stream(dev);
  launch(vl, args.first, tiles, stream);
  launch(vf, args.second, cdiv(num_bags, fwd_bags), stream);
  return {0, {out, key, gofs, scale, tid, fixed}};
}

at::Tensor sort_positions(const at::Tensor& key, int64_t total_rows, bool fbgemm_sort) {
  if (fbgemm_sort) {
    static const auto handle = c10::Dispatcher::singleton().findSchema(
        {"fbgemm::get_unique_indices_with_inverse", ""});
    if (handle.has_value()) {
      try {
        std::vector<c10::IValue> stack = {key, total_rows - 1, false, true};
        handle->callBoxed(&stack);
        return stack.at(3).toTensor();
      } catch (const c10::NotImplementedError&) {   // no kernel of the op for this device
      }
    }
  }
  return std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
}

// The training backward + update from the forward's linearised batch (host.py's Python twin:
// cuda/backend.py's _backward_kernels, uncached). Returns 0 (done), 1 (absent) or 2 (Python-only);
// when not 0 no kernel that writes the tables was launched.
int64_t train_backward(
    int64_t plan, const std::optional<at::Tensor>& weights, const at::Tensor& accum,
    const at::Tensor& linear, const at::Tensor& table_w_offset, const at::Tensor& table_dim,
    const at::Tensor& row_base, const at::Tensor& grad_out, const at::Tensor& knobs,
    const at::Tensor& nonfinite_rows, const std::optional<at::Tensor>& step, const at::Tensor& key,
    const at::Tensor& gofs, const at::Tensor& scale, const at::Tensor& tid, int64_t total_rows,
    int64_t seg_len, int64_t block, int64_t block_d, int64_t update_g, int64_t combine_cp,
    bool fbgemm_sort) {
  const at::Device dev = linear.device();
  c10::DeviceGuard guard(dev);
  const int64_t N = key.numel();
  TORCH_CHECK(N > 0, "torchrec_ftrl host path: an empty batch");
  const auto on = [&](at::ScalarType s) { return at::TensorOptions().dtype(s).device(dev); };
  const at::Tensor grad = grad_out.reshape(-1).contiguous();
  const at::Tensor& step_t = step.has_value() ? *step : row_base;
  const at::ScalarType seg_t = N < kI32Max ? at::kInt : at::kLong;
  const int64_t tiles = cdiv(N, block);
  const int64_t nmult = cdiv(N, seg_len) - 1;
  const int64_t bound = total_rows < 0 ? N : std::min(N, total_rows + N / seg_len);
  const Arg w = T(weights.has_value() ? *weights : grad);   // derived weights: an unused pointer
  // The step's buffers: fresh (F) for the registry lookups, then allocated (T) for the launches.
  // count is the int64 at element tiles + 1 of ws.
  struct Buffers { Arg sorted_key, sgofs, sscale, stid, seg, ws, count, part; };
  const auto mark_args = [&](const Arg& perm, const Buffers& b) {
    return std::vector<Arg>{T(key), perm, T(gofs), T(scale), T(tid), T(tid), b.sorted_key, b.sgofs,
                            b.sscale, b.stid, T(tid), b.seg, b.ws, I(N), I(tiles)};
  };
  const auto update_args = [&](const Buffers& b) {
    return std::vector<Arg>{b.seg, b.count, b.sorted_key, b.sgofs, b.sscale, b.stid, T(tid), T(grad), w,
                            T(accum), T(linear), T(grad), T(grad), T(grad), T(table_w_offset),
                            T(table_dim), T(row_base), b.part, T(nonfinite_rows), T(step_t), T(knobs),
                            I(N), I(0)};
  };
  const auto combine_args = [&](const Buffers& b) {
    return std::vector<Arg>{b.sorted_key, b.stid, T(tid), b.part, w, T(accum), T(linear), T(grad),
                            T(grad), T(grad), T(table_w_offset), T(table_dim), T(row_base),
                            T(nonfinite_rows), T(step_t), T(knobs), I(N), I(0)};
  };
  const Buffers fresh{F(key.scalar_type()), F(gofs.scalar_type()), F(scale.scalar_type()),
                      F(tid.scalar_type()), F(seg_t), F(at::kLong), F(at::kLong, (tiles + 1) % 2 == 0),
                      F(at::kFloat)};
  Variant vm, vu, vc;
  int rc = find(plan, kUpdate, dev.index(), update_args(fresh), &vu);
  if (rc == 0 && nmult > 0) rc = find(plan, kCombine, dev.index(), combine_args(fresh), &vc);
  if (rc != 0) return rc;
  const at::Tensor perm = sort_positions(key, total_rows, fbgemm_sort);   // its dtype: the sort's
  rc = find(plan, kMark, dev.index(), mark_args(T(perm), fresh), &vm);
  if (rc != 0) return rc;
  at::Tensor ws = at::zeros({tiles + 2}, on(at::kLong));
  at::Tensor part = at::empty({std::max<int64_t>(1, 2 * (nmult + 1)) * block_d}, on(at::kFloat));
  const Buffers b{T(at::empty_like(key)), T(at::empty_like(gofs)), T(at::empty_like(scale)),
                  T(at::empty_like(tid)), T(at::empty({N + 1}, on(seg_t))), T(ws),
                  T(ws.narrow(0, tiles + 1, 1)), T(part)};
  ensure_context(dev.index());
  void* stream = current_stream(dev);
  launch(vm, mark_args(T(perm), b), tiles, stream);
  launch(vu, update_args(b), cdiv(bound, update_g), stream);
  if (nmult > 0) launch(vc, combine_args(b), cdiv(nmult, combine_cp), stream);
  return 0;
}

// Training lookups whose backward ran in C++ (host.py reads it for its step counts).
std::atomic<int64_t> cpp_backward_steps{0};

std::vector<int64_t> counts() { return {cpp_backward_steps.load()}; }

// The arguments of train_lookup past the placeholder (one struct: the autograd Function's forward
// takes it by pointer; only the placeholder is a differentiable input).
struct LookupArgs {
  const at::Tensor& token;
  const at::Tensor& hp_version;
  int64_t fwd_plan, bwd_plan;
  const std::optional<at::Tensor>& weights;
  const at::Tensor &accum, &linear, &table_w_offset, &table_dim, &table_rows, &row_base, &feature_table,
      &bag_feature, &bag_out_offset, &indices, &offsets;
  const std::optional<at::Tensor>& psw;
  const at::Tensor& knobs;
  const std::optional<at::Tensor>& warn;
  int64_t max_D, total_rows, out_numel;
  at::ScalarType out_dtype;
  bool padded, has_scale;
  int64_t lin_bags, fwd_bags;
  const at::Tensor& nonfinite_rows;
  const std::optional<at::Tensor>& step;
  const at::Tensor& iter;
  c10::IntArrayRef bwd;   // seg_len, block, block_d, update_g, combine_cp, fbgemm_sort
};

// A whole training lookup as one autograd node: forward = train_forward; backward = train_backward
// (or, where a backward variant is not registered or the knobs changed since the forward, the
// Python path through the op torchrec_ftrl_host_py::backward_fallback, which registers it), then
// iter += 1. The forward of a
// step whose forward variants are not all registered launches nothing and returns an empty tensor.
struct TrainLookup : public torch::autograd::Function<TrainLookup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& placeholder,
                            const LookupArgs* a) {
    auto [rc, res] = train_forward(a->fwd_plan, a->weights, a->accum, a->linear, a->table_w_offset,
                                   a->table_dim, a->table_rows, a->row_base, a->feature_table,
                                   a->bag_feature, a->bag_out_offset, a->indices, a->offsets, a->psw,
                                   a->knobs, a->warn, a->max_D, a->total_rows, a->out_numel, a->out_dtype,
                                   a->padded, a->has_scale, a->lin_bags, a->fwd_bags);
    if (rc != 0) return at::empty({0}, a->linear.options().dtype(a->out_dtype));
    auto& d = ctx->saved_data;
    const char* const linearized[] = {"key", "gofs", "scale", "tid", "fixed"};   // res[1..5]
    for (size_t i = 0; i < 5; ++i) d[linearized[i]] = res[i + 1];
    d["token"] = a->token;
    d["hp_version"] = a->hp_version;
    d["hp_seen"] = *a->hp_version.data_ptr<int64_t>();
    d["plan"] = a->bwd_plan;
    d["weights"] = a->weights;
    d["accum"] = a->accum;
    d["linear"] = a->linear;
    d["table_w_offset"] = a->table_w_offset;
    d["table_dim"] = a->table_dim;
    d["row_base"] = a->row_base;
    d["knobs"] = a->knobs;
    d["nonfinite_rows"] = a->nonfinite_rows;
    d["step"] = a->step;
    d["iter"] = a->iter;
    d["total_rows"] = a->total_rows;
    d["bwd"] = a->bwd.vec();
    return res[0];
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& d = ctx->saved_data;
    const at::Tensor grad = grads.at(0).reshape(-1).contiguous();
    const at::Tensor key = d["key"].toTensor(), gofs = d["gofs"].toTensor();
    const at::Tensor scale = d["scale"].toTensor(), tid = d["tid"].toTensor();
    const std::vector<int64_t> bwd = d["bwd"].toIntVector();
    const std::optional<at::Tensor> weights = d["weights"].toOptional<at::Tensor>();
    const std::optional<at::Tensor> step = d["step"].toOptional<at::Tensor>();
    // knobs changed since the forward (hp_version moved): the Python path, with the current ones
    const bool knobs_current = *d["hp_version"].toTensor().data_ptr<int64_t>() == d["hp_seen"].toInt();
    const int64_t rc = !knobs_current ? 3 : train_backward(
        d["plan"].toInt(), weights, d["accum"].toTensor(), d["linear"].toTensor(),
        d["table_w_offset"].toTensor(), d["table_dim"].toTensor(), d["row_base"].toTensor(), grad,
        d["knobs"].toTensor(), d["nonfinite_rows"].toTensor(), step, key, gofs, scale, tid,
        d["total_rows"].toInt(), bwd.at(0), bwd.at(1), bwd.at(2), bwd.at(3), bwd.at(4), bwd.at(5) != 0);
    if (rc == 0) {
      ++cpp_backward_steps;
    } else {
      static const auto fallback = c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchrec_ftrl_host_py::backward_fallback", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      fallback.call(d["token"].toTensor(), grad, key, gofs, scale, tid, d["fixed"].toTensor(),
                    !knobs_current);
    }
    d["iter"].toTensor().add_(1);
    return {at::Tensor(), at::Tensor()};
  }
};

at::Tensor train_lookup(
    const at::Tensor& placeholder, const at::Tensor& token, const at::Tensor& hp_version,
    int64_t fwd_plan, int64_t bwd_plan,
    const std::optional<at::Tensor>& weights, const at::Tensor& accum, const at::Tensor& linear,
    const at::Tensor& table_w_offset, const at::Tensor& table_dim, const at::Tensor& table_rows,
    const at::Tensor& row_base, const at::Tensor& feature_table, const at::Tensor& bag_feature,
    const at::Tensor& bag_out_offset, const at::Tensor& indices, const at::Tensor& offsets,
    const std::optional<at::Tensor>& psw, const at::Tensor& knobs, const std::optional<at::Tensor>& warn,
    int64_t max_D, int64_t total_rows, int64_t out_numel, at::ScalarType out_dtype, bool padded,
    bool has_scale, int64_t lin_bags, int64_t fwd_bags, const at::Tensor& nonfinite_rows,
    const std::optional<at::Tensor>& step, const at::Tensor& iter, c10::IntArrayRef bwd) {
  TORCH_CHECK(hp_version.device().is_cpu() && hp_version.scalar_type() == at::kLong &&
              hp_version.numel() == 1, "torchrec_ftrl host path: hp_version must be a CPU int64 [1]");
  TORCH_CHECK(bwd.size() == 6, "torchrec_ftrl host path: train_lookup takes 6 backward settings, got ",
              bwd.size());
  const LookupArgs args{token, hp_version, fwd_plan, bwd_plan, weights, accum, linear, table_w_offset, table_dim,
                        table_rows, row_base, feature_table, bag_feature, bag_out_offset, indices,
                        offsets, psw, knobs, warn, max_D, total_rows, out_numel, out_dtype, padded,
                        has_scale, lin_bags, fwd_bags, nonfinite_rows, step, iter, bwd};
  return TrainLookup::apply(placeholder, &args);
}

}  // namespace

TORCH_LIBRARY(torchrec_ftrl_host, m) {
  m.def("counts() -> int[]", &counts);
  m.def("train_lookup(Tensor placeholder, Tensor token, Tensor hp_version, int fwd_plan, int bwd_plan, Tensor? weights, "
        "Tensor accum, Tensor linear, Tensor table_w_offset, Tensor table_dim, Tensor table_rows, "
        "Tensor row_base, Tensor feature_table, Tensor bag_feature, Tensor bag_out_offset, Tensor indices, "
        "Tensor offsets, Tensor? psw, Tensor knobs, Tensor(a!)? warn, int max_D, int total_rows, "
        "int out_numel, ScalarType out_dtype, bool padded, bool has_scale, int lin_bags, int fwd_bags, "
        "Tensor(b!) nonfinite_rows, Tensor? step, Tensor(c!) iter, int[] bwd) -> Tensor");
  m.def("register_variant(int plan, int role, int device, str sig, int function, int threads, "
        "int shared, str kinds) -> ()", &register_variant);
  m.def("clear_variants() -> ()", &clear_variants);
  m.def("signature(Tensor[] tensors, int[] ints, str order) -> str", &signature_op);
  m.def("train_forward(int plan, Tensor? weights, Tensor accum, Tensor linear, Tensor table_w_offset, "
        "Tensor table_dim, Tensor table_rows, Tensor row_base, Tensor feature_table, Tensor bag_feature, "
        "Tensor bag_out_offset, Tensor indices, Tensor offsets, Tensor? psw, Tensor knobs, Tensor(a!)? warn, "
        "int max_D, int total_rows, int out_numel, ScalarType out_dtype, bool padded, bool has_scale, "
        "int lin_bags, int fwd_bags) -> (int, Tensor[])", &train_forward);
  m.def("train_backward(int plan, Tensor(a!)? weights, Tensor(b!) accum, Tensor(c!) linear, "
        "Tensor table_w_offset, Tensor table_dim, Tensor row_base, Tensor grad_out, Tensor knobs, "
        "Tensor(d!) nonfinite_rows, "
        "Tensor? step, Tensor key, Tensor gofs, Tensor scale, Tensor tid, int total_rows, int seg_len, "
        "int block, int block_d, int update_g, int combine_cp, bool fbgemm_sort) -> int", &train_backward);
}

TORCH_LIBRARY_IMPL(torchrec_ftrl_host, Autograd, m) {
  m.impl("train_lookup", &train_lookup);
}
