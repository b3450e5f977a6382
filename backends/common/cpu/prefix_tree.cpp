// The prefix tree of a batch on the CPU, in one pass (the compiled path of brcompile/runtime/tree: build.py's
// build_tree and padding.py's drop_positions, which say what every array means; docs/ARCHITECTURE.md §4).
//
// build: rows in exact lexicographic order of their per-column code tuples (a stable sort: equal rows keep their
// order), lcp of adjacent rows, and sorted row i owns the new nodes at columns lcp[i-1] .. L-1, laid out row after
// row: a depth-first preorder in which every subtree is a range. The same layout as the vectorised builder,
// bitwise (tests/runtime/test_tree.py compares them), without hashing: the comparisons are exact.
// drop: the tokens no needed position holds deleted, each kept token under its nearest kept ancestor.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

// Maximal single-child chains (start, stop, subtree end) of a preorder forest given parent[] and end[]: token k
// continues k - 1's chain iff parent[k] == k - 1 and k - 1 has one child (no sibling after k's subtree).
at::Tensor chain_segments(const int64_t* parent, const int64_t* end, int64_t n) {
  std::vector<int64_t> starts;
  for (int64_t k = 0; k < n; ++k) {
    const bool continues = k > 0 && parent[k] == k - 1 && end[k] == end[k - 1];
    if (!continues) starts.push_back(k);
  }
  const int64_t S = starts.size();
  auto seg = at::empty({S, 3}, at::kLong);
  int64_t* sp = seg.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    sp[3 * s] = starts[s];
    sp[3 * s + 1] = s + 1 < S ? starts[s + 1] : n;
    sp[3 * s + 2] = end[starts[s]];
  }
  return seg;
}

// end[k] = 1 + the largest id in k's subtree (children have larger ids than their parent in a preorder).
void subtree_ends(const int64_t* parent, int64_t* end, int64_t n) {
  for (int64_t k = 0; k < n; ++k) end[k] = k + 1;
  for (int64_t k = n - 1; k >= 0; --k)
    if (parent[k] >= 0) end[parent[k]] = std::max(end[parent[k]], end[k]);
}

// codes [K, B, L] int64 (input 0 most significant), mask [B, L] bool or undefined ->
// (index [B, L], parent, end, position, valid, rep_row [N], segments [S, 3])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prefix_tree(
    const at::Tensor& codes_, const c10::optional<at::Tensor>& mask_) {
  TORCH_CHECK(codes_.dim() == 3 && codes_.scalar_type() == at::kLong && codes_.device().is_cpu(),
              "prefix_tree: codes must be a [K, B, L] int64 CPU tensor");
  const auto codes = codes_.contiguous();
  const int64_t K = codes.size(0), B = codes.size(1), L = codes.size(2);
  TORCH_CHECK(K >= 1 && B >= 1 && L >= 1, "prefix_tree: empty batch");
  const int64_t* c = codes.data_ptr<int64_t>();
  at::Tensor mask;
  if (mask_.has_value() && mask_->defined()) {
    mask = mask_->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == B && mask.size(1) == L,
                "prefix_tree: mask must be [B, L] bool");
  }
  // the first column where rows a and b differ (L if none): blocks of columns compared with memcmp first (rows of
  // a group share long prompts), then the columns of the first block that differs
  constexpr int64_t BLOCK = 64;
  auto first_difference = [&](int64_t a, int64_t b) {
    for (int64_t t0 = 0; t0 < L; t0 += BLOCK) {
      const int64_t n = std::min(BLOCK, L - t0);
      bool same = true;
      for (int64_t j = 0; j < K && same; ++j)
        same = std::memcmp(c + (j * B + a) * L + t0, c + (j * B + b) * L + t0, n * sizeof(int64_t)) == 0;
      if (same) continue;
      for (int64_t t = t0; t < t0 + n; ++t)
        for (int64_t j = 0; j < K; ++j)
          if (c[(j * B + a) * L + t] != c[(j * B + b) * L + t]) return t;
    }
    return L;
  };
  std::vector<int64_t> perm(B);
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    const int64_t t = first_difference(a, b);
    if (t == L) return false;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t x = c[(j * B + a) * L + t], y = c[(j * B + b) * L + t];
      if (x != y) return x < y;
    }
    return false;
  });
  std::vector<int64_t> first_col(B, 0), offset(B + 1, 0);
  for (int64_t i = 1; i < B; ++i) first_col[i] = first_difference(perm[i - 1], perm[i]);
  for (int64_t i = 0; i < B; ++i) offset[i + 1] = offset[i] + (L - first_col[i]);
  const int64_t N = offset[B];

  auto index = at::empty({B, L}, at::kLong);
  auto parent = at::empty({N}, at::kLong), end = at::empty({N}, at::kLong), position = at::empty({N}, at::kLong),
       rep_row = at::empty({N}, at::kLong);
  auto valid = at::empty({N}, at::kBool);
  int64_t *ip = index.data_ptr<int64_t>(), *pp = parent.data_ptr<int64_t>(), *posp = position.data_ptr<int64_t>(),
          *rp = rep_row.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t row = perm[i], s = first_col[i];
    int64_t* idx = ip + row * L;
    if (i > 0) std::copy(ip + perm[i - 1] * L, ip + perm[i - 1] * L + s, idx);  // the shared prefix's nodes
    for (int64_t t = s; t < L; ++t) {
      const int64_t k = offset[i] + t - s;
      idx[t] = k;
      posp[k] = t;
      rp[k] = row;
      pp[k] = t == 0 ? -1 : (t > s ? k - 1 : idx[t - 1]);
    }
  }
  for (int64_t b = 0; b < B; ++b)  // the smallest row holding each token
    for (int64_t t = 0; t < L; ++t) {
      const int64_t k = ip[b * L + t];
      if (b < rp[k]) rp[k] = b;
    }
  subtree_ends(pp, end.data_ptr<int64_t>(), N);
  bool* vp = valid.data_ptr<bool>();
  if (mask.defined()) {
    const bool* mp = mask.data_ptr<bool>();
    for (int64_t k = 0; k < N; ++k) vp[k] = mp[rp[k] * L + posp[k]];
  } else {
    std::fill(vp, vp + N, true);
  }
  return {index, parent, end, position, valid, rep_row, chain_segments(pp, end.data_ptr<int64_t>(), N)};
}

// The tree without the tokens no needed position holds (padding.py's drop_positions): index -1 at their
// positions, ids renumbered in order, each kept token's parent the nearest kept ancestor on its row. Returns
// (index, parent, end, position, valid, rep_row, segments, counts [kept, depth, live kept]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
drop_positions(const at::Tensor& index_, const at::Tensor& end_, const at::Tensor& position_,
               const at::Tensor& valid_, const at::Tensor& rep_row_, const at::Tensor& needed_,
               const c10::optional<at::Tensor>& live_) {
  const auto index = index_.contiguous(), end = end_.contiguous(), position = position_.contiguous(),
             valid = valid_.contiguous(), rep_row = rep_row_.contiguous(), needed = needed_.contiguous();
  const int64_t B = index.size(0), L = index.size(1), N = end.size(0);
  TORCH_CHECK(needed.scalar_type() == at::kBool && needed.sizes() == index.sizes(),
              "drop_positions: needed must be [B, L] bool");
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* np = needed.data_ptr<bool>();
  std::vector<char> keep(N, 0), held(N, 0);
  for (int64_t x = 0; x < B * L; ++x) {
    TORCH_CHECK(ip[x] >= 0 && ip[x] < N, "drop_positions: index out of range (a tree with dropped positions)");
    if (np[x]) keep[ip[x]] = 1;
  }
  const bool has_live = live_.has_value() && live_->defined();
  if (has_live) {
    const auto live = live_->contiguous();
    TORCH_CHECK(live.scalar_type() == at::kBool && live.sizes() == index.sizes(), "drop_positions: live must be [B, L] bool");
    const bool* lp = live.data_ptr<bool>();
    for (int64_t x = 0; x < B * L; ++x)
      if (lp[x]) held[ip[x]] = 1;
  }
  std::vector<int64_t> before(N + 1, 0);
  for (int64_t k = 0; k < N; ++k) before[k + 1] = before[k] + keep[k];
  const int64_t M = before[N];
  auto index2 = at::empty({B, L}, at::kLong), parent2 = at::empty({M}, at::kLong), end2 = at::empty({M}, at::kLong),
       pos2 = at::empty({M}, at::kLong), rep2 = at::empty({M}, at::kLong);
  auto valid2 = at::empty({M}, at::kBool);
  int64_t *ip2 = index2.data_ptr<int64_t>(), *pp2 = parent2.data_ptr<int64_t>(), *ep2 = end2.data_ptr<int64_t>(),
          *posp2 = pos2.data_ptr<int64_t>(), *rp2 = rep2.data_ptr<int64_t>();
  const int64_t *ep = end.data_ptr<int64_t>(), *posp = position.data_ptr<int64_t>(),
                *rp = rep_row.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  bool* vp2 = valid2.data_ptr<bool>();
  int64_t depth = 0, live_kept = 0;
  std::vector<int64_t> prev(B * L);  // the new id of the last kept column before t in row b, or -1
  for (int64_t b = 0; b < B; ++b) {
    int64_t kept_in_row = 0, last = -1;
    for (int64_t t = 0; t < L; ++t) {
      const int64_t k = ip[b * L + t];
      prev[b * L + t] = last;
      ip2[b * L + t] = keep[k] ? before[k] : -1;
      if (keep[k]) last = before[k];
      kept_in_row += keep[k];
    }
    depth = std::max(depth, kept_in_row);
  }
  for (int64_t k = 0; k < N; ++k) {
    if (!keep[k]) continue;
    const int64_t k2 = before[k], r = rp[k], t = posp[k];
    posp2[k2] = t;
    rp2[k2] = r;
    vp2[k2] = vp[k];
    ep2[k2] = before[ep[k]];
    live_kept += held[k];
    pp2[k2] = prev[r * L + t];
  }
  auto counts = at::empty({3}, at::kLong);
  counts.data_ptr<int64_t>()[0] = M;
  counts.data_ptr<int64_t>()[1] = depth;
  counts.data_ptr<int64_t>()[2] = has_live ? live_kept : -1;
  return {index2, parent2, end2, pos2, valid2, rep2, chain_segments(pp2, ep2, M), counts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(brcompile_cpu, m) {
  m.def("prefix_tree(Tensor codes, Tensor? mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("drop_positions(Tensor index, Tensor end, Tensor position, Tensor valid, Tensor rep_row, Tensor needed, "
        "Tensor? live) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("prefix_tree", c10::DispatchKey::CPU, TORCH_FN(prefix_tree));
  m.impl("drop_positions", c10::DispatchKey::CPU, TORCH_FN(drop_positions));
}
