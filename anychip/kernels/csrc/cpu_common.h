// Shared by the anychip CPU kernels: includes, the ISA codes and their run-time check, target attributes.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#define ANYCHIP_X86 1
#include <immintrin.h>
#define ANYCHIP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define ANYCHIP_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace anychip {

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

inline bool isa_supported(int64_t isa) {
#ifdef ANYCHIP_X86
  __builtin_cpu_init();
  if (isa == kAvx512Vnni)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == kPortable;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace anychip
