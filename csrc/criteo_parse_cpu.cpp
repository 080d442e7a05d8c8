// Criteo click-log text -> training arrays, in one pass over a byte buffer (lightning_rec/data/criteo_parse.py).
//
// Input: `buf` [L] uint8, whole lines, each ending in '\n' (the caller appends one to an unterminated last
// line). Output, one row per line (N = number of '\n' in buf):
//   label   [N]       float32  0 / 1 (NaN when the layout has no label)
//           [N, C]    float64  with label_columns (several labels): the C columns' numbers as they are, NaN for an
//                              empty field (the tasks' labels are derived from them in Python, as the reference does)
//   dense   [N, 13]   float32  raw count (NaN: missing), or log(1 + max(x, 0)) (missing: 0) when log_dense
//   sparse  [N, 26]   int64    hash_mode 0: the raw 32-bit hash (-1: missing)
//                              hash_mode 1: 1 + v % (n_f - 1), 0 for missing ("reserved_id")
//                              hash_mode 2: v % n_f, -1 for missing ("empty_bag")
//   status  [N]       int32    0 ok, 1 padded (fewer fields: trailing empty fields were stripped), 2 blank,
//                              else kind | (field << 8) for a bad row (kinds below; for a bad label column,
//                              kind | (its index in label_columns << 8)); the row's values are
//                              then undefined and the caller drops it or raises naming file:line:field.
//
// Work is split into line ranges: each range is cut at a newline, a first quick pass counts its lines
// (memchr), so every range knows where its rows go, then the ranges are parsed in parallel
// (torch.get_num_threads() threads, ranges handed out one at a time: parallel_ranges). Bytes are read
// once by the parse; nothing is allocated per row.
#include <torch/extension.h>

#include "check_message.h"

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <system_error>
#include <thread>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kDense = 13;
constexpr int kSparse = 26;

// status kinds (keep in sync with _STATUS_* in lightning_rec/data/criteo_parse.py)
constexpr int32_t kOk = 0, kPadded = 1, kBlank = 2, kTooMany = 3, kBadLabel = 4, kBadDense = 5,
                  kBadSparse = 6, kNonAscii = 7, kCut = 8, kBadLabelColumn = 9;

struct HexTable {
  uint8_t v[256];
  HexTable() {
    std::memset(v, 255, sizeof(v));
    for (int i = 0; i < 10; ++i) v['0' + i] = static_cast<uint8_t>(i);
    for (int i = 0; i < 6; ++i) v['a' + i] = v['A' + i] = static_cast<uint8_t>(10 + i);
  }
};
const HexTable kHex;

// What the Arrow string -> double cast (the reference parser) accepts: [+-]?(d+.?d*|.d+)([eE][+-]?d+)?
// Plain integers (every Criteo count) are converted exactly here; anything with '.' or an exponent goes
// through strtod, as Arrow's does, so both parsers give the same double.
inline bool parse_number(const uint8_t* b, const uint8_t* e, double* out) {
  const uint8_t* p = b;
  bool neg = false;
  if (p < e && (*p == '+' || *p == '-')) neg = (*p++ == '-');
  const uint8_t* digits = p;
  uint64_t v = 0;
  while (p < e && static_cast<unsigned>(*p - '0') < 10) v = v * 10 + (*p++ - '0');
  int64_t int_digits = p - digits;
  if (p == e) {
    if (int_digits == 0) return false;
    if (int_digits <= 18) {
      *out = neg ? -static_cast<double>(v) : static_cast<double>(v);
      return true;
    }
  } else {
    int64_t frac_digits = 0;
    if (*p == '.') {
      ++p;
      while (p < e && static_cast<unsigned>(*p - '0') < 10) ++p, ++frac_digits;
    }
    if (int_digits + frac_digits == 0) return false;
    if (p < e && (*p == 'e' || *p == 'E')) {
      ++p;
      if (p < e && (*p == '+' || *p == '-')) ++p;
      const uint8_t* exp = p;
      while (p < e && static_cast<unsigned>(*p - '0') < 10) ++p;
      if (p == exp) return false;
    }
    if (p != e) return false;
  }
  char tmp[128];
  const size_t n = static_cast<size_t>(e - b);
  if (n >= sizeof(tmp)) return false;  // no real count is 127 characters long
  std::memcpy(tmp, b, n);
  tmp[n] = '\0';
  *out = std::strtod(tmp, nullptr);
  return std::isfinite(*out);
}

// 8 hex characters -> value; false for any other non-empty field
inline bool parse_hex8(const uint8_t* b, const uint8_t* e, int64_t* out) {
  if (e - b != 8) return false;
  uint32_t v = 0;
  uint8_t bad = 0;
  for (int i = 0; i < 8; ++i) {
    const uint8_t d = kHex.v[b[i]];
    bad |= d;
    v = (v << 4) | (d & 15);
  }
  if (bad & 0xF0) return false;  // some byte mapped to 255
  *out = static_cast<int64_t>(v);
  return true;
}

struct Layout {
  uint8_t sep;
  int num_fields;
  // role of field k: -1 ignored, -2 label, 0..12 dense j, 100..125 sparse j
  std::vector<int> role;
  // label column c read from field k (-1: none); apart from role, as a mask column may be a feature too
  std::vector<int> label_slot;
  int num_label_columns = 0;
  int hash_mode;
  bool log_dense;
  // v % divisor[j] for 32-bit v without a division (Lemire, Kaser, Kurz: "Faster remainder by direct
  // computation", 2019): exact for 32-bit numerators and divisors; 26 divisions a row cost more than the parse.
  uint32_t divisor[kSparse];
  uint64_t magic[kSparse];
};

inline uint32_t fastmod(uint32_t a, uint64_t magic, uint32_t d) {
  const uint64_t low = magic * a;
  return static_cast<uint32_t>((static_cast<__uint128_t>(low) * d) >> 64);
}

inline int64_t hashed(int64_t raw, int j, const Layout& L) {
  if (L.hash_mode == 0) return raw;
  if (raw < 0) return L.hash_mode == 1 ? 0 : -1;
  const uint32_t d = L.divisor[j];
  const int64_t v = d ? fastmod(static_cast<uint32_t>(raw), L.magic[j], d) : raw;
  return L.hash_mode == 1 ? 1 + v : v;
}

// Field k of a row, [f, e), into its outputs (see parse_line); kOk, or the status of a bad value. A label column
// that is a feature too (a mask column such as I2) is read as both, the label column first.
inline int32_t parse_field(const uint8_t* f, const uint8_t* e, int k, const Layout& L, void* label, float* dense,
                           int64_t* sparse, float missing_dense) {
  double x;
  if (L.num_label_columns && L.label_slot[k] >= 0 && e > f) {
    // any number, kept as double: the tasks' thresholds compare it as the reference does
    if (!parse_number(f, e, &x)) return kBadLabelColumn | (L.label_slot[k] << 8);
    static_cast<double*>(label)[L.label_slot[k]] = x;
  }
  const int r = L.role[k];
  if (r >= 100) {
    int64_t v = -1;
    const bool bad = e > f && !parse_hex8(f, e, &v);
    sparse[r - 100] = hashed(v, r - 100, L);
    return bad ? kBadSparse | ((r - 100) << 8) : kOk;
  }
  if (r >= 0) {
    if (e == f) {
      dense[r] = missing_dense;
    } else if (parse_number(f, e, &x)) {
      dense[r] = static_cast<float>(x);  // as the reference: double -> float32
    } else {
      return kBadDense | (r << 8);
    }
  } else if (r == -2) {
    if (!(e > f && parse_number(f, e, &x) && (x == 0.0 || x == 1.0))) return kBadLabel;
    *static_cast<float*>(label) = static_cast<float>(x);
  }
  return kOk;
}

// Parse the line starting at p (ending in '\n'); returns the byte after its '\n'.
// When a row has several faults, the one reported is, in this order: a non-ASCII byte, too many fields,
// a row cut after a separator, the first bad field in field order (the reference parser's order too).
// `label`: the row's one label, or its label_columns [C] (float64) when the layout has several.
const uint8_t* parse_line(const uint8_t* p, const Layout& L, void* label, float* dense, int64_t* sparse,
                          int32_t* status) {
  const uint8_t* line = p;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float missing_dense = L.log_dense ? 0.f : nan;  // log(1 + 0); the log is taken after the parse
  int k = 0;
  int32_t st = kOk;
  int non_ascii = -1;
  double* columns = static_cast<double*>(label);
  const int C = L.num_label_columns;
  const double nan64 = std::numeric_limits<double>::quiet_NaN();
  if (C == 0) *static_cast<float*>(label) = nan;  // stays NaN without a label field
  for (int c = 0; c < C; ++c) columns[c] = nan64;  // an empty field: no label for that column
  while (true) {
    const uint8_t* f = p;
    uint8_t high = 0;
    while (*p != L.sep && *p != '\n') high |= *p++;
    const uint8_t* e = p;
    const bool last = (*p == '\n');
    if (last && e > f && e[-1] == '\r') --e;  // CRLF: the '\r' belongs to no field
    if ((high & 0x80) && non_ascii < 0) non_ascii = k;  // Criteo text is ASCII: this byte is corruption
    if (st == kOk && k < L.num_fields) st = parse_field(f, e, k, L, label, dense, sparse, missing_dense);
    ++k;
    ++p;
    if (last) break;
  }
  const int64_t len = p - line;  // with the '\n'
  if (len == 1 || (len == 2 && line[0] == '\r')) {
    *status = kBlank;
  } else if (non_ascii >= 0) {
    *status = kNonAscii | (non_ascii << 8);
  } else if (k > L.num_fields) {
    *status = kTooMany | (k << 8);
  } else if (k < L.num_fields) {
    // The row ends early. A row whose trailing empty fields were stripped ends in a value; one that ends
    // in a separator was cut in the middle (a truncated file), and padding it would invent values.
    const uint8_t* end = p - 1;
    if (end > line && end[-1] == '\r') --end;
    if (end > line && end[-1] == L.sep) {
      *status = kCut | (k << 8);
    } else if (st != kOk) {
      *status = st;
    } else {
      st = kPadded;
      for (int m = k; m < L.num_fields; ++m) {
        const int r = L.role[m];
        if (r >= 100) sparse[r - 100] = hashed(-1, r - 100, L);
        else if (r >= 0) dense[r] = missing_dense;
        else if (r == -2) st = kBadLabel;  // no label to pad with
      }
      *status = st;
    }
  } else {
    *status = st;
  }
  if ((*status & 0xFF) >= kBlank) {  // defined values in rows the caller drops (deterministic output)
    if (C == 0) *static_cast<float*>(label) = nan;
    for (int c = 0; c < C; ++c) columns[c] = nan64;
    for (int j = 0; j < kDense; ++j) dense[j] = missing_dense;
    for (int j = 0; j < kSparse; ++j) sparse[j] = hashed(-1, j, L);
  }
  return p;
}

// Runs fn(r) for r in [0, n) on this thread and up to threads - 1 helpers, ranges handed out one at a time.
// The caller waits only for ranges some thread has claimed: a helper the OS has not scheduled yet (a busy
// machine) finds nothing left when it starts and exits. (An OpenMP region would wait for every thread to
// arrive, twice per call; on a loaded 2-core machine that made 2 threads slower than 1.)
void parallel_ranges(int64_t n, int64_t threads, const std::function<void(int64_t)>& fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t helpers = std::min(threads, n) - 1;
  // helpers hold the shared counters (not fn) alive; fn is only called for a range claimed before
  // `done` reaches n, and the caller returns only after that
  auto work = [shared, n, &fn]() {
    for (int64_t r; (r = shared->next.fetch_add(1)) < n;) {
      fn(r);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    try {
      std::thread(work).detach();
    } catch (const std::system_error&) {
      break;  // no thread to be had (a process limit): the caller does the ranges itself
    }
  }
  work();
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// The op's arguments, checked, as the parse reads them.
Layout make_layout(int64_t separator, int64_t num_fields, int64_t label_field, at::IntArrayRef dense_fields,
                   at::IntArrayRef sparse_fields, at::IntArrayRef num_embeddings, int64_t hash_mode, bool log_dense,
                   at::IntArrayRef label_columns) {
  LR_CHECK(separator >= 0 && separator < 128 && separator != '\n' && separator != '\r',
           "parse_criteo: separator must be an ASCII byte other than a line end, got ", separator);
  LR_CHECK(dense_fields.size() == kDense && sparse_fields.size() == kSparse,
           "parse_criteo: need 13 dense and 26 sparse field indices, got ", dense_fields.size(), " and ",
           sparse_fields.size());
  LR_CHECK(num_fields >= 1 && num_fields < (1 << 22), "parse_criteo: num_fields out of range: ", num_fields);
  LR_CHECK(hash_mode >= 0 && hash_mode <= 2, "parse_criteo: hash_mode must be 0, 1 or 2, got ", hash_mode);
  if (hash_mode != 0) {
    LR_CHECK(num_embeddings.size() == kSparse, "parse_criteo: num_embeddings needs 26 sizes, got ",
             num_embeddings.size());
    for (int64_t n : num_embeddings) {
      LR_CHECK(n >= 2 && n <= (int64_t{1} << 32), "parse_criteo: every num_embeddings must be in [2, 2^32], got ", n);
    }
  }
  Layout L;
  L.sep = static_cast<uint8_t>(separator);
  L.num_fields = static_cast<int>(num_fields);
  L.role.assign(num_fields, -1);
  auto set_role = [&](int64_t field, int role) {
    LR_CHECK(field >= 0 && field < num_fields && L.role[field] == -1,
             "parse_criteo: field index ", field, " out of range or used twice (num_fields=", num_fields, ")");
    L.role[field] = role;
  };
  if (label_field >= 0) set_role(label_field, -2);
  LR_CHECK(label_columns.empty() || label_field < 0,
           "parse_criteo: give label_field or label_columns, not both (label_field=", label_field, ")");
  L.label_slot.assign(num_fields, -1);
  L.num_label_columns = static_cast<int>(label_columns.size());
  for (size_t c = 0; c < label_columns.size(); ++c) {
    const int64_t field = label_columns[c];
    LR_CHECK(field >= 0 && field < num_fields && L.label_slot[field] == -1, "parse_criteo: label column field ",
             field, " out of range or used twice (num_fields=", num_fields, ")");
    L.label_slot[field] = static_cast<int>(c);
  }
  for (int j = 0; j < kDense; ++j) set_role(dense_fields[j], j);
  for (int j = 0; j < kSparse; ++j) set_role(sparse_fields[j], 100 + j);
  L.hash_mode = static_cast<int>(hash_mode);
  L.log_dense = log_dense;
  for (int j = 0; j < kSparse && hash_mode != 0; ++j) {
    // raw hashes are 32-bit; a divisor of 2^32 (or more) leaves them as they are
    const int64_t d = num_embeddings[j] - (hash_mode == 1 ? 1 : 0);
    L.divisor[j] = d >= (int64_t{1} << 32) ? 0 : static_cast<uint32_t>(d);
    L.magic[j] = L.divisor[j] ? UINT64_C(0xFFFFFFFFFFFFFFFF) / L.divisor[j] + 1 : 0;
  }
  return L;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> parse_criteo(
    const at::Tensor& buf, int64_t separator, int64_t num_fields, int64_t label_field, at::IntArrayRef dense_fields,
    at::IntArrayRef sparse_fields, at::IntArrayRef num_embeddings, int64_t hash_mode, bool log_dense,
    at::IntArrayRef label_columns) {
  LR_CHECK(buf.dim() == 1 && buf.scalar_type() == at::kByte && buf.device().is_cpu(),
           "parse_criteo: buf must be a 1-D uint8 CPU tensor, got ", buf.sizes(), " ", buf.scalar_type());
  const Layout L = make_layout(separator, num_fields, label_field, dense_fields, sparse_fields, num_embeddings,
                               hash_mode, log_dense, label_columns);

  const at::Tensor b = buf.contiguous();
  const uint8_t* data = b.data_ptr<uint8_t>();
  const int64_t size = b.numel();
  LR_CHECK(size == 0 || data[size - 1] == '\n', "parse_criteo: buf must end with a newline (whole lines only)");

  // Line ranges, each starting right after a newline, many more than threads. Their lines are counted
  // first (memchr, ~5% of the parse), so every range knows where its rows go.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t min_range = 256 << 10;
  const int64_t num_ranges = std::max<int64_t>(1, std::min<int64_t>(threads * 16, size / min_range));
  std::vector<int64_t> starts(num_ranges + 1, size);
  std::vector<int64_t> row_start(num_ranges + 1, 0);
  starts[0] = 0;
  int64_t N = 0;
  {
    int64_t r = 1;
    const uint8_t* p = data;
    const uint8_t* end = data + size;
    while (p < end) {
      const void* nl = std::memchr(p, '\n', end - p);
      if (!nl) break;
      ++N;
      p = static_cast<const uint8_t*>(nl) + 1;
      if (r < num_ranges && p - data >= size * r / num_ranges) {
        starts[r] = p - data;
        row_start[r] = N;
        ++r;
      }
    }
    for (; r <= num_ranges; ++r) starts[r] = size, row_start[r] = N;
  }

  const int64_t C = L.num_label_columns;
  auto label = C ? at::empty({N, C}, at::kDouble) : at::empty({N}, at::kFloat);
  auto dense = at::empty({N, kDense}, at::kFloat);
  auto sparse = at::empty({N, kSparse}, at::kLong);
  auto status = at::empty({N}, at::kInt);
  char* label_p = static_cast<char*>(label.data_ptr());
  const int64_t label_row_bytes = C ? C * int64_t{sizeof(double)} : int64_t{sizeof(float)};
  float* dense_p = dense.data_ptr<float>();
  int64_t* sparse_p = sparse.data_ptr<int64_t>();
  int32_t* status_p = status.data_ptr<int32_t>();
  parallel_ranges(num_ranges, threads, [&](int64_t r) {
    const uint8_t* p = data + starts[r];
    const uint8_t* end = data + starts[r + 1];
    for (int64_t i = row_start[r]; p < end; ++i) {
      p = parse_line(p, L, label_p + i * label_row_bytes, dense_p + i * kDense, sparse_p + i * kSparse, status_p + i);
    }
    if (log_dense && row_start[r + 1] > row_start[r]) {
      // log(1 + max(x, 0)) on this range's rows, vectorised by ATen, on this thread (missing counts are 0):
      // the guard keeps ATen from opening an OpenMP region of its own inside ours
      c10::ParallelGuard serial(true);
      dense.narrow(0, row_start[r], row_start[r + 1] - row_start[r]).clamp_min_(0.f).log1p_();
    }
  });
  return {label, dense, sparse, status};
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_rec, CPU, m) {
  m.impl("parse_criteo", &parse_criteo);
}
