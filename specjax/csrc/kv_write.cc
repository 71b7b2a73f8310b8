// Store one layer's new keys and values in the paged pools, in place (an XLA FFI handler
// whose results alias the pools).
//
// XLA writes them as one dynamic_update_slice per token inside a while loop per pool and
// layer, ~3 us an iteration: 0.4-0.5 ms of a verify step of 8 tokens on the S config
// (docs/performance.md, seventh pass). Here it is one call per layer, a row copy per token.
//
// Shapes (letters of specjax/kv.py): pools [L, K, P, Z, E] (float32, or bfloat16: each
// float32 rounded to nearest even, as XLA's convert rounds); layer []; k, v [B, T, K, E] float32;
// page_table [B, Pr]; start [B]. Token t of row b goes to position start[b] + t, i.e. page
// page_table[b, pos / Z], offset pos % Z; positions past the row's Pr * Z slots are dropped.

#include <cstdint>
#include <cstring>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// float32 -> bfloat16, round to nearest even; a NaN stays a (quiet) NaN of the same sign.
inline uint16_t Bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void Put(float* to, const float* from, int64_t n) { std::memcpy(to, from, sizeof(float) * n); }
inline void Put(specjax::BF16* to, const float* from, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i].bits = Bf16(from[i]);
}

template <typename A, typename B>
bool SameShape(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

template <ffi::DataType D>
ffi::Error KvWriteImpl(ffi::Buffer<D> k_pool, ffi::Buffer<D> v_pool, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> page_table,
                       ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<D> k_out,
                       ffi::ResultBuffer<D> v_out) {
  using W = typename specjax::PoolElement<D>::type;
  auto pd = k_pool.dimensions();
  auto nd = k.dimensions();
  auto td = page_table.dimensions();
  if (pd.size() != 5 || nd.size() != 4 || td.size() != 2 || !SameShape(v_pool.dimensions(), pd) ||
      !SameShape(v.dimensions(), nd))
    return ffi::Error::InvalidArgument("kv_write: expected pools [L,K,P,Z,E], k and v [B,T,K,E], page_table [B,Pr]");
  const int64_t L = pd[0], K = pd[1], P = pd[2], Z = pd[3], E = pd[4];
  const int64_t B = nd[0], T = nd[1], Pr = td[1];
  if (nd[2] != K || nd[3] != E || td[0] != B || start.element_count() != B)
    return ffi::Error::InvalidArgument("kv_write: inconsistent shapes");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("kv_write: layer out of range");
  W* kp = reinterpret_cast<W*>(k_out->untyped_data());
  W* vp = reinterpret_cast<W*>(v_out->untyped_data());
  // The results alias the pools (input_output_aliases); should XLA ever hand over fresh
  // buffers, they start as copies of the pools.
  if (kp != k_pool.untyped_data()) std::memcpy(kp, k_pool.untyped_data(), sizeof(W) * k_pool.element_count());
  if (vp != v_pool.untyped_data()) std::memcpy(vp, v_pool.untyped_data(), sizeof(W) * v_pool.element_count());
  const int32_t* table = page_table.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = static_cast<int64_t>(start.typed_data()[b]) + t;
      if (pos < 0 || pos >= Pr * Z) continue;
      const int64_t page = table[b * Pr + pos / Z];
      if (page < 0 || page >= P) return ffi::Error::InvalidArgument("kv_write: page out of range");
      for (int64_t kh = 0; kh < K; ++kh) {
        const int64_t at = (((l * K + kh) * P + page) * Z + pos % Z) * E;
        const int64_t from = ((b * T + t) * K + kh) * E;
        Put(kp + at, k.typed_data() + from, E);
        Put(vp + at, v.typed_data() + from, E);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_KV_WRITE(name, D)                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, KvWriteImpl<D>,           \
                                ffi::Ffi::Bind()                \
                                    .Arg<ffi::Buffer<D>>()      \
                                    .Arg<ffi::Buffer<D>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Ret<ffi::Buffer<D>>()      \
                                    .Ret<ffi::Buffer<D>>());

SPECJAX_KV_WRITE(SpecjaxKvWrite, ffi::F32)
SPECJAX_KV_WRITE(SpecjaxKvWriteBf16, ffi::BF16)
