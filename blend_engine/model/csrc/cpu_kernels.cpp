// Blendserve's CPU kernels (blend_engine/model/cpu_kernels.py builds and loads them), seven ops:
//
// paged_decode: decode attention read straight from the paged pool, one call a layer for every row
// (issue #35 item 5), the CPU twin of executor/paged_decode.py's Triton kernel, same arguments.
//
//   pool K[h]:  | ... | start[b] .. start[b] + n[b] - 1 : row b's keys | ... |
//   row b:      G query heads of KV head h  x  keys lo(b) .. n[b]-1   (lo: the sliding window's first)
//
// Work items (row b, KV head h, part p of the row's keys), spread over the calling thread's OpenMP
// team, then a merge of each row's parts; see `attend_part`. Bound by reading the pool: ~20-24 GB/s
// of K and V on this 2-core host against ~13-17 for one scalar item per (b, h) before.
//
// rows_linear: y = x W^T (+ bias) for a few rows x [T, in] against an nn.Linear weight W [out, in]
// as stored (no repacking): each thread takes blocks of NT weight rows and runs MT x NT register
// tiles of 16-wide dot products over them, so a weight row is read from memory once for every
// 8 rows of x. MKL's sgemm takes a slow path at these shapes (benchmarks/results/cpu_kernels/).
// packed_linear: the same tiles over a weight kept in its GGUF block code (see there).
// selected_attention: a prefill's rows at sorted positions over the keys before each (see there).
// place_rotated: cached chunks' keys moved by RoPE and written with their values into a cache (see there).
// rms_norm: the families' RMSNorm, one pass a row (see there).
// rope: fresh queries or keys rotated to their positions, one pass (see there).
//
// All: float32 only (the CPU's dtype), float32 accumulation. Plain `omp parallel`, not
// at::parallel_for: that one's per-thread set-up is a thread_local compiled into this library, so
// its first call on a thread re-ran torch's init_num_threads and put the engine loop back on the
// process default (one core in the service; blend_engine/model/cpu_threads.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register (two AVX2 ones)
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float lanes_sum(v16 v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const v8 s8 = lo + hi;
  v4 a, b;
  std::memcpy(&a, &s8, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof(a), sizeof(b));
  const v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// paged_decode's work: one row's keys are cut into parts of PART keys (by its own length alone, so a
// row's result never depends on the rows beside it: batched equals alone); an item is (row b, KV
// head h, part p). Per item: the G query rows' scores over the part's keys (16 keys at a time, their
// 16 dot products folded into one vector), their maximum, exp and sum, then the numerators' weighted
// sum of the value rows; each key and value row is read from memory once for all G. A second pass
// merges a row's parts by their maxima. Nothing is copied out of the pool; a head dim of 16 x 1..8
// or 256 takes the vector path, any other a lane at a time.
constexpr int64_t PART = 512;  // keys per work item: 256, 512 and 1,024 measured, 512 best at 1 and at 8-16 rows

typedef int32_t vi16 __attribute__((vector_size(64)));

// x in every lane: one broadcast (from memory where x is). `v16{} + x` compiled to a scalar 0 + x and a
// register broadcast, two more uops on the FMA ports for every splat of an inner loop (0 + x is not x
// for x = -0, so the compiler may not drop it): selected_attention ran 1.1x slower with it.
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

const vi16 LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline vi16 lanes_below(int64_t n) { return LANES < vi16{} + static_cast<int32_t>(n); }  // lanes 0 .. n-1 set

// The 16 lane sums of x[0..15] as one vector (lane t: x[t]'s sum), by halving twice four times.
inline v16 fold16(v16* x) {
  const vi16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 a[8], b[4], c[2];
  for (int t = 0; t < 8; ++t) a[t] = __builtin_shuffle(x[2 * t], x[2 * t + 1], lo8) + __builtin_shuffle(x[2 * t], x[2 * t + 1], hi8);
  for (int t = 0; t < 4; ++t) b[t] = __builtin_shuffle(a[2 * t], a[2 * t + 1], lo4) + __builtin_shuffle(a[2 * t], a[2 * t + 1], hi4);
  for (int t = 0; t < 2; ++t) c[t] = __builtin_shuffle(b[2 * t], b[2 * t + 1], lo2) + __builtin_shuffle(b[2 * t], b[2 * t + 1], hi2);
  return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

inline float lanes_max(v16 v) {  // the largest of the 16 lanes, by halving four times
  const vi16 h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const vi16 h4 = {4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15};
  const vi16 h2 = {2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vi16 h1 = {1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 t = __builtin_shuffle(v, h8);
  v = v > t ? v : t;
  t = __builtin_shuffle(v, h4);
  v = v > t ? v : t;
  t = __builtin_shuffle(v, h2);
  v = v > t ? v : t;
  t = __builtin_shuffle(v, h1);
  v = v > t ? v : t;
  return v[0];
}

// exp(x) for x <= 0 (softmax numerators once the maximum is out): x = n ln2 + r, |r| <= ln2 / 2,
// Cephes' expf polynomial for e^r, times 2^n written into the exponent; ~1 ulp; x below -87.3 is
// taken as -87.3 (e^x < 1.2e-38 either way).
inline v16 exp16(v16 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const v16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const v16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Part {  // one work item's result: unnormalised sums acc [G, D], the scores' max and the numerators' sum [G]
  float* acc; float* top; float* total;
};

// G query rows q [G, D] over m keys (rows of K and V `kss` / `vss` floats apart): Part's sums.
// score: scratch of G x (m rounded up to 16) floats.
template <int DV>
void attend_part(const float* q, int64_t G, const float* kb, int64_t kss, const float* vb, int64_t vss, int64_t m,
                 float sc, float* score, const Part& out) {
  constexpr int64_t D = DV * 16;
  const int64_t stride = (m + 15) & ~int64_t(15);
  for (int64_t j = 0; j < m; j += 16) {
    const int64_t w = std::min<int64_t>(16, m - j);
    for (int64_t g = 0; g < G; ++g) {
      v16 qg[DV], dots[16];
      for (int c = 0; c < DV; ++c) qg[c] = load16(q + g * D + c * 16);
      for (int t = 0; t < 16; ++t) {
        const float* kr = kb + (j + std::min<int64_t>(t, w - 1)) * kss;  // a short last group repeats its last key
        v16 a = qg[0] * load16(kr);
        for (int c = 1; c < DV; ++c) a += qg[c] * load16(kr + c * 16);
        dots[t] = a;
      }
      const v16 s = fold16(dots) * sc;
      std::memcpy(score + g * stride + j, &s, sizeof(s));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = score + g * stride;
    v16 top = splat(-INFINITY);
    for (int64_t j = 0; j < m; j += 16) {
      const v16 s = load16(sg + j);
      top = lanes_below(m - j) & (s > top) ? s : top;
    }
    const float t = lanes_max(top);
    v16 sum = v16{};
    for (int64_t j = 0; j < m; j += 16) {
      v16 e = exp16(load16(sg + j) - t);
      e = lanes_below(m - j) ? e : v16{};  // past the last key: 0
      std::memcpy(sg + j, &e, sizeof(e));
      sum += e;
    }
    out.top[g] = t;
    out.total[g] = lanes_sum(sum);
  }
  for (int64_t g = 0; g < G; ++g) {
    v16 acc[DV];
    for (int c = 0; c < DV; ++c) acc[c] = v16{};
    const float* pg = score + g * stride;
    for (int64_t j = 0; j < m; ++j) {
      const float* vr = vb + j * vss;
      const v16 p = splat(pg[j]);
      for (int c = 0; c < DV; ++c) acc[c] += p * load16(vr + c * 16);
    }
    std::memcpy(out.acc + g * D, acc, sizeof(acc));
  }
}

// The same for any head dim, a lane at a time.
void attend_part_any(const float* q, int64_t G, int64_t D, const float* kb, int64_t kss, const float* vb,
                     int64_t vss, int64_t m, float sc, float* score, const Part& out) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = score + g * m;
    for (int64_t j = 0; j < m; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * kb[j * kss + d];
      sg[j] = dot * sc;
    }
    const float top = *std::max_element(sg, sg + m);
    float sum = 0.f;
    for (int64_t j = 0; j < m; ++j) sum += (sg[j] = std::exp(sg[j] - top));
    out.top[g] = top;
    out.total[g] = sum;
    float* a = out.acc + g * D;
    std::fill(a, a + D, 0.f);
    for (int64_t j = 0; j < m; ++j)
      for (int64_t d = 0; d < D; ++d) a[d] += sg[j] * vb[j * vss + d];
  }
}

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
  std::vector<int64_t> lo(B), keys(B), first(B + 1, 0);  // per row: first visible key, their count, first item
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 1 && sp[b] >= 0 && sp[b] + np[b] <= slots, "row ", b, "'s keys lie outside the pool");
    lo[b] = window > 0 ? std::min(std::max<int64_t>(pp[b] - window + 1, 0), np[b] - 1) : 0;
    keys[b] = np[b] - lo[b];  // >= 1: the row's own key is always visible
    first[b + 1] = first[b] + H * ((keys[b] + PART - 1) / PART);
  }
  const int64_t items = first[B];
  at::Tensor out = at::empty_like(q);                       // [B, H, G, D]
  at::Tensor work = at::empty({items, G, D + 2}, q.options());  // per item: acc [G, D], top [G], total [G]
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* wp = work.data_ptr<float>();
  const int64_t ksh = k_pool.stride(0), kss = k_pool.stride(1);
  const int64_t vsh = v_pool.stride(0), vss = v_pool.stride(1);
  const float sc = static_cast<float>(scale);
  auto part_of = [&](int64_t it) {
    Part p{wp + it * G * (D + 2), nullptr, nullptr};
    p.top = p.acc + G * D;
    p.total = p.top + G;
    return p;
  };

#pragma omp parallel
  {
    std::vector<float> score(G * PART);  // one item's scores, then its numerators
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      const int64_t parts = (first[b + 1] - first[b]) / H;
      const int64_t h = (it - first[b]) / parts, p = (it - first[b]) % parts;
      const int64_t j0 = lo[b] + p * PART, m = std::min(PART, keys[b] - p * PART);
      const float* qb = qp + (b * H + h) * G * D;
      const float* kb = kp + h * ksh + (sp[b] + j0) * kss;
      const float* vb = vp + h * vsh + (sp[b] + j0) * vss;
      const Part res = part_of(it);
      switch (D) {
        case 16: attend_part<1>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 32: attend_part<2>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 48: attend_part<3>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 64: attend_part<4>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 80: attend_part<5>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 96: attend_part<6>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 112: attend_part<7>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 128: attend_part<8>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        case 256: attend_part<16>(qb, G, kb, kss, vb, vss, m, sc, score.data(), res); break;
        default: attend_part_any(qb, G, D, kb, kss, vb, vss, m, sc, score.data(), res);
      }
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * H; ++i) {  // merge each (row, head)'s parts, in part order
      const int64_t b = i / H, h = i % H;
      const int64_t parts = (first[b + 1] - first[b]) / H, it0 = first[b] + h * parts;
      for (int64_t g = 0; g < G; ++g) {
        float top = -INFINITY, total = 0.f;
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_of(it0 + p).top[g]);
        float* o = op + (i * G + g) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const Part r = part_of(it0 + p);
          const float f = std::exp(r.top[g] - top);
          total += f * r.total[g];
          for (int64_t d = 0; d < D; ++d) o[d] += f * r.acc[g * D + d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
  return out;
}

// selected_attention: a blend's selected rows (sorted positions pos[S]) over the keys before them,
//
//   keys 0 .. N-1 (the blended cache):  | ............................................ |
//   row s (position pos[s]):             sees keys lo(s) .. pos[s]   (lo: the window's first, else 0)
//
// Work items (KV head h, block of SEL_ROWS rows): the block's G x SEL_ROWS query vectors, in register
// tiles (`sel_block`), run over key blocks of SEL_KEYS up to the block's last position (a tile skips
// the key blocks none of its rows sees): scores from keys transposed once per call (kt [H, D, N]),
// an online softmax (running maximum and sum per vector), then the values' weighted sum, every
// tile's sums in registers. One pass, no [S, N] mask; float32, head dim 16 x 1..8.
constexpr int64_t SEL_ROWS = 64;  // positions per work item: 8, 16, 32, 64, 128 measured, 64 best from 100 rows up
constexpr int SEL_KEYS = 64;      // keys per block: 4 16-lane score vectors per query vector

struct SelBlock {  // one work item's query vectors: pre-scaled q [NV, D], positions, window starts
  const float* q; const int64_t* p; const int64_t* lo;
};

// Vectors i0 .. i0+NT of the block over keys k0 .. k0+n_keys-1 (n_keys <= SEL_KEYS): their running
// max m, sum l and sums o [nv, D]. DC: the head dim in 16-lane vectors; kth: kt's row length.
template <int NT, int DC>
inline void sel_tile(const SelBlock& blk, int i0, int64_t k0, int64_t n_keys, const float* kt, int64_t kth,
                     const float* vh, int64_t vss, float* m, float* l, float* o) {
  constexpr int C = SEL_KEYS / 16, D = DC * 16;
  v16 s[NT][C];
  for (int r = 0; r < NT; ++r)
    for (int c = 0; c < C; ++c) s[r][c] = v16{};
  for (int d = 0; d < D; ++d) {  // scores: q . k for NT vectors x SEL_KEYS keys
    const float* kd = kt + d * kth + k0;
    v16 kk[C];
    for (int c = 0; c < C; ++c) kk[c] = load16(kd + c * 16);
    for (int r = 0; r < NT; ++r) {
      const v16 qq = splat(blk.q[(i0 + r) * D + d]);
      for (int c = 0; c < C; ++c) s[r][c] += qq * kk[c];
    }
  }
  alignas(64) float pr[NT][SEL_KEYS];  // the numerators, read back one key at a time
  float alpha[NT];
  // every vector of the tile sees every key of the block (most blocks): no masks. A maximum that did not
  // move rescales by 1 without an exp. Both as the general path computes them, bit for bit.
  const bool whole = n_keys == SEL_KEYS && blk.p[i0] >= k0 + SEL_KEYS - 1 && blk.lo[i0 + NT - 1] <= k0;
  for (int r = 0; r < NT; ++r) {
    const int64_t hi = std::min(blk.p[i0 + r], k0 + n_keys - 1), lo = blk.lo[i0 + r];  // keys lo .. hi visible
    v16 top = splat(-INFINITY);
    vi16 ok[C];
    for (int c = 0; c < C; ++c) {
      if (!whole) {
        const vi16 key = LANES + static_cast<int32_t>(k0 + c * 16);
        ok[c] = (key <= vi16{} + static_cast<int32_t>(hi)) & (key >= vi16{} + static_cast<int32_t>(lo));
        s[r][c] = ok[c] ? s[r][c] : splat(-INFINITY);
      }
      top = s[r][c] > top ? s[r][c] : top;
    }
    const float bm = lanes_max(top);
    const float mn = std::max(m[i0 + r], bm);
    if (mn == -INFINITY) {  // nothing visible yet to this vector
      alpha[r] = 1.f;
      std::memset(pr[r], 0, sizeof(pr[r]));
      continue;
    }
    alpha[r] = m[i0 + r] == mn ? 1.f : m[i0 + r] == -INFINITY ? 0.f : std::exp(m[i0 + r] - mn);
    v16 sum = v16{};
    for (int c = 0; c < C; ++c) {
      const v16 e = whole ? exp16(s[r][c] - mn) : ok[c] ? exp16(s[r][c] - mn) : v16{};
      std::memcpy(pr[r] + c * 16, &e, sizeof(e));
      sum += e;
    }
    m[i0 + r] = mn;
    l[i0 + r] = l[i0 + r] * alpha[r] + lanes_sum(sum);
  }
  v16 acc[NT][DC];
  for (int r = 0; r < NT; ++r)
    for (int c = 0; c < DC; ++c) acc[r][c] = load16(o + (i0 + r) * D + c * 16) * alpha[r];
  for (int64_t j = 0; j < n_keys; ++j) {  // sums += p . v
    const float* vr = vh + (k0 + j) * vss;
    v16 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = load16(vr + c * 16);
    for (int r = 0; r < NT; ++r) {
      const v16 pp = splat(pr[r][j]);
      for (int c = 0; c < DC; ++c) acc[r][c] += pp * vv[c];
    }
  }
  for (int r = 0; r < NT; ++r) std::memcpy(o + (i0 + r) * D, acc[r], sizeof(acc[r]));
}

// Every tile of one work item's nv vectors over one key block: tiles of TILE vectors (TILE x DC
// accumulators in registers), the last one shorter; a tile that sees none of the keys is skipped.
template <int TILE, int DC>
void sel_block(const SelBlock& blk, int nv, int64_t k0, int64_t n_keys, const float* kt, int64_t kth,
               const float* vh, int64_t vss, float* m, float* l, float* o) {
  for (int i0 = 0; i0 < nv; i0 += TILE) {
    const int nt = std::min(TILE, nv - i0);
    if (blk.p[i0 + nt - 1] < k0 || blk.lo[i0] > k0 + n_keys - 1) continue;
    if (nt == TILE) {
      sel_tile<TILE, DC>(blk, i0, k0, n_keys, kt, kth, vh, vss, m, l, o);
    } else {
      for (int i = i0; i < nv; ++i) sel_tile<1, DC>(blk, i, k0, n_keys, kt, kth, vh, vss, m, l, o);
    }
  }
}

at::Tensor selected_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& pos_in, int64_t window, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [Hq, S, D], k and v [H, N, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "selected attention takes float32 only");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor pos = pos_in.to(at::kLong).contiguous();
  const int64_t Hq = q.size(0), S = q.size(1), D = q.size(2), H = k.size(0), N = k.size(1);
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 128, "selected attention takes a head dim of 16 x 1..8");
  TORCH_CHECK(k.size(2) == D && v.size(2) == D && k.stride(2) == 1 && v.stride(2) == 1 && v.size(1) == N,
              "k and v must be [H, N, D] with D contiguous");
  TORCH_CHECK(H > 0 && Hq % H == 0 && v.size(0) == H && pos.numel() == S && S > 0, "q, k, v and pos disagree");
  const int64_t G = Hq / H;
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(pp[s] >= 0 && pp[s] < N && (s == 0 || pp[s] > pp[s - 1]),
                "positions must be sorted, distinct and within the keys");
  }
  const int64_t kth = (pp[S - 1] + SEL_KEYS) / SEL_KEYS * SEL_KEYS;  // keys 0 .. pos[S-1], rounded up
  at::Tensor kt = at::empty({H, D, kth}, q.options());  // [H, D, kth]: the keys transposed, zeros past the last
  const float* kp = k.data_ptr<float>();
  const int64_t ksh = k.stride(0), kss = k.stride(1);
  at::Tensor out = at::empty({S, Hq * D}, q.options());  // [S, Hq*D]
  const float* qp = q.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (S + SEL_ROWS - 1) / SEL_ROWS, vsh = v.stride(0), vss = v.stride(1);
  const float sc = static_cast<float>(scale);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < H * (kth / SEL_KEYS); ++t) {  // transpose: block t of SEL_KEYS keys of head h
      const int64_t h = t / (kth / SEL_KEYS), k0 = t % (kth / SEL_KEYS) * SEL_KEYS;
      const float* src = kp + h * ksh + k0 * kss;  // SEL_KEYS rows of D: read from L1, written a line at a time
      const int64_t n = std::min<int64_t>(SEL_KEYS, N - k0);
      for (int64_t d = 0; d < D; ++d) {
        float* dst = ktp + (h * D + d) * kth + k0;
        for (int64_t j = 0; j < n; ++j) dst[j] = src[j * kss + d];
        for (int64_t j = n; j < SEL_KEYS; ++j) dst[j] = 0.f;
      }
    }
    const int64_t nv_max = G * SEL_ROWS;
    std::vector<float> qb(nv_max * D), o(nv_max * D), m(nv_max), l(nv_max);
    std::vector<int64_t> p(nv_max), lo(nv_max);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < H * blocks; ++it) {
      const int64_t h = it % H, b = blocks - 1 - it / H;  // the last rows first: they see the most keys
      const int64_t s0 = b * SEL_ROWS, rows = std::min(SEL_ROWS, S - s0);
      const int nv = static_cast<int>(rows * G);
      for (int64_t r = 0; r < rows; ++r) {  // vector i = r * G + g: query head h * G + g at row s0 + r
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = r * G + g;
          const float* src = qp + ((h * G + g) * S + s0 + r) * D;
          for (int64_t d = 0; d < D; ++d) qb[i * D + d] = src[d] * sc;
          p[i] = pp[s0 + r];
          lo[i] = window > 0 ? std::max<int64_t>(pp[s0 + r] - window + 1, 0) : 0;
        }
      }
      std::fill(o.begin(), o.begin() + nv * D, 0.f);
      std::fill(m.begin(), m.begin() + nv, -INFINITY);
      std::fill(l.begin(), l.begin() + nv, 0.f);
      const SelBlock blk{qb.data(), p.data(), lo.data()};
      const float* kh = ktp + h * D * kth;
      const float* vh = vp + h * vsh;
      const int64_t last = p[nv - 1];
      for (int64_t k0 = lo[0] / SEL_KEYS * SEL_KEYS; k0 <= last; k0 += SEL_KEYS) {
        const int64_t n_keys = std::min<int64_t>(SEL_KEYS, last + 1 - k0);  // no vector sees a key past `last`
        float *mp = m.data(), *lp = l.data(), *opp = o.data();
        switch (D / 16) {  // tiles: SEL_KEYS / 16 score and D / 16 sum vectors per query vector, <= 24 in registers
          case 1: sel_block<6, 1>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          case 2: sel_block<6, 2>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          case 3: sel_block<6, 3>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          case 4: sel_block<6, 4>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          case 5: sel_block<4, 5>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          case 6: sel_block<4, 6>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          case 7: sel_block<3, 7>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp); break;
          default: sel_block<3, 8>(blk, nv, k0, n_keys, kh, kth, vh, vss, mp, lp, opp);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = r * G + g;
          const float inv = 1.f / l[i];
          float* dst = op + (s0 + r) * Hq * D + (h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = o[i * D + d] * inv;
        }
      }
    }
  }
  return out;
}

// packed_linear: rows_linear over a weight kept in the block code it was de-quantized from
// (`blend_engine/model/packed.py`), expanded to float32 in registers 16 lanes at a time:
//
//   "a4": w = d * q + m, q in 0..15: codes [out, in/2] uint8, per 32-block byte j = q[j] | q[j+16] << 4
//   "s8": w = d * q,     q in -128..127: codes [out, in] int8
//   d, m: [out, in/32] float32, one per block of 32 inputs
//
// d * q is exact in float32 (the packer checks every weight), so the expanded w equals the float32
// weight bit for bit, and the tiles run rows_linear's products in its order: the same result from
// 1/5 (a4) or 1/3.5 (s8) of the weight bytes. Under EXPAND_FROM rows each tile expands the codes
// in registers; from it each weight block is expanded once into a buffer that rows_linear's tiles
// read (measured on SmolLM2's 210 projections, 2 cores: 1 row 6.4 / 8.2 ms, 9 rows 21.8 / 20.5).

// Block codes to float32 lanes: AVX-512 where the build machine has it (one widening load, one
// convert and one FMA per 16 weights), else the same arithmetic a lane at a time.
#if defined(__AVX512F__)
inline v16 nibbles(__m512i x, int shift, float d, float m) {  // lanes (x >> shift) & 15 as d * q + m
  const __m512i q = _mm512_and_si512(_mm512_srli_epi32(x, shift), _mm512_set1_epi32(15));
  return (v16)_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d), _mm512_set1_ps(m));
}
inline v16 bytes_s8(const int8_t* p, float d) {  // 16 signed bytes as d * q
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (v16)_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d));
}
#endif

// Weight sources: NT rows from row n0 of a weight, as 16-lane float32 chunks; `expand(b, blk, lo, hi)`
// gives row n0+b's inputs blk*32 .. +15 and +16 .. +31. Float32 weights take any in_features (`ANY_K`:
// a last 16-wide chunk and a scalar tail); codes need a multiple of 32 (checked by packed_linear).
struct F32 {
  static constexpr bool ANY_K = true;
  const float* W; int64_t K;  // W: row n0
  F32 at(int64_t n0) const { return {W + n0 * K, K}; }
  inline const float* row(int b) const { return W + b * K; }
  inline void expand(int b, int64_t blk, v16& lo, v16& hi) const {
    lo = load16(row(b) + blk * 32);
    hi = load16(row(b) + blk * 32 + 16);
  }
};

struct A4 {
  static constexpr bool ANY_K = false;
  const uint8_t* codes; const float* d; const float* m; int64_t K;
  A4 at(int64_t n0) const { return {codes + n0 * (K / 2), d + n0 * (K / 32), m + n0 * (K / 32), K}; }
  inline void expand(int b, int64_t blk, v16& lo, v16& hi) const {
    const uint8_t* p = codes + b * (K / 2) + blk * 16;
    const float dd = d[b * (K / 32) + blk], mm = m[b * (K / 32) + blk];
#if defined(__AVX512F__)
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = nibbles(x, 0, dd, mm);
    hi = nibbles(x, 4, dd, mm);
#else
    for (int j = 0; j < 16; ++j) {
      lo[j] = dd * static_cast<float>(p[j] & 15) + mm;
      hi[j] = dd * static_cast<float>(p[j] >> 4) + mm;
    }
#endif
  }
};

struct S8 {
  static constexpr bool ANY_K = false;
  const int8_t* codes; const float* d; int64_t K;
  S8 at(int64_t n0) const { return {codes + n0 * K, d + n0 * (K / 32), K}; }
  inline void expand(int b, int64_t blk, v16& lo, v16& hi) const {
    const int8_t* p = codes + b * K + blk * 32;
    const float dd = d[b * (K / 32) + blk];
#if defined(__AVX512F__)
    lo = bytes_s8(p, dd);
    hi = bytes_s8(p + 16, dd);
#else
    for (int j = 0; j < 16; ++j) {
      lo[j] = dd * static_cast<float>(p[j]);
      hi[j] = dd * static_cast<float>(p[j + 16]);
    }
#endif
  }
};

// Y[m0 .. m0+MT, n0 .. n0+NT] = X[m0 .., :] . W[n0 .., :] (+ bias), W from `src` (at row n0): MT x NT
// accumulators in registers, each summing 16-wide products in input order, then its lanes.
template <int MT, int NT, class Src>
inline void tile(const float* X, const Src& src, const float* bias, float* Y, int64_t K, int64_t N,
                 int64_t m0, int64_t n0) {
  v16 acc[MT][NT];
#pragma GCC unroll 8
  for (int a = 0; a < MT; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < NT; ++b) acc[a][b] = v16{};
  for (int64_t blk = 0; blk < K / 32; ++blk) {
    v16 w[2][NT];
#pragma GCC unroll 4
    for (int b = 0; b < NT; ++b) src.expand(b, blk, w[0][b], w[1][b]);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
#pragma GCC unroll 8
      for (int a = 0; a < MT; ++a) {
        v16 x = load16(X + (m0 + a) * K + blk * 32 + c * 16);
        __asm__("" : "+v"(x));  // keep x in a register: loaded once for its NT products, not folded into each
#pragma GCC unroll 4
        for (int b = 0; b < NT; ++b) acc[a][b] += x * w[c][b];
      }
    }
  }
  int64_t k = K & ~int64_t(31);
  if constexpr (Src::ANY_K) {
    if (K - k >= 16) {
      for (int a = 0; a < MT; ++a) {
        const v16 x = load16(X + (m0 + a) * K + k);
        for (int b = 0; b < NT; ++b) acc[a][b] += x * load16(src.row(b) + k);
      }
      k += 16;
    }
  }
  for (int a = 0; a < MT; ++a) {
    for (int b = 0; b < NT; ++b) {
      float s = lanes_sum(acc[a][b]);
      if constexpr (Src::ANY_K) {
        for (int64_t j = k; j < K; ++j) s += X[(m0 + a) * K + j] * src.row(b)[j];
      }
      Y[(m0 + a) * N + n0 + b] = bias ? s + bias[n0 + b] : s;
    }
  }
}

// Every row of X against weight rows n0 .. n0+NT (`src` at n0): tiles of 8, 4, 2 and 1 rows.
template <int NT, class Src>
inline void column_block(const float* X, const Src& src, const float* bias, float* Y, int64_t M, int64_t K,
                         int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile<8, NT>(X, src, bias, Y, K, N, m, n0);
  if (M - m >= 4) { tile<4, NT>(X, src, bias, Y, K, N, m, n0); m += 4; }
  if (M - m >= 2) { tile<2, NT>(X, src, bias, Y, K, N, m, n0); m += 2; }
  if (M - m >= 1) tile<1, NT>(X, src, bias, Y, K, N, m, n0);
}

constexpr int NT = 3;  // weight rows per block: 8 x 3 accumulators + 2 x 3 weights + x in 32 registers

// Every column block of Y, spread over the calling thread's OpenMP team.
template <class Src>
void run_blocks(const float* X, const Src& src, const float* bias, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / NT;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < blocks; ++i) column_block<NT>(X, src.at(i * NT), bias, Y, M, K, N, i * NT);
  for (int64_t n = blocks * NT; n < N; ++n) column_block<1>(X, src.at(n), bias, Y, M, K, N, n);
}

// The optional bias as a contiguous float32 [N] (undefined when not given).
at::Tensor checked_bias(const c10::optional<at::Tensor>& bias_in, int64_t N) {
  if (!bias_in.has_value() || !bias_in->defined()) return at::Tensor();
  at::Tensor bias = bias_in->contiguous();
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N, "the bias must be float32 [out]");
  return bias;
}

at::Tensor rows_linear(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2, "rows_linear takes x [T, in] and a weight [out, in]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rows_linear takes float32 only");
  TORCH_CHECK(x_in.size(1) == weight.size(1), "x and the weight disagree on in_features");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor bias = checked_bias(bias_in, N);
  at::Tensor y = at::empty({M, N}, x.options());  // [T, out]
  const float* B = bias.defined() ? bias.data_ptr<float>() : nullptr;
  run_blocks(x.data_ptr<float>(), F32{w.data_ptr<float>(), K}, B, y.data_ptr<float>(), M, K, N);
  return y;
}

// The NT weight rows of `src` (at n0) as float32 [NT, K] in `rows`.
template <int NT, class Code>
inline void expand_rows(const Code& src, int64_t K, float* rows) {
  for (int b = 0; b < NT; ++b) {
    for (int64_t blk = 0; blk < K / 32; ++blk) {
      v16 lo, hi;
      src.expand(b, blk, lo, hi);
      std::memcpy(rows + b * K + blk * 32, &lo, sizeof(lo));
      std::memcpy(rows + b * K + blk * 32 + 16, &hi, sizeof(hi));
    }
  }
}

constexpr int64_t EXPAND_FROM = 9;  // rows from which codes are expanded once per weight block (measured)

// Few rows: each tile expands the codes in registers. More: each thread expands a block of NT weight
// rows once into an L1-sized buffer and runs the float32 tiles over it (a weight block is read by
// M / 8 tiles; expanding it in each would cost more than the products).
template <class Code>
void packed_run(const float* X, const Code& code, const float* bias, float* Y, int64_t M, int64_t K, int64_t N) {
  if (M < EXPAND_FROM) {
    run_blocks(X, code, bias, Y, M, K, N);
    return;
  }
  const int64_t blocks = N / NT;
#pragma omp parallel
  {
    std::vector<float> rows(NT * K);  // [NT, K]
#pragma omp for schedule(static)
    for (int64_t i = 0; i < blocks; ++i) {
      expand_rows<NT>(code.at(i * NT), K, rows.data());
      column_block<NT>(X, F32{rows.data(), K}, bias, Y, M, K, N, i * NT);
    }
  }
  std::vector<float> row(K);
  for (int64_t n = blocks * NT; n < N; ++n) {
    expand_rows<1>(code.at(n), K, row.data());
    column_block<1>(X, F32{row.data(), K}, bias, Y, M, K, N, n);
  }
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& d,
                         const c10::optional<at::Tensor>& m, const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "packed_linear takes x [T, in] float32");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && d.dim() == 2 && d.is_contiguous() &&
                  d.scalar_type() == at::kFloat, "codes [out, *] and d [out, in/32] float32, contiguous");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && d.size(0) == N && d.size(1) == K / 32, "in must be a multiple of 32, d [out, in/32]");
  const at::Tensor bias = checked_bias(bias_in, N);
  at::Tensor y = at::empty({M, N}, x.options());  // [T, out]
  const float* B = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (m.has_value() && m->defined()) {  // a4
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == K / 2, "a4 codes must be uint8 [out, in/2]");
    TORCH_CHECK(m->is_contiguous() && m->scalar_type() == at::kFloat && m->sizes() == d.sizes(), "m must be like d");
    const A4 code{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m->data_ptr<float>(), K};
    packed_run(x.data_ptr<float>(), code, B, y.data_ptr<float>(), M, K, N);
  } else {  // s8
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(1) == K, "s8 codes must be int8 [out, in]");
    const S8 code{codes.data_ptr<int8_t>(), d.data_ptr<float>(), K};
    packed_run(x.data_ptr<float>(), code, B, y.data_ptr<float>(), M, K, N);
  }
  return y;
}

// place_rotated: one layer of cached chunks written into a request's cache at their places in the
// prompt (executor/placement.py), the keys moved by RoPE on the way, in one pass:
//
//   k, v [H, Tc, D]: the chunks' layer as cached (at positions 0..t-1 each), float32, contiguous
//   K, V [H, C, D]:  the cache (a pool run's views: any strides over H and C, D contiguous)
//   K[h, dst[t]] = k[h, t] * cos[t] + rotate_half(k[h, t]) * sin[t],  V[h, dst[t]] = v[h, t]
//
// rotate_half(x) = (-x[D/2:], x[:D/2]), as `ModelRunner.apply_rotation`; each product rounded on its
// own, then the sum (no fused multiply-add), so the keys equal torch's `k * cos + rotate_half(k) * sin`
// bit for bit. Without cos (undefined) the keys are copied as they are (prefix-cache entries).
__attribute__((optimize("fp-contract=off")))
void place_row(float* out, const float* x, const float* c, const float* s, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = x[j] * c[j], b = x[j + h] * s[j];
    out[j] = a - b;
  }
  for (int64_t j = h; j < D; ++j) {
    const float a = x[j] * c[j], b = x[j - h] * s[j];
    out[j] = a + b;
  }
}

void place_rotated(const at::Tensor& K, const at::Tensor& V, const at::Tensor& k, const at::Tensor& v,
                   const c10::optional<at::Tensor>& cos_in, const c10::optional<at::Tensor>& sin_in,
                   const at::Tensor& dst_in) {
  TORCH_CHECK(K.dim() == 3 && V.dim() == 3 && k.dim() == 3 && v.dim() == 3, "K, V [H, C, D] and k, v [H, Tc, D]");
  TORCH_CHECK(K.scalar_type() == at::kFloat && V.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "place_rotated takes float32 only");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(), "k and v: contiguous [H, Tc, D]");
  const int64_t H = k.size(0), Tc = k.size(1), D = k.size(2), C = K.size(1);
  TORCH_CHECK(K.size(0) == H && V.size(0) == H && K.size(2) == D && V.size(2) == D && V.size(1) == C &&
                  K.stride(2) == 1 && V.stride(2) == 1, "K and V must be [H, C, D] with D contiguous, like k");
  const bool rotate = cos_in.has_value() && cos_in->defined();
  at::Tensor cs, sn;
  if (rotate) {
    TORCH_CHECK(sin_in.has_value() && sin_in->defined(), "cos without sin");
    cs = cos_in->contiguous();
    sn = sin_in->contiguous();
    TORCH_CHECK(cs.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat && cs.dim() == 2 &&
                    cs.size(0) == Tc && cs.size(1) == D && sn.sizes() == cs.sizes() && D % 2 == 0,
                "cos and sin must be float32 [Tc, D], D even");
  }
  const at::Tensor dst = dst_in.to(at::kLong).contiguous();
  TORCH_CHECK(dst.numel() == Tc, "one destination slot per cached token");
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t t = 0; t < Tc; ++t) TORCH_CHECK(dp[t] >= 0 && dp[t] < C, "a destination slot outside the cache");
  float* Kp = K.data_ptr<float>();
  float* Vp = V.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = rotate ? cs.data_ptr<float>() : nullptr;
  const float* sp = rotate ? sn.data_ptr<float>() : nullptr;
  const int64_t Ksh = K.stride(0), Kss = K.stride(1), Vsh = V.stride(0), Vss = V.stride(1);
#pragma omp parallel for schedule(static) if (H * Tc * D >= (1 << 16))
  for (int64_t r = 0; r < H * Tc; ++r) {  // row r: head r / Tc, cached token r % Tc
    const int64_t h = r / Tc, t = r % Tc;
    float* ko = Kp + h * Ksh + dp[t] * Kss;
    const float* ki = kp + r * D;
    if (rotate) {
      place_row(ko, ki, cp + t * D, sp + t * D, D);
    } else {
      std::memcpy(ko, ki, D * sizeof(float));
    }
    std::memcpy(Vp + h * Vsh + dp[t] * Vss, vp + r * D, D * sizeof(float));
  }
}

// rope: fresh queries or keys x [H, T, D] (any strides over H and T, D contiguous) rotated to their
// positions by the tables cos, sin [T, D]: x * cos + rotate_half(x) * sin, each product rounded on its
// own (`place_row`), so equal to torch's three ops bit for bit. The result is laid out as torch lays
// out that expression over qkv's [T, H, D]-major views: [T, H, D] memory, returned as [H, T, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "rope takes x [H, T, D] float32, D contiguous");
  const int64_t H = x.size(0), T = x.size(1), D = x.size(2);
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  TORCH_CHECK(cs.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat && cs.dim() == 2 && cs.size(0) == T &&
                  cs.size(1) == D && sn.sizes() == cs.sizes() && D % 2 == 0, "cos and sin must be float32 [T, D], D even");
  at::Tensor out = at::empty({T, H, D}, x.options());  // [T, H, D]
  const float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xsh = x.stride(0), xst = x.stride(1);
#pragma omp parallel for schedule(static) if (H * T * D >= (1 << 16))
  for (int64_t r = 0; r < T * H; ++r) {  // row r: position r / H, head r % H
    const int64_t t = r / H, h = r % H;
    place_row(op + r * D, xp + h * xsh + t * xst, cp + t * D, sp + t * D, D);
  }
  return out.transpose(0, 1);  // [H, T, D]
}

// rms_norm: the RMSNorm of the supported families (Llama, Mistral, Qwen2, Qwen3), one pass a row:
//   out[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)),  x [R, E] (any leading dims), w [E], float32
// where torch runs six ops a call (pow, mean, add, rsqrt, two muls), each over every row. A row's
// result depends on that row alone (the same sum order for any number of rows).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "rms_norm takes float32 only");
  TORCH_CHECK(x_in.dim() >= 1 && w_in.dim() == 1 && x_in.size(-1) == w_in.size(0) && w_in.size(0) > 0,
              "rms_norm takes x [..., E] and a weight [E]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t E = w.size(0), R = x.numel() / E, E16 = E / 16 * 16;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
#pragma omp parallel for schedule(static) if (R * E >= (1 << 16))
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = xp + r * E;
    float* orow = op + r * E;
    v16 acc{};
    for (int64_t j = 0; j < E16; j += 16) {
      const v16 a = load16(xr + j);
      acc += a * a;
    }
    float sum = lanes_sum(acc);
    for (int64_t j = E16; j < E; ++j) sum += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(E) + e);
    for (int64_t j = 0; j < E16; j += 16) {
      const v16 y = load16(wp + j) * (load16(xr + j) * inv);
      std::memcpy(orow + j, &y, sizeof(y));
    }
    for (int64_t j = E16; j < E; ++j) orow[j] = wp[j] * (xr[j] * inv);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(blendserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor start, Tensor n, Tensor pos, "
        "int window, float scale) -> Tensor");
  m.def("selected_attention(Tensor q, Tensor k, Tensor v, Tensor pos, int window, float scale) -> Tensor");
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor codes, Tensor d, Tensor? m, Tensor? bias) -> Tensor");
  m.def("place_rotated(Tensor(a!) K, Tensor(b!) V, Tensor k, Tensor v, Tensor? cos, Tensor? sin, Tensor dst) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(blendserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("selected_attention", &selected_attention);
  m.impl("rows_linear", &rows_linear);
  m.impl("packed_linear", &packed_linear);
  m.impl("place_rotated", &place_rotated);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
}
