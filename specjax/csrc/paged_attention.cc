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

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Eight floats as one value (GCC/Clang vector extension: AVX where the machine has it,
// pairs of SSE registers otherwise).
typedef float V8 __attribute__((vector_size(32)));

inline V8 Load(const float* p) {
  V8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline void Store(float* p, V8 x) { std::memcpy(p, &x, sizeof x); }

typedef int32_t V8i __attribute__((vector_size(32)));

// exp of eight floats: Cody-Waite reduction to r in [-ln2/2, ln2/2] and Cephes' degree-6
// polynomial for expf (within ~2 ulp of libm); 0 below the smallest normal result, so a
// masked score (-inf) gets weight exactly 0. libm's scalar expf, one call per score, was
// the kernel's largest cost at 8 queries per call.
inline V8 Exp(V8 x) {
  const V8i under = x < -87.33654f;
  x = x < -87.33654f ? V8{} - 87.33654f : x;
  x = x > 88.37626f ? V8{} + 88.37626f : x;
  const V8 fx = x * 1.44269504088896341f + 0.5f;
  V8 n = __builtin_convertvector(__builtin_convertvector(fx, V8i), V8);
  n = n > fx ? n - 1.0f : n;  // floor
  const V8 r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V8 y = 1.9875691500e-4f + V8{};
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const V8i bits = (__builtin_convertvector(n, V8i) + 127) << 23;
  V8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? V8{} : y * scale;
}

// Sum of the eight lanes in a fixed order.
inline float Lanes(V8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

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
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const int32_t s = seen[j];
        if (sp_row[s] > pos_row[t]) {
          row[j] = -INFINITY;
          continue;
        }
        const float* key = kb + static_cast<int64_t>(s) * E;
        V8 acc = qv[0] * Load(key);
        for (int i = 1; i < NV; ++i) acc += qv[i] * Load(key + 8 * i);
        row[j] = Lanes(acc) * scale;
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
        for (int i = 0; i < NV; ++i) acc[i] += p * Load(val + 8 * i);
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

ffi::Error PagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
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

  thread_local std::vector<float> scores;
  thread_local std::vector<int32_t> seen;  // slots some query of the row may see
  scores.resize(T * G * S);
  for (int64_t b = 0; b < B; ++b) {
    int32_t max_pos = std::numeric_limits<int32_t>::min();
    for (int64_t t = 0; t < T; ++t) max_pos = pos[b * T + t] > max_pos ? pos[b * T + t] : max_pos;
    seen.clear();
    for (int64_t s = 0; s < S; ++s)
      if (sp[b * S + s] <= max_pos) seen.push_back(static_cast<int32_t>(s));
    for (int64_t kh = 0; kh < K; ++kh)
      head(q.typed_data() + b * T * H * E, k.typed_data() + (l * K + kh) * S * E,
           v.typed_data() + (l * K + kh) * S * E, sp + b * S, pos + b * T, seen, T, G, H, kh, scale,
           scores.data(), S, out->typed_data() + b * T * H * E);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
