// Decode / verify attention over the paged KV pool, read in place (an XLA FFI handler).
//
// XLA:CPU runs this attention as a copy of the layer's pool slab plus YNNPACK batched
// matmuls with only T*G query rows, about half of a small model's decode step
// (docs/performance.md, fourth pass). Here each (row, kv head) streams the keys and values
// of the slots it may see once, for all of its T*G queries.
//
// Shapes (letters of specjax/kv.py): q [B, T, H, E]; k, v [L, K, P, Z, E]; layer [];
// slot_pos [B, P*Z] (absolute position a slot holds for the row, INT32_MAX if the row does
// not own it); q_pos [B, T]. Query t of row b sees slot s iff slot_pos[b, s] <= q_pos[b, t].
// Output [B, T, H, E]. Every query is computed the same way whatever T and B are (fixed
// summation order), so a token's attention in a verify step equals its decode-step value.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::Exp;
using specjax::Fma;
using specjax::Lanes;
using specjax::Load;
using specjax::ParallelFor;
using specjax::Store;
using specjax::V8;

// One (row, kv head): its T*G queries against the n slots in `seen` (slot indices, in
// slot order), keys and values at kb / vb + slot * E. NV = E / 8 is a template argument
// so a query and an output row live in registers while the slots stream past.
template <int NV>
void Head(const float* qp, const float* kb, const float* vb, const int32_t* sp_row, const int32_t* pos_row,
          const std::vector<int32_t>& seen, int64_t T, int64_t G, int64_t H, int64_t kh, float scale,
          float* scores, int64_t S, float* out) {
  constexpr int64_t E = 8 * NV;
  const int64_t n = static_cast<int64_t>(seen.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float* qr = qp + (t * H + kh * G + g) * E;
      V8 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = Load(qr + 8 * i);
      float* row = scores + r * S;
      // Four slots at a time: four independent FMA chains (one chain per score is
      // latency-bound); each score is still the same chain as if computed alone.
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const float* k0 = kb + static_cast<int64_t>(seen[j]) * E;
        const float* k1 = kb + static_cast<int64_t>(seen[j + 1]) * E;
        const float* k2 = kb + static_cast<int64_t>(seen[j + 2]) * E;
        const float* k3 = kb + static_cast<int64_t>(seen[j + 3]) * E;
        V8 a0 = qv[0] * Load(k0), a1 = qv[0] * Load(k1), a2 = qv[0] * Load(k2), a3 = qv[0] * Load(k3);
        for (int i = 1; i < NV; ++i) {
          a0 = Fma(qv[i], Load(k0 + 8 * i), a0);
          a1 = Fma(qv[i], Load(k1 + 8 * i), a1);
          a2 = Fma(qv[i], Load(k2 + 8 * i), a2);
          a3 = Fma(qv[i], Load(k3 + 8 * i), a3);
        }
        row[j] = Lanes(a0) * scale;
        row[j + 1] = Lanes(a1) * scale;
        row[j + 2] = Lanes(a2) * scale;
        row[j + 3] = Lanes(a3) * scale;
      }
      for (; j < n; ++j) {
        const float* key = kb + static_cast<int64_t>(seen[j]) * E;
        V8 acc = qv[0] * Load(key);
        for (int i = 1; i < NV; ++i) acc = Fma(qv[i], Load(key + 8 * i), acc);
        row[j] = Lanes(acc) * scale;
      }
      float m = -INFINITY;
      for (j = 0; j < n; ++j) {
        if (sp_row[seen[j]] > pos_row[t]) row[j] = -INFINITY;
        m = row[j] > m ? row[j] : m;
      }
      // Every score goes through the same vector exp (the tail padded with -inf) and is
      // summed in slot order, so a query's weights do not depend on which other queries
      // share the call.
      for (int64_t j = 0; j < n; j += 8) {
        const int64_t w = n - j < 8 ? n - j : 8;
        V8 chunk = V8{} - INFINITY;
        std::memcpy(&chunk, row + j, sizeof(float) * w);
        const V8 p = m == -INFINITY ? V8{} : Exp(chunk - m);
        std::memcpy(row + j, &p, sizeof(float) * w);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += row[j];
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      V8 acc[NV];
      for (int i = 0; i < NV; ++i) acc[i] = V8{};
      for (int64_t j = 0; j < n; ++j) {
        const float p = row[j];
        if (p == 0.0f) continue;
        const float* val = vb + static_cast<int64_t>(seen[j]) * E;
        const V8 pv = V8{} + p;
        for (int i = 0; i < NV; ++i) acc[i] = Fma(pv, Load(val + 8 * i), acc[i]);
      }
      float* dst = out + (t * H + kh * G + g) * E;
      for (int i = 0; i < NV; ++i) Store(dst + 8 * i, acc[i] * inv);
    }
  }
}

using HeadFn = decltype(&Head<8>);

HeadFn HeadFor(int64_t e) {
  switch (e) {
    case 16: return &Head<2>;
    case 24: return &Head<3>;
    case 32: return &Head<4>;
    case 48: return &Head<6>;
    case 64: return &Head<8>;
    case 96: return &Head<12>;
    case 128: return &Head<16>;
    default: return nullptr;
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slot_pos,
                              ffi::Buffer<ffi::S32> q_pos, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || slot_pos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: expected q [B,T,H,E], pools [L,K,P,Z,E], slot_pos [B,S]");
  const int64_t B = qd[0], T = qd[1], H = qd[2], E = qd[3];
  const int64_t L = kd[0], K = kd[1], S = kd[2] * kd[3];
  if (kd[4] != E || H % K != 0 || slot_pos.dimensions()[1] != S || slot_pos.dimensions()[0] != B)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  const HeadFn head = HeadFor(E);
  if (head == nullptr) return ffi::Error::InvalidArgument("paged_attention: unsupported head_dim");
  const int64_t G = H / K;
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const float scale = 1.0f / std::sqrt(static_cast<float>(E));
  const int32_t* sp = slot_pos.typed_data();
  const int32_t* pos = q_pos.typed_data();

  // Per row: the slots some query of the row may see, in slot order.
  std::vector<std::vector<int32_t>> seen(B);
  for (int64_t b = 0; b < B; ++b) {
    int32_t max_pos = std::numeric_limits<int32_t>::min();
    for (int64_t t = 0; t < T; ++t) max_pos = pos[b * T + t] > max_pos ? pos[b * T + t] : max_pos;
    for (int64_t s = 0; s < S; ++s)
      if (sp[b * S + s] <= max_pos) seen[b].push_back(static_cast<int32_t>(s));
  }
  ParallelFor(pool, B * K, [&](int64_t u) {
    const int64_t b = u / K, kh = u % K;
    thread_local std::vector<float> scores;
    scores.resize(T * G * S);
    head(q.typed_data() + b * T * H * E, k.typed_data() + (l * K + kh) * S * E,
         v.typed_data() + (l * K + kh) * S * E, sp + b * S, pos + b * T, seen[b], T, G, H, kh, scale,
         scores.data(), S, out->typed_data() + b * T * H * E);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
