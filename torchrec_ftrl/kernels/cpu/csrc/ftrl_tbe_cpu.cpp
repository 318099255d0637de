// Compiled CPU kernel of the fused FTRL-Proximal TBE (torchrec_ftrl.FTRLTableBatchedEmbeddingBags).
//
// Layout contract: torchrec_ftrl/kernels/batch.py (TBEBatch, TableArrays). Weights, accum (n) and
// linear (z) are flat 1-D buffers, table after table, row-major; element
// table_w_offset[t] + r * table_dim[t] + d. Bags are feature-major; bag k holds
// indices[offsets[k]:offsets[k+1]] and writes its pooled D-vector at bag_out_offset[k] of the flat
// output (PoolingMode.NONE: index i writes at i * max_D).
//
// Row layouts (torchrec_ftrl/row_layout.py), chosen by template flags, never per element:
// * derived weights (kDerived): no weight buffer; the forward reads w = ftrl_prox(z, n) and the
//   update takes it as the old weight, writing only z and n. ftrl_prox is the one function that
//   also gives a stored layout's new weight, so from the same (z, n) both layouts read the same bits.
// * row-wise accum (kRowwise): one n per row at the row's key (table_row_base[t] + r):
//   n += sum_d g_d^2 / D (sum_squares: a fixed order on every ISA), every element of the row then
//   takes ftrl_step with the row's n^(-p) before and after.
//
// Update rule: the twin of torchrec_ftrl/rule.py (ftrl_rule, ftrl_rule_rowwise, ftrl_prox;
// docs/ftrl.md for users; McMahan et al. 2013, Alg. 1, with TensorFlow ApplyFtrlV2's l2 shrinkage
// and Keras' beta): ftrl_prox, ftrl_step, ftrl_element, ftrl_row_accum and the scalars FtrlHp
// (FTRLHyperparams.kernel_scalars()) in ftrl_rule_gen.h, generated from
// torchrec_ftrl/rule_spec.py (python -m torchrec_ftrl.kernels.codegen --write).
//
// Backward + update is one call: linear row id per index -> stable LSD radix sort by row (carrying
// each index's gradient offset and scale) -> parallel over unique rows: sum the row's gradient
// contributions in fp32 in index-position order (deterministic, independent of the thread count)
// -> skip+count rows whose fp32 sum_d g_d^2 is not finite (a NaN/Inf gradient, or a square that
// overflows) -> one FTRL update per row, states fp32, weight written back in its own dtype. Scratch
// buffers are kept per calling thread (about 60 bytes per index) and reused.
//
// Every op checks all its arguments (the "checks" section) before it reads or writes memory through
// a data pointer; only the values of indices are trusted (the bounds check's job).
//
// Compact state (torchrec_ftrl/state_dtype.py): accum and/or linear may be stored in bf16 (uint16_t
// bit patterns here). They load exactly into fp32, the update is the same fp32 code, and a bf16 state
// is stored with stochastic rounding: the bits of sr_seed(step, state), sr_row(row key) and
// sr_bits(column) (column 0 for a row-wise accum; ftrl_rule_gen.h, the uint32 twin of
// state_dtype.sr_bits), added to the fp32 bit pattern before truncation (round_bf16_sr, the twin of
// state_dtype.round_bf16_stochastic).
//
// Weights, outputs and output gradients are fp32, fp16 or bf16 (FTRL_DISPATCH_FLOATS).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "ftrl_rule_gen.h"

namespace {

// FBGEMM's PoolingMode values, as torchrec_ftrl/kernels/batch.py passes them (POOL_SUM/MEAN/NONE).
constexpr int kPoolSum = 0;
constexpr int kPoolMean = 1;
constexpr int kPoolNone = 2;

// sum_d x[d]^2 of a row (the row-wise accum's increment, before / D) in one fixed order whatever the
// vector ISA: 16 lane sums (lane l takes d = l mod 16, in d order), then a fixed pairwise tree.
inline float sum_squares(const float* __restrict__ x, int64_t D) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += x[d + l] * x[d + l];
  }
  for (int l = 0; d + l < D; ++l) lane[l] += x[d + l] * x[d + l];
  for (int half = kLanes / 2; half > 0; half /= 2) {
    for (int l = 0; l < half; ++l) lane[l] += lane[l + half];
  }
  return lane[0];
}

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// ------------------------------------------------------------------ compact (bf16) state

inline float bf16_bits_to_f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Storage of one state: float, or uint16_t bf16 bits when kBf16.
template <bool kBf16>
using StateT = std::conditional_t<kBf16, uint16_t, float>;

// A stored state value in fp32 (a bf16 one loads exactly).
template <bool kBf16>
inline float load_state(StateT<kBf16> v) {
  if constexpr (kBf16) {
    return bf16_bits_to_f(v);
  } else {
    return v;
  }
}

// ------------------------------------------------------------------------------------------ dispatch

// The dtypes the FTRL TBE gives its weights, outputs and output gradients: fp32, fp16, bf16.
#define FTRL_DISPATCH_FLOATS(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

template <typename T>
struct TypeTag {
  using type = T;
};

// f(std::true_type{}) or f(std::false_type{}): a runtime flag made a compile-time one.
template <typename F>
decltype(auto) with_flag(bool flag, F&& f) {
  if (flag) return f(std::true_type{});
  return f(std::false_type{});
}

// ------------------------------------------------------------------------------------------ forward

// Where the forward reads the weight rows of one table. row(idx, D, scratch) returns the row's D
// values (any float type); prefetch(idx, D) starts loading it.

// Stored weights: the row in the weight buffer.
template <typename W>
struct StoredTable {
  const W* base;  // the table's first weight
  const W* row(int64_t idx, int64_t D, float* /*scratch*/) const { return base + idx * D; }
  void prefetch(int64_t idx, int64_t D) const { __builtin_prefetch(base + idx * D); }
};

template <typename W>
struct StoredRows {
  const W* weights;
  const int64_t* table_w_offset;
  StoredTable<W> table(int64_t t) const { return {weights + table_w_offset[t]}; }
};

// Derived weights: w = prox(z, n) computed into `scratch` from the table's linear and accum
// (kRowwise: one accum value per row).
template <bool kSqrt, bool kRowwise, bool kNB, bool kZB>
struct DerivedTable {
  const StateT<kNB>* n;  // the table's first accum value
  const StateT<kZB>* z;  // the table's first linear value
  const FtrlHp* hp;
  const float* row(int64_t idx, int64_t D, float* __restrict__ scratch) const {
    const StateT<kZB>* __restrict__ zr = z + idx * D;
    if constexpr (kRowwise) {
      const float pn = ftrl_power<kSqrt>(load_state<kNB>(n[idx]), *hp);
      for (int64_t d = 0; d < D; ++d) scratch[d] = ftrl_prox(load_state<kZB>(zr[d]), pn, *hp);
    } else {
      const StateT<kNB>* __restrict__ nr = n + idx * D;
      for (int64_t d = 0; d < D; ++d) {
        scratch[d] = ftrl_prox(load_state<kZB>(zr[d]), ftrl_power<kSqrt>(load_state<kNB>(nr[d]), *hp),
                               *hp);
      }
    }
    return scratch;
  }
  void prefetch(int64_t idx, int64_t D) const {
    __builtin_prefetch(z + idx * D);
    __builtin_prefetch(kRowwise ? n + idx : n + idx * D);
  }
};

template <bool kSqrt, bool kRowwise, bool kNB, bool kZB>
struct DerivedRows {
  const StateT<kNB>* accum;
  const StateT<kZB>* linear;
  const int64_t* table_w_offset;
  const int64_t* table_row_base;  // row-wise accum: row r of table t at table_row_base[t] + r
  FtrlHp hp;
  DerivedTable<kSqrt, kRowwise, kNB, kZB> table(int64_t t) const {
    return {accum + (kRowwise ? table_row_base[t] : table_w_offset[t]), linear + table_w_offset[t], &hp};
  }
};

template <typename Rows, typename O>
void forward_pooled(const Rows& rows, const int64_t* table_dim, const int64_t* feature_table,
                    const int64_t* bag_feature, const int64_t* bag_out_offset,
                    const int64_t* indices, const int64_t* offsets, const float* psw,
                    int64_t num_bags, int64_t max_D, bool mean, O* __restrict__ out) {
  at::parallel_for(0, num_bags, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(static_cast<size_t>(2 * max_D));
    float* __restrict__ acc = buf.data();
    float* __restrict__ scratch = buf.data() + max_D;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = feature_table[bag_feature[b]];
      const int64_t D = table_dim[t];
      const auto table = rows.table(t);
      const int64_t start = offsets[b], end = offsets[b + 1];
      std::fill(acc, acc + D, 0.0f);
      for (int64_t i = start; i < end; ++i) {
        if (i + 2 < end) {
          table.prefetch(indices[i + 2], D);
        }
        const auto* __restrict__ row = table.row(indices[i], D, scratch);
        if (psw != nullptr) {
          const float s = psw[i];
          for (int64_t d = 0; d < D; ++d) acc[d] += s * to_f(row[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) acc[d] += to_f(row[d]);
        }
      }
      O* __restrict__ dst = out + bag_out_offset[b];
      if (mean && end > start) {
        const float L = static_cast<float>(end - start);
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<O>(acc[d] / L);
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<O>(acc[d]);
      }
    }
  });
}

template <typename Rows, typename O>
void forward_sequence(const Rows& rows, const int64_t* table_dim, const int64_t* feature_table,
                      const int64_t* bag_feature, const int64_t* indices, const int64_t* offsets,
                      int64_t num_bags, int64_t max_D, O* __restrict__ out) {
  at::parallel_for(0, num_bags, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(static_cast<size_t>(max_D));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = feature_table[bag_feature[b]];
      const int64_t D = table_dim[t];
      const auto table = rows.table(t);
      for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) {
        const auto* __restrict__ row = table.row(indices[i], D, buf.data());
        O* __restrict__ dst = out + i * max_D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<O>(to_f(row[d]));
        for (int64_t d = D; d < max_D; ++d) dst[d] = static_cast<O>(0.0f);  // a narrower table's padding
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ checks
//
// Every op checks all its arguments here before it reads or writes memory through a data pointer,
// in O(T + F + bags) (T tables, F features): devices, dtypes, lengths, the tables' extents inside the
// flat arrays, the map entries, the offsets' shape and every output position. Messages name the op,
// the argument and its value. The values of indices are the bounds check's (torchrec_ftrl/tbe/
// bounds_check.py); an index outside its table is undefined behaviour here.

// The parameters of the ops' schemas (ops.py) shared by tbe_forward and tbe_backward_update_: the
// batch (in the schemas' order) and the HBM cache, which this kernel refuses (refuse_unsupported).
#define FTRL_BATCH_PARAMS                                                                         \
  const at::Tensor &table_w_offset, const at::Tensor &table_dim, const at::Tensor &table_rows,    \
      const at::Tensor &table_row_base, const at::Tensor &feature_table,                          \
      const at::Tensor &bag_feature, const at::Tensor &bag_out_offset, const at::Tensor &indices, \
      const at::Tensor &offsets, const c10::optional<at::Tensor> &per_sample_weights,             \
      int64_t pooling_mode, int64_t max_D, at::IntArrayRef table_dims, int64_t total_rows
#define FTRL_BATCH_ARGS                                                                           \
  table_w_offset, table_dim, table_rows, table_row_base, feature_table, bag_feature,              \
      bag_out_offset, indices, offsets, per_sample_weights, pooling_mode, max_D, table_dims, total_rows
#define FTRL_CACHE_PARAMS                                                                        \
  const c10::optional<at::Tensor> &cache_locations, const c10::optional<at::Tensor> &cache_weights, \
      const c10::optional<at::Tensor> &cache_accum, const c10::optional<at::Tensor> &cache_linear
#define FTRL_CACHE_ARGS                                                                          \
  {"cache_locations", &cache_locations}, {"cache_weights", &cache_weights},                      \
      {"cache_accum", &cache_accum}, {"cache_linear", &cache_linear}

// The largest max_D (a row's D is an int32 in the backward's segments).
constexpr int64_t kMaxDim = INT32_MAX;
// Bags per task of the parallel checks over bags.
constexpr int64_t kCheckGrain = int64_t{1} << 15;

// `t` is on the CPU: a tensor of another device (a meta or CUDA one among CPU arguments) raises.
void check_cpu(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "torchrec_ftrl::", op, ": ", name, " must be a CPU tensor like the "
              "other arguments of the compiled CPU kernel, got one on ", t.device());
}

// An index tensor: CPU, int64, contiguous 1-D; `numel` elements unless numel < 0 (`basis`: where that
// length comes from, for the message).
void check_index_tensor(const char* op, const at::Tensor& t, const char* name, int64_t numel = -1,
                        const char* basis = "") {
  check_cpu(op, t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, "torchrec_ftrl::", op, ": ", name, " must be int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "torchrec_ftrl::", op, ": ", name,
              " must be contiguous 1-D, got shape ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK(numel < 0 || t.numel() == numel, "torchrec_ftrl::", op, ": ", name, " must have ", numel,
              " elements", basis, ", got ", t.numel());
}

bool is_float_type(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

// Every entry of the index tensor `t` lies in [0, hi); raises naming the first that does not.
void check_entries(const char* op, const at::Tensor& t, const char* name, int64_t hi) {
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t n = t.numel();
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= (p[i] < 0) | (p[i] >= hi);  // vectorises
  if (!bad) return;
  int64_t i = 0;
  while (p[i] >= 0 && p[i] < hi) ++i;
  TORCH_CHECK(false, "torchrec_ftrl::", op, ": ", name, "[", i, "]=", p[i], " must be in [0, ", hi, ")");
}

// The per-sample weights: None, or contiguous fp32 [n] on the CPU.
c10::optional<at::Tensor> check_psw(const char* op, const c10::optional<at::Tensor>& psw, int64_t n) {
  if (!psw.has_value() || !psw->defined()) return c10::nullopt;
  check_cpu(op, *psw, "per_sample_weights");
  TORCH_CHECK(psw->scalar_type() == at::kFloat && psw->is_contiguous() && psw->numel() == n && psw->dim() == 1,
              "torchrec_ftrl::", op, ": per_sample_weights must be contiguous 1-D fp32 [N=", n, "], got ",
              psw->scalar_type(), " ", psw->sizes());
  return psw;
}

// The weight buffer of a stored layout, or null for derived weights.
const at::Tensor* stored_weights(const c10::optional<at::Tensor>& weights) {
  return weights.has_value() && weights->defined() ? &*weights : nullptr;
}

// The state arrays of a layout: on the CPU, contiguous; weights fp32/fp16/bf16, accum and linear
// fp32 or bf16; stored weights as long as linear; accum as long as linear, or `rows` (the tables' rows)
// with a row-wise accum.
void check_layout(const char* op, const at::Tensor* weights, const at::Tensor& accum,
                  const at::Tensor& linear, bool rowwise, int64_t rows) {
  check_cpu(op, accum, "accum");
  check_cpu(op, linear, "linear");
  if (weights) check_cpu(op, *weights, "weights");
  const auto state_ok = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(state_ok(accum) && state_ok(linear), "torchrec_ftrl::", op, ": accum and linear must be "
              "fp32 or bf16, got ", accum.scalar_type(), " and ", linear.scalar_type());
  TORCH_CHECK(!weights || is_float_type(weights->scalar_type()), "torchrec_ftrl::", op,
              ": weights must be fp32, fp16 or bf16, got ", weights ? weights->scalar_type() : at::kFloat);
  TORCH_CHECK(accum.is_contiguous() && linear.is_contiguous() && (!weights || weights->is_contiguous()),
              "torchrec_ftrl::", op, ": weights, accum and linear must be contiguous");
  for (const auto& [t, name] : {std::make_pair(&linear, "linear"), std::make_pair(&accum, "accum"),
                                std::make_pair(weights, "weights")}) {
    TORCH_CHECK(t == nullptr || t->dim() == 1, "torchrec_ftrl::", op, ": ", name, " must be 1-D (flat), "
                "got shape ", t->sizes());
  }
  const int64_t elements = linear.numel();
  TORCH_CHECK(!weights || weights->numel() == elements, "torchrec_ftrl::", op, ": weights must have as "
              "many elements as linear (", elements, "), got ", weights ? weights->numel() : 0);
  const int64_t want = rowwise ? rows : elements;
  TORCH_CHECK(accum.numel() == want, "torchrec_ftrl::", op, ": ", rowwise ? "a row-wise accum must have "
              "one element per row (" : "an element-wise accum must have as many elements as linear (",
              want, "), got ", accum.numel());
}

// The tables (O(T)): table_dims and table_dim agree; 1 <= dim <= max_D, max_D the largest dim (it
// sizes per-thread scratch rows); rows >= 0; each table's
// elements [w_offset, w_offset + rows * dim) inside the `elements` of linear; table_row_base the
// prefix sum of rows, whose total is total_rows.
void check_tables(const char* op, const at::Tensor& table_w_offset, const at::Tensor& table_dim,
                  const at::Tensor& table_rows, const at::Tensor& table_row_base,
                  at::IntArrayRef table_dims, int64_t max_D, int64_t total_rows, int64_t elements) {
  const int64_t T = table_rows.numel();
  TORCH_CHECK(static_cast<int64_t>(table_dims.size()) == T, "torchrec_ftrl::", op, ": table_dims must "
              "have one entry per table (", T, "), got ", table_dims.size());
  TORCH_CHECK_VALUE(max_D >= (T > 0 ? 1 : 0) && max_D <= kMaxDim, "torchrec_ftrl::", op, ": max_D must "
                    "be in [", T > 0 ? 1 : 0, ", ", kMaxDim, "], got ", max_D);
  const int64_t* woff = table_w_offset.data_ptr<int64_t>();
  const int64_t* dim = table_dim.data_ptr<int64_t>();
  const int64_t* rows = table_rows.data_ptr<int64_t>();
  const int64_t* base = table_row_base.data_ptr<int64_t>();
  int64_t sum = 0, widest = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(dim[t] >= 1 && dim[t] <= max_D && table_dims[t] == dim[t], "torchrec_ftrl::", op,
                ": table_dim[", t, "]=", dim[t], " must be in [1, max_D=", max_D, "] and equal table_dims[",
                t, "]=", table_dims[t]);
    widest = std::max(widest, dim[t]);
    TORCH_CHECK(rows[t] >= 0, "torchrec_ftrl::", op, ": table_rows[", t, "]=", rows[t], " must be >= 0");
    int64_t size = 0, end = 0;
    const bool overflow = __builtin_mul_overflow(rows[t], dim[t], &size) ||
                          __builtin_add_overflow(woff[t], size, &end);
    TORCH_CHECK(woff[t] >= 0 && !overflow && end <= elements, "torchrec_ftrl::", op, ": table ", t,
                " (table_w_offset=", woff[t], ", table_rows=", rows[t], ", table_dim=", dim[t],
                ") must lie inside linear's ", elements, " elements");
    TORCH_CHECK(base[t] == sum, "torchrec_ftrl::", op, ": table_row_base[", t, "]=", base[t],
                " must be the rows of the tables before it (", sum, ")");
    TORCH_CHECK(!__builtin_add_overflow(sum, rows[t], &sum), "torchrec_ftrl::", op,
                ": the tables' rows overflow int64");
  }
  TORCH_CHECK_VALUE(total_rows == sum, "torchrec_ftrl::", op, ": total_rows=", total_rows,
                    " must be the sum of table_rows (", sum, ")");
  TORCH_CHECK_VALUE(T == 0 || max_D == widest, "torchrec_ftrl::", op, ": max_D=", max_D,
                    " must be the largest table dim (", widest, ")");
}

// Raises for bag b, which check_bags found bad: decreasing offsets or an output position outside.
void raise_bag(const char* op, const int64_t* off, const int64_t* bout, int64_t D, int64_t b,
               const char* out_name, int64_t out_size) {
  TORCH_CHECK(off[b + 1] >= off[b], "torchrec_ftrl::", op, ": offsets must be non-decreasing, got offsets[",
              b, "]=", off[b], " and offsets[", b + 1, "]=", off[b + 1]);
  TORCH_CHECK(false, "torchrec_ftrl::", op, ": bag_out_offset[", b, "]=", bout[b], " must be in [0, ",
              out_name, " - D] = [0, ", out_size - D, "] (the bag's D=", D, ")");
}

// The bags (O(F + bags)): feature_table entries in [0, T), bag_feature entries in [0, F); offsets
// start at 0, never decrease and end at N (zero bags: offsets [0], then no index is read); every output
// position inside the output of `out_size` elements (`out_name`): bag b's D values at
// bag_out_offset[b] (SUM, MEAN), index i's at i * max_D (NONE: N * max_D elements).
void check_bags(const char* op, const at::Tensor& table_dim, const at::Tensor& feature_table,
                const at::Tensor& bag_feature, const at::Tensor& bag_out_offset, const at::Tensor& offsets,
                int64_t N, int64_t pooling_mode, int64_t max_D, const char* out_name, int64_t out_size) {
  const int64_t T = table_dim.numel(), F = feature_table.numel(), bags = bag_feature.numel();
  check_entries(op, feature_table, "feature_table", T);
  check_entries(op, bag_feature, "bag_feature", F);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && (bags == 0 || off[bags] == N), "torchrec_ftrl::", op, ": offsets must start "
              "at 0 and end at N=", N, ", got offsets[0]=", off[0], " and offsets[", bags, "]=", off[bags]);
  const bool pooled = pooling_mode != kPoolNone;
  int64_t need = 0;
  TORCH_CHECK(pooled || N == 0 || (!__builtin_mul_overflow(N, max_D, &need) && need <= out_size),
              "torchrec_ftrl::", op, ": ", out_name, "=", out_size, " must hold N * max_D = ", N, " * ",
              max_D, " elements (PoolingMode.NONE)");
  const int64_t* dim = table_dim.data_ptr<int64_t>();
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* bf = bag_feature.data_ptr<int64_t>();
  const int64_t* bout = bag_out_offset.data_ptr<int64_t>();
  std::vector<int64_t> fdim(static_cast<size_t>(F));  // D of each feature
  for (int64_t f = 0; f < F; ++f) fdim[f] = dim[ft[f]];
  const auto bag_bad = [&](int64_t b) {
    const int64_t o = bout[b];
    return (off[b + 1] < off[b]) | (pooled & ((o < 0) | (o > out_size - fdim[bf[b]])));
  };
  std::atomic<bool> any_bad{false};
  at::parallel_for(0, bags, kCheckGrain, [&](int64_t b0, int64_t b1) {
    bool bad = false;
    for (int64_t b = b0; b < b1; ++b) bad |= bag_bad(b);
    if (bad) any_bad.store(true, std::memory_order_relaxed);
  });
  if (!any_bad.load()) return;
  int64_t b = 0;
  while (!bag_bad(b)) ++b;
  raise_bag(op, off, bout, fdim[bf[b]], b, out_name, out_size);
}

// The batch of tbe_forward and tbe_backward_update_ against the layout's `elements` (linear's) and an
// output (the forward's, the backward's output gradient) of `out_size` elements named `out_name`.
// Returns the per-sample weights (None or checked).
c10::optional<at::Tensor> check_batch(const char* op, FTRL_BATCH_PARAMS, int64_t elements,
                                      const char* out_name, int64_t out_size) {
  const int64_t T = table_rows.numel();
  check_index_tensor(op, table_rows, "table_rows");
  check_index_tensor(op, table_w_offset, "table_w_offset", T, " (one per table_rows entry)");
  check_index_tensor(op, table_dim, "table_dim", T, " (one per table_rows entry)");
  check_index_tensor(op, table_row_base, "table_row_base", T, " (one per table_rows entry)");
  check_index_tensor(op, feature_table, "feature_table");
  check_index_tensor(op, bag_feature, "bag_feature");
  const int64_t bags = bag_feature.numel();
  check_index_tensor(op, bag_out_offset, "bag_out_offset", bags, " (one per bag_feature entry)");
  check_index_tensor(op, indices, "indices");
  check_index_tensor(op, offsets, "offsets", bags + 1, " (bag_feature.numel() + 1)");
  TORCH_CHECK_VALUE(pooling_mode == kPoolSum || pooling_mode == kPoolMean || pooling_mode == kPoolNone,
                    "torchrec_ftrl::", op, ": pooling_mode must be ", kPoolSum, " (SUM), ", kPoolMean,
                    " (MEAN) or ", kPoolNone, " (NONE), got ", pooling_mode);
  TORCH_CHECK_VALUE(out_size >= 0, "torchrec_ftrl::", op, ": ", out_name, " must be >= 0, got ", out_size);
  const auto psw = check_psw(op, per_sample_weights, indices.numel());
  TORCH_CHECK_VALUE(!psw || pooling_mode != kPoolNone, "torchrec_ftrl::", op, ": per_sample_weights "
                    "weight pooled bags (SUM, MEAN); pooling_mode NONE takes none");
  check_tables(op, table_w_offset, table_dim, table_rows, table_row_base, table_dims, max_D, total_rows,
               elements);
  check_bags(op, table_dim, feature_table, bag_feature, bag_out_offset, offsets, indices.numel(),
             pooling_mode, max_D, out_name, out_size);
  return psw;
}

// The knobs of the ops' knob tensor (fp32 [kFtrlKnobs], FtrlHp's order: rule_spec.KNOBS), checked as
// FTRLHyperparams checks them (finite; lr > 0, the others >= 0; 0 or a normal fp32 magnitude, and
// shrink2 = 2 s with s one too) and against the flags the ops take with it (knobs.py's knob_flags).
FtrlHp hp_from(const char* op, const at::Tensor& knobs, bool pow_half, bool has_shrink) {
  static_assert(sizeof(FtrlHp) == kFtrlKnobs * sizeof(float), "FtrlHp holds the knobs only");
  static const char* const kNames[kFtrlKnobs] = {"lr", "neg_power", "l1", "l2", "beta", "shrink2"};
  check_cpu(op, knobs, "knobs");
  TORCH_CHECK(knobs.scalar_type() == at::kFloat && knobs.numel() == kFtrlKnobs && knobs.is_contiguous() &&
                  knobs.dim() == 1,
              "torchrec_ftrl::", op, ": knobs must be a contiguous 1-D fp32 tensor of ", kFtrlKnobs,
              " elements, got ", knobs.scalar_type(), " ", knobs.sizes());
  FtrlHp hp;
  std::memcpy(&hp, knobs.data_ptr<float>(), sizeof(FtrlHp));
  float v[kFtrlKnobs];
  std::memcpy(v, &hp, sizeof(v));
  for (int64_t k = 0; k < kFtrlKnobs; ++k) {
    const bool lr = k == 0;
    TORCH_CHECK_VALUE(std::isfinite(v[k]) && (lr ? v[k] > 0.0f : v[k] >= 0.0f), "torchrec_ftrl::", op,
                      ": knob ", kNames[k], " must be finite and ", lr ? "> 0" : ">= 0", ", got ", v[k]);
    const float least = (k == 5 ? 2.0f : 1.0f) * std::numeric_limits<float>::min();
    TORCH_CHECK_VALUE(v[k] == 0.0f || v[k] >= least, "torchrec_ftrl::", op, ": knob ", kNames[k],
                      " must be 0 or >= ", least, " (a normal fp32 magnitude), got ", v[k]);
  }
  TORCH_CHECK_VALUE(pow_half == (hp.neg_power == 0.5f) && has_shrink == (hp.shrink2 != 0.0f),
                    "torchrec_ftrl::", op, ": pow_half=", pow_half, " and has_shrink=", has_shrink,
                    " disagree with the knobs (neg_power=", hp.neg_power, ", shrink2=", hp.shrink2,
                    "): give knob_flags of the knobs");
  return hp;
}

// The arguments of the ops' schemas (ops.py) this kernel does not take (its Capabilities): the fused
// bounds check, the linearised batch and the HBM cache. One that is given raises.
void refuse_unsupported(const char* op, bool check,
                        std::initializer_list<std::pair<const char*, const c10::optional<at::Tensor>*>> args) {
  TORCH_CHECK(!check, "torchrec_ftrl::", op, ": the compiled CPU kernel does not check indices (check=True)");
  for (const auto& a : args) {
    TORCH_CHECK(!a.second->has_value(), "torchrec_ftrl::", op, ": the compiled CPU kernel does not take ",
                a.first, " (the fused bounds check, the linearised batch and the HBM cache are the "
                "Triton kernels')");
  }
}

// Fills `out` (flat, preallocated, any of fp32/fp16/bf16) from stored weights, or from weights
// derived from (linear, accum) with `hp` when `weights` is null. The arguments are checked (tbe_forward).
void forward_into(const at::Tensor* weights, const at::Tensor& accum, const at::Tensor& linear,
                  const at::Tensor& table_w_offset, const at::Tensor& table_dim,
                  const at::Tensor& feature_table, const at::Tensor& bag_feature,
                  const at::Tensor& bag_out_offset, const at::Tensor& indices, const at::Tensor& offsets,
                  const c10::optional<at::Tensor>& psw, int64_t pooling_mode,
                  int64_t max_D, const at::Tensor& table_row_base, bool rowwise, const FtrlHp& hp,
                  bool use_sqrt, at::Tensor& out) {
  const int64_t num_bags = offsets.numel() - 1;
  if (num_bags <= 0) return;
  const int64_t* woff_p = table_w_offset.data_ptr<int64_t>();
  auto run = [&](const auto& rows) {
    FTRL_DISPATCH_FLOATS(out.scalar_type(), "ftrl_fwd_o", [&] {
      using O = scalar_t;
      if (pooling_mode == kPoolNone) {
        forward_sequence<std::decay_t<decltype(rows)>, O>(
            rows, table_dim.data_ptr<int64_t>(), feature_table.data_ptr<int64_t>(),
            bag_feature.data_ptr<int64_t>(), indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
            num_bags, max_D, out.data_ptr<O>());
      } else {
        forward_pooled<std::decay_t<decltype(rows)>, O>(
            rows, table_dim.data_ptr<int64_t>(), feature_table.data_ptr<int64_t>(),
            bag_feature.data_ptr<int64_t>(), bag_out_offset.data_ptr<int64_t>(),
            indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
            psw ? psw->data_ptr<float>() : nullptr, num_bags, max_D, pooling_mode == kPoolMean,
            out.data_ptr<O>());
      }
    });
  };
  if (weights != nullptr) {
    FTRL_DISPATCH_FLOATS(weights->scalar_type(), "ftrl_fwd_w", [&] {
      run(StoredRows<scalar_t>{weights->data_ptr<scalar_t>(), woff_p});
    });
    return;
  }
  with_flag(use_sqrt, [&](auto sqrt_tag) {
    with_flag(rowwise, [&](auto rowwise_tag) {
      with_flag(accum.scalar_type() == at::kBFloat16, [&](auto nb_tag) {
        with_flag(linear.scalar_type() == at::kBFloat16, [&](auto zb_tag) {
          constexpr bool kNB = decltype(nb_tag)::value, kZB = decltype(zb_tag)::value;
          run(DerivedRows<decltype(sqrt_tag)::value, decltype(rowwise_tag)::value, kNB, kZB>{
              static_cast<const StateT<kNB>*>(accum.data_ptr()),
              static_cast<const StateT<kZB>*>(linear.data_ptr()), woff_p,
              table_row_base.data_ptr<int64_t>(), hp});
        });
      });
    });
  });
}

// ------------------------------------------------------------------------------------------ workspace

// Grow-only scratch array (uninitialised), reused across calls of one thread: no per-call page faults.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> data;
  int64_t cap = 0;
  T* get(int64_t n) {
    if (n > cap) {
      data.reset(new T[static_cast<size_t>(n)]);
      cap = n;
    }
    return data.get();
  }
};

struct BackwardWorkspace {
  Scratch<uint64_t> keys, keys_tmp;  // linear row id of each index (sorted in place)
  Scratch<uint32_t> keys32, keys32_tmp;  // the same when every row id fits in 32 bits
  Scratch<int64_t> src, src_tmp;     // element offset of each index's gradient vector in grad_out
  Scratch<float> scale, scale_tmp;   // per-sample weight x 1/L (MEAN) of each index
  Scratch<int64_t> seg_start;        // [U + 1] first sorted slot of each unique row
  Scratch<int64_t> seg_off;          // [U] element offset of each unique row in weights/accum/linear
  Scratch<int32_t> seg_dim;          // [U] D of each unique row
  Scratch<uint64_t> seg_key;         // [U] row key of each unique row (bf16 states only)
};

// ------------------------------------------------------------------------------------------ sort

// Stable LSD radix sort by key (keys < 2^key_bits), carrying an int64 payload and an optional float
// payload. Parallel per pass: each chunk histograms its slice, chunk-major prefix sums keep the sort
// stable, each chunk scatters. Sorts in place using the *_tmp arrays as scratch (the pointers are
// swapped so that on return they name the sorted arrays).
template <typename K>
void radix_sort_pairs(K*& keys, int64_t*& vals, float*& fvals, K*& keys_tmp, int64_t*& vals_tmp,
                      float*& fvals_tmp, int64_t n, int key_bits) {
  if (n <= 1 || key_bits <= 0) return;
  constexpr int kMaxDigitBits = 11;  // at most 2048 buckets
  const int passes = (key_bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = (key_bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit_bits;
  const K mask = static_cast<K>(buckets - 1);
  const int64_t nchunks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 32768));
  const int64_t chunk = (n + nchunks - 1) / nchunks;
  std::vector<int64_t> hist(static_cast<size_t>(nchunks * buckets));
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * digit_bits;
    std::fill(hist.begin(), hist.end(), 0);
    const K* kin = keys;
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t* h = hist.data() + c * buckets;
        const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
        for (int64_t i = lo; i < hi; ++i) ++h[(kin[i] >> shift) & mask];
      }
    });
    int64_t run = 0;
    for (int64_t b = 0; b < buckets; ++b) {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t cnt = hist[c * buckets + b];
        hist[c * buckets + b] = run;
        run += cnt;
      }
    }
    const int64_t* vin = vals;
    const float* fin = fvals;
    K* kout = keys_tmp;
    int64_t* vout = vals_tmp;
    float* fout = fvals_tmp;
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t* h = hist.data() + c * buckets;
        const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t dst = h[(kin[i] >> shift) & mask]++;
          kout[dst] = kin[i];
          vout[dst] = vin[i];
          if (fin != nullptr) fout[dst] = fin[i];
        }
      }
    });
    std::swap(keys, keys_tmp);
    std::swap(vals, vals_tmp);
    std::swap(fvals, fvals_tmp);
  }
}

// ------------------------------------------------------------------------------------------ backward

// Starts loading the cache lines of [p, p + bytes) for writing.
__attribute__((always_inline)) inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 1, 1);
}

// True when x is finite (exponent bits not all ones).
inline bool is_finite_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// Starts loading the stored arrays of unique row s: its weights (unless kDerived), accum (kRowwise:
// one value, at its key) and linear. Always inlined: GCC deletes calls of an out-of-line function
// that only prefetches (it finds it const).
template <bool kDerived, bool kRowwise, typename W, typename N, typename Z>
__attribute__((always_inline)) inline void prefetch_seg(const W* weights, const N* accum, const Z* linear,
                                                        const int64_t* seg_off, const int32_t* seg_dim,
                                                        const uint64_t* seg_key, int64_t s) {
  const int64_t o = seg_off[s];
  const int64_t D = seg_dim[s];
  if constexpr (!kDerived) prefetch_row(weights + o, D * int64_t(sizeof(W)));
  if constexpr (kRowwise) {
    __builtin_prefetch(accum + seg_key[s], 1, 1);
  } else {
    prefetch_row(accum + o, D * int64_t(sizeof(N)));
  }
  prefetch_row(linear + o, D * int64_t(sizeof(Z)));
}

// Stores the fp32 values src[0:D] into a state row: as they are, or (kBf16) stochastically rounded
// with the bits of column d of the row hash h (sr_row).
template <bool kBf16>
inline void store_state_row(StateT<kBf16>* __restrict__ dst, const float* __restrict__ src, int64_t D,
                            uint32_t h) {
  if constexpr (kBf16) {
    for (int64_t d = 0; d < D; ++d) dst[d] = round_bf16_sr(src[d], sr_bits(h, uint32_t(d)));
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d];
  }
}

// The update of the D elements of a row with an element-wise accum: z, n (fp32) in place, the new
// weights into w unless kDerived (then w is unused). wf: fp32 scratch [D].
template <bool kSqrt, bool kDerived, typename W>
inline void element_steps(W* __restrict__ w, float* __restrict__ z, float* __restrict__ n,
                          const float* __restrict__ g, float* __restrict__ wf, int64_t D,
                          const FtrlHp& hp) {
  if constexpr (kDerived) {
    for (int64_t d = 0; d < D; ++d) ftrl_element<kSqrt, true>(0.0f, g[d], z[d], n[d], hp);
  } else if constexpr (std::is_same_v<W, float>) {
    for (int64_t d = 0; d < D; ++d) w[d] = ftrl_element<kSqrt, false>(w[d], g[d], z[d], n[d], hp);
  } else {
    for (int64_t d = 0; d < D; ++d) wf[d] = to_f(w[d]);
    for (int64_t d = 0; d < D; ++d) wf[d] = ftrl_element<kSqrt, false>(wf[d], g[d], z[d], n[d], hp);
    for (int64_t d = 0; d < D; ++d) w[d] = static_cast<W>(wf[d]);
  }
}

// The z and w steps of the D elements of a row with a row-wise accum (its pn_old, pn_new): z (fp32)
// in place, the new weights into w unless kDerived (then w is unused). wf: fp32 scratch [D].
template <bool kDerived, typename W>
inline void row_steps(W* __restrict__ w, float* __restrict__ z, const float* __restrict__ g,
                      float* __restrict__ wf, int64_t D, float pn_old, float pn_new, const FtrlHp& hp) {
  if constexpr (kDerived) {
    for (int64_t d = 0; d < D; ++d) ftrl_step<true>(0.0f, g[d], z[d], pn_old, pn_new, hp);
  } else if constexpr (std::is_same_v<W, float>) {
    for (int64_t d = 0; d < D; ++d) w[d] = ftrl_step<false>(w[d], g[d], z[d], pn_old, pn_new, hp);
  } else {
    for (int64_t d = 0; d < D; ++d) wf[d] = to_f(w[d]);
    for (int64_t d = 0; d < D; ++d) wf[d] = ftrl_step<false>(wf[d], g[d], z[d], pn_old, pn_new, hp);
    for (int64_t d = 0; d < D; ++d) w[d] = static_cast<W>(wf[d]);
  }
}

// kNB / kZB: accum / linear stored in bf16 (then seg_key and step feed the stochastic rounding).
// kDerived: no weight buffer (weights unused); the old weight is prox(z, n) and only z, n are written.
// kRowwise: one accum value per row, at the row's key (seg_key, required): n += sum_d g_d^2 / D.
template <typename W, typename G, bool kSqrt, bool kNB = false, bool kZB = false, bool kDerived = false,
          bool kRowwise = false>
int64_t update_rows(W* __restrict__ weights, StateT<kNB>* __restrict__ accum,
                    StateT<kZB>* __restrict__ linear,
                    const G* __restrict__ grad, const int64_t* __restrict__ src,
                    const float* __restrict__ scale,
                    const int64_t* __restrict__ seg_start, const int64_t* __restrict__ seg_off,
                    const int32_t* __restrict__ seg_dim, int64_t num_seg, int64_t max_D,
                    const FtrlHp& hp, const uint64_t* __restrict__ seg_key = nullptr,
                    uint64_t step = 0) {
  constexpr bool kCompact = kNB || kZB;
  constexpr int64_t kAhead = 4;  // rows prefetched ahead
  std::atomic<int64_t> nonfinite{0};
  at::parallel_for(0, num_seg, 64, [&](int64_t s0, int64_t s1) {
    std::vector<float> buf(static_cast<size_t>((kCompact ? 4 : 2) * max_D));
    float* __restrict__ gsum = buf.data();
    float* __restrict__ wf = buf.data() + max_D;
    float* __restrict__ nf = kCompact ? buf.data() + 2 * max_D : nullptr;  // fp32 accum, linear
    float* __restrict__ zf = kCompact ? buf.data() + 3 * max_D : nullptr;
    const uint32_t seed_n = kCompact ? sr_seed(step, 0) : 0u;
    const uint32_t seed_z = kCompact ? sr_seed(step, 1) : 0u;
    int64_t local_bad = 0;
    for (int64_t s = s0; s < std::min(s1, s0 + kAhead); ++s) {
      prefetch_seg<kDerived, kRowwise>(weights, accum, linear, seg_off, seg_dim, seg_key, s);
    }
    for (int64_t s = s0; s < s1; ++s) {
      if (s + kAhead < s1) {
        prefetch_seg<kDerived, kRowwise>(weights, accum, linear, seg_off, seg_dim, seg_key, s + kAhead);
      }
      const int64_t D = seg_dim[s];
      std::fill(gsum, gsum + D, 0.0f);
      for (int64_t j = seg_start[s]; j < seg_start[s + 1]; ++j) {  // index-position order
        const G* __restrict__ go = grad + src[j];
        if (scale != nullptr) {
          const float c = scale[j];
          for (int64_t d = 0; d < D; ++d) gsum[d] += to_f(go[d]) * c;
        } else {
          for (int64_t d = 0; d < D; ++d) gsum[d] += to_f(go[d]);
        }
      }
      // The non-finite rule: a row whose fp32 sum_d g_d^2 is not finite (a NaN/Inf gradient, or a
      // finite one whose square overflows) is left unchanged and counted.
      const float g2 = sum_squares(gsum, D);
      if (!is_finite_bits(g2)) {
        ++local_bad;
        continue;
      }
      const int64_t off = seg_off[s];
      StateT<kZB>* __restrict__ z = linear + off;
      W* w = kDerived ? nullptr : weights + off;
      if constexpr (kRowwise) {
        // One n per row: its old and new n^(-p), then every element's z and w steps with them.
        const uint64_t key = seg_key[s];
        const float n_old = load_state<kNB>(accum[key]);
        const float n_new = ftrl_row_accum(n_old, g2, static_cast<float>(D));
        const float pn_old = ftrl_power<kSqrt>(n_old, hp);
        const float pn_new = ftrl_power<kSqrt>(n_new, hp);
        if constexpr (kZB) {
          for (int64_t d = 0; d < D; ++d) zf[d] = bf16_bits_to_f(z[d]);
          row_steps<kDerived>(w, zf, gsum, wf, D, pn_old, pn_new, hp);
          store_state_row<true>(z, zf, D, sr_row(seed_z, key));
        } else {
          row_steps<kDerived>(w, z, gsum, wf, D, pn_old, pn_new, hp);
        }
        store_state_row<kNB>(accum + key, &n_new, 1, kNB ? sr_row(seed_n, key) : 0u);
      } else {
        StateT<kNB>* __restrict__ n = accum + off;
        if constexpr (kCompact) {
          // Load (exact upcast), the same fp32 update, store: bf16 states stochastically rounded.
          for (int64_t d = 0; d < D; ++d) {
            nf[d] = load_state<kNB>(n[d]);
            zf[d] = load_state<kZB>(z[d]);
          }
          element_steps<kSqrt, kDerived>(w, zf, nf, gsum, wf, D, hp);
          const uint64_t key = seg_key[s];
          store_state_row<kNB>(n, nf, D, kNB ? sr_row(seed_n, key) : 0u);
          store_state_row<kZB>(z, zf, D, kZB ? sr_row(seed_z, key) : 0u);
        } else {
          element_steps<kSqrt, kDerived>(w, z, n, gsum, wf, D, hp);
        }
      }
    }
    if (local_bad) nonfinite.fetch_add(local_bad, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

// The unique rows of a batch and, in row order, the gradient source of each of their indices.
struct SortedIndices {
  const int64_t* src = nullptr;    // [N] grad_out element offset of each index, sorted by row
  const float* scale = nullptr;    // [N] its scale (psw x 1/L), or null when all are 1
  const int64_t* seg_start = nullptr;  // [U + 1]
  const int64_t* seg_off = nullptr;    // [U] element offset of the row in weights/accum/linear
  const int32_t* seg_dim = nullptr;    // [U] its D
  const uint64_t* seg_key = nullptr;   // [U] its row key (with want_keys), else null
  int64_t U = 0;
};

// Steps 1-3 of the backward: per-index linear row id (key), gradient offset and scale (parallel over
// bags); stable radix sort by row (ties keep index-position order, so each row's summation order
// is fixed: deterministic); one segment per unique row. K: uint32_t when every row id fits.
template <typename K>
SortedIndices sort_by_row(BackwardWorkspace& ws, Scratch<K>& kbuf, Scratch<K>& kbuf_tmp,
                          const std::vector<uint64_t>& row_base, int key_bits, int64_t N,
                          int64_t num_bags, const int64_t* feat_tab, const int64_t* bag_feat,
                          const int64_t* bag_out, const int64_t* off_p, const int64_t* idx_p,
                          const float* psw_p, bool mean, bool none, int64_t max_D,
                          const int64_t* woff_p, const int64_t* dim_p, bool want_keys) {
  K* keys = kbuf.get(N);
  K* keys_tmp = kbuf_tmp.get(N);
  int64_t* src = ws.src.get(N);
  int64_t* src_tmp = ws.src_tmp.get(N);
  const bool scaled = psw_p != nullptr || mean;
  float* scale = scaled ? ws.scale.get(N) : nullptr;
  float* scale_tmp = scaled ? ws.scale_tmp.get(N) : nullptr;
  at::parallel_for(0, num_bags, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint64_t base = row_base[feat_tab[bag_feat[b]]];
      const int64_t start = off_p[b], end = off_p[b + 1];
      const float inv_len = mean ? 1.0f / static_cast<float>(end - start) : 1.0f;
      for (int64_t i = start; i < end; ++i) {
        keys[i] = static_cast<K>(base + static_cast<uint64_t>(idx_p[i]));
        src[i] = none ? i * max_D : bag_out[b];
        if (scale != nullptr) scale[i] = (psw_p != nullptr ? psw_p[i] : 1.0f) * inv_len;
      }
    }
  });
  radix_sort_pairs<K>(keys, src, scale, keys_tmp, src_tmp, scale_tmp, N, key_bits);
  // Unique rows: keys ascend, so the table of a key only moves forward.
  int64_t* seg_start = ws.seg_start.get(N + 1);
  int64_t* seg_off = ws.seg_off.get(N);
  int32_t* seg_dim = ws.seg_dim.get(N);
  uint64_t* seg_key = want_keys ? ws.seg_key.get(N) : nullptr;
  int64_t U = 0;
  int64_t t = 0;
  for (int64_t j = 0; j < N; ++j) {
    if (j == 0 || keys[j] != keys[j - 1]) {
      const uint64_t key = keys[j];
      while (key >= row_base[t + 1]) ++t;
      seg_start[U] = j;
      seg_off[U] = woff_p[t] + static_cast<int64_t>(key - row_base[t]) * dim_p[t];
      seg_dim[U] = static_cast<int32_t>(dim_p[t]);
      if (seg_key != nullptr) seg_key[U] = key;
      ++U;
    }
  }
  seg_start[U] = N;
  SortedIndices si;
  si.src = src;
  si.scale = scale;
  si.seg_start = seg_start;
  si.seg_off = seg_off;
  si.seg_dim = seg_dim;
  si.seg_key = seg_key;
  si.U = U;
  return si;
}

// The arguments of tbe_backward_update_ but the knobs (hp_from): the layout, the batch against
// grad_out (the output gradient: fp32, fp16 or bf16, contiguous, on the CPU; its numel is the output
// size), nonfinite_rows (int64 [1]) and step (int64 [1], required with a bf16 state). Returns the
// per-sample weights (None or checked).
c10::optional<at::Tensor> check_backward(const char* op, const at::Tensor* weights, const at::Tensor& accum,
                                         const at::Tensor& linear, bool rowwise, FTRL_BATCH_PARAMS,
                                         const at::Tensor& grad_out, const at::Tensor& nonfinite_rows,
                                         const c10::optional<at::Tensor>& step) {
  check_layout(op, weights, accum, linear, rowwise, total_rows);
  check_cpu(op, grad_out, "grad_out");
  TORCH_CHECK(is_float_type(grad_out.scalar_type()) && grad_out.is_contiguous() && grad_out.dim() == 1,
              "torchrec_ftrl::", op, ": grad_out must be contiguous 1-D fp32, fp16 or bf16, got ", grad_out.scalar_type(), " ",
              grad_out.sizes(), " strides ", grad_out.strides());
  check_cpu(op, nonfinite_rows, "nonfinite_rows");
  TORCH_CHECK(nonfinite_rows.scalar_type() == at::kLong && nonfinite_rows.dim() == 1 && nonfinite_rows.numel() == 1, "torchrec_ftrl::",
              op, ": nonfinite_rows must be int64 [1], got ", nonfinite_rows.scalar_type(), " ",
              nonfinite_rows.sizes());
  const bool bf16_state = accum.scalar_type() == at::kBFloat16 || linear.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(!bf16_state || step.has_value(), "torchrec_ftrl::", op, ": a bf16 optimizer state "
                    "needs step (the TBE's iter) for its stochastic rounding, got None");
  if (step.has_value()) {
    check_cpu(op, *step, "step");
    TORCH_CHECK(step->scalar_type() == at::kLong && step->dim() == 1 && step->numel() == 1, "torchrec_ftrl::", op,
                ": step must be int64 [1], got ", step->scalar_type(), " ", step->sizes());
  }
  return check_batch(op, FTRL_BATCH_ARGS, linear.numel(), "grad_out.numel()", grad_out.numel());
}

// torchrec_ftrl::tbe_backward_update_ (ops.py): weights None for derived weights, `rowwise` for a
// row-wise accum (one value per row, at the row's key).
void backward_update(const c10::optional<at::Tensor>& weights_opt, at::Tensor& accum, at::Tensor& linear,
                     bool rowwise, FTRL_BATCH_PARAMS, const at::Tensor& grad_out, const at::Tensor& knobs,
                     bool pow_half, bool has_shrink, at::Tensor& nonfinite_rows,
                     const c10::optional<at::Tensor>& step_opt, bool check,
                     const c10::optional<at::Tensor>& lin_key, const c10::optional<at::Tensor>& lin_gofs,
                     const c10::optional<at::Tensor>& lin_scale, const c10::optional<at::Tensor>& lin_tid,
                     FTRL_CACHE_PARAMS) {
  const char* op = "tbe_backward_update_";
  refuse_unsupported(op, check, {{"lin_key", &lin_key}, {"lin_gofs", &lin_gofs},
                     {"lin_scale", &lin_scale}, {"lin_tid", &lin_tid}, FTRL_CACHE_ARGS});
  const at::Tensor* weights = stored_weights(weights_opt);
  const auto psw = check_backward(op, weights, accum, linear, rowwise, FTRL_BATCH_ARGS, grad_out,
                                  nonfinite_rows, step_opt);
  const FtrlHp hp = hp_from(op, knobs, pow_half, has_shrink);
  const bool nb = accum.scalar_type() == at::kBFloat16;
  const bool zb = linear.scalar_type() == at::kBFloat16;
  const int64_t T = table_rows.numel();
  const int64_t* rows_p = table_rows.data_ptr<int64_t>();
  std::vector<uint64_t> row_base(static_cast<size_t>(T) + 1);
  for (int64_t t = 0; t < T; ++t) row_base[t + 1] = row_base[t] + static_cast<uint64_t>(rows_p[t]);
  const uint64_t rows_total = row_base[T];
  const int64_t N = indices.numel();
  const int64_t num_bags = offsets.numel() - 1;
  if (N == 0 || num_bags <= 0) return;
  const int64_t step = (nb || zb) ? step_opt->item<int64_t>() : 0;

  const int64_t* dim_p = table_dim.data_ptr<int64_t>();
  const int64_t* woff_p = table_w_offset.data_ptr<int64_t>();
  int key_bits = 0;
  while (key_bits < 64 && ((rows_total - 1) >> key_bits) != 0) ++key_bits;

  thread_local BackwardWorkspace ws;
  const bool mean = pooling_mode == kPoolMean;
  const float* psw_p = psw ? psw->data_ptr<float>() : nullptr;
  const bool want_keys = nb || zb || rowwise;  // the stochastic rounding's and the row-wise accum's
  SortedIndices si;
  if (key_bits <= 32) {
    si = sort_by_row<uint32_t>(ws, ws.keys32, ws.keys32_tmp, row_base, key_bits, N, num_bags,
                               feature_table.data_ptr<int64_t>(), bag_feature.data_ptr<int64_t>(),
                               bag_out_offset.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                               indices.data_ptr<int64_t>(), psw_p, mean,
                               pooling_mode == kPoolNone, max_D, woff_p, dim_p, want_keys);
  } else {
    si = sort_by_row<uint64_t>(ws, ws.keys, ws.keys_tmp, row_base, key_bits, N, num_bags,
                               feature_table.data_ptr<int64_t>(), bag_feature.data_ptr<int64_t>(),
                               bag_out_offset.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                               indices.data_ptr<int64_t>(), psw_p, mean,
                               pooling_mode == kPoolNone, max_D, woff_p, dim_p, want_keys);
  }
  // 4. Sum + FTRL per unique row, parallel over rows; the layout and state dtypes are template flags.
  int64_t bad = 0;
  auto update = [&](auto derived_tag, auto w_tag) {
    constexpr bool kDerived = decltype(derived_tag)::value;
    using W = typename decltype(w_tag)::type;
    FTRL_DISPATCH_FLOATS(grad_out.scalar_type(), "ftrl_bwd_g", [&] {
      using G = scalar_t;
      bad = with_flag(pow_half, [&](auto sqrt_tag) {
        return with_flag(rowwise, [&](auto rowwise_tag) {
          return with_flag(nb, [&](auto nb_tag) {
            return with_flag(zb, [&](auto zb_tag) {
              constexpr bool kNB = decltype(nb_tag)::value, kZB = decltype(zb_tag)::value;
              return update_rows<W, G, decltype(sqrt_tag)::value, kNB, kZB, kDerived,
                                 decltype(rowwise_tag)::value>(
                  kDerived ? nullptr : weights->data_ptr<W>(), static_cast<StateT<kNB>*>(accum.data_ptr()),
                  static_cast<StateT<kZB>*>(linear.data_ptr()), grad_out.data_ptr<G>(), si.src, si.scale,
                  si.seg_start, si.seg_off, si.seg_dim, si.U, max_D, hp, si.seg_key,
                  static_cast<uint64_t>(step));
            });
          });
        });
      });
    });
  };
  if (weights == nullptr) {
    update(std::true_type{}, TypeTag<float>{});
  } else {
    FTRL_DISPATCH_FLOATS(weights->scalar_type(), "ftrl_bwd_w", [&] {
      update(std::false_type{}, TypeTag<scalar_t>{});
    });
  }
  if (bad) nonfinite_rows.add_(bad);
}

// FATAL-mode input check, parallel over bags: the number of problems in (offsets, indices) - offsets
// not starting at 0, decreasing, or not ending at N (empty offsets: 1), plus indices outside [0, rows of
// the bag's table). 0 means valid. Reads only, never outside its arrays (a bag whose offsets are bad is
// counted, its indices not read); the caller builds the detailed error message when it is not 0.
// Raises for inconsistent arguments: a tensor not int64 contiguous 1-D on the CPU, bag_feature not
// one per bag, a feature_table or bag_feature entry out of range.
int64_t count_invalid_scalar(const at::Tensor& table_rows, const at::Tensor& feature_table,
                             const at::Tensor& bag_feature, const at::Tensor& indices,
                             const at::Tensor& offsets) {
  const char* op = "tbe_count_invalid";
  check_index_tensor(op, table_rows, "table_rows");
  check_index_tensor(op, feature_table, "feature_table");
  check_index_tensor(op, indices, "indices");
  check_index_tensor(op, offsets, "offsets");
  if (offsets.numel() == 0) {  // no bag structure at all: one problem (bag_feature's type still checked)
    check_index_tensor(op, bag_feature, "bag_feature");
    return 1;
  }
  check_index_tensor(op, bag_feature, "bag_feature", offsets.numel() - 1, " (offsets.numel() - 1: one per bag)");
  check_entries(op, feature_table, "feature_table", table_rows.numel());
  check_entries(op, bag_feature, "bag_feature", feature_table.numel());
  const int64_t* rows_p = table_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < table_rows.numel(); ++t) {
    TORCH_CHECK_VALUE(rows_p[t] >= 0, "torchrec_ftrl::", op, ": table_rows[", t, "]=", rows_p[t], " must be >= 0");
  }
  const int64_t n = indices.numel();
  const int64_t num_bags = offsets.numel() - 1;
  if (num_bags < 0) return 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t* bf = bag_feature.data_ptr<int64_t>();
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* rows = table_rows.data_ptr<int64_t>();
  if (off[0] != 0 || off[num_bags] != n) return 1;
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, num_bags, 1024, [&](int64_t b0, int64_t b1) {
    int64_t local = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t s = off[b], e = off[b + 1];
      if (s > e || s < 0 || e > n) {
        ++local;
        continue;
      }
      const int64_t r = rows[ft[bf[b]]];
      for (int64_t i = s; i < e; ++i) local += static_cast<int64_t>(idx[i] < 0) | (idx[i] >= r);
    }
    bad += local;
  });
  return bad.load();
}

// torchrec_ftrl::tbe_forward: the flat output [out_numel] in out_dtype (zeros for empty bags). `warn`
// (int64 [1]) is checked but never read or written: this kernel takes no fused check (check=False).
at::Tensor tbe_forward(const c10::optional<at::Tensor>& weights_opt, const at::Tensor& accum,
                       const at::Tensor& linear, bool rowwise, FTRL_BATCH_PARAMS, const at::Tensor& knobs,
                       bool pow_half, bool has_shrink, int64_t out_numel, at::ScalarType out_dtype,
                       at::Tensor& warn, bool check, const c10::optional<at::Tensor>& row_keys,
                       FTRL_CACHE_PARAMS) {
  const char* op = "tbe_forward";
  refuse_unsupported(op, check, {{"row_keys", &row_keys}, FTRL_CACHE_ARGS});
  check_cpu(op, warn, "warn");
  TORCH_CHECK(warn.scalar_type() == at::kLong && warn.dim() == 1 && warn.numel() == 1, "torchrec_ftrl::",
              op, ": warn must be int64 [1], got ", warn.scalar_type(), " ", warn.sizes());
  const at::Tensor* weights = stored_weights(weights_opt);
  check_layout(op, weights, accum, linear, rowwise, total_rows);
  TORCH_CHECK_VALUE(is_float_type(out_dtype), "torchrec_ftrl::", op, ": out_dtype must be fp32, fp16 or "
                    "bf16, got ", out_dtype);
  const auto psw = check_batch(op, FTRL_BATCH_ARGS, linear.numel(), "out_numel", out_numel);
  const FtrlHp hp = hp_from(op, knobs, pow_half, has_shrink);
  const auto options = linear.options().dtype(out_dtype);
  at::Tensor out = at::zeros({out_numel}, options);  // elements no bag writes read as 0
  forward_into(weights, accum, linear, table_w_offset, table_dim, feature_table, bag_feature,
               bag_out_offset, indices, offsets, psw, pooling_mode, max_D, table_row_base, rowwise, hp,
               pow_half, out);
  return out;
}

// torchrec_ftrl::tbe_count_invalid: int64 [1], the count of count_invalid_scalar.
at::Tensor tbe_count_invalid(const at::Tensor& table_rows, const at::Tensor& feature_table,
                             const at::Tensor& bag_feature, const at::Tensor& indices,
                             const at::Tensor& offsets) {
  return at::full({1}, count_invalid_scalar(table_rows, feature_table, bag_feature, indices, offsets),
                  indices.options().dtype(at::kLong));
}

}  // namespace

// The schemas are defined in torchrec_ftrl/kernels/ops.py; this library adds their CPU kernels.
TORCH_LIBRARY_IMPL(torchrec_ftrl, CPU, m) {
  m.impl("tbe_forward", &tbe_forward);
  m.impl("tbe_count_invalid", &tbe_count_invalid);
  m.impl("tbe_backward_update_", &backward_update);
}
