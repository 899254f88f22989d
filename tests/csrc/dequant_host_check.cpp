// Host build of csrc/dequant.h for the exhaustive CPU test (tests/csrc/test_dequant_host.py).
//
// stdin: one packed qweight word per line (hex, as w4a16.pack_int4 produced it). stdout, per word:
//   "<word> f16 v0..v7 bf16 v0..v7 f16hi v2 v3 v6 v7"  the magic-number values (offset + q) in k order, decoded
//   bit by bit here; f16hi: the odd pairs by fp16_high_pair (64 + q)
// then for every nibble q and zero point z, per dtype: "qz <dtype> q z value" with value = (offset+q) - raw_zero(z),
// and "chunk <dtype> z max_abs_error" for remove_offset on a 32-element chunk against exact double arithmetic.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dequant.h"

using namespace w4a16;

// IEEE half -> double, from the bits (independent of any compiler half type).
static double decode_fp16(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  double v = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
  if (exponent == 31) v = mantissa ? NAN : INFINITY;
  return sign ? -v : v;
}
// bf16 -> double: the top half of an IEEE single.
static double decode_bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename Tag>
static double decode(uint16_t bits);
template <>
double decode<Fp16Tag>(uint16_t bits) { return decode_fp16(bits); }
template <>
double decode<Bf16Tag>(uint16_t bits) { return decode_bf16(bits); }

template <typename Tag>
static void word_values(uint32_t word, double out[8]) {
  for (int p = 0; p < 4; ++p) {
    const uint32_t pair = magic_pair<Tag>(word, p);
    out[2 * p] = decode<Tag>(uint16_t(pair & 0xFFFF));
    out[2 * p + 1] = decode<Tag>(uint16_t(pair >> 16));
  }
}

// Every q and z: the exact (q - z) the kernel relies on, and the chunk identity of remove_offset.
template <typename Tag>
static void table(const char* name) {
  for (int q = 0; q < 16; ++q) {
    const uint32_t word = uint32_t(q) * 0x11111111u;  // q in every slot
    double v[8];
    word_values<Tag>(word, v);
    for (int z = 0; z < 16; ++z) std::printf("qz %s %d %d %.17g\n", name, q, z, v[0] - raw_zero<Tag>(z));
  }
  // remove_offset on chunks of 32 k (4 words) with random nibbles and activations representable in the dtype.
  srand(1234);
  for (int z = 0; z < 16; ++z) {
    double worst = 0;
    for (int trial = 0; trial < 200; ++trial) {
      float raw = 0.f, sum_x = 0.f;
      double exact = 0;
      for (int w = 0; w < 4; ++w) {
        uint32_t word = 0;
        for (int s = 0; s < 8; ++s) word |= uint32_t(rand() & 15) << (4 * s);
        double v[8];
        word_values<Tag>(word, v);
        for (int e = 0; e < 8; ++e) {
          // activations in [-4, 4) with 7 significant bits: exact in fp16 and bf16
          const float x = float((rand() % 1024) - 512) / 128.f;
          raw = std::fma(float(v[e]), x, raw);
          sum_x += x;
          exact += (v[e] - Magic<Tag>::kOffset - z) * double(x);
        }
      }
      const double err = std::fabs(double(remove_offset<Tag>(raw, sum_x, z)) - exact);
      worst = err > worst ? err : worst;
    }
    std::printf("chunk %s %d %.17g\n", name, z, worst);
  }
}

int main() {
  unsigned long word;
  while (std::scanf("%lx", &word) == 1) {
    double f16[8], bf16[8];
    word_values<Fp16Tag>(uint32_t(word), f16);
    word_values<Bf16Tag>(uint32_t(word), bf16);
    std::printf("%08lx f16", word);
    for (double v : f16) std::printf(" %.17g", v);
    std::printf(" bf16");
    for (double v : bf16) std::printf(" %.17g", v);
    std::printf(" f16hi");  // the odd pairs by fp16_high_pair: k = 2, 3, 6, 7
    for (int p = 1; p < 4; p += 2) {
      const uint32_t pair = fp16_high_pair(uint32_t(word), p);
      std::printf(" %.17g %.17g", decode_fp16(uint16_t(pair & 0xFFFF)), decode_fp16(uint16_t(pair >> 16)));
    }
    std::printf("\n");
  }
  table<Fp16Tag>("f16");
  table<Bf16Tag>("bf16");
  return 0;
}
