// A packed Llama-shaped decoder layer's two halves around its attention, and the draft head's:
// the same ATen linears as infer/cpu/scripted.py, and everything
// between them (RMSNorm, the rotation, the K/V write, SiLU * up, the residual adds) as plain loops instead
// of ~40 ATen kernels a layer. Each loop rounds where PyTorch's CPU kernels round, so the bits are the TorchScript halves' (and
// so HF's): fp32 statistics summed in the order of PyTorch's sum kernel, and a round to bf16 after every
// op that PyTorch runs as its own bf16 kernel. infer/cpu/fused.py checks that on a probe before use.
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

// x @ W.T + b with W packed by mkldnn::_reorder_linear_weight: the call infer/cpu/scripted.py makes.
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

// The packed q|k|v output of n rows -> q [1, heads, n, D], with k and v written to k_cache and v_cache
// [kv_heads, capacity, D] at slots [start, start + n): HF's x * cos + rotate_half(x) * sin, op by op,
// on q and k (cos, sin: n x D values in row order).
at::Tensor rotate_and_write(const at::Tensor& out, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t heads,
                            int64_t kv_heads, int64_t D, at::Tensor& k_cache, at::Tensor& v_cache, int64_t start) {
  const int64_t n = out.size(1), width = (heads + 2 * kv_heads) * D, half = D / 2;
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(out.size(2) == width, "q|k|v width ", out.size(2), " is not (heads + 2 kv_heads) x head_dim");
  TORCH_CHECK(cos.numel() == n * D && sin.numel() == n * D && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16, "cos and sin must hold n x head_dim bf16 values");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    check_bf16(*c, "a K/V cache");
    TORCH_CHECK(c->dim() == 3 && c->size(0) == kv_heads && c->size(2) == D && c->stride(2) == 1 && start >= 0 &&
                start + n <= c->size(1), "K/V caches must be [kv_heads, capacity >= start + n, head_dim]");
  }
  at::Tensor q = at::empty({1, heads, n, D}, out.options());
  const BFloat16 *op = out.data_ptr<BFloat16>(), *cp = cos.data_ptr<BFloat16>(), *sp = sin.data_ptr<BFloat16>();
  BFloat16 *qp = q.data_ptr<BFloat16>(), *kp = k_cache.data_ptr<BFloat16>(), *vp = v_cache.data_ptr<BFloat16>();
  const int64_t kh = k_cache.stride(0), kn = k_cache.stride(1), vh = v_cache.stride(0), vn = v_cache.stride(1);
  for (int64_t r = 0; r < n; ++r) {
    const BFloat16 *row = op + r * width, *c = cp + r * D, *s = sp + r * D;
    for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
      const BFloat16* xh = row + hd * D;
      BFloat16* dst = hd < heads ? qp + (hd * n + r) * D : kp + (hd - heads) * kh + (start + r) * kn;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -static_cast<float>(xh[d + half]) : static_cast<float>(xh[d - half]);
        const float a = bf16_round(static_cast<float>(xh[d]) * static_cast<float>(c[d]));
        const float b = bf16_round(rot * static_cast<float>(s[d]));
        dst[d] = BFloat16(a + b);
      }
    }
    for (int64_t hd = 0; hd < kv_heads; ++hd)
      std::memcpy(vp + hd * vh + (start + r) * vn, row + (heads + kv_heads + hd) * D, D * sizeof(BFloat16));
  }
  return q;
}

// a + b of two bf16 tensors of n values, rounded once (a residual add).
at::Tensor add_bf16(const at::Tensor& a_in, const at::Tensor& b_in) {
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  TORCH_CHECK(a.numel() == b.numel(), "residual shapes differ");
  at::Tensor y = at::empty(a.sizes(), a.options());
  const BFloat16 *ap = a.data_ptr<BFloat16>(), *bp = b.data_ptr<BFloat16>();
  BFloat16* yp = y.data_ptr<BFloat16>();
  for (int64_t i = 0; i < a.numel(); ++i) yp[i] = BFloat16(static_cast<float>(ap[i]) + static_cast<float>(bp[i]));
  return y;
}

// LlamaRMSNorm of x [1, n, H] (contiguous) with its bf16 weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16(weight, "the norm's weight");
  at::Tensor h = at::empty(x.sizes(), x.options());
  rms_norm_rows(x.data_ptr<BFloat16>(), weight.contiguous().data_ptr<BFloat16>(), static_cast<float>(eps),
                x.numel() / x.size(-1), x.size(-1), h.data_ptr<BFloat16>());
  return h;
}

// x + down(silu(gate) * up) of the norm of x: the MLP block with its residual.
at::Tensor mlp_block(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up,
                     const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                     const std::optional<at::Tensor>& down_bias, bool gate_up_rows, bool down_rows) {
  const int64_t n = x.size(1);
  const at::Tensor gu = linear_rows(rms_norm(x, norm_weight, eps), gate_up, gate_up_bias, gate_up_rows);
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
  return add_bf16(x, linear_rows(act, down, down_bias, down_rows));
}

}  // namespace

// Target layer, first half. x [1, n, H] -> q [1, heads, n, D]: input norm, packed q|k|v, q and k rotated
// (cos, sin: n x D values in row order); k and v written to k_cache, v_cache [kv_heads, capacity, D] at
// slots [start, start + n). per_row: the q|k|v linear a row at a time.
at::Tensor attention_inputs(const at::Tensor& x_in, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv,
                            const std::optional<at::Tensor>& qkv_bias, const at::Tensor& cos, const at::Tensor& sin,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, bool per_row, at::Tensor k_cache,
                            at::Tensor v_cache, int64_t start) {
  check_bf16(x_in, "x");
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "x must be [1, n, H]");
  const at::Tensor out = linear_rows(rms_norm(x, norm_weight, eps), qkv, qkv_bias, per_row);
  return rotate_and_write(out, cos, sin, heads, kv_heads, head_dim, k_cache, v_cache, start);
}

// Target layer, second half: x + o(attn), then its MLP block. x [1, n, H], attn [1, n, heads x D];
// per_row: [qkv, o, gate_up, down] called a row at a time.
at::Tensor output_and_mlp(const at::Tensor& x_in, const at::Tensor& attn, const at::Tensor& o,
                          const std::optional<at::Tensor>& o_bias, const at::Tensor& norm_weight, double eps,
                          const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_bias,
                          const at::Tensor& down, const std::optional<at::Tensor>& down_bias,
                          std::vector<bool> per_row) {
  check_bf16(x_in, "x");
  TORCH_CHECK(per_row.size() >= 4, "per_row must name [qkv, o, gate_up, down]");
  const at::Tensor x = add_bf16(x_in, linear_rows(attn, o, o_bias, per_row[1]));
  return mlp_block(x, norm_weight, eps, gate_up, gate_up_bias, down, down_bias, per_row[2], per_row[3]);
}

// The draft head's layer (trainer/head.py), first half: [norm(emb), norm(h)] -> packed q|k|v -> q
// [1, heads, m, D], k and v written to the draft cache at slots [slot, slot + m).
at::Tensor draft_inputs(const at::Tensor& h, const at::Tensor& emb, const at::Tensor& input_norm,
                        const at::Tensor& hidden_norm, double eps, const at::Tensor& qkv, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim, at::Tensor k_cache,
                        at::Tensor v_cache, int64_t slot) {
  check_bf16(h, "h");
  check_bf16(emb, "emb");
  const at::Tensor x = at::cat({rms_norm(emb.contiguous(), input_norm, eps), rms_norm(h.contiguous(), hidden_norm, eps)}, -1);
  return rotate_and_write(linear_rows(x, qkv, std::nullopt, false), cos, sin, heads, kv_heads, head_dim, k_cache,
                          v_cache, slot);
}

// The draft head's layer, second half, and its logits: attn [1, heads, m, D] -> (pre-norm outputs
// [1, m, H], draft logits [1, m, Vd], or [1, 1, Vd] for the last element when last_only).
std::tuple<at::Tensor, at::Tensor> draft_outputs(const at::Tensor& h, const at::Tensor& attn, const at::Tensor& o,
                                                 const at::Tensor& post_norm, double eps, const at::Tensor& gate_up,
                                                 const at::Tensor& down, const at::Tensor& final_norm,
                                                 const at::Tensor& lm_head, bool last_only) {
  check_bf16(h, "h");
  const int64_t m = attn.size(2);
  const at::Tensor a = attn.transpose(1, 2).reshape({1, m, -1});
  const at::Tensor x = mlp_block(add_bf16(h, packed_linear(a, o, std::nullopt)), post_norm, eps, gate_up,
                                 std::nullopt, down, std::nullopt, false, false);
  const at::Tensor y = last_only ? x.narrow(1, m - 1, 1).contiguous() : x;
  return {x, packed_linear(rms_norm(y, final_norm, eps), lm_head, std::nullopt)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_inputs", &attention_inputs);
  m.def("output_and_mlp", &output_and_mlp);
  m.def("draft_inputs", &draft_inputs);
  m.def("draft_outputs", &draft_outputs);
}
