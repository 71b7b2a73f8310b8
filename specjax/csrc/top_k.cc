// The k largest entries of each row of a float32 matrix, as lax.top_k orders them (an XLA
// FFI handler): x [N, V] -> values [N, k], indices [N, k] (int32).
//
// Order: XLA's total order on floats (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN),
// larger first, and the lower index first among equal values. A float's bits b, read as
// a signed integer, sort in that order after b ^ 0x7fffffff where b is negative, so rows
// are compared as those integer keys.
//
// XLA:CPU's TopK sorts a row's indices partially, ~17 us for 8192 entries. Here: split the
// row into k blocks; the least of the blocks' maxima is a key that at least k entries
// reach, so the k largest are all among the entries at or above it. Those candidates
// (a few percent of a row of logits) are found in one vector pass and only they are
// sorted: ~3.5 us a row. Rows are spread over XLA's intra-op threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline int32_t Key(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b < 0 ? b ^ 0x7fffffff : b;
}

// Entries of keys[0 .. n) at or above t, appended to `out` in index order.
void AtLeast(const int32_t* keys, int64_t n, int32_t t, std::vector<int32_t>& out) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256i tv = _mm256_set1_epi32(t - 1);  // key >= t  <=>  key > t - 1 (t > INT32_MIN here)
  for (; i + 8 <= n; i += 8) {
    const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(kv, tv))));
    while (hit) {
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(hit)));
      hit &= hit - 1;
    }
  }
#endif
  for (; i < n; ++i)
    if (keys[i] >= t) out.push_back(static_cast<int32_t>(i));
}

void Row(const float* x, int64_t v, int64_t k, float* values, int32_t* indices, std::vector<int32_t>& keys,
         std::vector<int32_t>& candidates) {
  keys.resize(v);
  for (int64_t i = 0; i < v; ++i) keys[i] = Key(x[i]);
  const int64_t size = v / k;  // k blocks of `size` entries (>= 1, as k <= v), the last with the rest
  int32_t t = INT32_MAX;
  for (int64_t b = 0; b < k; ++b) {
    const int64_t lo = b * size, hi = b == k - 1 ? v : lo + size;
    int32_t m = INT32_MIN;
    for (int64_t i = lo; i < hi; ++i) m = keys[i] > m ? keys[i] : m;
    t = m < t ? m : t;
  }
  candidates.clear();
  if (t == INT32_MIN) {  // a block of -NaNs: every entry is a candidate
    for (int64_t i = 0; i < v; ++i) candidates.push_back(static_cast<int32_t>(i));
  } else {
    AtLeast(keys.data(), v, t, candidates);
  }
  const int32_t* key = keys.data();
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(),
                    [key](int32_t a, int32_t b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
  for (int64_t j = 0; j < k; ++j) {
    indices[j] = candidates[j];
    values[j] = x[candidates[j]];
  }
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t k, ffi::ResultBuffer<ffi::F32> values,
                    ffi::ResultBuffer<ffi::S32> indices) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("top_k: expected x [N, V]");
  const int64_t n = dims[0], v = dims[1];
  if (k < 1 || k > v) return ffi::Error::InvalidArgument("top_k: k must be in [1, V]");
  const float* xs = x.typed_data();
  float* vs = values->typed_data();
  int32_t* is = indices->typed_data();
  specjax::ParallelFor(pool, n, [&](int64_t r) {
    thread_local std::vector<int32_t> keys, candidates;
    Row(xs + r * v, v, k, vs + r * k, is + r * k, keys, candidates);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
