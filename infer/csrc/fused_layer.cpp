// A packed Llama-shaped decoder layer's two halves around its attention (docs/ARCHITECTURE.md "Fused
// layer"): the same ATen linears as infer/scripted_layer.py, and everything between them (RMSNorm, the
// rotation, the K/V write, SiLU * up, the residual adds) as plain loops instead of ~40 ATen kernels a
// layer. Each loop rounds where PyTorch's CPU kernels round, so the bits are the TorchScript halves' (and
// so HF's): fp32 statistics summed in the order of PyTorch's sum kernel, and a round to bf16 after every
// op that PyTorch runs as its own bf16 kernel. infer/fused_layer.py checks that on a probe before use.
// Built with -ffp-contract=off: a fused multiply-add would round once where PyTorch rounds twice.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<BFloat16>;

inline float bf16_round(float x) { return static_cast<float>(BFloat16(x)); }

// The sum of x[0, n) in the order of PyTorch's CPU sum over a contiguous last dim (SumKernel.cpp:
// vectorized_inner_sum -> row_sum with 4 partial vectors -> multi_row_sum's cascade of 4 levels), so a
// row's mean has the bits of `x.pow(2).mean(-1)`. That kernel runs on 8-float vectors even where the
// elementwise kernels run at AVX512 (measured: its sums match 8 lanes, not 16), so the lanes here are 8.
struct Lanes {
  static constexpr int64_t W = 8;
  float v[W] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  void add(const float* x) {
    for (int64_t l = 0; l < W; ++l) v[l] = v[l] + x[l];
  }
  void add(const Lanes& o) { add(o.v); }
};

float inner_sum(const float* x, int64_t n) {
  constexpr int64_t W = Lanes::W, kIlp = 4, kLevels = 4;
  const int64_t nvec = n / W, rows = nvec / kIlp;
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < rows) ++log2;
  const int64_t power = std::max(int64_t(4), log2 / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  Lanes acc[kLevels][kIlp];
  auto row = [&](int64_t i, int64_t k) { return x + (i * kIlp + k) * W; };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(row(i, k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k] = Lanes();
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(row(i, k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k].add(acc[j][k]);
  Lanes total = acc[0][0];
  for (int64_t r = rows * kIlp; r < nvec; ++r) total.add(x + r * W);
  for (int64_t k = 1; k < kIlp; ++k) total.add(acc[0][k]);
  float out = 0.f;
  for (int64_t k = nvec * W; k < n; ++k) out += x[k];
  for (int64_t k = 0; k < W; ++k) out += total.v[k];
  return out;
}

// transformers' LlamaRMSNorm on each of `rows` rows of x [rows, H]: fp32 statistics, cast back, weight.
void rms_norm_rows(const BFloat16* x, const BFloat16* w, float eps, int64_t rows, int64_t H, BFloat16* out) {
  std::vector<float> sq(H);
  for (int64_t r = 0; r < rows; ++r) {
    const BFloat16* xr = x + r * H;
    for (int64_t i = 0; i < H; ++i) {
      const float f = xr[i];
      sq[i] = f * f;
    }
    const float rs = 1.f / std::sqrt(inner_sum(sq.data(), H) / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i)
      out[r * H + i] = BFloat16(static_cast<float>(w[i]) * bf16_round(static_cast<float>(xr[i]) * rs));
  }
}

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

// x @ W.T + b with W packed by mkldnn::_reorder_linear_weight: the call infer/scripted_layer.py makes.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<LinearPointwise>();
  return op.call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// per_row: one 1-row call per row, for a linear whose rows round differently in a multi-row call.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, bool per_row) {
  const int64_t n = x.size(1);
  if (!per_row || n == 1) return packed_linear(x, w, b).contiguous();
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < n; ++i) outs.push_back(packed_linear(x.narrow(1, i, 1), w, b));
  return at::cat(outs, 1);
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a bf16 CPU tensor");
}

}  // namespace

// x [1, n, H] -> q [1, heads, n, D]: input norm, packed q|k|v, q and k rotated (cos, sin: n x D values
// in row order); k and v are written to kv [2, kv_heads, capacity, D] at slots [start, start + n).
at::Tensor attention_inputs(const at::Tensor& x_in, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
                            const std::optional<at::Tensor>& qkv_bias, const at::Tensor& cos_in,
                            const at::Tensor& sin_in, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            bool per_row, at::Tensor kv, int64_t start) {
  check_bf16(x_in, "x");
  check_bf16(norm_weight, "the norm's weight");
  check_bf16(kv, "kv");
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t n = x.size(1), H = x.size(2), D = head_dim, half = D / 2;
  const int64_t width = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "x must be [1, n, H]");
  TORCH_CHECK(cos.numel() == n * D && sin.numel() == n * D && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16, "cos and sin must hold n x head_dim bf16 values");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.size(1) == kv_heads && kv.size(3) == D && kv.stride(3) == 1 &&
              start >= 0 && start + n <= kv.size(2), "kv must be [2, kv_heads, capacity >= start + n, head_dim]");
  at::Tensor h = at::empty({1, n, H}, x.options());
  rms_norm_rows(x.data_ptr<BFloat16>(), norm_weight.contiguous().data_ptr<BFloat16>(), static_cast<float>(eps), n,
                H, h.data_ptr<BFloat16>());
  const at::Tensor out = linear_rows(h, qkv, qkv_bias, per_row);
  TORCH_CHECK(out.size(2) == width, "q|k|v width ", out.size(2), " is not (heads + 2 kv_heads) x head_dim");
  at::Tensor q = at::empty({1, heads, n, D}, x.options());
  const BFloat16 *op = out.data_ptr<BFloat16>(), *cp = cos.data_ptr<BFloat16>(), *sp = sin.data_ptr<BFloat16>();
  BFloat16 *qp = q.data_ptr<BFloat16>(), *kvp = kv.data_ptr<BFloat16>();
  const int64_t s0 = kv.stride(0), s1 = kv.stride(1), s2 = kv.stride(2);
  for (int64_t r = 0; r < n; ++r) {
    const BFloat16 *row = op + r * width, *c = cp + r * D, *s = sp + r * D;
    for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {  // HF's x * cos + rotate_half(x) * sin, op by op
      const BFloat16* xh = row + hd * D;
      BFloat16* dst = hd < heads ? qp + (hd * n + r) * D : kvp + (hd - heads) * s1 + (start + r) * s2;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -static_cast<float>(xh[d + half]) : static_cast<float>(xh[d - half]);
        const float a = bf16_round(static_cast<float>(xh[d]) * static_cast<float>(c[d]));
        const float b = bf16_round(rot * static_cast<float>(s[d]));
        dst[d] = BFloat16(a + b);
      }
    }
    for (int64_t hd = 0; hd < kv_heads; ++hd)
      std::memcpy(kvp + s0 + hd * s1 + (start + r) * s2, row + (heads + kv_heads + hd) * D, D * sizeof(BFloat16));
  }
  return q;
}

// The rest of the layer: x + o(attn), then + down(silu(gate) * up) of its post-attention norm.
// x [1, n, H], attn [1, n, heads x D]; per_row: [qkv, o, gate_up, down] called a row at a time.
at::Tensor output_and_mlp(const at::Tensor& x_in, const at::Tensor& attn, const at::Tensor& o,
                          const std::optional<at::Tensor>& o_bias, const at::Tensor& norm_weight, double eps,
                          const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_bias,
                          const at::Tensor& down, const std::optional<at::Tensor>& down_bias,
                          std::vector<bool> per_row) {
  check_bf16(x_in, "x");
  check_bf16(norm_weight, "the norm's weight");
  TORCH_CHECK(per_row.size() >= 4, "per_row must name [qkv, o, gate_up, down]");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(1), H = x.size(2);
  const at::Tensor attn_out = linear_rows(attn, o, o_bias, per_row[1]);
  TORCH_CHECK(attn_out.numel() == n * H, "o's output is not [1, n, H]");
  at::Tensor x1 = at::empty({1, n, H}, x.options()), h = at::empty({1, n, H}, x.options());
  const BFloat16 *xp = x.data_ptr<BFloat16>(), *ap = attn_out.data_ptr<BFloat16>();
  BFloat16* x1p = x1.data_ptr<BFloat16>();
  for (int64_t i = 0; i < n * H; ++i) x1p[i] = BFloat16(static_cast<float>(xp[i]) + static_cast<float>(ap[i]));
  rms_norm_rows(x1p, norm_weight.contiguous().data_ptr<BFloat16>(), static_cast<float>(eps), n, H,
                h.data_ptr<BFloat16>());
  const at::Tensor gu = linear_rows(h, gate_up, gate_up_bias, per_row[2]);
  const int64_t I = gu.size(2) / 2;
  at::Tensor act = at::empty({1, n, I}, x.options());
  const BFloat16* gp = gu.data_ptr<BFloat16>();
  BFloat16* actp = act.data_ptr<BFloat16>();
  const Vec one(1.f);
  alignas(64) BFloat16 silu[BVec::size()];
  for (int64_t r = 0; r < n; ++r) {
    const BFloat16 *g = gp + r * 2 * I, *u = g + I;
    BFloat16* a = actp + r * I;
    int64_t i = 0;
    auto silu_times_up = [&](int64_t off) {  // PyTorch's vectorised bf16 SiLU: fp32 inside, one rounding
      auto [g0, g1] = at::vec::convert_to_float<BFloat16>(BVec::loadu(g + off));
      at::vec::convert_from_float<BFloat16>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp())).store(silu);
      for (int64_t j = 0; j < BVec::size(); ++j)
        a[off + j] = BFloat16(static_cast<float>(silu[j]) * static_cast<float>(u[off + j]));
    };
    for (; i + 2 * BVec::size() <= I; i += 2 * BVec::size()) {  // two vectors a step, as its loop takes them
      silu_times_up(i);
      silu_times_up(i + BVec::size());
    }
    for (; i < I; ++i) {  // and the rest, as its scalar loop
      const float gf = g[i];
      a[i] = BFloat16(bf16_round(gf / (1.f + std::exp(-gf))) * static_cast<float>(u[i]));
    }
  }
  const at::Tensor dn = linear_rows(act, down, down_bias, per_row[3]);
  at::Tensor y = at::empty({1, n, H}, x.options());
  const BFloat16* dp = dn.data_ptr<BFloat16>();
  BFloat16* yp = y.data_ptr<BFloat16>();
  for (int64_t i = 0; i < n * H; ++i) yp[i] = BFloat16(static_cast<float>(x1p[i]) + static_cast<float>(dp[i]));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_inputs", &attention_inputs);
  m.def("output_and_mlp", &output_and_mlp);
}
