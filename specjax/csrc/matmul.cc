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
//
// int8 panels (cpu_kernels.quantize: llama.cpp's q8_0 blocks of 32 columns, a float32
// scale each) are multiplied as llama.cpp multiplies q8_0 weights: each row of x is
// quantized the same way (Q8Rows), each block's dot product is summed in integers, and the
// block sum times the two scales is added to the output, block after block. The integer
// sums are exact however they are computed, so the two paths below give the same bits:
// with AVX512-VNNI, four columns at a time with `vpdpbusd` (panels interleaved by four
// columns); otherwise an FMA chain over the integers as float32 (every product and partial
// sum stays below 2^24, so it is exact too).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::ParallelFor;

constexpr int64_t kLine = 16;   // outputs per line
constexpr int64_t kGroup = 4;   // lines per unit of work: 64 outputs
constexpr int64_t kBlock = 32;  // columns per int8 scale (llama.cpp's q8_0 block)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int64_t kQ8Group = 4;  // columns interleaved per output in int8 panels: one vpdpbusd lane
#else
constexpr int64_t kQ8Group = 1;
#endif

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
inline Line Mul(Line a, Line b) { return (Line)_mm512_mul_ps((__m512)a, (__m512)b); }
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
inline Line Mul(Line a, Line b) { return {a.lo * b.lo, a.hi * b.hi}; }
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

// The accumulators of lines g0 .. g0 + NL - 1 for M rows into y [M, N] (the last line
// zero-padded past N).
template <int M, int NL>
void Store(const Line (&acc)[NL][M], float* y, int64_t N, int64_t g0) {
  for (int q = 0; q < NL; ++q) {
    const int64_t n0 = (g0 + q) * kLine;
    if (n0 + kLine <= N) {
      for (int m = 0; m < M; ++m) StoreLine(y + m * N + n0, acc[q][m]);
    } else {
      for (int m = 0; m < M; ++m)
        for (int64_t j = 0; n0 + j < N; ++j) y[m * N + n0 + j] = Lane(acc[q][m], j);
    }
  }
}

// Lines g0 .. g0 + NL - 1 (outputs 16 g0 ..) of float weights of type W, against M <= kRows
// rows of x; M and NL are template arguments so the accumulators live in registers while
// the weights stream past. Line g's column k is at w + (g / L) * D * kPanel + k * kPanel +
// (g % L) * 16 for L = kPanel / 16 lines per panel.
template <typename W, int M, int NL>
void Lines(const float* x, const W* w, float* y, int64_t D, int64_t N, int64_t g0) {
  constexpr int64_t L = kPanel / kLine;
  const W* line0[NL];
  for (int q = 0; q < NL; ++q) line0[q] = w + ((g0 + q) / L) * D * kPanel + ((g0 + q) % L) * kLine;
  Line acc[NL][M];
  for (int q = 0; q < NL; ++q)
    for (int m = 0; m < M; ++m) acc[q][m] = Line{};
  for (int64_t k = 0; k < D; ++k) {
    Line line[NL];
    for (int q = 0; q < NL; ++q) {
      if constexpr (L == 1)  // separate streams: fetched ahead (4 kB: 2 and 8 kB were slower)
        __builtin_prefetch(line0[q] + (k + 4096 / int64_t{sizeof(W) * kPanel}) * kPanel, 0, 0);
      line[q] = WidenLine(line0[q] + k * kPanel);
    }
    for (int m = 0; m < M; ++m) {
      const Line xs = Splat(x[m * D + k]);
      for (int q = 0; q < NL; ++q) acc[q][m] = Fma(xs, line[q], acc[q][m]);
    }
  }
  Store<M, NL>(acc, y, N, g0);
}

// Rows of x quantized per block of 32 columns as llama.cpp quantizes activations for q8_0
// weights (quantize_row_q8_0 in ggml): scale d = max |x| / 127 over the block and q = x
// times 1 / d (float32) rounded to nearest, ties to even. A block holding an infinity or
// NaN gets d = NaN and q = 0, so its outputs are NaN. Columns past D are zeros.
struct Q8Rows {
  int64_t blocks = 0, cols = 0;  // cols: D rounded up to whole blocks
  std::vector<float> scale;      // d [M, blocks]
  std::vector<float> values;     // q as float32 [M, cols] (the FMA path)
  std::vector<int8_t> ints;      // q [M, cols] (the VNNI path)
  std::vector<int32_t> offset;   // 128 times the sum of q over each block [M, blocks] (the VNNI path)
};

// One block of `n` <= 32 values of a row: its scale, and q into ints or values (32 entries,
// zeros past n); returns the sum of q. A block with an infinity or NaN gets scale NaN, q = 0;
// one whose scale would be subnormal (1 / scale infinite) scale 0, q = 0.
inline float Scale(float amax) {
  const float d = amax / 127.0f;
  return d < std::numeric_limits<float>::min() ? 0.0f : d;
}

int32_t QuantizeBlock(const float* x, int64_t n, float& scale, int8_t* ints, float* values) {
  constexpr float kMax = std::numeric_limits<float>::max();
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n == kBlock) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
    const __mmask16 bad = _mm512_cmp_ps_mask(a0, _mm512_set1_ps(kMax), _CMP_NLE_UQ) |
                          _mm512_cmp_ps_mask(a1, _mm512_set1_ps(kMax), _CMP_NLE_UQ);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float d = bad ? std::numeric_limits<float>::quiet_NaN() : Scale(amax);
    const __m512 id = _mm512_set1_ps(!bad && d != 0.0f ? 1.0f / d : 0.0f);
    scale = d;
    auto q = [&](__m512 v) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(bad ? _mm512_setzero_ps() : v, id),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    };
    const __m512 q0 = q(v0), q1 = q(v1);
    const __m512i i0 = _mm512_cvttps_epi32(q0), i1 = _mm512_cvttps_epi32(q1);
    if (ints) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ints), _mm512_cvtepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ints + 16), _mm512_cvtepi32_epi8(i1));
    } else {
      _mm512_storeu_ps(values, q0), _mm512_storeu_ps(values + 16, q1);
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  }
#endif
  float block[kBlock] = {};  // a partial block zero-padded
  std::memcpy(block, x, n * sizeof(float));
  float amax = 0.0f;
  bool ok = true;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float mag = std::fabs(block[j]);
    ok = ok && mag <= kMax;  // false for NaN
    amax = std::max(amax, mag);
  }
  const float d = ok ? Scale(amax) : std::numeric_limits<float>::quiet_NaN();
  const float id = ok && d != 0.0f ? 1.0f / d : 0.0f;
  scale = d;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float q = std::clamp(std::nearbyint((ok ? block[j] : 0.0f) * id), -127.0f, 127.0f);
    sum += static_cast<int32_t>(q);
    if (ints)
      ints[j] = static_cast<int8_t>(q);
    else
      values[j] = q;
  }
  return sum;
}

void Quantize(const float* x, int64_t M, int64_t D, bool ints, Q8Rows& a) {
  a.blocks = (D + kBlock - 1) / kBlock, a.cols = a.blocks * kBlock;
  a.scale.resize(M * a.blocks);
  if (ints) {
    a.ints.resize(M * a.cols), a.offset.resize(M * a.blocks);
  } else {
    a.values.resize(M * a.cols);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t at = m * a.cols + b * kBlock;
      const int32_t sum = QuantizeBlock(x + m * D + b * kBlock, std::min(kBlock, D - b * kBlock),
                                        a.scale[m * a.blocks + b], ints ? a.ints.data() + at : nullptr,
                                        ints ? nullptr : a.values.data() + at);
      if (ints) a.offset[m * a.blocks + b] = 128 * sum;
    }
}

// Lines g0 .. g0 + NL - 1 of int8 weights against rows m0 .. m0 + M - 1 (M <= kRows) of
// quantized x. Panels
// interleave G columns per output ([P, D / G, kPanel * G]: line g's columns k .. k + G - 1
// are the 16 x G bytes at w + (g / L) * D * kPanel + k * kPanel + (g % L) * 16 * G); scales
// are [P, ceil(D/32), kPanel]. Each block's integer dot product, as float32 (exact), is
// added to the output's FMA chain times (weight scale times row scale).
template <int G, int M, int NL>
void LinesQ8(const Q8Rows& a, int64_t m0, const int8_t* w, const float* scales, float* y, int64_t D, int64_t N,
             int64_t g0) {
  constexpr int64_t L = kPanel / kLine;
  const int8_t* line0[NL];
  const float* scale0[NL];
  for (int q = 0; q < NL; ++q) {
    const int64_t g = g0 + q;
    line0[q] = w + (g / L) * D * kPanel + (g % L) * kLine * G;
    scale0[q] = scales + (g / L) * a.blocks * kPanel + (g % L) * kLine;
  }
  Line acc[NL][M];
  for (int q = 0; q < NL; ++q)
    for (int m = 0; m < M; ++m) acc[q][m] = Line{};
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t k0 = b * kBlock, k1 = std::min(D, k0 + kBlock);
    Line sum[NL][M];
    if constexpr (G == 4) {
#if defined(__AVX512VNNI__)
      // vpdpbusd multiplies unsigned by signed bytes: the weights are read as q + 128 (their
      // sign bit flipped), and 128 times the row's block sum of q is taken off after.
      __m512i isum[NL][M];
      for (int q = 0; q < NL; ++q)
        for (int m = 0; m < M; ++m) isum[q][m] = _mm512_setzero_si512();
      for (int64_t k = k0; k < k1; k += G) {
        __m512i line[NL];
        for (int q = 0; q < NL; ++q)
          line[q] = _mm512_xor_si512(_mm512_loadu_si512(line0[q] + k * kPanel), _mm512_set1_epi8(-128));
        for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, a.ints.data() + (m0 + m) * a.cols + k, sizeof four);
          const __m512i xs = _mm512_set1_epi32(four);
          for (int q = 0; q < NL; ++q) isum[q][m] = _mm512_dpbusd_epi32(isum[q][m], line[q], xs);
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512i offset = _mm512_set1_epi32(a.offset[(m0 + m) * a.blocks + b]);
        for (int q = 0; q < NL; ++q) sum[q][m] = (Line)_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[q][m], offset));
      }
#else
      static_assert(G == 1, "interleaved int8 panels need AVX512-VNNI");
#endif
    } else {
      for (int q = 0; q < NL; ++q)
        for (int m = 0; m < M; ++m) sum[q][m] = Line{};
      for (int64_t k = k0; k < k1; ++k) {
        Line line[NL];
        for (int q = 0; q < NL; ++q) {
          if constexpr (L == 1) __builtin_prefetch(line0[q] + (k + 4096 / kPanel) * kPanel, 0, 0);
          line[q] = WidenLine(line0[q] + k * kPanel);
        }
        for (int m = 0; m < M; ++m) {
          const Line xs = Splat(a.values[(m0 + m) * a.cols + k]);
          for (int q = 0; q < NL; ++q) sum[q][m] = Fma(xs, line[q], sum[q][m]);
        }
      }
    }
    for (int q = 0; q < NL; ++q) {
      const Line scale = LoadLine(scale0[q] + b * kPanel);
      for (int m = 0; m < M; ++m) acc[q][m] = Fma(sum[q][m], Mul(scale, Splat(a.scale[(m0 + m) * a.blocks + b])), acc[q][m]);
    }
  }
  Store<M, NL>(acc, y, N, g0);
}

// A pass over lines g .. g + NL - 1 for rows m0 .. m0 + M - 1 (M and NL fixed by Pick).
using PassFn = void (*)(const void* ctx, int64_t m0, int64_t g);

template <typename W>
struct FloatPass {
  static constexpr int PassLines(int m) { return LinesPerPass(m); }
  const float* x;
  const W* w;
  float* y;
  int64_t D, N;
  template <int M, int NL>
  static void Fn(const void* ctx, int64_t m0, int64_t g) {
    const auto& c = *static_cast<const FloatPass*>(ctx);
    Lines<W, M, NL>(c.x + m0 * c.D, c.w, c.y + m0 * c.N, c.D, c.N, g);
  }
};

template <int G>
struct Q8Pass {
  // With VNNI each row and line keeps an integer block sum beside its accumulator: 4 lines
  // up to 4 rows, 2 beyond (up to kRows), so that most stay in the 32 registers (no clear
  // difference from other splits on Zen 4, all within noise).
  static constexpr int PassLines(int m) { return G == 1 ? LinesPerPass(m) : m <= 4 ? 4 : 2; }
  const Q8Rows* a;
  const int8_t* w;
  const float* scales;
  float* y;
  int64_t D, N;
  template <int M, int NL>
  static void Fn(const void* ctx, int64_t m0, int64_t g) {
    const auto& c = *static_cast<const Q8Pass*>(ctx);
    LinesQ8<G, M, NL>(*c.a, m0, c.w, c.scales, c.y + m0 * c.N, c.D, c.N, g);
  }
};

// Passes over Pass::PassLines(M) lines for M rows, one entry per M, and over one line.
template <typename Pass, int... Ms>
PassFn Pick(int64_t m, bool wide, std::integer_sequence<int, Ms...>) {
  PassFn wides[] = {&Pass::template Fn<Ms + 1, Pass::PassLines(Ms + 1)>...};
  PassFn ones[] = {&Pass::template Fn<Ms + 1, 1>...};
  return wide ? wides[m - 1] : ones[m - 1];
}

// y [M, N] by passes over units of 64 outputs split across the pool. More than kRows rows:
// passes of as many rows each as may be, over the unit's lines (read again from L1/L2).
template <typename Pass>
void Run(ffi::ThreadPool& pool, const Pass& pass, int64_t M, int64_t N) {
  const int64_t lines = (N + kLine - 1) / kLine;
  const int64_t passes = (M + kRows - 1) / kRows, per = (M + passes - 1) / passes;
  ParallelFor(pool, (lines + kGroup - 1) / kGroup, [&](int64_t u) {
    const int64_t g1 = std::min(lines, (u + 1) * kGroup);
    for (int64_t m0 = 0; m0 < M; m0 += per) {
      const int64_t rows = std::min<int64_t>(per, M - m0);
      const int64_t nl = Pass::PassLines(static_cast<int>(rows));
      const auto seq = std::make_integer_sequence<int, kRows>{};
      const PassFn wide = Pick<Pass>(rows, true, seq), one = Pick<Pass>(rows, false, seq);
      int64_t g = u * kGroup;
      for (; g + nl <= g1; g += nl) wide(&pass, m0, g);
      for (; g < g1; ++g) one(&pass, m0, g);
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
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("matmul: expected x [M, D], int8 w [P, D / G, panel width * G] and y [M, N]");
  const int64_t M = xd[0], D = xd[1], N = yd[1], G = wd[2] / kPanel;
  if (!(wd[2] == kPanel || (wd[2] == kQ8Group * kPanel && kQ8Group > 1)) || wd[1] * G != D)
    return ffi::Error::InvalidArgument("matmul: int8 panels are [P, D / G, panel width * G] for G = 1 or q8_group()");
  if (M < 1 || N > wd[0] * kPanel || N <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument("matmul: needs M >= 1 and N in the last panel");
  if (sd.size() != 3 || sd[0] != wd[0] || sd[1] != (D + kBlock - 1) / kBlock || sd[2] != kPanel)
    return ffi::Error::InvalidArgument("matmul: expected scales [P, ceil(D/32), panel width] for int8 panels");
  thread_local Q8Rows rows;  // reused: no allocation per call once it has grown
  Quantize(x.typed_data(), M, D, G > 1, rows);
  if (G > 1) {
    Run(pool, Q8Pass<kQ8Group>{&rows, w.typed_data(), scales.typed_data(), y->typed_data(), D, N}, M, N);
  } else {
    Run(pool, Q8Pass<1>{&rows, w.typed_data(), scales.typed_data(), y->typed_data(), D, N}, M, N);
  }
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
      Run(pool, FloatPass<float>{xp, static_cast<const float*>(w.untyped_data()), yp, D, N}, M, N);
      break;
    case ffi::DataType::BF16:
      Run(pool, FloatPass<specjax::BF16>{xp, static_cast<const specjax::BF16*>(w.untyped_data()), yp, D, N}, M, N);
      break;
    case ffi::DataType::F16:
      Run(pool, FloatPass<specjax::F16>{xp, static_cast<const specjax::F16*>(w.untyped_data()), yp, D, N}, M, N);
      break;
    default:
      return ffi::Error::InvalidArgument("matmul: weight panels must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

// The outputs per panel this build packs weights in (cpu_kernels.panel_width).
extern "C" int SpecjaxPanelWidth() { return static_cast<int>(kPanel); }

// The columns per output this build interleaves int8 panels by where D allows
// (cpu_kernels.q8_group).
extern "C" int SpecjaxQ8Group() { return static_cast<int>(kQ8Group); }

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
