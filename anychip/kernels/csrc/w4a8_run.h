// Dispatch (ISA code -> tile kernels) and the threaded driver loop over weight blocks and token panels.
// Torch-free: the caller passes its thread pool as `parallel(threads, work)`, which runs work() on `threads`
// threads (at::parallel_for in the binding, std::thread in the Arm test driver).
#pragma once

#include "w4a8_arm.h"
#include "w4a8_amx.h"
#include "w4a8_tiles.h"
#include "w4a8_x86.h"

#include <memory>
#include <numeric>
#include <vector>

namespace anychip {

using TileFn = void (*)(const Problem&, int64_t, int64_t);

// Tuning knobs (compile-time; the defaults won on a 2-core AMD EPYC Zen 5, AVX512-VNNI, single-thread CPU time):
//   tokens per AVX512 GEMM tile  4 (acc x2): 714 GOPS, 6 (acc x1): 670, 8 (acc x1): 770, 8 (acc x2): 775
//   token panel in L2            128 KiB: +3-4% over no panels (K=6144), same as 256 KiB
//   GEMV accumulators per token  4 vs 2: within noise; prefetch 2048 B ahead: ~+8% over 1024 or none, 512 B: -15%
//                                (since replaced on x86 by 12 KB ahead into L2: kPrefetchL2, w4a8_tiles.h)
//   wide tile, 2 blocks (32 rows) x 6 tokens: 752-768 GOPS at K=2048 (8x16: 732), 723 at K=576 (8x16: 640);
//                                   2 blocks x 4 tokens: 705-712
//   vectorized epilogue (vs scalar stores): K=576 550 -> 640 GOPS; vpdpbusd {1to16} broadcast: +0-10% (small M)
//   measured vpdpbusd peak of one core: about 930 GOPS, so the GEMM runs at about 80% of it
#ifndef ANYCHIP_TILE_M
#define ANYCHIP_TILE_M 8
#endif
#ifndef ANYCHIP_GEMV_ACC
#define ANYCHIP_GEMV_ACC 4
#endif
#ifndef ANYCHIP_GEMM_ACC
#define ANYCHIP_GEMM_ACC 1
#endif
// Tokens sharing each unpacked weight vector in the GEMM path: AVX512 has 32 registers for 8 x (acc, sum), AVX2
// only 16; NEON has 32 of 4 lanes, and 4 tokens x 16 rows of INT32 accumulators already take 16 of them.
constexpr int64_t tile_m(int64_t isa) { return isa == kAvx512Vnni ? ANYCHIP_TILE_M : 4; }

template <int MT, bool DOTS>
TileFn tile_for(int64_t isa) {
  switch (isa) {
#ifdef ANYCHIP_X86
    case kAvx512Vnni:
      return &tile_avx512<MT, 1, (MT == 1 ? ANYCHIP_GEMV_ACC : MT < 8 ? 2 : ANYCHIP_GEMM_ACC), DOTS>;
    case kAvx2:
      return &tile_avx2<MT, DOTS>;
#endif
#ifdef ANYCHIP_ARM
    case kArmDotprod:
      return &tile_dotprod<MT, (MT == 1 ? 2 : 1), DOTS>;
    case kArmI8mm:
      return &tile_i8mm<MT, DOTS>;
#endif
    default:
      return &tile_portable<MT, DOTS>;
  }
}

template <bool DOTS>
TileFn tile_fn(int64_t isa, int64_t mt) {
  switch (mt) {
    case 1: return tile_for<1, DOTS>(isa);
    case 2: return tile_for<2, DOTS>(isa);
    case 3: return tile_for<3, DOTS>(isa);
    case 4: return tile_for<4, DOTS>(isa);
    case 5: return tile_for<5, DOTS>(isa);
    case 6: return tile_for<6, DOTS>(isa);
    case 7: return tile_for<7, DOTS>(isa);
    default: return tile_for<8, DOTS>(isa);
  }
}

#ifndef ANYCHIP_WIDE_TILE_M
#define ANYCHIP_WIDE_TILE_M 6
#endif

// GEMM tile over two neighbouring weight blocks (32 rows), or nullptr where the ISA has none.  unpacked: the tile
// that reads the pair from p.wu, which run() fills with unpack_fn(isa) first.
template <bool DOTS>
TileFn wide_tile_fn([[maybe_unused]] int64_t isa, [[maybe_unused]] bool unpacked) {
#ifdef ANYCHIP_X86
  if (ANYCHIP_WIDE_TILE_M > 0 && isa == kAvx512Vnni) {
    constexpr int mt = ANYCHIP_WIDE_TILE_M > 0 ? ANYCHIP_WIDE_TILE_M : 1;
    return unpacked ? &tile_avx512<mt, 2, 1, DOTS, true> : &tile_avx512<mt, 2, 1, DOTS>;
  }
#endif
  return nullptr;
}

// Unpacks blocks [nb0, nb0 + nb) of p.w into dst (the wide tile's p.wu): (K/8) * kUnpackedChunkBytes a block.
using UnpackFn = void (*)(const Problem&, int64_t nb0, int64_t nb, uint8_t* dst);

// Calls with at least this many tokens unpack each pair of weight blocks once per token panel for the wide tile
// (w4a8_x86.h); fewer tokens share an unpacked pair among too few tiles to pay for the pass (0: never unpack).
#ifndef ANYCHIP_UNPACK_MIN_M
#define ANYCHIP_UNPACK_MIN_M 24
#endif

inline UnpackFn unpack_fn([[maybe_unused]] int64_t isa) {
#ifdef ANYCHIP_X86
  if (ANYCHIP_WIDE_TILE_M > 0 && isa == kAvx512Vnni) return &unpack_blocks_avx512<false>;
#endif
  return nullptr;
}

// Calls with at least this many tokens run the AMX-INT8 tiles (w4a8_amx.h) on the unpacked pairs, where the CPU has
// AMX and the group size fits it (0: never).
#ifndef ANYCHIP_AMX_MIN_M
#define ANYCHIP_AMX_MIN_M 32
#endif

// The AMX tile's unpacking of a pair (signed bytes), where there is one.
inline UnpackFn amx_unpack_fn() {
#ifdef ANYCHIP_X86
  return &unpack_blocks_avx512<true>;
#else
  return nullptr;
#endif
}

// The AMX tiles for a call of route `isa` (cpu.amx_int8 only; its op checked amx_usable before the call).
template <bool DOTS>
AmxFn amx_tiles_fn([[maybe_unused]] int64_t isa, [[maybe_unused]] const Problem& p) {
#ifdef ANYCHIP_X86
  if (ANYCHIP_AMX_MIN_M > 0 && isa == kAmxInt8 && p.m >= ANYCHIP_AMX_MIN_M && amx_fits(p.group_size))
    return &run_amx<DOTS>;
#endif
  return nullptr;
}

// This thread's buffer of at least `bytes`, 64-byte aligned; kept between calls, so a prefill allocates nothing.
inline uint8_t* thread_buffer(int64_t bytes) {
  thread_local std::vector<uint8_t> buf;
  if (int64_t(buf.size()) < bytes + 64) buf.resize(bytes + 64);
  const auto addr = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + (64 - addr % 64) % 64;
}

#ifndef ANYCHIP_PANEL_BYTES
#define ANYCHIP_PANEL_BYTES (128 * 1024)
#endif
// The AMX tiles' panels: every AMX CPU so far has 2 MB of L2 a core, and a larger panel unpacks each pair of weight
// blocks fewer times (SmolLM2's K = 576 at M = 512: once instead of three times). Same-process timings of the four
// G32 GEMMs of a layer on the 2-vCPU Xeon (2 threads, best of 15 x 5 calls, alternated, against 128 KB): M = 512
// 0.93-0.96x the time (three alternations), M = 2048 0.96-0.98x, M = 128 0.97-1.00x; 512 x 2048 x 6144 and
// 512 x 6144 x 2048 at G128 0.94-0.95x. 2 MB panels were no better (M = 512: 0.95-0.97x).
#ifndef ANYCHIP_AMX_PANEL_BYTES
#define ANYCHIP_AMX_PANEL_BYTES (512 * 1024)
#endif

#ifndef ANYCHIP_CHUNKS_PER_THREAD
#define ANYCHIP_CHUNKS_PER_THREAD 8
#endif
// Smallest chunk a thread takes (BlockSchedule), and the weight bytes per thread woken (M < 4): the old
// split gave a small GEMV (N = 192, K = 576: 62 KB) 12 chunks of one 5 KB block, a contended atomic each, and a
// second thread whose wake-up and join cost about as much as streaming the whole weight.  On the shared 2-core
// test machine one thread ran N = 192 in 7.1 us and two in 9.5 us (best of 12 rounds, same process).
#ifndef ANYCHIP_CHUNK_BYTES
#define ANYCHIP_CHUNK_BYTES (24 * 1024)
#endif
#ifndef ANYCHIP_THREAD_BYTES
#define ANYCHIP_THREAD_BYTES (64 * 1024)
#endif
// Smallest chunk at the end of a thread's range (BlockSchedule): one 16-row block of K = 576 (5.8 KB) streams in
// well under a us.
#ifndef ANYCHIP_TAIL_CHUNK_BYTES
#define ANYCHIP_TAIL_CHUNK_BYTES (6 * 1024)
#endif

// How one call splits its weight blocks over threads: chunks of `chunk` blocks at first, shrinking towards the end
// of each thread's range (see BlockSchedule) but never below `min_chunk`; every chunk a multiple of `unit` blocks
// but the call's last.
struct Split {
  int64_t threads, chunk, min_chunk, unit;
};

// unit 2 where the wide tile takes pairs of blocks: a chunk of odd size would leave its last block to the 16-row
// tile (a third of SmolLM2's o_proj blocks at M = 512 on 2 threads; the unpacked pair tile is about 20% faster a
// block).
inline Split split_blocks(const Problem& p, int64_t max_threads, int64_t unit = 1) {
  const int64_t nblocks = (p.n + kRows - 1) / kRows;
  const int64_t block_bytes = p.k * 8 + p.groups * kRows * 4;  // weight + scales of 16 rows
  const int64_t by_bytes = std::max<int64_t>(1, nblocks * block_bytes / ANYCHIP_THREAD_BYTES);
  // more tokens, more work per byte: M >= 4 takes every thread the blocks allow
  const int64_t wanted = p.m >= 4 ? max_threads : std::min(max_threads, by_bytes);
  const int64_t threads = std::max<int64_t>(1, std::min(wanted, nblocks));
  // chunks per thread: as many as ANYCHIP_CHUNKS_PER_THREAD, each at least ANYCHIP_CHUNK_BYTES, and always a whole
  // number per thread (3 chunks over 2 threads would leave one thread a third of the work to do alone)
  const int64_t min_chunk = std::max<int64_t>(1, ANYCHIP_CHUNK_BYTES / block_bytes);
  const int64_t per_thread = std::clamp<int64_t>(nblocks / (threads * min_chunk), 1, ANYCHIP_CHUNKS_PER_THREAD);
  const int64_t chunks = threads * per_thread;
  const auto whole_units = [unit](int64_t blocks) { return (blocks + unit - 1) / unit * unit; };
  const int64_t chunk = whole_units((nblocks + chunks - 1) / chunks);
  const int64_t tail = whole_units(std::max<int64_t>(1, (ANYCHIP_TAIL_CHUNK_BYTES) / block_bytes));
  return {threads, chunk, std::min(chunk, tail), unit};
}

// Which blocks each thread works on: every thread owns a contiguous range of the call's blocks (whole units; the
// last range ends at the last block) and claims chunks from its front, on a counter in a cache line of its own;
// a thread whose range is done takes chunks from the others' (a thread the OS preempts on a shared machine delays
// only its current chunk, not its whole range). Chunks are at most split.chunk and at most half of what is left of
// their range, never below split.min_chunk, so the last ones are small and the threads finish close together.
// One shared counter for all threads (the scheme before) bounced its cache line between the cores at every claim
// and interleaved the threads' chunks over the weight; on the 2-core AMD EPYC (Zen 1, AVX2) the 120 SmolLM2
// decode linears took 5.32-5.93 ms a step that way against 4.84-5.54 ms with owned ranges, 7-11% less in each of
// four alternated pairs of processes (fastest of 60 steps; docs/kernels-cpu.md, "Threads").
class BlockSchedule {
 public:
  BlockSchedule(int64_t nblocks, const Split& split)
      : split_(split),
        heap_(split.threads > kLocal ? new Range[split.threads] : nullptr),
        ranges_(heap_ ? heap_.get() : local_) {
    const int64_t units = (nblocks + split.unit - 1) / split.unit;
    const auto start = [&](int64_t t) { return std::min(nblocks, units * t / split.threads * split.unit); };
    for (int64_t t = 0; t < split.threads; ++t) {
      ranges_[t].next.store(start(t), std::memory_order_relaxed);
      ranges_[t].end = t + 1 == split.threads ? nblocks : start(t + 1);
    }
  }

  // The next chunk [*b0, *b1) for the thread that owns range `me`: from its own range, then from the others' in
  // turn; false when every range is done.
  bool next(int64_t me, int64_t* b0, int64_t* b1) {
    for (int64_t i = 0; i < split_.threads; ++i) {
      Range& r = ranges_[(me + i) % split_.threads];
      int64_t cur = r.next.load(std::memory_order_relaxed);
      while (cur < r.end) {
        const int64_t half = (r.end - cur) / 2 / split_.unit * split_.unit;
        const int64_t size =
            split_.threads == 1 ? split_.chunk : std::max(split_.min_chunk, std::min(split_.chunk, half));
        if (r.next.compare_exchange_weak(cur, cur + size, std::memory_order_relaxed)) {
          *b0 = cur;
          *b1 = std::min(r.end, cur + size);
          return true;
        }
      }
    }
    return false;
  }

 private:
  struct alignas(64) Range {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  static constexpr int64_t kLocal = 8;
  Split split_;
  Range local_[kLocal];
  std::unique_ptr<Range[]> heap_;  // more than kLocal threads
  Range* ranges_;                  // local_ or heap_
};

// A no-op prologue: the activations of `p` are ready before the call.
struct ReadyActivations {
  void operator()(Problem&) const {}
};

// The tile kernels run() takes for a call of route `route` (ISA code): the wide tile and its unpacking of pairs of
// blocks, the AMX tiles on the (signed) unpacked pair; nullptr where the call has none.
template <bool DOTS>
struct CallTiles {
  int64_t isa;  // the vector ISA: AMX-INT8's route is AVX512-VNNI's but for its tiles
  UnpackFn unpack;
  TileFn wide;
  AmxFn amx;

  CallTiles(const Problem& p, int64_t route) : isa(route == kAmxInt8 ? kAvx512Vnni : route) {
    unpack = ANYCHIP_UNPACK_MIN_M > 0 && p.m >= ANYCHIP_UNPACK_MIN_M ? unpack_fn(isa) : nullptr;
    // the wide tile always takes ANYCHIP_WIDE_TILE_M tokens: never hand it fewer (that would read and write past M)
    wide = p.m >= ANYCHIP_WIDE_TILE_M ? wide_tile_fn<DOTS>(isa, unpack != nullptr) : nullptr;
    amx = unpack && wide ? amx_tiles_fn<DOTS>(route, p) : nullptr;
  }
};

// The first token whose group corrections (Problem::xcorr) a call of route `route` reads; the rows before it need
// none. The AMX tiles' signed weights need no correction, and where they take the call they take every whole 16
// tokens of every pair of blocks (panels are multiples of 16 tokens, so only the last panel has a rest), leaving
// the VNNI tile the tokens past the last whole 16; a call with an odd number of blocks runs its last block on the
// VNNI tile for every token. At M = 512 computing corrections no tile reads was 2% of a prefill on the Xeon.
template <bool DOTS>
int64_t corrections_from(const Problem& p, int64_t route) {
  const int64_t nblocks = (p.n + kRows - 1) / kRows;
  if (!CallTiles<DOTS>(p, route).amx || nblocks % 2) return 0;
  return p.m / kAmxTokens * kAmxTokens;
}

// Threads take chunks of weight blocks through a BlockSchedule (their own range first, then the others').  Within a
// chunk, tokens go in panels whose activations stay in L2 (about ANYCHIP_PANEL_BYTES of int8,
// ANYCHIP_AMX_PANEL_BYTES for the AMX tiles) while the chunk's blocks stream past; without panels every block
// would re-read all M x K activations from L3.
// `prologue(local)` runs once on each thread taking part, before its first chunk, on that thread's copy of the
// problem: the fused linear quantizes the (few) tokens there, on every thread, instead of in a pass of its own.
template <bool DOTS, typename Parallel, typename Prologue = ReadyActivations>
void run(const Problem& p, int64_t route, int64_t max_threads, Parallel&& parallel, Prologue&& prologue = {}) {
  const CallTiles<DOTS> tiles(p, route);
  const int64_t isa = tiles.isa;
  const int64_t nblocks = (p.n + kRows - 1) / kRows;
  const UnpackFn unpack = tiles.unpack;
  const TileFn wide = tiles.wide;
  const AmxFn amx = tiles.amx;
  const UnpackFn amx_unpack = amx ? amx_unpack_fn() : nullptr;
  const int64_t mt = wide ? std::min<int64_t>(p.m, ANYCHIP_WIDE_TILE_M) : std::min(p.m, tile_m(isa));
  const int64_t unit = amx ? std::lcm(kAmxPanelTokens, mt) : mt;  // panels of whole AMX tiles (and tiles of mt)
  const int64_t panel_bytes = amx ? ANYCHIP_AMX_PANEL_BYTES : ANYCHIP_PANEL_BYTES;
  const int64_t panel = std::max<int64_t>(unit, (panel_bytes / p.k) / unit * unit);
  const TileFn tile = tile_fn<DOTS>(isa, mt);
  const Split split = split_blocks(p, max_threads, wide ? 2 : 1);
  BlockSchedule schedule(nblocks, split);
  std::atomic<int64_t> ticket{0};  // which range a thread owns: the order the threads arrive in
  auto body = [&](const Problem& q, int64_t b0, int64_t b1) {
    Problem u = q;  // the wide tile's problem: q, and the unpacked pair when there is one
    uint8_t* pair = unpack ? thread_buffer(2 * (q.k / 8) * kUnpackedChunkBytes) : nullptr;
    u.wu = pair;
    for (int64_t t0 = 0; t0 < q.m; t0 += panel) {
      const int64_t t1 = std::min(q.m, t0 + panel);
      const int64_t full_end = t0 + (t1 - t0) / mt * mt;
      const TileFn tail = t1 > full_end ? tile_fn<DOTS>(isa, t1 - full_end) : nullptr;
      int64_t nb = b0;
      if (amx) {  // a pair: AMX tiles of 16 tokens, the panel's last tokens (< 16) on the packed weights
        const int64_t amx_end = t0 + (t1 - t0) / kAmxTokens * kAmxTokens;
        const int64_t rest_end = amx_end + (t1 - amx_end) / mt * mt;
        const TileFn rest_tail = t1 > rest_end ? tile_fn<DOTS>(isa, t1 - rest_end) : nullptr;
        for (; nb + 2 <= b1; nb += 2) {
          if (amx_end > t0) amx_unpack(q, nb, 2, pair), amx(u, t0, amx_end, nb);
          for (int64_t b = nb; b < nb + 2; ++b) {
            for (int64_t t = amx_end; t < rest_end; t += mt) tile(q, t, b);
            if (rest_tail) rest_tail(q, rest_end, b);
          }
        }
      } else if (wide) {
        for (; nb + 2 <= b1; nb += 2) {
          if (unpack && full_end > t0) unpack(q, nb, 2, pair);
          for (int64_t t = t0; t < full_end; t += mt) wide(u, t, nb);
          if (tail) tail(q, full_end, nb), tail(q, full_end, nb + 1);
        }
      }
      for (; nb < b1; ++nb) {
        for (int64_t t = t0; t < full_end; t += mt) tile(q, t, nb);
        if (tail) tail(q, full_end, nb);
      }
    }
  };
  parallel(split.threads, [&]() {
    const int64_t me = ticket.fetch_add(1, std::memory_order_relaxed) % split.threads;
    int64_t b0, b1;
    if (!schedule.next(me, &b0, &b1)) return;  // nothing left for this thread: skip its prologue too
    Problem local = p;
    prologue(local);
    do body(local, b0, b1);
    while (schedule.next(me, &b0, &b1));
  });
}

}  // namespace anychip
