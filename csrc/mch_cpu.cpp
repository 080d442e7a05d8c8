// mch_profile_remap: one pass over every managed-collision table of a step (lightning_rec/managed_collision/mch.py).
//
// Per table, the same rules as MCHManagedCollisionModule's torch path, so that both give equal buffers bit for bit:
// profile (the step's ids, or distinct ids with counts): residents' counts and last-seen step updated, new ids merged
// into the candidates (past capacity: the most counted, then the most recent, then the smaller id stay), candidates
// that reached min_count take the free rows (the most counted first, ties by id), the sorted id map merged; then
// remap: ids -> rows (the unknown row, zch_size - 1, for ids without one), counting lookups of reused rows. The
// eviction run (every eviction_interval steps, in batches) comes between profile and remap: in the same call for the
// built-in policies, else between a profile and a remap call.
// One call for all tables: no per-table dispatch, no host read. Parallel over tables. mch_evict: the eviction run
// of the tables whose step it is: the built-in policies scored here, any other MCHEvictionPolicy's scores given.
//
//   state       an MchState (mch_state.h, made once per table group): its tensors, 12 a table: sorted_ids,
//               sorted_rows, row_ids, counts, last_seen [M] int64, reused [M] bool, cand_ids, cand_counts,
//               cand_last [C] int64, step [] int64, evictions_total [] int64, host [3] int64 (lookups of reused
//               rows and lookups, added to; rows the last eviction run handed over); per table its min_count
//               (lookups a new id needs before it takes a row), eviction interval and policy
//   profile_ids [P] int64, profile_counts [P] int64 or None (1 each), profile_segments [Sp, 3] (table, begin, end)
//   values      [N] int64, out [N] int64 (written at the remapped positions), remap_segments [Sr, 3]
//   key_lengths None, or a jagged batch's lengths [K, B] (int32/int64): a segment's begin and end are then keys
//               (segments made once for a key layout), their positions the keys' offsets
//   evict       the eviction run of the tables whose step is a multiple of their interval, between profile and remap
//   returns     (rows handed out [A] int64 table after table: admitted, then evicted; their number per table [T];
//               of those, evicted per table [T], -1 where no run was due (empty: none was))
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "check_message.h"
#include "mch_state.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

namespace lightning_rec {
namespace {

constexpr int64_t kFree = -1;                                      // a row without id
constexpr int64_t kNoId = std::numeric_limits<int64_t>::max();  // sorts after every id: empty map / candidate slot
constexpr int kStates = 12;

struct Table {
  int64_t *sorted_ids, *sorted_rows, *row_ids, *counts, *last_seen;
  bool* reused;
  int64_t *cand_ids, *cand_counts, *cand_last;
  int64_t step;
  int64_t *evictions_total, *host;  // host [3]: lookups of reused rows, lookups, rows the last run handed over
  int64_t M, C, min_count;
};

struct Entry {
  int64_t id, count, last;
};

// Position of id's lower bound in the sorted map, clamped to the map (M >= 1). Branchless (a select a level): the
// ids of a step are unpredictable, so a branch a level is mispredicted half the time.
int64_t find(const Table& t, int64_t id) {
  const int64_t* base = t.sorted_ids;
  int64_t n = t.M;
  while (n > 1) {
    const int64_t half = n / 2;
    base = base[half - 1] < id ? base + half : base;
    n -= half;
  }
  return std::min<int64_t>(base - t.sorted_ids + (*base < id), t.M - 1);
}

// find() of n ids at once into `out`, eight searches abreast: their loads overlap instead of waiting one after
// another.
void find_all(const Table& t, const std::vector<int64_t>& ids, std::vector<int64_t>& out) {
  constexpr int64_t K = 8;
  const int64_t n = static_cast<int64_t>(ids.size());
  out.resize(n);
  for (int64_t i = 0; i < n; i += K) {
    const int64_t k = std::min(K, n - i);
    const int64_t* base[K];
    for (int64_t j = 0; j < k; ++j) base[j] = t.sorted_ids;
    for (int64_t len = t.M; len > 1;) {
      const int64_t half = len / 2;
      for (int64_t j = 0; j < k; ++j) base[j] = base[j][half - 1] < ids[i + j] ? base[j] + half : base[j];
      len -= half;
    }
    for (int64_t j = 0; j < k; ++j)
      out[i + j] = std::min<int64_t>(base[j] - t.sorted_ids + (*base[j] < ids[i + j]), t.M - 1);
  }
}

// Candidates the buffers hold: they come first, sorted by id, kNoId after the last.
int64_t num_candidates(const Table& t) {
  return std::lower_bound(t.cand_ids, t.cand_ids + t.C, kNoId) - t.cand_ids;
}

// Rows holding an id: the sorted map's entries before its first kNoId.
int64_t num_resident(const Table& t) {
  return std::lower_bound(t.sorted_ids, t.sorted_ids + t.M, kNoId) - t.sorted_ids;
}

// mch.py's _merge of the candidates (sorted by id) and distinct new ids into `out`: one merge, same ids summed
// (counts) and maxed (last seen); only the new ids are sorted.
void with_candidates(const Table& t, std::vector<Entry>& fresh, std::vector<Entry>& out) {
  std::sort(fresh.begin(), fresh.end(), [](const Entry& a, const Entry& b) { return a.id < b.id; });
  const int64_t n = num_candidates(t);
  out.clear();
  out.reserve(n + fresh.size());
  int64_t i = 0;
  for (const Entry& f : fresh) {
    for (; i < n && t.cand_ids[i] < f.id; ++i) out.push_back(Entry{t.cand_ids[i], t.cand_counts[i], t.cand_last[i]});
    if (i < n && t.cand_ids[i] == f.id) {
      out.push_back(Entry{f.id, t.cand_counts[i] + f.count, std::max(t.cand_last[i], f.last)});
      ++i;
    } else {
      out.push_back(f);
    }
  }
  for (; i < n; ++i) out.push_back(Entry{t.cand_ids[i], t.cand_counts[i], t.cand_last[i]});
}

// The candidates that keep their place past capacity C: the most counted, then the most recent, then the smaller id
// (entries are in id order): mch.py's stable sorts. Found without a sort or a comparator: the C-th largest count,
// then among that count the largest last-seen steps still needed, then the first of those at the boundary step.
struct Keep {
  int64_t count, last, at_last;  // keep: count > .count, or == and last > .last, or == both for the first at_last
};

int64_t kth_largest(std::vector<int64_t>& v, int64_t k) {  // 1-based; reorders v
  std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<int64_t>());
  return v[k - 1];
}

Keep to_keep(const std::vector<Entry>& e, int64_t C) {
  thread_local std::vector<int64_t> v;  // kept: no allocation per table and step
  v.clear();
  for (const Entry& x : e) v.push_back(x.count);
  Keep k{kth_largest(v, C), 0, 0};
  int64_t need = C;
  v.clear();
  for (const Entry& x : e) {
    need -= x.count > k.count;
    if (x.count == k.count) v.push_back(x.last);
  }
  k.last = kth_largest(v, need);
  for (const int64_t last : v) need -= last > k.last;
  k.at_last = need;
  return k;
}

// mch.py's _set_candidates: entries sorted by id into the fixed buffers (past capacity, to_keep's), still in id
// order. `before`: the candidates the buffers held (their slots past the new count are cleared, the rest of the
// buffers is already empty).
void set_candidates(Table& t, const std::vector<Entry>& e, int64_t before) {
  const bool over = static_cast<int64_t>(e.size()) > t.C;
  Keep k = over ? to_keep(e, t.C) : Keep{};
  const auto stays = [&](const Entry& x) {
    if (!over || x.count != k.count) return !over || x.count > k.count;
    return x.last != k.last ? x.last > k.last : k.at_last-- > 0;
  };
  int64_t n = 0;
  for (const Entry& x : e) {
    if (!stays(x)) continue;
    t.cand_ids[n] = x.id;
    t.cand_counts[n] = x.count;
    t.cand_last[n++] = x.last;
  }
  for (int64_t i = n; i < std::max(before, n); ++i) {
    t.cand_ids[i] = kNoId;
    t.cand_counts[i] = 0;
    t.cand_last[i] = 0;
  }
}

// mch.py's _merge_map: the ids `old` leave the sorted map, new (id, row) pairs are merged in.
void merge_map(Table& t, const std::vector<int64_t>& old, std::vector<std::pair<int64_t, int64_t>> fresh) {
  std::sort(fresh.begin(), fresh.end());
  std::vector<bool> keep(t.M);
  for (int64_t i = 0; i < t.M; ++i) keep[i] = t.sorted_ids[i] != kNoId;
  for (int64_t id : old) keep[std::lower_bound(t.sorted_ids, t.sorted_ids + t.M, id) - t.sorted_ids] = false;
  std::vector<std::pair<int64_t, int64_t>> kept;
  for (int64_t i = 0; i < t.M; ++i)
    if (keep[i]) kept.emplace_back(t.sorted_ids[i], t.sorted_rows[i]);
  size_t a = 0, b = 0, k = 0;
  while (a < kept.size() || b < fresh.size()) {
    const bool take_kept = b == fresh.size() || (a < kept.size() && kept[a].first <= fresh[b].first);
    const auto& x = take_kept ? kept[a++] : fresh[b++];
    t.sorted_ids[k] = x.first;
    t.sorted_rows[k++] = x.second;
  }
  for (int64_t i = static_cast<int64_t>(k); i < t.M; ++i) {
    t.sorted_ids[i] = kNoId;
    t.sorted_rows[i] = 0;
  }
}

// mch.py's _place: candidate cands[i] takes rows[i] (its id, if any, leaves the map); the rest stay candidates.
void place(Table& t, const std::vector<int64_t>& rows, const std::vector<int64_t>& cands,
           std::vector<int64_t>& placed) {
  std::vector<int64_t> old;
  std::vector<std::pair<int64_t, int64_t>> fresh;
  std::vector<bool> taken(t.C, false);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t row = rows[i], c = cands[i];
    if (t.row_ids[row] != kFree) old.push_back(t.row_ids[row]);
    fresh.emplace_back(t.cand_ids[c], row);
    t.row_ids[row] = t.cand_ids[c];
    t.counts[row] = t.cand_counts[c];
    t.last_seen[row] = t.cand_last[c];
    taken[c] = true;
    placed.push_back(row);
  }
  merge_map(t, old, std::move(fresh));
  const int64_t n = num_candidates(t);
  std::vector<Entry> rest;
  for (int64_t i = 0; i < n; ++i)
    if (!taken[i]) rest.push_back(Entry{t.cand_ids[i], t.cand_counts[i], t.cand_last[i]});
  set_candidates(t, rest, n);
}

// mch.py's _admit_to_free_rows: ready candidates (the most counted first, ties by id) take the free rows in order.
void admit(Table& t, std::vector<int64_t>& admitted) {
  if (num_resident(t) == t.M) return;  // full: no scan of the rows (a table of millions, every step)
  std::vector<int64_t> free_rows, ready;
  for (int64_t r = 0; r < t.M; ++r)
    if (t.row_ids[r] == kFree) free_rows.push_back(r);
  const int64_t n = num_candidates(t);
  for (int64_t i = 0; i < n; ++i)
    if (t.cand_counts[i] >= t.min_count) ready.push_back(i);
  if (free_rows.empty() || ready.empty()) return;
  std::stable_sort(ready.begin(), ready.end(),
                   [&](int64_t a, int64_t b) { return t.cand_counts[a] > t.cand_counts[b]; });
  ready.resize(std::min(ready.size(), free_rows.size()));
  free_rows.resize(ready.size());
  place(t, free_rows, ready, admitted);
}

// The first k of `order` under the strict total order `less`, sorted: a selection, then a sort of k.
template <typename Less>
void first_k(std::vector<int64_t>& order, int64_t k, Less less) {
  if (k < static_cast<int64_t>(order.size())) std::nth_element(order.begin(), order.begin() + k, order.end(), less);
  order.resize(k);
  std::sort(order.begin(), order.end(), less);
}

// mch.py's _evict given the policy's scores (residents [M], ready candidates [R]): the strongest candidates take
// the rows of the weakest residents they outscore (stable sorts: ties fall by position; residents keep ties),
// only when no row is free; the candidates are cleared.
void evict(Table& t, const int64_t* ready, int64_t R, const double* resident, const double* incoming,
           std::vector<int64_t>& evicted) {
  int64_t handed = 0;
  if (R && num_resident(t) == t.M) {
    const int64_t k = std::min(R, t.M);
    std::vector<int64_t> low(t.M), high(R);
    std::iota(low.begin(), low.end(), 0);
    std::iota(high.begin(), high.end(), 0);
    // the k weakest residents and strongest candidates in stable-sort order: (score, position) is a total order
    first_k(low, k, [&](int64_t a, int64_t b) { return resident[a] != resident[b] ? resident[a] < resident[b] : a < b; });
    first_k(high, k, [&](int64_t a, int64_t b) { return incoming[a] != incoming[b] ? incoming[a] > incoming[b] : a < b; });
    std::vector<int64_t> rows, cands;
    for (int64_t i = 0; i < k; ++i)
      if (incoming[high[i]] > resident[low[i]]) {
        rows.push_back(low[i]);
        cands.push_back(ready[high[i]]);
      }
    for (int64_t row : rows) t.reused[row] = true;
    if (!rows.empty()) place(t, rows, cands, evicted);
    handed = static_cast<int64_t>(rows.size());
  }
  *t.evictions_total += handed;
  t.host[2] = handed;
  set_candidates(t, {}, num_candidates(t));
}

// One table's ids of a step, distinct, with their counts and (once profiled) rows: open addressing, no sort.
// Reused from table to table and step to step (a thread's own): reset() keeps the memory.
struct IdHash {
  std::vector<int64_t> keys, slot_of;  // table of kNoId (empty) or id, and its slot below
  std::vector<int64_t> ids, counts, rows;  // per distinct id, first seen first; rows: -2 until profiled
  uint64_t mask = 0;
  int shift = 64;
  void reset(size_t n) {  // room for n distinct ids, none held
    int bits = 4;
    while ((size_t(1) << bits) < 2 * n) ++bits;
    keys.assign(size_t(1) << bits, kNoId);
    slot_of.resize(keys.size());
    ids.clear();
    counts.clear();
    rows.clear();
    mask = keys.size() - 1;
    shift = 64 - bits;
  }
  size_t probe(int64_t id) const {
    size_t h = (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift;
    while (keys[h] != id && keys[h] != kNoId) h = (h + 1) & mask;
    return h;
  }
  int64_t add(int64_t id, int64_t count) {  // returns the id's slot
    const size_t h = probe(id);
    if (keys[h] == kNoId) {
      keys[h] = id;
      slot_of[h] = static_cast<int64_t>(ids.size());
      ids.push_back(id);
      counts.push_back(0);
      rows.push_back(-2);
    }
    counts[slot_of[h]] += count;
    return slot_of[h];
  }
  int64_t row(int64_t id) const {  // -2: not among these ids
    const size_t h = probe(id);
    return keys[h] == kNoId ? -2 : rows[slot_of[h]];
  }
};

// mch.py's profile_counts without the eviction run: residents counted, new ids merged into the candidates, ready
// candidates admitted; then every distinct id's row (M, the unknown row, for ids without one) into `seen.rows`.
// A thread's working memory, kept from table to table and step to step: no allocation per table and step.
struct Scratch {
  IdHash seen;
  std::vector<int64_t> slot_at, at;
  std::vector<Entry> fresh, merged;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

void profile(Table& t, IdHash& seen, std::vector<int64_t>& admitted, Scratch& scr) {
  if (seen.ids.empty()) return;
  std::vector<Entry>& fresh = scr.fresh;
  std::vector<int64_t>& at = scr.at;
  fresh.clear();
  find_all(t, seen.ids, at);
  for (size_t s = 0; s < seen.ids.size(); ++s) {
    const int64_t pos = at[s];
    if (t.sorted_ids[pos] == seen.ids[s]) {
      const int64_t row = t.sorted_rows[pos];
      t.counts[row] += seen.counts[s];
      t.last_seen[row] = t.step;
      seen.rows[s] = row;
    } else {
      fresh.push_back(Entry{seen.ids[s], seen.counts[s], t.step});
    }
  }
  const size_t before = admitted.size();
  if (!fresh.empty()) {
    with_candidates(t, fresh, scr.merged);
    set_candidates(t, scr.merged, num_candidates(t));
    admit(t, admitted);  // fills free rows only: the residents found above keep theirs
  }
  const bool placed = admitted.size() > before;  // else the new ids read the unknown row: no second search
  for (size_t s = 0; s < seen.ids.size(); ++s)
    if (seen.rows[s] == -2) {
      const int64_t pos = placed ? find(t, seen.ids[s]) : 0;
      seen.rows[s] = placed && t.sorted_ids[pos] == seen.ids[s] ? t.sorted_rows[pos] : t.M;
    }
}

// Table t's ids at `spans` of v into o; returns the lookups of reused rows. `slot_at`: each position's slot in
// `seen` (its ids profiled in the same order), so rows are read back without a probe; else each id is looked up in
// `seen` (the profiled ids), or searched in the map.
int64_t remap_table(const Table& t, const IdHash& seen, const std::vector<int64_t>* slot_at,
                    const std::vector<std::pair<int64_t, int64_t>>& spans, const int64_t* v, int64_t* o) {
  int64_t reused = 0;
  if (slot_at) {
    size_t k = 0;
    for (const auto& [a, b] : spans)
      for (int64_t p = a; p < b; ++p) o[p] = seen.rows[(*slot_at)[k++]];
    for (size_t d = 0; d < seen.ids.size(); ++d)  // each id's lookups at once: its count
      reused += seen.rows[d] != t.M && t.reused[seen.rows[d]] ? seen.counts[d] : 0;
    return reused;
  }
  const bool profiled = !seen.ids.empty();
  for (const auto& [a, b] : spans) {
    std::vector<int64_t> at;
    if (!profiled) find_all(t, std::vector<int64_t>(v + a, v + b), at);
    for (int64_t p = a; p < b; ++p) {
      int64_t row = profiled ? seen.row(v[p]) : -2;
      if (row == -2) {
        const int64_t pos = profiled ? find(t, v[p]) : at[p - a];
        row = t.sorted_ids[pos] == v[p] ? t.sorted_rows[pos] : t.M;  // M = zch_size - 1: the unknown row
      }
      o[p] = row;
      reused += row != t.M && t.reused[row];
    }
  }
  return reused;
}

// The ready candidates (count at least min_count), by position: mch.py's _eviction_scores' `ready`.
std::vector<int64_t> ready_candidates(const Table& t) {
  std::vector<int64_t> ready;
  const int64_t n = num_candidates(t);
  for (int64_t i = 0; i < n; ++i)
    if (t.cand_counts[i] >= t.min_count) ready.push_back(i);
  return ready;
}

// The built-in policies' scores (mch.py's LFU / LRU / DistanceLFU(decay 1) .scores, the same double arithmetic) of
// `n` ids, their counts and last-seen steps given by position.
template <typename Count, typename Last>
std::vector<double> scores(int64_t policy, int64_t n, int64_t step, Count count, Last last) {
  std::vector<double> out(n);
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) most = std::max(most, count(i));
  for (int64_t i = 0; i < n; ++i) {
    const double c = static_cast<double>(count(i));
    if (policy == 1) out[i] = c;
    else if (policy == 2) out[i] = static_cast<double>(last(i)) + c / (static_cast<double>(most) + 1);
    else out[i] = c / (static_cast<double>(std::max<int64_t>(step - last(i), 0)) + 1);
  }
  return out;
}

// The eviction run of table t under a built-in policy (1 lfu, 2 lru, 3 distance-lfu of decay 1): rows handed to
// candidates appended to `evicted`.
void evict_builtin(Table& t, int64_t policy, std::vector<int64_t>& evicted) {
  const std::vector<int64_t> r = ready_candidates(t);
  const int64_t R = static_cast<int64_t>(r.size());
  const std::vector<double> resident = scores(
      policy, t.M, t.step, [&](int64_t j) { return t.counts[j]; }, [&](int64_t j) { return t.last_seen[j]; });
  const std::vector<double> incoming = scores(
      policy, R, t.step, [&](int64_t j) { return t.cand_counts[r[j]]; }, [&](int64_t j) { return t.cand_last[r[j]]; });
  evict(t, r.data(), R, resident.data(), incoming.data(), evicted);
}

using Segments = std::vector<std::vector<std::pair<int64_t, int64_t>>>;

// The offsets of a jagged batch's keys [K + 1] from its lengths [K, B]; empty for None.
std::vector<int64_t> key_offsets(const c10::optional<at::Tensor>& lengths) {
  std::vector<int64_t> out;
  if (!lengths.has_value()) return out;
  const at::Tensor& l = *lengths;
  LR_CHECK(l.device().is_cpu() && l.dim() == 2 && l.is_contiguous() &&
               (l.scalar_type() == at::kLong || l.scalar_type() == at::kInt),
           "lightning_rec::mch_profile_remap: key_lengths must be a contiguous int32/int64 [K, B] CPU tensor");
  const int64_t K = l.size(0), B = l.size(1);
  out.assign(K + 1, 0);
  AT_DISPATCH_INDEX_TYPES(l.scalar_type(), "key_offsets", [&] {
    const index_t* x = l.data_ptr<index_t>();
    for (int64_t k = 0; k < K; ++k) {
      int64_t n = 0;
      for (int64_t b = 0; b < B; ++b) n += x[k * B + b];
      out[k + 1] = out[k] + n;
    }
  });
  return out;
}

Segments by_table(const at::Tensor& segments, const std::vector<int64_t>& bounds, int64_t T, int64_t n,
                  const char* what) {
  LR_CHECK(segments.device().is_cpu() && segments.scalar_type() == at::kLong && segments.is_contiguous() &&
               segments.dim() == 2 && segments.size(1) == 3,
           "lightning_rec::mch_profile_remap: ", what, " must be a contiguous int64 [S, 3] CPU tensor");
  Segments out(T);
  const int64_t* s = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.size(0); ++i) {
    int64_t t = s[3 * i], a = s[3 * i + 1], b = s[3 * i + 2];
    if (!bounds.empty()) {
      const int64_t K = static_cast<int64_t>(bounds.size());
      LR_CHECK(a >= 0 && a <= b && b < K, "lightning_rec::mch_profile_remap: ", what, " row ", i, " (table ", t,
               ", keys ", a, ":", b, ") is outside the ", K - 1, " keys");
      a = bounds[a];
      b = bounds[b];
    }
    LR_CHECK(t >= 0 && t < T && a >= 0 && a <= b && b <= n, "lightning_rec::mch_profile_remap: ", what, " row ", i,
             " (table ", t, ", ", a, ":", b, ") is outside ", T, " tables or ", n, " ids");
    out[t].emplace_back(a, b);
  }
  return out;
}

void check_ids(const at::Tensor& x, const char* what) {
  LR_CHECK(x.device().is_cpu() && x.scalar_type() == at::kLong && x.dim() == 1 && x.is_contiguous(),
           "lightning_rec::mch_profile_remap: ", what, " must be a contiguous 1-D int64 CPU tensor");
}

void check_table(const std::vector<at::Tensor>& s, int64_t i) {
  const at::Tensor* x = &s[kStates * i];
  const int64_t M = x[2].numel(), C = x[6].numel();
  for (int k = 0; k < kStates; ++k)
    LR_CHECK(x[k].device().is_cpu() && x[k].is_contiguous() && x[k].scalar_type() == (k == 5 ? at::kBool : at::kLong),
             "lightning_rec::MchState: state ", k, " of table ", i,
             " must be a contiguous CPU tensor (int64; reused: bool)");
  LR_CHECK(M >= 1 && x[0].numel() == M && x[1].numel() == M && x[3].numel() == M && x[4].numel() == M &&
               x[5].numel() == M && C >= 1 && x[7].numel() == C && x[8].numel() == C && x[9].numel() == 1 &&
               x[10].numel() == 1 && x[11].numel() == 3,
           "lightning_rec::MchState: the state of table ", i, " has inconsistent sizes");
}

// Table i's pointers (taken when the state was made).
Table table_of(const MchState& st, int64_t i) {
  void* const* x = &st.data[kStates * i];
  const auto p = [&](int k) { return static_cast<int64_t*>(x[k]); };
  return Table{p(0), p(1), p(2), p(3), p(4), static_cast<bool*>(x[5]), p(6), p(7), p(8), *p(9), p(10), p(11),
               st.tensors[kStates * i + 2].numel(), st.tensors[kStates * i + 6].numel(), st.min_counts[i]};
}

std::tuple<at::Tensor, at::Tensor> flat(const std::vector<std::vector<int64_t>>& rows_T) {
  const int64_t T = static_cast<int64_t>(rows_T.size());
  at::Tensor per_table = at::empty({T}, at::kLong);
  int64_t total = 0;
  for (int64_t i = 0; i < T; ++i) total += per_table.data_ptr<int64_t>()[i] = static_cast<int64_t>(rows_T[i].size());
  at::Tensor rows = at::empty({total}, at::kLong);
  int64_t* r = rows.data_ptr<int64_t>();
  for (const auto& a : rows_T) r = std::copy(a.begin(), a.end(), r);
  return {rows, per_table};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mch_profile_remap_cpu(
    const c10::intrusive_ptr<MchState>& state, const at::Tensor& profile_ids,
    const c10::optional<at::Tensor>& profile_counts, const at::Tensor& profile_segments, const at::Tensor& values,
    const at::Tensor& out, const at::Tensor& remap_segments, const c10::optional<at::Tensor>& key_lengths,
    bool count, bool advance, bool evict) {
  const int64_t T = static_cast<int64_t>(state->min_counts.size());
  check_ids(profile_ids, "profile_ids");
  check_ids(values, "values");
  check_ids(out, "out");
  LR_CHECK(out.numel() == values.numel(), "lightning_rec::mch_profile_remap: out and values differ in length");
  const int64_t* pc = nullptr;
  if (profile_counts.has_value()) {
    check_ids(*profile_counts, "profile_counts");
    LR_CHECK(profile_counts->numel() == profile_ids.numel(),
             "lightning_rec::mch_profile_remap: profile_counts and profile_ids differ in length");
    pc = profile_counts->data_ptr<int64_t>();
  }
  const std::vector<int64_t> bounds = key_offsets(key_lengths);
  const Segments prof = by_table(profile_segments, bounds, T, profile_ids.numel(), "profile_segments");
  const Segments remap = by_table(remap_segments, bounds, T, values.numel(), "remap_segments");
  std::vector<Table> tables;
  std::vector<char> due(T, 0);
  bool any_due = false;
  for (int64_t i = 0; i < T; ++i) {
    tables.push_back(table_of(*state, i));
    if (advance) tables.back().step = ++*static_cast<int64_t*>(state->data[kStates * i + 9]);
    if (evict && tables.back().step % state->intervals[i] == 0) {
      LR_CHECK(state->policies[i] != 0, "lightning_rec::mch_profile_remap: table ", i,
               "'s eviction policy is scored outside: run its eviction with mch_evict");
      due[i] = 1;
      any_due = true;
    }
  }
  const int64_t* pid = profile_ids.data_ptr<int64_t>();
  const int64_t* v = values.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> admitted(T);
  at::Tensor evicted = any_due ? at::full({T}, -1, at::kLong) : at::empty({0}, at::kLong);
  int64_t* evicted_T = evicted.data_ptr<int64_t>();
  // a step's own ids profiled and remapped alike: each position's slot kept, its row read back without a probe
  const bool same = !pc && profile_ids.is_same(values) && profile_segments.is_same(remap_segments);
  at::parallel_for(0, T, 1, [&](int64_t tb, int64_t te) {
    for (int64_t i = tb; i < te; ++i) {
      Table& t = tables[i];
      size_t n = 0;
      for (const auto& [a, b] : prof[i]) n += b - a;
      Scratch& s = scratch();
      IdHash& seen = s.seen;
      std::vector<int64_t>& slot_at = s.slot_at;
      seen.reset(n);
      slot_at.clear();
      for (const auto& [a, b] : prof[i])
        for (int64_t p = a; p < b; ++p) {
          const int64_t slot = seen.add(pid[p], pc ? pc[p] : 1);
          if (same) slot_at.push_back(slot);
        }
      profile(t, seen, admitted[i], s);
      if (due[i]) {
        const size_t before = admitted[i].size();
        evict_builtin(t, state->policies[i], admitted[i]);
        evicted_T[i] = static_cast<int64_t>(admitted[i].size() - before);
        for (size_t d = 0; d < seen.ids.size(); ++d) {  // the rows the run took or gave: read again
          const int64_t pos = find(t, seen.ids[d]);
          seen.rows[d] = t.sorted_ids[pos] == seen.ids[d] ? t.sorted_rows[pos] : t.M;
        }
      }
      const int64_t reused = remap_table(t, seen, same ? &slot_at : nullptr, remap[i], v, o);
      if (count) {
        t.host[0] += reused;
        for (const auto& [a, b] : remap[i]) t.host[1] += b - a;
      }
    }
  });
  auto [rows, per_table] = flat(admitted);
  return {rows, per_table, evicted};
}

std::tuple<at::Tensor, at::Tensor> mch_evict_cpu(const c10::intrusive_ptr<MchState>& state, at::IntArrayRef due,
                                                 at::TensorList resident_scores, at::TensorList incoming_scores) {
  const int64_t T = static_cast<int64_t>(due.size()), all = static_cast<int64_t>(state->min_counts.size());
  LR_CHECK(static_cast<int64_t>(resident_scores.size()) == T && static_cast<int64_t>(incoming_scores.size()) == T,
           "lightning_rec::mch_evict: two scores per due table");
  std::vector<Table> tables;
  std::vector<int64_t> policies;
  std::vector<std::vector<int64_t>> ready(T);
  for (int64_t i = 0; i < T; ++i) {
    LR_CHECK(due[i] >= 0 && due[i] < all, "lightning_rec::mch_evict: table ", due[i], " is not one of ", all);
    tables.push_back(table_of(*state, due[i]));
    policies.push_back(state->policies[due[i]]);
    ready[i] = ready_candidates(tables[i]);
    LR_CHECK(policies[i] != 0 || (resident_scores[i].scalar_type() == at::kDouble &&
                                  resident_scores[i].is_contiguous() && resident_scores[i].numel() == tables[i].M &&
                                  incoming_scores[i].scalar_type() == at::kDouble &&
                                  incoming_scores[i].is_contiguous() &&
                                  incoming_scores[i].numel() == static_cast<int64_t>(ready[i].size())),
             "lightning_rec::mch_evict: table ", i, ": given scores must be float64 [M] and [ready candidates]");
  }
  std::vector<std::vector<int64_t>> evicted(T);
  at::parallel_for(0, T, 1, [&](int64_t tb, int64_t te) {
    for (int64_t i = tb; i < te; ++i) {
      Table& t = tables[i];
      if (policies[i] == 0) {
        evict(t, ready[i].data(), static_cast<int64_t>(ready[i].size()), resident_scores[i].data_ptr<double>(),
              incoming_scores[i].data_ptr<double>(), evicted[i]);
        continue;
      }
      evict_builtin(t, policies[i], evicted[i]);
    }
  });
  return flat(evicted);
}

// mch.py's owner_of: two multiply-xorshift rounds (int64 products wrap), bits 33..62, modulo the owners (one for all
// ids, or one per id).
at::Tensor mch_owner_of_cpu(const at::Tensor& ids, const at::Tensor& owners) {
  check_ids(ids, "ids");
  LR_CHECK(owners.device().is_cpu() && owners.scalar_type() == at::kLong && owners.is_contiguous() &&
               (owners.numel() == 1 || owners.numel() == ids.numel()),
           "lightning_rec::mch_owner_of: owners must be a contiguous int64 CPU tensor of one value or one per id");
  at::Tensor out = at::empty_like(ids);
  const uint64_t* v = reinterpret_cast<const uint64_t*>(ids.data_ptr<int64_t>());
  const int64_t* k = owners.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool one = owners.numel() == 1;
  for (int64_t i = 0; i < ids.numel(); ++i) {
    uint64_t x = v[i] * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 32)) * 0xBF58476D1CE4E5B9ull;
    o[i] = static_cast<int64_t>((x >> 33) & ((1ull << 30) - 1)) % k[one ? 0 : i];
  }
  return out;
}

}  // namespace

// Before the kernels below: their schemas name the class.
TORCH_LIBRARY_FRAGMENT(lightning_rec, m) {
  // The state tensors of a table group, made once per group (checked then), held by the calls below.
  m.class_<MchState>("MchState")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>());
  // A step of every table of the group in one pass: profile (counts, candidates, admission to free rows) and remap
  // raw ids to rows, per table as MCHManagedCollisionModule's torch path; state written in place; `key_lengths`: a
  // jagged batch's [K, B], whose keys a segment's begin and end are (None: positions); `advance`: every table's
  // step counter first; `evict`: the eviction run of the tables whose step it is (built-in policies) between
  // profile and remap. Returns (rows handed
  // to new ids, table after table (admitted, then evicted); their number per table; of those, the evicted per table,
  // -1 where no run was due, empty when none was).
  m.def(
      "mch_profile_remap(__torch__.torch.classes.lightning_rec.MchState state, Tensor profile_ids, "
      "Tensor? profile_counts, Tensor profile_segments, Tensor values, Tensor(b!) out, Tensor remap_segments, "
      "Tensor? key_lengths, bool count, bool advance, bool evict) -> (Tensor, Tensor, Tensor)");
  // The eviction run of the tables `due`: each one's policy (0: the scores given, 1: lfu, 2: lru, 3: distance-lfu
  // with decay 1) scores residents and ready candidates; returns (rows, per table).
  m.def("mch_evict(__torch__.torch.classes.lightning_rec.MchState state, int[] due, "
        "Tensor[] resident_scores, Tensor[] incoming_scores) -> (Tensor, Tensor)");
  // The row shard (0..owners-1) of each raw id (mch.py's owner_of): owners one value or one per id.
  m.def("mch_owner_of(Tensor ids, Tensor owners) -> Tensor");
}

MchState::MchState(std::vector<at::Tensor> t, std::vector<int64_t> m, std::vector<int64_t> iv, std::vector<int64_t> p)
    : tensors(std::move(t)), min_counts(std::move(m)), intervals(std::move(iv)), policies(std::move(p)) {
  const int64_t T = static_cast<int64_t>(min_counts.size());
  LR_CHECK(static_cast<int64_t>(intervals.size()) == T && static_cast<int64_t>(policies.size()) == T,
           "lightning_rec::MchState: a min_count, an eviction interval and a policy per table");
  for (int64_t k = 0; k < T; ++k)
    LR_CHECK(intervals[k] >= 1 && policies[k] >= 0 && policies[k] <= 3, "lightning_rec::MchState: table ", k,
             ": eviction interval ", intervals[k], " (>= 1) and policy ", policies[k],
             " (0 scored outside, 1 lfu, 2 lru, 3 distance-lfu of decay 1)");
  LR_CHECK(static_cast<int64_t>(tensors.size()) == kStates * T, "lightning_rec::MchState: ", kStates,
           " state tensors per table expected for ", T, " tables, got ", static_cast<int64_t>(tensors.size()));
  for (int64_t i = 0; i < T; ++i) check_table(tensors, i);
  for (const at::Tensor& x : tensors) data.push_back(x.data_ptr());
}

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("mch_profile_remap", &mch_profile_remap_cpu);
  m.impl("mch_evict", &mch_evict_cpu);
  m.impl("mch_owner_of", &mch_owner_of_cpu);
}

}  // namespace lightning_rec
