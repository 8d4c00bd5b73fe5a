// Shared by the anychip CPU kernels: the ISA codes and their run-time check, target attributes, 16-bit floats.
// Torch-free: the kernel core (these headers) builds into the torch extension (w4a8_cpu.cpp) and into the
// cross-compiled Arm test driver (tests/arm/driver.cpp) alike.
#pragma once

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
#include <cpuid.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#if defined(__aarch64__)
#define ANYCHIP_ARM 1
#include <arm_neon.h>
#include <sys/auxv.h>
// Function-level targets: the binary assumes only baseline Armv8-A (NEON); these paths run after getauxval says so.
// Both extensions are optional from Armv8.2-A on, so a CPU that has either implements Armv8.2-A.
#define ANYCHIP_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define ANYCHIP_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif
#endif

namespace anychip {

// The codes the Python routes pass (anychip/kernels/routes/*.py `code`).
// kAmxInt8 is kAvx512Vnni with the prefill tiles (M >= 32) on AMX-INT8 (w4a8_amx.h): same layout, same bits.
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2, kArmDotprod = 3, kArmI8mm = 4, kAmxInt8 = 5 };
constexpr int64_t kIsaCount = 6;

// Whether this CPU has AMX-INT8 (with AVX512-VNNI) and the OS lets this process use the tile registers. Linux hands
// out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); an AMX instruction
// without it raises SIGILL. Asked once a process (machine.request_amx_tiles asks the same for vLLM's attention,
// through torch; the kernels ask for themselves, since they may run before or without it). Elsewhere: never.
inline bool amx_usable() {
#ifdef ANYCHIP_X86
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    __builtin_cpu_init();
    if (!tile || !int8 || !__builtin_cpu_supports("avx512vnni")) return false;
#ifdef __linux__
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;  // no known way to ask this OS for the tile state: cpu.avx512_vnni serves
#endif
  }();
  return ok;
#else
  return false;
#endif
}

inline bool isa_supported(int64_t isa) {
#ifdef ANYCHIP_X86
  __builtin_cpu_init();
  if (isa == kAvx512Vnni || isa == kAmxInt8)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           (isa == kAvx512Vnni || amx_usable());
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#ifdef ANYCHIP_ARM
  const bool dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  if (isa == kArmDotprod) return dotprod;
  if (isa == kArmI8mm) return dotprod && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#endif
  return isa == kPortable;
}

// The route's name for an ISA code (the part after the dot in "cpu.avx2", "arm.i8mm").
inline const char* isa_name(int64_t isa) {
  switch (isa) {
    case kAvx2: return "avx2";
    case kAvx512Vnni: return "avx512_vnni";
    case kAmxInt8: return "amx_int8";
    case kArmDotprod: return "dotprod";
    case kArmI8mm: return "i8mm";
    default: return "portable";
  }
}

// The Python route id of an ISA code (anychip/kernels/routes/*.py `id`; tests/test_kernels.py checks they agree).
inline const char* isa_route_id(int64_t isa) {
  switch (isa) {
    case kAvx2: return "cpu.avx2";
    case kAvx512Vnni: return "cpu.avx512_vnni";
    case kAmxInt8: return "cpu.amx_int8";
    case kArmDotprod: return "arm.dotprod";
    case kArmI8mm: return "arm.i8mm";
    default: return "cpu.portable";
  }
}

// The ISA code of a route's op code (anychip/kernels/routes/*.py `code`: an ISA code for this extension's routes), or
// -1 when the route is not one of this extension's (the torch ops hand those to the route's Python implementation).
inline int64_t route_isa(int64_t code) { return code >= 0 && code < kIsaCount ? code : -1; }

// ISAs this CPU and build support, best first, ending with kPortable; returns how many.
inline int supported_isas(int64_t out[kIsaCount]) {
  static constexpr int64_t order[] = {kAmxInt8, kAvx512Vnni, kAvx2, kArmI8mm, kArmDotprod, kPortable};
  int n = 0;
  for (int64_t isa : order)
    if (isa_supported(isa)) out[n++] = isa;
  return n;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------- 16-bit floats as plain bits
// Layout-compatible with c10::BFloat16 / c10::Half (one uint16_t), so the torch binding can cast pointers.

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_f(float v) { return v; }
inline float to_f(Bf16 v) { return f32_from_bits(uint32_t(v.bits) << 16); }

// Exact: every half is an fp32.
inline float to_f(Fp16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000) << 16;
  const uint32_t e = (v.bits >> 10) & 0x1F, man = v.bits & 0x3FF;
  if (e == 0x1F) return f32_from_bits(sign | 0x7F800000u | (man << 13));  // inf, nan
  if (e != 0) return f32_from_bits(sign | ((e + 112) << 23) | (man << 13));
  return f32_from_bits(sign | f32_bits(float(man) * 0x1p-24f));  // zero and subnormals: man * 2^-24
}

// Round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16).
inline uint16_t bf16_bits(float f) {
  const uint32_t u = f32_bits(f);
  if (std::isnan(f)) return 0x7FC0;
  return uint16_t((u + ((u >> 16) & 1) + 0x7FFF) >> 16);
}

// Round to nearest even, overflow to inf, quiet NaN kept (as c10::Half and the FCVT / VCVTPS2PH instructions).
inline uint16_t fp16_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a >= 0x7F800000u) return sign | (a > 0x7F800000u ? uint16_t(0x7E00 | ((a >> 13) & 0x3FF)) : 0x7C00);
  const int e = int(a >> 23) - 127 + 15;  // half exponent
  if (e >= 31) return sign | 0x7C00;
  if (e >= 1) {  // normal: keep 10 of 23 mantissa bits; a carry out of the mantissa bumps the exponent
    const uint32_t man = (uint32_t(e) << 10) | ((a >> 13) & 0x3FF), rem = a & 0x1FFF;
    return sign | uint16_t(man + (rem > 0x1000 || (rem == 0x1000 && (man & 1))));
  }
  if (e < -10) return sign;  // below half the smallest subnormal
  const uint32_t full = (a & 0x7FFFFF) | 0x800000;
  const uint32_t shift = uint32_t(14 - e);  // 14..24
  const uint32_t man = full >> shift;
  const uint32_t rem = full & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | uint16_t(man + (rem > half || (rem == half && (man & 1))));
}

// Output element types of the linear (and the debug int32 group sums).
enum class OutType { kF32, kBF16, kF16, kI32 };

}  // namespace anychip
