// Torch-free test driver for the W4A8 CPU kernels, built from the headers the torch extension ships
// (anychip/kernels/csrc/*.h).  `make test-arm` cross-compiles it for aarch64 and runs it under qemu-aarch64 once per
// CPU model (tests/arm/run.sh).  Built natively on x86 it checks the x86 paths the same way.
//
//   driver --expect i8mm|dotprod|portable|avx512_vnni|avx2 [--fixtures DIR] [--threads N]
//
// Checks, for every ISA this CPU runs (the best must be --expect):
//   1. 16-bit float conversions and the row quantizers (scalar and SIMD) agree bit for bit; the threads' schedule
//      (BlockSchedule) hands out every weight block once;
//   2. the fixtures (tests/arm/fixtures.py: torch reference answers) equal the driver's scalar reference: INT8
//      activations, scales and INT32 group sums exactly, the output within fp32 tolerance (exactly where the case
//      says so); the C++ packers here equal the Python layouts stored in them; the kernels reproduce them;
//   3. a sweep M in {1,3,7,64}, K in {576,2048}, N in {17,576,1536}, G in {32,64,128}, then every tile tail and
//      token panel (M = 1..9, 63, 129): the kernels' INT32 group sums and fp32 outputs (bf16 / fp16 on a quarter of
//      the sweep) equal the scalar reference exactly, and nothing is written past the outputs; M <= 8 runs with
//      run()'s per-thread prologue making the group corrections, as the torch binding's fused calls do.
// Exit status 0 when everything matched; the first lines of each mismatch are printed.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "quantize_act.h"
#include "w4a8_run.h"

using namespace anychip;

namespace {

int failures = 0;

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);   \
      std::printf(__VA_ARGS__);                          \
      std::printf("\n");                                 \
      if (++failures == 20) {                            \
        std::printf("FAILED: stopping at 20 failures\n"); \
        std::exit(1);                                    \
      }                                                  \
    }                                                    \
  } while (0)

struct Threads {
  int64_t n = 2;
  template <typename Work>
  void operator()(int64_t threads, Work&& work) const {
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back([&] { work(); });
    work();
    for (auto& t : pool) t.join();
  }
};
Threads g_threads;

// ---------------------------------------------------------------- the scalar reference

struct Linear {
  int64_t m, k, n, g;
  std::vector<int8_t> xq;     // (M, K)
  std::vector<float> sx;      // (M)
  std::vector<int8_t> wq;     // (N, K) in [-8, 7]
  std::vector<float> sw;      // (N, K/G)
  std::vector<float> bias;    // (N) or empty
  int64_t groups() const { return k / g; }
};

std::vector<int32_t> ref_dots(const Linear& L) {
  std::vector<int32_t> d(L.m * L.n * L.groups());
  for (int64_t i = 0; i < L.m; ++i)
    for (int64_t r = 0; r < L.n; ++r)
      for (int64_t gi = 0; gi < L.groups(); ++gi) {
        int32_t s = 0;
        for (int64_t j = gi * L.g; j < (gi + 1) * L.g; ++j) s += int32_t(L.xq[i * L.k + j]) * L.wq[r * L.k + j];
        d[(i * L.n + r) * L.groups() + gi] = s;
      }
  return d;
}

// The float epilogue each path promises (w4a8_tiles.h): groups summed in order, y = y + dot_g * s_g, then
// y * sx + bias.  Every aarch64 path fuses both steps; on x86 the SIMD paths fuse the group step, AVX2 the last
// one too, the portable path neither (the driver is built with -ffp-contract=off, so unfused means unfused).
struct Epilogue {
  bool fused_groups, fused_finish;
};

Epilogue epilogue(int64_t isa) {
#ifdef ANYCHIP_ARM
  (void)isa;
  return {true, true};
#else
  return {isa != kPortable, isa == kAvx2};
#endif
}

std::vector<float> ref_output(const Linear& L, const std::vector<int32_t>& dots, Epilogue e) {
  std::vector<float> y(L.m * L.n);
  for (int64_t i = 0; i < L.m; ++i)
    for (int64_t r = 0; r < L.n; ++r) {
      float acc = 0.f;
      for (int64_t gi = 0; gi < L.groups(); ++gi) {
        const float d = float(dots[(i * L.n + r) * L.groups() + gi]), s = L.sw[r * L.groups() + gi];
        acc = e.fused_groups ? std::fma(d, s, acc) : acc + d * s;
      }
      const float b = L.bias.empty() ? 0.f : L.bias[r];
      y[i * L.n + r] = e.fused_finish ? std::fma(acc, L.sx[i], b) : acc * L.sx[i] + b;
    }
  return y;
}

// ---------------------------------------------------------------- layouts (the Python ones are in the fixtures)

int64_t blocks(int64_t n) { return (n + kRows - 1) / kRows; }

uint8_t u4(const Linear& L, int64_t r, int64_t kk) { return r < L.n ? uint8_t(L.wq[r * L.k + kk] + 8) : 8; }

std::vector<uint8_t> pack_blocked(const Linear& L) {
  std::vector<uint8_t> w(blocks(L.n) * L.k * 8);
  for (int64_t b = 0; b < blocks(L.n); ++b)
    for (int64_t c = 0; c < L.k / 8; ++c)
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t row = b * kRows + r;
          w[(b * (L.k / 8) + c) * 64 + r * 4 + j] = uint8_t(u4(L, row, 8 * c + j) | (u4(L, row, 8 * c + 4 + j) << 4));
        }
  // padded rows: zero weights are u4 8, both nibbles
  return w;
}

std::vector<uint8_t> pack_pairs(const Linear& L) {
  std::vector<uint8_t> w(blocks(L.n) * L.k * 8);
  for (int64_t b = 0; b < blocks(L.n); ++b)
    for (int64_t c = 0; c < L.k / 16; ++c)
      for (int64_t q = 0; q < 8; ++q)
        for (int64_t i = 0; i < 2; ++i)
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t row = b * kRows + 2 * q + i;
            w[(b * (L.k / 16) + c) * 128 + 16 * q + 8 * i + j] =
                uint8_t(u4(L, row, 16 * c + j) | (u4(L, row, 16 * c + 8 + j) << 4));
          }
  return w;
}

std::vector<float> pack_scales(const Linear& L) {
  std::vector<float> s(blocks(L.n) * L.groups() * kRows, 0.f);
  for (int64_t r = 0; r < L.n; ++r)
    for (int64_t gi = 0; gi < L.groups(); ++gi)
      s[((r / kRows) * L.groups() + gi) * kRows + r % kRows] = L.sw[r * L.groups() + gi];
  return s;
}

// ---------------------------------------------------------------- running the shipped kernels

struct Prepared {
  std::vector<uint8_t> blocked, pairs;
  std::vector<float> scales;
  std::vector<Bf16> scales_bf16;  // when not empty, the kernels read these (the layout of a bf16 checkpoint)
};

Prepared prepare(const Linear& L) { return {pack_blocked(L), pack_pairs(L), pack_scales(L), {}}; }

// The layout of a checkpoint whose scales are bf16: L's scales rounded to bf16 (the reference then uses those
// values), the kernels given their bits.
Prepared prepare_bf16_scales(Linear& L) {
  for (auto& v : L.sw) v = f32_from_bits(uint32_t(bf16_bits(v)) << 16);
  Prepared P = prepare(L);
  for (float v : P.scales) P.scales_bf16.push_back(Bf16{bf16_bits(v)});
  return P;
}

// Runs the kernels of `isa` on L into `out` (M x N of out_type, or M x N x groups int32 when type is kI32).
void run_kernels(const Linear& L, const Prepared& P, int64_t isa, OutType type, void* out) {
  std::vector<int32_t> xcorr(L.m * L.groups());
  for (int64_t i = 0; i < L.m; ++i) group_corr_row(L.xq.data() + i * L.k, L.k, L.g, xcorr.data() + i * L.groups());
  Problem p{};
  p.xq = L.xq.data();
  p.sx = L.sx.data();
  p.xcorr = xcorr.data();
  p.w = isa == kArmI8mm ? P.pairs.data() : P.blocked.data();
  if (P.scales_bf16.empty()) {
    p.sw = P.scales.data();
  } else {
    p.sw_bf16 = P.scales_bf16.data();
  }
  p.bias = L.bias.empty() ? nullptr : L.bias.data();
  p.out = out;
  p.out_type = type;
  p.m = L.m, p.n = L.n, p.k = L.k, p.groups = L.groups(), p.group_size = L.g;
  // small M as the torch binding's fused calls run it: each thread makes its own group corrections (run()'s prologue)
  auto own_corr = [&](Problem& local) {
    thread_local std::vector<int32_t> corr;
    corr.assign(L.m * L.groups(), 0);
    for (int64_t i = 0; i < L.m; ++i) group_corr_row(L.xq.data() + i * L.k, L.k, L.g, corr.data() + i * L.groups());
    local.xcorr = corr.data();
  };
  if (L.m <= 8) p.xcorr = nullptr;
  if (type == OutType::kI32)
    L.m <= 8 ? run<true>(p, isa, g_threads.n, g_threads, own_corr) : run<true>(p, isa, g_threads.n, g_threads);
  else
    L.m <= 8 ? run<false>(p, isa, g_threads.n, g_threads, own_corr) : run<false>(p, isa, g_threads.n, g_threads);
}

// Every kernel of `isa` against the scalar reference: exact group sums, exact outputs in all three types.
// Seconds spent per ISA (index: ISA code) and in the scalar reference.
double g_seconds[kIsaCount + 1] = {};
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void check_kernels(const Linear& L, const Prepared& P, int64_t isa, const std::vector<int32_t>& dots,
                   const char* what, bool half_types = true) {
  const double t0 = now();
  const std::vector<float> y = ref_output(L, dots, epilogue(isa));
  // each output buffer has kGuard sentinel elements past its end: a tile that writes past M x N trips them
  constexpr size_t kGuard = 64;
  std::vector<int32_t> got(dots.size() + kGuard, -1);
  run_kernels(L, P, isa, OutType::kI32, got.data());
  CHECK(std::all_of(got.end() - kGuard, got.end(), [](int32_t v) { return v == -1; }), "%s %s: wrote past the group sums", what, isa_name(isa));
  for (size_t i = 0, shown = 0; i < dots.size(); ++i)
    if (got[i] != dots[i] && shown++ < 3) CHECK(false, "%s %s: dot[%zu] = %d, reference %d", what, isa_name(isa), i, got[i], dots[i]);
  std::vector<float> yf(y.size() + kGuard, -1.f);
  run_kernels(L, P, isa, OutType::kF32, yf.data());
  CHECK(std::all_of(yf.end() - kGuard, yf.end(), [](float v) { return v == -1.f; }), "%s %s: wrote past the output", what, isa_name(isa));
  for (size_t i = 0, shown = 0; i < y.size(); ++i)
    if (f32_bits(yf[i]) != f32_bits(y[i]) && shown++ < 3)
      CHECK(false, "%s %s: y[%zu] = %.9g, reference %.9g", what, isa_name(isa), i, yf[i], y[i]);
  for (OutType t : {OutType::kBF16, OutType::kF16}) {
    if (!half_types) break;
    std::vector<uint16_t> yh(y.size() + kGuard, 0xFFFF);
    run_kernels(L, P, isa, t, yh.data());
    CHECK(std::all_of(yh.end() - kGuard, yh.end(), [](uint16_t v) { return v == 0xFFFF; }), "%s %s: wrote past the output", what, isa_name(isa));
    for (size_t i = 0, shown = 0; i < y.size(); ++i) {
      const uint16_t want = t == OutType::kBF16 ? bf16_bits(y[i]) : fp16_bits(y[i]);
      if (yh[i] != want && shown++ < 3)
        CHECK(false, "%s %s: %s y[%zu] = 0x%04x, reference 0x%04x", what, isa_name(isa),
              t == OutType::kBF16 ? "bf16" : "fp16", i, yh[i], want);
    }
  }
  g_seconds[isa] += now() - t0;
}

// ---------------------------------------------------------------- 1. conversions and quantizers

void check_conversions() {
#ifdef ANYCHIP_ARM
  for (uint32_t h = 0; h < 65536; ++h) {  // fp16 -> fp32 against FCVTL
    const float want = vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(uint16_t(h)))), 0);
    const float got = to_f(Fp16{uint16_t(h)});
    CHECK(f32_bits(got) == f32_bits(want) || (std::isnan(got) && std::isnan(want)), "fp16 0x%04x -> %a, FCVTL %a", h,
          got, want);
  }
  // fp32 -> fp16 against FCVTN (round to nearest even): a stride over all floats, and every tie between two
  // neighbouring halves with the floats either side of it (ties are too rare for the stride to meet)
  auto fcvtn = [](float f) { return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(f))), 0); };
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const float f = f32_from_bits(uint32_t(u));
    CHECK(fp16_bits(f) == fcvtn(f), "fp32 %a -> fp16 0x%04x, FCVTN 0x%04x", f, fp16_bits(f), fcvtn(f));
  }
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const float mid = float((double(to_f(Fp16{uint16_t(h)})) + double(to_f(Fp16{uint16_t(h + 1)}))) / 2);
    for (float sign : {1.f, -1.f})
      for (float f : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)})
        CHECK(fp16_bits(sign * f) == fcvtn(sign * f), "fp32 %a -> fp16 0x%04x, FCVTN 0x%04x", sign * f,
              fp16_bits(sign * f), fcvtn(sign * f));
  }
#endif
  // fp32 -> bf16: the nearer of the two neighbours (ties to even), checked in double
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const float f = f32_from_bits(uint32_t(u));
    if (std::isnan(f)) {
      CHECK(bf16_bits(f) == 0x7FC0, "bf16 of a NaN");
      continue;
    }
    const uint16_t lo = uint16_t(u >> 16), got = bf16_bits(f);
    const double dlo = to_f(Bf16{lo}), dhi = to_f(Bf16{uint16_t(lo + 1)});
    const double elo = std::fabs(double(f) - dlo), ehi = std::fabs(double(f) - dhi);
    const uint16_t want = (elo < ehi || (elo == ehi && !(lo & 1))) ? lo : uint16_t(lo + 1);
    if ((lo & 0x7F80) != 0x7F80 && (uint16_t(lo + 1) & 0x7F80) != 0x7F80)
      CHECK(got == want, "fp32 %a -> bf16 0x%04x, nearest 0x%04x", f, got, want);
  }
  for (uint32_t b = 0; b < 0x7F7F; b += 7) {  // ties between neighbouring bf16 go to the even one
    const uint32_t tie = (b << 16) | 0x8000;
    const uint16_t even = (b & 1) ? uint16_t(b + 1) : uint16_t(b);
    CHECK(bf16_bits(f32_from_bits(tie)) == even, "bf16 tie 0x%08x -> 0x%04x, even 0x%04x", tie,
          bf16_bits(f32_from_bits(tie)), even);
    CHECK(bf16_bits(f32_from_bits(tie + 1)) == uint16_t(b + 1), "bf16 above the tie 0x%08x", tie);
    CHECK(bf16_bits(f32_from_bits(tie - 1)) == uint16_t(b), "bf16 below the tie 0x%08x", tie);
  }
}

template <typename T>
void check_quantizer_rows(std::mt19937& rng, T (*make)(float)) {
  for (int64_t k : {1, 3, 37, 576, 2048}) {
    for (int row = 0; row < 6; ++row) {
      std::vector<T> x(k);
      std::normal_distribution<float> nd(0.f, std::pow(10.f, float(row) - 3.f));
      for (auto& v : x) v = make(nd(rng));
      if (row == 0) std::fill(x.begin(), x.end(), make(0.f));
      if (row == 1 && k >= 8) {  // amax 127: scale 1, halves are ties
        const float ties[8] = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f};
        for (int i = 0; i < 8; ++i) x[i] = make(ties[i]);
      }
      std::vector<int8_t> qa(k), qb(k);
      float sa, sb;
      quantize_row_scalar(x.data(), k, qa.data(), &sa);
      for (int level = kQuantSimd; level <= quant_simd(); ++level) {  // every SIMD quantizer this CPU runs
        quantize_row(x.data(), k, qb.data(), &sb, level);
        CHECK(f32_bits(sa) == f32_bits(sb) && qa == qb, "quantizer %d disagrees (K=%ld, row %d, %zu-byte input)",
              level, long(k), row, sizeof(T));
      }
      if (row == 1 && k >= 8)
        CHECK(qa[1] == 0 && qa[2] == 2 && qa[3] == 2 && qa[4] == 0 && qa[5] == -2 && qa[7] == 126, "ties not to even");
    }
  }
}

void check_quantizers() {
  std::mt19937 rng(7);
  check_quantizer_rows<float>(rng, [](float f) { return f; });
  check_quantizer_rows<Bf16>(rng, [](float f) { return Bf16{bf16_bits(f)}; });
  check_quantizer_rows<Fp16>(rng, [](float f) { return Fp16{fp16_bits(f)}; });
}

// ---------------------------------------------------------------- 2. fixtures from the torch reference

struct Reader {
  std::vector<char> data;
  size_t at = 0;
  template <typename T>
  std::vector<T> take(int64_t count) {
    std::vector<T> v(count);
    if (at + count * sizeof(T) > data.size()) throw std::runtime_error("fixture truncated");
    std::memcpy(v.data(), data.data() + at, count * sizeof(T));
    at += count * sizeof(T);
    return v;
  }
};

template <typename T>
void quantize_all(const T* x, Linear& L, int level) {
  L.xq.resize(L.m * L.k);
  L.sx.resize(L.m);
  for (int64_t i = 0; i < L.m; ++i) quantize_row(x + i * L.k, L.k, L.xq.data() + i * L.k, &L.sx[i], level);
}

void check_fixture(const std::string& path, const std::vector<int64_t>& isas) {
  Reader rd;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    CHECK(false, "cannot open %s", path.c_str());
    return;
  }
  char buf[1 << 16];
  for (size_t got; (got = std::fread(buf, 1, sizeof(buf), f)) > 0;) rd.data.insert(rd.data.end(), buf, buf + got);
  std::fclose(f);
  if (rd.data.size() < 40 || std::memcmp(rd.data.data(), "ANYW4A8", 8) != 0) {
    CHECK(false, "%s: not a fixture (magic)", path.c_str());
    return;
  }
  rd.at = 8;
  const auto h = rd.take<int32_t>(8);  // version, m, k, n, g, x_dtype, has_bias, exact
  if (h[0] != 1) {
    CHECK(false, "%s: fixture version %d, the driver knows 1: regenerate with tests/arm/fixtures.py", path.c_str(), h[0]);
    return;
  }
  Linear L{h[1], h[2], h[3], h[4], {}, {}, {}, {}, {}};
  const int x_dtype = h[5];
  const bool exact = h[7] != 0;
  std::vector<float> xf;
  std::vector<uint16_t> xh;
  if (x_dtype == 0) xf = rd.take<float>(L.m * L.k); else xh = rd.take<uint16_t>(L.m * L.k);
  L.wq = rd.take<int8_t>(L.n * L.k);
  L.sw = rd.take<float>(L.n * L.groups());
  if (h[6]) L.bias = rd.take<float>(L.n);
  const auto xq = rd.take<int8_t>(L.m * L.k);
  const auto sx = rd.take<float>(L.m);
  const auto dots = rd.take<int32_t>(L.m * L.n * L.groups());
  const auto y64 = rd.take<double>(L.m * L.n);
  const auto blocked = rd.take<uint8_t>(blocks(L.n) * L.k * 8);
  const auto bscales = rd.take<float>(blocks(L.n) * L.groups() * kRows);
  const auto pairs = rd.take<uint8_t>(blocks(L.n) * L.k * 8);
  CHECK(rd.at == rd.data.size(), "%s: %zu bytes after the last array", path.c_str(), rd.data.size() - rd.at);
  const char* name = path.c_str() + path.rfind('/') + 1;

  for (int level = kQuantScalar; level <= quant_simd(); ++level) {  // every quantizer this CPU runs, vs the reference
    if (x_dtype == 0) quantize_all(xf.data(), L, level);
    else if (x_dtype == 1) quantize_all(reinterpret_cast<const Bf16*>(xh.data()), L, level);
    else quantize_all(reinterpret_cast<const Fp16*>(xh.data()), L, level);
    CHECK(L.xq == xq, "%s: quantizer %d: INT8 activations differ from the reference", name, level);
    CHECK(std::memcmp(L.sx.data(), sx.data(), 4 * L.m) == 0, "%s: token scales differ from the reference", name);
  }
  const auto my_dots = ref_dots(L);
  CHECK(my_dots == dots, "%s: the driver's INT32 group sums differ from the reference", name);
  const auto y = ref_output(L, my_dots, epilogue(kPortable));
  double ymax = 1e-6;
  for (double v : y64) ymax = std::max(ymax, std::fabs(v));
  for (int64_t i = 0; i < L.m * L.n; ++i) {
    const double err = std::fabs(double(y[i]) - y64[i]), bound = exact ? 0.0 : 1e-5 * ymax + 1e-5 * std::fabs(y64[i]);
    CHECK(err <= bound, "%s: y[%ld] = %.9g, reference %.9g (|err| %.3g > %.3g)", name, long(i), y[i], y64[i], err, bound);
  }
  const Prepared P = prepare(L);
  CHECK(P.blocked == blocked, "%s: C++ blocked packing differs from cpu_x86.blocked_layout", name);
  CHECK(P.scales == bscales, "%s: C++ scale packing differs from cpu_x86.blocked_layout", name);
  CHECK(P.pairs == pairs, "%s: C++ pair packing differs from arm_neon.pair_layout", name);
  const Prepared from_python{blocked, pairs, bscales, {}};  // the kernels on the bytes Python prepares
  for (int64_t isa : isas) check_kernels(L, from_python, isa, dots, name);
  std::printf("fixture %-40s ok\n", name);
}

// ---------------------------------------------------------------- 3. the sweep

Linear random_linear(int64_t m, int64_t k, int64_t n, int64_t g, std::mt19937& rng) {
  Linear L{m, k, n, g, std::vector<int8_t>(m * k), std::vector<float>(m), std::vector<int8_t>(n * k),
           std::vector<float>(n * (k / g)), {}};
  std::uniform_int_distribution<int> wd(-8, 7), xd(-127, 127);
  std::uniform_real_distribution<float> sd(1e-3f, 2e-2f), td(1e-3f, 0.1f);
  for (auto& v : L.wq) v = int8_t(wd(rng));
  for (auto& v : L.xq) v = int8_t(xd(rng));
  for (auto& v : L.sw) v = sd(rng);
  for (auto& v : L.sx) v = td(rng);
  for (int64_t j = 0; j < g; ++j) L.wq[j] = -8, L.xq[j] = -127;  // the largest |dot| a group reaches
  for (int64_t j = k - g; j < k; ++j) L.wq[(n - 1) * k + j] = 7;
  if (m > 2) std::fill(L.xq.begin() + k, L.xq.begin() + 2 * k, 0), L.sx[1] = 0.f;
  if ((m + n) % 2) {
    L.bias.resize(n);
    for (auto& v : L.bias) v = sd(rng) - 0.01f;
  }
  return L;
}

// BlockSchedule hands out every block of a call exactly once, in chunks of whole units (but the call's last), at
// most split.chunk long, whichever threads turn up: all of them in turn, or one alone (the others preempted).
void check_schedule() {
  for (int64_t unit = 1; unit <= 2; ++unit)
    for (int64_t threads = 1; threads <= 11; threads += threads < 4 ? 1 : 7)
      for (int64_t nblocks = 1; nblocks <= 70; ++nblocks)
        for (int64_t chunk : {unit, 3 * unit, 8 * unit}) {
          const Split split{std::min(threads, nblocks), chunk, unit, unit};
          for (int order = 0; order < 3; ++order) {  // round robin; the first thread alone; the last alone
            BlockSchedule schedule(nblocks, split);
            std::vector<int> seen(nblocks, 0);
            std::vector<bool> done(split.threads, false);
            int64_t b0, b1, turn = 0, left = split.threads;
            while (left > 0) {
              const int64_t me = order == 0 ? turn++ % split.threads : order == 1 ? 0 : split.threads - 1;
              if (done[me]) continue;
              if (!schedule.next(me, &b0, &b1)) {
                done[me] = true, --left;
                if (order) break;  // one thread alone: it found nothing left anywhere
                continue;
              }
              CHECK(0 <= b0 && b0 < b1 && b1 <= nblocks && b1 - b0 <= chunk && b0 % unit == 0 &&
                        ((b1 - b0) % unit == 0 || b1 == nblocks),
                    "schedule: chunk [%ld, %ld) of %ld blocks, unit %ld, chunk %ld, %ld threads", long(b0),
                    long(b1), long(nblocks), long(unit), long(chunk), long(split.threads));
              for (int64_t b = b0; b < b1; ++b) ++seen[b];
            }
            for (int64_t b = 0; b < nblocks; ++b)
              CHECK(seen[b] == 1, "schedule: block %ld of %ld taken %d times (%ld threads, unit %ld, order %d)",
                    long(b), long(nblocks), seen[b], long(split.threads), long(unit), order);
          }
        }
}

// bf16 / fp16 outputs (the same kernels with another store) on every fourth shape.
void sweep(const std::vector<int64_t>& isas) {
  std::mt19937 rng(11);
  int cases = 0;
  for (int64_t m : {1, 3, 7, 64})
    for (int64_t k : {576, 2048})
      for (int64_t n : {17, 576, 1536})
        for (int64_t g : {32, 64, 128}) {
          Linear L = random_linear(m, k, n, g, rng);
          const double t0 = now();
          const auto dots = ref_dots(L);
          g_seconds[kIsaCount] += now() - t0;
          const bool bf16_scales = cases % 2;  // every other shape: scales rounded to bf16, read as bf16
          const Prepared P = bf16_scales ? prepare_bf16_scales(L) : prepare(L);
          char what[64];
          std::snprintf(what, sizeof(what), "M%ld-K%ld-N%ld-G%ld%s", long(m), long(k), long(n), long(g),
                        bf16_scales ? " bf16 scales" : "");
          for (int64_t isa : isas) check_kernels(L, P, isa, dots, what, cases % 4 == 0);
          ++cases;
        }
  // every tile height and tail (M = 1..9), and the token panels (M = 63, 129 at K = 2048: 64-token panels)
  for (int64_t m : {1, 2, 4, 5, 6, 8, 9, 63, 129}) {
    Linear L = random_linear(m, m > 9 ? 2048 : 576, 33, 64, rng);
    const auto dots = ref_dots(L);
    const Prepared P = m % 2 ? prepare_bf16_scales(L) : prepare(L);
    char what[48];
    std::snprintf(what, sizeof(what), "tiles M%ld%s", long(m), m % 2 ? " bf16 scales" : "");
    for (int64_t isa : isas) check_kernels(L, P, isa, dots, what);
    ++cases;
  }
  std::printf("sweep: %d shapes, scalar reference %.1f s;", cases, g_seconds[kIsaCount]);
  for (int64_t isa : isas) std::printf(" %s %.1f s", isa_name(isa), g_seconds[isa]);
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string expect, fixtures;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--expect" && i + 1 < argc) expect = argv[++i];
    else if (a == "--fixtures" && i + 1 < argc) fixtures = argv[++i];
    else if (a == "--threads" && i + 1 < argc) g_threads.n = std::atol(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s --expect ISA [--fixtures DIR] [--threads N]\n", argv[0]);
      return 2;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  int64_t found[kIsaCount];
  const std::vector<int64_t> isas(found, found + supported_isas(found));
  std::printf("ISAs on this CPU, best first:");
  for (int64_t isa : isas) std::printf(" %s", isa_name(isa));
  std::printf("\n");
  if (!expect.empty() && expect != isa_name(isas[0])) {
    std::printf("FAIL: dispatch picks %s, this CPU model should give %s\n", isa_name(isas[0]), expect.c_str());
    return 1;
  }
  check_conversions();
  check_quantizers();
  check_schedule();
  if (!fixtures.empty()) {
    std::vector<std::string> files;
    if (DIR* d = opendir(fixtures.c_str())) {
      while (dirent* e = readdir(d))
        if (std::string(e->d_name).size() > 4 && std::string(e->d_name).substr(std::string(e->d_name).size() - 4) == ".bin")
          files.push_back(fixtures + "/" + e->d_name);
      closedir(d);
    }
    CHECK(!files.empty(), "no fixtures in %s", fixtures.c_str());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) check_fixture(f, isas);
  }
  // The portable path is the same code on every CPU model: swept where it is the best (the run without dotprod).
  std::vector<int64_t> swept;
  for (int64_t isa : isas)
    if (isa != kPortable || isas.size() == 1) swept.push_back(isa);
  sweep(swept);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s: %d failures, %.1f s\n", failures ? "FAILED" : "passed", failures, s);
  return failures ? 1 : 0;
}
