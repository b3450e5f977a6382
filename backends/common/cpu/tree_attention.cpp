// Tree attention on the CPU in one pass over the tree: the "cpu" impl's compiled kernel (when it runs:
// backends/attention/cpu_kernel.py; the build: backends/common/cpu/__init__.py).
//
// The tree (docs/ARCHITECTURE.md §4): N packed tokens in depth-first preorder; segments (start, stop, subtree_end)
// are the maximal single-child chains; query q sees key k  <=>  k <= q < end[k] and valid[k]. For a query in
// segment s, that is: every key of every strict ancestor segment of s (invalid keys aside), and the keys of s up
// to q itself. So a query block inside one segment attends its ancestors' segments whole and its own segment
// causally, and a key block inside segment t is seen by the queries of t after it (causally) and by every query
// of t's descendants [stop, subtree_end) whole. Nothing else is ever computed: no padding, no other branch.
//
// Cached (a streamed chunk against a cached prefix's K/V, backends/attention/cached.py): the chunk's queries also see
// the cache keys of the cross rows (q_start, q_stop, k_start, k_stop) holding them, whole, invalid cache keys aside.
// Forward: those ranges come first in a query block's online softmax (blocks never straddle a row's query bound);
// backward: the cache's keys are key blocks too (never straddling a row's key bound), each seen by the query ranges
// of the rows holding it, so one call gives (out, lse) merged over both parts and (dq, dk, dv, dk_cache, dv_cache).
// The plain ops are the cached ones with an empty cache.
//
// Forward (per kv head and query block, the block's g query heads stacked): online softmax over the key ranges
//     s = scale q.k,  m' = max(m, max_k s),  l' = l e^(m - m') + sum_k e^(s - m'),  acc' = acc e^(m - m') + sum_k e^(s - m') v
//     out = acc / l,  lse = m + log l           (a query that sees no key: out = 0, lse = -inf)
// Backward (per kv head and key block; flash-attention-2's schedule), with delta = rowsum(dout * out):
//     p = e^(s - lse),  dv += p^T dout,  dp = dout v^T,  ds = p (dp - delta),  dk += scale ds^T q,  dq += scale ds k
// dq rows are summed by several key blocks: each worker adds into its own buffer, summed at the end in a fixed
// order, and the work is split into per-worker lists by a deterministic greedy balance, so results do not depend
// on thread timing. Matrix products: BLAS sgemm/dgemm (the one torch links; MKL at one thread inside our workers).
// Row passes: at::vec.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
// MKL (torch's BLAS on x86): one thread per call inside our own parallel loops (weak: absent with other BLAS)
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));  // the C interface (lowercase: Fortran)
}

namespace {

constexpr int64_t BQ = 64;   // queries per block, per head
constexpr int64_t BK = 64;   // keys per block (backward)
constexpr int64_t KC = 256;  // keys per chunk (forward)
constexpr int64_t DQ_BUFFER_BYTES = int64_t(256) << 20;  // the backward's extra dq buffers, at most

// Column-major BLAS, as the Fortran interface takes it (a row-major [r, c] matrix is a column-major [c, r] one).
inline void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}
inline void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                 const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
  dgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}

// S [M, n] (row-major, ld n) = A [M, D] (ld lda) . B [n, D]^T (ld ldb)
template <typename T>
inline void mm_abt(int64_t M, int64_t n, int64_t D, const T* A, int64_t lda, const T* B, int64_t ldb, T* S) {
  gemm('T', 'N', n, M, D, T(1), B, ldb, A, lda, T(0), S, n);
}
// C [M, D] (ld ldc) = alpha P [M, n] (ld n) . B [n, D] (ld ldb) + beta C
template <typename T>
inline void mm_ab(int64_t M, int64_t n, int64_t D, T alpha, const T* P, const T* B, int64_t ldb, T beta, T* C,
                  int64_t ldc) {
  gemm('N', 'N', D, M, n, alpha, B, ldb, P, n, beta, C, ldc);
}
// C [n, D] (ld D) += P [M, n]^T (ld n) . A [M, D] (ld lda)
template <typename T>
inline void mm_atb_acc(int64_t M, int64_t n, int64_t D, const T* P, const T* A, int64_t lda, T* C) {
  gemm('N', 'T', D, n, M, T(1), A, lda, P, n, T(1), C, D);
}

// The segments of the tree, each segment's parent segment, and which keys are invalid.
struct Tree {
  at::Tensor valid_t;
  const bool* valid = nullptr;
  std::vector<int64_t> start, stop, sub_end, parent;
  std::vector<char> all_valid;
};

// The segments must partition [0, N) into chains agreeing with end[] (what the tree builder makes): checked, so
// that no range read below leaves the tensors.
Tree make_tree(const at::Tensor& end, const at::Tensor& valid, const at::Tensor& segments) {
  Tree t;
  const at::Tensor end_c = end.contiguous();
  const int64_t* endp = end_c.data_ptr<int64_t>();
  const int64_t N = end_c.size(0);
  t.valid_t = valid.contiguous();
  t.valid = t.valid_t.data_ptr<bool>();
  auto segc = segments.contiguous();
  const int64_t S = segc.size(0);
  const int64_t* seg = segc.data_ptr<int64_t>();
  t.start.resize(S); t.stop.resize(S); t.sub_end.resize(S); t.parent.resize(S); t.all_valid.resize(S);
  std::vector<int64_t> open;  // segments whose subtree contains the current one, outermost first
  for (int64_t s = 0; s < S; ++s) {
    t.start[s] = seg[3 * s]; t.stop[s] = seg[3 * s + 1]; t.sub_end[s] = seg[3 * s + 2];
    TORCH_CHECK(t.start[s] == (s == 0 ? 0 : t.stop[s - 1]) && t.start[s] < t.stop[s] && t.stop[s] <= t.sub_end[s] &&
                    t.sub_end[s] <= N && (s + 1 < S || t.stop[s] == N),
                "tree attention kernel: segments do not partition [0, ", N, ") into chains (start, stop, subtree_end): "
                "segment ", s, " is (", t.start[s], ", ", t.stop[s], ", ", t.sub_end[s], ")");
    for (int64_t k = t.start[s]; k < t.stop[s]; ++k)
      TORCH_CHECK(endp[k] == t.sub_end[s], "tree attention kernel: end[] disagrees with segments: token ", k,
                  " has end ", endp[k], " but its segment ends its subtree at ", t.sub_end[s]);
    while (!open.empty() && t.sub_end[open.back()] <= t.start[s]) open.pop_back();
    t.parent[s] = open.empty() ? -1 : open.back();
    open.push_back(s);
    bool all = true;
    for (int64_t k = t.start[s]; k < t.stop[s] && all; ++k) all = t.valid[k];
    t.all_valid[s] = all;
  }
  return t;
}

// A unit of work: a block [a, b) of one segment (seg < 0: of the cache's keys, backward), for one kv head; cost:
// the pairs it computes (for balancing).
struct Unit {
  int64_t head, seg, a, b, cost;
};

// The units split into `workers` lists by the greedy longest-first rule: each unit, costliest first (ties in
// their order), goes to the least loaded list (ties: the first). Deterministic: the same lists on every call.
std::vector<std::vector<Unit>> balance(std::vector<Unit> units, int64_t workers) {
  std::vector<size_t> order(units.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return units[x].cost > units[y].cost; });
  std::vector<std::vector<Unit>> lists(workers);
  std::vector<int64_t> load(workers, 0);
  for (size_t i : order) {
    int64_t w = std::min_element(load.begin(), load.end()) - load.begin();
    lists[w].push_back(units[i]);
    load[w] += units[i].cost;
  }
  return lists;
}

// Runs f(list) for each list, one per worker thread; BLAS calls inside run on the calling thread alone.
template <typename F>
void run_lists(const std::vector<std::vector<Unit>>& lists, const F& f) {
  at::parallel_for(0, (int64_t)lists.size(), 1, [&](int64_t begin, int64_t end) {
    const int before = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
    for (int64_t w = begin; w < end; ++w) f(w, lists[w]);
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(before);
  });
}

int64_t workers_for(int64_t units) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units)); }

// The cached prefix a streamed chunk's queries also see (backends/attention/cached.py): K/V [Hkv, P, D] with valid
// bits, through the cross rows (q_start, q_stop, k_start, k_stop): chunk queries [q_start, q_stop) see cache keys
// [k_start, k_stop) whole (non-causal). Empty rows are dropped. A plain call has none.
struct Cache {
  at::Tensor valid_t;
  const bool* valid = nullptr;
  int64_t P = 0;
  std::vector<int64_t> q0, q1, k0, k1;
  std::vector<int64_t> valid_before;  // [P + 1]: valid keys before each
  std::vector<int64_t> qcuts, kcuts;  // every row's query (key) bounds, sorted, unique
  int64_t rows() const { return (int64_t)q0.size(); }
  bool holes(int64_t a, int64_t b) const { return valid_before[b] - valid_before[a] != b - a; }
  // rows whose query range holds [a, b) (blocks never straddle a bound: qcuts)
  bool sees(int64_t r, int64_t a, int64_t b) const { return q0[r] <= a && b <= q1[r]; }
  // rows whose key range holds [a, b) (blocks never straddle a bound: kcuts)
  bool seen(int64_t r, int64_t a, int64_t b) const { return k0[r] <= a && b <= k1[r]; }
};

std::vector<int64_t> sorted_unique(std::vector<int64_t> x) {
  std::sort(x.begin(), x.end());
  x.erase(std::unique(x.begin(), x.end()), x.end());
  return x;
}

Cache make_cache(const at::Tensor& cache_valid, const at::Tensor& cross, int64_t N) {
  Cache c;
  c.valid_t = cache_valid.contiguous();
  c.valid = c.valid_t.data_ptr<bool>();
  c.P = c.valid_t.size(0);
  c.valid_before.assign(c.P + 1, 0);
  for (int64_t i = 0; i < c.P; ++i) c.valid_before[i + 1] = c.valid_before[i] + (c.valid[i] ? 1 : 0);
  const at::Tensor x = cross.contiguous();
  const int64_t* xp = x.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) {
    const int64_t a = xp[4 * r], b = xp[4 * r + 1], ka = xp[4 * r + 2], kb = xp[4 * r + 3];
    if (b <= a || kb <= ka) continue;
    TORCH_CHECK(a >= 0 && b <= N && ka >= 0 && kb <= c.P, "tree attention kernel: cross row ", r, " (", a, ", ", b,
                ", ", ka, ", ", kb, ") leaves the chunk's ", N, " queries or the cache's ", c.P, " keys");
    c.q0.push_back(a); c.q1.push_back(b); c.k0.push_back(ka); c.k1.push_back(kb);
  }
  std::vector<int64_t> qc(c.q0), kc(c.k0);
  qc.insert(qc.end(), c.q1.begin(), c.q1.end());
  kc.insert(kc.end(), c.k1.begin(), c.k1.end());
  c.qcuts = sorted_unique(qc);
  c.kcuts = sorted_unique(kc);
  return c;
}

// The end of the block of at most `width` starting at a, before `stop` and before the next cut after a.
int64_t block_end(int64_t a, int64_t stop, int64_t width, const std::vector<int64_t>& cuts) {
  auto next = std::upper_bound(cuts.begin(), cuts.end(), a);
  return std::min({stop, a + width, next == cuts.end() ? stop : *next});
}

// A key range a query block attends: keys [k0, k1) of the chunk or of the cache, the block's own segment (causal)
// or not, with invalid keys or not.
struct Range {
  int64_t k0, k1;
  bool own, cache, holes;
};

// The key ranges of a query block [a, b) of segment `seg`: the cache ranges of the cross rows holding it (in row
// order), its strict ancestors (root first), then itself up to b (the last range: causal).
void block_ranges(const Tree& t, const Cache& c, int64_t seg, int64_t a, int64_t b, std::vector<Range>& out) {
  out.clear();
  for (int64_t r = 0; r < c.rows(); ++r)
    if (c.sees(r, a, b)) out.push_back({c.k0[r], c.k1[r], false, true, c.holes(c.k0[r], c.k1[r])});
  const size_t first = out.size();
  for (int64_t p = t.parent[seg]; p >= 0; p = t.parent[p])
    out.push_back({t.start[p], t.stop[p], false, false, !t.all_valid[p]});
  std::reverse(out.begin() + first, out.end());
  out.push_back({t.start[seg], b, true, false, !t.all_valid[seg]});
}

template <typename T>
using Vec = at::vec::Vectorized<T>;

template <typename T>
T row_max(const T* s, int64_t n) {
  return at::vec::reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return at::vec::maximum(a, b); }, s, n);
}

// s[c] = exp(s[c] - m) for c < n; returns the sum. exp_u20: at::vec's fast exp for float (within 20 ulp, as torch's
// CPU flash kernel uses it), Sleef's exp for double.
template <typename T>
T exp_sum(T* s, int64_t n, T m) {
  int64_t c = 0;
  Vec<T> acc(T(0)), vm(m);
  for (; c + Vec<T>::size() <= n; c += Vec<T>::size()) {
    Vec<T> x = (Vec<T>::loadu(s + c) - vm).exp_u20();
    x.store(s + c);
    acc = acc + x;
  }
  T sum = at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return a + b; }, acc);
  for (; c < n; ++c) {
    const T x = std::exp(s[c] - m);
    s[c] = x;
    sum += x;
  }
  return sum;
}

template <typename T>
void scale_row(T* x, int64_t n, T f) {
  at::vec::map([f](Vec<T> v) { return v * Vec<T>(f); }, x, x, n);
}

// Invalid keys of range [c0, c0 + n) get -inf (only called for ranges with holes); `valid`: the chunk's or the cache's.
template <typename T>
void mask_holes(const bool* valid, T* s, int64_t c0, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (!valid[c0 + c]) s[c] = -std::numeric_limits<T>::infinity();
}

// Keys and values [Hkv, *, D] (the chunk's, or the cache's: same Hkv, D and dtype).
template <typename T>
struct KV {
  const T *k, *v;
  int64_t skh, skn, svh, svn;
  KV(const at::Tensor& kt, const at::Tensor& vt)
      : k(kt.data_ptr<T>()), v(vt.data_ptr<T>()), skh(kt.stride(0)), skn(kt.stride(1)), svh(vt.stride(0)),
        svn(vt.stride(1)) {}
};

template <typename T>
void forward_impl(const at::Tensor& q, const KV<T>& kv, const KV<T>& kvc, const Tree& t, const Cache& c,
                  int64_t Hkv, double scale_d, at::Tensor& out, at::Tensor& lse) {
  const int64_t Hq = q.size(0), N = q.size(1), D = q.size(2), g = Hq / Hkv;
  const T scale = static_cast<T>(scale_d), NEG = -std::numeric_limits<T>::infinity();
  const T* qp = q.data_ptr<T>();
  const int64_t sqh = q.stride(0), sqn = q.stride(1);
  T* op = out.data_ptr<T>();
  T* lp = lse.data_ptr<T>();
  // query blocks of at most BQ inside one segment, never straddling a cross row's query bound
  std::vector<Unit> units;
  for (int64_t s = 0; s < (int64_t)t.start.size(); ++s) {
    int64_t ancestors = 0;
    for (int64_t p = t.parent[s]; p >= 0; p = t.parent[p]) ancestors += t.stop[p] - t.start[p];
    for (int64_t a = t.start[s]; a < t.stop[s];) {
      const int64_t b = block_end(a, t.stop[s], BQ, c.qcuts);
      int64_t cached = 0;
      for (int64_t r = 0; r < c.rows(); ++r)
        if (c.sees(r, a, b)) cached += c.k1[r] - c.k0[r];
      for (int64_t h = 0; h < Hkv; ++h)
        units.push_back({h, s, a, b, (b - a) * (cached + ancestors + b - t.start[s] + 8)});
      a = b;
    }
  }
  const auto lists = balance(units, workers_for(units.size()));
  run_lists(lists, [&](int64_t, const std::vector<Unit>& list) {
    const int64_t Mmax = g * BQ;
    std::vector<T> Qs(Mmax * D), S(Mmax * KC), acc(Mmax * D), m(Mmax), l(Mmax);
    std::vector<Range> ranges;
    for (const Unit& u : list) {
      const int64_t q0 = u.a, nq = u.b - u.a, M = g * nq;
      // the group's query heads stacked: row j * nq + i = head u.head * g + j, query q0 + i; scaled
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < nq; ++i)
          at::vec::map([scale](Vec<T> x) { return x * Vec<T>(scale); }, Qs.data() + (j * nq + i) * D,
                       qp + (u.head * g + j) * sqh + (q0 + i) * sqn, D);
      std::fill(acc.begin(), acc.begin() + M * D, T(0));
      std::fill(m.begin(), m.begin() + M, NEG);
      std::fill(l.begin(), l.begin() + M, T(0));
      block_ranges(t, c, u.seg, u.a, u.b, ranges);
      for (const Range& r : ranges) {
        const KV<T>& src = r.cache ? kvc : kv;
        const bool* valid = r.cache ? c.valid : t.valid;
        const T *kh = src.k + u.head * src.skh, *vh = src.v + u.head * src.svh;
        for (int64_t c0 = r.k0; c0 < r.k1; c0 += KC) {
          const int64_t nk = std::min(KC, r.k1 - c0);
          mm_abt<T>(M, nk, D, Qs.data(), D, kh + c0 * src.skn, src.skn, S.data());
          for (int64_t row = 0; row < M; ++row) {
            T* s = S.data() + row * nk;
            // keys c0 .. c0 + lim - 1 of the chunk are visible to this row (its own segment: up to the query)
            const int64_t lim = r.own ? std::min(nk, std::max<int64_t>(0, q0 + row % nq - c0 + 1)) : nk;
            std::fill(s + std::max<int64_t>(lim, 0), s + nk, T(0));
            if (lim <= 0) continue;
            if (r.holes) mask_holes(valid, s, c0, lim);
            const T m_new = std::max(m[row], row_max(s, lim));
            if (m_new == NEG) {  // every key so far invalid
              std::fill(s, s + lim, T(0));
              continue;
            }
            const T sum = exp_sum(s, lim, m_new);
            const T alpha = m[row] == NEG ? T(0) : std::exp(m[row] - m_new);
            l[row] = l[row] * alpha + sum;
            m[row] = m_new;
            if (alpha != T(1)) scale_row(acc.data() + row * D, D, alpha);
          }
          mm_ab<T>(M, nk, D, T(1), S.data(), vh + c0 * src.svn, src.svn, T(1), acc.data(), D);
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t row = j * nq + i, h = u.head * g + j, at_ = h * N + q0 + i;
          T* dst = op + at_ * D;
          if (l[row] > T(0)) {
            const T inv = T(1) / l[row];
            at::vec::map([inv](Vec<T> x) { return x * Vec<T>(inv); }, dst, acc.data() + row * D, D);
            lp[at_] = m[row] + std::log(l[row]);
          } else {
            std::fill(dst, dst + D, T(0));
            lp[at_] = NEG;
          }
        }
    }
  });
}

// Backward units: key blocks of at most BK, one segment's (seg >= 0) or the cache's (seg = -1, inside one interval
// between the cross rows' key bounds that some row sees).
std::vector<Unit> backward_units(const Tree& t, const Cache& c, int64_t Hkv) {
  std::vector<Unit> units;
  for (int64_t s = 0; s < (int64_t)t.start.size(); ++s)
    for (int64_t a = t.start[s]; a < t.stop[s]; a += BK) {
      const int64_t b = std::min(t.stop[s], a + BK);
      for (int64_t h = 0; h < Hkv; ++h) units.push_back({h, s, a, b, (b - a) * (t.sub_end[s] - a + 8)});
    }
  for (size_t i = 0; i + 1 < c.kcuts.size(); ++i)
    for (int64_t a = c.kcuts[i]; a < c.kcuts[i + 1];) {
      const int64_t b = std::min(c.kcuts[i + 1], a + BK);
      int64_t queries = 0;
      for (int64_t r = 0; r < c.rows(); ++r)
        if (c.seen(r, a, b)) queries += c.q1[r] - c.q0[r];
      if (queries > 0)
        for (int64_t h = 0; h < Hkv; ++h) units.push_back({h, -1, a, b, (b - a) * (queries + 8)});
      a = b;
    }
  return units;
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const KV<T>& kv, const KV<T>& kvc,
                   const at::Tensor& out, const at::Tensor& lse, const Tree& t, const Cache& c, int64_t Hkv,
                   double scale_d, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dkc, at::Tensor& dvc) {
  const int64_t Hq = q.size(0), N = q.size(1), D = q.size(2), g = Hq / Hkv;
  const T scale = static_cast<T>(scale_d), NEG = -std::numeric_limits<T>::infinity();
  const T *qp = q.data_ptr<T>(), *gp = dout.data_ptr<T>(), *op = out.data_ptr<T>(), *lp = lse.data_ptr<T>();
  const int64_t sqh = q.stride(0), sqn = q.stride(1), sgh = dout.stride(0), sgn = dout.stride(1),
                soh = out.stride(0), son = out.stride(1), slh = lse.stride(0), sln = lse.stride(1);
  // delta[h, q] = sum_d dout * out
  std::vector<T> delta(Hq * N);
  at::parallel_for(0, Hq * N, 256, [&](int64_t b, int64_t e) {
    for (int64_t x = b; x < e; ++x) {
      const int64_t h = x / N, i = x % N;
      delta[x] = at::vec::map2_reduce_all<T>([](Vec<T> a, Vec<T> c) { return a * c; },
                                             [](Vec<T> a, Vec<T> c) { return a + c; }, gp + h * sgh + i * sgn,
                                             op + h * soh + i * son, D);
    }
  });
  const std::vector<Unit> units = backward_units(t, c, Hkv);
  // at most DQ_BUFFER_BYTES of extra dq buffers: fewer workers for a very long tree
  const int64_t per_buffer = Hq * N * D * (int64_t)sizeof(T);
  const auto lists = balance(units, std::min(workers_for(units.size()), 1 + DQ_BUFFER_BYTES / per_buffer));
  const int64_t W = lists.size();
  // per-worker dq (a worker's units add into its own buffer; the buffers are summed in order afterwards)
  std::vector<T> dqbuf(W > 1 ? (W - 1) * Hq * N * D : 0, T(0));
  T* dq0 = dq.data_ptr<T>();
  std::fill(dq0, dq0 + Hq * N * D, T(0));
  run_lists(lists, [&](int64_t w, const std::vector<Unit>& list) {
    T* dqw = w == 0 ? dq0 : dqbuf.data() + (w - 1) * Hq * N * D;
    const int64_t Mmax = g * BQ;
    std::vector<T> Qs(Mmax * D), G(Mmax * D), P(Mmax * BK), dP(Mmax * BK), lse_r(Mmax), delta_r(Mmax),
        dKb(BK * D), dVb(BK * D);
    for (const Unit& u : list) {
      const bool cached = u.seg < 0;
      const KV<T>& src = cached ? kvc : kv;
      const bool* valid = cached ? c.valid : t.valid;
      const int64_t k0 = u.a, nk = u.b - u.a;
      const bool holes = cached ? c.holes(u.a, u.b) : !t.all_valid[u.seg];
      const T *kb = src.k + u.head * src.skh + k0 * src.skn, *vb = src.v + u.head * src.svh + k0 * src.svn;
      std::fill(dKb.begin(), dKb.begin() + nk * D, T(0));
      std::fill(dVb.begin(), dVb.begin() + nk * D, T(0));
      // one query tile [a, b) against the block (own: the block's own segment, causally)
      auto tile = [&](int64_t a, int64_t b, bool own) {
        const int64_t nq = b - a, M = g * nq;
        for (int64_t j = 0; j < g; ++j) {
          const int64_t h = u.head * g + j;
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t row = j * nq + i;
            at::vec::map([scale](Vec<T> x) { return x * Vec<T>(scale); }, Qs.data() + row * D,
                         qp + h * sqh + (a + i) * sqn, D);
            std::copy(gp + h * sgh + (a + i) * sgn, gp + h * sgh + (a + i) * sgn + D, G.data() + row * D);
            lse_r[row] = lp[h * slh + (a + i) * sln];
            delta_r[row] = delta[h * N + a + i];
          }
        }
        mm_abt<T>(M, nk, D, Qs.data(), D, kb, src.skn, P.data());   // s (scaled)
        mm_abt<T>(M, nk, D, G.data(), D, vb, src.svn, dP.data());   // dp = dout v^T
        for (int64_t row = 0; row < M; ++row) {
          T* p = P.data() + row * nk;
          T* dp = dP.data() + row * nk;
          const int64_t lim = own ? std::min(nk, std::max<int64_t>(0, a + row % nq - k0 + 1)) : nk;
          if (lim <= 0 || lse_r[row] == NEG) {  // sees none of these keys (or none at all)
            std::fill(p, p + nk, T(0));
            std::fill(dp, dp + nk, T(0));
            continue;
          }
          if (holes) mask_holes(valid, p, k0, lim);
          const T L = lse_r[row], dl = delta_r[row];
          int64_t x = 0;
          for (; x + Vec<T>::size() <= lim; x += Vec<T>::size()) {
            Vec<T> e = (Vec<T>::loadu(p + x) - Vec<T>(L)).exp_u20();
            e.store(p + x);
            (e * (Vec<T>::loadu(dp + x) - Vec<T>(dl))).store(dp + x);
          }
          for (; x < lim; ++x) {
            const T e = std::exp(p[x] - L);
            p[x] = e;
            dp[x] = e * (dp[x] - dl);
          }
          std::fill(p + lim, p + nk, T(0));
          std::fill(dp + lim, dp + nk, T(0));
        }
        mm_atb_acc<T>(M, nk, D, P.data(), G.data(), D, dVb.data());    // dv += p^T dout
        mm_atb_acc<T>(M, nk, D, dP.data(), Qs.data(), D, dKb.data());  // dk += ds^T (scale q)
        for (int64_t j = 0; j < g; ++j)                                   // dq += scale ds k
          mm_ab<T>(nq, nk, D, scale, dP.data() + j * nq * nk, kb, src.skn, T(1),
                   dqw + ((u.head * g + j) * N + a) * D, D);
      };
      if (cached) {  // the queries of every cross row that sees the block, whole
        for (int64_t r = 0; r < c.rows(); ++r)
          if (c.seen(r, u.a, u.b))
            for (int64_t a = c.q0[r]; a < c.q1[r]; a += BQ) tile(a, std::min(c.q1[r], a + BQ), false);
      } else {  // the own segment from k0 (causal), then the descendants (every key visible)
        for (int64_t a = k0; a < t.sub_end[u.seg];) {
          const bool own = a < t.stop[u.seg];
          const int64_t b = std::min(own ? t.stop[u.seg] : t.sub_end[u.seg], a + BQ);
          tile(a, b, own);
          a = b;
        }
      }
      const int64_t rows_total = cached ? c.P : N;
      T* dkp = (cached ? dkc : dk).template data_ptr<T>() + (u.head * rows_total + k0) * D;
      T* dvp = (cached ? dvc : dv).template data_ptr<T>() + (u.head * rows_total + k0) * D;
      std::copy(dKb.data(), dKb.data() + nk * D, dkp);
      std::copy(dVb.data(), dVb.data() + nk * D, dvp);
    }
  });
  if (W > 1) {
    at::parallel_for(0, Hq * N * D, 4096, [&](int64_t b, int64_t e) {
      for (int64_t w = 1; w < W; ++w) {
        const T* src = dqbuf.data() + (w - 1) * Hq * N * D;
        for (int64_t x = b; x < e; ++x) dq0[x] += src[x];
      }
    });
  }
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& end,
           const at::Tensor& valid, const at::Tensor& segments) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "tree attention kernel: q, k, v must be [H, N, D]");
  TORCH_CHECK(q.device().is_cpu(), "tree attention kernel: CPU tensors only");
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "tree attention kernel: Hq must be a multiple of Hkv");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(1) == k.size(1) && q.size(2) == k.size(2),
              "tree attention kernel: q, k, v disagree in N or D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "tree attention kernel: q, k, v must share a dtype");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 1 && valid.size(0) == q.size(1),
              "tree attention kernel: valid must be [N] bool");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3,
              "tree attention kernel: segments must be [S, 3] int64");
  TORCH_CHECK(end.scalar_type() == at::kLong && end.dim() == 1 && end.size(0) == q.size(1),
              "tree attention kernel: end must be [N] int64");
  TORCH_CHECK(q.size(1) == 0 || segments.size(0) > 0, "tree attention kernel: no segments for N > 0 tokens");
}

void check_cache(const at::Tensor& k, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& cache_valid, const at::Tensor& cross) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == k.size(0) &&
                  k_cache.size(2) == k.size(2),
              "tree attention kernel: k_cache, v_cache must be [Hkv, P, D] as k's heads and D");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "tree attention kernel: CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type(),
              "tree attention kernel: the cache must share q's dtype");
  TORCH_CHECK(cache_valid.scalar_type() == at::kBool && cache_valid.dim() == 1 &&
                  cache_valid.size(0) == k_cache.size(1),
              "tree attention kernel: cache_valid must be [P] bool");
  TORCH_CHECK(cross.scalar_type() == at::kLong && cross.dim() == 2 && cross.size(1) == 4,
              "tree attention kernel: cross must be [C, 4] int64");
}

at::Tensor last_dim_contiguous(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

// (out, lse) of the chunk's queries over their tree and the cache (a plain call: an empty cache).
std::tuple<at::Tensor, at::Tensor> forward_op(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                              const at::Tensor& end, const at::Tensor& valid,
                                              const at::Tensor& segments, const at::Tensor& kc_,
                                              const at::Tensor& vc_, const at::Tensor& cache_valid,
                                              const at::Tensor& cross, double scale) {
  check(q_, k_, v_, end, valid, segments);
  check_cache(k_, kc_, vc_, cache_valid, cross);
  auto q = last_dim_contiguous(q_), k = last_dim_contiguous(k_), v = last_dim_contiguous(v_);
  auto kc = last_dim_contiguous(kc_), vc = last_dim_contiguous(vc_);
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options());
  if (q.numel() == 0) {
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out.zero_(), lse};
  }
  const Tree t = make_tree(end, valid, segments);
  const Cache c = make_cache(cache_valid, cross, q.size(1));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "brcompile_cpu::tree_attention_forward", [&] {
    forward_impl<scalar_t>(q, KV<scalar_t>(k, v), KV<scalar_t>(kc, vc), t, c, k.size(0), scale, out, lse);
  });
  return {out, lse};
}

// (dq, dk, dv, dk_cache, dv_cache) with the forward's (merged) out and lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_op(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& out_, const at::Tensor& lse, const at::Tensor& end, const at::Tensor& valid,
    const at::Tensor& segments, const at::Tensor& kc_, const at::Tensor& vc_, const at::Tensor& cache_valid,
    const at::Tensor& cross, double scale) {
  check(q_, k_, v_, end, valid, segments);
  check_cache(k_, kc_, vc_, cache_valid, cross);
  auto q = last_dim_contiguous(q_), k = last_dim_contiguous(k_), v = last_dim_contiguous(v_);
  auto kc = last_dim_contiguous(kc_), vc = last_dim_contiguous(vc_);
  auto dout = last_dim_contiguous(dout_.to(q.scalar_type())), out = last_dim_contiguous(out_.to(q.scalar_type()));
  auto lse_t = lse.to(q.scalar_type());
  auto dq = at::empty(q.sizes(), q.options()), dk = at::zeros(k.sizes(), k.options()),
       dv = at::zeros(v.sizes(), v.options()), dkc = at::zeros(kc.sizes(), kc.options()),
       dvc = at::zeros(vc.sizes(), vc.options());
  if (q.numel() == 0) return {dq.zero_(), dk, dv, dkc, dvc};
  const Tree t = make_tree(end, valid, segments);
  const Cache c = make_cache(cache_valid, cross, q.size(1));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "brcompile_cpu::tree_attention_backward", [&] {
    backward_impl<scalar_t>(dout, q, KV<scalar_t>(k, v), KV<scalar_t>(kc, vc), out, lse_t, t, c, k.size(0), scale,
                            dq, dk, dv, dkc, dvc);
  });
  return {dq, dk, dv, dkc, dvc};
}

// The plain ops: no cache.
at::Tensor no_cache(const at::Tensor& k) { return at::empty({k.size(0), 0, k.size(2)}, k.options()); }

std::tuple<at::Tensor, at::Tensor> tree_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const at::Tensor& end,
                                                          const at::Tensor& valid, const at::Tensor& segments,
                                                          double scale) {
  TORCH_CHECK(k.dim() == 3, "tree attention kernel: q, k, v must be [H, N, D]");
  const auto none = no_cache(k);
  return forward_op(q, k, v, end, valid, segments, none, none, at::empty({0}, valid.options().dtype(at::kBool)),
                    at::empty({0, 4}, end.options().dtype(at::kLong)), scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& end, const at::Tensor& valid, const at::Tensor& segments, double scale) {
  TORCH_CHECK(k.dim() == 3, "tree attention kernel: q, k, v must be [H, N, D]");
  const auto none = no_cache(k);
  auto r = backward_op(dout, q, k, v, out, lse, end, valid, segments, none, none,
                       at::empty({0}, valid.options().dtype(at::kBool)),
                       at::empty({0, 4}, end.options().dtype(at::kLong)), scale);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(brcompile_cpu, m) {
  m.def("tree_attention_forward(Tensor q, Tensor k, Tensor v, Tensor end, Tensor valid, Tensor segments, "
        "float scale) -> (Tensor, Tensor)");
  m.def("tree_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor end, Tensor valid, Tensor segments, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("tree_attention_cached_forward(Tensor q, Tensor k, Tensor v, Tensor end, Tensor valid, Tensor segments, "
        "Tensor k_cache, Tensor v_cache, Tensor cache_valid, Tensor cross, float scale) -> (Tensor, Tensor)");
  m.def("tree_attention_cached_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor end, Tensor valid, Tensor segments, Tensor k_cache, Tensor v_cache, Tensor cache_valid, "
        "Tensor cross, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("tree_attention_forward", c10::DispatchKey::CPU, TORCH_FN(tree_attention_forward));
  m.impl("tree_attention_backward", c10::DispatchKey::CPU, TORCH_FN(tree_attention_backward));
  m.impl("tree_attention_cached_forward", c10::DispatchKey::CPU, TORCH_FN(forward_op));
  m.impl("tree_attention_cached_backward", c10::DispatchKey::CPU, TORCH_FN(backward_op));
}
