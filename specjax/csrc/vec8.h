// Eight-float vectors for the CPU kernels (GCC/Clang vector extension: AVX where the
// machine has it, pairs of SSE registers otherwise), with fixed-order reductions so a
// result never depends on how work was batched.

#ifndef SPECJAX_CSRC_VEC8_H_
#define SPECJAX_CSRC_VEC8_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace specjax {

typedef float V8 __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));

inline V8 Load(const float* p) {
  V8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline void Store(float* p, V8 x) { std::memcpy(p, &x, sizeof x); }

// 16-bit weights, as stored: the raw bits of a bfloat16 or an IEEE float16.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

typedef uint16_t V8h __attribute__((vector_size(16)));
typedef uint32_t V8u __attribute__((vector_size(32)));

inline V8u Bits(const uint16_t* p) {
  V8h h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, V8u);
}

inline V8 AsFloat(V8u u) {
  V8 r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

// Eight weights as float32; exact for both 16-bit formats (every value they hold is a
// float32) and for int8 (to be scaled by the caller).
inline V8 Widen(const float* p) { return Load(p); }

typedef int8_t V8b __attribute__((vector_size(8)));

inline V8 Widen(const int8_t* p) {
#if defined(__AVX2__)  // GCC converts the vector-extension form one lane at a time
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (V8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
  V8b b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, V8i), V8);
#endif
}

// bfloat16 is float32's upper half. (GCC lowers the vector-extension form to five
// instructions; AVX2's zero extension from memory and a shift are two.)
inline V8 Widen(const BF16* p) {
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (V8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  return AsFloat(Bits(&p->bits) << 16);
#endif
}

inline V8 Widen(const F16* p) {
#if defined(__F16C__)
  __m128i h;
  std::memcpy(&h, p, sizeof h);
  return (V8)_mm256_cvtph_ps(h);
#else
  // Exponent and mantissa moved into float32's fields and rebiased (15 -> 127); infinities
  // and NaNs rebiased once more to the top exponent; subnormals renormalized by subtracting
  // 2^-14, which float32 does exactly. Then the sign.
  const V8u h = Bits(&p->bits);
  const V8u shifted = (h & 0x7fffu) << 13;
  const V8u exp = shifted & (0x7c00u << 13);
  V8u u = shifted + ((127u - 15u) << 23);
  u = exp == (0x7c00u << 13) ? u + ((128u - 16u) << 23) : u;
  const V8 sub = AsFloat(u + (1u << 23)) - AsFloat(V8u{} + (113u << 23));
  V8u out = exp == 0 ? (V8u)sub : u;
  return AsFloat(out | ((h & 0x8000u) << 16));
#endif
}

// x in every lane (one broadcast; `V8{} + x` costs an add as well, which must stay: 0 + -0 is +0).
inline V8 Splat(float x) { return V8{x, x, x, x, x, x, x, x}; }

// a * b + c, fused where the machine has FMA. Always written out: the kernels build with
// -ffp-contract=off so that the compiler never fuses some products and not others.
inline V8 Fma(V8 a, V8 b, V8 c) {
#if defined(__FMA__) && defined(__AVX__)
  return (V8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

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

// Lanes of four vectors at once, bitwise equal to Lanes of each (out[i] = Lanes(v[i])): the
// halves' sums are (a0+a4, a1+a5, a2+a6, a3+a7), and two rounds of pairwise adds finish
// the same tree, in 7 vector ops instead of ~20 scalar ones per output.
inline void Lanes4(V8 a, V8 b, V8 c, V8 d, float* out) {
#if defined(__AVX__)
  auto half = [](V8 v) { return _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1)); };
  _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(half(a), half(b)), _mm_hadd_ps(half(c), half(d))));
#else
  out[0] = Lanes(a), out[1] = Lanes(b), out[2] = Lanes(c), out[3] = Lanes(d);
#endif
}

}  // namespace specjax

#endif  // SPECJAX_CSRC_VEC8_H_
