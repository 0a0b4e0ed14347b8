// Torch binding of the kvcompress CUDA kernels: torch.ops.kvcompress.*
//
// The only csrc file that includes torch headers. It validates arguments, allocates
// the workspaces with the caching allocator and calls the torch-free launchers of
// csrc/kernels (launchers.h) on the current CUDA stream. Importing the built module
// (`import kvcompress._C`, or torch.ops.load_library on the .so) registers the ops.
//
// Only light CUDA headers (c10/cuda stream and guard) are used, so a syntax check
// against a CPU build of torch plus the CUDA toolkit headers is possible.

#include <Python.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>

#include "kernels/launchers.h"

namespace {

using at::Tensor;

void check_device(const Tensor& t, const char* name, const Tensor& ref) {
  TORCH_CHECK(t.is_cuda(), "kvcompress: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == ref.device(), "kvcompress: ", name, " is on ", t.device(),
              " but the cache is on ", ref.device());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kvcompress: ", what, " launch failed: ", cudaGetErrorString(err));
}

kvcompress::DType cache_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return kvcompress::DType::kFloat32;
    case at::kHalf:
      return kvcompress::DType::kFloat16;
    case at::kBFloat16:
      return kvcompress::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "kvcompress: unsupported dtype ", type, " (float32, float16, bfloat16)");
  }
}

// Small index tensors are converted (copied) when they are not int64 already.
Tensor as_int64(const Tensor& t) { return t.scalar_type() == at::kLong ? t : t.to(at::kLong); }

bool aligned16(const Tensor& t) {
  const int64_t es = t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * es) % 16 == 0 &&
         (t.stride(1) * es) % 16 == 0;
}

cudaStream_t current_stream(const Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

int num_sms(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // the heuristic falls back to an H100's count
  }
  if (device >= 0 && device < 64) cached[device] = count;
  return count;
}

// The pool's tensors as both kernels' parameter structs name them (PagedDecodeParams,
// MoveCacheParams): data pointers and page / slot strides.
template <typename Params>
void set_pool_caches(Params& p, const Tensor& key_cache, const Tensor& value_cache,
                     const Tensor& slot_positions) {
  p.key_cache = key_cache.data_ptr();
  p.k_stride_page = key_cache.stride(0);
  p.k_stride_slot = key_cache.stride(1);
  p.value_cache = value_cache.data_ptr();
  p.v_stride_page = value_cache.stride(0);
  p.v_stride_slot = value_cache.stride(1);
  p.slot_positions = slot_positions.data_ptr<int32_t>();
  p.pos_stride_page = slot_positions.stride(0);
  p.pos_stride_slot = slot_positions.stride(1);
}

template <typename Params>
void set_slot_metrics(Params& p, const Tensor& slot_metrics) {
  p.slot_metrics = slot_metrics.data_ptr<float>();
  p.metric_stride_page = slot_metrics.stride(0);
  p.metric_stride_slot = slot_metrics.stride(1);
}

// Schema in TORCH_LIBRARY below. partition_size 0 picks one
// (paged_decode_default_partition_size); max_head_len, when given, must be >= every
// head_lens entry and narrows the partition grid to ceil(max_head_len / block_size)
// pages (same as passing block_tables[..., :that]), without a device sync.
void paged_decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache,
                            const Tensor& value_cache, const Tensor& slot_positions,
                            const Tensor& block_tables_in, const Tensor& head_lens_in,
                            const Tensor& query_positions_in, double scale, int64_t partition_size,
                            const std::optional<Tensor>& slot_metrics,
                            const std::optional<Tensor>& metric_seqs_in, int64_t metric_power,
                            std::optional<int64_t> max_head_len) {
  TORCH_CHECK(query.dim() == 3, "kvcompress: query must be [num_seqs, num_q_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "kvcompress: out must match query's shape and dtype");
  TORCH_CHECK(key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes(),
              "kvcompress: key_cache and value_cache must be [num_pages, block_size, head_size]");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "kvcompress: query and caches must share a dtype");
  for (const Tensor* t : std::initializer_list<const Tensor*>{
           &out, &query, &value_cache, &slot_positions, &block_tables_in, &head_lens_in,
           &query_positions_in}) {
    check_device(*t, "every argument", key_cache);
  }
  const int64_t num_seqs = query.size(0);
  const int64_t num_q_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_pages = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == head_size, "kvcompress: cache head size ", key_cache.size(2),
              " != query head size ", head_size);
  TORCH_CHECK(kvcompress::paged_decode_supported(static_cast<int>(head_size), static_cast<int>(block_size)),
              "kvcompress: no kernel for head_size ", head_size, " / block_size ", block_size,
              " (head 64/128/256, block 16/32)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(2) == 1 &&
                  value_cache.stride(2) == 1,
              "kvcompress: the head dim of query, out and the caches must be contiguous");
  TORCH_CHECK(aligned16(key_cache) && aligned16(value_cache),
              "kvcompress: cache rows must be 16-byte aligned (base pointer and strides)");
  TORCH_CHECK(num_seqs <= 65535, "kvcompress: at most 65535 sequences per call, got ", num_seqs);
  TORCH_CHECK(block_tables_in.dim() == 3 && block_tables_in.size(0) == num_seqs,
              "kvcompress: block_tables must be [num_seqs, num_kv_heads, max_pages]");
  const int64_t num_kv_heads = block_tables_in.size(1);
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0,
              "kvcompress: num_q_heads ", num_q_heads, " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(head_lens_in.dim() == 2 && head_lens_in.size(0) == num_seqs &&
                  head_lens_in.size(1) == num_kv_heads,
              "kvcompress: head_lens must be [num_seqs, num_kv_heads]");
  TORCH_CHECK(query_positions_in.dim() == 1 && query_positions_in.size(0) == num_seqs,
              "kvcompress: query_positions must be [num_seqs]");
  TORCH_CHECK(slot_positions.scalar_type() == at::kInt && slot_positions.dim() == 2 &&
                  slot_positions.size(0) == num_pages && slot_positions.size(1) == block_size,
              "kvcompress: slot_positions must be int32 [num_pages, block_size]");
  TORCH_CHECK(partition_size == 0 || (partition_size > 0 && partition_size % block_size == 0 &&
                                       partition_size <= 4096),
              "kvcompress: partition_size must be 0 (auto) or a multiple of block_size <= 4096, got ",
              partition_size);
  TORCH_CHECK(metric_power >= 0, "kvcompress: metric_power must be >= 0");
  TORCH_CHECK(!max_head_len.has_value() || *max_head_len >= 0, "kvcompress: max_head_len must be >= 0");
  if (num_seqs == 0) return;

  const c10::cuda::CUDAGuard guard(key_cache.device());
  Tensor block_tables = as_int64(block_tables_in);
  if (max_head_len.has_value()) {
    const int64_t pages = std::max<int64_t>(1, (*max_head_len + block_size - 1) / block_size);
    if (pages < block_tables.size(2)) block_tables = block_tables.narrow(2, 0, pages);
  }
  if (partition_size == 0) {
    partition_size = kvcompress::paged_decode_default_partition_size(
        static_cast<int>(num_seqs), static_cast<int>(num_kv_heads),
        static_cast<int>(num_q_heads / num_kv_heads), block_tables.size(2),
        static_cast<int>(block_size), num_sms(key_cache.get_device()));
  }
  const Tensor head_lens = as_int64(head_lens_in);
  const Tensor query_positions = as_int64(query_positions_in);
  const bool metrics = slot_metrics.has_value() && metric_seqs_in.has_value();
  Tensor metric_seqs;
  if (metrics) {
    check_device(*slot_metrics, "slot_metrics", key_cache);
    check_device(*metric_seqs_in, "metric_seqs", key_cache);
    TORCH_CHECK(slot_metrics->scalar_type() == at::kFloat && slot_metrics->dim() == 2 &&
                    slot_metrics->size(0) == num_pages && slot_metrics->size(1) == block_size,
                "kvcompress: slot_metrics must be float32 [num_pages, block_size]");
    TORCH_CHECK(metric_seqs_in->dim() == 1 && metric_seqs_in->size(0) == num_seqs,
                "kvcompress: metric_seqs must be [num_seqs]");
    metric_seqs = metric_seqs_in->to(at::kBool).contiguous();
  }

  const auto workspace = kvcompress::paged_decode_workspace(
      static_cast<int>(num_seqs), static_cast<int>(num_q_heads), static_cast<int>(head_size),
      block_tables.size(2), static_cast<int>(block_size), static_cast<int>(partition_size), metrics);
  const auto fopts = key_cache.options().dtype(at::kFloat);
  const Tensor max_logits = at::empty({workspace.softmax_stats}, fopts);
  const Tensor exp_sums = at::empty({workspace.softmax_stats}, fopts);
  const Tensor tmp_out = at::empty({workspace.tmp_out}, fopts);
  const Tensor logits = at::empty({workspace.logits}, fopts);

  kvcompress::PagedDecodeParams p;
  p.out = out.data_ptr();
  p.out_stride_seq = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.query = query.data_ptr();
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  set_pool_caches(p, key_cache, value_cache, slot_positions);
  p.block_tables = block_tables.data_ptr<int64_t>();
  p.bt_stride_seq = block_tables.stride(0);
  p.bt_stride_head = block_tables.stride(1);
  p.bt_stride_page = block_tables.stride(2);
  p.head_lens = head_lens.data_ptr<int64_t>();
  p.hl_stride_seq = head_lens.stride(0);
  p.hl_stride_head = head_lens.stride(1);
  p.query_positions = query_positions.data_ptr<int64_t>();
  p.qp_stride = query_positions.stride(0);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group = static_cast<int>(num_q_heads / num_kv_heads);
  p.head_size = static_cast<int>(head_size);
  p.block_size = static_cast<int>(block_size);
  p.max_pages = block_tables.size(2);
  p.partition_size = static_cast<int>(partition_size);
  p.scale = static_cast<float>(scale);
  p.max_logits = max_logits.data_ptr<float>();
  p.exp_sums = exp_sums.data_ptr<float>();
  p.tmp_out = workspace.tmp_out ? tmp_out.data_ptr<float>() : nullptr;
  if (metrics) {
    p.logits = logits.data_ptr<float>();
    set_slot_metrics(p, *slot_metrics);
    p.metric_seqs = reinterpret_cast<const uint8_t*>(metric_seqs.data_ptr<bool>());
    p.metric_power = static_cast<int>(metric_power);
  }
  check_launch(kvcompress::launch_paged_decode_attention(p, cache_dtype(query.scalar_type()),
                                                         current_stream(key_cache)),
               "paged_decode_attention");
}

// move_cache(Tensor! key_cache, Tensor! value_cache, Tensor! slot_metrics,
//     Tensor! slot_positions, Tensor src_pages, Tensor src_offsets, Tensor dst_pages,
//     Tensor dst_offsets) -> ()
void move_cache(Tensor& key_cache, Tensor& value_cache, Tensor& slot_metrics, Tensor& slot_positions,
                const Tensor& src_pages, const Tensor& src_offsets, const Tensor& dst_pages,
                const Tensor& dst_offsets) {
  TORCH_CHECK(key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "kvcompress: key_cache and value_cache must be [num_pages, block_size, head_size] of one dtype");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1,
              "kvcompress: the head dim of the caches must be contiguous");
  TORCH_CHECK(slot_metrics.scalar_type() == at::kFloat && slot_metrics.dim() == 2,
              "kvcompress: slot_metrics must be float32 [num_pages, block_size]");
  TORCH_CHECK(slot_positions.scalar_type() == at::kInt && slot_positions.dim() == 2,
              "kvcompress: slot_positions must be int32 [num_pages, block_size]");
  const int64_t num_moves = src_pages.numel();
  for (const Tensor* t : {&src_offsets, &dst_pages, &dst_offsets}) {
    TORCH_CHECK(t->numel() == num_moves, "kvcompress: move index tensors must have the same length");
  }
  for (const Tensor* t : std::initializer_list<const Tensor*>{
           &value_cache, &slot_metrics, &slot_positions, &src_pages, &src_offsets, &dst_pages,
           &dst_offsets}) {
    check_device(*t, "every argument", key_cache);
  }
  if (num_moves == 0) return;
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const Tensor sp = as_int64(src_pages).reshape({-1}).contiguous();
  const Tensor so = as_int64(src_offsets).reshape({-1}).contiguous();
  const Tensor dp = as_int64(dst_pages).reshape({-1}).contiguous();
  const Tensor dof = as_int64(dst_offsets).reshape({-1}).contiguous();

  kvcompress::MoveCacheParams p;
  set_pool_caches(p, key_cache, value_cache, slot_positions);
  set_slot_metrics(p, slot_metrics);
  p.element_size = static_cast<int>(key_cache.element_size());
  p.head_size = static_cast<int>(key_cache.size(2));
  p.src_pages = sp.data_ptr<int64_t>();
  p.src_offsets = so.data_ptr<int64_t>();
  p.dst_pages = dp.data_ptr<int64_t>();
  p.dst_offsets = dof.data_ptr<int64_t>();
  p.num_moves = num_moves;
  check_launch(kvcompress::launch_move_cache(p, current_stream(key_cache)), "move_cache");
}

// allocate_pages(Tensor! page_tables, Tensor free_stack, int stack_start, Tensor offsets,
//     Tensor first_column, Tensor rows) -> ()
void allocate_pages(Tensor& page_tables, const Tensor& free_stack, int64_t stack_start,
                    const Tensor& offsets, const Tensor& first_column, const Tensor& rows) {
  TORCH_CHECK(page_tables.scalar_type() == at::kInt && page_tables.dim() >= 1 &&
                  page_tables.is_contiguous(),
              "kvcompress: page_tables must be a contiguous int32 tensor [..., max_columns]");
  TORCH_CHECK(free_stack.scalar_type() == at::kLong && free_stack.dim() == 1 && free_stack.is_contiguous(),
              "kvcompress: free_stack must be a contiguous int64 [num_pages]");
  const int64_t num_requesters = rows.numel();
  TORCH_CHECK(offsets.numel() == num_requesters + 1 && first_column.numel() == num_requesters,
              "kvcompress: offsets must have num_requesters + 1 entries, first_column num_requesters");
  TORCH_CHECK(stack_start >= 0 && stack_start <= free_stack.numel(),
              "kvcompress: stack_start out of range");
  for (const Tensor* t : {&free_stack, &offsets, &first_column, &rows}) {
    check_device(*t, "every argument", page_tables);
  }
  if (num_requesters == 0) return;
  const c10::cuda::CUDAGuard guard(page_tables.device());
  const Tensor off = as_int64(offsets).reshape({-1}).contiguous();
  const Tensor col = as_int64(first_column).reshape({-1}).contiguous();
  const Tensor row = as_int64(rows).reshape({-1}).contiguous();

  kvcompress::AllocatePagesParams p;
  p.page_tables = page_tables.data_ptr<int32_t>();
  p.row_stride = page_tables.size(-1);
  p.free_stack = free_stack.data_ptr<int64_t>();
  p.stack_start = stack_start;
  p.offsets = off.data_ptr<int64_t>();
  p.first_column = col.data_ptr<int64_t>();
  p.rows = row.data_ptr<int64_t>();
  p.num_requesters = num_requesters;
  check_launch(kvcompress::launch_allocate_pages(p, current_stream(page_tables)), "allocate_pages");
}

}  // namespace

// Op schemas: documented in csrc/README.md.
TORCH_LIBRARY(kvcompress, m) {
  m.def(
      "paged_decode_attention(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor slot_positions, Tensor block_tables, Tensor head_lens, Tensor query_positions, "
      "float scale, int partition_size=0, Tensor!? slot_metrics=None, Tensor? metric_seqs=None, "
      "int metric_power=2, int? max_head_len=None) -> ()");
  m.def(
      "move_cache(Tensor! key_cache, Tensor! value_cache, Tensor! slot_metrics, "
      "Tensor! slot_positions, Tensor src_pages, Tensor src_offsets, Tensor dst_pages, "
      "Tensor dst_offsets) -> ()");
  m.def(
      "allocate_pages(Tensor! page_tables, Tensor free_stack, int stack_start, Tensor offsets, "
      "Tensor first_column, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(kvcompress, CUDA, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("move_cache", &move_cache);
  m.impl("allocate_pages", &allocate_pages);
}

// A Python module init so that `import kvcompress._C` loads the library (and thereby
// runs the registrations above). TORCH_EXTENSION_NAME comes from torch's build helpers.
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
#define KVC_CONCAT_(a, b) a##b
#define KVC_CONCAT(a, b) KVC_CONCAT_(a, b)
#define KVC_STR_(x) #x
#define KVC_STR(x) KVC_STR_(x)

PyMODINIT_FUNC KVC_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                      KVC_STR(TORCH_EXTENSION_NAME),
                                      "kvcompress CUDA kernels (torch.ops.kvcompress)",
                                      -1,
                                      nullptr,
                                      nullptr,
                                      nullptr,
                                      nullptr,
                                      nullptr};
  return PyModule_Create(&module);
}
