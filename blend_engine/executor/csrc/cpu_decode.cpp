// Decode attention read straight from the paged pool on the CPU: one call a layer for every row
// (issue #35 item 5), the CPU twin of paged_decode.py's Triton kernel, same arguments.
//
//   pool K[h]:  | ... | start[b] .. start[b] + n[b] - 1 : row b's keys | ... |
//   row b:      G query heads of KV head h  x  keys lo(b) .. n[b]-1   (lo: the sliding window's first)
//
// One work item per (row b, KV head h), spread over the calling thread's OpenMP team: its G query
// rows' scores over the row's keys (each key row read once for all G), a softmax, then the weighted
// sum of the value rows (each read once). Nothing is copied out of the pool and nothing is written
// but the [B, H, G, D] output. float32 only (the CPU's dtype); accumulation in float32.
//
// A plain `omp parallel for`, not at::parallel_for: that one's per-thread set-up is a thread_local
// compiled into this library, so its first call on a thread re-ran torch's init_num_threads and put
// the engine loop back on the process default (one core in the service; blend_engine/cpu_threads.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& start, const at::Tensor& n, const at::Tensor& pos,
                        int64_t window, double scale) {
  TORCH_CHECK(q_in.dim() == 4, "q must be [B, H, G, D]");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.dim() == 3, "the pool's K and V must be [H, slots, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat,
              "cpu paged decode takes float32 only");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1, "the pool's head dim must be contiguous");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(k_pool.size(0) == H && v_pool.size(0) == H && k_pool.size(2) == D && v_pool.size(2) == D,
              "q and the pool disagree on KV heads or head dim");
  const at::Tensor st = start.to(at::kLong).contiguous();
  const at::Tensor nk = n.to(at::kLong).contiguous();
  const at::Tensor ps = pos.to(at::kLong).contiguous();
  TORCH_CHECK(st.numel() == B && nk.numel() == B && ps.numel() == B, "start, n and pos need one value per row");
  const int64_t slots = k_pool.size(1);
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* np = nk.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 1 && sp[b] >= 0 && sp[b] + np[b] <= slots, "row ", b, "'s keys lie outside the pool");
  }
  at::Tensor out = at::empty_like(q);  // [B, H, G, D]
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ksh = k_pool.stride(0), kss = k_pool.stride(1);
  const int64_t vsh = v_pool.stride(0), vss = v_pool.stride(1);
  const float sc = static_cast<float>(scale);

#pragma omp parallel
  {
    std::vector<float> score;       // [G, m]: one row's scores, then its softmax numerators
    std::vector<float> acc(G * D);  // [G, D]
    std::vector<float> total(G);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * H; ++i) {
      const int64_t b = i / H, h = i % H;
      const int64_t lo = window > 0 ? std::max<int64_t>(pp[b] - window + 1, 0) : 0;
      const int64_t m = np[b] - lo;  // >= 1: the row's own key is always visible
      score.resize(G * m);
      const float* qb = qp + i * G * D;
      const float* kb = kp + h * ksh + (sp[b] + lo) * kss;
      const float* vb = vp + h * vsh + (sp[b] + lo) * vss;
      for (int64_t j = 0; j < m; ++j) {
        const float* kr = kb + j * kss;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qb + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          score[g * m + j] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = score.data() + g * m;
        const float top = *std::max_element(sg, sg + m);
        float sum = 0.f;
        for (int64_t j = 0; j < m; ++j) {
          sg[j] = std::exp(sg[j] - top);
          sum += sg[j];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < m; ++j) {
        const float* vr = vb + j * vss;
        for (int64_t g = 0; g < G; ++g) {
          const float p = score[g * m + j];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      float* ob = op + i * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv;
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(blendserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor start, Tensor n, Tensor pos, "
        "int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(blendserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
