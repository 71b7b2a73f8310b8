// y [M, N] = x [M, D] · wᵀ for the rows of a decode, verify or prefill step (an XLA FFI handler),
// with the weight w [N, D] stored as panels [ceil(N/16), D, 16]: panel p holds outputs
// 16p .. 16p+15, column by column (cpu_kernels.pack). XLA:CPU streams a weight at ~23 GB/s
// for one row but switches to a packed GEMM from two rows on that costs about twice as
// much for the same bytes (docs/performance.md); here the weight is streamed once for all
// M rows, split across the intra-op thread pool by panels. Many rows (a prefill chunk) are
// passes over a panel while it sits in L2, faster than XLA's GEMM here (docs/performance.md).
//
// A panel is read as one 64-byte line per input column: every row's x[m, k] is broadcast
// against it, so a pass over the panel keeps 16 outputs per row in registers and needs no
// horizontal sums (the earlier kernel, one dot product per output in eight lanes, spent
// nine loads per eight FMAs and ran a verify of 8 rows at ~1.5x one row). With AVX-512 a
// line is one 512-bit vector (one widening and one FMA per row and column), otherwise a
// pair of eight-float vectors.
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

constexpr int64_t kPanel = 16;  // outputs per panel: one line
constexpr int64_t kBlock = 32;  // columns per int8 scale (llama.cpp's q8_0 block)
// Bytes prefetched ahead of the column being read (4 kB: 2 and 8 kB were slower for float32
// panels, none 1.5x at M = 8).
constexpr int64_t kAheadBytes = 4096;

#if defined(__AVX512F__)
// A line of 16 outputs in one 512-bit register. Rows per pass: one accumulator a row, plus
// the line and a broadcast, within AVX-512's 32 vector registers.
typedef float Line __attribute__((vector_size(64)));
constexpr int kRows = 16;

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
inline Line Scale(Line a, Line s) { return a * s; }
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
inline Line Scale(Line a, Line s) { return {a.lo * s.lo, a.hi * s.hi}; }
inline void StoreLine(float* p, Line a) { specjax::Store(p, a.lo), specjax::Store(p + 8, a.hi); }
inline float Lane(Line a, int64_t j) { return j < 8 ? a.lo[j] : a.hi[j - 8]; }
#endif

// Panels per pass for M rows: each output is one FMA chain, whose latency (4 cycles) caps a
// pass of one row and one panel at a 64-byte line per 4 cycles, below what the caches deliver
// for a model resident in L3; a pass over several panels at once runs that many chains side
// by side. The chains and their order are the same however panels are grouped, so this
// changes no bits.
constexpr int PanelsPerPass(int m) {
#if defined(__AVX512F__)
  return m == 1 ? 4 : m < 4 ? 2 : 1;  // accumulators and lines within 32 registers
#else
  return m == 1 ? 2 : 1;  // a line is two vectors here
#endif
}
constexpr int64_t kGroup = 4;  // panels per unit of work: a multiple of every PanelsPerPass

// NP panels from p0 of weights of type W against M <= kRows rows of x; M and NP are template
// arguments so the accumulators live in registers while the panels stream past. int8 panels
// (q8: cpu_kernels.quantize) come with scales [P, ceil(D/32), 16], one per output and block
// of 32 columns: the weight is q * scale, rounded to float32 as NumPy's q * scale is, then
// the same FMA chain.
template <typename W, int M, int NP>
void Panels(const float* x, const W* w, const float* scales, float* y, int64_t D, int64_t N, int64_t p0) {
  constexpr bool kQ8 = std::is_same_v<W, int8_t>;
  const int64_t blocks = (D + kBlock - 1) / kBlock;
  const W* panel[NP];
  for (int q = 0; q < NP; ++q) panel[q] = w + (p0 + q) * D * kPanel;
  Line acc[NP][M];
  for (int q = 0; q < NP; ++q)
    for (int m = 0; m < M; ++m) acc[q][m] = Line{};
  for (int64_t k0 = 0; k0 < D; k0 += kBlock) {
    Line scale[NP];
    for (int q = 0; q < NP; ++q) {
      scale[q] = Line{};
      if constexpr (kQ8) scale[q] = LoadLine(scales + ((p0 + q) * blocks + k0 / kBlock) * kPanel);
    }
    for (int64_t k = k0; k < std::min(D, k0 + kBlock); ++k) {
      Line line[NP];
      for (int q = 0; q < NP; ++q) {
        __builtin_prefetch(panel[q] + (k + kAheadBytes / int64_t{sizeof(W) * kPanel}) * kPanel, 0, 0);
        line[q] = WidenLine(panel[q] + k * kPanel);
        if constexpr (kQ8) line[q] = Scale(line[q], scale[q]);
      }
      for (int m = 0; m < M; ++m) {
        const Line xs = Splat(x[m * D + k]);
        for (int q = 0; q < NP; ++q) acc[q][m] = Fma(xs, line[q], acc[q][m]);
      }
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t n0 = (p0 + q) * kPanel;
    if (n0 + kPanel <= N) {
      for (int m = 0; m < M; ++m) StoreLine(y + m * N + n0, acc[q][m]);
    } else {  // the last panel, zero-padded past N
      for (int m = 0; m < M; ++m)
        for (int64_t j = 0; n0 + j < N; ++j) y[m * N + n0 + j] = Lane(acc[q][m], j);
    }
  }
}

template <typename W>
using PanelsFn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t, int64_t);

// Panels<W, m, PanelsPerPass(m)> (wide) or Panels<W, m, 1> for m = 1 .. kRows.
template <typename W, int... Ms>
PanelsFn<W> Pick(int64_t m, bool wide, std::integer_sequence<int, Ms...>) {
  PanelsFn<W> wides[] = {&Panels<W, Ms + 1, PanelsPerPass(Ms + 1)>...};
  PanelsFn<W> ones[] = {&Panels<W, Ms + 1, 1>...};
  return wide ? wides[m - 1] : ones[m - 1];
}

template <typename W>
void Run(ffi::ThreadPool& pool, const float* xp, const W* wp, const float* sp, float* yp, int64_t M, int64_t D,
         int64_t P, int64_t N) {
  ParallelFor(pool, (P + kGroup - 1) / kGroup, [&](int64_t u) {
    const int64_t g0 = u * kGroup, g1 = std::min(P, g0 + kGroup);
    // More than kRows rows: passes of kRows over the group's panels (read again from L1/L2).
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - m0);
      const int64_t np = PanelsPerPass(static_cast<int>(rows));
      const auto seq = std::make_integer_sequence<int, kRows>{};
      const PanelsFn<W> wide = Pick<W>(rows, true, seq), one = Pick<W>(rows, false, seq);
      int64_t p = g0;
      for (; p + np <= g1; p += np) wide(xp + m0 * D, wp, sp, yp + m0 * N, D, N, p);
      for (; p < g1; ++p) one(xp + m0 * D, wp, sp, yp + m0 * N, D, N, p);
    }
  });
}

// The shapes of x [M, D], w [P, D, 16] and y [M, N] agree, N within the last panel.
ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] || wd[2] != kPanel || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("matmul: expected x [M, D], w [P, D, 16] and y [M, N]");
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
    return ffi::Error::InvalidArgument("matmul: expected scales [P, ceil(D/32), 16] for int8 panels");
  Run(pool, x.typed_data(), w.typed_data(), scales.typed_data(), y->typed_data(), xd[0], xd[1], wd[0], yd[1]);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  ffi::Error shapes = CheckShapes(xd, wd, yd);
  if (shapes.failure()) return shapes;
  const int64_t M = xd[0], D = xd[1], P = wd[0], N = yd[1];
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F32:
      Run(pool, xp, static_cast<const float*>(w.untyped_data()), nullptr, yp, M, D, P, N);
      break;
    case ffi::DataType::BF16:
      Run(pool, xp, static_cast<const specjax::BF16*>(w.untyped_data()), nullptr, yp, M, D, P, N);
      break;
    case ffi::DataType::F16:
      Run(pool, xp, static_cast<const specjax::F16*>(w.untyped_data()), nullptr, yp, M, D, P, N);
      break;
    default:
      return ffi::Error::InvalidArgument("matmul: weight panels must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

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
