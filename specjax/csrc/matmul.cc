// y [M, N] = x [M, D] · wᵀ for the rows of a decode, verify or prefill step (an XLA FFI handler),
// with the weight w [N, D] stored as panels [ceil(N/P), D, P]: panel p holds outputs
// P p .. P p + P - 1, column by column (cpu_kernels.pack), P = 64 where the build has
// AVX-512 and 16 otherwise (kPanel; cpu_kernels.panel_width asks the library). XLA:CPU
// streams a weight at ~23 GB/s for one row but switches to a packed GEMM from two rows on
// that costs about twice as much for the same bytes (docs/performance.md); here the weight
// is streamed once for all M rows, split across the intra-op thread pool by units of 64
// outputs. Many rows (a prefill chunk) are passes over a unit while it sits in L2, faster
// than XLA's GEMM here (docs/performance.md).
//
// A panel's column is P / 16 lines of 16 outputs (64 bytes in float32, 32 in 16 bits):
// every row's x[m, k] is broadcast against a line, so a pass keeps 16 outputs per row and
// line in registers and needs no horizontal sums (the earlier kernel, one dot product per
// output in eight lanes, spent nine loads per eight FMAs and ran a verify of 8 rows at
// ~1.5x one row). With AVX-512 a line is one 512-bit vector (one widening and one FMA per
// row and column) and a pass reads a 64-wide panel's columns whole, one sequential stream;
// 16-wide panels read four side by side (four streams 12 kB apart) ran the shipped model's
// matmuls at 0.85-0.9x the speed at one row and 0.8x at 16 on an AMD EPYC (Zen 4), and
// 1.1x at 8 (docs/performance.md). Otherwise a line is a pair of eight-float vectors.
//
// Each output is one FMA chain over k = 0 .. D-1 in order, so row m's result is bitwise the
// same whatever M is and however rows and panels are grouped into passes: the logits of a
// token in a verify step equal those of the decode step that would have produced it.
//
// The panels may hold float32, bfloat16 or float16 (a 16-bit checkpoint kept in 16 bits:
// half the bytes a step streams). A 16-bit panel line is widened to float32 in registers
// (WidenLine); widening is exact, so the FMA chain and every output are bitwise those
// of the same weight stored as float32.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "parallel.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::ParallelFor;

constexpr int64_t kLine = 16;   // outputs per line
constexpr int64_t kGroup = 4;   // lines per unit of work: 64 outputs
constexpr int64_t kBlock = 32;  // columns per int8 scale (llama.cpp's q8_0 block)

#if defined(__AVX512F__)
// A line of 16 outputs in one 512-bit register. Rows per pass: a whole panel's four
// accumulators a row, plus its four lines and a broadcast, fit AVX-512's 32 vector
// registers up to 6 rows; at 7 and 8 rows GCC keeps a few accumulators on the stack (in
// L1), which still beats two passes over the panel (8-20 % at 7 and 8 rows, float32,
// bfloat16 and int8 panels: docs/performance.md, section 3). (int8 passes keep a block sum
// beside each accumulator: more of them on the stack from 4 rows on.)
typedef float Line __attribute__((vector_size(64)));
constexpr int kRows = 8;
constexpr int64_t kPanel = 64;  // a unit's four lines side by side: one stream

inline Line LoadLine(const float* p) { return (Line)_mm512_loadu_ps(p); }
inline Line WidenLine(const float* p) { return LoadLine(p); }
inline Line WidenLine(const specjax::BF16* p) {  // float32's upper half: zero extension and a shift
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (Line)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Line WidenLine(const specjax::F16* p) {
  return (Line)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Line WidenLine(const int8_t* p) {
  return (Line)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Line Splat(float x) { return (Line)_mm512_set1_ps(x); }
inline Line Fma(Line a, Line b, Line c) { return (Line)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline void StoreLine(float* p, Line a) { _mm512_storeu_ps(p, (__m512)a); }
inline float Lane(Line a, int64_t j) { return a[j]; }
#else
// A line of 16 outputs as two eight-float vectors. Rows per pass: 2 accumulators a row,
// plus the line's two vectors and a broadcast, within the vector registers (32 with
// AVX-512VL, 16 with AVX).
struct Line {
  specjax::V8 lo, hi;
};
#if defined(__AVX512VL__)
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif
// A line per panel: a pass of one row reads two panels, more rows one (as many lines as
// registers allow): these streams measured faster here than a 64-wide panel read a quarter
// or half at a time (tiny-code, a -mno-avx512f build on Zen 4: the 64-wide layout ran at
// 0.88-0.93x the speed at one row, 0.8-0.88x at 4 to 16).
constexpr int64_t kPanel = 16;

inline Line LoadLine(const float* p) { return {specjax::Load(p), specjax::Load(p + 8)}; }
template <typename W>
inline Line WidenLine(const W* p) {
  return {specjax::Widen(p), specjax::Widen(p + 8)};
}
inline Line Splat(float x) {
  const specjax::V8 v = specjax::Splat(x);
  return {v, v};
}
inline Line Fma(Line a, Line b, Line c) { return {specjax::Fma(a.lo, b.lo, c.lo), specjax::Fma(a.hi, b.hi, c.hi)}; }
inline void StoreLine(float* p, Line a) { specjax::Store(p, a.lo), specjax::Store(p + 8, a.hi); }
inline float Lane(Line a, int64_t j) { return j < 8 ? a.lo[j] : a.hi[j - 8]; }
#endif

// Lines per pass for M rows: each output is one FMA chain, whose latency (4 cycles) caps a
// pass of one row over one line at a 64-byte line per 4 cycles, below what the caches
// deliver for a model resident in L3; a pass over several lines runs that many chains
// side by side. The chains and their order are the same however lines are grouped, so
// this changes no bits.
constexpr int LinesPerPass(int m) {
#if defined(__AVX512F__)
  return 4;  // a pass reads its panel's columns whole
#else
  return m == 1 ? 2 : 1;  // a line is two vectors here
#endif
}

// Lines g0 .. g0 + NL - 1 (outputs 16 g0 ..) of weights of type W, against M <= kRows rows
// of x; M and NL are template arguments so the accumulators live in registers while the
// weights stream past. Line g's column k is at w + (g / L) * D * kPanel + k * kPanel +
// (g % L) * 16 for L = kPanel / 16 lines per panel. int8 panels (q8:
// cpu_kernels.quantize) come with scales [P, ceil(D/32), kPanel], one per output and block
// of 32 columns: each block's FMA chain runs over q as float32 (exact) into a sum of its
// own, which one more FMA scales into the output's chain (llama.cpp's q8_0 kernels scale a
// block's dot product the same way); a multiply per column and line less than scaling each
// weight first.
template <typename W, int M, int NL>
void Lines(const float* x, const W* w, const float* scales, float* y, int64_t D, int64_t N, int64_t g0) {
  constexpr bool kQ8 = std::is_same_v<W, int8_t>;
  constexpr int64_t L = kPanel / kLine;
  const int64_t blocks = (D + kBlock - 1) / kBlock;
  const W* line0[NL];
  int64_t scale0[NL];
  for (int q = 0; q < NL; ++q) {
    const int64_t g = g0 + q;
    line0[q] = w + (g / L) * D * kPanel + (g % L) * kLine;
    scale0[q] = (g / L) * blocks * kPanel + (g % L) * kLine;
  }
  Line acc[NL][M], block[NL][M];
  for (int q = 0; q < NL; ++q)
    for (int m = 0; m < M; ++m) acc[q][m] = Line{};
  auto& sum = kQ8 ? block : acc;  // where the column FMAs go
  for (int64_t k0 = 0; k0 < D; k0 += kBlock) {
    if constexpr (kQ8)
      for (int q = 0; q < NL; ++q)
        for (int m = 0; m < M; ++m) block[q][m] = Line{};
    for (int64_t k = k0; k < std::min(D, k0 + kBlock); ++k) {
      Line line[NL];
      for (int q = 0; q < NL; ++q) {
        if constexpr (L == 1)  // separate streams: fetched ahead (4 kB: 2 and 8 kB were slower)
          __builtin_prefetch(line0[q] + (k + 4096 / int64_t{sizeof(W) * kPanel}) * kPanel, 0, 0);
        line[q] = WidenLine(line0[q] + k * kPanel);
      }
      for (int m = 0; m < M; ++m) {
        const Line xs = Splat(x[m * D + k]);
        for (int q = 0; q < NL; ++q) sum[q][m] = Fma(xs, line[q], sum[q][m]);
      }
    }
    if constexpr (kQ8)
      for (int q = 0; q < NL; ++q) {
        const Line scale = LoadLine(scales + scale0[q] + (k0 / kBlock) * kPanel);
        for (int m = 0; m < M; ++m) acc[q][m] = Fma(block[q][m], scale, acc[q][m]);
      }
  }
  for (int q = 0; q < NL; ++q) {
    const int64_t n0 = (g0 + q) * kLine;
    if (n0 + kLine <= N) {
      for (int m = 0; m < M; ++m) StoreLine(y + m * N + n0, acc[q][m]);
    } else {  // the last line, zero-padded past N
      for (int m = 0; m < M; ++m)
        for (int64_t j = 0; n0 + j < N; ++j) y[m * N + n0 + j] = Lane(acc[q][m], j);
    }
  }
}

template <typename W>
using LinesFn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t, int64_t);

// Lines<W, m, LinesPerPass(m)> (wide) or Lines<W, m, 1> for m = 1 .. kRows.
template <typename W, int... Ms>
LinesFn<W> Pick(int64_t m, bool wide, std::integer_sequence<int, Ms...>) {
  LinesFn<W> wides[] = {&Lines<W, Ms + 1, LinesPerPass(Ms + 1)>...};
  LinesFn<W> ones[] = {&Lines<W, Ms + 1, 1>...};
  return wide ? wides[m - 1] : ones[m - 1];
}

template <typename W>
void Run(ffi::ThreadPool& pool, const float* xp, const W* wp, const float* sp, float* yp, int64_t M, int64_t D,
         int64_t N) {
  const int64_t lines = (N + kLine - 1) / kLine;
  // More than kRows rows: passes of as many rows each as may be, over the unit's lines
  // (read again from L1/L2).
  const int64_t passes = (M + kRows - 1) / kRows, per = (M + passes - 1) / passes;
  ParallelFor(pool, (lines + kGroup - 1) / kGroup, [&](int64_t u) {
    const int64_t g1 = std::min(lines, (u + 1) * kGroup);
    for (int64_t m0 = 0; m0 < M; m0 += per) {
      const int64_t rows = std::min<int64_t>(per, M - m0);
      const int64_t nl = LinesPerPass(static_cast<int>(rows));
      const auto seq = std::make_integer_sequence<int, kRows>{};
      const LinesFn<W> wide = Pick<W>(rows, true, seq), one = Pick<W>(rows, false, seq);
      int64_t g = u * kGroup;
      for (; g + nl <= g1; g += nl) wide(xp + m0 * D, wp, sp, yp + m0 * N, D, N, g);
      for (; g < g1; ++g) one(xp + m0 * D, wp, sp, yp + m0 * N, D, N, g);
    }
  });
}

// The shapes of x [M, D], w [P, D, kPanel] and y [M, N] agree, N within the last panel.
ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] || wd[2] != kPanel || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("matmul: expected x [M, D], w [P, D, panel width] and y [M, N]");
  if (xd[0] < 1 || yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument("matmul: needs M >= 1 and N in the last panel");
  return ffi::Error::Success();
}

ffi::Error MatmulQ8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                        ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  ffi::Error shapes = CheckShapes(xd, wd, yd);
  if (shapes.failure()) return shapes;
  if (sd.size() != 3 || sd[0] != wd[0] || sd[1] != (wd[1] + kBlock - 1) / kBlock || sd[2] != kPanel)
    return ffi::Error::InvalidArgument("matmul: expected scales [P, ceil(D/32), panel width] for int8 panels");
  Run(pool, x.typed_data(), w.typed_data(), scales.typed_data(), y->typed_data(), xd[0], xd[1], yd[1]);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  ffi::Error shapes = CheckShapes(xd, wd, yd);
  if (shapes.failure()) return shapes;
  const int64_t M = xd[0], D = xd[1], N = yd[1];
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F32:
      Run(pool, xp, static_cast<const float*>(w.untyped_data()), nullptr, yp, M, D, N);
      break;
    case ffi::DataType::BF16:
      Run(pool, xp, static_cast<const specjax::BF16*>(w.untyped_data()), nullptr, yp, M, D, N);
      break;
    case ffi::DataType::F16:
      Run(pool, xp, static_cast<const specjax::F16*>(w.untyped_data()), nullptr, yp, M, D, N);
      break;
    default:
      return ffi::Error::InvalidArgument("matmul: weight panels must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

// The outputs per panel this build packs weights in (cpu_kernels.panel_width).
extern "C" int SpecjaxPanelWidth() { return static_cast<int>(kPanel); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulQ8, MatmulQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
