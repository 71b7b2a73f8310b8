// Decode / verify attention over the paged KV pool, read in place (an XLA FFI handler).
//
// XLA:CPU runs this attention as a copy of the layer's pool slab plus YNNPACK batched
// matmuls with only T*G query rows, about half of a small model's decode step
// (docs/performance.md, fourth pass). Here each (row, kv head) streams the keys and values
// of the slots it may see once, for all of its T*G queries.
//
// Shapes (letters of specjax/kv.py): q [B, T, H, E]; k, v [L, K, P, Z, E] (float32, or
// bfloat16, widened block by block: half the bytes a step reads from the pool); layer [];
// slots [B, N] (the pool slot, page * Z + offset, holding position n of row b); q_pos
// [B, T]; base [B]; bits [B, T]. Query t of row b sees positions n <= q_pos[b, t], except
// that of the 32 positions base[b] + j it sees only those whose bit j of bits[b, t] is set
// (a tree step: a node sees the committed prefix, its ancestors and itself; a chain passes
// every bit). A row reads only its own positions, in position order, wherever its pages
// lie in the pool. Output [B, T, H, E].
// Every query is computed the same way whatever T, B and the page placement are (fixed
// summation order), so a token's attention in a verify step equals its decode-step value
// and a row's equals its value alone.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "pool.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::Exp;
using specjax::Fma;
using specjax::Lanes;
using specjax::Lanes4;
using specjax::Load;
using specjax::ParallelFor;
using specjax::BF16;
using specjax::Splat;
using specjax::Store;
using specjax::V8;
using specjax::Widen;

constexpr int64_t kSlotBlock = 32;  // slots whose keys (or values) stay in L1 for all queries

// The R = T * G queries of one (row, kv head) against the n slots in `seen` (the slots of
// positions 0 .. n - 1, the row's last position's view, in position order), keys and values at kb / vb + slot * E; q_at
// and out_at give query r's vectors, pos[r / G] its last visible position and bits[r / G]
// which of the 32 positions from base it sees (`Sees`). Slots are taken in blocks
// that stay in L1 while every query passes over them, so keys and values are read from
// memory once per call rather than once per query. NV = E / 8 is a template argument.
//
// Exactness: a query's scores are each one fixed chain; its softmax runs over the scores
// of the positions it sees, in position order, which is the list it would have alone (for
// a tree node: the forward over its own path); slots it does not see get weight exactly 0
// and add exactly nothing to its output. So every query gets the same bits whatever T is.
inline bool Sees(int64_t j, int32_t p, int64_t base, int32_t bits) {
  if (j > p) return false;
  const int64_t d = j - base;
  return d < 0 || d >= 32 || ((static_cast<uint32_t>(bits) >> d) & 1u);
}

// Whether the positions query (p, base, bits) sees among 0 .. n - 1 are exactly 0 .. min(p, n - 1):
// every chain query, and a tree node none of whose window positions up to its own is
// hidden. Its list is then the scores in order, and the softmax needs no test per position.
// (A maximum taken lane by lane is the same value as one taken in order: `x > m ? x : m`
// never picks a NaN, and which zero it keeps does not change exp(x - m).)
inline bool SeesPrefix(int32_t p, int64_t n, int64_t base, int32_t bits) {
  const int64_t last = p < n - 1 ? p : n - 1;
  const int64_t lo = base > 0 ? base : 0, hi = last < base + 31 ? last : base + 31;
  if (hi < lo) return true;
  const int64_t count = hi - lo + 1;
  const uint32_t mask = (count == 32 ? ~0u : ((1u << count) - 1u)) << (lo - base);
  return (static_cast<uint32_t>(bits) & mask) == mask;
}

// Asks for the keys (or values) of slots [j0, j1) to be brought into cache, a line at a
// time, so that the block after the one being computed streams in meanwhile: a row's slots
// jump between pages, and a cache that the weights of every layer pass through holds none
// of them.
template <typename W>
inline void Prefetch(const W* base, const int32_t* seen, int64_t j0, int64_t j1, int64_t E) {
  for (int64_t j = j0; j < j1; ++j) {
    const char* at = reinterpret_cast<const char*>(base + static_cast<int64_t>(seen[j]) * E);
    for (int64_t b = 0; b < E * static_cast<int64_t>(sizeof(W)); b += 64) __builtin_prefetch(at + b);
  }
}

// The keys (or values) of slots [j0, j1) as float32 vectors: at[j - j0] points at slot
// seen[j]'s E entries. A float32 pool is read in place; a bfloat16 block is widened once into
// `buffer` ([kSlotBlock, E], in L1) for all of the call's queries, instead of once per query
// (a verify step's 8-16 tokens times the group's queries widened every entry again: with
// bfloat16 pools an edit's lookup decoding ran at 0.77x its speed with float32 ones).
// Widening is exact, so the scores and outputs are the same bits either way.
template <int NV>
inline void BlockOf(const float* pool, const int32_t* seen, int64_t j0, int64_t j1, float*, const float** at) {
  for (int64_t j = j0; j < j1; ++j) at[j - j0] = pool + static_cast<int64_t>(seen[j]) * (8 * NV);
}

template <int NV>
inline void BlockOf(const BF16* pool, const int32_t* seen, int64_t j0, int64_t j1, float* buffer, const float** at) {
  constexpr int64_t E = 8 * NV;
  for (int64_t j = j0; j < j1; ++j) {
    const BF16* src = pool + static_cast<int64_t>(seen[j]) * E;
    float* dst = buffer + (j - j0) * E;
    for (int i = 0; i < NV; ++i) Store(dst + 8 * i, Widen(src + 8 * i));
    at[j - j0] = dst;
  }
}

// W: the pools' element (float, or BF16 widened exactly to the float it stands for).
template <typename W, int NV>
void Head(const float* const* q_at, float* const* out_at, const int32_t* pos, const int32_t* bits, int64_t base,
          const W* kb, const W* vb, const int32_t* seen, int64_t n, int64_t R, int64_t G, float scale,
          float* scores, float* weights, float* own, V8* accs) {
  constexpr int64_t E = 8 * NV;
  alignas(64) float buffer[kSlotBlock * E];  // a bfloat16 block, widened (`BlockOf`)
  const float* at[kSlotBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kSlotBlock) {
    const int64_t j1 = j0 + kSlotBlock < n ? j0 + kSlotBlock : n;
    Prefetch(kb, seen, j1, j1 + kSlotBlock < n ? j1 + kSlotBlock : n, E);
    Prefetch(vb, seen, j0, j1, E);  // for the value pass: the row's values fit in L2
    BlockOf<NV>(kb, seen, j0, j1, buffer, at);
    for (int64_t r = 0; r < R; ++r) {
      V8 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = Load(q_at[r] + 8 * i);
      float* row = scores + r * n;
      // Four slots at a time: four independent FMA chains (one chain per score is
      // latency-bound) and one horizontal reduction for the four.
      auto four = [&](const float* k0, const float* k1, const float* k2, const float* k3, float* out) {
        V8 a0 = qv[0] * Load(k0), a1 = qv[0] * Load(k1), a2 = qv[0] * Load(k2), a3 = qv[0] * Load(k3);
        for (int i = 1; i < NV; ++i) {
          a0 = Fma(qv[i], Load(k0 + 8 * i), a0);
          a1 = Fma(qv[i], Load(k1 + 8 * i), a1);
          a2 = Fma(qv[i], Load(k2 + 8 * i), a2);
          a3 = Fma(qv[i], Load(k3 + 8 * i), a3);
        }
        Lanes4(a0, a1, a2, a3, out);
      };
      int64_t j = j0;
      for (; j + 4 <= j1; j += 4) {
        const float* const* k = at + (j - j0);
        // Four slots of one page lie one after another: addressed from one pointer (given
        // four, the compiler reloads them from `at` for every line).
        if (k[1] == k[0] + E && k[2] == k[0] + 2 * E && k[3] == k[0] + 3 * E)
          four(k[0], k[0] + E, k[0] + 2 * E, k[0] + 3 * E, row + j);
        else
          four(k[0], k[1], k[2], k[3], row + j);
      }
      for (; j < j1; ++j) {
        const float* key = at[j - j0];
        V8 acc = qv[0] * Load(key);
        for (int i = 1; i < NV; ++i) acc = Fma(qv[i], Load(key + 8 * i), acc);
        row[j] = Lanes(acc);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* row = scores + r * n;
    float* wrow = weights + r * n;
    const int32_t p = pos[r / G], b = bits[r / G];
    // Positions 0 .. end - 1 may be seen; the first `lead` of them all are (every one for a
    // query that sees a prefix; for a tree node, every one before the window of bits), so
    // only the window is tested position by position.
    const int64_t end = p < 0 ? 0 : p + 1 < n ? p + 1 : n;
    const int64_t lead = SeesPrefix(p, n, base, b) ? end : base < 0 ? 0 : base < end ? base : end;
    float m = -INFINITY;
    {
      const V8 sc = Splat(scale);
      V8 mv = V8{} - INFINITY;
      int64_t j = 0;
      for (; j + 8 <= lead; j += 8) {
        const V8 x = Load(row + j) * sc;
        Store(own + j, x);
        mv = x > mv ? x : mv;
      }
      for (int i = 0; i < 8; ++i) m = mv[i] > m ? mv[i] : m;
      for (; j < lead; ++j) {
        own[j] = row[j] * scale;
        m = own[j] > m ? own[j] : m;
      }
    }
    int64_t c = lead;  // the scores of the positions this query sees
    for (int64_t j = lead; j < end; ++j) {
      if (!Sees(j, p, base, b)) continue;
      own[c] = row[j] * scale;
      m = own[c] > m ? own[c] : m;
      ++c;
    }
    // exp of every score through the same vector code (the tail padded with -inf, whose
    // weight is exactly 0), summed in eight lanes in list order.
    V8 sums{};
    int64_t j = 0;
    for (; j + 8 <= c; j += 8) {
      const V8 e = Exp(Load(own + j) - m);
      Store(own + j, e);
      sums += e;
    }
    if (j < c) {
      V8 chunk = V8{} - INFINITY;
      std::memcpy(&chunk, own + j, sizeof(float) * (c - j));
      const V8 e = Exp(chunk - m);
      std::memcpy(own + j, &e, sizeof(float) * (c - j));
      sums += e;
    }
    const float sum = Lanes(sums);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    {
      const V8 iv = Splat(inv);
      int64_t j = 0;
      for (; j + 8 <= lead; j += 8) Store(wrow + j, Load(own + j) * iv);
      for (; j < lead; ++j) wrow[j] = own[j] * inv;
      for (int64_t k = lead; j < n; ++j) wrow[j] = j < end && Sees(j, p, base, b) ? own[k++] * inv : 0.0f;
    }
    for (int i = 0; i < NV; ++i) accs[r * NV + i] = V8{};
  }
  for (int64_t j0 = 0; j0 < n; j0 += kSlotBlock) {
    const int64_t j1 = j0 + kSlotBlock < n ? j0 + kSlotBlock : n;
    BlockOf<NV>(vb, seen, j0, j1, buffer, at);
    int64_t r = 0;
    // Two queries at a time: each value line loaded once feeds both (and twice the
    // independent FMA chains); each query's chain over j is the one it has alone.
    for (; r + 2 <= R; r += 2) {
      const float *w0 = weights + r * n, *w1 = w0 + n;
      V8 a0[NV], a1[NV];
      for (int i = 0; i < NV; ++i) a0[i] = accs[r * NV + i], a1[i] = accs[(r + 1) * NV + i];
      for (int64_t j = j0; j < j1; ++j) {
        const float* val = at[j - j0];
        const V8 p0 = Splat(w0[j]), p1 = Splat(w1[j]);  // weights are >= +0, so the same bits as before
        for (int i = 0; i < NV; ++i) {
          const V8 x = Load(val + 8 * i);
          a0[i] = Fma(p0, x, a0[i]);
          a1[i] = Fma(p1, x, a1[i]);
        }
      }
      for (int i = 0; i < NV; ++i) accs[r * NV + i] = a0[i], accs[(r + 1) * NV + i] = a1[i];
    }
    for (; r < R; ++r) {
      const float* wrow = weights + r * n;
      V8 acc[NV];
      for (int i = 0; i < NV; ++i) acc[i] = accs[r * NV + i];
      for (int64_t j = j0; j < j1; ++j) {
        const float* val = at[j - j0];
        const V8 pv = Splat(wrow[j]);
        for (int i = 0; i < NV; ++i) acc[i] = Fma(pv, Load(val + 8 * i), acc[i]);
      }
      for (int i = 0; i < NV; ++i) accs[r * NV + i] = acc[i];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) Store(out_at[r] + 8 * i, accs[r * NV + i]);
}

template <typename W>
using HeadFn = decltype(&Head<W, 8>);

template <typename W>
HeadFn<W> HeadFor(int64_t e) {
  switch (e) {
    case 16: return &Head<W, 2>;
    case 24: return &Head<W, 3>;
    case 32: return &Head<W, 4>;
    case 48: return &Head<W, 6>;
    case 64: return &Head<W, 8>;
    case 96: return &Head<W, 12>;
    case 128: return &Head<W, 16>;
    default: return nullptr;
  }
}

template <ffi::DataType D>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<D> k, ffi::Buffer<D> v,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                              ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> base, ffi::Buffer<ffi::S32> bits,
                              ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || slots.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: expected q [B,T,H,E], pools [L,K,P,Z,E], slots [B,N]");
  const int64_t B = qd[0], T = qd[1], H = qd[2], E = qd[3];
  const int64_t L = kd[0], K = kd[1], S = kd[2] * kd[3];
  const int64_t N = slots.dimensions()[1];
  if (kd[4] != E || H % K != 0 || slots.dimensions()[0] != B || q_pos.element_count() != B * T ||
      base.element_count() != B || bits.element_count() != B * T)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  using W = typename specjax::PoolElement<D>::type;
  const HeadFn<W> head = HeadFor<W>(E);
  if (head == nullptr) return ffi::Error::InvalidArgument("paged_attention: unsupported head_dim");
  const int64_t G = H / K;
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const float scale = 1.0f / std::sqrt(static_cast<float>(E));
  const int32_t* sl = slots.typed_data();
  const int32_t* pos = q_pos.typed_data();

  // Per row: the slots of the positions its last query may see, in position order.
  std::vector<std::vector<int32_t>> seen(B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t max_pos = -1;
    for (int64_t t = 0; t < T; ++t) max_pos = pos[b * T + t] > max_pos ? pos[b * T + t] : max_pos;
    const int64_t n = max_pos + 1 < N ? max_pos + 1 : N;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t s = sl[b * N + j];
      if (s < 0 || s >= S) return ffi::Error::InvalidArgument("paged_attention: slot out of range");
      seen[b].push_back(s);
    }
  }
  const int64_t R = T * G;
  ParallelFor(pool, B * K, [&](int64_t u) {
    const int64_t b = u / K, kh = u % K, n = static_cast<int64_t>(seen[b].size());
    thread_local std::vector<float> scratch;
    thread_local std::vector<V8> accs;
    thread_local std::vector<const float*> q_at;
    thread_local std::vector<float*> out_at;
    scratch.resize((2 * R + 1) * n);  // scores, weights, one query's compacted scores
    accs.resize(R * (E / 8));
    q_at.resize(R);
    out_at.resize(R);
    for (int64_t r = 0; r < R; ++r) {  // q and out [B, T, H, E] at (b, t, kh * G + g)
      const int64_t at = ((b * T + r / G) * H + kh * G + r % G) * E;
      q_at[r] = q.typed_data() + at;
      out_at[r] = out->typed_data() + at;
    }
    const W* kw = reinterpret_cast<const W*>(k.untyped_data());
    const W* vw = reinterpret_cast<const W*>(v.untyped_data());
    head(q_at.data(), out_at.data(), pos + b * T, bits.typed_data() + b * T, base.typed_data()[b], kw + (l * K + kh) * S * E,
         vw + (l * K + kh) * S * E, seen[b].data(), n, R, G, scale, scratch.data(),
         scratch.data() + R * n, scratch.data() + 2 * R * n, accs.data());
  });
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_PAGED_ATTENTION(name, D)                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PagedAttentionImpl<D>,  \
                                ffi::Ffi::Bind()              \
                                    .Ctx<ffi::ThreadPool>()   \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<D>>()    \
                                    .Arg<ffi::Buffer<D>>()    \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>());

SPECJAX_PAGED_ATTENTION(SpecjaxPagedAttention, ffi::F32)
SPECJAX_PAGED_ATTENTION(SpecjaxPagedAttentionBf16, ffi::BF16)
