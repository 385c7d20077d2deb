// Python bindings of the CPU kernels (one module, built by kernels/cpu_ops.py).
#include <torch/extension.h>

namespace pagedserve {
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window, double softcap);
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& chunks, double scale, at::Tensor& out,
                             int64_t window, double softcap, const c10::optional<at::Tensor>& key_limits);
bool prefill_attention_available();
int64_t prefill_attention_max_group();
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping);
bool lane_linear_available(bool bfloat16);
at::Tensor pack_lane_weight(const at::Tensor& weight);
at::Tensor lane_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::optional<at::Tensor> residual);
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w);
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& positions);
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& qtypes,
                        bool precise);
at::Tensor dequantize_rows(const at::Tensor& w, int64_t qtype, int64_t cols, bool bfloat16);
at::Tensor dequant_lane_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                               const std::vector<int64_t>& qtypes);
at::Tensor repack_rows(const at::Tensor& w, int64_t qtype);
void repack_rows_(at::Tensor& w, int64_t qtype);
at::Tensor unpack_rows(const at::Tensor& packed, int64_t qtype, int64_t cols, const at::Tensor& ids);
at::Tensor repacked_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& qtypes,
                           const std::vector<int64_t>& rows, bool precise, bool bf16_out);
bool repacked_kernel_available();
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor draw_rows(at::Tensor& y, const at::Tensor& u);
at::Tensor top_indices(const at::Tensor& x, int64_t k);
void penalize_rows(at::Tensor& x, const at::Tensor& which, const at::Tensor& counts, const at::Tensor& prompt,
                   const at::Tensor& table_rows, const at::Tensor& repetition, const at::Tensor& presence,
                   const at::Tensor& frequency);
at::Tensor nucleus_draw_rows(at::Tensor& y, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                             const at::Tensor& u);
bool set_work_pool(bool on);
bool lora_delta_available(bool bfloat16);
void lora_delta_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& row_slots, int64_t rank_stride, const std::vector<int64_t>& offsets,
                 const std::vector<int64_t>& sizes);
std::tuple<at::Tensor, at::Tensor> work_pool_probe(int64_t n, int64_t chunk, int64_t threads, int64_t sleep_us,
                                                   int64_t throw_at, bool nested);
std::tuple<at::Tensor, at::Tensor> logits_top(const at::Tensor& x, int64_t k);
std::tuple<at::Tensor, at::Tensor, at::Tensor> seeded_race_candidates(const at::Tensor& probs, const at::Tensor& keys);
}  // namespace pagedserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("seeded_race_candidates", &pagedserve::seeded_race_candidates,
        "the tokens that can win each seeded row's exponential race, (counts [rows], index [C], u [C] float64)");
  m.def("paged_decode_attention", &pagedserve::paged_decode_attention,
        "decode attention over a paged KV cache (query [B,H,D], caches [N,bs,KVH,D]); window: the last keys a "
        "token sees (0: all), softcap: scaled scores capped at cap * tanh(s / cap) (0: none)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("write_kv_cache", &pagedserve::write_kv_cache,
        "the step's new key and value rows [T,KVH,D] into k_cache / v_cache [N,bs,KVH,D] at flat slots [T]");
  m.def("paged_prefill_attention", &pagedserve::paged_prefill_attention,
        "causal attention of prefill chunks over a paged KV cache into out's rows (chunks: int64 [P, 3] = "
        "row start, rows, context_len; block_tables int64 [P, max_blocks]); window: the last keys a row sees "
        "(0: all), softcap: scaled scores capped at cap * tanh(s / cap) (0: none), key_limits: int64 [query rows], "
        "the last key each row sees, bidirectional blocks (None: causal)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("chunks"),
        py::arg("scale"), py::arg("out"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("key_limits") = py::none());
  m.def("prefill_attention_available", &pagedserve::prefill_attention_available,
        "whether paged_prefill_attention was compiled (AVX-512, or AVX2 with FMA)");
  m.def("prefill_attention_max_group", &pagedserve::prefill_attention_max_group,
        "the most query heads per kv head paged_prefill_attention takes (48 with AVX-512, 24 with AVX2; 0: none)");
  m.def("lane_linear_available", &pagedserve::lane_linear_available,
        "whether lane_linear was compiled for float32 (bfloat16=False: AVX-512, or AVX2 with FMA) or bfloat16 (AVX-512 with avx512_bf16)");
  m.def("pack_lane_weight", &pagedserve::pack_lane_weight,
        "float32 or bfloat16 [N, K] -> int32 [ceil(N/16), K or K/2, 16]: 16 rows' floats (bfloat16 pairs) per vector");
  m.def("lane_linear", &pagedserve::lane_linear, "x [M, K] @ weight.T in x's dtype, weight = pack_lane_weight(weight) of N rows");
  m.def("small_m_linear", &pagedserve::small_m_linear, "x @ w.T in float32 for small row counts");
  m.def("silu_and_mul", &pagedserve::silu_and_mul, "silu(x[:, :I]) * x[:, I:]");
  m.def("rms_norm", &pagedserve::rms_norm, "RMSNorm (float32 statistics); with residual: residual += x, then norm it",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("quant_linear", &pagedserve::quant_linear,
        "x [M, K] @ concat(weights).T in float32; weights: uint8 [N_i, bytes] of GGUF blocks of qtypes[i]",
        py::arg("x"), py::arg("weights"), py::arg("qtypes"), py::arg("precise") = false);
  m.def("dequantize_rows", &pagedserve::dequantize_rows, "GGUF blocks uint8 [N, bytes] -> [N, cols] float32 (or bfloat16)",
        py::arg("w"), py::arg("qtype"), py::arg("cols"), py::arg("bfloat16") = false);
  m.def("dequant_lane_linear", &pagedserve::dequant_lane_linear,
        "x float32 [M, K] @ concat(GGUF block weights).T -> float32, 16 weight rows dequantized at a time for the lane kernel");
  m.def("repack_rows", &pagedserve::repack_rows,
        "GGUF blocks uint8 [N, bytes] (Q4_0/Q4_1/Q8_0) -> 16-row interleaved tiles [ceil(N/16), 16 * bytes]");
  m.def("repack_rows_", &pagedserve::repack_rows_, "repack_rows in the blocks' own storage (N a multiple of 16)");
  m.def("unpack_rows", &pagedserve::unpack_rows, "the original blocks of rows `ids` of a repacked weight");
  m.def("repacked_linear", &pagedserve::repacked_linear,
        "x [M, K] @ concat(weights).T in float32 (or bfloat16) on repacked weights (rows[i] rows each)",
        py::arg("x"), py::arg("packed"), py::arg("qtypes"), py::arg("rows"), py::arg("precise") = false,
        py::arg("bf16_out") = false);
  m.def("repacked_kernel_available", &pagedserve::repacked_kernel_available,
        "whether repacked_linear was compiled (AVX-512 VNNI)");
  m.def("argmax_rows", &pagedserve::argmax_rows, "torch.argmax(x, -1) of a contiguous float32 [rows, n]");
  m.def("top_indices", &pagedserve::top_indices, "x.topk(k, sorted=False).indices of a contiguous float32 [rows, n]");
  m.def("draw_rows", &pagedserve::draw_rows,
        "a token a row from softmax(y) by inverse transform with uniforms u (y overwritten with exp(y - max))");
  m.def("nucleus_draw_rows", &pagedserve::nucleus_draw_rows,
        "draw_rows within each row's top_k, top_p nucleus and min_p floor (y overwritten with exp(y - max))");
  m.def("penalize_rows", &pagedserve::penalize_rows,
        "repetition, presence and frequency penalties on x's rows from a PenaltyCounts table's rows, in place");
  m.def("logits_top", &pagedserve::logits_top,
        "(x.float(), indices of each row's k largest, unsorted) of a float32 or bfloat16 [rows, n], in one pass");
  m.def("rotary_inplace", &pagedserve::rotary_inplace, "rotate-half rotary embedding of q and k in place");
  m.def("lora_delta_available", &pagedserve::lora_delta_available,
        "whether lora_delta_ was compiled for float32 (AVX-512) or bfloat16 (AVX-512 with avx512_bf16)");
  m.def("lora_delta_", &pagedserve::lora_delta_,
        "out [T, N] += each row's LoRA delta: its own slot's shrink and expand (lora_delta.cpp; a, b packed by "
        "worker/lora/packed.py; row_slots int32 [T], -1 none)");
  m.def("set_work_pool", &pagedserve::set_work_pool,
        "the kernels' thread pool on or off (OpenMP; the default unless PAGEDSERVE_WORK_POOL=1); returns the old state");
  m.def("work_pool_probe", &pagedserve::work_pool_probe,
        "tests: (ran on a pool thread, times run) per item of a pool region (work_pool.cpp)", py::arg("n"),
        py::arg("chunk"), py::arg("threads"), py::arg("sleep_us") = 0, py::arg("throw_at") = -1,
        py::arg("nested") = false, py::call_guard<py::gil_scoped_release>());
}
