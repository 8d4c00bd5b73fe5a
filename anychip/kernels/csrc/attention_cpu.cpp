// vLLM's CPU attention step for one decoder layer, called from C++ (no Python per call):
//   anychip::cpu_attention(Tensor query, Tensor? key, Tensor? value, Tensor(a!) output, Tensor layer) -> ()
//       query (T, H, D), key / value (T, Hkv, D), output (T, H, Dv): vLLM's Attention.forward views
// It makes the two calls vLLM's Python ops make (vllm::unified_kv_cache_update, then
// vllm::unified_attention_with_output with the CPU backend): `_C::cpu_attn_reshape_and_cache` writes the step's keys
// and values into the layer's cache, `_C::cpu_attention_with_kv_cache` attends; same kernels, same arguments, so
// the same bits. What those Python ops look up at every call (the layer's cache and constants, the step's metadata)
// is handed over ahead: the layer's once (attn_register_layer), the step's once a forward (attn_set_group for each
// metadata group, attn_set_state).  vLLM's kernels are found through the dispatcher by name, at the first call.
//
// A step of at least kPrefillMinTokens rows, at least 6 for each sequence (prompts, chunks of them), can instead
// be attended by anychip's own prefill kernel (attention_prefill_x86.h), where the plugin switched it on
// (attn_set_prefill_kernel: AVX2-only x86, where vLLM's kernels are their generic ones): from the step's keys and
// values when every sequence is a fresh prompt, else from the paged cache (where vLLM's attention is its `vec` build,
// whose cache layout the kernel reads), after the step's keys and values went there as always.  Steps with decode
// rows keep vLLM's kernels.  anychip::prefill_attention(_cached) are the kernel as
// ops of their own (tests, benchmarks).

#include "attention_prefill_x86.h"
#include "parallel_cpu.h"

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <vector>

namespace anychip {
namespace {

struct AttnLayer {
  at::Tensor key_cache, value_cache;  // views of the layer's (blocks, Hkv, 2 * block, D) cache, as vLLM chunks it
  double scale = 1.0, softcap = 0.0, k_scale = 1.0, v_scale = 1.0;
  int64_t sliding_window = -1, group = -1;
  c10::optional<at::Tensor> alibi, sinks;
  c10::IValue isa, kv_cache_dtype;  // strings, made once in the form the ops' stacks take
  bool registered = false;
};

struct AttnGroup {  // one attention-metadata object of the step (one KV-cache group)
  int64_t num_tokens = 0;  // num_actual_tokens
  bool causal = true, set = false;
  at::Tensor query_start_loc, seq_lens, block_table, scheduler_metadata;
  c10::optional<at::Tensor> dynamic_causal, slot_mapping;
};

// kUnset: no forward the plugin prepared is running (a call then is an error: vLLM's path would have found its
// context); kNoMetadata: a forward without attention metadata (vLLM's warm-up and profiling runs: the ops return
// at once, as vLLM's do); kReady: the groups hold this step's metadata.
enum State : int64_t { kUnset = 0, kNoMetadata = 1, kReady = 2 };

struct Registry {
  std::mutex mu;  // registration and step setting come from Python; the op reads under the GIL-free dispatcher
  std::vector<AttnLayer> layers;
  std::vector<AttnGroup> groups;
  State state = kUnset;
};

Registry& registry() {
  static Registry r;
  return r;
}

c10::OperatorHandle vllm_op(const char* name) {  // by value: the handle lives in the optional findOp returns
  auto handle = c10::Dispatcher::singleton().findOp({name, ""});
  TORCH_CHECK(handle.has_value(), "anychip cpu_attention: vLLM's op ", name,
              " is not registered (import vLLM's CPU ops first; anychip installs this path only on vLLM's CPU "
              "backend)");
  return *handle;
}

const c10::OperatorHandle& reshape_and_cache_op() {
  static const c10::OperatorHandle h = vllm_op("_C::cpu_attn_reshape_and_cache");
  return h;
}

const c10::OperatorHandle& attention_op() {
  static const c10::OperatorHandle h = vllm_op("_C::cpu_attention_with_kv_cache");
  return h;
}

c10::IValue opt(const c10::optional<at::Tensor>& t) { return t.has_value() ? c10::IValue(*t) : c10::IValue(); }

std::atomic<bool> g_prefill_kernel{false};
std::atomic<int64_t> g_prefill_calls{0};  // layer calls the prefill kernel served
constexpr int64_t kPrefillMinTokens = 32;  // fewer tokens a step: vLLM's kernel (nothing to gain)
constexpr const char* kCacheLayoutIsa = "vec";  // vLLM's attention ISA whose paged cache the kernel reads

// Query start offsets as int64 (vLLM's are int32).
std::vector<int64_t> starts_of(const at::Tensor& query_start_loc, int64_t nseq) {
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const int64_t* q = qsl.data_ptr<int64_t>();
  return std::vector<int64_t>(q, q + nseq + 1);
}

void check_prefill_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& output) {
  for (const at::Tensor* t : {&query, &key, &value, &output}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1,
                "anychip prefill attention: q, k, v and out must be CPU bfloat16 (tokens, heads, dim) with unit "
                "stride in dim, got ", t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  }
  const int64_t heads = query.size(1), kv_heads = key.size(1), dim = query.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && value.size(1) == kv_heads && output.size(1) == heads,
              "anychip prefill attention: heads ", heads, " must be a multiple of KV heads ", kv_heads);
  TORCH_CHECK(key.size(2) == dim && value.size(2) == dim && output.size(2) == dim,
              "anychip prefill attention: q, k, v and out must share the head dim ", dim);
  TORCH_CHECK(key.size(0) >= query.size(0) && value.size(0) >= query.size(0) && output.size(0) >= query.size(0),
              "anychip prefill attention: fewer key, value or output rows than query rows");
  TORCH_CHECK(prefill_attention_supported(dim), "anychip prefill attention: needs AVX2 + FMA and a head dim that "
              "is a multiple of 8 up to ", kAttnMaxDim, " (dim ", dim, ")");
}

// The kernel's view of the step: q and out always; keys and values from k, v (`key` given: fresh prompts) or from
// the paged cache (`cache` given: block table, context per sequence).
struct CacheSource {
  at::Tensor key_cache, value_cache, block_table;  // (blocks, Hkv, block, D) x 2, (sequences, blocks) int32
  std::vector<int64_t> context;
};

void run_prefill(const at::Tensor& query, const at::Tensor* key, const at::Tensor* value, const at::Tensor& output,
                 std::vector<int64_t> starts, double scale, const CacheSource* cache) {
#ifdef ANYCHIP_X86
  PrefillAttention a;
  const auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  a.q = bits(query), a.q_t = query.stride(0), a.q_h = query.stride(1);
  if (key != nullptr) {
    a.k = bits(*key), a.k_t = key->stride(0), a.k_h = key->stride(1);
    a.v = bits(*value), a.v_t = value->stride(0), a.v_h = value->stride(1);
  }
  if (cache != nullptr) {
    const at::Tensor& kc = cache->key_cache;
    a.kc = bits(kc), a.vc = bits(cache->value_cache);
    a.c_b = kc.stride(0), a.c_h = kc.stride(1), a.c_j = kc.stride(2), a.block = kc.size(2);
    a.block_table = cache->block_table.data_ptr<int32_t>(), a.bt_s = cache->block_table.stride(0);
    a.context = cache->context;
  }
  a.out = reinterpret_cast<uint16_t*>(output.data_ptr()), a.o_t = output.stride(0), a.o_h = output.stride(1);
  a.starts = std::move(starts);
  a.heads = query.size(1), a.kv_heads = key != nullptr ? key->size(1) : cache->key_cache.size(1);
  a.dim = query.size(2), a.scale = static_cast<float>(scale);
  prefill_attention_avx2(a, at::get_num_threads(), TorchParallel{});
#else
  (void)query, (void)key, (void)value, (void)output, (void)starts, (void)scale, (void)cache;
  TORCH_CHECK(false, "anychip prefill attention: x86 only");
#endif
}

std::vector<int64_t> checked_starts(const at::Tensor& query_start_loc, int64_t rows) {
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) >= 2,
              "anychip prefill attention: query_start_loc must hold sequences + 1 offsets");
  const int64_t nseq = query_start_loc.size(0) - 1;
  std::vector<int64_t> starts = starts_of(query_start_loc, nseq);
  TORCH_CHECK(starts[0] == 0 && starts[nseq] <= rows, "anychip prefill attention: offsets must start at 0 and end "
              "within the ", rows, " rows");
  for (int64_t i = 0; i < nseq; ++i)
    TORCH_CHECK(starts[i + 1] >= starts[i], "anychip prefill attention: offsets must not decrease");
  return starts;
}

// anychip::prefill_attention: the kernel alone, on fresh prompts' q, k, v the caller made.
void prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& output, const at::Tensor& query_start_loc, double scale) {
  check_prefill_args(query, key, value, output);
  run_prefill(query, &key, &value, output, checked_starts(query_start_loc, query.size(0)), scale, nullptr);
}

// Whether a paged cache is one the kernel reads: BF16 (blocks, Hkv, block, D) keys and values alike, unit stride in
// D, and an int32 block table with unit stride in its rows.
bool cache_readable(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
                    int64_t kv_heads, int64_t dim) {
  for (const at::Tensor* t : {&key_cache, &value_cache})
    if (t->scalar_type() != at::kBFloat16 || t->dim() != 4 || t->stride(3) != 1 || t->size(1) != kv_heads ||
        t->size(3) != dim || t->strides() != key_cache.strides() || t->sizes() != key_cache.sizes())
      return false;
  return block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
         key_cache.size(2) > 0;
}

// anychip::prefill_attention_cached: the kernel alone, keys and values from a paged cache (vLLM's CPU layout:
// (blocks, Hkv, block, D) a tensor) that holds each sequence's seq_lens[i] tokens, the query rows' the last of them.
void prefill_attention_cached(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& output, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                              const at::Tensor& block_table, double scale) {
  check_prefill_args(query, query, query, output);  // q and out; the cache below
  TORCH_CHECK(key_cache.dim() == 4 && query.size(1) % std::max<int64_t>(1, key_cache.size(1)) == 0 &&
              cache_readable(key_cache, value_cache, block_table, key_cache.size(1), query.size(2)),
              "anychip prefill attention: caches must be bfloat16 (blocks, KV heads, block, dim) with unit stride in "
              "dim, KV heads dividing the query heads, and the block table int32 with unit stride in its rows");
  std::vector<int64_t> starts = checked_starts(query_start_loc, query.size(0));
  const int64_t nseq = int64_t(starts.size()) - 1;
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == nseq && block_table.size(0) >= nseq,
              "anychip prefill attention: seq_lens and block_table need one row a sequence");
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t block = key_cache.size(2);
  CacheSource cache{key_cache, value_cache, block_table, {}};
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t len = lens.data_ptr<int64_t>()[i], ctx = len - (starts[i + 1] - starts[i]);
    TORCH_CHECK(ctx >= 0, "anychip prefill attention: sequence ", i, " is shorter than its query rows");
    TORCH_CHECK((len + block - 1) / block <= block_table.size(1), "anychip prefill attention: sequence ", i,
                " needs more blocks than the block table has");
    const at::Tensor ids = block_table[i].narrow(0, 0, (len + block - 1) / block);
    TORCH_CHECK(ids.min().item<int32_t>() >= 0 && ids.max().item<int32_t>() < key_cache.size(0),
                "anychip prefill attention: sequence ", i, " names a block outside the cache");
    cache.context.push_back(ctx);
  }
  run_prefill(query, nullptr, nullptr, output, std::move(starts), scale, &cache);
}

// A step as kernel work: the rows' offsets and each sequence's context (all 0: fresh prompts, read from the step's
// keys and values; otherwise the cache).
struct KernelStep {
  std::vector<int64_t> starts, context;
  bool fresh = true;
};

// Whether the kernel takes this step: switched on, enough rows, at least a tile's rows (6) for every sequence, the
// cache written (slot mapping), and nothing the kernel leaves out (sliding window, soft-capping, ALiBi, sinks,
// another cache dtype or layout).
bool kernel_step(const AttnLayer& layer, const AttnGroup& group, const at::Tensor& query,
                 const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& value,
                 const at::Tensor& output, KernelStep* step) {
  if (!g_prefill_kernel.load(std::memory_order_relaxed) || group.num_tokens < kPrefillMinTokens) return false;
  if (!key.has_value() || !value.has_value() || !group.slot_mapping.has_value()) return false;
  if (!group.causal || group.dynamic_causal.has_value()) return false;
  if (layer.kv_cache_dtype.toStringRef() != "auto" || layer.alibi.has_value() || layer.sinks.has_value() ||
      layer.softcap != 0.0 || layer.sliding_window >= 0)
    return false;
  for (const at::Tensor* t : {&query, &*key, &*value, &output})
    if (t->scalar_type() != at::kBFloat16 || t->dim() != 3 || t->stride(2) != 1) return false;
  const int64_t kv_heads = key->size(1), dim = query.size(2);
  if (kv_heads == 0 || query.size(1) % kv_heads || value->size(2) != dim || output.size(2) != dim ||
      !prefill_attention_supported(dim))
    return false;
  const int64_t nseq = group.seq_lens.size(0);
  if (group.query_start_loc.size(0) < nseq + 1) return false;
  step->starts = starts_of(group.query_start_loc, nseq);
  if (step->starts[0] != 0 || step->starts[nseq] != group.num_tokens) return false;
  const at::Tensor lens = group.seq_lens.to(at::kLong).contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  step->context.assign(nseq, 0);
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t rows = step->starts[i + 1] - step->starts[i], ctx = len[i] - rows;
    // a decode row (or a prompt shorter than a tile) beside prompts: vLLM's kernel for the step, since the kernel's
    // tiles of 6 rows would compute 6 against that sequence's whole context for one row
    if (ctx < 0 || rows < kAttnRows) return false;
    step->context[i] = ctx;
    step->fresh = step->fresh && ctx == 0;
  }
  if (step->fresh) return true;
  // The paged cache as the kernel reads it, (blocks, Hkv, block, D), is what vLLM's `vec` attention build writes
  // (its generic x86 one, where the plugin turns the kernel on). Its AMX build writes its own packed form, which
  // the kernel read as garbage (1.15 nats off on the 2-vCPU Xeon with ANYCHIP_ATTN_PREFILL=1), and `vec16`'s is
  // not verified: steps with cached context keep vLLM's kernels there.
  if (layer.isa.toStringRef() != kCacheLayoutIsa) return false;
  if (!cache_readable(layer.key_cache, layer.value_cache, group.block_table, kv_heads, dim) ||
      group.block_table.size(0) < nseq)
    return false;
  const int64_t block = layer.key_cache.size(2);
  for (int64_t i = 0; i < nseq; ++i)
    if ((len[i] + block - 1) / block > group.block_table.size(1)) return false;
  return true;
}

// The first n rows of t (t itself when it has n: a decode step's call then makes no view).
at::Tensor first_rows(const at::Tensor& t, int64_t n) { return t.size(0) == n ? t : t.narrow(0, 0, n); }

void cpu_attention(const at::Tensor& query, const c10::optional<at::Tensor>& key,
                   const c10::optional<at::Tensor>& value, const at::Tensor& output, const at::Tensor& layer_id) {
  Registry& r = registry();
  // the plugin's layer ids are one-element int64 CPU tensors: read directly (item() is a dispatcher call a layer)
  const int64_t id = layer_id.scalar_type() == at::kLong && layer_id.numel() == 1 && layer_id.device().is_cpu()
                         ? *layer_id.const_data_ptr<int64_t>()
                         : layer_id.item<int64_t>();
  AttnLayer layer;
  AttnGroup group;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    TORCH_CHECK(r.state != kUnset, "anychip cpu_attention: called outside a forward pass prepared by anychip's "
                "vLLM plugin (its forward-context hook did not run); set ANYCHIP_CPU_ATTENTION=0 to serve with "
                "vLLM's own attention path");
    if (r.state == kNoMetadata) return;
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(r.layers.size()) && r.layers[id].registered,
                "anychip cpu_attention: layer ", id, " was not registered");
    layer = r.layers[id];
    TORCH_CHECK(layer.group >= 0 && layer.group < static_cast<int64_t>(r.groups.size()) && r.groups[layer.group].set,
                "anychip cpu_attention: layer ", id, " has no attention metadata for this step");
    group = r.groups[layer.group];
  }
  if (key.has_value() && value.has_value() && group.slot_mapping.has_value()) {
    torch::jit::Stack s{*key, *value, layer.key_cache, layer.value_cache, *group.slot_mapping, layer.isa,
                        layer.k_scale, layer.v_scale, layer.kv_cache_dtype};
    reshape_and_cache_op().callBoxed(&s);
  }
  const int64_t n = group.num_tokens;
  KernelStep step;
  if (kernel_step(layer, group, query, key, value, output, &step)) {
    const at::Tensor q = first_rows(query, n), out = first_rows(output, n);
    if (step.fresh) {
      const at::Tensor k = first_rows(*key, n), v = first_rows(*value, n);
      run_prefill(q, &k, &v, out, std::move(step.starts), layer.scale, nullptr);
    } else {
      CacheSource cache{layer.key_cache, layer.value_cache, group.block_table, std::move(step.context)};
      run_prefill(q, nullptr, nullptr, out, std::move(step.starts), layer.scale, &cache);
    }
    g_prefill_calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  torch::jit::Stack s{first_rows(query, n), layer.key_cache, layer.value_cache, first_rows(output, n),
                      group.query_start_loc, group.seq_lens, layer.scale, group.causal, opt(layer.alibi),
                      layer.sliding_window, group.block_table, layer.softcap, group.scheduler_metadata,
                      opt(layer.sinks), opt(group.dynamic_causal), layer.k_scale, layer.v_scale,
                      layer.kv_cache_dtype};
  attention_op().callBoxed(&s);
}

void cpu_attention_meta(const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                        const at::Tensor&, const at::Tensor&) {}

// kv_cache: the layer's (blocks, Hkv, block, 2 * D) tensor, viewed and split as vLLM's CPU backend does.
void attn_register_layer(int64_t id, const at::Tensor& kv_cache, double scale, const c10::optional<at::Tensor>& alibi,
                         int64_t sliding_window, double softcap, const c10::optional<at::Tensor>& sinks,
                         double k_scale, double v_scale, c10::string_view isa, c10::string_view kv_cache_dtype) {
  TORCH_CHECK(id >= 0, "attn_register_layer: negative layer id ", id);
  TORCH_CHECK(kv_cache.dim() == 4, "attn_register_layer: the KV cache must be (blocks, Hkv, block, 2 * D), got ",
              kv_cache.sizes());
  const int64_t blocks = kv_cache.size(0), heads = kv_cache.size(1), block = kv_cache.size(2);
  auto halves = kv_cache.view({blocks, heads, block * 2, -1}).chunk(2, 2);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (static_cast<int64_t>(r.layers.size()) <= id) r.layers.resize(id + 1);
  AttnLayer& l = r.layers[id];
  const int64_t group = l.group;
  l = AttnLayer{halves[0], halves[1], scale, softcap, k_scale, v_scale, sliding_window, group, alibi, sinks,
                c10::IValue(std::string(isa)), c10::IValue(std::string(kv_cache_dtype)), true};
}

void attn_set_layer_groups(const std::vector<int64_t>& groups) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.layers.size() < groups.size()) r.layers.resize(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) r.layers[i].group = groups[i];
}

void attn_set_group(int64_t g, int64_t num_tokens, bool causal, const at::Tensor& query_start_loc,
                    const at::Tensor& seq_lens, const at::Tensor& block_table, const at::Tensor& scheduler_metadata,
                    const c10::optional<at::Tensor>& dynamic_causal, const c10::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(g >= 0, "attn_set_group: negative group ", g);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (static_cast<int64_t>(r.groups.size()) <= g) r.groups.resize(g + 1);
  r.groups[g] = AttnGroup{num_tokens, causal, true, query_start_loc, seq_lens, block_table, scheduler_metadata,
                          dynamic_causal, slot_mapping};
}

// Sets the state (0 unset, 1 no metadata, 2 ready) and returns the previous one; leaving `ready` drops the
// step's tensors.
int64_t attn_set_state(int64_t state) {
  TORCH_CHECK(state >= kUnset && state <= kReady, "attn_set_state: unknown state ", state);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const int64_t previous = r.state;
  r.state = static_cast<State>(state);
  if (state != kReady) {
    for (auto& g : r.groups) g = AttnGroup{};
  }
  return previous;
}

// Turns the prefill kernel on or off for steps of fresh prompts; returns the previous setting.
bool attn_set_prefill_kernel(bool on) { return g_prefill_kernel.exchange(on); }

// Layer calls the prefill kernel has served in this process.
int64_t attn_prefill_calls() { return g_prefill_calls.load(std::memory_order_relaxed); }

}  // namespace
}  // namespace anychip

TORCH_LIBRARY_FRAGMENT(anychip, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, Tensor query_start_loc, "
        "float scale) -> ()");
  m.def("prefill_attention_cached(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, float scale) -> ()");
  m.def("attn_set_prefill_kernel(bool on) -> bool");
  m.def("attn_prefill_calls() -> int");
  m.impl("attn_set_prefill_kernel", &anychip::attn_set_prefill_kernel);
  m.impl("attn_prefill_calls", &anychip::attn_prefill_calls);
  m.def("cpu_attention(Tensor query, Tensor? key, Tensor? value, Tensor(a!) output, Tensor layer) -> ()");
  m.def("attn_register_layer(int id, Tensor kv_cache, float scale, Tensor? alibi, int sliding_window, float softcap, "
        "Tensor? sinks, float k_scale, float v_scale, str isa, str kv_cache_dtype) -> ()");
  m.def("attn_set_layer_groups(int[] groups) -> ()");
  m.def("attn_set_group(int group, int num_tokens, bool causal, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, Tensor scheduler_metadata, Tensor? dynamic_causal, Tensor? slot_mapping) -> ()");
  m.def("attn_set_state(int state) -> int");
  m.impl("attn_register_layer", &anychip::attn_register_layer);
  m.impl("attn_set_layer_groups", &anychip::attn_set_layer_groups);
  m.impl("attn_set_group", &anychip::attn_set_group);
  m.impl("attn_set_state", &anychip::attn_set_state);
}

TORCH_LIBRARY_IMPL(anychip, CPU, m) {
  m.impl("cpu_attention", &anychip::cpu_attention);
  m.impl("prefill_attention", &anychip::prefill_attention);
  m.impl("prefill_attention_cached", &anychip::prefill_attention_cached);
}

TORCH_LIBRARY_IMPL(anychip, Meta, m) { m.impl("cpu_attention", &anychip::cpu_attention_meta); }
