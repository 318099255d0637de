// Compiled CPU kernel of the fused FTRL-Proximal TBE (torchrec_ftrl.FTRLTableBatchedEmbeddingBags).
//
// Layout contract: torchrec_ftrl/kernels/layout.py (TBEBatch). Weights, accum (n) and linear (z) are
// flat 1-D buffers, table after table, row-major; element table_w_offset[t] + r * table_dim[t] + d.
// Bags are feature-major; bag k holds indices[offsets[k]:offsets[k+1]] and writes its pooled D-vector
// at bag_out_offset[k] of the flat output (PoolingMode.NONE: index i writes at i * max_D).
//
// Update rule: shared/docs/FTRL.md (McMahan et al. 2013, Alg. 1, with TensorFlow ApplyFtrlV2's l2
// shrinkage and Keras' beta). It lives in exactly one place below: ftrl_element().
//
// Backward + update is one call: linear row id per index -> stable LSD radix sort of (row, position)
// -> parallel over unique rows: sum the row's gradient contributions in fp32 in index-position order
// (deterministic, independent of the thread count) -> skip+count rows with a NaN/Inf sum -> one FTRL
// update per row, states fp32, weight written back in its own dtype.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int kPoolSum = 0;
constexpr int kPoolMean = 1;
constexpr int kPoolNone = 2;

// FTRL hyperparameters in the fp32 form the kernel computes with.
struct FtrlHp {
  float lr;        // alpha > 0
  float neg_power; // -p >= 0 (used by the pow path only)
  float l1;        // lambda1
  float l2;        // L2 term of q: 2*lambda2 (tensorflow) or lambda2 (mcmahan) = hp.l2_effective
  float beta;      // beta
  float shrink2;   // 2 * l2_shrinkage
};

// THE FTRL-Proximal update of one element (shared/docs/FTRL.md, line for line). `w` is the OLD
// weight, `g` the gradient summed over the row's duplicates; updates `z` (linear) and `n` (accum) in
// place and returns the new weight. kSqrt: p == -0.5, n^0.5 via sqrt; otherwise pow(n, -p).
template <bool kSqrt>
inline float ftrl_element(float w, float g, float& z, float& n, const FtrlHp& hp) {
  const float n_new = n + g * g;  // accum uses the raw gradient
  const float pn_new = kSqrt ? std::sqrt(n_new) : std::pow(n_new, hp.neg_power);
  const float pn_old = kSqrt ? std::sqrt(n) : std::pow(n, hp.neg_power);
  const float sigma = (pn_new - pn_old) / hp.lr;
  const float g_s = g + hp.shrink2 * w;     // l2 shrinkage (s = 0: plain FTRL)
  const float z_new = z + g_s - sigma * w;  // OLD w
  const float q = (hp.beta + pn_new) / hp.lr + hp.l2;
  // Exact zero from the branch |z| > l1 (a select, so the loop vectorises), never from a clamp: when
  // |z| <= l1 the result is exactly 0.0 whatever the candidate is (NaN/Inf if q == 0).
  const float cand = (std::copysign(hp.l1, z_new) - z_new) / q;
  const float w_new = std::fabs(z_new) > hp.l1 ? cand : 0.0f;
  z = z_new;
  n = n_new;
  return w_new;
}

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// ------------------------------------------------------------------------------------------ forward

template <typename W, typename O>
void forward_pooled(const W* __restrict__ weights, const int64_t* table_w_offset,
                    const int64_t* table_dim, const int64_t* feature_table,
                    const int64_t* bag_feature, const int64_t* bag_out_offset,
                    const int64_t* indices, const int64_t* offsets, const float* psw,
                    int64_t num_bags, int64_t max_D, bool mean, O* __restrict__ out) {
  at::parallel_for(0, num_bags, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc_buf(static_cast<size_t>(max_D));
    float* __restrict__ acc = acc_buf.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = feature_table[bag_feature[b]];
      const int64_t D = table_dim[t];
      const W* __restrict__ base = weights + table_w_offset[t];
      const int64_t start = offsets[b], end = offsets[b + 1];
      std::fill(acc, acc + D, 0.0f);
      for (int64_t i = start; i < end; ++i) {
        if (i + 2 < end) {
          __builtin_prefetch(base + indices[i + 2] * D);
        }
        const W* __restrict__ row = base + indices[i] * D;
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

template <typename W, typename O>
void forward_sequence(const W* __restrict__ weights, const int64_t* table_w_offset,
                      const int64_t* table_dim, const int64_t* feature_table,
                      const int64_t* bag_feature, const int64_t* indices, const int64_t* offsets,
                      int64_t num_bags, int64_t max_D, O* __restrict__ out) {
  at::parallel_for(0, num_bags, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = feature_table[bag_feature[b]];
      const int64_t D = table_dim[t];
      const W* __restrict__ base = weights + table_w_offset[t];
      for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) {
        const W* __restrict__ row = base + indices[i] * D;
        O* __restrict__ dst = out + i * max_D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<O>(to_f(row[d]));
      }
    }
  });
}

void check_index_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.dim() == 1, name, " must be contiguous 1-D");
}

c10::optional<at::Tensor> check_psw(const c10::optional<at::Tensor>& psw, int64_t n) {
  if (!psw.has_value() || !psw->defined()) return c10::nullopt;
  TORCH_CHECK(psw->scalar_type() == at::kFloat && psw->is_contiguous() && psw->numel() == n,
              "per_sample_weights must be contiguous fp32 [N]");
  return psw;
}

// Fills `out` (flat, preallocated, any of fp32/fp16/bf16).
void forward(const at::Tensor& weights, const at::Tensor& table_w_offset, const at::Tensor& table_dim,
             const at::Tensor& feature_table, const at::Tensor& bag_feature,
             const at::Tensor& bag_out_offset, const at::Tensor& indices, const at::Tensor& offsets,
             const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling_mode,
             int64_t max_D, at::Tensor& out) {
  for (auto* p : {&table_w_offset, &table_dim, &feature_table, &bag_feature, &bag_out_offset,
                  &indices, &offsets}) {
    check_index_tensor(*p, "TBEBatch tensor");
  }
  TORCH_CHECK(weights.is_contiguous() && out.is_contiguous(), "weights and out must be contiguous");
  const auto psw = check_psw(per_sample_weights, indices.numel());
  const int64_t num_bags = offsets.numel() - 1;
  if (num_bags <= 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "ftrl_fwd_w", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "ftrl_fwd_o", [&] {
      using O = scalar_t;
      if (pooling_mode == kPoolNone) {
        forward_sequence<W, O>(weights.data_ptr<W>(), table_w_offset.data_ptr<int64_t>(),
                               table_dim.data_ptr<int64_t>(), feature_table.data_ptr<int64_t>(),
                               bag_feature.data_ptr<int64_t>(), indices.data_ptr<int64_t>(),
                               offsets.data_ptr<int64_t>(), num_bags, max_D, out.data_ptr<O>());
      } else {
        forward_pooled<W, O>(weights.data_ptr<W>(), table_w_offset.data_ptr<int64_t>(),
                             table_dim.data_ptr<int64_t>(), feature_table.data_ptr<int64_t>(),
                             bag_feature.data_ptr<int64_t>(), bag_out_offset.data_ptr<int64_t>(),
                             indices.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                             psw ? psw->data_ptr<float>() : nullptr, num_bags, max_D,
                             pooling_mode == kPoolMean, out.data_ptr<O>());
      }
    });
  });
}

// ------------------------------------------------------------------------------------------ sort

// Stable LSD radix sort of (key, value) pairs by key, keys < 2^key_bits. Parallel per pass: each
// chunk histograms its slice, chunk-major prefix sums keep the sort stable, each chunk scatters.
// Result is in keys/vals (the tmp buffers are scratch of the same size).
void radix_sort_pairs(std::vector<uint64_t>& keys, std::vector<int64_t>& vals,
                      std::vector<uint64_t>& keys_tmp, std::vector<int64_t>& vals_tmp,
                      int key_bits) {
  const int64_t n = static_cast<int64_t>(keys.size());
  if (n <= 1 || key_bits <= 0) return;
  const int passes = (key_bits + 10) / 11;
  const int digit_bits = (key_bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit_bits;
  const uint64_t mask = static_cast<uint64_t>(buckets - 1);
  const int64_t nchunks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 32768));
  const int64_t chunk = (n + nchunks - 1) / nchunks;
  std::vector<int64_t> hist(static_cast<size_t>(nchunks * buckets));
  uint64_t* kin = keys.data();
  int64_t* vin = vals.data();
  uint64_t* kout = keys_tmp.data();
  int64_t* vout = vals_tmp.data();
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * digit_bits;
    std::fill(hist.begin(), hist.end(), 0);
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
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t* h = hist.data() + c * buckets;
        const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t dst = h[(kin[i] >> shift) & mask]++;
          kout[dst] = kin[i];
          vout[dst] = vin[i];
        }
      }
    });
    std::swap(kin, kout);
    std::swap(vin, vout);
  }
  if (kin != keys.data()) {  // odd number of passes: result lives in the tmp buffers
    keys.swap(keys_tmp);
    vals.swap(vals_tmp);
  }
}

// ------------------------------------------------------------------------------------------ backward

template <typename W, typename G, bool kSqrt>
int64_t update_rows(W* __restrict__ weights, float* __restrict__ accum, float* __restrict__ linear,
                    const int64_t* table_w_offset, const int64_t* table_dim,
                    const int64_t* feature_table, const int64_t* bag_feature,
                    const int64_t* bag_out_offset, const int64_t* indices, const int64_t* offsets,
                    const float* psw, int pooling_mode, int64_t max_D, const G* __restrict__ grad,
                    const std::vector<int64_t>& idx_bag, const std::vector<int64_t>& sorted_pos,
                    const std::vector<int64_t>& seg_start, const FtrlHp& hp) {
  const int64_t num_seg = static_cast<int64_t>(seg_start.size()) - 1;
  std::atomic<int64_t> nonfinite{0};
  at::parallel_for(0, num_seg, 16, [&](int64_t s0, int64_t s1) {
    std::vector<float> gbuf(static_cast<size_t>(max_D));
    float* __restrict__ gsum = gbuf.data();
    int64_t local_bad = 0;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t j0 = seg_start[s], j1 = seg_start[s + 1];
      const int64_t first = sorted_pos[j0];
      const int64_t t = feature_table[bag_feature[idx_bag[first]]];
      const int64_t D = table_dim[t];
      std::fill(gsum, gsum + D, 0.0f);
      for (int64_t j = j0; j < j1; ++j) {  // index-position order: deterministic
        const int64_t pos = sorted_pos[j];
        const int64_t bag = idx_bag[pos];
        float scale = psw != nullptr ? psw[pos] : 1.0f;
        const G* __restrict__ go;
        if (pooling_mode == kPoolNone) {
          go = grad + pos * max_D;
        } else {
          go = grad + bag_out_offset[bag];
          if (pooling_mode == kPoolMean) {
            scale *= 1.0f / static_cast<float>(offsets[bag + 1] - offsets[bag]);
          }
        }
        for (int64_t d = 0; d < D; ++d) gsum[d] += to_f(go[d]) * scale;
      }
      bool finite = true;
      for (int64_t d = 0; d < D; ++d) finite &= std::isfinite(gsum[d]);
      if (!finite) {
        ++local_bad;
        continue;
      }
      const int64_t off = table_w_offset[t] + indices[first] * D;
      W* __restrict__ w = weights + off;
      float* __restrict__ n = accum + off;
      float* __restrict__ z = linear + off;
      for (int64_t d = 0; d < D; ++d) {
        w[d] = static_cast<W>(ftrl_element<kSqrt>(to_f(w[d]), gsum[d], z[d], n[d], hp));
      }
    }
    if (local_bad) nonfinite.fetch_add(local_bad, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

void backward_update(at::Tensor& weights, at::Tensor& accum, at::Tensor& linear,
                     const at::Tensor& table_w_offset, const at::Tensor& table_dim,
                     const at::Tensor& table_rows, const at::Tensor& feature_table,
                     const at::Tensor& bag_feature, const at::Tensor& bag_out_offset,
                     const at::Tensor& indices, const at::Tensor& offsets,
                     const c10::optional<at::Tensor>& per_sample_weights, int64_t pooling_mode,
                     int64_t max_D, const at::Tensor& grad_out, double lr, double power, double l1,
                     double l2_effective, double beta, double l2_shrinkage,
                     at::Tensor& nonfinite_rows) {
  for (auto* p : {&table_w_offset, &table_dim, &table_rows, &feature_table, &bag_feature,
                  &bag_out_offset, &indices, &offsets}) {
    check_index_tensor(*p, "TBEBatch tensor");
  }
  TORCH_CHECK(weights.is_contiguous() && accum.is_contiguous() && linear.is_contiguous() &&
                  grad_out.is_contiguous(),
              "weights, accum, linear and grad_out must be contiguous");
  TORCH_CHECK(accum.scalar_type() == at::kFloat && linear.scalar_type() == at::kFloat,
              "accum and linear must be fp32");
  TORCH_CHECK(nonfinite_rows.scalar_type() == at::kLong && nonfinite_rows.numel() == 1,
              "nonfinite_rows must be int64 [1]");
  const auto psw = check_psw(per_sample_weights, indices.numel());
  const int64_t N = indices.numel();
  const int64_t num_bags = offsets.numel() - 1;
  if (N == 0 || num_bags <= 0) return;

  const int64_t T = table_rows.numel();
  const int64_t* rows_p = table_rows.data_ptr<int64_t>();
  std::vector<uint64_t> row_base(static_cast<size_t>(T));
  uint64_t total_rows = 0;
  for (int64_t t = 0; t < T; ++t) {
    row_base[t] = total_rows;
    total_rows += static_cast<uint64_t>(rows_p[t]);
  }
  int key_bits = 0;
  while (key_bits < 64 && (total_rows - 1) >> key_bits) ++key_bits;

  // 1. Linear row id (key) and bag of every index, parallel over bags.
  const int64_t* feat_tab = feature_table.data_ptr<int64_t>();
  const int64_t* bag_feat = bag_feature.data_ptr<int64_t>();
  const int64_t* off_p = offsets.data_ptr<int64_t>();
  const int64_t* idx_p = indices.data_ptr<int64_t>();
  std::vector<uint64_t> keys(static_cast<size_t>(N)), keys_tmp(static_cast<size_t>(N));
  std::vector<int64_t> pos(static_cast<size_t>(N)), pos_tmp(static_cast<size_t>(N));
  std::vector<int64_t> idx_bag(static_cast<size_t>(N));
  at::parallel_for(0, num_bags, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint64_t base = row_base[feat_tab[bag_feat[b]]];
      for (int64_t i = off_p[b]; i < off_p[b + 1]; ++i) {
        keys[i] = base + static_cast<uint64_t>(idx_p[i]);
        pos[i] = i;
        idx_bag[i] = b;
      }
    }
  });

  // 2. Stable sort by row; ties stay in index-position order.
  radix_sort_pairs(keys, pos, keys_tmp, pos_tmp, key_bits);

  // 3. Segments of equal rows.
  std::vector<int64_t>& seg_start = pos_tmp;  // reuse scratch: at most N + 1 entries needed
  seg_start.clear();
  seg_start.reserve(static_cast<size_t>(N) + 1);
  seg_start.push_back(0);
  for (int64_t j = 1; j < N; ++j) {
    if (keys[j] != keys[j - 1]) seg_start.push_back(j);
  }
  seg_start.push_back(N);

  // 4. Sum + FTRL per unique row, parallel over rows.
  FtrlHp hp;
  hp.lr = static_cast<float>(lr);
  hp.neg_power = static_cast<float>(-power);
  hp.l1 = static_cast<float>(l1);
  hp.l2 = static_cast<float>(l2_effective);
  hp.beta = static_cast<float>(beta);
  hp.shrink2 = static_cast<float>(2.0 * l2_shrinkage);
  const bool use_sqrt = power == -0.5;
  int64_t bad = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "ftrl_bwd_w", [&] {
    using W = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "ftrl_bwd_g", [&] {
      using G = scalar_t;
      auto run = [&](auto sqrt_tag) {
        constexpr bool kSqrt = decltype(sqrt_tag)::value;
        return update_rows<W, G, kSqrt>(
            weights.data_ptr<W>(), accum.data_ptr<float>(), linear.data_ptr<float>(),
            table_w_offset.data_ptr<int64_t>(), table_dim.data_ptr<int64_t>(), feat_tab, bag_feat,
            bag_out_offset.data_ptr<int64_t>(), idx_p, off_p,
            psw ? psw->data_ptr<float>() : nullptr, static_cast<int>(pooling_mode), max_D,
            grad_out.data_ptr<G>(), idx_bag, pos, seg_start, hp);
      };
      bad = use_sqrt ? run(std::true_type{}) : run(std::false_type{});
    });
  });
  if (bad) nonfinite_rows.add_(bad);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused FTRL-Proximal TBE CPU kernel (torchrec_ftrl)";
  m.def("forward", &forward, "Pooled lookup into a preallocated flat output");
  m.def("backward_update", &backward_update,
        "Sum gradients per unique row, then one FTRL update per row, in place");
}
