// The one registration file for rtvoice's CUDA kernels: every op is declared here under the
// `rtvoice_kernels` namespace and implemented for CUDA in its own .cu file.
#include <torch/extension.h>
#include <torch/library.h>

void prev_tokens_shift_inplace(torch::Tensor prev, torch::Tensor next_tokens);
void decode_attention(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                      torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor table,
                      torch::Tensor wblock, torch::Tensor pos, torch::Tensor out,
                      int64_t splits, std::optional<torch::Tensor> qw,
                      std::optional<torch::Tensor> kw, std::optional<torch::Tensor> cs,
                      double eps, bool pdl);
void sample_topk(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_p,
                 torch::Tensor top_k, torch::Tensor seed, torch::Tensor step,
                 torch::Tensor stream, torch::Tensor out, bool pdl,
                 std::optional<torch::Tensor> embed, std::optional<torch::Tensor> embed_out);
void snake(torch::Tensor x, torch::Tensor alpha, std::optional<torch::Tensor> bias,
           torch::Tensor out);
void bias_residual(torch::Tensor x, torch::Tensor y, torch::Tensor bias, torch::Tensor out);
void snake_cat(torch::Tensor tail, torch::Tensor x, torch::Tensor alpha,
               std::optional<torch::Tensor> bias, torch::Tensor out);
void linear_small_m(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> scale,
                    torch::Tensor out, int64_t splits, int64_t kwarps, int64_t variant,
                    bool glu, std::optional<torch::Tensor> residual,
                    std::optional<torch::Tensor> norm_weight, double eps, int64_t pdl);
void linear_small_m_attend(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor cs, int64_t pos, torch::Tensor w,
                           std::optional<torch::Tensor> scale, torch::Tensor out,
                           int64_t splits, int64_t kwarps,
                           std::optional<torch::Tensor> residual, int64_t pdl);
void book_ras_inputs(torch::Tensor logits, torch::Tensor temperature,
                     torch::Tensor ras_temperature, torch::Tensor top_p, torch::Tensor ras_top_p,
                     torch::Tensor top_k, torch::Tensor seed, torch::Tensor step,
                     torch::Tensor out_logits, torch::Tensor out_t, torch::Tensor out_p,
                     torch::Tensor out_k, torch::Tensor out_seed, torch::Tensor out_step);
void book_frame_tokens(torch::Tensor idx, torch::Tensor table, torch::Tensor h,
                       int64_t n_semantic, int64_t semantic_start, int64_t im_end,
                       torch::Tensor token, torch::Tensor code, torch::Tensor x);
void book_step_end(std::vector<torch::Tensor> columns, torch::Tensor was, torch::Tensor next_col,
                   torch::Tensor pos, torch::Tensor frames_left, torch::Tensor active,
                   torch::Tensor draw_step, int64_t im_end, torch::Tensor out);

TORCH_LIBRARY(rtvoice_kernels, m) {
  m.def("prev_tokens_shift_inplace(Tensor(a!) prev, Tensor next_tokens) -> ()");
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor table, Tensor wblock, Tensor pos, Tensor(c!) out, "
        "int splits, Tensor? qw=None, Tensor? kw=None, Tensor? cs=None, float eps=0.0, "
        "bool pdl=False) -> ()");
  m.def("sample_topk(Tensor logits, Tensor temperature, Tensor top_p, Tensor top_k, "
        "Tensor seed, Tensor step, Tensor stream, Tensor(a!) out, bool pdl=False, "
        "Tensor? embed=None, Tensor(b!)? embed_out=None) -> ()");
  m.def("snake(Tensor x, Tensor alpha, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("bias_residual(Tensor x, Tensor y, Tensor bias, Tensor(a!) out) -> ()");
  m.def("snake_cat(Tensor tail, Tensor x, Tensor alpha, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("linear_small_m(Tensor x, Tensor w, Tensor? scale, Tensor(a!) out, int splits, "
        "int kwarps, int variant, bool glu=False, Tensor? residual=None, "
        "Tensor? norm_weight=None, float eps=0.0, int pdl=0) -> ()");
  m.def("linear_small_m_attend(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cs, "
        "int pos, Tensor w, Tensor? scale, Tensor(c!) out, int splits, int kwarps, "
        "Tensor? residual=None, int pdl=0) -> ()");
  m.def("book_ras_inputs(Tensor logits, Tensor temperature, Tensor ras_temperature, "
        "Tensor top_p, Tensor ras_top_p, Tensor top_k, Tensor seed, Tensor step, "
        "Tensor(a!) out_logits, Tensor(b!) out_t, Tensor(c!) out_p, Tensor(d!) out_k, "
        "Tensor(e!) out_seed, Tensor(f!) out_step) -> ()");
  m.def("book_frame_tokens(Tensor idx, Tensor table, Tensor h, int n_semantic, "
        "int semantic_start, int im_end, Tensor(a!) token, Tensor(b!) code, Tensor(c!) x) -> ()");
  m.def("book_step_end(Tensor[] columns, Tensor was, Tensor(a!) next_col, Tensor(b!) pos, "
        "Tensor(c!) frames_left, Tensor(d!) active, Tensor(e!) draw_step, int im_end, "
        "Tensor(f!) out) -> ()");
}

TORCH_LIBRARY_IMPL(rtvoice_kernels, CUDA, m) {
  m.impl("prev_tokens_shift_inplace", &prev_tokens_shift_inplace);
  m.impl("decode_attention", &decode_attention);
  m.impl("sample_topk", &sample_topk);
  m.impl("snake", &snake);
  m.impl("bias_residual", &bias_residual);
  m.impl("snake_cat", &snake_cat);
  m.impl("linear_small_m", &linear_small_m);
  m.impl("linear_small_m_attend", &linear_small_m_attend);
  m.impl("book_ras_inputs", &book_ras_inputs);
  m.impl("book_frame_tokens", &book_frame_tokens);
  m.impl("book_step_end", &book_step_end);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
