// A paged batch's per-batch GPU work in one host call: the plan's lengths, its error flags, the page
// guard and the decided logits kernel's schedule, computed by one kernel into one allocation.
//
// What it computes is, bit for bit, what the Triton path computes in three steps (visible_lengths'
// torch ops, backends/shared/page_guard.py's guard, and the schedule of backends/triton/paged_schedule.py
// or backends/deepgemm/guard_and_schedule.py); tests/backends/test_plan_prepare.py holds the two equal on
// a GPU. It exists for the host: each torch op and each Triton launch costs a GPU host 3-30 us, and
// engines build a plan every step on the host's critical path, so the work is one C++ call (one
// allocation, one memset of the flags word, one launch) instead of about ten.
//
// Grid: blocks [0, R) each own one request row (its lengths, and its guard when the pool is known);
// block R computes the schedule from seq_lens directly, so no block waits on another's output.
// Integer arithmetic wraps in 32 bits where the Triton kernels' does (hostile lengths give the same
// outputs on both paths; the guard poisons and flags those rows).

// ATen and torch's pybind casters only, not torch/extension.h: the build is a third as long (nvcc 13.0:
// 46 s against about 150 on a 2-core host), and it runs at every warm-up of a new machine.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kNoBadPage = 1 << 30;  // the guard's "no out-of-range page seen"

__device__ __forceinline__ int32_t wrap_add(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}

__device__ __forceinline__ int32_t wrap_mul(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b));
}

// Token j of a request of total length L sees L - N + 1 + j keys (dispatch.step.paged_plan.visible_lengths).
// int32 lengths are used as they are (the int32 add wraps, as torch's does); int64 ones are clamped into
// [-1, INT32_MAX] first, as visible_lengths does, so a length past 2^31 stays past every bound.
__device__ __forceinline__ int32_t narrowed(int32_t length) { return length; }
__device__ __forceinline__ int32_t narrowed(int64_t length) {
  return static_cast<int32_t>(length < -1 ? -1 : (length > INT32_MAX ? INT32_MAX : length));
}

template <typename Length>
__device__ __forceinline__ int32_t visible(const Length* seq_lens, int64_t request, int next_n, int token) {
  const int32_t seen = wrap_add(narrowed(seq_lens[request]), 1 - next_n + token);
  return seen < 0 ? 0 : seen;
}

__device__ __forceinline__ int32_t cdiv32(int32_t x, int32_t d) { return wrap_add(x, d - 1) / d; }

__device__ int block_min(int value, int* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value = min(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    int result = scratch[0];
    for (int w = 1; w < kThreads / 32; ++w) result = min(result, scratch[w]);
    scratch[0] = result;
  }
  __syncthreads();
  int result = scratch[0];
  __syncthreads();
  return result;
}

struct GuardArgs {
  const int32_t* table;
  int64_t stride_table_row;
  int32_t* safe_table;  // [R, pages]
  int32_t* lens;        // [R, N]
  float* fill;          // [R * N]
  int32_t* readable;    // [R * N]: min(visible length, max_context_len)
  int32_t* error_flags;
  int64_t num_blocks;  // < 0: no guard now (the first layer call guards)
  int32_t max_context_len;
  int32_t pages;
  int32_t block_kv;
  int32_t bad_page_bit;
  int32_t length_past_bound_bit;
};

// One request row: its visible lengths, and (pool known) backends/shared/page_guard.py's guard of it.
template <typename Length>
__device__ void lengths_and_guard(const Length* seq_lens, int32_t* context_lens, int next_n, const GuardArgs& g,
                                  int* scratch) {
  const int64_t row = blockIdx.x;
  if (threadIdx.x < next_n) {
    const int32_t seen = visible(seq_lens, row, next_n, threadIdx.x);
    context_lens[row * next_n + threadIdx.x] = seen;
    // What a top-k may read of the token's logits row (its width is max_context_len): a length past the
    // bound is flagged by the guard, and cut here, so a kernel that trusts its lengths stays inside.
    g.readable[row * next_n + threadIdx.x] = min(seen, g.max_context_len);
  }
  if (g.num_blocks < 0) return;
  int first_bad = kNoBadPage;
  for (int page = threadIdx.x; page < g.pages; page += kThreads) {
    const int32_t entry = g.table[row * g.stride_table_row + page];
    const bool out_of_range = entry < 0 || static_cast<int64_t>(entry) >= g.num_blocks;
    g.safe_table[row * g.pages + page] = out_of_range ? 0 : entry;
    if (out_of_range) first_bad = min(first_bad, page);
  }
  first_bad = block_min(first_bad, scratch);
  if (threadIdx.x < 32) {
    const int token = threadIdx.x;
    const bool live = token < next_n;
    const int32_t seen = live ? visible(seq_lens, row, next_n, token) : 0;
    const int32_t needed = min(cdiv32(seen < 0 ? 0 : seen, g.block_kv), g.pages);
    const bool page_fault = live && needed > first_bad;
    const bool past_bound = live && seen > g.max_context_len;
    if (live) {
      const bool poisoned = page_fault || past_bound;
      g.lens[row * next_n + token] = poisoned ? -1 : seen;
      g.fill[row * next_n + token] = poisoned ? __int_as_float(0x7fc00000) : -INFINITY;
    }
    const unsigned faults = __ballot_sync(0xffffffffu, page_fault), pasts = __ballot_sync(0xffffffffu, past_bound);
    const int32_t flags = (faults ? g.bad_page_bit : 0) | (pasts ? g.length_past_bound_bit : 0);
    if (token == 0 && flags) atomicOr(g.error_flags, flags);
  }
}

// Block-wide inclusive scan of one value per thread (kThreads of them), any type with +.
template <typename T>
__device__ T block_inclusive_scan(T value, T* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset <<= 1) {
    T add = threadIdx.x >= offset ? scratch[threadIdx.x - offset] : T(0);
    __syncthreads();
    scratch[threadIdx.x] += add;
    __syncthreads();
  }
  T result = scratch[threadIdx.x];
  __syncthreads();
  return result;
}

// backends/deepgemm/guard_and_schedule.py's _schedule_body: DeepGEMM's SM90 schedule rule, in uint32.
template <typename Length>
__device__ void deepgemm_schedule(const Length* seq_lens, int next_n, int32_t batch, int32_t slots, int32_t search_steps,
                                  bool clamp_request, int32_t* prefix, int32_t* schedule, uint32_t* scratch) {
  uint32_t carry = 0;
  for (int32_t first = 0; first < batch; first += kThreads) {
    const int32_t request = first + threadIdx.x;
    const bool live = request < batch;
    const uint32_t length = live ? static_cast<uint32_t>(visible(seq_lens, request, next_n, next_n - 1)) : 0u;
    const uint32_t segments = live ? (length + 255u) / 256u : 0u;
    const uint32_t inclusive = block_inclusive_scan<uint32_t>(segments, scratch) + carry;
    if (live) prefix[request] = static_cast<int32_t>(inclusive);
    if (threadIdx.x == kThreads - 1) scratch[0] = inclusive;
    __syncthreads();
    carry = scratch[0];
    __syncthreads();
  }
  if (threadIdx.x == 0) prefix[batch] = static_cast<int32_t>(carry);
  __syncthreads();
  const uint32_t total = carry, unsigned_slots = static_cast<uint32_t>(slots);
  const uint32_t share = total / unsigned_slots, pivot = unsigned_slots - total % unsigned_slots;
  for (int32_t s = threadIdx.x; s < slots; s += kThreads) {
    const uint32_t slot = static_cast<uint32_t>(s);
    const uint32_t start = slot * share + (slot > pivot ? slot - pivot : 0u);
    int32_t lo = 0, hi = batch;
    for (int32_t step = 0; step < search_steps; ++step) {  // DeepGEMM's upper-bound search, step for step
      if (lo >= hi) break;
      const int32_t mid = (lo + hi) / 2;
      if (static_cast<uint32_t>(prefix[mid]) <= start) lo = mid + 1; else hi = mid;
    }
    const int32_t request = clamp_request ? min(lo, batch - 1) : lo;
    const uint32_t before = request > 0 ? static_cast<uint32_t>(prefix[request - 1]) : 0u;
    const uint32_t upto = static_cast<uint32_t>(prefix[request]);
    const uint32_t offset = start - before, own = upto - before;
    const uint32_t atom = own > 0 ? offset / own : 0u, split = own > 0 ? offset % own : 0u;
    schedule[s * 2] = static_cast<int32_t>(static_cast<uint32_t>(request) + atom);
    schedule[s * 2 + 1] = static_cast<int32_t>(split);
  }
  if (threadIdx.x == 0) {
    schedule[slots * 2] = batch;
    schedule[slots * 2 + 1] = 0;
  }
}

// backends/triton/paged_schedule.py's _schedule_kernel: the Triton logits kernel's length-balanced cuts.
struct TritonScheduleArgs {
  int64_t* cost_prefix;  // [V]
  int32_t* work_pages;   // [V]
  int32_t* bounds;       // [P + 1, 2]
  int32_t work_rows;     // V = R * groups
  int32_t pages;
  int32_t programs;
  int32_t search_steps;
  int32_t tokens;  // TG
  int32_t groups;
  int32_t block_kv;
  int32_t compute_cost;
  int32_t fill_cost;
};

template <typename Length>
__device__ void triton_schedule(const Length* seq_lens, int next_n, const TritonScheduleArgs& a, int64_t* scratch) {
  int64_t carry = 0;
  const int32_t width_keys = wrap_mul(a.pages, a.block_kv);
  for (int32_t first = 0; first < a.work_rows; first += kThreads) {
    const int32_t work_row = first + threadIdx.x;
    const bool live = work_row < a.work_rows;
    int32_t longest = INT32_MIN;
    int32_t computed = 0;
    int64_t cost = 0;
    if (live) {
      const int32_t row = work_row / a.groups, group = work_row % a.groups;
      for (int32_t t = 0; t < a.tokens; ++t) {
        const int32_t token = group * a.tokens + t;
        const int32_t length = token < next_n ? visible(seq_lens, row, next_n, token) : 0;
        longest = max(longest, min(max(length, 0), width_keys));
      }
      computed = cdiv32(longest, a.block_kv);
      cost = static_cast<int64_t>(
          wrap_add(wrap_mul(computed, a.compute_cost), wrap_mul(wrap_add(a.pages, -computed), a.fill_cost)));
    }
    const int64_t inclusive = block_inclusive_scan<int64_t>(cost, scratch) + carry;
    if (live) {
      a.cost_prefix[work_row] = inclusive - cost;
      a.work_pages[work_row] = computed;
    }
    if (threadIdx.x == kThreads - 1) scratch[0] = inclusive;
    __syncthreads();
    carry = scratch[0];
    __syncthreads();
  }
  __threadfence_block();
  __syncthreads();
  const int64_t total = carry;
  for (int32_t p = threadIdx.x; p <= a.programs; p += kThreads) {
    const int64_t target = (static_cast<int64_t>(p) * total) / a.programs;
    int32_t lo = 0, hi = a.work_rows;
    for (int32_t step = 0; step < a.search_steps; ++step) {
      const int32_t mid = (lo + hi) / 2;
      if (hi - lo > 1) {
        if (a.cost_prefix[mid] <= target) lo = mid; else hi = mid;
      }
    }
    const int64_t into = target - a.cost_prefix[lo];
    const int64_t computed = a.work_pages[lo];
    const int64_t computed_cost = computed * a.compute_cost;
    const int64_t page = into <= computed_cost ? (into + a.compute_cost - 1) / a.compute_cost
                                               : computed + (into - computed_cost + a.fill_cost - 1) / a.fill_cost;
    a.bounds[p * 2] = lo;
    a.bounds[p * 2 + 1] = static_cast<int32_t>(page < a.pages ? page : a.pages);
  }
}

template <typename Length>
__global__ void __launch_bounds__(kThreads) deepgemm_plan_kernel(
    const Length* seq_lens, int32_t* context_lens, int next_n, GuardArgs guard, int32_t batch, int32_t slots,
    int32_t search_steps, bool clamp_request, int32_t* prefix, int32_t* schedule) {
  __shared__ uint32_t scratch[kThreads];
  if (blockIdx.x < batch) {
    lengths_and_guard(seq_lens, context_lens, next_n, guard, reinterpret_cast<int*>(scratch));
  } else {
    deepgemm_schedule(seq_lens, next_n, batch, slots, search_steps, clamp_request, prefix, schedule, scratch);
  }
}

template <typename Length>
__global__ void __launch_bounds__(kThreads) triton_plan_kernel(
    const Length* seq_lens, int32_t* context_lens, int next_n, GuardArgs guard, int32_t batch,
    TritonScheduleArgs schedule) {
  __shared__ int64_t scratch[kThreads];
  if (blockIdx.x < batch) {
    lengths_and_guard(seq_lens, context_lens, next_n, guard, reinterpret_cast<int*>(scratch));
  } else {
    triton_schedule(seq_lens, next_n, schedule, scratch);
  }
}

// One int32 allocation, cut into the outputs in order; int64 and fp32 outputs are views of it. Every
// output starts on a kAlignWords boundary, as a tensor of its own from torch's caching allocator would
// (512 bytes): the kernels that read them load vectors (DeepGEMM reads a schedule row as one uint2), and
// an output at an odd word crashes them with a misaligned address (seen on the H200 at B = 1).
constexpr int64_t kAlignWords = 128;

int64_t aligned(int64_t words) { return (words + kAlignWords - 1) / kAlignWords * kAlignWords; }

struct Carver {
  at::Tensor buffer;
  int64_t at = 0;
  // The plan's shared outputs (lengths, flags, the guard's three) and then a schedule's `pieces`.
  static Carver of(int64_t rows, int64_t next_n, int64_t pages, std::initializer_list<int64_t> pieces,
                   const at::TensorOptions& options) {
    int64_t words = aligned(rows * next_n) + aligned(1) + aligned(rows * pages) + 3 * aligned(rows * next_n);
    for (int64_t piece : pieces) words += aligned(piece);
    return Carver{at::empty({words}, options)};
  }
  at::Tensor take(int64_t words) { return take(words, {words}, {1}); }
  // Each piece a tensor over the buffer's storage made directly, not through a dispatched view op:
  // each ATen call costs the host ~1 us, every batch. Int and float pieces that autograd never sees.
  at::Tensor take(int64_t words, at::IntArrayRef sizes, at::IntArrayRef strides,
                  caffe2::TypeMeta dtype = caffe2::TypeMeta::Make<int32_t>()) {
    const int64_t per = static_cast<int64_t>(dtype.itemsize()) / 4;  // words an element spans
    auto view = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(), dtype);
    view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, at / per);
    at += aligned(words);
    return view;
  }
};

// Whether the launch takes this batch as the Triton path would; where it does not, the prepare returns
// no tensors and the plan takes the Triton launches, which raise their own located error for input they
// refuse. Asked here, not by Python: the same questions took 2.2 us a batch in Python on a CI-like CPU,
// more on a GPU machine's host.
bool servable(const at::Tensor& seq_lens, const at::Tensor& table, int64_t next_n, int64_t pages) {
  return seq_lens.is_cuda() && seq_lens.dim() == 1 &&
         (seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong) && seq_lens.is_contiguous() &&
         table.device() == seq_lens.device() && table.dim() == 2 && table.scalar_type() == at::kInt &&
         (table.size(1) <= 1 || table.stride(1) == 1) && next_n >= 1 && next_n <= 32 && seq_lens.size(0) > 0 &&
         seq_lens.size(0) < INT32_MAX / 64 && table.size(1) >= pages;
}

// What a served batch must also hold (a PagedBatch holds it where it was built).
void check_inputs(const at::Tensor& seq_lens, const at::Tensor& table) {
  TORCH_CHECK(table.size(0) == seq_lens.size(0), "plan_prepare: page_table must have one row per request");
}

// The outputs both schedules share, carved first and in this order into `out`: context_lens [B, N],
// error_flags [1], safe_table [B, pages], lens [B, N], fill fp32 [B*N], readable lengths [B*N]; the
// guard's arguments over them.
GuardArgs shared_outputs(Carver& carve, const at::Tensor& table, int64_t rows, int64_t next_n, int64_t num_blocks,
                         int64_t max_context_len, int64_t pages, int64_t block_kv, int64_t bad_page,
                         int64_t past_bound, std::vector<at::Tensor>& out) {
  out.push_back(carve.take(rows * next_n, {rows, next_n}, {next_n, 1}));
  out.push_back(carve.take(1));
  out.push_back(carve.take(rows * pages, {rows, pages}, {pages, 1}));
  out.push_back(carve.take(rows * next_n, {rows, next_n}, {next_n, 1}));
  out.push_back(carve.take(rows * next_n, {rows * next_n}, {1}, caffe2::TypeMeta::Make<float>()));
  out.push_back(carve.take(rows * next_n));
  GuardArgs g;
  g.table = table.data_ptr<int32_t>();
  g.stride_table_row = table.stride(0);
  g.error_flags = out[1].data_ptr<int32_t>();
  g.safe_table = out[2].data_ptr<int32_t>();
  g.lens = out[3].data_ptr<int32_t>();
  g.fill = out[4].data_ptr<float>();
  g.readable = out[5].data_ptr<int32_t>();
  g.num_blocks = num_blocks;
  g.max_context_len = static_cast<int32_t>(max_context_len);
  g.pages = static_cast<int32_t>(pages);
  g.block_kv = static_cast<int32_t>(block_kv);
  g.bad_page_bit = static_cast<int32_t>(bad_page);
  g.length_past_bound_bit = static_cast<int32_t>(past_bound);
  return g;
}

// Returns [context_lens [B, N], error_flags [1], safe_table [B, pages], lens [B, N], fill fp32 [B*N],
// readable [B*N], prefix [B + 1], schedule [slots + 1, 2]] for DeepGEMM's SM90 paged kernels; [] where
// the batch is not servable().
std::vector<at::Tensor> deepgemm_prepare(at::Tensor seq_lens, at::Tensor table, int64_t next_n,
                                            int64_t num_blocks, int64_t max_context_len, int64_t block_kv,
                                            int64_t bad_page, int64_t past_bound, int64_t slots, bool clamp_request) {
  const int64_t rows = seq_lens.size(0), pages = (max_context_len + block_kv - 1) / block_kv;
  if (!servable(seq_lens, table, next_n, pages)) return {};
  check_inputs(seq_lens, table);
  TORCH_CHECK(slots >= 1, "plan_prepare: the schedule needs at least one slot");
  const c10::cuda::CUDAGuard device_guard(seq_lens.device());
  Carver carve = Carver::of(rows, next_n, pages, {rows + 1, (slots + 1) * 2}, table.options());
  std::vector<at::Tensor> out;
  const GuardArgs g = shared_outputs(carve, table, rows, next_n, num_blocks, max_context_len, pages, block_kv,
                                     bad_page, past_bound, out);
  auto context_lens = out[0];
  auto prefix = carve.take(rows + 1);
  auto schedule = carve.take((slots + 1) * 2, {slots + 1, 2}, {2, 1});
  out.push_back(prefix);
  out.push_back(schedule);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(g.error_flags, 0, sizeof(int32_t), stream));
  int32_t search_steps = 1;
  for (int64_t b = rows > 1 ? rows : 1; b; b >>= 1) ++search_steps;  // bit_length(max(B, 1)) + 1
  const dim3 grid(static_cast<unsigned>(rows + 1));
  if (seq_lens.scalar_type() == at::kInt) {
    deepgemm_plan_kernel<int32_t><<<grid, kThreads, 0, stream>>>(
        seq_lens.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), static_cast<int>(next_n), g,
        static_cast<int32_t>(rows), static_cast<int32_t>(slots), search_steps, clamp_request,
        prefix.data_ptr<int32_t>(), schedule.data_ptr<int32_t>());
  } else {
    deepgemm_plan_kernel<int64_t><<<grid, kThreads, 0, stream>>>(
        seq_lens.data_ptr<int64_t>(), context_lens.data_ptr<int32_t>(), static_cast<int>(next_n), g,
        static_cast<int32_t>(rows), static_cast<int32_t>(slots), search_steps, clamp_request,
        prefix.data_ptr<int32_t>(), schedule.data_ptr<int32_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Returns [context_lens, error_flags, safe_table, lens, fill, readable, cost_prefix int64 [V], work_pages [V],
// bounds [P + 1, 2]] for the Triton paged logits kernel; [] where the batch is not servable().
std::vector<at::Tensor> triton_prepare(at::Tensor seq_lens, at::Tensor table, int64_t next_n,
                                          int64_t num_blocks, int64_t max_context_len, int64_t block_kv,
                                          int64_t bad_page, int64_t past_bound, int64_t programs, int64_t tokens,
                                          int64_t compute_cost, int64_t fill_cost) {
  const int64_t rows = seq_lens.size(0), pages = (max_context_len + block_kv - 1) / block_kv;
  if (!servable(seq_lens, table, next_n, pages)) return {};
  check_inputs(seq_lens, table);
  TORCH_CHECK(programs >= 1 && tokens >= 1, "plan_prepare: the schedule needs programs and tokens >= 1");
  const c10::cuda::CUDAGuard device_guard(seq_lens.device());
  const int64_t groups = (next_n + tokens - 1) / tokens, work_rows = rows * groups;
  Carver carve = Carver::of(rows, next_n, pages, {2 * work_rows, work_rows, (programs + 1) * 2}, table.options());
  std::vector<at::Tensor> out;
  const GuardArgs g = shared_outputs(carve, table, rows, next_n, num_blocks, max_context_len, pages, block_kv,
                                     bad_page, past_bound, out);
  auto context_lens = out[0];
  auto cost_prefix = carve.take(2 * work_rows, {work_rows}, {1}, caffe2::TypeMeta::Make<int64_t>());  // 8-byte aligned: on its own boundary
  auto work_pages = carve.take(work_rows);
  auto bounds = carve.take((programs + 1) * 2, {programs + 1, 2}, {2, 1});
  out.push_back(cost_prefix);
  out.push_back(work_pages);
  out.push_back(bounds);
  TritonScheduleArgs s;
  s.cost_prefix = cost_prefix.data_ptr<int64_t>();
  s.work_pages = work_pages.data_ptr<int32_t>();
  s.bounds = bounds.data_ptr<int32_t>();
  s.work_rows = static_cast<int32_t>(work_rows);
  s.pages = static_cast<int32_t>(pages);
  s.programs = static_cast<int32_t>(programs);
  s.search_steps = 1;
  for (int64_t v = work_rows > 1 ? work_rows - 1 : 1; v; v >>= 1) ++s.search_steps;  // bit_length(max(V - 1, 1)) + 1
  s.tokens = static_cast<int32_t>(tokens);
  s.groups = static_cast<int32_t>(groups);
  s.block_kv = static_cast<int32_t>(block_kv);
  s.compute_cost = static_cast<int32_t>(compute_cost);
  s.fill_cost = static_cast<int32_t>(fill_cost);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(g.error_flags, 0, sizeof(int32_t), stream));
  const dim3 grid(static_cast<unsigned>(rows + 1));
  if (seq_lens.scalar_type() == at::kInt) {
    triton_plan_kernel<int32_t><<<grid, kThreads, 0, stream>>>(
        seq_lens.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), static_cast<int>(next_n), g,
        static_cast<int32_t>(rows), s);
  } else {
    triton_plan_kernel<int64_t><<<grid, kThreads, 0, stream>>>(
        seq_lens.data_ptr<int64_t>(), context_lens.data_ptr<int32_t>(), static_cast<int>(next_n), g,
        static_cast<int32_t>(rows), s);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("deepgemm_prepare", &deepgemm_prepare, "lengths, flags, page guard and DeepGEMM's SM90 schedule: one launch");
  m.def("triton_prepare", &triton_prepare, "lengths, flags, page guard and the Triton paged schedule: one launch");
}
