// y [M, N] = x [M, D] · w [N, D]ᵀ for the few rows of a decode or verify step (an XLA FFI
// handler). XLA:CPU streams a weight at ~23 GB/s for one row but switches to a packed GEMM
// from two rows on that costs about twice as much for the same bytes (docs/performance.md),
// which is what makes a verify step of 8 tokens cost 2x a decode step. Here the weight is
// streamed once for all M rows, split across the intra-op thread pool by blocks of w rows.
//
// Each output is one dot product accumulated in eight lanes in the order of D and summed
// in a fixed order, so row m's result is bitwise the same whatever M is: the logits of a
// token in a verify step equal those of the decode step that would have produced it.

#include <algorithm>
#include <cstdint>
#include <utility>

#include "parallel.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::Fma;
using specjax::Lanes;
using specjax::Lanes4;
using specjax::Load;
using specjax::ParallelFor;
using specjax::V8;

constexpr int64_t kBlock = 16;  // w rows per unit of work
constexpr int kRows = 8;        // x rows per pass over a block (accumulators in registers)

// Rows [n0, n1) of w against M <= kRows rows of x; M is a template argument so the M
// accumulators live in registers while w streams past.
template <int M>
void Rows(const float* x, const float* w, float* y, int64_t D, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * D;
    V8 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = V8{};
    for (int64_t i = 0; i < D; i += 8) {
      // The row four ahead, one cache line per two steps: with eight rows of x the loop is
      // busy enough that the hardware prefetcher alone falls behind (~8 % at M = 8).
      if ((i & 15) == 0) __builtin_prefetch(wr + 4 * D + i, 0, 3);
      const V8 wv = Load(wr + i);
      for (int m = 0; m < M; ++m) acc[m] = Fma(Load(x + m * D + i), wv, acc[m]);
    }
    int m = 0;
    for (; m + 4 <= M; m += 4) {
      float s[4];
      Lanes4(acc[m], acc[m + 1], acc[m + 2], acc[m + 3], s);
      for (int j = 0; j < 4; ++j) y[(m + j) * N + n] = s[j];
    }
    for (; m < M; ++m) y[m * N + n] = Lanes(acc[m]);
  }
}

using RowsFn = decltype(&Rows<1>);

template <int... Ms>
RowsFn Pick(int64_t m, std::integer_sequence<int, Ms...>) {
  RowsFn fns[] = {&Rows<Ms + 1>...};
  return fns[m - 1];
}

ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("skinny_matmul: expected x [M, D] and w [N, D]");
  const int64_t M = xd[0], D = xd[1], N = wd[0];
  if (M < 1 || M > 16 || D % 8 != 0)
    return ffi::Error::InvalidArgument("skinny_matmul: needs 1 <= M <= 16 and D a multiple of 8");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t blocks = (N + kBlock - 1) / kBlock;

  ParallelFor(pool, blocks, [&](int64_t b) {
    const int64_t n0 = b * kBlock, n1 = n0 + kBlock < N ? n0 + kBlock : N;
    // More than kRows rows: passes of kRows over the block (read again from cache); each
    // output is computed the same way in any pass.
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const RowsFn rows = Pick(std::min<int64_t>(kRows, M - m0), std::make_integer_sequence<int, kRows>{});
      rows(xp + m0 * D, wp, yp + m0 * N, D, N, n0, n1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSkinnyMatmul, SkinnyMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
