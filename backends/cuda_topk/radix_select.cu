// dispatch's own CUDA top-k: one CTA a row, one launch a call, exact whatever the data.
//
// Three instances, chosen per call on the host from its ints (rows, width): Wide (an 8192-entry list)
// at T = 512 or 1024 threads (at <= 64 registers a thread two 512-thread CTAs share an SM, so one
// row's select overlaps another row's read), and ShortList (a 4096-entry list, three 512-thread CTAs
// an SM) for many rows of at most ~24K keys. Per row:
// - short rows (n <= kShortPer * T: 16384 keys at 1024 threads, 8192 at 512, 4096 in the short-list
//   instance): the row read once into registers (scalar coalesced loads, so any start or stride), then
//   the exact radix select over those registers.
// - longer rows, the filtered pass: a sample of kSample keys (four adjacent keys at each of kSpots
//   spots spread over the row) gives a cut at the sample's r-th largest key (r four standard
//   deviations past what the sample expects above the k-th largest key); the row streamed once from
//   HBM with 16-byte loads (the first ones issued behind the sample's, the next ones in flight while the
//   current ones are filed), every value at or above the cut (a float compare) appended as its key to a
//   shared-memory list (a thread's 4 x kUnroll values take their slots with one warp scan and one shared
//   atomic per warp); a list of at least k keys is read into registers and takes the same radix select.
// The select over registers visits only the register slots that hold entries (a 2.4K-key row at 1024
// threads: 3 of 8).
// The radix select: up to three digits of the keys' window (a short row: 11 + 11 + 10 bits of the key;
// a candidate list: the 11 bits below its width of [cut, its largest key], then the next 11, then the
// rest); each round one histogram (shared atomics; the next round's histogram cleared meanwhile, two
// buffers) and one threshold search (a warp scan, then every warp sums the warps before it itself: two
// block-wide syncs), so three syncs a digit, and no further round once the threshold bin holds just the
// keys still needed, or at most 32 keys, which are then ranked against each other; then the keys above
// that bin and the first of its keys still needed (ties: any will do), each thread's output slots from
// one block-wide scan of its counts.
// Keys are the order-preserving uint32 form of the fp32 bits, NaN -> 0 (below -inf's key, so never
// selected).
// Otherwise (the sample misjudged the row, the list overflowed, too few numbers) the full select: a
// histogram of the whole row (its first stage_cap keys staged in shared memory, the rest re-read), the
// threshold bin's keys as the list, or the row itself when they overflow it.
// Rows with no more than k selectable (non-NaN) keys write every such position, then -1 (a row of at
// most k keys without any select: every_key_row).
// Output positions are relative to the row's start, or physical KV slots through the page table.
// A row's positions are in no promised order (some slots are taken by atomics).
// No host sync, no allocation: CUDA-graph safe; nothing outside [start, start + n) of a row, the
// lengths, starts, page rows or the page table's [0, pages) columns of a row is read.
// Launched with programmatic dependent launch where the host asks (sm90+, backends/shared/
// dependent_launch.py): every CTA waits for the kernel before it (the logits' writer) before its first
// global read, then lets the next kernel launch. (Clearing shared memory ahead of the wait made ptxas
// spill in the short-list instance, so the CTA's start alone overlaps the kernel before.)

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace {

constexpr int kMaxWarps = 32;   // a CTA of 1024 threads
constexpr int kSample = 1024;   // keys the cut samples from a long row
constexpr int kSpots = 256;     // where the sample's keys are read: four adjacent keys at each
constexpr int kBins = 2048;       // the first two rounds' digits: 11 bits
constexpr int kLastBins = 1024;   // the last round's: 10 bits
constexpr int kExactCutKeys = 256;  // the most sample keys of the cut's bin ranked for the exact cut
constexpr int kTieRank = 32;        // the largest threshold bin select_in_registers finishes by ranking

// The kernel's two instances, chosen per call on the host (radix_topk.py's `instance`).
// Wide: an 8192-entry list (the filtered pass's 2-7K on rows to 98K; a threshold bin's 1-3K), two
// 512-thread CTAs an SM (<= 64 registers a thread) or one of 1024.
struct Wide {
  static constexpr int kCandCap = 8192;  // candidates kept as a list
  static constexpr int kShortPer = 16;   // keys a thread holds of a short row: 8192 at 512 threads, 16384 at 1024
  static constexpr int kUnroll = 4;      // 16-byte loads each thread has in flight in the load passes
  static constexpr int blocks(int threads) { return 1024 / threads; }
};
// Many short rows: a 4096-entry list, three 512-thread CTAs an SM (<= 40 registers a thread), the
// same 11-bit cut (a list that overflows sends its row to the full select). Occupancy pays only there
// (many rows, short ones): on the H200 at 512 x 49K the same list lost 2x to the wide instance
// (round 4). The cut refined to 22 bits (a second histogram of the sample) was 3-6% slower in extend
// and at 512 x 24.5K (round 6, benchmark-history): its second round cost more than the overflows it saved.
struct ShortList {
  static constexpr int kCandCap = 4096;
  static constexpr int kShortPer = 8;
  static constexpr int kUnroll = 2;
  static constexpr int blocks(int) { return 3; }
};

template <class C>
struct alignas(16) Shared {
  using Config = C;
  static constexpr int kCandCap = C::kCandCap;
  int hist[2][kBins];  // a round's histogram and the next round's, cleared while the first fills
  uint32_t cand_key[kCandCap];
  int cand_pos[kCandCap];
  int warp_sums[kMaxWarps];
  int out_count;
  int cand_count;
  int eq_count;
  int selectable;
  int bin;
  int above;
  int in_bin;         // find_threshold's bin: its entries
  uint32_t cand_max;  // the list's largest key
  uint32_t cut;  // candidate_cut's exact cut, from the thread whose key it is
  uint32_t tie_key[kTieRank];  // a small threshold bin's keys and positions, ranked by rank_finish
  int tie_pos[kTieRank];
  int tie_count;
};

struct Params {
  const float* logits;
  int64_t stride_row;
  const int* lengths;
  int64_t stride_len;
  const int* starts;
  int64_t stride_start;
  int width;
  int k;
  int stage_cap;  // keys of a row staged in shared memory (a multiple of 4)
  int* out;
  const int* page_table;
  int64_t stride_pt;
  const int* page_rows;
  int64_t stride_page_rows;
  int table_rows;
  int table_pages;
  int block_size;
  int filtered;  // 1: the sampled cut and the filtered pass first; 0: the full select only (tests)
};

// griddepcontrol (sm90+): a no-op where the launch did not ask for PDL; absent below sm90.
__device__ __forceinline__ void wait_previous_then_launch_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ uint32_t ordered_key(float x) {
  // Flip the sign bit of a positive float, every bit of a negative one: unsigned order is value order.
  const uint32_t bits = __float_as_uint(x);
  const uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return x != x ? 0u : key;  // NaN: the lowest key, below -inf's 0x007FFFFF; bin 0 holds only NaN
}

struct PageRow {
  const int* row;
  int pages;
};

template <bool kHasPages>
__device__ __forceinline__ int slot_value(int pos, const PageRow& pr, int block_size) {
  if (!kHasPages) return pos;
  const int page = pos / block_size;
  if (page >= pr.pages) return -1;
  const int phys = pr.row[page];
  return phys >= 0 ? phys * block_size + pos % block_size : -1;
}

// Warp-aggregated slot: one shared atomic per warp for every lane that takes one.
__device__ __forceinline__ int warp_slot(bool take, int* counter) {
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, take);
  const int lane = threadIdx.x & 31;
  int base = 0;
  if (lane == 0 && mask) base = atomicAdd(counter, __popc(mask));
  base = __shfl_sync(0xFFFFFFFFu, base, 0);
  return base + __popc(mask & ((1u << lane) - 1u));
}

template <int T>
__device__ __forceinline__ void clear_bins(int* hist, int bins) {
  for (int b = threadIdx.x; b < bins; b += T) hist[b] = 0;
}

// The sum of `mine` over the threads before this one (one warp scan, the warps' totals published once,
// every warp summing the warps before it itself): one block-wide sync. s.warp_sums must be free.
template <int T, class S>
__device__ __forceinline__ int block_exclusive_sum(S& s, int mine) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) s.warp_sums[warp] = inclusive;
  __syncthreads();
  int earlier = lane < warp ? s.warp_sums[lane] : 0;
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) earlier += __shfl_xor_sync(0xFFFFFFFFu, earlier, d);
  return earlier + inclusive - mine;
}

// The bin b (of `bins`, ascending key order) of `hist` holding the need-th largest of its entries
// (1 <= need <= their total), how many entries lie in bins above b and how many in it: s.bin, s.above,
// s.in_bin. Two block-wide syncs: each thread scans its kOwn bins, then block_exclusive_sum.
template <int T, class S>
__device__ void find_threshold(S& s, const int* hist, int need, int bins) {
  constexpr int kOwn = kBins / T;  // bins a thread owns: descending positions kOwn*t .. kOwn*t + kOwn - 1
  const int t = threadIdx.x;
  const int b_hi = bins - 1 - kOwn * t;
  int h[kOwn];
  int sum = 0;
#pragma unroll
  for (int e = 0; e < kOwn; ++e) {
    h[e] = b_hi - e >= 0 ? hist[b_hi - e] : 0;
    sum += h[e];
  }
  int before = block_exclusive_sum<T>(s, sum);
#pragma unroll
  for (int e = 0; e < kOwn; ++e) {
    if (before < need && need <= before + h[e]) {
      s.bin = b_hi - e;
      s.above = before;
      s.in_bin = h[e];
    }
    before += h[e];
  }
  __syncthreads();
}

struct RowView {
  const float* src;    // the row's first visible logit
  const uint32_t* stage;  // stage[i + pad] is key i, for i < stage_cap
  int pad;
  int stage_cap;
  int n;

  __device__ __forceinline__ uint32_t key(int i) const {
    return i < stage_cap ? stage[i + pad] : ordered_key(src[i]);
  }
  // The keys before the first 16-byte-aligned one (at most 3); the row's 16-byte vectors start there.
  __device__ __forceinline__ int head() const { return min(n, (4 - pad) & 3); }
  __device__ __forceinline__ int vectors() const { return (n - head()) / 4; }
  __device__ __forceinline__ const float4* body() const { return reinterpret_cast<const float4*>(src + head()); }
};

// The full select's first pass: stage and count. The body is 16-byte loads from the first 16-byte-aligned key on; the keys
// before it (at most 3) and after the last full vector are read one at a time.
template <int T, int kUnroll>
__device__ void load_row(const RowView& v, uint32_t* stage, int* hist) {
  const int t = threadIdx.x;
  const int n = v.n;
  const int head = v.head();
  auto one = [&](int i) {
    const uint32_t key = ordered_key(v.src[i]);
    if (i < v.stage_cap) stage[i + v.pad] = key;
    atomicAdd(&hist[key >> 21], 1);
  };
  if (t < head) one(t);
  const int vectors = v.vectors();
  const float4* body = v.body();
  for (int base = 0; base < vectors; base += T * kUnroll) {
    float4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * T + t;
      if (j < vectors) x[u] = __ldg(body + j);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * T + t;
      if (j >= vectors) continue;
      const int i = head + 4 * j;
      const uint4 keys = make_uint4(ordered_key(x[u].x), ordered_key(x[u].y), ordered_key(x[u].z),
                                    ordered_key(x[u].w));
      if (i + 3 < v.stage_cap) {
        *reinterpret_cast<uint4*>(stage + i + v.pad) = keys;  // i + pad is a multiple of 4
      } else {
        if (i < v.stage_cap) stage[i + v.pad] = keys.x;
        if (i + 1 < v.stage_cap) stage[i + 1 + v.pad] = keys.y;
        if (i + 2 < v.stage_cap) stage[i + 2 + v.pad] = keys.z;
      }
      atomicAdd(&hist[keys.x >> 21], 1);
      atomicAdd(&hist[keys.y >> 21], 1);
      atomicAdd(&hist[keys.z >> 21], 1);
      atomicAdd(&hist[keys.w >> 21], 1);
    }
  }
  const int tail = head + 4 * vectors + t;
  if (tail < n) one(tail);
}

// The candidates of the later rounds: the list, or (when it overflowed) the row filtered to bin b1.
// f(key, pos, live) is called warp-uniformly (every lane of a warp calls it the same number of times).
template <int T, class S, typename F>
__device__ __forceinline__ void for_each_candidate(const RowView& v, const S& s, bool from_list, int count,
                                                   uint32_t b1, F f) {
  const int total = from_list ? count : v.n;
  for (int base = 0; base < total; base += T) {
    const int i = base + threadIdx.x;
    const bool in = i < total;
    uint32_t key = 0;
    int pos = 0;
    if (in) {
      key = from_list ? s.cand_key[i] : v.key(i);
      pos = from_list ? s.cand_pos[i] : i;
    }
    f(key, pos, in && (key >> 21) == b1);
  }
}

// The cut for the filtered pass over a long row (n > kCandCap): a key at or above it is a candidate.
// kSample keys from kSpots spots spread over the row, kSample / kSpots adjacent keys at each (adjacent
// lanes read one 32-byte sector: a quarter of the DRAM accesses of kSample scattered keys, whose
// loads held 9% of the stall samples at 512 x 49K on the H200). The cut is the sample's r-th largest
// key itself, r four standard deviations past the k * kSample / n the sample expects above the k-th
// largest key: found by its top-11-bit bin, then by each of that bin's sample keys counting the ones
// above it. The lower edge of that bin (the cut until 2026-12-02) let in up to a quarter octave more
// keys, as many more as the bin edges happened to allow: on the logits the step produces, rows that
// overflowed the list took the full select, and at 256 x 98K the kernel ran 111 us against 40 with this
// cut (H200, docs/benchmarks.md). Where the bin holds more sample keys than kExactCutKeys (a crowded
// sample), its lower edge is still the cut. 0: no cut (the sample holds too few numbers), so the row
// takes the full select. early_loads() is called once the sample's loads are issued. Leaves s.hist[0] cleared.
template <int T, class S, typename Early>
__device__ uint32_t candidate_cut(const RowView& v, S& s, int k, Early early_loads) {
  constexpr int kAt = kSample / kSpots;
  static_assert(kExactCutKeys <= T && kSample <= S::kCandCap, "a thread per ranked key; the sample fits the list");
  static_assert(kSample % T == 0, "every thread reads the same number of sample keys");
  const int step = v.n / kSpots;  // >= kCandCap / kSpots > kAt: the spots never overlap
  // The sample is kept in the (still empty) list's keys for the exact cut: in registers across the
  // threshold search it spilled the short-list instance.
  constexpr int kMine = kSample / T;
  float x[kMine];
#pragma unroll
  for (int e = 0; e < kMine; ++e) {
    const int j = threadIdx.x + e * T;
    const int64_t i = static_cast<int64_t>(j / kAt) * step + step / 2 + j % kAt;
    x[e] = v.src[i];
  }
  // The filtered pass's first loads, issued behind the sample's so they fly while the cut is found
  // (the whole row prefetched to L2 before the sample made the sample wait behind it: benchmark-history).
  early_loads();
#pragma unroll
  for (int e = 0; e < kMine; ++e) {
    const int j = threadIdx.x + e * T;
    const uint32_t key = ordered_key(x[e]);
    s.cand_key[j] = key;
    atomicAdd(&s.hist[0][key >> 21], 1);
  }
  __syncthreads();
  const int numbers = kSample - s.hist[0][0];
  const float expect = static_cast<float>(k) * kSample / v.n;
  const int rank = min(static_cast<int>(ceilf(expect + 4.0f * sqrtf(expect))) + 4, kSample);
  uint32_t cut = 0u;
  if (numbers >= rank) {  // block-uniform: every thread read the same counts
    find_threshold<T>(s, s.hist[0], rank, kBins);
    const int bin = s.bin;
    const int in_bin = s.in_bin;
    const int need = rank - s.above;  // the cut is the need-th largest of the bin's sample keys
    cut = static_cast<uint32_t>(bin) << 21;
    if (bin > 0 && in_bin <= kExactCutKeys) {  // block-uniform; bin 0 holds only NaN
      // The bin's sample keys into the list's positions, then each ranks itself among them, ties by slot.
      uint32_t* in_cut_bin = reinterpret_cast<uint32_t*>(s.cand_pos);
#pragma unroll
      for (int j = threadIdx.x; j < kSample; j += T) {  // warp-uniform: kSample is a multiple of T
        const uint32_t key = s.cand_key[j];
        const bool in = static_cast<int>(key >> 21) == bin;
        const int slot = warp_slot(in, &s.eq_count);
        if (in) in_cut_bin[slot] = key;
      }
      __syncthreads();
      if (static_cast<int>(threadIdx.x) < in_bin) {
        const uint32_t mine = in_cut_bin[threadIdx.x];
        int before = 0;
        for (int e = 0; e < in_bin; ++e) {
          const uint32_t other = in_cut_bin[e];
          before += other > mine || (other == mine && e < static_cast<int>(threadIdx.x));
        }
        if (before == need - 1) s.cut = mine;
      }
      __syncthreads();
      cut = s.cut;
      if (threadIdx.x == 0) s.eq_count = 0;  // read again only by the select, syncs later
    }
  }
  __syncthreads();  // the list's scratch read before collect_candidates writes it
  clear_bins<T>(s.hist[0], kBins);
  return cut;  // the sync after collect_candidates orders the clearing before the next histogram
}

// The filtered pass: the row streamed once from HBM with 16-byte loads, every key at or above `cut` appended
// to the candidate list (slots past kCandCap counted, not written), the largest in s.cand_max. The values
// are compared as floats and only the taken ones turned into keys: a key for every value cost 1.5 us at
// 512 x 49K and 1.6 at 256 x 98K (H200, 2026-12-03; round 4 had measured the float compare 0.1-1.6 us
// slower, in an earlier form of this loop).
// The next kUnroll loads are in flight while the current ones are filed; the first of them (`first`)
// were issued behind the sample's, before the cut was known.
template <int T, class S>
__device__ void collect_candidates(const RowView& v, S& s, uint32_t cut, const float4 (&first)[S::Config::kUnroll]) {
  constexpr int kUnroll = S::Config::kUnroll;
  const int t = threadIdx.x;
  const int n = v.n;
  const int head = v.head();
  uint32_t top = 0u;  // the largest key this thread took: the select's window ends there
  // Compared as floats: x >= cut_value exactly when x is no NaN and its key >= cut (the caller has
  // moved a cut at +0.0's key to -0.0's, where the float compare cannot tell the zeros apart).
  const float cut_value = cut <= 0x007FFFFFu ? -INFINITY
                          : __uint_as_float((cut & 0x80000000u) ? (cut & 0x7FFFFFFFu) : ~cut);
  auto offer = [&](bool in, uint32_t key, int pos) {  // warp-uniform
    const bool take = in && key >= cut;
    if (take) top = max(top, key);
    const int c = warp_slot(take, &s.cand_count);
    if (take && c < S::kCandCap) {
      s.cand_key[c] = key;
      s.cand_pos[c] = pos;
    }
  };
  offer(t < head, t < head ? ordered_key(v.src[t]) : 0u, t);  // the few keys before the vectors, as keys
  const int vectors = v.vectors();
  const float4* body = v.body();
  const int lane = t & 31;
  float4 next[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) next[u] = first[u];
  for (int base = 0; base < vectors; base += T * kUnroll) {
    float4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      x[u] = next[u];
      const int j = base + T * kUnroll + u * T + t;
      next[u] = j < vectors ? __ldg(body + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float vals[4 * kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      vals[4 * u] = x[u].x;
      vals[4 * u + 1] = x[u].y;
      vals[4 * u + 2] = x[u].z;
      vals[4 * u + 3] = x[u].w;
    }
    // A thread's 4 * kUnroll keys take their slots together: one warp scan and one shared atomic per
    // warp for 512 keys (a slot counter per key serialises the CTA's warps on one address).
    unsigned taken = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool in = base + u * T + t < vectors;
#pragma unroll
      for (int c = 0; c < 4; ++c) taken |= static_cast<unsigned>(in && vals[4 * u + c] >= cut_value) << (4 * u + c);
    }
    const int mine = __popc(taken);
    int inclusive = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int other = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
      if (lane >= d) inclusive += other;
    }
    const int total = __shfl_sync(0xFFFFFFFFu, inclusive, 31);
    int first = 0;
    if (lane == 31 && total) first = atomicAdd(&s.cand_count, total);
    int slot = __shfl_sync(0xFFFFFFFFu, first, 31) + inclusive - mine;
#pragma unroll
    for (int e = 0; e < 4 * kUnroll; ++e) {
      if ((taken >> e) & 1u) {
        const uint32_t key = ordered_key(vals[e]);
        top = max(top, key);
        if (slot < S::kCandCap) {
          s.cand_key[slot] = key;
          s.cand_pos[slot] = head + 4 * (base + (e / 4) * T + t) + e % 4;
        }
        ++slot;
      }
    }
  }
  const int tail = head + 4 * vectors + t;
  offer(tail < n, tail < n ? ordered_key(v.src[tail]) : 0u, tail);
  top = __reduce_max_sync(0xFFFFFFFFu, top);
  if (lane == 0 && top != 0u) atomicMax(&s.cand_max, top);
}

// The select's end where the threshold bin (the keys whose (key - lo) >> shift is prefix) holds at most
// kTieRank: the keys above it take the slots after the earlier threads' (one block-wide scan), the bin's
// keys are listed in shared memory, and each of them counts the listed keys ranked before it (greater, or
// equal at a lower list slot); the `need` first take the last `need` slots. One block-wide sync. Against
// the next radix round (H200, 2026-12-03, bench's step logits, one run): 0.2-1.9 us faster at 128 x 49K
// to 512 x 49K, 0.4 at 64 x 12K, 5.6 us on 4096 prefill rows; a bound of 64 was no faster, one of 256
// up to 2.2 us slower at short rows (each of its threads ranks against 256 keys).
template <int T, bool kHasPages, class S, int kPer, typename Pos>
__device__ __forceinline__ void rank_finish(S& s, const uint32_t (&key)[kPer], int count, int k, int need,
                                            int* out_row, const PageRow& pr, int block_size, Pos pos, uint32_t lo,
                                            int shift, uint32_t prefix) {
  const int t = threadIdx.x;
  int counts = 0;
#pragma unroll
  for (int j = 0; j < kPer && j * T < count; ++j) {
    const bool live = key[j] != 0u;
    const uint32_t digit = (key[j] - lo) >> shift;
    counts += live && digit > prefix;
    const bool tie = live && digit == prefix;
    const int slot = warp_slot(tie, &s.tie_count);
    if (tie) {
      s.tie_key[slot] = key[j];
      s.tie_pos[slot] = pos(t + j * T);
    }
  }
  int above_slot = block_exclusive_sum<T>(s, counts);  // its sync also completes the bin's list
#pragma unroll
  for (int j = 0; j < kPer && j * T < count; ++j) {
    const uint32_t digit = (key[j] - lo) >> shift;
    if (key[j] != 0u && digit > prefix) out_row[above_slot++] = slot_value<kHasPages>(pos(t + j * T), pr, block_size);
  }
  const int ties = s.tie_count;
  for (int i = t; i < ties; i += T) {
    const uint32_t mine = s.tie_key[i];
    int before = 0;
    for (int e = 0; e < ties; ++e) {
      const uint32_t other = s.tie_key[e];
      before += other > mine || (other == mine && e < i);
    }
    if (before < need) out_row[k - need + before] = slot_value<kHasPages>(s.tie_pos[i], pr, block_size);
  }
}

// The k largest of the `count` keys a CTA holds in registers (thread t's key[j] is entry t + j * T; key
// 0 for NaN and for entries past the end) into out_row: up to three radix rounds over the registers,
// then the keys above the threshold bin and the first `need` in it; where no more than k are selectable
// (non-NaN), all of them, then -1. pos(i) is entry i's position in the row. s.hist[0] is clear on entry.
// The keys lie in the window [lo, lo + 2^(s1 + 11)): the first digit is (key - lo) >> s1, the next the
// (at most) 11 bits below it, the last the rest. A short row's window is every key (lo 0, s1 21: the top
// 11 bits of the key, then 11, then 10). A candidate list's is [cut, its largest key], a few octaves at
// most, so its first digit spreads the list over the bins and the second usually isolates the k-th
// key. A round whose threshold bin holds just the keys still needed ends the search: the whole bin is
// taken (on the H200's step logits, 2026-12-02, the third round took 0.6-0.8 us of a row's 10-20).
// Every loop stops at the first register slot past `count` (j * T >= count: no thread holds an entry
// there). The bound is block-uniform, so the warp-wide slot claims stay uniform. A 2.4K-key row at
// 1024 threads visits 3 of its 8 slots, and a list of 3.5K keys at 512 threads 7 of 16.
template <int T, bool kHasPages, class S, int kPer, typename Pos>
__device__ void select_in_registers(S& s, const uint32_t (&key)[kPer], int count, int k, int* out_row,
                                    const PageRow& pr, int block_size, Pos pos, uint32_t lo, int s1) {
  const int t = threadIdx.x;
  int mine = 0;
#pragma unroll
  for (int j = 0; j < kPer && j * T < count; ++j) {
    if (key[j] != 0u) atomicAdd(&s.hist[0][(key[j] - lo) >> s1], 1);
    mine += key[j] != 0u;
  }
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) mine += __shfl_xor_sync(0xFFFFFFFFu, mine, d);
  if ((t & 31) == 0 && mine) atomicAdd(&s.selectable, mine);
  clear_bins<T>(s.hist[1], kBins);
  __syncthreads();
  const int selectable = s.selectable;
  if (selectable <= k) {  // block-uniform
#pragma unroll
    for (int j = 0; j < kPer && j * T < count; ++j) {
      const bool take = key[j] != 0u;
      const int slot = warp_slot(take, &s.out_count);
      if (take) out_row[slot] = slot_value<kHasPages>(pos(t + j * T), pr, block_size);
    }
    for (int i = selectable + t; i < k; i += T) out_row[i] = -1;
    return;
  }
  // The threshold bin so far: the keys whose (key - lo) >> shift is prefix. Every test is block-uniform.
  find_threshold<T>(s, s.hist[0], k, kBins);
  uint32_t prefix = s.bin;
  int shift = s1;
  int need = k - s.above;
  bool found = shift == 0 || s.in_bin == need;
  if (!found && s.in_bin <= kTieRank) {  // block-uniform
    rank_finish<T, kHasPages>(s, key, count, k, need, out_row, pr, block_size, pos, lo, shift, prefix);
    return;
  }

  if (!found) {
    const int next = max(shift - 11, 0);
    const uint32_t digits = (1u << (shift - next)) - 1u;
#pragma unroll
    for (int j = 0; j < kPer && j * T < count; ++j)
      if (key[j] != 0u && ((key[j] - lo) >> shift) == prefix)
        atomicAdd(&s.hist[1][((key[j] - lo) >> next) & digits], 1);
    clear_bins<T>(s.hist[0], kLastBins);  // round 1's readers are past find_threshold's last sync
    __syncthreads();
    find_threshold<T>(s, s.hist[1], need, static_cast<int>(digits) + 1);
    prefix = (prefix << (shift - next)) | static_cast<uint32_t>(s.bin);
    shift = next;
    need -= s.above;
    found = shift == 0 || s.in_bin == need;
  }
  if (!found && s.in_bin <= kTieRank) {  // block-uniform
    rank_finish<T, kHasPages>(s, key, count, k, need, out_row, pr, block_size, pos, lo, shift, prefix);
    return;
  }
  if (!found) {  // shift <= 10: the window is at most 32 bits wide, so s1 <= 21
    const uint32_t digits = (1u << shift) - 1u;
#pragma unroll
    for (int j = 0; j < kPer && j * T < count; ++j)
      if (key[j] != 0u && ((key[j] - lo) >> shift) == prefix) atomicAdd(&s.hist[0][(key[j] - lo) & digits], 1);
    __syncthreads();
    find_threshold<T>(s, s.hist[0], need, static_cast<int>(digits) + 1);
    prefix = (prefix << shift) | static_cast<uint32_t>(s.bin);
    shift = 0;
    need -= s.above;
  }
  // need >= 1 of the bin's keys are still needed: all of them where the search ended early.

  // Every thread's output slots from one block-wide scan of its counts, the keys above the threshold
  // bin in the low 16 bits and those in it in the high ones (each total <= kPer * T = 16384). Slots
  // claimed by shared atomics on two counters, one claim per warp and register slot, took 1.0-1.7 us
  // of a row's 10-20 (thread 0's clocks, H200, 2026-12-02).
  int counts = 0;
#pragma unroll
  for (int j = 0; j < kPer && j * T < count; ++j) {
    const uint32_t digit = (key[j] - lo) >> shift;
    counts += key[j] != 0u ? static_cast<int>(digit > prefix) + (static_cast<int>(digit == prefix) << 16) : 0;
  }
  const int before = block_exclusive_sum<T>(s, counts);
  int above_slot = before & 0xFFFF;
  int equal_slot = before >> 16;
#pragma unroll
  for (int j = 0; j < kPer && j * T < count; ++j) {
    const bool live = key[j] != 0u;
    const uint32_t digit = (key[j] - lo) >> shift;
    if (live && digit > prefix) {
      out_row[above_slot++] = slot_value<kHasPages>(pos(t + j * T), pr, block_size);
    } else if (live && digit == prefix) {
      if (equal_slot < need) out_row[k - need + equal_slot] = slot_value<kHasPages>(pos(t + j * T), pr, block_size);
      ++equal_slot;
    }
  }
}

// A row of at most k keys: every non-NaN one is selected, so it is read once and compacted, without a
// histogram, a threshold or the shared-memory reset (the engines' kernels write 0 .. n - 1 without
// reading such a row; the NaN rule needs the read). Then -1 up to k.
template <int T, bool kHasPages, class S>
__device__ void every_key_row(const RowView& v, S& s, int k, int* out_row, const PageRow& pr, int block_size) {
  if (threadIdx.x == 0) s.out_count = 0;
  __syncthreads();
  for (int base = 0; base < v.n; base += T) {  // block-uniform bound: warp_slot's claims stay warp-uniform
    const int i = base + threadIdx.x;
    const float x = i < v.n ? __ldg(v.src + i) : __int_as_float(0x7FC00000);
    const bool take = x == x;  // not NaN
    const int slot = warp_slot(take, &s.out_count);
    if (take) out_row[slot] = slot_value<kHasPages>(i, pr, block_size);
  }
  __syncthreads();
  for (int i = s.out_count + threadIdx.x; i < k; i += T) out_row[i] = -1;
}

// A short row (n <= kPer * T) read once into registers with coalesced scalar loads (any start, any
// stride), then selected there.
template <int T, bool kHasPages, int kPer, class S>
__device__ void short_row(const RowView& v, S& s, int k, int* out_row, const PageRow& pr, int block_size) {
  const int t = threadIdx.x;
  uint32_t key[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = t + j * T;
    key[j] = i < v.n ? ordered_key(__ldg(v.src + i)) : 0u;
  }
  select_in_registers<T, kHasPages>(s, key, v.n, k, out_row, pr, block_size, [](int i) { return i; }, 0u, 21);
}

// The full select (rows the filtered pass cannot serve: a sample that misjudged the row, a list that
// overflowed, too few numbers): a histogram of the whole row, its threshold bin's keys as the list, or
// the row itself when they overflow it; exact whatever the data. s.hist[0] is clear on entry.
template <int T, bool kHasPages, class S>
__device__ void full_select(const RowView& v, uint32_t* stage, S& s, int k, int* out_row, const PageRow& pr,
                            int block_size) {
  const int t = threadIdx.x;
  const int n = v.n;
  int* hist = s.hist[0];
  load_row<T, S::Config::kUnroll>(v, stage, hist);
  __syncthreads();

  const int selectable = n - hist[0];
  if (selectable <= k) {
    // Every non-NaN key is selected: its positions, then -1 up to k.
    for (int base = 0; base < n; base += T) {
      const int i = base + t;
      const bool take = i < n && v.key(i) != 0u;
      const int slot = warp_slot(take, &s.out_count);
      if (take) out_row[slot] = slot_value<kHasPages>(i, pr, block_size);
    }
    for (int i = selectable + t; i < k; i += T) out_row[i] = -1;
    return;
  }

  find_threshold<T>(s, hist, k, kBins);
  const uint32_t b1 = s.bin;
  int need = k - s.above;
  // Keys of bins above b1 are selected; b1's are the candidates.
  for (int base = 0; base < n; base += T) {
    const int i = base + t;
    const uint32_t key = i < n ? v.key(i) : 0u;
    const uint32_t digit = key >> 21;
    const bool above = i < n && digit > b1;
    const int slot = warp_slot(above, &s.out_count);
    if (above) out_row[slot] = slot_value<kHasPages>(i, pr, block_size);
    const bool cand = i < n && digit == b1;
    const int c = warp_slot(cand, &s.cand_count);
    if (cand && c < S::kCandCap) {
      s.cand_key[c] = key;
      s.cand_pos[c] = i;
    }
  }
  clear_bins<T>(hist, kBins);
  __syncthreads();
  const int count = s.cand_count;
  const bool from_list = count <= S::kCandCap;

  // Round 2: bits 20..10 of b1's keys.
  for_each_candidate<T>(v, s, from_list, count, b1, [&](uint32_t key, int, bool live) {
    if (live) atomicAdd(&hist[(key >> 10) & 0x7FF], 1);
  });
  __syncthreads();
  find_threshold<T>(s, hist, need, kBins);
  const uint32_t prefix = (b1 << 21) | (static_cast<uint32_t>(s.bin) << 10);
  need -= s.above;
  clear_bins<T>(hist, kLastBins);
  __syncthreads();

  // Round 3: bits 9..0 of the keys sharing the prefix.
  for_each_candidate<T>(v, s, from_list, count, b1, [&](uint32_t key, int, bool live) {
    if (live && (key >> 10) == (prefix >> 10)) atomicAdd(&hist[key & 0x3FF], 1);
  });
  __syncthreads();
  find_threshold<T>(s, hist, need, kLastBins);
  const uint32_t threshold = prefix | static_cast<uint32_t>(s.bin);
  need -= s.above;  // keys equal to the threshold still needed, >= 1

  // The keys of b1 above the threshold fill the slots after the higher bins'; the first `need` equal
  // to it fill the last `need` slots.
  for_each_candidate<T>(v, s, from_list, count, b1, [&](uint32_t key, int pos, bool live) {
    const bool above = live && key > threshold;
    const int slot = warp_slot(above, &s.out_count);
    if (above) out_row[slot] = slot_value<kHasPages>(pos, pr, block_size);
    const bool equal = live && key == threshold;
    const int e = warp_slot(equal, &s.eq_count);
    if (equal && e < need) out_row[k - need + e] = slot_value<kHasPages>(pos, pr, block_size);
  });
}

template <int T, class S>
__device__ void reset(S& s) {
  clear_bins<T>(s.hist[0], kBins);
  if (threadIdx.x == 0) {
    s.out_count = 0;
    s.cand_count = 0;
    s.eq_count = 0;
    s.selectable = 0;
    s.cand_max = 0u;
    s.tie_count = 0;
  }
  __syncthreads();
}

// C::blocks(T) CTAs an SM: Wide's two at 512 threads (<= 64 registers a thread) or one at 1024;
// ShortList's three at 512 (<= 40).
template <int T, class C, bool kHasPages>
__global__ void __launch_bounds__(T, C::blocks(T)) radix_topk_kernel(const Params p) {
  using S = Shared<C>;
  constexpr int kCandCap = C::kCandCap;
  extern __shared__ uint4 smem[];
  S& s = *reinterpret_cast<S*>(smem);
  uint32_t* stage = reinterpret_cast<uint32_t*>(&s + 1);
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;
  wait_previous_then_launch_next();  // every CTA, before its first global read

  // The visible window [start, start + n), clamped to the tensor.
  int start = 0;
  if (p.starts != nullptr) start = min(max(p.starts[row * p.stride_start], 0), p.width);
  const int n = min(max(p.lengths[row * p.stride_len], 0), p.width - start);
  RowView v;
  v.src = p.logits + row * p.stride_row + start;
  // The row's first key sits pad keys past a 16-byte boundary; staging it at stage[pad] lines the
  // 16-byte loads up with 16-byte shared stores.
  v.pad = static_cast<int>((reinterpret_cast<uintptr_t>(v.src) >> 2) & 3);
  v.stage = stage;
  v.stage_cap = p.stage_cap;
  v.n = n;
  int* out_row = p.out + row * p.k;
  const int k = p.k;
  PageRow pr{nullptr, 0};
  if (kHasPages) {
    // An out-of-table page row gets no pages: every position maps to -1, nothing outside is read.
    const int page_row = p.page_rows[row * p.stride_page_rows];
    const bool ok = page_row >= 0 && page_row < p.table_rows;
    pr.row = p.page_table + static_cast<int64_t>(ok ? page_row : 0) * p.stride_pt;
    pr.pages = ok ? p.table_pages : 0;
  }

  constexpr int kShortCap = C::kShortPer * T;
  static_assert(kShortCap >= kCandCap, "a row too long to sit in registers is longer than the list");
  if (p.filtered && n <= k) {  // block-uniform
    every_key_row<T, kHasPages>(v, s, k, out_row, pr, p.block_size);
    return;
  }
  const bool is_short = p.filtered && n <= kShortCap;
  reset<T>(s);
  constexpr int kPer = kCandCap / T;  // a list's keys a thread
  if (is_short) {
    // A row the list would hold takes kPer registers' loops; only a longer one all kShortPer. At 1024
    // threads, 16 keys a thread for every short row cost rows of 2K keys 0.3-0.5 us (H200, 2026-12-02).
    if (kPer == C::kShortPer || n <= kCandCap) {
      short_row<T, kHasPages, kPer>(v, s, k, out_row, pr, p.block_size);
    } else {
      short_row<T, kHasPages, C::kShortPer>(v, s, k, out_row, pr, p.block_size);
    }
    return;
  }
  // The filtered pass's first kUnroll vectors a thread, loaded while candidate_cut works (a full select
  // that follows drops them and reads the row itself).
  float4 first[C::kUnroll];
  auto early_loads = [&]() {
    const int vectors = v.vectors();
    const float4* body = v.body();
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) {
      const int j = u * T + t;
      first[u] = j < vectors ? __ldg(body + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  uint32_t cut = p.filtered ? candidate_cut<T>(v, s, k, early_loads) : 0u;
  if (cut != 0u) {
    if (cut == 0x80000000u) cut = 0x7FFFFFFFu;  // +0.0's key: -0.0 too (collect_candidates compares floats)
    collect_candidates<T>(v, s, cut, first);
    __syncthreads();
    const int count = s.cand_count;
    if (count <= kCandCap && count >= k) {
      uint32_t key[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = t + j * T;
        key[j] = i < count ? s.cand_key[i] : 0u;
      }
      // The window [cut, the list's largest key]: its first digit's shift from the window's width.
      const uint32_t width = s.cand_max - cut;
      const int s1 = max(0, 32 - __clz(width) - 11);
      select_in_registers<T, kHasPages>(s, key, count, k, out_row, pr, p.block_size,
                                        [&](int i) { return s.cand_pos[i]; }, cut, s1);
      return;
    }
    __syncthreads();
    reset<T>(s);  // the sample misjudged the row (too few candidates, or more than the list holds)
  } else {
    __syncthreads();  // candidate_cut's clearing of s.hist[0] before the full select's histogram
  }
  full_select<T, kHasPages>(v, stage, s, k, out_row, pr, p.block_size);
}

using Kernel = void (*)(Params);

template <int T, class C, bool kHasPages>
Kernel kernel_with_smem(int bytes) {
  static int raised[64] = {};  // per device: the dynamic shared memory limit this instance was given
  Kernel kernel = radix_topk_kernel<T, C, kHasPages>;
  int& limit = raised[c10::cuda::current_device() & 63];
  if (bytes > limit) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    limit = bytes;
  }
  return kernel;
}

template <int T, class C>
Kernel pick_kernel(bool has_pages, int bytes) {
  return has_pages ? kernel_with_smem<T, C, true>(bytes) : kernel_with_smem<T, C, false>(bytes);
}

}  // namespace

// The most keys a row may stage on this device (the opt-in shared memory less the larger fixed part).
int64_t max_stage(int64_t device) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, static_cast<int>(device)));
  const int64_t keys = (static_cast<int64_t>(optin) - static_cast<int64_t>(sizeof(Shared<Wide>)) - 16) / 4;
  return keys / 4 * 4;
}

// out int32 [rows, k] (contiguous); the host wrapper (radix_topk.py) has checked every tensor.
void radix_topk(const torch::Tensor& logits, const torch::Tensor& lengths, const c10::optional<torch::Tensor>& starts,
                const c10::optional<torch::Tensor>& page_table, const c10::optional<torch::Tensor>& page_rows,
                int64_t k, int64_t block_size, int64_t stage_cap, bool filtered, int64_t threads, bool short_list,
                bool dependent_launch, torch::Tensor& out) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  Params p{};
  p.logits = logits.data_ptr<float>();
  p.stride_row = logits.stride(0);
  p.lengths = lengths.data_ptr<int>();
  p.stride_len = lengths.stride(0);
  p.starts = starts ? starts->data_ptr<int>() : nullptr;
  p.stride_start = starts ? starts->stride(0) : 0;
  p.width = static_cast<int>(logits.size(1));
  p.k = static_cast<int>(k);
  p.stage_cap = static_cast<int>(stage_cap);
  p.out = out.data_ptr<int>();
  p.page_table = page_table ? page_table->data_ptr<int>() : nullptr;
  p.stride_pt = page_table ? page_table->stride(0) : 0;
  p.page_rows = page_rows ? page_rows->data_ptr<int>() : nullptr;
  p.stride_page_rows = page_rows ? page_rows->stride(0) : 0;
  p.table_rows = page_table ? static_cast<int>(page_table->size(0)) : 0;
  p.table_pages = page_table ? static_cast<int>(page_table->size(1)) : 0;
  p.block_size = static_cast<int>(block_size);
  p.filtered = filtered ? 1 : 0;
  const int fixed = static_cast<int>(short_list ? sizeof(Shared<ShortList>) : sizeof(Shared<Wide>));
  const int bytes = fixed + static_cast<int>(4 * (stage_cap + 4));
  const bool has_pages = page_table.has_value();
  TORCH_CHECK(threads == 512 || threads == 1024, "radix_topk: threads must be 512 or 1024, got ", threads);
  TORCH_CHECK(!short_list || threads == 512, "radix_topk: the short-list instance has 512 threads, got ", threads);
  const Kernel kernel = short_list      ? pick_kernel<512, ShortList>(has_pages, bytes)
                        : threads == 512 ? pick_kernel<512, Wide>(has_pages, bytes)
                                         : pick_kernel<1024, Wide>(has_pages, bytes);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(rows));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(bytes);
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent_launch ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("radix_topk", &radix_topk, "dispatch's CUDA radix top-k (see radix_select.cu)");
  m.def("max_stage", &max_stage, "keys a row may stage in shared memory on a device");
}
